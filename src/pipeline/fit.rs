//! Whether the job's prompts fit the policy's context, checked before any session starts.
//!
//! [`check_first_prompt`] starts an episode of the environment's first task (the one the job
//! supervisor starts first), renders its first observation (messages and tool schemas) with the
//! checkpoint's chat template exactly as the chat policy does, closes the episode, and refuses
//! the job when that prompt leaves no position for a response in the policy's context (the
//! smaller of `policy.max_context` and the checkpoint's `max_position_embeddings`). Without it,
//! such a job would only learn the fact from every session failing.

use clawrl_actors::loops::Environment;
use minijinja::Value;

use crate::model::ChatTemplate;

/// The context sequences actually get: `policy.max_context`, capped at the checkpoint's
/// `max_position_embeddings` (the engine caps it the same way).
pub fn effective_context(max_context: usize, max_positions: usize) -> usize {
    max_context.min(max_positions)
}

/// Why the first task's prompt was refused.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// The prompt leaves no room for a response.
    #[error(
        "the prompt of env task `{task}` (the first task, as rendered with its {tools} tool \
         schema(s) by the checkpoint's chat template) is {tokens} tokens, but the policy's \
         context holds {context} (policy.max_context {max_context}, the checkpoint's \
         max_position_embeddings {max_positions}) and a response needs at least one more \
         position: use a checkpoint with a longer context or shorter task prompts"
    )]
    TooLong {
        /// The task's id.
        task: String,
        /// Tool schemas in the prompt.
        tools: usize,
        /// Prompt tokens.
        tokens: usize,
        /// The effective context.
        context: usize,
        /// `policy.max_context`.
        max_context: usize,
        /// The checkpoint's `max_position_embeddings`.
        max_positions: usize,
    },
    /// The first task could not be started to measure its prompt.
    #[error("starting the first env task to measure its prompt: {0}")]
    Start(String),
    /// The chat template could not render the first observation.
    #[error("rendering the prompt of env task `{task}` with the chat template: {message}")]
    Render {
        /// The task's id.
        task: String,
        /// The template's error.
        message: String,
    },
}

/// What [`check_first_prompt`] measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptFit {
    /// The first task's id.
    pub task: String,
    /// Its prompt's tokens.
    pub tokens: usize,
    /// The effective context.
    pub context: usize,
}

/// Renders the first observation of task 0 and checks that it fits (see the module doc).
pub async fn check_first_prompt(
    env: &dyn Environment,
    template: &ChatTemplate,
    tokenizer: &tokenizers::Tokenizer,
    max_context: usize,
    max_positions: usize,
    seed: u64,
) -> Result<PromptFit, FitError> {
    let episode = env
        .start(0, seed)
        .await
        .map_err(|e| FitError::Start(e.to_string()))?;
    let task = episode.task_id().to_string();
    let observation = episode.observation();
    episode.close().await;
    let messages = Value::from_serialize(&observation.messages);
    let tools = (!observation.tools.is_empty()).then(|| Value::from_serialize(&observation.tools));
    let prompt = template
        .encode(tokenizer, &messages, tools.as_ref())
        .map_err(|e| FitError::Render {
            task: task.clone(),
            message: e.to_string(),
        })?;
    let context = effective_context(max_context, max_positions);
    // The chat policy's own refusal: a prompt must leave a position for the response.
    if prompt.ids.len() + 1 >= context {
        return Err(FitError::TooLong {
            task,
            tools: observation.tools.len(),
            tokens: prompt.ids.len(),
            context,
            max_context,
            max_positions,
        });
    }
    Ok(PromptFit {
        task,
        tokens: prompt.ids.len(),
        context,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_is_capped_by_the_checkpoint() {
        assert_eq!(effective_context(4096, 512), 512);
        assert_eq!(effective_context(1024, 2048), 1024);
    }
}
