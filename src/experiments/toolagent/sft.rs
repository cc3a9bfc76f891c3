//! The warm start of the tool-call experiment ([`crate::experiments::warm_start`]): a small seeded
//! Qwen3 policy supervised-trained on generated transcripts ([`super::corpus`]) of train-split
//! tasks, saved with the tokenizer and chat template of [`super::tokenizer`], cached under the
//! hash of its settings and tasks.
//!
//! One transcript is one learner sample: the prompt is the rendered question, the response is
//! everything after it (policy messages, each ended by the stop token, and the tool messages
//! appended by [`super::tokenizer::continuation_ids`], exactly as rollouts build them). The
//! advantage is `0` on the tool's tokens and `L / 32` on the policy's, where `L` is the
//! sample's response length: the learner averages each sample's loss over its `L` response
//! tokens, so this weight makes every policy token count the same whatever the length of its
//! transcript (otherwise a short direct answer would outweigh each token of a long tool-using
//! transcript many times over). With old log-probs equal to the current ones and no KL term,
//! one learner step is then one supervised step on the token-mean NLL of the policy's tokens
//! (scaled by a constant).

use std::path::Path;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::corpus::{transcript, Mixture, Segment, Transcript};
use super::tasks::GenTask;
use super::tokenizer::{build_tokenizer, chat_template, continuation_ids, tokenizer_files, IM_END};
pub use crate::experiments::warm_start::SftError;
use crate::experiments::warm_start::{self, cache_key, ChatEncoder, Recipe, SftOutcome, WarmStart};
use clawrl::train::Sample;

/// The constant the per-token weight `L / 32` divides by (see the module doc).
pub const TOKEN_WEIGHT_SCALE: f32 = 32.0;

/// The warm start's recipe; its version is bumped whenever the corpus, tokenizer or recipe
/// changes, so old caches are not reused.
pub const RECIPE: Recipe = Recipe {
    version: 3,
    draw_salt: 0x70_01a6,
    probe: 32,
    log_every: 100,
};

/// The `[sft]` table.
pub type SftSettings = warm_start::SftSettings<CorpusSettings>;

/// The `[sft]` keys of the transcripts.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct CorpusSettings {
    /// The behaviours of the transcripts.
    pub mixture: Mixture,
}

impl Default for SftSettings {
    fn default() -> Self {
        Self {
            max_positions: 256,
            steps: 600,
            batch_size: 16,
            lr: 5e-3,
            ..Self::small(CorpusSettings::default())
        }
    }
}

impl SftSettings {
    /// Checks every value.
    pub fn validate(&self) -> Result<(), SftError> {
        self.check(128, "a two-call transcript takes about 150 tokens")?;
        let mixture = &self.extra.mixture;
        for (key, v) in [
            ("mixture.direct_rate", mixture.direct_rate),
            ("mixture.two_call_rate", mixture.two_call_rate),
            ("mixture.slip_rate", mixture.slip_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(SftError::Setting {
                    key,
                    reason: "must lie in [0, 1]".into(),
                });
            }
        }
        Ok(())
    }
}

/// Encodes transcripts into learner samples.
pub struct Encoder(ChatEncoder);

impl Encoder {
    /// The experiment's tokenizer and template.
    pub fn new() -> Result<Self, SftError> {
        Ok(Self(ChatEncoder::new(
            build_tokenizer()?,
            chat_template()?,
            IM_END,
        )))
    }

    /// The tokenizer.
    #[cfg(test)]
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.0.tokenizer
    }

    /// The prompt ids of a question (the template's rendering of the user message).
    pub fn prompt(&self, question: &str) -> Result<Vec<u32>, SftError> {
        self.0
            .prompt(&json!([{"role": "user", "content": question}]))
    }

    /// One supervised sample.
    pub fn sample(&self, t: &Transcript) -> Result<Sample, SftError> {
        let prompt = self.prompt(&t.question)?;
        let mut response = Vec::new();
        let mut advantages = Vec::new();
        let mut tools: Vec<String> = Vec::new();
        for seg in &t.segments {
            match seg {
                Segment::Assistant(text) => {
                    if !tools.is_empty() {
                        let ids = continuation_ids(&self.0.tokenizer, &tools)?;
                        advantages.extend(std::iter::repeat_n(0.0, ids.len()));
                        response.extend(ids);
                        tools.clear();
                    }
                    let ids = self.0.reply(text)?;
                    advantages.extend(std::iter::repeat_n(1.0, ids.len()));
                    response.extend(ids);
                }
                Segment::Tool(text) => tools.push(text.clone()),
            }
        }
        let weight = response.len() as f32 / TOKEN_WEIGHT_SCALE;
        for a in &mut advantages {
            *a *= weight;
        }
        Ok(Sample {
            prompt_ids: prompt,
            response_ids: response,
            advantages,
            old_logprobs: None,
            ref_logprobs: None,
            rollout_logprobs: None,
            opd: None,
            importance: None,
        })
    }
}

/// The cached warm start for `settings` over the train tasks `train` (its cache key covers
/// both), trained first when absent or when `force`.
pub fn warm_start(
    settings: &SftSettings,
    train: &[GenTask],
    cache_dir: &Path,
    force: bool,
) -> Result<SftOutcome, SftError> {
    settings.validate()?;
    if train.is_empty() {
        return Err(SftError::Setting {
            key: "tasks",
            reason: "the train split is empty".into(),
        });
    }
    let enc = Encoder::new()?;
    let run = WarmStart {
        cache_dir,
        recipe: &RECIPE,
        key: cache_key(&(RECIPE.version, settings, train)),
        settings,
        config: settings.model_config(enc.0.tokenizer.get_vocab_size(true), enc.0.stop),
        tokenizer_files: tokenizer_files(),
    };
    run.run(force, |rng: &mut ChaCha8Rng| {
        let task = &train[rng.random_range(0..train.len())];
        enc.sample(&transcript(task, &settings.extra.mixture, rng))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiments::toolagent::tasks::Op;
    use rand::SeedableRng;

    #[test]
    fn a_bad_value_of_a_mixture_key_names_it() {
        let err = toml::from_str::<SftSettings>("[mixture]\nslip_rate = \"often\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`mixture.slip_rate`"), "{err}");
        let ok: SftSettings = toml::from_str("[mixture]\nslip_rate = 0.5\n").unwrap();
        assert_eq!(ok.extra.mixture.slip_rate, 0.5);
        assert_eq!(ok.extra.mixture.direct_rate, Mixture::default().direct_rate);
    }

    #[test]
    fn samples_train_only_the_policys_tokens() {
        let enc = Encoder::new().unwrap();
        let task = GenTask {
            operands: [47, 29, 18],
            ops: [Op::Add, Op::Mul],
        };
        let mix = Mixture {
            direct_rate: 0.0,
            two_call_rate: 1.0,
            slip_rate: 0.0,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let s = enc.sample(&transcript(&task, &mix, &mut rng)).unwrap();
        assert_eq!(s.response_ids.len(), s.advantages.len());
        let w = s.response_ids.len() as f32 / TOKEN_WEIGHT_SCALE;
        assert!(s.advantages.iter().all(|a| *a == 0.0 || *a == w));
        let text = |pick: f32| {
            let ids: Vec<u32> = s
                .response_ids
                .iter()
                .zip(&s.advantages)
                .filter(|(_, a)| **a == pick * w)
                .map(|(i, _)| *i)
                .collect();
            enc.tokenizer().decode(&ids, false).unwrap()
        };
        let policy = text(1.0);
        assert!(policy.contains("print(29*18)") && policy.contains("print(47+522)"));
        assert!(policy.ends_with("\\boxed{569}<|im_end|>"), "{policy}");
        let tool = text(0.0);
        assert!(
            tool.contains("stdout:\n522\n") && !tool.contains("print"),
            "{tool}"
        );
        let len = s.prompt_ids.len() + s.response_ids.len();
        assert!(len < 170, "{len}");
        assert!(SftSettings::default().validate().is_ok());
        let bad = SftSettings {
            heads: 3,
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("sft.heads"));
    }
}
