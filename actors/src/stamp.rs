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

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

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
    #[prost(bytes, tag = "1")]
    Auth(Vec<u8>),
    #[prost(message, tag = "2")]
    Node(NodeMessage),
    #[prost(bytes, tag = "3")]
    Control(Vec<u8>),
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
    #[prost(bytes, tag = "3")]
    Reply(Vec<u8>),
}

/// `node.Cast`, every field.
#[derive(Clone, PartialEq, prost::Message)]
struct Cast {
    #[prost(uint64, tag = "1")]
    to: u64,
    #[prost(bytes, tag = "2")]
    what: Vec<u8>,
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
    #[prost(bytes, tag = "2")]
    what: Vec<u8>,
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
/// be passed on as it came.
pub fn stamp_frame(payload: &[u8], node: &str) -> Result<Option<Vec<u8>>, StampError> {
    use prost::Message as _;
    let mut msg = NetworkMessage::decode(payload)?;
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

/// Reads one frame (`u64` big-endian length and payload) from `src`; `None` at a clean end of
/// the stream before a frame starts.
pub async fn read_session_frame<R: AsyncRead + Unpin>(
    src: &mut R,
) -> Result<Option<Vec<u8>>, std::io::Error> {
    let mut len = [0u8; 8];
    let mut got = 0;
    while got < len.len() {
        match src.read(&mut len[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    let len = u64::from_be_bytes(len);
    if len > MAX_SESSION_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            StampError::TooLarge(len),
        ));
    }
    // Grown as bytes arrive: a length alone reserves nothing.
    let mut payload = Vec::new();
    src.take(len).read_to_end(&mut payload).await?;
    if payload.len() as u64 != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(payload))
}

/// Copies node-session frames from `src` to `dst`, stamping each from peer `node`, until `src`
/// ends, `dst` is dropped, or a frame is refused (then `dst` is closed: the session ends).
pub async fn stamp_session<R, W>(mut src: R, mut dst: W, node: &str) -> Result<(), std::io::Error>
where
    R: AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    while let Some(payload) = read_session_frame(&mut src).await? {
        let stamped = stamp_frame(&payload, node)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let out = stamped.as_deref().unwrap_or(&payload);
        dst.write_all(&(out.len() as u64).to_be_bytes()).await?;
        dst.write_all(out).await?;
    }
    dst.shutdown().await
}

/// Bytes buffered between the stamping task and the session's reader.
const PIPE_BYTES: usize = 256 * 1024;

/// The read half of a node session from peer `node`, stamped: a task reads `src` and feeds the
/// returned reader with the stamped frames.
pub fn stamped_reader<R>(src: R, node: String) -> ractor_cluster::BoxRead
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let (reader, writer) = tokio::io::duplex(PIPE_BYTES);
    tokio::spawn(async move {
        if let Err(e) = stamp_session(src, writer, &node).await {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                tracing::warn!("node session from `{node}` closed: {e}");
            }
        }
    });
    Box::new(reader)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    fn call(metadata: Option<&[u8]>) -> Vec<u8> {
        NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Call(Call {
                    to: 7,
                    what: vec![1, 2, 3],
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
        let out = stamp_frame(&forged, "intruder")
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
            (7, vec![1, 2, 3], 9, Some(500), "clawrl.rpc")
        );
    }

    #[test]
    fn an_unstamped_cast_is_stamped() {
        let cast = NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Cast(Cast {
                    to: 1,
                    what: vec![4],
                    variant: "v".into(),
                    metadata: None,
                })),
            })),
        }
        .encode_to_vec();
        let out = stamp_frame(&cast, "a").unwrap().expect("rewritten");
        assert_eq!(
            read_stamp(&metadata_of(&out).unwrap()).as_deref(),
            Some("a")
        );
    }

    #[test]
    fn other_frames_pass_unchanged() {
        let reply = NetworkMessage {
            message: Some(Network::Node(NodeMessage {
                msg: Some(Node::Reply(vec![8, 1, 16, 2])),
            })),
        }
        .encode_to_vec();
        let auth = NetworkMessage {
            message: Some(Network::Auth(vec![10, 1, 97])),
        }
        .encode_to_vec();
        let control = NetworkMessage {
            message: Some(Network::Control(vec![26, 0])),
        }
        .encode_to_vec();
        for frame in [reply, auth, control, Vec::new()] {
            assert_eq!(stamp_frame(&frame, "a").unwrap(), None, "{frame:?}");
        }
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(matches!(
            stamp_frame(&[0xff, 0xff, 0xff], "a"),
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
            message: Some(Network::Auth(vec![10, 1, 97])),
        }
        .encode_to_vec();
        let input = [framed(&auth), framed(&call(Some(b"forged")))].concat();
        let mut out = Vec::new();
        stamp_session(input.as_slice(), &mut out, "peer")
            .await
            .unwrap();
        let mut rest = out.as_slice();
        let first = read_session_frame(&mut rest).await.unwrap().unwrap();
        assert_eq!(first, auth, "passed byte for byte");
        let second = read_session_frame(&mut rest).await.unwrap().unwrap();
        assert_eq!(
            read_stamp(&metadata_of(&second).unwrap()).as_deref(),
            Some("peer")
        );
        assert_eq!(read_session_frame(&mut rest).await.unwrap(), None);
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
