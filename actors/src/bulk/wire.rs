//! The bulk plane's wire format. A bulk stream is a QUIC bidirectional stream whose first byte
//! is [`BULK_TAG`]; after it come length-prefixed control frames (`u32` little-endian length,
//! then a bincode-2 body of at most [`MAX_FRAME`] bytes) and, between them, raw chunk bytes
//! whose lengths the manifest fixes. Every decoded frame is validated before use: unknown
//! variants, trailing bytes, oversized frames, long name lists and truncated streams are errors.
//!
//! Conversations (the opener speaks first):
//! - fetch: `Request::Fetch` → `FetchReply::Found(manifest)` + all chunk bytes, or another reply;
//! - push: `Request::Push` → `PushAck`; on `Send` the opener writes all chunk bytes and finishes
//!   its side; the receiver then answers `PushDone` once it and its relay subtree are done.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::manifest::{BlobId, Manifest, MAX_CHUNKS};

/// First byte of every bulk stream (the ractor session streams use `0x01`).
pub const BULK_TAG: u8 = 0x02;
/// Largest control frame body (a manifest of [`MAX_CHUNKS`] hashes plus slack).
pub const MAX_FRAME: usize = MAX_CHUNKS * 32 + 64 * 1024;
/// Most peer names a push may ask a receiver to relay to.
pub const MAX_FORWARD: usize = 4096;
/// Longest peer name accepted on the wire.
pub const MAX_NAME_LEN: usize = 255;
/// Longest error text accepted (and sent) on the wire.
pub const MAX_REASON_LEN: usize = 4096;

/// What the opener of a bulk stream asks for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Send me the blob with this id.
    Fetch {
        /// The blob wanted.
        id: BlobId,
    },
    /// Take this blob (its chunks follow) and relay it to `forward`.
    Push {
        /// The blob's manifest; its id is the blob's id.
        manifest: Manifest,
        /// Peers the receiver must pass the blob on to (it splits them among its children).
        forward: Vec<String>,
    },
}

/// Answer to [`Request::Fetch`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FetchReply {
    /// The blob is here; exactly `manifest.total_len` bytes of chunk data follow.
    Found(Manifest),
    /// This peer does not hold the blob.
    NotFound,
}

/// Answer to [`Request::Push`], before any chunk data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PushAck {
    /// Send the chunk data.
    Send,
    /// I already hold this blob; send nothing (I relay from my copy).
    Have,
    /// I will not take this blob (no room, too large, bad manifest).
    Refused(String),
}

/// Final answer to [`Request::Push`], covering the receiver and its relay subtree. A receiver
/// whose own copy failed (e.g. a corrupt chunk) lists itself under `failed` with the reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushDone {
    /// Peers that now hold the verified blob.
    pub delivered: Vec<String>,
    /// Peers that do not, with the reason.
    pub failed: Vec<(String, String)>,
}

impl PushDone {
    /// Checks the name lists' sizes (reasons are bounded by the frame size).
    pub fn validate(&self) -> Result<(), WireError> {
        validate_names(self.delivered.iter())?;
        validate_names(self.failed.iter().map(|(n, _)| n))?;
        if self.failed.iter().any(|(_, r)| r.len() > MAX_REASON_LEN) {
            return Err(WireError::Invalid(format!(
                "failure reason longer than {MAX_REASON_LEN} bytes"
            )));
        }
        Ok(())
    }
}

/// A frame or stream that breaks the wire rules.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The stream failed or ended early (a truncated stream lands here).
    #[error("bulk stream i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A frame announces more than [`MAX_FRAME`] bytes.
    #[error("bulk frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    FrameTooLarge(usize),
    /// A frame body does not decode as the expected message.
    #[error("bulk frame does not decode as {what}: {reason}")]
    Decode {
        /// The message type expected.
        what: &'static str,
        /// What the decoder said.
        reason: String,
    },
    /// A message decodes but breaks a limit or rule.
    #[error("bulk message invalid: {0}")]
    Invalid(String),
}

/// Writes one control frame.
pub async fn write_frame<W, T>(w: &mut W, msg: &T) -> Result<(), WireError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let body = bincode::serde::encode_to_vec(msg, bincode::config::standard())
        .map_err(|e| WireError::Invalid(format!("cannot encode frame: {e}")))?;
    if body.len() > MAX_FRAME {
        return Err(WireError::FrameTooLarge(body.len()));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    Ok(())
}

/// Reads one control frame and decodes it as `T` (no trailing bytes allowed).
pub async fn read_frame<R, T>(r: &mut R, what: &'static str) -> Result<T, WireError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(WireError::FrameTooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    decode(&body, what)
}

/// Decodes a frame body as `T`, rejecting trailing bytes.
pub fn decode<T: DeserializeOwned>(body: &[u8], what: &'static str) -> Result<T, WireError> {
    let config = bincode::config::standard().with_limit::<MAX_FRAME>();
    let (msg, used) =
        bincode::serde::decode_from_slice(body, config).map_err(|e| WireError::Decode {
            what,
            reason: e.to_string(),
        })?;
    if used != body.len() {
        return Err(WireError::Decode {
            what,
            reason: format!("{} trailing bytes", body.len() - used),
        });
    }
    Ok(msg)
}

/// Checks a list of peer names from the wire (count and lengths).
pub fn validate_names<'a>(
    names: impl ExactSizeIterator<Item = &'a String>,
) -> Result<(), WireError> {
    if names.len() > MAX_FORWARD {
        return Err(WireError::Invalid(format!(
            "{} peer names, more than the limit {MAX_FORWARD}",
            names.len()
        )));
    }
    for n in names {
        if n.is_empty() || n.len() > MAX_NAME_LEN {
            return Err(WireError::Invalid(format!(
                "peer name of {} bytes (must be 1..={MAX_NAME_LEN})",
                n.len()
            )));
        }
    }
    Ok(())
}

/// Cuts an error text to [`MAX_REASON_LEN`] bytes (on a char boundary) before sending it.
pub fn clip_reason(mut s: String) -> String {
    if s.len() > MAX_REASON_LEN {
        let mut end = MAX_REASON_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest::build(&[7u8; 10_000], 4096).unwrap()
    }

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let req = Request::Push {
            manifest: manifest(),
            forward: vec!["b".into(), "c".into()],
        };
        write_frame(&mut a, &req).await.unwrap();
        write_frame(&mut a, &PushAck::Refused("full".into()))
            .await
            .unwrap();
        assert_eq!(
            read_frame::<_, Request>(&mut b, "request").await.unwrap(),
            req
        );
        assert_eq!(
            read_frame::<_, PushAck>(&mut b, "ack").await.unwrap(),
            PushAck::Refused("full".into())
        );
    }

    #[tokio::test]
    async fn oversized_frame_is_refused_before_allocation() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        let err = read_frame::<_, Request>(&mut b, "request")
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::FrameTooLarge(n) if n == u32::MAX as usize));
    }

    #[tokio::test]
    async fn truncated_frame_is_an_io_error() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&100u32.to_le_bytes()).await.unwrap();
        a.write_all(&[1, 2, 3]).await.unwrap();
        drop(a);
        let err = read_frame::<_, Request>(&mut b, "request")
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::Io(_)), "{err}");
    }

    #[test]
    fn unknown_variant_and_trailing_bytes_are_rejected() {
        let err = decode::<Request>(&[9], "request").unwrap_err();
        assert!(
            matches!(
                err,
                WireError::Decode {
                    what: "request",
                    ..
                }
            ),
            "{err}"
        );
        let mut body =
            bincode::serde::encode_to_vec(PushAck::Send, bincode::config::standard()).unwrap();
        body.push(0);
        let err = decode::<PushAck>(&body, "ack").unwrap_err();
        assert!(err.to_string().contains("trailing"), "{err}");
    }

    #[test]
    fn name_lists_are_bounded() {
        validate_names(["a".to_string()].iter()).unwrap();
        assert!(validate_names([String::new()].iter()).is_err());
        assert!(validate_names(["x".repeat(300)].iter()).is_err());
        let many = vec!["p".to_string(); MAX_FORWARD + 1];
        assert!(validate_names(many.iter()).is_err());
    }

    #[test]
    fn reasons_are_clipped_on_char_boundaries() {
        let s = clip_reason("é".repeat(MAX_REASON_LEN));
        assert!(s.len() <= MAX_REASON_LEN);
        assert!(s.chars().all(|c| c == 'é'));
    }
}
