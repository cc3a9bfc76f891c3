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
//!   node (size and blake3 checked, loaded beside the serving version). Sessions ask the hosts
//!   in turn ([`RemoteChatPolicy`]); a host that is gone or does not serve the job yet is
//!   skipped, so sessions re-route when a rollout node dies. A [`RolloutPool`] on the job home
//!   offers the newest version to every host of the group that does not serve it yet, so a
//!   host that joins or restarts is brought up to date.
//! - **Environments** (nodes started with `--env KIND:N`): an [`EnvHost`] in group
//!   `clawrl.envhost.KIND` builds the job's environment from the spec and holds its episodes;
//!   the session on the job home drives its episode over the wire ([`RemoteEnvironment`]). An
//!   episode starts on the host of a node holding workers Control placed on the job, the least
//!   busy first. When its node dies the episode's next step fails, the session fails, and the
//!   job supervisor restarts it on its task (on a live host) or counts it lost.
//!
//! Everything that crosses the wire is a `serde` value in `bincode` over [`rpc::Rpc`]; chat
//! messages and tool schemas (JSON values, which `bincode` cannot carry as such) travel as JSON
//! text. Peers are looked up through their process group at every call, so a restarted peer is
//! found again. Paths in a job spec are resolved on each node against the spec file's directory:
//! the spec's files (checkpoint, tasks) must exist at the same paths on the job home and on the
//! environment nodes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use clawrl_actors::config::{NodeConfig, Role};
use clawrl_actors::control::{ControlReply, ControlRequest, JobRecord, JobState as PlacedState};
use clawrl_actors::loops::{
    spawn_job, BoxFuture, EnvError, Environment, Episode, Generated, JobArgs, JobCounts, JobMsg,
    JobPhase, Observation, PolicyError, PolicyTurn, ProgressReport, Recorder, RecorderConfig,
    RecorderMsg, RelayPublisher, RolloutArgs, RolloutMsg, RolloutStats, RolloutWorker, StepOutcome,
    Subscriber, TrainSample, Trainer, TrainerArgs, TrainerEvent, TrainerMsg, TurnPolicy,
    WeightAnnounce, WeightPublisher, WeightSource,
};
use clawrl_actors::node::{Node, NodeConnector};
use clawrl_actors::rpc::{self, Rpc};
use clawrl_actors::worker::EnvSpec;
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef};
use serde::{Deserialize, Serialize};

use super::{
    actor_err, build_env, build_judging, job_settings, learner, policy, sampling_params,
    spawn_teacher, step_records, trainer_config, wait_serving, RunError, KEEP_CHECKPOINTS,
};
use crate::job::{JobKind, JobSpec};
use crate::model::{
    load_checkpoint, ChatTemplate, EngineOptions, GenerationRequest, GenerationResult, Qwen3Config,
    SamplingParams,
};
use crate::serve::EnginePolicy;
use crate::train::learner::Learner as BurnLearner;
use crate::{CpuAutodiff, CpuBackend};

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

// ---------------------------------------------------------------------------------------------
// Wire types.

/// A request to a [`RolloutHost`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RolloutRequest {
    /// Serve `job` (start its worker if there is none) and install `announce` (fetched over the
    /// bulk plane); replies [`RolloutReply::Stats`].
    Serve {
        /// The job id.
        job: String,
        /// The policy's `config.json` text.
        model_config: String,
        /// Engine batch size.
        max_batch: usize,
        /// Engine context.
        max_context: usize,
        /// The version to install.
        announce: WeightAnnounce,
    },
    /// Generate for `job`.
    Generate {
        /// The job id.
        job: String,
        /// The prompt.
        prompt_ids: Vec<u32>,
        /// Sampling.
        params: SamplingParams,
    },
    /// Stop serving `job`.
    Release {
        /// The job id.
        job: String,
    },
}

/// A [`RolloutHost`]'s reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RolloutReply {
    /// The job's worker counters.
    Stats(RolloutStats),
    /// A generation, with the version of its tokens.
    Generated(Generated<GenerationResult>),
    /// This host does not serve the job (yet): ask another.
    NotServing,
    /// The request itself is bad (the engine refused it, or the config does not parse).
    Refused(String),
    /// The job's worker was stopped.
    Released,
}

/// A request to an [`EnvHost`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum EnvRequest {
    /// Build the job's environment (once per job) and describe it.
    Describe {
        /// The job id.
        job: String,
        /// The spec's file (its directory resolves relative paths).
        file: String,
        /// The spec text.
        spec: String,
    },
    /// Start an episode of task `task_index`.
    Start {
        /// The job id.
        job: String,
        /// The spec's file.
        file: String,
        /// The spec text.
        spec: String,
        /// The task.
        task_index: u64,
        /// The episode's seed.
        seed: u64,
    },
    /// Step an episode with an action (JSON of [`clawrl_actors::loops::Action`]).
    Step {
        /// The episode.
        episode: u64,
        /// The action, as JSON text.
        action: String,
    },
    /// Close an episode.
    Close {
        /// The episode.
        episode: u64,
    },
}

/// An [`EnvHost`]'s reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum EnvReply {
    /// The job's environment.
    Described {
        /// Its kind.
        kind: String,
        /// Its task count.
        task_count: u64,
        /// Its step limit.
        max_steps: u32,
    },
    /// An episode started.
    Started {
        /// Its id on the host.
        episode: u64,
        /// The task's id.
        task_id: String,
        /// The task's instruction.
        instruction: String,
        /// The first observation (JSON of [`Observation`]).
        observation: String,
    },
    /// A step's outcome and the observation after it (JSON texts).
    Stepped {
        /// JSON of [`StepOutcome`].
        outcome: String,
        /// JSON of [`Observation`].
        observation: String,
    },
    /// The episode was closed (or was not open).
    Closed,
    /// The environment failed (the reason).
    Failed(String),
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("in-memory JSON values serialize")
}

fn unjson<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|e| format!("malformed {what} on the wire: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Rollout host (rollout nodes).

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

const GENERATE_TIMEOUT: Duration = Duration::from_secs(600);

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
                    let request = GenerationRequest { prompt_ids, params };
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

// ---------------------------------------------------------------------------------------------
// Environment host (env nodes).

struct OpenEpisode {
    episode: tokio::sync::Mutex<Option<Box<dyn Episode>>>,
    last_used: Mutex<Instant>,
}

type Episodes = Arc<Mutex<HashMap<u64, Arc<OpenEpisode>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The actor that hosts the episodes of jobs on an environment node (see the module docs).
pub struct EnvHost;

/// How an [`EnvHost`] starts.
pub struct EnvHostArgs {
    /// The environment kind it hosts (`--env KIND:N`).
    pub kind: String,
}

/// An [`EnvHost`]'s state.
pub struct EnvHostState {
    kind: String,
    /// Built environments by job id, with the spec text they were built from.
    envs: HashMap<String, (String, Arc<dyn Environment>)>,
    episodes: Episodes,
    next: u64,
}

impl EnvHostState {
    /// The job's environment, built on first use from its spec.
    fn environment(
        &mut self,
        job: &str,
        file: &str,
        spec_text: &str,
    ) -> Result<Arc<dyn Environment>, String> {
        if let Some((text, env)) = self.envs.get(job) {
            if text == spec_text {
                return Ok(env.clone());
            }
        }
        let spec = JobSpec::parse(spec_text, file).map_err(|e| e.to_string())?;
        if spec.env.kind != self.kind {
            return Err(format!(
                "job {job} wants env.kind `{}`; this host runs `{}`",
                spec.env.kind, self.kind
            ));
        }
        let env = build_env(&spec).map_err(|e| e.to_string())?;
        tracing::info!(
            job = %job,
            "built the job's `{}` environment: {} tasks",
            self.kind,
            env.task_count()
        );
        self.envs
            .insert(job.to_string(), (spec_text.to_string(), env.clone()));
        Ok(env)
    }
}

impl Actor for EnvHost {
    type Msg = Rpc;
    type State = EnvHostState;
    type Arguments = EnvHostArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Rpc>,
        args: EnvHostArgs,
    ) -> Result<EnvHostState, ActorProcessingErr> {
        ractor::pg::join(envhost_group(&args.kind), vec![myself.get_cell()]);
        let episodes: Episodes = Arc::new(Mutex::new(HashMap::new()));
        // Episodes nobody steps any more (their job's home died) are closed after a while.
        let weak: Weak<Mutex<HashMap<u64, Arc<OpenEpisode>>>> = Arc::downgrade(&episodes);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(60)).await;
                let Some(map) = weak.upgrade() else { return };
                let idle: Vec<Arc<OpenEpisode>> = {
                    let mut m = lock(&map);
                    let ids: Vec<u64> = m
                        .iter()
                        .filter(|(_, e)| lock(&e.last_used).elapsed() > EPISODE_IDLE)
                        .map(|(k, _)| *k)
                        .collect();
                    ids.iter().filter_map(|k| m.remove(k)).collect()
                };
                for e in idle {
                    if let Some(ep) = e.episode.lock().await.take() {
                        tracing::warn!("closing an episode idle for {EPISODE_IDLE:?}");
                        ep.close().await;
                    }
                }
            }
        });
        Ok(EnvHostState {
            kind: args.kind,
            envs: HashMap::new(),
            episodes,
            next: 1,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Rpc>,
        msg: Rpc,
        state: &mut EnvHostState,
    ) -> Result<(), ActorProcessingErr> {
        let req = match rpc::decode::<EnvRequest>(&msg.request) {
            Ok(r) => r,
            Err(e) => {
                rpc::reply(
                    msg.reply,
                    &EnvReply::Failed(format!("malformed environment request: {e}")),
                );
                return Ok(());
            }
        };
        match req {
            EnvRequest::Describe { job, file, spec } => {
                let reply = match state.environment(&job, &file, &spec) {
                    Ok(env) => EnvReply::Described {
                        kind: env.kind().to_string(),
                        task_count: env.task_count() as u64,
                        max_steps: env.max_steps(),
                    },
                    Err(e) => EnvReply::Failed(e),
                };
                rpc::reply(msg.reply, &reply);
            }
            EnvRequest::Start {
                job,
                file,
                spec,
                task_index,
                seed,
            } => {
                let env = match state.environment(&job, &file, &spec) {
                    Ok(env) => env,
                    Err(e) => {
                        rpc::reply(msg.reply, &EnvReply::Failed(e));
                        return Ok(());
                    }
                };
                let id = state.next;
                state.next += 1;
                let episodes = state.episodes.clone();
                tokio::spawn(async move {
                    let reply = match env.start(task_index as usize, seed).await {
                        Ok(ep) => {
                            let reply = EnvReply::Started {
                                episode: id,
                                task_id: ep.task_id().to_string(),
                                instruction: ep.instruction().to_string(),
                                observation: json(&ep.observation()),
                            };
                            lock(&episodes).insert(
                                id,
                                Arc::new(OpenEpisode {
                                    episode: tokio::sync::Mutex::new(Some(ep)),
                                    last_used: Mutex::new(Instant::now()),
                                }),
                            );
                            reply
                        }
                        Err(e) => EnvReply::Failed(e.to_string()),
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
            EnvRequest::Step { episode, action } => {
                let open = lock(&state.episodes).get(&episode).cloned();
                tokio::spawn(async move {
                    let reply = match open {
                        None => EnvReply::Failed(format!("no open episode {episode} here")),
                        Some(open) => {
                            *lock(&open.last_used) = Instant::now();
                            let mut guard = open.episode.lock().await;
                            match (
                                guard.as_mut(),
                                unjson::<clawrl_actors::loops::Action>("action", &action),
                            ) {
                                (None, _) => EnvReply::Failed(format!("episode {episode} closed")),
                                (_, Err(e)) => EnvReply::Failed(e),
                                (Some(ep), Ok(action)) => match ep.step(&action).await {
                                    Ok(outcome) => EnvReply::Stepped {
                                        outcome: json(&outcome),
                                        observation: json(&ep.observation()),
                                    },
                                    Err(e) => EnvReply::Failed(e.to_string()),
                                },
                            }
                        }
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
            EnvRequest::Close { episode } => {
                let open = lock(&state.episodes).remove(&episode);
                tokio::spawn(async move {
                    if let Some(open) = open {
                        if let Some(ep) = open.episode.lock().await.take() {
                            ep.close().await;
                        }
                    }
                    rpc::reply(msg.reply, &EnvReply::Closed);
                });
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Rpc>,
        state: &mut EnvHostState,
    ) -> Result<(), ActorProcessingErr> {
        let open: Vec<Arc<OpenEpisode>> = lock(&state.episodes).drain().map(|(_, e)| e).collect();
        for e in open {
            if let Some(ep) = e.episode.lock().await.take() {
                ep.close().await;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The job home's view of remote environments.

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

/// A job's environment whose episodes run on environment hosts.
pub struct RemoteEnvironment {
    job: String,
    file: String,
    spec: String,
    kind: String,
    task_count: usize,
    max_steps: u32,
    timeout: Duration,
    /// Episodes open per host label (to start on the least busy).
    open: Arc<Mutex<HashMap<String, usize>>>,
    next: AtomicUsize,
}

impl RemoteEnvironment {
    /// The hosts of the job's kind on nodes that hold environment workers Control placed on
    /// the job (all hosts of the kind when Control cannot say).
    async fn hosts(&self) -> Vec<ActorCell> {
        let all = ractor::pg::get_members(&envhost_group(&self.kind));
        let placed: Option<Vec<String>> =
            match control_call(&ControlRequest::Status(Some(self.job.clone()))).await {
                Ok(ControlReply::Jobs(j)) if !j.is_empty() => Some(
                    j[0].placement
                        .env_workers
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
    async fn describe(
        job: &str,
        file: &str,
        spec: &JobSpec,
        spec_text: &str,
    ) -> Result<Option<(String, usize, u32)>, String> {
        let probe = RemoteEnvironment {
            job: job.to_string(),
            file: file.to_string(),
            spec: spec_text.to_string(),
            kind: spec.env.kind.clone(),
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

// ---------------------------------------------------------------------------------------------
// The job home's view of remote generation.

/// The chat policy over the rollout hosts of the cluster (group `clawrl.rollout`).
pub struct RemoteChatPolicy {
    job: String,
    template: Arc<ChatTemplate>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    params: SamplingParams,
    max_context: usize,
    next: AtomicUsize,
    next_seed: AtomicU64,
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
                    announce: announce.clone(),
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
    /// Starts offering the job's versions to the cluster's rollout hosts; with `relay` (the
    /// trainer's publisher), keeps its targets the nodes of the hosts.
    pub fn start(
        job: &str,
        model_config: &Qwen3Config,
        engine: EngineOptions,
        relay: Option<Arc<RelayPublisher<NodeConnector>>>,
    ) -> RolloutPool {
        let shared = Arc::new(PoolShared {
            job: job.to_string(),
            model_config: model_config.to_json(),
            engine,
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

// ---------------------------------------------------------------------------------------------
// The job home.

/// Runs one job placed on this node to its stop condition (see the module docs). Returns its
/// final counts; `stop` set from outside (a cancel) makes a waiting job give up and a running
/// one drain.
pub async fn run_placed_job(
    node: &Node,
    record: &JobRecord,
    out: PathBuf,
    progress: ProgressReport,
    stop: Arc<AtomicBool>,
    supervisor: Arc<Mutex<Option<ActorRef<JobMsg<TrainSample>>>>>,
) -> Result<JobCounts, RunError> {
    let job_id = record.id.clone();
    let file = record.file.clone();
    let spec = JobSpec::parse(&record.spec, &file)?;
    if spec.kind != JobKind::Rl {
        return Err(RunError::Actor {
            what: "job runner",
            message: "only `rl` jobs run across nodes; a `personal` job runs with `clawrl run`"
                .into(),
        });
    }
    let waiting = |what: &str| {
        let counts = JobCounts {
            last_error: Some(format!("waiting for {what}")),
            ..Default::default()
        };
        progress(&counts);
    };

    // The environment, on the hosts Control placed.
    let (kind, task_count, max_steps) = loop {
        if stop.load(Ordering::Relaxed) {
            return Err(RunError::Actor {
                what: "job",
                message: "cancelled before it started".into(),
            });
        }
        match RemoteEnvironment::describe(&job_id, &file, &spec, &record.spec).await {
            Ok(Some(d)) => break d,
            Ok(None) => {
                waiting(&format!("an environment host of kind `{}`", spec.env.kind));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                return Err(RunError::Env {
                    kind: spec.env.kind.clone(),
                    tasks: spec.resolve(&spec.env.tasks),
                    message: e,
                })
            }
        }
    };
    let env = Arc::new(RemoteEnvironment {
        job: job_id.clone(),
        file: file.clone(),
        spec: record.spec.clone(),
        kind,
        task_count,
        max_steps,
        timeout: Duration::from_secs_f64(spec.env.episode_timeout_s.unwrap_or(600.0)),
        open: Default::default(),
        next: AtomicUsize::new(0),
    });

    // The learner and the policy's tokenizer and template.
    let ckpt_dir = spec.resolve(&spec.policy.checkpoint);
    let device = Default::default();
    let ck =
        load_checkpoint::<CpuAutodiff>(&ckpt_dir, &device).map_err(|e| RunError::Checkpoint {
            path: ckpt_dir.clone(),
            message: e.to_string(),
        })?;
    let stop_ids = ck.stop_token_ids();
    let tokenizer = Arc::new(ck.tokenizer);
    let template = Arc::new(ck.chat_template);
    let learner = BurnLearner::new(
        ck.config,
        ck.model,
        super::train_config(&spec),
        device,
        spec.seed,
    );
    let model_config = learner.model_config().clone();
    let engine = EngineOptions {
        max_batch: spec.policy.max_batch as usize,
        max_context: spec.policy.max_context as usize,
    };

    // Records.
    let (recorder, _) = Actor::spawn(
        None,
        Recorder,
        RecorderConfig::new(out.join("records"), &job_id),
    )
    .await
    .map_err(actor_err("recorder"))?;
    let rec =
        ractor::call_t!(recorder, RecorderMsg::Handle, 10_000).map_err(actor_err("recorder"))?;

    // Generation on the rollout hosts, the OPD teacher here, the trainer publishing on this
    // node's bulk plane.
    // The trainer pushes each version through the bulk plane's relay groups to the rollout
    // hosts' nodes before announcing it (its uplink sends about one copy whatever their
    // number); a node the relay misses fetches from the trainer's node when offered.
    let relay = Arc::new(
        RelayPublisher::new(node.bulk().clone(), Vec::new()).map_err(|e| RunError::Actor {
            what: "weight publisher",
            message: e.to_string(),
        })?,
    );
    let pool = RolloutPool::start(&job_id, &model_config, engine, Some(relay.clone()));
    let mut subscribers = vec![pool.subscriber()];
    let teacher = spawn_teacher(
        &spec,
        &model_config,
        &template,
        &tokenizer,
        &mut subscribers,
    )
    .await?;
    let publisher: Arc<dyn WeightPublisher> = relay;
    let (trainer, _) = Actor::spawn(
        None,
        Trainer::new(),
        TrainerArgs {
            config: trainer_config(&spec, &job_id, &out),
            learner: learner::PolicyLearner::new(learner, KEEP_CHECKPOINTS),
            publisher,
            subscribers,
        },
    )
    .await
    .map_err(actor_err("trainer"))?;
    let stop_all = |trainer: &ActorRef<TrainerMsg>| {
        trainer.stop(None);
        if let Some(t) = &teacher {
            t.stop(None);
        }
        recorder.stop(None);
    };
    waiting("a rollout worker serving the job's first version");
    if !pool.wait_serving(&stop).await {
        stop_all(&trainer);
        pool.release().await;
        return Err(RunError::Actor {
            what: "job",
            message: "cancelled before it started".into(),
        });
    }
    if let Some(t) = &teacher {
        wait_serving(std::slice::from_ref(t), "OPD teacher").await?;
    }

    let (judge, builder) =
        build_judging(&spec, &file, &ckpt_dir, engine, &job_id, teacher.clone())?;
    let chat = RemoteChatPolicy {
        job: job_id.clone(),
        template,
        tokenizer,
        params: sampling_params(&spec, stop_ids),
        max_context: engine.max_context,
        next: AtomicUsize::new(0),
        next_seed: AtomicU64::new(spec.seed),
    };
    let (job, done) = spawn_job::<TrainSample>(JobArgs {
        job: job_id.clone(),
        env,
        policy: Arc::new(chat),
        judge: Arc::new(judge),
        builder: Arc::new(super::samples::SharedBuilder(Arc::new(builder))),
        trainer: Arc::new(trainer.clone()),
        recorder: Some(rec.clone()),
        settings: job_settings(&spec, Duration::from_millis(200)),
        progress: Some(progress.clone()),
        done: None,
    })
    .await
    .map_err(actor_err("job supervisor"))?;
    *lock(&supervisor) = Some(job.clone());
    if stop.load(Ordering::Relaxed) {
        let _ = job.cast(JobMsg::Stop);
    }
    trainer
        .cast(TrainerMsg::Subscribe(step_records(job.clone()), None))
        .map_err(actor_err("trainer"))?;

    let counts = done.await.map_err(|_| RunError::Lost)?;
    match ractor::call_t!(trainer, TrainerMsg::Checkpoint, 600_000) {
        Ok(Ok(p)) => tracing::info!(job = %job_id, "final checkpoint {}", p.display()),
        Ok(Err(e)) => tracing::warn!(job = %job_id, "final checkpoint: {e}"),
        Err(e) => tracing::warn!(job = %job_id, "final checkpoint: {e}"),
    }
    let _ = rec.flush().await;
    trainer.stop(None);
    if let Some(t) = &teacher {
        t.stop(None);
    }
    pool.release().await;
    let _ = recorder
        .stop_and_wait(None, Some(Duration::from_secs(60)))
        .await;
    Ok(counts)
}

/// Sends `counts` to Control as job `id`'s progress, retrying a while (the final counts must
/// arrive, or Control would run the job again).
async fn report(id: &str, counts: &JobCounts, attempts: u32) -> bool {
    for _ in 0..attempts {
        let req = ControlRequest::Progress {
            id: id.to_string(),
            counts: Box::new(counts.clone()),
        };
        match control_call(&req).await {
            Ok(ControlReply::Jobs(_)) => return true,
            Ok(ControlReply::Error(e)) => {
                tracing::warn!("reporting {id} to Control: {e}");
                return false;
            }
            Err(e) => tracing::debug!("reporting {id} to Control: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// A job this node runs.
struct Running {
    stop: Arc<AtomicBool>,
    supervisor: Arc<Mutex<Option<ActorRef<JobMsg<TrainSample>>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn stop(&self) {
        if !self.stop.swap(true, Ordering::Relaxed) {
            if let Some(j) = lock(&self.supervisor).as_ref() {
                let _ = j.cast(JobMsg::Stop);
            }
        }
    }
}

/// The job runner of a trainer node (see the module docs).
pub struct JobRunner;

impl JobRunner {
    /// Starts the runner's loop on `node`; run directories go under `data_dir/jobs`.
    pub fn start(node: Node, data_dir: PathBuf) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut running: HashMap<String, Running> = HashMap::new();
            loop {
                tokio::time::sleep(RUNNER_POLL).await;
                running.retain(|_, r| !r.task.is_finished());
                let jobs = match control_call(&ControlRequest::List).await {
                    Ok(ControlReply::Jobs(j)) => j,
                    _ => continue,
                };
                for j in jobs {
                    let mine = j.placement.trainer.as_deref() == Some(node.name());
                    if let Some(r) = running.get(&j.id) {
                        if j.state == PlacedState::Cancelled || !mine {
                            r.stop();
                        }
                        continue;
                    }
                    if !mine || !j.is_active() || j.state == PlacedState::Waiting {
                        continue;
                    }
                    running.insert(j.id.clone(), Self::launch(&node, &data_dir, j));
                }
            }
        })
    }

    fn launch(node: &Node, data_dir: &std::path::Path, record: JobRecord) -> Running {
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = Arc::new(Mutex::new(None));
        let out = data_dir.join("jobs").join(&record.id);
        let (node, s, sup) = (node.clone(), stop.clone(), supervisor.clone());
        tracing::info!(job = %record.id, "running job {} here ({})", record.id, out.display());
        let task = tokio::spawn(async move {
            let id = record.id.clone();
            // Progress goes to Control in order, at most about once a second.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<JobCounts>();
            let reporter_id = id.clone();
            let reporter = tokio::spawn(async move {
                while let Some(mut c) = rx.recv().await {
                    while let Ok(newer) = rx.try_recv() {
                        c = newer;
                    }
                    report(&reporter_id, &c, 1).await;
                    tokio::time::sleep(Duration::from_millis(1000)).await;
                }
            });
            let progress: ProgressReport = Arc::new(move |c: &JobCounts| {
                if c.phase != JobPhase::Finished {
                    let _ = tx.send(c.clone());
                }
            });
            let result = run_placed_job(&node, &record, out, progress, s, sup).await;
            reporter.abort();
            let counts = match result {
                Ok(c) => {
                    tracing::info!(
                        job = %id,
                        "finished: {} turns, {} steps, version {}",
                        c.turns,
                        c.trainer.steps,
                        c.trainer.version
                    );
                    c
                }
                Err(e) => {
                    let why = format!("the job could not run on node {}: {e}", node.name());
                    tracing::error!(job = %id, "{why}");
                    JobCounts {
                        phase: JobPhase::Finished,
                        last_error: Some(why.clone()),
                        gave_up: Some(why),
                        ..Default::default()
                    }
                }
            };
            if !report(&id, &counts, 120).await {
                tracing::error!(job = %id, "Control never took the final counts");
            }
        });
        Running {
            stop,
            supervisor,
            task,
        }
    }
}

/// Why a node's job services could not start.
#[derive(Debug, thiserror::Error)]
#[error("starting the {what}: {message}")]
pub struct ServicesError {
    what: String,
    message: String,
}

/// Starts what a `clawrl node` runs for jobs, by its roles: a [`RolloutHost`] (`rollout`), an
/// [`EnvHost`] per environment kind of `envs`, and the [`JobRunner`] (`trainer`).
pub async fn start_node_services(
    node: &Node,
    config: &NodeConfig,
    envs: &[EnvSpec],
) -> Result<(), ServicesError> {
    let err = |what: String| {
        move |e: ractor::SpawnErr| ServicesError {
            what,
            message: e.to_string(),
        }
    };
    if config.has_role(Role::Rollout) {
        let what = format!("{}/rollout", node.name());
        Actor::spawn(
            Some(what.clone()),
            RolloutHost,
            RolloutHostArgs {
                source: Arc::new(node.bulk().clone()),
            },
        )
        .await
        .map_err(err(what))?;
    }
    let mut kinds: Vec<&str> = envs.iter().map(|e| e.kind.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    for kind in kinds {
        let what = format!("{}/envhost.{kind}", node.name());
        Actor::spawn(
            Some(what.clone()),
            EnvHost,
            EnvHostArgs {
                kind: kind.to_string(),
            },
        )
        .await
        .map_err(err(what))?;
    }
    if config.has_role(Role::Trainer) {
        JobRunner::start(node.clone(), config.data_dir.clone());
    }
    Ok(())
}
