//! The policy as environment sessions use it: a [`TurnPolicy`] over a pool of rollout workers
//! serving the Qwen3 engine ([`EnginePolicy`]).
//!
//! For each observation it renders the conversation and tools with the checkpoint's chat
//! template (generation prompt on), tokenizes, asks one rollout worker to generate (round-robin;
//! a worker that is gone or refuses is skipped and the next one asked, so sessions re-route when
//! a replica dies), decodes the sampled ids (special tokens kept, so tool-call tags survive:
//! [`served_text`]) and parses Qwen tool calls into an [`Action`]. The token ids, their
//! log-probs and the weight version come back exactly as the worker produced them; nothing is
//! re-tokenized. A response whose tool-call markup is malformed is not an
//! error: it becomes a plain-text action, and the environment answers it as such.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clawrl_actors::loops::{
    Action, BoxFuture, Observation, PolicyError, PolicyTurn, RolloutMsg, ToolCallAction, TurnPolicy,
};
use minijinja::Value;
use ractor::ActorRef;

use crate::model::{parse_tool_calls, ChatTemplate, GenerationRequest, SamplingParams};
use crate::serve::EnginePolicy;
use crate::CpuBackend;

/// A rollout worker over the engine.
pub type Replica = ActorRef<RolloutMsg<EnginePolicy<CpuBackend>>>;

/// The chat policy over a replica pool.
pub struct ChatPolicy {
    replicas: Vec<Replica>,
    next: AtomicUsize,
    template: Arc<ChatTemplate>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    params: SamplingParams,
    next_seed: AtomicU64,
    max_context: usize,
    timeout: Duration,
}

impl ChatPolicy {
    /// A policy over `replicas` (at least one) that samples with `params` (its `seed` is the
    /// base of per-request seeds) and refuses prompts that leave no room in `max_context`.
    pub fn new(
        replicas: Vec<Replica>,
        template: Arc<ChatTemplate>,
        tokenizer: Arc<tokenizers::Tokenizer>,
        params: SamplingParams,
        max_context: usize,
        timeout: Duration,
    ) -> Self {
        assert!(!replicas.is_empty(), "a chat policy needs a replica");
        ChatPolicy {
            replicas,
            next: AtomicUsize::new(0),
            next_seed: AtomicU64::new(params.seed),
            template,
            tokenizer,
            params,
            max_context,
            timeout,
        }
    }

    /// The replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    async fn generate(
        &self,
        prompt_ids: Vec<u32>,
    ) -> Result<clawrl_actors::loops::Generated<crate::model::GenerationResult>, PolicyError> {
        let mut params = self.params.clone();
        params.seed = self.next_seed.fetch_add(1, Ordering::Relaxed);
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut errors = Vec::new();
        for k in 0..self.replicas.len() {
            let replica = &self.replicas[(start + k) % self.replicas.len()];
            let request = GenerationRequest {
                prompt_ids: prompt_ids.clone(),
                params: params.clone(),
                raw_logprobs: None,
            };
            match replica
                .call(
                    |port| RolloutMsg::Generate(request, port),
                    Some(self.timeout),
                )
                .await
            {
                Ok(ractor::rpc::CallResult::Success(Ok(g))) => return Ok(g),
                Ok(ractor::rpc::CallResult::Success(Err(e))) => {
                    // A generation error is about the request, not the replica: no retry.
                    return Err(PolicyError(e.to_string()));
                }
                Ok(ractor::rpc::CallResult::Timeout) => errors.push(format!(
                    "replica {}: no answer within {:?}",
                    replica.get_id(),
                    self.timeout
                )),
                Ok(ractor::rpc::CallResult::SenderError) | Err(_) => {
                    errors.push(format!("replica {} is gone", replica.get_id()))
                }
            }
        }
        Err(PolicyError(format!(
            "no rollout worker answered: {}",
            errors.join("; ")
        )))
    }
}

/// Splits sampled text into the action the environment sees.
pub fn action_of(text: &str, raw: String, call_prefix: &str) -> Action {
    match parse_tool_calls(text) {
        Ok(parsed) => Action {
            content: parsed.content,
            tool_calls: parsed
                .tool_calls
                .into_iter()
                .enumerate()
                .map(|(i, c)| ToolCallAction {
                    id: format!("{call_prefix}-{i}"),
                    name: c.name,
                    arguments: c.arguments,
                })
                .collect(),
            raw,
        },
        Err(e) => {
            tracing::debug!("malformed tool-call markup, kept as text: {e}");
            Action {
                content: text.trim().to_string(),
                tool_calls: Vec::new(),
                raw,
            }
        }
    }
}

impl TurnPolicy for ChatPolicy {
    fn act<'a>(
        &'a self,
        observation: &'a Observation,
    ) -> BoxFuture<'a, Result<PolicyTurn, PolicyError>> {
        Box::pin(chat_turn(
            &self.template,
            &self.tokenizer,
            self.max_context,
            observation,
            |ids| self.generate(ids),
        ))
    }
}

/// The response as served and parsed: `ids` decoded with special tokens kept (a tokenizer may
/// mark `<tool_call>` / `</tool_call>` special, and skipping special tokens would erase the
/// tool-call markup), less the final stop token when generation `stopped` on one.
pub fn served_text(
    tokenizer: &tokenizers::Tokenizer,
    ids: &[u32],
    stopped: bool,
) -> tokenizers::Result<String> {
    let ids = match ids.split_last() {
        Some((_, rest)) if stopped => rest,
        _ => ids,
    };
    tokenizer.decode(ids, false)
}

/// One turn of the chat policy with generation left to `generate` (a local replica pool, or
/// rollout workers on other nodes): render `observation` with the chat template and tools,
/// refuse a prompt that leaves no room in `max_context`, generate, decode and parse tool calls.
pub(crate) async fn chat_turn<F, Fut>(
    template: &ChatTemplate,
    tokenizer: &tokenizers::Tokenizer,
    max_context: usize,
    observation: &Observation,
    generate: F,
) -> Result<PolicyTurn, PolicyError>
where
    F: FnOnce(Vec<u32>) -> Fut,
    Fut: std::future::Future<
        Output = Result<
            clawrl_actors::loops::Generated<crate::model::GenerationResult>,
            PolicyError,
        >,
    >,
{
    let messages = Value::from_serialize(&observation.messages);
    let tools = (!observation.tools.is_empty()).then(|| Value::from_serialize(&observation.tools));
    let prompt = template
        .encode_with(
            tokenizer,
            &messages,
            tools.as_ref(),
            &observation.template_kwargs,
        )
        .map_err(|e| PolicyError(format!("rendering the observation: {e}")))?;
    if prompt.ids.len() + 1 >= max_context {
        return Err(PolicyError(format!(
            "the prompt has {} tokens; the context holds {}",
            prompt.ids.len(),
            max_context
        )));
    }
    let g = generate(prompt.ids.clone()).await?;
    let ids = &g.output.response_ids;
    let stopped = g.output.finish_reason == crate::model::FinishReason::Stop;
    let text = served_text(tokenizer, ids, stopped)
        .map_err(|e| PolicyError(format!("decoding the response: {e}")))?;
    let raw = tokenizer
        .decode(ids, false)
        .map_err(|e| PolicyError(format!("decoding the response: {e}")))?;
    let call_prefix = format!("call-v{}-{}", g.version, ids.len());
    Ok(PolicyTurn {
        action: action_of(&text, raw, &call_prefix),
        prompt_ids: prompt.ids,
        response_ids: g.output.response_ids,
        logprobs: g.output.logprobs,
        version: g.version,
        prompt_text: prompt.text,
        response_text: text,
    })
}
