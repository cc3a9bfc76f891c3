//! The `EnvSession` actor: owns one [`Episode`] and drives it — observe, ask the policy, step,
//! hand the turn on — until the episode is done, hits its step limit or its deadline, or fails.
//!
//! The policy is a small LLM-agnostic trait ([`TurnPolicy`]): the root crate renders the
//! observation with its chat template, generates on a rollout worker and parses tool calls; the
//! session only needs the [`Action`] plus the exact token ids, log-probs and weight version it
//! came from ([`PolicyTurn`]). Every step produces one [`Turn`], reported through the session's
//! [`SessionReport`] callback together with a final [`SessionEvent::Ended`] that says why the
//! session ended.
//!
//! Rules the session keeps:
//! - the whole episode (start, every policy call, every step) runs under one deadline; running
//!   out of it ends the session with [`EndReason::Deadline`], not a failure;
//! - [`Episode::close`] is called exactly once for every episode that started: when the session
//!   ends on its own, or in `post_stop` when the session is stopped from outside;
//! - a failure (environment or policy error) ends the session with [`EndReason::Failed`] and the
//!   reason; the actor itself stops normally, so its supervisor decides what a failure means.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::{Deserialize, Serialize};

use super::env::{Action, BoxFuture, Environment, Episode, Observation, StepOutcome};

/// What the policy produced for one observation, with the exact tokens behind it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyTurn {
    /// The parsed assistant message.
    pub action: Action,
    /// The prompt `s_t` as token ids, exactly as served.
    pub prompt_ids: Vec<u32>,
    /// The response `a_t` as token ids, exactly as sampled.
    pub response_ids: Vec<u32>,
    /// The log-probability of each response token at sampling time.
    pub logprobs: Vec<f32>,
    /// The weight version that produced every response token.
    pub version: u64,
    /// The prompt as rendered text.
    pub prompt_text: String,
    /// The response as decoded text.
    pub response_text: String,
}

/// Why the policy produced no turn.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("policy: {0}")]
pub struct PolicyError(pub String);

/// The policy as a session sees it: an observation in, an action with its tokens out.
pub trait TurnPolicy: Send + Sync + 'static {
    /// Acts on `observation`.
    fn act<'a>(
        &'a self,
        observation: &'a Observation,
    ) -> BoxFuture<'a, Result<PolicyTurn, PolicyError>>;
}

/// One step of an episode: what the policy saw and did, and what the environment answered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// The session (unique per started episode within a job).
    pub session_id: String,
    /// The task's id.
    pub task_id: String,
    /// The task's index in its set.
    pub task_index: usize,
    /// The task's instruction.
    pub instruction: String,
    /// The step index within the episode (0-based).
    pub turn: u32,
    /// The conversation and tools the policy saw (`s_t` as messages).
    pub observation: Observation,
    /// What the policy did, with its tokens.
    pub policy: PolicyTurn,
    /// What the environment answered (`s_{t+1}`, done, outcome, info).
    pub outcome: StepOutcome,
    /// From the second step of a session on: whether this step's prompt ids start with the
    /// previous step's prompt ids followed by its sampled response ids. `false` means the history
    /// differs from what the policy saw and wrote: the chat template rendered it otherwise (a
    /// tool call written back in another JSON spacing, dropped reasoning), or a client sent it
    /// back otherwise (a message left out). The policy then learns from histories it never had. An `EnvSession` sets it, and so does a `personal` job for
    /// each gateway turn after its session's first; `None` for a first step, and where nothing
    /// checked.
    #[serde(default)]
    pub history_kept: Option<bool>,
}

/// Whether `prompt` keeps `history` (the previous step's prompt ids followed by its response
/// ids): it starts with it, token for token.
pub fn keeps_history(prompt: &[u32], history: &[u32]) -> bool {
    prompt.starts_with(history)
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum EndReason {
    /// The environment said the episode is over.
    Done {
        /// The episode's outcome, when it has one.
        outcome: Option<f64>,
    },
    /// The step limit was reached.
    StepLimit,
    /// The deadline passed.
    Deadline,
    /// The session was stopped from outside (job stop).
    Stopped,
    /// The environment or the policy failed.
    Failed {
        /// What went wrong.
        error: String,
    },
}

impl EndReason {
    /// Whether this is a failure (a supervisor restarts failed sessions).
    pub fn is_failure(&self) -> bool {
        matches!(self, EndReason::Failed { .. })
    }
}

/// What a session reports.
#[derive(Clone, Debug, PartialEq)]
pub enum SessionEvent {
    /// A step was taken.
    Turn(Box<Turn>),
    /// The session ended (always the last event of a session, sent exactly once).
    Ended {
        /// The session.
        session_id: String,
        /// The task's id (empty when the episode never started).
        task_id: String,
        /// Turns reported.
        turns: u32,
        /// Why.
        reason: EndReason,
    },
}

/// Where a session's events go.
pub type SessionReport = Arc<dyn Fn(SessionEvent) + Send + Sync>;

/// How an [`EnvSession`] starts.
pub struct SessionArgs {
    /// The session's id.
    pub session_id: String,
    /// The task set.
    pub env: Arc<dyn Environment>,
    /// Which task.
    pub task_index: usize,
    /// The episode's seed.
    pub seed: u64,
    /// The policy.
    pub policy: Arc<dyn TurnPolicy>,
    /// The time the whole episode may take.
    pub deadline: Duration,
    /// A step limit below the environment's own (`None`: the environment's).
    pub max_steps: Option<u32>,
    /// Where events go.
    pub report: SessionReport,
}

/// Messages of an [`EnvSession`].
#[derive(Debug)]
pub enum SessionMsg {
    /// Take the next step (the session sends it to itself).
    Step,
}

impl ractor::Message for SessionMsg {}

/// The session actor (behaviour only; see the module docs).
pub struct EnvSession;

/// The session's state.
pub struct SessionState {
    args: SessionArgs,
    episode: Option<Box<dyn Episode>>,
    started: Instant,
    task_id: String,
    turns: u32,
    ended: bool,
    /// The previous step's prompt ids followed by its response ids (empty before the first).
    history: Vec<u32>,
}

impl SessionState {
    fn remaining(&self) -> Duration {
        self.args.deadline.saturating_sub(self.started.elapsed())
    }

    fn step_limit(&self) -> u32 {
        let env = self.args.env.max_steps().max(1);
        self.args.max_steps.map_or(env, |m| m.clamp(1, env))
    }

    /// Closes the episode (if it started and is still held) and reports the end, once.
    async fn finish(&mut self, reason: EndReason) {
        if let Some(ep) = self.episode.take() {
            ep.close().await;
        }
        if !self.ended {
            self.ended = true;
            (self.args.report)(SessionEvent::Ended {
                session_id: self.args.session_id.clone(),
                task_id: self.task_id.clone(),
                turns: self.turns,
                reason,
            });
        }
    }

    /// One step; `Some(reason)` when the session is over.
    async fn step(&mut self) -> Option<EndReason> {
        let remaining = self.remaining();
        if remaining.is_zero() {
            return Some(EndReason::Deadline);
        }
        if self.episode.is_none() {
            let start = self.args.env.start(self.args.task_index, self.args.seed);
            match tokio::time::timeout(remaining, start).await {
                Err(_) => return Some(EndReason::Deadline),
                Ok(Err(e)) => {
                    return Some(EndReason::Failed {
                        error: e.to_string(),
                    })
                }
                Ok(Ok(ep)) => {
                    self.task_id = ep.task_id().to_string();
                    self.episode = Some(ep);
                }
            }
        }
        let remaining = self.remaining();
        let ep = self.episode.as_mut().expect("started above");
        let observation = ep.observation();
        let policy = self.args.policy.clone();
        let turn = match tokio::time::timeout(remaining, policy.act(&observation)).await {
            Err(_) => return Some(EndReason::Deadline),
            Ok(Err(e)) => {
                return Some(EndReason::Failed {
                    error: e.to_string(),
                })
            }
            Ok(Ok(t)) => t,
        };
        let remaining = self.args.deadline.saturating_sub(self.started.elapsed());
        let outcome = match tokio::time::timeout(remaining, ep.step(&turn.action)).await {
            Err(_) => return Some(EndReason::Deadline),
            Ok(Err(e)) => {
                return Some(EndReason::Failed {
                    error: e.to_string(),
                })
            }
            Ok(Ok(o)) => o,
        };
        let done = outcome.done;
        let final_outcome = outcome.outcome;
        let instruction = ep.instruction().to_string();
        let history_kept = (self.turns > 0).then(|| keeps_history(&turn.prompt_ids, &self.history));
        self.history.clear();
        self.history.extend_from_slice(&turn.prompt_ids);
        self.history.extend_from_slice(&turn.response_ids);
        (self.args.report)(SessionEvent::Turn(Box::new(Turn {
            session_id: self.args.session_id.clone(),
            task_id: self.task_id.clone(),
            task_index: self.args.task_index,
            instruction,
            turn: self.turns,
            observation,
            policy: turn,
            outcome,
            history_kept,
        })));
        self.turns += 1;
        if done {
            Some(EndReason::Done {
                outcome: final_outcome,
            })
        } else if self.turns >= self.step_limit() {
            Some(EndReason::StepLimit)
        } else {
            None
        }
    }
}

impl Actor for EnvSession {
    type Msg = SessionMsg;
    type State = SessionState;
    type Arguments = SessionArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SessionMsg>,
        args: SessionArgs,
    ) -> Result<SessionState, ActorProcessingErr> {
        Ok(SessionState {
            args,
            episode: None,
            started: Instant::now(),
            task_id: String::new(),
            turns: 0,
            ended: false,
            history: Vec::new(),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<SessionMsg>,
        _state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        myself.cast(SessionMsg::Step)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionMsg>,
        msg: SessionMsg,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionMsg::Step => {
                if state.ended {
                    return Ok(());
                }
                match state.step().await {
                    Some(reason) => {
                        state.finish(reason).await;
                        myself.stop(None);
                    }
                    None => myself.cast(SessionMsg::Step)?,
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionMsg>,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped from outside mid-episode: release it and say so.
        state.finish(EndReason::Stopped).await;
        Ok(())
    }
}
