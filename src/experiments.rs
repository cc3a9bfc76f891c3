//! The experiments in miniature, part of the `clawrl` program rather than its library: each
//! builds its own small policy and tokenizer, warm-starts it offline, and then trains it through
//! the library's public API as any user's job would.
//!
//! - [`personal`]: simulated students and teachers talk to a `personal` job's gateway over HTTP;
//!   binary RL, OPD and their combination are compared on a personalization score
//!   (`clawrl run examples/personal.toml`).
//! - [`toolagent`]: a policy learns to call a sandboxed `code_interpreter` on generated math
//!   tasks, with integrated or outcome-only rewards (`clawrl run examples/tool_call_agent.toml`).
//!
//! Both build their tokenizers with [`word_tokenizer`] and their warm starts with
//! [`warm_start`].

use std::path::{Path, PathBuf};

use serde::Serialize;

use warm_start::SftOutcome;

pub mod personal;
pub mod toolagent;
pub mod warm_start;
pub mod word_tokenizer;

/// Which experiment a file describes, by its top-level `kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExperimentKind {
    /// `kind = "personal_experiment"` ([`personal::experiment::KIND`]).
    Personal,
    /// `kind = "tool_call_experiment"` ([`toolagent::experiment::KIND`]).
    ToolCall,
}

impl ExperimentKind {
    /// The kind `path` names at its top level; `None` when it names another (a job spec) or
    /// cannot be read or parsed (the job-spec parser then reports why).
    pub fn of_file(path: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(path).ok()?;
        let table = toml::from_str::<toml::Table>(&text).ok()?;
        match table.get("kind")?.as_str()? {
            personal::experiment::KIND => Some(Self::Personal),
            toolagent::experiment::KIND => Some(Self::ToolCall),
            _ => None,
        }
    }
}

/// `out`, or `runs/<name>-<unix time>` when not given.
pub fn run_dir(out: Option<PathBuf>, name: &str) -> PathBuf {
    out.unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        PathBuf::from("runs").join(format!("{name}-{secs}"))
    })
}

/// Prints a finished run on stdout: its whole `report` as one line of JSON with `json`, else
/// `table` and a line saying how long it took and where its `outputs` are.
pub fn print_report<R: Serialize>(json: bool, report: &R, table: &str, done: Done<'_>) {
    if json {
        println!(
            "{}",
            serde_json::to_string(report).expect("the report serializes")
        );
        return;
    }
    println!("{table}");
    let start = match done.sft {
        Some(sft) => format!(
            "warm start {} ({}), ",
            sft.dir.display(),
            if sft.cached { "cached" } else { "trained now" }
        ),
        None => String::new(),
    };
    println!(
        "{start}{:.0} s in all; {} in {}",
        done.seconds,
        done.outputs,
        done.run_dir.display()
    );
}

/// What [`print_report`] says under the table.
pub struct Done<'a> {
    /// The warm start, when one run used one.
    pub sft: Option<&'a SftOutcome>,
    /// Seconds for the whole run.
    pub seconds: f64,
    /// What the run wrote, in words.
    pub outputs: &'a str,
    /// Where.
    pub run_dir: &'a Path,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experiment_files_are_recognised_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        for (text, want) in [
            (
                "kind = \"personal_experiment\"\n",
                Some(ExperimentKind::Personal),
            ),
            (
                "kind = \"tool_call_experiment\"\n",
                Some(ExperimentKind::ToolCall),
            ),
            ("kind = \"rl\"\n", None),
            ("kind = 3\n", None),
            ("not toml at all [", None),
        ] {
            std::fs::write(&p, text).unwrap();
            assert_eq!(ExperimentKind::of_file(&p), want, "{text}");
        }
        assert_eq!(
            ExperimentKind::of_file(&dir.path().join("missing.toml")),
            None
        );
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert_eq!(
            ExperimentKind::of_file(&root.join("examples/personal.toml")),
            Some(ExperimentKind::Personal)
        );
        assert_eq!(
            ExperimentKind::of_file(&root.join("examples/tool_call_agent.toml")),
            Some(ExperimentKind::ToolCall)
        );
    }
}
