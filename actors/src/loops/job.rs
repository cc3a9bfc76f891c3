//! The job supervisor: one actor per training job that keeps `parallelism` [`EnvSession`]s
//! alive, sends their turns through a [`PrmVoter`], builds training samples from each finished
//! episode's judged turns, hands them to the trainer, writes the job's records, and stops at the
//! stop condition.
//!
//! It knows no LLM: samples are built by the root crate behind [`SampleBuilder`] (binary, OPD,
//! combined or step-wise), and reach the trainer through [`TrainerLink`]; the sample type is a
//! parameter. Supervision decisions, made on purpose:
//! - a session that ends normally (done, step limit, deadline) is replaced by a new one on the
//!   next task;
//! - a session that fails (environment or policy error, or a panic) is restarted on the same task
//!   up to `max_restarts` times in a row; after that its slot moves on to the next task and the
//!   failure is counted as a *lost* session; when as many sessions as there are slots are lost
//!   before any session has finished, the job stops (drains) with that error instead of spinning;
//! - a failing voter, builder or trainer call never stops the job: turns go on unjudged, a failed
//!   build is counted, a refused submission is counted.
//!
//! Builds: each finished episode is built alone, or, in a job with GRPO groups
//! ([`JobSettings::group_size`]), the episodes of one group are built together once the group
//! is complete; a failed session is then retried within its group and its attempt discarded, and
//! a session given up on drops its group whole ([`super::groups`] has the rules).
//!
//! Admission (with [`JobSettings::admission`]): sessions are held back so that they do not
//! outrun the trainer. Each turn is admitted by a [`Gate`] before the policy is
//! asked, and a new session starts only when the gate would admit a turn; the supervisor keeps
//! the gate's view of the backlog (samples at the trainer, turns being judged or built, turns of
//! running episodes) up to date. See [`super::admission`] for the rule and why it cannot
//! deadlock; draining opens the gate for good, and while the trainer's counters cannot be read
//! the gate counts nothing as queued there (it fails open).
//!
//! Turn sources ([`TurnSource`]): the supervisor runs the sessions itself over an environment,
//! or turns are produced elsewhere and offered to it ([`JobMsg::Offer`], e.g. the turns a gateway
//! served, which its clients' next messages completed): each offered turn is a one-turn episode,
//! judged, built and submitted like any other; its producer keeps the full turn, and the job's
//! records get a short `turn` record (session and turn index) that its `judge` record pairs.
//! Counting, judging and the stop rules are the same for both.
//!
//! Stop: when the trainer has made `max_trainer_steps` steps, or `max_turns` turns were produced,
//! or `max_samples` samples submitted, or `max_duration` passed (or [`JobMsg::Stop`] came), no
//! new session starts and running ones are stopped (each closes its episode); the job then
//! drains: every turn already produced is judged, built and submitted (an offering source first
//! says it has no more with [`JobMsg::SourceClosed`]), and the final counts (which balance:
//! `produced = trained + dropped_stale + failed + pending` on the trainer side; `stopped_by` says
//! why) go to whoever started the job.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::admission::{AdmissionCounts, AdmissionSettings, Backlog, Gate, GatedPolicy};
use super::env::{BoxFuture, Environment};
use super::groups::{GroupCounts, GroupId, Groups, Settled};
use super::recorder::RecorderHandle;
use super::session::{EndReason, EnvSession, SessionArgs, SessionEvent, Turn, TurnPolicy};
use super::trainer::{TrainSample, TrainerMsg, TrainerStats};
use super::voter::{JudgedTurn, PrmVoter, TurnJudge, VoterArgs, VoterMsg};

/// One finished episode with its judged turns (in turn order).
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeTurns {
    /// The session.
    pub session_id: String,
    /// The task's id.
    pub task_id: String,
    /// Its GRPO group, in a job with groups ([`JobSettings::group_size`]).
    pub group: Option<GroupId>,
    /// Why the episode ended.
    pub reason: EndReason,
    /// Its turns with their verdicts.
    pub turns: Vec<JudgedTurn>,
}

/// What a build produced.
#[derive(Debug)]
pub struct Built<S> {
    /// The training samples (each carries the version of its tokens).
    pub samples: Vec<S>,
    /// The OPD teacher's weight version per `(session_id, turn)`, for the judged-turn records.
    pub teacher_versions: HashMap<(String, u32), u64>,
}

/// Builds training samples from finished episodes (the method lives here: binary, OPD,
/// combined, step-wise).
pub trait SampleBuilder<S>: Send + Sync + 'static {
    /// Builds samples from `episodes`: one episode, or the members of one GRPO group in a job
    /// with groups ([`JobSettings::group_size`]).
    fn build(
        &self,
        episodes: Arc<Vec<EpisodeTurns>>,
    ) -> BoxFuture<'static, Result<Built<S>, String>>;
}

/// What the job needs to know of a sample: the version of its tokens and a small record of it
/// (kind `sample` in the job's records, so that every sample's version is on disk).
pub trait JobSample: Send + 'static {
    /// The weight version that produced the sample's tokens.
    fn version(&self) -> u64;
    /// The record written for it.
    fn record(&self) -> serde_json::Value;
}

impl JobSample for TrainSample {
    fn version(&self) -> u64 {
        self.version
    }

    fn record(&self) -> serde_json::Value {
        let n = self.advantages.len().max(1) as f64;
        let mean = self.advantages.iter().map(|&a| a as f64).sum::<f64>() / n;
        serde_json::json!({
            "session_id": self.session_id,
            "turn": self.turn,
            "version": self.version,
            "prompt_tokens": self.prompt_ids.len(),
            "response_tokens": self.response_ids.len(),
            "advantage_mean": mean,
            // `advantage_mean` is the binary (or step-wise) part; an OPD term is added by the
            // trainer with its own old log-probs.
            "opd": self.opd.is_some(),
        })
    }
}

/// The trainer's counters as the job reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainerCounts {
    /// Samples the trainer accepted.
    pub produced: u64,
    /// Samples it trained on.
    pub trained: u64,
    /// Samples it dropped as too stale.
    pub dropped_stale: u64,
    /// Samples given up on after failed steps.
    pub failed: u64,
    /// Samples waiting for a step.
    pub pending: u64,
    /// The current weight version.
    pub version: u64,
    /// Optimizer steps made.
    pub steps: u64,
}

/// How the job reaches its trainer.
pub trait TrainerLink<S>: Send + Sync + 'static {
    /// Hands samples over (accepted samples are never lost silently).
    fn submit(&self, samples: Vec<S>) -> Result<(), String>;

    /// The trainer's counters.
    fn counts(&self) -> BoxFuture<'_, Result<TrainerCounts, String>>;

    /// Waits until no step runs and no full batch waits; then the counters.
    fn idle(&self) -> BoxFuture<'_, Result<TrainerCounts, String>> {
        self.counts()
    }

    /// Replaces the trainer's own step limit, when it keeps one (the job's step limit
    /// changed while it runs).
    fn set_max_steps(&self, max_steps: Option<u64>) -> Result<(), String>;
}

fn trainer_counts(s: &TrainerStats) -> TrainerCounts {
    TrainerCounts {
        produced: s.produced,
        trained: s.trained,
        dropped_stale: s.dropped_stale,
        failed: s.failed,
        pending: s.pending,
        version: s.version,
        steps: s.steps,
    }
}

const TRAINER_CALL: Duration = Duration::from_secs(30);

impl TrainerLink<TrainSample> for ActorRef<TrainerMsg> {
    fn submit(&self, samples: Vec<TrainSample>) -> Result<(), String> {
        self.cast(TrainerMsg::Samples(samples))
            .map_err(|e| format!("the trainer is gone: {e}"))
    }

    fn counts(&self) -> BoxFuture<'_, Result<TrainerCounts, String>> {
        Box::pin(async move {
            ractor::call_t!(self, TrainerMsg::Stats, TRAINER_CALL.as_millis() as u64)
                .map(|s| trainer_counts(&s))
                .map_err(|e| format!("trainer stats: {e}"))
        })
    }

    fn idle(&self) -> BoxFuture<'_, Result<TrainerCounts, String>> {
        Box::pin(async move {
            ractor::call_t!(self, TrainerMsg::Idle, 600_000)
                .map(|s| trainer_counts(&s))
                .map_err(|e| format!("waiting for the trainer: {e}"))
        })
    }

    fn set_max_steps(&self, max_steps: Option<u64>) -> Result<(), String> {
        self.cast(TrainerMsg::SetMaxSteps(max_steps))
            .map_err(|e| format!("the trainer is gone: {e}"))
    }
}

/// When a job stops (any bound reached stops it; at least one must be set).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StopCondition {
    /// Trainer optimizer steps.
    pub max_trainer_steps: Option<u64>,
    /// Turns produced.
    pub max_turns: Option<u64>,
    /// Samples handed to the trainer.
    pub max_samples: Option<u64>,
    /// Wall-clock time.
    pub max_duration: Option<Duration>,
}

/// The job's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSettings {
    /// Sessions kept running.
    pub parallelism: usize,
    /// Time one episode may take.
    pub episode_deadline: Duration,
    /// A step limit below the environment's own.
    pub max_episode_steps: Option<u32>,
    /// Time one turn's judging may take.
    pub judge_timeout: Duration,
    /// Turns judged at once.
    pub judge_concurrency: usize,
    /// Consecutive restarts of a failing session's slot before it counts as lost.
    pub max_restarts: u32,
    /// Base of the episode seeds.
    pub seed: u64,
    /// When to stop.
    pub stop: StopCondition,
    /// How often the trainer's counters are polled and progress reported.
    pub poll: Duration,
    /// Admission control (backpressure from the trainer); `None`: sessions run freely.
    #[serde(default)]
    pub admission: Option<AdmissionSettings>,
    /// GRPO groups: `Some(n)` runs `n` episodes of one task as a group that is built together
    /// (a failed attempt is retried in its group and discarded; a group with a session given
    /// up on is dropped whole; see [`super::groups`]). `None`: every episode is built alone,
    /// a failed one included.
    #[serde(default)]
    pub group_size: Option<usize>,
}

impl Default for JobSettings {
    fn default() -> Self {
        JobSettings {
            parallelism: 4,
            episode_deadline: Duration::from_secs(600),
            max_episode_steps: None,
            judge_timeout: Duration::from_secs(300),
            judge_concurrency: 64,
            max_restarts: 3,
            seed: 0,
            stop: StopCondition::default(),
            poll: Duration::from_millis(200),
            admission: None,
            group_size: None,
        }
    }
}

/// Why a job stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopCause {
    /// `max_trainer_steps` trainer steps were made.
    MaxSteps,
    /// `max_turns` turns were produced.
    MaxTurns,
    /// `max_samples` samples were submitted.
    MaxSamples,
    /// `max_duration` passed.
    MaxDuration,
    /// [`JobMsg::Stop`] came (a cancel, a signal).
    Requested,
    /// Every session failed before one finished.
    GaveUp,
}

impl StopCause {
    /// The spec key (or event) the cause stands for.
    pub fn name(self) -> &'static str {
        match self {
            StopCause::MaxSteps => "max_steps",
            StopCause::MaxTurns => "max_turns",
            StopCause::MaxSamples => "max_samples",
            StopCause::MaxDuration => "max_hours",
            StopCause::Requested => "requested",
            StopCause::GaveUp => "gave_up",
        }
    }
}

/// Where the job is (ordered as a job goes through them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobPhase {
    /// Sessions run.
    #[default]
    Running,
    /// The stop condition was reached; work already produced is being finished.
    Draining,
    /// Done.
    Finished,
}

/// The job's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCounts {
    /// Where the job is.
    pub phase: JobPhase,
    /// Milliseconds since the job started.
    pub elapsed_ms: u64,
    /// Sessions started (restarts included).
    pub sessions_started: u64,
    /// Sessions running now.
    pub sessions_running: u64,
    /// Sessions that ended normally (done, step limit, deadline, stopped).
    pub sessions_finished: u64,
    /// Sessions that failed.
    pub sessions_failed: u64,
    /// Failed sessions restarted on the same task.
    pub sessions_restarted: u64,
    /// Failed sessions given up on after `max_restarts` restarts.
    pub sessions_lost: u64,
    /// Turns produced.
    pub turns: u64,
    /// Turns whose prompt did not start with the previous turn's prompt and sampled response
    /// ([`super::session::Turn::history_kept`]): the chat template or the client rewrote the
    /// history.
    #[serde(default)]
    pub history_rewritten: u64,
    /// Turns judged.
    pub judged: u64,
    /// Turns left unjudged (the reason is in the judge records).
    pub unjudged: u64,
    /// Judge votes that failed, every turn together (a turn is unjudged only when all did).
    pub votes_failed: u64,
    /// Of those, votes cut off at the judge's `max_tokens` (raise `judge.max_tokens` /
    /// `judge.hint_max_tokens` when this grows).
    pub votes_truncated: u64,
    /// Turns settled: handed to a build (whatever it made of them) or discarded. A driver that
    /// must not overshoot a step count reads `turns - turns_settled` as turns that may still
    /// become samples.
    #[serde(default)]
    pub turns_settled: u64,
    /// Episodes turned into samples.
    pub episodes_built: u64,
    /// Builds that failed (their episodes give no samples; the error is logged).
    pub build_errors: u64,
    /// Samples built and handed to the trainer.
    pub samples_submitted: u64,
    /// Samples the trainer refused to take (the link failed).
    pub samples_refused: u64,
    /// The trainer's counters.
    pub trainer: TrainerCounts,
    /// Records written by the recorder.
    pub records_written: u64,
    /// Times the record queue was full and the job waited (backpressure).
    pub records_waited: u64,
    /// Records that could not be queued (recorder stopped) or serialized.
    pub records_failed: u64,
    /// The last problem worth showing (a failed session, build or submission).
    pub last_error: Option<String>,
    /// Why the job gave up before its stop condition (every session failed, or the judge gave
    /// no verdict on any turn), if it did.
    #[serde(default)]
    pub gave_up: Option<String>,
    /// What admission control did (all zero without it).
    #[serde(default)]
    pub admission: AdmissionCounts,
    /// What became of GRPO groups, in a job with groups.
    #[serde(default)]
    pub groups: Option<GroupCounts>,
    /// Why the job stopped, once it did.
    #[serde(default)]
    pub stopped_by: Option<StopCause>,
}

impl JobCounts {
    /// The counts of a job made of several supervisors (one per agent, each over its own
    /// trainer), as one: every counter summed; the phase of the least advanced part; the longest
    /// elapsed time; the newest trainer version; the first part's error, give-up reason and stop
    /// cause that are set. The sum balances exactly when every part does, since each trainer
    /// counter is summed.
    pub fn sum<'a>(parts: impl IntoIterator<Item = &'a JobCounts>) -> JobCounts {
        let mut total = JobCounts {
            phase: JobPhase::Finished,
            ..JobCounts::default()
        };
        let mut any = false;
        for p in parts {
            any = true;
            let JobCounts {
                phase,
                elapsed_ms,
                sessions_started,
                sessions_running,
                sessions_finished,
                sessions_failed,
                sessions_restarted,
                sessions_lost,
                turns,
                history_rewritten,
                judged,
                unjudged,
                votes_failed,
                votes_truncated,
                turns_settled,
                episodes_built,
                build_errors,
                samples_submitted,
                samples_refused,
                trainer,
                records_written,
                records_waited,
                records_failed,
                last_error,
                gave_up,
                admission,
                groups,
                stopped_by,
            } = p;
            let t = &mut total;
            t.phase = t.phase.min(*phase);
            t.elapsed_ms = t.elapsed_ms.max(*elapsed_ms);
            t.sessions_started += sessions_started;
            t.sessions_running += sessions_running;
            t.sessions_finished += sessions_finished;
            t.sessions_failed += sessions_failed;
            t.sessions_restarted += sessions_restarted;
            t.sessions_lost += sessions_lost;
            t.turns += turns;
            t.history_rewritten += history_rewritten;
            t.judged += judged;
            t.unjudged += unjudged;
            t.votes_failed += votes_failed;
            t.votes_truncated += votes_truncated;
            t.turns_settled += turns_settled;
            t.episodes_built += episodes_built;
            t.build_errors += build_errors;
            t.samples_submitted += samples_submitted;
            t.samples_refused += samples_refused;
            let TrainerCounts {
                produced,
                trained,
                dropped_stale,
                failed,
                pending,
                version,
                steps,
            } = trainer;
            t.trainer.produced += produced;
            t.trainer.trained += trained;
            t.trainer.dropped_stale += dropped_stale;
            t.trainer.failed += failed;
            t.trainer.pending += pending;
            t.trainer.version = t.trainer.version.max(*version);
            t.trainer.steps += steps;
            t.records_written += records_written;
            t.records_waited += records_waited;
            t.records_failed += records_failed;
            if t.last_error.is_none() {
                t.last_error.clone_from(last_error);
            }
            if t.gave_up.is_none() {
                t.gave_up.clone_from(gave_up);
            }
            let a = &mut t.admission;
            a.max_backlog += admission.max_backlog;
            a.backlog += admission.backlog;
            a.admitted += admission.admitted;
            a.held += admission.held;
            a.held_ms += admission.held_ms;
            a.wait_expired += admission.wait_expired;
            a.starts_deferred += admission.starts_deferred;
            if let Some(g) = groups {
                let s = t.groups.get_or_insert(GroupCounts {
                    size: g.size,
                    ..GroupCounts::default()
                });
                s.started += g.started;
                s.built += g.built;
                s.short += g.short;
                s.dropped += g.dropped;
                s.episodes_discarded += g.episodes_discarded;
            }
            t.stopped_by = t.stopped_by.or(*stopped_by);
        }
        if !any {
            total.phase = JobPhase::Running;
        }
        total
    }

    /// Whether the trainer's counts balance: produced = trained + dropped_stale + failed +
    /// pending.
    pub fn balanced(&self) -> bool {
        let t = &self.trainer;
        t.produced == t.trained + t.dropped_stale + t.failed + t.pending
    }
}

/// Called with the counters at every poll and at the end.
pub type ProgressReport = Arc<dyn Fn(&JobCounts) + Send + Sync>;

/// Where a job's turns come from.
pub enum TurnSource {
    /// `parallelism` [`EnvSession`]s the supervisor keeps running over `env`'s tasks, each
    /// asking `policy` for its actions; their turns are recorded (kind `turn`).
    Sessions {
        /// The task set.
        env: Arc<dyn Environment>,
        /// The policy.
        policy: Arc<dyn TurnPolicy>,
    },
    /// Turns produced outside the job and handed in with [`JobMsg::Offer`], each a one-turn
    /// episode of its own, recorded in full by their producer. The job drains only after
    /// [`JobMsg::SourceClosed`].
    Offered,
}

/// The environment and policy of a [`TurnSource::Sessions`].
type SessionParts<'a> = (&'a Arc<dyn Environment>, &'a Arc<dyn TurnPolicy>);

impl TurnSource {
    fn sessions(&self) -> Option<SessionParts<'_>> {
        match self {
            TurnSource::Sessions { env, policy } => Some((env, policy)),
            TurnSource::Offered => None,
        }
    }
}

/// How a job starts.
pub struct JobArgs<S> {
    /// The job's id (names sessions and records).
    pub job: String,
    /// Where its turns come from.
    pub source: TurnSource,
    /// The judge.
    pub judge: Arc<dyn TurnJudge>,
    /// The sample builder.
    pub builder: Arc<dyn SampleBuilder<S>>,
    /// The trainer.
    pub trainer: Arc<dyn TrainerLink<S>>,
    /// Where the job's records go (`turn`, `judge` kinds).
    pub recorder: Option<RecorderHandle>,
    /// Settings.
    pub settings: JobSettings,
    /// Progress callback.
    pub progress: Option<ProgressReport>,
    /// Gets the final counters.
    pub done: Option<oneshot::Sender<JobCounts>>,
}

/// Messages of a [`JobSupervisor`].
pub enum JobMsg<S> {
    /// An event of a session.
    Session(SessionEvent),
    /// A judged turn from the voter.
    Judged(Box<JudgedTurn>),
    /// A build finished.
    Built(Arc<Vec<EpisodeTurns>>, Result<Built<S>, String>),
    /// Episodes that give no samples, to settle (a failed attempt in a job with groups, or
    /// a dropped group).
    Discarded(Arc<Vec<EpisodeTurns>>),
    /// Poll the trainer, report progress, check the stop condition.
    Tick,
    /// Stop now (as if the stop condition were reached) and drain.
    Stop,
    /// Replace the trainer-step bound of the stop condition (and the trainer's own limit). A
    /// job already draining keeps draining.
    SetMaxSteps(u64),
    /// A turn produced outside the job ([`TurnSource::Offered`]): judged, built as a one-turn
    /// episode and submitted. Taken while running and while draining.
    Offer(Box<Turn>),
    /// An offering source has no more turns: the job may finish once it drains.
    SourceClosed,
    /// Write a record (e.g. a trainer step event) to the job's records.
    Record {
        /// The weight version the record belongs to.
        version: u64,
        /// Its kind.
        kind: String,
        /// The record.
        record: serde_json::Value,
    },
    /// The counters.
    Counts(RpcReplyPort<JobCounts>),
}

impl<S: JobSample> ractor::Message for JobMsg<S> {}

/// The job supervisor actor (behaviour only; see the module docs).
pub struct JobSupervisor<S>(std::marker::PhantomData<fn() -> S>);

impl<S> JobSupervisor<S> {
    /// The actor value to spawn.
    pub fn new() -> Self {
        JobSupervisor(std::marker::PhantomData)
    }
}

impl<S> Default for JobSupervisor<S> {
    fn default() -> Self {
        Self::new()
    }
}

/// A session slot.
struct Slot {
    session_id: String,
    task_index: usize,
    failures: u32,
    group: Option<GroupId>,
}

/// A session's episode being assembled.
#[derive(Default)]
struct Assembly {
    task_id: String,
    group: Option<GroupId>,
    received: u32,
    ended: Option<(u32, EndReason)>,
    judged: Vec<JudgedTurn>,
}

/// `Ended::turns` of a session that died without saying how many turns it sent: every turn
/// that arrived before the (queued) end counts.
const TURNS_AS_RECEIVED: u32 = u32::MAX;

/// The supervisor's state.
pub struct SupervisorState<S> {
    args: JobArgs<S>,
    started: Instant,
    voter: ActorRef<VoterMsg>,
    /// Live sessions by actor id.
    live: HashMap<ActorId, (ActorRef<super::session::SessionMsg>, Slot)>,
    /// Sessions whose `Ended` was seen, by session id (slot to refill).
    assemblies: BTreeMap<String, Assembly>,
    builds_in_flight: usize,
    next_session: u64,
    next_task: usize,
    counts: JobCounts,
    /// The admission gate, with admission control.
    gate: Option<Arc<Gate>>,
    /// Turns of episodes handed to a build (whatever it made of them).
    turns_settled: u64,
    /// Turns in builds running now.
    build_turns: u64,
    /// Samples submitted since the trainer's counters were last polled.
    submitted_since_poll: u64,
    /// Whether the last poll of the trainer's counters failed (admission then opens: a trainer
    /// that cannot be asked must not hold the sessions back on counts it may have lost).
    trainer_unreachable: bool,
    /// The GRPO groups, in a job with groups.
    groups: Option<Groups<EpisodeTurns>>,
    /// Whether more turns may still be offered (never, for a job running its own sessions).
    source_open: bool,
    /// The sessions offered turns belong to.
    offered_sessions: HashSet<String>,
    /// Turns the judge was asked about (they had a next state) that came back without a
    /// verdict.
    judge_failures: u64,
}

/// Whether a job's judge has never worked: not one turn judged, and `failures` turns with a
/// next state came back without a verdict (every vote failed, the judge erred or timed out),
/// at least `limit` of them. Such a judge is misconfigured (an endpoint that refuses, a judge
/// model whose prompt cannot fit), not slow: a job whose sessions keep producing turns for it
/// would spin without ever training.
pub fn judge_never_worked(judged: u64, failures: u64, limit: u64) -> bool {
    judged == 0 && failures >= limit
}

/// How many turns without a verdict, none judged, make a job with `parallelism` sessions give
/// up: four rounds of its sessions, and never fewer than 64, so a judge that is still coming up
/// gets time.
pub fn judge_failure_limit(parallelism: usize) -> u64 {
    (4 * parallelism as u64).max(64)
}

impl<S: JobSample> SupervisorState<S> {
    fn judging(&self) -> u64 {
        self.counts.turns - self.counts.judged - self.counts.unjudged
    }

    async fn record<T: Serialize>(&mut self, version: u64, kind: &str, record: &T) {
        if let Some(r) = &self.args.recorder {
            if let Err(e) = r.record(version, kind, record).await {
                self.counts.records_failed += 1;
                self.counts.last_error = Some(format!("recording a {kind} record: {e}"));
            }
        }
    }

    async fn spawn_session(
        &mut self,
        myself: &ActorRef<JobMsg<S>>,
        task_index: usize,
        failures: u32,
        group: Option<GroupId>,
    ) -> Result<(), ActorProcessingErr> {
        let n = self.next_session;
        self.next_session += 1;
        let session_id = format!("{}-s{n:06}", self.args.job);
        let me = myself.clone();
        let report: super::session::SessionReport = Arc::new(move |ev| {
            let _ = me.cast(JobMsg::Session(ev));
        });
        let Some((env, policy)) = self.args.source.sessions() else {
            return Ok(());
        };
        let args = SessionArgs {
            session_id: session_id.clone(),
            env: env.clone(),
            task_index,
            seed: self.args.settings.seed.wrapping_add(n),
            policy: match &self.gate {
                Some(gate) => Arc::new(GatedPolicy::new(
                    policy.clone(),
                    gate.clone(),
                    session_id.clone(),
                    n,
                )) as Arc<dyn TurnPolicy>,
                None => policy.clone(),
            },
            deadline: self.args.settings.episode_deadline,
            max_steps: self.args.settings.max_episode_steps,
            report,
        };
        self.assemblies.insert(
            session_id.clone(),
            Assembly {
                group,
                ..Assembly::default()
            },
        );
        let (actor, _) = Actor::spawn_linked(None, EnvSession, args, myself.get_cell()).await?;
        self.counts.sessions_started += 1;
        self.live.insert(
            actor.get_id(),
            (
                actor,
                Slot {
                    session_id,
                    task_index,
                    failures,
                    group,
                },
            ),
        );
        Ok(())
    }

    /// Tasks of the environment (none with offered turns).
    fn task_count(&self) -> usize {
        self.args
            .source
            .sessions()
            .map_or(0, |(env, _)| env.task_count())
    }

    fn take_task(&mut self) -> usize {
        let t = self.next_task % self.task_count().max(1);
        self.next_task += 1;
        t
    }

    /// Starts sessions until `parallelism` run (only while running, and while the admission
    /// gate, if any, would admit a turn).
    async fn fill(&mut self, myself: &ActorRef<JobMsg<S>>) -> Result<(), ActorProcessingErr> {
        while self.args.source.sessions().is_some()
            && self.counts.phase == JobPhase::Running
            && self.live.len() < self.args.settings.parallelism
        {
            if self.gate.as_ref().is_some_and(|g| !g.admits_start()) {
                break;
            }
            let count = self.task_count().max(1);
            let (task, group) = match &mut self.groups {
                Some(groups) => {
                    let next = &mut self.next_task;
                    let Some((group, task)) = groups.assign(|| {
                        let t = *next % count;
                        *next += 1;
                        t
                    }) else {
                        break;
                    };
                    (task, Some(group))
                }
                None => (self.take_task(), None),
            };
            self.spawn_session(myself, task, 0, group).await?;
        }
        Ok(())
    }

    fn stop_condition(&self) -> Option<(StopCause, String)> {
        let s = &self.args.settings.stop;
        if let Some(m) = s.max_trainer_steps {
            if self.counts.trainer.steps >= m {
                return Some((StopCause::MaxSteps, format!("{m} trainer steps")));
            }
        }
        if let Some(m) = s.max_turns {
            if self.counts.turns >= m {
                return Some((StopCause::MaxTurns, format!("{m} turns")));
            }
        }
        if let Some(m) = s.max_samples {
            if self.counts.samples_submitted >= m {
                return Some((StopCause::MaxSamples, format!("{m} samples")));
            }
        }
        if let Some(d) = s.max_duration {
            if self.started.elapsed() >= d {
                return Some((StopCause::MaxDuration, format!("{d:?} elapsed")));
            }
        }
        None
    }

    fn begin_drain(&mut self, myself: &ActorRef<JobMsg<S>>, cause: StopCause, why: &str) {
        if self.counts.phase != JobPhase::Running {
            return;
        }
        tracing::info!(job = %self.args.job, "stop condition reached ({why}): draining");
        self.counts.phase = JobPhase::Draining;
        self.counts.stopped_by = Some(cause);
        if let Some(gate) = &self.gate {
            gate.open_all();
        }
        for (actor, _) in self.live.values() {
            actor.stop(Some("job stopping".into()));
        }
        if let Some(groups) = &mut self.groups {
            let settled = groups.drain();
            self.settle(myself, settled);
        }
    }

    async fn on_session_event(
        &mut self,
        myself: &ActorRef<JobMsg<S>>,
        ev: SessionEvent,
    ) -> Result<(), ActorProcessingErr> {
        match ev {
            SessionEvent::Turn(turn) => {
                self.count_turn(&turn);
                let session_id = turn.session_id.clone();
                if let Some(a) = self.assemblies.get_mut(&turn.session_id) {
                    a.task_id = turn.task_id.clone();
                    a.received += 1;
                }
                let version = turn.policy.version;
                self.record(version, "turn", &SessionTurnRecord::of(&turn))
                    .await;
                if let Err(e) = self.voter.cast(VoterMsg::Judge(turn)) {
                    // The voter is gone: the turn cannot be judged; keep the books straight.
                    self.counts.last_error = Some(format!("the voter refused a turn: {e}"));
                    if let ractor::MessagingErr::SendErr(VoterMsg::Judge(turn)) = e {
                        let judgement =
                            super::voter::Judgement::unjudged(&turn, "the voter is gone");
                        myself.cast(JobMsg::Judged(Box::new(JudgedTurn {
                            turn: *turn,
                            judgement,
                        })))?;
                    }
                }
                if let Some((cause, why)) = self.stop_condition() {
                    self.begin_drain(myself, cause, &why);
                }
                // Counted as produced first, then no longer as admitted: the gate never sees
                // the turn missing from both.
                self.refresh_gate();
                if let Some(gate) = &self.gate {
                    gate.produced(&session_id);
                }
            }
            SessionEvent::Ended {
                session_id,
                task_id,
                turns,
                reason,
            } => {
                let failed = reason.is_failure();
                if let EndReason::Failed { error } = &reason {
                    self.counts.sessions_failed += 1;
                    self.counts.last_error = Some(format!("session {session_id}: {error}"));
                    tracing::warn!(job = %self.args.job, "session {session_id} failed: {error}");
                } else {
                    self.counts.sessions_finished += 1;
                }
                // The slot, if the actor is still known (its termination may come later).
                let slot = self
                    .live
                    .iter()
                    .find(|(_, (_, s))| s.session_id == session_id)
                    .map(|(id, _)| *id);
                let slot = slot.and_then(|id| self.live.remove(&id)).map(|(_, s)| s);
                // A failed session is restarted while the job runs and its restarts last,
                // unless its group was already dropped (nothing of it will be built).
                let group = self.assemblies.get(&session_id).and_then(|a| a.group);
                let group_dropped = match (&self.groups, group) {
                    (Some(groups), Some(g)) => groups.is_dropped(g),
                    _ => false,
                };
                let retry = failed
                    && !group_dropped
                    && self.counts.phase == JobPhase::Running
                    && slot
                        .as_ref()
                        .is_some_and(|s| s.failures < self.args.settings.max_restarts);
                // Its group learns that before the episode can complete (a group must not be
                // built short while a retry is on its way): one more attempt, or dropped.
                if let (true, false, Some(groups), Some(g)) =
                    (failed, group_dropped, &mut self.groups, group)
                {
                    if retry {
                        groups.retry(g);
                    } else {
                        let settled = groups.give_up(g);
                        self.settle(myself, settled);
                    }
                }
                if let Some(a) = self.assemblies.get_mut(&session_id) {
                    if a.task_id.is_empty() {
                        a.task_id = task_id;
                    }
                    let turns = if turns == TURNS_AS_RECEIVED {
                        a.received
                    } else {
                        turns
                    };
                    a.ended = Some((turns, reason));
                }
                if let Some(gate) = &self.gate {
                    gate.ended(&session_id);
                }
                self.try_complete(myself, &session_id)?;
                self.refresh_gate();
                if let Some(slot) = slot {
                    // A failure in a dropped group frees its slot like a normal end: the
                    // session was not given up on, its group was.
                    let failed = failed && !group_dropped;
                    self.refill(myself, slot, failed, retry).await?;
                }
            }
        }
        Ok(())
    }

    /// Counts a turn produced (by a session or offered), and one whose prompt rewrote the
    /// history its producer saw and wrote.
    fn count_turn(&mut self, turn: &Turn) {
        self.counts.turns += 1;
        if turn.history_kept == Some(false) {
            if self.counts.history_rewritten == 0 {
                tracing::warn!(
                    job = %self.args.job,
                    session = %turn.session_id,
                    step = turn.turn,
                    "a turn's prompt does not start with the previous turn's prompt and sampled \
                     response: the history was rendered (chat template) or sent back (client) \
                     otherwise than the policy saw and wrote it (counted as history_rewritten; \
                     warned once)"
                );
            }
            self.counts.history_rewritten += 1;
        }
    }

    /// A turn offered from outside: counted, its session noted, and sent to the voter (the
    /// judged turn then becomes a one-turn episode). A finished job takes no more.
    async fn on_offered(&mut self, myself: &ActorRef<JobMsg<S>>, turn: Box<Turn>) {
        if self.counts.phase == JobPhase::Finished || self.args.source.sessions().is_some() {
            tracing::warn!(
                job = %self.args.job,
                "a turn of session {} offered to a job that takes none now", turn.session_id
            );
            self.counts.last_error = Some("a turn was offered to a job that takes none".into());
            return;
        }
        self.count_turn(&turn);
        if self.offered_sessions.insert(turn.session_id.clone()) {
            self.counts.sessions_started += 1;
        }
        // A turn record now (its producer keeps the full turn), its judge record once judged:
        // a turn the process dies holding is found unpaired by the next start's recorder and
        // recorded as lost.
        let key = serde_json::json!({"session_id": turn.session_id, "turn": turn.turn});
        self.record(turn.policy.version, "turn", &key).await;
        if let Err(e) = self.voter.cast(VoterMsg::Judge(turn)) {
            self.counts.last_error = Some(format!("the voter refused a turn: {e}"));
            if let ractor::MessagingErr::SendErr(VoterMsg::Judge(turn)) = e {
                let judgement = super::voter::Judgement::unjudged(&turn, "the voter is gone");
                let _ = myself.cast(JobMsg::Judged(Box::new(JudgedTurn {
                    turn: *turn,
                    judgement,
                })));
            }
        }
        if let Some((cause, why)) = self.stop_condition() {
            self.begin_drain(myself, cause, &why);
        }
    }

    async fn refill(
        &mut self,
        myself: &ActorRef<JobMsg<S>>,
        slot: Slot,
        failed: bool,
        retry: bool,
    ) -> Result<(), ActorProcessingErr> {
        if self.counts.phase != JobPhase::Running {
            if failed {
                self.counts.sessions_lost += 1;
            }
            return Ok(());
        }
        if failed {
            if retry {
                self.counts.sessions_restarted += 1;
                return self
                    .spawn_session(myself, slot.task_index, slot.failures + 1, slot.group)
                    .await;
            }
            self.counts.sessions_lost += 1;
            // Not one session has ever finished and a whole round of slots is lost: the
            // environment or the policy cannot work at all (a prompt longer than the context,
            // a sandbox that cannot start). Stop instead of spinning through the task set.
            let parallelism = self.args.settings.parallelism.max(1) as u64;
            if self.counts.sessions_finished == 0 && self.counts.sessions_lost >= parallelism {
                let why = format!(
                    "every session failed ({} lost, none finished); last: {}",
                    self.counts.sessions_lost,
                    self.counts
                        .last_error
                        .as_deref()
                        .unwrap_or("no error recorded")
                );
                tracing::error!(job = %self.args.job, "{why}");
                self.counts.last_error = Some(why.clone());
                self.counts.gave_up = Some(why.clone());
                self.begin_drain(myself, StopCause::GaveUp, &why);
                return Ok(());
            }
        }
        // The slot moves on to the next task (when admission lets a session start; else a
        // later poll fills it).
        self.fill(myself).await
    }

    fn try_complete(
        &mut self,
        myself: &ActorRef<JobMsg<S>>,
        session_id: &str,
    ) -> Result<(), ActorProcessingErr> {
        let complete = self
            .assemblies
            .get(session_id)
            .is_some_and(|a| matches!(&a.ended, Some((n, _)) if a.judged.len() as u32 >= *n));
        if complete {
            let a = self.assemblies.remove(session_id).expect("checked");
            let (_, reason) = a.ended.expect("checked");
            let member = !reason.is_failure();
            let mut turns = a.judged;
            turns.sort_by_key(|t| t.turn.turn);
            let episode = (!turns.is_empty()).then(|| EpisodeTurns {
                session_id: session_id.to_string(),
                task_id: a.task_id,
                group: a.group,
                reason,
                turns,
            });
            match (&mut self.groups, a.group) {
                (Some(groups), Some(g)) => {
                    let settled = groups.episode(g, episode, member);
                    self.settle(myself, settled);
                }
                _ => {
                    if let Some(e) = episode {
                        self.start_build(myself, vec![e]);
                    }
                }
            }
        }
        Ok(())
    }

    /// Acts on what the groups hand back: a group to build, or episodes to discard.
    fn settle(
        &mut self,
        myself: &ActorRef<JobMsg<S>>,
        settled: impl IntoIterator<Item = Settled<EpisodeTurns>>,
    ) {
        for s in settled {
            match s {
                Settled::Build { episodes, .. } => self.start_build(myself, episodes),
                Settled::Discard(episodes) => {
                    // Settled like a build that made nothing, through the mailbox so that the
                    // judge records are written in order with everything else.
                    self.build_turns += episodes.iter().map(|e| e.turns.len() as u64).sum::<u64>();
                    self.builds_in_flight += 1;
                    let _ = myself.cast(JobMsg::Discarded(Arc::new(episodes)));
                }
            }
        }
    }

    /// Starts building `episodes` (one episode, or one group) off the actor.
    fn start_build(&mut self, myself: &ActorRef<JobMsg<S>>, episodes: Vec<EpisodeTurns>) {
        self.build_turns += episodes.iter().map(|e| e.turns.len() as u64).sum::<u64>();
        let batch = Arc::new(episodes);
        let fut = self.args.builder.build(batch.clone());
        let me = myself.clone();
        self.builds_in_flight += 1;
        tokio::spawn(async move {
            let result = fut.await;
            let _ = me.cast(JobMsg::Built(batch, result));
        });
    }

    async fn on_built(
        &mut self,
        episodes: Arc<Vec<EpisodeTurns>>,
        result: Result<Built<S>, String>,
    ) {
        self.builds_in_flight -= 1;
        let turns = episodes.iter().map(|e| e.turns.len() as u64).sum::<u64>();
        self.build_turns -= turns;
        self.turns_settled += turns;
        self.counts.turns_settled = self.turns_settled;
        let teacher = match result {
            Ok(built) => {
                self.counts.episodes_built += episodes.len() as u64;
                let n = built.samples.len() as u64;
                // Each sample's record says which group and step index it belongs to (its
                // step-wise advantage is z-scored among those).
                let groups: HashMap<&str, GroupId> = episodes
                    .iter()
                    .filter_map(|e| e.group.map(|g| (e.session_id.as_str(), g)))
                    .collect();
                let records: Vec<(u64, serde_json::Value)> = built
                    .samples
                    .iter()
                    .map(|s| {
                        let mut record = s.record();
                        if let Some(obj) = record.as_object_mut() {
                            let group = obj
                                .get("session_id")
                                .and_then(|v| v.as_str())
                                .and_then(|sid| groups.get(sid));
                            obj.insert("group".into(), group.copied().into());
                            if let Some(turn) = obj.get("turn").cloned() {
                                obj.insert("step".into(), turn);
                            }
                        }
                        (s.version(), record)
                    })
                    .collect();
                for (version, record) in records {
                    self.record(version, "sample", &record).await;
                }
                if n > 0 {
                    match self.args.trainer.submit(built.samples) {
                        Ok(()) => {
                            self.counts.samples_submitted += n;
                            self.submitted_since_poll += n;
                        }
                        Err(e) => {
                            self.counts.samples_refused += n;
                            self.counts.last_error =
                                Some(format!("the trainer refused {n} samples: {e}"));
                            tracing::error!(job = %self.args.job, "the trainer refused {n} samples: {e}");
                        }
                    }
                }
                built.teacher_versions
            }
            Err(e) => {
                self.counts.build_errors += 1;
                self.counts.last_error = Some(format!("building samples: {e}"));
                tracing::error!(job = %self.args.job, "building samples: {e}");
                HashMap::new()
            }
        };
        self.record_judgements(&episodes, &teacher).await;
    }

    /// Episodes that give no samples (a failed attempt, a dropped group) are settled: their
    /// turns leave the backlog and their judge records are written.
    async fn on_discarded(&mut self, episodes: Arc<Vec<EpisodeTurns>>) {
        self.builds_in_flight -= 1;
        let turns = episodes.iter().map(|e| e.turns.len() as u64).sum::<u64>();
        self.build_turns -= turns;
        self.turns_settled += turns;
        self.counts.turns_settled = self.turns_settled;
        self.record_judgements(&episodes, &HashMap::new()).await;
    }

    /// The judge record of every turn of `episodes`, with the OPD teacher's version where one
    /// scored the turn.
    async fn record_judgements(
        &mut self,
        episodes: &[EpisodeTurns],
        teacher: &HashMap<(String, u32), u64>,
    ) {
        for ep in episodes.iter() {
            for jt in &ep.turns {
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
    }

    async fn poll(&mut self) {
        match self.args.trainer.counts().await {
            Ok(c) => {
                self.counts.trainer = c;
                self.submitted_since_poll = 0;
                self.trainer_unreachable = false;
            }
            Err(e) => {
                self.counts.last_error = Some(format!("trainer counts: {e}"));
                self.trainer_unreachable = true;
            }
        }
        self.refresh_gate();
        if let Some(gate) = &self.gate {
            self.counts.admission = gate.counts();
        }
        if let Some(r) = &self.args.recorder {
            let s = r.stats();
            self.counts.records_written = s.written;
            self.counts.records_waited = s.waited_full;
        }
        self.counts.sessions_running = self.live.len() as u64;
        self.counts.groups = self.groups.as_ref().map(|g| g.counts().clone());
        self.counts.elapsed_ms = self.started.elapsed().as_millis() as u64;
    }

    /// Tells the admission gate where the work on its way to the trainer is.
    fn refresh_gate(&self) {
        let Some(gate) = &self.gate else { return };
        let ended: u64 = self
            .assemblies
            .values()
            .filter(|a| a.ended.is_some())
            .map(|a| a.received as u64)
            .sum();
        let settling = ended + self.build_turns;
        let unsubmitted = self.counts.turns.saturating_sub(self.turns_settled);
        let trainer_pending = if self.trainer_unreachable {
            0
        } else {
            self.counts.trainer.pending + self.submitted_since_poll
        };
        gate.update(Backlog {
            trainer_pending,
            settling,
            open: unsubmitted.saturating_sub(settling),
            admitted: 0,
        });
    }

    fn drained(&self) -> bool {
        self.counts.phase == JobPhase::Draining
            && !self.source_open
            && self.live.is_empty()
            && self.judging() == 0
            && self.assemblies.is_empty()
            && self.groups.as_ref().is_none_or(|g| g.is_empty())
            && self.builds_in_flight == 0
    }

    fn report(&self) {
        if let Some(p) = &self.args.progress {
            p(&self.counts);
        }
    }
}

/// The turn record (kind `turn`): messages, prompt and response text, tool calls, next state,
/// token counts and the version of the tokens.
#[derive(Debug, Serialize)]
pub struct SessionTurnRecord<'a> {
    /// The session.
    pub session_id: &'a str,
    /// The task.
    pub task_id: &'a str,
    /// The step index.
    pub turn: u32,
    /// The messages the policy saw.
    pub messages: &'a [serde_json::Value],
    /// The tools offered.
    pub tools: &'a [serde_json::Value],
    /// The prompt as rendered.
    pub prompt_text: &'a str,
    /// The response as sampled.
    pub response_text: &'a str,
    /// The parsed tool calls.
    pub tool_calls: &'a [super::env::ToolCallAction],
    /// The next state.
    pub next_state: &'a [serde_json::Value],
    /// Whether the episode ended here.
    pub done: bool,
    /// The episode's outcome, when it ended with one.
    pub outcome: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Response tokens.
    pub response_tokens: usize,
    /// The weight version of the response tokens.
    pub version: u64,
    /// What the environment wanted recorded.
    pub info: &'a serde_json::Value,
}

impl<'a> SessionTurnRecord<'a> {
    /// The record of `turn`.
    pub fn of(turn: &'a Turn) -> Self {
        SessionTurnRecord {
            session_id: &turn.session_id,
            task_id: &turn.task_id,
            turn: turn.turn,
            messages: &turn.observation.messages,
            tools: &turn.observation.tools,
            prompt_text: &turn.policy.prompt_text,
            response_text: &turn.policy.response_text,
            tool_calls: &turn.policy.action.tool_calls,
            next_state: &turn.outcome.next_state,
            done: turn.outcome.done,
            outcome: turn.outcome.outcome,
            prompt_tokens: turn.policy.prompt_ids.len(),
            response_tokens: turn.policy.response_ids.len(),
            version: turn.policy.version,
            info: &turn.outcome.info,
        }
    }
}

/// Spawns the job's voter, linked to the supervisor `myself`, which it reports each judged
/// turn to.
async fn spawn_voter<S: JobSample>(
    myself: &ActorRef<JobMsg<S>>,
    args: &JobArgs<S>,
) -> Result<ActorRef<VoterMsg>, ractor::SpawnErr> {
    let me = myself.clone();
    let s = &args.settings;
    let (voter, _) = Actor::spawn_linked(
        None,
        PrmVoter,
        VoterArgs {
            judge: args.judge.clone(),
            timeout: s.judge_timeout,
            max_concurrent: s.judge_concurrency.max(1),
            report: Arc::new(move |jt| {
                let _ = me.cast(JobMsg::Judged(Box::new(jt)));
            }),
        },
        myself.get_cell(),
    )
    .await?;
    Ok(voter)
}

impl<S: JobSample> Actor for JobSupervisor<S> {
    type Msg = JobMsg<S>;
    type State = SupervisorState<S>;
    type Arguments = JobArgs<S>;

    async fn pre_start(
        &self,
        myself: ActorRef<JobMsg<S>>,
        args: JobArgs<S>,
    ) -> Result<SupervisorState<S>, ActorProcessingErr> {
        let s = &args.settings;
        if s.parallelism == 0 && args.source.sessions().is_some() {
            return Err("job: parallelism must be at least 1".into());
        }
        if s.stop.max_trainer_steps.is_none()
            && s.stop.max_turns.is_none()
            && s.stop.max_samples.is_none()
            && s.stop.max_duration.is_none()
        {
            return Err("job: the stop condition sets no bound".into());
        }
        if args
            .source
            .sessions()
            .is_some_and(|(env, _)| env.task_count() == 0)
        {
            return Err("job: the environment has no tasks".into());
        }
        let gate = match s.admission {
            Some(a) => Some(Gate::new(a).map_err(|e| format!("job: {e}"))?),
            None => None,
        };
        let groups = s.group_size.map(Groups::new);
        let offered = matches!(args.source, TurnSource::Offered);
        let voter = spawn_voter(&myself, &args).await?;
        Ok(SupervisorState {
            args,
            started: Instant::now(),
            voter,
            live: HashMap::new(),
            assemblies: BTreeMap::new(),
            builds_in_flight: 0,
            next_session: 0,
            next_task: 0,
            counts: JobCounts::default(),
            gate,
            turns_settled: 0,
            build_turns: 0,
            submitted_since_poll: 0,
            trainer_unreachable: false,
            groups,
            source_open: offered,
            offered_sessions: HashSet::new(),
            judge_failures: 0,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<JobMsg<S>>,
        state: &mut SupervisorState<S>,
    ) -> Result<(), ActorProcessingErr> {
        match state.args.source.sessions() {
            Some((env, _)) => tracing::info!(
                job = %state.args.job,
                "job started: {} sessions over {} tasks of `{}`",
                state.args.settings.parallelism,
                env.task_count(),
                env.kind()
            ),
            None => tracing::info!(job = %state.args.job, "job started: taking offered turns"),
        }
        state.fill(&myself).await?;
        myself.send_interval(state.args.settings.poll, || JobMsg::Tick);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<JobMsg<S>>,
        msg: JobMsg<S>,
        state: &mut SupervisorState<S>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            JobMsg::Session(ev) => state.on_session_event(&myself, ev).await?,
            JobMsg::Judged(jt) => {
                if jt.judgement.unjudged.is_some() {
                    state.counts.unjudged += 1;
                } else {
                    state.counts.judged += 1;
                }
                state.counts.votes_failed += u64::from(jt.judgement.failed_votes);
                state.counts.votes_truncated += u64::from(jt.judgement.truncated_votes);
                if let Some(reason) = &jt.judgement.unjudged {
                    if !jt.turn.outcome.next_state.is_empty() {
                        state.judge_failures += 1;
                    }
                    // A job running its own sessions stops rather than spin on a judge that has
                    // never worked; a gateway's job keeps serving (its turns stay recorded).
                    let limit = judge_failure_limit(state.args.settings.parallelism);
                    if state.args.source.sessions().is_some()
                        && judge_never_worked(state.counts.judged, state.judge_failures, limit)
                        && state.counts.gave_up.is_none()
                    {
                        let why = format!(
                            "the judge gave no verdict on any turn ({} turns asked, none judged); \
                             last: {reason}",
                            state.judge_failures
                        );
                        tracing::error!(job = %state.args.job, "{why}");
                        state.counts.last_error = Some(why.clone());
                        state.counts.gave_up = Some(why.clone());
                        state.begin_drain(&myself, StopCause::GaveUp, &why);
                    }
                }
                if state.args.source.sessions().is_none() {
                    // An offered turn is an episode of its own.
                    let episode = EpisodeTurns {
                        session_id: jt.turn.session_id.clone(),
                        task_id: jt.turn.task_id.clone(),
                        group: None,
                        reason: EndReason::Done { outcome: None },
                        turns: vec![*jt],
                    };
                    state.start_build(&myself, vec![episode]);
                    return Ok(());
                }
                let sid = jt.turn.session_id.clone();
                match state.assemblies.get_mut(&sid) {
                    Some(a) => a.judged.push(*jt),
                    None => tracing::warn!("a judged turn of unknown session {sid}"),
                }
                state.try_complete(&myself, &sid)?;
            }
            JobMsg::Built(episodes, result) => state.on_built(episodes, result).await,
            JobMsg::Discarded(episodes) => state.on_discarded(episodes).await,
            JobMsg::Tick => {
                if state.counts.phase == JobPhase::Finished {
                    return Ok(());
                }
                state.poll().await;
                if let Some((cause, why)) = state.stop_condition() {
                    state.begin_drain(&myself, cause, &why);
                }
                // Slots left empty by admission control start when the backlog allows.
                state.fill(&myself).await?;
                if state.drained() {
                    match state.args.trainer.idle().await {
                        Ok(c) => state.counts.trainer = c,
                        Err(e) => state.counts.last_error = Some(e),
                    }
                    if let Some(r) = &state.args.recorder {
                        let _ = r.flush().await;
                    }
                    state.poll().await;
                    state.counts.phase = JobPhase::Finished;
                    state.report();
                    if let Some(done) = state.args.done.take() {
                        let _ = done.send(state.counts.clone());
                    }
                    myself.stop(Some("job finished".into()));
                } else {
                    state.report();
                }
            }
            JobMsg::Stop => state.begin_drain(&myself, StopCause::Requested, "stop requested"),
            JobMsg::Offer(turn) => state.on_offered(&myself, turn).await,
            JobMsg::SourceClosed => state.source_open = false,
            JobMsg::SetMaxSteps(max_steps) => {
                tracing::info!(job = %state.args.job, max_steps, "the job's step limit changed");
                state.args.settings.stop.max_trainer_steps = Some(max_steps);
                if let Err(e) = state.args.trainer.set_max_steps(Some(max_steps)) {
                    state.counts.last_error = Some(e);
                }
            }
            JobMsg::Record {
                version,
                kind,
                record,
            } => state.record(version, &kind, &record).await,
            JobMsg::Counts(port) => {
                let _ = port.send(state.counts.clone());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<JobMsg<S>>,
        evt: SupervisionEvent,
        state: &mut SupervisorState<S>,
    ) -> Result<(), ActorProcessingErr> {
        match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                if cell.get_id() == state.voter.get_id() {
                    // The voter died (a bug): restart it so the loops go on.
                    tracing::error!(job = %state.args.job, "the voter failed: {err}; restarting it");
                    state.voter = spawn_voter(&myself, &state.args).await?;
                } else if let Some((_, slot)) = state.live.get(&cell.get_id()) {
                    // A session panicked: it sent no `Ended`. Queue one behind the turns it
                    // already sent, so its episode is assembled from what arrived.
                    let sid = slot.session_id.clone();
                    myself.cast(JobMsg::Session(SessionEvent::Ended {
                        session_id: sid.clone(),
                        task_id: String::new(),
                        turns: TURNS_AS_RECEIVED,
                        reason: EndReason::Failed {
                            error: format!("the session actor failed: {err}"),
                        },
                    }))?;
                }
            }
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                // Normal ends are handled on `Ended` (always sent before the actor stops).
                let _ = cell;
            }
            _ => {}
        }
        Ok(())
    }
}

/// Starts a job; the receiver gets the final counters when it finishes.
pub async fn spawn_job<S: JobSample>(
    mut args: JobArgs<S>,
) -> Result<(ActorRef<JobMsg<S>>, oneshot::Receiver<JobCounts>), ActorProcessingErr> {
    let (tx, rx) = oneshot::channel();
    args.done = Some(tx);
    let (actor, _) = Actor::spawn(None, JobSupervisor::<S>::new(), args).await?;
    Ok((actor, rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_judge_never_worked_only_with_no_verdict_at_all_and_enough_failures() {
        let limit = judge_failure_limit(2);
        assert_eq!(limit, 64);
        assert_eq!(judge_failure_limit(32), 128);
        assert!(judge_never_worked(0, limit, limit));
        assert!(!judge_never_worked(0, limit - 1, limit));
        // One verdict is enough: a judge that works sometimes is slow or flaky, not
        // misconfigured.
        assert!(!judge_never_worked(1, 10 * limit, limit));
    }

    fn part(phase: JobPhase, turns: u64, produced: u64, trained: u64, version: u64) -> JobCounts {
        JobCounts {
            phase,
            turns,
            trainer: TrainerCounts {
                produced,
                trained,
                pending: produced - trained,
                version,
                steps: version,
                ..TrainerCounts::default()
            },
            ..JobCounts::default()
        }
    }

    #[test]
    fn a_sum_of_parts_counts_every_part_and_waits_for_the_slowest() {
        let a = part(JobPhase::Finished, 3, 4, 4, 2);
        let mut b = part(JobPhase::Draining, 5, 6, 2, 1);
        b.stopped_by = Some(StopCause::MaxSteps);
        b.last_error = Some("b".into());
        let s = JobCounts::sum([&a, &b]);
        assert_eq!(s.phase, JobPhase::Draining);
        assert_eq!(s.turns, 8);
        assert_eq!(s.trainer.produced, 10);
        assert_eq!(s.trainer.pending, 4);
        assert_eq!(s.trainer.steps, 3);
        assert_eq!(s.trainer.version, 2, "the newest version, not a sum");
        assert_eq!(s.stopped_by, Some(StopCause::MaxSteps));
        assert_eq!(s.last_error.as_deref(), Some("b"));
        assert!(s.balanced());
        // One unbalanced part unbalances the sum.
        b.trainer.pending = 0;
        assert!(!JobCounts::sum([&a, &b]).balanced());
        assert_eq!(JobCounts::sum([&a]), a);
    }
}
