//! The one async trait every judge backend implements, and the local-model backend.
//!
//! A backend turns a rendered judge request into the judge's raw text; parsing it into a vote is
//! the runner's job ([`super::votes`]), so every backend's output goes through the same exact
//! parser. Backends: [`super::scripted::ScriptedBackend`] (rules from config),
//! [`super::openai::OpenAiBackend`] (any OpenAI-compatible endpoint) and [`ModelBackend`] (a local
//! policy behind the small [`ChatGenerator`] trait).

use std::sync::Arc;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::prompt::{Material, PromptKind};

/// One chat message, OpenAI style (text content only: judge prompts are text).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// Sampling parameters of one judge query.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Temperature (docs/design.md §1: 0.6).
    pub temperature: f32,
    /// Nucleus sampling mass.
    pub top_p: f32,
    /// Maximum tokens of the judge's answer.
    pub max_tokens: u32,
    /// A per-vote seed, for backends that honour one.
    pub seed: Option<u64>,
}

/// One judge query: the rendered messages plus what they were rendered from.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeRequest {
    /// The prompt kind (which also fixes the allowed scores).
    pub kind: PromptKind,
    /// The material the prompt was rendered from (scripted rules read it).
    pub material: Material,
    /// The messages to send.
    pub messages: Vec<ChatMessage>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Index of this vote among the `m` votes of its setting.
    pub vote_index: u32,
}

/// Why a backend produced no text. Every variant becomes a failed vote, never a stall.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BackendError {
    /// The endpoint could not be reached (connection refused, DNS, TLS).
    #[error("judge endpoint unreachable: {0}")]
    Unreachable(String),
    /// No answer within the time limit.
    #[error("judge timed out after {0} ms")]
    Timeout(u64),
    /// The endpoint answered with an HTTP error status.
    #[error("judge endpoint answered HTTP {status}: {body}")]
    Http {
        /// The status code.
        status: u16,
        /// The start of the response body.
        body: String,
    },
    /// The endpoint answered 2xx but not with a chat completion we can read.
    #[error("judge endpoint gave an unreadable response: {0}")]
    BadResponse(String),
    /// A local generator failed.
    #[error("local judge model failed: {0}")]
    Generation(String),
    /// The answer was cut off at `max_tokens` (the endpoint's `finish_reason` was `length`).
    /// The vote still counts when the text parses; otherwise it fails as truncated.
    #[error("judge answer cut off at max_tokens = {max_tokens}")]
    Truncated {
        /// The budget it hit.
        max_tokens: u32,
        /// What was written before the cut.
        text: String,
    },
}

/// A judge backend: rendered request in, raw judge text out.
pub trait JudgeBackend: Send + Sync {
    /// A short name for logs and records (`scripted`, `openai`, `model`).
    fn name(&self) -> &str;

    /// Produces the judge's text for one vote.
    fn complete<'a>(
        &'a self,
        request: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>>;
}

/// A [`ChatGenerator`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// The text.
    pub text: String,
    /// Generation stopped at `max_tokens`, not at an end of turn.
    pub cut_off: bool,
}

/// The error type of a [`ChatGenerator`].
pub type GenerateError = Box<dyn std::error::Error + Send + Sync>;

/// A local chat model: messages plus sampling parameters in, generated text out. The policy
/// engine of `crate::model` (frozen initial policy or any HF checkpoint, served by a rollout
/// worker pool) is plugged in behind this trait.
pub trait ChatGenerator: Send + Sync {
    /// Generates the assistant's reply to `messages`.
    fn generate<'a>(
        &'a self,
        messages: &'a [ChatMessage],
        params: &'a SamplingParams,
    ) -> BoxFuture<'a, Result<Generated, GenerateError>>;
}

/// The `model` backend: judge votes sampled from a local chat model.
pub struct ModelBackend {
    generator: Arc<dyn ChatGenerator>,
}

impl ModelBackend {
    /// Wraps a generator.
    pub fn new(generator: Arc<dyn ChatGenerator>) -> Self {
        Self { generator }
    }
}

impl JudgeBackend for ModelBackend {
    fn name(&self) -> &str {
        "model"
    }

    fn complete<'a>(
        &'a self,
        request: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        Box::pin(async move {
            let out = self
                .generator
                .generate(&request.messages, &request.params)
                .await
                .map_err(|e| BackendError::Generation(e.to_string()))?;
            if out.cut_off {
                return Err(BackendError::Truncated {
                    max_tokens: request.params.max_tokens,
                    text: out.text,
                });
            }
            Ok(out.text)
        })
    }
}
