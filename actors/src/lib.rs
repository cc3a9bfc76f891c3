//! clawrl-actors: the actor system and QUIC cluster runtime. It knows no LLM.
//!
//! A process runs one [`node::Node`]: a `quinn` endpoint with mutual TLS ([`pki`],
//! [`transport`]) that carries `ractor_cluster` node sessions on QUIC streams, keeps a full mesh
//! with its peers, and supervises the local actors its roles call for ([`control::Control`],
//! the node's [`member::Member`]). Its configuration is [`config::NodeConfig`]; the CLI talks to
//! a node through [`cli`].

pub mod authority;
pub mod bulk;
pub mod cli;
pub mod config;
pub mod control;
pub mod dial;
pub mod loops;
pub mod member;
pub mod node;
pub mod pki;
pub mod rpc;
pub mod stamp;
pub mod transport;

/// Names of the process groups clawrl uses for discovery.
pub mod groups {
    /// One member per node, describing it (name, address, roles).
    pub const NODES: &str = "clawrl.nodes";
    /// The cluster's Control actor.
    pub const CONTROL: &str = "clawrl.control";
    /// Rollout (policy serving) workers.
    pub const ROLLOUT: &str = "clawrl.rollout";
    /// Judge workers.
    pub const JUDGE: &str = "clawrl.judge";
    /// Prefix of every clawrl group.
    pub const PREFIX: &str = "clawrl.";
}
