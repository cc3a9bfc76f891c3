//! The training pipeline: one job's four loops wired together in-process, from a [`JobSpec`].
//!
//! [`run_job`] builds, from the spec: the environment (the `scripted` kind here; terminal, SWE
//! and tool-call through `crate::env::build_environment`), a learner over the policy checkpoint
//! inside the `Trainer` actor (checkpoints and resume under `<out>/checkpoints`), `replicas`
//! rollout workers over the generation engine that install every new version the trainer
//! publishes without pausing, the judge ([`judge::PipelineJudge`]), the sample builder of the
//! method ([`samples::MethodBuilder`], with an OPD teacher worker when the method needs one),
//! the job's `Recorder` (JSONL under `<out>/records`, rotated per weight version), and the job
//! supervisor that runs sessions to the stop condition. It returns a [`RunReport`] with counts
//! that balance.
//!
//! Modules: [`policy`] (the chat policy over the replica pool), [`judge`] (the judge adapter),
//! [`samples`] (samples per method, the teacher).

pub mod distributed;
pub mod fit;
pub mod gateway_job;
pub mod judge;
pub mod learner;
pub mod policy;
pub mod samples;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl_actors::loops::{
    rollout_subscriber, spawn_job, AdmissionSettings, Delivery, Environment, JobArgs, JobCounts,
    JobMsg, JobSettings, LocalPublisher, ProgressReport, Recorder, RecorderConfig, RecorderMsg,
    RecorderStats, RolloutArgs, RolloutMsg, RolloutStats, RolloutWorker, StalenessMode,
    StopCondition, Subscriber, TrainSample, Trainer, TrainerArgs, TrainerConfig, TrainerEvent,
    TrainerMsg, TrainerStats,
};
use ractor::{Actor, ActorRef};
use serde::{Deserialize, Serialize};

use crate::job::{JobSpec, JudgeBackend, StalenessPolicy};
use crate::judge::{
    BackendConfig, ChatGenerator, EngineGenerator, JudgeConfig, ModelSource, OpdConfig, PromptKind,
    Teacher, VoteSettings,
};
use crate::model::{load_checkpoint, EngineOptions, SamplingParams};
use crate::rl::{AdvantageWeights, EpisodeKind};
use crate::serve::EnginePolicy;
use crate::train::learner::Learner as BurnLearner;
use crate::train::TrainConfig;
use crate::{CpuAutodiff, CpuBackend};

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
        kind: String,
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
        kind: spec.env.kind.clone(),
        tasks: tasks.clone(),
        message,
    };
    match spec.env.kind.as_str() {
        "scripted" => Ok(Arc::new(
            crate::env::scripted::ScriptedEnv::load(&tasks).map_err(|e| err(e.to_string()))?,
        )),
        kind => {
            let kind = if kind == "toolcall" {
                "tool_call"
            } else {
                kind
            };
            let options = crate::env::EnvOptions {
                max_steps: spec.env.max_steps,
                episode_deadline: episode_deadline(spec),
                // GUI: as many ready browsers as sessions run at once (at most 8), so that the
                // first wave and every replacement session start without a launch.
                warm_browsers: (spec.env.parallelism as usize).clamp(1, 8),
                work_root: work_root.map(Path::to_path_buf),
                ..Default::default()
            };
            crate::env::build_environment(kind, &tasks, options).map_err(|e| err(e.to_string()))
        }
    }
}

fn episode_deadline(spec: &JobSpec) -> Duration {
    Duration::from_secs_f64(spec.env.episode_timeout_s.unwrap_or(600.0))
}

/// The step-reward formula and step prompt for the environment's kind.
fn step_kinds(spec: &JobSpec) -> (EpisodeKind, PromptKind) {
    let by_env = match spec.env.kind.as_str() {
        "terminal" => (EpisodeKind::Terminal, PromptKind::StepTerminal),
        "gui" => (EpisodeKind::Gui, PromptKind::StepGui),
        "swe" => (EpisodeKind::Swe, PromptKind::StepSwe),
        "tool_call" | "toolcall" => (EpisodeKind::ToolCall, PromptKind::StepToolCall),
        _ => (EpisodeKind::General, PromptKind::StepToolCall),
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

/// The judge and the sample builder of a job's method (with the OPD `teacher` when the method
/// uses hints).
pub(crate) fn build_judging(
    spec: &JobSpec,
    file: &str,
    ckpt_dir: &Path,
    engine: EngineOptions,
    job_id: &str,
    teacher: Option<ActorRef<RolloutMsg<samples::TeacherScorer>>>,
) -> Result<(judge::PipelineJudge, samples::MethodBuilder), RunError> {
    let (step_kind, step_prompt) = step_kinds(spec);
    let judge = build_judge(spec, file, ckpt_dir, engine, step_prompt)?;
    let builder = samples::MethodBuilder::new(
        job_id.to_string(),
        spec.method.kind,
        AdvantageWeights {
            w_binary: spec.method.w_binary as f32,
            w_opd: spec.method.w_opd as f32,
        },
        teacher,
        step_kind,
    )
    .map_err(RunError::Judge)?;
    Ok((judge, builder))
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
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: 0,
        max_new_tokens: p.max_new_tokens as usize,
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

/// Checkpoints kept under `<out>/checkpoints`.
const KEEP_CHECKPOINTS: usize = 3;

/// Runs a job to its stop condition.
pub async fn run_job(
    spec: &JobSpec,
    file: &str,
    options: RunOptions,
) -> Result<RunReport, RunError> {
    let started = Instant::now();
    let job_id = options.job_id.clone();
    let out = options.out.clone();
    // The run dir is this job's data: its work dirs go there rather than in the shared temp dir.
    let env = build_env_in(spec, Some(&out))?;

    // The policy: tokenizer, template, and the learner's weights.
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
    let learner = BurnLearner::new(ck.config, ck.model, train_config(spec), device, spec.seed);
    let model_config = learner.model_config().clone();
    // Sequences get the smaller of `policy.max_context` and the checkpoint's positions; the
    // first task's prompt must fit it, or no session could ever run.
    let max_context = fit::effective_context(
        spec.policy.max_context as usize,
        model_config.max_position_embeddings,
    );
    fit::check_first_prompt(
        env.as_ref(),
        &template,
        &tokenizer,
        spec.policy.max_context as usize,
        model_config.max_position_embeddings,
        spec.seed,
    )
    .await?;

    // Records.
    let records_dir = out.join("records");
    let (recorder, _) = Actor::spawn(None, Recorder, RecorderConfig::new(&records_dir, &job_id))
        .await
        .map_err(|e| RunError::Actor {
            what: "recorder",
            message: e.to_string(),
        })?;
    let rec =
        ractor::call_t!(recorder, RecorderMsg::Handle, 10_000).map_err(|e| RunError::Actor {
            what: "recorder",
            message: e.to_string(),
        })?;
    crate::watch::scalars::tap_recorder(&rec, &out).await?;

    // Rollout workers (they get their first version from the trainer).
    let p = &spec.policy;
    let engine = EngineOptions {
        max_batch: p.max_batch as usize,
        max_context: p.max_context as usize,
        prefix_cache_bytes: (p.prefix_cache_mib as usize) << 20,
    };
    let mut replicas = Vec::new();
    for _ in 0..p.replicas {
        let policy = EnginePolicy::<CpuBackend>::new(
            model_config.clone(),
            Some(tokenizer.clone()),
            engine,
            Default::default(),
        );
        let (w, _) = Actor::spawn(
            None,
            RolloutWorker::new(),
            RolloutArgs {
                policy: Arc::new(policy),
                source: None,
                initial: None,
            },
        )
        .await
        .map_err(actor_err("rollout worker"))?;
        replicas.push(w);
    }
    let mut subscribers: Vec<Subscriber> = replicas
        .iter()
        .map(|w| rollout_subscriber(w.clone(), Delivery::Install))
        .collect();

    // The OPD teacher.
    let method = spec.method.kind;
    let teacher = spawn_teacher(
        spec,
        file,
        &model_config,
        &template,
        &tokenizer,
        &mut subscribers,
    )
    .await?;

    // The trainer.
    let (trainer, _) = Actor::spawn(
        None,
        Trainer::new(),
        TrainerArgs {
            config: trainer_config(spec, &job_id, &out),
            learner: learner::PolicyLearner::new(learner, KEEP_CHECKPOINTS),
            publisher: Arc::new(LocalPublisher {
                source: "local".into(),
            }),
            subscribers,
        },
    )
    .await
    .map_err(actor_err("trainer"))?;
    wait_serving(&replicas, "rollout worker").await?;
    if let Some(t) = &teacher {
        wait_serving(std::slice::from_ref(t), "OPD teacher").await?;
    }

    // The judge and the method's sample builder.
    let (judge, builder) = build_judging(spec, file, &ckpt_dir, engine, &job_id, teacher.clone())?;

    // The policy sessions use.
    let params = sampling_params(spec, stop_ids);
    let chat = policy::ChatPolicy::new(
        replicas.clone(),
        template.clone(),
        tokenizer.clone(),
        params,
        max_context,
        Duration::from_secs(600),
    );

    let (job, done) = spawn_job::<TrainSample>(JobArgs {
        job: job_id.clone(),
        env,
        policy: Arc::new(chat),
        judge: Arc::new(judge),
        builder: Arc::new(samples::SharedBuilder(Arc::new(builder))),
        trainer: Arc::new(trainer.clone()),
        recorder: Some(rec.clone()),
        settings: job_settings(spec, options.poll),
        progress: options.progress.clone(),
        done: None,
    })
    .await
    .map_err(actor_err("job supervisor"))?;

    // Trainer steps go to the job's records.
    trainer
        .cast(TrainerMsg::Subscribe(step_records(job.clone()), None))
        .map_err(|e| RunError::Actor {
            what: "trainer",
            message: e.to_string(),
        })?;

    let counts = done.await.map_err(|_| RunError::Lost)?;

    // Final checkpoint, counters, shutdown (the recorder drains on stop).
    let final_checkpoint = match ractor::call_t!(trainer, TrainerMsg::Checkpoint, 600_000) {
        Ok(Ok(p)) => Some(p),
        Ok(Err(e)) => {
            tracing::warn!("final checkpoint: {e}");
            None
        }
        Err(e) => {
            tracing::warn!("final checkpoint: {e}");
            None
        }
    };
    let trainer_stats =
        ractor::call_t!(trainer, TrainerMsg::Stats, 60_000).map_err(|e| RunError::Actor {
            what: "trainer",
            message: e.to_string(),
        })?;
    let mut replica_stats = Vec::new();
    for w in &replicas {
        if let Ok(s) = ractor::call_t!(w, RolloutMsg::Stats, 10_000) {
            replica_stats.push(s);
        }
    }
    trainer.stop(None);
    for w in &replicas {
        w.stop(None);
    }
    if let Some(t) = &teacher {
        t.stop(None);
    }
    let _ = rec.flush().await;
    let records = rec.stats();
    let _ = recorder
        .stop_and_wait(None, Some(Duration::from_secs(60)))
        .await;
    let wall_s = started.elapsed().as_secs_f64();
    Ok(RunReport {
        job: job_id,
        method: method.name().into(),
        turns_per_s: counts.turns as f64 / wall_s.max(1e-9),
        counts,
        trainer: trainer_stats,
        replicas: replica_stats,
        records,
        records_dir,
        checkpoint_dir: out.join("checkpoints"),
        final_checkpoint,
        wall_s,
    })
}
