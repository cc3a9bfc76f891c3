//! The one message type of clawrl's cluster-visible actors: a request as bytes with a reply port,
//! and who sent it.
//!
//! Requests and replies are `serde` types encoded with `bincode` 2, so the same actor answers
//! local and remote callers; across nodes the message rides a `ractor_cluster` session as a
//! serialized call. The caller of a remote request is the node its session's certificate
//! proves, stamped by the receiving node ([`crate::stamp`]), never a name the sender wrote: a
//! remote request without that stamp is dropped.

use std::time::Duration;

use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{ActorCell, ActorRef, Message, RpcReplyPort};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Who sent a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// Code of this process (this node).
    Local,
    /// The node of that name, as its certificate proves.
    Node(String),
}

impl Caller {
    /// The caller's node name, `here` being this node's.
    pub fn node<'a>(&'a self, here: &'a str) -> &'a str {
        match self {
            Caller::Local => here,
            Caller::Node(n) => n,
        }
    }
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Caller::Local => f.write_str("this node"),
            Caller::Node(n) => write!(f, "node `{n}`"),
        }
    }
}

/// A request (`bincode` bytes), where its reply (`bincode` bytes) goes, and who sent it.
pub struct Rpc {
    /// The encoded request.
    pub request: Vec<u8>,
    /// The reply port.
    pub reply: RpcReplyPort<Vec<u8>>,
    /// Who sent it.
    pub caller: Caller,
}

impl Rpc {
    /// A request sent from this process (the caller a remote receiver sees is stamped there).
    pub fn local(request: Vec<u8>, reply: RpcReplyPort<Vec<u8>>) -> Self {
        Rpc {
            request,
            reply,
            caller: Caller::Local,
        }
    }
}

const VARIANT: &str = "clawrl.rpc";

impl Message for Rpc {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        // The receiving node stamps the caller; whatever is sent here would be overwritten.
        Ok(SerializedMessage::Call {
            variant: VARIANT.to_string(),
            args: self.request,
            reply: self.reply,
            metadata: None,
        })
    }

    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match bytes {
            SerializedMessage::Call {
                variant,
                args,
                reply,
                metadata,
            } if variant == VARIANT => {
                let Some(node) = metadata.as_deref().and_then(crate::stamp::read_stamp) else {
                    tracing::warn!("a remote request without its caller's stamp was dropped");
                    return Err(BoxedDowncastErr);
                };
                Ok(Rpc {
                    request: args,
                    reply,
                    caller: Caller::Node(node),
                })
            }
            _ => Err(BoxedDowncastErr),
        }
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The actor could not be reached or did not answer in time.
    #[error("call to {target}: {message}")]
    Unreachable {
        /// The target's name or id.
        target: String,
        /// What happened.
        message: String,
    },
    /// The reply did not decode.
    #[error("reply from {target} is malformed: {message}")]
    Malformed {
        /// The target's name or id.
        target: String,
        /// The decode error.
        message: String,
    },
}

/// Encodes a value as `bincode`.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .expect("serializing an in-memory value to a Vec cannot fail")
}

/// Decodes `bincode` bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::error::DecodeError> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard()).map(|(v, _)| v)
}

/// A printable name of an actor: its registered name, else its id.
pub fn actor_label(cell: &ActorCell) -> String {
    cell.get_name().unwrap_or_else(|| cell.get_id().to_string())
}

/// Calls `target` with `req` and decodes its reply, waiting at most `timeout`.
pub async fn call<Req: Serialize, Resp: DeserializeOwned>(
    target: &ActorCell,
    req: &Req,
    timeout: Duration,
) -> Result<Resp, CallError> {
    let name = actor_label(target);
    let actor: ActorRef<Rpc> = target.clone().into();
    let request = encode(req);
    let out = actor
        .call(|reply| Rpc::local(request, reply), Some(timeout))
        .await
        .map_err(|e| CallError::Unreachable {
            target: name.clone(),
            message: e.to_string(),
        })?;
    let bytes = match out {
        ractor::rpc::CallResult::Success(b) => b,
        ractor::rpc::CallResult::Timeout => {
            return Err(CallError::Unreachable {
                target: name,
                message: format!("no reply within {timeout:?}"),
            })
        }
        ractor::rpc::CallResult::SenderError => {
            return Err(CallError::Unreachable {
                target: name,
                message: "the actor dropped the request".into(),
            })
        }
    };
    decode(&bytes).map_err(|e| CallError::Malformed {
        target: name,
        message: e.to_string(),
    })
}

/// Replies to an [`Rpc`] with an encoded value (a gone caller is not an error).
pub fn reply<T: Serialize>(port: RpcReplyPort<Vec<u8>>, value: &T) {
    let _ = port.send(encode(value));
}
