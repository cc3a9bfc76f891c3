//! A cluster node: the QUIC endpoint, the peer mesh, and the supervisor of the local actors.
//!
//! One `quinn` endpoint serves everything (mutual TLS: only certificates of the cluster CA get
//! in; refused handshakes are logged). Membership: the dialing side opens a
//! [`Hello`](crate::transport::StreamTag::Hello) stream, both sides exchange name, address,
//! roles and known peers, and both apply the same rule to keep exactly one connection per pair
//! of nodes ([`prefer_new`]). The dialer then opens an
//! [`ActorSession`](crate::transport::StreamTag::ActorSession) stream that becomes a
//! `ractor_cluster` node session (the `NodeServer`'s own TCP listener is bound to loopback
//! behind a TLS acceptor nobody holds a certificate for, so all actor traffic rides QUIC). A
//! maintenance loop dials seeds and gossiped peers by the pure policy of [`crate::dial`]
//! (capped backoff, a bounded table, learnt addresses that never answer dropped), reopens a
//! node session that `ractor_cluster` dropped, and gossips the peer list so nodes form a full
//! mesh. A connection silent for [`transport::IDLE_TIMEOUT`] is dead: its node session ends and
//! its members leave their process groups.
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
//!
//! # Tasks and actors
//!
//! ```text
//! Node::start
//! ├── NodeSupervisor (actor)                          supervisor.rs
//! │   ├── ractor_cluster NodeServer                  its loss stops the node
//! │   ├── Member `<name>/node`                        restarted
//! │   ├── Member `<name>/env.<kind>.<i>`              restarted
//! │   └── Control `<name>/control` (control role)     restarted; reloads its jobs
//! ├── accept loop (task)                              streams.rs
//! │   └── per connection: refuse revoked, then serve its streams (task)
//! │       └── per stream (task), by tag:
//! │           ├── Hello        → admit or refuse      mesh.rs (rules: admission.rs)
//! │           ├── ActorSession → the NodeServer       admitted peers only
//! │           ├── Gossip       → learn addresses      mesh.rs, admitted peers only
//! │           ├── Cli          → answer the request   cli_service.rs, blobs.rs
//! │           └── Bulk         → the bulk plane       admitted peers only
//! └── maintenance loop (task, every 250 ms)          maintenance.rs
//!     ├── dial the due addresses (crate::dial)       mesh.rs: hello, then serve it
//!     ├── every 4th tick: reopen node sessions ractor_cluster dropped
//!     └── every 8th tick: gossip the peer list to every peer
//! ```
//!
//! Every task holds a clone of the [`Node`] handle. The accept loop ends when the endpoint
//! closes, the maintenance loop when the supervisor has stopped (shutdown, a signal, the node
//! server lost, or a crash loop).
//!
//! # Method taxonomy
//!
//! This file holds the handle, its start and its plain accessors; each IO file (`tls`,
//! `streams`, `mesh`, `maintenance`, `cli_service`, `blobs`) adds one `impl Node` block for
//! its concern, and `admission` and `supervisor` hold no `Node` methods. The public methods
//! are:
//!
//! - **setup**: [`Node::start`];
//! - **queries** (no side effects): [`Node::name`], [`Node::addr`], [`Node::endpoint`],
//!   [`Node::peers`], [`Node::connection`], [`Node::bulk`], [`Node::view`];
//! - **control**: [`Node::set_denied`], [`Node::run_until_signal`], [`Node::shutdown`].
//!
//! Everything else is private and runs on the tasks above: `serve_*` methods answer a stream
//! the peer opened, `dial`/`open_session`/`gossip` open one, and the decisions they apply are
//! the pure functions of [`admission`] and [`crate::dial`], which take every fact (and the
//! time, where it matters) as an argument.

pub mod admission;
mod blobs;
mod cli_service;
mod maintenance;
mod mesh;
mod streams;
mod supervisor;
mod tls;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use ractor::{Actor, ActorRef};
use ractor_cluster::{NodeServer, NodeServerMessage};

use crate::bulk::{BulkConfig, BulkPlane};
use crate::config::{NodeConfig, Role};
use crate::control::JobValidator;
use crate::dial::DialTable;
use crate::member::{EnvSpec, MemberInfo};
use crate::pki;
use crate::transport;
use admission::MeshAdmission;
use supervisor::{spawn_child, start_node_server, Child, NodeSupervisor, SupervisorMsg};

pub use admission::prefer_new;
pub use blobs::NodeConnector;
pub use mesh::Peer;

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
    /// Environment slots this node hosts (`--env KIND:N`), offered to Control in the node's
    /// description; whoever starts the node serves them (the binary's environment hosts).
    pub envs: Vec<EnvSpec>,
}

/// The bulk plane's view of this node's peer table: the live connection to a named peer,
/// waiting briefly when the mesh is (re)connecting to it.
struct Inner {
    name: String,
    roles: Vec<Role>,
    /// The environment slots this node offers.
    envs: Vec<EnvSpec>,
    advertised: SocketAddr,
    digest: String,
    endpoint: quinn::Endpoint,
    node_server: ActorRef<NodeServerMessage>,
    peers: Arc<Mutex<HashMap<String, Peer>>>,
    /// Where this node dials (the pure policy of [`crate::dial`]).
    dial: Mutex<DialTable>,
    bulk: BulkPlane<NodeConnector>,
    /// Who may connect and join (the pure rules of [`admission`]); its revoked names are the
    /// config's `[tls] deny`.
    admission: Mutex<MeshAdmission>,
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

impl Node {
    /// Starts a node from its config: certificates, endpoint, actor runtime, local actors, the
    /// accept loop and the maintenance loop.
    pub fn start<'a>(
        config: &'a NodeConfig,
        options: NodeOptions,
    ) -> BoxFuture<'a, Result<Node, NodeError>> {
        // Boxed here, so the future's body is compiled once, in this crate: a caller in
        // another crate that awaited the `async fn` itself would compile the whole body again.
        Box::pin(Self::start_body(config, options))
    }

    async fn start_body(config: &NodeConfig, options: NodeOptions) -> Result<Node, NodeError> {
        let identity = tls::load_identity(config)?;
        if config.has_role(Role::Control) && options.validator.is_none() {
            return Err(NodeError::Invalid(
                "the control role needs a job validator".into(),
            ));
        }
        if !options.envs.is_empty() && !config.has_role(Role::Env) {
            return Err(NodeError::Invalid(format!(
                "environment slots requested but {} does not give node `{}` the `env` role",
                config.file.display(),
                config.name
            )));
        }
        tls::warn_if_misnamed(config, &identity);
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
                tls::sealed_acceptor()?,
            )),
            Some(ractor_cluster::node::NodeConnectionMode::Isolated),
        )
        .with_listen_addr(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        let node_server = start_node_server(&supervisor, server).await?;

        let peers = Arc::new(Mutex::new(HashMap::new()));
        let denied = config
            .tls
            .as_ref()
            .map(|t| t.deny.clone())
            .unwrap_or_default();
        let inner = Arc::new(Inner {
            name: config.name.clone(),
            roles: config.roles.clone(),
            envs: options.envs.clone(),
            advertised,
            admission: Mutex::new(MeshAdmission::new(&config.name, &digest, denied)),
            digest,
            endpoint,
            node_server,
            peers: peers.clone(),
            dial: Mutex::new(DialTable::new(config.seeds.iter().copied(), Instant::now())),
            bulk: BulkPlane::new(
                NodeConnector::new(peers),
                BulkConfig::new(config.name.clone()),
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
            envs: options.envs.clone(),
        })];
        if let (true, Some(v)) = (config.has_role(Role::Control), &options.validator) {
            children.push(Child::Control {
                validator: v.clone(),
                dir: config.data_dir.join("control"),
                label: format!("{}/control", config.name),
                node: config.name.clone(),
            });
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

    /// Runs until Ctrl-C or SIGTERM, then closes the endpoint and stops the local actors. On
    /// SIGHUP it re-reads the config file's `[tls] deny` list ([`Node::set_denied`]).
    pub fn run_until_signal(self) -> BoxFuture<'static, ()> {
        // Boxed, as [`Node::start`] is.
        Box::pin(self.run_until_signal_body())
    }

    async fn run_until_signal_body(self) {
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

    /// Closes every connection and stops the local actors.
    pub fn shutdown(&self) -> BoxFuture<'_, ()> {
        // Boxed, as [`Node::start`] is.
        Box::pin(self.shutdown_body())
    }

    async fn shutdown_body(&self) {
        tracing::info!("node `{}` shutting down", self.inner.name);
        self.inner.endpoint.close(0u32.into(), b"shutdown");
        self.supervisor.stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
    }
}
