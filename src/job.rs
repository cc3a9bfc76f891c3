//! The job spec (`JOB.toml`): what a user submits to the cluster's Control actor.
//!
//! A spec names the policy checkpoint, the judge (backend, votes), the method (`binary`, `opd`,
//! `combined`, `stepwise`) and its weights, the optimiser settings (batch size, learning rate,
//! clip range, KL coefficient, staleness bound), the environment (kind, parallelism, task set)
//! and a stop condition. Parsing is strict (`deny_unknown_fields`); every error names the key
//! path and the file. The training pipeline that runs a job lives elsewhere: this module only
//! parses and validates, and tells Control what the job needs to be placed.
//!
//! ```toml
//! kind = "rl"
//! name = "terminal-demo"
//! [policy]
//! checkpoint = "tests/fixtures/qwen3-tiny"
//! [judge]
//! backend = "scripted"       # model | openai | scripted
//! votes = 3
//! [method]
//! kind = "combined"          # binary | opd | combined | stepwise
//! w_binary = 1.0
//! w_opd = 1.0
//! [optim]
//! batch_size = 16
//! lr = 1e-6
//! clip = 0.2
//! clip_high = 0.28
//! kl = 0.01
//! staleness = 2
//! [env]
//! kind = "terminal"
//! parallelism = 4
//! tasks = "tasks/terminal.jsonl"
//! [stop]
//! max_steps = 100
//! ```

use std::path::Path;

use clawrl_actors::control::{JobNeeds, JobValidator};
use serde::{Deserialize, Serialize};

/// What kind of job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Online reinforcement learning from environment / user signals.
    Rl,
}

/// The policy to train.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// A Hugging Face checkpoint directory (or a path the trainer node can resolve).
    pub checkpoint: String,
}

/// Where judge votes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JudgeBackend {
    /// A local Burn model served by judge workers (`model`).
    Model,
    /// An OpenAI-compatible endpoint (`openai`).
    Openai,
    /// Scripted rules from the job config (`scripted`), for simulations and tests.
    Scripted,
}

/// The judge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeSpec {
    /// Its backend.
    pub backend: JudgeBackend,
    /// Independent votes per query (`m`).
    pub votes: u32,
    /// The endpoint URL (required for `openai`).
    pub endpoint: Option<String>,
    /// The model name or checkpoint (for `model` / `openai`).
    pub model: Option<String>,
}

/// The learning signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MethodKind {
    /// Binary RL from PRM votes.
    Binary,
    /// Hindsight-guided on-policy distillation.
    Opd,
    /// Binary plus OPD.
    Combined,
    /// Step-wise rewards for long episodes.
    Stepwise,
}

fn one() -> f64 {
    1.0
}

/// The method and its weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MethodSpec {
    /// Which method.
    pub kind: MethodKind,
    /// Weight of the binary term (default 1).
    #[serde(default = "one")]
    pub w_binary: f64,
    /// Weight of the OPD term (default 1).
    #[serde(default = "one")]
    pub w_opd: f64,
}

fn default_clip_high() -> f64 {
    0.28
}

/// Optimiser and sampling settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimSpec {
    /// Samples per optimizer step.
    pub batch_size: u32,
    /// Learning rate.
    pub lr: f64,
    /// PPO clip ε (lower side).
    pub clip: f64,
    /// PPO clip ε_high, the upper side (default 0.28, DESIGN §1).
    #[serde(default = "default_clip_high")]
    pub clip_high: f64,
    /// KL coefficient β (0 disables the reference model).
    pub kl: f64,
    /// Largest allowed policy-version lag of a sample.
    pub staleness: u32,
}

/// The environment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSpec {
    /// Environment kind (`terminal`, `swe`, `toolcall`, `gui`, `personal`).
    pub kind: String,
    /// Environment workers wanted.
    pub parallelism: u32,
    /// The task set (a file or a named set).
    pub tasks: String,
}

/// When the job ends (at least one bound).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopSpec {
    /// Optimizer steps.
    pub max_steps: Option<u64>,
    /// Training samples.
    pub max_samples: Option<u64>,
    /// Wall-clock hours.
    pub max_hours: Option<f64>,
}

/// A job spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The job kind.
    pub kind: JobKind,
    /// A display name (default: the file stem).
    pub name: Option<String>,
    /// The policy.
    pub policy: PolicySpec,
    /// The judge.
    pub judge: JudgeSpec,
    /// The method.
    pub method: MethodSpec,
    /// Optimiser settings.
    pub optim: OptimSpec,
    /// The environment.
    pub env: EnvSpec,
    /// The stop condition.
    pub stop: StopSpec,
}

/// A spec that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("job spec {file}: key `{key}`: {message}")]
pub struct JobSpecError {
    /// The file.
    pub file: String,
    /// The offending key (dotted path).
    pub key: String,
    /// What is wrong.
    pub message: String,
}

const ENV_KINDS: &[&str] = &["terminal", "swe", "toolcall", "gui", "personal"];

impl JobSpec {
    /// Parses and validates spec text read from `file`.
    pub fn parse(text: &str, file: &str) -> Result<Self, JobSpecError> {
        let de = toml::Deserializer::new(text);
        let spec: JobSpec = serde_path_to_error::deserialize(de).map_err(|e| JobSpecError {
            file: file.to_string(),
            key: e.path().to_string(),
            message: e.inner().message().to_string(),
        })?;
        spec.validate(file)?;
        Ok(spec)
    }

    /// Reads, parses and validates a spec file.
    pub fn load(path: &Path) -> Result<Self, JobSpecError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| JobSpecError {
            file: file.clone(),
            key: ".".into(),
            message: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, &file)
    }

    fn validate(&self, file: &str) -> Result<(), JobSpecError> {
        let bad = |key: &str, message: String| {
            Err(JobSpecError {
                file: file.to_string(),
                key: key.to_string(),
                message,
            })
        };
        if self.policy.checkpoint.trim().is_empty() {
            return bad("policy.checkpoint", "must not be empty".into());
        }
        if !(1..=64).contains(&self.judge.votes) {
            return bad(
                "judge.votes",
                format!("{} is not in 1..=64", self.judge.votes),
            );
        }
        if self.judge.backend == JudgeBackend::Openai && self.judge.endpoint.is_none() {
            return bad(
                "judge.endpoint",
                "required when judge.backend = \"openai\"".into(),
            );
        }
        for (key, w) in [
            ("method.w_binary", self.method.w_binary),
            ("method.w_opd", self.method.w_opd),
        ] {
            if !w.is_finite() || w < 0.0 {
                return bad(key, format!("{w} must be a finite number >= 0"));
            }
        }
        let o = &self.optim;
        if o.batch_size == 0 {
            return bad("optim.batch_size", "must be at least 1".into());
        }
        if !(o.lr.is_finite() && o.lr > 0.0 && o.lr < 1.0) {
            return bad("optim.lr", format!("{} must be in (0, 1)", o.lr));
        }
        if !(o.clip.is_finite() && o.clip > 0.0 && o.clip < 1.0) {
            return bad("optim.clip", format!("{} must be in (0, 1)", o.clip));
        }
        let h = o.clip_high;
        if !(h.is_finite() && h >= o.clip && h < 10.0) {
            return bad(
                "optim.clip_high",
                format!("{h} must be in [optim.clip, 10)"),
            );
        }
        if !(o.kl.is_finite() && o.kl >= 0.0) {
            return bad("optim.kl", format!("{} must be a finite number >= 0", o.kl));
        }
        if !ENV_KINDS.contains(&self.env.kind.as_str()) {
            return bad(
                "env.kind",
                format!("`{}` is not one of {}", self.env.kind, ENV_KINDS.join(", ")),
            );
        }
        if !(1..=4096).contains(&self.env.parallelism) {
            return bad(
                "env.parallelism",
                format!("{} is not in 1..=4096", self.env.parallelism),
            );
        }
        if self.env.tasks.trim().is_empty() {
            return bad("env.tasks", "must not be empty".into());
        }
        let s = &self.stop;
        if s.max_steps.is_none() && s.max_samples.is_none() && s.max_hours.is_none() {
            return bad(
                "stop",
                "set at least one of max_steps, max_samples, max_hours".into(),
            );
        }
        if s.max_steps == Some(0) {
            return bad("stop.max_steps", "must be at least 1".into());
        }
        if s.max_samples == Some(0) {
            return bad("stop.max_samples", "must be at least 1".into());
        }
        if let Some(h) = s.max_hours {
            if !(h.is_finite() && h > 0.0) {
                return bad("stop.max_hours", format!("{h} must be > 0"));
            }
        }
        Ok(())
    }

    /// What Control needs to place this job.
    pub fn needs(&self, file: &str) -> JobNeeds {
        let name = self.name.clone().unwrap_or_else(|| {
            Path::new(file)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "job".into())
        });
        JobNeeds {
            name,
            env_kind: self.env.kind.clone(),
            env_parallelism: self.env.parallelism,
        }
    }
}

/// The validator the Control actor uses: [`JobSpec::parse`].
pub struct SpecValidator;

impl JobValidator for SpecValidator {
    fn validate(&self, file: &str, text: &str) -> Result<JobNeeds, String> {
        JobSpec::parse(text, file)
            .map(|s| s.needs(file))
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const GOOD: &str = r#"
kind = "rl"
name = "demo"
[policy]
checkpoint = "tests/fixtures/qwen3-tiny"
[judge]
backend = "scripted"
votes = 3
[method]
kind = "combined"
[optim]
batch_size = 16
lr = 1e-6
clip = 0.2
clip_high = 0.28
kl = 0.01
staleness = 2
[env]
kind = "terminal"
parallelism = 4
tasks = "tasks/terminal.jsonl"
[stop]
max_steps = 100
"#;

    fn err(text: &str) -> String {
        JobSpec::parse(text, "jobs/x.toml").unwrap_err().to_string()
    }

    #[test]
    fn good_spec_parses_with_defaults() {
        let s = JobSpec::parse(GOOD, "x.toml").unwrap();
        assert_eq!(s.method.kind, MethodKind::Combined);
        assert_eq!(s.method.w_binary, 1.0);
        let n = s.needs("x.toml");
        assert_eq!(
            (n.name.as_str(), n.env_kind.as_str(), n.env_parallelism),
            ("demo", "terminal", 4)
        );
    }

    #[test]
    fn unknown_key_names_key_and_file() {
        let e = err(&GOOD.replace("lr = 1e-6", "lr = 1e-6\nlearning_rate = 3"));
        assert!(
            e.contains("jobs/x.toml") && e.contains("learning_rate"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_the_key_path() {
        let e = err(&GOOD.replace("batch_size = 16", "batch_size = \"sixteen\""));
        assert!(e.contains("optim.batch_size"), "{e}");
    }

    #[test]
    fn missing_field_names_the_key() {
        let e = err(&GOOD.replace("staleness = 2", ""));
        assert!(e.contains("staleness"), "{e}");
    }

    #[test]
    fn bad_values_name_the_key() {
        assert!(
            err(&GOOD.replace(r#"kind = "combined""#, r#"kind = "magic""#)).contains("method.kind")
        );
        assert!(err(&GOOD.replace("votes = 3", "votes = 0")).contains("judge.votes"));
        assert!(
            err(&GOOD.replace("parallelism = 4", "parallelism = 0")).contains("env.parallelism")
        );
        assert!(
            err(&GOOD.replace(r#"kind = "terminal""#, r#"kind = "moon""#)).contains("env.kind")
        );
        assert!(err(&GOOD.replace("max_steps = 100", "")).contains("`stop`"));
        assert!(
            err(&GOOD.replace(r#"backend = "scripted""#, r#"backend = "openai""#))
                .contains("judge.endpoint")
        );
    }
}
