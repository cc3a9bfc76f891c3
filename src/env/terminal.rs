//! The terminal environment (docs/design.md §4): tasks from JSONL, a `shell_exec` tool running bash in
//! the sandbox over the task's work dir, `submit` (or a plain answer) to finish, 10 steps by
//! default, and a check script that decides the outcome.
//!
//! A task line is `{"id", "instruction", "setup"?, "check"}` with `setup` an object holding
//! `files` (`{relative path: content}`, written before the episode starts) and/or `script` (bash
//! run in the sandbox after the files are written; it must exit 0). Unknown keys, missing fields,
//! blank texts and paths that leave the work dir are errors naming the line and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clawrl_actors::loops::{EnvError, Episode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::exec::{no_arg_tool, string_tool, CommandLimits, Runner};
use super::shell::{shell_episode, ShellConfig, Verdict, SUBMIT_TOOL};
use super::task_env::{setup_error, take_workdir, TaskEnv, TaskKind};
use super::tasks::{check_nonblank, check_relative_path, read_tasks, TaskError};
use super::workdir::WorkDirPool;
use super::{EnvBuildError, EnvKind, EnvOptions};

/// The default step limit.
pub const DEFAULT_MAX_STEPS: u32 = 10;

/// The shell tool's name.
pub const SHELL_TOOL: &str = "shell_exec";

const SYSTEM_PROMPT: &str = "You are an agent working in a Linux shell. Your working directory \
is /work; there is no network. Run commands with the `shell_exec` tool (each call is a fresh \
bash; files in /work persist between calls). When the task is done, call `submit`.";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    id: String,
    instruction: String,
    #[serde(default)]
    setup: Option<RawSetup>,
    check: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSetup {
    #[serde(default)]
    files: Option<BTreeMap<String, String>>,
    #[serde(default)]
    script: Option<String>,
}

/// One terminal task.
#[derive(Clone, Debug, PartialEq)]
pub struct TerminalTask {
    /// Its id.
    pub id: String,
    /// What the agent must do.
    pub instruction: String,
    /// Files written into the work dir before the episode (relative path, content).
    pub files: Vec<(PathBuf, String)>,
    /// A bash setup script run in the sandbox after the files are written.
    pub setup_script: Option<String>,
    /// The bash check script: exit 0 is success.
    pub check: String,
}

/// Reads and validates a terminal task file.
pub fn load_tasks(path: &Path) -> Result<Vec<TerminalTask>, TaskError> {
    read_tasks(
        path,
        |raw: &RawTask| &raw.id,
        |line, raw| {
            check_nonblank(path, line, "instruction", &raw.instruction)?;
            check_nonblank(path, line, "check", &raw.check)?;
            let mut files = Vec::new();
            let mut setup_script = None;
            if let Some(setup) = raw.setup {
                if setup.files.is_none() && setup.script.is_none() {
                    return Err(TaskError::invalid(
                        path,
                        line,
                        "setup",
                        "needs `files` and/or `script` (omit `setup` for none)",
                    ));
                }
                for (rel, content) in setup.files.unwrap_or_default() {
                    let p = check_relative_path(&rel).map_err(|reason| {
                        TaskError::invalid(path, line, &format!("setup.files.{rel}"), reason)
                    })?;
                    files.push((p, content));
                }
                if let Some(s) = setup.script {
                    check_nonblank(path, line, "setup.script", &s)?;
                    setup_script = Some(s);
                }
            }
            Ok(TerminalTask {
                id: raw.id,
                instruction: raw.instruction,
                files,
                setup_script,
                check: raw.check,
            })
        },
    )
}

/// The terminal environment over a task set.
pub type TerminalEnv = TaskEnv<Terminal>;

/// What the terminal kind adds to its task set: the shell episode's settings and the work dirs.
pub struct Terminal {
    cfg: ShellConfig,
    pool: Arc<WorkDirPool>,
}

impl TaskKind for Terminal {
    type Task = TerminalTask;

    const KIND: EnvKind = EnvKind::Terminal;

    fn load_tasks(path: &Path) -> Result<Vec<TerminalTask>, TaskError> {
        load_tasks(path)
    }

    fn build(options: &EnvOptions, pool: Arc<WorkDirPool>) -> Result<Self, EnvBuildError> {
        let limits = options
            .limits
            .clone()
            .unwrap_or_else(CommandLimits::terminal);
        let tools = vec![
            string_tool(
                SHELL_TOOL,
                "Run a bash command in /work and return its exit code, stdout and stderr.",
                "command",
                "The bash command line.",
            ),
            no_arg_tool(SUBMIT_TOOL, "Finish the task; the result is then checked."),
        ];
        Ok(Self {
            cfg: ShellConfig {
                tool: SHELL_TOOL,
                tools: Arc::new(tools),
                max_steps: options.max_steps.unwrap_or(DEFAULT_MAX_STEPS),
                observation_bytes: options.observation_bytes,
                deadline: options.episode_deadline,
                runner: Runner::new(limits, Vec::new(), options.max_concurrent_commands),
            },
            pool,
        })
    }

    fn max_steps(&self) -> u32 {
        self.cfg.max_steps
    }

    async fn start(
        &self,
        task: Arc<TerminalTask>,
        started: Instant,
    ) -> Result<Box<dyn Episode>, EnvError> {
        let setup_err = |reason| setup_error(&task.id, reason);
        let wd = take_workdir(&self.pool, &task.id)?;
        // Into the fresh work dir, following no link (crate::sandbox::host_fs).
        for (rel, content) in &task.files {
            crate::sandbox::host_fs::write_file(wd.path(), rel, content.as_bytes(), 0o644)
                .map_err(|e| setup_err(format!("writing {}: {e}", rel.display())))?;
        }
        if let Some(script) = &task.setup_script {
            let out = self
                .cfg
                .runner
                .bash(wd.path(), script, None)
                .await
                .map_err(|e| setup_err(format!("running the setup script: {e}")))?;
            if out.exit_code != Some(0) {
                return Err(setup_err(format!(
                    "the setup script failed (exit {:?}, signal {:?}, timed out {}): {}",
                    out.exit_code, out.signal, out.timed_out, out.stderr
                )));
            }
        }
        let messages: Vec<Value> = vec![
            json!({"role": "system", "content": SYSTEM_PROMPT}),
            json!({"role": "user", "content": task.instruction}),
        ];
        Ok(shell_episode(
            task.id.clone(),
            task.instruction.clone(),
            messages,
            self.cfg.clone(),
            Verdict::Check(task.check.clone()),
            wd,
            started,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Vec<TerminalTask>, TaskError> {
        crate::env::tasks::load_text("terminal", text, load_tasks)
    }

    fn key_of(text: &str) -> (usize, String) {
        match load(text).unwrap_err() {
            TaskError::Invalid { line, key, .. } => (line, key),
            e => panic!("{e}"),
        }
    }

    #[test]
    fn valid_tasks_load() {
        let t = load(concat!(
            r#"{"id":"a","instruction":"do","setup":{"files":{"d/x.txt":"hi"}},"check":"true"}"#,
            "\n",
            r#"{"id":"b","instruction":"do","setup":{"script":"echo > y"},"check":"test -f y"}"#,
            "\n",
            r#"{"id":"c","instruction":"do","check":"true"}"#,
        ))
        .unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(
            t[0].files,
            vec![(PathBuf::from("d/x.txt"), "hi".to_string())]
        );
        assert_eq!(t[1].setup_script.as_deref(), Some("echo > y"));
        assert!(t[2].files.is_empty() && t[2].setup_script.is_none());
    }

    #[test]
    fn invalid_tasks_name_line_and_key() {
        let ok = r#"{"id":"a","instruction":"do","check":"true"}"#;
        let cases = [
            (r#"{"id":"b","instruction":"do"}"#, "check"),
            (
                r#"{"id":"b","instruction":"do","check":"true","extra":1}"#,
                "extra",
            ),
            (
                r#"{"id":"b","instruction":"do","check":"true","setup":{"file":{}}}"#,
                "setup.file",
            ),
            (
                r#"{"id":"b","instruction":"do","check":"true","setup":{"files":{"../x":"1"}}}"#,
                "setup.files.../x",
            ),
            (
                r#"{"id":"b","instruction":"do","check":"true","setup":{"files":{"/etc/x":"1"}}}"#,
                "setup.files./etc/x",
            ),
            (
                r#"{"id":"b","instruction":"do","check":"true","setup":{"files":{"x":1}}}"#,
                "setup.files.x",
            ),
            (
                r#"{"id":"b","instruction":"do","check":"true","setup":{}}"#,
                "setup",
            ),
            (
                r#"{"id":"b","instruction":"  ","check":"true"}"#,
                "instruction",
            ),
            (r#"{"id":"a","instruction":"do","check":"true"}"#, "id"),
            (r#"{"id":"b c","instruction":"do","check":"true"}"#, "id"),
        ];
        for (bad, key) in cases {
            let (line, got) = key_of(&format!("{ok}\n\n{bad}\n"));
            assert_eq!((line, got.as_str()), (3, key), "{bad}");
        }
    }
}
