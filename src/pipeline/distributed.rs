//! A job across several OS processes: what `clawrl node` runs so that a job submitted to
//! Control actually runs on the nodes Control placed it on.
//!
//! - **Job home** (nodes with the `trainer` role): a [`JobRunner`] task asks Control for the
//!   jobs every half second and runs each active `rl` job placed on its node: the job
//!   supervisor, the `EnvSession` actors, the `PrmVoter`, the `Recorder` and the `Trainer` live
//!   here, with the run directory `<data_dir>/jobs/<job-id>` (checkpoints, journal of pending
//!   samples, records). A restarted node finds its job placed on it again and resumes the
//!   trainer from the last checkpoint, versions counting on. Counts are reported to Control
//!   (`clawrl status`); a cancelled job is stopped (drained).
//! - **Generation** (nodes with the `rollout` role): a [`RolloutHost`] in group
//!   `clawrl.rollout` keeps one `RolloutWorker` per job over the generation engine, fed by the
//!   job's weight announcements and fetching the bytes over the bulk plane from the trainer's
//!   node (verified against the announced blob id, loaded beside the serving version).
//!   Sessions ask the hosts in turn ([`RemoteChatPolicy`]); a host that is gone or does not
//!   serve the job yet is skipped, so sessions re-route when a rollout node dies. A
//!   [`RolloutPool`] on the job home offers the newest version to every host of the group that
//!   does not serve it yet, so a host that joins or restarts is brought up to date.
//! - **Environments** (nodes started with `--env KIND:N`, which offer N slots of KIND in their
//!   node description): an [`EnvHost`] in group `clawrl.envhost.KIND` builds the job's
//!   environment from the spec and holds its episodes; the session on the job home drives its
//!   episode over the wire ([`RemoteEnvironment`]). An episode starts on the host of a node
//!   whose slots Control placed the job on, the least busy first. When its node dies the episode's next step fails, the session fails, and the
//!   job supervisor restarts it on its task (on a live host) or counts it lost.
//! - **Judging** (nodes with the `judge` role): a [`JudgeHost`] in group `clawrl.judge` builds
//!   a job's judge from its spec under its own node's `[judge]` grants and judges the turns the
//!   home sends it. A home that has the `judge` role itself judges its turns where it is, as
//!   the embedded node does; one without it judges on the judge hosts ([`RemoteJudge`]), in
//!   turn, skipping one that is gone, and waits for a judge host before the job starts. The
//!   OPD teacher stays on the home: it scores with the job's own policy.
//!
//! Everything that crosses the wire is a `serde` value in `bincode` over [`rpc::Rpc`]; chat
//! messages and tool schemas (JSON values, which `bincode` cannot carry as such) travel as JSON
//! text. Peers are looked up through their process group at every call, so a restarted peer is
//! found again. Paths in a job spec are resolved on each node against the spec file's directory:
//! the spec's files (checkpoint, tasks) must exist at the same paths on the job home and on the
//! environment nodes.
//!
//! One file per concern: [`wire`] (the messages), [`rollout_host`], [`env_host`] and
//! [`judge_host`] (what the other nodes run), [`remote_env`], [`remote_policy`] and
//! [`remote_judge`] (the job home's view of them), and [`home`] (the job runner and the node
//! services).

use clawrl_actors::control::{ControlReply, ControlRequest};
use clawrl_actors::rpc;
use serde::Serialize;
use std::sync::Mutex;
use std::time::Duration;

mod env_host;
mod home;
mod judge_host;
mod remote_env;
mod remote_judge;
mod remote_policy;
mod rollout_host;
mod wire;

pub use env_host::{EnvHost, EnvHostArgs, EnvHostState};
pub use home::{run_placed_job, start_node_services, JobRunner, Judging, ServicesError};
pub use judge_host::{JudgeHost, JudgeHostArgs, JudgeHostState};
pub use remote_env::RemoteEnvironment;
pub use remote_judge::RemoteJudge;
pub use remote_policy::{RemoteChatPolicy, RolloutPool};
pub use rollout_host::{RolloutHost, RolloutHostArgs, RolloutHostState};
pub use wire::{
    AdapterServing, EnvReply, EnvRequest, JudgeReply, JudgeRequest, RolloutReply, RolloutRequest,
};

/// The group of judge hosts.
pub const JUDGE_GROUP: &str = "clawrl.judge";

/// The group of environment hosts of `kind`.
pub fn envhost_group(kind: &str) -> String {
    format!("clawrl.envhost.{kind}")
}

/// How long a call to Control may take.
const CONTROL_CALL: Duration = Duration::from_secs(10);
/// How often the job runner asks Control for its jobs.
const RUNNER_POLL: Duration = Duration::from_millis(500);
/// How often the rollout pool offers the newest version to lagging hosts.
const POOL_TICK: Duration = Duration::from_millis(250);
/// An episode untouched this long on an environment host is closed (its job is gone).
const EPISODE_IDLE: Duration = Duration::from_secs(1800);

/// A JSON value as text, for the wire.
fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("in-memory JSON values serialize")
}

/// A JSON value from wire text; `what` names it in the error.
fn unjson<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|e| format!("malformed {what} on the wire: {e}"))
}

/// Locks `m`, going on past a panic of another holder (the data stays consistent: no
/// holder leaves it half-changed).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A call to the cluster's Control actor.
async fn control_call(req: &ControlRequest) -> Result<ControlReply, String> {
    let cell = ractor::pg::get_members(&clawrl_actors::groups::CONTROL.to_string())
        .into_iter()
        .next()
        .ok_or("no Control actor in the cluster")?;
    rpc::call(&cell, req, CONTROL_CALL)
        .await
        .map_err(|e| e.to_string())
}

/// The node part of a member label `<node>/<actor>`.
fn node_of(label: &str) -> &str {
    label.split('/').next().unwrap_or(label)
}
