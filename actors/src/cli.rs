//! The CLI protocol: what `clawrl submit/status/cancel/nodes/ping/blob` ask a node and what it
//! answers, and the client that asks (one QUIC connection with the cluster's client
//! certificate, one [`crate::transport::StreamTag::Cli`] stream per request).
//!
//! No request names a path on the node: `blob publish` and `blob save` read and write files on
//! the CLI's machine, and the blob's bytes travel on the CLI stream as a body of raw bytes after
//! the request (publish) or the reply (save) frame. A body has a declared length; its reader
//! takes it in pieces of at most [`BODY_CHUNK`] bytes, refuses a length over its cap, a stream
//! that ends early and any byte past the declared length, and gives up on a body that makes no
//! progress for [`BODY_STALL`].

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::BoxFuture;
use quinn::{RecvStream, SendStream};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::config::NodeConfig;
use crate::control::{ControlReply, ControlRequest};
use crate::pki::{self, Identity, NODE_SERVER_NAME};
use crate::transport::{self, StreamTag};

/// Largest piece of a blob body read or written at once (bodies are raw bytes beside the
/// frames, whose size [`transport::MAX_FRAME`] caps, so a blob never travels as one frame).
pub const BODY_CHUNK: usize = 1 << 20;
/// A blob body that makes no progress for this long is abandoned.
pub const BODY_STALL: Duration = Duration::from_secs(30);

/// A CLI request to a node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum CliRequest {
    /// The cluster as this node sees it: nodes and process groups.
    Nodes,
    /// Ping every group member from this node (a remote round trip each).
    Ping,
    /// Forward to the cluster's Control actor.
    Control(ControlRequest),
    /// Operate this node's bulk plane.
    Blob(BlobRequest),
}

/// A request to a node's bulk plane. None names a file: files stay on the CLI's machine.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum BlobRequest {
    /// Publish the body that follows this request on the stream as a blob: exactly `len` raw
    /// bytes, then the end of the stream.
    Publish {
        /// The body's length in bytes (at most the node's bulk `max_blob`).
        len: u64,
    },
    /// Broadcast a blob held by this node to other nodes (relayed).
    Broadcast {
        /// The blob id (hex).
        id: String,
        /// Target node names.
        targets: Vec<String>,
    },
    /// Send a blob held by this node: the reply [`BlobReply::Bytes`] is followed by its bytes.
    Save {
        /// The blob id (hex).
        id: String,
    },
}

/// A bulk plane's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum BlobReply {
    /// The blob's id and size.
    Published {
        /// The blob id (hex).
        id: String,
        /// Its size in bytes.
        len: u64,
    },
    /// Nodes now holding the blob.
    Broadcast {
        /// Every target, all holding the blob.
        delivered: Vec<String>,
        /// Targets that needed a direct retry.
        retried: Vec<String>,
    },
    /// The blob's bytes follow this reply on the stream: exactly `len` raw bytes.
    Bytes {
        /// The body's length in bytes.
        len: u64,
        /// blake3 of the body (hex).
        blake3: String,
    },
}

/// A node's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum CliReply {
    /// Answer to [`CliRequest::Nodes`].
    Nodes(ClusterView),
    /// Answer to [`CliRequest::Ping`].
    Ping(Vec<PingResult>),
    /// Control's answer.
    Control(ControlReply),
    /// The bulk plane's answer.
    Blob(BlobReply),
    /// The request failed.
    Error(String),
}

/// One node in [`ClusterView`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeView {
    /// The node's name.
    pub name: String,
    /// Its advertised QUIC address.
    pub addr: String,
    /// Its roles.
    pub roles: Vec<String>,
    /// The environment slots it offers (`KIND:COUNT`).
    pub envs: Vec<String>,
}

/// The cluster as one node sees it (`clawrl nodes --json` prints exactly this).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterView {
    /// This node and its connected peers, by name.
    pub nodes: Vec<NodeView>,
    /// Every `clawrl.*` process group and its members (`<node>/<actor>`), sorted.
    pub groups: BTreeMap<String, Vec<String>>,
}

/// Result of pinging one group member.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PingResult {
    /// The group.
    pub group: String,
    /// The member (`<node>/<actor>`).
    pub member: String,
    /// Whether it echoed the nonce.
    pub ok: bool,
    /// Round-trip time in microseconds, or the error.
    pub detail: String,
}

/// Why a CLI request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Certificates missing or unusable.
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    /// Endpoint setup failed.
    #[error(transparent)]
    Endpoint(#[from] transport::EndpointError),
    /// The node could not be reached.
    #[error("cannot reach node at {addr}: {message}")]
    Connect {
        /// The address dialed.
        addr: SocketAddr,
        /// What happened.
        message: String,
    },
    /// The exchange failed.
    #[error("request to {addr}: {source}")]
    Frame {
        /// The address dialed.
        addr: SocketAddr,
        /// The framing error.
        source: transport::FrameError,
    },
    /// A local file (the CLI's machine) could not be read or written.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A blob's bytes did not travel whole.
    #[error("blob bytes to or from {addr}: {source}")]
    Body {
        /// The address dialed.
        addr: SocketAddr,
        /// What went wrong.
        source: BodyError,
    },
    /// The node's bytes do not hash to the blake3 it announced.
    #[error("blob from {addr}: the node announced blake3 {announced} but its bytes hash to {got}")]
    Corrupt {
        /// The address dialed.
        addr: SocketAddr,
        /// blake3 the node announced.
        announced: String,
        /// blake3 of the bytes received.
        got: String,
    },
    /// The node answered with an error.
    #[error("{message}")]
    Refused {
        /// The node's message.
        message: String,
    },
    /// The node answered something this request does not expect.
    #[error("unexpected reply from {addr}: {reply}")]
    Unexpected {
        /// The address dialed.
        addr: SocketAddr,
        /// The reply, debug-printed.
        reply: String,
    },
}

/// Why a blob body could not be read or written on a CLI stream.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The declared length is over the reader's cap.
    #[error("{declared} bytes declared, over the {cap}-byte cap")]
    TooLarge {
        /// The declared length.
        declared: u64,
        /// The cap.
        cap: u64,
    },
    /// The body ended before its declared length.
    #[error("ended after {got} of {declared} declared bytes")]
    Short {
        /// Bytes that came.
        got: u64,
        /// The declared length.
        declared: u64,
    },
    /// More bytes came than declared.
    #[error("more than the {declared} declared bytes")]
    Excess {
        /// The declared length.
        declared: u64,
    },
    /// No progress for [`BODY_STALL`].
    #[error("no progress for {BODY_STALL:?} after {done} bytes")]
    Stalled {
        /// Bytes moved before the stall.
        done: u64,
    },
    /// Reading the stream failed.
    #[error("stream: {0}")]
    Read(#[from] quinn::ReadError),
    /// Writing the stream failed.
    #[error("stream: {0}")]
    Write(std::io::Error),
    /// Reading the bytes to send failed.
    #[error("reading the bytes to send: {0}")]
    Source(std::io::Error),
    /// Keeping the bytes received failed.
    #[error("keeping the bytes received: {0}")]
    Sink(std::io::Error),
}

/// Reads a body of exactly `declared` bytes (at most `cap`) from `recv`, handing each piece to
/// `sink`, then requires the end of the stream: the sender finishes its side right after the
/// body, so any further byte is an error.
pub async fn read_body(
    recv: &mut RecvStream,
    declared: u64,
    cap: u64,
    mut sink: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<(), BodyError> {
    if declared > cap {
        return Err(BodyError::TooLarge { declared, cap });
    }
    let mut got = 0u64;
    while got < declared {
        let want = (declared - got).min(BODY_CHUNK as u64) as usize;
        let chunk = tokio::time::timeout(BODY_STALL, recv.read_chunk(want, true))
            .await
            .map_err(|_| BodyError::Stalled { done: got })??;
        let Some(chunk) = chunk else {
            return Err(BodyError::Short { got, declared });
        };
        got += chunk.bytes.len() as u64;
        sink(&chunk.bytes).map_err(BodyError::Sink)?;
    }
    match tokio::time::timeout(BODY_STALL, recv.read_chunk(1, true)).await {
        Err(_) => Err(BodyError::Stalled { done: got }),
        Ok(Ok(None)) => Ok(()),
        Ok(Ok(Some(_))) => Err(BodyError::Excess { declared }),
        Ok(Err(e)) => Err(e.into()),
    }
}

/// Writes a body of exactly `len` bytes taken from `source` on `send`, in pieces of at most
/// [`BODY_CHUNK`]; a source that ends early is an error (bytes beyond `len` are not read).
pub async fn write_body(
    send: &mut SendStream,
    source: &mut (impl AsyncRead + Unpin),
    len: u64,
) -> Result<(), BodyError> {
    let mut buf = vec![0u8; BODY_CHUNK.min(len as usize)];
    let mut sent = 0u64;
    while sent < len {
        let want = (len - sent).min(BODY_CHUNK as u64) as usize;
        let n = source
            .read(&mut buf[..want])
            .await
            .map_err(BodyError::Source)?;
        if n == 0 {
            return Err(BodyError::Short {
                got: sent,
                declared: len,
            });
        }
        tokio::time::timeout(BODY_STALL, AsyncWriteExt::write_all(send, &buf[..n]))
            .await
            .map_err(|_| BodyError::Stalled { done: sent })?
            .map_err(BodyError::Write)?;
        sent += n as u64;
    }
    Ok(())
}

/// The identity the CLI uses for a node config: `[tls] client_cert/client_key`, or the ephemeral
/// CA's client certificate under `data_dir` when there is no `[tls]`.
pub fn client_identity(config: &NodeConfig) -> Result<Identity, pki::PkiError> {
    match &config.tls {
        Some(t) => Identity::load(&t.ca, &t.client_cert, &t.client_key),
        None => {
            let dir = pki::ephemeral_dir(&config.data_dir);
            Identity::load(
                &dir.join("ca.pem"),
                &dir.join("client.pem"),
                &dir.join("client.key"),
            )
        }
    }
}

/// The address a local client dials for a node config (unspecified IPs become loopback).
pub fn dial_addr(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

/// Opens a CLI stream to the node of `config` and runs `exchange` on it, all within `timeout`.
async fn with_stream<T, F, Fut>(
    config: &NodeConfig,
    timeout: Duration,
    exchange: F,
) -> Result<T, ClientError>
where
    F: FnOnce(SendStream, RecvStream, SocketAddr) -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let identity = client_identity(config)?;
    let addr = dial_addr(config.listen);
    let bind: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let ep = transport::endpoint(&identity, bind, false)?;
    let connect_err = |message: String| ClientError::Connect { addr, message };
    let work = async {
        let conn = ep
            .connect(addr, NODE_SERVER_NAME)
            .map_err(|e| connect_err(e.to_string()))?
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        let (send, recv) = transport::open_tagged(&conn, StreamTag::Cli)
            .await
            .map_err(|source| ClientError::Frame { addr, source })?;
        let out = exchange(send, recv, addr).await;
        conn.close(0u32.into(), b"done");
        out
    };
    let out = tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(connect_err(format!("no answer within {timeout:?}"))));
    let _ = tokio::time::timeout(Duration::from_secs(1), ep.wait_idle()).await;
    out
}

/// Sends one request to the node of `config` and returns its reply.
pub fn request<'a>(
    config: &'a NodeConfig,
    req: &'a CliRequest,
    timeout: Duration,
) -> BoxFuture<'a, Result<CliReply, ClientError>> {
    // Boxed here, so the future's body is compiled once, in this crate: a caller in another
    // crate that awaited the `async fn` itself would compile the whole body again.
    Box::pin(request_body(config, req, timeout))
}

async fn request_body(
    config: &NodeConfig,
    req: &CliRequest,
    timeout: Duration,
) -> Result<CliReply, ClientError> {
    with_stream(config, timeout, |mut send, mut recv, addr| async move {
        let frame = |source| ClientError::Frame { addr, source };
        transport::write_frame(&mut send, req)
            .await
            .map_err(frame)?;
        let _ = send.finish();
        transport::read_frame(&mut recv).await.map_err(frame)
    })
    .await
}

/// A blob published from a local file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishedBlob {
    /// The blob id (hex).
    pub id: String,
    /// Its size in bytes.
    pub len: u64,
}

/// A blob saved to a local file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedBlob {
    /// Bytes written.
    pub len: u64,
    /// blake3 of the bytes written (hex), checked against the node's.
    pub blake3: String,
}

/// Publishes the file at `path`, read on this machine, as a blob on the node of `config`: its
/// bytes follow the request on the CLI stream.
pub fn publish_blob<'a>(
    config: &'a NodeConfig,
    path: &'a Path,
    timeout: Duration,
) -> BoxFuture<'a, Result<PublishedBlob, ClientError>> {
    // Boxed, as [`request`] is.
    Box::pin(publish_blob_body(config, path, timeout))
}

async fn publish_blob_body(
    config: &NodeConfig,
    path: &Path,
    timeout: Duration,
) -> Result<PublishedBlob, ClientError> {
    let file_err = |source| ClientError::File {
        path: path.to_path_buf(),
        source,
    };
    let mut file = tokio::fs::File::open(path).await.map_err(file_err)?;
    let len = file.metadata().await.map_err(file_err)?.len();
    let reply = with_stream(config, timeout, |mut send, mut recv, addr| async move {
        let frame = |source| ClientError::Frame { addr, source };
        let req = CliRequest::Blob(BlobRequest::Publish { len });
        transport::write_frame(&mut send, &req)
            .await
            .map_err(frame)?;
        if let Err(source) = write_body(&mut send, &mut file, len).await {
            // A node that refuses the body says why before it stops reading.
            let said = tokio::time::timeout(
                Duration::from_secs(2),
                transport::read_frame::<CliReply>(&mut recv),
            )
            .await;
            return match said {
                Ok(Ok(reply @ CliReply::Error(_))) => Ok(reply),
                _ => Err(match source {
                    BodyError::Source(e) => file_err(e),
                    source => ClientError::Body { addr, source },
                }),
            };
        }
        let _ = send.finish();
        transport::read_frame(&mut recv).await.map_err(frame)
    })
    .await?;
    match reply {
        CliReply::Blob(BlobReply::Published { id, len }) => Ok(PublishedBlob { id, len }),
        CliReply::Error(message) => Err(ClientError::Refused { message }),
        other => Err(ClientError::Unexpected {
            addr: dial_addr(config.listen),
            reply: format!("{other:?}"),
        }),
    }
}

/// Fetches blob `id` from the node of `config` and writes it to the file `path` on this
/// machine. The bytes go to a temporary file beside `path`, which replaces `path` only once
/// they are all there and hash to the blake3 the node announced.
pub fn save_blob<'a>(
    config: &'a NodeConfig,
    id: &'a str,
    path: &'a Path,
    timeout: Duration,
) -> BoxFuture<'a, Result<SavedBlob, ClientError>> {
    // Boxed, as [`request`] is.
    Box::pin(save_blob_body(config, id, path, timeout))
}

async fn save_blob_body(
    config: &NodeConfig,
    id: &str,
    path: &Path,
    timeout: Duration,
) -> Result<SavedBlob, ClientError> {
    let name = path.file_name().ok_or_else(|| ClientError::File {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
    })?;
    let mut partial = name.to_os_string();
    partial.push(".partial");
    let partial = path.with_file_name(partial);
    let out = with_stream(config, timeout, |mut send, mut recv, addr| {
        let partial = partial.clone();
        async move {
            let frame = |source| ClientError::Frame { addr, source };
            let req = CliRequest::Blob(BlobRequest::Save { id: id.to_string() });
            transport::write_frame(&mut send, &req)
                .await
                .map_err(frame)?;
            let _ = send.finish();
            let (len, announced) = match transport::read_frame(&mut recv).await.map_err(frame)? {
                CliReply::Blob(BlobReply::Bytes { len, blake3 }) => (len, blake3),
                CliReply::Error(message) => return Err(ClientError::Refused { message }),
                other => {
                    return Err(ClientError::Unexpected {
                        addr,
                        reply: format!("{other:?}"),
                    })
                }
            };
            let file_err = |source| ClientError::File {
                path: partial.clone(),
                source,
            };
            let mut file = std::fs::File::create(&partial).map_err(file_err)?;
            let mut hasher = blake3::Hasher::new();
            read_body(&mut recv, len, u64::MAX, |piece| {
                hasher.update(piece);
                std::io::Write::write_all(&mut file, piece)
            })
            .await
            .map_err(|source| match source {
                BodyError::Sink(e) => file_err(e),
                source => ClientError::Body { addr, source },
            })?;
            file.sync_all().map_err(file_err)?;
            let got = hasher.finalize().to_hex().to_string();
            if got != announced {
                return Err(ClientError::Corrupt {
                    addr,
                    announced,
                    got,
                });
            }
            Ok(SavedBlob { len, blake3: got })
        }
    })
    .await;
    match out {
        Ok(saved) => {
            std::fs::rename(&partial, path).map_err(|source| ClientError::File {
                path: path.to_path_buf(),
                source,
            })?;
            Ok(saved)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}
