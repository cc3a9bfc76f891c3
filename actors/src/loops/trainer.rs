//! The `Trainer`: one per job. It collects samples, enforces the staleness bound, runs optimizer
//! steps on a dedicated learner thread, publishes every new weight version on the bulk plane,
//! announces it to the job's subscribers (rollout workers, records), checkpoints, and resumes
//! from the last checkpoint with the version counting on.
//!
//! - **Never blocks on the learner.** The [`Learner`] lives on its own OS thread for the whole
//!   life of the actor; steps, exports, publishes and checkpoints run there. The message loop
//!   keeps accepting samples while a step runs.
//! - **Batching.** A step fires as soon as `batch_size` samples pass the staleness check (or on
//!   [`TrainerMsg::Flush`], with fewer). One step runs at a time. With
//!   [`TrainerConfig::max_steps`] no step starts once the learner has made that many: the
//!   samples beyond stay `pending` (counted; with a checkpoint directory also journaled, so a
//!   resumed trainer with a higher limit trains them), so a job stops at exactly its step count.
//! - **Staleness** is checked when a batch is formed, against the trainer's version then: a
//!   sample whose tokens are more than `max_lag` versions behind is dropped and counted
//!   ([`StalenessMode::Drop`]), or trained with truncated importance weights
//!   ([`StalenessMode::Importance`]; the learner computes `min(exp(trainer − rollout), cap)` per
//!   token from the sample's rollout log-probs, and a stale sample without them is dropped).
//! - **Counts balance.** `produced = trained + dropped_stale + failed + pending`, where
//!   `pending` includes the samples of the step in flight. A failed step puts its samples back at
//!   the head of the queue; after `max_step_attempts` failures of the same batch (or at once
//!   when the learner skips the update, e.g. on a non-finite loss) they are counted as `failed`
//!   with the reason kept in [`TrainerStats::last_error`]. Samples refused on arrival (invalid,
//!   or claiming a version newer than the trainer's) are never accepted: they are counted in
//!   `rejected`, not in `produced`.
//! - **Versions only grow.** On start the learner resumes from the newest checkpoint under the
//!   configured directory. Versions published after that checkpoint (recorded in
//!   `<dir>/published`) were served but are lost with the old trainer: the resumed weights are
//!   then re-published as the next version above them, so replicas (which ignore versions that
//!   are not newer) switch to the trainer's lineage and versions keep counting up.
//!
//! - **Accepted samples survive a trainer restart.** With a checkpoint directory, every accepted
//!   sample is appended to `<dir>/pending.jsonl` before it is counted; when a checkpoint is
//!   written the journal is rewritten (temporary file, renamed) to the samples that checkpoint
//!   does not cover (the step in flight and the queue). A restarted trainer replays the journal
//!   into its queue ([`TrainerStats::recovered`]), so samples pending at the crash, and samples
//!   trained only into versions lost with the old trainer, are trained again from the
//!   checkpoint (under this trainer's job id: a job re-run on the same run directory gets a
//!   new one). The journal is flushed to the OS on every append (it survives a killed
//!   process; not a power cut). Counters are per incarnation: recovered samples count in the
//!   new one's `produced`.
//!
//! The actor's parts live beside it: `learner` (the [`Learner`] contract and the thread that
//! owns it), `publish` (where versions go and who hears of them), and `journal` (the
//! pending samples on disk).

mod journal;
mod learner;
mod publish;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::WeightAnnounce;
use journal::Journal;
use learner::{learner_thread, Job};

pub use learner::Learner;
pub use publish::{
    rollout_subscriber, Delivery, LocalPublisher, PublishFailed, RelayPublisher, Subscriber,
    WeightPublisher,
};

/// One training sample as the job produces it: token ids exactly as served and sampled, one
/// advantage per response token, and the weight version that produced every response token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSample {
    /// The job it belongs to.
    pub job: String,
    /// The session it came from.
    pub session_id: String,
    /// The turn (or step) index within the session.
    pub turn: u32,
    /// The weight version that produced every response token.
    pub version: u64,
    /// The full prompt as token ids.
    pub prompt_ids: Vec<u32>,
    /// The response as token ids.
    pub response_ids: Vec<u32>,
    /// One advantage per response token: the binary (or step-wise) term. An OPD term is not
    /// in here: it needs the trainer's own log-probs, see `opd`.
    pub advantages: Vec<f32>,
    /// The rollout worker's log-prob of each response token, when known.
    pub rollout_logprobs: Option<Vec<f32>>,
    /// The sample's OPD term, added to `advantages` by the trainer.
    #[serde(default)]
    pub opd: Option<OpdTerm>,
}

/// The on-policy distillation term of a sample, in one of the two forms of [`OpdLossKind`].
///
/// - Without `topk` (the advantage form): per response token `a_k` the term adds
///   `weight · (teacher_logprobs[k] − log π_old(a_k | s))` to the advantage, where `π_old` is the
///   trainer's own policy before the update at temperature 1, like the teacher. The rollout's
///   log-probs cannot stand in for it: they come from a tempered distribution and maybe an older
///   version.
/// - With `topk` (the top-k form): the term is `weight ×` the reverse KL from the student under
///   `s` to the teacher under `s_enhanced` over the teacher's top-k ids plus a tail bin, a loss
///   of its own beside the policy-gradient one; `teacher_logprobs` is then only carried along.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpdTerm {
    /// `w_opd`.
    pub weight: f32,
    /// `log π_teacher(a_k | s_enhanced)`, one per response token.
    pub teacher_logprobs: Vec<f32>,
    /// The teacher's top-k distribution per response token, for the top-k form.
    #[serde(default)]
    pub topk: Option<TeacherTopK>,
}

/// The teacher's `k` most likely tokens under `s_enhanced` at every response position, row-major
/// `[response tokens, k]`, most likely first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeacherTopK {
    /// `k` (≥ 1).
    pub k: u32,
    /// Token ids, `[tokens, k]`.
    pub ids: Vec<u32>,
    /// `log π_teacher(id | s_enhanced, a_<k)`, `[tokens, k]`.
    pub logprobs: Vec<f32>,
}

impl TeacherTopK {
    /// Checks the shape against `tokens` response tokens: `k ≥ 1`, `k` ids and `k` finite
    /// log-probs `≤ 0` per token. Says what is wrong, naming the field.
    pub fn check(&self, tokens: usize) -> Result<(), String> {
        if self.k == 0 {
            return Err("`opd.topk.k` is 0".into());
        }
        let expected = tokens * self.k as usize;
        for (field, len) in [
            ("opd.topk.ids", self.ids.len()),
            ("opd.topk.logprobs", self.logprobs.len()),
        ] {
            if len != expected {
                return Err(format!(
                    "`{field}` has {len} values for {tokens} response tokens × k {}",
                    self.k
                ));
            }
        }
        if let Some(i) = self
            .logprobs
            .iter()
            .position(|v| !(v.is_finite() && *v <= 0.0))
        {
            return Err(format!(
                "`opd.topk.logprobs` holds {} at index {i} (a log-prob is finite and <= 0)",
                self.logprobs[i]
            ));
        }
        Ok(())
    }
}

/// Which loss a trainer applies to the OPD term of its samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpdLossKind {
    /// The teacher-minus-old log-prob added to each token's advantage, under the clipped
    /// policy-gradient loss.
    #[default]
    Advantage,
    /// The reverse KL over the teacher's top-k tokens plus a tail bin.
    Topk,
}

impl OpdLossKind {
    /// The name as written in specs and records.
    pub fn name(self) -> &'static str {
        match self {
            OpdLossKind::Advantage => "advantage",
            OpdLossKind::Topk => "topk",
        }
    }

    /// The form an OPD term takes under this loss.
    pub fn of(term: &OpdTerm) -> Self {
        if term.topk.is_some() {
            OpdLossKind::Topk
        } else {
            OpdLossKind::Advantage
        }
    }
}

/// The train/serve mismatch: statistics of `rollout − old` log-probs over the response tokens
/// whose rollout log-probs are known, `old` being the trainer's log-probs before the update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LogprobGap {
    /// Mean of `rollout − old`.
    pub mean: f64,
    /// Mean of `|rollout − old|`.
    pub mean_abs: f64,
    /// Largest `|rollout − old|`.
    pub max_abs: f64,
    /// Tokens measured.
    pub tokens: usize,
}

impl LogprobGap {
    /// The gap over `(rollout, old)` log-prob pairs; `None` without any pair.
    pub fn measure(pairs: impl IntoIterator<Item = (f32, f32)>) -> Option<Self> {
        let (mut sum, mut sum_abs, mut max_abs, mut tokens) = (0f64, 0f64, 0f64, 0usize);
        for (rollout, old) in pairs {
            let d = (rollout - old) as f64;
            sum += d;
            sum_abs += d.abs();
            max_abs = max_abs.max(d.abs());
            tokens += 1;
        }
        (tokens > 0).then(|| LogprobGap {
            mean: sum / tokens as f64,
            mean_abs: sum_abs / tokens as f64,
            max_abs,
            tokens,
        })
    }

    /// The gap over the tokens of both (means weighted by tokens, the larger maximum).
    pub fn merge(self, other: LogprobGap) -> LogprobGap {
        let tokens = self.tokens + other.tokens;
        let n = tokens.max(1) as f64;
        let (a, b) = (self.tokens as f64, other.tokens as f64);
        LogprobGap {
            mean: (self.mean * a + other.mean * b) / n,
            mean_abs: (self.mean_abs * a + other.mean_abs * b) / n,
            max_abs: self.max_abs.max(other.max_abs),
            tokens,
        }
    }
}

/// How a sample of a batch is corrected for being off-policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Importance {
    /// Trained as is.
    None,
    /// Per-token truncated importance weights `min(exp(trainer − rollout), cap)` multiply the
    /// sample's policy-gradient term (the sample carries rollout log-probs).
    Truncated {
        /// The cap `C`.
        cap: f32,
    },
}

/// Summary of the importance weights a step applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ImportanceSummary {
    /// Tokens weighted.
    pub tokens: usize,
    /// Mean weight.
    pub mean: f64,
    /// Tokens whose weight was truncated at the cap.
    pub truncated: usize,
}

/// What the learner reports for one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// Weight version after the step.
    pub version: u64,
    /// Optimizer steps applied so far.
    pub steps: u64,
    /// Why the update was not applied (e.g. a non-finite loss); `None` when it was.
    pub skipped: Option<String>,
    /// The loss.
    pub loss: f64,
    /// The clipped policy-gradient term of the loss.
    pub pg_loss: f64,
    /// The KL estimate (0 when the KL term is off).
    pub kl: f64,
    /// Fraction of response tokens where the clipped term was active.
    pub clip_fraction: f64,
    /// Global gradient norm before clipping (NaN when not computed).
    pub grad_norm: f64,
    /// The OPD loss the learner applies.
    pub opd_loss: OpdLossKind,
    /// Samples of the batch that carried an OPD term.
    pub opd_samples: usize,
    /// Whether `π_old` was the learner's own recomputation before the update for every sample
    /// (else some sample brought its own old log-probs).
    pub old_recomputed: bool,
    /// Rollout-vs-old log-prob gap, when some sample carried rollout log-probs.
    pub logprob_gap: Option<LogprobGap>,
    /// Response tokens in the batch.
    pub tokens: usize,
    /// Tokens the forward pass computed over tokens the batch holds: below 1 when samples
    /// sharing a prefix ran it once, above 1 by the padding otherwise.
    pub packing_ratio: f64,
    /// Importance weights applied, when any sample was weighted.
    pub importance: Option<ImportanceSummary>,
}

/// One exported weight version.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedWeights {
    /// The version.
    pub version: u64,
    /// The weight blob (the format the job's policy replicas load).
    pub bytes: Bytes,
}

/// Bounds the actor checks on arrival, from the learner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleLimits {
    /// Token ids must be below this.
    pub vocab: Option<usize>,
    /// Prompt plus response must not be longer than this.
    pub max_tokens: Option<usize>,
}

/// What the trainer does with a sample that is too stale.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum StalenessMode {
    /// Drop it and count it in [`TrainerStats::dropped_stale`].
    Drop,
    /// Train it with truncated importance weights capped at `cap` (needs rollout log-probs;
    /// a stale sample without them is dropped).
    Importance {
        /// The cap `C` (finite, > 0).
        cap: f32,
    },
}

/// How a [`Trainer`] runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerConfig {
    /// The job; samples naming another job are refused (empty: any).
    pub job: String,
    /// Samples per step.
    pub batch_size: usize,
    /// Largest lag in versions (`trainer version − sample version`) trained as is.
    pub max_lag: u64,
    /// What happens to samples beyond `max_lag`.
    pub staleness: StalenessMode,
    /// Checkpoint every this many applied steps (0: never).
    pub checkpoint_every: u64,
    /// Where checkpoints live and are resumed from (`None`: no checkpoints, no resume).
    pub checkpoint_dir: Option<PathBuf>,
    /// Attempts of one batch before its samples are counted as failed (≥ 1).
    pub max_step_attempts: u32,
    /// Versions kept on the publisher (older ones are retired; ≥ 1).
    pub keep_published: usize,
    /// The most optimizer steps the learner applies, over its life (checkpoints included, as
    /// [`TrainerStats::steps`]); once reached no batch is formed and samples stay pending.
    /// `None`: no limit.
    #[serde(default)]
    pub max_steps: Option<u64>,
}

impl TrainerConfig {
    /// Defaults for `job`: batches of 16, lag ≤ 2 versions dropped beyond, checkpoint every
    /// step when a directory is set, 3 attempts, the last 2 versions kept, no step limit.
    pub fn new(job: impl Into<String>) -> Self {
        TrainerConfig {
            job: job.into(),
            batch_size: 16,
            max_lag: 2,
            staleness: StalenessMode::Drop,
            checkpoint_every: 1,
            checkpoint_dir: None,
            max_step_attempts: 3,
            keep_published: 2,
            max_steps: None,
        }
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<(), TrainerStartError> {
        let bad = |key: &'static str, reason: String| TrainerStartError::Config { key, reason };
        if self.batch_size == 0 {
            return Err(bad("batch_size", "must be at least 1".into()));
        }
        if let StalenessMode::Importance { cap } = self.staleness {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(bad(
                    "staleness.cap",
                    format!("must be finite and > 0, got {cap}"),
                ));
            }
        }
        if self.max_step_attempts == 0 {
            return Err(bad("max_step_attempts", "must be at least 1".into()));
        }
        if self.keep_published == 0 {
            return Err(bad("keep_published", "must be at least 1".into()));
        }
        if self.max_steps == Some(0) {
            return Err(bad("max_steps", "must be at least 1 (or none)".into()));
        }
        Ok(())
    }
}

/// Why a trainer could not start.
#[derive(Debug, thiserror::Error)]
pub enum TrainerStartError {
    /// A bad setting.
    #[error("trainer config: `{key}` {reason}")]
    Config {
        /// The setting.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Resuming, exporting or publishing the initial version failed.
    #[error("trainer start: {0}")]
    Init(String),
}

/// Counters of one trainer incarnation. `produced = trained + dropped_stale + failed + pending`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerStats {
    /// Samples accepted.
    pub produced: u64,
    /// Samples in applied steps.
    pub trained: u64,
    /// Samples dropped as too stale.
    pub dropped_stale: u64,
    /// Samples given up on (their step failed `max_step_attempts` times, or was skipped).
    pub failed: u64,
    /// Samples waiting, including those of the step in flight.
    pub pending: u64,
    /// Of `pending`, those in the step in flight.
    pub in_step: u64,
    /// Samples refused on arrival (never accepted, not in `produced`).
    pub rejected: u64,
    /// Of `produced`, samples replayed at start from the previous incarnation's journal.
    pub recovered: u64,
    /// Samples trained with importance weights.
    pub importance_weighted: u64,
    /// The trainer's weight version.
    pub version: u64,
    /// Optimizer steps applied (over the learner's life, checkpoints included).
    pub steps: u64,
    /// The newest version published.
    pub published: Option<u64>,
    /// The size in bytes of the newest version published (whole weights, or an adapter alone).
    #[serde(default)]
    pub published_bytes: Option<u64>,
    /// Step attempts that failed.
    pub failed_attempts: u64,
    /// Checkpoints written by this incarnation.
    pub checkpoints: u64,
    /// The version of the newest checkpoint written or resumed from.
    pub checkpoint_version: Option<u64>,
    /// The version resumed from at start, if any.
    pub resumed_from: Option<u64>,
    /// Rollout-vs-old log-prob gap over every applied step of this incarnation.
    pub logprob_gap: Option<LogprobGap>,
    /// The last step, publish or checkpoint error.
    pub last_error: Option<String>,
    /// Why the last refused sample was refused.
    pub last_rejection: Option<String>,
}

impl TrainerStats {
    /// True when `produced = trained + dropped_stale + failed + pending`.
    pub fn balanced(&self) -> bool {
        self.produced == self.trained + self.dropped_stale + self.failed + self.pending
    }
}

/// Metrics of one step, for the job's records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepEvent {
    /// The job.
    pub job: String,
    /// Optimizer steps applied after this one.
    pub step: u64,
    /// The weight version after the step.
    pub version: u64,
    /// The loss.
    pub loss: f64,
    /// The clipped policy-gradient term of the loss (records older than this field read 0).
    #[serde(default)]
    pub pg_loss: f64,
    /// The KL estimate (records older than this field read 0).
    #[serde(default)]
    pub kl: f64,
    /// Fraction of response tokens where the clipped term was active (records older than this
    /// field read 0).
    #[serde(default)]
    pub clip_fraction: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The OPD loss the learner applied ([`StepReport::opd_loss`]).
    pub opd_loss: OpdLossKind,
    /// Samples of the batch that carried an OPD term.
    pub opd_samples: usize,
    /// Whether `π_old` was the learner's own recomputation for every sample.
    pub old_recomputed: bool,
    /// Rollout-vs-old log-prob gap, when samples carried rollout log-probs.
    pub logprob_gap: Option<LogprobGap>,
    /// Samples trained in this step.
    pub kept: usize,
    /// Of those, samples trained with importance weights.
    pub importance_weighted: usize,
    /// Importance weights applied.
    pub importance: Option<ImportanceSummary>,
    /// Samples dropped as stale while this batch was formed.
    pub dropped_stale: usize,
    /// Oldest sample version in the batch.
    pub oldest_version: u64,
    /// Response tokens.
    pub tokens: usize,
    /// Tokens computed over tokens held ([`StepReport::packing_ratio`]; records older than this
    /// field read 0).
    #[serde(default)]
    pub packing_ratio: f64,
    /// Milliseconds of the optimizer step.
    pub step_ms: f64,
    /// Milliseconds exporting the weights.
    pub export_ms: f64,
    /// Milliseconds publishing them.
    pub publish_ms: f64,
    /// When the step ended, in seconds since the Unix epoch (records older than this field
    /// read 0).
    #[serde(default)]
    pub wall_time: f64,
    /// Counters after the step.
    pub stats: TrainerStats,
}

/// What subscribers hear.
#[derive(Debug, Clone)]
pub enum TrainerEvent {
    /// A version was published (also sent to each new subscriber for the newest version).
    Published {
        /// Its announcement.
        announce: WeightAnnounce,
        /// Its bytes (for in-process installs).
        bytes: Bytes,
        /// When the step that made it ended (`None` for the version at start).
        step_finished: Option<Instant>,
    },
    /// A step was applied (sent before its version's `Published`).
    Step(Box<StepEvent>),
    /// A step failed.
    StepFailed {
        /// Samples in the batch.
        samples: usize,
        /// Which attempt this was.
        attempt: u32,
        /// Whether the samples were given up on (counted as failed) or put back.
        gave_up: bool,
        /// Why.
        error: String,
    },
    /// A checkpoint was written.
    Checkpointed {
        /// Its version.
        version: u64,
        /// Its directory.
        path: PathBuf,
    },
}

/// Messages of a [`Trainer`].
pub enum TrainerMsg {
    /// New samples (cast). Accepted ones are never lost silently; refused ones are counted.
    Samples(Vec<TrainSample>),
    /// The counters.
    Stats(RpcReplyPort<TrainerStats>),
    /// Adds a subscriber; it first hears the newest published version. Replies its id.
    Subscribe(Subscriber, Option<RpcReplyPort<u64>>),
    /// Removes a subscriber.
    Unsubscribe(u64),
    /// Steps on the samples pending now even if fewer than a batch (e.g. at the job's end).
    Flush,
    /// Replies once no step is running and no full batch is waiting (or the step limit,
    /// `max_steps`, is reached).
    Idle(RpcReplyPort<TrainerStats>),
    /// Writes a checkpoint now (after the step in flight); replies its directory.
    Checkpoint(RpcReplyPort<Result<PathBuf, String>>),
    /// Replaces the step limit ([`TrainerConfig::max_steps`]); samples held back by the old
    /// limit are stepped on at once when the new one allows it.
    SetMaxSteps(Option<u64>),
    /// Internal: the learner thread finished a step.
    #[doc(hidden)]
    StepDone(Box<StepDone>),
    /// Internal: the learner thread finished a checkpoint.
    #[doc(hidden)]
    CheckpointDone(Result<(u64, PathBuf), String>),
    /// Internal: the learner thread is gone (it panicked).
    #[doc(hidden)]
    LearnerLost(String),
}

impl ractor::Message for TrainerMsg {}

/// Internal: the outcome of one step on the learner thread.
#[doc(hidden)]
pub struct StepDone {
    result: Result<StepReport, String>,
    published: Option<Result<(WeightAnnounce, Bytes), String>>,
    step_finished: Instant,
    step_ms: f64,
    export_ms: f64,
    publish_ms: f64,
}

/// How a [`Trainer`] starts.
pub struct TrainerArgs<L: Learner> {
    /// Settings.
    pub config: TrainerConfig,
    /// The learner, at its initial weights (replaced by the newest checkpoint if there is one).
    pub learner: L,
    /// Where versions are published.
    pub publisher: Arc<dyn WeightPublisher>,
    /// Subscribers from the start (they hear the version at start).
    pub subscribers: Vec<Subscriber>,
}

/// The trainer actor (behaviour only; see the module docs).
pub struct Trainer<L>(std::marker::PhantomData<fn() -> L>);

impl<L> Trainer<L> {
    /// The actor value to spawn.
    pub fn new() -> Self {
        Trainer(std::marker::PhantomData)
    }
}

impl<L> Default for Trainer<L> {
    fn default() -> Self {
        Self::new()
    }
}

struct InStep {
    batch: Arc<Vec<TrainSample>>,
    importance: Vec<Importance>,
    attempt: u32,
    dropped: usize,
}

/// The trainer's state.
pub struct TrainerState {
    config: TrainerConfig,
    limits: SampleLimits,
    jobs: std_mpsc::Sender<Job>,
    queue: VecDeque<TrainSample>,
    in_step: Option<InStep>,
    /// Samples dropped since the last batch was sent.
    dropped_since: usize,
    /// Attempts of the batch at the head of the queue (after a failure).
    head_attempts: u32,
    flush: bool,
    stats: TrainerStats,
    subscribers: Vec<(u64, Subscriber)>,
    next_subscriber: u64,
    published: VecDeque<WeightAnnounce>,
    latest: Option<(WeightAnnounce, Bytes)>,
    publisher: Arc<dyn WeightPublisher>,
    steps_since_checkpoint: u64,
    idle_waiters: Vec<RpcReplyPort<TrainerStats>>,
    checkpoint_waiters: Vec<RpcReplyPort<Result<PathBuf, String>>>,
    checkpoint_running: bool,
    journal: Option<Journal>,
}

impl TrainerState {
    fn snapshot(&self) -> TrainerStats {
        let mut s = self.stats.clone();
        let in_step = self.in_step.as_ref().map_or(0, |s| s.batch.len()) as u64;
        s.in_step = in_step;
        s.pending = self.queue.len() as u64 + in_step;
        s
    }

    fn emit(&mut self, event: &TrainerEvent) {
        self.subscribers.retain(|(_, s)| s(event));
    }

    /// Why `sample` cannot be accepted, if it cannot.
    fn refuse(&self, s: &TrainSample) -> Option<String> {
        let who = format!("sample {}#{}", s.session_id, s.turn);
        if !self.config.job.is_empty() && s.job != self.config.job {
            return Some(format!(
                "{who}: job {:?}, this trainer is job {:?}",
                s.job, self.config.job
            ));
        }
        if s.prompt_ids.is_empty() {
            return Some(format!("{who}: `prompt_ids` is empty"));
        }
        if s.response_ids.is_empty() {
            return Some(format!("{who}: `response_ids` is empty"));
        }
        let n = s.response_ids.len();
        if let Some(o) = &s.opd {
            if !o.weight.is_finite() {
                return Some(format!("{who}: `opd.weight` is {}", o.weight));
            }
        }
        let fields = [
            ("advantages", Some(&s.advantages)),
            ("rollout_logprobs", s.rollout_logprobs.as_ref()),
            (
                "opd.teacher_logprobs",
                s.opd.as_ref().map(|o| &o.teacher_logprobs),
            ),
        ];
        for (field, values) in fields {
            let Some(values) = values else { continue };
            if values.len() != n {
                return Some(format!(
                    "{who}: `{field}` has {} values for {n} response tokens",
                    values.len()
                ));
            }
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Some(format!("{who}: `{field}` holds {} at index {i}", values[i]));
            }
        }
        if let Some(t) = s.opd.as_ref().and_then(|o| o.topk.as_ref()) {
            if let Err(why) = t.check(n) {
                return Some(format!("{who}: {why}"));
            }
        }
        let topk_ids = s.opd.as_ref().and_then(|o| o.topk.as_ref()).map(|t| &t.ids);
        if let Some(vocab) = self.limits.vocab {
            for (field, ids) in [
                ("prompt_ids", Some(&s.prompt_ids)),
                ("response_ids", Some(&s.response_ids)),
                ("opd.topk.ids", topk_ids),
            ] {
                let Some(ids) = ids else { continue };
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Some(format!(
                        "{who}: `{field}` holds token id {id}, outside the vocabulary of {vocab}"
                    ));
                }
            }
        }
        if let Some(max) = self.limits.max_tokens {
            let len = s.prompt_ids.len() + n;
            if len > max {
                return Some(format!(
                    "{who}: {len} tokens, more than the model's {max} positions"
                ));
            }
        }
        if s.version > self.stats.version {
            return Some(format!(
                "{who}: version {} is newer than the trainer's {}",
                s.version, self.stats.version
            ));
        }
        None
    }

    fn accept(&mut self, samples: Vec<TrainSample>) {
        let mut accepted = Vec::with_capacity(samples.len());
        for s in samples {
            match self.refuse(&s) {
                Some(reason) => {
                    tracing::warn!("trainer refused a sample: {reason}");
                    self.stats.rejected += 1;
                    self.stats.last_rejection = Some(reason);
                }
                None => accepted.push(s),
            }
        }
        if let Some(journal) = &mut self.journal {
            if let Err(e) = journal.append(&accepted) {
                // Still accepted and trained; only a restart could lose them now.
                tracing::error!("appending to the pending-sample journal: {e}");
                self.stats.last_error = Some(format!("pending-sample journal: {e}"));
            }
        }
        self.stats.produced += accepted.len() as u64;
        self.queue.extend(accepted);
        self.maybe_step();
    }

    /// Forms a batch and sends it to the learner when one is ready and none is running.
    fn maybe_step(&mut self) {
        if self.in_step.is_some() {
            return;
        }
        if self.config.max_steps.is_some_and(|m| self.stats.steps >= m) {
            // The step limit is reached: what is queued stays pending (journaled), untouched.
            self.flush = false;
            self.answer_idle();
            return;
        }
        // Staleness, against the version now.
        let version = self.stats.version;
        let max_lag = self.config.max_lag;
        let mode = self.config.staleness;
        let mut kept = VecDeque::with_capacity(self.queue.len());
        let mut importance = Vec::new();
        for s in self.queue.drain(..) {
            let lag = version.saturating_sub(s.version);
            if lag <= max_lag {
                kept.push_back(s);
                importance.push(Importance::None);
                continue;
            }
            match mode {
                StalenessMode::Importance { cap } if s.rollout_logprobs.is_some() => {
                    kept.push_back(s);
                    importance.push(Importance::Truncated { cap });
                }
                _ => {
                    self.stats.dropped_stale += 1;
                    self.dropped_since += 1;
                    tracing::debug!(
                        sample_version = s.version,
                        version,
                        "dropping a sample {lag} versions behind (bound {max_lag})"
                    );
                }
            }
        }
        self.queue = kept;
        let n = self.config.batch_size;
        let ready = self.queue.len() >= n || (self.flush && !self.queue.is_empty());
        if !ready {
            if self.queue.is_empty() {
                self.flush = false;
            }
            self.answer_idle();
            return;
        }
        let take = n.min(self.queue.len());
        let batch: Vec<TrainSample> = self.queue.drain(..take).collect();
        importance.truncate(take);
        if self.queue.is_empty() {
            self.flush = false;
        }
        let due = self.config.checkpoint_every > 0
            && self.steps_since_checkpoint + 1 >= self.config.checkpoint_every;
        let checkpoint = self.config.checkpoint_dir.clone().filter(|_| due);
        let batch = Arc::new(batch);
        let attempt = self.head_attempts + 1;
        let job = Job::Step {
            batch: batch.clone(),
            importance: importance.clone(),
            checkpoint,
        };
        self.in_step = Some(InStep {
            batch,
            importance,
            attempt,
            dropped: std::mem::take(&mut self.dropped_since),
        });
        if self.jobs.send(job).is_err() {
            // The thread is gone; LearnerLost is on its way (or the thread ended on a cast
            // failure, which means this actor is stopping).
            tracing::error!("the learner thread is gone");
        }
    }

    fn step_done(&mut self, done: StepDone) {
        let Some(in_step) = self.in_step.take() else {
            tracing::warn!("a step finished that was never started");
            return;
        };
        let n = in_step.batch.len();
        match done.result {
            Ok(report) if report.skipped.is_none() => {
                self.head_attempts = 0;
                self.stats.trained += n as u64;
                let weighted = in_step
                    .importance
                    .iter()
                    .filter(|i| matches!(i, Importance::Truncated { .. }))
                    .count();
                self.stats.importance_weighted += weighted as u64;
                self.stats.version = report.version;
                self.stats.steps = report.steps;
                if let Some(gap) = report.logprob_gap {
                    self.stats.logprob_gap =
                        Some(self.stats.logprob_gap.map_or(gap, |g| g.merge(gap)));
                }
                self.steps_since_checkpoint += 1;
                if self.config.checkpoint_every > 0
                    && self.steps_since_checkpoint >= self.config.checkpoint_every
                    && self.config.checkpoint_dir.is_some()
                {
                    self.steps_since_checkpoint = 0;
                    self.checkpoint_running = true;
                }
                let event = StepEvent {
                    job: self.config.job.clone(),
                    step: report.steps,
                    version: report.version,
                    loss: report.loss,
                    pg_loss: report.pg_loss,
                    kl: report.kl,
                    clip_fraction: report.clip_fraction,
                    grad_norm: report.grad_norm,
                    opd_loss: report.opd_loss,
                    opd_samples: report.opd_samples,
                    old_recomputed: report.old_recomputed,
                    logprob_gap: report.logprob_gap,
                    kept: n,
                    importance_weighted: weighted,
                    importance: report.importance,
                    dropped_stale: in_step.dropped,
                    oldest_version: in_step.batch.iter().map(|s| s.version).min().unwrap_or(0),
                    tokens: report.tokens,
                    packing_ratio: report.packing_ratio,
                    step_ms: done.step_ms,
                    export_ms: done.export_ms,
                    publish_ms: done.publish_ms,
                    wall_time: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                    stats: self.snapshot(),
                };
                tracing::info!(
                    step = event.step,
                    version = event.version,
                    loss = event.loss,
                    kept = n,
                    "trainer step"
                );
                self.emit(&TrainerEvent::Step(Box::new(event)));
                match done.published {
                    Some(Ok((announce, bytes))) => {
                        self.announce(announce, bytes, Some(done.step_finished))
                    }
                    Some(Err(e)) => {
                        tracing::error!(version = report.version, "{e}");
                        self.stats.last_error = Some(e);
                    }
                    None => {}
                }
            }
            other => {
                let (error, retry) = match other {
                    Ok(report) => (
                        format!(
                            "the learner skipped the update: {}",
                            report.skipped.unwrap_or_default()
                        ),
                        false,
                    ),
                    Err(e) => (e, in_step.attempt < self.config.max_step_attempts),
                };
                self.stats.failed_attempts += 1;
                self.stats.last_error = Some(error.clone());
                if retry {
                    tracing::warn!(
                        attempt = in_step.attempt,
                        "trainer step failed, retrying its {n} samples: {error}"
                    );
                    self.head_attempts = in_step.attempt;
                    let batch = Arc::try_unwrap(in_step.batch).unwrap_or_else(|a| (*a).clone());
                    for s in batch.into_iter().rev() {
                        self.queue.push_front(s);
                    }
                } else {
                    tracing::error!(
                        attempt = in_step.attempt,
                        "trainer step failed, giving up on its {n} samples: {error}"
                    );
                    self.head_attempts = 0;
                    self.stats.failed += n as u64;
                }
                self.emit(&TrainerEvent::StepFailed {
                    samples: n,
                    attempt: in_step.attempt,
                    gave_up: !retry,
                    error,
                });
            }
        }
        self.maybe_step();
    }

    fn announce(&mut self, announce: WeightAnnounce, bytes: Bytes, step_finished: Option<Instant>) {
        self.stats.published = Some(announce.version);
        self.stats.published_bytes = Some(announce.size);
        self.published.push_back(announce.clone());
        while self.published.len() > self.config.keep_published {
            if let Some(old) = self.published.pop_front() {
                self.publisher.retire(&old);
            }
        }
        let event = TrainerEvent::Published {
            announce: announce.clone(),
            bytes: bytes.clone(),
            step_finished,
        };
        self.latest = Some((announce, bytes));
        self.emit(&event);
    }

    fn answer_idle(&mut self) {
        if self.in_step.is_some() || self.checkpoint_running {
            return;
        }
        let stats = self.snapshot();
        for port in self.idle_waiters.drain(..) {
            let _ = port.send(stats.clone());
        }
    }
}

impl<L: Learner> Actor for Trainer<L> {
    type Msg = TrainerMsg;
    type State = TrainerState;
    type Arguments = TrainerArgs<L>;

    async fn pre_start(
        &self,
        myself: ActorRef<TrainerMsg>,
        args: TrainerArgs<L>,
    ) -> Result<TrainerState, ActorProcessingErr> {
        args.config.validate()?;
        let (jobs_tx, jobs_rx) = std_mpsc::channel();
        let (started_tx, started_rx) = oneshot::channel();
        let root = args.config.checkpoint_dir.clone();
        let publisher = args.publisher.clone();
        let me = myself.clone();
        let learner = args.learner;
        let keep = args.config.keep_published;
        std::thread::Builder::new()
            .name(format!("learner-{}", args.config.job))
            .spawn(move || learner_thread(learner, publisher, root, started_tx, jobs_rx, me, keep))
            .map_err(|e| TrainerStartError::Init(format!("spawning the learner thread: {e}")))?;
        let started = started_rx
            .await
            .map_err(|_| TrainerStartError::Init("the learner thread died while starting".into()))?
            .map_err(TrainerStartError::Init)?;
        let mut state = TrainerState {
            config: args.config,
            limits: started.limits,
            jobs: jobs_tx,
            queue: VecDeque::new(),
            in_step: None,
            dropped_since: 0,
            head_attempts: 0,
            flush: false,
            stats: TrainerStats {
                version: started.version,
                steps: started.steps,
                resumed_from: started.resumed_from,
                checkpoint_version: started.resumed_from,
                ..TrainerStats::default()
            },
            subscribers: args
                .subscribers
                .into_iter()
                .enumerate()
                .map(|(i, s)| (i as u64, s))
                .collect(),
            next_subscriber: 0,
            published: VecDeque::new(),
            latest: None,
            publisher: args.publisher,
            steps_since_checkpoint: 0,
            idle_waiters: Vec::new(),
            checkpoint_waiters: Vec::new(),
            checkpoint_running: false,
            journal: None,
        };
        state.next_subscriber = state.subscribers.len() as u64;
        match started.initial {
            Ok((announce, bytes)) => state.announce(announce, bytes, None),
            Err(e) => {
                tracing::error!("publishing the starting version: {e}");
                state.stats.last_error = Some(e);
            }
        }
        if let Some(v) = started.resumed_from {
            tracing::info!(
                checkpoint = v,
                version = state.stats.version,
                "trainer resumed"
            );
        }
        if let Some(root) = state.config.checkpoint_dir.clone() {
            // Samples the previous incarnation accepted that no checkpoint covers.
            let left = Journal::replay(&root).map_err(TrainerStartError::Init)?;
            let mut recovered = Vec::with_capacity(left.len());
            for mut s in left {
                // The journal belongs to the checkpoint directory's lineage, whatever job id
                // wrote it: a job re-run on the same run directory gets a new one.
                if !state.config.job.is_empty() {
                    s.job.clone_from(&state.config.job);
                }
                match state.refuse(&s) {
                    Some(reason) => {
                        state.stats.rejected += 1;
                        state.stats.last_rejection = Some(reason);
                    }
                    None => recovered.push(s),
                }
            }
            state.journal =
                Some(Journal::rewrite(&root, recovered.iter()).map_err(TrainerStartError::Init)?);
            if !recovered.is_empty() {
                tracing::info!("trainer recovered {} pending samples", recovered.len());
            }
            state.stats.recovered = recovered.len() as u64;
            state.stats.produced = recovered.len() as u64;
            state.queue.extend(recovered);
            state.maybe_step();
        }
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<TrainerMsg>,
        msg: TrainerMsg,
        state: &mut TrainerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TrainerMsg::Samples(samples) => state.accept(samples),
            TrainerMsg::Stats(port) => {
                let _ = port.send(state.snapshot());
            }
            TrainerMsg::Subscribe(subscriber, port) => {
                let id = state.next_subscriber;
                state.next_subscriber += 1;
                let keep = match &state.latest {
                    Some((announce, bytes)) => subscriber(&TrainerEvent::Published {
                        announce: announce.clone(),
                        bytes: bytes.clone(),
                        step_finished: None,
                    }),
                    None => true,
                };
                if keep {
                    state.subscribers.push((id, subscriber));
                }
                if let Some(port) = port {
                    let _ = port.send(id);
                }
            }
            TrainerMsg::Unsubscribe(id) => state.subscribers.retain(|(i, _)| *i != id),
            TrainerMsg::Flush => {
                state.flush = true;
                state.maybe_step();
            }
            TrainerMsg::SetMaxSteps(max_steps) => {
                tracing::info!(?max_steps, "trainer step limit changed");
                state.config.max_steps = max_steps.filter(|&m| m > 0);
                state.maybe_step();
            }
            TrainerMsg::Idle(port) => {
                state.idle_waiters.push(port);
                state.maybe_step();
                state.answer_idle();
            }
            TrainerMsg::Checkpoint(port) => match state.config.checkpoint_dir.clone() {
                None => {
                    let _ = port.send(Err("this trainer has no checkpoint directory".into()));
                }
                Some(root) => {
                    state.checkpoint_waiters.push(port);
                    state.checkpoint_running = true;
                    if state.jobs.send(Job::Checkpoint(root)).is_err() {
                        return Err("the learner thread is gone".into());
                    }
                }
            },
            TrainerMsg::StepDone(done) => state.step_done(*done),
            TrainerMsg::CheckpointDone(result) => {
                state.checkpoint_running = false;
                match &result {
                    Ok((version, path)) => {
                        state.stats.checkpoints += 1;
                        state.stats.checkpoint_version = Some(*version);
                        state.steps_since_checkpoint = 0;
                        state.compact_journal();
                        let event = TrainerEvent::Checkpointed {
                            version: *version,
                            path: path.clone(),
                        };
                        state.emit(&event);
                    }
                    Err(e) => {
                        tracing::error!("{e}");
                        state.stats.last_error = Some(e.clone());
                    }
                }
                for port in state.checkpoint_waiters.drain(..) {
                    let _ = port.send(result.clone().map(|(_, p)| p));
                }
                state.answer_idle();
            }
            TrainerMsg::LearnerLost(why) => {
                return Err(format!("the learner thread panicked: {why}").into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprob_gaps_measure_and_merge_by_tokens() {
        let a = LogprobGap::measure([(-1.0, -1.5), (-2.0, -1.0)]).unwrap();
        assert_eq!(
            (a.mean, a.mean_abs, a.max_abs, a.tokens),
            (-0.25, 0.75, 1.0, 2)
        );
        assert_eq!(LogprobGap::measure(std::iter::empty()), None);
        let b = LogprobGap::measure([(0.0, -2.0)]).unwrap();
        let m = a.merge(b);
        assert_eq!(m.tokens, 3);
        assert!((m.mean - 1.5 / 3.0).abs() < 1e-12 && (m.mean_abs - 3.5 / 3.0).abs() < 1e-12);
        assert_eq!(m.max_abs, 2.0);
    }

    /// A sample with a top-k OPD term survives the actor wire (bincode) and the pending-sample
    /// journal (JSON); a journal line written before top-k terms existed still reads.
    #[test]
    fn topk_terms_travel_on_the_wire_and_in_the_journal() {
        let sample = TrainSample {
            job: "j".into(),
            session_id: "s".into(),
            turn: 1,
            version: 2,
            prompt_ids: vec![1, 2],
            response_ids: vec![3, 4],
            advantages: vec![1.0, 1.0],
            rollout_logprobs: Some(vec![-0.5, -0.25]),
            opd: Some(OpdTerm {
                weight: 0.5,
                teacher_logprobs: vec![-0.1, -0.2],
                topk: Some(TeacherTopK {
                    k: 2,
                    ids: vec![3, 9, 4, 8],
                    logprobs: vec![-0.1, -3.0, -0.2, -2.0],
                }),
            }),
        };
        let bytes = crate::rpc::encode(&sample);
        assert_eq!(crate::rpc::decode::<TrainSample>(&bytes).unwrap(), sample);
        let line = serde_json::to_string(&sample).unwrap();
        assert_eq!(serde_json::from_str::<TrainSample>(&line).unwrap(), sample);
        let old = r#"{"job":"j","session_id":"s","turn":1,"version":2,"prompt_ids":[1],
            "response_ids":[3],"advantages":[0.0],"rollout_logprobs":null,
            "opd":{"weight":1.0,"teacher_logprobs":[-0.3]}}"#;
        let old: TrainSample = serde_json::from_str(old).unwrap();
        assert_eq!(old.opd.unwrap().topk, None);
    }

    #[test]
    fn teacher_topk_shapes_are_checked() {
        let t = TeacherTopK {
            k: 2,
            ids: vec![1, 2, 3, 4],
            logprobs: vec![-0.1, -2.0, -0.5, -1.0],
        };
        assert!(t.check(2).is_ok());
        assert!(t.check(3).unwrap_err().contains("opd.topk.ids"));
        let mut bad = t.clone();
        bad.logprobs[3] = 0.5;
        assert!(bad.check(2).unwrap_err().contains("opd.topk.logprobs"));
        let zero = TeacherTopK { k: 0, ..t };
        assert!(zero.check(2).unwrap_err().contains("opd.topk.k"));
    }
}
