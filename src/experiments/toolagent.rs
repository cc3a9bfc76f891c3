//! The tool-call agent experiment: a small Qwen3 policy with its own
//! tokenizer ([`tokenizer`]) warm-started on generated transcripts ([`corpus`], [`sft`]) to
//! call the `code_interpreter` tool on generated math tasks ([`tasks`]), then trained with RL
//! in the real tool-call environment with integrated (outcome + step-wise process) rewards or
//! outcome-only rewards ([`experiment`]), the process score coming from a rule-based step
//! judge ([`prm`]). Run it with `cargo run --release --example tool_call_agent`.

pub mod corpus;
pub mod experiment;
pub mod prm;
pub mod sft;
pub mod tasks;
pub mod tokenizer;
