//! Environments as the loops see them: a task set that starts [`Episode`]s, and an episode that
//! shows the policy an [`Observation`] and answers each [`Action`] with a [`StepOutcome`].
//!
//! This is the contract between the `EnvSession` actor (which owns one episode and drives it:
//! observe → ask the policy → step → hand the turn to the judges) and the root crate's concrete
//! environments (terminal, SWE, tool-call, GUI, simulated users). It knows no LLM: messages and
//! tool schemas are OpenAI chat-format JSON values, which every environment and every policy in
//! the project already speaks.
//!
//! Rules every implementation keeps:
//! - the episode owns its conversation: after [`Episode::step`] the next
//!   [`Episode::observation`] holds the assistant message for the action and then the
//!   `next_state` messages the step returned;
//! - `next_state` is what docs/design.md §1 calls `s_{t+1}`: tool results (`role: "tool"`), a terminal's
//!   output, or the user's reply (`role: "user"`); it is empty only when the episode ended
//!   without one;
//! - a step after `done` is an error ([`EnvError::Finished`]), never a panic;
//! - [`Episode::close`] releases what the episode holds (sandbox, browser page) and is called
//!   exactly once, also when the episode fails.

use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A boxed future, as the object-safe traits here return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the policy sees before a step: the whole conversation so far and the tools it may call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// OpenAI-format chat messages (`{"role", "content", ...}`), system prompt first.
    pub messages: Vec<Value>,
    /// OpenAI-format tool schemas (`{"type":"function","function":{"name","description",
    /// "parameters"}}`); empty when the environment offers none.
    pub tools: Vec<Value>,
    /// Extra chat-template variables the prompt was rendered with (a gateway request's
    /// `chat_template_kwargs`, e.g. `enable_thinking`); empty for environments. Whoever renders
    /// this observation again (the OPD teacher) renders with them too.
    #[serde(default)]
    pub template_kwargs: serde_json::Map<String, Value>,
}

/// One tool call the policy made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCallAction {
    /// The call id (the environment echoes it as `tool_call_id` in the tool message).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// Its arguments, as parsed from the policy's output (a JSON object).
    pub arguments: Value,
}

/// What the policy did at a step: its assistant message.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Action {
    /// The text of the message with tool-call markup removed (may be empty).
    pub content: String,
    /// The tool calls, in order (empty when the message is a plain answer).
    pub tool_calls: Vec<ToolCallAction>,
    /// The full response text exactly as sampled, markup included.
    pub raw: String,
}

/// What an environment answers to an action.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// The next state `s_{t+1}`: tool results or the user's reply, as chat messages.
    pub next_state: Vec<Value>,
    /// Whether the episode is over (task solved or failed, step limit reached, user left).
    pub done: bool,
    /// The episode's outcome when `done`: `+1.0` success, `-1.0` failure (or a score in
    /// `[-1, 1]`); `None` while the episode runs, or when it has no verifiable outcome.
    pub outcome: Option<f64>,
    /// What the environment wants recorded with the step (exit codes, truncation, timings).
    pub info: Value,
}

/// Why an environment could not start or step an episode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvError {
    /// There is no task with this index.
    #[error("task {index} does not exist (the task set has {count})")]
    NoSuchTask {
        /// The index asked for.
        index: usize,
        /// How many tasks there are.
        count: usize,
    },
    /// The task could not be set up (files, setup script, page load).
    #[error("setting up task `{task}`: {reason}")]
    Setup {
        /// The task id.
        task: String,
        /// What went wrong.
        reason: String,
    },
    /// A step could not be carried out for a reason that is not the policy's fault (sandbox
    /// failed to start, browser crashed). A malformed action is *not* an error: the
    /// environment answers it with an observation saying what was wrong.
    #[error("stepping task `{task}`: {reason}")]
    Step {
        /// The task id.
        task: String,
        /// What went wrong.
        reason: String,
    },
    /// The episode already ended.
    #[error("task `{task}` already finished")]
    Finished {
        /// The task id.
        task: String,
    },
}

/// A set of tasks of one kind, able to start episodes. Shared by every session of a job.
pub trait Environment: Send + Sync + 'static {
    /// The kind (`terminal`, `swe`, `tool_call`, `gui`, `personal`, ...); Control places a job
    /// on environment slots of this kind.
    fn kind(&self) -> &str;

    /// How many tasks the set holds (at least one).
    fn task_count(&self) -> usize;

    /// The step limit of an episode.
    fn max_steps(&self) -> u32;

    /// Starts an episode of task `index`; `seed` makes any randomness in the environment (a
    /// simulated user's choices) reproducible.
    fn start(&self, index: usize, seed: u64) -> BoxFuture<'_, Result<Box<dyn Episode>, EnvError>>;
}

/// One running episode, owned by one `EnvSession`.
pub trait Episode: Send {
    /// The task's id (stable across runs; used in records and for grouping samples).
    fn task_id(&self) -> &str;

    /// The task's instruction in words (what step judges are told the agent must do).
    fn instruction(&self) -> &str;

    /// The conversation so far and the tools.
    fn observation(&self) -> Observation;

    /// Applies the policy's action.
    fn step<'a>(&'a mut self, action: &'a Action) -> BoxFuture<'a, Result<StepOutcome, EnvError>>;

    /// Releases the episode's resources.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}
