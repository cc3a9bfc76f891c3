//! The buffer a blob is received into while it may already be relayed onward. One
//! [`BlobWriter`] fills the blob's single allocation chunk by chunk, in order; a filled chunk
//! is verified (on any thread, through its [`FilledChunk`], while the writer fills the next)
//! and then committed, in order, and any number of [`BlobReader`]s (the relay's forwarders) may
//! then read it while later chunks are still arriving. No chunk is copied per forwarder, so a
//! slow child costs no memory beyond the blob itself. When every chunk is in, the writer turns
//! the allocation into a [`Bytes`] without copying. When nothing reads a received blob any
//! more, its allocation goes to the plane's [`Recycler`] for the next transfer of its length.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::watch;

use super::manifest::Manifest;
use super::retired::{Retired, KEEP};

type Allocation = Box<[UnsafeCell<u8>]>;

/// The shared allocation. Bytes `[0, ready)` are immutable; only the unique writer writes bytes
/// at or after its `filled` chunk, and the filled, unverified chunks between are only read (by
/// their verification).
struct Shared {
    data: Allocation,
    /// Number of leading bytes that are committed (verified) and will never change again.
    ready: AtomicUsize,
    /// Where `data` goes when the last reference to it drops.
    recycler: Weak<Recycler>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(recycler) = self.recycler.upgrade() {
            recycler.retire(std::mem::take(&mut self.data));
        }
    }
}

/// Keeps the memory of a received blob nothing reads any more for the next transfer of the
/// same length ([`super::retired`] has the rules). Successive weight versions of one model
/// have one length, so a replica receives each version into the memory of the one it served
/// before the last: memory already mapped, where a fresh allocation first faults in every page
/// (about 60 ms for 85 MiB on a 2-core virtual machine, against 6 ms to write mapped memory).
/// A kept allocation's old bytes are never seen: a blob is complete only when every chunk has
/// been written over and verified.
pub(crate) struct Recycler {
    retired: Mutex<Retired<Allocation>>,
    /// Runs the timer that lets go of a buffer nobody took within its keep time.
    runtime: tokio::runtime::Handle,
    reused: AtomicU64,
}

impl Recycler {
    /// A recycler whose expiry timers run on `runtime`.
    pub(crate) fn new(runtime: tokio::runtime::Handle) -> Arc<Recycler> {
        Arc::new(Recycler {
            retired: Mutex::new(Retired::new(KEEP)),
            runtime,
            reused: AtomicU64::new(0),
        })
    }

    /// Transfers received into a retired allocation so far.
    pub(crate) fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// Bytes kept for reuse now.
    pub(crate) fn held(&self) -> usize {
        self.lock().held()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Retired<Allocation>> {
        // The rules' state is one `Option`, whole between calls.
        self.retired.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self, len: usize) -> Option<Allocation> {
        let found = self.lock().take(len, Instant::now());
        if found.is_some() {
            self.reused.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Keeps `data` (may run on any thread: the last reader of a blob can be an engine's).
    fn retire(self: Arc<Self>, data: Allocation) {
        // A small blob's memory is simply freed: no lock, no timer.
        if !Retired::<Allocation>::keeps(data.len()) {
            return;
        }
        let dropped = self.lock().put(data.len(), data, Instant::now());
        drop(dropped);
        // One timer per kept buffer; one that finds a newer buffer kept lets it be.
        let recycler = Arc::downgrade(&self);
        self.runtime.spawn(async move {
            tokio::time::sleep(KEEP + std::time::Duration::from_millis(10)).await;
            if let Some(recycler) = recycler.upgrade() {
                let expired = recycler.lock().expire(Instant::now());
                drop(expired);
            }
        });
    }
}

// SAFETY: access to `data` is split by `ready`: readers only form shared slices below `ready`
// (loaded with Acquire), and the single writer only forms a mutable slice at or above it,
// publishing with Release after the write. The two ranges never overlap.
unsafe impl Sync for Shared {}

impl Shared {
    fn ptr(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.data.as_ptr())
    }

    /// The committed prefix `[0, ready)`.
    fn committed(&self) -> &[u8] {
        let ready = self.ready.load(Ordering::Acquire);
        // SAFETY: `[0, ready)` is committed: the writer never writes there again.
        unsafe { std::slice::from_raw_parts(self.ptr(), ready) }
    }
}

/// Where the transfer stands, as seen by readers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Progress {
    /// This many leading chunks are committed.
    Chunks(usize),
    /// The transfer failed; no more chunks will come.
    Failed,
}

/// The one writer of a blob being received.
pub(crate) struct BlobWriter {
    shared: Arc<Shared>,
    manifest: Arc<Manifest>,
    /// The chunk to commit next (chunks before it are committed).
    next: usize,
    /// The chunk to fill next (chunks from `next` up to it are filled, awaiting verification).
    filled: usize,
    progress: watch::Sender<Progress>,
}

/// A filled chunk awaiting verification, which may run on another thread while the writer
/// fills later chunks; [`BlobWriter::commit`] then commits it given the verdict.
pub(crate) struct FilledChunk {
    shared: Arc<Shared>,
    manifest: Arc<Manifest>,
    index: usize,
}

impl FilledChunk {
    /// Whether the chunk's bytes match the manifest's hash.
    pub(crate) fn verify(&self) -> bool {
        let range = self.manifest.chunk_range(self.index);
        // SAFETY: the chunk is filled and not committed: the writer writes only at later
        // chunks, readers read only committed bytes, so nothing writes these bytes now.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.shared.ptr().add(range.start), range.len()) };
        self.manifest.chunk_matches(self.index, bytes)
    }
}

/// A reader of a blob being received (cheap to clone).
#[derive(Clone)]
pub(crate) struct BlobReader {
    shared: Arc<Shared>,
    manifest: Arc<Manifest>,
    progress: watch::Receiver<Progress>,
}

/// The blob's transfer failed before the chunk a reader waited for.
#[derive(Debug, thiserror::Error)]
#[error("the incoming copy of this blob failed before chunk {0} arrived")]
pub(crate) struct SourceFailed(pub usize);

/// A buffer for the manifest's blob, a retired one of its length from `recycler` or else a
/// zeroed one, and its writer and a reader. The buffer goes back to `recycler` when nothing
/// reads it any more.
pub(crate) fn incoming(
    manifest: Arc<Manifest>,
    recycler: Option<&Arc<Recycler>>,
) -> (BlobWriter, BlobReader) {
    let len = manifest.total_len as usize;
    let data = recycler.and_then(|r| r.take(len)).unwrap_or_else(|| {
        let v: Vec<u8> = vec![0u8; len];
        let b: Box<[u8]> = v.into_boxed_slice();
        // SAFETY: `UnsafeCell<u8>` has the same layout as `u8`.
        unsafe { Box::from_raw(Box::into_raw(b) as *mut [UnsafeCell<u8>]) }
    });
    let shared = Arc::new(Shared {
        data,
        ready: AtomicUsize::new(0),
        recycler: recycler.map(Arc::downgrade).unwrap_or_default(),
    });
    let (tx, rx) = watch::channel(Progress::Chunks(0));
    (
        BlobWriter {
            shared: shared.clone(),
            manifest: manifest.clone(),
            next: 0,
            filled: 0,
            progress: tx,
        },
        BlobReader {
            shared,
            manifest,
            progress: rx,
        },
    )
}

impl BlobWriter {
    /// Index of the chunk the writer commits next (`== chunk_count()` when all are in).
    pub(crate) fn next_index(&self) -> usize {
        self.next
    }

    /// The region of the next chunk to fill, to read the wire into. `None` when every chunk is
    /// filled.
    pub(crate) fn next_region(&mut self) -> Option<&mut [u8]> {
        if self.filled >= self.manifest.chunk_count() {
            return None;
        }
        let range = self.manifest.chunk_range(self.filled);
        // SAFETY: `range` starts at or after `ready` and lies within the allocation; no reader
        // forms a slice beyond `ready`, the filled chunks before it are only read by their
        // verification, and `&mut self` makes this the only mutable slice.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.shared.ptr().add(range.start), range.len())
        })
    }

    /// Marks the region [`next_region`](Self::next_region) gave as filled; its verification
    /// comes back to [`commit`](Self::commit) in chunk order.
    pub(crate) fn fill(&mut self) -> FilledChunk {
        let index = self.filled;
        assert!(index < self.manifest.chunk_count(), "every chunk is filled");
        self.filled += 1;
        FilledChunk {
            shared: self.shared.clone(),
            manifest: self.manifest.clone(),
            index,
        }
    }

    /// Commits the oldest filled chunk if `verified` (its [`FilledChunk::verify`]), making it
    /// readable; returns `verified`. A chunk that failed is not committed, and the transfer
    /// is then dead: nothing after it can be.
    pub(crate) fn commit(&mut self, verified: bool) -> bool {
        assert!(self.next < self.filled, "a filled chunk to commit");
        if !verified {
            return false;
        }
        let end = self.manifest.chunk_range(self.next).end;
        self.shared.ready.store(end, Ordering::Release);
        self.next += 1;
        self.progress.send_replace(Progress::Chunks(self.next));
        true
    }

    /// Marks the region just written as filled, verifies it on this thread and commits it: the
    /// sequential form of [`fill`](Self::fill), [`FilledChunk::verify`] and
    /// [`commit`](Self::commit). A chunk that fails is offered again by `next_region`.
    #[cfg(test)]
    pub(crate) fn verify_and_commit(&mut self) -> bool {
        let chunk = self.fill();
        let ok = chunk.verify();
        if !ok {
            // Not filled after all: the same region is offered again.
            self.filled -= 1;
            return false;
        }
        self.commit(true)
    }

    /// Turns the completed buffer into `Bytes` (no copy). `Err(self)` if chunks are missing.
    pub(crate) fn finish(self) -> Result<Bytes, BlobWriter> {
        if self.next < self.manifest.chunk_count() {
            return Err(self);
        }
        Ok(Bytes::from_owner(Complete(self.shared.clone())))
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if self.next < self.manifest.chunk_count() {
            self.progress.send_replace(Progress::Failed);
        }
    }
}

/// Owner handed to `Bytes::from_owner` once every byte is committed.
struct Complete(Arc<Shared>);

impl AsRef<[u8]> for Complete {
    fn as_ref(&self) -> &[u8] {
        // Every byte is committed here, so this is the whole blob.
        self.0.committed()
    }
}

impl BlobReader {
    /// Waits until chunk `index` is committed and returns its bytes (shared, not copied).
    pub(crate) async fn chunk(&mut self, index: usize) -> Result<Bytes, SourceFailed> {
        let state = self
            .progress
            .wait_for(|p| match p {
                Progress::Chunks(n) => *n > index,
                Progress::Failed => true,
            })
            .await
            .map(|p| *p);
        match state {
            Ok(Progress::Chunks(_)) => {
                let range = self.manifest.chunk_range(index);
                Ok(Bytes::from_owner(Committed(self.shared.clone(), range)))
            }
            // Failed, or the writer vanished without finishing.
            _ => Err(SourceFailed(index)),
        }
    }
}

/// Owner of a `Bytes` view of a committed range (which never changes again).
struct Committed(Arc<Shared>, std::ops::Range<usize>);

impl AsRef<[u8]> for Committed {
    fn as_ref(&self) -> &[u8] {
        &self.0.committed()[self.1.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 253) as u8).collect()
    }

    #[tokio::test]
    async fn readers_see_chunks_as_they_commit_and_finish_is_bit_exact() {
        let data = blob(10_000);
        let m = Arc::new(Manifest::build(&data, 4096).unwrap());
        let (mut w, r) = incoming(m.clone(), None);
        let reader = tokio::spawn(async move {
            let mut r = r;
            let mut out = Vec::new();
            for i in 0..3 {
                out.extend_from_slice(&r.chunk(i).await.unwrap());
            }
            out
        });
        loop {
            let range = m.chunk_range(w.next_index());
            let Some(region) = w.next_region() else {
                break;
            };
            region.copy_from_slice(&data[range]);
            assert!(w.verify_and_commit());
            tokio::task::yield_now().await;
        }
        let bytes = w.finish().ok().unwrap();
        assert_eq!(&bytes[..], &data[..]);
        assert_eq!(reader.await.unwrap(), data);
    }

    #[tokio::test]
    async fn a_bad_chunk_is_not_committed_and_readers_learn_of_the_failure() {
        let data = blob(9000);
        let m = Arc::new(Manifest::build(&data, 4096).unwrap());
        let (mut w, mut r) = incoming(m.clone(), None);
        w.next_region()
            .unwrap()
            .copy_from_slice(&data[m.chunk_range(0)]);
        assert!(w.verify_and_commit());
        let region = w.next_region().unwrap();
        region.copy_from_slice(&data[m.chunk_range(1)]);
        region[17] ^= 1;
        assert!(!w.verify_and_commit());
        assert_eq!(w.next_index(), 1);
        assert_eq!(&r.chunk(0).await.unwrap()[..], &data[..4096]);
        drop(w);
        assert!(r.chunk(1).await.is_err());
    }

    #[test]
    fn finish_refuses_an_incomplete_blob() {
        let data = blob(9000);
        let m = Arc::new(Manifest::build(&data, 4096).unwrap());
        let (w, _r) = incoming(m, None);
        assert!(w.finish().is_err());
    }
}
