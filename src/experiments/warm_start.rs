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
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use clawrl::model::{
    save_checkpoint_dir, ChatTemplate, Qwen3, Qwen3Config, SaveError, TokenizerFiles,
};
use clawrl::train::learner::{BurnLearner, StepError};
use clawrl::train::{Sample, TrainConfig};

/// A warm start's settings, an experiment's `[sft]` table (field names are the TOML keys): the
/// policy's shape and the supervised recipe every warm start has, and the experiment's own keys
/// (`X`, flattened into the same table). Serde parses flattened keys from a buffered copy of the
/// table, so an unknown key, or a bad value of one of `X`'s keys, is reported at the `[sft]`
/// table rather than at its line, and an unknown key without the list of known keys; `X`'s
/// fields name themselves in their errors ([`named_key`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftSettings<X> {
    /// Seed of the initial weights and of the training draws.
    pub seed: u64,
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
    /// Longest sequence (prompt plus response).
    pub max_positions: usize,
    /// Supervised steps.
    pub steps: usize,
    /// Samples per step.
    pub batch_size: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// The experiment's own settings.
    #[serde(flatten)]
    pub extra: X,
}

/// Deserializes an experiment's own `[sft]` key `key` (a dotted path inside it), naming the key
/// in the error: a value read from serde's buffered copy of a flattened table would otherwise be
/// refused without saying which key it was.
pub fn named_key<'de, D, T>(key: &'static str, d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map_err(|e| serde::de::Error::custom(format!("[sft] `{key}`: {e}")))
}

impl<X> SftSettings<X> {
    /// The small policy every experiment starts from (seed 0; 2 layers of width 64, 4 query
    /// and 2 key/value heads, an MLP of 192; 128 positions), trained 1000 steps of 32 samples
    /// at learning rate 3e-3, with the experiment's own `extra`.
    pub fn small(extra: X) -> Self {
        Self {
            seed: 0,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            intermediate: 192,
            max_positions: 128,
            steps: 1000,
            batch_size: 32,
            lr: 3e-3,
            extra,
        }
    }

    /// Checks the shape and the recipe: every size at least 1, a whole and even head width,
    /// key/value heads dividing the query heads, at least `min_positions` positions (`why`
    /// says what needs them), a finite `lr` > 0. The error names the `[sft]` key.
    pub fn check(&self, min_positions: usize, why: &str) -> Result<(), SftError> {
        let bad = |key, reason: String| Err(SftError::Setting { key, reason });
        for (key, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
        ] {
            if v == 0 {
                return bad(key, "must be at least 1".into());
            }
        }
        if !self.hidden.is_multiple_of(self.heads) || !(self.hidden / self.heads).is_multiple_of(2)
        {
            return bad(
                "heads",
                "hidden / heads must be a whole, even head width".into(),
            );
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad("kv_heads", "must divide heads".into());
        }
        if self.max_positions < min_positions {
            return bad(
                "max_positions",
                format!("must be at least {min_positions} ({why})"),
            );
        }
        if self.batch_size == 0 {
            return bad("batch_size", "must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", "must be a finite number > 0".into());
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

/// The cache key of everything in `shaped_by`: blake3 of its JSON, 16 hex digits.
pub fn cache_key(shaped_by: &impl Serialize) -> String {
    let text = serde_json::to_string(shaped_by).expect("settings serialize");
    blake3::hash(text.as_bytes()).to_hex()[..16].to_string()
}

/// Encodes chat turns into token ids with an experiment's tokenizer and chat template.
pub struct ChatEncoder {
    /// The tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    template: ChatTemplate,
    /// The stop token ending each of the policy's messages.
    pub stop: u32,
}

impl ChatEncoder {
    /// An encoder whose stop token is `stop` (which the vocabulary must hold).
    pub fn new(tokenizer: tokenizers::Tokenizer, template: ChatTemplate, stop: &str) -> Self {
        let stop = tokenizer
            .token_to_id(stop)
            .expect("the vocabulary holds the stop token");
        Self {
            tokenizer,
            template,
            stop,
        }
    }

    /// The prompt ids of `messages` as the template renders them.
    pub fn prompt(&self, messages: &impl Serialize) -> Result<Vec<u32>, SftError> {
        let messages = minijinja::Value::from_serialize(messages);
        Ok(self.template.encode(&self.tokenizer, &messages, None)?.ids)
    }

    /// The ids of one policy message `text`, ended by the stop token.
    pub fn reply(&self, text: &str) -> Result<Vec<u32>, SftError> {
        let mut ids = clawrl::model::chat::encode_text(&self.tokenizer, text)?;
        ids.push(self.stop);
        Ok(ids)
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

/// What an experiment's warm start fixes in code: bumped with its corpus, tokenizer or recipe,
/// how its training draws are seeded, how it measures and logs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recipe {
    /// The recipe version: part of the cache key and written into the stamp, so a change of
    /// corpus, tokenizer or recipe does not reuse old caches.
    pub version: u32,
    /// XORed into the seed for the training draws' generator.
    pub draw_salt: u64,
    /// Held-aside samples the final NLL is measured on (drawn first, from `seed ^ 0x9e37`).
    pub probe: usize,
    /// Steps between progress lines in the log.
    pub log_every: usize,
}

/// One warm start: where it is cached and how it trains.
pub struct WarmStart<'a, X> {
    /// The cache directory; the checkpoint is `<cache_dir>/sft-<key>`.
    pub cache_dir: &'a Path,
    /// The cache key ([`cache_key`] over everything that shapes the result).
    pub key: String,
    /// The experiment's recipe.
    pub recipe: &'a Recipe,
    /// The settings; a cached directory is reused only when its stamp holds exactly these.
    /// Training is AdamW without weight decay.
    pub settings: &'a SftSettings<X>,
    /// The policy's config.
    pub config: Qwen3Config,
    /// The checkpoint's tokenizer files.
    pub tokenizer_files: TokenizerFiles,
}

impl<X: Serialize> WarmStart<'_, X> {
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
        if v.get("settings") != Some(&json!(self.settings)) {
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
        let (seed, steps, batch_size) = (
            self.settings.seed,
            self.settings.steps,
            self.settings.batch_size,
        );
        let train = TrainConfig {
            lr: self.settings.lr,
            weight_decay: 0.0,
            kl_coef: 0.0,
            batch_size,
            ..TrainConfig::default()
        };
        let model = Qwen3::<clawrl::CpuAutodiff>::init(&self.config, &Default::default(), seed);
        let mut learner: BurnLearner =
            BurnLearner::new(self.config.clone(), model, train, Default::default(), seed);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ self.recipe.draw_salt);
        let mut probe_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37);
        let probe: Vec<Sample> = (0..self.recipe.probe)
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
        for step in 0..steps {
            let batch: Vec<Sample> = (0..batch_size)
                .map(|_| draw(&mut rng))
                .collect::<Result<_, _>>()?;
            learner
                .step(&batch)
                .map_err(|source| WarmStartError::Step { step, source })?;
            if (step + 1) % self.recipe.log_every.max(1) == 0 {
                tracing::info!(
                    step = step + 1,
                    of = steps,
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
            "recipe_version": self.recipe.version,
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
