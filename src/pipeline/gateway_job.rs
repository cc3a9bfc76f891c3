//! The `personal` job kind: the OpenAI-compatible gateway ([`crate::gateway`]) serves the policy,
//! and the conversations it records train it, live (docs/design.md §4).
//!
//! [`run_gateway_job`] builds, from the spec: the learner inside the `Trainer` actor (as
//! [`super::run_job`]: checkpoints and resume under `<out>/checkpoints`), the gateway over the
//! same checkpoint with [`GatewayPolicy::trainer_subscriber`] registered on the trainer (every
//! published version is installed while serving, never paused), the judge
//! ([`super::judge::PipelineJudge`]), the sample builder of the method
//! ([`super::samples::MethodBuilder`], with the OPD teacher when the method needs one) and the
//! job's `Recorder` (`<out>/records`). Every completed main turn the gateway records (next state
//! arrived, or a session's last turn at `X-Session-Done` / idle timeout / shutdown, per the
//! gateway's `on_session_end`) is handed over by [`crate::gateway::Gateway::tap_turns`], judged,
//! built into samples as a one-turn episode and cast to the trainer. Side turns are never
//! recorded by the gateway, so never trained on. The job stops at `[stop]` (`max_steps`,
//! `max_samples`, `max_hours`) or when `shutdown` resolves (Ctrl-C); then the gateway stops
//! (its open sessions end and their last turns are judged), every turn in hand is finished, the
//! trainer's step in flight completes and a final checkpoint is written.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::{AutodiffBackend, Backend};
use clawrl_actors::loops::{
    Action, EndReason, EpisodeTurns, JobCounts, JobPhase, JobSample, JudgedTurn, Judgement,
    LocalPublisher, Observation, PolicyTurn, ProgressReport, Recorder, RecorderConfig,
    RecorderHandle, RecorderMsg, RecorderStats, SampleBuilder, StepOutcome, Subscriber,
    ToolCallAction, Trainer, TrainerArgs, TrainerEvent, TrainerLink, TrainerMsg, TrainerStats,
    Turn, TurnJudge,
};
use ractor::{Actor, ActorRef};
use serde::Serialize;
use serde_json::Value;

use super::{
    actor_err, build_judge, samples, train_config, trainer_config, wait_serving, RunError,
    KEEP_CHECKPOINTS,
};
#[cfg(feature = "cuda")]
use crate::device::CudaAutodiff;
use crate::device::{Device, DeviceError};
use crate::gateway::{Gateway, GatewayConfig, GatewayError, PolicyStats, TurnEnd, TurnRecord};
use crate::job::{JobKind, JobSpec};
use crate::judge::PromptKind;
use crate::model::Qwen3;
use crate::model::{load_checkpoint, EngineOptions};
use crate::rl::{AdvantageWeights, EpisodeKind};
use crate::train::learner::Learner as BurnLearner;
use crate::CpuAutodiff;

/// The task id the gateway's one-turn episodes carry.
pub const GATEWAY_TASK: &str = "gateway";

/// Why a personal job could not run.
#[derive(Debug, thiserror::Error)]
pub enum GatewayJobError {
    /// The spec is not a `personal` job.
    #[error("job spec {file}: kind is not \"personal\"")]
    NotPersonal {
        /// The spec file.
        file: String,
    },
    /// Building the pipeline failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The gateway could not start or serve.
    #[error("gateway: {0}")]
    Gateway(#[from] GatewayError),
    /// `[policy] device` cannot be used.
    #[error("policy.device: {0}")]
    Device(#[from] DeviceError),
    /// The listen address cannot be bound.
    #[error("gateway.listen {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// Called once the gateway listens, with its address and model name.
pub type OnListening = Box<dyn FnOnce(SocketAddr, &str) + Send>;

/// How [`run_gateway_job`] runs.
pub struct GatewayJobOptions {
    /// The run directory (records, checkpoints, the gateway's turn files when its `data_dir`
    /// is relative).
    pub out: PathBuf,
    /// The job id (names records and samples).
    pub job_id: String,
    /// Called with the counts as the job runs.
    pub progress: Option<ProgressReport>,
    /// How often counts are polled and the stop condition checked.
    pub poll: Duration,
    /// Called once the gateway listens.
    pub on_listening: Option<OnListening>,
}

/// What a finished personal job reports.
#[derive(Clone, Debug, Serialize)]
pub struct GatewayJobReport {
    /// The job id.
    pub job: String,
    /// The method's name.
    pub method: String,
    /// Where the gateway listened.
    pub addr: String,
    /// The model id it served.
    pub model: String,
    /// Why the job stopped (`max_steps`, `max_samples`, `max_hours`, `interrupted`).
    pub stopped_by: String,
    /// The job's counters (`turns`: main turns recorded; `sessions_started`: distinct sessions).
    pub counts: JobCounts,
    /// Of `turns`, those with a next state.
    pub turns_with_next_state: u64,
    /// The trainer's counters at the end.
    pub trainer: TrainerStats,
    /// The gateway's weight versions at the end.
    pub gateway: PolicyStats,
    /// The recorder's counters.
    pub records: RecorderStats,
    /// Where records are.
    pub records_dir: PathBuf,
    /// Where the gateway's turn files are.
    pub turns_dir: PathBuf,
    /// The final checkpoint, if one was written.
    pub final_checkpoint: Option<PathBuf>,
    /// Wall time in seconds.
    pub wall_s: f64,
}

impl GatewayJobReport {
    /// Whether produced = trained + dropped_stale + failed + pending.
    pub fn balanced(&self) -> bool {
        let t = &self.trainer;
        t.produced == t.trained + t.dropped_stale + t.failed + t.pending
    }
}

/// The gateway config a spec describes: `[gateway]` (or the defaults), a relative `data_dir`
/// under the run directory.
pub fn gateway_config(spec: &JobSpec, out: &Path) -> GatewayConfig {
    let mut cfg = spec.gateway.clone().unwrap_or_default();
    if cfg.data_dir.is_relative() {
        cfg.data_dir = out.join(&cfg.data_dir);
    }
    cfg
}

/// A recorded gateway turn as the judge and the sample builder see it: `s_t` = the request's
/// messages and tools, `a_t` = the exact sampled ids; the action is the message the gateway
/// served (its content and tool calls, with the call ids the client saw and answers with), the
/// response text those ids decoded with special tokens kept (a tokenizer may mark `<tool_call>`
/// special) less a final special stop token; `s_{t+1}` = the next main request's last message,
/// if any.
pub fn turn_of(rec: &TurnRecord, index: u32, tokenizer: &tokenizers::Tokenizer) -> Turn {
    let array = |v: Option<Value>| match v {
        Some(Value::Array(a)) => a,
        _ => Vec::new(),
    };
    let messages = array(serde_json::to_value(&rec.messages).ok());
    let tools = array(
        rec.tools
            .as_ref()
            .and_then(|t| serde_json::to_value(t).ok()),
    );
    let served = super::judge::content_text(&rec.response);
    let raw = tokenizer
        .decode(&rec.response_ids, false)
        .unwrap_or_else(|_| served.clone());
    let ends_on_special = rec.finish_reason != "length"
        && rec.response_ids.last().is_some_and(|id| {
            tokenizer
                .get_added_tokens_decoder()
                .get(id)
                .is_some_and(|t| t.special)
        });
    let text = super::policy::served_text(tokenizer, &rec.response_ids, ends_on_special)
        .unwrap_or_else(|_| raw.clone());
    let instruction = messages
        .iter()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(super::judge::content_text)
        .unwrap_or_default();
    let ended = matches!(rec.end, Some(TurnEnd::SessionDone | TurnEnd::IdleTimeout));
    Turn {
        session_id: rec.session_id.clone(),
        task_id: GATEWAY_TASK.into(),
        task_index: 0,
        instruction,
        turn: index,
        observation: Observation {
            messages,
            tools,
            template_kwargs: rec.template_kwargs.clone(),
        },
        policy: PolicyTurn {
            action: served_action(&rec.response, raw),
            prompt_ids: rec.prompt_ids.clone(),
            response_ids: rec.response_ids.clone(),
            logprobs: rec.logprobs.clone(),
            version: rec.version,
            prompt_text: rec.prompt_text.clone(),
            response_text: text,
        },
        outcome: StepOutcome {
            next_state: if rec.next_messages.is_empty() {
                rec.next_state.clone().into_iter().collect()
            } else {
                rec.next_messages.clone()
            },
            done: ended,
            outcome: None,
            info: serde_json::json!({ "end": rec.end, "finish_reason": rec.finish_reason }),
        },
    }
}

/// The assistant message the gateway served, as an [`Action`]: its text content and its
/// OpenAI tool calls (ids as served; arguments parsed from their JSON text, kept as a string
/// when they are not JSON).
fn served_action(response: &Value, raw: String) -> Action {
    let tool_calls = response
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let function = c.get("function");
                    let field = |k: &str| {
                        function
                            .and_then(|f| f.get(k))
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string()
                    };
                    let arguments = field("arguments");
                    ToolCallAction {
                        id: c
                            .get("id")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                        name: field("name"),
                        arguments: serde_json::from_str(&arguments)
                            .unwrap_or(Value::String(arguments)),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    Action {
        content: super::judge::content_text(response),
        tool_calls,
        raw,
    }
}

#[derive(Default)]
struct Counters {
    turns: AtomicU64,
    with_next_state: AtomicU64,
    judged: AtomicU64,
    unjudged: AtomicU64,
    votes_failed: AtomicU64,
    votes_truncated: AtomicU64,
    built: AtomicU64,
    build_errors: AtomicU64,
    submitted: AtomicU64,
    refused: AtomicU64,
    records_failed: AtomicU64,
    sessions: Mutex<HashSet<String>>,
    last_error: Mutex<Option<String>>,
}

impl Counters {
    fn error(&self, e: String) {
        tracing::error!("personal job: {e}");
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    }

    fn snapshot(&self, phase: JobPhase, started: Instant, rec: &RecorderHandle) -> JobCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let r = rec.stats();
        JobCounts {
            phase,
            elapsed_ms: started.elapsed().as_millis() as u64,
            sessions_started: self
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len() as u64,
            turns: l(&self.turns),
            judged: l(&self.judged),
            unjudged: l(&self.unjudged),
            votes_failed: l(&self.votes_failed),
            votes_truncated: l(&self.votes_truncated),
            episodes_built: l(&self.built),
            build_errors: l(&self.build_errors),
            samples_submitted: l(&self.submitted),
            samples_refused: l(&self.refused),
            records_written: r.written,
            records_waited: r.waited_full,
            records_failed: l(&self.records_failed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            ..JobCounts::default()
        }
    }
}

struct Ctx {
    judge: super::judge::PipelineJudge,
    builder: samples::SharedBuilder,
    trainer: ActorRef<TrainerMsg>,
    rec: RecorderHandle,
    counters: Counters,
    judge_timeout: Duration,
}

impl Ctx {
    async fn record(&self, version: u64, kind: &str, value: &Value) {
        if let Err(e) = self.rec.record(version, kind, value).await {
            self.counters.records_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("personal job: {kind} record not written: {e}");
        }
    }

    /// Judges one turn, builds its samples and hands them to the trainer.
    async fn handle(&self, turn: Turn) {
        let c = &self.counters;
        let judgement =
            match tokio::time::timeout(self.judge_timeout, self.judge.judge(&turn)).await {
                Ok(Ok(j)) => j,
                Ok(Err(e)) => Judgement::unjudged(&turn, e),
                Err(_) => Judgement::unjudged(&turn, "the judge timed out"),
            };
        if judgement.unjudged.is_some() {
            c.unjudged.fetch_add(1, Ordering::Relaxed);
        } else {
            c.judged.fetch_add(1, Ordering::Relaxed);
        }
        c.votes_failed
            .fetch_add(judgement.failed_votes.into(), Ordering::Relaxed);
        c.votes_truncated
            .fetch_add(judgement.truncated_votes.into(), Ordering::Relaxed);
        let episode = EpisodeTurns {
            session_id: turn.session_id.clone(),
            task_id: GATEWAY_TASK.into(),
            group: None,
            reason: EndReason::Done { outcome: None },
            turns: vec![JudgedTurn { turn, judgement }],
        };
        let episodes = Arc::new(vec![episode]);
        let teacher = match self.builder.build(episodes.clone()).await {
            Ok(built) => {
                c.built.fetch_add(1, Ordering::Relaxed);
                for s in &built.samples {
                    self.record(s.version(), "sample", &s.record()).await;
                }
                let n = built.samples.len() as u64;
                if n > 0 {
                    match self.trainer.submit(built.samples) {
                        Ok(()) => {
                            c.submitted.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) => {
                            c.refused.fetch_add(n, Ordering::Relaxed);
                            c.error(format!("the trainer refused {n} samples: {e}"));
                        }
                    }
                }
                built.teacher_versions
            }
            Err(e) => {
                c.build_errors.fetch_add(1, Ordering::Relaxed);
                c.error(format!("building samples: {e}"));
                HashMap::new()
            }
        };
        let jt = &episodes[0].turns[0];
        let mut record = jt.judgement.record.clone();
        if let (Some(v), Some(obj)) = (
            teacher.get(&(jt.turn.session_id.clone(), jt.turn.turn)),
            record.as_object_mut(),
        ) {
            obj.insert("teacher_version".into(), (*v).into());
        }
        self.record(jt.turn.policy.version, "judge", &record).await;
    }
}

/// Runs a `personal` job until its stop condition or `shutdown`, on `[policy] device`.
pub async fn run_gateway_job(
    spec: &JobSpec,
    file: &str,
    options: GatewayJobOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<GatewayJobReport, GatewayJobError> {
    if spec.kind != JobKind::Personal {
        return Err(GatewayJobError::NotPersonal { file: file.into() });
    }
    match spec.policy.device {
        Device::Cpu => {
            run_on::<CpuAutodiff>(spec, file, options, shutdown, Default::default()).await
        }
        #[cfg(feature = "cuda")]
        cuda @ Device::Cuda(_) => {
            let device = cuda.cuda()?;
            run_on::<CudaAutodiff>(spec, file, options, shutdown, device).await
        }
        #[cfg(not(feature = "cuda"))]
        cuda @ Device::Cuda(_) => Err(DeviceError::CudaNotBuilt(cuda).into()),
    }
}

/// [`run_gateway_job`] with the learner on autodiff backend `AB` and the gateway's copy of the
/// policy on its inner backend, both on `device`.
async fn run_on<AB>(
    spec: &JobSpec,
    file: &str,
    options: GatewayJobOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
    device: AB::Device,
) -> Result<GatewayJobReport, GatewayJobError>
where
    AB: AutodiffBackend,
    AB::InnerBackend: Backend<Device = AB::Device>,
    Qwen3<AB::InnerBackend>: Send + Sync,
    AB::Device: Send + Sync,
{
    let started = Instant::now();
    let job_id = options.job_id.clone();
    let out = options.out.clone();
    let method = spec.method.kind;

    // The learner's copy of the policy.
    let ckpt_dir = spec.resolve(&spec.policy.checkpoint);
    let ck_err = |e: crate::model::LoadError| RunError::Checkpoint {
        path: ckpt_dir.clone(),
        message: e.to_string(),
    };
    let ck = load_checkpoint::<AB>(&ckpt_dir, &device).map_err(ck_err)?;
    let tokenizer = Arc::new(ck.tokenizer);
    let template = Arc::new(ck.chat_template);
    let learner = BurnLearner::new(
        ck.config,
        ck.model,
        train_config(spec),
        device.clone(),
        spec.seed,
    );
    let model_config = learner.model_config().clone();

    // The gateway's copy, serving version 0 until the trainer publishes.
    let cfg = gateway_config(spec, &out);
    let turns_dir = cfg.data_dir.clone();
    let listen = cfg.listen;
    let serve_ck = load_checkpoint::<AB::InnerBackend>(&ckpt_dir, &device).map_err(ck_err)?;
    let default_name = ckpt_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "clawrl".into());
    let record_queue = cfg.record_queue;
    let gateway = Gateway::new(serve_ck, cfg, &default_name)?;
    let model = gateway.model_name().to_string();
    let gateway_policy = gateway.policy();
    let mut tap = gateway
        .tap_turns(record_queue)
        .expect("a new gateway is not tapped");

    // Records.
    let records_dir = out.join("records");
    let (recorder, _) = Actor::spawn(None, Recorder, RecorderConfig::new(&records_dir, &job_id))
        .await
        .map_err(actor_err("recorder"))?;
    let rec =
        ractor::call_t!(recorder, RecorderMsg::Handle, 10_000).map_err(actor_err("recorder"))?;
    crate::watch::scalars::tap_recorder(&rec, &out)
        .await
        .map_err(RunError::from)?;

    // The OPD teacher.
    let engine = EngineOptions {
        max_batch: spec.policy.max_batch as usize,
        max_context: spec.policy.max_context as usize,
        prefix_cache_bytes: (spec.policy.prefix_cache_mib as usize) << 20,
    };
    let mut subscribers: Vec<Subscriber> = vec![gateway_policy.trainer_subscriber()];
    let teacher = super::spawn_teacher(
        spec,
        file,
        &model_config,
        &template,
        &tokenizer,
        &mut subscribers,
    )
    .await?;

    // The trainer; its steps go to the records.
    let (trainer, _) = Actor::spawn(
        None,
        Trainer::new(),
        TrainerArgs {
            config: trainer_config(spec, &job_id, &out),
            learner: super::learner::PolicyLearner::new(learner, KEEP_CHECKPOINTS),
            publisher: Arc::new(LocalPublisher {
                source: "local".into(),
            }),
            subscribers,
        },
    )
    .await
    .map_err(actor_err("trainer"))?;
    let steps_rec = rec.clone();
    let steps: Subscriber = Arc::new(move |ev: &TrainerEvent| {
        if let TrainerEvent::Step(e) = ev {
            if let Err(err) = steps_rec.try_record(e.version, "trainer_step", e) {
                tracing::warn!("trainer_step record not written: {err}");
            }
        }
        true
    });
    trainer
        .cast(TrainerMsg::Subscribe(steps, None))
        .map_err(actor_err("trainer"))?;
    if let Some(t) = &teacher {
        wait_serving(std::slice::from_ref(t), "OPD teacher").await?;
    }

    // The judge and the method.
    let judge = build_judge(spec, file, &ckpt_dir, engine, PromptKind::StepToolCall)?;
    let builder = samples::MethodBuilder::new(
        job_id.clone(),
        method,
        AdvantageWeights {
            w_binary: spec.method.w_binary as f32,
            w_opd: spec.method.w_opd as f32,
        },
        teacher.clone(),
        EpisodeKind::General,
    )
    .map_err(RunError::Judge)?;
    let ctx = Arc::new(Ctx {
        judge,
        builder: samples::SharedBuilder(Arc::new(builder)),
        trainer: trainer.clone(),
        rec: rec.clone(),
        counters: Counters::default(),
        judge_timeout: Duration::from_secs_f64(spec.judge.timeout_s),
    });

    // Serve.
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| GatewayJobError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| GatewayJobError::Bind {
            addr: listen,
            source,
        })?;
    gateway.dashboard_run(&out);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.serve(listener, async move {
        let _ = stop_rx.await;
    }));
    if let Some(f) = options.on_listening {
        f(addr, &model);
    }

    // Completed main turns → judge → samples → trainer, `judge.concurrency` at once.
    let consumer = {
        let ctx = ctx.clone();
        let tokenizer = tokenizer.clone();
        let limit = Arc::new(tokio::sync::Semaphore::new(
            spec.judge.concurrency.max(1) as usize
        ));
        tokio::spawn(async move {
            let mut index: HashMap<String, u32> = HashMap::new();
            let mut tasks = tokio::task::JoinSet::new();
            while let Some(rec) = tap.recv().await {
                let c = &ctx.counters;
                c.turns.fetch_add(1, Ordering::Relaxed);
                if rec.next_state.is_some() {
                    c.with_next_state.fetch_add(1, Ordering::Relaxed);
                }
                c.sessions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(rec.session_id.clone());
                let i = index.entry(rec.session_id.clone()).or_insert(0);
                let turn = turn_of(&rec, *i, &tokenizer);
                *i += 1;
                let permit = limit.clone().acquire_owned().await.expect("never closed");
                let ctx = ctx.clone();
                tasks.spawn(async move {
                    ctx.handle(turn).await;
                    drop(permit);
                });
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    };

    // Wait for the stop condition or the shutdown signal.
    let stop = &spec.stop;
    let max_duration = stop.max_hours.map(|h| Duration::from_secs_f64(h * 3600.0));
    tokio::pin!(shutdown);
    let stopped_by = loop {
        tokio::select! {
            _ = &mut shutdown => break "interrupted",
            _ = tokio::time::sleep(options.poll) => {}
        }
        let mut counts = ctx.counters.snapshot(JobPhase::Running, started, &rec);
        match trainer.counts().await {
            Ok(t) => counts.trainer = t,
            Err(e) => ctx.counters.error(e),
        }
        if let Some(p) = &options.progress {
            p(&counts);
        }
        if stop.max_steps.is_some_and(|m| counts.trainer.steps >= m) {
            break "max_steps";
        }
        if stop
            .max_samples
            .is_some_and(|m| counts.samples_submitted >= m)
        {
            break "max_samples";
        }
        if max_duration.is_some_and(|d| started.elapsed() >= d) {
            break "max_hours";
        }
    };

    // Drain: stop serving (open sessions end, their last turns come through the tap), finish
    // every turn in hand, let the step in flight complete, checkpoint.
    if let Some(p) = &options.progress {
        let mut c = ctx.counters.snapshot(JobPhase::Draining, started, &rec);
        if let Ok(t) = trainer.counts().await {
            c.trainer = t;
        }
        p(&c);
    }
    let _ = stop_tx.send(());
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => ctx.counters.error(format!("the gateway stopped: {e}")),
        Err(e) => ctx.counters.error(format!("the gateway task failed: {e}")),
    }
    if let Err(e) = consumer.await {
        ctx.counters.error(format!("the turn consumer failed: {e}"));
    }
    if let Err(e) = ractor::call_t!(trainer, TrainerMsg::Idle, 600_000) {
        ctx.counters.error(format!("waiting for the trainer: {e}"));
    }
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
        ractor::call_t!(trainer, TrainerMsg::Stats, 60_000).map_err(actor_err("trainer"))?;
    // Versions published at the very end reach the gateway's policy handle too.
    let gateway_stats = gateway_policy.stats();
    trainer.stop(None);
    if let Some(t) = &teacher {
        t.stop(None);
    }
    let _ = rec.flush().await;
    let records = rec.stats();
    let mut counts = ctx.counters.snapshot(JobPhase::Finished, started, &rec);
    counts.trainer = clawrl_actors::loops::TrainerCounts {
        produced: trainer_stats.produced,
        trained: trainer_stats.trained,
        dropped_stale: trainer_stats.dropped_stale,
        failed: trainer_stats.failed,
        pending: trainer_stats.pending,
        version: trainer_stats.version,
        steps: trainer_stats.steps,
    };
    counts.records_written = records.written;
    let _ = recorder
        .stop_and_wait(None, Some(Duration::from_secs(60)))
        .await;
    if let Some(p) = &options.progress {
        p(&counts);
    }
    Ok(GatewayJobReport {
        job: job_id,
        method: method.name().into(),
        addr: addr.to_string(),
        model,
        stopped_by: stopped_by.into(),
        turns_with_next_state: ctx.counters.with_next_state.load(Ordering::Relaxed),
        counts,
        trainer: trainer_stats,
        gateway: gateway_stats,
        records,
        records_dir,
        turns_dir,
        final_checkpoint,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> tokenizers::Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/qwen3-tiny/tokenizer.json"
        );
        tokenizers::Tokenizer::from_file(path).expect("the fixture tokenizer")
    }

    fn record(tokenizer: &tokenizers::Tokenizer, text: &str, response: Value) -> TurnRecord {
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        TurnRecord {
            session_id: "s".into(),
            version: 3,
            model: "m".into(),
            messages: minijinja::Value::from_serialize(
                serde_json::json!([{"role": "user", "content": "list files"}]),
            ),
            tools: None,
            template_kwargs: serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap(),
            prompt_text: String::new(),
            prompt_ids: vec![1, 2],
            logprobs: vec![0.0; ids.len()],
            response_ids: ids,
            response,
            finish_reason: "tool_calls".into(),
            created: 0,
            next_state: None,
            next_messages: Vec::new(),
            end: None,
        }
    }

    #[test]
    fn a_served_tool_call_keeps_its_id_arguments_and_markup() {
        let tok = tokenizer();
        let text = "<tool_call>\n{\"name\": \"shell_exec\", \"arguments\": {\"command\": \"ls\"}}\n</tool_call><|im_end|>";
        let response = serde_json::json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{"id": "call_abc", "type": "function",
                "function": {"name": "shell_exec", "arguments": "{\"command\": \"ls\"}"}}],
        });
        let turn = turn_of(&record(&tok, text, response), 0, &tok);
        // The template variables the turn was served with travel to whoever re-renders it.
        assert_eq!(
            turn.observation.template_kwargs["enable_thinking"],
            serde_json::json!(false)
        );
        let action = &turn.policy.action;
        assert_eq!(action.content, "");
        assert_eq!(action.tool_calls.len(), 1);
        assert_eq!(action.tool_calls[0].id, "call_abc");
        assert_eq!(action.tool_calls[0].name, "shell_exec");
        assert_eq!(action.tool_calls[0].arguments["command"], "ls");
        // The markup survives decoding (the fixture marks <tool_call> special); the final
        // <|im_end|> stop token does not.
        assert!(
            turn.policy.response_text.starts_with("<tool_call>"),
            "{}",
            turn.policy.response_text
        );
        assert!(
            turn.policy.response_text.ends_with("</tool_call>"),
            "{}",
            turn.policy.response_text
        );
        assert!(action.raw.ends_with("<|im_end|>"));
    }

    #[test]
    fn unparsable_arguments_stay_text_and_plain_content_is_the_action() {
        let tok = tokenizer();
        let response = serde_json::json!({
            "role": "assistant",
            "content": "hello there",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{not json"}}],
        });
        let turn = turn_of(&record(&tok, "hello there", response), 1, &tok);
        assert_eq!(turn.policy.action.content, "hello there");
        assert_eq!(
            turn.policy.action.tool_calls[0].arguments,
            Value::String("{not json".into())
        );
        assert_eq!(turn.policy.response_text, "hello there");
        assert_eq!(turn.turn, 1);
    }
}
