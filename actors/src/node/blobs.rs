//! The node's blobs: the bulk plane's view of the peer table ([`NodeConnector`]: the live
//! connection to a named peer, waiting briefly while the mesh reconnects), and the CLI's blob
//! requests (`blob publish`, `blob save`, `blob broadcast`), whose bytes travel on the CLI
//! stream itself, so a CLI request names no path on the node.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn::{RecvStream, SendStream};

use super::streams::STREAM_REFUSED;
use super::{lock, Node, Peer};
use crate::bulk::{BlobId, ConnectError, PeerConnector};
use crate::cli::{self, BlobReply, CliReply};
use crate::transport;

/// The bulk plane's view of this node's peer table: the live connection to a named peer,
/// waiting briefly when the mesh is (re)connecting to it.
#[derive(Clone)]
pub struct NodeConnector {
    peers: Arc<Mutex<HashMap<String, Peer>>>,
}

impl NodeConnector {
    /// A connector over the node's peer table.
    pub(super) fn new(peers: Arc<Mutex<HashMap<String, Peer>>>) -> Self {
        NodeConnector { peers }
    }
}

/// How long the bulk plane waits for a peer that is not connected right now.
const CONNECT_WAIT: Duration = Duration::from_secs(5);

impl PeerConnector for NodeConnector {
    fn connection(
        &self,
        peer: &str,
    ) -> impl std::future::Future<Output = Result<quinn::Connection, ConnectError>> + Send {
        let peers = self.peers.clone();
        let peer = peer.to_string();
        async move {
            let start = Instant::now();
            loop {
                let live = lock(&peers)
                    .get(&peer)
                    .filter(|p| p.conn.close_reason().is_none())
                    .map(|p| p.conn.clone());
                if let Some(c) = live {
                    return Ok(c);
                }
                if start.elapsed() > CONNECT_WAIT {
                    return Err(format!("not connected to node `{peer}`").into());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

impl Node {
    /// `blob publish`: the CLI's file arrives as the body after its request, in pieces, and
    /// becomes a blob. The body is bounded by the bulk plane's `max_blob` and by its declared
    /// length (the buffer grows as bytes arrive, so a declared length alone reserves nothing).
    pub(super) async fn receive_blob(
        &self,
        from: SocketAddr,
        len: u64,
        recv: &mut RecvStream,
    ) -> CliReply {
        let cap = self.inner.bulk.config().max_blob;
        let mut data = Vec::new();
        let body = cli::read_body(recv, len, cap, |piece| {
            data.extend_from_slice(piece);
            Ok(())
        })
        .await;
        if let Err(e) = body {
            tracing::warn!("{from}: blob publish refused: {e}");
            let _ = recv.stop(STREAM_REFUSED);
            return CliReply::Error(format!("blob publish refused: {e}"));
        }
        match self.inner.bulk.publish(bytes::Bytes::from(data)) {
            Ok(id) => {
                tracing::info!("published blob {id} ({len} bytes) sent by the CLI at {from}");
                CliReply::Blob(BlobReply::Published {
                    id: id.to_string(),
                    len,
                })
            }
            Err(e) => CliReply::Error(e.to_string()),
        }
    }

    /// The bytes of blob `id` if this node holds it.
    pub(super) fn held_blob(&self, id: &str) -> Result<bytes::Bytes, String> {
        let id = id.parse::<BlobId>().map_err(|e| e.to_string())?;
        self.inner
            .bulk
            .get(&id)
            .ok_or_else(|| format!("blob {id} is not held by node `{}`", self.inner.name))
    }

    /// `blob save`: answers [`BlobReply::Bytes`], then sends the blob as the body; the CLI
    /// writes the file on its own machine.
    pub(super) async fn send_blob(
        &self,
        from: SocketAddr,
        mut send: SendStream,
        data: bytes::Bytes,
    ) {
        let header = CliReply::Blob(BlobReply::Bytes {
            len: data.len() as u64,
            blake3: blake3::hash(&data).to_hex().to_string(),
        });
        if let Err(e) = transport::write_frame(&mut send, &header).await {
            tracing::warn!("{from}: cannot answer blob save: {e}");
            return;
        }
        if let Err(e) = cli::write_body(&mut send, &mut &data[..], data.len() as u64).await {
            tracing::warn!("{from}: blob save: {e}");
            return;
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(cli::BODY_STALL, send.stopped()).await;
    }

    pub(super) async fn broadcast_blob(
        &self,
        id: &str,
        targets: &[String],
    ) -> Result<BlobReply, String> {
        let id = id.parse::<BlobId>().map_err(|e| e.to_string())?;
        let r = self
            .inner
            .bulk
            .broadcast(id, targets)
            .await
            .map_err(|e| e.to_string())?;
        Ok(BlobReply::Broadcast {
            delivered: r.delivered,
            retried: r.retried,
        })
    }
}
