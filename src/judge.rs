//! The judge: turns next states into rewards and hindsight hints (docs/design.md §1).
//!
//! It owns the prompts ([`prompt`]), the exact parsing of judge text into votes and hints
//! ([`parse`]), the backends that produce judge text ([`backend`]: scripted rules, any
//! OpenAI-compatible endpoint, a local chat model), the concurrent vote runner that never stalls
//! ([`votes`]), the judged-turn records and their JSONL writer ([`records`]), the pure part of OPD ([`opd`]) and its seams to the
//! local policy of `crate::model` ([`local`]: the engine as a judge, teacher scoring). Aggregation and the
//! advantage arithmetic live in [`crate::rl`]. Which endpoints and key variables a job's judge
//! may use is the node's to grant ([`access`]).

pub mod access;
pub mod backend;
pub mod config;
pub mod local;
pub mod opd;
pub mod openai;
pub mod parse;
pub mod prompt;
pub mod records;
pub mod scripted;
pub mod votes;

pub use access::{JudgeAccess, JudgeAccessError};
pub use backend::{
    BackendError, ChatGenerator, ChatMessage, GenerateError, Generated, JudgeBackend, JudgeRequest,
    ModelBackend, SamplingParams,
};
pub use config::{BackendConfig, JudgeConfig, JudgeConfigError, ModelSource, OpdConfig, Teacher};
pub use local::{EngineGenerator, TeacherError, TeacherModel, TeacherScore, TemplateKwargs};
pub use opd::{enhance_messages, OpdError, HINT_PREFIX};
pub use parse::{last_boxed_digit, parse_hint, parse_vote, VoteError};
pub use prompt::{
    Material, PromptKind, PromptOverrides, PromptSet, StepMaterial, StepMessage, TurnMaterial,
};
pub use records::{RecordError, RecordWriter};
pub use votes::{
    Judge, JudgedTurnRecord, StepJudgement, TurnJudgement, VoteKind, VoteRecord, VoteSettings,
};
