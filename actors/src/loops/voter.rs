//! The `PrmVoter` actor: judges turns concurrently and never stalls the loops.
//!
//! It knows no LLM: the root crate's judge (prompts, `m` concurrent votes, parsing, hint choice)
//! sits behind the [`TurnJudge`] trait. Each turn is judged on its own task, at most
//! `max_concurrent` at once (more wait for a permit, never in the message loop), bounded by
//! `timeout`. A judge error, a timeout or a panicking judge leaves the turn *unjudged* with the
//! reason (reward 0, no hint) and the turn still goes on to its sink, so the job's counts always
//! balance and the loops go on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::env::BoxFuture;
use super::session::Turn;

/// The judge's verdict on one turn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Judgement {
    /// The reward (binary: the majority vote in `{-1, 0, 1}`; step-wise: the process score).
    pub reward: f64,
    /// The accepted hindsight hint, if any.
    pub hint: Option<String>,
    /// Set when the turn could not be judged: why.
    pub unjudged: Option<String>,
    /// Votes that failed (timeout, endpoint error, unparseable or truncated answer).
    #[serde(default)]
    pub failed_votes: u32,
    /// Of those, votes whose answer was cut off at the judge's `max_tokens`.
    #[serde(default)]
    pub truncated_votes: u32,
    /// The judged-turn record as the judge writes it (`{session_id, turn, votes, reward,
    /// hint_accepted, hint, teacher_version, ...}`).
    pub record: serde_json::Value,
}

impl Judgement {
    /// An unjudged verdict for `turn`: reward 0, no hint, the reason kept in the record.
    pub fn unjudged(turn: &Turn, reason: impl Into<String>) -> Self {
        let reason = reason.into();
        Judgement {
            reward: 0.0,
            hint: None,
            record: serde_json::json!({
                "session_id": turn.session_id,
                "turn": turn.turn,
                "votes": [],
                "reward": 0,
                "hint_accepted": false,
                "hint": null,
                "teacher_version": null,
                "unjudged": reason,
            }),
            unjudged: Some(reason),
            failed_votes: 0,
            truncated_votes: 0,
        }
    }
}

/// A turn with its verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct JudgedTurn {
    /// The turn.
    pub turn: Turn,
    /// The verdict.
    pub judgement: Judgement,
}

/// A judge as the voter sees it. An `Err` is a turn the judge could not judge (recorded as
/// unjudged with the message).
pub trait TurnJudge: Send + Sync + 'static {
    /// Judges one turn (all its votes).
    fn judge<'a>(&'a self, turn: &'a Turn) -> BoxFuture<'a, Result<Judgement, String>>;
}

/// Where judged turns go.
pub type JudgedReport = Arc<dyn Fn(JudgedTurn) + Send + Sync>;

/// How a [`PrmVoter`] starts.
pub struct VoterArgs {
    /// The judge.
    pub judge: Arc<dyn TurnJudge>,
    /// Time limit of one turn's judging.
    pub timeout: Duration,
    /// Turns judged at once.
    pub max_concurrent: usize,
    /// Where judged turns go.
    pub report: JudgedReport,
}

/// Counters of a voter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoterStats {
    /// Turns received.
    pub received: u64,
    /// Turns judged (a verdict from the judge).
    pub judged: u64,
    /// Turns left unjudged (error, timeout, panic, or every vote failed).
    pub unjudged: u64,
    /// Turns being judged or waiting for a permit.
    pub in_flight: u64,
}

/// Messages of a [`PrmVoter`].
pub enum VoterMsg {
    /// Judge this turn.
    Judge(Box<Turn>),
    /// The counters.
    Stats(RpcReplyPort<VoterStats>),
}

impl ractor::Message for VoterMsg {}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    judged: AtomicU64,
    unjudged: AtomicU64,
    in_flight: AtomicU64,
}

/// The voter actor (behaviour only; see the module docs).
pub struct PrmVoter;

/// The voter's state.
pub struct VoterState {
    args: VoterArgs,
    permits: Arc<Semaphore>,
    counters: Arc<Counters>,
}

async fn judge_one(judge: Arc<dyn TurnJudge>, turn: &Turn, timeout: Duration) -> Judgement {
    // The judge runs on its own task so that a panic in it is caught here.
    let t = turn.clone();
    let task = tokio::spawn(async move {
        match tokio::time::timeout(timeout, judge.judge(&t)).await {
            Err(_) => Err(format!(
                "judging timed out after {} ms",
                timeout.as_millis()
            )),
            Ok(r) => r,
        }
    });
    match task.await {
        Ok(Ok(j)) => j,
        Ok(Err(reason)) => Judgement::unjudged(turn, reason),
        Err(e) => Judgement::unjudged(turn, format!("the judge task failed: {e}")),
    }
}

impl Actor for PrmVoter {
    type Msg = VoterMsg;
    type State = VoterState;
    type Arguments = VoterArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<VoterMsg>,
        args: VoterArgs,
    ) -> Result<VoterState, ActorProcessingErr> {
        if args.max_concurrent == 0 {
            return Err("PrmVoter: max_concurrent must be at least 1".into());
        }
        Ok(VoterState {
            permits: Arc::new(Semaphore::new(args.max_concurrent)),
            args,
            counters: Arc::new(Counters::default()),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<VoterMsg>,
        msg: VoterMsg,
        state: &mut VoterState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            VoterMsg::Judge(turn) => {
                let c = state.counters.clone();
                c.received.fetch_add(1, Ordering::Relaxed);
                c.in_flight.fetch_add(1, Ordering::Relaxed);
                let permits = state.permits.clone();
                let judge = state.args.judge.clone();
                let report = state.args.report.clone();
                let timeout = state.args.timeout;
                tokio::spawn(async move {
                    let judgement = match permits.acquire_owned().await {
                        Ok(_permit) => judge_one(judge, &turn, timeout).await,
                        Err(_) => Judgement::unjudged(&turn, "the voter has shut down"),
                    };
                    if judgement.unjudged.is_some() {
                        c.unjudged.fetch_add(1, Ordering::Relaxed);
                    } else {
                        c.judged.fetch_add(1, Ordering::Relaxed);
                    }
                    c.in_flight.fetch_sub(1, Ordering::Relaxed);
                    report(JudgedTurn {
                        turn: *turn,
                        judgement,
                    });
                });
            }
            VoterMsg::Stats(port) => {
                let c = &state.counters;
                let _ = port.send(VoterStats {
                    received: c.received.load(Ordering::Relaxed),
                    judged: c.judged.load(Ordering::Relaxed),
                    unjudged: c.unjudged.load(Ordering::Relaxed),
                    in_flight: c.in_flight.load(Ordering::Relaxed),
                });
            }
        }
        Ok(())
    }
}
