//! The HTTP side of the gateway: axum routes speaking the OpenAI chat-completions wire format.
//!
//! - `POST /v1/chat/completions`: non-streaming, or SSE with one chunk per piece of new text as
//!   tokens are sampled (`stream: true`), `tool_calls` deltas for `<tool_call>` blocks;
//! - `GET /v1/models`, `GET /v1/models/{id}`, `GET /healthz`, `GET /metrics`.
//!
//! `/v1/*` and `/metrics` (unless `metrics_public`) need `Authorization: Bearer <key>` when keys
//! are configured: a missing or wrong key gets 401 from the headers alone, before the body is
//! read, and the key found is the request's session [`Scope`]. Bodies over the limit get 413,
//! malformed JSON 400, messages with keys the gateway does not understand 400, an unknown model
//! 404 (the model ids are the checkpoint's and those of `[adapters]`, less those the key may not
//! use: to a scoped key they do not exist), a main request that would open more sessions than
//! its key may have 429 with `Retry-After`; every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
//! Each answer carries `session_id` (body field and `X-Session-Id` header): the one the request
//! named, else the one inferred from the conversation it resends ([`super::infer`]), else a
//! fresh one; see [`super::session`] for what is recorded. Each answer also carries the weight
//! version that served it (`X-Clawrl-Version`); a request that sends `X-Clawrl-Version: N` must
//! be answered by version `N`: while another version serves it gets 409 (`version_mismatch`,
//! the serving version in the answer's `X-Clawrl-Version`) and touches no session.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path as AxPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use burn::tensor::backend::Backend;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value as Json_};
use tokio::sync::{mpsc, oneshot};

use super::auth::ApiKeys;
use super::infer::Transcript;
use super::listen::{serve_http1, ConnectionLimits};
use super::logprobs::TokenBytes;
use super::metrics::Metrics;
use super::policy::GatewayPolicy;
use super::reasoning::{split_reasoning, Part, ReasoningSplitter};
use super::session::{
    Admission, Finished, Inferred, Scope, SessionStats, SessionTable, SessionsFull, TurnEnd,
    TurnType,
};
use super::sink::{SinkError, TurnRecord, TurnSink};
use super::text::{split_all, Piece, TextStream, ToolCallSplitter};
use super::GatewayConfig;
use crate::model::chat::{encode_text, validate_messages, validate_tools, ChatTemplate};
use crate::model::engine::{
    EngineError, EngineOptions, FinishReason, GenerationRequest, StreamEvent, MAX_TOP_LOGPROBS,
};
use crate::model::qwen3::Qwen3;
use crate::model::sampling::{RawLogprobs, SamplingParams};
use crate::model::tool_call::ToolCall;
use crate::model::{Checkpoint, LoraWeights};
use crate::serve::ServedVersion;
use crate::watch::dashboard::{self, DashboardSource};

/// The gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The config is invalid.
    #[error(transparent)]
    Config(#[from] super::ConfigError),
    /// The record sink could not start.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// An adapter of `adapters` could not be loaded.
    #[error("adapters.{name}: {error}")]
    Adapter {
        /// The model id it was to be served as.
        name: String,
        /// Why.
        error: Box<crate::model::AdapterLoadError>,
    },
    /// Serving failed.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

/// A model id the gateway serves beside the checkpoint: an adapter attached to its engine.
struct AdapterModel {
    name: String,
    policy: GatewayPolicy,
}

struct AppState {
    cfg: GatewayConfig,
    model_name: String,
    /// The accepted API keys, and the model ids each may use.
    keys: ApiKeys,
    /// The model ids served beside the checkpoint's, in `adapters` order (model index 1, 2, ...
    /// of a [`Scope`]; 0 is the checkpoint).
    adapters: Vec<AdapterModel>,
    /// Whether the checkpoint itself is a model id (not when the gateway serves agents'
    /// adapters over it: [`Gateway::for_agents`]).
    base_served: bool,
    /// The dashboard's data by model id: the run's records (when a job set them; an agent's
    /// own under a gateway serving agents) and this gateway's state.
    dashboards: std::sync::OnceLock<std::collections::HashMap<String, Arc<DashboardSource>>>,
    /// The dashboard of a model id with no run: live data only.
    live_only: Arc<DashboardSource>,
    policy: GatewayPolicy,
    tokenizer: Arc<tokenizers::Tokenizer>,
    /// Every token's bytes, for answers with log-probs (made on first use).
    token_bytes: std::sync::OnceLock<TokenBytes>,
    template: ChatTemplate,
    stop_ids: Vec<u32>,
    /// Shared with [`GatewayCounter`]s, which outlive the state.
    sessions: Arc<Mutex<SessionTable<TurnRecord>>>,
    /// Requests being answered, per key ([`InFlightSlot`]).
    in_flight_by_key: Mutex<std::collections::HashMap<Scope, usize>>,
    sink: TurnSink,
    /// Where completed main turns are also sent, when a training job taps them
    /// ([`Gateway::tap_turns`]).
    tap: std::sync::OnceLock<mpsc::Sender<TurnRecord>>,
    /// Shared with [`GatewayCounter`]s.
    metrics: Arc<Metrics>,
    created: u64,
}

/// A built gateway: the model loaded, the generation thread and the turn writer running.
/// [`Gateway::policy`] is the handle new weight versions are installed through, while serving.
pub struct Gateway {
    state: Arc<AppState>,
    writer: std::thread::JoinHandle<()>,
}

/// What a gateway counted: its session table, the main turns whose client left early, its
/// 5xx answers, and its journals, with what their start repaired after a crash. The same
/// numbers as `/metrics`, read through a [`GatewayCounter`] (also after the gateway stopped).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GatewayCounts {
    /// The session table's counters.
    pub sessions: SessionStats,
    /// Sessions open when read (0 once the gateway has stopped: shutdown ends them all).
    pub open_sessions: u64,
    /// Main turns whose client left before the answer was whole (mid-stream, or before a
    /// non-streamed answer was ready): in the turn file as abandoned, never tapped.
    pub turns_abandoned: u64,
    /// Streams their client left before the end.
    pub streams_aborted: u64,
    /// Requests being generated (0 once the gateway has stopped).
    pub requests_in_flight: u64,
    /// Answers with a 5xx status.
    pub responses_5xx: u64,
    /// Answered main turns written to the served journal.
    pub served_written: u64,
    /// Complete turn records written (abandoned ones included).
    pub records_written: u64,
    /// Write errors of the journals.
    pub record_write_errors: u64,
    /// Torn last lines (a crash mid-write) cut from the journals at start.
    pub torn_lines_cut: u64,
    /// Answered turns a crash left without their complete record, recorded at start as lost.
    pub lost_by_crash: u64,
}

/// Reads a gateway's [`GatewayCounts`]; cloned from [`Gateway::counter`] before
/// [`Gateway::serve`] consumes the gateway. It holds the counters alone: the record writer
/// still ends when the gateway stops (it ends when the last record sender goes).
#[derive(Clone)]
pub struct GatewayCounter {
    sessions: Arc<Mutex<SessionTable<TurnRecord>>>,
    metrics: Arc<Metrics>,
    sink: Arc<super::sink::SinkStats>,
}

impl GatewayCounter {
    /// The counts now.
    pub fn counts(&self) -> GatewayCounts {
        let (sessions, open) = {
            let t = self.sessions.lock().unwrap();
            (t.stats(), t.open_sessions())
        };
        let (m, sk) = (&self.metrics, &self.sink);
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        GatewayCounts {
            sessions,
            open_sessions: open as u64,
            turns_abandoned: ld(&m.turns_abandoned),
            streams_aborted: ld(&m.streams_aborted),
            requests_in_flight: ld(&m.in_flight),
            responses_5xx: m.server_errors(),
            served_written: ld(&sk.served_written),
            records_written: ld(&sk.written),
            record_write_errors: ld(&sk.write_errors),
            torn_lines_cut: ld(&sk.torn_lines_cut),
            lost_by_crash: ld(&sk.lost_by_crash),
        }
    }
}

impl Gateway {
    /// Builds the gateway over a loaded checkpoint, serving it as weight version `cfg.version`.
    /// `default_name` is the model id used when the config names none. Versions installed
    /// later are read with the learner's export config
    /// ([`crate::train::learner::float32_config`] of the checkpoint's).
    pub fn new<B: Backend>(
        ck: Checkpoint<B>,
        cfg: GatewayConfig,
        default_name: &str,
    ) -> Result<Self, GatewayError>
    where
        Qwen3<B>: Send + Sync,
        B::Device: Send + Sync,
    {
        Self::build(ck, cfg, default_name, None)
    }

    /// Builds the gateway over a checkpoint's base that serves only `agents`: each name a
    /// model id, its adapter attached to the base's engine as version `cfg.version` (requests
    /// of every agent decode in the same batches), its later versions installed through
    /// [`model_policy`](Self::model_policy). The checkpoint's own id is not served, so every
    /// turn the gateway records is an agent's. `cfg.adapters` must be empty.
    pub fn for_agents<B: Backend>(
        ck: Checkpoint<B>,
        cfg: GatewayConfig,
        agents: Vec<(String, LoraWeights)>,
    ) -> Result<Self, GatewayError>
    where
        Qwen3<B>: Send + Sync,
        B::Device: Send + Sync,
    {
        if !cfg.adapters.is_empty() {
            return Err(super::ConfigError::Invalid {
                key: "adapters",
                reason: "a gateway serving agents serves their adapters alone".into(),
            }
            .into());
        }
        Self::build(ck, cfg, "", Some(agents))
    }

    fn build<B: Backend>(
        ck: Checkpoint<B>,
        cfg: GatewayConfig,
        default_name: &str,
        agents: Option<Vec<(String, LoraWeights)>>,
    ) -> Result<Self, GatewayError>
    where
        Qwen3<B>: Send + Sync,
        B::Device: Send + Sync,
    {
        cfg.validate()?;
        let stop_ids = ck.stop_token_ids();
        let Checkpoint {
            config,
            model,
            tokenizer,
            chat_template,
            ..
        } = ck;
        let tokenizer = Arc::new(tokenizer);
        let positions = config.max_position_embeddings;
        let max_context = match cfg.max_context {
            None => positions,
            Some(c) if c > positions => {
                return Err(super::ConfigError::Invalid {
                    key: "max_context",
                    reason: format!(
                        "{c} is more than the model's max_position_embeddings ({positions})"
                    ),
                }
                .into())
            }
            Some(c) => c,
        };
        let update_config = crate::train::learner::float32_config(&config);
        let policy = GatewayPolicy::new(
            model,
            cfg.version,
            update_config.clone(),
            cfg.adapter_versions.clone(),
            Some(tokenizer.clone()),
            EngineOptions {
                max_batch: cfg.max_batch,
                max_context,
                prefix_cache_bytes: cfg.prefix_cache_mib << 20,
            },
        );
        // Turns a crash left waiting for their next state are recorded as lost, unless last turns
        // are dropped (a dropped one has no complete record either).
        let reconcile = cfg.on_session_end == super::session::EndPolicy::Keep;
        let model_name = cfg
            .model_name
            .clone()
            .unwrap_or_else(|| default_name.to_string());
        let mut adapters = Vec::with_capacity(cfg.adapters.len());
        for (name, dir) in &cfg.adapters {
            if *name == model_name {
                return Err(super::ConfigError::Invalid {
                    key: "adapters",
                    reason: format!("{name:?} is also the checkpoint's model id"),
                }
                .into());
            }
            let adapter = crate::model::load_adapter(dir, &config).map_err(|error| {
                GatewayError::Adapter {
                    name: name.clone(),
                    error: Box::new(error),
                }
            })?;
            adapters.push(AdapterModel {
                name: name.clone(),
                policy: GatewayPolicy::attached(
                    &policy,
                    adapter.weights,
                    cfg.version,
                    update_config.clone(),
                ),
            });
        }
        let base_served = agents.is_none();
        for (name, weights) in agents.into_iter().flatten() {
            if !super::valid_model_id(&name) || adapters.iter().any(|a| a.name == name) {
                return Err(super::ConfigError::Invalid {
                    key: "agents",
                    reason: format!("{name:?} is not a model id, or is named twice"),
                }
                .into());
            }
            adapters.push(AdapterModel {
                name,
                policy: GatewayPolicy::attached(
                    &policy,
                    weights,
                    cfg.version,
                    update_config.clone(),
                ),
            });
        }
        for (i, k) in cfg.scoped_keys.iter().enumerate() {
            let served = |m: &String| {
                (base_served && *m == model_name) || adapters.iter().any(|a| a.name == *m)
            };
            if let Some(m) = k.models.iter().find(|m| !served(m)) {
                return Err(super::ConfigError::Invalid {
                    key: "scoped_keys",
                    reason: format!("entry {i}: {m:?} is not a model id this gateway serves"),
                }
                .into());
            }
        }
        let (sink, writer) = TurnSink::start(&cfg.data_dir, cfg.record_queue, reconcile)?;
        let state = AppState {
            model_name,
            keys: cfg.accepted_keys(),
            adapters,
            base_served,
            dashboards: std::sync::OnceLock::new(),
            live_only: Arc::new(DashboardSource::new(None)),
            policy,
            tokenizer,
            template: chat_template,
            stop_ids,
            sessions: Arc::new(Mutex::new(SessionTable::new(cfg.session_config()))),
            sink,
            tap: std::sync::OnceLock::new(),
            token_bytes: std::sync::OnceLock::new(),
            in_flight_by_key: Mutex::default(),
            metrics: Arc::default(),
            created: unix_now(),
            cfg,
        };
        Ok(Self {
            state: Arc::new(state),
            writer,
        })
    }

    /// The handle that installs new weight versions while the gateway serves (clone it before
    /// [`serve`](Self::serve) consumes the gateway).
    pub fn policy(&self) -> GatewayPolicy {
        self.state.policy.clone()
    }

    /// The model id clients name for the checkpoint (not served by a gateway
    /// [`for_agents`](Self::for_agents)).
    pub fn model_name(&self) -> &str {
        &self.state.model_name
    }

    /// The policy that serves model id `name` (an agent's or an adapter's), through which its
    /// new versions are installed; `None` when no adapter has that id.
    pub fn model_policy(&self, name: &str) -> Option<GatewayPolicy> {
        let a = self.state.adapters.iter().find(|a| a.name == name)?;
        Some(a.policy.clone())
    }

    /// The file turns of `version` are written to.
    pub fn turns_path(&self, version: u64) -> std::path::PathBuf {
        self.state.sink.path(version)
    }

    /// The handle that reads this gateway's counts, while it serves and after.
    pub fn counter(&self) -> GatewayCounter {
        GatewayCounter {
            sessions: self.state.sessions.clone(),
            metrics: self.state.metrics.clone(),
            sink: self.state.sink.shared_stats(),
        }
    }

    /// Also hands every completed main turn (the record the sink writes, next state and end
    /// reason set) to the returned receiver, for a training job; the sender waits when
    /// `capacity` records are queued. Side turns are never recorded, so never tapped. The
    /// receiver ends when the gateway has stopped. `None` when the turns are already tapped.
    pub fn tap_turns(&self, capacity: usize) -> Option<mpsc::Receiver<TurnRecord>> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        self.state.tap.set(tx).ok().map(|()| rx)
    }

    /// Makes `GET /dashboard/data?model=ID` show the run of each `(ID, run_dir)` (its records
    /// under `run_dir/records`) besides what the gateway knows now; a model id with no run is
    /// shown live only. Set once; `false` when it was already set.
    pub fn dashboard_runs(
        &self,
        runs: impl IntoIterator<Item = (String, std::path::PathBuf)>,
    ) -> bool {
        let runs = runs
            .into_iter()
            .map(|(id, dir)| (id, Arc::new(DashboardSource::new(Some(dir)))))
            .collect();
        self.state.dashboards.set(runs).is_ok()
    }

    /// The routes.
    pub fn router(&self) -> Router {
        let s = self.state.clone();
        let mut keyed = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(list_models))
            .route("/v1/models/{id}", get(get_model))
            .route("/dashboard/data", get(dashboard_data));
        let mut open = Router::new()
            .route("/healthz", get(healthz))
            .route("/dashboard", get(|| async { dashboard::page() }));
        if s.cfg.metrics_public {
            open = open.route("/metrics", get(metrics));
        } else {
            keyed = keyed.route("/metrics", get(metrics));
        }
        // A route layer runs after routing and before the handler's extractors, so a request
        // without a valid key is answered from its headers: its body is never read.
        let keyed = keyed.route_layer(axum::middleware::from_fn_with_state(s.clone(), require_key));
        keyed
            .merge(open)
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(s.cfg.max_body_bytes))
            .layer(axum::middleware::from_fn_with_state(s.clone(), track))
            .with_state(s)
    }

    /// Serves on `listener` until `shutdown` resolves; sessions idle past the timeout are ended
    /// as they expire. At shutdown every open session ends (its last turn kept or dropped as
    /// configured) and every queued record is written before this returns.
    pub fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: BoxFuture<'static, ()>,
    ) -> BoxFuture<'static, Result<(), GatewayError>> {
        // Boxed here, so the future's body is compiled once, in this crate: a caller in another
        // crate that awaited the `async fn` itself would compile the whole body again.
        Box::pin(self.serve_body(listener, shutdown))
    }

    async fn serve_body(
        self,
        listener: tokio::net::TcpListener,
        shutdown: BoxFuture<'static, ()>,
    ) -> Result<(), GatewayError> {
        let router = self.router();
        let sweeper = {
            let s = self.state.clone();
            let period = (s.cfg.idle_timeout_secs / 4.0).clamp(0.01, 1.0);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(std::time::Duration::from_secs_f64(period));
                loop {
                    tick.tick().await;
                    let out = s.sessions.lock().unwrap().expire(Instant::now());
                    record_all(&s, out).await;
                }
            })
        };
        let limits = ConnectionLimits {
            max_connections: self.state.cfg.max_connections,
            header_read_timeout: std::time::Duration::from_secs_f64(
                self.state.cfg.header_read_timeout_secs,
            ),
            max_header_bytes: self.state.cfg.max_header_bytes,
        };
        let result = serve_http1(listener, router, limits, shutdown).await;
        sweeper.abort();
        let _ = sweeper.await;
        let out = self.state.sessions.lock().unwrap().end_all();
        record_all(&self.state, out).await;
        let Self { state, writer } = self;
        drop(state);
        // The writer ends once every sink handle is gone (handlers that still hold the state
        // finish first); wait for it off the async threads.
        let _ = tokio::task::spawn_blocking(move || writer.join()).await;
        result.map_err(GatewayError::Io)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn random_hex(n: usize) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..n)
        .map(|_| format!("{:x}", rng.random_range(0..16u8)))
        .collect()
}

async fn record_all(s: &AppState, out: Vec<Finished<TurnRecord>>) {
    for f in out {
        let mut rec = f.turn;
        rec.next_state = f.next_state;
        rec.next_messages = f.next_messages;
        rec.end = Some(f.end);
        if let Some(tap) = s.tap.get() {
            if tap.send(rec.clone()).await.is_err() {
                tracing::warn!("the turn tap is closed; turn not handed to training");
                s.metrics.count_error("tap_closed");
            }
        }
        if let Err(e) = s.sink.send(rec).await {
            tracing::error!(error = %e, "turn not recorded");
            s.metrics.count_error("record_failed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// An OpenAI-style error answer.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    param: Option<std::borrow::Cow<'static, str>>,
    message: String,
}

impl ApiError {
    fn bad(code: &'static str, param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            param: param.map(Into::into),
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }});
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of a body that stalled may never come: the connection is not reused.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                HeaderValue::from_static("close"),
            );
        }
        r.extensions_mut().insert(ErrorCode(self.code));
        r
    }
}

#[derive(Clone, Copy)]
struct ErrorCode(&'static str);

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Sampling(s) => ApiError::bad("invalid_sampling", None, s.to_string()),
        EngineError::PromptTooLong { .. } => {
            ApiError::bad("context_length_exceeded", Some("messages"), e.to_string())
        }
        EngineError::EmptyPrompt | EngineError::BadToken { .. } => {
            ApiError::bad("invalid_prompt", Some("messages"), e.to_string())
        }
        EngineError::TooManyTopLogprobs { .. } => {
            ApiError::bad("invalid_value", Some("top_logprobs"), e.to_string())
        }
        EngineError::NoTokenizer | EngineError::Adapter(_) | EngineError::Closed => ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: "generation_failed",
            param: None,
            message: e.to_string(),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Middleware and small routes

async fn track(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let t0 = Instant::now();
    let resp = next.run(req).await;
    s.metrics
        .count_request(&route, resp.status().as_u16(), t0.elapsed().as_secs_f64());
    if let Some(ErrorCode(code)) = resp.extensions().get::<ErrorCode>() {
        s.metrics.count_error(code);
    } else if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
        s.metrics.count_error("payload_too_large");
    }
    resp
}

/// The scope of the bearer key in `headers` ([`ApiKeys::check`]), or the 401 answer.
fn authenticate(s: &AppState, headers: &HeaderMap) -> Result<Scope, ApiError> {
    s.keys.check(headers).ok_or_else(|| ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "invalid_request_error",
        code: "invalid_api_key",
        param: None,
        message: "missing or invalid API key: send Authorization: Bearer <key>".into(),
    })
}

/// Admits only requests with a valid key (when keys are configured) and hands their [`Scope`]
/// to the handler.
async fn require_key(State(s): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    match authenticate(&s, req.headers()) {
        Ok(scope) => {
            req.extensions_mut().insert(scope);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

impl AppState {
    /// Every model id served, with its policy, in model-index order.
    fn served(&self) -> impl Iterator<Item = (&str, &GatewayPolicy)> {
        let base = self
            .base_served
            .then_some((self.model_name.as_str(), &self.policy));
        base.into_iter()
            .chain(self.adapters.iter().map(|a| (a.name.as_str(), &a.policy)))
    }

    /// The first model id served, and its policy: what `/healthz`, `/metrics` and the dashboard
    /// report the weight version of.
    fn primary(&self) -> (&str, &GatewayPolicy) {
        self.served()
            .next()
            .unwrap_or((self.model_name.as_str(), &self.policy))
    }

    /// The model ids the key of `scope` may use, with their model index and policy: the
    /// checkpoint's first, then the adapters'.
    fn models_for(&self, scope: Scope) -> Vec<(u32, &str, &GatewayPolicy)> {
        std::iter::once((self.model_name.as_str(), &self.policy))
            .chain(self.adapters.iter().map(|a| (a.name.as_str(), &a.policy)))
            .enumerate()
            .filter(|(i, _)| *i > 0 || self.base_served)
            .filter(|(_, (name, _))| self.keys.allows(scope, name))
            .map(|(i, (name, policy))| (i as u32, name, policy))
            .collect()
    }

    /// Model id `id` as the key of `scope` sees it: its index and policy, or 404 when it does
    /// not exist for that key (a model the key may not use is one it cannot see).
    fn model(&self, scope: Scope, id: &str) -> Result<(u32, GatewayPolicy), ApiError> {
        let models = self.models_for(scope);
        match models.iter().find(|(_, name, _)| *name == id) {
            Some((i, _, policy)) => Ok((*i, (*policy).clone())),
            None => Err(unknown_model(
                id,
                &models.iter().map(|(_, n, _)| *n).collect::<Vec<_>>(),
            )),
        }
    }
}

fn model_json(s: &AppState, id: &str) -> Json_ {
    json!({"id": id, "object": "model", "created": s.created, "owned_by": "clawrl"})
}

async fn list_models(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<Scope>,
) -> Response {
    let data: Vec<Json_> = s
        .models_for(scope)
        .iter()
        .map(|(_, id, _)| model_json(&s, id))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_model(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<Scope>,
    AxPath(id): AxPath<String>,
) -> Response {
    match s.model(scope, &id) {
        Ok(_) => Json(model_json(&s, &id)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn unknown_model(id: &str, served: &[&str]) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: "model_not_found",
        param: Some("model".into()),
        message: format!("the model {id:?} does not exist; this gateway serves {served:?}"),
    }
}

/// The query of `GET /dashboard/data`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DashboardQuery {
    /// The model id to show (default: the first the key may use).
    model: Option<String>,
}

/// The dashboard's data of one model id the key may use: its run's records (when set) and this
/// gateway's counters now. A model id the key may not use is a 404, as on `/v1/models/{id}`.
async fn dashboard_data(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<Scope>,
    axum::extract::Query(q): axum::extract::Query<DashboardQuery>,
) -> Response {
    let (index, model, policy) = match &q.model {
        Some(id) => match s.model(scope, id) {
            Ok((index, policy)) => (index, id.clone(), policy),
            Err(e) => return e.into_response(),
        },
        None => match s.models_for(scope).first() {
            Some((index, id, policy)) => (*index, id.to_string(), (*policy).clone()),
            None => return unknown_model("", &[]).into_response(),
        },
    };
    // That model id's sessions alone: one agent's user never sees another's counts.
    let counts = s.sessions.lock().unwrap().model_counts(index);
    let live = dashboard::Live {
        version: policy.version(),
        sessions_open: counts.open,
        sessions_started: counts.started,
        main_turns: counts.main_turns,
        model: model.clone(),
    };
    let source = s
        .dashboards
        .get()
        .and_then(|runs| runs.get(&model))
        .cloned()
        .unwrap_or_else(|| s.live_only.clone());
    dashboard::data_response(source, Some(live)).await
}

/// `model` and `version` are those of the first model id served; `models` lists each with the
/// version it serves.
async fn healthz(State(s): State<Arc<AppState>>) -> Response {
    let (model, policy) = s.primary();
    let models: Vec<Json_> = s
        .served()
        .map(|(id, p)| json!({"id": id, "version": p.version()}))
        .collect();
    Json(json!({"status": "ok", "model": model, "version": policy.version(), "models": models}))
        .into_response()
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: "not_found",
        param: None,
        message: "no such route".into(),
    }
    .into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let (st, open) = {
        let t = s.sessions.lock().unwrap();
        (t.stats(), t.open_sessions())
    };
    let sk = s.sink.stats();
    let ps = s.primary().1.stats();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    let extra = [
        (
            "clawrl_gateway_weight_version",
            "gauge",
            "The weight version new requests run on.",
            ps.version as f64,
        ),
        (
            "clawrl_gateway_weight_install_seconds",
            "gauge",
            "Seconds the last weight install took, bytes in hand to serving (0 before the first).",
            ps.last_install_s,
        ),
        (
            "clawrl_gateway_weight_switches_total",
            "counter",
            "Weight versions switched to while serving.",
            ps.switches as f64,
        ),
        (
            "clawrl_gateway_weight_installs_stale_total",
            "counter",
            "Weight installs refused as not newer than the served version.",
            ps.stale_installs as f64,
        ),
        (
            "clawrl_gateway_weight_installs_failed_total",
            "counter",
            "Weight installs whose load failed (the served version kept serving).",
            ps.failed_installs as f64,
        ),
        (
            "clawrl_gateway_sessions_open",
            "gauge",
            "Open sessions.",
            open as f64,
        ),
        (
            "clawrl_gateway_sessions_started_total",
            "counter",
            "Sessions opened.",
            st.started as f64,
        ),
        (
            "clawrl_gateway_sessions_refused_total",
            "counter",
            "Main requests refused (429): their key had max_sessions_per_key sessions.",
            st.refused_full as f64,
        ),
        (
            "clawrl_gateway_sessions_inferred_total",
            "counter",
            "Main requests without a session id that continued a session they extend.",
            st.inferred as f64,
        ),
        (
            "clawrl_gateway_turns_superseded_total",
            "counter",
            "Pending turns closed because a request extended an older turn (edit, regeneration).",
            st.superseded as f64,
        ),
        (
            "clawrl_gateway_sessions_ended_done_total",
            "counter",
            "Sessions ended by X-Session-Done.",
            st.ended_done as f64,
        ),
        (
            "clawrl_gateway_sessions_ended_idle_total",
            "counter",
            "Sessions ended by the idle timeout (or shutdown).",
            st.ended_idle as f64,
        ),
        (
            "clawrl_gateway_main_turns_total",
            "counter",
            "Main-line turns served.",
            st.main_turns as f64,
        ),
        (
            "clawrl_gateway_side_turns_total",
            "counter",
            "Side turns served (never recorded).",
            st.side_turns as f64,
        ),
        (
            "clawrl_gateway_turns_with_next_state_total",
            "counter",
            "Turns completed with a next state.",
            st.with_next_state as f64,
        ),
        (
            "clawrl_gateway_last_turns_kept_total",
            "counter",
            "Last turns recorded without a next state.",
            st.kept_without_next_state as f64,
        ),
        (
            "clawrl_gateway_last_turns_dropped_total",
            "counter",
            "Last turns dropped at session end.",
            st.dropped as f64,
        ),
        (
            "clawrl_gateway_records_queued_total",
            "counter",
            "Turn records queued for writing.",
            ld(&sk.queued),
        ),
        (
            "clawrl_gateway_served_written_total",
            "counter",
            "Answered main turns written to the served journal (served-v<version>.jsonl).",
            ld(&sk.served_written),
        ),
        (
            "clawrl_gateway_records_written_total",
            "counter",
            "Turn records written.",
            ld(&sk.written),
        ),
        (
            "clawrl_gateway_record_queue_full_total",
            "counter",
            "Times the record queue was full and serving waited.",
            ld(&sk.queue_full),
        ),
        (
            "clawrl_gateway_journal_torn_lines_cut_total",
            "counter",
            "Torn last lines (a crash mid-write) cut from the turn journals at start.",
            ld(&sk.torn_lines_cut),
        ),
        (
            "clawrl_gateway_turns_lost_by_crash_total",
            "counter",
            "Answered turns found at start never completed (a crash took them while they waited for their next state), recorded as lost.",
            ld(&sk.lost_by_crash),
        ),
        (
            "clawrl_gateway_record_write_errors_total",
            "counter",
            "Turn record write errors.",
            ld(&sk.write_errors),
        ),
    ];
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(&extra),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Chat completions: request

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The request body. Every field the server reads is named here and any other is refused with
/// a 400 naming it (`deny_unknown_fields`): a field that would change the answer and is not
/// supported must never be silently ignored. The informational fields at the end are accepted
/// and have no effect on the answer.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    model: String,
    messages: minijinja::Value,
    #[serde(default)]
    tools: Option<minijinja::Value>,
    #[serde(default)]
    tool_choice: Option<Json_>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    turn_type: Option<String>,
    #[serde(default)]
    session_done: Option<bool>,
    /// Extra variables for the chat template (e.g. `{"enable_thinking": false}`).
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Json_>>,
    /// Accepted only as 0 (no penalty): the sampler has none.
    #[serde(default)]
    frequency_penalty: Option<f32>,
    /// Accepted only as 0 (no penalty): the sampler has none.
    #[serde(default)]
    presence_penalty: Option<f32>,
    /// Return each answer token's log-prob under the model's own distribution.
    #[serde(default)]
    logprobs: Option<bool>,
    /// With `logprobs`, also the this-many most likely tokens at each position (0 to 20).
    #[serde(default)]
    top_logprobs: Option<u32>,
    // Informational: they name or tag the request, or ask for caching and storage that do not
    // change the answer.
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<Json_>,
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<Json_>,
    #[serde(default)]
    #[allow(dead_code)]
    store: Option<Json_>,
    #[serde(default)]
    #[allow(dead_code)]
    parallel_tool_calls: Option<Json_>,
    #[serde(default)]
    #[allow(dead_code)]
    prompt_cache_key: Option<Json_>,
    #[serde(default)]
    #[allow(dead_code)]
    safety_identifier: Option<Json_>,
}

/// The names serde gives an unknown field (`unknown field `x`, expected ...`).
fn unknown_field(message: &str) -> Option<&str> {
    message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| name)
}

fn parse_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize::<_, ChatRequest>(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let text = inner.to_string();
        if let Some(field) = unknown_field(&text) {
            // The path already ends with the unknown field, except at the top level.
            let at = if path == "." { field.to_string() } else { path };
            return ApiError {
                param: Some(at.clone().into()),
                ..ApiError::bad(
                    "unsupported_field",
                    None,
                    format!("`{at}` is not supported by this server (it would change the answer or is unknown; it is refused rather than ignored)"),
                )
            };
        }
        let msg = if inner.is_syntax() || inner.is_eof() {
            format!("malformed JSON body: {inner}")
        } else if path == "." {
            format!("invalid request body: {inner}")
        } else {
            format!("invalid request body at {path}: {inner}")
        };
        ApiError::bad("invalid_json", None, msg)
    })
}

/// Refuses the values of supported fields that this server cannot honour.
fn check_unsupported_values(r: &ChatRequest) -> Result<(), ApiError> {
    for (name, v) in [
        ("frequency_penalty", r.frequency_penalty),
        ("presence_penalty", r.presence_penalty),
    ] {
        if matches!(v, Some(x) if x != 0.0) {
            return Err(ApiError::bad(
                "unsupported",
                Some(name),
                format!("{name} is not supported (only 0)"),
            ));
        }
    }
    let top = r.top_logprobs.unwrap_or(0) as usize;
    if top > MAX_TOP_LOGPROBS {
        return Err(ApiError::bad(
            "invalid_value",
            Some("top_logprobs"),
            format!("top_logprobs {top} is more than {MAX_TOP_LOGPROBS}"),
        ));
    }
    if top > 0 && r.logprobs != Some(true) {
        return Err(ApiError::bad(
            "invalid_value",
            Some("top_logprobs"),
            "top_logprobs needs logprobs: true",
        ));
    }
    // "auto" lets the model choose and "none" hides the tools; forcing a call would need
    // constrained decoding, which the engine does not have.
    match &r.tool_choice {
        None => {}
        Some(Json_::String(c)) if c == "auto" || c == "none" => {}
        Some(other) => {
            return Err(ApiError::bad(
                "unsupported",
                Some("tool_choice"),
                format!("tool_choice {other} is not supported (only \"auto\" and \"none\"): a forced tool call needs constrained decoding"),
            ))
        }
    }
    Ok(())
}

/// The template variables of `chat_template_kwargs`; the ones the server sets itself
/// (`messages`, `tools`, `add_generation_prompt`) are refused.
fn template_kwargs(r: &ChatRequest) -> Result<Vec<(String, minijinja::Value)>, ApiError> {
    let Some(map) = &r.chat_template_kwargs else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(k, v)| {
            if matches!(k.as_str(), "messages" | "tools" | "add_generation_prompt") {
                return Err(ApiError::bad(
                    "invalid_value",
                    Some("chat_template_kwargs"),
                    format!("chat_template_kwargs.{k} is set by the server"),
                ));
            }
            Ok((k.clone(), minijinja::Value::from_serialize(v)))
        })
        .collect()
}

fn sampling_params(s: &AppState, r: &ChatRequest) -> Result<SamplingParams, ApiError> {
    if let Some(n) = r.n {
        if n != 1 {
            return Err(ApiError::bad(
                "unsupported",
                Some("n"),
                "only n = 1 is supported",
            ));
        }
    }
    let temperature = r.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(ApiError::bad(
            "invalid_value",
            Some("temperature"),
            format!("temperature must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "invalid_value",
            Some("top_p"),
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let max = r
        .max_completion_tokens
        .or(r.max_tokens)
        .unwrap_or(s.cfg.default_max_tokens);
    if max == 0 || max > s.cfg.max_tokens_limit {
        return Err(ApiError::bad(
            "invalid_value",
            Some("max_tokens"),
            format!(
                "max_tokens must be in [1, {}], got {max}",
                s.cfg.max_tokens_limit
            ),
        ));
    }
    let stop = match &r.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad(
            "invalid_value",
            Some("stop"),
            "stop must be at most 4 non-empty strings",
        ));
    }
    let seed = r.seed.unwrap_or_else(rand::random);
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k: r.top_k.unwrap_or(0),
        max_new_tokens: max,
        stop_token_ids: s.stop_ids.clone(),
        stop_strings: stop,
        seed,
    })
}

/// The message keys the gateway understands: the chat template renders `role`, `content`,
/// `tool_calls` and `reasoning_content`; `name` and `tool_call_id` are OpenAI's bookkeeping
/// (clients send them on tool results), kept in the record.
const MESSAGE_KEYS: [&str; 6] = [
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
];

/// The keys of one entry of `tool_calls` (`index` comes with calls accumulated from stream
/// deltas) and of its `function`.
const TOOL_CALL_KEYS: [&str; 4] = ["id", "type", "function", "index"];
const FUNCTION_KEYS: [&str; 2] = ["name", "arguments"];

/// The longest `name`, `tool_call_id` or tool-call `id`: none is rendered into the prompt, so
/// none is bounded by the context check.
const MAX_ID_BYTES: usize = 1024;

/// A request whose messages carry a key the gateway does not understand is refused, never
/// served with the key ignored: an ignored field would silently change what the client asked
/// for, and an unrendered one would reach the record unbounded by the context check. A key
/// whose value is `null` counts as absent (SDKs resend fields such as `refusal` or `audio` as
/// `null`).
fn unsupported_key(at: &str, key: &str, known: &[&str]) -> ApiError {
    ApiError::bad(
        "unsupported_message_key",
        Some("messages"),
        format!(
            "{at} has the key {key:?}, which this gateway does not support (supported: {}; a \
             null value counts as absent)",
            known.join(", ")
        ),
    )
}

fn invalid_message(at: &str, what: impl std::fmt::Display) -> ApiError {
    ApiError::bad(
        "invalid_messages",
        Some("messages"),
        format!("{at}: {what}"),
    )
}

/// A string of at most [`MAX_ID_BYTES`], or null.
fn check_id(at: &str, key: &str, v: &minijinja::Value) -> Result<(), ApiError> {
    match v.as_str() {
        _ if v.is_none() => Ok(()),
        Some(t) if t.len() <= MAX_ID_BYTES => Ok(()),
        Some(_) => Err(invalid_message(
            at,
            format!("{key:?} is longer than {MAX_ID_BYTES} bytes"),
        )),
        None => Err(invalid_message(at, format!("{key:?} must be a string"))),
    }
}

/// Checks the entries of a message's `tool_calls` list (see [`unsupported_key`]).
fn check_tool_calls(at: &str, calls: &minijinja::Value) -> Result<(), ApiError> {
    use minijinja::value::ValueKind;
    for (j, c) in calls.try_iter().expect("a list").enumerate() {
        let at = format!("{at}, tool call {j}");
        if c.kind() != ValueKind::Map {
            return Err(invalid_message(&at, "a tool call must be an object"));
        }
        for k in c.try_iter().expect("a map") {
            let v = c.get_item(&k).unwrap_or_default();
            match k.as_str().unwrap_or_default() {
                "id" => check_id(&at, "id", &v)?,
                "type" if v.is_none() || v.as_str() == Some("function") => {}
                "type" => return Err(invalid_message(&at, "\"type\" must be \"function\"")),
                "index" if v.is_none() || v.is_integer() => {}
                "index" => return Err(invalid_message(&at, "\"index\" must be an integer")),
                "function" if v.kind() == ValueKind::Map => {
                    let at = format!("{at}, function");
                    for fk in v.try_iter().expect("a map") {
                        let fv = v.get_item(&fk).unwrap_or_default();
                        let name = fk.as_str().unwrap_or_default();
                        match name {
                            _ if fv.is_none() => {}
                            "name" if fv.kind() == ValueKind::String => {}
                            "name" => {
                                return Err(invalid_message(&at, "\"name\" must be a string"))
                            }
                            "arguments" => check_arguments(&at, &fv)?,
                            _ => return Err(unsupported_key(&at, name, &FUNCTION_KEYS)),
                        }
                    }
                }
                "function" => return Err(invalid_message(&at, "\"function\" must be an object")),
                _ if v.is_none() => {}
                other => return Err(unsupported_key(&at, other, &TOOL_CALL_KEYS)),
            }
        }
    }
    Ok(())
}

/// A tool call's `arguments` in history: an object, or (as OpenAI sends them) a string holding
/// one. Anything else would reach the template as something the model never wrote.
fn check_arguments(at: &str, v: &minijinja::Value) -> Result<(), ApiError> {
    use minijinja::value::ValueKind;
    let bad = |why: String| invalid_message(at, format!("\"arguments\" {why}"));
    match v.kind() {
        ValueKind::Map => Ok(()),
        ValueKind::String => match serde_json::from_str::<serde_json::Value>(v.as_str().unwrap()) {
            Ok(serde_json::Value::Object(_)) => Ok(()),
            Ok(_) => Err(bad("must hold a JSON object".into())),
            Err(e) => Err(bad(format!("is not valid JSON ({e})"))),
        },
        _ => Err(bad("must be a JSON object or a string holding one".into())),
    }
}

/// OpenAI messages → what the chat template expects: text-part lists joined, a missing or null
/// `content` made `""`, tool-call `arguments` given as a JSON string decoded to the object the
/// model wrote (key order kept), other keys with a null value left out. A key outside
/// [`MESSAGE_KEYS`] with a value is refused ([`unsupported_key`]).
fn normalize_messages(messages: &minijinja::Value) -> Result<minijinja::Value, ApiError> {
    use minijinja::value::ValueKind;
    validate_messages(messages, "messages")
        .map_err(|e| ApiError::bad("invalid_messages", Some("messages"), e.to_string()))?;
    let mut out = Vec::new();
    for (i, m) in messages.try_iter().expect("validated list").enumerate() {
        let at = format!("message {i}");
        let mut pairs: Vec<(minijinja::Value, minijinja::Value)> = Vec::new();
        let mut has_content = false;
        for k in m.try_iter().expect("validated map") {
            let v = m.get_item(&k).unwrap_or_default();
            let v = match k.as_str().unwrap_or_default() {
                "content" => {
                    has_content = true;
                    content_text(&v).map_err(|e| invalid_message(&at, e))?
                }
                "tool_calls" if v.kind() == ValueKind::Seq => {
                    check_tool_calls(&at, &v)?;
                    decode_arguments(&v)
                }
                "tool_calls" if v.is_none() => v,
                "tool_calls" => return Err(invalid_message(&at, "\"tool_calls\" must be a list")),
                key @ ("name" | "tool_call_id") => {
                    check_id(&at, key, &v)?;
                    v
                }
                "reasoning_content" if v.is_none() || v.kind() == ValueKind::String => v,
                "reasoning_content" => {
                    return Err(invalid_message(
                        &at,
                        "\"reasoning_content\" must be a string",
                    ))
                }
                "role" => match v.as_str() {
                    Some("system" | "user" | "assistant" | "tool") => v,
                    // OpenAI's `developer` role is the system prompt of models that have no
                    // role of that name; the chat template knows only `system`.
                    Some("developer") => minijinja::Value::from("system"),
                    _ => {
                        return Err(invalid_message(
                            &at,
                            format!(
                                "role {v:?} is not one of \"system\", \"developer\", \"user\", \"assistant\", \"tool\""
                            ),
                        ))
                    }
                },
                _ if v.is_none() => continue,
                other => return Err(unsupported_key(&at, other, &MESSAGE_KEYS)),
            };
            pairs.push((k, v));
        }
        if !has_content {
            pairs.push((
                minijinja::Value::from("content"),
                minijinja::Value::from(""),
            ));
        }
        out.push(pairs.into_iter().collect::<minijinja::Value>());
    }
    Ok(minijinja::Value::from(out))
}

fn content_text(v: &minijinja::Value) -> Result<minijinja::Value, String> {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::String => Ok(v.clone()),
        ValueKind::None | ValueKind::Undefined => Ok(minijinja::Value::from("")),
        ValueKind::Seq => {
            let mut text = String::new();
            for (j, part) in v.try_iter().map_err(|e| e.to_string())?.enumerate() {
                let ty = part.get_attr("type").unwrap_or_default();
                match ty.as_str() {
                    Some("text") => {
                        let t = part.get_attr("text").unwrap_or_default();
                        let t = t.as_str().ok_or_else(|| {
                            format!("content part {j} (text) has no string \"text\"")
                        })?;
                        text.push_str(t)
                    }
                    Some(other) => {
                        return Err(format!(
                            "content part {j} has the type {other:?}, which is not supported \
                             (text only)"
                        ))
                    }
                    None => return Err(format!("content part {j} has no string \"type\"")),
                }
            }
            Ok(minijinja::Value::from(text))
        }
        _ => Err("content must be a string, a list of text parts or null".into()),
    }
}

fn decode_arguments(calls: &minijinja::Value) -> minijinja::Value {
    let calls: Vec<minijinja::Value> = calls
        .try_iter()
        .map(|it| {
            it.map(|c| {
                let Some(f) = c.get_attr("function").ok().filter(|f| !f.is_undefined()) else {
                    return c;
                };
                let args = f.get_attr("arguments").unwrap_or_default();
                let Some(text) = args.as_str() else {
                    return c;
                };
                let Ok(obj) = serde_json::from_str::<minijinja::Value>(text) else {
                    return c;
                };
                if obj.kind() != minijinja::value::ValueKind::Map {
                    return c;
                }
                let f2 = rebuild(&f, "arguments", obj);
                rebuild(&c, "function", f2)
            })
            .collect()
        })
        .unwrap_or_default();
    minijinja::Value::from(calls)
}

/// `map` with `key` set to `value`, key order kept.
fn rebuild(map: &minijinja::Value, key: &str, value: minijinja::Value) -> minijinja::Value {
    let mut value = Some(value);
    map.try_iter()
        .map(|it| {
            it.map(|k| {
                let v = if k.as_str() == Some(key) {
                    value.take().unwrap_or_default()
                } else {
                    map.get_item(&k).unwrap_or_default()
                };
                (k, v)
            })
            .collect()
        })
        .unwrap_or_default()
}

/// Everything a request resolved to before generation.
struct Prepared {
    /// The key's scope, narrowed to the model the request names.
    scope: Scope,
    /// The model id, as named.
    model: String,
    /// Its weight versions.
    policy: GatewayPolicy,
    session_id: String,
    /// The session a main request without a session id continues, by inference.
    inferred: Option<Inferred>,
    /// A main request's messages as sent (what its turn's transcript is built from).
    sent: Vec<Json_>,
    /// A main request's hold on its session, once admitted.
    hold: Option<Hold>,
    turn_type: TurnType,
    done: bool,
    messages: minijinja::Value,
    tools: Option<minijinja::Value>,
    /// The request's `chat_template_kwargs`, as given.
    template_kwargs: serde_json::Map<String, Json_>,
    prompt_text: String,
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    /// `Some(k)`: answer each token's log-prob and its `k` most likely alternatives.
    raw_logprobs: Option<usize>,
    stream: bool,
    include_usage: bool,
}

/// A main request's [`Admission`] while its turn is generated. It is handed to the session
/// table when the turn was served ([`finish_turn`]); dropped before that (the engine refused
/// the request, generation failed, the client left), it releases the admission, so the request
/// leaves no session behind.
struct Hold {
    state: Arc<AppState>,
    admission: Option<Admission>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(a) = self.admission.take() {
            // Never dropped while the table is locked: the lock is taken only here and for
            // single statements or blocks that hold no `Hold`.
            let mut t = self
                .state
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            t.release(a);
        }
    }
}

/// One request being answered, counted against its key's `max_in_flight_per_key` until dropped.
struct InFlightSlot {
    state: Arc<AppState>,
    scope: Scope,
}

impl InFlightSlot {
    /// A slot for `scope`, or `None` when its key already has as many requests in flight as
    /// allowed.
    fn take(s: &Arc<AppState>, scope: Scope) -> Option<Self> {
        let mut counts = s.in_flight_by_key.lock().unwrap();
        let n = counts.entry(scope).or_default();
        if *n >= s.cfg.max_in_flight_per_key {
            return None;
        }
        *n += 1;
        Some(Self {
            state: s.clone(),
            scope,
        })
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        let mut counts = self
            .state
            .in_flight_by_key
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(&self.scope) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.scope);
            }
        }
    }
}

/// A request submitted to the engine, counted in `clawrl_gateway_requests_in_flight` until
/// dropped, however it ends: answered, refused, failed, or left by its client.
struct Generating(Arc<AppState>);

impl Generating {
    fn start(s: &Arc<AppState>) -> Self {
        s.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(s.clone())
    }
}

impl Drop for Generating {
    fn drop(&mut self) {
        self.0.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// 429 for a key with `max_in_flight_per_key` requests being answered.
fn too_many_in_flight(s: &AppState) -> Response {
    let mut r = ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        kind: "rate_limit_error",
        code: "too_many_requests_in_flight",
        param: None,
        message: format!(
            "this key already has {} requests being answered; retry after 1 s",
            s.cfg.max_in_flight_per_key
        ),
    }
    .into_response();
    r.headers_mut()
        .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(1u64));
    r
}

/// Reads a request body whole, within `max_body_bytes` (413) and `body_read_timeout_secs` (408,
/// and the connection is closed).
async fn read_body(s: &AppState, body: axum::body::Body) -> Result<Bytes, ApiError> {
    let secs = s.cfg.body_read_timeout_secs;
    let read = axum::body::to_bytes(body, s.cfg.max_body_bytes);
    match tokio::time::timeout(std::time::Duration::from_secs_f64(secs), read).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_large =
                std::iter::successors(Some(&e as &(dyn std::error::Error + 'static)), |x| {
                    x.source()
                })
                .any(|x| x.is::<http_body_util::LengthLimitError>());
            Err(if too_large {
                ApiError {
                    status: StatusCode::PAYLOAD_TOO_LARGE,
                    kind: "invalid_request_error",
                    code: "payload_too_large",
                    param: None,
                    message: format!(
                        "request body exceeds the limit of {} bytes",
                        s.cfg.max_body_bytes
                    ),
                }
            } else {
                ApiError::bad(
                    "invalid_body",
                    None,
                    format!("cannot read the request body: {e}"),
                )
            })
        }
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            kind: "invalid_request_error",
            code: "body_timeout",
            param: None,
            message: format!("the request body did not arrive whole within {secs} s"),
        }),
    }
}

/// 429 for a main request whose key has `max_sessions_per_key` sessions, with `Retry-After`
/// (whole seconds until the key's first session times out).
fn sessions_full(full: SessionsFull) -> Response {
    let secs = full.retry_after.as_secs_f64().ceil().max(1.0) as u64;
    let mut r = ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        kind: "rate_limit_error",
        code: "too_many_sessions",
        param: Some("session_id".into()),
        message: format!("{full}; retry after {secs} s"),
    }
    .into_response();
    r.headers_mut()
        .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

fn prepare(
    s: &AppState,
    scope: Scope,
    headers: &HeaderMap,
    r: ChatRequest,
) -> Result<Prepared, ApiError> {
    let (model_index, policy) = s.model(scope, &r.model)?;
    // Sessions belong to the key and the model: one model's turns never meet another's.
    let scope = scope.with_model(model_index);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_string())
    };
    let named = header("x-session-id")
        .or(r.session_id.clone())
        .filter(|x| !x.is_empty());
    if matches!(&named, Some(id) if id.len() > 256) {
        return Err(ApiError::bad(
            "invalid_value",
            Some("session_id"),
            "session_id is longer than 256 bytes",
        ));
    }
    let explicit = match header("x-turn-type").or(r.turn_type.clone()) {
        None => None,
        Some(t) => Some(
            t.parse::<TurnType>()
                .map_err(|e| ApiError::bad("invalid_value", Some("turn_type"), e))?,
        ),
    };
    let done = match header("x-session-done") {
        Some(v) => !matches!(v.to_ascii_lowercase().as_str(), "0" | "false" | "no"),
        None => r.session_done.unwrap_or(false),
    };
    let turn_type = s
        .sessions
        .lock()
        .unwrap()
        .resolve_turn_type(explicit, named.is_some());
    check_unsupported_values(&r)?;
    let kwargs = template_kwargs(&r)?;
    let params = sampling_params(s, &r)?;
    let messages = normalize_messages(&r.messages)?;
    let sent: Vec<Json_> = match turn_type {
        TurnType::Main => match serde_json::to_value(&r.messages) {
            Ok(Json_::Array(v)) => v,
            _ => Vec::new(),
        },
        TurnType::Side => Vec::new(),
    };
    // A main request that names no session continues the one whose turn it extends.
    let inferred = match (&named, turn_type) {
        (None, TurnType::Main) => s.sessions.lock().unwrap().infer(scope, &sent),
        _ => None,
    };
    let session_id = named
        .or_else(|| inferred.as_ref().map(|i| i.session_id.clone()))
        .unwrap_or_else(|| format!("sess-{}", random_hex(24)));
    let use_tools = !matches!(&r.tool_choice, Some(Json_::String(c)) if c == "none");
    let tools = match r.tools {
        Some(t) if !t.is_none() && !t.is_undefined() => {
            validate_tools(&t, "tools")
                .map_err(|e| ApiError::bad("invalid_tools", Some("tools"), e.to_string()))?;
            (use_tools && t.len().unwrap_or(0) > 0).then_some(t)
        }
        _ => None,
    };
    let prompt_text = s
        .template
        .render(
            &messages,
            tools.as_ref(),
            true,
            &kwargs
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect::<Vec<_>>(),
        )
        .map_err(|e| ApiError::bad("invalid_messages", Some("messages"), e.to_string()))?;
    let prompt_ids = encode_text(&s.tokenizer, &prompt_text).map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        kind: "server_error",
        code: "tokenizer",
        param: None,
        message: e.to_string(),
    })?;
    Ok(Prepared {
        scope,
        model: r.model,
        policy,
        session_id,
        inferred,
        sent,
        hold: None,
        turn_type,
        done,
        messages,
        tools,
        prompt_text,
        prompt_ids,
        params,
        stream: r.stream.unwrap_or(false),
        include_usage: r.stream_options.unwrap_or_default().include_usage,
        template_kwargs: r.chat_template_kwargs.clone().unwrap_or_default(),
        raw_logprobs: (r.logprobs == Some(true)).then_some(r.top_logprobs.unwrap_or(0) as usize),
    })
}

// ---------------------------------------------------------------------------------------------
// Chat completions: response

fn openai_tool_call(c: &ToolCall) -> Json_ {
    json!({
        "id": format!("call_{}", random_hex(24)),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments.to_string()},
    })
}

fn finish_reason(reason: FinishReason, tool_calls: bool) -> &'static str {
    if tool_calls {
        return "tool_calls";
    }
    match reason {
        FinishReason::Stop | FinishReason::StopString => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

/// The ids of an answer as served: a final stop token excluded.
fn served_ids<'a>(s: &AppState, ids: &'a [u32]) -> &'a [u32] {
    match ids.last() {
        Some(last) if s.stop_ids.contains(last) => &ids[..ids.len() - 1],
        _ => ids,
    }
}

/// The decoding of `ids` as served: a final stop token excluded, special tokens kept (so
/// `<tool_call>` tags survive).
fn decode(s: &AppState, ids: &[u32]) -> String {
    s.tokenizer
        .decode(served_ids(s, ids), false)
        .unwrap_or_default()
}

/// OpenAI's `logprobs` entries of the served ids `ids[from..]` (every sampled token but a final
/// stop token: reasoning and tool-call tokens included).
fn logprob_entries(s: &AppState, c: &Collected, from: usize) -> Vec<Json_> {
    let ids = served_ids(s, &c.ids);
    let from = from.min(ids.len());
    let raw = &c.raw[from.min(c.raw.len())..];
    s.token_bytes
        .get_or_init(|| TokenBytes::new(&s.tokenizer))
        .content(&ids[from..], raw)
}

/// A choice's `logprobs`: `null` unless the request asked for them.
fn logprobs_object(s: &AppState, p: &Prepared, c: &Collected) -> Json_ {
    match p.raw_logprobs {
        None => Json_::Null,
        Some(_) => json!({"content": logprob_entries(s, c, 0), "refusal": null}),
    }
}

/// The request header naming the weight version a request must be answered by.
pub const VERSION_HEADER: &str = "x-clawrl-version";

/// The version a request's `X-Clawrl-Version` header names, if it names one (a decimal
/// integer; anything else is a bad request).
fn pinned_version(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(v) = headers.get(VERSION_HEADER) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            ApiError::bad(
                "invalid_value",
                Some("X-Clawrl-Version"),
                "X-Clawrl-Version must be a weight version (a non-negative integer)",
            )
        })
}

/// 409: the request named weight version `want`, the gateway serves `serving` (also in the
/// answer's `X-Clawrl-Version`, so the client knows whether to wait or give up).
fn version_conflict(want: u64, serving: u64) -> Response {
    let mut r = ApiError {
        status: StatusCode::CONFLICT,
        kind: "invalid_request_error",
        code: "version_mismatch",
        param: Some("X-Clawrl-Version".into()),
        message: format!(
            "this request must be answered by weight version {want}; the gateway serves version \
             {serving}"
        ),
    }
    .into_response();
    r.headers_mut()
        .insert(VERSION_HEADER, HeaderValue::from(serving));
    r
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<Scope>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    // The slot is held until the answer is complete (for a stream, by its task).
    let Some(slot) = InFlightSlot::take(&s, scope) else {
        return too_many_in_flight(&s);
    };
    let body = match read_body(&s, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let t0 = Instant::now();
    let mut prepared = match parse_request(&body).and_then(|r| prepare(&s, scope, &headers, r)) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // The request runs, to its end, on the version current now; a request that names the
    // version it must be answered by (`X-Clawrl-Version`) is refused with 409, before it
    // touches any session, when that is not the one.
    let served = prepared.policy.current();
    match pinned_version(&headers) {
        Ok(Some(want)) if want != served.version() => {
            return version_conflict(want, served.version())
        }
        Ok(_) => {}
        Err(e) => return e.into_response(),
    }
    // A main request may open a session only within its key's cap; it is opened when the turn
    // has been served (`finish_turn`), and released if it never is.
    if prepared.turn_type == TurnType::Main {
        let admitted =
            s.sessions
                .lock()
                .unwrap()
                .admit(prepared.scope, &prepared.session_id, Instant::now());
        match admitted {
            Ok(a) => {
                prepared.hold = Some(Hold {
                    state: s.clone(),
                    admission: Some(a),
                })
            }
            Err(full) => return sessions_full(full),
        }
    }
    // A request that names its session completes the session's pending main turn with its last
    // message; an inferred one with every message after the turn it extends.
    let out = match &prepared.inferred {
        Some(i) => s
            .sessions
            .lock()
            .unwrap()
            .on_inferred(prepared.scope, i, Instant::now()),
        None => {
            let last = prepared
                .messages
                .get_item_by_index(prepared.messages.len().unwrap_or(1) - 1)
                .ok()
                .and_then(|m| serde_json::to_value(&m).ok());
            s.sessions.lock().unwrap().on_request(
                prepared.scope,
                &prepared.session_id,
                prepared.turn_type,
                last.as_ref(),
                Instant::now(),
            )
        }
    };
    record_all(&s, out).await;

    let generating = Generating::start(&s);
    let rx = served.engine().submit_streaming(GenerationRequest {
        prompt_ids: prepared.prompt_ids.clone(),
        params: prepared.params.clone(),
        raw_logprobs: prepared.raw_logprobs,
    });
    let sid = HeaderValue::from_str(&prepared.session_id).ok();
    let version = HeaderValue::from(served.version());
    let answer = Answer {
        served,
        rx,
        id: format!("chatcmpl-{}", random_hex(24)),
        t0,
        generating,
        slot,
    };
    // The request is answered by a task of its own, which outlives this handler: a client who
    // leaves drops the handler's future (and with it `head`'s receiver), which the task sees,
    // so its turn is recorded as abandoned as far as it was sampled, at whatever point it left.
    let (head, answered) = oneshot::channel();
    tokio::spawn(answer_request(s.clone(), prepared, answer, head));
    let mut resp = match answered.await {
        Ok(r) => r,
        Err(_) => engine_error(EngineError::Closed).into_response(),
    };
    if resp.status().is_success() {
        if let Some(v) = sid {
            resp.headers_mut().insert("x-session-id", v);
        }
        resp.headers_mut().insert("x-clawrl-version", version);
    }
    resp
}

/// Answers one request the engine accepted, sending its response (an error, the whole JSON
/// answer, or the event stream) through `head`. It waits for the first event first, so that a
/// refusal is a proper HTTP error, streamed or not.
async fn answer_request(
    s: Arc<AppState>,
    p: Prepared,
    mut answer: Answer,
    mut head: oneshot::Sender<Response>,
) {
    let first = tokio::select! {
        e = answer.rx.recv() => e,
        () = head.closed() => {
            // The client left before the first token: nothing was sampled, and dropping the
            // receiver frees the sequence at the engine's next step.
            let version = answer.served.version();
            drop(answer.rx);
            abandon_turn(&s, p, version, Collected::new(), "", "").await;
            drop(answer.generating);
            return;
        }
    };
    let first = match first {
        Some(StreamEvent::Failed(e)) => {
            if p.done {
                let out = s
                    .sessions
                    .lock()
                    .unwrap()
                    .end_session(p.scope, &p.session_id);
                record_all(&s, out).await;
            }
            let _ = head.send(engine_error(e).into_response());
            return;
        }
        None => {
            let _ = head.send(engine_error(EngineError::Closed).into_response());
            return;
        }
        Some(ev) => ev,
    };
    s.metrics
        .first_token_seconds
        .observe(answer.t0.elapsed().as_secs_f64());
    s.metrics
        .prompt_tokens
        .fetch_add(p.prompt_ids.len() as u64, Ordering::Relaxed);
    if p.stream {
        stream_response(s, p, answer, first, head).await
    } else {
        complete_response(s, p, answer, first, head).await
    }
}

/// Collects the events of one request.
struct Collected {
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    /// Raw log-probs of `ids`, when the request asked for them.
    raw: Vec<RawLogprobs>,
    reason: Option<FinishReason>,
    cached_tokens: usize,
}

impl Collected {
    fn new() -> Self {
        Self {
            ids: Vec::new(),
            logprobs: Vec::new(),
            raw: Vec::new(),
            reason: None,
            cached_tokens: 0,
        }
    }

    /// Applies one event; `Err` when the request failed.
    fn apply(&mut self, ev: StreamEvent) -> Result<(), EngineError> {
        match ev {
            StreamEvent::Token { id, logprob, raw } => {
                self.ids.push(id);
                self.logprobs.push(logprob);
                self.raw.extend(raw);
            }
            StreamEvent::Finished(r) => {
                // The result repeats the streamed tokens; it is the authority.
                debug_assert_eq!(r.response_ids, self.ids);
                self.ids = r.response_ids;
                self.logprobs = r.logprobs;
                self.raw = r.raw_logprobs;
                self.reason = Some(r.finish_reason);
                self.cached_tokens = r.cached_tokens;
            }
            StreamEvent::Failed(e) => return Err(e),
        }
        Ok(())
    }
}

/// Builds the record of a served turn and hands it to the session table.
#[allow(clippy::too_many_arguments)]
async fn finish_turn(
    s: &AppState,
    mut p: Prepared,
    version: u64,
    c: Collected,
    message: Json_,
    finish: &str,
    t0: Instant,
    generating: Generating,
) {
    s.metrics
        .generation_seconds
        .observe(t0.elapsed().as_secs_f64());
    s.metrics
        .completion_tokens
        .fetch_add(c.ids.len() as u64, Ordering::Relaxed);
    let admission = p.hold.as_mut().and_then(|h| h.admission.take());
    let transcript = admission
        .as_ref()
        .map(|_| Transcript::new(&p.sent, &message));
    let record = TurnRecord {
        session_id: p.session_id.clone(),
        version,
        model: p.model.clone(),
        messages: p.messages,
        tools: p.tools,
        template_kwargs: p.template_kwargs,
        prompt_text: p.prompt_text,
        prompt_ids: p.prompt_ids,
        response_ids: c.ids,
        logprobs: c.logprobs,
        response: message,
        finish_reason: finish.to_string(),
        created: unix_now(),
        next_state: None,
        next_messages: Vec::new(),
        end: None,
    };
    // The client has (or is about to have) this answer: journal it before it waits in the
    // session table for its next state, so a crash cannot lose it.
    if admission.is_some() {
        if let Err(e) = s.sink.send_served(record.clone()).await {
            tracing::error!(error = %e, "served turn not journaled");
            s.metrics.count_error("served_record_failed");
        }
    }
    let out = {
        let mut t = s.sessions.lock().unwrap();
        match admission {
            Some(a) => t.on_served(a, record, transcript, p.done, Instant::now()),
            None => t.on_side_served(p.scope, &p.session_id, p.done, Instant::now()),
        }
    };
    record_all(s, out).await;
    // Counted last, so a request no longer in flight is already in the session table.
    drop(generating);
}

/// Records a main turn whose client left before its answer was whole, as far as it was
/// sampled, with [`TurnEnd::Abandoned`]: it goes to the turn file only, never to training, and
/// its admission is released (a session it would have opened is not opened).
async fn abandon_turn(
    s: &AppState,
    p: Prepared,
    version: u64,
    c: Collected,
    reasoning: &str,
    content: &str,
) {
    let Some(Hold {
        admission: Some(_), ..
    }) = &p.hold
    else {
        return; // a side turn: nothing is recorded
    };
    s.metrics.turns_abandoned.fetch_add(1, Ordering::Relaxed);
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = Json_::String(reasoning.to_string());
    }
    let record = TurnRecord {
        session_id: p.session_id.clone(),
        version,
        model: p.model.clone(),
        messages: p.messages.clone(),
        tools: p.tools.clone(),
        template_kwargs: p.template_kwargs.clone(),
        prompt_text: p.prompt_text.clone(),
        prompt_ids: p.prompt_ids.clone(),
        response_ids: c.ids,
        logprobs: c.logprobs,
        response: message,
        finish_reason: "abandoned".into(),
        created: unix_now(),
        next_state: None,
        next_messages: Vec::new(),
        end: Some(TurnEnd::Abandoned),
    };
    if let Err(e) = s.sink.send(record).await {
        tracing::error!(error = %e, "abandoned turn not recorded");
        s.metrics.count_error("record_failed");
    }
    // `p` (and its hold) is dropped here: the admission is released.
}

/// OpenAI's usage object; `cached` prompt tokens came from the engine's prefix cache.
fn usage(prompt: usize, completion: usize, cached: usize) -> Json_ {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The text of the tokens `c` holds, as a non-streamed answer gives it: cut at the request's
/// stop strings, its reasoning apart, and its content apart from its tool calls.
fn whole_answer(
    s: &AppState,
    p: &Prepared,
    c: &Collected,
) -> (Option<String>, String, Vec<ToolCall>) {
    let decoded = decode(s, &c.ids);
    let visible = super::text::cut_at_stop(&decoded, &p.params.stop_strings);
    let (reasoning, answer) = split_reasoning(&p.prompt_text, visible);
    let (content, calls) = split_all(&answer);
    (reasoning, content, calls)
}

/// A request the engine accepted: what answering it needs, whether streamed or not.
struct Answer {
    /// The version answering it, held to the end (its engine stops after its last request).
    served: Arc<ServedVersion>,
    /// The engine's events.
    rx: mpsc::UnboundedReceiver<StreamEvent>,
    /// The completion's id.
    id: String,
    /// When the request arrived.
    t0: Instant,
    /// Its place in `clawrl_gateway_requests_in_flight`, let go of once the request is
    /// accounted for (its turn recorded, or its error answered).
    generating: Generating,
    /// Its place in its key's `max_in_flight_per_key`, let go of once the answer is complete.
    slot: InFlightSlot,
}

/// Collects a non-streamed answer from `first` on and sends its response through `whole`. If
/// the client leaves first (the receiving end of `whole` is dropped with the handler), the
/// generation is dropped (its sequence freed at the engine's next decode step) and a main turn
/// is recorded as abandoned as far as it was sampled, as a stream's is.
async fn complete_response(
    s: Arc<AppState>,
    p: Prepared,
    answer: Answer,
    first: StreamEvent,
    mut whole: oneshot::Sender<Response>,
) {
    let Answer {
        served,
        mut rx,
        id,
        t0,
        generating,
        slot,
    } = answer;
    let version = served.version();
    let mut c = Collected::new();
    let mut ev = Some(first);
    while c.reason.is_none() {
        // Not `ev.take().or(rx.recv().await)`: `or` evaluates its argument first, which
        // received (and lost) the second token of every answer.
        let next = match ev.take() {
            Some(e) => Some(e),
            None => tokio::select! {
                e = rx.recv() => e,
                () = whole.closed() => {
                    drop(rx);
                    let (reasoning, content, _) = whole_answer(&s, &p, &c);
                    let reasoning = reasoning.unwrap_or_default();
                    abandon_turn(&s, p, version, c, &reasoning, &content).await;
                    // Counted last, so a request no longer in flight is already accounted for.
                    drop(generating);
                    return;
                }
            },
        };
        let failed = match next {
            None => Some(EngineError::Closed),
            Some(e) => c.apply(e).err(),
        };
        if let Some(e) = failed {
            let _ = whole.send(engine_error(e).into_response());
            return;
        }
    }
    let (reasoning, content, calls) = whole_answer(&s, &p, &c);
    let reason = finish_reason(c.reason.expect("loop ends on a reason"), !calls.is_empty());
    let mut message = json!({"role": "assistant", "content": content});
    if let Some(r) = reasoning {
        message["reasoning_content"] = Json_::String(r);
    }
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Json_::Null;
        }
        message["tool_calls"] = calls.iter().map(openai_tool_call).collect();
    }
    let body = json!({
        "id": id,
        "object": "chat.completion",
        "created": unix_now(),
        "model": p.model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason,
                     "logprobs": logprobs_object(&s, &p, &c)}],
        "usage": usage(p.prompt_ids.len(), c.ids.len(), c.cached_tokens),
        "session_id": p.session_id,
        "turn_type": p.turn_type,
        "version": version,
    });
    finish_turn(&s, p, version, c, message, reason, t0, generating).await;
    // The key's slot is free before the client has its answer, so an answer it acts on at
    // once never meets its own request's slot.
    drop(served);
    drop(slot);
    let _ = whole.send(Json(body).into_response());
}

/// Streams an answer from `first` on: sends the event stream through `head`, then feeds it.
/// If the client leaves (a send fails), the generation is dropped and a main turn is recorded
/// as abandoned as far as it was sampled.
async fn stream_response(
    s: Arc<AppState>,
    p: Prepared,
    answer: Answer,
    first: StreamEvent,
    head: oneshot::Sender<Response>,
) {
    let (tx, out) = mpsc::channel::<Event>(64);
    let stream = futures::stream::unfold(out, |mut out| async move {
        out.recv().await.map(|e| (Ok::<_, Infallible>(e), out))
    });
    // A client already gone drops the stream with the response: the first send below fails.
    let _ = head.send(Sse::new(stream).into_response());
    let Answer {
        served,
        mut rx,
        id,
        t0,
        generating,
        slot,
    } = answer;
    let created = unix_now();
    let version = served.version();
    let chunk = |delta: Json_, finish: Option<&str>, logprobs: Json_| {
        let v = json!({
            "id": id, "object": "chat.completion.chunk", "created": created,
            "model": p.model, "session_id": p.session_id, "version": version,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        });
        Event::default().data(v.to_string())
    };
    // With log-probs asked for, a chunk carries the entries of the tokens sampled since the
    // last chunk that carried some (text held back waits with its tokens); the finishing
    // chunk carries the rest.
    let mut logprobs_sent = 0usize;
    let mut pending_logprobs = |c: &Collected| -> Json_ {
        if p.raw_logprobs.is_none() {
            return Json_::Null;
        }
        let entries = logprob_entries(&s, c, logprobs_sent);
        logprobs_sent += entries.len();
        json!({"content": entries, "refusal": null})
    };
    let mut c = Collected::new();
    let mut text = TextStream::new(p.params.stop_strings.clone());
    let mut thinking = ReasoningSplitter::new(&p.prompt_text);
    let mut splitter = ToolCallSplitter::default();
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<Json_> = Vec::new();
    let mut ok = tx
        .send(chunk(
            json!({"role": "assistant", "content": ""}),
            None,
            Json_::Null,
        ))
        .await
        .is_ok();
    let mut ev = Some(first);
    let mut failed = false;
    while ok && c.reason.is_none() {
        let next = match ev.take() {
            Some(e) => Some(e),
            None => rx.recv().await,
        };
        let Some(e) = next else {
            failed = true;
            break;
        };
        if c.apply(e).is_err() {
            failed = true;
            break;
        }
        let decoded = decode(&s, &c.ids);
        let piece = text.push(&decoded, c.reason.is_some());
        let mut parts = thinking.push(&piece);
        if c.reason.is_some() {
            parts.extend(thinking.finish());
        }
        // Reasoning goes out as it comes; the answer goes through the tool-call splitter.
        let mut pieces: Vec<Part<Piece>> = Vec::new();
        for part in parts {
            match part {
                Part::Reasoning(r) => pieces.push(Part::Reasoning(r)),
                Part::Content(t) => pieces.extend(splitter.push(&t).into_iter().map(Part::Content)),
            }
        }
        if c.reason.is_some() {
            pieces.extend(splitter.finish().into_iter().map(Part::Content));
        }
        for pc in pieces {
            let delta = match pc {
                Part::Reasoning(r) => {
                    reasoning.push_str(&r);
                    json!({"reasoning_content": r})
                }
                Part::Content(Piece::Content(t)) => {
                    content.push_str(&t);
                    json!({"content": t})
                }
                Part::Content(Piece::ToolCall(tc)) => {
                    let mut j = openai_tool_call(&tc);
                    j["index"] = json!(calls.len());
                    calls.push(j.clone());
                    json!({"tool_calls": [j]})
                }
            };
            let logprobs = pending_logprobs(&c);
            if tx.send(chunk(delta, None, logprobs)).await.is_err() {
                ok = false;
                break;
            }
        }
    }
    if !ok || failed {
        // The client left (or the engine died): the turn was not served whole. Dropping
        // the receiver frees its sequence at the engine's next decode step.
        drop(rx);
        if failed {
            s.metrics.count_error("generation_failed");
        } else {
            s.metrics.streams_aborted.fetch_add(1, Ordering::Relaxed);
            abandon_turn(&s, p, version, c, &reasoning, &content).await;
        }
        // Counted last, so a request no longer in flight is already accounted for.
        drop(generating);
        return;
    }
    let reason = finish_reason(c.reason.expect("loop ends on a reason"), !calls.is_empty());
    let logprobs = pending_logprobs(&c);
    let _ = tx.send(chunk(json!({}), Some(reason), logprobs)).await;
    if p.include_usage {
        let v = json!({
            "id": id, "object": "chat.completion.chunk", "created": created,
            "model": p.model, "session_id": p.session_id, "version": version,
            "choices": [],
            "usage": usage(p.prompt_ids.len(), c.ids.len(), c.cached_tokens),
        });
        let _ = tx.send(Event::default().data(v.to_string())).await;
    }
    let _ = tx.send(Event::default().data("[DONE]")).await;
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = Json_::String(reasoning);
    }
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Json_::Null;
        }
        for c in calls.iter_mut() {
            c.as_object_mut().map(|o| o.remove("index"));
        }
        message["tool_calls"] = Json_::Array(calls);
    }
    finish_turn(&s, p, version, c, message, reason, t0, generating).await;
    // The version is let go of only now: its engine stops after its last request.
    drop(served);
    drop(slot);
}
