//! Content addressing for the bulk plane: a blob is cut into fixed-size chunks, each chunk is
//! hashed with blake3, and the list of chunk hashes (with the total size and chunk size) forms
//! the [`Manifest`]. The [`BlobId`] is the blake3 hash of the manifest's canonical encoding, so
//! a receiver that knows the id can check the manifest, and a receiver (or relay) that has the
//! manifest can check every chunk as soon as it arrives.

use std::fmt;
use std::str::FromStr;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Smallest chunk size a manifest may declare (bytes).
pub const MIN_CHUNK_SIZE: u32 = 4 * 1024;
/// Largest chunk size a manifest may declare (bytes); bounds what a receiver hashes per step.
pub const MAX_CHUNK_SIZE: u32 = 64 * 1024 * 1024;
/// Largest number of chunks a manifest may list (bounds the manifest frame: 32 bytes each).
pub const MAX_CHUNKS: usize = 1 << 18;

/// Domain separator mixed into every manifest hash.
const MANIFEST_DOMAIN: &[u8] = b"clawrl-bulk-manifest-v1";

/// Content address of a blob: blake3 of its manifest's canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlobId(pub [u8; 32]);

impl BlobId {
    /// The first 8 bytes in hex, for log lines.
    pub fn short(&self) -> String {
        hex(&self.0[..8])
    }
}

impl fmt::Display for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobId({})", self.short())
    }
}

/// A string that is not 64 hex digits was given as a blob id.
#[derive(Debug, thiserror::Error)]
#[error("blob id {0:?} is not 64 hex digits")]
pub struct ParseBlobIdError(String);

impl FromStr for BlobId {
    type Err = ParseBlobIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseBlobIdError(s.to_owned());
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(BlobId(out))
    }
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Describes a blob: its size, its chunking and one blake3 hash per chunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Total size of the blob in bytes.
    pub total_len: u64,
    /// Size of every chunk but the last (which may be shorter).
    pub chunk_size: u32,
    /// blake3 hash of each chunk, in order.
    pub chunks: Vec<[u8; 32]>,
}

/// A manifest that breaks the rules (bad chunk size, wrong chunk count, too large).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    /// The chunk size is outside `[MIN_CHUNK_SIZE, MAX_CHUNK_SIZE]`.
    #[error("chunk size {0} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")]
    ChunkSize(u32),
    /// The number of chunk hashes does not match `ceil(total_len / chunk_size)`.
    #[error("manifest lists {listed} chunk hashes but {total_len} bytes in chunks of {chunk_size} need {needed}")]
    ChunkCount {
        /// Hashes listed.
        listed: usize,
        /// Hashes the size implies.
        needed: u64,
        /// Declared blob size.
        total_len: u64,
        /// Declared chunk size.
        chunk_size: u32,
    },
    /// More chunks than [`MAX_CHUNKS`].
    #[error("manifest lists {0} chunks, more than the limit {MAX_CHUNKS}")]
    TooManyChunks(usize),
    /// The blob is larger than the receiver accepts.
    #[error("blob of {total_len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Declared blob size.
        total_len: u64,
        /// The receiver's limit.
        limit: u64,
    },
}

impl Manifest {
    /// Cuts `data` into chunks of `chunk_size` bytes and hashes each one.
    pub fn build(data: &[u8], chunk_size: u32) -> Result<Manifest, ManifestError> {
        check_chunk_size(chunk_size)?;
        // Chunks hash independently: on the rayon pool.
        let chunks: Vec<[u8; 32]> = data
            .par_chunks(chunk_size as usize)
            .map(|c| *blake3::hash(c).as_bytes())
            .collect();
        if chunks.len() > MAX_CHUNKS {
            return Err(ManifestError::TooManyChunks(chunks.len()));
        }
        Ok(Manifest {
            total_len: data.len() as u64,
            chunk_size,
            chunks,
        })
    }

    /// Checks the manifest's internal consistency and that the blob is at most `max_len` bytes.
    pub fn validate(&self, max_len: u64) -> Result<(), ManifestError> {
        check_chunk_size(self.chunk_size)?;
        if self.chunks.len() > MAX_CHUNKS {
            return Err(ManifestError::TooManyChunks(self.chunks.len()));
        }
        if self.total_len > max_len {
            return Err(ManifestError::TooLarge {
                total_len: self.total_len,
                limit: max_len,
            });
        }
        let needed = self.total_len.div_ceil(u64::from(self.chunk_size));
        if needed != self.chunks.len() as u64 {
            return Err(ManifestError::ChunkCount {
                listed: self.chunks.len(),
                needed,
                total_len: self.total_len,
                chunk_size: self.chunk_size,
            });
        }
        Ok(())
    }

    /// The blob's content address.
    pub fn id(&self) -> BlobId {
        let mut h = blake3::Hasher::new();
        h.update(MANIFEST_DOMAIN);
        h.update(&self.total_len.to_le_bytes());
        h.update(&self.chunk_size.to_le_bytes());
        h.update(&(self.chunks.len() as u64).to_le_bytes());
        for c in &self.chunks {
            h.update(c);
        }
        BlobId(*h.finalize().as_bytes())
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Byte range of chunk `index` within the blob. The manifest must be valid.
    pub fn chunk_range(&self, index: usize) -> std::ops::Range<usize> {
        let start = index as u64 * u64::from(self.chunk_size);
        let end = (start + u64::from(self.chunk_size)).min(self.total_len);
        start as usize..end as usize
    }

    /// True when `data` hashes to the manifest's hash for chunk `index`.
    pub fn chunk_matches(&self, index: usize, data: &[u8]) -> bool {
        self.chunks
            .get(index)
            .is_some_and(|want| blake3::hash(data) == blake3::Hash::from(*want))
    }
}

fn check_chunk_size(chunk_size: u32) -> Result<(), ManifestError> {
    if (MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) {
        Ok(())
    } else {
        Err(ManifestError::ChunkSize(chunk_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn build_chunks_and_ranges_cover_the_blob() {
        let d = data(10_000);
        let m = Manifest::build(&d, 4096).unwrap();
        assert_eq!(m.chunk_count(), 3);
        assert_eq!(m.chunk_range(0), 0..4096);
        assert_eq!(m.chunk_range(2), 8192..10_000);
        for i in 0..3 {
            assert!(m.chunk_matches(i, &d[m.chunk_range(i)]));
        }
        assert!(!m.chunk_matches(3, &[]));
        m.validate(10_000).unwrap();
    }

    #[test]
    fn empty_blob_has_no_chunks() {
        let m = Manifest::build(&[], 4096).unwrap();
        assert_eq!(m.chunk_count(), 0);
        m.validate(0).unwrap();
    }

    #[test]
    fn a_flipped_byte_fails_its_chunk_only() {
        let mut d = data(9000);
        let m = Manifest::build(&d, 4096).unwrap();
        d[5000] ^= 1;
        assert!(m.chunk_matches(0, &d[m.chunk_range(0)]));
        assert!(!m.chunk_matches(1, &d[m.chunk_range(1)]));
    }

    #[test]
    fn id_depends_on_content_and_chunking() {
        let d = data(20_000);
        let a = Manifest::build(&d, 4096).unwrap();
        let b = Manifest::build(&d, 8192).unwrap();
        let mut e = d.clone();
        e[0] ^= 0xff;
        let c = Manifest::build(&e, 4096).unwrap();
        assert_ne!(a.id(), b.id());
        assert_ne!(a.id(), c.id());
        assert_eq!(a.id(), Manifest::build(&d, 4096).unwrap().id());
    }

    #[test]
    fn validate_rejects_inconsistent_manifests() {
        let m = Manifest::build(&data(10_000), 4096).unwrap();
        let mut short = m.clone();
        short.chunks.pop();
        assert!(matches!(
            short.validate(u64::MAX),
            Err(ManifestError::ChunkCount {
                listed: 2,
                needed: 3,
                ..
            })
        ));
        let mut tiny = m.clone();
        tiny.chunk_size = 16;
        assert_eq!(tiny.validate(u64::MAX), Err(ManifestError::ChunkSize(16)));
        assert!(matches!(
            m.validate(9_999),
            Err(ManifestError::TooLarge {
                total_len: 10_000,
                limit: 9_999
            })
        ));
        assert_eq!(
            Manifest::build(&[], 3).unwrap_err(),
            ManifestError::ChunkSize(3)
        );
    }

    #[test]
    fn blob_id_round_trips_through_hex() {
        let id = Manifest::build(&data(5000), 4096).unwrap().id();
        let s = id.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(s.parse::<BlobId>().unwrap(), id);
        assert!("xyz".parse::<BlobId>().is_err());
        assert!("zz".repeat(32).parse::<BlobId>().is_err());
    }
}
