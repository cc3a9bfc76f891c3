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

use clawrl::job::{JobSpec, JobSpecError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

use personal::experiment::Results;
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

/// Why an experiment file could not be read, or a run's files not written.
#[derive(Debug, Error)]
pub enum FileError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a valid experiment.
    #[error("invalid experiment file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong (names the key).
        message: String,
    },
    /// The run directory already holds files: an earlier run's jobs there would resume from
    /// their checkpoints, while an experiment measures jobs that start from its warm start.
    #[error(
        "{path} is not empty: an experiment starts its jobs fresh, and jobs resume from what \
         their directory holds; give another --out, or remove it"
    )]
    RunDirInUse {
        /// The directory.
        path: PathBuf,
    },
    /// Writing (or preparing) a run's files failed.
    #[error("writing {path}: {message}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl FileError {
    /// A [`FileError::Parse`] of `origin`.
    pub fn parse(origin: &str, message: impl Into<String>) -> Self {
        Self::Parse {
            path: origin.to_string(),
            message: message.into(),
        }
    }

    /// A [`FileError::Write`] of `path`.
    pub fn write(path: &Path, message: impl ToString) -> Self {
        Self::Write {
            path: path.to_path_buf(),
            message: message.to_string(),
        }
    }
}

/// The text of the experiment file at `path`.
pub fn read_text(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(|source| FileError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Parses experiment TOML `text` into `T`; `origin` names it in errors.
pub fn parse_text<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, FileError> {
    toml::from_str(text).map_err(|e| FileError::parse(origin, e.to_string()))
}

/// `run_dir` created and made absolute; refused when it already holds anything.
pub fn prepare_run_dir(run_dir: &Path) -> Result<PathBuf, FileError> {
    std::fs::create_dir_all(run_dir).map_err(|e| FileError::write(run_dir, e))?;
    let mut entries = std::fs::read_dir(run_dir).map_err(|e| FileError::write(run_dir, e))?;
    if entries.next().is_some() {
        return Err(FileError::RunDirInUse {
            path: run_dir.to_path_buf(),
        });
    }
    std::path::absolute(run_dir).map_err(|e| FileError::write(run_dir, e))
}

/// A TOML table of `pairs`, for the job specs an experiment builds.
pub fn toml_table(pairs: Vec<(&str, toml::Value)>) -> toml::Value {
    toml::Value::Table(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// The job spec `table` describes, checked by the job-spec parser as any spec file is;
/// `origin (label)` names it in errors.
pub fn job_spec(table: toml::Value, origin: &str, label: &str) -> Result<JobSpec, JobSpecError> {
    let text = toml::to_string(&table).map_err(|e| JobSpecError {
        file: origin.to_string(),
        key: "experiment".into(),
        message: e.to_string(),
    })?;
    JobSpec::parse(&text, &format!("{origin} ({label})"))
}

/// Writes a run's outputs into `run_dir`: `results.json` (the scores), `details.json` (the
/// whole report) and the plot of the scores as `png`.
pub fn write_outputs<R: Serialize>(
    run_dir: &Path,
    results: &Results,
    details: &R,
    png: &str,
) -> Result<(), FileError> {
    let write_json = |name: &str, text: String| {
        let p = run_dir.join(name);
        std::fs::write(&p, text).map_err(|e| FileError::write(&p, e))
    };
    write_json(
        "results.json",
        serde_json::to_string_pretty(results).expect("results serialize"),
    )?;
    write_json(
        "details.json",
        serde_json::to_string_pretty(details).expect("report serializes"),
    )?;
    let png = run_dir.join(png);
    personal::plot::plot_scores(results, &png).map_err(|e| FileError::write(&png, e.message))
}

/// The text of `examples/<name>`.
#[cfg(test)]
pub fn example_text(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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

    #[test]
    fn a_run_dir_must_be_new_or_empty() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("a/b");
        assert!(prepare_run_dir(&fresh).unwrap().is_absolute());
        // Empty still: a second preparation (or an empty `--out`) is fine.
        prepare_run_dir(&fresh).unwrap();
        std::fs::write(fresh.join("results.json"), "{}").unwrap();
        let err = prepare_run_dir(&fresh).unwrap_err();
        assert!(
            matches!(&err, FileError::RunDirInUse { path } if path == &fresh),
            "{err}"
        );
        assert!(err.to_string().contains("--out"), "{err}");
    }
}
