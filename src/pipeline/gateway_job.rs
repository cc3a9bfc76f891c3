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
//! the full turns (the job's records pair a short `turn` record with each `judge` record).
//!
//! With `policy.agents`, the job is one such set of parts per agent over one load of the
//! checkpoint: each agent's learner has its own adapter over the shared frozen base, and the
//! gateway ([`Gateway::for_agents`]) serves each agent's adapter as its own model id, attached to
//! the one base engine, so every agent's requests decode in the same batches. A recorded turn
//! names the model id its request asked for, and goes to that agent's supervisor alone; since
//! sessions are scoped by key and model id, no turn of one agent continues, or becomes the next
//! state of, another's. Each agent stops by `[stop]` on its own counts; one that stopped first
//! keeps taking its turns, as a job does while it drains, until every agent has stopped.
//!
//! The job stops at `[stop]` (`max_steps`, `max_samples`, `max_hours`) or when `shutdown`
//! resolves (Ctrl-C); then the gateway stops (its open sessions end and their last turns are
//! offered), every turn in hand is finished, the trainers' steps in flight complete and final
//! checkpoints are written.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::{AutodiffBackend, Backend};
use clawrl_actors::loops::{
    keeps_history, Action, JobCounts, JobMsg, JobPhase, LocalPublisher, Observation, PolicyTurn,
    ProgressReport, RecorderStats, StepOutcome, StopCause, ToolCallAction, TrainSample,
    TrainerStats, Turn, TurnSource,
};
use futures::future::BoxFuture;
use ractor::ActorRef;
use serde::Serialize;
use serde_json::Value;

use super::parts::{JobParts, LoadedPolicy};
use super::RunError;
#[cfg(feature = "cuda")]
use crate::device::CudaAutodiff;
use crate::device::{Device, DeviceError};
use crate::gateway::{
    Gateway, GatewayConfig, GatewayCounts, GatewayError, GatewayPolicy, PolicyStats, TurnEnd,
    TurnRecord,
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
    /// Why the job stopped (`max_steps`, `max_samples`, `max_hours`, `interrupted`): with
    /// several agents, the first agent's that stopped by a rule.
    pub stopped_by: String,
    /// The job's counters, every agent's summed ([`JobCounts::sum`]; `turns`: main turns
    /// recorded; `sessions_started`: distinct sessions).
    pub counts: JobCounts,
    /// Of `turns`, those with a next state.
    pub turns_with_next_state: u64,
    /// What the gateway counted, read once it stopped: sessions, abandoned turns, 5xx answers,
    /// and what its start repaired after a crash (torn journal lines cut, answered turns
    /// recorded as lost).
    pub serving: GatewayCounts,
    /// Where the gateway's turn files are (every agent's turns, each naming its model id).
    pub turns_dir: PathBuf,
    /// Each policy the job trained, in `policy.agents` order (one, under the checkpoint's
    /// model id, without agents).
    pub agents: Vec<AgentReport>,
    /// Wall time in seconds.
    pub wall_s: f64,
}

/// What one policy of a personal job did: the job's one policy, or one agent's adapter.
#[derive(Clone, Debug, Serialize)]
pub struct AgentReport {
    /// The model id it was served as.
    pub model: String,
    /// Why its supervisor stopped.
    pub stopped_by: String,
    /// Its supervisor's counters.
    pub counts: JobCounts,
    /// Of `counts.turns`, those with a next state.
    pub turns_with_next_state: u64,
    /// Its trainer's counters at the end.
    pub trainer: TrainerStats,
    /// The gateway's versions of it at the end.
    pub gateway: PolicyStats,
    /// Its recorder's counters.
    pub records: RecorderStats,
    /// Where its records are.
    pub records_dir: PathBuf,
    /// Its final checkpoint, if one was written.
    pub final_checkpoint: Option<PathBuf>,
}

impl GatewayJobReport {
    /// Whether produced = trained + dropped_stale + failed + pending, for every agent.
    pub fn balanced(&self) -> bool {
        self.agents.iter().all(|a| {
            let t = &a.trainer;
            t.produced == t.trained + t.dropped_stale + t.failed + t.pending
        })
    }

    /// The first (with one policy, the only) agent's report.
    pub fn first(&self) -> &AgentReport {
        &self.agents[0]
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
        history_kept: None,
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
pub fn run_gateway_job<'a>(
    spec: &'a JobSpec,
    file: &'a str,
    options: GatewayJobOptions,
    shutdown: BoxFuture<'static, ()>,
) -> BoxFuture<'a, Result<GatewayJobReport, GatewayJobError>> {
    // Boxed here, so the future's body is compiled once, in this crate: a caller in another
    // crate that awaited the `async fn` itself would compile the whole body again.
    Box::pin(run_gateway_job_body(spec, file, options, shutdown))
}

async fn run_gateway_job_body(
    spec: &JobSpec,
    file: &str,
    options: GatewayJobOptions,
    shutdown: BoxFuture<'static, ()>,
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

/// One policy a personal job trains, running: its parts (recorder, teacher, trainer), its
/// supervisor, and the gateway policy its versions install into.
struct Agent {
    /// The model id its turns name.
    model: String,
    /// Its run directory (the job's, or `<out>/agents/<name>`).
    out: PathBuf,
    parts: JobParts,
    policy: GatewayPolicy,
    job: ActorRef<JobMsg<TrainSample>>,
    done: tokio::sync::oneshot::Receiver<JobCounts>,
    phase: tokio::sync::watch::Receiver<JobPhase>,
    with_next_state: Arc<AtomicU64>,
}

/// [`run_gateway_job`] with the learners on autodiff backend `AB` and the gateway's copy of the
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
    let names = &spec.policy.agents;
    // One learner per agent over one load of the checkpoint (one without agents).
    let policies = LoadedPolicy::<AB>::load_many(spec, device.clone(), names.len().max(1))?;
    let tokenizer = policies[0].tokenizer.clone();
    let ckpt_dir = policies[0].ckpt_dir.clone();

    // The gateway's copy, serving version 0 until the trainers publish. It serves the learners'
    // starting weights, sharing their tensors (a frozen LoRA base is then held once in this
    // process); only the tokenizer files are read again.
    let mut cfg = gateway_config(spec, &out);
    let turns_dir = cfg.data_dir.clone();
    let listen = cfg.listen;
    let record_queue = cfg.record_queue;
    let ckpt = |e: crate::model::LoadError| RunError::Checkpoint {
        path: ckpt_dir.clone(),
        message: e.to_string(),
    };
    let (tok, chat_template, files) = load_tokenizer_files(&ckpt_dir).map_err(ckpt)?;
    let config = load_config(&ckpt_dir).map_err(ckpt)?;
    let gateway = if names.is_empty() {
        let serve_ck = Checkpoint {
            config,
            model: policies[0].serving_model(),
            tokenizer: tok,
            chat_template,
            files,
        };
        let default_name = ckpt_dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "clawrl".into());
        Gateway::new(serve_ck, cfg, &default_name)?
    } else {
        // The base once, each agent's adapter attached to its engine.
        let lora = spec
            .policy
            .lora
            .clone()
            .ok_or_else(|| RunError::Checkpoint {
                path: ckpt_dir.clone(),
                message: "policy.agents without policy.lora".into(),
            })?;
        let mut adapters = Vec::with_capacity(names.len());
        for (name, p) in names.iter().zip(&policies) {
            let weights =
                p.serving_model()
                    .lora_weights(&lora)
                    .map_err(|e| RunError::Checkpoint {
                        path: ckpt_dir.clone(),
                        message: format!("agent {name}: its adapter: {e}"),
                    })?;
            adapters.push((name.clone(), weights));
        }
        cfg.adapter_versions = None;
        let serve_ck = Checkpoint {
            config,
            model: policies[0].serving_model().without_lora(),
            tokenizer: tok,
            chat_template,
            files,
        };
        Gateway::for_agents(serve_ck, cfg, adapters)?
    };
    let counter = gateway.counter();
    let mut tap = gateway
        .tap_turns(record_queue)
        .expect("a new gateway is not tapped");

    // Each agent's parts: its trainer installs every version it publishes into the gateway's
    // policy of its model id, while serving.
    let mut started_parts: Vec<(String, PathBuf, JobParts, GatewayPolicy)> = Vec::new();
    let abort_all = |parts: &[(String, PathBuf, JobParts, GatewayPolicy)]| {
        for (_, _, p, _) in parts {
            p.abort();
        }
    };
    for (i, policy) in policies.into_iter().enumerate() {
        let (model, agent_out, agent_id, gateway_policy) = match names.get(i) {
            None => (
                gateway.model_name().to_string(),
                out.clone(),
                job_id.clone(),
                gateway.policy(),
            ),
            Some(name) => (
                name.clone(),
                out.join("agents").join(name),
                format!("{job_id}.{name}"),
                gateway
                    .model_policy(name)
                    .expect("the gateway serves every agent"),
            ),
        };
        let publisher = Arc::new(LocalPublisher {
            source: "local".into(),
        });
        let subscribers = vec![gateway_policy.trainer_subscriber()];
        let parts = match JobParts::start(
            spec,
            file,
            &agent_id,
            &agent_out,
            policy,
            publisher,
            subscribers,
        )
        .await
        {
            Ok(p) => p,
            Err(e) => {
                abort_all(&started_parts);
                return Err(e.into());
            }
        };
        started_parts.push((model, agent_out, parts, gateway_policy));
    }
    let bound = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l.local_addr().map(|a| (l, a)),
        Err(e) => Err(e),
    };
    let (listener, addr) = match bound {
        Ok(b) => b,
        Err(source) => {
            abort_all(&started_parts);
            return Err(GatewayJobError::Bind {
                addr: listen,
                source,
            });
        }
    };

    // Each agent's supervisor takes the gateway's completed main turns of its model id; the
    // caller's progress report sees every agent's counts summed.
    let latest = Arc::new(Mutex::new(vec![JobCounts::default(); started_parts.len()]));
    let mut agents: Vec<Agent> = Vec::with_capacity(started_parts.len());
    let mut parts_iter = started_parts.into_iter();
    for (i, (model, agent_out, parts, policy)) in parts_iter.by_ref().enumerate() {
        let (phase_tx, phase) = tokio::sync::watch::channel(JobPhase::Running);
        let caller = options.progress.clone();
        let latest = latest.clone();
        let progress: ProgressReport = Arc::new(move |c: &JobCounts| {
            phase_tx.send_replace(c.phase);
            let total = {
                let mut l = latest.lock().unwrap_or_else(|p| p.into_inner());
                l[i] = c.clone();
                JobCounts::sum(l.iter())
            };
            if let Some(p) = &caller {
                p(&total);
            }
        });
        match parts
            .spawn_job(TurnSource::Offered, Some(progress), options.poll)
            .await
        {
            Ok((job, done)) => agents.push(Agent {
                model,
                out: agent_out,
                parts,
                policy,
                job,
                done,
                phase,
                with_next_state: Arc::default(),
            }),
            Err(e) => {
                parts.abort();
                for (_, _, p, _) in parts_iter {
                    p.abort();
                }
                for a in &agents {
                    a.job.stop(None);
                    a.parts.abort();
                }
                return Err(e.into());
            }
        }
    }

    // Serve. The dashboard shows each model id's records: the run's, or each agent's own.
    gateway.dashboard_runs(agents.iter().map(|a| (a.model.clone(), a.out.clone())));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.serve(
        listener,
        Box::pin(async move {
            let _ = stop_rx.await;
        }),
    ));
    if let Some(f) = options.on_listening {
        let served = agents.iter().map(|a| a.model.as_str()).collect::<Vec<_>>();
        f(addr, &served.join(","));
    }

    // Completed main turns → the supervisor of the model id they name (judged, built, trained
    // on there), in the order the gateway completed them; each session's turns are numbered
    // from 0. A turn naming no agent cannot come from a gateway that serves only the agents.
    let consumer = {
        let routes: Vec<(String, ActorRef<JobMsg<TrainSample>>, Arc<AtomicU64>)> = agents
            .iter()
            .map(|a| (a.model.clone(), a.job.clone(), a.with_next_state.clone()))
            .collect();
        let single = routes.len() == 1 && names.is_empty();
        tokio::spawn(async move {
            // Per session: the next turn's index, and the last turn's prompt and response ids
            // (what the next prompt should start with); dropped when the session ends.
            let mut sessions: HashMap<(usize, String), (u32, Vec<u32>)> = HashMap::new();
            while let Some(rec) = tap.recv().await {
                let Some(a) = (if single {
                    Some(0)
                } else {
                    routes.iter().position(|(m, _, _)| *m == rec.model)
                }) else {
                    tracing::error!(
                        model = %rec.model,
                        "personal job: a served turn names no agent; it stays in the turn files"
                    );
                    continue;
                };
                let (_, job, with_next_state) = &routes[a];
                if rec.next_state.is_some() {
                    with_next_state.fetch_add(1, Ordering::Relaxed);
                }
                let key = (a, rec.session_id.clone());
                let (i, history) = sessions.entry(key.clone()).or_default();
                let mut turn = turn_of(&rec, *i, &tokenizer);
                if *i > 0 {
                    turn.history_kept = Some(keeps_history(&rec.prompt_ids, history));
                }
                *i += 1;
                history.clear();
                history.extend_from_slice(&rec.prompt_ids);
                history.extend_from_slice(&rec.response_ids);
                if turn.outcome.done {
                    sessions.remove(&key);
                }
                if let Err(e) = job.cast(JobMsg::Offer(Box::new(turn))) {
                    tracing::error!("personal job: a served turn could not reach the job: {e}");
                }
            }
        })
    };

    // Serve until every supervisor's stop condition, or the shutdown signal. An agent that
    // reached its condition first keeps taking its turns, as a job does while it drains.
    tokio::pin!(shutdown);
    let all_stopped = async {
        for a in &mut agents {
            let _ = a.phase.wait_for(|p| *p != JobPhase::Running).await;
        }
    };
    let interrupted = tokio::select! {
        _ = &mut shutdown => {
            for a in &agents {
                let _ = a.job.cast(JobMsg::Stop);
            }
            true
        }
        _ = all_stopped => false,
    };

    // Drain: stop serving (open sessions end and their last turns come through the tap), hand
    // every turn in hand to the supervisors, then tell them no more come; they finish judging
    // and building, and wait for their trainer's step in flight.
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
    for a in &agents {
        let _ = a.job.cast(JobMsg::SourceClosed);
    }
    let mut reports = Vec::with_capacity(agents.len());
    let mut failure = None;
    for a in agents {
        let counts = a.done.await.map_err(|_| RunError::Lost);
        let finished = a.parts.finish().await;
        // Versions published at the very end reach the gateway's policy handle too.
        let gateway_stats = a.policy.stats();
        let (counts, finished) = match (counts, finished) {
            (Ok(c), Ok(f)) => (c, f),
            (Err(e), _) | (_, Err(e)) => {
                failure.get_or_insert(e);
                continue;
            }
        };
        let mut counts = counts;
        counts.records_written = finished.records.written;
        let stopped_by = match counts.stopped_by {
            Some(StopCause::Requested) if interrupted => "interrupted",
            Some(cause) => cause.name(),
            None => "unknown",
        };
        reports.push(AgentReport {
            model: a.model,
            stopped_by: stopped_by.into(),
            turns_with_next_state: a.with_next_state.load(Ordering::Relaxed),
            counts,
            trainer: finished.trainer,
            gateway: gateway_stats,
            records: finished.records,
            records_dir: a.out.join("records"),
            final_checkpoint: finished.final_checkpoint,
        });
    }
    if let Some(e) = failure {
        return Err(e.into());
    }
    let mut counts = JobCounts::sum(reports.iter().map(|r| &r.counts));
    for e in errors {
        tracing::error!("personal job: {e}");
        counts.last_error = Some(e);
    }
    if let Some(p) = &options.progress {
        p(&counts);
    }
    let stopped_by = match reports.iter().find(|r| r.stopped_by != "unknown") {
        _ if interrupted => "interrupted".to_string(),
        Some(r) => r.stopped_by.clone(),
        None => "unknown".into(),
    };
    Ok(GatewayJobReport {
        job: job_id,
        method: spec.method.kind.name().into(),
        addr: addr.to_string(),
        stopped_by,
        turns_with_next_state: reports.iter().map(|r| r.turns_with_next_state).sum(),
        counts,
        serving,
        turns_dir,
        agents: reports,
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
