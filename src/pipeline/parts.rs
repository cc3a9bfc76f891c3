//! What every job is built from, whatever produces its turns: the policy checkpoint loaded into
//! a learner ([`LoadedPolicy`]), then [`JobParts`]: the job's `Recorder` (and its TensorBoard
//! tap), the OPD teacher when the method uses hints, the `Trainer` actor with every subscriber,
//! and the job supervisor over the judge and the method's sample builder. Its
//! [`finish`](JobParts::finish) writes the final checkpoint and gives the trainer's and
//! recorder's counters.
//!
//! The three job runners differ only in what serves the policy and where turns come from:
//! - the local job ([`super::run_job`]): rollout workers in-process, sessions over an
//!   environment;
//! - the job across nodes ([`super::distributed::run_placed_job`]): rollout hosts on other
//!   nodes, sessions over remote environment hosts;
//! - the `personal` job ([`super::gateway_job::run_gateway_job`]): the gateway serves, and the
//!   turns its clients complete are offered to the supervisor.
//!
//! Order, and why: the serving side is created from the [`LoadedPolicy`] first, because the
//! trainer publishes its first version to the subscribers it starts with; the teacher subscribes
//! last; the supervisor starts once the teacher serves (its first judged turn may need it).

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use clawrl_actors::loops::{
    spawn_job, JobArgs, JobCounts, JobMsg, ProgressReport, Recorder, RecorderConfig,
    RecorderHandle, RecorderMsg, RecorderStats, RolloutMsg, Subscriber, TrainSample, Trainer,
    TrainerArgs, TrainerMsg, TrainerStats, TurnJudge, TurnSource, WeightPublisher,
};
use ractor::{Actor, ActorRef};
use tokio::sync::oneshot;

use super::{
    actor_err, build_builder, build_judge, job_settings, learner, samples, spawn_teacher,
    step_kinds, step_records, train_config, trainer_config, wait_serving, RunError,
};
use crate::job::JobSpec;
use crate::model::checkpoint::load_model_as;
use crate::model::{
    load_checkpoint_in, ChatTemplate, EngineOptions, LinearLayout, LoraWeights, Qwen3, Qwen3Config,
};
use crate::serve::VersionWeights;
use crate::train::learner::BurnLearner;
use crate::CpuBackend;

/// The policy checkpoint of a spec, loaded: what the serving side is built from, and the
/// learner the trainer will own.
pub struct LoadedPolicy<AB: AutodiffBackend> {
    /// `policy.checkpoint`, resolved against the spec's directory.
    pub ckpt_dir: PathBuf,
    /// The checkpoint's tokenizer.
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    /// Its chat template.
    pub template: Arc<ChatTemplate>,
    /// The token ids that end a response.
    pub stop_ids: Vec<u32>,
    /// The learner's (float32) model config: replicas load exported versions with it.
    pub model_config: Qwen3Config,
    /// The generation engine's options from `[policy]`.
    pub engine: EngineOptions,
    learner: BurnLearner<AB>,
}

impl<AB: AutodiffBackend> LoadedPolicy<AB> {
    /// Loads `policy.checkpoint` on `device` into a learner with the spec's optimiser settings;
    /// with `policy.lora`, a fresh adapter seeded by the spec's seed is attached and only it
    /// trains.
    pub fn load(spec: &JobSpec, device: AB::Device) -> Result<Self, RunError> {
        let mut loaded = Self::load_many(spec, device, 1)?;
        Ok(loaded.remove(0))
    }

    /// `count` learners over one load of `policy.checkpoint` (one per agent of
    /// `policy.agents`): with `policy.lora`, each gets its own fresh adapter (all seeded by the
    /// spec's seed, so every agent starts from the same policy) over the checkpoint's tensors,
    /// which they share, frozen, rather than copy.
    pub fn load_many(
        spec: &JobSpec,
        device: AB::Device,
        count: usize,
    ) -> Result<Vec<Self>, RunError> {
        let ckpt_dir = spec.resolve(&spec.policy.checkpoint);
        // A LoRA job's base is frozen, and the job's engine decodes from the learner's own
        // tensors: they are kept as decoding wants them. Whole weights train, so they stay
        // `[in, out]`.
        let layout = match spec.policy.lora {
            Some(_) => LinearLayout::decoding::<AB::InnerBackend>(),
            None => LinearLayout::InOut,
        };
        let ck = load_checkpoint_in::<AB>(&ckpt_dir, &device, layout).map_err(|e| {
            RunError::Checkpoint {
                path: ckpt_dir.clone(),
                message: e.to_string(),
            }
        })?;
        let stop_ids = ck.stop_token_ids();
        let tokenizer = Arc::new(ck.tokenizer);
        let template = Arc::new(ck.chat_template);
        let engine = super::engine_options(spec);
        let mut loaded = Vec::with_capacity(count);
        for _ in 0..count {
            let model = match &spec.policy.lora {
                None => ck.model.clone(),
                Some(lora) => ck
                    .model
                    .clone()
                    .with_lora(&LoraWeights::fresh(lora, &ck.config, spec.seed))
                    .map_err(|e| RunError::Checkpoint {
                        path: ckpt_dir.clone(),
                        message: format!("attaching the adapter of `policy.lora`: {e}"),
                    })?,
            };
            let learner = BurnLearner::new(
                ck.config.clone(),
                model,
                train_config(spec),
                device.clone(),
                spec.seed,
            );
            loaded.push(LoadedPolicy {
                ckpt_dir: ckpt_dir.clone(),
                tokenizer: tokenizer.clone(),
                template: template.clone(),
                stop_ids: stop_ids.clone(),
                model_config: learner.model_config().clone(),
                engine,
                learner,
            });
        }
        Ok(loaded)
    }

    /// The learner's weights as they start (version 0), for a serving side in this process: its
    /// tensors are the learner's, shared rather than copied.
    pub fn serving_model(&self) -> Qwen3<AB::InnerBackend> {
        self.learner.policy().valid()
    }

    /// [`version_weights`](Self::version_weights) for a reader on the CPU whatever device the
    /// learner uses (the OPD teacher): with `policy.lora`, the learner's own base when the
    /// learner is on the CPU too (shared, as the serving side shares it: the base is frozen),
    /// else a copy of the base read from the checkpoint under the learner's config.
    pub fn cpu_version_weights(&self) -> Result<VersionWeights<CpuBackend>, RunError> {
        let shared: Box<dyn Any> = Box::new(self.version_weights());
        if let Ok(weights) = shared.downcast::<VersionWeights<CpuBackend>>() {
            return Ok(*weights);
        }
        match self.learner.policy().valid().lora_config() {
            None => Ok(VersionWeights::Full),
            Some(config) => {
                let base = load_model_as::<CpuBackend>(
                    &self.ckpt_dir,
                    &self.model_config,
                    &Default::default(),
                )
                .map_err(|e| RunError::Checkpoint {
                    path: self.ckpt_dir.clone(),
                    message: e.to_string(),
                })?;
                Ok(VersionWeights::Adapter {
                    base: Box::new(base),
                    config,
                })
            }
        }
    }

    /// What the serving side reads weight versions as: whole weights, or with `policy.lora`,
    /// adapters over the learner's frozen base (its tensors shared, not copied).
    pub fn version_weights(&self) -> VersionWeights<AB::InnerBackend> {
        let policy = self.learner.policy().valid();
        match policy.lora_config() {
            None => VersionWeights::Full,
            Some(config) => VersionWeights::Adapter {
                base: Box::new(policy.without_lora()),
                config,
            },
        }
    }
}

/// A job's recorder, teacher and trainer, running (see the module docs).
pub struct JobParts {
    spec: JobSpec,
    file: String,
    job_id: String,
    out: PathBuf,
    ckpt_dir: PathBuf,
    engine: EngineOptions,
    /// The job's records (`<out>/records`).
    pub rec: RecorderHandle,
    recorder: ActorRef<RecorderMsg>,
    /// The trainer.
    pub trainer: ActorRef<TrainerMsg>,
    teacher: Option<ActorRef<RolloutMsg<samples::TeacherScorer>>>,
}

/// What a finished job's parts report.
pub struct Finished {
    /// The final checkpoint, when one was written.
    pub final_checkpoint: Option<PathBuf>,
    /// The trainer's counters at the end.
    pub trainer: TrainerStats,
    /// The recorder's counters at the end.
    pub records: RecorderStats,
}

impl JobParts {
    /// Starts the recorder (records and TensorBoard scalars under `out`), the OPD teacher when
    /// the method uses hints, and the trainer over `policy`'s learner, publishing through
    /// `publisher` to `subscribers` (the serving side) and the teacher; returns once the teacher
    /// serves. Checkpoints go to `<out>/checkpoints`, and the trainer resumes from the newest.
    pub async fn start<AB: AutodiffBackend>(
        spec: &JobSpec,
        file: &str,
        job_id: &str,
        out: &Path,
        policy: LoadedPolicy<AB>,
        publisher: Arc<dyn WeightPublisher>,
        mut subscribers: Vec<Subscriber>,
    ) -> Result<Self, RunError> {
        let (recorder, _) = Actor::spawn(
            None,
            Recorder,
            RecorderConfig::new(out.join("records"), job_id),
        )
        .await
        .map_err(actor_err("recorder"))?;
        let rec = ractor::call_t!(recorder, RecorderMsg::Handle, 10_000)
            .map_err(actor_err("recorder"))?;
        if let Err(e) = crate::watch::scalars::tap_recorder(&rec, out).await {
            recorder.stop(None);
            return Err(e.into());
        }
        let teacher = match spawn_teacher(
            spec,
            file,
            &policy.model_config,
            || policy.cpu_version_weights(),
            &policy.template,
            &policy.tokenizer,
            &mut subscribers,
        )
        .await
        {
            Ok(t) => t,
            Err(e) => {
                recorder.stop(None);
                return Err(e);
            }
        };
        let spawned = Actor::spawn(
            None,
            Trainer::new(),
            TrainerArgs {
                config: trainer_config(spec, job_id, out),
                learner: learner::PolicyLearner::new(
                    policy.learner,
                    spec.optim
                        .keep_checkpoints
                        .unwrap_or(crate::job::DEFAULT_KEEP_CHECKPOINTS)
                        as usize,
                ),
                publisher,
                subscribers,
            },
        )
        .await;
        let trainer = match spawned {
            Ok((t, _)) => t,
            Err(e) => {
                if let Some(t) = &teacher {
                    t.stop(None);
                }
                recorder.stop(None);
                return Err(actor_err("trainer")(e));
            }
        };
        let parts = JobParts {
            spec: spec.clone(),
            file: file.to_string(),
            job_id: job_id.to_string(),
            out: out.to_path_buf(),
            ckpt_dir: policy.ckpt_dir,
            engine: policy.engine,
            rec,
            recorder,
            trainer,
            teacher,
        };
        if let Some(t) = &parts.teacher {
            if let Err(e) = wait_serving(std::slice::from_ref(t), "OPD teacher").await {
                parts.abort();
                return Err(e);
            }
        }
        Ok(parts)
    }

    /// Starts the job supervisor over `source`, with the spec's judge, the method's sample
    /// builder (and the teacher), and its stop condition; every trainer step is recorded (kind
    /// `trainer_step`). The receiver gets the final counts.
    pub async fn spawn_job(
        &self,
        source: TurnSource,
        progress: Option<ProgressReport>,
        poll: Duration,
    ) -> Result<(ActorRef<JobMsg<TrainSample>>, oneshot::Receiver<JobCounts>), RunError> {
        self.spawn_job_judged_by(source, progress, poll, None).await
    }

    /// [`spawn_job`](Self::spawn_job) with `judge` judging the turns instead of the spec's
    /// judge built here (a job home without the `judge` role: the judge hosts').
    pub async fn spawn_job_judged_by(
        &self,
        source: TurnSource,
        progress: Option<ProgressReport>,
        poll: Duration,
        judge: Option<Arc<dyn TurnJudge>>,
    ) -> Result<(ActorRef<JobMsg<TrainSample>>, oneshot::Receiver<JobCounts>), RunError> {
        let judge: Arc<dyn TurnJudge> = match judge {
            Some(j) => j,
            None => Arc::new(build_judge(
                &self.spec,
                &self.file,
                &self.ckpt_dir,
                self.engine,
                step_kinds(&self.spec).1,
            )?),
        };
        let builder = build_builder(&self.spec, &self.job_id, self.teacher.clone())?;
        let mut settings = job_settings(&self.spec, poll);
        if matches!(source, TurnSource::Offered) {
            // Offered turns are one-turn episodes the job never holds back.
            settings.admission = None;
            settings.group_size = None;
        }
        let (job, done) = spawn_job::<TrainSample>(JobArgs {
            job: self.job_id.clone(),
            source,
            judge,
            builder: Arc::new(samples::SharedBuilder(Arc::new(builder))),
            trainer: Arc::new(self.trainer.clone()),
            recorder: Some(self.rec.clone()),
            settings,
            progress,
            done: None,
        })
        .await
        .map_err(actor_err("job supervisor"))?;
        self.trainer
            .cast(TrainerMsg::Subscribe(step_records(job.clone()), None))
            .map_err(actor_err("trainer"))?;
        Ok((job, done))
    }

    /// Stops the trainer, the teacher and the recorder without a final checkpoint (a job that
    /// could not start).
    pub fn abort(&self) {
        self.trainer.stop(None);
        if let Some(t) = &self.teacher {
            t.stop(None);
        }
        self.recorder.stop(None);
    }

    /// Writes the final checkpoint (a failure is logged: the checkpoints the trainer wrote
    /// before stand), reads the trainer's counters, stops the trainer and the teacher, and
    /// drains the recorder to disk.
    pub async fn finish(self) -> Result<Finished, RunError> {
        let job = &self.job_id;
        let final_checkpoint = match ractor::call_t!(self.trainer, TrainerMsg::Checkpoint, 600_000)
        {
            Ok(Ok(p)) => {
                tracing::info!(job = %job, "final checkpoint {}", p.display());
                Some(p)
            }
            Ok(Err(e)) => {
                tracing::warn!(job = %job, "final checkpoint: {e}");
                None
            }
            Err(e) => {
                tracing::warn!(job = %job, "final checkpoint: {e}");
                None
            }
        };
        let trainer = ractor::call_t!(self.trainer, TrainerMsg::Stats, 60_000);
        self.trainer.stop(None);
        if let Some(t) = &self.teacher {
            t.stop(None);
        }
        let _ = self.rec.flush().await;
        let records = self.rec.stats();
        let _ = self
            .recorder
            .stop_and_wait(None, Some(Duration::from_secs(60)))
            .await;
        Ok(Finished {
            final_checkpoint,
            trainer: trainer.map_err(actor_err("trainer"))?,
            records,
        })
    }

    /// The run directory.
    pub fn out(&self) -> &Path {
        &self.out
    }
}
