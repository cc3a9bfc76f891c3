//! The job home's view of generation on other nodes: a chat policy that asks the rollout hosts
//! in turn, and the pool that offers every host the newest weight version.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clawrl_actors::loops::{
    BoxFuture, Generated, Observation, PolicyError, PolicyTurn, RelayPublisher, Subscriber,
    TrainerEvent, TurnPolicy, WeightAnnounce,
};
use clawrl_actors::node::NodeConnector;
use clawrl_actors::rpc;
use ractor::{ActorCell, ActorId};

use super::rollout_host::GENERATE_TIMEOUT;
use super::wire::{AdapterServing, RolloutReply, RolloutRequest};
use super::{lock, CONTROL_CALL, POOL_TICK};
use crate::model::{ChatTemplate, EngineOptions, GenerationResult, Qwen3Config, SamplingParams};
use crate::pipeline::policy;

/// The chat policy over the rollout hosts of the cluster (group `clawrl.rollout`).
pub struct RemoteChatPolicy {
    pub(super) job: String,
    pub(super) template: Arc<ChatTemplate>,
    pub(super) tokenizer: Arc<tokenizers::Tokenizer>,
    pub(super) params: SamplingParams,
    pub(super) max_context: usize,
    pub(super) next: AtomicUsize,
    pub(super) next_seed: AtomicU64,
}

impl RemoteChatPolicy {
    async fn generate(
        &self,
        prompt_ids: Vec<u32>,
    ) -> Result<Generated<GenerationResult>, PolicyError> {
        let mut params = self.params.clone();
        params.seed = self.next_seed.fetch_add(1, Ordering::Relaxed);
        let hosts = ractor::pg::get_members(&clawrl_actors::groups::ROLLOUT.to_string());
        if hosts.is_empty() {
            return Err(PolicyError("no rollout worker in the cluster".into()));
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut errors = Vec::new();
        for k in 0..hosts.len() {
            let host = &hosts[(start + k) % hosts.len()];
            let req = RolloutRequest::Generate {
                job: self.job.clone(),
                prompt_ids: prompt_ids.clone(),
                params: params.clone(),
            };
            match rpc::call::<_, RolloutReply>(host, &req, GENERATE_TIMEOUT).await {
                Ok(RolloutReply::Generated(g)) => return Ok(g),
                // About the request, not the host: no retry.
                Ok(RolloutReply::Refused(e)) => return Err(PolicyError(e)),
                Ok(other) => errors.push(format!("{}: {other:?}", rpc::actor_label(host))),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(PolicyError(format!(
            "no rollout worker answered: {}",
            errors.join("; ")
        )))
    }
}

impl TurnPolicy for RemoteChatPolicy {
    fn act<'a>(
        &'a self,
        observation: &'a Observation,
    ) -> BoxFuture<'a, Result<PolicyTurn, PolicyError>> {
        Box::pin(policy::chat_turn(
            &self.template,
            &self.tokenizer,
            self.max_context,
            observation,
            |ids| self.generate(ids),
        ))
    }
}

/// Keeps every rollout host of the cluster serving the job's newest version.
pub struct RolloutPool {
    shared: Arc<PoolShared>,
    task: tokio::task::JoinHandle<()>,
}

struct PoolShared {
    job: String,
    model_config: String,
    engine: EngineOptions,
    adapter: Option<AdapterServing>,
    latest: Mutex<Option<WeightAnnounce>>,
    /// The version each host last reported serving.
    serving: Mutex<HashMap<ActorId, Option<u64>>>,
    wake: tokio::sync::Notify,
    /// The trainer's relaying publisher, whose targets follow the hosts' nodes.
    relay: Option<Arc<RelayPublisher<NodeConnector>>>,
}

impl PoolShared {
    /// Points the relaying publisher at the nodes of `hosts` (actors named `<node>/rollout`),
    /// so the next version is pushed to them before it is announced.
    fn relay_to(&self, hosts: &[ActorCell]) {
        if let Some(relay) = &self.relay {
            let mut nodes: Vec<String> = hosts
                .iter()
                .filter_map(|h| h.get_name())
                .filter_map(|n| n.split_once('/').map(|(node, _)| node.to_string()))
                .collect();
            nodes.sort();
            nodes.dedup();
            relay.set_targets(nodes);
        }
    }

    async fn offer_all(&self) {
        let Some(announce) = lock(&self.latest).clone() else {
            return;
        };
        let hosts = ractor::pg::get_members(&clawrl_actors::groups::ROLLOUT.to_string());
        self.relay_to(&hosts);
        let mut calls = tokio::task::JoinSet::new();
        {
            let mut serving = lock(&self.serving);
            serving.retain(|id, _| hosts.iter().any(|h| h.get_id() == *id));
            for h in hosts {
                let current = serving.get(&h.get_id()).copied().flatten();
                if current.is_some_and(|v| v >= announce.version) {
                    continue;
                }
                let req = RolloutRequest::Serve {
                    job: self.job.clone(),
                    model_config: self.model_config.clone(),
                    max_batch: self.engine.max_batch,
                    max_context: self.engine.max_context,
                    prefix_cache_bytes: self.engine.prefix_cache_bytes,
                    announce: announce.clone(),
                    adapter: self.adapter.clone(),
                };
                calls.spawn(async move {
                    let r = rpc::call::<_, RolloutReply>(&h, &req, CONTROL_CALL).await;
                    (h, r)
                });
            }
        }
        while let Some(Ok((h, r))) = calls.join_next().await {
            match r {
                Ok(RolloutReply::Stats(s)) => {
                    if let Some(e) = &s.last_update_error {
                        tracing::debug!("rollout host {}: {e}", rpc::actor_label(&h));
                    }
                    lock(&self.serving).insert(h.get_id(), s.version);
                }
                Ok(other) => tracing::warn!(
                    "rollout host {} answered {other:?} to Serve",
                    rpc::actor_label(&h)
                ),
                Err(e) => tracing::debug!("{e}"),
            }
        }
    }
}

impl RolloutPool {
    /// Starts offering the job's versions to the cluster's rollout hosts, with `adapter` when
    /// they are LoRA adapters over a base the hosts fetch once; with `relay` (the trainer's
    /// publisher), keeps its targets the nodes of the hosts.
    pub fn start(
        job: &str,
        model_config: &Qwen3Config,
        engine: EngineOptions,
        adapter: Option<AdapterServing>,
        relay: Option<Arc<RelayPublisher<NodeConnector>>>,
    ) -> RolloutPool {
        let shared = Arc::new(PoolShared {
            job: job.to_string(),
            model_config: model_config.to_json(),
            engine,
            adapter,
            latest: Mutex::new(None),
            serving: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
            relay,
        });
        shared.relay_to(&ractor::pg::get_members(
            &clawrl_actors::groups::ROLLOUT.to_string(),
        ));
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let _ = tokio::time::timeout(POOL_TICK, s.wake.notified()).await;
                s.offer_all().await;
            }
        });
        RolloutPool { shared, task }
    }

    /// A trainer subscriber handing every published version to the pool.
    pub fn subscriber(&self) -> Subscriber {
        let weak = Arc::downgrade(&self.shared);
        Arc::new(move |ev: &TrainerEvent| {
            let Some(s) = weak.upgrade() else {
                return false;
            };
            if let TrainerEvent::Published { announce, .. } = ev {
                let mut latest = lock(&s.latest);
                if latest.as_ref().is_none_or(|l| l.version < announce.version) {
                    *latest = Some(announce.clone());
                }
                drop(latest);
                s.wake.notify_one();
            }
            true
        })
    }

    /// Waits until some host serves a version of the job (or `stop` is set).
    pub async fn wait_serving(&self, stop: &AtomicBool) -> bool {
        loop {
            if lock(&self.shared.serving).values().any(|v| v.is_some()) {
                return true;
            }
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops offering and tells every host to release the job.
    pub async fn release(self) {
        self.task.abort();
        let hosts = ractor::pg::get_members(&clawrl_actors::groups::ROLLOUT.to_string());
        for h in hosts {
            let req = RolloutRequest::Release {
                job: self.shared.job.clone(),
            };
            let _ = rpc::call::<_, RolloutReply>(&h, &req, Duration::from_secs(5)).await;
        }
    }
}
