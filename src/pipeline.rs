//! The training pipeline: one job's four loops wired together in-process, from a [`JobSpec`].
//!
//! Every job is assembled from [`parts`] (the policy loaded into a learner, the recorder, the OPD
//! teacher, the trainer and the job supervisor); the runners differ in what serves the policy
//! and where turns come from. [`run_job`] is the local one: the environment (the `scripted` kind
//! here; terminal, SWE, tool-call and GUI through `crate::env::build_environment`), `replicas`
//! rollout workers over the generation engine that install every new version the trainer
//! publishes without pausing, and sessions run by the supervisor to the stop condition. It
//! returns a [`RunReport`] with counts that balance.
//!
//! Modules: [`parts`] (the assembly), [`policy`] (the chat policy over the replica pool),
//! [`judge`] (the judge adapter), [`samples`] (samples per method, the teacher), [`learner`]
//! (the trainer's learner), [`gateway_job`] (the `personal` job), [`distributed`] (the job
//! across nodes).

pub mod distributed;
pub mod fit;
pub mod gateway_job;
pub mod judge;
pub mod learner;
pub mod parts;
pub mod policy;
pub mod samples;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl_actors::loops::{
    rollout_subscriber, AdmissionSettings, Delivery, Environment, JobCounts, JobMsg, JobSettings,
    LocalPublisher, ProgressReport, RecorderStats, RolloutArgs, RolloutMsg, RolloutStats,
    RolloutWorker, StalenessMode, StopCondition, Subscriber, TrainSample, TrainerConfig,
    TrainerEvent, TrainerStats, TurnSource,
};
use futures::future::BoxFuture;
use ractor::{Actor, ActorRef};
use serde::{Deserialize, Serialize};

use crate::env::EnvKind;
use crate::job::{JobKind, JobSpec, JudgeBackend, StalenessPolicy};
use crate::judge::{
    BackendConfig, ChatGenerator, EngineGenerator, JudgeConfig, ModelSource, OpdConfig, PromptKind,
    Teacher, VoteSettings,
};
use crate::model::{EngineOptions, SamplingParams};
use crate::rl::{AdvantageWeights, EpisodeKind};
use crate::serve::{EnginePolicy, VersionWeights};
use crate::train::TrainConfig;
use crate::{CpuAutodiff, CpuBackend};
use parts::{JobParts, LoadedPolicy};

/// Why a job could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The spec cannot be used as it is.
    #[error(transparent)]
    Spec(#[from] crate::job::JobSpecError),
    /// The environment could not be built.
    #[error("env.tasks {tasks} (env.kind `{kind}`): {message}")]
    Env {
        /// The kind.
        kind: EnvKind,
        /// The task file.
        tasks: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The policy checkpoint could not be loaded.
    #[error("policy.checkpoint {path}: {message}")]
    Checkpoint {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The first task's prompt does not fit the policy's context.
    #[error(transparent)]
    PromptFit(#[from] fit::FitError),
    /// The judge could not be built.
    #[error("judge: {0}")]
    Judge(String),
    /// The node does not allow the endpoint or key variable the spec's judge asks for.
    #[error(transparent)]
    JudgeAccess(#[from] crate::judge::JudgeAccessError),
    /// An actor could not start or answer.
    #[error("starting the {what}: {message}")]
    Actor {
        /// Which actor.
        what: &'static str,
        /// What went wrong.
        message: String,
    },
    /// The job ended without its final counts (its supervisor died).
    #[error("the job supervisor stopped without a summary")]
    Lost,
    /// The TensorBoard scalars could not be set up.
    #[error(transparent)]
    Scalars(#[from] crate::watch::scalars::TapError),
}

fn actor_err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> RunError {
    move |e| RunError::Actor {
        what,
        message: e.to_string(),
    }
}

/// The OPD teacher of a job whose method uses hints (`None` otherwise): a rollout worker whose
/// "generation" scores the original response under the hint-enhanced prompt (and gives its
/// top-k with `method.opd_loss = "topk"`, after checking `method.topk` against the policy's
/// vocabulary; `file` names the spec). With `teacher = current_policy` it installs every
/// published version (a subscriber is added); with `frozen_initial` only the first.
pub(crate) async fn spawn_teacher(
    spec: &JobSpec,
    file: &str,
    model_config: &crate::model::Qwen3Config,
    weights: impl FnOnce() -> Result<VersionWeights<CpuBackend>, RunError>,
    template: &Arc<crate::model::ChatTemplate>,
    tokenizer: &Arc<tokenizers::Tokenizer>,
    subscribers: &mut Vec<Subscriber>,
) -> Result<Option<ActorRef<RolloutMsg<samples::TeacherScorer>>>, RunError> {
    if !spec.method.kind.uses_hints() {
        return Ok(None);
    }
    spec.method.check_topk(model_config.vocab_size, file)?;
    let scorer = samples::TeacherScorer::new(
        model_config.clone(),
        weights()?,
        template.clone(),
        tokenizer.clone(),
        spec.method.topk(),
    );
    let (w, _) = Actor::spawn(
        None,
        RolloutWorker::new(),
        RolloutArgs {
            policy: Arc::new(scorer),
            source: None,
            initial: None,
        },
    )
    .await
    .map_err(actor_err("OPD teacher"))?;
    match spec.judge.teacher {
        Teacher::CurrentPolicy => {
            subscribers.push(rollout_subscriber(w.clone(), Delivery::Install))
        }
        Teacher::FrozenInitial => {
            // Only the version at start: a subscriber that leaves after the first version.
            let once = w.clone();
            subscribers.push(Arc::new(move |ev: &TrainerEvent| match ev {
                TrainerEvent::Published {
                    announce, bytes, ..
                } => {
                    let _ = once.cast(RolloutMsg::Install(announce.clone(), bytes.clone(), None));
                    false
                }
                _ => true,
            }));
        }
    }
    Ok(Some(w))
}

/// How [`run_job`] runs.
pub struct RunOptions {
    /// The run directory (records, checkpoints).
    pub out: PathBuf,
    /// The job id (names sessions, records and samples).
    pub job_id: String,
    /// Called with the counts as the job runs.
    pub progress: Option<ProgressReport>,
    /// How often counts are polled.
    pub poll: Duration,
}

/// What a finished job reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    /// The job id.
    pub job: String,
    /// The method.
    pub method: String,
    /// The job's counts.
    pub counts: JobCounts,
    /// The trainer's final counters.
    pub trainer: TrainerStats,
    /// Each rollout worker's counters.
    pub replicas: Vec<RolloutStats>,
    /// The recorder's counters.
    pub records: RecorderStats,
    /// Where the records are.
    pub records_dir: PathBuf,
    /// Where checkpoints are.
    pub checkpoint_dir: PathBuf,
    /// The final checkpoint, when one was written.
    pub final_checkpoint: Option<PathBuf>,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// Turns per second over the run.
    pub turns_per_s: f64,
}

/// Builds the environment a spec names, its work dirs under the temp dir
/// ([`build_env_in`] with no work root).
pub fn build_env(spec: &JobSpec) -> Result<Arc<dyn Environment>, RunError> {
    build_env_in(spec, None)
}

/// Builds the environment a spec names; its work dirs go in a fresh private directory under
/// `work_root` (a node's data dir or the run dir; `None`: the temp dir), see
/// [`crate::env::EnvOptions::work_root`].
pub fn build_env_in(
    spec: &JobSpec,
    work_root: Option<&Path>,
) -> Result<Arc<dyn Environment>, RunError> {
    let tasks = spec.resolve(&spec.env.tasks);
    let err = |message: String| RunError::Env {
        kind: spec.env.kind,
        tasks: tasks.clone(),
        message,
    };
    let options = crate::env::EnvOptions {
        max_steps: spec.env.max_steps,
        episode_deadline: episode_deadline(spec),
        // GUI: as many ready browsers as sessions run at once (at most 8), so that the first
        // wave and every replacement session start without a launch.
        warm_browsers: (spec.env.parallelism as usize).clamp(1, 8),
        work_root: work_root.map(Path::to_path_buf),
        ..Default::default()
    };
    crate::env::build_environment(spec.env.kind, &tasks, options).map_err(|e| err(e.to_string()))
}

fn episode_deadline(spec: &JobSpec) -> Duration {
    Duration::from_secs_f64(spec.env.episode_timeout_s.unwrap_or(600.0))
}

/// The step-reward formula and step prompt for the environment's kind.
fn step_kinds(spec: &JobSpec) -> (EpisodeKind, PromptKind) {
    let by_env = match (spec.kind, spec.env.kind) {
        // A personal job's turns are a conversation with tools, outcome-free.
        (JobKind::Personal, _) | (JobKind::Rl, EnvKind::Scripted) => {
            (EpisodeKind::General, PromptKind::StepToolCall)
        }
        (JobKind::Rl, EnvKind::Terminal) => (EpisodeKind::Terminal, PromptKind::StepTerminal),
        (JobKind::Rl, EnvKind::Gui) => (EpisodeKind::Gui, PromptKind::StepGui),
        (JobKind::Rl, EnvKind::Swe) => (EpisodeKind::Swe, PromptKind::StepSwe),
        (JobKind::Rl, EnvKind::ToolCall) => (EpisodeKind::ToolCall, PromptKind::StepToolCall),
    };
    (spec.method.step_reward.unwrap_or(by_env.0), by_env.1)
}

/// The judge config a spec describes.
pub fn judge_config(spec: &JobSpec, file: &str) -> Result<JudgeConfig, RunError> {
    let j = &spec.judge;
    let backend = match j.backend {
        JudgeBackend::Scripted => BackendConfig::Scripted(spec.scripted_config(file)?),
        JudgeBackend::Openai => {
            let v = serde_json::json!({
                "url": j.endpoint,
                "model": j.model,
                "api_key_env": j.api_key_env,
                "request_timeout_ms": (j.timeout_s * 1000.0) as u64,
            });
            BackendConfig::Openai(
                serde_json::from_value(v).map_err(|e| RunError::Judge(e.to_string()))?,
            )
        }
        JudgeBackend::Model => BackendConfig::Model {
            source: match &j.checkpoint {
                Some(p) => ModelSource::Checkpoint {
                    path: spec.resolve(p),
                },
                None => ModelSource::FrozenInitial,
            },
        },
    };
    let method = spec.method.kind;
    let votes = VoteSettings {
        m: if method.uses_eval() {
            j.votes as usize
        } else {
            0
        },
        hint_m: if method.uses_hints() {
            j.hint_votes.unwrap_or(j.votes) as usize
        } else {
            0
        },
        temperature: j.temperature,
        max_tokens: j.max_tokens,
        hint_max_tokens: j.hint_max_tokens,
        step_aggregation: j.step_aggregation.unwrap_or(crate::rl::Aggregation::Mean),
        vote_timeout_ms: (j.timeout_s * 1000.0) as u64,
        seed: Some(spec.seed),
        ..VoteSettings::default()
    };
    Ok(JudgeConfig {
        backend,
        votes,
        prompts: j.prompts.clone(),
        opd: OpdConfig {
            teacher: j.teacher.clone(),
            w_binary: spec.method.w_binary as f32,
            w_opd: spec.method.w_opd as f32,
        },
    })
}

/// The trainer's settings for a spec.
pub fn trainer_config(spec: &JobSpec, job_id: &str, out: &Path) -> TrainerConfig {
    let o = &spec.optim;
    TrainerConfig {
        batch_size: o.batch_size as usize,
        max_lag: o.staleness as u64,
        staleness: match o.staleness_mode {
            StalenessPolicy::Drop => StalenessMode::Drop,
            StalenessPolicy::Importance => StalenessMode::Importance {
                cap: o.importance_cap.unwrap_or(2.0),
            },
        },
        checkpoint_every: o.checkpoint_every.unwrap_or(0),
        checkpoint_dir: Some(out.join("checkpoints")),
        // Exactly `stop.max_steps` steps: samples beyond stay pending (and journaled).
        max_steps: spec.stop.max_steps,
        ..TrainerConfig::new(job_id)
    }
}

/// The optimiser settings for a spec.
pub fn train_config(spec: &JobSpec) -> TrainConfig {
    let o = &spec.optim;
    TrainConfig {
        lr: o.lr,
        eps_clip: o.clip,
        eps_clip_high: o.clip_high,
        kl_coef: o.kl,
        batch_size: o.batch_size as usize,
        opd_loss: spec.method.opd_loss,
        pack_prefixes: o.pack_prefixes,
        recompute_activations: o.recompute_activations,
        ..TrainConfig::default()
    }
}

/// The job supervisor's settings for a spec.
pub fn job_settings(spec: &JobSpec, poll: Duration) -> JobSettings {
    let s = &spec.stop;
    JobSettings {
        parallelism: spec.env.parallelism as usize,
        episode_deadline: episode_deadline(spec),
        max_episode_steps: spec.env.max_steps,
        judge_timeout: Duration::from_secs_f64(spec.judge.timeout_s),
        judge_concurrency: spec.judge.concurrency as usize,
        max_restarts: 3,
        seed: spec.seed,
        stop: StopCondition {
            max_trainer_steps: s.max_steps,
            max_turns: s.max_turns,
            max_samples: s.max_samples,
            max_duration: s.max_hours.map(|h| Duration::from_secs_f64(h * 3600.0)),
        },
        poll,
        // A held turn waits at most a quarter of its episode's time.
        admission: spec.max_backlog().map(|max_backlog| AdmissionSettings {
            max_backlog,
            batch_size: spec.optim.batch_size as u64,
            max_wait: episode_deadline(spec) / 4,
        }),
        group_size: spec.group_size(),
    }
}

/// Waits until every worker serves some version (the trainer's start version).
pub(crate) async fn wait_serving<P: clawrl_actors::loops::PolicyReplica>(
    workers: &[ActorRef<RolloutMsg<P>>],
    what: &'static str,
) -> Result<(), RunError> {
    let deadline = Instant::now() + Duration::from_secs(300);
    for w in workers {
        loop {
            let stats =
                ractor::call_t!(w, RolloutMsg::Stats, 10_000).map_err(|e| RunError::Actor {
                    what,
                    message: e.to_string(),
                })?;
            if stats.version.is_some() {
                break;
            }
            if let Some(e) = stats.last_update_error {
                return Err(RunError::Actor {
                    what,
                    message: format!("loading the first version: {e}"),
                });
            }
            if Instant::now() > deadline {
                return Err(RunError::Actor {
                    what,
                    message: "no weight version installed within 300 s".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// The sample builder of the job's method (with the OPD teacher, for `opd` and `combined`).
pub(crate) fn build_builder(
    spec: &JobSpec,
    job_id: &str,
    teacher: Option<ActorRef<RolloutMsg<samples::TeacherScorer>>>,
) -> Result<samples::MethodBuilder, RunError> {
    let (step_kind, _) = step_kinds(spec);
    Ok(samples::MethodBuilder::new(
        job_id.to_string(),
        spec.method.kind,
        AdvantageWeights {
            w_binary: spec.method.w_binary as f32,
            w_opd: spec.method.w_opd as f32,
        },
        teacher,
        step_kind,
    )
    .map_err(RunError::Judge)?
    .with_process_weight(spec.method.process_weight()))
}

/// The engine a job's `[policy]` sizes: the policy's, and a `model` judge's.
pub(crate) fn engine_options(spec: &JobSpec) -> EngineOptions {
    let p = &spec.policy;
    EngineOptions {
        max_batch: p.max_batch as usize,
        max_context: p.max_context as usize,
        prefix_cache_bytes: (p.prefix_cache_mib as usize) << 20,
    }
}

/// The judge of a job as a node without its policy builds it (a `judge` node): the spec's
/// checkpoint for a `model` backend, its engine sized by `[policy]`, and the step prompt of the
/// job's kind, as the job home would build it.
pub(crate) fn build_job_judge(
    spec: &JobSpec,
    file: &str,
) -> Result<judge::PipelineJudge, RunError> {
    let (_, step_prompt) = step_kinds(spec);
    build_judge(
        spec,
        file,
        &spec.resolve(&spec.policy.checkpoint),
        engine_options(spec),
        step_prompt,
    )
}

/// The judge of a job (every kind): `[judge]` built into a [`crate::judge::Judge`] (the
/// `model` backend's frozen-initial generator loaded from `ckpt_dir`) behind the
/// [`judge::PipelineJudge`] adapter of the method, step-judging with `step_prompt`.
pub(crate) fn build_judge(
    spec: &JobSpec,
    file: &str,
    ckpt_dir: &Path,
    engine: EngineOptions,
    step_prompt: PromptKind,
) -> Result<judge::PipelineJudge, RunError> {
    let jc = judge_config(spec, file)?;
    let generator: Option<Arc<dyn ChatGenerator>> = match &jc.backend {
        BackendConfig::Model {
            source: ModelSource::FrozenInitial,
        } => {
            let g = EngineGenerator::load(ckpt_dir, engine, spec.seed).map_err(|e| {
                RunError::Judge(format!(
                    "loading the frozen initial policy as the judge: {e}"
                ))
            })?;
            Some(Arc::new(g))
        }
        _ => None,
    };
    let judge = jc
        .build(generator)
        .map_err(|e| RunError::Judge(e.to_string()))?;
    Ok(judge::PipelineJudge::new(
        judge,
        spec.method.kind,
        step_prompt,
    ))
}

/// The sampling parameters sessions generate with (`seed` is the base of per-request seeds).
pub(crate) fn sampling_params(spec: &JobSpec, stop_token_ids: Vec<u32>) -> SamplingParams {
    let p = &spec.policy;
    SamplingParams {
        temperature: p.temperature(),
        top_p: p.top_p(),
        top_k: 0,
        max_new_tokens: p.max_new_tokens() as usize,
        stop_token_ids,
        stop_strings: Vec::new(),
        seed: spec.seed,
    }
}

/// A trainer subscriber writing every step to the job's records (kind `trainer_step`), and
/// making the job poll the trainer at once (its admission control sees the step).
pub(crate) fn step_records(job: ActorRef<JobMsg<TrainSample>>) -> Subscriber {
    Arc::new(move |ev: &TrainerEvent| match ev {
        TrainerEvent::Step(e) => {
            job.cast(JobMsg::Record {
                version: e.version,
                kind: "trainer_step".into(),
                record: serde_json::to_value(e).unwrap_or_default(),
            })
            .is_ok()
                && job.cast(JobMsg::Tick).is_ok()
        }
        _ => true,
    })
}

/// Runs a job to its stop condition.
pub fn run_job<'a>(
    spec: &'a JobSpec,
    file: &'a str,
    options: RunOptions,
) -> BoxFuture<'a, Result<RunReport, RunError>> {
    // Boxed here, so the future's body is compiled once, in this crate: a caller in another
    // crate that awaited the `async fn` itself would compile the whole body again.
    Box::pin(run_job_body(spec, file, options))
}

async fn run_job_body(
    spec: &JobSpec,
    file: &str,
    options: RunOptions,
) -> Result<RunReport, RunError> {
    let started = Instant::now();
    let job_id = options.job_id.clone();
    let out = options.out.clone();
    // The run dir is this job's data: its work dirs go there rather than in the shared temp dir.
    let env = build_env_in(spec, Some(&out))?;
    let policy = LoadedPolicy::<CpuAutodiff>::load(spec, Default::default())?;
    // Sequences get the smaller of `policy.max_context` and the checkpoint's positions; the
    // first task's prompt must fit it, or no session could ever run.
    let max_context = fit::effective_context(
        spec.policy.max_context as usize,
        policy.model_config.max_position_embeddings,
    );
    fit::check_first_prompt(
        env.as_ref(),
        &policy.template,
        &policy.tokenizer,
        spec.policy.max_context as usize,
        policy.model_config.max_position_embeddings,
        spec.seed,
    )
    .await?;

    // Rollout workers (they get their first version from the trainer).
    let mut replicas = Vec::new();
    for _ in 0..spec.policy.replicas() {
        let engine_policy = EnginePolicy::<CpuBackend>::with_weights(
            policy.model_config.clone(),
            policy.version_weights(),
            Some(policy.tokenizer.clone()),
            policy.engine,
            Default::default(),
        );
        let (w, _) = Actor::spawn(
            None,
            RolloutWorker::new(),
            RolloutArgs {
                policy: Arc::new(engine_policy),
                source: None,
                initial: None,
            },
        )
        .await
        .map_err(actor_err("rollout worker"))?;
        replicas.push(w);
    }
    let subscribers: Vec<Subscriber> = replicas
        .iter()
        .map(|w| rollout_subscriber(w.clone(), Delivery::Install))
        .collect();
    let chat = policy::ChatPolicy::new(
        replicas.clone(),
        policy.template.clone(),
        policy.tokenizer.clone(),
        sampling_params(spec, policy.stop_ids.clone()),
        max_context,
        Duration::from_secs(600),
    );
    let stop_replicas = |replicas: &[ActorRef<RolloutMsg<EnginePolicy<CpuBackend>>>]| {
        for w in replicas {
            w.stop(None);
        }
    };
    let publisher = Arc::new(LocalPublisher {
        source: "local".into(),
    });
    let parts =
        match JobParts::start(spec, file, &job_id, &out, policy, publisher, subscribers).await {
            Ok(p) => p,
            Err(e) => {
                stop_replicas(&replicas);
                return Err(e);
            }
        };
    let spawned = match wait_serving(&replicas, "rollout worker").await {
        Ok(()) => {
            parts
                .spawn_job(
                    TurnSource::Sessions {
                        env,
                        policy: Arc::new(chat),
                    },
                    options.progress.clone(),
                    options.poll,
                )
                .await
        }
        Err(e) => Err(e),
    };
    let done = match spawned {
        Ok((_, done)) => done,
        Err(e) => {
            parts.abort();
            stop_replicas(&replicas);
            return Err(e);
        }
    };
    let counts = done.await.map_err(|_| RunError::Lost)?;

    let mut replica_stats = Vec::new();
    for w in &replicas {
        if let Ok(s) = ractor::call_t!(w, RolloutMsg::Stats, 10_000) {
            replica_stats.push(s);
        }
    }
    let finished = parts.finish().await;
    stop_replicas(&replicas);
    let finished = finished?;
    let wall_s = started.elapsed().as_secs_f64();
    Ok(RunReport {
        job: job_id,
        method: spec.method.kind.name().into(),
        turns_per_s: counts.turns as f64 / wall_s.max(1e-9),
        counts,
        trainer: finished.trainer,
        replicas: replica_stats,
        records: finished.records,
        records_dir: out.join("records"),
        checkpoint_dir: out.join("checkpoints"),
        final_checkpoint: finished.final_checkpoint,
        wall_s,
    })
}
