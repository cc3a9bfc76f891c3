//! The `personal` job kind: the OpenAI-compatible gateway ([`crate::gateway`]) serves the policy,
//! and the conversations it records train it, live (docs/design.md §4).
//!
//! [`run_gateway_job`] is a job like any other ([`super::parts`]: recorder, teacher, trainer and
//! the job supervisor with the judge and the method's sample builder), whose serving side is the
//! gateway over the same checkpoint (every version the trainer publishes is installed while
//! serving, never paused) and whose turns are offered to the supervisor
//! ([`TurnSource::Offered`]): every completed main turn the gateway records (next state arrived,
//! or a session's last turn at `X-Session-Done` / idle timeout / shutdown, per the gateway's
//! `on_session_end`) comes from [`crate::gateway::Gateway::tap_turns`] as a one-turn episode,
//! and is judged, built and trained on there, with the counts and stop rules of every job. Side
//! turns are never recorded by the gateway, so never trained on; the gateway's turn files hold
//! the full turns (the job's records pair a short `turn` record with each `judge` record). The job stops at `[stop]` (`max_steps`, `max_samples`, `max_hours`)
//! or when `shutdown` resolves (Ctrl-C); then the gateway stops (its open sessions end and their
//! last turns are offered), every turn in hand is finished, the trainer's step in flight
//! completes and a final checkpoint is written.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::backend::{AutodiffBackend, Backend};
use clawrl_actors::loops::{
    Action, JobCounts, JobMsg, JobPhase, LocalPublisher, Observation, PolicyTurn, ProgressReport,
    RecorderStats, StepOutcome, StopCause, ToolCallAction, TrainerStats, Turn, TurnSource,
};
use serde::Serialize;
use serde_json::Value;

use super::parts::{JobParts, LoadedPolicy};
use super::RunError;
#[cfg(feature = "cuda")]
use crate::device::CudaAutodiff;
use crate::device::{Device, DeviceError};
use crate::gateway::{
    Gateway, GatewayConfig, GatewayCounts, GatewayError, PolicyStats, TurnEnd, TurnRecord,
};
use crate::job::{JobKind, JobSpec};
use crate::model::checkpoint::{load_config, load_tokenizer_files, Checkpoint};
use crate::model::Qwen3;
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
    /// What the gateway counted, read once it stopped: sessions, abandoned turns, 5xx answers,
    /// and what its start repaired after a crash (torn journal lines cut, answered turns
    /// recorded as lost).
    pub serving: GatewayCounts,
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
/// under the run directory, versions read as adapters when the job trains one.
pub fn gateway_config(spec: &JobSpec, out: &Path) -> GatewayConfig {
    let mut cfg = spec.gateway.clone().unwrap_or_default();
    if cfg.data_dir.is_relative() {
        cfg.data_dir = out.join(&cfg.data_dir);
    }
    // The trainer publishes the adapter alone; the gateway attaches it to its checkpoint.
    cfg.adapter_versions = spec.policy.lora.clone();
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
    let policy = LoadedPolicy::<AB>::load(spec, device.clone())?;
    let tokenizer = policy.tokenizer.clone();

    // The gateway's copy, serving version 0 until the trainer publishes.
    let cfg = gateway_config(spec, &out);
    let turns_dir = cfg.data_dir.clone();
    let listen = cfg.listen;
    // The gateway serves the learner's starting weights, sharing their tensors (a frozen LoRA
    // base is then held once in this process); only the tokenizer files are read again.
    let serve_ck = {
        let ckpt = |e: crate::model::LoadError| RunError::Checkpoint {
            path: policy.ckpt_dir.clone(),
            message: e.to_string(),
        };
        let (tokenizer, chat_template, files) =
            load_tokenizer_files(&policy.ckpt_dir).map_err(ckpt)?;
        Checkpoint {
            config: load_config(&policy.ckpt_dir).map_err(ckpt)?,
            model: policy.serving_model(),
            tokenizer,
            chat_template,
            files,
        }
    };
    let default_name = policy
        .ckpt_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "clawrl".into());
    let record_queue = cfg.record_queue;
    let gateway = Gateway::new(serve_ck, cfg, &default_name)?;
    let model = gateway.model_name().to_string();
    let gateway_policy = gateway.policy();
    let counter = gateway.counter();
    let mut tap = gateway
        .tap_turns(record_queue)
        .expect("a new gateway is not tapped");

    // The trainer installs every version it publishes into the gateway while it serves.
    let publisher = Arc::new(LocalPublisher {
        source: "local".into(),
    });
    let subscribers = vec![gateway_policy.trainer_subscriber()];
    let parts = JobParts::start(spec, file, &job_id, &out, policy, publisher, subscribers).await?;
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(source) => {
            parts.abort();
            return Err(GatewayJobError::Bind {
                addr: listen,
                source,
            });
        }
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(source) => {
            parts.abort();
            return Err(GatewayJobError::Bind {
                addr: listen,
                source,
            });
        }
    };

    // The job supervisor takes the gateway's completed main turns; the caller's progress
    // report also tells this task when the supervisor stops taking new work.
    let (phase_tx, mut phase_rx) = tokio::sync::watch::channel(JobPhase::Running);
    let caller = options.progress.clone();
    let progress: ProgressReport = Arc::new(move |c: &JobCounts| {
        phase_tx.send_replace(c.phase);
        if let Some(p) = &caller {
            p(c);
        }
    });
    let (job, done) = match parts
        .spawn_job(TurnSource::Offered, Some(progress), options.poll)
        .await
    {
        Ok(j) => j,
        Err(e) => {
            parts.abort();
            return Err(e.into());
        }
    };

    // Serve.
    gateway.dashboard_run(&out);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.serve(listener, async move {
        let _ = stop_rx.await;
    }));
    if let Some(f) = options.on_listening {
        f(addr, &model);
    }

    // Completed main turns → the supervisor (judged, built, trained on there), in the order
    // the gateway completed them; each session's turns are numbered from 0.
    let with_next_state = Arc::new(AtomicU64::new(0));
    let consumer = {
        let job = job.clone();
        let with_next_state = with_next_state.clone();
        tokio::spawn(async move {
            let mut index: HashMap<String, u32> = HashMap::new();
            while let Some(rec) = tap.recv().await {
                if rec.next_state.is_some() {
                    with_next_state.fetch_add(1, Ordering::Relaxed);
                }
                let i = index.entry(rec.session_id.clone()).or_insert(0);
                let turn = turn_of(&rec, *i, &tokenizer);
                *i += 1;
                if let Err(e) = job.cast(JobMsg::Offer(Box::new(turn))) {
                    tracing::error!("personal job: a served turn could not reach the job: {e}");
                }
            }
        })
    };

    // Serve until the supervisor's stop condition or the shutdown signal.
    tokio::pin!(shutdown);
    let interrupted = tokio::select! {
        _ = &mut shutdown => {
            let _ = job.cast(JobMsg::Stop);
            true
        }
        _ = phase_rx.wait_for(|p| *p != JobPhase::Running) => false,
    };

    // Drain: stop serving (open sessions end and their last turns come through the tap), hand
    // every turn in hand to the supervisor, then tell it no more come; it finishes judging and
    // building, and waits for the trainer's step in flight.
    let _ = stop_tx.send(());
    let mut errors = Vec::new();
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => errors.push(format!("the gateway stopped: {e}")),
        Err(e) => errors.push(format!("the gateway task failed: {e}")),
    }
    // Stopped: every session has ended and every record is written.
    let serving = counter.counts();
    if let Err(e) = consumer.await {
        errors.push(format!("the turn consumer failed: {e}"));
    }
    let _ = job.cast(JobMsg::SourceClosed);
    let counts = done.await.map_err(|_| RunError::Lost);
    let finished = parts.finish().await;
    // Versions published at the very end reach the gateway's policy handle too.
    let gateway_stats = gateway_policy.stats();
    let mut counts = counts?;
    let finished = finished?;
    for e in errors {
        tracing::error!("personal job: {e}");
        counts.last_error = Some(e);
    }
    counts.records_written = finished.records.written;
    if let Some(p) = &options.progress {
        p(&counts);
    }
    let stopped_by = match counts.stopped_by {
        Some(StopCause::Requested) if interrupted => "interrupted",
        Some(cause) => cause.name(),
        None => "unknown",
    };
    Ok(GatewayJobReport {
        job: job_id,
        method: spec.method.kind.name().into(),
        addr: addr.to_string(),
        model,
        stopped_by: stopped_by.into(),
        turns_with_next_state: with_next_state.load(Ordering::Relaxed),
        counts,
        trainer: finished.trainer,
        gateway: gateway_stats,
        serving,
        records: finished.records,
        records_dir: out.join("records"),
        turns_dir,
        final_checkpoint: finished.final_checkpoint,
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
