//! A supervised warm start, cached on disk: a small Qwen3 policy from a seeded random
//! initialisation ([`Qwen3::init`]), trained on samples an experiment draws, saved as a Hugging
//! Face checkpoint directory with the experiment's tokenizer files and an `sft.json` stamp, and
//! reused when asked again with the same settings. The experiments build their own samples and
//! settings on it ([`super::personal::sft`], [`super::toolagent::sft`]).
//!
//! Training goes through the project's [`BurnLearner`] (exact AdamW, gradient-norm clip): with
//! no KL term and old log-probs equal to the current ones, the gradient of the docs/design.md §1
//! loss is that of the advantage-weighted token negative log-likelihood, so one learner step is
//! one supervised step over the tokens with a positive advantage.
//!
//! The cache: the checkpoint of settings with key `K` is `<cache>/sft-K`. It is written into a
//! temporary directory unique to the process and call, then renamed into place, so a reader
//! never sees a half-written one and concurrent warm starts with the same settings keep one
//! identical result. A directory is reused only when its stamp holds the same settings.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::{json, Value};

use clawrl::model::{save_checkpoint_dir, Qwen3, Qwen3Config, SaveError, TokenizerFiles};
use clawrl::train::learner::{BurnLearner, StepError};
use clawrl::train::{Sample, TrainConfig};

/// The policy's shape: the `[sft]` keys every warm start has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// Decoder layers.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate: usize,
    /// Longest sequence.
    pub max_positions: usize,
}

impl ModelShape {
    /// Checks the shape: every size at least 1, a whole and even head width, key/value heads
    /// dividing the query heads, at least `min_positions` positions (`why` says what needs
    /// them). The error names the `[sft]` key.
    pub fn validate(&self, min_positions: usize, why: &str) -> Result<(), (&'static str, String)> {
        for (key, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
        ] {
            if v == 0 {
                return Err((key, "must be at least 1".into()));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) || !(self.hidden / self.heads).is_multiple_of(2)
        {
            return Err((
                "heads",
                "hidden / heads must be a whole, even head width".into(),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(("kv_heads", "must divide heads".into()));
        }
        if self.max_positions < min_positions {
            return Err((
                "max_positions",
                format!("must be at least {min_positions} ({why})"),
            ));
        }
        Ok(())
    }

    /// The model config for a vocabulary of `vocab` pieces with stop token `eos`.
    pub fn model_config(&self, vocab: usize, eos: u32) -> Qwen3Config {
        let cfg = json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": true,
            "max_position_embeddings": self.max_positions,
            "eos_token_id": eos,
            "initializer_range": 0.02,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        });
        Qwen3Config::from_json(&cfg.to_string()).expect("a validated shape builds")
    }
}

/// Why a warm start failed.
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    /// A setting is out of range.
    #[error("sft.{key}: {reason}")]
    Setting {
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] crate::experiments::word_tokenizer::TokenizerError),
    /// Tokenizing or the chat template failed.
    #[error("sft: {0}")]
    Chat(#[from] clawrl::model::ChatError),
    /// Training or caching failed.
    #[error(transparent)]
    Run(#[from] WarmStartError),
}

/// Checks what every warm start's settings hold: the policy's `shape` (at least
/// `min_positions` positions, `why`), `batch_size` ≥ 1 and a finite `lr` > 0.
pub fn check_recipe(
    shape: &ModelShape,
    min_positions: usize,
    why: &str,
    batch_size: usize,
    lr: f64,
) -> Result<(), SftError> {
    let bad = |key, reason: String| Err(SftError::Setting { key, reason });
    if let Err((key, reason)) = shape.validate(min_positions, why) {
        return bad(key, reason);
    }
    if batch_size == 0 {
        return bad("batch_size", "must be at least 1".into());
    }
    if !(lr.is_finite() && lr > 0.0) {
        return bad("lr", "must be a finite number > 0".into());
    }
    Ok(())
}

/// Why a warm start's training or its cache failed (the experiment's own errors, such as its
/// tokenizer's, come through the sample draws).
#[derive(Debug, thiserror::Error)]
pub enum WarmStartError {
    /// A training step failed.
    #[error("sft step {step}: {source}")]
    Step {
        /// The step.
        step: usize,
        /// The cause.
        source: StepError,
    },
    /// The checkpoint could not be written.
    #[error("sft: writing the checkpoint: {0}")]
    Save(#[from] SaveError),
    /// A file operation failed.
    #[error("sft: {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// What a warm start produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SftOutcome {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Whether it came from the cache.
    pub cached: bool,
    /// Seconds spent (0 when cached).
    pub seconds: f64,
    /// Mean NLL of the trained tokens (those with a positive advantage) on a fixed held-aside
    /// batch at the end of training (from `sft.json` when cached).
    pub final_nll: f64,
}

/// One warm start: where it is cached and how it trains.
pub struct WarmStart<'a> {
    /// The cache directory; the checkpoint is `<cache_dir>/sft-<key>`.
    pub cache_dir: &'a Path,
    /// The cache key (hex digits of a hash over everything that shapes the result).
    pub key: String,
    /// The recipe version written into the stamp.
    pub recipe_version: u32,
    /// The settings as the stamp keeps them; a cached directory is reused only when its stamp
    /// holds exactly these.
    pub settings: Value,
    /// The policy's config.
    pub config: Qwen3Config,
    /// Seed of the initial weights and the learner; the draws use it salted.
    pub seed: u64,
    /// XORed into `seed` for the training draws' generator.
    pub draw_salt: u64,
    /// Supervised steps.
    pub steps: usize,
    /// Samples per step.
    pub batch_size: usize,
    /// AdamW learning rate (no weight decay).
    pub lr: f64,
    /// Held-aside samples the final NLL is measured on (drawn first, from `seed ^ 0x9e37`).
    pub probe: usize,
    /// Steps between progress lines in the log.
    pub log_every: usize,
    /// The checkpoint's tokenizer files.
    pub tokenizer_files: TokenizerFiles,
}

impl WarmStart<'_> {
    /// The checkpoint directory.
    pub fn dir(&self) -> PathBuf {
        self.cache_dir.join(format!("sft-{}", self.key))
    }

    /// The cached result, when the directory holds a checkpoint stamped with these settings.
    pub fn cached(&self) -> Option<SftOutcome> {
        let dir = self.dir();
        if !dir.join("model.safetensors").exists() {
            return None;
        }
        let text = std::fs::read_to_string(dir.join("sft.json")).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        if v.get("settings") != Some(&self.settings) {
            return None;
        }
        tracing::info!(dir = %dir.display(), "sft: reusing the cached checkpoint");
        Some(SftOutcome {
            cached: true,
            seconds: 0.0,
            final_nll: v["final_nll"].as_f64().unwrap_or(f64::NAN),
            dir,
        })
    }

    /// The cached result, or (when absent, or `force`) trains with samples from `draw` and
    /// caches the result.
    pub fn run<E: From<WarmStartError>>(
        &self,
        force: bool,
        mut draw: impl FnMut(&mut ChaCha8Rng) -> Result<Sample, E>,
    ) -> Result<SftOutcome, E> {
        if !force {
            if let Some(out) = self.cached() {
                return Ok(out);
            }
        }
        let started = Instant::now();
        let train = TrainConfig {
            lr: self.lr,
            weight_decay: 0.0,
            kl_coef: 0.0,
            batch_size: self.batch_size,
            ..TrainConfig::default()
        };
        let model =
            Qwen3::<clawrl::CpuAutodiff>::init(&self.config, &Default::default(), self.seed);
        let mut learner: BurnLearner = BurnLearner::new(
            self.config.clone(),
            model,
            train,
            Default::default(),
            self.seed,
        );
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ self.draw_salt);
        let mut probe_rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x9e37);
        let probe: Vec<Sample> = (0..self.probe)
            .map(|_| draw(&mut probe_rng))
            .collect::<Result<_, _>>()?;
        let nll = |learner: &BurnLearner| -> Result<f64, WarmStartError> {
            let lps = learner
                .logprobs(&probe)
                .map_err(|source| WarmStartError::Step { step: 0, source })?;
            let (mut sum, mut n) = (0f64, 0usize);
            for (lp, s) in lps.iter().zip(&probe) {
                for (l, a) in lp.iter().zip(&s.advantages) {
                    if *a > 0.0 {
                        sum -= *l as f64;
                        n += 1;
                    }
                }
            }
            Ok(sum / n.max(1) as f64)
        };
        for step in 0..self.steps {
            let batch: Vec<Sample> = (0..self.batch_size)
                .map(|_| draw(&mut rng))
                .collect::<Result<_, _>>()?;
            learner
                .step(&batch)
                .map_err(|source| WarmStartError::Step { step, source })?;
            if (step + 1) % self.log_every.max(1) == 0 {
                tracing::info!(
                    step = step + 1,
                    of = self.steps,
                    nll = nll(&learner)?,
                    secs = started.elapsed().as_secs_f64(),
                    "sft"
                );
            }
        }
        let final_nll = nll(&learner)?;
        let seconds = started.elapsed().as_secs_f64();
        let dir = self.save(&learner, final_nll, seconds)?;
        tracing::info!(dir = %dir.display(), seconds, final_nll, "sft: checkpoint written");
        Ok(SftOutcome {
            dir,
            cached: false,
            seconds,
            final_nll,
        })
    }

    /// Writes the trained checkpoint and its stamp into a fresh temporary directory, then
    /// renames it into place.
    fn save(
        &self,
        learner: &BurnLearner,
        final_nll: f64,
        seconds: f64,
    ) -> Result<PathBuf, WarmStartError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WarmStartError::Io { path, source }
        };
        std::fs::create_dir_all(self.cache_dir).map_err(io(self.cache_dir))?;
        // Unique per process and call, so concurrent warm starts never share a temporary dir.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let tmp = self.cache_dir.join(format!(
            "sft-{}.tmp-{}-{}",
            self.key,
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&tmp);
        save_checkpoint_dir(
            &tmp,
            learner.model_config(),
            &learner.policy().valid(),
            &self.tokenizer_files,
        )?;
        let stamp = serde_json::to_string_pretty(&json!({
            "recipe_version": self.recipe_version,
            "settings": self.settings,
            "final_nll": final_nll,
            "seconds": seconds,
        }))
        .expect("json serializes");
        std::fs::write(tmp.join("sft.json"), stamp).map_err(io(&tmp))?;
        let dir = self.dir();
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::rename(&tmp, &dir) {
            // A concurrent warm start with the same settings may have put its identical result
            // in place first; keep that one.
            let _ = std::fs::remove_dir_all(&tmp);
            if !dir.join("sft.json").exists() {
                return Err(io(&dir)(e));
            }
        }
        Ok(dir)
    }
}
