//! Mesh membership: the hello exchange on both sides (the dialer sends its hello on a
//! [`StreamTag::Hello`] stream; the dialed node answers a welcome with its own, or a refusal
//! with a reason), the peer table (one [`Peer`] per admitted node, one connection per pair),
//! the addresses learnt from hellos, and the node session opened on a connection this node
//! dialed. Whether a hello is welcome and which connection is kept are the pure rules of
//! [`admission`].

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quinn::{RecvStream, SendStream};
use ractor_cluster::NodeServerMessage;
use serde::{Deserialize, Serialize};

use super::admission::{self, Held, HelloRefusal, Join};
use super::{lock, Node, STREAM_HEAD_TIMEOUT};
use crate::config::Role;
use crate::member::EnvSpec;
use crate::pki::NODE_SERVER_NAME;
use crate::transport::{self, QuicBidi, StreamTag};

#[derive(Clone, Debug)]
pub struct Peer {
    /// The peer's node name.
    pub name: String,
    /// Its advertised address.
    pub addr: SocketAddr,
    /// Its roles.
    pub roles: Vec<Role>,
    /// The environment slots it offers.
    pub envs: Vec<EnvSpec>,
    /// The one QUIC connection to it.
    pub conn: quinn::Connection,
    /// Which node dialed this connection.
    pub dialer: String,
    /// When this side last opened a node session on it (dialer side only).
    pub(super) session_opened: Option<Instant>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Hello {
    cluster: String,
    name: String,
    addr: SocketAddr,
    roles: Vec<Role>,
    envs: Vec<EnvSpec>,
    peers: Vec<(String, SocketAddr)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum HelloReply {
    Welcome(Hello),
    Refused { name: String, reason: String },
}

impl Node {
    fn my_hello(&self) -> Hello {
        Hello {
            cluster: self.inner.digest.clone(),
            name: self.inner.name.clone(),
            addr: self.inner.advertised,
            roles: self.inner.roles.clone(),
            envs: self.inner.envs.clone(),
            peers: self
                .peers()
                .into_values()
                .map(|p| (p.name, p.addr))
                .collect(),
        }
    }

    /// Makes `addr` dialable: an unspecified advertised IP is replaced by the IP the
    /// connection actually comes from.
    fn fix_addr(addr: SocketAddr, conn: &quinn::Connection) -> SocketAddr {
        if addr.ip().is_unspecified() {
            SocketAddr::new(conn.remote_address().ip(), addr.port())
        } else {
            addr
        }
    }

    /// Adds gossiped or greeted peer addresses (not this node's own) to the dial table.
    pub(super) fn learn(&self, addrs: impl IntoIterator<Item = (String, SocketAddr)>) {
        let me = &self.inner.name;
        let learnt = lock(&self.inner.dial).learn(
            addrs
                .into_iter()
                .filter(|(name, _)| name != me)
                .map(|(_, addr)| addr),
            Instant::now(),
        );
        if learnt.refused > 0 {
            tracing::warn!(
                added = learnt.added,
                refused = learnt.refused,
                "peer addresses left out: past the per-frame or table cap"
            );
        }
    }

    /// Decides whether `conn` becomes the connection to `hello.name`; returns false when the
    /// connection already held wins.
    fn admit(&self, conn: &quinn::Connection, hello: &Hello, dialer: &str) -> bool {
        let addr = Self::fix_addr(hello.addr, conn);
        let mut peers = lock(&self.inner.peers);
        let old = peers.get(&hello.name);
        let held = old.map(|old| Held {
            same_connection: old.conn.stable_id() == conn.stable_id(),
            live: old.conn.close_reason().is_none(),
            dialer: &old.dialer,
        });
        match admission::join(&self.inner.name, &hello.name, dialer, held) {
            Join::AlreadyHeld => return true,
            Join::KeepHeld => return false,
            Join::Insert { close_held } => {
                if let (true, Some(old)) = (close_held, old) {
                    tracing::info!("peer `{}`: replacing a duplicate connection", hello.name);
                    old.conn.close(1u32.into(), b"duplicate");
                }
            }
        }
        tracing::info!("peer `{}` joined from {addr}", hello.name);
        if admission::control_conflict(&hello.roles, &self.inner.roles) {
            tracing::error!(
                "nodes `{}` and `{}` both have the control role; a cluster has one Control \
                 (the CLI uses the one whose node name sorts first)",
                self.inner.name,
                hello.name
            );
        }
        peers.insert(
            hello.name.clone(),
            Peer {
                name: hello.name.clone(),
                addr,
                roles: hello.roles.clone(),
                envs: hello.envs.clone(),
                conn: conn.clone(),
                dialer: dialer.to_string(),
                session_opened: None,
            },
        );
        true
    }

    /// Opens a node session stream on a connection this node dialed.
    pub(super) async fn open_session(&self, peer: &str, conn: &quinn::Connection) {
        match transport::open_tagged(conn, StreamTag::ActorSession).await {
            Ok((send, recv)) => {
                if let Some(p) = lock(&self.inner.peers).get_mut(peer) {
                    p.session_opened = Some(Instant::now());
                }
                let label = format!("{peer}@{}", conn.remote_address());
                self.start_node_session(send, recv, peer, label, false);
            }
            Err(e) => tracing::warn!("peer `{peer}`: cannot open a node session stream: {e}"),
        }
    }

    /// Hands a node session stream with admitted peer `peer` to the `NodeServer`
    /// (`is_server`: the peer opened it); its requests are stamped as `peer`'s.
    pub(super) fn start_node_session(
        &self,
        send: SendStream,
        recv: RecvStream,
        peer: &str,
        label: String,
        is_server: bool,
    ) {
        let stream = QuicBidi::new(send, recv, peer.to_string(), label, self.inner.name.clone());
        if let Err(e) = self
            .inner
            .node_server
            .cast(NodeServerMessage::ConnectionOpenedExternal {
                stream: Box::new(stream),
                is_server,
            })
        {
            tracing::error!("node server gone: {e}");
        }
    }

    /// Answers a peer's hello: a welcome with this node's hello, or a refusal with its
    /// reason (then the connection is closed).
    pub(super) async fn serve_hello(
        &self,
        conn: quinn::Connection,
        mut send: SendStream,
        mut recv: RecvStream,
    ) {
        let from = conn.remote_address();
        let hello: Hello =
            match tokio::time::timeout(STREAM_HEAD_TIMEOUT, transport::read_frame(&mut recv)).await
            {
                Ok(Ok(h)) => h,
                Ok(Err(e)) => {
                    tracing::warn!("{from}: bad hello: {e}");
                    conn.close(3u32.into(), b"bad hello");
                    return;
                }
                Err(_) => {
                    conn.close(3u32.into(), b"hello timeout");
                    return;
                }
            };
        let refuse = |reason: &str| HelloReply::Refused {
            name: self.inner.name.clone(),
            reason: reason.to_string(),
        };
        let certified = transport::peer_name(&conn);
        let verdict = lock(&self.inner.admission).hello(&hello.cluster, &hello.name, certified);
        let reply = if let Err(e) = verdict {
            match &e {
                HelloRefusal::AnotherCluster => {
                    tracing::warn!("refused `{}` from {from}: another cluster CA", hello.name)
                }
                HelloRefusal::Identity(e) => {
                    tracing::warn!("refused `{}` from {from}: {e}", hello.name)
                }
                HelloRefusal::SameName | HelloRefusal::InvalidName => {}
            }
            refuse(&e.to_string())
        } else if self.admit(&conn, &hello, &hello.name) {
            self.learn(hello.peers.iter().cloned());
            HelloReply::Welcome(self.my_hello())
        } else {
            refuse("duplicate connection")
        };
        let refused = matches!(reply, HelloReply::Refused { .. });
        if transport::write_frame(&mut send, &reply).await.is_ok() {
            let _ = send.finish();
        }
        if refused {
            // Let the reply reach the peer, then drop the connection.
            let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
            conn.close(4u32.into(), b"refused");
        }
    }

    /// Connects to `addr`, exchanges hellos, and on a welcome admits the peer, opens the node
    /// session and serves the connection.
    pub(super) async fn dial(self, addr: SocketAddr) -> Result<(), String> {
        let connecting = self
            .inner
            .endpoint
            .connect(addr, NODE_SERVER_NAME)
            .map_err(|e| e.to_string())?;
        let conn = tokio::time::timeout(STREAM_HEAD_TIMEOUT, connecting)
            .await
            .map_err(|_| "handshake timed out".to_string())?
            .map_err(|e| e.to_string())?;
        if let Some(name) = self.revoked_peer(&conn) {
            conn.close(5u32.into(), b"revoked");
            return Err(format!("`{name}` at {addr} is revoked ([tls] deny)"));
        }
        let exchange = async {
            let (mut send, mut recv) = transport::open_tagged(&conn, StreamTag::Hello)
                .await
                .map_err(|e| e.to_string())?;
            transport::write_frame(&mut send, &self.my_hello())
                .await
                .map_err(|e| e.to_string())?;
            let _ = send.finish();
            transport::read_frame::<HelloReply>(&mut recv)
                .await
                .map_err(|e| e.to_string())
        };
        let reply = tokio::time::timeout(STREAM_HEAD_TIMEOUT, exchange)
            .await
            .map_err(|_| "hello timed out".to_string())??;
        let hello = match reply {
            HelloReply::Refused { name, reason } => {
                self.set_target_name(addr, &name);
                conn.close(0u32.into(), b"refused");
                return Err(format!("`{name}` refused: {reason}"));
            }
            HelloReply::Welcome(h) => h,
        };
        if let Err(e) = admission::check_identity(&hello.name, transport::peer_name(&conn)) {
            tracing::warn!("refused `{}` at {addr}: {e}", hello.name);
            conn.close(4u32.into(), b"refused");
            return Err(format!("`{}` refused: {e}", hello.name));
        }
        self.set_target_name(addr, &hello.name);
        if !lock(&self.inner.admission).same_cluster(&hello.cluster) {
            conn.close(4u32.into(), b"another cluster");
            return Err(format!("`{}` belongs to another cluster", hello.name));
        }
        self.learn(hello.peers.iter().cloned());
        if !self.admit(&conn, &hello, &self.inner.name.clone()) {
            conn.close(1u32.into(), b"duplicate");
            return Ok(());
        }
        self.open_session(&hello.name, &conn).await;
        let node = self.clone();
        tokio::spawn(node.serve_connection(conn));
        Ok(())
    }

    fn set_target_name(&self, addr: SocketAddr, name: &str) {
        lock(&self.inner.dial).set_name(addr, name);
    }
}
