//! The SWE environment (docs/design.md §4): a task is a repository, an issue text and a test command;
//! the repository is copied into the episode's work dir, the policy works on it with a `bash`
//! tool (20 steps by default) and finishes with `submit` or a plain answer; then the protected
//! files (the tests) are restored to their original content inside the sandbox and the test
//! command decides the outcome (exit 0: `+1`, else `-1`).
//!
//! A task set is a directory; each subdirectory is one task holding
//! `task.json` = `{"id", "issue", "test_command", "protected"?: [relative paths]}` and `repo/`
//! (regular files and directories only; `target/`, `__pycache__/` and `.git/` are not copied).
//! Other files in a task's directory (for instance a known fix kept for tests) are ignored.
//! Rust tasks use the toolchain the sandbox mounts at `/opt/rust` (`cargo` on its `PATH`).

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clawrl_actors::loops::{EnvError, Episode};
use serde::Deserialize;
use serde_json::json;

use super::exec::{no_arg_tool, string_tool, CommandLimits, Runner};
use super::shell::{shell_episode, ShellConfig, Verdict, SUBMIT_TOOL};
use super::task_env::{setup_error, take_workdir, TaskEnv, TaskKind};
use super::tasks::{check_id, check_nonblank, check_relative_path, parse_json, TaskError};
use super::workdir::{WorkDir, WorkDirPool};
use super::{EnvBuildError, EnvKind, EnvOptions};

/// The default step limit.
pub const DEFAULT_MAX_STEPS: u32 = 20;

/// The shell tool's name.
pub const BASH_TOOL: &str = "bash";

/// The most bytes a task's repository may hold.
pub const MAX_REPO_BYTES: u64 = 64 << 20;

/// Directory names never copied from a repository.
const SKIPPED_DIRS: [&str; 3] = ["target", "__pycache__", ".git"];

const SYSTEM_PROMPT: &str = "You are a software engineer fixing an issue in a repository checked \
out at /work (your working directory; there is no network). Run commands with the `bash` tool \
(each call is a fresh bash; changes to files persist). Edit the code, not the tests. When the \
fix is done, call `submit`; the repository's tests then decide whether it is correct.";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    id: String,
    issue: String,
    test_command: String,
    #[serde(default)]
    protected: Vec<String>,
}

/// A file of a task's repository.
#[derive(Clone, Debug, PartialEq)]
pub struct RepoFile {
    /// Its path relative to the repository root.
    pub path: PathBuf,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Whether it is executable.
    pub executable: bool,
}

/// One SWE task.
#[derive(Clone, Debug, PartialEq)]
pub struct SweTask {
    /// Its id.
    pub id: String,
    /// The issue text.
    pub issue: String,
    /// The bash command that runs the tests.
    pub test_command: String,
    /// The repository's files (directories are implied, plus `dirs` for empty ones).
    pub files: Vec<RepoFile>,
    /// Every directory of the repository, parents first.
    pub dirs: Vec<PathBuf>,
    /// Protected files and their original text, restored before the tests run.
    pub protected: Vec<(String, String)>,
}

fn read_repo(root: &Path, task_json: &Path) -> Result<(Vec<RepoFile>, Vec<PathBuf>), TaskError> {
    let read_err = |path: &Path, source| TaskError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let mut total = 0u64;
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| read_err(&dir, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| read_err(&dir, e))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name();
            let r = rel.join(&name);
            let meta = std::fs::symlink_metadata(e.path()).map_err(|er| read_err(&e.path(), er))?;
            if meta.is_dir() {
                if SKIPPED_DIRS.iter().any(|s| name == *s) {
                    continue;
                }
                dirs.push(r.clone());
                stack.push(r);
            } else if meta.is_file() {
                total += meta.len();
                if total > MAX_REPO_BYTES {
                    return Err(TaskError::invalid(
                        task_json,
                        1,
                        "repo",
                        format!("the repository is larger than {MAX_REPO_BYTES} bytes"),
                    ));
                }
                let bytes = std::fs::read(e.path()).map_err(|er| read_err(&e.path(), er))?;
                files.push(RepoFile {
                    path: r,
                    bytes,
                    executable: meta.permissions().mode() & 0o111 != 0,
                });
            } else {
                return Err(TaskError::invalid(
                    task_json,
                    1,
                    "repo",
                    format!(
                        "{} is neither a regular file nor a directory",
                        e.path().display()
                    ),
                ));
            }
        }
    }
    dirs.sort_by_key(|d| d.components().count());
    Ok((files, dirs))
}

/// Reads one task directory (`task.json` + `repo/`).
pub fn load_task(dir: &Path, seen: &mut HashSet<String>) -> Result<SweTask, TaskError> {
    let task_json = dir.join("task.json");
    let text = std::fs::read_to_string(&task_json).map_err(|source| TaskError::Read {
        path: task_json.clone(),
        source,
    })?;
    let raw: RawTask = parse_json(&task_json, 1, &text)?;
    check_id(&task_json, 1, &raw.id, seen)?;
    check_nonblank(&task_json, 1, "issue", &raw.issue)?;
    check_nonblank(&task_json, 1, "test_command", &raw.test_command)?;
    let repo = dir.join("repo");
    if !repo.is_dir() {
        return Err(TaskError::invalid(
            &task_json,
            1,
            "repo",
            format!("{} is not a directory", repo.display()),
        ));
    }
    let (files, dirs) = read_repo(&repo, &task_json)?;
    let mut protected = Vec::new();
    for (i, p) in raw.protected.iter().enumerate() {
        let key = format!("protected[{i}]");
        let rel = check_relative_path(p).map_err(|r| TaskError::invalid(&task_json, 1, &key, r))?;
        let f = files.iter().find(|f| f.path == rel).ok_or_else(|| {
            TaskError::invalid(&task_json, 1, &key, format!("{p:?} is not a file of repo/"))
        })?;
        let text = String::from_utf8(f.bytes.clone()).map_err(|_| {
            TaskError::invalid(&task_json, 1, &key, format!("{p:?} is not UTF-8 text"))
        })?;
        protected.push((p.clone(), text));
    }
    Ok(SweTask {
        id: raw.id,
        issue: raw.issue,
        test_command: raw.test_command,
        files,
        dirs,
        protected,
    })
}

/// Reads every task directory under `root` (sorted by name).
pub fn load_tasks(root: &Path) -> Result<Vec<SweTask>, TaskError> {
    let read_err = |source| TaskError::Read {
        path: root.to_path_buf(),
        source,
    };
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(read_err)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(read_err)?;
    dirs.retain(|p| p.is_dir());
    dirs.sort();
    let mut seen = HashSet::new();
    let tasks = dirs
        .iter()
        .map(|d| load_task(d, &mut seen))
        .collect::<Result<Vec<_>, _>>()?;
    if tasks.is_empty() {
        return Err(TaskError::Empty {
            path: root.to_path_buf(),
        });
    }
    Ok(tasks)
}

/// Copies the repository into the (empty) work dir, following no link
/// ([`crate::sandbox::host_fs`]): files are 0755 when executable, else 0644.
fn write_repo(task: &SweTask, wd: &Path) -> std::io::Result<()> {
    use crate::sandbox::host_fs;
    for d in &task.dirs {
        host_fs::create_dirs(wd, d)?;
    }
    for f in &task.files {
        let mode = if f.executable { 0o755 } else { 0o644 };
        host_fs::write_file(wd, &f.path, &f.bytes, mode)?;
    }
    Ok(())
}

/// The SWE environment over a task set.
pub type SweEnv = TaskEnv<Swe>;

/// What the SWE kind adds to its task set: the shell episode's settings and the work dirs.
pub struct Swe {
    cfg: ShellConfig,
    pool: Arc<WorkDirPool>,
}

impl TaskKind for Swe {
    type Task = SweTask;

    const KIND: EnvKind = EnvKind::Swe;

    /// Reads the task directories under `path`.
    fn load_tasks(path: &Path) -> Result<Vec<SweTask>, TaskError> {
        load_tasks(path)
    }

    fn build(options: &EnvOptions, pool: Arc<WorkDirPool>) -> Result<Self, EnvBuildError> {
        let limits = options.limits.clone().unwrap_or_else(CommandLimits::swe);
        let tools = vec![
            string_tool(
                BASH_TOOL,
                "Run a bash command in the repository (/work) and return its exit code, stdout \
                 and stderr.",
                "command",
                "The bash command line.",
            ),
            no_arg_tool(SUBMIT_TOOL, "Finish; the repository's tests then run."),
        ];
        let env = vec![
            ("PYTHONDONTWRITEBYTECODE".to_string(), "1".to_string()),
            ("CARGO_TERM_COLOR".to_string(), "never".to_string()),
        ];
        Ok(Self {
            cfg: ShellConfig {
                tool: BASH_TOOL,
                tools: Arc::new(tools),
                max_steps: options.max_steps.unwrap_or(DEFAULT_MAX_STEPS),
                observation_bytes: options.observation_bytes,
                deadline: options.episode_deadline,
                runner: Runner::new(limits, env, options.max_concurrent_commands),
            },
            pool,
        })
    }

    fn max_steps(&self) -> u32 {
        self.cfg.max_steps
    }

    async fn start(
        &self,
        task: Arc<SweTask>,
        started: Instant,
    ) -> Result<Box<dyn Episode>, EnvError> {
        let wd: WorkDir = take_workdir(&self.pool, &task.id)?;
        let copy_err = |e: &dyn std::fmt::Display| {
            setup_error(&task.id, format!("copying the repository: {e}"))
        };
        let t = Arc::clone(&task);
        let path = wd.path().to_path_buf();
        tokio::task::spawn_blocking(move || write_repo(&t, &path))
            .await
            .map_err(|e| copy_err(&e))?
            .map_err(|e| copy_err(&e))?;
        let user = format!(
            "Fix this issue in the repository at /work.\n\n{}\n\nThe tests run with `{}`.",
            task.issue.trim_end(),
            task.test_command
        );
        let messages = vec![
            json!({"role": "system", "content": SYSTEM_PROMPT}),
            json!({"role": "user", "content": user}),
        ];
        Ok(shell_episode(
            task.id.clone(),
            task.issue.clone(),
            messages,
            self.cfg.clone(),
            Verdict::Tests {
                command: task.test_command.clone(),
                restore: Arc::new(task.protected.clone()),
            },
            wd,
            started,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task_dir(name: &str, task_json: &str) -> PathBuf {
        let d = std::env::temp_dir()
            .join(format!("clawrl-swe-tasks-{}", std::process::id()))
            .join(name);
        std::fs::create_dir_all(d.join("repo/tests")).unwrap();
        std::fs::create_dir_all(d.join("repo/target")).unwrap();
        std::fs::write(d.join("repo/a.py"), "x = 1\n").unwrap();
        std::fs::write(d.join("repo/tests/test_a.py"), "import a\n").unwrap();
        std::fs::write(d.join("repo/target/junk"), "j").unwrap();
        std::fs::write(d.join("task.json"), task_json).unwrap();
        d
    }

    #[test]
    fn task_dirs_load_strictly() {
        let mut seen = HashSet::new();
        let d = task_dir(
            "ok",
            r#"{"id":"ok","issue":"x is wrong","test_command":"python3 -m unittest","protected":["tests/test_a.py"]}"#,
        );
        let t = load_task(&d, &mut seen).unwrap();
        assert_eq!(t.files.len(), 2, "target/ is skipped");
        assert_eq!(
            t.protected,
            vec![("tests/test_a.py".into(), "import a\n".into())]
        );
        assert_eq!(t.dirs, vec![PathBuf::from("tests")]);
        let cases = [
            (r#"{"id":"b","issue":"i","test_command":"t","x":1}"#, "x"),
            (r#"{"id":"b","issue":"i"}"#, "test_command"),
            (r#"{"id":"b","issue":"","test_command":"t"}"#, "issue"),
            (
                r#"{"id":"b","issue":"i","test_command":"t","protected":["../a"]}"#,
                "protected[0]",
            ),
            (
                r#"{"id":"b","issue":"i","test_command":"t","protected":["nope.py"]}"#,
                "protected[0]",
            ),
        ];
        for (i, (json, key)) in cases.into_iter().enumerate() {
            let d = task_dir(&format!("bad{i}"), json);
            match load_task(&d, &mut HashSet::new()).unwrap_err() {
                TaskError::Invalid { key: k, .. } => assert_eq!(k, key, "{json}"),
                e => panic!("{json}: {e}"),
            }
        }
        std::fs::remove_dir_all(d.parent().unwrap()).unwrap();
    }
}
