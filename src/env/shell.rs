//! The episode that terminal and SWE tasks share: the policy runs shell commands through one
//! tool in its sandboxed work dir, finishes with `submit` or a plain answer (or hits the step
//! limit or the deadline), and a verdict run in the sandbox decides the outcome (a check script,
//! or the test command after the protected files are restored).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl_actors::loops::{Action, BoxFuture, EnvError, Episode};
use serde_json::{json, Value};

use super::episode::{verdict, Finish, StepResult, ToolEpisode, ToolSteps};
use super::exec::{output_info, render_output, string_argument, tool_message, Runner};
use super::workdir::WorkDir;

/// The name of the tool that ends an episode.
pub const SUBMIT_TOOL: &str = "submit";

/// Restores files inside the sandbox (so that links a policy planted resolve inside it, never on
/// the host): reads `{path: content}` JSON on stdin and makes each path a regular file with that
/// content, replacing whatever is there and any link or file standing where one of its parent
/// directories belongs. It runs as `python3 -I -S` ([`RESTORE_ARGV`]) because `/work` is the
/// policy's: isolated mode puts neither the cwd nor a script dir on `sys.path`, reads no user
/// site under `HOME=/work` and no `PYTHON*` variable, and `-S` skips `site` altogether, so only
/// the read-only standard library is imported and a planted `/work/json.py` is never run.
const RESTORE_PY: &str = r#"
import json, os, shutil, sys
for rel, content in json.load(sys.stdin).items():
    parts = [x for x in rel.split("/") if x not in ("", ".")]
    d = "/work"
    for part in parts[:-1]:
        d = os.path.join(d, part)
        if os.path.islink(d) or (os.path.lexists(d) and not os.path.isdir(d)):
            os.remove(d)
        if not os.path.lexists(d):
            os.mkdir(d)
    p = os.path.join(d, parts[-1])
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.remove(p)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content)
"#;

/// The restore's argv before the script: see [`RESTORE_PY`] for why isolated mode.
const RESTORE_ARGV: [&str; 4] = ["python3", "-I", "-S", "-c"];

/// What decides a shell episode's outcome.
#[derive(Clone, Debug)]
pub enum Verdict {
    /// A bash script; exit 0 is success.
    Check(String),
    /// Protected files (relative path, original content) are restored, then the bash test
    /// command runs; exit 0 is success.
    Tests {
        /// The test command.
        command: String,
        /// Files put back before the tests run.
        restore: Arc<Vec<(String, String)>>,
    },
}

/// The parts of a shell episode that come from its environment.
#[derive(Clone, Debug)]
pub struct ShellConfig {
    /// The command tool's name (`shell_exec`, `bash`).
    pub tool: &'static str,
    /// The tool schemas offered.
    pub tools: Arc<Vec<Value>>,
    /// The step limit.
    pub max_steps: u32,
    /// Bytes shown of each output stream.
    pub observation_bytes: usize,
    /// The episode's wall-clock budget.
    pub deadline: Duration,
    /// Runs the commands.
    pub runner: Runner,
}

/// What a terminal or SWE episode does with its steps: runs the commands in its work dir and
/// judges by its verdict.
pub struct ShellSteps {
    task_id: String,
    cfg: ShellConfig,
    verdict: Verdict,
    workdir: Option<WorkDir>,
}

/// A terminal or SWE episode over a prepared work dir, with the first messages (system, user).
pub fn shell_episode(
    task_id: String,
    instruction: String,
    messages: Vec<Value>,
    cfg: ShellConfig,
    verdict: Verdict,
    workdir: WorkDir,
    started: Instant,
) -> Box<dyn Episode> {
    let deadline = started + cfg.deadline;
    let tools = Arc::clone(&cfg.tools);
    let steps = ShellSteps {
        task_id: task_id.clone(),
        cfg,
        verdict,
        workdir: Some(workdir),
    };
    Box::new(ToolEpisode::new(
        task_id,
        instruction,
        messages,
        tools,
        deadline,
        steps,
    ))
}

impl ShellSteps {
    fn step_error(&self, reason: impl std::fmt::Display) -> EnvError {
        EnvError::Step {
            task: self.task_id.clone(),
            reason: reason.to_string(),
        }
    }

    async fn judge(&self) -> Result<(f64, Value), EnvError> {
        let wd = self
            .workdir
            .as_ref()
            .expect("open episode has a work dir")
            .path();
        let runner = &self.cfg.runner;
        let script = match &self.verdict {
            Verdict::Check(s) => s,
            Verdict::Tests { command, restore } => {
                if !restore.is_empty() {
                    let files: serde_json::Map<String, Value> = restore
                        .iter()
                        .map(|(p, c)| (p.clone(), Value::String(c.clone())))
                        .collect();
                    let out = runner
                        .run(
                            wd,
                            RESTORE_ARGV
                                .iter()
                                .map(|a| a.to_string())
                                .chain([RESTORE_PY.to_string()])
                                .collect(),
                            Some(Value::Object(files).to_string().into_bytes()),
                            None,
                        )
                        .await
                        .map_err(|e| self.step_error(format!("restoring test files: {e}")))?;
                    if out.exit_code != Some(0) {
                        return Err(self.step_error(format!(
                            "restoring test files failed ({:?}): {}",
                            out.exit_code, out.stderr
                        )));
                    }
                }
                command
            }
        };
        let out = runner
            .bash(wd, script, None)
            .await
            .map_err(|e| self.step_error(format!("running the check: {e}")))?;
        let outcome = if out.exit_code == Some(0) { 1.0 } else { -1.0 };
        let (tail, _) = super::exec::truncate_middle(&out.stdout, 2048);
        let (err_tail, _) = super::exec::truncate_middle(&out.stderr, 2048);
        let mut info = output_info(&out);
        info["stdout"] = Value::String(tail);
        info["stderr"] = Value::String(err_tail);
        Ok((outcome, info))
    }
}

impl ToolSteps for ShellSteps {
    async fn run(
        &mut self,
        action: &Action,
        step: u32,
        deadline: Instant,
    ) -> Result<StepResult, EnvError> {
        let mut next_state = Vec::new();
        let mut commands = Vec::new();
        let mut finish = Finish::of(action);
        for call in &action.tool_calls {
            if let Some(refusal) = finish.refusal(call) {
                next_state.push(refusal);
                continue;
            }
            if call.name == SUBMIT_TOOL {
                finish.submit();
                next_state.push(tool_message(call, "submitted".into()));
                continue;
            }
            if call.name != self.cfg.tool {
                next_state.push(tool_message(
                    call,
                    format!(
                        "error: unknown tool `{}`; the tools are `{}` and `{SUBMIT_TOOL}`",
                        call.name, self.cfg.tool
                    ),
                ));
                continue;
            }
            let command = match string_argument(call, "command") {
                Ok(c) => c,
                Err(msg) => {
                    next_state.push(tool_message(call, msg));
                    continue;
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let wd = self.workdir.as_ref().expect("open episode has a work dir");
            let out = self
                .cfg
                .runner
                .bash(wd.path(), command, Some(left))
                .await
                .map_err(|e| self.step_error(e))?;
            let (text, cut) = render_output(&out, self.cfg.observation_bytes);
            let mut info = output_info(&out);
            info["observation_truncated"] = Value::Bool(cut);
            commands.push(info);
            next_state.push(tool_message(call, text));
        }
        let mut info = json!({"step": step, "commands": commands});
        let mut outcome = None;
        if let Some(how) = finish.how(step, self.cfg.max_steps) {
            outcome = Some(verdict(&mut info, how, self.judge().await?));
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
