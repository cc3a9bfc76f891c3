//! The tool-call agent experiment: warm-start a small policy to call the
//! `code_interpreter` tool ([`super::sft`]), then continue with RL on generated math tasks in
//! the real tool-call environment ([`clawrl::env::tool_call::ToolCallEnv`]: every call runs
//! `python3` in the sandbox), once per reward arm — **integrated** (episode outcome plus each
//! step's process score from [`super::prm`]) and **outcome-only** — with the same seed, task
//! draws, sampling seeds and budget, and measure the success rate on held-out tasks after the
//! configured numbers of updates.
//!
//! **One update.** `tasks_per_update` train tasks are drawn (the same for both arms: the draw
//! depends only on the seed and the update number) and each is rolled out `group_size` times
//! ([`clawrl::env::reward::group_plan`]: group `r{update}-t{k}`, distinct seeds). A rollout is a
//! multi-step episode: the policy's response is decoded and parsed into a tool call or a plain
//! answer ([`clawrl::pipeline::policy::action_of`]), the environment runs it, and the tool's
//! messages are appended to the transcript by token concatenation. Each tool step gets one PRM
//! vote; the final answer step, having no next state, gets none. Step rewards and advantages
//! come from [`clawrl::env::reward::group_advantages`] (kind `tool_call`: `outcome + prm`,
//! z-scored within (group, step index) buckets; [`RewardMode::OutcomeOnly`] sets `prm = 0`).
//! Every surviving step becomes one learner sample (its prompt is the transcript up to the
//! step, its response the step's sampled ids, every token carrying the step's advantage), and
//! the learner takes one optimizer step on all of them.
//!
//! **Success rate.** Each held-out task is rolled out `eval_samples` times (temperature
//! `temperature`, seeds fixed per task and sample, the same at every measurement and for both
//! arms); the rate is the fraction of episodes whose outcome is a correct answer.
//!
//! This loop runs in-process over the generation engine and the learner, not through the job
//! actors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use futures::future::join_all;
use rand::seq::index::sample as sample_indices;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::prm::judge_step;
use super::sft::{warm_start, SftError, SftSettings};
use super::tasks::{task_sets, GenTask};
use super::tokenizer::continuation_ids;
use crate::experiments::warm_start::SftOutcome;
use clawrl::env::reward::{
    check_groups, group_advantages, group_plan, RewardError, RewardMode, ScoredEpisode,
};
use clawrl::env::{EnvBuildError, EnvOptions, ToolCallEnv};
use clawrl::model::{
    load_checkpoint, load_model, spawn_engine, Checkpoint, EngineError, EngineOptions,
    GenerationRequest, LoadError, Qwen3, SamplingParams,
};
use clawrl::pipeline::policy::action_of;
use clawrl::rl::{Aggregation, EpisodeKind};
use clawrl::train::learner::{BurnLearner, StepError};
use clawrl::train::{Sample, TrainConfig};
use clawrl::watch::scalars::{JudgedPoint, ScalarWriter, StepPoint};
use clawrl_actors::loops::{Environment, Episode};

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

/// The `[experiment]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentSettings {
    /// Reward arms to run, in order.
    pub arms: Vec<RewardMode>,
    /// Optimizer steps per arm.
    pub updates: usize,
    /// After how many updates to measure (0 = the warm start).
    pub eval_at: Vec<usize>,
    /// Train tasks per update.
    pub tasks_per_update: usize,
    /// Episodes per task in a group.
    pub group_size: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Coefficient of the k3 KL term against the warm start (0 disables it).
    pub kl_coef: f64,
    /// Most `code_interpreter` calls of an episode.
    pub max_tool_calls: u32,
    /// Episodes per held-out task at a measurement.
    pub eval_samples: usize,
    /// Sampling temperature of rollouts and measurements.
    pub temperature: f32,
    /// Longest response of one step.
    pub max_new_tokens: usize,
    /// Seed of the task draws per update, the sampling and the learner.
    pub seed: u64,
}

impl Default for ExperimentSettings {
    fn default() -> Self {
        Self {
            arms: vec![RewardMode::Integrated, RewardMode::OutcomeOnly],
            updates: 30,
            eval_at: vec![0, 15, 30],
            tasks_per_update: 8,
            group_size: 8,
            lr: 1e-3,
            kl_coef: 0.0,
            max_tool_calls: 3,
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
    /// The warm start failed.
    #[error(transparent)]
    Sft(#[from] SftError),
    /// The warm-start checkpoint could not be loaded.
    #[error("loading the warm start: {0}")]
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
    /// Rewards could not be computed.
    #[error(transparent)]
    Reward(#[from] RewardError),
    /// A learner step failed.
    #[error("learner: {0}")]
    Step(#[from] StepError),
    /// Writing results failed.
    #[error("writing {path}: {message}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl ExperimentFile {
    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ExperimentError> {
        let file: ExperimentFile = toml::from_str(text).map_err(|e| ExperimentError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        file.validate().map_err(|message| ExperimentError::Parse {
            path: origin.to_string(),
            message,
        })?;
        Ok(file)
    }

    /// Reads and validates a file.
    pub fn from_file(path: &Path) -> Result<Self, ExperimentError> {
        let text = std::fs::read_to_string(path).map_err(|source| ExperimentError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Checks every value; the message names the key.
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
            ("experiment.tasks_per_update", x.tasks_per_update),
            ("experiment.group_size", x.group_size),
            ("experiment.eval_samples", x.eval_samples),
            ("experiment.max_new_tokens", x.max_new_tokens),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        if x.tasks_per_update > t.train {
            return Err("experiment.tasks_per_update exceeds tasks.train".into());
        }
        if x.arms.is_empty() {
            return Err("experiment.arms is empty".into());
        }
        if x.max_tool_calls == 0 {
            return Err("experiment.max_tool_calls must be at least 1".into());
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
}

/// The name of an arm.
pub fn arm_name(mode: RewardMode) -> &'static str {
    match mode {
        RewardMode::Integrated => "integrated",
        RewardMode::OutcomeOnly => "outcome_only",
    }
}

/// One step of a rolled-out episode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRecord {
    /// The prompt ids (the transcript up to this step).
    #[serde(skip)]
    pub prompt_ids: Vec<u32>,
    /// The sampled ids.
    #[serde(skip)]
    pub response_ids: Vec<u32>,
    /// Their rollout log-probs.
    #[serde(skip)]
    pub logprobs: Vec<f32>,
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

/// What one update did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdateLog {
    /// 1-based update number.
    pub update: usize,
    /// Episodes rolled out.
    pub episodes: usize,
    /// Of those, correct.
    pub correct: usize,
    /// Tool steps, and how many the PRM scored `+1`.
    pub tool_steps: usize,
    /// See `tool_steps`.
    pub prm_positive: usize,
    /// Steps rolled out, and how many survived z-scoring as samples.
    pub steps: usize,
    /// See `steps`.
    pub trained: usize,
    /// The learner's loss.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean |log-prob after the step − rollout log-prob| over the batch's tokens: how far the
    /// update moved the policy on what it trained on.
    pub shift: f64,
}

/// One arm's run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmRun {
    /// The arm.
    pub arm: String,
    /// Measurements, in `eval_at` order.
    pub measurements: Vec<Measurement>,
    /// Every update.
    pub updates: Vec<UpdateLog>,
    /// Seconds for this arm.
    pub seconds: f64,
}

/// Everything the experiment measured (`details.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
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

/// The policy-side helpers.
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
                    prompt_ids: std::mem::take(&mut prompts[k]),
                    response_ids: gen.response_ids.clone(),
                    logprobs: gen.logprobs,
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

/// The learner samples of one update's episodes under `mode`.
pub fn update_samples(
    mode: RewardMode,
    episodes: &[EpisodeRecord],
    groups: &[String],
    group_size: usize,
) -> Result<Vec<Sample>, ExperimentError> {
    let scored: Vec<ScoredEpisode> = episodes
        .iter()
        .zip(groups)
        .map(|(e, g)| ScoredEpisode {
            group: g.clone(),
            outcome: e.outcome,
            step_votes: e
                .steps
                .iter()
                .map(|s| s.prm.map(|v| vec![Some(v)]).unwrap_or_default())
                .collect(),
        })
        .collect();
    check_groups(&scored, group_size)?;
    let adv = group_advantages(EpisodeKind::ToolCall, mode, Aggregation::Mean, &scored)?;
    Ok(adv
        .into_iter()
        .map(|a| {
            let s = &episodes[a.episode].steps[a.step as usize];
            Sample {
                prompt_ids: s.prompt_ids.clone(),
                response_ids: s.response_ids.clone(),
                advantages: vec![a.advantage as f32; s.response_ids.len()],
                old_logprobs: None,
                ref_logprobs: None,
                rollout_logprobs: Some(s.logprobs.clone()),
                opd: None,
                importance: None,
            }
        })
        .collect())
}

/// Runs the experiment described by `file`, writing `results.json`, `details.json` and
/// `success.png` into `run_dir`.
pub fn run(file: &ExperimentFile, run_dir: &Path) -> Result<Report, ExperimentError> {
    file.validate().map_err(|message| ExperimentError::Parse {
        path: "<settings>".into(),
        message,
    })?;
    let started = Instant::now();
    let write_err = |path: &Path, message: String| ExperimentError::Write {
        path: path.to_path_buf(),
        message,
    };
    std::fs::create_dir_all(run_dir).map_err(|e| write_err(run_dir, e.to_string()))?;
    let t = &file.tasks;
    let (train, held) = task_sets(t.seed, t.operand_min, t.operand_max, t.train, t.held_out);
    let sft = warm_start(&file.sft, &train, &file.cache_dir(), false)?;
    tracing::info!(dir = %sft.dir.display(), cached = sft.cached, secs = sft.seconds, "toolagent: warm start ready");
    let x = file.experiment.clone();
    let ck = load_checkpoint::<clawrl::CpuBackend>(&sft.dir, &Default::default())?;
    let stop = ck.stop_token_ids();
    let max_positions = ck.config.max_position_embeddings;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| write_err(run_dir, format!("starting the runtime: {e}")))?;
    let world = World {
        ck,
        stop,
        settings: x.clone(),
        max_positions,
        rt,
    };
    let options = || EnvOptions {
        max_tool_calls: x.max_tool_calls,
        max_concurrent_commands: 8,
        warm_workdirs: 4,
        ..EnvOptions::default()
    };
    clawrl::sandbox::probe().map_err(EnvBuildError::from)?;
    let train_env = ToolCallEnv::new(train.iter().map(GenTask::math_task).collect(), options())?;
    let eval_env = ToolCallEnv::new(held.iter().map(GenTask::math_task).collect(), options())?;
    let initial = Arc::new(world.ck.model.clone());
    let base = if x.eval_at.first() == Some(&0) {
        let m = world.measure(initial.clone(), &eval_env, &held, 0)?;
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
    for &mode in &x.arms {
        let t0 = Instant::now();
        let (cfg, model) = load_model::<clawrl::CpuAutodiff>(&sft.dir, &Default::default())?;
        let train_cfg = TrainConfig {
            lr: x.lr,
            kl_coef: x.kl_coef,
            batch_size: x.tasks_per_update * x.group_size,
            ..TrainConfig::default()
        };
        let mut learner: BurnLearner =
            BurnLearner::new(cfg, model, train_cfg, Default::default(), x.seed);
        // Each arm's scalars are a TensorBoard run of their own: `tb/<arm>/`.
        let tb_dir = clawrl::watch::scalars::tb_dir(run_dir).join(arm_name(mode));
        let mut tb =
            ScalarWriter::create(&tb_dir).map_err(|e| write_err(&tb_dir, e.to_string()))?;
        let mut measurements: Vec<Measurement> = base.iter().cloned().collect();
        let mut logs = Vec::new();
        for update in 1..=x.updates {
            let policy = Arc::new(learner.policy().valid());
            let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(x.seed, update as u64));
            let drawn = sample_indices(&mut rng, train.len(), x.tasks_per_update).into_vec();
            let members = group_plan(drawn.len(), x.group_size, mix_seed(x.seed, update as u64))?;
            let plan: Vec<(usize, u64)> = members.iter().map(|m| (drawn[m.task], m.seed)).collect();
            let groups: Vec<String> = members.iter().map(|m| m.group.clone()).collect();
            let eps = world.rollout(policy, &train_env, &train, &plan)?;
            let batch = update_samples(mode, &eps, &groups, x.group_size)?;
            // Each tool call's step score from the rule-based PRM is one judged step (one vote,
            // never failed, no hint).
            for p in eps.iter().flat_map(|e| &e.steps).filter_map(|s| s.prm) {
                tb.log().judged(&JudgedPoint {
                    judged: true,
                    reward: p,
                    hint_accepted: false,
                    votes: 1,
                    failed_votes: 0,
                });
            }
            let tool_steps = eps
                .iter()
                .flat_map(|e| &e.steps)
                .filter(|s| s.prm.is_some());
            let mut log = UpdateLog {
                update,
                episodes: eps.len(),
                correct: eps.iter().filter(|e| e.outcome > 0.0).count(),
                tool_steps: tool_steps.clone().count(),
                prm_positive: tool_steps.filter(|s| s.prm == Some(1)).count(),
                steps: eps.iter().map(|e| e.steps.len()).sum(),
                trained: batch.len(),
                loss: f64::NAN,
                grad_norm: f64::NAN,
                shift: f64::NAN,
            };
            if !batch.is_empty() {
                let t0 = Instant::now();
                let m = learner.step(&batch)?;
                let step_ms = t0.elapsed().as_secs_f64() * 1e3;
                tb.step(&StepPoint::of_metrics(&m, batch.len(), step_ms));
                log.loss = m.loss;
                log.grad_norm = m.grad_norm;
                let after = learner.logprobs(&batch)?;
                let (mut sum, mut n) = (0f64, 0usize);
                for (s, lp) in batch.iter().zip(&after) {
                    for (a, b) in lp.iter().zip(s.rollout_logprobs.iter().flatten()) {
                        sum += (a - b).abs() as f64;
                        n += 1;
                    }
                }
                log.shift = sum / n.max(1) as f64;
            }
            tracing::info!(
                arm = arm_name(mode),
                update,
                correct = log.correct,
                episodes = log.episodes,
                prm_positive = log.prm_positive,
                tool_steps = log.tool_steps,
                trained = log.trained,
                loss = log.loss,
                "toolagent: update"
            );
            logs.push(log);
            if x.eval_at.contains(&update) {
                let m =
                    world.measure(Arc::new(learner.policy().valid()), &eval_env, &held, update)?;
                tracing::info!(
                    arm = arm_name(mode),
                    update,
                    success = m.success,
                    "toolagent: measured"
                );
                measurements.push(m);
            }
        }
        runs.push(ArmRun {
            arm: arm_name(mode).to_string(),
            measurements,
            updates: logs,
            seconds: t0.elapsed().as_secs_f64(),
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
    let write_json = |name: &str, text: String| {
        let p = run_dir.join(name);
        std::fs::write(&p, text).map_err(|e| write_err(&p, e.to_string()))
    };
    let results = crate::experiments::personal::experiment::Results {
        updates: report.eval_at.clone(),
        scores: report.success.clone(),
        ..Default::default()
    };
    write_json(
        "results.json",
        serde_json::to_string_pretty(&results).expect("results serialize"),
    )?;
    write_json(
        "details.json",
        serde_json::to_string_pretty(&report).expect("report serializes"),
    )?;
    let png = run_dir.join("success.png");
    crate::experiments::personal::plot::plot_scores(&results, &png)
        .map_err(|e| write_err(&png, e.message))?;
    Ok(report)
}

/// The success table of a report, one line per arm (the README's table).
pub fn summary_table(report: &Report) -> String {
    let mut out = String::from("| reward |");
    for u in &report.eval_at {
        out.push_str(&format!(" {u} updates |"));
    }
    out.push_str("\n| --- |");
    for _ in &report.eval_at {
        out.push_str(" --- |");
    }
    for r in &report.runs {
        out.push_str(&format!("\n| {} |", r.arm));
        for m in &r.measurements {
            out.push_str(&format!(" {:.2} |", m.success));
        }
    }
    out
}

/// `clawrl run <tool-call experiment file>`: runs it into `out` (default
/// `runs/tool-call-agent-<unix time>`) and prints the success table, or the whole report as
/// JSON with `json`. `seed` replaces the file's `experiment.seed`.
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
    let report = run(&file, &run_dir)?;
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
        std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/tool_call_agent.toml"
        ))
        .unwrap()
    }

    #[test]
    fn the_example_parses_and_bad_values_name_the_key() {
        let text = example_text();
        let f = ExperimentFile::from_toml_str(&text, "t.toml").unwrap();
        assert_eq!(
            f.experiment.arms,
            vec![RewardMode::Integrated, RewardMode::OutcomeOnly]
        );
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
    }

    fn record(outcome: f64, prms: &[Option<i8>]) -> EpisodeRecord {
        EpisodeRecord {
            task: 0,
            question: String::new(),
            steps: prms
                .iter()
                .enumerate()
                .map(|(i, p)| StepRecord {
                    prompt_ids: vec![1, 2],
                    response_ids: vec![10 + i as u32; 3],
                    logprobs: vec![-0.5; 3],
                    text: String::new(),
                    calls: usize::from(p.is_some()),
                    results: Vec::new(),
                    prm: *p,
                })
                .collect(),
            outcome,
            finish: "answer".into(),
        }
    }

    #[test]
    fn process_scores_separate_failures_only_in_the_integrated_arm() {
        // One group of three: solved (good call), failed after a good call, failed after a bad
        // call. Outcome-only cannot tell the two failures apart at step 0; integrated can.
        let eps = [
            record(1.0, &[Some(1), None]),
            record(-1.0, &[Some(1), None]),
            record(-1.0, &[Some(-1), None]),
        ];
        let groups = vec!["g".to_string(); 3];
        let adv = |mode| {
            update_samples(mode, &eps, &groups, 3)
                .unwrap()
                .iter()
                .map(|s| s.advantages[0])
                .collect::<Vec<f32>>()
        };
        let o = adv(RewardMode::OutcomeOnly);
        let i = adv(RewardMode::Integrated);
        // Both arms: 3 step-0 samples and 3 step-1 samples.
        assert_eq!((o.len(), i.len()), (6, 6));
        // Outcome-only: the two failures get the same step-0 advantage.
        assert_eq!(o[2], o[4]);
        // Integrated: the good call of the failed episode is above the bad one.
        assert!(i[2] > i[4] && i[0] > i[2], "{i:?}");
        let err = update_samples(RewardMode::Integrated, &eps[..2], &groups[..2], 3).unwrap_err();
        assert!(err.to_string().contains("retry"), "{err}");
    }
}
