//! The policy: a Qwen3 decoder in Burn that loads and saves Hugging Face checkpoints, renders
//! chat templates exactly as Hugging Face does, scores responses and generates with a KV cache.
//!
//! Layout: [`config`] (the `config.json` schema), [`qwen3`] (the module and its forward passes),
//! [`attention`] (tiled causal attention with its own backward; [`cpu_attention`], its forward
//! as one CPU kernel), [`matmul`] (float32-exact
//! products on GPUs that round to TF32),
//! [`lora`] (low-rank adapters on the linear layers: attach, read back, merge), [`peft`] (the
//! PEFT adapter directory in and out),
//! [`kv_cache`] (per-sequence cache outside the model), [`prefix_cache`] (which prompt blocks
//! the engine keeps for reuse), [`weights`] (safetensors in and out),
//! [`checkpoint`] (the directory layout), [`chat`] (templates and tokenization), [`score`]
//! (per-token log-probs in one pass), [`sampling`] (temperature / top-k / top-p), [`engine`] (the
//! batching scheduler) and [`tool_call`] (Qwen `<tool_call>` parsing).

pub mod attention;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod cpu_attention;
pub mod cpu_matmul;
pub mod cpu_tensor;
pub mod engine;
pub mod fused;
pub mod kv_cache;
pub mod lora;
pub mod matmul;
pub mod peft;
pub mod prefix_cache;
pub mod qwen3;
pub mod sampling;
pub mod score;
pub mod tool_call;
pub mod weights;

pub use chat::{ChatError, ChatTemplate, Prompt};
pub use checkpoint::{
    load_checkpoint, load_checkpoint_in, load_config, load_model, load_model_in,
    save_checkpoint_dir, Checkpoint, LoadError, ReadError, TokenizerFiles,
};
pub use config::{ConfigError, Qwen3Config};
pub use engine::{
    spawn_engine, EngineError, EngineHandle, EngineOptions, FinishReason, GenerationRequest,
    GenerationResult, StreamEvent, MAX_TOP_LOGPROBS,
};
pub use fused::token_logprobs;
pub use kv_cache::{KvCache, KvCacheError};
pub use lora::{LoraConfig, LoraConfigError, LoraError, LoraTarget, LoraWeights};
pub use peft::{apply_adapter, load_adapter, save_adapter, AdapterLoadError, AdapterSaveError};
pub use qwen3::{LinearLayout, Qwen3, WeightData};
pub use sampling::{RawLogprobs, SamplingParams};
pub use score::{score_batch, score_response, score_response_topk, ScoredTopK};
pub use tool_call::{parse_tool_calls, ParsedResponse, ToolCall, ToolCallError};
pub use weights::{
    model_from_safetensors, model_from_safetensors_as, model_from_shared_safetensors,
    model_to_safetensors, model_to_safetensors_into, SaveError,
};
