//! The job home's view of the judge hosts: a [`TurnJudge`] whose votes run on the cluster's
//! `judge` nodes. Each turn goes to the hosts in turn; a host that is gone or does not answer
//! is skipped for the next, so turns re-route when a judge node dies. A host that answers with
//! a failure (the judge's endpoint erred, the node's grants refuse the spec) is not asked
//! again for that turn: another node would build the same judge.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clawrl_actors::loops::{BoxFuture, Judgement, Turn, TurnJudge};
use clawrl_actors::rpc;
use ractor::ActorCell;

use super::wire::{JudgeReply, JudgeRequest};
use super::{json, unjson, JUDGE_GROUP};

/// A job's judge on the cluster's judge hosts (see the module docs).
pub struct RemoteJudge {
    /// The job id.
    pub job: String,
    /// The spec's file.
    pub file: String,
    /// The spec text the hosts build the judge from.
    pub spec: String,
    /// How long one host may take over one turn (the voter's own limit cuts it sooner).
    pub timeout: Duration,
    /// Where the round-robin over hosts stands.
    pub next: AtomicUsize,
}

/// The judge hosts of the cluster, in a stable order.
fn hosts() -> Vec<ActorCell> {
    let mut hosts = ractor::pg::get_members(&JUDGE_GROUP.to_string());
    hosts.sort_by_key(rpc::actor_label);
    hosts
}

impl RemoteJudge {
    /// Has a judge host build the job's judge: `Ok(true)` once one has, `Ok(false)` while the
    /// cluster has no judge host that answers, `Err` when one refuses (this node is not the
    /// job's home, its grants refuse the spec's judge, or the judge cannot be built there).
    pub async fn prepare(&self) -> Result<bool, String> {
        for host in hosts() {
            let req = JudgeRequest::Prepare {
                job: self.job.clone(),
                file: self.file.clone(),
                spec: self.spec.clone(),
            };
            match rpc::call::<_, JudgeReply>(&host, &req, Duration::from_secs(120)).await {
                Ok(JudgeReply::Ready) => return Ok(true),
                Ok(JudgeReply::Failed(e)) => {
                    return Err(format!("judge host {}: {e}", rpc::actor_label(&host)))
                }
                Ok(other) => tracing::warn!("judge host answered {other:?} to Prepare"),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        Ok(false)
    }
}

impl TurnJudge for RemoteJudge {
    fn judge<'a>(&'a self, turn: &'a Turn) -> BoxFuture<'a, Result<Judgement, String>> {
        Box::pin(async move {
            let hosts = hosts();
            if hosts.is_empty() {
                return Err("no judge node in the cluster".into());
            }
            let req = JudgeRequest::Judge {
                job: self.job.clone(),
                file: self.file.clone(),
                spec: self.spec.clone(),
                turn: json(turn),
            };
            let first = self.next.fetch_add(1, Ordering::Relaxed);
            let mut unreachable = Vec::new();
            for k in 0..hosts.len() {
                let host = &hosts[(first + k) % hosts.len()];
                let label = rpc::actor_label(host);
                match rpc::call::<_, JudgeReply>(host, &req, self.timeout).await {
                    Ok(JudgeReply::Judged(text)) => return unjson::<Judgement>("judgement", &text),
                    Ok(JudgeReply::Failed(e)) => return Err(format!("judge host {label}: {e}")),
                    Ok(JudgeReply::Ready) => {
                        return Err(format!("judge host {label} answered Ready to a turn"))
                    }
                    Err(e) => {
                        tracing::warn!("judging on {label}: {e}; trying the next judge host");
                        unreachable.push(format!("{label}: {e}"));
                    }
                }
            }
            Err(format!(
                "no judge host answered: {}",
                unreachable.join("; ")
            ))
        })
    }
}
