//! The tool-call environment (docs/design.md §4): math questions from JSONL, a `code_interpreter` tool
//! that runs Python 3 in the sandbox, at most 16 tool calls, and an outcome from matching the
//! final answer against the reference by normalised numeric value ([`super::answer`]).
//!
//! A task line is `{"id", "question", "answer"}`; `answer` is a JSON number or a string that
//! parses as one. The episode ends on the first message without tool calls (its text holds the
//! answer: the last `\boxed{}` or else the last number) or when the step limit (`max_tool_calls
//! + 1` by default) is reached, in which case the last message's text is judged. Calls beyond
//! the budget are answered without running. Each call is a fresh `python3` process (state does
//! not carry over; files written in `/work` do).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl_actors::loops::{Action, BoxFuture, EnvError, Episode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::answer::{answer_matches, extract_answer, parse_number};
use super::episode::{StepResult, ToolEpisode, ToolSteps};
use super::exec::{
    output_info, render_output, string_argument, string_tool, tool_message, CommandLimits, Runner,
};
use super::task_env::{take_workdir, TaskEnv, TaskKind};
use super::tasks::{check_nonblank, read_tasks, TaskError};
use super::workdir::{WorkDir, WorkDirPool};
use super::{EnvBuildError, EnvKind, EnvOptions};

/// The interpreter tool's name.
pub const INTERPRETER_TOOL: &str = "code_interpreter";

const SYSTEM_PROMPT: &str = "Solve the math problem. You may run Python 3 with the \
`code_interpreter` tool (each call is a fresh process with no network; print what you need to \
see). When you are done, reply without a tool call and put the final answer in \\boxed{}.";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    id: String,
    question: String,
    answer: Value,
}

/// One math task.
#[derive(Clone, Debug, PartialEq)]
pub struct MathTask {
    /// Its id.
    pub id: String,
    /// The question.
    pub question: String,
    /// The reference answer's text.
    pub answer: String,
}

/// Reads and validates a tool-call task file.
pub fn load_tasks(path: &Path) -> Result<Vec<MathTask>, TaskError> {
    read_tasks(
        path,
        |raw: &RawTask| &raw.id,
        |line, raw| {
            check_nonblank(path, line, "question", &raw.question)?;
            let answer = match &raw.answer {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                other => {
                    return Err(TaskError::invalid(
                        path,
                        line,
                        "answer",
                        format!("must be a number or a string holding one, got {other}"),
                    ))
                }
            };
            if parse_number(&answer).is_none() {
                return Err(TaskError::invalid(
                    path,
                    line,
                    "answer",
                    format!("{answer:?} is not a number (see env::answer for the accepted forms)"),
                ));
            }
            Ok(MathTask {
                id: raw.id,
                question: raw.question,
                answer,
            })
        },
    )
}

#[derive(Clone, Debug)]
struct Config {
    tools: Arc<Vec<Value>>,
    max_steps: u32,
    max_calls: u32,
    observation_bytes: usize,
    deadline: Duration,
    runner: Runner,
}

/// The tool-call environment over a task set.
pub type ToolCallEnv = TaskEnv<ToolCall>;

/// What the tool-call kind adds to its task set: the episodes' settings and the work dirs.
pub struct ToolCall {
    cfg: Config,
    pool: Arc<WorkDirPool>,
}

impl TaskKind for ToolCall {
    type Task = MathTask;

    const KIND: EnvKind = EnvKind::ToolCall;

    fn load_tasks(path: &Path) -> Result<Vec<MathTask>, TaskError> {
        load_tasks(path)
    }

    fn build(options: &EnvOptions, pool: Arc<WorkDirPool>) -> Result<Self, EnvBuildError> {
        let limits = options
            .limits
            .clone()
            .unwrap_or_else(CommandLimits::tool_call);
        let tools = vec![string_tool(
            INTERPRETER_TOOL,
            "Run Python 3 code and return its exit code, stdout and stderr.",
            "code",
            "The Python source to run.",
        )];
        Ok(Self {
            cfg: Config {
                tools: Arc::new(tools),
                max_steps: options.max_steps.unwrap_or(options.max_tool_calls + 1),
                max_calls: options.max_tool_calls,
                observation_bytes: options.observation_bytes,
                deadline: options.episode_deadline,
                runner: Runner::new(
                    limits,
                    vec![("PYTHONDONTWRITEBYTECODE".into(), "1".into())],
                    options.max_concurrent_commands,
                ),
            },
            pool,
        })
    }

    fn max_steps(&self) -> u32 {
        self.cfg.max_steps
    }

    async fn start(
        &self,
        task: Arc<MathTask>,
        started: Instant,
    ) -> Result<Box<dyn Episode>, EnvError> {
        let wd = take_workdir(&self.pool, &task.id)?;
        let messages = vec![
            json!({"role": "system", "content": SYSTEM_PROMPT}),
            json!({"role": "user", "content": task.question}),
        ];
        Ok(Box::new(ToolEpisode::new(
            task.id.clone(),
            task.question.clone(),
            messages,
            Arc::clone(&self.cfg.tools),
            started + self.cfg.deadline,
            ToolCallSteps {
                task,
                cfg: self.cfg.clone(),
                workdir: Some(wd),
                calls: 0,
            },
        )))
    }
}

/// What a tool-call episode does with its steps: runs the code in its work dir, within the
/// budget of calls, and judges the final answer.
pub struct ToolCallSteps {
    task: Arc<MathTask>,
    cfg: Config,
    workdir: Option<WorkDir>,
    calls: u32,
}

impl ToolCallSteps {
    fn judge(&self, text: &str) -> (f64, Value) {
        let given = extract_answer(text);
        let ok = answer_matches(text, &self.task.answer);
        (
            if ok { 1.0 } else { -1.0 },
            json!({"given": given, "expected": self.task.answer, "correct": ok}),
        )
    }
}

impl ToolSteps for ToolCallSteps {
    async fn run(
        &mut self,
        action: &Action,
        step: u32,
        deadline: Instant,
    ) -> Result<StepResult, EnvError> {
        if action.tool_calls.is_empty() {
            let (o, answer) = self.judge(&action.content);
            return Ok(StepResult {
                next_state: vec![],
                outcome: Some(o),
                info: json!({"step": step, "finish": "answer", "answer": answer}),
            });
        }
        let mut next_state = Vec::new();
        let mut runs = Vec::new();
        for call in &action.tool_calls {
            if call.name != INTERPRETER_TOOL {
                next_state.push(tool_message(
                    call,
                    format!(
                        "error: unknown tool `{}`; the only tool is `{INTERPRETER_TOOL}`",
                        call.name
                    ),
                ));
                continue;
            }
            if self.calls >= self.cfg.max_calls {
                next_state.push(tool_message(
                    call,
                    format!(
                        "not run: the budget of {} tool calls is used up; give your final answer",
                        self.cfg.max_calls
                    ),
                ));
                continue;
            }
            let code = match string_argument(call, "code") {
                Ok(c) => c,
                Err(msg) => {
                    next_state.push(tool_message(call, msg));
                    continue;
                }
            };
            self.calls += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let wd = self.workdir.as_ref().expect("open episode has a work dir");
            let out = self
                .cfg
                .runner
                .run(
                    wd.path(),
                    vec!["python3".into(), "-".into()],
                    Some(code.as_bytes().to_vec()),
                    Some(left),
                )
                .await
                .map_err(|e| EnvError::Step {
                    task: self.task.id.clone(),
                    reason: e.to_string(),
                })?;
            let (text, cut) = render_output(&out, self.cfg.observation_bytes);
            let mut info = output_info(&out);
            info["observation_truncated"] = Value::Bool(cut);
            runs.push(info);
            next_state.push(tool_message(call, text));
        }
        let mut info = json!({"step": step, "calls": runs, "calls_used": self.calls});
        let mut outcome = None;
        if step >= self.cfg.max_steps {
            let (o, answer) = self.judge(&action.content);
            outcome = Some(o);
            info["finish"] = Value::String("step_limit".into());
            info["answer"] = answer;
        }
        Ok(StepResult {
            next_state,
            outcome,
            info,
        })
    }

    fn close(mut self) -> BoxFuture<'static, ()> {
        Box::pin(super::workdir::release(self.workdir.take()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Vec<MathTask>, TaskError> {
        crate::env::tasks::load_text("toolcall", text, load_tasks)
    }

    #[test]
    fn tasks_load_and_answers_must_be_numbers() {
        let t = load(concat!(
            r#"{"id":"a","question":"1+1?","answer":2}"#,
            "\n",
            r#"{"id":"b","question":"half?","answer":"1/2"}"#
        ))
        .unwrap();
        assert_eq!(t[0].answer, "2");
        assert_eq!(t[1].answer, "1/2");
        for (bad, key) in [
            (r#"{"id":"c","question":"q","answer":"two"}"#, "answer"),
            (r#"{"id":"c","question":"q","answer":[2]}"#, "answer"),
            (r#"{"id":"c","question":"q"}"#, "answer"),
            (r#"{"id":"c","question":"q","answer":1,"hint":"x"}"#, "hint"),
            (r#"{"id":"c","question":"","answer":1}"#, "question"),
        ] {
            match load(&format!(
                "{}\n{bad}",
                r#"{"id":"a","question":"q","answer":1}"#
            ))
            .unwrap_err()
            {
                TaskError::Invalid { line, key: k, .. } => assert_eq!((line, k.as_str()), (2, key)),
                e => panic!("{bad}: {e}"),
            }
        }
    }
}
