//! The CLI protocol: what `clawrl submit/status/cancel/nodes/ping` ask a node and what it answers,
//! and the client that asks (one QUIC connection with the cluster's client certificate, one
//! [`crate::transport::StreamTag::Cli`] stream per request).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::NodeConfig;
use crate::control::{ControlReply, ControlRequest};
use crate::pki::{self, Identity, NODE_SERVER_NAME};
use crate::transport::{self, StreamTag};

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

/// A request to a node's bulk plane. Paths are on the node's filesystem.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum BlobRequest {
    /// Read a file and publish its bytes as a blob.
    Publish {
        /// The file (node-side path).
        path: std::path::PathBuf,
    },
    /// Broadcast a blob held by this node to other nodes (relayed).
    Broadcast {
        /// The blob id (hex).
        id: String,
        /// Target node names.
        targets: Vec<String>,
    },
    /// Write a blob held by this node to a file.
    Save {
        /// The blob id (hex).
        id: String,
        /// The file (node-side path).
        path: std::path::PathBuf,
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
    /// The blob was written.
    Saved {
        /// Bytes written.
        len: u64,
        /// blake3 of the bytes written (hex).
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

/// Sends one request to the node of `config` and returns its reply.
pub async fn request(
    config: &NodeConfig,
    req: &CliRequest,
    timeout: Duration,
) -> Result<CliReply, ClientError> {
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
        let frame = |source| ClientError::Frame { addr, source };
        let (mut send, mut recv) = transport::open_tagged(&conn, StreamTag::Cli)
            .await
            .map_err(frame)?;
        transport::write_frame(&mut send, req)
            .await
            .map_err(frame)?;
        let _ = send.finish();
        let reply: CliReply = transport::read_frame(&mut recv).await.map_err(frame)?;
        conn.close(0u32.into(), b"done");
        Ok(reply)
    };
    let out = tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(connect_err(format!("no answer within {timeout:?}"))));
    let _ = tokio::time::timeout(Duration::from_secs(1), ep.wait_idle()).await;
    out
}
