//! The job home's view of environments on other nodes: an `Environment` whose episodes run on
//! environment hosts, placed on the least busy host of the workers Control assigned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clawrl_actors::control::{ControlReply, ControlRequest};
use clawrl_actors::loops::{BoxFuture, EnvError, Environment, Episode, Observation, StepOutcome};
use clawrl_actors::rpc;
use ractor::ActorCell;

use super::wire::{EnvReply, EnvRequest};
use super::{control_call, envhost_group, json, lock, node_of, unjson, CONTROL_CALL};
use crate::job::JobSpec;

/// A job's environment whose episodes run on environment hosts.
pub struct RemoteEnvironment {
    pub(super) job: String,
    pub(super) file: String,
    pub(super) spec: String,
    pub(super) kind: String,
    pub(super) task_count: usize,
    pub(super) max_steps: u32,
    pub(super) timeout: Duration,
    /// Episodes open per host label (to start on the least busy).
    pub(super) open: Arc<Mutex<HashMap<String, usize>>>,
    pub(super) next: AtomicUsize,
}

impl RemoteEnvironment {
    /// The hosts of the job's kind on nodes whose environment slots Control placed the job on
    /// (all hosts of the kind when Control cannot say).
    async fn hosts(&self) -> Vec<ActorCell> {
        let all = ractor::pg::get_members(&envhost_group(&self.kind));
        let placed: Option<Vec<String>> =
            match control_call(&ControlRequest::Status(Some(self.job.clone()))).await {
                Ok(ControlReply::Jobs(j)) if !j.is_empty() => Some(
                    j[0].placement
                        .env_slots
                        .iter()
                        .map(|w| node_of(w).to_string())
                        .collect(),
                ),
                _ => None,
            };
        match placed {
            Some(nodes) => all
                .into_iter()
                .filter(|c| nodes.iter().any(|n| n == node_of(&rpc::actor_label(c))))
                .collect(),
            None => all,
        }
    }

    /// Waits until a placed host builds the job's environment and describes it (returns
    /// `Err` when a host refuses the spec, `Ok(None)` while none is there).
    pub(super) async fn describe(
        job: &str,
        file: &str,
        spec: &JobSpec,
        spec_text: &str,
    ) -> Result<Option<(String, usize, u32)>, String> {
        let probe = RemoteEnvironment {
            job: job.to_string(),
            file: file.to_string(),
            spec: spec_text.to_string(),
            kind: spec.env.kind.name().to_string(),
            task_count: 0,
            max_steps: 0,
            timeout: CONTROL_CALL,
            open: Default::default(),
            next: AtomicUsize::new(0),
        };
        for host in probe.hosts().await {
            let req = EnvRequest::Describe {
                job: job.to_string(),
                file: file.to_string(),
                spec: spec_text.to_string(),
            };
            match rpc::call::<_, EnvReply>(&host, &req, Duration::from_secs(120)).await {
                Ok(EnvReply::Described {
                    kind,
                    task_count,
                    max_steps,
                }) => return Ok(Some((kind, task_count as usize, max_steps))),
                Ok(EnvReply::Failed(e)) => {
                    return Err(format!("environment host {}: {e}", rpc::actor_label(&host)))
                }
                Ok(other) => tracing::warn!("environment host answered {other:?} to Describe"),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        Ok(None)
    }
}

impl Environment for RemoteEnvironment {
    fn kind(&self) -> &str {
        &self.kind
    }

    fn task_count(&self) -> usize {
        self.task_count
    }

    fn max_steps(&self) -> u32 {
        self.max_steps
    }

    fn start(&self, index: usize, seed: u64) -> BoxFuture<'_, Result<Box<dyn Episode>, EnvError>> {
        Box::pin(async move {
            let setup = |reason: String| EnvError::Setup {
                task: format!("#{index}"),
                reason,
            };
            let hosts = self.hosts().await;
            if hosts.is_empty() {
                return Err(setup(format!(
                    "no environment host of kind `{}` is placed on job {}",
                    self.kind, self.job
                )));
            }
            let host = {
                let open = lock(&self.open);
                let rr = self.next.fetch_add(1, Ordering::Relaxed);
                let n = hosts.len();
                (0..n)
                    .map(|k| &hosts[(rr + k) % n])
                    .min_by_key(|c| open.get(&rpc::actor_label(c)).copied().unwrap_or(0))
                    .cloned()
                    .expect("hosts is not empty")
            };
            let label = rpc::actor_label(&host);
            let req = EnvRequest::Start {
                job: self.job.clone(),
                file: self.file.clone(),
                spec: self.spec.clone(),
                task_index: index as u64,
                seed,
            };
            match rpc::call::<_, EnvReply>(&host, &req, self.timeout).await {
                Ok(EnvReply::Started {
                    episode,
                    task_id,
                    instruction,
                    observation,
                }) => {
                    let observation: Observation = unjson("observation", &observation)
                        .map_err(|e| setup(format!("{label}: {e}")))?;
                    *lock(&self.open).entry(label.clone()).or_insert(0) += 1;
                    Ok(Box::new(RemoteEpisode {
                        host,
                        label,
                        episode,
                        task_id,
                        instruction,
                        observation,
                        timeout: self.timeout,
                        open: self.open.clone(),
                    }) as Box<dyn Episode>)
                }
                Ok(EnvReply::Failed(e)) => Err(setup(format!("{label}: {e}"))),
                Ok(other) => Err(setup(format!("{label} answered {other:?} to Start"))),
                Err(e) => Err(setup(e.to_string())),
            }
        })
    }
}

/// An episode held by an environment host.
struct RemoteEpisode {
    host: ActorCell,
    label: String,
    episode: u64,
    task_id: String,
    instruction: String,
    observation: Observation,
    timeout: Duration,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

impl Episode for RemoteEpisode {
    fn task_id(&self) -> &str {
        &self.task_id
    }

    fn instruction(&self) -> &str {
        &self.instruction
    }

    fn observation(&self) -> Observation {
        self.observation.clone()
    }

    fn step<'a>(
        &'a mut self,
        action: &'a clawrl_actors::loops::Action,
    ) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        Box::pin(async move {
            let fail = |reason: String| EnvError::Step {
                task: self.task_id.clone(),
                reason,
            };
            let req = EnvRequest::Step {
                episode: self.episode,
                action: json(action),
            };
            match rpc::call::<_, EnvReply>(&self.host, &req, self.timeout).await {
                Ok(EnvReply::Stepped {
                    outcome,
                    observation,
                }) => {
                    let outcome: StepOutcome = unjson("step outcome", &outcome)
                        .map_err(|e| fail(format!("{}: {e}", self.label)))?;
                    self.observation = unjson("observation", &observation)
                        .map_err(|e| fail(format!("{}: {e}", self.label)))?;
                    Ok(outcome)
                }
                Ok(EnvReply::Failed(e)) => Err(fail(format!("{}: {e}", self.label))),
                Ok(other) => Err(fail(format!("{} answered {other:?} to Step", self.label))),
                Err(e) => Err(fail(e.to_string())),
            }
        })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Some(n) = lock(&self.open).get_mut(&self.label) {
                *n = n.saturating_sub(1);
            }
            let req = EnvRequest::Close {
                episode: self.episode,
            };
            if let Err(e) =
                rpc::call::<_, EnvReply>(&self.host, &req, Duration::from_secs(30)).await
            {
                tracing::debug!("closing episode {} on {}: {e}", self.episode, self.label);
            }
        })
    }
}
