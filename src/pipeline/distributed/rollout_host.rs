//! The rollout host: on a `rollout` node, one `RolloutWorker` per job over the generation
//! engine, brought to each announced weight version over the bulk plane. For a job that trains a
//! LoRA adapter, the host fetches the job's base once when it starts serving it, and each
//! version is an adapter attached to that base.
//!
//! Only the job's home (its trainer node, as Control places it) may have a job served,
//! announce its versions or release it; only nodes placed on the job may generate for it
//! ([`clawrl_actors::authority`]). Other callers are refused, and the refusal is logged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use clawrl_actors::authority::{JobPlaces, Need};
use clawrl_actors::loops::{RolloutArgs, RolloutMsg, RolloutWorker, WeightSource};
use clawrl_actors::rpc;
use clawrl_actors::rpc::Rpc;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::wire::{AdapterServing, RolloutReply, RolloutRequest};
use crate::model::{
    model_from_shared_safetensors, EngineOptions, GenerationRequest, LinearLayout, Qwen3Config,
};
use crate::serve::{EnginePolicy, VersionWeights};
use crate::CpuBackend;

type Replica = ActorRef<RolloutMsg<EnginePolicy<CpuBackend>>>;

/// The actor that serves generation for jobs on a rollout node (see the module docs).
pub struct RolloutHost;

/// How a [`RolloutHost`] starts.
pub struct RolloutHostArgs {
    /// Where announced versions are fetched (the node's bulk plane).
    pub source: Arc<dyn WeightSource>,
    /// This node's name.
    pub node: String,
}

/// A [`RolloutHost`]'s state: one worker per job.
pub struct RolloutHostState {
    source: Arc<dyn WeightSource>,
    jobs: HashMap<String, Replica>,
    /// Where jobs run, to check callers.
    places: JobPlaces,
}

pub(super) const GENERATE_TIMEOUT: Duration = Duration::from_secs(600);

/// The base of a job that trains an adapter, fetched over the bulk plane (verified against its
/// blob id, then its announced size) and loaded on the CPU: what its versions attach to. Its
/// tensors are views of the fetched blob where the engine decodes from the blob's layout.
async fn fetch_base(
    source: &Arc<dyn WeightSource>,
    config: &Qwen3Config,
    adapter: &AdapterServing,
) -> Result<VersionWeights<CpuBackend>, String> {
    let bytes = source
        .fetch_weights(&adapter.base)
        .await
        .map_err(|e| format!("fetching the job's base: {e}"))?;
    adapter
        .base
        .check_size(&bytes)
        .map_err(|e| format!("the job's base: {e}"))?;
    let config = config.clone();
    let base = tokio::task::spawn_blocking(move || {
        // The base engine shares these tensors, so they are loaded as it decodes fastest.
        model_from_shared_safetensors::<CpuBackend>(
            &config,
            &bytes,
            &Default::default(),
            LinearLayout::decoding::<CpuBackend>(),
        )
    })
    .await
    .map_err(|e| format!("loading the job's base: the task died: {e}"))?
    .map_err(|e| format!("loading the job's base: {e}"))?;
    Ok(VersionWeights::Adapter {
        base: Box::new(base),
        config: adapter.lora.clone(),
    })
}

impl Actor for RolloutHost {
    type Msg = Rpc;
    type State = RolloutHostState;
    type Arguments = RolloutHostArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Rpc>,
        args: RolloutHostArgs,
    ) -> Result<RolloutHostState, ActorProcessingErr> {
        ractor::pg::join(
            clawrl_actors::groups::ROLLOUT.to_string(),
            vec![myself.get_cell()],
        );
        Ok(RolloutHostState {
            source: args.source,
            jobs: HashMap::new(),
            places: JobPlaces::new(args.node),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Rpc>,
        msg: Rpc,
        state: &mut RolloutHostState,
    ) -> Result<(), ActorProcessingErr> {
        let req = match rpc::decode::<RolloutRequest>(&msg.request) {
            Ok(r) => r,
            Err(e) => {
                rpc::reply(
                    msg.reply,
                    &RolloutReply::Refused(format!("malformed rollout request: {e}")),
                );
                return Ok(());
            }
        };
        let (job, need, what) = match &req {
            RolloutRequest::Serve { job, .. } => (job, Need::Home, "Serve"),
            RolloutRequest::Generate { job, .. } => (job, Need::Placed, "Generate"),
            RolloutRequest::Release { job } => (job, Need::Home, "Release"),
        };
        if let Err(e) = state.places.check(job, &msg.caller, need).await {
            tracing::warn!(job = %job, caller = %msg.caller, "rollout host: {what} refused: {e}");
            rpc::reply(msg.reply, &RolloutReply::Refused(e.to_string()));
            return Ok(());
        }
        match req {
            RolloutRequest::Serve {
                job,
                model_config,
                max_batch,
                max_context,
                prefix_cache_bytes,
                announce,
                adapter,
            } => {
                let alive = state
                    .jobs
                    .get(&job)
                    .is_some_and(|w| w.get_status() == ractor::ActorStatus::Running);
                if !alive {
                    let config = match Qwen3Config::from_json(&model_config) {
                        Ok(c) => c,
                        Err(e) => {
                            rpc::reply(
                                msg.reply,
                                &RolloutReply::Refused(format!("the job's model config: {e}")),
                            );
                            return Ok(());
                        }
                    };
                    let weights = match adapter {
                        None => VersionWeights::Full,
                        Some(a) => match fetch_base(&state.source, &config, &a).await {
                            Ok(w) => w,
                            Err(e) => {
                                rpc::reply(msg.reply, &RolloutReply::Refused(e));
                                return Ok(());
                            }
                        },
                    };
                    let policy = EnginePolicy::<CpuBackend>::with_weights(
                        config,
                        weights,
                        None,
                        EngineOptions {
                            max_batch,
                            max_context,
                            prefix_cache_bytes,
                        },
                        Default::default(),
                    );
                    let (w, _) = Actor::spawn(
                        None,
                        RolloutWorker::new(),
                        RolloutArgs {
                            policy: Arc::new(policy),
                            source: Some(state.source.clone()),
                            initial: None,
                        },
                    )
                    .await?;
                    tracing::info!(job = %job, "serving the job's policy");
                    state.jobs.insert(job.clone(), w);
                }
                let w = state.jobs[&job].clone();
                let _ = w.cast(RolloutMsg::Announce(announce, None));
                tokio::spawn(async move {
                    let reply = match ractor::call_t!(w, RolloutMsg::Stats, 10_000) {
                        Ok(s) => RolloutReply::Stats(s),
                        Err(_) => RolloutReply::NotServing,
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
            RolloutRequest::Generate {
                job,
                prompt_ids,
                params,
            } => {
                let Some(w) = state.jobs.get(&job).cloned() else {
                    rpc::reply(msg.reply, &RolloutReply::NotServing);
                    return Ok(());
                };
                tokio::spawn(async move {
                    let request = GenerationRequest {
                        prompt_ids,
                        params,
                        raw_logprobs: None,
                    };
                    let reply = match w
                        .call(
                            |port| RolloutMsg::Generate(request, port),
                            Some(GENERATE_TIMEOUT),
                        )
                        .await
                    {
                        Ok(ractor::rpc::CallResult::Success(Ok(g))) => RolloutReply::Generated(g),
                        Ok(ractor::rpc::CallResult::Success(Err(
                            clawrl_actors::loops::RolloutError::NoVersion,
                        ))) => RolloutReply::NotServing,
                        Ok(ractor::rpc::CallResult::Success(Err(e))) => {
                            RolloutReply::Refused(e.to_string())
                        }
                        _ => RolloutReply::NotServing,
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
            RolloutRequest::Release { job } => {
                if let Some(w) = state.jobs.remove(&job) {
                    tracing::info!(job = %job, "released the job's policy");
                    w.stop(None);
                }
                rpc::reply(msg.reply, &RolloutReply::Released);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Rpc>,
        state: &mut RolloutHostState,
    ) -> Result<(), ActorProcessingErr> {
        for w in state.jobs.values() {
            w.stop(None);
        }
        Ok(())
    }
}
