//! The tool-call agent experiment: warm-start a small policy to call the `code_interpreter`
//! tool ([`super::sft`]), then train it with RL on generated math tasks as a step-wise
//! `clawrl` job in the real tool-call environment (every call runs `python3` in the sandbox),
//! once per reward arm, and measure the success rate on held-out tasks after the configured
//! numbers of updates.
//!
//! **One arm is one job** ([`clawrl::pipeline::run_job`], the path `clawrl run JOB.toml` takes):
//! `kind = "rl"`, `env.kind = "tool_call"` over the train tasks (written as the job's task
//! file), `method.kind = "stepwise"` with `step_reward = "tool_call"` (`outcome + w_process ·
//! prm`), groups of `group_size` episodes of one task z-scored together per step index, the
//! rollout workers, `PrmVoter`s and `Trainer` actors of any job, and every new version installed
//! on the rollout workers while episodes run. The process score comes from the rule-based PRM
//! ([`super::prm`]) behind the job's `openai` judge ([`super::endpoint`]): one vote per tool
//! step; the final answer step has no next state and gets none. The arms differ only in
//! `method.w_process`: 1 for **integrated** (outcome plus process), 0 for **outcome-only**
//! (the PRM still votes, so both arms report the same judge counts). Both share the warm
//! start, the task order, the job seed and the budget (`updates` trainer steps of `batch_size`
//! step samples).
//!
//! **Success rate.** The job checkpoints at every measured update; each checkpoint (and the
//! warm start, for 0 updates) rolls out every held-out task `eval_samples` times in process
//! (temperature `temperature`, seeds fixed per task and sample, the same at every measurement
//! and for both arms), and the rate is the fraction of episodes whose outcome is a correct
//! answer. Measuring does not train.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::endpoint::{PrmEndpoint, VoteCounts, MODEL, TEMPLATE};
use super::prm::judge_step;
use super::sft::{warm_start, SftError, SftSettings};
use super::tasks::{task_sets, GenTask};
use super::tokenizer::continuation_ids;
use crate::experiments::warm_start::SftOutcome;
use crate::experiments::{
    parse_text, prepare_run_dir, read_text, toml_table, write_outputs, FileError,
};
use clawrl::env::{EnvBuildError, EnvOptions, ToolCallEnv};
use clawrl::job::{JobSpec, JobSpecError};
use clawrl::model::checkpoint::load_model_as;
use clawrl::model::{
    load_checkpoint, spawn_engine, Checkpoint, EngineError, EngineOptions, GenerationRequest,
    LinearLayout, LoadError, Qwen3, SamplingParams,
};
use clawrl::pipeline::policy::action_of;
use clawrl::pipeline::{run_job, RunError, RunOptions, RunReport};
use clawrl::train::TrainConfig;
use clawrl_actors::loops::{Environment, Episode, JobCounts};

/// The `[tasks]` table: the generated task sets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskSettings {
    /// Seed of the task draws.
    pub seed: u64,
    /// Smallest operand.
    pub operand_min: i64,
    /// Largest operand.
    pub operand_max: i64,
    /// Train tasks (the warm start and RL draw from these).
    pub train: usize,
    /// Held-out tasks (only measured on).
    pub held_out: usize,
}

impl Default for TaskSettings {
    fn default() -> Self {
        Self {
            seed: 0,
            operand_min: 2,
            operand_max: 9,
            train: 1500,
            held_out: 64,
        }
    }
}

/// A reward arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    /// Episode outcome plus each step's process score.
    Integrated,
    /// Episode outcome alone.
    OutcomeOnly,
}

impl Arm {
    /// Its name in files and tables.
    pub fn name(self) -> &'static str {
        match self {
            Arm::Integrated => "integrated",
            Arm::OutcomeOnly => "outcome_only",
        }
    }

    /// Its job's `method.w_process`.
    pub fn w_process(self) -> f64 {
        match self {
            Arm::Integrated => 1.0,
            Arm::OutcomeOnly => 0.0,
        }
    }
}

/// The `[experiment]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentSettings {
    /// Reward arms to run, in order.
    pub arms: Vec<Arm>,
    /// Trainer steps per arm (the job's `stop.max_steps`).
    pub updates: usize,
    /// After how many updates to measure (0 = the warm start).
    pub eval_at: Vec<usize>,
    /// Step samples per trainer step (`optim.batch_size`).
    pub batch_size: usize,
    /// Episodes of one task z-scored together (`env.group_size`).
    pub group_size: usize,
    /// Episodes run at once (`env.parallelism`).
    pub parallelism: usize,
    /// Most versions a sample may lag the trainer before it is dropped (`optim.staleness`).
    pub staleness: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Coefficient of the k3 KL term against the warm start (0 disables it).
    pub kl_coef: f64,
    /// Most steps of an episode (`env.max_steps`; a step is one response: tool calls or the
    /// answer).
    pub max_steps: u32,
    /// Episodes per held-out task at a measurement.
    pub eval_samples: usize,
    /// Sampling temperature of rollouts and measurements.
    pub temperature: f32,
    /// Longest response of one step.
    pub max_new_tokens: usize,
    /// The job's seed (its episodes' sampling) and the measurements' seed.
    pub seed: u64,
}

impl Default for ExperimentSettings {
    fn default() -> Self {
        Self {
            arms: vec![Arm::Integrated, Arm::OutcomeOnly],
            updates: 30,
            eval_at: vec![0, 15, 30],
            batch_size: 128,
            group_size: 8,
            parallelism: 16,
            staleness: 1,
            lr: 1e-3,
            kl_coef: 0.0,
            max_steps: 4,
            eval_samples: 2,
            temperature: 1.0,
            max_new_tokens: 64,
            seed: 1,
        }
    }
}

/// The top-level `kind` of a tool-call experiment file.
pub const KIND: &str = "tool_call_experiment";

/// An experiment file (`examples/tool_call_agent.toml`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentFile {
    /// Must be `tool_call_experiment`.
    pub kind: String,
    /// Where the warm start is cached (default `target/clawrl-cache/toolagent`).
    pub cache_dir: Option<PathBuf>,
    /// The task sets.
    pub tasks: TaskSettings,
    /// The warm start.
    pub sft: SftSettings,
    /// The RL runs.
    pub experiment: ExperimentSettings,
}

/// Why the experiment failed.
#[derive(Debug, Error)]
pub enum ExperimentError {
    /// The file could not be read, or the run's files not written.
    #[error(transparent)]
    File(#[from] FileError),
    /// The warm start failed.
    #[error(transparent)]
    Sft(#[from] SftError),
    /// The warm start or a job checkpoint could not be loaded.
    #[error("loading a policy: {0}")]
    Load(#[from] LoadError),
    /// The environment could not be built.
    #[error(transparent)]
    Env(#[from] EnvBuildError),
    /// An episode failed.
    #[error("episode: {0}")]
    Episode(#[from] clawrl_actors::loops::EnvError),
    /// Tokenizing failed.
    #[error("prompt: {0}")]
    Chat(#[from] clawrl::model::ChatError),
    /// Generation failed.
    #[error("generation: {0}")]
    Engine(#[from] EngineError),
    /// An arm's job spec was refused.
    #[error(transparent)]
    Spec(#[from] JobSpecError),
    /// An arm's job failed.
    #[error("the {arm} job: {source}")]
    Job {
        /// The arm.
        arm: &'static str,
        /// Why.
        source: RunError,
    },
    /// An arm's job ended without training as asked.
    #[error("the {arm} job ended after {steps} of {updates} trainer steps: {why}")]
    Short {
        /// The arm.
        arm: &'static str,
        /// Steps made.
        steps: u64,
        /// Steps asked for.
        updates: usize,
        /// What the job reported.
        why: String,
    },
    /// The runtime or the PRM's endpoint could not start.
    #[error("starting {what}: {source}")]
    Start {
        /// What.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

impl ExperimentFile {
    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, FileError> {
        let file: ExperimentFile = parse_text(text, origin)?;
        file.validate().map_err(|m| FileError::parse(origin, m))?;
        Ok(file)
    }

    /// Reads and validates a file.
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        Self::from_toml_str(&read_text(path)?, &path.display().to_string())
    }

    /// Checks every value; the message names the key. (Each arm's job spec is checked again
    /// by the job-spec parser when it is built.)
    pub fn validate(&self) -> Result<(), String> {
        if self.kind != KIND {
            return Err(format!(
                "kind = {:?}: this runner only runs kind = {KIND:?}",
                self.kind
            ));
        }
        let t = &self.tasks;
        if t.operand_min < 1 || t.operand_max < t.operand_min || t.operand_max > 9999 {
            return Err(format!(
                "tasks.operand_min / operand_max must satisfy 1 <= min <= max <= 9999, got {} / {}",
                t.operand_min, t.operand_max
            ));
        }
        let range = (t.operand_max - t.operand_min + 1) as f64;
        if ((t.train + t.held_out) as f64) > range.powi(3) * 9.0 / 2.0 {
            return Err(
                "tasks.train + tasks.held_out exceed half the distinct tasks of the operand range"
                    .into(),
            );
        }
        let x = &self.experiment;
        for (key, v) in [
            ("tasks.train", t.train),
            ("tasks.held_out", t.held_out),
            ("experiment.updates", x.updates),
            ("experiment.batch_size", x.batch_size),
            ("experiment.group_size", x.group_size),
            ("experiment.parallelism", x.parallelism),
            ("experiment.eval_samples", x.eval_samples),
            ("experiment.max_new_tokens", x.max_new_tokens),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        if x.arms.is_empty() {
            return Err("experiment.arms is empty".into());
        }
        if x.max_steps == 0 {
            return Err("experiment.max_steps must be at least 1".into());
        }
        if x.eval_at.is_empty() || !x.eval_at.windows(2).all(|w| w[0] < w[1]) {
            return Err("experiment.eval_at must be a non-empty, strictly increasing list".into());
        }
        if let Some(&e) = x.eval_at.iter().find(|&&e| e > x.updates) {
            return Err(format!(
                "experiment.eval_at holds {e}, more than experiment.updates = {}",
                x.updates
            ));
        }
        if !(x.lr.is_finite() && x.lr > 0.0) {
            return Err(format!("experiment.lr = {} must be > 0", x.lr));
        }
        if !(x.kl_coef.is_finite() && x.kl_coef >= 0.0) {
            return Err(format!("experiment.kl_coef = {} must be >= 0", x.kl_coef));
        }
        if !(x.temperature.is_finite() && x.temperature > 0.0) {
            return Err(format!(
                "experiment.temperature = {} must be > 0",
                x.temperature
            ));
        }
        if x.max_new_tokens >= self.sft.max_positions {
            return Err("experiment.max_new_tokens must be below sft.max_positions".into());
        }
        self.sft.validate().map_err(|e| e.to_string())
    }

    /// The warm start's cache directory.
    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("target/clawrl-cache/toolagent"))
    }

    /// The job spec of `arm`: the policy at `checkpoint`, the train tasks in `tasks`, the PRM at
    /// `judge_url`; `origin` names the experiment file in errors.
    pub fn job_spec(
        &self,
        arm: Arm,
        checkpoint: &Path,
        tasks: &Path,
        judge_url: &str,
        origin: &str,
    ) -> Result<JobSpec, JobSpecError> {
        let x = &self.experiment;
        let train = TrainConfig::default();
        let int = |v: usize| toml::Value::Integer(v as i64);
        let float = toml::Value::Float;
        let sub = toml_table;
        let mut optim = vec![
            ("batch_size", int(x.batch_size)),
            ("lr", float(x.lr)),
            ("clip", float(train.eps_clip)),
            ("clip_high", float(train.eps_clip_high)),
            ("kl", float(x.kl_coef)),
            ("staleness", int(x.staleness)),
            // Every measured checkpoint stays.
            ("keep_checkpoints", int(0)),
        ];
        if let Some(every) = checkpoint_every(&x.eval_at) {
            optim.push(("checkpoint_every", int(every)));
        }
        let spec = sub(vec![
            ("kind", "rl".into()),
            ("name", format!("tool-call-{}", arm.name()).into()),
            ("seed", toml::Value::Integer(x.seed as i64)),
            (
                "policy",
                sub(vec![
                    ("checkpoint", checkpoint.display().to_string().into()),
                    ("temperature", float(x.temperature as f64)),
                    ("max_new_tokens", int(x.max_new_tokens)),
                    ("max_batch", int(x.parallelism)),
                    ("max_context", int(self.sft.max_positions)),
                ]),
            ),
            (
                "judge",
                sub(vec![
                    ("backend", "openai".into()),
                    ("endpoint", judge_url.into()),
                    ("model", MODEL.into()),
                    ("votes", int(1)),
                    ("timeout_s", float(60.0)),
                    ("prompts", sub(vec![("step_tool_call", TEMPLATE.into())])),
                ]),
            ),
            (
                "method",
                sub(vec![
                    ("kind", "stepwise".into()),
                    ("step_reward", "tool_call".into()),
                    ("w_process", float(arm.w_process())),
                ]),
            ),
            ("optim", sub(optim)),
            (
                "env",
                sub(vec![
                    ("kind", "tool_call".into()),
                    ("parallelism", int(x.parallelism)),
                    ("tasks", tasks.display().to_string().into()),
                    ("max_steps", int(x.max_steps as usize)),
                    ("group_size", int(x.group_size)),
                ]),
            ),
            ("stop", sub(vec![("max_steps", int(x.updates))])),
        ]);
        crate::experiments::job_spec(spec, origin, arm.name())
    }
}

/// The checkpoint interval that lands on every measured update: the greatest common divisor
/// of the non-zero `eval_at` (none when only the warm start is measured).
pub fn checkpoint_every(eval_at: &[usize]) -> Option<usize> {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    eval_at.iter().copied().filter(|&u| u > 0).reduce(gcd)
}

/// One step of a rolled-out episode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRecord {
    /// The response text as sampled.
    pub text: String,
    /// Tool calls the response made.
    pub calls: usize,
    /// The tool messages the environment answered with (the next state; empty for the answer).
    pub results: Vec<String>,
    /// The PRM's vote (`None` for a step without a next state).
    pub prm: Option<i8>,
}

/// One rolled-out episode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpisodeRecord {
    /// Index of the task in its set.
    pub task: usize,
    /// Its question.
    pub question: String,
    /// The steps.
    pub steps: Vec<StepRecord>,
    /// `+1` correct, `-1` not.
    pub outcome: f64,
    /// How it ended (`answer`, `step_limit`, `deadline`, `context`).
    pub finish: String,
}

impl EpisodeRecord {
    fn calls(&self) -> usize {
        self.steps.iter().map(|s| s.calls).sum()
    }
}

/// One measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measurement {
    /// After this many updates.
    pub updates: usize,
    /// The success rate on held-out tasks.
    pub success: f64,
    /// Fraction of episodes with at least one tool call.
    pub tool_use: f64,
    /// Fraction of tool steps whose call(s) ran (exit code 0).
    pub calls_ran: f64,
    /// Mean tool calls per episode.
    pub mean_calls: f64,
    /// Fraction of tool steps the PRM scored `+1`.
    pub prm_positive: f64,
    /// A few episodes (question, step texts, outcome).
    pub examples: Vec<(String, Vec<String>, f64)>,
}

/// One arm's run.
#[derive(Debug, Clone, Serialize)]
pub struct ArmRun {
    /// The arm.
    pub arm: String,
    /// Measurements, in `eval_at` order.
    pub measurements: Vec<Measurement>,
    /// What its job reported: counts (turns, judged, samples, groups), the trainer's stats,
    /// the rollout workers', where its records and checkpoints are.
    pub job: RunReport,
    /// The PRM's votes over the job's tool steps.
    pub prm: VoteCounts,
    /// Seconds for this arm (its job and its measurements).
    pub seconds: f64,
    /// Seconds of its job alone, per trainer step.
    pub seconds_per_update: f64,
}

/// Everything the experiment measured (`details.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The measured numbers of updates.
    pub eval_at: Vec<usize>,
    /// Arm name → success rate per entry of `eval_at`.
    pub success: BTreeMap<String, Vec<f64>>,
    /// The warm start.
    pub sft: SftOutcome,
    /// Per arm.
    pub runs: Vec<ArmRun>,
    /// Seconds for the whole experiment (warm start included).
    pub seconds: f64,
}
/// The measuring side: held-out episodes rolled out in process over the generation engine
/// (each round of steps one batch for the engine, the tool calls of a round run concurrently).
struct World {
    ck: Checkpoint<clawrl::CpuBackend>,
    stop: Vec<u32>,
    settings: ExperimentSettings,
    max_positions: usize,
    rt: tokio::runtime::Runtime,
}

fn mix_seed(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl World {
    /// Rolls out one episode per `(task index, seed)` of `plan` on `model`, all at once (each
    /// round of steps is one batch for the engine; the tool calls of a round run
    /// concurrently).
    fn rollout(
        &self,
        model: Arc<Qwen3<clawrl::CpuBackend>>,
        env: &ToolCallEnv,
        tasks: &[GenTask],
        plan: &[(usize, u64)],
    ) -> Result<Vec<EpisodeRecord>, ExperimentError> {
        let x = &self.settings;
        let started = self
            .rt
            .block_on(join_all(plan.iter().map(|(i, s)| env.start(*i, *s))));
        let mut eps: Vec<Box<dyn Episode>> = Vec::with_capacity(plan.len());
        for e in started {
            eps.push(e?);
        }
        let mut prompts = Vec::with_capacity(plan.len());
        for ep in &eps {
            let obs = ep.observation();
            let messages = minijinja::Value::from_serialize(&obs.messages);
            prompts.push(self.ck.encode_chat(&messages, None)?.ids);
        }
        let mut records: Vec<EpisodeRecord> = plan
            .iter()
            .map(|(i, _)| EpisodeRecord {
                task: *i,
                question: tasks[*i].question(),
                steps: Vec::new(),
                outcome: -1.0,
                finish: String::new(),
            })
            .collect();
        let mut active: Vec<bool> = vec![true; plan.len()];
        let mut seen: Vec<Vec<i64>> = vec![Vec::new(); plan.len()];
        let engine = spawn_engine(
            model,
            None,
            EngineOptions {
                max_batch: 64,
                max_context: self.max_positions,
                ..EngineOptions::default()
            },
        );
        let mut round = 0u64;
        while active.iter().any(|a| *a) {
            let idx: Vec<usize> = (0..plan.len()).filter(|&k| active[k]).collect();
            let rxs: Vec<_> = idx
                .iter()
                .map(|&k| {
                    engine.submit(GenerationRequest {
                        prompt_ids: prompts[k].clone(),
                        params: SamplingParams {
                            temperature: x.temperature,
                            top_p: 1.0,
                            top_k: 0,
                            max_new_tokens: x.max_new_tokens,
                            stop_token_ids: self.stop.clone(),
                            stop_strings: Vec::new(),
                            seed: mix_seed(plan[k].1, round),
                        },
                        raw_logprobs: None,
                    })
                })
                .collect();
            let mut gens = Vec::with_capacity(idx.len());
            for rx in rxs {
                gens.push(rx.blocking_recv().map_err(|_| EngineError::Closed)??);
            }
            let actions: Vec<_> = gens
                .iter()
                .map(|g| {
                    let text = self
                        .ck
                        .tokenizer
                        .decode(&g.response_ids, true)
                        .unwrap_or_default();
                    let raw = self
                        .ck
                        .tokenizer
                        .decode(&g.response_ids, false)
                        .unwrap_or_default();
                    (
                        text.clone(),
                        action_of(&text, raw, &format!("call-{round}")),
                    )
                })
                .collect();
            let outcomes = {
                let mut futs = Vec::with_capacity(idx.len());
                let mut rest: &mut [Box<dyn Episode>] = &mut eps;
                let mut base = 0;
                for (&k, (_, action)) in idx.iter().zip(&actions) {
                    let (_, tail) = rest.split_at_mut(k - base);
                    let (head, tail) = tail.split_at_mut(1);
                    futs.push(head[0].step(action));
                    rest = tail;
                    base = k + 1;
                }
                self.rt.block_on(join_all(futs))
            };
            for ((&k, (text, action)), (gen, out)) in
                idx.iter().zip(actions).zip(gens.into_iter().zip(outcomes))
            {
                let out = out?;
                let results: Vec<String> = out
                    .next_state
                    .iter()
                    .map(|m| {
                        m.get("content")
                            .and_then(|c| c.as_str())
                            .unwrap_or_default()
                            .to_string()
                    })
                    .collect();
                let prm = (!results.is_empty())
                    .then(|| judge_step(&tasks[plan[k].0], &results, &mut seen[k]));
                let mut next = prompts[k].clone();
                next.extend_from_slice(&gen.response_ids);
                records[k].steps.push(StepRecord {
                    text,
                    calls: action.tool_calls.len(),
                    results: results.clone(),
                    prm,
                });
                if out.done {
                    active[k] = false;
                    records[k].outcome = out.outcome.unwrap_or(-1.0);
                    records[k].finish = out
                        .info
                        .get("finish")
                        .and_then(|f| f.as_str())
                        .unwrap_or("done")
                        .to_string();
                    continue;
                }
                if gen
                    .response_ids
                    .last()
                    .is_none_or(|t| !self.stop.contains(t))
                {
                    next.push(self.stop[0]);
                }
                next.extend(continuation_ids(&self.ck.tokenizer, &results)?);
                if next.len() + x.max_new_tokens > self.max_positions {
                    // The transcript cannot hold another step: the episode ends unanswered.
                    active[k] = false;
                    records[k].outcome = -1.0;
                    records[k].finish = "context".into();
                    continue;
                }
                prompts[k] = next;
            }
            round += 1;
        }
        self.rt
            .block_on(join_all(eps.into_iter().map(|e| e.close())));
        Ok(records)
    }

    /// The success rate of `model` on the held-out tasks.
    fn measure(
        &self,
        model: Arc<Qwen3<clawrl::CpuBackend>>,
        env: &ToolCallEnv,
        tasks: &[GenTask],
        updates: usize,
    ) -> Result<Measurement, ExperimentError> {
        let x = &self.settings;
        let plan: Vec<(usize, u64)> = (0..tasks.len())
            .flat_map(|i| {
                (0..x.eval_samples)
                    .map(move |s| (i, mix_seed(x.seed ^ 0xe7a1, ((i as u64) << 8) | s as u64)))
            })
            .collect();
        let eps = self.rollout(model, env, tasks, &plan)?;
        Ok(summarize(&eps, updates))
    }
}

/// The measurement of a set of episodes.
fn summarize(eps: &[EpisodeRecord], updates: usize) -> Measurement {
    let n = eps.len().max(1) as f64;
    let tool_steps: Vec<&StepRecord> = eps
        .iter()
        .flat_map(|e| e.steps.iter().filter(|s| s.prm.is_some()))
        .collect();
    let frac = |k: usize, of: usize| if of == 0 { 0.0 } else { k as f64 / of as f64 };
    Measurement {
        updates,
        success: eps.iter().filter(|e| e.outcome > 0.0).count() as f64 / n,
        tool_use: eps.iter().filter(|e| e.calls() > 0).count() as f64 / n,
        calls_ran: frac(
            tool_steps
                .iter()
                .filter(|s| s.results.iter().all(|r| r.starts_with("exit code: 0\n")))
                .count(),
            tool_steps.len(),
        ),
        mean_calls: eps.iter().map(|e| e.calls()).sum::<usize>() as f64 / n,
        prm_positive: frac(
            tool_steps.iter().filter(|s| s.prm == Some(1)).count(),
            tool_steps.len(),
        ),
        examples: eps
            .iter()
            .take(4)
            .map(|e| {
                (
                    e.question.clone(),
                    e.steps.iter().map(|s| s.text.clone()).collect(),
                    e.outcome,
                )
            })
            .collect(),
    }
}

/// Writes `tasks` as a tool-call task file (JSONL: `id`, `question`, `answer`) at `path`.
fn write_task_file(tasks: &[GenTask], path: &Path) -> std::io::Result<()> {
    let mut text = String::new();
    for t in tasks {
        let m = t.math_task();
        let line = serde_json::json!({"id": m.id, "question": m.question, "answer": m.answer});
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(path, text)
}

/// A progress bar of one arm's trainer steps (hidden when `show` is false).
fn arm_bar(arm: Arm, updates: usize, show: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(updates as u64),
        if show {
            ProgressDrawTarget::stderr_with_hz(4)
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{elapsed_precise}} {:>12} [{{bar:30}}] {{pos}}/{{len}} updates {{msg}}",
            arm.name()
        ))
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

fn progress_message(c: &JobCounts) -> String {
    format!(
        "· {} turns, {} judged · {} episodes · samples trained {}, stale {}",
        c.turns, c.judged, c.sessions_finished, c.trainer.trained, c.trainer.dropped_stale
    )
}

/// Runs the experiment described by `file` (read from `origin`), writing `results.json`,
/// `details.json` and `success.png` into `run_dir`, each arm's job (records, checkpoints,
/// TensorBoard scalars) under `run_dir/<arm>`; `show_progress` draws a bar per arm on stderr.
pub fn run(
    file: &ExperimentFile,
    origin: &str,
    run_dir: &Path,
    show_progress: bool,
) -> Result<Report, ExperimentError> {
    file.validate().map_err(|m| FileError::parse(origin, m))?;
    let started = Instant::now();
    let run_dir = prepare_run_dir(run_dir)?;
    let t = &file.tasks;
    let (train, held) = task_sets(t.seed, t.operand_min, t.operand_max, t.train, t.held_out);
    let sft = warm_start(&file.sft, &train, &file.cache_dir(), false)?;
    tracing::info!(dir = %sft.dir.display(), cached = sft.cached, secs = sft.seconds, "toolagent: warm start ready");
    let sft_dir = std::path::absolute(&sft.dir).map_err(|e| FileError::write(&sft.dir, e))?;
    let x = file.experiment.clone();
    let ck = load_checkpoint::<clawrl::CpuBackend>(&sft_dir, &Default::default())?;
    let stop = ck.stop_token_ids();
    let max_positions = ck.config.max_position_embeddings;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| ExperimentError::Start {
            what: "the async runtime",
            source,
        })?;
    let world = World {
        ck,
        stop,
        settings: x.clone(),
        max_positions,
        rt,
    };
    clawrl::sandbox::probe().map_err(EnvBuildError::from)?;
    let eval_env = ToolCallEnv::new(
        held.iter().map(GenTask::math_task).collect(),
        EnvOptions {
            max_steps: Some(x.max_steps),
            max_concurrent_commands: 8,
            warm_workdirs: 4,
            ..EnvOptions::default()
        },
    )?;
    let tasks_file = run_dir.join("train_tasks.jsonl");
    write_task_file(&train, &tasks_file).map_err(|e| FileError::write(&tasks_file, e))?;
    let base = if x.eval_at.first() == Some(&0) {
        let decoding = LinearLayout::decoding::<clawrl::CpuBackend>();
        let model = world.ck.model.clone().into_layout(decoding);
        let m = world.measure(Arc::new(model), &eval_env, &held, 0)?;
        tracing::info!(
            success = m.success,
            tool_use = m.tool_use,
            "toolagent: warm start measured"
        );
        Some(m)
    } else {
        None
    };
    let mut runs = Vec::new();
    for &arm in &x.arms {
        let t0 = Instant::now();
        let out = run_dir.join(arm.name());
        let prm = world
            .rt
            .block_on(PrmEndpoint::start(&train))
            .map_err(|source| ExperimentError::Start {
                what: "the PRM's endpoint",
                source,
            })?;
        let spec = file.job_spec(arm, &sft_dir, &tasks_file, &prm.url(), origin)?;
        let bar = arm_bar(arm, x.updates, show_progress);
        let shown = bar.clone();
        let options = RunOptions {
            out: out.clone(),
            job_id: format!("tool-call-{}", arm.name()),
            progress: Some(Arc::new(move |c: &JobCounts| {
                shown.set_position(c.trainer.steps);
                shown.set_message(progress_message(c));
            })),
            poll: Duration::from_millis(200),
        };
        let job = world
            .rt
            .block_on(run_job(&spec, origin, options))
            .map_err(|source| ExperimentError::Job {
                arm: arm.name(),
                source,
            })?;
        bar.finish_and_clear();
        let votes = prm.counts();
        drop(prm);
        if job.trainer.steps < x.updates as u64 {
            return Err(ExperimentError::Short {
                arm: arm.name(),
                steps: job.trainer.steps,
                updates: x.updates,
                why: job
                    .counts
                    .gave_up
                    .clone()
                    .unwrap_or_else(|| "no reason given".into()),
            });
        }
        let seconds_per_update = job.wall_s / x.updates as f64;
        tracing::info!(
            arm = arm.name(),
            turns = job.counts.turns,
            prm_positive = votes.positive,
            prm_negative = votes.negative,
            secs = job.wall_s,
            "toolagent: job done"
        );
        let mut measurements: Vec<Measurement> = base.iter().cloned().collect();
        for &u in x.eval_at.iter().filter(|&&u| u > 0) {
            let dir = job.checkpoint_dir.join(format!("step-{u:08}"));
            let model =
                load_model_as::<clawrl::CpuBackend>(&dir, &world.ck.config, &Default::default())?
                    .into_layout(LinearLayout::decoding::<clawrl::CpuBackend>());
            let m = world.measure(Arc::new(model), &eval_env, &held, u)?;
            tracing::info!(
                arm = arm.name(),
                updates = u,
                success = m.success,
                "toolagent: measured"
            );
            measurements.push(m);
        }
        runs.push(ArmRun {
            arm: arm.name().to_string(),
            measurements,
            job,
            prm: votes,
            seconds: t0.elapsed().as_secs_f64(),
            seconds_per_update,
        });
    }
    let success = runs
        .iter()
        .map(|r| {
            (
                r.arm.clone(),
                r.measurements.iter().map(|m| m.success).collect(),
            )
        })
        .collect();
    let report = Report {
        eval_at: x.eval_at.clone(),
        success,
        sft,
        runs,
        seconds: started.elapsed().as_secs_f64(),
    };
    let results = crate::experiments::personal::experiment::Results {
        updates: report.eval_at.clone(),
        scores: report.success.clone(),
        ..Default::default()
    };
    write_outputs(&run_dir, &results, &report, "success.png")?;
    Ok(report)
}

/// The success table of a report, one line per arm (the README's table).
pub fn summary_table(report: &Report) -> String {
    let mut out = String::from("| reward |");
    for u in &report.eval_at {
        out.push_str(&format!(" {u} updates |"));
    }
    out.push_str(" s / update |\n| --- |");
    for _ in &report.eval_at {
        out.push_str(" --- |");
    }
    out.push_str(" --- |");
    for r in &report.runs {
        out.push_str(&format!("\n| {} |", r.arm));
        for m in &r.measurements {
            out.push_str(&format!(" {:.2} |", m.success));
        }
        out.push_str(&format!(" {:.1} |", r.seconds_per_update));
    }
    out
}

/// `clawrl run <tool-call experiment file>`: runs it into `out` (default
/// `runs/tool-call-agent-<unix time>`) and prints the success table, or the whole report as
/// JSON with `json` (which also hides the progress bars). `seed` replaces the file's
/// `experiment.seed`.
pub fn cli_main(
    path: &Path,
    out: Option<PathBuf>,
    json: bool,
    seed: Option<u64>,
) -> Result<PathBuf, ExperimentError> {
    let mut file = ExperimentFile::from_file(path)?;
    if let Some(s) = seed {
        file.experiment.seed = s;
    }
    let run_dir = crate::experiments::run_dir(out, "tool-call-agent");
    let report = run(&file, &path.display().to_string(), &run_dir, !json)?;
    crate::experiments::print_report(
        json,
        &report,
        &summary_table(&report),
        crate::experiments::Done {
            sft: Some(&report.sft),
            seconds: report.seconds,
            outputs: "results.json, details.json and success.png",
            run_dir: &run_dir,
        },
    );
    Ok(run_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_text() -> String {
        crate::experiments::example_text("tool_call_agent.toml")
    }

    #[test]
    fn the_example_parses_and_bad_values_name_the_key() {
        let text = example_text();
        let f = ExperimentFile::from_toml_str(&text, "t.toml").unwrap();
        assert_eq!(f.experiment.arms, vec![Arm::Integrated, Arm::OutcomeOnly]);
        let err = |t: String| {
            ExperimentFile::from_toml_str(&t, "x.toml")
                .unwrap_err()
                .to_string()
        };
        let e = err(text.replace("group_size = 8", "group_size = 0"));
        assert!(
            e.contains("x.toml") && e.contains("experiment.group_size"),
            "{e}"
        );
        let e = err(text.replace("group_size = 8", "group_size = 8\nbogus = 1"));
        assert!(e.contains("bogus"), "{e}");
        let e = err(text.replace("heads = 4", "heads = 3"));
        assert!(e.contains("sft.heads"), "{e}");
        let e = err(format!("{text}\n[experiment.x]\n"));
        assert!(e.contains("x.toml"), "{e}");
        let e = err(text.replace("kind = \"tool_call_experiment\"", "kind = \"rl\""));
        assert!(e.contains("kind = \"rl\""), "{e}");
        let e = err(text.replace("kind = \"tool_call_experiment\"", ""));
        assert!(e.contains("tool_call_experiment"), "{e}");
        let e = err(text.replace("updates = 30", "updates = 0"));
        assert!(e.contains("experiment.updates"), "{e}");
    }

    #[test]
    fn each_arm_is_a_stepwise_tool_call_job_that_differs_only_in_the_process_weight() {
        let f = ExperimentFile::from_toml_str(&example_text(), "t.toml").unwrap();
        let spec = |arm| {
            f.job_spec(
                arm,
                Path::new("/ck"),
                Path::new("/tasks.jsonl"),
                "http://127.0.0.1:9/v1",
                "t.toml",
            )
            .unwrap()
        };
        let (i, o) = (spec(Arm::Integrated), spec(Arm::OutcomeOnly));
        assert_eq!(i.method.kind, clawrl::job::MethodKind::Stepwise);
        assert_eq!(i.env.kind, clawrl::env::EnvKind::ToolCall);
        assert_eq!(i.env.group_size, Some(8));
        assert_eq!(i.stop.max_steps, Some(30));
        assert_eq!(i.optim.checkpoint_every, Some(15));
        assert_eq!(i.optim.keep_checkpoints, Some(0));
        assert_eq!(i.judge.prompts.step_tool_call.as_deref(), Some(TEMPLATE));
        assert_eq!(
            (i.method.process_weight(), o.method.process_weight()),
            (1.0, 0.0)
        );
        let mut same = o.clone();
        same.method.w_process = i.method.w_process;
        same.name = i.name.clone();
        assert_eq!(same, i);
    }

    #[test]
    fn checkpoints_land_on_every_measured_update() {
        assert_eq!(checkpoint_every(&[0, 15, 30]), Some(15));
        assert_eq!(checkpoint_every(&[0, 4, 10]), Some(2));
        assert_eq!(checkpoint_every(&[3]), Some(3));
        assert_eq!(checkpoint_every(&[0]), None);
    }
}
