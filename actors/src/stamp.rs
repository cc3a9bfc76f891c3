//! The caller stamp of node sessions: every actor request a peer sends carries the name the
//! peer's certificate proves, put there by the receiving node, never by the sender.
//!
//! A `ractor_cluster` node session is a stream of frames: a `u64` big-endian length, then a
//! protobuf `NetworkMessage`. Requests to actors are its node `Cast` and `Call` messages, whose
//! `metadata` field ractor hands to [`ractor::Message::deserialize`] untouched. The read half of
//! every node-session stream passes through [`stamp_frame`], which overwrites that field with
//! the authenticated peer name (whatever the peer put there is discarded); every other frame
//! passes through byte for byte. [`crate::rpc::Rpc`] reads the stamp back as its
//! [`crate::rpc::Caller`].
//!
//! Only the messages rewritten are modelled here (the protocol module of `ractor_cluster` is
//! private): `prost` drops fields it does not know when it re-encodes, so a frame is re-encoded
//! only when it is a node `Cast` or `Call`, whose every field is modelled.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, ReadBuf};

/// The largest node-session frame accepted from a peer. The stamped frame may grow by a node
/// name and its field header, and must stay within the limit of `ractor_cluster`'s own reader.
pub const MAX_SESSION_FRAME: u64 =
    ractor_cluster::node::DEFAULT_MAX_INBOUND_FRAME_SIZE - STAMP_ROOM;

/// Room left for the stamp under `ractor_cluster`'s frame limit (a node name is at most 63
/// bytes: [`crate::config::valid_node_name`]).
const STAMP_ROOM: u64 = 1024;

/// What the stamp carries before the node name, so a stamp is told from any other metadata.
const STAMP_PREFIX: &[u8] = b"clawrl.caller:";

/// Why a node-session frame was not passed on (the session is then closed).
#[derive(Debug, thiserror::Error)]
pub enum StampError {
    /// The peer announced a frame over [`MAX_SESSION_FRAME`].
    #[error("node-session frame of {0} bytes exceeds the {MAX_SESSION_FRAME}-byte cap")]
    TooLarge(u64),
    /// The frame is not a protobuf message of the node-session protocol.
    #[error("malformed node-session frame: {0}")]
    Malformed(#[from] prost::DecodeError),
}

/// `meta.NetworkMessage`, with only its `node` branch modelled; the others stay bytes (a
/// message field and a bytes field share their wire form).
#[derive(Clone, PartialEq, prost::Message)]
struct NetworkMessage {
    #[prost(oneof = "Network", tags = "1, 2, 3")]
    message: Option<Network>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Network {
    #[prost(bytes = "bytes", tag = "1")]
    Auth(Bytes),
    #[prost(message, tag = "2")]
    Node(NodeMessage),
    #[prost(bytes = "bytes", tag = "3")]
    Control(Bytes),
}

/// `node.NodeMessage`: a cast, a call, or a call's reply (kept as bytes: never rewritten).
#[derive(Clone, PartialEq, prost::Message)]
struct NodeMessage {
    #[prost(oneof = "Node", tags = "1, 2, 3")]
    msg: Option<Node>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Node {
    #[prost(message, tag = "1")]
    Cast(Cast),
    #[prost(message, tag = "2")]
    Call(Call),
    #[prost(bytes = "bytes", tag = "3")]
    Reply(Bytes),
}

/// `node.Cast`, every field.
#[derive(Clone, PartialEq, prost::Message)]
struct Cast {
    #[prost(uint64, tag = "1")]
    to: u64,
    #[prost(bytes = "bytes", tag = "2")]
    what: Bytes,
    #[prost(string, tag = "3")]
    variant: String,
    #[prost(bytes, optional, tag = "6")]
    metadata: Option<Vec<u8>>,
}

/// `node.Call`, every field.
#[derive(Clone, PartialEq, prost::Message)]
struct Call {
    #[prost(uint64, tag = "1")]
    to: u64,
    #[prost(bytes = "bytes", tag = "2")]
    what: Bytes,
    #[prost(uint64, tag = "3")]
    tag: u64,
    #[prost(uint64, optional, tag = "4")]
    timeout_ms: Option<u64>,
    #[prost(string, tag = "5")]
    variant: String,
    #[prost(bytes, optional, tag = "6")]
    metadata: Option<Vec<u8>>,
}

/// The stamp naming `node`: what a node's own session reader puts in a request from `node`
/// (a peer that writes it itself gains nothing: [`stamp_frame`] overwrites it).
pub fn caller_stamp(node: &str) -> Vec<u8> {
    [STAMP_PREFIX, node.as_bytes()].concat()
}

/// The node a stamp names, or `None` when `metadata` is not a stamp.
pub fn read_stamp(metadata: &[u8]) -> Option<String> {
    let name = metadata.strip_prefix(STAMP_PREFIX)?;
    String::from_utf8(name.to_vec()).ok()
}

/// Stamps one frame's payload (without its length) from peer `node`: a node `Cast` or `Call`
/// comes back re-encoded with `metadata` naming `node`; any other frame comes back `None`, to
/// be passed on as it came. Decoding borrows the payload's byte fields (a call's body is not
/// copied until it is re-encoded).
pub fn stamp_frame(payload: &Bytes, node: &str) -> Result<Option<Vec<u8>>, StampError> {
    use prost::Message as _;
    let mut msg = NetworkMessage::decode(payload.clone())?;
    let metadata = match &mut msg.message {
        Some(Network::Node(NodeMessage {
            msg: Some(Node::Cast(c)),
        })) => &mut c.metadata,
        Some(Network::Node(NodeMessage {
            msg: Some(Node::Call(c)),
        })) => &mut c.metadata,
        _ => return Ok(None),
    };
    *metadata = Some(caller_stamp(node));
    Ok(Some(msg.encode_to_vec()))
}

/// Most bytes a frame's payload buffer grows by per read: a length alone reserves nothing, so a
/// peer announcing a large frame and sending nothing costs no memory.
const GROW_STEP: usize = 64 * 1024;

/// Bytes the reader buffers from the stream, so that a small frame's length and payload come
/// out of one read of the transport; a larger payload is read past the buffer, straight into
/// its own.
const READ_BUFFER: usize = 4 * 1024;

/// Where a [`StampedReader`] is in the frame it is reading.
enum Frame {
    /// Gathering the 8-byte length; this many bytes of it are in.
    Length([u8; 8], usize),
    /// Gathering a payload of this many bytes.
    Payload(usize),
}

/// The read half of a node session from peer `node`, stamped as it is read: frames are read
/// from the stream, each node `Cast` and `Call` re-encoded by [`stamp_frame`], and handed to
/// the session's reader with their new length; other frames are handed on as they came,
/// without a copy. Reading happens in the session reader's own task (no task or pipe in
/// between). A frame over [`MAX_SESSION_FRAME`], a malformed frame or a stream ending inside
/// a frame is an error, which ends the session.
pub struct StampedReader<R> {
    src: tokio::io::BufReader<R>,
    node: String,
    frame: Frame,
    payload: BytesMut,
    /// The frame being handed out: its length, then its payload, and how much of the two has
    /// been.
    head: [u8; 8],
    body: Bytes,
    out_pos: usize,
}

impl<R: AsyncRead + Unpin> StampedReader<R> {
    /// Stamps the frames read from `src` with peer `node`.
    pub fn new(src: R, node: String) -> Self {
        StampedReader {
            src: tokio::io::BufReader::with_capacity(READ_BUFFER, src),
            node,
            frame: Frame::Length([0; 8], 0),
            payload: BytesMut::new(),
            head: [0; 8],
            body: Bytes::new(),
            out_pos: 8,
        }
    }

    /// Bytes of the current frame not yet handed out.
    fn pending(&self) -> usize {
        8 + self.body.len() - self.out_pos
    }

    /// Reads until one whole frame is stamped and ready to hand out; `Ready(Ok(false))` at a
    /// clean end of the stream before a frame starts.
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<bool>> {
        loop {
            match &mut self.frame {
                Frame::Length(bytes, got) => {
                    let mut buf = ReadBuf::new(&mut bytes[*got..]);
                    ready!(Pin::new(&mut self.src).poll_read(cx, &mut buf))?;
                    let n = buf.filled().len();
                    if n == 0 {
                        return if *got == 0 {
                            Poll::Ready(Ok(false))
                        } else {
                            Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()))
                        };
                    }
                    *got += n;
                    if *got < 8 {
                        continue;
                    }
                    let len = u64::from_be_bytes(*bytes);
                    if len > MAX_SESSION_FRAME {
                        return Poll::Ready(Err(self.refuse(StampError::TooLarge(len))));
                    }
                    self.payload = BytesMut::new();
                    self.frame = Frame::Payload(len as usize);
                }
                Frame::Payload(len) => {
                    let len = *len;
                    let have = self.payload.len();
                    if have < len {
                        self.payload.reserve((len - have).min(GROW_STEP));
                        let spare = self.payload.spare_capacity_mut();
                        let room = spare.len().min(len - have);
                        let mut buf = ReadBuf::uninit(&mut spare[..room]);
                        // What the buffer holds comes from it; the rest of a large payload
                        // is read straight from the stream (the buffer passes large reads by).
                        ready!(Pin::new(&mut self.src).poll_read(cx, &mut buf))?;
                        let n = buf.filled().len();
                        if n == 0 {
                            return Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()));
                        }
                        // SAFETY: `poll_read` initialised the first `n` spare bytes.
                        unsafe { self.payload.set_len(have + n) };
                        continue;
                    }
                    let payload = std::mem::take(&mut self.payload).freeze();
                    let body = match stamp_frame(&payload, &self.node) {
                        Ok(Some(stamped)) => Bytes::from(stamped),
                        Ok(None) => payload,
                        Err(e) => return Poll::Ready(Err(self.refuse(e))),
                    };
                    self.head = (body.len() as u64).to_be_bytes();
                    self.body = body;
                    self.out_pos = 0;
                    self.frame = Frame::Length([0; 8], 0);
                    return Poll::Ready(Ok(true));
                }
            }
        }
    }

    fn refuse(&self, e: StampError) -> std::io::Error {
        tracing::warn!("node session from `{}` closed: {e}", self.node);
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for StampedReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.pending() == 0 && !ready!(this.poll_frame(cx))? {
            return Poll::Ready(Ok(()));
        }
        if this.out_pos < 8 {
            let n = buf.remaining().min(8 - this.out_pos);
            buf.put_slice(&this.head[this.out_pos..this.out_pos + n]);
            this.out_pos += n;
        }
        if this.out_pos >= 8 {
            let at = this.out_pos - 8;
            let n = buf.remaining().min(this.body.len() - at);
            buf.put_slice(&this.body[at..at + n]);
            this.out_pos += n;
        }
        Poll::Ready(Ok(()))
    }
}

/// The read half of a node session from peer `node`, stamped ([`StampedReader`]).
pub fn stamped_reader<R>(src: R, node: String) -> ractor_cluster::BoxRead
where
    R: AsyncRead + Unpin + Send + 'static,
{
    Box::new(StampedReader::new(src, node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;
    use tokio::io::AsyncReadExt;

    /// Reads one frame (`u64` big-endian length and payload); `None` at the end.
    async fn read_session_frame(src: &mut &[u8]) -> Option<Vec<u8>> {
        if src.is_empty() {
            return None;
        }
        let len = src.read_u64().await.unwrap() as usize;
        let mut payload = vec![0u8; len];
        src.read_exact(&mut payload).await.unwrap();
        Some(payload)
    }

    /// Everything the stamped reader gives for `input` from peer `peer`.
    async fn stamp_session(input: &[u8], out: &mut Vec<u8>, peer: &str) -> std::io::Result<usize> {
        StampedReader::new(input, peer.to_string())
            .read_to_end(out)
            .await
    }

    fn call(metadata: Option<&[u8]>) -> Vec<u8> {
        NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Call(Call {
                    to: 7,
                    what: vec![1, 2, 3].into(),
                    tag: 9,
                    timeout_ms: Some(500),
                    variant: "clawrl.rpc".into(),
                    metadata: metadata.map(|m| m.to_vec()),
                })),
            })),
        }
        .encode_to_vec()
    }

    fn metadata_of(payload: &[u8]) -> Option<Vec<u8>> {
        match NetworkMessage::decode(payload).unwrap().message {
            Some(Network::Node(NodeMessage {
                msg: Some(Node::Call(c)),
            })) => c.metadata,
            Some(Network::Node(NodeMessage {
                msg: Some(Node::Cast(c)),
            })) => c.metadata,
            other => panic!("not a call or cast: {other:?}"),
        }
    }

    #[test]
    fn a_forged_caller_is_overwritten_by_the_peer_name() {
        let forged = call(Some(&caller_stamp("control-node")));
        let out = stamp_frame(&forged.into(), "intruder")
            .unwrap()
            .expect("rewritten");
        assert_eq!(
            read_stamp(&metadata_of(&out).unwrap()).as_deref(),
            Some("intruder")
        );
        // Everything else of the call is kept.
        let NetworkMessage {
            message:
                Some(Network::Node(NodeMessage {
                    msg: Some(Node::Call(c)),
                })),
        } = NetworkMessage::decode(out.as_slice()).unwrap()
        else {
            panic!("not a call")
        };
        assert_eq!(
            (c.to, c.what, c.tag, c.timeout_ms, c.variant.as_str()),
            (7, Bytes::from(vec![1, 2, 3]), 9, Some(500), "clawrl.rpc")
        );
    }

    #[test]
    fn an_unstamped_cast_is_stamped() {
        let cast = NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Cast(Cast {
                    to: 1,
                    what: vec![4].into(),
                    variant: "v".into(),
                    metadata: None,
                })),
            })),
        }
        .encode_to_vec();
        let out = stamp_frame(&cast.into(), "a").unwrap().expect("rewritten");
        assert_eq!(
            read_stamp(&metadata_of(&out).unwrap()).as_deref(),
            Some("a")
        );
    }

    #[test]
    fn other_frames_pass_unchanged() {
        let reply = NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Reply(vec![8, 1, 16, 2].into())),
            })),
        }
        .encode_to_vec();
        let auth = NetworkMessage {
            message: Some(Network::Auth(vec![10, 1, 97].into())),
        }
        .encode_to_vec();
        let control = NetworkMessage {
            message: Some(Network::Control(vec![26, 0].into())),
        }
        .encode_to_vec();
        for frame in [reply, auth, control, Vec::new()] {
            let frame = Bytes::from(frame);
            assert_eq!(stamp_frame(&frame, "a").unwrap(), None, "{frame:?}");
        }
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(matches!(
            stamp_frame(&Bytes::from_static(&[0xff, 0xff, 0xff]), "a"),
            Err(StampError::Malformed(_))
        ));
    }

    #[test]
    fn only_stamps_name_a_caller() {
        assert_eq!(read_stamp(&caller_stamp("n-1")).as_deref(), Some("n-1"));
        assert_eq!(read_stamp(b"n-1"), None);
    }

    fn framed(payload: &[u8]) -> Vec<u8> {
        [&(payload.len() as u64).to_be_bytes()[..], payload].concat()
    }

    #[tokio::test]
    async fn a_session_is_stamped_frame_by_frame() {
        let auth = NetworkMessage {
            message: Some(Network::Auth(vec![10, 1, 97].into())),
        }
        .encode_to_vec();
        let input = [framed(&auth), framed(&call(Some(b"forged")))].concat();
        let mut out = Vec::new();
        stamp_session(input.as_slice(), &mut out, "peer")
            .await
            .unwrap();
        let mut rest = out.as_slice();
        let first = read_session_frame(&mut rest).await.unwrap();
        assert_eq!(first, auth, "passed byte for byte");
        let second = read_session_frame(&mut rest).await.unwrap();
        assert_eq!(
            read_stamp(&metadata_of(&second).unwrap()).as_deref(),
            Some("peer")
        );
        assert_eq!(read_session_frame(&mut rest).await, None);
    }

    /// A stream that gives one byte a read, returning `Pending` (and waking) every other poll.
    struct Trickle<'a>(&'a [u8], bool);

    impl AsyncRead for Trickle<'_> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            self.1 = !self.1;
            if self.1 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if let Some((first, rest)) = self.0.split_first() {
                buf.put_slice(&[*first]);
                self.0 = rest;
            }
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn frames_split_anywhere_come_out_whole_and_read_in_small_pieces() {
        // A reply larger than the payload buffer's growth step, between two calls.
        let reply = NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Reply(vec![7; 3 * GROW_STEP + 5].into())),
            })),
        }
        .encode_to_vec();
        let input = [
            framed(&call(None)),
            framed(&reply),
            framed(&call(Some(b"forged"))),
        ]
        .concat();
        let mut reader = StampedReader::new(Trickle(&input, false), "peer".into());
        let mut out = Vec::new();
        let mut piece = [0u8; 5];
        loop {
            let n = reader.read(&mut piece).await.unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&piece[..n]);
        }
        let mut rest = out.as_slice();
        for expect_stamp in [true, false, true] {
            let frame = read_session_frame(&mut rest).await.unwrap();
            if expect_stamp {
                let stamp = metadata_of(&frame).unwrap();
                assert_eq!(read_stamp(&stamp).as_deref(), Some("peer"));
            } else {
                assert_eq!(frame, reply);
            }
        }
        assert_eq!(read_session_frame(&mut rest).await, None);
    }

    #[tokio::test]
    async fn a_frame_over_the_cap_is_an_error() {
        let input = (MAX_SESSION_FRAME + 1).to_be_bytes();
        let mut out = Vec::new();
        let e = stamp_session(&input[..], &mut out, "peer")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("cap"), "{e}");
        assert!(out.is_empty());
    }

    #[tokio::test]
    async fn a_truncated_frame_is_an_error() {
        let whole = framed(&call(None));
        for cut in [3, whole.len() - 1] {
            let mut out = Vec::new();
            let e = stamp_session(&whole[..cut], &mut out, "peer")
                .await
                .unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
    }
}
