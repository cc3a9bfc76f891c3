//! The episode every work-dir kind (terminal, SWE, tool-call, GUI) runs: one conversation in
//! which the policy calls the kind's tools, a step limit and a wall-clock deadline.
//! [`ToolEpisode`] keeps the conversation, counts the steps, ends a step begun past the
//! deadline and is the [`Episode`]; a kind supplies what one step's tool calls do and how the
//! episode's resources are released ([`ToolSteps`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use clawrl_actors::loops::{
    Action, BoxFuture, EnvError, Episode, Observation, StepOutcome, ToolCallAction,
};
use serde_json::Value;

use super::exec::{assistant_message, past_deadline, tool_message};

/// What one step's tool calls gave.
pub struct StepResult {
    /// The tool messages (the next state).
    pub next_state: Vec<Value>,
    /// The outcome, when this step ends the episode.
    pub outcome: Option<f64>,
    /// The step's info.
    pub info: Value,
}

/// What one kind of tool-using episode does.
pub trait ToolSteps: Send + Sized + 'static {
    /// Runs step `step` (counted from 1) with `action`, which is already in the conversation,
    /// begun before `deadline`. An outcome ends the episode.
    fn run(
        &mut self,
        action: &Action,
        step: u32,
        deadline: Instant,
    ) -> impl Future<Output = Result<StepResult, EnvError>> + Send;

    /// Releases the episode's resources.
    fn close(self) -> BoxFuture<'static, ()>;
}

/// How a step of a kind that ends with a `submit` call or a plain answer (terminal, SWE, GUI)
/// finishes the episode: calls after the submit are not run, and the step limit finishes a
/// step that nothing else did.
pub struct Finish(Option<&'static str>);

impl Finish {
    /// The finish of a step with `action`: `answer` when it calls no tool.
    pub fn of(action: &Action) -> Self {
        Self(action.tool_calls.is_empty().then_some("answer"))
    }

    /// The tool message answering `call` when the step has already finished: it is not run.
    pub fn refusal(&self, call: &ToolCallAction) -> Option<Value> {
        self.0
            .is_some()
            .then(|| tool_message(call, "not run: the episode was already submitted".into()))
    }

    /// The step submitted the episode.
    pub fn submit(&mut self) {
        self.0 = Some("submit");
    }

    /// How step `step` ends the episode, when it does: as it finished, else `step_limit` at
    /// the step limit `max_steps`.
    pub fn how(self, step: u32, max_steps: u32) -> Option<&'static str> {
        self.0.or((step >= max_steps).then_some("step_limit"))
    }
}

/// The outcome of a step that finished `how` with the verdict `(outcome, check)`; both go into
/// the step's `info` (`finish`, `check`).
pub fn verdict(info: &mut Value, how: &str, (outcome, check): (f64, Value)) -> f64 {
    info["finish"] = Value::String(how.into());
    info["check"] = check;
    outcome
}

/// A running tool-using episode of kind `S`.
pub struct ToolEpisode<S: ToolSteps> {
    task_id: String,
    instruction: String,
    messages: Vec<Value>,
    tools: Arc<Vec<Value>>,
    steps: u32,
    done: bool,
    deadline: Instant,
    kind: S,
}

impl<S: ToolSteps> ToolEpisode<S> {
    /// An episode of task `task_id` with the first messages (system, user) and the tools
    /// offered, ending at `deadline`.
    pub fn new(
        task_id: String,
        instruction: String,
        messages: Vec<Value>,
        tools: Arc<Vec<Value>>,
        deadline: Instant,
        kind: S,
    ) -> Self {
        Self {
            task_id,
            instruction,
            messages,
            tools,
            steps: 0,
            done: false,
            deadline,
            kind,
        }
    }

    async fn do_step(&mut self, action: &Action) -> Result<StepOutcome, EnvError> {
        if self.done {
            return Err(EnvError::Finished {
                task: self.task_id.clone(),
            });
        }
        self.steps += 1;
        let step = self.steps;
        self.messages.push(assistant_message(action));
        if Instant::now() >= self.deadline {
            self.done = true;
            return Ok(past_deadline(step));
        }
        let StepResult {
            next_state,
            outcome,
            info,
        } = self.kind.run(action, step, self.deadline).await?;
        self.done = outcome.is_some();
        self.messages.extend(next_state.iter().cloned());
        Ok(StepOutcome {
            next_state,
            done: self.done,
            outcome,
            info,
        })
    }
}

impl<S: ToolSteps> Episode for ToolEpisode<S> {
    fn task_id(&self) -> &str {
        &self.task_id
    }

    fn instruction(&self) -> &str {
        &self.instruction
    }

    fn observation(&self) -> Observation {
        Observation {
            messages: self.messages.clone(),
            tools: self.tools.as_ref().clone(),
            template_kwargs: Default::default(),
        }
    }

    fn step<'a>(&'a mut self, action: &'a Action) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        Box::pin(self.do_step(action))
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        self.kind.close()
    }
}
