//! `clawrl sft`: the warm start of the personal-agent experiment. Builds a small
//! Qwen3-architecture policy (seeded random init), supervised-trains it on the synthetic,
//! style-conditioned corpus of [`super::corpus`] and saves it as a Hugging Face checkpoint
//! directory (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` with
//! the chat template, and `sft.json` describing the run), cached under a key that is the hash of
//! the settings: a second run with the same settings reuses the directory.
//!
//! Training goes through the project's [`BurnLearner`] (exact AdamW, gradient-norm clip): with every
//! advantage `1`, no KL term and old log-probs equal to the current ones, the gradient of the
//! docs/design.md §1 loss is exactly that of the mean token negative log-likelihood, so one learner step
//! is one supervised step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::json;
use thiserror::Error;

use super::corpus::{sft_example, SftExample};
use super::tokenizer::{build_tokenizer, tokenizer_files, TokenizerError, CHAT_TEMPLATE, IM_END};
use crate::model::{save_checkpoint_dir, ChatError, ChatTemplate, Qwen3, Qwen3Config, SaveError};
use crate::train::learner::{BurnLearner, StepError};
use crate::train::{Sample, TrainConfig};

/// Bumped whenever the corpus, tokenizer or training recipe changes, so old caches are not
/// reused.
pub const RECIPE_VERSION: u32 = 1;

/// The warm start's settings (the `[sft]` table). Field names are the TOML keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftSettings {
    /// Seed of the initial weights and of the corpus sampling.
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
    /// Examples per step.
    pub batch_size: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Fraction of examples whose prompt carries a style instruction.
    pub instruct_rate: f64,
}

impl Default for SftSettings {
    fn default() -> Self {
        Self {
            seed: 0,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            intermediate: 192,
            max_positions: 128,
            steps: 800,
            batch_size: 32,
            lr: 3e-3,
            instruct_rate: 0.5,
        }
    }
}

/// Why the warm start failed.
#[derive(Debug, Error)]
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
    Tokenizer(#[from] TokenizerError),
    /// The chat template failed.
    #[error("sft: {0}")]
    Chat(#[from] ChatError),
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

impl SftSettings {
    /// Checks every value.
    pub fn validate(&self) -> Result<(), SftError> {
        let bad = |key, reason: &str| {
            Err(SftError::Setting {
                key,
                reason: reason.to_string(),
            })
        };
        for (key, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
            ("batch_size", self.batch_size),
        ] {
            if v == 0 {
                return bad(key, "must be at least 1");
            }
        }
        if !self.hidden.is_multiple_of(self.heads) || !(self.hidden / self.heads).is_multiple_of(2)
        {
            return bad("heads", "hidden / heads must be a whole, even head width");
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad("kv_heads", "must divide heads");
        }
        if self.max_positions < 64 {
            return bad(
                "max_positions",
                "must be at least 64 (prompts need ~50 tokens)",
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", "must be a finite number > 0");
        }
        if !(0.0..=1.0).contains(&self.instruct_rate) {
            return bad("instruct_rate", "must lie in [0, 1]");
        }
        Ok(())
    }

    /// The cache key: blake3 of the recipe version and the settings, 16 hex digits.
    pub fn cache_key(&self) -> String {
        let text = serde_json::to_string(&(RECIPE_VERSION, self)).expect("settings serialize");
        blake3::hash(text.as_bytes()).to_hex()[..16].to_string()
    }

    /// The model config for a vocabulary of `vocab` words with stop token `eos`.
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
        Qwen3Config::from_json(&cfg.to_string()).expect("a validated sft config builds")
    }
}

/// A seeded random initialisation: normal(0, `initializer_range`) weights, unit norms.
pub fn seeded_init(cfg: &Qwen3Config, seed: u64) -> Qwen3<crate::CpuAutodiff> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let std = cfg.initializer_range;
    Qwen3::build(cfg, &Default::default(), &mut |name, shape| {
        let n: usize = shape.iter().product();
        if name.ends_with("norm.weight") {
            return Ok::<_, std::convert::Infallible>(vec![1.0; n]);
        }
        Ok((0..n)
            .map(|_| {
                // Box-Muller.
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random();
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * std) as f32
            })
            .collect())
    })
    .unwrap_or_else(|e| match e {})
}

/// Encodes supervised examples into learner samples (response + stop token, advantage 1).
pub struct Encoder {
    tokenizer: tokenizers::Tokenizer,
    template: ChatTemplate,
    stop: u32,
}

impl Encoder {
    /// The experiment's tokenizer and chat template.
    pub fn new() -> Result<Self, SftError> {
        let tokenizer = build_tokenizer()?;
        let template = ChatTemplate::new(
            CHAT_TEMPLATE,
            "personal chat template",
            vec![("eos_token".into(), IM_END.into())],
        )?;
        let stop = tokenizer
            .token_to_id(IM_END)
            .expect("the vocabulary holds the stop token");
        Ok(Self {
            tokenizer,
            template,
            stop,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// The stop token id.
    pub fn stop(&self) -> u32 {
        self.stop
    }

    /// One SFT sample.
    pub fn sample(&self, ex: &SftExample) -> Result<Sample, SftError> {
        let messages = minijinja::Value::from_serialize(&ex.messages);
        let prompt = self.template.encode(&self.tokenizer, &messages, None)?;
        let mut response = crate::model::chat::encode_text(&self.tokenizer, &ex.response)?;
        response.push(self.stop);
        Ok(Sample {
            prompt_ids: prompt.ids,
            advantages: vec![1.0; response.len()],
            response_ids: response,
            old_logprobs: None,
            ref_logprobs: None,
            rollout_logprobs: None,
            opd: None,
            importance: None,
        })
    }
}

/// What [`warm_start`] produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SftOutcome {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Whether it came from the cache.
    pub cached: bool,
    /// Seconds spent (0 when cached).
    pub seconds: f64,
    /// Mean token NLL on a fixed held-aside batch at the end of training (from `sft.json` when
    /// cached).
    pub final_nll: f64,
}

/// The cached checkpoint for `settings` under `cache_dir`, training it first when absent.
/// `force` retrains even when the cache holds it.
pub fn warm_start(
    settings: &SftSettings,
    cache_dir: &Path,
    force: bool,
) -> Result<SftOutcome, SftError> {
    settings.validate()?;
    let dir = cache_dir.join(format!("sft-{}", settings.cache_key()));
    let stamp = dir.join("sft.json");
    if !force && dir.join("model.safetensors").exists() {
        if let Ok(text) = std::fs::read_to_string(&stamp) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                if v.get("settings") == Some(&json!(settings)) {
                    tracing::info!(dir = %dir.display(), "sft: reusing the cached checkpoint");
                    return Ok(SftOutcome {
                        dir,
                        cached: true,
                        seconds: 0.0,
                        final_nll: v["final_nll"].as_f64().unwrap_or(f64::NAN),
                    });
                }
            }
        }
    }
    let started = Instant::now();
    let encoder = Encoder::new()?;
    let vocab = encoder.tokenizer.get_vocab_size(true);
    let cfg = settings.model_config(vocab, encoder.stop);
    let train = TrainConfig {
        lr: settings.lr,
        weight_decay: 0.0,
        kl_coef: 0.0,
        batch_size: settings.batch_size,
        ..TrainConfig::default()
    };
    let model = seeded_init(&cfg, settings.seed);
    let mut learner: BurnLearner =
        BurnLearner::new(cfg, model, train, Default::default(), settings.seed);
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed ^ 0x5f7_c0de);
    let mut probe_rng = ChaCha8Rng::seed_from_u64(settings.seed ^ 0x9e37);
    let probe: Vec<Sample> = (0..64)
        .map(|_| encoder.sample(&sft_example(settings.instruct_rate, &mut probe_rng)))
        .collect::<Result<_, _>>()?;
    let nll = |learner: &BurnLearner| -> Result<f64, SftError> {
        let lps = learner
            .logprobs(&probe)
            .map_err(|source| SftError::Step { step: 0, source })?;
        let (sum, n) = lps
            .iter()
            .flatten()
            .fold((0f64, 0usize), |(s, n), &lp| (s - lp as f64, n + 1));
        Ok(sum / n.max(1) as f64)
    };
    for step in 0..settings.steps {
        let batch: Vec<Sample> = (0..settings.batch_size)
            .map(|_| encoder.sample(&sft_example(settings.instruct_rate, &mut rng)))
            .collect::<Result<_, _>>()?;
        learner
            .step(&batch)
            .map_err(|source| SftError::Step { step, source })?;
        if (step + 1) % 200 == 0 {
            tracing::info!(
                step = step + 1,
                of = settings.steps,
                nll = nll(&learner)?,
                secs = started.elapsed().as_secs_f64(),
                "sft"
            );
        }
    }
    let final_nll = nll(&learner)?;
    std::fs::create_dir_all(cache_dir).map_err(|source| SftError::Io {
        path: cache_dir.to_path_buf(),
        source,
    })?;
    // Unique per process and call, so concurrent warm starts never share a temporary dir.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = cache_dir.join(format!(
        "sft-{}.tmp-{}-{}",
        settings.cache_key(),
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    save_checkpoint_dir(
        &tmp,
        learner.model_config(),
        &learner.policy().valid(),
        &tokenizer_files(),
    )?;
    let seconds = started.elapsed().as_secs_f64();
    let stamp_text = serde_json::to_string_pretty(&json!({
        "recipe_version": RECIPE_VERSION,
        "settings": settings,
        "final_nll": final_nll,
        "seconds": seconds,
    }))
    .expect("json serializes");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SftError::Io { path, source }
    };
    std::fs::write(tmp.join("sft.json"), stamp_text).map_err(io(&tmp))?;
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        // A concurrent warm start with the same settings may have put its identical result in
        // place first; keep that one.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("sft.json").exists() {
            return Err(io(&dir)(e));
        }
    }
    tracing::info!(dir = %dir.display(), seconds, final_nll, "sft: checkpoint written");
    Ok(SftOutcome {
        dir,
        cached: false,
        seconds,
        final_nll,
    })
}
