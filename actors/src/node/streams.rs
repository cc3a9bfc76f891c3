//! The QUIC endpoint's server side: the accept loop (a connection must negotiate the clawrl
//! ALPN and carry no revoked certificate), one task per connection serving the streams its
//! peer opens until it ends (then the peer leaves the table), and one task per stream, which
//! reads the stream's tag byte and hands the stream to its service. Node sessions, gossip and
//! bulk streams are served only to a peer a hello admitted ([`admission::needs_admission`]).

use std::net::SocketAddr;

use quinn::{RecvStream, SendStream};
use tokio::io::AsyncReadExt;

use super::{admission, lock, Node, STREAM_HEAD_TIMEOUT};
use crate::pki;
use crate::transport::{self, StreamTag};

impl Node {
    /// Accepts connections until the endpoint closes, each on its own task.
    pub(super) async fn accept_loop(self) {
        while let Some(incoming) = self.inner.endpoint.accept().await {
            let node = self.clone();
            tokio::spawn(async move {
                let from = incoming.remote_address();
                let conn = match incoming.accept() {
                    Ok(connecting) => match connecting.await {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!("refused connection from {from}: {e}");
                            return;
                        }
                    },
                    Err(e) => {
                        tracing::warn!("refused connection from {from}: {e}");
                        return;
                    }
                };
                if transport::negotiated_alpn(&conn).as_deref() != Some(pki::ALPN) {
                    tracing::warn!("refused connection from {from}: wrong or missing ALPN");
                    conn.close(2u32.into(), b"ALPN clawrl/1 required");
                    return;
                }
                if let Some(name) = node.revoked_peer(&conn) {
                    tracing::warn!(
                        "refused `{name}` from {from}: its certificate is revoked ([tls] deny)"
                    );
                    conn.close(5u32.into(), b"revoked");
                    return;
                }
                node.serve_connection(conn).await;
            });
        }
    }

    /// Serves the streams a connection's peer opens until the connection ends.
    pub(super) async fn serve_connection(self, conn: quinn::Connection) {
        loop {
            let (send, recv) = match conn.accept_bi().await {
                Ok(s) => s,
                Err(_) => break,
            };
            let node = self.clone();
            let c = conn.clone();
            tokio::spawn(async move { node.serve_stream(c, send, recv).await });
        }
        let reason = conn
            .close_reason()
            .map(|r| r.to_string())
            .unwrap_or_default();
        let mut peers = lock(&self.inner.peers);
        let name = peers
            .iter()
            .find(|(_, p)| p.conn.stable_id() == conn.stable_id())
            .map(|(n, _)| n.clone());
        if let Some(n) = name {
            peers.remove(&n);
            tracing::warn!("peer `{n}` left ({reason})");
        }
    }

    /// Reads a stream's tag byte and hands the stream to its service.
    async fn serve_stream(self, conn: quinn::Connection, send: SendStream, mut recv: RecvStream) {
        let from = conn.remote_address();
        let mut tag = [0u8; 1];
        match tokio::time::timeout(
            STREAM_HEAD_TIMEOUT,
            AsyncReadExt::read_exact(&mut recv, &mut tag),
        )
        .await
        {
            Ok(Ok(_)) => {}
            _ => {
                tracing::debug!("stream from {from} sent no tag");
                return;
            }
        }
        let Some(kind) = StreamTag::from_byte(tag[0]) else {
            tracing::warn!("{from}: unknown stream tag {:#04x}; stream dropped", tag[0]);
            return;
        };
        let peer = match self.admitted_name(&conn) {
            Some(peer) => peer,
            None if admission::needs_admission(kind) => {
                return refuse_unadmitted(kind, from, send, recv);
            }
            // Hello and CLI streams come before, or without, admission: no peer name.
            None => String::new(),
        };
        match kind {
            StreamTag::Hello => self.serve_hello(conn, send, recv).await,
            StreamTag::ActorSession => {
                self.start_node_session(send, recv, &peer, format!("{peer}@{from}"), true)
            }
            StreamTag::Gossip => {
                let r = tokio::time::timeout(
                    STREAM_HEAD_TIMEOUT,
                    transport::read_frame::<Vec<(String, SocketAddr)>>(&mut recv),
                )
                .await;
                match r {
                    Ok(Ok(list)) => self.learn(list),
                    Ok(Err(e)) => tracing::warn!("{from}: bad gossip: {e}"),
                    Err(_) => tracing::warn!("{from}: gossip timed out"),
                }
            }
            StreamTag::Cli => self.serve_cli(from, send, recv).await,
            StreamTag::Bulk => {
                if let Err(e) = self.inner.bulk.serve_stream(&peer, send, recv).await {
                    tracing::warn!("bulk stream from `{peer}` ({from}): {e}");
                }
            }
        }
    }

    /// The name of the admitted peer whose connection `conn` is, if any.
    fn admitted_name(&self, conn: &quinn::Connection) -> Option<String> {
        lock(&self.inner.peers)
            .values()
            .find(|p| p.conn.stable_id() == conn.stable_id())
            .map(|p| p.name.clone())
    }
}

/// Turns away a stream that needs an admitted peer, on a connection that has not completed the
/// hello (the CLI's, or a refused one): it has no node identity.
fn refuse_unadmitted(kind: StreamTag, from: SocketAddr, send: SendStream, recv: RecvStream) {
    match kind {
        StreamTag::ActorSession => {
            tracing::warn!("{from}: node session stream before hello; refused");
        }
        StreamTag::Bulk => {
            tracing::warn!("{from}: bulk stream before hello; refused");
            refuse_stream(send, recv);
        }
        StreamTag::Gossip | StreamTag::Hello | StreamTag::Cli => {}
    }
}

/// Error code of a stream refused before its conversation starts.
pub(super) const STREAM_REFUSED: quinn::VarInt = quinn::VarInt::from_u32(1);

/// Refuses a stream: resets our side and asks the peer to stop sending.
fn refuse_stream(mut send: SendStream, mut recv: RecvStream) {
    let _ = send.reset(STREAM_REFUSED);
    let _ = recv.stop(STREAM_REFUSED);
}
