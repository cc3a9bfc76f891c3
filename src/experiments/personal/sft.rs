//! `clawrl sft`: the warm start of the personal-agent experiment. Builds a small
//! Qwen3-architecture policy (seeded random init), supervised-trains it on the synthetic,
//! style-conditioned corpus of [`super::corpus`] and saves it as a Hugging Face checkpoint
//! directory (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` with
//! the chat template, and `sft.json` describing the run), cached under a key that is the hash of
//! the settings: a second run with the same settings reuses the directory.
//!
//! The training and the cache are [`crate::experiments::warm_start`]'s; every response token has
//! advantage `1`, so one learner step is one supervised step on the mean token negative
//! log-likelihood.

use std::path::Path;

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::corpus::{sft_example, SftExample};
use super::tokenizer::{build_tokenizer, tokenizer_files, CHAT_TEMPLATE, IM_END};
pub use crate::experiments::warm_start::SftError;
use crate::experiments::warm_start::{check_recipe, ModelShape, SftOutcome, WarmStart};
use clawrl::model::{ChatTemplate, Qwen3Config};
use clawrl::train::Sample;

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
            steps: 1000,
            batch_size: 32,
            lr: 3e-3,
            instruct_rate: 0.5,
        }
    }
}

impl SftSettings {
    /// Checks every value.
    pub fn validate(&self) -> Result<(), SftError> {
        let shape = self.shape();
        check_recipe(
            &shape,
            64,
            "prompts need ~50 tokens",
            self.batch_size,
            self.lr,
        )?;
        if !(0.0..=1.0).contains(&self.instruct_rate) {
            return Err(SftError::Setting {
                key: "instruct_rate",
                reason: "must lie in [0, 1]".into(),
            });
        }
        Ok(())
    }

    /// The policy's shape.
    pub fn shape(&self) -> ModelShape {
        ModelShape {
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            intermediate: self.intermediate,
            max_positions: self.max_positions,
        }
    }

    /// The cache key: blake3 of the recipe version and the settings, 16 hex digits.
    pub fn cache_key(&self) -> String {
        let text = serde_json::to_string(&(RECIPE_VERSION, self)).expect("settings serialize");
        blake3::hash(text.as_bytes()).to_hex()[..16].to_string()
    }

    /// The model config for a vocabulary of `vocab` words with stop token `eos`.
    pub fn model_config(&self, vocab: usize, eos: u32) -> Qwen3Config {
        self.shape().model_config(vocab, eos)
    }
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

    /// One SFT sample.
    pub fn sample(&self, ex: &SftExample) -> Result<Sample, SftError> {
        let messages = minijinja::Value::from_serialize(&ex.messages);
        let prompt = self.template.encode(&self.tokenizer, &messages, None)?;
        let mut response = clawrl::model::chat::encode_text(&self.tokenizer, &ex.response)?;
        response.push(self.stop);
        Ok(Sample::new(prompt.ids, response, 1.0))
    }
}

/// The cached checkpoint for `settings` under `cache_dir`, training it first when absent.
/// `force` retrains even when the cache holds it.
pub fn warm_start(
    settings: &SftSettings,
    cache_dir: &Path,
    force: bool,
) -> Result<SftOutcome, SftError> {
    settings.validate()?;
    let encoder = Encoder::new()?;
    let run = WarmStart {
        cache_dir,
        key: settings.cache_key(),
        recipe_version: RECIPE_VERSION,
        settings: json!(settings),
        config: settings.model_config(encoder.tokenizer.get_vocab_size(true), encoder.stop),
        seed: settings.seed,
        draw_salt: 0x5f7_c0de,
        steps: settings.steps,
        batch_size: settings.batch_size,
        lr: settings.lr,
        probe: 64,
        log_every: 200,
        tokenizer_files: tokenizer_files(),
    };
    run.run(force, |rng: &mut ChaCha8Rng| {
        encoder.sample(&sft_example(settings.instruct_rate, rng))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_settings_are_another_cache_entry() {
        let base = SftSettings::default();
        assert_eq!(base.cache_key(), SftSettings::default().cache_key());
        assert_eq!(base.cache_key().len(), 16);
        let mut other = base.clone();
        other.seed += 1;
        assert_ne!(other.cache_key(), base.cache_key());
        let mut other = base.clone();
        other.steps += 1;
        assert_ne!(other.cache_key(), base.cache_key());
    }
}
