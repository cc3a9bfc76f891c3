//! The personal-agent experiment: warm-start a small policy ([`super::sft`], offline), then for
//! each method — binary RL, OPD, combined — run a `personal` job over it
//! ([`clawrl::pipeline::gateway_job::run_gateway_job`]: the gateway serves the warm start, its
//! completed main turns are judged by the job's `PrmVoter`s and trained on by the `Trainer`
//! actor, and every new weight version is installed into the gateway while it serves), with the
//! simulated student and teacher of [`crate::experiments::personal::users`] as its users, and measure the
//! personalization score of first responses on held-out prompts after the configured numbers of
//! updates.
//!
//! **The users** are HTTP clients of the job's gateway speaking the OpenAI chat-completions wire
//! format (every other conversation streamed), sending no session header: the gateway links
//! each conversation's requests into one session by inference ([`clawrl::gateway::session`]).
//! A user asks its question, reads the answer, and replies ([`crate::experiments::personal::users::reply`]);
//! the reply is sent as the conversation's next request, so it becomes the answered turn's next
//! state. A user who leaves (satisfied, or after `users.max_turns` replies) sends its last reply
//! and never answers what follows: that last turn is dropped when the session idles out
//! (`on_session_end = "drop"`), so every trained turn has a next state.
//!
//! **Exact versions.** Each turn yields at most one sample and each trainer step takes exactly
//! `batch_size` samples, so the driver lets users start a turn only while the samples handed to
//! the trainer (less those it dropped), plus the turns that may still become samples, stay under
//! `batch_size ×` the next measured number of updates ([`committed`]), and at most two batches
//! beyond the trainer's version ([`lead_cap`]: users keep talking while a step runs, on the
//! version served then). Training traffic thus stops when the trainer reaches that version; the driver then waits until the gateway serves it and
//! measures with side turns (`X-Turn-Type: side`, never recorded or trained on) that name it
//! (`X-Clawrl-Version`: the gateway answers 409 if another version serves), and lets the users
//! talk again. A sample answered by an older version than the one trained is never dropped: its
//! advantage carries truncated importance weights ([`ExperimentFile::job_spec`]).
//!
//! **Personalization score.** For each held-out task (half student, half teacher, from the
//! held-out split of [`super::corpus::Split`]) the gateway samples `eval_samples` first
//! responses (temperature `temperature`, seeds fixed per task and sample, the same at every
//! measurement and for every method); the score is the fraction of those responses that
//! satisfy their user's rules ([`super::style::personalization_score`]), the same deterministic rules the
//! simulated users reply by.
//!
//! **Seeds.** [`run_seeds`] runs the whole experiment once per experiment seed, all from one
//! warm start, and reports per method and measurement the mean and the sample standard
//! deviation over the seeds ([`Results::over_seeds`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clawrl_actors::loops::{Action, Episode, JobCounts, JobPhase, ProgressReport};
use futures::{StreamExt, TryStreamExt};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;
use tokio::sync::{watch, Notify};

use super::corpus::Split;
use super::sft::{warm_start, SftError, SftSettings};
use super::style::{personalization_score, UserKind};
use crate::experiments::personal::users::{PersonalEnv, PersonalEnvError, UserSettings};
use crate::experiments::warm_start::SftOutcome;
use crate::experiments::{
    parse_text, prepare_run_dir, read_text, toml_table, write_outputs, FileError,
};
use clawrl::job::{JobSpec, JobSpecError, MethodKind};
use clawrl::pipeline::gateway_job::{
    run_gateway_job, GatewayJobError, GatewayJobOptions, GatewayJobReport,
};
use clawrl::train::TrainConfig;

/// The job kind of an experiment file.
pub const KIND: &str = "personal_experiment";

/// A training method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Binary RL from the evaluative signal.
    Binary,
    /// Hindsight-guided on-policy distillation from the directive signal.
    Opd,
    /// Both.
    Combined,
}

impl Method {
    /// `binary` / `opd` / `combined`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Binary => "binary",
            Method::Opd => "opd",
            Method::Combined => "combined",
        }
    }

    /// The job method it runs as.
    pub fn kind(self) -> MethodKind {
        match self {
            Method::Binary => MethodKind::Binary,
            Method::Opd => MethodKind::Opd,
            Method::Combined => MethodKind::Combined,
        }
    }
}

/// The `[experiment]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentSettings {
    /// Methods to run, in order.
    pub methods: Vec<Method>,
    /// Optimizer steps per method.
    pub updates: usize,
    /// After how many updates to measure (0 = the warm start).
    pub eval_at: Vec<usize>,
    /// Samples per update (the job's `optim.batch_size`).
    pub batch_size: usize,
    /// AdamW learning rate of the RL updates.
    pub lr: f64,
    /// Coefficient of the k3 KL term against the warm start (0 disables it).
    pub kl_coef: f64,
    /// Weight of the binary term (the job's `method.w_binary`).
    pub w_binary: f64,
    /// Weight of the OPD term (the job's `method.w_opd`).
    pub w_opd: f64,
    /// Simulated users talking to the gateway at once.
    pub users_at_once: usize,
    /// Train-split tasks per user.
    pub train_tasks_per_user: usize,
    /// Held-out tasks per user.
    pub eval_tasks_per_user: usize,
    /// First responses sampled per held-out task.
    pub eval_samples: usize,
    /// Sampling temperature of the users' requests and the measurements.
    pub temperature: f32,
    /// Longest response.
    pub max_new_tokens: usize,
    /// Seed of task draws, sampling and the learner.
    pub seed: u64,
}

impl Default for ExperimentSettings {
    fn default() -> Self {
        Self {
            methods: vec![Method::Binary, Method::Opd, Method::Combined],
            updates: 16,
            eval_at: vec![0, 8, 16],
            batch_size: 16,
            lr: 1e-3,
            kl_coef: 0.02,
            w_binary: 1.0,
            w_opd: 1.0,
            users_at_once: 16,
            train_tasks_per_user: 128,
            eval_tasks_per_user: 32,
            eval_samples: 2,
            temperature: 1.0,
            max_new_tokens: 40,
            seed: 1,
        }
    }
}

/// An experiment file (`examples/personal.toml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentFile {
    /// Must be `personal_experiment`.
    pub kind: String,
    /// A name for logs.
    #[serde(default = "default_name")]
    pub name: String,
    /// Where the SFT checkpoint is cached (default `target/clawrl-cache/personal`, relative to
    /// the working directory).
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// The warm start.
    #[serde(default)]
    pub sft: SftSettings,
    /// The RL runs.
    #[serde(default)]
    pub experiment: ExperimentSettings,
    /// The simulated users.
    #[serde(default)]
    pub users: UserSettings,
    /// The jobs' `[judge]` table, as in a `personal` job spec (checked as part of one).
    pub judge: toml::Table,
}

fn default_name() -> String {
    "personal".into()
}

/// Why the experiment failed.
#[derive(Debug, Error)]
pub enum ExperimentError {
    /// The file could not be read, or the run's files not written.
    #[error(transparent)]
    File(#[from] FileError),
    /// The warm start failed.
    #[error(transparent)]
    Sft(#[from] SftError),
    /// The environment refused its settings.
    #[error(transparent)]
    Env(#[from] PersonalEnvError),
    /// An episode failed.
    #[error("episode: {0}")]
    Episode(#[from] clawrl_actors::loops::EnvError),
    /// The job spec built for a method is invalid.
    #[error(transparent)]
    Spec(#[from] JobSpecError),
    /// A method's job failed.
    #[error("the {method} job: {source}")]
    Job {
        /// The method.
        method: &'static str,
        /// The cause.
        source: GatewayJobError,
    },
    /// The job ended before the driver was done with it.
    #[error("the {method} job ended early ({why})")]
    JobEnded {
        /// The method.
        method: &'static str,
        /// What its counts say.
        why: String,
    },
    /// A request to the gateway failed or its answer is not a chat completion.
    #[error("gateway request ({what}): {message}")]
    Http {
        /// Which request.
        what: &'static str,
        /// What went wrong.
        message: String,
    },
    /// The gateway answered with an error status.
    #[error("gateway answered {status} ({what}): {body}")]
    Status {
        /// Which request.
        what: &'static str,
        /// The HTTP status.
        status: u16,
        /// Its body.
        body: String,
    },
    /// A measurement found another version serving than the one it must measure.
    #[error("measuring version {want}: the gateway serves version {serving}")]
    WrongVersion {
        /// The version to measure.
        want: u64,
        /// The version served.
        serving: u64,
    },
    /// Nothing moved for too long while the driver waited for a version.
    #[error("waiting for version {want}: no progress in {secs} s ({counts})")]
    Stalled {
        /// The version waited for.
        want: u64,
        /// How long nothing moved.
        secs: u64,
        /// The job's counts then.
        counts: String,
    },
    /// The async runtime could not start.
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
}

impl ExperimentFile {
    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, FileError> {
        let bad = |message: String| FileError::parse(origin, message);
        let file: ExperimentFile = parse_text(text, origin)?;
        if file.kind != KIND {
            return Err(bad(format!(
                "kind = {:?}: this runner only runs kind = {KIND:?}",
                file.kind
            )));
        }
        let x = &file.experiment;
        if x.methods.is_empty() {
            return Err(bad("experiment.methods is empty".into()));
        }
        for (key, v) in [
            ("experiment.batch_size", x.batch_size),
            ("experiment.updates", x.updates),
            ("experiment.users_at_once", x.users_at_once),
            ("experiment.train_tasks_per_user", x.train_tasks_per_user),
            ("experiment.eval_tasks_per_user", x.eval_tasks_per_user),
            ("experiment.eval_samples", x.eval_samples),
            ("experiment.max_new_tokens", x.max_new_tokens),
        ] {
            if v == 0 {
                return Err(bad(format!("{key} must be at least 1")));
            }
        }
        if x.users_at_once > 256 {
            return Err(bad(format!(
                "experiment.users_at_once = {} is more than 256",
                x.users_at_once
            )));
        }
        if let Some(&e) = x.eval_at.iter().find(|&&e| e > x.updates) {
            return Err(bad(format!(
                "experiment.eval_at holds {e}, more than experiment.updates = {}",
                x.updates
            )));
        }
        if !x.eval_at.windows(2).all(|w| w[0] < w[1]) || x.eval_at.is_empty() {
            return Err(bad(
                "experiment.eval_at must be a non-empty, strictly increasing list".into(),
            ));
        }
        if !(x.lr.is_finite() && x.lr > 0.0) {
            return Err(bad(format!("experiment.lr = {} must be > 0", x.lr)));
        }
        for (key, v) in [
            ("experiment.kl_coef", x.kl_coef),
            ("experiment.w_binary", x.w_binary),
            ("experiment.w_opd", x.w_opd),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(format!("{key} = {v} must be >= 0")));
            }
        }
        if !(x.temperature.is_finite() && x.temperature > 0.0) {
            return Err(bad(format!(
                "experiment.temperature = {} must be > 0",
                x.temperature
            )));
        }
        file.sft.validate().map_err(|e| bad(format!("{e}")))?;
        PersonalEnv::new(
            PersonalEnv::sample_tasks(Split::Train, 1, 0),
            file.users.clone(),
        )
        .map_err(|e| bad(format!("users: {e}")))?;
        // Every method's job spec must be valid (the judge table is checked there).
        for &m in &x.methods {
            file.job_spec(m, Path::new("(warm start)"), "sk-check", origin)
                .map_err(|e| bad(e.to_string()))?;
        }
        Ok(file)
    }

    /// Reads and validates a file.
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        Self::from_toml_str(&read_text(path)?, &path.display().to_string())
    }

    /// The SFT cache directory.
    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("target/clawrl-cache/personal"))
    }

    /// The `personal` job spec of `method` over the checkpoint `checkpoint`, serving on a
    /// loopback port of its choosing behind `key`; `origin` names the experiment file in errors.
    pub fn job_spec(
        &self,
        method: Method,
        checkpoint: &Path,
        key: &str,
        origin: &str,
    ) -> Result<JobSpec, JobSpecError> {
        let x = &self.experiment;
        let train = TrainConfig::default();
        let sub = toml_table;
        let int = |v: usize| toml::Value::Integer(v as i64);
        let spec = sub(vec![
            ("kind", "personal".into()),
            ("name", format!("{}-{}", self.name, method.name()).into()),
            ("seed", toml::Value::Integer(x.seed as i64)),
            (
                "policy",
                sub(vec![
                    ("checkpoint", checkpoint.display().to_string().into()),
                    ("max_batch", int(32)),
                    ("max_context", int(self.sft.max_positions)),
                ]),
            ),
            (
                "gateway",
                sub(vec![
                    ("listen", "127.0.0.1:0".into()),
                    ("model_name", MODEL.into()),
                    ("api_keys", toml::Value::Array(vec![key.into()])),
                    // A user who left never answers its last turn: it is dropped, not judged.
                    ("on_session_end", "drop".into()),
                    ("idle_timeout_secs", toml::Value::Float(IDLE_TIMEOUT_SECS)),
                    ("max_sessions_per_key", int(65_536)),
                    ("max_in_flight_per_key", int(1024)),
                    ("max_batch", int(32)),
                    ("data_dir", "turns".into()),
                    ("default_max_tokens", int(x.max_new_tokens)),
                ]),
            ),
            ("judge", toml::Value::Table(self.judge.clone())),
            (
                "method",
                sub(vec![
                    ("kind", method.kind().name().into()),
                    ("w_binary", toml::Value::Float(x.w_binary)),
                    ("w_opd", toml::Value::Float(x.w_opd)),
                ]),
            ),
            (
                "optim",
                sub(vec![
                    ("batch_size", int(x.batch_size)),
                    ("lr", toml::Value::Float(x.lr)),
                    ("clip", toml::Value::Float(train.eps_clip)),
                    ("clip_high", toml::Value::Float(train.eps_clip_high)),
                    ("kl", toml::Value::Float(x.kl_coef)),
                    // No sample is dropped. One answered by an older version than the one
                    // being trained (the users keep talking while a step runs) has its
                    // advantage scaled per token by the truncated importance weight
                    // `min(exp(trainer − rollout), 2)`: the token's probability under the
                    // policy being trained over that under the version that sampled it.
                    ("staleness", int(0)),
                    ("staleness_mode", "importance".into()),
                ]),
            ),
            // The driver stops each job; this only bounds a run that hangs.
            ("stop", sub(vec![("max_hours", toml::Value::Float(6.0))])),
        ]);
        crate::experiments::job_spec(spec, origin, method.name())
    }
}

/// The model id the jobs' gateways serve.
const MODEL: &str = "personal";

/// Seconds a session of a user who left stays open before its last (unanswered) turn is
/// dropped.
const IDLE_TIMEOUT_SECS: f64 = 20.0;

/// How often the job's counts are polled (and the driver sees them).
const POLL: Duration = Duration::from_millis(10);

/// How long the driver waits for a version with no count moving before it gives up.
const STALL: Duration = Duration::from_secs(300);

/// `results.json`: scores of each method after each measured number of updates. A run over
/// several seeds adds the seeds, each seed's scores and their spread; `scores` is then the
/// mean over the seeds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// The measured numbers of updates.
    pub updates: Vec<usize>,
    /// Method name → one score per entry of `updates` (the mean over `seeds` when there are
    /// several).
    pub scores: BTreeMap<String, Vec<f64>>,
    /// The experiment seeds, in run order (only with several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seeds: Option<Vec<u64>>,
    /// Method name → seed → one score per entry of `updates` (only with several seeds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_seed: Option<BTreeMap<String, BTreeMap<String, Vec<f64>>>>,
    /// Method name → the sample standard deviation (n − 1 in the denominator) over the seeds
    /// of each entry of `scores` (only with several seeds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub std: Option<BTreeMap<String, Vec<f64>>>,
}

impl Results {
    /// The results of several seeds' runs (`(seed, results)`, in run order, each over the same
    /// methods and `updates`): per method and measurement, the mean over the seeds and its
    /// sample standard deviation.
    pub fn over_seeds(runs: &[(u64, Results)]) -> Results {
        let updates = runs
            .first()
            .map(|(_, r)| r.updates.clone())
            .unwrap_or_default();
        let mut per_seed: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for (seed, r) in runs {
            for (method, scores) in &r.scores {
                per_seed
                    .entry(method.clone())
                    .or_default()
                    .insert(seed.to_string(), scores.clone());
            }
        }
        let mut scores = BTreeMap::new();
        let mut std = BTreeMap::new();
        for (method, by_seed) in &per_seed {
            let (means, stds) = (0..updates.len())
                .map(|i| {
                    let xs: Vec<f64> = by_seed.values().filter_map(|v| v.get(i).copied()).collect();
                    mean_and_sample_std(&xs)
                })
                .unzip();
            scores.insert(method.clone(), means);
            std.insert(method.clone(), stds);
        }
        Results {
            updates,
            scores,
            seeds: Some(runs.iter().map(|(s, _)| *s).collect()),
            per_seed: Some(per_seed),
            std: Some(std),
        }
    }
}

/// The mean of `xs` and their sample standard deviation (n − 1 in the denominator; 0 for
/// fewer than two values).
pub fn mean_and_sample_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// The experiment seeds of `clawrl run --seeds 1,2,3`: at least one, none repeated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seeds(pub Vec<u64>);

/// Why a `--seeds` value is not a list of seeds.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SeedsError {
    /// No seed at all.
    #[error("--seeds is empty: give comma-separated seeds, such as --seeds 1,2,3")]
    Empty,
    /// An entry is not a non-negative integer.
    #[error("--seeds: {0:?} is not a seed (a non-negative integer)")]
    NotANumber(String),
    /// A seed appears twice.
    #[error("--seeds: seed {0} is given twice")]
    Duplicate(u64),
}

impl std::str::FromStr for Seeds {
    type Err = SeedsError;

    /// Comma-separated seeds; spaces around each are ignored.
    fn from_str(s: &str) -> Result<Self, SeedsError> {
        if s.trim().is_empty() {
            return Err(SeedsError::Empty);
        }
        let mut seeds = Vec::new();
        for part in s.split(',').map(str::trim) {
            let seed: u64 = part
                .parse()
                .map_err(|_| SeedsError::NotANumber(part.to_string()))?;
            if seeds.contains(&seed) {
                return Err(SeedsError::Duplicate(seed));
            }
            seeds.push(seed);
        }
        Ok(Seeds(seeds))
    }
}

/// The job's counts when the trainer was first seen at one version (`details.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdateLog {
    /// The number of updates (= the trainer's weight version).
    pub update: u64,
    /// Seconds of training traffic since the job started (measurements excluded).
    pub train_seconds: f64,
    /// Main turns the gateway recorded and offered to the job, so far.
    pub turns: u64,
    /// Of those, judged.
    pub judged: u64,
    /// Samples built and handed to the trainer, so far.
    pub samples: u64,
    /// Samples the trainer trained on, so far.
    pub trained: u64,
    /// Optimizer steps made.
    pub trainer_steps: u64,
    /// User requests answered since the previous entry, by the weight version that served them.
    pub served_by_version: BTreeMap<u64, u64>,
}

/// One measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measurement {
    /// After this many updates (the weight version every response was answered by).
    pub updates: usize,
    /// The personalization score.
    pub score: f64,
    /// The score over student tasks only.
    pub student: f64,
    /// The score over teacher tasks only.
    pub teacher: f64,
    /// A few first responses (task id, response).
    pub examples: Vec<(String, String)>,
}

/// One method's run.
#[derive(Debug, Clone, Serialize)]
pub struct MethodRun {
    /// The method.
    pub method: Method,
    /// Measurements, in `eval_at` order.
    pub measurements: Vec<Measurement>,
    /// One entry per update.
    pub updates: Vec<UpdateLog>,
    /// Conversations the users held with the gateway.
    pub conversations: u64,
    /// User requests answered, by the weight version that served them.
    pub served_by_version: BTreeMap<u64, u64>,
    /// Seconds of training traffic (measurements excluded) divided by the updates.
    pub seconds_per_update: f64,
    /// Seconds for the whole job (start, training, measuring, drain).
    pub seconds: f64,
    /// The job's own report (counts, trainer, gateway versions, records).
    pub job: GatewayJobReport,
}

/// Everything the experiment measured (`details.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The scores table.
    pub results: Results,
    /// The warm start.
    pub sft: SftOutcome,
    /// The warm start measured with each user's whole directive as a hint on every held-out
    /// question: how well it follows the instruction an OPD teacher sees.
    pub instructed: Option<Measurement>,
    /// Per method.
    pub runs: Vec<MethodRun>,
    /// Seconds for the whole experiment (warm start included).
    pub seconds: f64,
}

/// What the driver shows while a method runs: the method and its job's counts.
pub type Progress = Arc<dyn Fn(Method, &JobCounts) + Send + Sync>;

/// Samples the trainer has or will have from the turns so far: those handed to it (less those
/// it dropped or failed) plus `reserved` user turns not yet settled by the job (each yields at
/// most one sample).
pub fn committed(c: &JobCounts, reserved: u64) -> u64 {
    let t = &c.trainer;
    c.samples_submitted
        .saturating_sub(t.dropped_stale + t.failed)
        .saturating_add(reserved.saturating_sub(c.turns_settled))
}

/// How many samples the users may hold beyond the trainer's version: the batch of the step in
/// flight and the next one, gathered while that step runs (so a sample is at most about one
/// version stale when trained, as in an online deployment that keeps serving while it trains).
pub fn lead_cap(version: u64, batch: u64) -> u64 {
    (version + 2) * batch
}

/// The gate in front of every user turn: a turn may start while [`committed`] stays under the
/// cap (`batch_size ×` the next measured number of updates) and under [`lead_cap`]; no cap:
/// the users leave.
struct Budget {
    state: Mutex<BudgetState>,
    changed: Notify,
    counts: watch::Receiver<JobCounts>,
    batch: u64,
}

struct BudgetState {
    cap: Option<u64>,
    /// User turns started that will be (or were) completed with a next state.
    reserved: u64,
}

impl Budget {
    fn new(counts: watch::Receiver<JobCounts>, batch: u64) -> Self {
        Self {
            state: Mutex::new(BudgetState {
                cap: Some(0),
                reserved: 0,
            }),
            changed: Notify::new(),
            counts,
            batch,
        }
    }

    fn set_cap(&self, cap: Option<u64>) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).cap = cap;
        self.changed.notify_waiters();
    }

    /// Reserves one turn: at once if the cap allows, else (with `wait`) when it does; `false`
    /// when the users must leave (or, without `wait`, when it does not allow one now).
    async fn reserve(&self, wait: bool) -> bool {
        let mut counts = self.counts.clone();
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let c = counts.borrow_and_update().clone();
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let Some(cap) = st.cap else { return false };
                let cap = cap.min(lead_cap(c.trainer.version, self.batch));
                if committed(&c, st.reserved) < cap {
                    st.reserved += 1;
                    return true;
                }
                if !wait {
                    return false;
                }
            }
            tokio::select! {
                r = counts.changed() => if r.is_err() { return false },
                _ = &mut notified => {}
            }
        }
    }

    /// Gives back a reserved turn that was never completed (its request failed).
    fn cancel(&self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.reserved = st.reserved.saturating_sub(1);
    }
}

/// A client of one job's gateway.
#[derive(Clone)]
struct Gateway {
    http: reqwest::Client,
    base: String,
    key: String,
    temperature: f32,
    max_tokens: usize,
}

/// One chat completion to ask.
struct Ask<'a> {
    what: &'static str,
    messages: &'a [Value],
    seed: u64,
    stream: bool,
    /// A side turn (never recorded, never trained on).
    side: bool,
    /// The weight version that must answer it.
    version: Option<u64>,
    /// The most tokens to answer with, when not the experiment's `max_new_tokens`.
    max_tokens: Option<usize>,
}

/// A chat completion's answer: the assistant's text and the version that served it.
struct Answer {
    content: String,
    version: u64,
}

impl Gateway {
    async fn chat(&self, ask: &Ask<'_>) -> Result<Answer, ExperimentError> {
        let what = ask.what;
        let http_err = |e: reqwest::Error| ExperimentError::Http {
            what,
            message: e.to_string(),
        };
        let mut req = self
            .http
            .post(format!("{}/v1/chat/completions", self.base))
            .bearer_auth(&self.key)
            .json(&json!({
                "model": MODEL,
                "messages": ask.messages,
                "temperature": self.temperature,
                "top_p": 1.0,
                "max_tokens": ask.max_tokens.unwrap_or(self.max_tokens),
                "seed": ask.seed,
                "stream": ask.stream,
            }));
        if ask.side {
            req = req.header("X-Turn-Type", "side");
        }
        if let Some(v) = ask.version {
            req = req.header("X-Clawrl-Version", v.to_string());
        }
        let mut resp = req.send().await.map_err(http_err)?;
        let status = resp.status().as_u16();
        let version = resp
            .headers()
            .get("x-clawrl-version")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if status == 409 {
            if let (Some(want), Some(serving)) = (ask.version, version) {
                return Err(ExperimentError::WrongVersion { want, serving });
            }
        }
        if !(200..300).contains(&status) {
            let body = resp.text().await.unwrap_or_default();
            return Err(ExperimentError::Status { what, status, body });
        }
        let bad = |message: String| ExperimentError::Http { what, message };
        let version = version.ok_or_else(|| bad("no X-Clawrl-Version header".into()))?;
        let content = if ask.stream {
            let mut sse = SseText::default();
            while let Some(chunk) = resp.chunk().await.map_err(http_err)? {
                sse.push(&chunk).map_err(bad)?;
            }
            sse.finish().map_err(bad)?
        } else {
            let v: Value = resp.json().await.map_err(http_err)?;
            completion_text(&v).map_err(bad)?
        };
        Ok(Answer { content, version })
    }

    /// The version the gateway serves now (`GET /healthz`).
    async fn serving(&self) -> Result<u64, ExperimentError> {
        let what = "healthz";
        let v: Value = self
            .http
            .get(format!("{}/healthz", self.base))
            .bearer_auth(&self.key)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| ExperimentError::Http {
                what,
                message: e.to_string(),
            })?
            .json()
            .await
            .map_err(|e| ExperimentError::Http {
                what,
                message: e.to_string(),
            })?;
        v["version"].as_u64().ok_or_else(|| ExperimentError::Http {
            what,
            message: format!("no version in {v}"),
        })
    }
}

/// The assistant text of a (non-streamed) chat completion: `choices[0].message.content`, a
/// string or null.
fn completion_text(v: &Value) -> Result<String, String> {
    let m = v
        .pointer("/choices/0/message")
        .ok_or_else(|| format!("not a chat completion: {v}"))?;
    match m.get("content") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Null) | None => Ok(String::new()),
        Some(other) => Err(format!("message content is not text: {other}")),
    }
}

/// The assistant text of a streamed chat completion, from its server-sent events: the
/// `choices[0].delta.content` pieces, in order, up to `data: [DONE]`.
#[derive(Default)]
struct SseText {
    buf: Vec<u8>,
    text: String,
    done: bool,
}

impl SseText {
    fn push(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.buf.extend_from_slice(bytes);
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let event = std::str::from_utf8(&event).map_err(|e| format!("event: {e}"))?;
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                if self.done {
                    return Err("data after [DONE]".into());
                }
                let v: Value =
                    serde_json::from_str(data).map_err(|e| format!("event {data:?}: {e}"))?;
                if let Some(e) = v.get("error") {
                    return Err(format!("the stream failed: {e}"));
                }
                match v.pointer("/choices/0/delta/content") {
                    Some(Value::String(s)) => self.text.push_str(s),
                    Some(Value::Null) | None => {}
                    Some(other) => return Err(format!("delta content is not text: {other}")),
                }
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<String, String> {
        if !self.done {
            return Err("the stream ended without data: [DONE]".into());
        }
        Ok(self.text)
    }
}

/// What the users share: the train tasks, the draws, and what they count.
struct Users {
    env: PersonalEnv,
    rng: Mutex<ChaCha8Rng>,
    gateway: Gateway,
    budget: Budget,
    conversations: Mutex<u64>,
    served: Mutex<BTreeMap<u64, u64>>,
    /// The questions of the conversations under way: two at once never share one, so the
    /// gateway's session inference cannot mistake one's reply for the other's.
    asking: Mutex<std::collections::HashSet<String>>,
}

impl Users {
    /// One user after another on this seat until the budget sends them away.
    async fn seat(self: Arc<Self>) -> Result<(), ExperimentError> {
        while self.budget.reserve(true).await {
            let (draw, question) = {
                let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
                let mut asking = self.asking.lock().unwrap_or_else(|p| p.into_inner());
                let tasks = self.env.tasks();
                // A question under way is drawn again (a bounded number of times: with fewer
                // distinct questions than seats, two conversations may share one).
                let mut index = rng.random_range(0..tasks.len());
                for _ in 0..64 {
                    if !asking.contains(&tasks[index].question()) {
                        break;
                    }
                    index = rng.random_range(0..tasks.len());
                }
                let question = tasks[index].question();
                asking.insert(question.clone());
                let draw = (
                    index,
                    rng.random::<u64>(),
                    rng.random::<u64>(),
                    rng.random_bool(0.5),
                );
                (draw, question)
            };
            let done = self.converse(draw).await;
            self.asking
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&question);
            done?;
        }
        Ok(())
    }

    /// One conversation; its first turn is already reserved.
    async fn converse(
        &self,
        (index, episode_seed, seed, stream): (usize, u64, u64, bool),
    ) -> Result<(), ExperimentError> {
        *self.conversations.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let mut ep = self.env.episode(index, episode_seed)?;
        let mut messages = ep.observation().messages;
        let mut request = 0u64;
        loop {
            let ask = Ask {
                what: "a user's turn",
                messages: &messages,
                seed: seed.wrapping_add(request),
                stream,
                side: false,
                version: None,
                max_tokens: None,
            };
            request += 1;
            let answer = match self.gateway.chat(&ask).await {
                Ok(a) => a,
                Err(e) => {
                    self.budget.cancel();
                    return Err(e);
                }
            };
            *self
                .served
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(answer.version)
                .or_default() += 1;
            let (outcome, _) = ep.apply(&Action {
                content: answer.content.clone(),
                tool_calls: Vec::new(),
                raw: answer.content,
            })?;
            messages = ep.observation().messages;
            // The reply is the answered turn's next state: it goes to the gateway as the next
            // request. The user answers what follows only if it stays and the budget allows.
            let stays = !outcome.done && self.budget.reserve(false).await;
            if !stays {
                // A user who leaves reads none of the answer to its reply, so it asks for one
                // token: the request is there to deliver the next state.
                let ask = Ask {
                    what: "a user's last reply",
                    messages: &messages,
                    seed: seed.wrapping_add(request),
                    stream,
                    side: false,
                    version: None,
                    max_tokens: Some(1),
                };
                let answer = self.gateway.chat(&ask).await?;
                *self
                    .served
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(answer.version)
                    .or_default() += 1;
                return Ok(());
            }
        }
    }
}

/// Measures the version the gateway serves, which must be `version`: the held-out first
/// responses, as side turns that name it. With `instructed`, each question carries the user's
/// whole directive as a hint (what an OPD teacher sees at best).
async fn measure(
    gateway: &Gateway,
    eval: &PersonalEnv,
    x: &ExperimentSettings,
    version: u64,
    instructed: bool,
) -> Result<Measurement, ExperimentError> {
    let mut asks = Vec::new();
    for (i, task) in eval.tasks().iter().enumerate() {
        let ep = eval.episode(i, 0)?;
        let mut messages = ep.observation().messages;
        if instructed {
            let hint = super::style::directive_phrases(task.user).join(" , ");
            let last = messages.len() - 1;
            let text = messages[last]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            messages[last]["content"] =
                Value::String(format!("{text}{}{hint}", clawrl::judge::HINT_PREFIX));
        }
        for s in 0..x.eval_samples {
            let seed = x.seed ^ 0xe7a1_0000 ^ ((i as u64) << 8) ^ s as u64;
            asks.push((messages.clone(), seed, task.user, task.id()));
        }
    }
    let answers: Vec<(String, UserKind, String)> = futures::stream::iter(asks)
        .enumerate()
        .map(|(n, (messages, seed, user, id))| async move {
            let a = gateway
                .chat(&Ask {
                    what: "a measurement",
                    messages: &messages,
                    seed,
                    stream: n % 2 == 1,
                    side: true,
                    version: Some(version),
                    max_tokens: None,
                })
                .await?;
            Ok::<_, ExperimentError>((a.content, user, id))
        })
        .buffered(64)
        .try_collect()
        .await?;
    // Up to six examples, alternating student and teacher, in the order they were asked.
    let mut examples = Vec::new();
    for (text, user, id) in &answers {
        if examples.len() < 6 && (examples.len() % 2 == 0) == (*user == UserKind::Student) {
            examples.push((id.clone(), text.clone()));
        }
    }
    let score = |only: Option<UserKind>| {
        personalization_score(
            answers
                .iter()
                .filter(|(_, user, _)| only.is_none_or(|o| o == *user))
                .map(|(text, user, _)| (*user, text.as_str())),
        )
    };
    Ok(Measurement {
        updates: version as usize,
        score: score(None),
        student: score(Some(UserKind::Student)),
        teacher: score(Some(UserKind::Teacher)),
        examples,
    })
}

/// Waits until the gateway serves `version` (the trainer has published it; the gateway
/// installs it while serving), checking at each count poll; an error if it serves a newer one
/// or nothing moves for [`STALL`].
async fn wait_serving(
    gateway: &Gateway,
    counts: &mut watch::Receiver<JobCounts>,
    version: u64,
) -> Result<(), ExperimentError> {
    let since = Instant::now();
    loop {
        let serving = gateway.serving().await?;
        if serving == version {
            return Ok(());
        }
        if serving > version || since.elapsed() > STALL {
            return Err(ExperimentError::WrongVersion {
                want: version,
                serving,
            });
        }
        if counts.changed().await.is_err() {
            return Err(ExperimentError::WrongVersion {
                want: version,
                serving,
            });
        }
    }
}

/// The counts whose change means the job moved (the clock alone does not).
fn progress_of(c: &JobCounts) -> [u64; 6] {
    let t = &c.trainer;
    [
        c.turns,
        c.turns_settled,
        c.samples_submitted,
        t.trained,
        t.pending,
        t.version,
    ]
}

/// What driving one method's job gave.
struct Driven {
    measurements: Vec<Measurement>,
    instructed: Option<Measurement>,
    updates: Vec<UpdateLog>,
    conversations: u64,
    served: BTreeMap<u64, u64>,
    train_seconds: f64,
}

/// Drives one method's job: measures at 0, lets the users talk until the trainer reaches each
/// measured version, measures it, and stops the users after the last.
#[allow(clippy::too_many_arguments)]
async fn drive(
    method: Method,
    file: &ExperimentFile,
    gateway: Gateway,
    mut counts: watch::Receiver<JobCounts>,
    train: PersonalEnv,
    eval: &PersonalEnv,
    with_instructed: bool,
) -> Result<Driven, ExperimentError> {
    let x = &file.experiment;
    let name = method.name();
    let users = Arc::new(Users {
        env: train,
        rng: Mutex::new(ChaCha8Rng::seed_from_u64(x.seed ^ 0x7a11)),
        gateway: gateway.clone(),
        budget: Budget::new(counts.clone(), x.batch_size as u64),
        conversations: Mutex::new(0),
        served: Mutex::new(BTreeMap::new()),
        asking: Mutex::new(Default::default()),
    });
    let mut measurements = Vec::new();
    if x.eval_at.first() == Some(&0) {
        wait_serving(&gateway, &mut counts, 0).await?;
        measurements.push(measure(&gateway, eval, x, 0, false).await?);
    }
    let instructed = if with_instructed {
        Some(measure(&gateway, eval, x, 0, true).await?)
    } else {
        None
    };
    let mut seats = tokio::task::JoinSet::new();
    for _ in 0..x.users_at_once {
        seats.spawn(users.clone().seat());
    }
    let mut updates = Vec::new();
    let mut logged = 0u64;
    let mut served_before = BTreeMap::new();
    let mut train_seconds = 0.0;
    let result: Result<(), ExperimentError> = async {
        for &target in x.eval_at.iter().filter(|&&e| e > 0) {
            let target = target as u64;
            let resumed = Instant::now();
            let mut moved = Instant::now();
            let mut last = progress_of(&counts.borrow());
            users.budget.set_cap(Some(target * x.batch_size as u64));
            loop {
                let c = counts.borrow_and_update().clone();
                if progress_of(&c) != last {
                    moved = Instant::now();
                    last = progress_of(&c);
                }
                while logged < c.trainer.version.min(target) {
                    logged += 1;
                    let served = users
                        .served
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone();
                    let delta = served
                        .iter()
                        .map(|(v, n)| (*v, n - served_before.get(v).copied().unwrap_or(0)))
                        .filter(|(_, n)| *n > 0)
                        .collect();
                    served_before = served;
                    updates.push(UpdateLog {
                        update: logged,
                        train_seconds: train_seconds + resumed.elapsed().as_secs_f64(),
                        turns: c.turns,
                        judged: c.judged,
                        samples: c.samples_submitted,
                        trained: c.trainer.trained,
                        trainer_steps: c.trainer.steps,
                        served_by_version: delta,
                    });
                }
                if c.trainer.version >= target {
                    break;
                }
                if c.phase != JobPhase::Running {
                    return Err(ExperimentError::JobEnded {
                        method: name,
                        why: format!("{:?}: {:?}", c.phase, c.last_error),
                    });
                }
                if moved.elapsed() > STALL {
                    return Err(ExperimentError::Stalled {
                        want: target,
                        secs: STALL.as_secs(),
                        counts: serde_json::to_string(&c).unwrap_or_default(),
                    });
                }
                tokio::select! {
                    r = counts.changed() => if r.is_err() {
                        return Err(ExperimentError::JobEnded {
                            method: name,
                            why: "its counts stopped".into(),
                        });
                    },
                    Some(done) = seats.join_next() => match done {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(e),
                        Err(e) => return Err(ExperimentError::JobEnded {
                            method: name,
                            why: format!("a user task failed: {e}"),
                        }),
                    },
                }
            }
            train_seconds += resumed.elapsed().as_secs_f64();
            wait_serving(&gateway, &mut counts, target).await?;
            let m = measure(&gateway, eval, x, target, false).await?;
            tracing::info!(
                method = name,
                updates = target,
                score = m.score,
                "personal: measured"
            );
            measurements.push(m);
        }
        Ok(())
    }
    .await;
    // The users leave; a user's failure counts once the driver is done.
    users.budget.set_cap(None);
    let mut first_err = result.err();
    while let Some(done) = seats.join_next().await {
        let err = match done {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(e) => Some(ExperimentError::JobEnded {
                method: name,
                why: format!("a user task failed: {e}"),
            }),
        };
        if first_err.is_none() {
            first_err = err;
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let conversations = *users
        .conversations
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let served = users
        .served
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(Driven {
        measurements,
        instructed,
        updates,
        conversations,
        served,
        train_seconds,
    })
}

/// Runs one method's `personal` job under the driver; its run directory is `out`.
#[allow(clippy::too_many_arguments)]
async fn run_method(
    method: Method,
    file: &ExperimentFile,
    origin: &str,
    sft_dir: &Path,
    out: &Path,
    eval: &PersonalEnv,
    with_instructed: bool,
    progress: Option<Progress>,
) -> Result<(MethodRun, Option<Measurement>), ExperimentError> {
    let started = Instant::now();
    let x = &file.experiment;
    let key = format!("sk-experiment-{:016x}", rand::random::<u64>());
    let spec = file.job_spec(method, sft_dir, &key, origin)?;
    let train = PersonalEnv::new(
        PersonalEnv::sample_tasks(Split::Train, x.train_tasks_per_user, x.seed),
        file.users.clone(),
    )?;
    let (counts_tx, counts_rx) = watch::channel(JobCounts::default());
    let report: ProgressReport = Arc::new(move |c: &JobCounts| {
        if let Some(p) = &progress {
            p(method, c);
        }
        counts_tx.send_replace(c.clone());
    });
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let options = GatewayJobOptions {
        out: out.to_path_buf(),
        job_id: format!("{}-{}", file.name, method.name()),
        progress: Some(report),
        poll: POLL,
        on_listening: Some(Box::new(move |addr, _model| {
            let _ = addr_tx.send(addr);
        })),
    };
    let job = run_gateway_job(
        &spec,
        origin,
        options,
        Box::pin(async move {
            let _ = stop_rx.await;
        }),
    );
    let driver = async move {
        let driven = match addr_rx.await {
            Ok(addr) => {
                let gateway = Gateway {
                    http: reqwest::Client::new(),
                    base: format!("http://{addr}"),
                    key,
                    temperature: x.temperature,
                    max_tokens: x.max_new_tokens,
                };
                drive(
                    method,
                    file,
                    gateway,
                    counts_rx,
                    train,
                    eval,
                    with_instructed,
                )
                .await
            }
            Err(_) => Err(ExperimentError::JobEnded {
                method: method.name(),
                why: "it never listened".into(),
            }),
        };
        let _ = stop_tx.send(());
        driven
    };
    let (job, driven) = tokio::join!(job, driver);
    let job = job.map_err(|source| ExperimentError::Job {
        method: method.name(),
        source,
    })?;
    let d = driven?;
    let run = MethodRun {
        method,
        measurements: d.measurements,
        seconds_per_update: d.train_seconds / x.eval_at.last().copied().unwrap_or(1).max(1) as f64,
        updates: d.updates,
        conversations: d.conversations,
        served_by_version: d.served,
        seconds: started.elapsed().as_secs_f64(),
        job,
    };
    Ok((run, d.instructed))
}

/// Runs the experiment described by `file` (read from `origin`), writing `results.json`,
/// `details.json` and `scores.png` into `run_dir`, each method's job under `run_dir/<method>`;
/// `progress` sees every job's counts.
pub fn run(
    file: &ExperimentFile,
    origin: &str,
    run_dir: &Path,
    progress: Option<Progress>,
) -> Result<Report, ExperimentError> {
    let started = Instant::now();
    let run_dir = prepare_run_dir(run_dir)?;
    let sft = warm_start(&file.sft, &file.cache_dir(), false)?;
    tracing::info!(dir = %sft.dir.display(), cached = sft.cached, "personal: warm start ready");
    let sft_dir = std::path::absolute(&sft.dir).map_err(|e| FileError::write(&sft.dir, e))?;
    let x = &file.experiment;
    let eval = PersonalEnv::new(
        PersonalEnv::sample_tasks(Split::HeldOut, x.eval_tasks_per_user, x.seed ^ 0xe7a1),
        file.users.clone(),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ExperimentError::Runtime)?;
    let mut runs = Vec::new();
    let mut instructed = None;
    for (i, &method) in x.methods.iter().enumerate() {
        let out = run_dir.join(method.name());
        let (run, inst) = rt.block_on(run_method(
            method,
            file,
            origin,
            &sft_dir,
            &out,
            &eval,
            i == 0,
            progress.clone(),
        ))?;
        tracing::info!(
            method = method.name(),
            seconds = run.seconds,
            per_update = run.seconds_per_update,
            "personal: method done"
        );
        instructed = instructed.or(inst);
        runs.push(run);
    }
    let results = Results {
        seeds: None,
        per_seed: None,
        std: None,
        updates: x.eval_at.clone(),
        scores: runs
            .iter()
            .map(|r| {
                (
                    r.method.name().to_string(),
                    r.measurements.iter().map(|m| m.score).collect(),
                )
            })
            .collect(),
    };
    let report = Report {
        results,
        sft,
        instructed,
        runs,
        seconds: started.elapsed().as_secs_f64(),
    };
    write_outputs(&run_dir, &report.results, &report, "scores.png")?;
    Ok(report)
}

/// Everything a run over several seeds measured (`details.json` of such a run).
#[derive(Debug, Clone, Serialize)]
pub struct SeedsReport {
    /// The scores table: mean and sample standard deviation over the seeds, and each seed's.
    pub results: Results,
    /// Each seed's whole report (its per-update counts among them), by seed.
    pub per_seed: BTreeMap<String, Report>,
    /// Seconds for the whole run (warm start included).
    pub seconds: f64,
}

/// Runs the experiment once per seed of `seeds` (each replacing `experiment.seed`: task draws,
/// sampling, the learner, the held-out tasks), each into `run_dir/seed-<seed>` as [`run`]
/// does, all from the same warm start (`sft` does not change, so the first run trains or finds
/// it and the others find it cached); then writes the results over the seeds (`results.json`,
/// `details.json`, `scores.png` with a band of ± one standard deviation) into `run_dir`.
/// `progress` sees every job's counts with the seed it runs.
pub fn run_seeds(
    file: &ExperimentFile,
    origin: &str,
    run_dir: &Path,
    seeds: &[u64],
    progress: Option<SeedProgress>,
) -> Result<SeedsReport, ExperimentError> {
    let started = Instant::now();
    let mut reports = Vec::new();
    for &seed in seeds {
        let mut f = file.clone();
        f.experiment.seed = seed;
        let p: Option<Progress> = progress.clone().map(|p| {
            let p: Progress = Arc::new(move |m: Method, c: &JobCounts| p(seed, m, c));
            p
        });
        let report = run(&f, origin, &run_dir.join(format!("seed-{seed}")), p)?;
        tracing::info!(seed, seconds = report.seconds, "personal: seed done");
        reports.push((seed, report));
    }
    let results = Results::over_seeds(
        &reports
            .iter()
            .map(|(s, r)| (*s, r.results.clone()))
            .collect::<Vec<_>>(),
    );
    let report = SeedsReport {
        results,
        per_seed: reports
            .into_iter()
            .map(|(s, r)| (s.to_string(), r))
            .collect(),
        seconds: started.elapsed().as_secs_f64(),
    };
    write_outputs(run_dir, &report.results, &report, "scores.png")?;
    Ok(report)
}

/// What the driver shows while several seeds run: the seed, the method and its job's counts.
pub type SeedProgress = Arc<dyn Fn(u64, Method, &JobCounts) + Send + Sync>;

/// The table of a run over several seeds: per method and measurement, mean ± sample standard
/// deviation over the seeds (and the mean seconds per update), then each seed's scores.
pub fn seeds_table(report: &SeedsReport) -> String {
    let r = &report.results;
    let mut out = String::from("| method |");
    for u in &r.updates {
        out.push_str(&format!(" {u} updates |"));
    }
    out.push_str(" s / update |\n| --- |");
    for _ in &r.updates {
        out.push_str(" --- |");
    }
    out.push_str(" --- |");
    // Methods in the order they ran.
    let methods: Vec<&str> = report
        .per_seed
        .values()
        .next()
        .map(|rep| rep.runs.iter().map(|run| run.method.name()).collect())
        .unwrap_or_default();
    let empty = BTreeMap::new();
    for (method, means) in methods.iter().filter_map(|m| r.scores.get_key_value(*m)) {
        let stds = r.std.as_ref().and_then(|s| s.get(method));
        out.push_str(&format!("\n| {method} |"));
        for (i, m) in means.iter().enumerate() {
            let sd = stds.and_then(|s| s.get(i)).copied().unwrap_or(0.0);
            out.push_str(&format!(" {m:.3} ± {sd:.3} |"));
        }
        let per_update: Vec<f64> = report
            .per_seed
            .values()
            .flat_map(|rep| rep.runs.iter())
            .filter(|run| run.method.name() == method)
            .map(|run| run.seconds_per_update)
            .collect();
        out.push_str(&format!(" {:.2} |", mean_and_sample_std(&per_update).0));
    }
    out.push_str("\n\n| method | seed |");
    for u in &r.updates {
        out.push_str(&format!(" {u} updates |"));
    }
    out.push_str("\n| --- | --- |");
    for _ in &r.updates {
        out.push_str(" --- |");
    }
    for (method, by_seed) in methods
        .iter()
        .filter_map(|m| r.per_seed.as_ref().unwrap_or(&empty).get_key_value(*m))
    {
        for seed in r.seeds.iter().flatten() {
            if let Some(scores) = by_seed.get(&seed.to_string()) {
                out.push_str(&format!("\n| {method} | {seed} |"));
                for x in scores {
                    out.push_str(&format!(" {x:.3} |"));
                }
            }
        }
    }
    out
}

/// The scores table of a report, one line per method (the README's table).
pub fn summary_table(report: &Report) -> String {
    let mut out = String::from("| method |");
    for u in &report.results.updates {
        out.push_str(&format!(" {u} updates |"));
    }
    out.push_str(" s / update |\n| --- |");
    for _ in &report.results.updates {
        out.push_str(" --- |");
    }
    out.push_str(" --- |");
    for r in &report.runs {
        out.push_str(&format!("\n| {} |", r.method.name()));
        for m in &r.measurements {
            out.push_str(&format!(" {:.2} |", m.score));
        }
        out.push_str(&format!(" {:.2} |", r.seconds_per_update));
    }
    out
}

/// `clawrl run <experiment file> [--seeds S,..]`: runs it into `out` (default
/// `runs/<name>-<unix time>`) with a progress bar per method, and prints the scores table, or
/// the whole report as JSON with `json` (no bars). Without `seeds` it runs the file's seed;
/// one seed replaces the file's; several run [`run_seeds`] and print mean ± standard
/// deviation. Returns the run directory.
pub fn cli_main(
    path: &Path,
    out: Option<PathBuf>,
    json: bool,
    seeds: Option<&Seeds>,
) -> Result<PathBuf, ExperimentError> {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let mut file = ExperimentFile::from_file(path)?;
    let several = match seeds.map(|s| s.0.as_slice()) {
        Some([one]) => {
            file.experiment.seed = *one;
            None
        }
        Some(many) if many.len() > 1 => Some(many.to_vec()),
        _ => None,
    };
    let run_dir = crate::experiments::run_dir(out, &file.name);
    let bar = ProgressBar::with_draw_target(
        Some(file.experiment.updates as u64),
        if json {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr_with_hz(5)
        },
    );
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} {prefix:>16} [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let shown = bar.clone();
    let progress: SeedProgress = Arc::new(move |seed: u64, m: Method, c: &JobCounts| {
        let prefix = format!("seed {seed} {}", m.name());
        if shown.prefix() != prefix {
            shown.set_prefix(prefix);
            shown.reset();
        }
        shown.set_position(c.trainer.version);
        shown.set_message(format!(
            "updates · turns {} judged {} · samples {} trained {}",
            c.turns, c.judged, c.samples_submitted, c.trainer.trained
        ));
    });
    let origin = path.display().to_string();
    if let Some(seeds) = several {
        let report = run_seeds(&file, &origin, &run_dir, &seeds, Some(progress));
        bar.finish_and_clear();
        let report = report?;
        crate::experiments::print_report(
            json,
            &report,
            &seeds_table(&report),
            crate::experiments::Done {
                sft: None,
                seconds: report.seconds,
                outputs: &format!(
                    "results.json, details.json and scores.png (mean ± sample standard \
                     deviation over seeds {seeds:?}; each seed's own in seed-<seed>/)"
                ),
                run_dir: &run_dir,
            },
        );
        return Ok(run_dir);
    }
    let seed = file.experiment.seed;
    let one: Progress = Arc::new(move |m: Method, c: &JobCounts| progress(seed, m, c));
    let report = run(&file, &origin, &run_dir, Some(one));
    bar.finish_and_clear();
    let report = report?;
    crate::experiments::print_report(
        json,
        &report,
        &summary_table(&report),
        crate::experiments::Done {
            sft: Some(&report.sft),
            seconds: report.seconds,
            outputs: "results.json, details.json and scores.png",
            run_dir: &run_dir,
        },
    );
    Ok(run_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_text() -> String {
        crate::experiments::example_text("personal.toml")
    }

    #[test]
    fn the_example_parses_and_bad_files_name_the_key() {
        let text = example_text();
        let f = ExperimentFile::from_toml_str(&text, "personal.toml").unwrap();
        assert_eq!(f.experiment.eval_at, vec![0, 8, 16]);
        assert_eq!(f.experiment.batch_size, 16);
        let spec = f
            .job_spec(Method::Combined, Path::new("/ck"), "k", "personal.toml")
            .unwrap();
        assert_eq!(spec.method.kind, MethodKind::Combined);
        assert_eq!(spec.optim.batch_size, 16);
        // No sample is dropped; one answered by an older version is importance-weighted.
        assert_eq!(spec.optim.staleness, 0);
        assert_eq!(
            spec.optim.staleness_mode,
            clawrl::job::StalenessPolicy::Importance
        );
        let g = spec.gateway.as_ref().unwrap();
        assert_eq!(g.on_session_end, clawrl::gateway::session::EndPolicy::Drop);
        let err = |t: String| {
            ExperimentFile::from_toml_str(&t, "x.toml")
                .unwrap_err()
                .to_string()
        };
        let e = err(text.replace("kind = \"personal_experiment\"", "kind = \"rl\""));
        assert!(
            e.contains("x.toml") && e.contains("personal_experiment"),
            "{e}"
        );
        let e = err(text.replace("eval_at = [0, 8, 16]", "eval_at = [0, 8, 17]"));
        assert!(e.contains("experiment.eval_at"), "{e}");
        let e = err(text.replace("batch_size = 16", "batch_size = 0"));
        assert!(e.contains("experiment.batch_size"), "{e}");
        let e = err(text.replace("heads = 4", "heads = 3"));
        assert!(e.contains("sft.heads"), "{e}");
        let e = err(text.replace("users_at_once = 16", "users_at_once = 16\nbogus = 1"));
        assert!(e.contains("bogus"), "{e}");
        let e = err(text.replace("votes = 3", "votes = 0"));
        assert!(e.contains("judge.votes"), "{e}");
        let e = err(text.replace("directive_rate = 0.8", "directive_rate = 1.5"));
        assert!(e.contains("directive_rate"), "{e}");
    }

    #[test]
    fn seeds_parse_as_a_comma_list_and_bad_lists_name_the_flag() {
        let ok = |t: &str| t.parse::<Seeds>().unwrap().0;
        assert_eq!(ok("1,2,3"), vec![1, 2, 3]);
        assert_eq!(ok(" 7 , 0 "), vec![7, 0]);
        assert_eq!(ok("42"), vec![42]);
        let bad = |t: &str| t.parse::<Seeds>().unwrap_err();
        assert_eq!(bad(""), SeedsError::Empty);
        assert_eq!(bad("  "), SeedsError::Empty);
        assert_eq!(bad("1,2,1"), SeedsError::Duplicate(1));
        assert_eq!(bad("1,x"), SeedsError::NotANumber("x".into()));
        assert_eq!(bad("1,,2"), SeedsError::NotANumber("".into()));
        assert_eq!(bad("-1"), SeedsError::NotANumber("-1".into()));
        assert_eq!(bad("1.5"), SeedsError::NotANumber("1.5".into()));
        for t in ["", "1,1", "a"] {
            assert!(bad(t).to_string().contains("--seeds"), "{t:?}");
        }
    }

    #[test]
    fn results_over_seeds_are_the_mean_and_sample_std_per_point() {
        let one = |b: [f64; 2], c: [f64; 2]| Results {
            updates: vec![0, 8],
            scores: [
                ("binary".into(), b.to_vec()),
                ("combined".into(), c.to_vec()),
            ]
            .into(),
            ..Default::default()
        };
        let r = Results::over_seeds(&[
            (1, one([0.2, 0.4], [0.2, 0.6])),
            (2, one([0.2, 0.6], [0.2, 0.8])),
            (3, one([0.2, 0.8], [0.2, 1.0])),
        ]);
        assert_eq!(r.seeds, Some(vec![1, 2, 3]));
        assert_eq!(r.updates, vec![0, 8]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(r.scores["binary"][1], 0.6) && close(r.scores["combined"][1], 0.8));
        // Sample (n − 1) std of 0.4, 0.6, 0.8 is 0.2; no spread is 0.
        let std = r.std.as_ref().unwrap();
        assert!(close(std["binary"][1], 0.2) && close(std["binary"][0], 0.0));
        assert_eq!(
            r.per_seed.as_ref().unwrap()["combined"]["2"],
            vec![0.2, 0.8]
        );
        let v = serde_json::to_value(&r).unwrap();
        assert!(v["per_seed"]["binary"]["3"].is_array() && v["std"]["combined"].is_array());
        // One seed's results keep the plain shape.
        let v = serde_json::to_value(one([0.1, 0.2], [0.1, 0.3])).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
        assert_eq!(mean_and_sample_std(&[0.5]), (0.5, 0.0));
    }

    #[test]
    fn committed_counts_samples_held_and_turns_that_may_become_samples() {
        let mut c = JobCounts::default();
        assert_eq!(committed(&c, 0), 0);
        // 5 turns started, none settled: each may still give a sample.
        assert_eq!(committed(&c, 5), 5);
        // 3 settled into 2 samples (one gave none), 1 of them dropped stale.
        c.turns_settled = 3;
        c.samples_submitted = 2;
        c.trainer.dropped_stale = 1;
        assert_eq!(committed(&c, 5), 1 + 2);
        // Users run at most the batch in flight and one more ahead of the trainer.
        assert_eq!(lead_cap(0, 16), 32);
        assert_eq!(lead_cap(7, 16), 144);
    }

    #[test]
    fn streamed_text_is_the_concatenated_deltas_up_to_done() {
        let mut s = SseText::default();
        let ev = |t: &str| {
            format!(
                "data: {}\n\n",
                json!({"choices": [{"delta": {"content": t}}]})
            )
        };
        let all = format!(
            "{}{}data: {}\n\ndata: [DONE]\n\n",
            ev("hel"),
            ev("lo"),
            json!({"choices": [{"delta": {}, "finish_reason": "stop"}]})
        );
        // Split mid-event and mid-character.
        let bytes = all.as_bytes();
        s.push(&bytes[..7]).unwrap();
        s.push(&bytes[7..]).unwrap();
        assert_eq!(s.finish().unwrap(), "hello");
        let mut s = SseText::default();
        s.push(ev("x").as_bytes()).unwrap();
        assert!(s.finish().unwrap_err().contains("[DONE]"));
        let mut s = SseText::default();
        assert!(s
            .push(b"data: {\"error\": {\"message\": \"boom\"}}\n\n")
            .unwrap_err()
            .contains("boom"));
        assert_eq!(
            completion_text(&json!({"choices": [{"message": {"content": null}}]})).unwrap(),
            ""
        );
        assert!(completion_text(&json!({"x": 1})).is_err());
    }
}
