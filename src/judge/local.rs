//! The judge's seams to the local policy of [`crate::model`]: a [`ChatGenerator`] over the
//! generation engine (the `model` judge backend), and OPD teacher scoring (the teacher's per-token
//! log-probs of the *original* response under `s_enhanced`, then the four-case combine).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::tensor::backend::Backend;
use clawrl_actors::loops::TeacherTopK;
use futures::future::BoxFuture;
use minijinja::Value;
use thiserror::Error;

use super::backend::{ChatGenerator, ChatMessage, GenerateError, Generated, SamplingParams};
use super::opd::{enhance_messages, OpdError};

use crate::model::{
    load_checkpoint, score_response, score_response_topk, spawn_engine, ChatError, ChatTemplate,
    EngineHandle, EngineOptions, GenerationRequest, LinearLayout, LoadError, Qwen3,
};
use crate::rl::{combine, AdvantageError, AdvantageWeights, CombinedSample};

/// A chat generator backed by the policy's generation engine: renders the judge messages with
/// the checkpoint's chat template, generates, and decodes the sampled ids (special tokens
/// skipped). Votes without a seed get distinct seeds from a counter, so `m` votes are `m`
/// independent samples.
pub struct EngineGenerator {
    engine: EngineHandle,
    template: ChatTemplate,
    tokenizer: Arc<tokenizers::Tokenizer>,
    stop_token_ids: Vec<u32>,
    next_seed: AtomicU64,
}

impl EngineGenerator {
    /// Wraps a running engine with the template and tokenizer of the same checkpoint;
    /// `stop_token_ids` end generation (e.g. `Checkpoint::stop_token_ids`).
    pub fn new(
        engine: EngineHandle,
        template: ChatTemplate,
        tokenizer: Arc<tokenizers::Tokenizer>,
        stop_token_ids: Vec<u32>,
        seed: u64,
    ) -> Self {
        Self {
            engine,
            template,
            tokenizer,
            stop_token_ids,
            next_seed: AtomicU64::new(seed),
        }
    }
}

impl EngineGenerator {
    /// Loads a Hugging Face checkpoint directory on the CPU backend and starts a generation
    /// engine over it: a `model` judge from any checkpoint (or the frozen initial policy's).
    pub fn load(
        dir: &std::path::Path,
        options: EngineOptions,
        seed: u64,
    ) -> Result<Self, LoadError> {
        let ck = load_checkpoint::<crate::CpuBackend>(dir, &Default::default())?;
        let stop = ck.stop_token_ids();
        let tokenizer = Arc::new(ck.tokenizer);
        let model = ck
            .model
            .into_layout(LinearLayout::decoding::<crate::CpuBackend>());
        let engine = spawn_engine(Arc::new(model), Some(tokenizer.clone()), options);
        Ok(Self::new(engine, ck.chat_template, tokenizer, stop, seed))
    }
}

impl ChatGenerator for EngineGenerator {
    fn generate<'a>(
        &'a self,
        messages: &'a [ChatMessage],
        params: &'a SamplingParams,
    ) -> BoxFuture<'a, Result<Generated, GenerateError>> {
        Box::pin(async move {
            let prompt =
                self.template
                    .encode(&self.tokenizer, &Value::from_serialize(messages), None)?;
            let seed = params
                .seed
                .unwrap_or_else(|| self.next_seed.fetch_add(1, Ordering::Relaxed));
            let request = GenerationRequest {
                prompt_ids: prompt.ids,
                params: crate::model::SamplingParams {
                    temperature: params.temperature,
                    top_p: params.top_p,
                    top_k: 0,
                    max_new_tokens: params.max_tokens as usize,
                    stop_token_ids: self.stop_token_ids.clone(),
                    stop_strings: Vec::new(),
                    seed,
                },
                raw_logprobs: None,
            };
            let out = self.engine.generate(request).await?;
            let text = self
                .tokenizer
                .decode(&out.response_ids, true)
                .map_err(|e| format!("decoding the judge's answer: {e}"))?;
            Ok(Generated {
                text,
                cut_off: out.finish_reason == crate::model::FinishReason::Length,
            })
        })
    }
}

/// Errors scoring an OPD sample with the teacher.
#[derive(Debug, Error)]
pub enum TeacherError {
    /// `s_enhanced` could not be built.
    #[error(transparent)]
    Opd(#[from] OpdError),
    /// The chat template or tokenizer failed on `s_enhanced`.
    #[error("rendering s_enhanced: {0}")]
    Chat(#[from] ChatError),
    /// Nothing to score.
    #[error("OPD: empty response")]
    EmptyResponse,
    /// A response id outside the teacher's vocabulary.
    #[error(
        "OPD: response token {token} at {index} is outside the teacher's vocabulary of {vocab}"
    )]
    BadToken {
        /// The id.
        token: u32,
        /// Its position.
        index: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The top-k asked for does not fit the teacher's vocabulary.
    #[error("OPD: method.topk {k} must be in 1..={vocab} (the teacher's vocabulary)")]
    TopK {
        /// The k asked for.
        k: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The advantages could not be combined.
    #[error(transparent)]
    Advantage(#[from] AdvantageError),
}

/// Extra chat-template variables (a request's `chat_template_kwargs`).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// What the teacher says about a response under `s_enhanced`.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherScore {
    /// `log π_teacher(a_k | s_enhanced)`, one per response token.
    pub logprobs: Vec<f32>,
    /// The teacher's top-k at every response position, when asked for.
    pub topk: Option<TeacherTopK>,
}

/// A teacher: the policy (current or frozen) with the chat template and tokenizer it renders with.
pub struct TeacherModel<'a, B: Backend> {
    /// The teacher's weights.
    pub model: &'a Qwen3<B>,
    /// The chat template `s_t` was rendered with.
    pub template: &'a ChatTemplate,
    /// The tokenizer.
    pub tokenizer: &'a tokenizers::Tokenizer,
}

impl<B: Backend> TeacherModel<'_, B> {
    /// `log π_teacher(a_t,k | s_enhanced)` for every original response token: `s_enhanced` is
    /// `messages` with the hint on the last user message, rendered with the same `tools`, the
    /// same extra template variables `kwargs` and the generation prompt, exactly as `s_t` was
    /// served.
    pub fn logprobs(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &TemplateKwargs,
        hint: &str,
        response_ids: &[u32],
    ) -> Result<Vec<f32>, TeacherError> {
        let prompt = self.enhanced_prompt(messages, tools, kwargs, hint, response_ids)?;
        Ok(score_response(self.model, &prompt, response_ids))
    }

    /// [`TeacherModel::logprobs`] and, with `topk = Some(k)`, the teacher's `k` most likely
    /// tokens and their log-probs at every response position under `s_enhanced` (one forward
    /// pass for both). `k` must be in `1..=vocab`.
    pub fn score(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &TemplateKwargs,
        hint: &str,
        response_ids: &[u32],
        topk: Option<usize>,
    ) -> Result<TeacherScore, TeacherError> {
        let Some(k) = topk else {
            return Ok(TeacherScore {
                logprobs: self.logprobs(messages, tools, kwargs, hint, response_ids)?,
                topk: None,
            });
        };
        let vocab = self.model.vocab_size();
        if !(1..=vocab).contains(&k) {
            return Err(TeacherError::TopK { k, vocab });
        }
        let prompt = self.enhanced_prompt(messages, tools, kwargs, hint, response_ids)?;
        let s = score_response_topk(self.model, &prompt, response_ids, k);
        Ok(TeacherScore {
            logprobs: s.logprobs,
            topk: Some(TeacherTopK {
                k: k as u32,
                ids: s.ids,
                logprobs: s.topk_logprobs,
            }),
        })
    }

    /// `s_enhanced` as token ids, after checking the response against the teacher's vocabulary.
    fn enhanced_prompt(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &TemplateKwargs,
        hint: &str,
        response_ids: &[u32],
    ) -> Result<Vec<u32>, TeacherError> {
        if response_ids.is_empty() {
            return Err(TeacherError::EmptyResponse);
        }
        let vocab = self.model.vocab_size();
        if let Some((index, &token)) = response_ids
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(TeacherError::BadToken {
                token,
                index,
                vocab,
            });
        }
        let enhanced = enhance_messages(messages, hint)?;
        Ok(self
            .template
            .encode_with(self.tokenizer, &enhanced, tools, kwargs)?
            .ids)
    }

    /// The combined training sample of one turn (docs/design.md §1's four cases): with a hint, the
    /// teacher scores the response under `s_enhanced` and `old_logprobs` (the old policy under
    /// `s_t`) give the OPD term; `reward` gives the binary term. `Ok(None)`: no sample.
    #[allow(clippy::too_many_arguments)]
    pub fn combined_sample(
        &self,
        weights: AdvantageWeights,
        reward: i8,
        hint: Option<&str>,
        messages: &Value,
        tools: Option<&Value>,
        response_ids: &[u32],
        old_logprobs: &[f32],
    ) -> Result<Option<CombinedSample>, TeacherError> {
        let none = TemplateKwargs::new();
        let teacher = match hint {
            Some(h) => Some(self.logprobs(messages, tools, &none, h, response_ids)?),
            None => None,
        };
        Ok(combine(
            weights,
            reward,
            teacher.as_deref().map(|t| (t, old_logprobs)),
            response_ids.len(),
        )?)
    }
}
