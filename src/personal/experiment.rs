//! The personal-agent experiment: warm-start a small policy ([`super::sft`]),
//! then for each method — binary RL, OPD, combined — train it online against the simulated
//! student and teacher of [`crate::env::personal`] with a scripted judge, and measure the
//! personalization score of first responses on held-out prompts after the configured numbers
//! of updates.
//!
//! **Personalization score.** For each held-out task (half student, half teacher, from the
//! held-out split of [`super::corpus::Split`]) the policy samples `eval_samples` first responses
//! (temperature `temperature`, seeds fixed per task and sample, the same at every measurement and
//! for every method); the score is the fraction of those responses that satisfy their user's
//! rules ([`super::style::satisfies`]), the same deterministic rules the simulated users reply by.
//!
//! **One update.** Rounds of `batch_size` conversations (train-split tasks drawn at random) are
//! rolled out on the current weights through the generation engine; each first response goes to
//! its user, whose reply is judged (`m` evaluation votes, and for OPD/combined `hint_m` hint
//! votes) by the configured judge. Each turn becomes a training sample by the method's rule:
//! binary RL — docs/design.md §1's selection ([`crate::rl::binary_samples`]) with the majority reward on
//! every token; OPD — only turns with an accepted hint, advantage `teacher_k − old_k` where the
//! teacher (current or frozen initial policy, `judge.opd.teacher`) scores the original response
//! under the hint-enhanced prompt ([`crate::judge::TeacherModel`]); combined — the four cases of
//! docs/design.md §1 ([`crate::judge::TeacherModel::combined_sample`]). Rounds continue until
//! `batch_size` samples are pending (at most `max_rounds` rounds); the learner then takes one
//! optimizer step on `batch_size` of them (leftovers wait for the next update, as the trainer
//! keeps accepted samples). This loop runs in-process over the engine and the learner; it does
//! not go through the cluster's actor pipeline.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use futures::future::join_all;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::corpus::Split;
use super::sft::{warm_start, SftError, SftOutcome, SftSettings};
use super::style::{satisfies, UserKind};
use crate::env::personal::{PersonalEnv, PersonalEnvError, UserSettings};
use crate::judge::{
    Judge, JudgeConfig, JudgeConfigError, Teacher, TeacherError, TeacherModel, TurnMaterial,
};
use crate::model::{
    load_checkpoint, load_model, score_response, spawn_engine, Checkpoint, EngineError,
    EngineOptions, GenerationRequest, GenerationResult, LoadError, Qwen3, SamplingParams,
};
use crate::rl::{binary_samples, opd_advantages, AdvantageError, BinaryTurn};
use crate::train::learner::{BurnLearner, StepError};
use crate::train::{Sample, TrainConfig};
use crate::watch::scalars::{JudgedPoint, ScalarWriter, StepPoint};
use clawrl_actors::loops::Action;

/// The job kind of an experiment file.
pub const KIND: &str = "personal_experiment";

/// A training method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Binary RL from the evaluative signal.
    Binary,
    /// Hindsight-guided on-policy distillation from the directive signal.
    Opd,
    /// Both.
    Combined,
}

impl Method {
    /// `binary` / `opd` / `combined`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Binary => "binary",
            Method::Opd => "opd",
            Method::Combined => "combined",
        }
    }
}

/// The `[experiment]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentSettings {
    /// Methods to run, in order.
    pub methods: Vec<Method>,
    /// Optimizer steps per method.
    pub updates: usize,
    /// After how many updates to measure (0 = the warm start).
    pub eval_at: Vec<usize>,
    /// Samples per update.
    pub batch_size: usize,
    /// AdamW learning rate of the RL updates.
    pub lr: f64,
    /// Coefficient of the k3 KL term against the warm start (0 disables it).
    pub kl_coef: f64,
    /// Train-split tasks per user.
    pub train_tasks_per_user: usize,
    /// Held-out tasks per user.
    pub eval_tasks_per_user: usize,
    /// First responses sampled per held-out task.
    pub eval_samples: usize,
    /// Sampling temperature of rollouts and measurements.
    pub temperature: f32,
    /// Longest response.
    pub max_new_tokens: usize,
    /// Rollout rounds (of `batch_size` conversations) per update at most.
    pub max_rounds: usize,
    /// Seed of task draws, sampling and the learner.
    pub seed: u64,
}

impl Default for ExperimentSettings {
    fn default() -> Self {
        Self {
            methods: vec![Method::Binary, Method::Opd, Method::Combined],
            updates: 16,
            eval_at: vec![0, 8, 16],
            batch_size: 16,
            lr: 1e-3,
            kl_coef: 0.02,
            train_tasks_per_user: 128,
            eval_tasks_per_user: 32,
            eval_samples: 2,
            temperature: 1.0,
            max_new_tokens: 40,
            max_rounds: 8,
            seed: 1,
        }
    }
}

/// An experiment file (`examples/personal.toml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentFile {
    /// Must be `personal_experiment`.
    pub kind: String,
    /// A name for logs.
    #[serde(default = "default_name")]
    pub name: String,
    /// Where the SFT checkpoint is cached (default `target/clawrl-cache/personal`, relative to
    /// the working directory).
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// The warm start.
    #[serde(default)]
    pub sft: SftSettings,
    /// The RL runs.
    #[serde(default)]
    pub experiment: ExperimentSettings,
    /// The simulated users.
    #[serde(default)]
    pub users: UserSettings,
    /// The judge (backend, votes, OPD teacher and weights).
    pub judge: JudgeConfig,
}

fn default_name() -> String {
    "personal".into()
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
    /// The environment refused its settings.
    #[error(transparent)]
    Env(#[from] PersonalEnvError),
    /// An episode failed.
    #[error("episode: {0}")]
    Episode(#[from] clawrl_actors::loops::EnvError),
    /// The judge config is invalid.
    #[error(transparent)]
    Judge(#[from] JudgeConfigError),
    /// Rendering or tokenizing failed.
    #[error("prompt: {0}")]
    Chat(#[from] crate::model::ChatError),
    /// Generation failed.
    #[error("generation: {0}")]
    Engine(#[from] EngineError),
    /// Teacher scoring failed.
    #[error(transparent)]
    Teacher(#[from] TeacherError),
    /// Advantages could not be built.
    #[error(transparent)]
    Advantage(#[from] AdvantageError),
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
        let bad = |message: String| ExperimentError::Parse {
            path: origin.to_string(),
            message,
        };
        let file: ExperimentFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if file.kind != KIND {
            return Err(bad(format!(
                "kind = {:?}: this runner only runs kind = {KIND:?}",
                file.kind
            )));
        }
        let x = &file.experiment;
        if x.methods.is_empty() {
            return Err(bad("experiment.methods is empty".into()));
        }
        for (key, v) in [
            ("experiment.batch_size", x.batch_size),
            ("experiment.train_tasks_per_user", x.train_tasks_per_user),
            ("experiment.eval_tasks_per_user", x.eval_tasks_per_user),
            ("experiment.eval_samples", x.eval_samples),
            ("experiment.max_new_tokens", x.max_new_tokens),
            ("experiment.max_rounds", x.max_rounds),
        ] {
            if v == 0 {
                return Err(bad(format!("{key} must be at least 1")));
            }
        }
        if let Some(&e) = x.eval_at.iter().find(|&&e| e > x.updates) {
            return Err(bad(format!(
                "experiment.eval_at holds {e}, more than experiment.updates = {}",
                x.updates
            )));
        }
        if !x.eval_at.windows(2).all(|w| w[0] < w[1]) || x.eval_at.is_empty() {
            return Err(bad(
                "experiment.eval_at must be a non-empty, strictly increasing list".into(),
            ));
        }
        if !(x.lr.is_finite() && x.lr > 0.0) {
            return Err(bad(format!("experiment.lr = {} must be > 0", x.lr)));
        }
        if !(x.kl_coef.is_finite() && x.kl_coef >= 0.0) {
            return Err(bad(format!(
                "experiment.kl_coef = {} must be >= 0",
                x.kl_coef
            )));
        }
        if !(x.temperature.is_finite() && x.temperature > 0.0) {
            return Err(bad(format!(
                "experiment.temperature = {} must be > 0",
                x.temperature
            )));
        }
        file.sft.validate().map_err(|e| bad(format!("{e}")))?;
        file.judge
            .build(None)
            .map_err(|e| bad(format!("judge: {e}")))?;
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

    /// The SFT cache directory.
    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("target/clawrl-cache/personal"))
    }
}

/// `results.json`: scores of each method after each measured number of updates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// The measured numbers of updates.
    pub updates: Vec<usize>,
    /// Method name → one score per entry of `updates`.
    pub scores: BTreeMap<String, Vec<f64>>,
}

/// What one update did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdateLog {
    /// 1-based update number.
    pub update: usize,
    /// Conversations rolled out for it.
    pub rollouts: usize,
    /// Of those, how many satisfied their user (the training-time reward rate).
    pub satisfied: usize,
    /// Of those, how many got an accepted hint (OPD / combined).
    pub hints: usize,
    /// Samples in the optimizer step.
    pub trained: usize,
    /// Samples left waiting for the next update.
    pub pending: usize,
    /// The learner's loss.
    pub loss: f64,
    /// The k3 KL estimate.
    pub kl: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean |rollout − trainer| log-prob gap of the batch.
    pub rollout_gap: Option<f64>,
}

/// One measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measurement {
    /// After this many updates.
    pub updates: usize,
    /// The personalization score.
    pub score: f64,
    /// The score over student tasks only.
    pub student: f64,
    /// The score over teacher tasks only.
    pub teacher: f64,
    /// A few first responses (task id, response).
    pub examples: Vec<(String, String)>,
}

/// One method's run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MethodRun {
    /// The method.
    pub method: Method,
    /// Measurements, in `eval_at` order.
    pub measurements: Vec<Measurement>,
    /// Every update.
    pub updates: Vec<UpdateLog>,
    /// Seconds for training and measuring this method.
    pub seconds: f64,
}

/// Everything the experiment measured (`details.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The scores table.
    pub results: Results,
    /// The warm start.
    pub sft: SftOutcome,
    /// The warm start measured with each user's whole directive as a hint on every held-out
    /// question: how well it follows the instruction an OPD teacher sees.
    pub instructed: Measurement,
    /// Per method.
    pub runs: Vec<MethodRun>,
    /// Seconds for the whole experiment (warm start included).
    pub seconds: f64,
}

/// The policy-side helpers shared by rollouts and measurements.
struct World {
    ck: Checkpoint<crate::CpuBackend>,
    stop: Vec<u32>,
    settings: ExperimentSettings,
    max_context: usize,
}

impl World {
    fn prompt(&self, messages: &[serde_json::Value]) -> Result<Vec<u32>, ExperimentError> {
        let v = minijinja::Value::from_serialize(messages);
        Ok(self.ck.encode_chat(&v, None)?.ids)
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.ck.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// Samples one response per prompt on `model` (all submitted at once, batched by the
    /// engine).
    fn generate(
        &self,
        model: Arc<Qwen3<crate::CpuBackend>>,
        prompts: &[(Vec<u32>, u64)],
    ) -> Result<Vec<GenerationResult>, ExperimentError> {
        let engine = spawn_engine(
            model,
            None,
            EngineOptions {
                max_batch: 32,
                max_context: self.max_context,
                ..EngineOptions::default()
            },
        );
        let rxs: Vec<_> = prompts
            .iter()
            .map(|(ids, seed)| {
                engine.submit(GenerationRequest {
                    prompt_ids: ids.clone(),
                    params: SamplingParams {
                        temperature: self.settings.temperature,
                        top_p: 1.0,
                        top_k: 0,
                        max_new_tokens: self.settings.max_new_tokens,
                        stop_token_ids: self.stop.clone(),
                        stop_strings: Vec::new(),
                        seed: *seed,
                    },
                    raw_logprobs: None,
                })
            })
            .collect();
        rxs.into_iter()
            .map(|rx| {
                rx.blocking_recv()
                    .map_err(|_| EngineError::Closed)?
                    .map_err(ExperimentError::from)
            })
            .collect()
    }

    /// The personalization score of `model` on the held-out tasks. With `instructed`, each
    /// question carries the user's whole directive as a hint (what an OPD teacher sees at
    /// best), which measures how well the model follows instructions.
    fn measure(
        &self,
        model: Arc<Qwen3<crate::CpuBackend>>,
        eval: &PersonalEnv,
        updates: usize,
        instructed: bool,
    ) -> Result<Measurement, ExperimentError> {
        let mut prompts = Vec::new();
        let mut users = Vec::new();
        for (i, task) in eval.tasks().iter().enumerate() {
            let ep = eval.episode(i, 0)?;
            let mut messages = clawrl_actors::loops::Episode::observation(&ep).messages;
            if instructed {
                let hint = super::style::directive_phrases(task.user).join(" , ");
                let last = messages.len() - 1;
                let text = messages[last]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                messages[last]["content"] =
                    serde_json::Value::String(format!("{text}{}{hint}", crate::judge::HINT_PREFIX));
            }
            let ids = self.prompt(&messages)?;
            for s in 0..self.settings.eval_samples {
                let seed = self.settings.seed ^ 0xe7a1_0000 ^ ((i as u64) << 8) ^ s as u64;
                prompts.push((ids.clone(), seed));
                users.push((task.user, task.id()));
            }
        }
        let out = self.generate(model, &prompts)?;
        let mut ok = BTreeMap::<UserKind, (usize, usize)>::new();
        let mut examples = Vec::new();
        for (g, (user, id)) in out.iter().zip(&users) {
            let text = self.decode(&g.response_ids);
            let e = ok.entry(*user).or_default();
            e.0 += usize::from(satisfies(*user, &text));
            e.1 += 1;
            if examples.len() < 6 && (examples.len() % 2 == 0) == (*user == UserKind::Student) {
                examples.push((id.clone(), text));
            }
        }
        let frac = |(a, n): (usize, usize)| if n == 0 { 0.0 } else { a as f64 / n as f64 };
        let total = ok
            .values()
            .fold((0, 0), |acc, v| (acc.0 + v.0, acc.1 + v.1));
        Ok(Measurement {
            updates,
            score: frac(total),
            student: frac(ok.get(&UserKind::Student).copied().unwrap_or_default()),
            teacher: frac(ok.get(&UserKind::Teacher).copied().unwrap_or_default()),
            examples,
        })
    }
}

/// One rolled-out, judged conversation turn.
struct Turn {
    messages: Vec<serde_json::Value>,
    prompt_ids: Vec<u32>,
    gen: GenerationResult,
    satisfied: bool,
    reward: i8,
    hint: Option<String>,
    /// What the turn adds to the run's judge scalars.
    point: JudgedPoint,
}

/// Rolls out one round of conversations on `policy` and judges them.
fn round(
    world: &World,
    policy: &Arc<Qwen3<crate::CpuBackend>>,
    env: &PersonalEnv,
    judge: &Judge,
    with_hint: bool,
    rng: &mut ChaCha8Rng,
    rt: &tokio::runtime::Runtime,
) -> Result<Vec<Turn>, ExperimentError> {
    let n = world.settings.batch_size;
    let mut episodes = Vec::with_capacity(n);
    let mut prompts = Vec::with_capacity(n);
    for _ in 0..n {
        let index = rng.random_range(0..env.tasks().len());
        let ep = env.episode(index, rng.random())?;
        let messages = clawrl_actors::loops::Episode::observation(&ep).messages;
        prompts.push((world.prompt(&messages)?, rng.random()));
        episodes.push((ep, messages));
    }
    let gens = world.generate(policy.clone(), &prompts)?;
    let mut judged = Vec::with_capacity(n);
    let mut pending = Vec::with_capacity(n);
    for ((mut ep, messages), (gen, (prompt_ids, _))) in
        episodes.into_iter().zip(gens.into_iter().zip(prompts))
    {
        let content = world.decode(&gen.response_ids);
        let raw = world
            .ck
            .tokenizer
            .decode(&gen.response_ids, false)
            .unwrap_or_default();
        let (_, reply) = ep.apply(&Action {
            content: content.clone(),
            tool_calls: Vec::new(),
            raw,
        })?;
        judged.push(TurnMaterial {
            response: content,
            next_state: reply.text.clone(),
            next_state_role: "user".into(),
        });
        pending.push((messages, prompt_ids, gen, reply.satisfied));
    }
    let judgements = rt.block_on(join_all(
        judged.into_iter().map(|m| judge.judge_turn(m, with_hint)),
    ));
    Ok(pending
        .into_iter()
        .zip(judgements)
        .map(|((messages, prompt_ids, gen, satisfied), j)| Turn {
            point: JudgedPoint::of_record(&j.record("", 0, None)),
            messages,
            prompt_ids,
            gen,
            satisfied,
            reward: j.reward,
            hint: j.hint,
        })
        .collect())
}

/// Turns judged turns into training samples by `method`.
fn samples(
    method: Method,
    turns: &[Turn],
    teacher: &TeacherModel<'_, crate::CpuBackend>,
    old_model: &Qwen3<crate::CpuBackend>,
    weights: crate::rl::AdvantageWeights,
) -> Result<Vec<Sample>, ExperimentError> {
    let sample = |t: &Turn, advantages: Vec<f32>| Sample {
        prompt_ids: t.prompt_ids.clone(),
        response_ids: t.gen.response_ids.clone(),
        advantages,
        old_logprobs: None,
        ref_logprobs: None,
        rollout_logprobs: Some(t.gen.logprobs.clone()),
        opd: None,
        importance: None,
    };
    let mut out = Vec::new();
    match method {
        Method::Binary => {
            let bt: Vec<BinaryTurn> = turns
                .iter()
                .enumerate()
                .map(|(i, t)| BinaryTurn {
                    session_id: format!("s{i}"),
                    turn: 0,
                    has_next_state: true,
                    reward: t.reward,
                })
                .collect();
            for b in binary_samples(&bt) {
                let t = &turns[b.index];
                out.push(sample(t, vec![b.advantage; t.gen.response_ids.len()]));
            }
        }
        Method::Opd | Method::Combined => {
            for t in turns {
                let messages = minijinja::Value::from_serialize(&t.messages);
                let old = score_response(old_model, &t.prompt_ids, &t.gen.response_ids);
                if method == Method::Opd {
                    let Some(hint) = &t.hint else { continue };
                    let teacher_lp = teacher.logprobs(
                        &messages,
                        None,
                        &Default::default(),
                        hint,
                        &t.gen.response_ids,
                    )?;
                    let adv = opd_advantages(&teacher_lp, &old)?;
                    out.push(sample(t, adv.iter().map(|a| a * weights.w_opd).collect()));
                } else if let Some(c) = teacher.combined_sample(
                    weights,
                    t.reward,
                    t.hint.as_deref(),
                    &messages,
                    None,
                    &t.gen.response_ids,
                    &old,
                )? {
                    out.push(sample(t, c.advantages));
                }
            }
        }
    }
    Ok(out)
}

/// Runs the experiment described by `file`, writing `results.json`, `details.json` and
/// `scores.png` into `run_dir`.
pub fn run(file: &ExperimentFile, run_dir: &Path) -> Result<Report, ExperimentError> {
    let started = Instant::now();
    let write_err = |path: &Path, message: String| ExperimentError::Write {
        path: path.to_path_buf(),
        message,
    };
    std::fs::create_dir_all(run_dir).map_err(|e| write_err(run_dir, e.to_string()))?;
    let sft = warm_start(&file.sft, &file.cache_dir(), false)?;
    tracing::info!(dir = %sft.dir.display(), cached = sft.cached, "personal: warm start ready");
    let x = file.experiment.clone();
    let ck = load_checkpoint::<crate::CpuBackend>(&sft.dir, &Default::default())?;
    let stop = ck.stop_token_ids();
    let max_context = ck.config.max_position_embeddings;
    let world = World {
        ck,
        stop,
        settings: x.clone(),
        max_context,
    };
    let train_env = PersonalEnv::new(
        PersonalEnv::sample_tasks(Split::Train, x.train_tasks_per_user, x.seed),
        file.users.clone(),
    )?;
    let eval_env = PersonalEnv::new(
        PersonalEnv::sample_tasks(Split::HeldOut, x.eval_tasks_per_user, x.seed ^ 0xe7a1),
        file.users.clone(),
    )?;
    let judge = file.judge.build(None)?;
    let weights = file.judge.opd.weights();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| write_err(run_dir, format!("starting the judge runtime: {e}")))?;
    let initial = Arc::new(world.ck.model.clone());
    let base = if x.eval_at.first() == Some(&0) {
        Some(world.measure(initial.clone(), &eval_env, 0, false)?)
    } else {
        None
    };
    let instructed = world.measure(initial.clone(), &eval_env, 0, true)?;
    tracing::info!(
        score = instructed.score,
        "personal: warm start with the full directive as a hint"
    );
    let mut runs = Vec::new();
    for &method in &x.methods {
        let t0 = Instant::now();
        let (cfg, model) = load_model::<crate::CpuAutodiff>(&sft.dir, &Default::default())?;
        let train = TrainConfig {
            lr: x.lr,
            kl_coef: x.kl_coef,
            batch_size: x.batch_size,
            ..TrainConfig::default()
        };
        let mut learner: BurnLearner =
            BurnLearner::new(cfg, model, train, Default::default(), x.seed);
        // Each method's scalars are a TensorBoard run of their own: `tb/<method>/`.
        let tb_dir = crate::watch::scalars::tb_dir(run_dir).join(method.name());
        let mut tb =
            ScalarWriter::create(&tb_dir).map_err(|e| write_err(&tb_dir, e.to_string()))?;
        let mut rng = ChaCha8Rng::seed_from_u64(x.seed ^ 0x7a11);
        let mut measurements: Vec<Measurement> = base.iter().cloned().collect();
        let mut logs = Vec::new();
        let mut pending: Vec<Sample> = Vec::new();
        for update in 1..=x.updates {
            let policy = Arc::new(learner.policy().valid());
            let teacher_model = match file.judge.opd.teacher {
                Teacher::CurrentPolicy => policy.clone(),
                Teacher::FrozenInitial => initial.clone(),
            };
            let teacher = TeacherModel {
                model: &teacher_model,
                template: &world.ck.chat_template,
                tokenizer: &world.ck.tokenizer,
            };
            let (mut rollouts, mut satisfied, mut hints) = (0, 0, 0);
            let mut rounds = 0;
            while pending.len() < x.batch_size && rounds < x.max_rounds {
                rounds += 1;
                let turns = round(
                    &world,
                    &policy,
                    &train_env,
                    &judge,
                    method != Method::Binary,
                    &mut rng,
                    &rt,
                )?;
                rollouts += turns.len();
                turns.iter().for_each(|t| tb.log().judged(&t.point));
                satisfied += turns.iter().filter(|t| t.satisfied).count();
                hints += turns.iter().filter(|t| t.hint.is_some()).count();
                pending.extend(samples(method, &turns, &teacher, &policy, weights)?);
            }
            let take = pending.len().min(x.batch_size);
            let batch: Vec<Sample> = pending.drain(..take).collect();
            let mut log = UpdateLog {
                update,
                rollouts,
                satisfied,
                hints,
                trained: batch.len(),
                pending: pending.len(),
                loss: f64::NAN,
                kl: f64::NAN,
                grad_norm: f64::NAN,
                rollout_gap: None,
            };
            if !batch.is_empty() {
                let t0 = Instant::now();
                let m = learner.step(&batch)?;
                let step_ms = t0.elapsed().as_secs_f64() * 1e3;
                tb.step(&StepPoint::of_metrics(&m, batch.len(), step_ms));
                log.loss = m.loss;
                log.kl = m.kl;
                log.grad_norm = m.grad_norm;
                log.rollout_gap = m.logprob_gap.map(|g| g.mean_abs);
            }
            tracing::info!(
                method = method.name(),
                update,
                rollouts,
                satisfied,
                hints,
                trained = log.trained,
                loss = log.loss,
                "personal: update"
            );
            logs.push(log);
            if x.eval_at.contains(&update) {
                let m =
                    world.measure(Arc::new(learner.policy().valid()), &eval_env, update, false)?;
                tracing::info!(
                    method = method.name(),
                    update,
                    score = m.score,
                    "personal: measured"
                );
                measurements.push(m);
            }
        }
        runs.push(MethodRun {
            method,
            measurements,
            updates: logs,
            seconds: t0.elapsed().as_secs_f64(),
        });
    }
    let results = Results {
        updates: x.eval_at.clone(),
        scores: runs
            .iter()
            .map(|r| {
                (
                    r.method.name().to_string(),
                    r.measurements.iter().map(|m| m.score).collect(),
                )
            })
            .collect(),
    };
    let report = Report {
        results,
        sft,
        instructed,
        runs,
        seconds: started.elapsed().as_secs_f64(),
    };
    let write_json = |name: &str, text: String| {
        let p = run_dir.join(name);
        std::fs::write(&p, text).map_err(|e| write_err(&p, e.to_string()))
    };
    write_json(
        "results.json",
        serde_json::to_string_pretty(&report.results).expect("results serialize"),
    )?;
    write_json(
        "details.json",
        serde_json::to_string_pretty(&report).expect("report serializes"),
    )?;
    let png = run_dir.join("scores.png");
    super::plot::plot_scores(&report.results, &png).map_err(|e| write_err(&png, e.message))?;
    Ok(report)
}

/// Reads `path` and runs it (see [`run`]).
pub fn run_file(path: &Path, run_dir: &Path) -> Result<Report, ExperimentError> {
    run(&ExperimentFile::from_file(path)?, run_dir)
}

/// Whether `path` is an experiment file (its top-level `kind` is `personal_experiment`);
/// `false` when it cannot be read or parsed (the caller's own parser then reports why).
pub fn is_experiment_file(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| toml::from_str::<toml::Table>(&t).ok())
        .and_then(|t| t.get("kind").and_then(|k| k.as_str()).map(|k| k == KIND))
        .unwrap_or(false)
}

/// The scores table of a report, one line per method (the README's table).
pub fn summary_table(report: &Report) -> String {
    let mut out = String::from("| method |");
    for u in &report.results.updates {
        out.push_str(&format!(" {u} updates |"));
    }
    out.push_str("\n| --- |");
    for _ in &report.results.updates {
        out.push_str(" --- |");
    }
    for r in &report.runs {
        out.push_str(&format!("\n| {} |", r.method.name()));
        for m in &r.measurements {
            out.push_str(&format!(" {:.2} |", m.score));
        }
    }
    out
}

/// `clawrl run <experiment file>`: runs it into `out` (default `runs/<name>-<unix time>`) and
/// prints the scores table, or the whole report as JSON with `json`. Returns the run directory.
pub fn cli_main(path: &Path, out: Option<PathBuf>, json: bool) -> Result<PathBuf, ExperimentError> {
    let file = ExperimentFile::from_file(path)?;
    let run_dir = out.unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        PathBuf::from("runs").join(format!("{}-{secs}", file.name))
    });
    let report = run(&file, &run_dir)?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("the report serializes")
        );
    } else {
        println!("{}", summary_table(&report));
        println!(
            "warm start {} ({}), {:.0} s in all; results.json, details.json and scores.png in {}",
            report.sft.dir.display(),
            if report.sft.cached {
                "cached"
            } else {
                "trained now"
            },
            report.seconds,
            run_dir.display()
        );
    }
    Ok(run_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_text() -> String {
        std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/personal.toml"
        ))
        .unwrap()
    }

    #[test]
    fn the_example_parses_and_bad_files_name_the_key() {
        let text = example_text();
        let f = ExperimentFile::from_toml_str(&text, "personal.toml").unwrap();
        assert_eq!(f.experiment.eval_at, vec![0, 8, 16]);
        assert_eq!(f.experiment.batch_size, 16);
        let err = |t: String| {
            ExperimentFile::from_toml_str(&t, "x.toml")
                .unwrap_err()
                .to_string()
        };
        let e = err(text.replace("kind = \"personal_experiment\"", "kind = \"rl\""));
        assert!(
            e.contains("x.toml") && e.contains("personal_experiment"),
            "{e}"
        );
        let e = err(text.replace("eval_at = [0, 8, 16]", "eval_at = [0, 8, 17]"));
        assert!(e.contains("experiment.eval_at"), "{e}");
        let e = err(text.replace("batch_size = 16", "batch_size = 0"));
        assert!(e.contains("experiment.batch_size"), "{e}");
        let e = err(text.replace("heads = 4", "heads = 3"));
        assert!(e.contains("sft.heads"), "{e}");
        let e = err(text.replace("max_rounds = 8", "max_rounds = 8\nbogus = 1"));
        assert!(e.contains("bogus"), "{e}");
        let e = err(text.replace("score = -1", "score = -10"));
        assert!(e.contains("judge"), "{e}");
    }

    #[test]
    fn experiment_files_are_recognised_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(&p, example_text()).unwrap();
        assert!(is_experiment_file(&p));
        std::fs::write(&p, "kind = \"rl\"\n").unwrap();
        assert!(!is_experiment_file(&p));
        assert!(!is_experiment_file(&dir.path().join("missing.toml")));
    }
}
