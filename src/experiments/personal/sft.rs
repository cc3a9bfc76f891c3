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

use super::corpus::{sft_example, SftExample};
use super::tokenizer::{build_tokenizer, tokenizer_files, CHAT_TEMPLATE, IM_END};
pub use crate::experiments::warm_start::SftError;
use crate::experiments::warm_start::{self, cache_key, ChatEncoder, Recipe, SftOutcome, WarmStart};
use clawrl::model::ChatTemplate;
use clawrl::train::Sample;

/// The warm start's settings (the `[sft]` table).
pub type SftSettings = warm_start::SftSettings<CorpusSettings>;

/// The `[sft]` keys of the personal corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CorpusSettings {
    /// Fraction of examples whose prompt carries a style instruction.
    #[serde(deserialize_with = "instruct_rate")]
    pub instruct_rate: f64,
}

fn instruct_rate<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    warm_start::named_key("instruct_rate", d)
}

impl Default for CorpusSettings {
    fn default() -> Self {
        Self { instruct_rate: 0.5 }
    }
}

impl Default for SftSettings {
    fn default() -> Self {
        Self::small(CorpusSettings::default())
    }
}

impl SftSettings {
    /// Checks every value.
    pub fn validate(&self) -> Result<(), SftError> {
        self.check(64, "prompts need ~50 tokens")?;
        if !(0.0..=1.0).contains(&self.extra.instruct_rate) {
            return Err(SftError::Setting {
                key: "instruct_rate",
                reason: "must lie in [0, 1]".into(),
            });
        }
        Ok(())
    }

    /// The cache key: over the recipe version and the settings.
    pub fn cache_key(&self) -> String {
        cache_key(&(RECIPE.version, self))
    }
}

/// The personal chat encoder.
pub fn encoder() -> Result<ChatEncoder, SftError> {
    let template = ChatTemplate::new(
        CHAT_TEMPLATE,
        "personal chat template",
        vec![("eos_token".into(), IM_END.into())],
    )?;
    Ok(ChatEncoder::new(build_tokenizer()?, template, IM_END))
}

/// One SFT sample of `ex`: its response and the stop token, advantage 1.
pub fn sample(encoder: &ChatEncoder, ex: &SftExample) -> Result<Sample, SftError> {
    let prompt = encoder.prompt(&ex.messages)?;
    Ok(Sample::new(prompt, encoder.reply(&ex.response)?, 1.0))
}

/// The warm start's recipe; its version is bumped whenever the corpus, tokenizer or training
/// recipe changes, so old caches are not reused.
pub const RECIPE: Recipe = Recipe {
    version: 1,
    draw_salt: 0x5f7_c0de,
    probe: 64,
    log_every: 200,
};

/// The cached checkpoint for `settings` under `cache_dir`, training it first when absent.
/// `force` retrains even when the cache holds it.
pub fn warm_start(
    settings: &SftSettings,
    cache_dir: &Path,
    force: bool,
) -> Result<SftOutcome, SftError> {
    settings.validate()?;
    let encoder = encoder()?;
    let run = WarmStart {
        cache_dir,
        recipe: &RECIPE,
        key: settings.cache_key(),
        settings,
        config: settings.model_config(encoder.tokenizer.get_vocab_size(true), encoder.stop),
        tokenizer_files: tokenizer_files(),
    };
    run.run(force, |rng: &mut ChaCha8Rng| {
        sample(&encoder, &sft_example(settings.extra.instruct_rate, rng))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_value_of_the_corpus_key_names_it() {
        let err = toml::from_str::<SftSettings>("steps = 10\ninstruct_rate = \"lots\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`instruct_rate`"), "{err}");
        let ok: SftSettings = toml::from_str("instruct_rate = 0.25\n").unwrap();
        assert_eq!(ok.extra.instruct_rate, 0.25);
        assert_eq!(ok.steps, SftSettings::default().steps);
    }

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
