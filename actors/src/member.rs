//! Node members: the actors other nodes discover through ractor process groups.
//!
//! Every node runs one member in [`crate::groups::NODES`] describing itself: name, address,
//! roles, and the environment capacity it hosts. A node started with `--env KIND:N` (or
//! `clawrl attach`) offers N environment slots of KIND, which the node's environment host serves
//! (that host lives in the binary that runs episodes); Control places jobs on those slots
//! ([`crate::control`]), and a slot is a name, `<node>/env.<KIND>.<i>`, not an actor.

use std::net::SocketAddr;
use std::str::FromStr;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::{Deserialize, Serialize};

use crate::config::Role;
use crate::rpc::{self, Rpc};

/// A request to a group member.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum MemberRequest {
    /// Say who you are.
    Describe,
    /// Echo the nonce (a liveness / round-trip check).
    Ping(u64),
}

/// A group member's reply.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum MemberReply {
    /// The member's description.
    Info(MemberInfo),
    /// The echoed nonce.
    Pong(u64),
}

/// What a group member says about itself.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemberInfo {
    /// The node it runs on.
    pub node: String,
    /// Its label, `<node>/<actor>` (also its registered actor name).
    pub label: String,
    /// The process group it joined.
    pub group: String,
    /// The node's advertised QUIC address.
    pub addr: SocketAddr,
    /// The node's roles.
    pub roles: Vec<Role>,
    /// The environment slots the node hosts, by kind.
    pub envs: Vec<EnvSpec>,
}

impl MemberInfo {
    /// The names of the node's environment slots of `kind`: `<node>/env.<kind>.<i>`.
    pub fn env_slots(&self, kind: &str) -> Vec<String> {
        self.envs
            .iter()
            .filter(|e| e.kind == kind)
            .flat_map(|e| (0..e.count).map(move |i| env_slot(&self.node, &e.kind, i)))
            .collect()
    }
}

/// The name of environment slot `i` of `kind` on `node`.
pub fn env_slot(node: &str, kind: &str, i: u32) -> String {
    format!("{node}/env.{kind}.{i}")
}

/// An environment kind and how many slots of it a node hosts (`terminal:32`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvSpec {
    /// The environment kind (`terminal`, `swe`, `gui`, ...).
    pub kind: String,
    /// How many slots (sessions at once).
    pub count: u32,
}

/// A malformed `--env` value.
#[derive(Debug, thiserror::Error)]
#[error(
    "--env `{0}`: expected KIND:COUNT, KIND of ASCII letters, digits, '-' or '_', COUNT 1..=4096"
)]
pub struct EnvSpecError(String);

impl FromStr for EnvSpec {
    type Err = EnvSpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || EnvSpecError(s.to_string());
        let (kind, count) = s.split_once(':').ok_or_else(bad)?;
        let count: u32 = count.parse().map_err(|_| bad())?;
        if !crate::config::valid_node_name(kind) || count == 0 || count > 4096 {
            return Err(bad());
        }
        Ok(EnvSpec {
            kind: kind.to_string(),
            count,
        })
    }
}

/// An actor that joins a process group and answers [`MemberRequest`]s.
pub struct Member;

impl Actor for Member {
    type Msg = Rpc;
    type State = MemberInfo;
    type Arguments = MemberInfo;

    async fn pre_start(
        &self,
        myself: ActorRef<Rpc>,
        info: MemberInfo,
    ) -> Result<MemberInfo, ActorProcessingErr> {
        ractor::pg::join(info.group.clone(), vec![myself.get_cell()]);
        Ok(info)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Rpc>,
        msg: Rpc,
        info: &mut MemberInfo,
    ) -> Result<(), ActorProcessingErr> {
        match rpc::decode::<MemberRequest>(&msg.request) {
            Ok(MemberRequest::Describe) => rpc::reply(msg.reply, &MemberReply::Info(info.clone())),
            Ok(MemberRequest::Ping(n)) => rpc::reply(msg.reply, &MemberReply::Pong(n)),
            // A malformed request is the caller's problem: drop it (the caller times out) and
            // keep serving.
            Err(e) => tracing::warn!(member = %info.label, "malformed member request: {e}"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_spec_parses_and_rejects() {
        assert_eq!(
            "terminal:32".parse::<EnvSpec>().unwrap(),
            EnvSpec {
                kind: "terminal".into(),
                count: 32
            }
        );
        for bad in ["terminal", "terminal:0", ":3", "a b:2", "x:-1", "x:99999"] {
            assert!(bad.parse::<EnvSpec>().is_err(), "{bad}");
        }
    }
}
