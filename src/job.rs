//! The job spec (`JOB.toml`): what a user submits to the cluster's Control actor or runs with
//! `clawrl run`.
//!
//! A spec names the policy checkpoint (and how it samples), the judge (backend, votes, scripted
//! rules inline or from a file, prompt replacements, the OPD teacher), the method (`binary`,
//! `opd`, `combined`, `stepwise`) and its weights, the optimiser settings (batch size, learning
//! rate, clip range, KL coefficient, staleness bound), the environment (kind, parallelism, task
//! set, episode limits, the admission bound that keeps sessions from outrunning the trainer) and
//! a stop condition (trainer steps, turns, samples, hours). Parsing is
//! strict (`deny_unknown_fields`); every error names the key path and the file. Relative paths in
//! a spec (checkpoint, tasks, rules file) are resolved against the spec file's directory
//! ([`JobSpec::resolve`]). This module only parses and validates; `crate::pipeline` runs a job.
//!
//! ```toml
//! kind = "rl"
//! name = "terminal-demo"
//! seed = 7                   # optional
//! [policy]
//! checkpoint = "tests/fixtures/qwen3-tiny"
//! replicas = 1               # rollout workers (default 1)
//! temperature = 1.0          # sampling (defaults: 1.0, top_p 1.0, max_new_tokens 256)
//! [judge]
//! backend = "scripted"       # model | openai | scripted
//! votes = 3                  # evaluation votes m
//! hint_votes = 3             # OPD hint votes (default: votes)
//! teacher = "current_policy" # or "frozen_initial" (OPD teacher)
//! rules = [{ pattern = "(?i)thanks", score = 1 }, { pattern = "(?i)wrong", score = -1 }]
//! default_score = 0
//! hint = { pattern = "(?i)hint: (.*)" }
//! [method]
//! kind = "combined"          # binary | opd | combined | stepwise
//! w_binary = 1.0
//! w_opd = 1.0
//! opd_loss = "advantage"     # or "topk": reverse KL over the teacher's top-k (opd, combined)
//! # topk = 50                # opd_loss = "topk": the teacher's tokens per position
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
//! max_backlog = 32           # default batch_size × min(staleness + 1, 2); "off": none
//! [stop]
//! max_steps = 100
//! ```

use std::path::{Path, PathBuf};

use clawrl_actors::control::{JobNeeds, JobValidator};
use serde::{Deserialize, Serialize};

use crate::device::Device;
use crate::env::EnvKind;
use crate::judge::prompt::PromptOverrides;
use crate::judge::scripted::{HintRule, ScoreRule, ScriptedConfig};
use crate::judge::Teacher;
use crate::rl::Aggregation;
use crate::train::OpdLossKind;

/// What kind of job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Online reinforcement learning from environment / user signals.
    Rl,
    /// Live learning from a personal agent's conversations: the OpenAI-compatible gateway
    /// (`[gateway]`) serves the policy, and its completed main turns are judged and trained on
    /// (no `[env]`; `crate::pipeline::gateway_job`).
    Personal,
}

const DEFAULT_REPLICAS: u32 = 1;
const DEFAULT_TEMPERATURE: f32 = 1.0;
const DEFAULT_TOP_P: f32 = 1.0;
const DEFAULT_MAX_NEW_TOKENS: u32 = 256;
fn default_prefix_cache_mib() -> u32 {
    (crate::model::engine::DEFAULT_PREFIX_CACHE_BYTES >> 20) as u32
}

fn default_max_batch() -> u32 {
    16
}
fn default_max_context() -> u32 {
    4096
}

/// The policy to train and how it samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// A Hugging Face checkpoint directory.
    pub checkpoint: String,
    /// Rollout workers (policy replicas), each with its own engine (`rl` jobs; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// Sampling temperature (`rl` jobs; default 1.0, which makes the rollout log-probs the
    /// policy's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus mass (`rl` jobs; default 1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Most tokens of one response (`rl` jobs; default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u32>,
    /// Most sequences one replica decodes together.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// Most positions (prompt + response) of one sequence.
    #[serde(default = "default_max_context")]
    pub max_context: u32,
    /// MiB of prompt keys and values each engine keeps for later prompts with the same prefix
    /// (a task's prompt across its group, an agent's system prompt across turns); 0: off.
    #[serde(default = "default_prefix_cache_mib")]
    pub prefix_cache_mib: u32,
    /// Where the learner and the served policy compute: `cpu` (the default) or `cuda:N`
    /// (a build with the `cuda` feature). `personal` jobs only; the OPD teacher and a local
    /// judge model stay on the CPU.
    #[serde(default)]
    pub device: Device,
    /// A low-rank adapter to train instead of the whole policy: `lora = { r, alpha, targets }`
    /// (see [`crate::model::LoraConfig`]). The job starts a fresh adapter (seeded by `seed`)
    /// over the frozen checkpoint; only the adapter trains, each weight version is the adapter
    /// alone, and the serving side holds the base once and attaches each version's adapter
    /// (rollout hosts on other nodes fetch the base once over the bulk plane).
    #[serde(default)]
    pub lora: Option<crate::model::LoraConfig>,
    /// One adapter per agent (`personal` jobs with `lora`): `agents = ["alice", "bob"]` trains
    /// one adapter of `lora`'s shape for each name over the one frozen checkpoint. The gateway
    /// serves each as its own model id (the checkpoint's own id is not served), and each has
    /// its own sessions, judge results, trainer, versions, checkpoints and records under
    /// `<run>/agents/<name>`; a turn trains only the adapter its request named. Empty (the
    /// default): the job trains one policy, served under the checkpoint's id.
    #[serde(default)]
    pub agents: Vec<String>,
}

impl PolicySpec {
    /// Rollout workers, the default filled in.
    pub fn replicas(&self) -> u32 {
        self.replicas.unwrap_or(DEFAULT_REPLICAS)
    }
    /// Sampling temperature, the default filled in.
    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(DEFAULT_TEMPERATURE)
    }
    /// Nucleus mass, the default filled in.
    pub fn top_p(&self) -> f32 {
        self.top_p.unwrap_or(DEFAULT_TOP_P)
    }
    /// Most tokens of one response, the default filled in.
    pub fn max_new_tokens(&self) -> u32 {
        self.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS)
    }
}

/// Most agents one job trains adapters for.
pub const MAX_AGENTS: usize = 64;

/// Whether `name` can name an agent: it is a model id, a directory name and a record-file
/// prefix, so 1 to 64 ASCII letters, digits, `-`, `_` or `.`, not starting with `.`.
pub fn valid_agent_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
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

fn default_judge_temperature() -> f32 {
    0.6
}
fn default_judge_timeout() -> f64 {
    120.0
}
fn default_judge_concurrency() -> u32 {
    64
}
fn default_judge_max_tokens() -> u32 {
    4096
}
fn default_judge_hint_max_tokens() -> u32 {
    8192
}

/// The judge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeSpec {
    /// Its backend.
    pub backend: JudgeBackend,
    /// Independent evaluation votes per query (`m`).
    pub votes: u32,
    /// Independent hint votes per turn for OPD (default: `votes`).
    pub hint_votes: Option<u32>,
    /// Sampling temperature of every vote (default 0.6).
    #[serde(default = "default_judge_temperature")]
    pub temperature: f32,
    /// Most tokens of an evaluation vote's answer (default 4096: a thinking judge cut off is a
    /// failed vote).
    #[serde(default = "default_judge_max_tokens")]
    pub max_tokens: u32,
    /// Most tokens of a hint vote's answer (default 8192).
    #[serde(default = "default_judge_hint_max_tokens")]
    pub hint_max_tokens: u32,
    /// Seconds one turn's judging may take (every vote; default 120).
    #[serde(default = "default_judge_timeout")]
    pub timeout_s: f64,
    /// Turns judged at once (default 64).
    #[serde(default = "default_judge_concurrency")]
    pub concurrency: u32,
    /// How step-judge votes are aggregated (`majority` or `mean`; default `mean`).
    pub step_aggregation: Option<Aggregation>,
    /// The endpoint URL (required for `openai`).
    pub endpoint: Option<String>,
    /// The model name (`openai`).
    pub model: Option<String>,
    /// The environment variable holding the endpoint's API key (`openai`).
    pub api_key_env: Option<String>,
    /// A judge checkpoint directory (`model`; default: the frozen initial policy).
    pub checkpoint: Option<String>,
    /// The OPD teacher (default: the current policy).
    #[serde(default)]
    pub teacher: Teacher,
    /// Scripted scoring rules, first match wins (`scripted`).
    pub rules: Option<Vec<ScoreRule>>,
    /// Scripted: the score when no rule matches.
    pub default_score: Option<i8>,
    /// Scripted: the hint rule.
    pub hint: Option<HintRule>,
    /// Scripted: probability that a vote is flipped.
    pub noise_rate: Option<f64>,
    /// Scripted: the seed of the noise.
    pub noise_seed: Option<u64>,
    /// Scripted: a TOML file holding the whole scripted config (`rules`, `default_score`,
    /// `hint`, `noise_rate`, `seed`) instead of the inline keys.
    pub rules_file: Option<String>,
    /// Prompt template replacements.
    #[serde(default)]
    pub prompts: PromptOverrides,
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

impl MethodKind {
    /// Whether the method needs hint votes (OPD term).
    pub fn uses_hints(self) -> bool {
        matches!(self, MethodKind::Opd | MethodKind::Combined)
    }

    /// Whether the method needs evaluation votes.
    pub fn uses_eval(self) -> bool {
        !matches!(self, MethodKind::Opd)
    }

    /// The name as written in specs.
    pub fn name(self) -> &'static str {
        match self {
            MethodKind::Binary => "binary",
            MethodKind::Opd => "opd",
            MethodKind::Combined => "combined",
            MethodKind::Stepwise => "stepwise",
        }
    }
}

fn one() -> f64 {
    1.0
}

/// The teacher's tokens per position of the top-k OPD loss when `method.topk` is not given.
pub const DEFAULT_TOPK: u32 = 50;

impl MethodSpec {
    /// The teacher's `k` when the OPD term takes the top-k loss, else `None`.
    pub fn topk(&self) -> Option<usize> {
        (self.kind.uses_hints() && self.opd_loss == OpdLossKind::Topk)
            .then(|| self.topk.unwrap_or(DEFAULT_TOPK) as usize)
    }

    /// Checks `method.topk` against the policy's vocabulary (known once the checkpoint is
    /// loaded); `file` names the spec in the error.
    pub fn check_topk(&self, vocab: usize, file: &str) -> Result<(), JobSpecError> {
        match self.topk() {
            Some(k) if k > vocab => Err(JobSpecError {
                file: file.to_string(),
                key: "method.topk".into(),
                message: format!("{k} is more than the policy's vocabulary of {vocab} tokens"),
            }),
            _ => Ok(()),
        }
    }
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
    /// The loss of the OPD term (`opd` and `combined`): `"advantage"` (the default; the
    /// teacher-minus-old log-prob in each token's advantage) or `"topk"` (the reverse KL over the
    /// teacher's top-k tokens plus a tail bin).
    #[serde(default)]
    pub opd_loss: OpdLossKind,
    /// `opd_loss = "topk"`: the teacher's tokens per position (default [`DEFAULT_TOPK`];
    /// `1 ≤ topk ≤` the policy's vocabulary, checked when the checkpoint is loaded).
    pub topk: Option<u32>,
    /// Step-wise: the reward formula (`terminal`, `gui`, `swe`, `tool_call`, `general`; default
    /// from the environment kind).
    pub step_reward: Option<crate::rl::EpisodeKind>,
    /// Step-wise: the weight of each step's process score: a step's reward is the
    /// `step_reward` formula with `w_process · prm` in place of `prm` (default 1; 0 trains on
    /// the outcome alone while the judge still votes, so the votes stay in the records).
    pub w_process: Option<f64>,
}

impl MethodSpec {
    /// The weight of the process score ([`MethodSpec::w_process`], default 1).
    pub fn process_weight(&self) -> f64 {
        self.w_process.unwrap_or(1.0)
    }
}

fn default_clip_high() -> f64 {
    0.28
}

fn default_true() -> bool {
    true
}

/// Checkpoints a job keeps when `optim.keep_checkpoints` is not given.
pub const DEFAULT_KEEP_CHECKPOINTS: u32 = 3;

/// What the trainer does with samples over the staleness bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum StalenessPolicy {
    /// Drop and count them.
    #[default]
    Drop,
    /// Train them with truncated importance weights.
    Importance,
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
    /// PPO clip ε_high, the upper side (default 0.28, docs/design.md §1).
    #[serde(default = "default_clip_high")]
    pub clip_high: f64,
    /// KL coefficient β (0 disables the reference model).
    pub kl: f64,
    /// Largest allowed policy-version lag of a sample.
    pub staleness: u32,
    /// Over the bound: `drop` (default) or `importance` (truncated importance weights).
    #[serde(default)]
    pub staleness_mode: StalenessPolicy,
    /// The importance-weight cap (`importance` mode; default 2).
    pub importance_cap: Option<f32>,
    /// Checkpoint every this many steps (0 or absent: only at the end).
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept under `<out>/checkpoints`, the newest (default
    /// [`DEFAULT_KEEP_CHECKPOINTS`]; 0 keeps every one).
    pub keep_checkpoints: Option<u32>,
    /// Samples of a batch that share a token prefix run it through the model once (default
    /// `true`; the loss and gradients are those of the unpacked samples).
    #[serde(default = "default_true")]
    pub pack_prefixes: bool,
    /// A step keeps only each decoder layer's input and recomputes the layer's activations in
    /// the backward pass (default `false`): the same gradients for one more forward pass, and
    /// a fraction of the memory on long samples (an agent's 12k-token prompts on a real model).
    #[serde(default)]
    pub recompute_activations: bool,
}

/// The `[env]` section of a job spec: the environment its sessions run in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    /// The environment kind.
    pub kind: EnvKind,
    /// Sessions run at once.
    pub parallelism: u32,
    /// The task set (a file).
    pub tasks: String,
    /// A per-episode step limit below the environment's own.
    pub max_steps: Option<u32>,
    /// Seconds one episode may take (default 600).
    pub episode_timeout_s: Option<f64>,
    /// Admission control: the most samples on their way to the trainer (queued there, being
    /// judged or built, or in running episodes) before new turns and sessions wait; `"off"`:
    /// sessions run freely. Default: `optim.batch_size × min(optim.staleness + 1, 2)`
    /// ([`JobSpec::max_backlog`]).
    pub max_backlog: Option<BacklogBound>,
    /// Step-wise jobs: episodes of one task run as a GRPO group, whose advantages are
    /// z-scored together per step index ([`JobSpec::group_size`]; default 8).
    pub group_size: Option<u32>,
}

/// `env.max_backlog`: a number of samples, or `"off"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BacklogBound {
    /// At most this many samples on their way to the trainer.
    Samples(u64),
    /// No admission control.
    Off,
}

impl Serialize for BacklogBound {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            BacklogBound::Samples(n) => s.serialize_u64(*n),
            BacklogBound::Off => s.serialize_str("off"),
        }
    }
}

impl<'de> Deserialize<'de> for BacklogBound {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = BacklogBound;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number of samples or \"off\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<BacklogBound, E> {
                Ok(BacklogBound::Samples(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<BacklogBound, E> {
                u64::try_from(v).map(BacklogBound::Samples).map_err(|_| {
                    E::invalid_value(serde::de::Unexpected::Signed(v), &"a number >= 0")
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BacklogBound, E> {
                if v == "off" {
                    Ok(BacklogBound::Off)
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Str(v), &self))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// When the job ends (at least one bound).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopSpec {
    /// Trainer optimizer steps.
    pub max_steps: Option<u64>,
    /// Turns produced by the environment sessions.
    pub max_turns: Option<u64>,
    /// Training samples handed to the trainer.
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
    /// Seed of episodes and sampling (default 0).
    #[serde(default)]
    pub seed: u64,
    /// The policy.
    pub policy: PolicySpec,
    /// The judge.
    pub judge: JudgeSpec,
    /// The method.
    pub method: MethodSpec,
    /// Optimiser settings.
    pub optim: OptimSpec,
    /// The environment (required for `rl`; absent for `personal`).
    #[serde(default)]
    pub env: EnvSection,
    /// The gateway of a `personal` job (`crate::gateway::GatewayConfig`'s keys; default: its
    /// defaults). Only for `personal`.
    #[serde(default, skip_serializing)]
    pub gateway: Option<crate::gateway::GatewayConfig>,
    /// The stop condition.
    pub stop: StopSpec,
    /// The directory relative paths are resolved against (the spec file's).
    #[serde(skip)]
    pub base_dir: PathBuf,
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

/// The environment kind Control places a `personal` job on (the gateway).
pub const PERSONAL_ENV_KIND: &str = "gateway";

/// Episodes per GRPO group of a step-wise job when `env.group_size` is not given.
pub const DEFAULT_GROUP_SIZE: u32 = 8;

impl JobSpec {
    /// Parses and validates spec text read from `file`.
    pub fn parse(text: &str, file: &str) -> Result<Self, JobSpecError> {
        let de = toml::Deserializer::new(text);
        let mut spec: JobSpec = serde_path_to_error::deserialize(de).map_err(|e| JobSpecError {
            file: file.to_string(),
            key: e.path().to_string(),
            message: e.inner().message().to_string(),
        })?;
        spec.base_dir = Path::new(file)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
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

    /// A path from the spec, resolved against the spec file's directory when relative.
    pub fn resolve(&self, path: &str) -> PathBuf {
        let p = Path::new(path);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    /// The display name: `name`, else the file stem.
    pub fn display_name(&self, file: &str) -> String {
        self.name.clone().unwrap_or_else(|| {
            Path::new(file)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "job".into())
        })
    }

    /// The scripted judge config: from `rules_file` when given, else from the inline keys.
    pub fn scripted_config(&self, file: &str) -> Result<ScriptedConfig, JobSpecError> {
        let j = &self.judge;
        let bad = |key: &str, message: String| JobSpecError {
            file: file.to_string(),
            key: key.to_string(),
            message,
        };
        if let Some(f) = &j.rules_file {
            let path = self.resolve(f);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                bad(
                    "judge.rules_file",
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            let de = toml::Deserializer::new(&text);
            return serde_path_to_error::deserialize(de).map_err(|e| {
                bad(
                    "judge.rules_file",
                    format!(
                        "{}: key `{}`: {}",
                        path.display(),
                        e.path(),
                        e.inner().message()
                    ),
                )
            });
        }
        Ok(ScriptedConfig {
            rules: j.rules.clone().unwrap_or_default(),
            default_score: j.default_score,
            hint: j.hint.clone(),
            noise_rate: j.noise_rate.unwrap_or(0.0),
            seed: j.noise_seed.unwrap_or(self.seed),
        })
    }

    fn validate(&self, file: &str) -> Result<(), JobSpecError> {
        let bad = |key: &str, message: String| {
            Err(JobSpecError {
                file: file.to_string(),
                key: key.to_string(),
                message,
            })
        };
        let p = &self.policy;
        if p.checkpoint.trim().is_empty() {
            return bad("policy.checkpoint", "must not be empty".into());
        }
        if self.kind == JobKind::Personal {
            // A personal job generates only for its gateway's requests, each of which sets its
            // own sampling, on the gateway's one engine: these keys would change nothing.
            for (key, set) in [
                ("policy.replicas", p.replicas.is_some()),
                ("policy.temperature", p.temperature.is_some()),
                ("policy.top_p", p.top_p.is_some()),
                ("policy.max_new_tokens", p.max_new_tokens.is_some()),
            ] {
                if set {
                    return bad(
                        key,
                        "not used by a personal job: its gateway's requests set their own \
                         sampling (`max_tokens` defaults to `gateway.default_max_tokens`) and \
                         its one engine serves them all"
                            .into(),
                    );
                }
            }
        }
        if !(1..=64).contains(&p.replicas()) {
            return bad(
                "policy.replicas",
                format!("{} is not in 1..=64", p.replicas()),
            );
        }
        if !(p.temperature().is_finite() && p.temperature() > 0.0) {
            return bad(
                "policy.temperature",
                format!("{} must be > 0", p.temperature()),
            );
        }
        if !(p.top_p() > 0.0 && p.top_p() <= 1.0) {
            return bad("policy.top_p", format!("{} must be in (0, 1]", p.top_p()));
        }
        if p.max_new_tokens() == 0 {
            return bad("policy.max_new_tokens", "must be at least 1".into());
        }
        if p.max_batch == 0 {
            return bad("policy.max_batch", "must be at least 1".into());
        }
        if p.max_context < 2 {
            return bad("policy.max_context", "must be at least 2".into());
        }
        if p.device != Device::Cpu && self.kind != JobKind::Personal {
            return bad(
                "policy.device",
                format!(
                    "`{}`: only `personal` jobs run off the CPU so far; `rl` jobs compute on `cpu`",
                    p.device
                ),
            );
        }
        if !p.agents.is_empty() {
            if self.kind != JobKind::Personal || p.lora.is_none() {
                return bad(
                    "policy.agents",
                    "one adapter per agent needs a `personal` job with `policy.lora`".into(),
                );
            }
            if p.agents.len() > MAX_AGENTS {
                return bad(
                    "policy.agents",
                    format!("{} agents; at most {MAX_AGENTS}", p.agents.len()),
                );
            }
            let mut seen = std::collections::HashSet::new();
            for a in &p.agents {
                if !valid_agent_name(a) {
                    return bad(
                        "policy.agents",
                        format!(
                            "{a:?} is not an agent name (1 to 64 ASCII letters, digits, `-`, \
                             `_` or `.`, not starting with `.`)"
                        ),
                    );
                }
                if !seen.insert(a.as_str()) {
                    return bad("policy.agents", format!("{a:?} is named twice"));
                }
            }
        }
        let j = &self.judge;
        if !(1..=64).contains(&j.votes) {
            return bad("judge.votes", format!("{} is not in 1..=64", j.votes));
        }
        if let Some(h) = j.hint_votes {
            if !(1..=64).contains(&h) {
                return bad("judge.hint_votes", format!("{h} is not in 1..=64"));
            }
        }
        if !(j.temperature.is_finite() && j.temperature >= 0.0) {
            return bad(
                "judge.temperature",
                format!("{} must be >= 0", j.temperature),
            );
        }
        if j.hint_max_tokens == 0 {
            return bad("judge.hint_max_tokens", "must be at least 1".into());
        }
        if j.max_tokens == 0 {
            return bad("judge.max_tokens", "must be at least 1".into());
        }
        if !(j.timeout_s.is_finite() && j.timeout_s > 0.0) {
            return bad("judge.timeout_s", format!("{} must be > 0", j.timeout_s));
        }
        if j.concurrency == 0 {
            return bad("judge.concurrency", "must be at least 1".into());
        }
        let scripted_keys = j.rules.is_some()
            || j.default_score.is_some()
            || j.hint.is_some()
            || j.noise_rate.is_some()
            || j.noise_seed.is_some()
            || j.rules_file.is_some();
        match j.backend {
            JudgeBackend::Openai => {
                if j.endpoint.is_none() {
                    return bad(
                        "judge.endpoint",
                        "required when judge.backend = \"openai\"".into(),
                    );
                }
                if j.model.is_none() {
                    return bad(
                        "judge.model",
                        "required when judge.backend = \"openai\"".into(),
                    );
                }
            }
            JudgeBackend::Scripted => {
                if j.rules_file.is_some()
                    && (j.rules.is_some()
                        || j.default_score.is_some()
                        || j.hint.is_some()
                        || j.noise_rate.is_some()
                        || j.noise_seed.is_some())
                {
                    return bad(
                        "judge.rules_file",
                        "give the scripted rules either inline or in rules_file, not both".into(),
                    );
                }
                let cfg = self.scripted_config(file)?;
                if let Err(e) = crate::judge::scripted::ScriptedBackend::new(&cfg) {
                    return bad("judge.rules", e.to_string());
                }
            }
            JudgeBackend::Model => {}
        }
        if j.backend != JudgeBackend::Scripted && scripted_keys {
            return bad(
                "judge.rules",
                "scripted rules are only read when judge.backend = \"scripted\"".into(),
            );
        }
        for (key, w) in [
            ("method.w_binary", self.method.w_binary),
            ("method.w_opd", self.method.w_opd),
            ("method.w_process", self.method.process_weight()),
        ] {
            if !w.is_finite() || w < 0.0 {
                return bad(key, format!("{w} must be a finite number >= 0"));
            }
        }
        if self.method.w_process.is_some() && self.method.kind != MethodKind::Stepwise {
            return bad(
                "method.w_process",
                format!(
                    "applies to method.kind = \"stepwise\" only (the weight of a step's process \
                     score); method `{}` has no step rewards",
                    self.method.kind.name()
                ),
            );
        }
        if self.method.kind.uses_hints() && self.policy.temperature() != 1.0 {
            return bad(
                "policy.temperature",
                format!(
                    "{} with method `{}`: the OPD term uses the rollout log-probs as log π_old, \
                     which are the policy's own only at temperature 1",
                    self.policy.temperature(),
                    self.method.kind.name()
                ),
            );
        }
        let m = &self.method;
        if m.opd_loss == OpdLossKind::Topk && !m.kind.uses_hints() {
            return bad(
                "method.opd_loss",
                format!(
                    "\"topk\" with method `{}`, which has no OPD term (opd or combined have one)",
                    m.kind.name()
                ),
            );
        }
        match m.topk {
            Some(_) if m.opd_loss != OpdLossKind::Topk => {
                return bad(
                    "method.topk",
                    "only read when method.opd_loss = \"topk\"".into(),
                )
            }
            Some(0) => return bad("method.topk", "must be at least 1".into()),
            _ => {}
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
        if let Some(c) = o.importance_cap {
            if !(c.is_finite() && c > 0.0) {
                return bad("optim.importance_cap", format!("{c} must be > 0"));
            }
        }
        match self.kind {
            JobKind::Rl => {
                if self.gateway.is_some() {
                    return bad("gateway", "only read when kind = \"personal\"".into());
                }
                self.validate_env(file)?;
            }
            JobKind::Personal => {
                if self.env != EnvSection::default() {
                    return bad(
                        "env",
                        "a personal job has no environment: its turns come from the gateway".into(),
                    );
                }
                if self.method.kind == MethodKind::Stepwise {
                    return bad(
                        "method.kind",
                        "stepwise needs episodes with outcomes; a personal job takes binary, \
                         opd or combined"
                            .into(),
                    );
                }
                if self.stop.max_turns.is_some() {
                    return bad(
                        "stop.max_turns",
                        "not used by a personal job (use max_steps, max_samples or max_hours)"
                            .into(),
                    );
                }
                if let Some(g) = &self.gateway {
                    if let Err(e) = g.validate() {
                        return bad("gateway", e.to_string());
                    }
                    if g.version != 0 {
                        return bad(
                            "gateway.version",
                            "set by the trainer in a personal job (it serves the trainer's \
                             versions, from 0 or the resumed checkpoint's)"
                                .into(),
                        );
                    }
                    if !g.adapters.is_empty() {
                        return bad(
                            "gateway.adapters",
                            "a personal job serves only what it trains (one adapter per agent \
                             with `policy.agents`); serve fixed adapters beside a checkpoint \
                             with `clawrl serve`"
                                .into(),
                        );
                    }
                    if g.model_name.is_some() && !p.agents.is_empty() {
                        return bad(
                            "gateway.model_name",
                            "with `policy.agents` the gateway serves the agents' names as its \
                             model ids, and not the checkpoint"
                                .into(),
                        );
                    }
                    for (i, k) in g.scoped_keys.iter().enumerate() {
                        let served = |m: &String| {
                            if p.agents.is_empty() {
                                g.model_name.as_ref().is_none_or(|n| n == m)
                            } else {
                                p.agents.contains(m)
                            }
                        };
                        if let Some(m) = k.models.iter().find(|m| !served(m)) {
                            return bad(
                                "gateway.scoped_keys",
                                format!("entry {i}: {m:?} is not a model id this job serves"),
                            );
                        }
                    }
                }
            }
        }
        let s = &self.stop;
        if s.max_steps.is_none()
            && s.max_turns.is_none()
            && s.max_samples.is_none()
            && s.max_hours.is_none()
        {
            return bad(
                "stop",
                "set at least one of max_steps, max_turns, max_samples, max_hours".into(),
            );
        }
        for (key, v) in [
            ("stop.max_steps", s.max_steps),
            ("stop.max_turns", s.max_turns),
            ("stop.max_samples", s.max_samples),
        ] {
            if v == Some(0) {
                return bad(key, "must be at least 1".into());
            }
        }
        if let Some(h) = s.max_hours {
            if !(h.is_finite() && h > 0.0) {
                return bad("stop.max_hours", format!("{h} must be > 0"));
            }
        }
        Ok(())
    }

    fn validate_env(&self, file: &str) -> Result<(), JobSpecError> {
        let bad = |key: &str, message: String| {
            Err(JobSpecError {
                file: file.to_string(),
                key: key.to_string(),
                message,
            })
        };
        if self.env == EnvSection::default() {
            return bad("env", "required when kind = \"rl\"".into());
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
        if self.env.max_steps == Some(0) {
            return bad("env.max_steps", "must be at least 1".into());
        }
        if let Some(t) = self.env.episode_timeout_s {
            if !(t.is_finite() && t > 0.0) {
                return bad("env.episode_timeout_s", format!("{t} must be > 0"));
            }
        }
        if let Some(n) = self.env.group_size {
            if self.method.kind != MethodKind::Stepwise {
                return bad(
                    "env.group_size",
                    format!(
                        "applies to method.kind = \"stepwise\" only (GRPO groups of one task); \
                         method `{}` builds each episode alone",
                        self.method.kind.name()
                    ),
                );
            }
            if !(1..=1024).contains(&n) {
                return bad("env.group_size", format!("{n} is not in 1..=1024"));
            }
        }
        if let Some(BacklogBound::Samples(n)) = self.env.max_backlog {
            let b = self.optim.batch_size as u64;
            if n < b {
                return bad(
                    "env.max_backlog",
                    format!(
                        "{n} is below optim.batch_size ({b}): the trainer could never form a \
                         batch from the work admitted (use \"off\" for no admission control)"
                    ),
                );
            }
        }
        Ok(())
    }

    /// The admission bound of an `rl` job: `env.max_backlog`, by default
    /// `optim.batch_size × min(optim.staleness + 1, 2)` samples (the batch being trained and
    /// the next one; one batch when no lag is allowed); `None` when it is `"off"`.
    ///
    /// Why not the whole `batch_size × (staleness + 1)` the staleness bound could use in
    /// principle: an episode's early turns age while it is held between turns, and replicas
    /// install a version a moment after it is published, so a backlog at that bound still
    /// loses samples (measured on the pipeline bench, batch 16, staleness 4: 20% of samples
    /// dropped stale at 80, 10% at 64, 3% at 48, 2% at 32, with the trainer as busy at 32).
    pub fn max_backlog(&self) -> Option<u64> {
        match self.env.max_backlog {
            Some(BacklogBound::Off) => None,
            Some(BacklogBound::Samples(n)) => Some(n),
            None => Some(
                (self.optim.batch_size as u64)
                    .saturating_mul((self.optim.staleness as u64 + 1).min(2)),
            ),
        }
    }

    /// The GRPO group size of a step-wise job (`env.group_size`, default
    /// [`DEFAULT_GROUP_SIZE`]); `None` for per-turn methods, which build each episode alone.
    pub fn group_size(&self) -> Option<usize> {
        (self.method.kind == MethodKind::Stepwise)
            .then(|| self.env.group_size.unwrap_or(DEFAULT_GROUP_SIZE) as usize)
    }

    /// What Control needs to place this job.
    pub fn needs(&self, file: &str) -> JobNeeds {
        match self.kind {
            JobKind::Rl => JobNeeds {
                name: self.display_name(file),
                env_kind: self.env.kind.name().into(),
                env_parallelism: self.env.parallelism,
            },
            // The gateway stands for the environment: one member of kind `gateway`.
            JobKind::Personal => JobNeeds {
                name: self.display_name(file),
                env_kind: PERSONAL_ENV_KIND.into(),
                env_parallelism: 1,
            },
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
    fn group_size_defaults_to_eight_for_stepwise_and_is_refused_elsewhere() {
        let stepwise = GOOD.replace(r#"kind = "combined""#, r#"kind = "stepwise""#);
        let s = JobSpec::parse(&stepwise, "x.toml").unwrap();
        assert_eq!(s.group_size(), Some(DEFAULT_GROUP_SIZE as usize));
        let with = |text: &str, v: &str| {
            text.replace(
                "parallelism = 4",
                &format!("parallelism = 4\ngroup_size = {v}"),
            )
        };
        let s = JobSpec::parse(&with(&stepwise, "3"), "x.toml").unwrap();
        assert_eq!(s.group_size(), Some(3));
        assert_eq!(JobSpec::parse(GOOD, "x.toml").unwrap().group_size(), None);
        let e = err(&with(GOOD, "3"));
        assert!(
            e.contains("env.group_size") && e.contains("stepwise"),
            "{e}"
        );
        let e = err(&with(&stepwise, "0"));
        assert!(
            e.contains("env.group_size") && e.contains("1..=1024"),
            "{e}"
        );
        // The old key is gone, and says so.
        let e = err(&stepwise.replace("[method]", "[method]\ngroup_episodes = 4"));
        assert!(e.contains("group_episodes"), "{e}");
    }

    #[test]
    fn process_weight_is_stepwise_only_and_not_negative() {
        let stepwise = GOOD.replace(r#"kind = "combined""#, r#"kind = "stepwise""#);
        let with =
            |text: &str, v: &str| text.replace("[method]", &format!("[method]\nw_process = {v}"));
        assert_eq!(
            JobSpec::parse(&stepwise, "x.toml")
                .unwrap()
                .method
                .process_weight(),
            1.0
        );
        let s = JobSpec::parse(&with(&stepwise, "0.0"), "x.toml").unwrap();
        assert_eq!(s.method.process_weight(), 0.0);
        let e = err(&with(&stepwise, "-1.0"));
        assert!(e.contains("method.w_process") && e.contains(">= 0"), "{e}");
        let e = err(&with(GOOD, "0.5"));
        assert!(
            e.contains("method.w_process") && e.contains("stepwise"),
            "{e}"
        );
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
    fn opd_loss_and_topk_are_checked() {
        let s = JobSpec::parse(GOOD, "x.toml").unwrap();
        assert_eq!(s.method.opd_loss, OpdLossKind::Advantage);
        assert_eq!(s.method.topk(), None);
        let topk = |extra: &str| {
            GOOD.replace(
                r#"kind = "combined""#,
                &format!("kind = \"combined\"\nopd_loss = \"topk\"\n{extra}"),
            )
        };
        let s = JobSpec::parse(&topk(""), "x.toml").unwrap();
        assert_eq!(s.method.topk(), Some(50));
        let s = JobSpec::parse(&topk("topk = 7"), "x.toml").unwrap();
        assert_eq!(s.method.topk(), Some(7));
        assert!(s.method.check_topk(7, "x.toml").is_ok());
        let e = s.method.check_topk(6, "x.toml").unwrap_err().to_string();
        assert!(
            e.contains("method.topk") && e.contains("vocabulary of 6"),
            "{e}"
        );
        let e = err(&topk("topk = 0"));
        assert!(e.contains("method.topk") && e.contains("at least 1"), "{e}");
        let e = err(&topk("topk = -3"));
        assert!(e.contains("method.topk"), "{e}");
        // topk without the top-k loss, the loss without an OPD term, an unknown loss.
        let e = err(&GOOD.replace(r#"kind = "combined""#, "kind = \"combined\"\ntopk = 5"));
        assert!(e.contains("method.topk") && e.contains("only read"), "{e}");
        let e = err(&topk("").replace(r#"kind = "combined""#, r#"kind = "binary""#));
        assert!(e.contains("method.opd_loss") && e.contains("binary"), "{e}");
        let e = err(&GOOD.replace(
            r#"kind = "combined""#,
            "kind = \"combined\"\nopd_loss = \"sdpo\"",
        ));
        assert!(e.contains("method.opd_loss"), "{e}");
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
        // Only kinds an environment can be built from: not the job kind `personal`, nor an
        // alias.
        for bad in ["moon", "personal", "toolcall"] {
            let e = err(&GOOD.replace(r#"kind = "terminal""#, &format!("kind = {bad:?}")));
            assert!(
                e.contains("env.kind") && e.contains(&format!("`{bad}`")),
                "{e}"
            );
        }
        assert!(err(&GOOD.replace("max_steps = 100", "")).contains("`stop`"));
        let lora = |l: &str| {
            err(&GOOD.replace(
                "checkpoint = \"tests/fixtures/qwen3-tiny\"",
                &format!("checkpoint = \"tests/fixtures/qwen3-tiny\"\nlora = {l}"),
            ))
        };
        let e = lora("{ r = 0, alpha = 8, targets = [\"q_proj\"] }");
        assert!(e.contains("lora.r"), "{e}");
        let e = lora("{ r = 4, alpha = 8, targets = [\"x_proj\"] }");
        assert!(e.contains("lora.targets") && e.contains("x_proj"), "{e}");
        let e = lora("{ r = 4, alpha = 8, targets = [\"q_proj\"], dropout = 0.1 }");
        assert!(e.contains("dropout"), "{e}");
        let spec = JobSpec::parse(
            &GOOD.replace(
                "checkpoint = \"tests/fixtures/qwen3-tiny\"",
                "checkpoint = \"tests/fixtures/qwen3-tiny\"\nlora = { r = 4, alpha = 8, targets = [\"q_proj\", \"v_proj\"] }",
            ),
            "job.toml",
        )
        .unwrap();
        assert_eq!(
            spec.policy.lora.map(|l| (l.r, l.targets.len())),
            Some((4, 2))
        );
        assert!(
            err(&GOOD.replace(r#"backend = "scripted""#, r#"backend = "openai""#))
                .contains("judge.endpoint")
        );
    }
    #[test]
    fn new_keys_parse_and_paths_resolve_against_the_spec() {
        let text = GOOD
            .replace("kind = \"terminal\"", "kind = \"scripted\"\nmax_steps = 3")
            .replace("votes = 3", "votes = 3\nhint_votes = 2\nrules = [{ pattern = \"ok\", score = 1 }]\nhint = { pattern = \"hint: (.*)\" }")
            .replace("max_steps = 100", "max_steps = 100\nmax_turns = 50")
            .replace("checkpoint = \"tests/fixtures/qwen3-tiny\"", "checkpoint = \"ck\"\nreplicas = 4\ntemperature = 0.7");
        // OPD needs the rollout log-probs to be the policy's own: temperature 1.
        assert!(err(&text).contains("policy.temperature"));
        let text = text.replace("kind = \"combined\"", "kind = \"binary\"");
        let s = JobSpec::parse(&text, "jobs/x.toml").unwrap();
        assert_eq!((s.policy.replicas(), s.policy.temperature()), (4, 0.7));
        assert_eq!(
            (s.judge.hint_votes, s.env.max_steps, s.stop.max_turns),
            (Some(2), Some(3), Some(50))
        );
        assert_eq!(s.resolve("ck"), std::path::Path::new("jobs/ck"));
        assert_eq!(s.resolve("/abs/ck"), std::path::Path::new("/abs/ck"));
        let c = s.scripted_config("jobs/x.toml").unwrap();
        assert_eq!((c.rules.len(), c.hint.is_some()), (1, true));
    }

    #[test]
    fn scripted_rules_are_checked_and_only_for_the_scripted_backend() {
        let bad_regex = GOOD.replace(
            "votes = 3",
            "votes = 3\nrules = [{ pattern = \"(\", score = 1 }]",
        );
        assert!(err(&bad_regex).contains("judge.rules"));
        let not_scripted = GOOD
            .replace("backend = \"scripted\"", "backend = \"model\"")
            .replace("votes = 3", "votes = 3\ndefault_score = 1");
        assert!(err(&not_scripted).contains("judge.rules"));
        let both = GOOD.replace(
            "votes = 3",
            "votes = 3\nrules_file = \"r.toml\"\ndefault_score = 1",
        );
        assert!(err(&both).contains("judge.rules_file"));
        let missing = GOOD.replace(
            "votes = 3",
            "votes = 3\nrules_file = \"no/such/rules.toml\"",
        );
        let e = err(&missing);
        assert!(
            e.contains("judge.rules_file") && e.contains("no/such/rules.toml"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("r.toml"),
            "default_score = 1\nnoise_rate = 0.5\n",
        )
        .unwrap();
        let f = dir.path().join("job.toml");
        let s = JobSpec::parse(
            &GOOD.replace("votes = 3", "votes = 3\nrules_file = \"r.toml\""),
            &f.display().to_string(),
        )
        .unwrap();
        let c = s.scripted_config(&f.display().to_string()).unwrap();
        assert_eq!((c.default_score, c.noise_rate), (Some(1), 0.5));
        assert!(err(&GOOD.replace("max_steps = 100", "max_turns = 0")).contains("stop.max_turns"));
        assert!(
            err(&GOOD.replace("[policy]", "[policy]\nreplicas = 0")).contains("policy.replicas")
        );
    }

    #[test]
    fn max_backlog_defaults_to_two_batches_and_is_checked() {
        let s = JobSpec::parse(GOOD, "x.toml").unwrap();
        // batch_size 16, staleness 2: two batches.
        assert_eq!(s.max_backlog(), Some(32));
        let s = JobSpec::parse(&GOOD.replace("staleness = 2", "staleness = 0"), "x.toml").unwrap();
        assert_eq!(s.max_backlog(), Some(16), "no lag allowed: one batch");
        let with = |v: &str| {
            GOOD.replace(
                "parallelism = 4",
                &format!("parallelism = 4\nmax_backlog = {v}"),
            )
        };
        let s = JobSpec::parse(&with("100"), "x.toml").unwrap();
        assert_eq!(s.max_backlog(), Some(100));
        let s = JobSpec::parse(&with("\"off\""), "x.toml").unwrap();
        assert_eq!(s.max_backlog(), None);
        for bad in ["8", "-1", "\"on\"", "1.5"] {
            let e = err(&with(bad));
            assert!(e.contains("env.max_backlog"), "{bad}: {e}");
        }
        assert!(err(&with("8")).contains("optim.batch_size"));
    }

    const PERSONAL: &str = r#"
kind = "personal"
[policy]
checkpoint = "tests/fixtures/qwen3-tiny"
[gateway]
listen = "127.0.0.1:0"
api_keys = ["k"]
on_session_end = "drop"
[judge]
backend = "scripted"
votes = 1
[method]
kind = "binary"
[optim]
batch_size = 2
lr = 1e-6
clip = 0.2
kl = 0.0
staleness = 2
[stop]
max_steps = 3
"#;

    #[test]
    fn the_example_job_specs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
        for f in [
            "demo.toml",
            "personal_serve.toml",
            "personal_agents.toml",
            "openclaw.toml",
        ] {
            let spec = JobSpec::load(&dir.join(f)).unwrap_or_else(|e| panic!("{e}"));
            if f == "personal_agents.toml" {
                assert_eq!(spec.policy.agents, ["alice", "bob"]);
            }
        }
    }

    #[test]
    fn agents_need_a_personal_lora_job_and_names_that_are_ids_and_directories() {
        let lora = "checkpoint = \"tests/fixtures/qwen3-tiny\"\n\
                    lora = { r = 4, alpha = 8, targets = [\"q_proj\"] }";
        let with = |agents: &str| {
            PERSONAL.replace(
                "checkpoint = \"tests/fixtures/qwen3-tiny\"",
                &format!("{lora}\nagents = {agents}"),
            )
        };
        let s = JobSpec::parse(&with("[\"alice\", \"bob-2\"]"), "p.toml").unwrap();
        assert_eq!(s.policy.agents, ["alice", "bob-2"]);
        // Without an adapter there is nothing per agent to train.
        let no_lora = PERSONAL.replace(
            "checkpoint = \"tests/fixtures/qwen3-tiny\"",
            "checkpoint = \"tests/fixtures/qwen3-tiny\"\nagents = [\"a\"]",
        );
        assert!(err(&no_lora).contains("policy.agents"));
        for bad in [
            "[\"a\", \"a\"]",
            "[\"../x\"]",
            "[\".hidden\"]",
            "[\"a b\"]",
            "[\"\"]",
        ] {
            assert!(err(&with(bad)).contains("policy.agents"), "{bad}");
        }
        let many = (0..=MAX_AGENTS)
            .map(|i| format!("\"a{i}\""))
            .collect::<Vec<_>>();
        assert!(err(&with(&format!("[{}]", many.join(",")))).contains("policy.agents"));
        // The gateway serves the agents' ids: no checkpoint id, scoped keys name agents.
        let named = with("[\"alice\"]").replace("api_keys", "model_name = \"m\"\napi_keys");
        assert!(err(&named).contains("gateway.model_name"));
        let scoped = |models: &str| {
            format!(
                "{}[[gateway.scoped_keys]]\nkey = \"s\"\nmodels = {models}\n",
                with("[\"alice\", \"bob\"]")
            )
        };
        assert!(JobSpec::parse(&scoped("[\"bob\"]"), "p.toml").is_ok());
        assert!(err(&scoped("[\"carol\"]")).contains("gateway.scoped_keys"));
        // An `rl` job has no agents.
        let rl = GOOD.replace(
            "[policy]\n",
            "[policy]\nagents = [\"a\"]\nlora = { r = 4, alpha = 8, targets = [\"q_proj\"] }\n",
        );
        assert!(err(&rl).contains("policy.agents"), "{}", err(&rl));
    }

    #[test]
    fn the_policy_device_is_parsed_and_only_personal_jobs_leave_the_cpu() {
        use crate::device::Device;
        assert_eq!(
            JobSpec::parse(PERSONAL, "p.toml").unwrap().policy.device,
            Device::Cpu
        );
        let on =
            |spec: &str, d: &str| spec.replace("[policy]", &format!("[policy]\ndevice = \"{d}\""));
        let s = JobSpec::parse(&on(PERSONAL, "cuda:1"), "p.toml").unwrap();
        assert_eq!(s.policy.device, Device::Cuda(1));
        let e = err(&on(PERSONAL, "gpu"));
        assert!(e.contains("policy.device") && e.contains("cuda:N"), "{e}");
        let e = err(&on(GOOD, "cuda:0"));
        assert!(e.contains("policy.device") && e.contains("personal"), "{e}");
        assert_eq!(
            JobSpec::parse(&on(GOOD, "cpu"), "x.toml")
                .unwrap()
                .policy
                .device,
            Device::Cpu
        );
    }

    #[test]
    fn recomputing_activations_is_an_optim_key_off_by_default() {
        let plain = JobSpec::parse(PERSONAL, "p.toml").unwrap();
        assert!(!crate::pipeline::train_config(&plain).recompute_activations);
        let on = PERSONAL.replace("[optim]\n", "[optim]\nrecompute_activations = true\n");
        assert_ne!(on, PERSONAL);
        let on = JobSpec::parse(&on, "p.toml").unwrap();
        assert!(crate::pipeline::train_config(&on).recompute_activations);
        let bad = PERSONAL.replace("[optim]\n", "[optim]\nrecompute_activations = 1\n");
        assert!(err(&bad).contains("recompute_activations"), "{}", err(&bad));
    }

    #[test]
    fn personal_jobs_take_a_gateway_and_no_env() {
        let s = JobSpec::parse(PERSONAL, "p.toml").unwrap();
        assert_eq!(s.kind, JobKind::Personal);
        let g = s.gateway.as_ref().unwrap();
        assert_eq!(
            (g.api_keys.clone(), g.on_session_end),
            (vec!["k".to_string()], crate::gateway::EndPolicy::Drop)
        );
        assert_eq!(s.needs("p.toml").env_kind, PERSONAL_ENV_KIND);
        let with_env =
            format!("{PERSONAL}[env]\nkind = \"scripted\"\nparallelism = 1\ntasks = \"t\"\n");
        assert!(err(&with_env).contains("`env`"));
        assert!(
            err(&PERSONAL.replace("kind = \"binary\"", "kind = \"stepwise\""))
                .contains("method.kind")
        );
        assert!(err(&PERSONAL.replace("max_steps = 3", "max_turns = 3")).contains("stop.max_turns"));
        assert!(
            err(&PERSONAL.replace("api_keys = [\"k\"]", "api_key = \"k\"")).contains("api_key")
        );
        assert!(
            err(&PERSONAL.replace("api_keys = [\"k\"]", "version = 2")).contains("gateway.version")
        );
        assert!(
            err(&PERSONAL.replace("api_keys = [\"k\"]", "max_batch = 0")).contains("max_batch")
        );
        assert!(
            err(&format!("{PERSONAL}[gateway.adapters]\nalice = \"a\"\n"))
                .contains("gateway.adapters")
        );
        // Sampling and replica keys change nothing in a personal job (its requests set their
        // own sampling, on the gateway's one engine): refused by name, even at their defaults.
        for key in [
            "replicas = 1",
            "temperature = 1.0",
            "top_p = 0.9",
            "max_new_tokens = 8",
        ] {
            let e = err(&PERSONAL.replace("[gateway]", &format!("{key}\n[gateway]")));
            let name = key.split(' ').next().unwrap();
            assert!(e.contains(&format!("policy.{name}")), "{key}: {e}");
            assert!(e.contains("not used by a personal job"), "{key}: {e}");
        }
        // `rl` keeps its rules: an environment, and no gateway.
        assert!(
            err(&PERSONAL.replace("kind = \"personal\"", "kind = \"rl\"")).contains("`gateway`")
        );
        let mut no_env = GOOD.to_string();
        let i = no_env.find("[env]").unwrap();
        let j = no_env.find("[stop]").unwrap();
        no_env.replace_range(i..j, "");
        assert!(err(&no_env).contains("`env`"));
    }
}
