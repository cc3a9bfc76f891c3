//! The general-agent environments of docs/design.md §4 (terminal, SWE, tool-call) as implementations of
//! the loops' [`Environment`] / [`Episode`] contract, plus the pure piece they need: final-answer
//! normalisation ([`answer`]). Step rewards and their (group, step index) normalisation are the
//! RL core's ([`crate::rl::stepwise`]), applied by the job's sample builder.
//!
//! Every command a policy issues runs through [`crate::sandbox::exec`] in a host work dir of its
//! own (mounted at `/work` inside the sandbox), taken from a warm pool when the episode starts and
//! removed when it closes ([`workdir`]). [`build_environment`] builds one by kind, which is how the
//! pipeline gets them. The kinds with work dirs (terminal, SWE, tool-call, GUI) share one
//! environment over their task set ([`task_env`]) and one tool-using episode ([`episode`]); each
//! supplies only what differs.

pub mod answer;
pub mod episode;
pub mod exec;
pub mod gui;
pub mod scripted;
pub mod shell;
pub mod swe;
pub mod task_env;
pub mod tasks;
pub mod terminal;
pub mod tool_call;
pub mod workdir;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clawrl_actors::loops::Environment;

pub use exec::CommandLimits;
pub use gui::GuiEnv;
pub use swe::SweEnv;
pub use tasks::TaskError;
pub use terminal::TerminalEnv;
pub use tool_call::ToolCallEnv;

/// The environment kinds a job may run in: the one list that job specs are validated against,
/// nodes' `--env KIND:N` are checked against, and [`build_environment`] builds from. Written in
/// specs by [`EnvKind::name`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EnvKind {
    /// Scripted tasks with canned next states, for tests and demos ([`scripted`]).
    #[default]
    Scripted,
    /// Shell tasks checked by a command ([`terminal`]).
    Terminal,
    /// Repository tasks checked by their tests ([`swe`]).
    Swe,
    /// Questions answered with tool calls ([`tool_call`]).
    ToolCall,
    /// Web pages driven through headless Chromium ([`gui`]).
    Gui,
}

impl EnvKind {
    /// Every kind.
    pub const ALL: [EnvKind; 5] = [
        EnvKind::Scripted,
        EnvKind::Terminal,
        EnvKind::Swe,
        EnvKind::ToolCall,
        EnvKind::Gui,
    ];

    /// Its name in specs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EnvKind::Scripted => "scripted",
            EnvKind::Terminal => "terminal",
            EnvKind::Swe => "swe",
            EnvKind::ToolCall => "tool_call",
            EnvKind::Gui => "gui",
        }
    }

    /// Whether its episodes run commands in the sandbox (checked once when one is built).
    fn sandboxed(self) -> bool {
        matches!(self, EnvKind::Terminal | EnvKind::Swe | EnvKind::ToolCall)
    }
}

impl std::fmt::Display for EnvKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not an [`EnvKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown environment kind `{0}` (known: scripted, terminal, swe, tool_call, gui)")]
pub struct UnknownEnvKind(pub String);

impl std::str::FromStr for EnvKind {
    type Err = UnknownEnvKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EnvKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownEnvKind(s.to_string()))
    }
}

impl serde::Serialize for EnvKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for EnvKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// How an environment runs its episodes. [`EnvOptions::default`] gives every kind's defaults.
#[derive(Clone, Debug)]
pub struct EnvOptions {
    /// The step limit of an episode; `None` takes the kind's default (terminal 10, SWE 20,
    /// tool-call `max_tool_calls + 1`, GUI 30).
    pub max_steps: Option<u32>,
    /// Limits of one sandboxed command; `None` takes the kind's default
    /// ([`CommandLimits::terminal`], [`CommandLimits::swe`], [`CommandLimits::tool_call`]).
    pub limits: Option<CommandLimits>,
    /// The most bytes of stdout, and separately of stderr, an observation shows; longer output
    /// keeps its head and tail around a `[... N bytes truncated ...]` marker. GUI: the most
    /// bytes of the accessibility tree shown (whole lines, with a marker when cut).
    pub observation_bytes: usize,
    /// The wall-clock budget of one episode from its start. A step begun after it ends the
    /// episode with outcome `-1` (`info.deadline_exceeded = true`); a command's timeout is
    /// clipped to what is left of it.
    pub episode_deadline: Duration,
    /// At most this many sandboxed commands of one environment run at once (others wait);
    /// GUI: at most this many browsers are alive at once (an episode holds one until it closes).
    pub max_concurrent_commands: usize,
    /// Work dirs created ahead of time, so that starting an episode takes one from the pool.
    pub warm_workdirs: usize,
    /// GUI only: browsers launched ahead of time and kept ready, so that starting an episode
    /// opens its page in one instead of launching (0: every episode launches its own). Counted
    /// under `max_concurrent_commands`, which must be at least this.
    pub warm_browsers: usize,
    /// The directory under which the environment creates the root of its work dirs, a fresh
    /// `clawrl-env-<kind>-<random>` of mode 0700 ([`workdir::WorkDirPool::new`]): a node's data
    /// dir or a run dir when there is one; `None` is the temp dir.
    pub work_root: Option<PathBuf>,
    /// The size cap of each episode's work dir in MiB, on the total of its files: a tmpfs of
    /// this size is mounted over it ([`workdir::WorkDirPool`]); `None`: no cap (each file is
    /// still bounded by the command limits' `file_size_mb`).
    pub workdir_mb: Option<u64>,
    /// Tool-call only: the most `code_interpreter` calls of an episode.
    pub max_tool_calls: u32,
}

impl Default for EnvOptions {
    fn default() -> Self {
        Self {
            max_steps: None,
            limits: None,
            observation_bytes: 4096,
            episode_deadline: Duration::from_secs(15 * 60),
            max_concurrent_commands: 64,
            warm_workdirs: 8,
            warm_browsers: 2,
            work_root: None,
            workdir_mb: Some(1024),
            max_tool_calls: 16,
        }
    }
}

impl EnvOptions {
    /// Checks the options that every kind uses.
    pub fn validate(&self) -> Result<(), EnvBuildError> {
        let bad = |what: &str, why: &str| {
            Err(EnvBuildError::Options {
                option: what.to_string(),
                reason: why.to_string(),
            })
        };
        if self.max_steps == Some(0) {
            return bad("max_steps", "must be at least 1");
        }
        if self.observation_bytes < 64 {
            return bad("observation_bytes", "must be at least 64");
        }
        if self.episode_deadline.is_zero() {
            return bad("episode_deadline", "must be positive");
        }
        if self.max_concurrent_commands == 0 {
            return bad("max_concurrent_commands", "must be at least 1");
        }
        if matches!(self.workdir_mb, Some(mb) if mb == 0 || mb > 1 << 30) {
            return bad("workdir_mb", "must be between 1 and 2^30 MiB");
        }
        if self.max_tool_calls == 0 {
            return bad("max_tool_calls", "must be at least 1");
        }
        if let Some(l) = &self.limits {
            l.validate().map_err(|reason| EnvBuildError::Options {
                option: "limits".into(),
                reason,
            })?;
        }
        Ok(())
    }

    /// What every kind does first: validate the options, refuse an empty task set, and create
    /// the work dir pool in a fresh `<work root>/clawrl-env-<kind>-<random>`.
    pub(crate) fn prepare(
        &self,
        kind: &str,
        task_count: usize,
    ) -> Result<std::sync::Arc<workdir::WorkDirPool>, EnvBuildError> {
        self.validate()?;
        if task_count == 0 {
            return Err(EnvBuildError::Options {
                option: "tasks".into(),
                reason: "the task set is empty".into(),
            });
        }
        let root = self.work_root.clone().unwrap_or_else(std::env::temp_dir);
        workdir::WorkDirPool::new(
            &root,
            &format!("clawrl-env-{kind}-"),
            self.warm_workdirs,
            self.workdir_mb,
        )
        .map_err(|source| EnvBuildError::WorkDir { root, source })
    }
}

/// Why an environment could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EnvBuildError {
    /// The scripted task file could not be read or is invalid.
    #[error(transparent)]
    Scripted(#[from] scripted::ScriptedEnvError),
    /// An option is out of range.
    #[error("environment option `{option}`: {reason}")]
    Options {
        /// The option.
        option: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Sandboxes cannot start on this host.
    #[error("environment needs the sandbox: {0}")]
    Sandbox(#[from] crate::sandbox::SandboxError),
    /// Chromium is missing or cannot start as the GUI environment runs it.
    #[error("the gui environment needs Chromium: {0}")]
    Browser(String),
    /// The task set could not be read or is invalid.
    #[error(transparent)]
    Tasks(#[from] TaskError),
    /// The work dir pool could not be created.
    #[error("creating work dirs under {root}: {source}")]
    WorkDir {
        /// The work root.
        root: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
}

/// Builds the environment of `kind` over the tasks at `tasks`:
///
/// - `scripted`: a JSON file of scripted tasks ([`scripted`]);
/// - `terminal`: a JSONL file of `{"id", "instruction", "setup"?, "check"}` ([`terminal`]);
/// - `swe`: a directory whose subdirectories each hold `task.json` and `repo/` ([`swe`]);
/// - `tool_call`: a JSONL file of `{"id", "question", "answer"}` ([`tool_call`]);
/// - `gui`: a JSONL file of `{"id", "instruction", "page", "check"}` ([`gui`]).
///
/// The tasks are read and validated here (an error names the file, line and key). For the kinds
/// that run commands the work dir pool is created warm, and one sandbox is started
/// ([`crate::sandbox::probe`], once per process) so that a host where sandboxes cannot start
/// fails here rather than in every episode (the `gui` kind instead checks that Chromium can
/// start; it does not use the sandbox).
pub fn build_environment(
    kind: EnvKind,
    tasks: &Path,
    options: EnvOptions,
) -> Result<Arc<dyn Environment>, EnvBuildError> {
    if kind.sandboxed() {
        crate::sandbox::probe()?;
    }
    Ok(match kind {
        EnvKind::Scripted => Arc::new(scripted::ScriptedEnv::load(tasks)?),
        EnvKind::Terminal => Arc::new(TerminalEnv::load(tasks, options)?),
        EnvKind::Swe => Arc::new(SweEnv::load(tasks, options)?),
        EnvKind::ToolCall => Arc::new(ToolCallEnv::load(tasks, options)?),
        EnvKind::Gui => Arc::new(GuiEnv::load(tasks, options)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_by_name_and_an_unknown_one_is_named() {
        for k in EnvKind::ALL {
            assert_eq!(k.name().parse::<EnvKind>(), Ok(k));
        }
        for bad in ["browser", "toolcall", "personal", "Terminal", ""] {
            let e = bad.parse::<EnvKind>().unwrap_err();
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn options_are_validated() {
        let o = EnvOptions {
            max_steps: Some(0),
            ..EnvOptions::default()
        };
        assert!(
            matches!(o.validate(), Err(EnvBuildError::Options { option, .. }) if option == "max_steps")
        );
        let o = EnvOptions {
            max_concurrent_commands: 0,
            ..EnvOptions::default()
        };
        assert!(o.validate().is_err());
        assert!(EnvOptions::default().validate().is_ok());
    }
}
