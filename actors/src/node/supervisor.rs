//! The node supervisor: the root of a node's local actors. It spawns each child itself and
//! decides what a child's failure means: the `ractor_cluster` node server's loss stops the
//! node; the node's group member (its description) and the Control actor are
//! restarted, unless the node is in a crash loop ([`MAX_RESTARTS`] within [`RESTART_WINDOW`]),
//! which stops it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use ractor_cluster::{NodeServer, NodeServerMessage};

use super::NodeError;
use crate::control::{Control, ControlArgs, JobValidator};
use crate::member::{Member, MemberInfo};

#[derive(Clone)]
pub(super) enum Child {
    /// The `ractor_cluster` node server: without it there is no actor traffic, so its loss
    /// stops the node.
    NodeServer,
    /// The node's group member (its description): restarted.
    Member(MemberInfo),
    /// The Control actor: restarted; it reloads its jobs from disk.
    Control {
        validator: Arc<dyn JobValidator>,
        dir: std::path::PathBuf,
        label: String,
        node: String,
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
pub(super) enum SupervisorMsg {
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
pub(super) struct NodeSupervisor;

pub(super) struct SupervisorState {
    children: HashMap<ActorId, Child>,
    /// Restart times of recent failures, to give up on a crash loop.
    restarts: Vec<Instant>,
}

const RESTART_WINDOW: Duration = Duration::from_secs(10);
const MAX_RESTARTS: usize = 20;
/// Delay before a failed restart is tried again (each try counts towards [`MAX_RESTARTS`]).
const RESTART_RETRY: Duration = Duration::from_millis(250);

pub(super) async fn spawn_child(
    supervisor: &ActorRef<SupervisorMsg>,
    c: Child,
) -> Result<(), NodeError> {
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

/// Has the supervisor spawn the `ractor_cluster` node server, linked to it and watched (see
/// [`SupervisorMsg`]).
pub(super) async fn start_node_server(
    supervisor: &ActorRef<SupervisorMsg>,
    server: NodeServer,
) -> Result<ActorRef<NodeServerMessage>, NodeError> {
    match supervisor
        .call(
            |reply| SupervisorMsg::StartNodeServer(Box::new(server), reply),
            None,
        )
        .await
    {
        Ok(ractor::rpc::CallResult::Success(r)) => r,
        Ok(_) => Err(NodeError::Spawn {
            what: "ractor_cluster node server".into(),
            message: "the node supervisor did not answer".into(),
        }),
        Err(e) => Err(NodeError::Spawn {
            what: "ractor_cluster node server".into(),
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
            node,
        } => {
            let (a, _) = Actor::spawn_linked(
                Some(label.clone()),
                Control,
                ControlArgs {
                    validator: validator.clone(),
                    dir: dir.clone(),
                    label: label.clone(),
                    node: node.clone(),
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
