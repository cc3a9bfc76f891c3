//! The rollout host: on a `rollout` node, one `RolloutWorker` per job over the generation
//! engine, brought to each announced weight version over the bulk plane.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use clawrl_actors::loops::{RolloutArgs, RolloutMsg, RolloutWorker, WeightSource};
use clawrl_actors::rpc;
use clawrl_actors::rpc::Rpc;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::wire::{RolloutReply, RolloutRequest};
use crate::model::{EngineOptions, GenerationRequest, Qwen3Config};
use crate::serve::EnginePolicy;
use crate::CpuBackend;

type Replica = ActorRef<RolloutMsg<EnginePolicy<CpuBackend>>>;

/// The actor that serves generation for jobs on a rollout node (see the module docs).
pub struct RolloutHost;

/// How a [`RolloutHost`] starts.
pub struct RolloutHostArgs {
    /// Where announced versions are fetched (the node's bulk plane).
    pub source: Arc<dyn WeightSource>,
}

/// A [`RolloutHost`]'s state: one worker per job.
pub struct RolloutHostState {
    source: Arc<dyn WeightSource>,
    jobs: HashMap<String, Replica>,
}

pub(super) const GENERATE_TIMEOUT: Duration = Duration::from_secs(600);

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
        match req {
            RolloutRequest::Serve {
                job,
                model_config,
                max_batch,
                max_context,
                prefix_cache_bytes,
                announce,
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
                    let policy = EnginePolicy::<CpuBackend>::new(
                        config,
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
