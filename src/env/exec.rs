//! What the environments share about running commands: per-command limits, the [`Runner`] that
//! sends commands to [`crate::sandbox::exec`] with a bound on how many run at once, the text an
//! observation shows for a command's output (truncated to a limit), and the chat messages an
//! episode appends for an action and its tool results.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use clawrl_actors::loops::{Action, StepOutcome, ToolCallAction};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::sandbox::{self, ExecOutput, Limits, SandboxError, SandboxSpec};

/// The `PATH` every sandboxed command gets unless an environment adds to it.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Limits of one sandboxed command: the sandbox's own [`Limits`], with per-kind presets.
pub type CommandLimits = Limits;

impl Limits {
    /// Terminal commands: 30 s, 1 GiB, 128 processes.
    pub fn terminal() -> Self {
        Self {
            cpu_secs: 30,
            memory_mb: 1024,
            processes: 128,
            file_size_mb: 64,
            timeout: Duration::from_secs(30),
            output_bytes: 1 << 20,
        }
    }

    /// SWE commands: builds and test suites need more (120 s, 4 GiB, 512 processes).
    pub fn swe() -> Self {
        Self {
            cpu_secs: 240,
            memory_mb: 4096,
            processes: 512,
            file_size_mb: 512,
            timeout: Duration::from_secs(120),
            output_bytes: 1 << 20,
        }
    }

    /// Code-interpreter calls: 20 s, 1 GiB, 64 processes.
    pub fn tool_call() -> Self {
        Self {
            cpu_secs: 20,
            memory_mb: 1024,
            processes: 64,
            file_size_mb: 64,
            timeout: Duration::from_secs(20),
            output_bytes: 1 << 20,
        }
    }

    /// Checks that every limit is positive.
    pub fn validate(&self) -> Result<(), String> {
        if self.cpu_secs == 0
            || self.memory_mb == 0
            || self.processes == 0
            || self.file_size_mb == 0
            || self.output_bytes == 0
            || self.timeout.is_zero()
        {
            return Err(format!("every limit must be positive: {self:?}"));
        }
        Ok(())
    }
}

/// Runs commands of one environment in the sandbox, at most `slots` at a time.
#[derive(Clone, Debug)]
pub struct Runner {
    limits: CommandLimits,
    env: Arc<Vec<(String, String)>>,
    slots: Arc<Semaphore>,
}

impl Runner {
    /// A runner with these limits, environment variables and concurrency bound.
    pub fn new(limits: CommandLimits, env: Vec<(String, String)>, slots: usize) -> Self {
        Self {
            limits,
            env: Arc::new(env),
            slots: Arc::new(Semaphore::new(slots.max(1))),
        }
    }

    /// The per-command limits.
    pub fn limits(&self) -> &CommandLimits {
        &self.limits
    }

    /// Runs `argv` with `workdir` as `/work`; `timeout` (clipped to the limit) overrides the
    /// limits' timeout.
    pub async fn run(
        &self,
        workdir: &Path,
        argv: Vec<String>,
        stdin: Option<Vec<u8>>,
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, SandboxError> {
        let timeout = timeout
            .map(|t| t.min(self.limits.timeout))
            .unwrap_or(self.limits.timeout)
            .max(Duration::from_millis(100));
        let spec = SandboxSpec {
            workdir: workdir.to_path_buf(),
            command: argv,
            stdin,
            env: self.env.as_ref().clone(),
            limits: Limits {
                timeout,
                ..self.limits.clone()
            },
        };
        let _slot = self.slots.acquire().await.expect("semaphore never closed");
        sandbox::exec(&spec).await
    }

    /// Runs a bash script (`/bin/bash -c script`).
    pub async fn bash(
        &self,
        workdir: &Path,
        script: &str,
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, SandboxError> {
        self.run(
            workdir,
            vec!["/bin/bash".into(), "-c".into(), script.to_string()],
            None,
            timeout,
        )
        .await
    }
}

/// `s` cut to at most `max` bytes (on char boundaries), keeping the head and the tail around a
/// `[... N bytes truncated ...]` marker; the flag says whether anything was cut.
pub fn truncate_middle(s: &str, max: usize) -> (String, bool) {
    if s.len() <= max {
        return (s.to_string(), false);
    }
    let mut head = max / 2;
    while !s.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = s.len() - (max - max / 2);
    while !s.is_char_boundary(tail) {
        tail += 1;
    }
    let cut = tail - head;
    (
        format!(
            "{}\n[... {cut} bytes truncated ...]\n{}",
            &s[..head],
            &s[tail..]
        ),
        true,
    )
}

/// What an observation shows of a command's output: the exit code (or signal / timeout) and
/// stdout and stderr, each truncated to `max_bytes`. The flag says whether anything was cut
/// (here or already by the sandbox).
pub fn render_output(out: &ExecOutput, max_bytes: usize) -> (String, bool) {
    let (stdout, cut_out) = truncate_middle(&out.stdout, max_bytes);
    let (stderr, cut_err) = truncate_middle(&out.stderr, max_bytes);
    let mut text = String::new();
    if out.timed_out {
        text.push_str(&format!(
            "timed out after {:.1} s (killed)\n",
            out.wall.as_secs_f64()
        ));
    }
    match (out.exit_code, out.signal) {
        (Some(c), _) => text.push_str(&format!("exit code: {c}\n")),
        (None, Some(s)) => text.push_str(&format!("killed by signal {s}\n")),
        (None, None) => text.push_str("exit code: none\n"),
    }
    if out.truncated {
        text.push_str("(output was cut by the sandbox's output limit)\n");
    }
    text.push_str("stdout:\n");
    text.push_str(&stdout);
    if !stdout.is_empty() && !stdout.ends_with('\n') {
        text.push('\n');
    }
    text.push_str("stderr:\n");
    text.push_str(&stderr);
    (text, cut_out || cut_err || out.truncated)
}

/// The answer to a step taken once the episode's deadline has passed: the episode ends with
/// outcome −1 and no next state, and `info` says why.
pub fn past_deadline(step: u32) -> StepOutcome {
    StepOutcome {
        next_state: vec![],
        done: true,
        outcome: Some(-1.0),
        info: json!({"step": step, "finish": "deadline", "deadline_exceeded": true}),
    }
}

/// A command's facts for a step's `info`.
pub fn output_info(out: &ExecOutput) -> Value {
    json!({
        "exit_code": out.exit_code,
        "signal": out.signal,
        "timed_out": out.timed_out,
        "truncated": out.truncated,
        "wall_ms": out.wall.as_millis() as u64,
    })
}

/// The assistant message for an action: its content and, when it called tools, the OpenAI
/// `tool_calls` (arguments as the object the model wrote, as the chat template renders them).
pub fn assistant_message(action: &Action) -> Value {
    let mut m = json!({"role": "assistant", "content": action.content});
    if !action.tool_calls.is_empty() {
        m["tool_calls"] = action
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect();
    }
    m
}

/// The tool message answering call `call`.
pub fn tool_message(call: &ToolCallAction, content: String) -> Value {
    json!({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content})
}

/// An OpenAI tool schema with one required string parameter.
pub fn string_tool(name: &str, description: &str, param: &str, param_description: &str) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {param: {"type": "string", "description": param_description}},
                "required": [param],
                "additionalProperties": false,
            },
        },
    })
}

/// An OpenAI tool schema without parameters.
pub fn no_arg_tool(name: &str, description: &str) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": false},
        },
    })
}

/// The string argument `param` of a call whose only argument it is; the error is the text the
/// tool message shows the policy.
pub fn string_argument<'a>(call: &'a ToolCallAction, param: &str) -> Result<&'a str, String> {
    let Some(obj) = call.arguments.as_object() else {
        return Err(format!(
            "error: the arguments of `{}` must be a JSON object {{\"{param}\": string}}",
            call.name
        ));
    };
    if let Some(k) = obj.keys().find(|k| k.as_str() != param) {
        return Err(format!(
            "error: `{}` takes only \"{param}\", not \"{k}\"",
            call.name
        ));
    }
    match obj.get(param) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!(
            "error: \"{param}\" of `{}` must be a string, got {other}",
            call.name
        )),
        None => Err(format!(
            "error: `{}` needs the argument \"{param}\" (a string)",
            call.name
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_head_and_tail_on_char_boundaries() {
        assert_eq!(truncate_middle("short", 10), ("short".into(), false));
        let s = "a".repeat(50) + &"é".repeat(50) + &"z".repeat(50);
        let (t, cut) = truncate_middle(&s, 40);
        assert!(cut);
        assert!(t.starts_with(&"a".repeat(20)));
        assert!(t.ends_with(&"z".repeat(20)));
        assert!(t.contains("bytes truncated"));
        let n: usize = t
            .split("[... ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(n, s.len() - 40);
        // A cut inside a two-byte character moves to a boundary.
        let (t, _) = truncate_middle(&"é".repeat(100), 21);
        assert!(t.starts_with(&"é".repeat(5)));
    }

    #[test]
    fn rendered_output_shows_exit_code_streams_and_cuts() {
        let out = ExecOutput {
            stdout: "x".repeat(1000),
            stderr: "oops\n".into(),
            exit_code: Some(3),
            signal: None,
            timed_out: false,
            truncated: false,
            wall: Duration::from_millis(5),
        };
        let (text, cut) = render_output(&out, 100);
        assert!(cut);
        assert!(text.starts_with("exit code: 3\nstdout:\n"));
        assert!(text.contains("stderr:\noops\n"));
        assert!(text.len() < 300);
        let out = ExecOutput {
            exit_code: None,
            signal: Some(9),
            timed_out: true,
            stdout: String::new(),
            ..out
        };
        let (text, cut) = render_output(&out, 100);
        assert!(!cut);
        assert!(text.contains("timed out"));
        assert!(text.contains("killed by signal 9"));
    }

    #[test]
    fn string_argument_is_strict() {
        let call = |args: Value| ToolCallAction {
            id: "c".into(),
            name: "shell_exec".into(),
            arguments: args,
        };
        assert_eq!(
            string_argument(&call(json!({"command": "ls"})), "command").unwrap(),
            "ls"
        );
        assert!(string_argument(&call(json!({})), "command")
            .unwrap_err()
            .contains("needs"));
        assert!(string_argument(&call(json!({"command": 1})), "command")
            .unwrap_err()
            .contains("must be a string"));
        assert!(
            string_argument(&call(json!({"command": "ls", "x": 1})), "command")
                .unwrap_err()
                .contains("\"x\"")
        );
        assert!(string_argument(&call(json!("ls")), "command").is_err());
    }

    #[test]
    fn assistant_message_carries_tool_calls() {
        let a = Action {
            content: "run".into(),
            tool_calls: vec![ToolCallAction {
                id: "1".into(),
                name: "bash".into(),
                arguments: json!({"command": "ls"}),
            }],
            raw: String::new(),
        };
        let m = assistant_message(&a);
        assert_eq!(m["tool_calls"][0]["function"]["name"], "bash");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"]["command"], "ls");
        let plain = assistant_message(&Action::default());
        assert!(plain.get("tool_calls").is_none());
    }
}
