//! A cluster node: the QUIC endpoint, the peer mesh, and the supervisor of the local actors.
//!
//! One `quinn` endpoint serves everything (mutual TLS: only certificates of the cluster CA get
//! in; refused handshakes are logged). Membership: the dialing side opens a
//! [`StreamTag::Hello`] stream, both sides exchange name, address, roles and known peers, and
//! both apply the same rule to keep exactly one connection per pair of nodes ([`prefer_new`]).
//! The dialer then opens a [`StreamTag::ActorSession`] stream that becomes a `ractor_cluster`
//! node session (the `NodeServer`'s own TCP listener is bound to loopback behind a TLS acceptor
//! nobody holds a certificate for, so all actor traffic rides QUIC). A maintenance loop dials
//! seeds and gossiped peers by the pure policy of [`crate::dial`] (capped backoff, a bounded
//! table, learnt addresses that never answer dropped), reopens a node session that
//! `ractor_cluster` dropped, and gossips the peer list so nodes form a full mesh. A connection
//! silent for [`transport::IDLE_TIMEOUT`] is dead: its node session ends and its members leave
//! their process groups.
//!
//! A node's name is the identity in its certificate: each side admits the other only under the
//! name its verified certificate carries, and never under a reserved name (the CLI's client
//! certificate may make CLI requests, nothing else). Node sessions, gossip and the bulk plane
//! serve admitted peers only. CLI requests name no path on the node: blob bytes come and go on
//! the CLI stream ([`crate::cli`]).
//!
//! Revocation: a certificate whose name is in the config's `[tls] deny` list is refused at
//! the handshake's end, whatever the connection is for (node, CLI). On SIGHUP a node re-reads
//! its config file and closes the connections of names newly denied ([`Node::set_denied`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn::{RecvStream, SendStream};
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use ractor_cluster::{NodeServer, NodeServerMessage};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::bulk::{BlobId, BulkConfig, BulkPlane, ConnectError, PeerConnector};
use crate::cli::{
    self, BlobReply, BlobRequest, CliReply, CliRequest, ClusterView, NodeView, PingResult,
};
use crate::config::{NodeConfig, Role};
use crate::control::{Control, ControlArgs, JobValidator};
use crate::dial::{AfterDial, DialTable};
use crate::pki::{self, Identity, NODE_SERVER_NAME};
use crate::rpc;
use crate::transport::{self, QuicBidi, StreamTag};
use crate::worker::{EnvSpec, Member, MemberInfo, MemberReply, MemberRequest};

/// How long a stream may take to send its tag byte or its first frame.
const STREAM_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Maintenance loop period.
const TICK: Duration = Duration::from_millis(250);
/// A node session missing this long after it was opened is reopened.
const SESSION_GRACE: Duration = Duration::from_secs(3);
/// The host part of every `ractor_cluster` node name (`<name>@clawrl`).
const RACTOR_HOST: &str = "clawrl";

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Certificates missing or unusable.
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    /// The QUIC endpoint could not be set up.
    #[error(transparent)]
    Endpoint(#[from] transport::EndpointError),
    /// An actor could not be spawned.
    #[error("spawning {what}: {message}")]
    Spawn {
        /// Which actor.
        what: String,
        /// The error.
        message: String,
    },
    /// Options contradict the config.
    #[error("{0}")]
    Invalid(String),
}

/// Extra behaviour the binary gives a node.
#[derive(Clone, Default)]
pub struct NodeOptions {
    /// Validates job specs for the Control actor (required when the node has `control`).
    pub validator: Option<Arc<dyn JobValidator>>,
    /// Environment workers to run on this node (`--env KIND:N`).
    pub envs: Vec<EnvSpec>,
}

/// The bulk plane's view of this node's peer table: the live connection to a named peer,
/// waiting briefly when the mesh is (re)connecting to it.
#[derive(Clone)]
pub struct NodeConnector {
    peers: Arc<Mutex<HashMap<String, Peer>>>,
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

/// A connected peer.
#[derive(Clone, Debug)]
pub struct Peer {
    /// The peer's node name.
    pub name: String,
    /// Its advertised address.
    pub addr: SocketAddr,
    /// Its roles.
    pub roles: Vec<Role>,
    /// The one QUIC connection to it.
    pub conn: quinn::Connection,
    /// Which node dialed this connection.
    pub dialer: String,
    /// When this side last opened a node session on it (dialer side only).
    session_opened: Option<Instant>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Hello {
    cluster: String,
    name: String,
    addr: SocketAddr,
    roles: Vec<Role>,
    peers: Vec<(String, SocketAddr)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum HelloReply {
    Welcome(Hello),
    Refused { name: String, reason: String },
}

/// Why a peer may not be admitted under the name its hello claims.
#[derive(Debug, thiserror::Error)]
enum IdentityError {
    /// Its certificate carries no usable name.
    #[error("it claims to be `{claimed}` but its certificate names no node: {source}")]
    Unnamed {
        /// The name in the hello.
        claimed: String,
        /// Why no name was read.
        source: pki::CertNameError,
    },
    /// Its certificate names another node.
    #[error("it claims to be `{claimed}` but its certificate names `{certified}`")]
    Mismatch {
        /// The name in the hello.
        claimed: String,
        /// The name in its certificate.
        certified: String,
    },
    /// The name is reserved, as the CLI's client certificate's is.
    #[error("`{0}` is a reserved name (the CLI's client certificate may not join as a node)")]
    Reserved(String),
}

/// Checks that the peer of `conn` may be node `claimed`: the name in its certificate (verified
/// against the cluster CA by the handshake) must be `claimed`, and not a reserved one.
fn check_identity(conn: &quinn::Connection, claimed: &str) -> Result<(), IdentityError> {
    let certified = transport::peer_name(conn).map_err(|source| IdentityError::Unnamed {
        claimed: claimed.to_string(),
        source,
    })?;
    if certified != claimed {
        return Err(IdentityError::Mismatch {
            claimed: claimed.to_string(),
            certified,
        });
    }
    if pki::is_reserved_name(claimed) {
        return Err(IdentityError::Reserved(certified));
    }
    Ok(())
}

/// Whether a new connection to a peer replaces the one already held. Both ends compute the
/// same answer: the connection dialed by the node whose name sorts first wins; between two
/// dialed by the same node, the newer wins (the older is a leftover of a restart).
pub fn prefer_new(me: &str, peer: &str, new_dialer: &str, old_dialer: &str) -> bool {
    let canonical = if me <= peer { me } else { peer };
    let (new_c, old_c) = (new_dialer == canonical, old_dialer == canonical);
    if new_c != old_c {
        new_c
    } else {
        true
    }
}

struct Inner {
    name: String,
    roles: Vec<Role>,
    advertised: SocketAddr,
    digest: String,
    endpoint: quinn::Endpoint,
    node_server: ActorRef<NodeServerMessage>,
    peers: Arc<Mutex<HashMap<String, Peer>>>,
    /// Where this node dials (the pure policy of [`crate::dial`]).
    dial: Mutex<DialTable>,
    bulk: BulkPlane<NodeConnector>,
    /// Revoked names (`[tls] deny`).
    denied: Mutex<BTreeSet<String>>,
    /// The config file, re-read on SIGHUP.
    config_file: std::path::PathBuf,
}

/// A running node. Cloning gives another handle to the same node.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
    supervisor: ActorRef<SupervisorMsg>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A TLS acceptor for the `NodeServer`'s TCP listener that no client can pass: it requires a
/// client certificate from a CA whose key is thrown away at once.
fn sealed_acceptor() -> Result<tokio_rustls::TlsAcceptor, pki::PkiError> {
    let ca = pki::Ca::generate()?;
    let (cert, key) = ca.issue("sealed")?;
    use rustls::pki_types::pem::PemObject;
    let pem = |s: &str| {
        rustls::pki_types::CertificateDer::from_pem_slice(s.as_bytes()).map_err(|e| {
            pki::PkiError::Pem {
                path: "<memory>".into(),
                message: e.to_string(),
            }
        })
    };
    let id = Identity {
        ca: pem(&ca.cert_pem())?,
        cert: pem(&cert)?,
        key: rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| {
            pki::PkiError::Pem {
                path: "<memory>".into(),
                message: e.to_string(),
            }
        })?,
    };
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(
        id.server_config(&[])?,
    )))
}

impl Node {
    /// Starts a node from its config: certificates, endpoint, actor runtime, local actors, the
    /// accept loop and the maintenance loop.
    pub async fn start(config: &NodeConfig, options: NodeOptions) -> Result<Node, NodeError> {
        let identity = match &config.tls {
            Some(t) => Identity::load(&t.ca, &t.cert, &t.key)?,
            None => {
                let (id, created) = pki::ephemeral_identity(&config.data_dir, &config.name)?;
                let dir = pki::ephemeral_dir(&config.data_dir);
                if created {
                    tracing::warn!(
                        "no [tls] in {}: created an EPHEMERAL cluster CA in {} (single-machine use only)",
                        config.file.display(),
                        dir.display()
                    );
                } else {
                    tracing::warn!(
                        "no [tls] in {}: using the EPHEMERAL cluster CA in {} (single-machine use only)",
                        config.file.display(),
                        dir.display()
                    );
                }
                id
            }
        };
        if config.has_role(Role::Control) && options.validator.is_none() {
            return Err(NodeError::Invalid(
                "the control role needs a job validator".into(),
            ));
        }
        if !options.envs.is_empty() && !config.has_role(Role::Env) {
            return Err(NodeError::Invalid(format!(
                "environment workers requested but {} does not give node `{}` the `env` role",
                config.file.display(),
                config.name
            )));
        }
        match pki::certificate_name(&identity.cert) {
            Ok(n) if n == config.name => {}
            Ok(n) => tracing::warn!(
                "node `{}`: its certificate names `{n}`; peers will refuse it under the name `{}`",
                config.name,
                config.name
            ),
            Err(e) => tracing::warn!(
                "node `{}`: its certificate names no node ({e}); peers will refuse it",
                config.name
            ),
        }
        let endpoint = transport::endpoint(&identity, config.listen, true)?;
        let local = endpoint
            .local_addr()
            .map_err(|e| NodeError::Invalid(format!("endpoint address: {e}")))?;
        let advertised = SocketAddr::new(config.listen.ip(), local.port());
        let digest = identity.cluster_digest();

        let (supervisor, _) = Actor::spawn(
            Some(format!("{}/supervisor", config.name)),
            NodeSupervisor,
            (),
        )
        .await
        .map_err(|e| NodeError::Spawn {
            what: "node supervisor".into(),
            message: e.to_string(),
        })?;
        let server = NodeServer::new(
            0,
            digest.clone(),
            config.name.clone(),
            RACTOR_HOST.into(),
            Some(ractor_cluster::IncomingEncryptionMode::Tls(
                sealed_acceptor()?,
            )),
            Some(ractor_cluster::node::NodeConnectionMode::Isolated),
        )
        .with_listen_addr(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        // The supervisor spawns the node server itself (see [`SupervisorMsg`]).
        let node_server = match supervisor
            .call(
                |reply| SupervisorMsg::StartNodeServer(Box::new(server), reply),
                None,
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r?,
            Ok(_) => {
                return Err(NodeError::Spawn {
                    what: "ractor_cluster node server".into(),
                    message: "the node supervisor did not answer".into(),
                })
            }
            Err(e) => {
                return Err(NodeError::Spawn {
                    what: "ractor_cluster node server".into(),
                    message: format!("node supervisor: {e}"),
                })
            }
        };

        let peers = Arc::new(Mutex::new(HashMap::new()));
        let inner = Arc::new(Inner {
            name: config.name.clone(),
            roles: config.roles.clone(),
            advertised,
            digest,
            endpoint,
            node_server,
            peers: peers.clone(),
            dial: Mutex::new(DialTable::new(config.seeds.iter().copied(), Instant::now())),
            bulk: BulkPlane::new(
                NodeConnector { peers },
                BulkConfig::new(config.name.clone()),
            ),
            denied: Mutex::new(
                config
                    .tls
                    .as_ref()
                    .map(|t| t.deny.iter().cloned().collect())
                    .unwrap_or_default(),
            ),
            config_file: config.file.clone(),
        });

        // Local actors.
        let mut children = vec![Child::Member(MemberInfo {
            node: config.name.clone(),
            label: format!("{}/node", config.name),
            group: crate::groups::NODES.into(),
            addr: advertised,
            roles: config.roles.clone(),
        })];
        if let (true, Some(v)) = (config.has_role(Role::Control), &options.validator) {
            children.push(Child::Control {
                validator: v.clone(),
                dir: config.data_dir.join("control"),
                label: format!("{}/control", config.name),
            });
        }
        for e in &options.envs {
            for i in 0..e.count {
                children.push(Child::Member(MemberInfo {
                    node: config.name.clone(),
                    label: format!("{}/env.{}.{}", config.name, e.kind, i),
                    group: crate::groups::env(&e.kind),
                    addr: advertised,
                    roles: Vec::new(),
                }));
            }
        }
        for c in children {
            spawn_child(&supervisor, c).await?;
        }

        let node = Node { inner, supervisor };
        tokio::spawn(node.clone().accept_loop());
        tokio::spawn(node.clone().maintenance_loop());
        tracing::info!(
            "node `{}` listening on {} (QUIC, ALPN clawrl/1), roles [{}]",
            config.name,
            local,
            config
                .roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(node)
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The address this node advertises to peers.
    pub fn addr(&self) -> SocketAddr {
        self.inner.advertised
    }

    /// The node's QUIC endpoint (for planes that open their own streams).
    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.inner.endpoint
    }

    /// The connected peers, by name.
    pub fn peers(&self) -> BTreeMap<String, Peer> {
        lock(&self.inner.peers)
            .iter()
            .filter(|(_, p)| p.conn.close_reason().is_none())
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// The live QUIC connection to peer `name`, if any.
    pub fn connection(&self, name: &str) -> Option<quinn::Connection> {
        lock(&self.inner.peers)
            .get(name)
            .filter(|p| p.conn.close_reason().is_none())
            .map(|p| p.conn.clone())
    }

    /// This node's bulk plane (blobs move between nodes on their own QUIC streams).
    pub fn bulk(&self) -> &BulkPlane<NodeConnector> {
        &self.inner.bulk
    }

    /// The cluster as this node sees it.
    pub fn view(&self) -> ClusterView {
        let mut nodes = vec![NodeView {
            name: self.inner.name.clone(),
            addr: self.inner.advertised.to_string(),
            roles: self.inner.roles.iter().map(|r| r.as_str().into()).collect(),
        }];
        for p in self.peers().into_values() {
            nodes.push(NodeView {
                name: p.name,
                addr: p.addr.to_string(),
                roles: p.roles.iter().map(|r| r.as_str().into()).collect(),
            });
        }
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        let mut groups = BTreeMap::new();
        for g in ractor::pg::which_groups() {
            if !g.starts_with(crate::groups::PREFIX) {
                continue;
            }
            let mut members: Vec<String> = ractor::pg::get_members(&g)
                .iter()
                .map(rpc::actor_label)
                .collect();
            if members.is_empty() {
                continue;
            }
            members.sort();
            groups.insert(g, members);
        }
        ClusterView { nodes, groups }
    }

    /// Runs until Ctrl-C or SIGTERM, then closes the endpoint and stops the local actors. On
    /// SIGHUP it re-reads the config file's `[tls] deny` list ([`Node::set_denied`]).
    pub async fn run_until_signal(self) {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match (
                signal(SignalKind::terminate()),
                signal(SignalKind::hangup()),
            ) {
                (Ok(mut term), Ok(mut hup)) => loop {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => break,
                        _ = term.recv() => break,
                        _ = hup.recv() => self.reload_denied(),
                        _ = self.supervisor.wait(None) => break,
                    }
                },
                _ => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = self.supervisor.wait(None) => {}
                    }
                }
            }
        }
        #[cfg(not(unix))]
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = self.supervisor.wait(None) => {}
        }
        self.shutdown().await;
    }

    /// Re-reads the config file and applies its `[tls] deny` list; a file that no longer
    /// parses leaves the current list in force.
    fn reload_denied(&self) {
        let file = &self.inner.config_file;
        match NodeConfig::load(file) {
            Ok(c) => {
                let deny = c.tls.map(|t| t.deny).unwrap_or_default();
                tracing::info!("SIGHUP: reloaded {}: deny {:?}", file.display(), deny);
                self.set_denied(deny);
            }
            Err(e) => tracing::error!(
                "SIGHUP: {} does not load ({e}); the deny list in force is kept",
                file.display()
            ),
        }
    }

    /// Replaces the revoked names and closes the connections of the peers now revoked (their
    /// node sessions end and their members leave their groups).
    pub fn set_denied(&self, names: impl IntoIterator<Item = String>) {
        let denied: BTreeSet<String> = names.into_iter().collect();
        let revoked: Vec<(String, quinn::Connection)> = lock(&self.inner.peers)
            .iter()
            .filter(|(n, _)| denied.contains(*n))
            .map(|(n, p)| (n.clone(), p.conn.clone()))
            .collect();
        *lock(&self.inner.denied) = denied;
        for (name, conn) in revoked {
            tracing::warn!("peer `{name}` is revoked ([tls] deny): closing its connection");
            conn.close(5u32.into(), b"revoked");
        }
    }

    /// The revoked name the certificate of `conn`'s peer carries, if it is revoked.
    fn revoked_peer(&self, conn: &quinn::Connection) -> Option<String> {
        let name = transport::peer_name(conn).ok()?;
        lock(&self.inner.denied).contains(&name).then_some(name)
    }

    /// Closes every connection and stops the local actors.
    pub async fn shutdown(&self) {
        tracing::info!("node `{}` shutting down", self.inner.name);
        self.inner.endpoint.close(0u32.into(), b"shutdown");
        self.supervisor.stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
    }

    fn my_hello(&self) -> Hello {
        Hello {
            cluster: self.inner.digest.clone(),
            name: self.inner.name.clone(),
            addr: self.inner.advertised,
            roles: self.inner.roles.clone(),
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

    fn learn(&self, addrs: impl IntoIterator<Item = (String, SocketAddr)>) {
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
        if let Some(old) = peers.get(&hello.name) {
            if old.conn.stable_id() == conn.stable_id() {
                return true;
            }
            if old.conn.close_reason().is_none()
                && !prefer_new(&self.inner.name, &hello.name, dialer, &old.dialer)
            {
                return false;
            }
            if old.conn.close_reason().is_none() {
                tracing::info!("peer `{}`: replacing a duplicate connection", hello.name);
                old.conn.close(1u32.into(), b"duplicate");
            }
        }
        tracing::info!("peer `{}` joined from {addr}", hello.name);
        if hello.roles.contains(&Role::Control) && self.inner.roles.contains(&Role::Control) {
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
                conn: conn.clone(),
                dialer: dialer.to_string(),
                session_opened: None,
            },
        );
        true
    }

    /// Opens a node session stream on a connection this node dialed.
    async fn open_session(&self, peer: &str, conn: &quinn::Connection) {
        match transport::open_tagged(conn, StreamTag::ActorSession).await {
            Ok((send, recv)) => {
                if let Some(p) = lock(&self.inner.peers).get_mut(peer) {
                    p.session_opened = Some(Instant::now());
                }
                let stream = QuicBidi::new(
                    send,
                    recv,
                    format!("{peer}@{}", conn.remote_address()),
                    self.inner.name.clone(),
                );
                if let Err(e) =
                    self.inner
                        .node_server
                        .cast(NodeServerMessage::ConnectionOpenedExternal {
                            stream: Box::new(stream),
                            is_server: false,
                        })
                {
                    tracing::error!("node server gone: {e}");
                }
            }
            Err(e) => tracing::warn!("peer `{peer}`: cannot open a node session stream: {e}"),
        }
    }

    async fn accept_loop(self) {
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
    async fn serve_connection(self, conn: quinn::Connection) {
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
        match StreamTag::from_byte(tag[0]) {
            Some(StreamTag::Hello) => self.serve_hello(conn, send, recv).await,
            Some(StreamTag::ActorSession) => {
                let Some(peer) = self.admitted_name(&conn) else {
                    tracing::warn!("{from}: node session stream before hello; refused");
                    return;
                };
                let stream = QuicBidi::new(
                    send,
                    recv,
                    format!("{peer}@{from}"),
                    self.inner.name.clone(),
                );
                if let Err(e) =
                    self.inner
                        .node_server
                        .cast(NodeServerMessage::ConnectionOpenedExternal {
                            stream: Box::new(stream),
                            is_server: true,
                        })
                {
                    tracing::error!("node server gone: {e}");
                }
            }
            Some(StreamTag::Gossip) => {
                if self.admitted_name(&conn).is_none() {
                    return;
                }
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
            Some(StreamTag::Cli) => self.serve_cli(from, send, recv).await,
            Some(StreamTag::Bulk) => {
                // Blobs are served to admitted nodes only: a connection that has not completed
                // the hello (the CLI's, or a refused one) has no node identity.
                let Some(peer) = self.admitted_name(&conn) else {
                    tracing::warn!("{from}: bulk stream before hello; refused");
                    refuse_stream(send, recv);
                    return;
                };
                if let Err(e) = self.inner.bulk.serve_stream(send, recv).await {
                    tracing::warn!("bulk stream from `{peer}` ({from}): {e}");
                }
            }
            None => tracing::warn!("{from}: unknown stream tag {:#04x}; stream dropped", tag[0]),
        }
    }

    /// The name of the admitted peer whose connection `conn` is, if any.
    fn admitted_name(&self, conn: &quinn::Connection) -> Option<String> {
        lock(&self.inner.peers)
            .values()
            .find(|p| p.conn.stable_id() == conn.stable_id())
            .map(|p| p.name.clone())
    }

    async fn serve_hello(
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
        let reply = if hello.cluster != self.inner.digest {
            tracing::warn!("refused `{}` from {from}: another cluster CA", hello.name);
            refuse("another cluster")
        } else if hello.name == self.inner.name {
            refuse("same name as this node")
        } else if !crate::config::valid_node_name(&hello.name) {
            refuse("invalid node name")
        } else if let Err(e) = check_identity(&conn, &hello.name) {
            tracing::warn!("refused `{}` from {from}: {e}", hello.name);
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

    async fn serve_cli(&self, from: SocketAddr, mut send: SendStream, mut recv: RecvStream) {
        let req: CliRequest =
            match tokio::time::timeout(STREAM_HEAD_TIMEOUT, transport::read_frame(&mut recv)).await
            {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    tracing::warn!("{from}: bad CLI request: {e}");
                    return;
                }
                Err(_) => return,
            };
        let reply = match req {
            CliRequest::Nodes => CliReply::Nodes(self.view()),
            CliRequest::Ping => CliReply::Ping(self.ping_all().await),
            CliRequest::Blob(BlobRequest::Publish { len }) => {
                self.receive_blob(from, len, &mut recv).await
            }
            CliRequest::Blob(BlobRequest::Save { id }) => match self.held_blob(&id) {
                Ok(data) => return self.send_blob(from, send, data).await,
                Err(e) => CliReply::Error(e),
            },
            CliRequest::Blob(BlobRequest::Broadcast { id, targets }) => {
                match self.broadcast_blob(&id, &targets).await {
                    Ok(r) => CliReply::Blob(r),
                    Err(e) => CliReply::Error(e),
                }
            }
            CliRequest::Control(c) => {
                let mut members = ractor::pg::get_members(&crate::groups::CONTROL.to_string());
                members.sort_by_key(rpc::actor_label);
                if members.len() > 1 {
                    tracing::warn!(
                        "{} Control actors in the cluster; using {}",
                        members.len(),
                        rpc::actor_label(&members[0])
                    );
                }
                match members.first() {
                    None => CliReply::Error(
                        "no Control actor in the cluster (no node with the `control` role is connected)".into(),
                    ),
                    Some(ctl) => match rpc::call(ctl, &c, Duration::from_secs(20)).await {
                        Ok(r) => CliReply::Control(r),
                        Err(e) => CliReply::Error(e.to_string()),
                    },
                }
            }
        };
        if let Err(e) = transport::write_frame(&mut send, &reply).await {
            tracing::warn!("{from}: cannot answer CLI request: {e}");
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    }

    /// `blob publish`: the CLI's file arrives as the body after its request, in pieces, and
    /// becomes a blob. The body is bounded by the bulk plane's `max_blob` and by its declared
    /// length (the buffer grows as bytes arrive, so a declared length alone reserves nothing).
    async fn receive_blob(&self, from: SocketAddr, len: u64, recv: &mut RecvStream) -> CliReply {
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
    fn held_blob(&self, id: &str) -> Result<bytes::Bytes, String> {
        let id = id.parse::<BlobId>().map_err(|e| e.to_string())?;
        self.inner
            .bulk
            .get(&id)
            .ok_or_else(|| format!("blob {id} is not held by node `{}`", self.inner.name))
    }

    /// `blob save`: answers [`BlobReply::Bytes`], then sends the blob as the body; the CLI
    /// writes the file on its own machine.
    async fn send_blob(&self, from: SocketAddr, mut send: SendStream, data: bytes::Bytes) {
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

    async fn broadcast_blob(&self, id: &str, targets: &[String]) -> Result<BlobReply, String> {
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

    /// Pings every node member and environment worker, concurrently.
    async fn ping_all(&self) -> Vec<PingResult> {
        let mut set = tokio::task::JoinSet::new();
        let mut n = 0u64;
        // Only the groups of generic members answer `MemberRequest`; Control, the rollout
        // hosts and the environment hosts speak their own protocols.
        for g in ractor::pg::which_groups() {
            if g != crate::groups::NODES && !g.starts_with(crate::groups::ENV_PREFIX) {
                continue;
            }
            for m in ractor::pg::get_members(&g) {
                n += 1;
                let g = g.clone();
                let nonce = n ^ 0x5eed_0000_0000;
                set.spawn(async move {
                    let t = Instant::now();
                    let r: Result<MemberReply, _> =
                        rpc::call(&m, &MemberRequest::Ping(nonce), Duration::from_secs(3)).await;
                    let member = rpc::actor_label(&m);
                    let (ok, detail) = match r {
                        Ok(MemberReply::Pong(x)) if x == nonce => {
                            (true, format!("{}", t.elapsed().as_micros()))
                        }
                        Ok(other) => (false, format!("unexpected reply {other:?}")),
                        Err(e) => (false, e.to_string()),
                    };
                    PingResult {
                        group: g,
                        member,
                        ok,
                        detail,
                    }
                });
            }
        }
        let mut out = Vec::new();
        while let Some(r) = set.join_next().await {
            if let Ok(r) = r {
                out.push(r);
            }
        }
        out.sort_by(|a, b| (&a.group, &a.member).cmp(&(&b.group, &b.member)));
        out
    }

    async fn dial(self, addr: SocketAddr) -> Result<(), String> {
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
        if let Err(e) = check_identity(&conn, &hello.name) {
            tracing::warn!("refused `{}` at {addr}: {e}", hello.name);
            conn.close(4u32.into(), b"refused");
            return Err(format!("`{}` refused: {e}", hello.name));
        }
        self.set_target_name(addr, &hello.name);
        if hello.cluster != self.inner.digest {
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

    async fn maintenance_loop(self) {
        let mut tick: u64 = 0;
        let mut interval = tokio::time::interval(TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if self.supervisor.get_status() == ractor::ActorStatus::Stopped {
                return;
            }
            tick += 1;
            self.dial_targets();
            if tick.is_multiple_of(4) {
                self.check_sessions().await;
            }
            if tick.is_multiple_of(8) {
                self.gossip();
            }
        }
    }

    fn dial_targets(&self) {
        let peers = self.peers();
        let live_addrs: Vec<SocketAddr> = peers.values().map(|p| p.addr).collect();
        let me = &self.inner.name;
        let due = lock(&self.inner.dial).due(Instant::now(), |addr, name| {
            name.is_some_and(|n| n == me || peers.contains_key(n))
                || live_addrs.contains(addr)
                || *addr == self.inner.advertised
        });
        for addr in due {
            let node = self.clone();
            tokio::spawn(async move {
                let r = node.clone().dial(addr).await;
                let after = lock(&node.inner.dial).dialed(addr, r.is_ok(), Instant::now());
                match (r, after) {
                    (Err(e), AfterDial::Retry(b)) => {
                        tracing::debug!("dial {addr}: {e}; retry in {b:?}")
                    }
                    (Err(e), AfterDial::Pruned) => {
                        tracing::info!(
                            "dial {addr}: {e}; a learnt address that never answers, dropped"
                        )
                    }
                    _ => {}
                }
            });
        }
    }

    /// Reopens node sessions that `ractor_cluster` dropped on connections this node dialed.
    async fn check_sessions(&self) {
        let sessions = match self
            .inner
            .node_server
            .call(NodeServerMessage::GetSessions, Some(Duration::from_secs(2)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(s)) => s,
            _ => return,
        };
        let live: Vec<String> = sessions
            .values()
            .filter_map(|s| s.peer_name.as_ref())
            .filter_map(|n| {
                n.name
                    .strip_suffix(&format!("@{RACTOR_HOST}"))
                    .map(String::from)
            })
            .collect();
        let stale: Vec<(String, quinn::Connection)> = lock(&self.inner.peers)
            .values()
            .filter(|p| {
                p.dialer == self.inner.name
                    && p.conn.close_reason().is_none()
                    && !live.contains(&p.name)
                    && p.session_opened.is_none_or(|t| t.elapsed() > SESSION_GRACE)
            })
            .map(|p| (p.name.clone(), p.conn.clone()))
            .collect();
        for (name, conn) in stale {
            tracing::info!("peer `{name}`: no node session; opening one");
            self.open_session(&name, &conn).await;
        }
    }

    fn gossip(&self) {
        let mut list: Vec<(String, SocketAddr)> = self
            .peers()
            .into_values()
            .map(|p| (p.name, p.addr))
            .collect();
        list.push((self.inner.name.clone(), self.inner.advertised));
        for p in self.peers().into_values() {
            let list = list.clone();
            tokio::spawn(async move {
                if let Ok((mut send, _recv)) =
                    transport::open_tagged(&p.conn, StreamTag::Gossip).await
                {
                    if transport::write_frame(&mut send, &list).await.is_ok() {
                        let _ = send.finish();
                    }
                }
            });
        }
    }
}

/// Error code of a stream refused before its conversation starts.
const STREAM_REFUSED: quinn::VarInt = quinn::VarInt::from_u32(1);

/// Refuses a stream: resets our side and asks the peer to stop sending.
fn refuse_stream(mut send: SendStream, mut recv: RecvStream) {
    let _ = send.reset(STREAM_REFUSED);
    let _ = recv.stop(STREAM_REFUSED);
}

/// What the node supervisor restarts, and how.
#[derive(Clone)]
enum Child {
    /// The `ractor_cluster` node server: without it there is no actor traffic, so its loss
    /// stops the node.
    NodeServer,
    /// A group member (the node's own, or an environment worker): restarted.
    Member(MemberInfo),
    /// The Control actor: restarted; it reloads its jobs from disk.
    Control {
        validator: Arc<dyn JobValidator>,
        dir: std::path::PathBuf,
        label: String,
    },
}

impl Child {
    fn label(&self) -> String {
        match self {
            Child::NodeServer => "node server".into(),
            Child::Member(m) => m.label.clone(),
            Child::Control { label, .. } => label.clone(),
        }
    }
}

/// Messages of the node supervisor.
///
/// Children are spawned *by the supervisor itself*, inside its own handler, and entered in its
/// child map before the handler returns. A child's supervision events can therefore never be
/// handled before the supervisor knows the child (ractor delivers supervision events on a port
/// separate from, and polled ahead of, ordinary messages, so an "adopt after spawn" message
/// could lose that race and leave a killed child unrestarted).
enum SupervisorMsg {
    /// Spawn the `ractor_cluster` node server linked to the supervisor and watch it.
    StartNodeServer(
        Box<NodeServer>,
        ractor::RpcReplyPort<Result<ActorRef<NodeServerMessage>, NodeError>>,
    ),
    /// Spawn a child linked to the supervisor and watch it.
    Start(Child, ractor::RpcReplyPort<Result<(), NodeError>>),
    /// Try again to restart a child whose restart failed.
    Restart(Child, String),
}

impl ractor::Message for SupervisorMsg {}

/// The root of a node's local actors; decides what each child's failure means (see [`Child`]).
struct NodeSupervisor;

struct SupervisorState {
    children: HashMap<ActorId, Child>,
    /// Restart times of recent failures, to give up on a crash loop.
    restarts: Vec<Instant>,
}

const RESTART_WINDOW: Duration = Duration::from_secs(10);
const MAX_RESTARTS: usize = 20;
/// Delay before a failed restart is tried again (each try counts towards [`MAX_RESTARTS`]).
const RESTART_RETRY: Duration = Duration::from_millis(250);

async fn spawn_child(supervisor: &ActorRef<SupervisorMsg>, c: Child) -> Result<(), NodeError> {
    let label = c.label();
    match supervisor
        .call(|reply| SupervisorMsg::Start(c, reply), None)
        .await
    {
        Ok(ractor::rpc::CallResult::Success(r)) => r,
        Ok(_) => Err(NodeError::Spawn {
            what: label,
            message: "the node supervisor did not answer".into(),
        }),
        Err(e) => Err(NodeError::Spawn {
            what: label,
            message: format!("node supervisor: {e}"),
        }),
    }
}

async fn start_child(sup: ActorCell, c: &Child) -> Result<ActorCell, NodeError> {
    let err = |e: ractor::SpawnErr| NodeError::Spawn {
        what: c.label(),
        message: e.to_string(),
    };
    match c {
        Child::NodeServer => Err(NodeError::Invalid(
            "the node server is not restartable".into(),
        )),
        Child::Member(info) => {
            let (a, _) = Actor::spawn_linked(Some(info.label.clone()), Member, info.clone(), sup)
                .await
                .map_err(err)?;
            Ok(a.get_cell())
        }
        Child::Control {
            validator,
            dir,
            label,
        } => {
            let (a, _) = Actor::spawn_linked(
                Some(label.clone()),
                Control,
                ControlArgs {
                    validator: validator.clone(),
                    dir: dir.clone(),
                    label: label.clone(),
                },
                sup,
            )
            .await
            .map_err(err)?;
            Ok(a.get_cell())
        }
    }
}

impl NodeSupervisor {
    /// Restarts `child` (which `why` failed), unless the node is in a crash loop. A failed
    /// restart is tried again after [`RESTART_RETRY`] through the mailbox, so the supervisor
    /// keeps handling other children meanwhile.
    async fn restart(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        child: Child,
        why: String,
        state: &mut SupervisorState,
    ) {
        let now = Instant::now();
        state
            .restarts
            .retain(|t| now.duration_since(*t) < RESTART_WINDOW);
        if state.restarts.len() >= MAX_RESTARTS {
            tracing::error!(
                "{} {why}; {MAX_RESTARTS} restarts within {RESTART_WINDOW:?}: stopping the node",
                child.label()
            );
            myself.stop(Some("crash loop".into()));
            return;
        }
        state.restarts.push(now);
        tracing::warn!("{} {why}; restarting it", child.label());
        match start_child(myself.get_cell(), &child).await {
            Ok(new) => {
                state.children.insert(new.get_id(), child);
            }
            Err(e) => {
                tracing::warn!(
                    "restarting {} failed: {e}; retrying in {RESTART_RETRY:?}",
                    child.label()
                );
                let why = format!("could not be restarted ({e})");
                myself.send_after(RESTART_RETRY, move || SupervisorMsg::Restart(child, why));
            }
        }
    }
}

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        _: (),
    ) -> Result<SupervisorState, ActorProcessingErr> {
        Ok(SupervisorState {
            children: HashMap::new(),
            restarts: Vec::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::StartNodeServer(server, reply) => {
                let r = Actor::spawn_linked(None, *server, (), myself.get_cell())
                    .await
                    .map(|(a, _)| {
                        state.children.insert(a.get_id(), Child::NodeServer);
                        a
                    })
                    .map_err(|e| NodeError::Spawn {
                        what: "ractor_cluster node server".into(),
                        message: e.to_string(),
                    });
                let _ = reply.send(r);
            }
            SupervisorMsg::Start(child, reply) => {
                let r = start_child(myself.get_cell(), &child).await.map(|cell| {
                    state.children.insert(cell.get_id(), child);
                });
                let _ = reply.send(r);
            }
            SupervisorMsg::Restart(child, why) => {
                if myself.get_status() == ractor::ActorStatus::Running {
                    self.restart(&myself, child, why, state).await;
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        evt: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match evt {
            SupervisionEvent::ActorFailed(cell, e) => (cell, format!("failed: {e}")),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, format!("stopped ({})", reason.unwrap_or_default()))
            }
            // Children starting and group changes need no decision.
            SupervisionEvent::ActorStarted(_)
            | SupervisionEvent::ProcessGroupChanged(_)
            | SupervisionEvent::PidLifecycleEvent(_) => return Ok(()),
        };
        // Every linked child entered the map in the same handler that spawned it, so an
        // unknown id is not ours (or already handled): nothing to decide.
        let Some(child) = state.children.remove(&cell.get_id()) else {
            return Ok(());
        };
        if myself.get_status() != ractor::ActorStatus::Running {
            return Ok(());
        }
        if let Child::NodeServer = child {
            tracing::error!("the ractor_cluster node server {why}; stopping the node");
            myself.stop(Some("node server lost".into()));
            return Ok(());
        }
        // The old actor left the registry and its groups when it began stopping, before this
        // event was sent, so its name is free for the new one.
        self.restart(&myself, child, why, state).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_keep_the_same_connection() {
        // a < b: the connection dialed by a wins on both ends, whichever arrives first.
        assert!(prefer_new("a", "b", "a", "b"));
        assert!(!prefer_new("a", "b", "b", "a"));
        assert!(prefer_new("b", "a", "a", "b"));
        assert!(!prefer_new("b", "a", "b", "a"));
        // Same dialer (a restart): the newer wins.
        assert!(prefer_new("a", "b", "b", "b"));
        assert!(prefer_new("b", "a", "b", "b"));
    }
}
