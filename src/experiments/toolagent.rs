//! The tool-call agent experiment: a small Qwen3 policy with its own
//! tokenizer ([`tokenizer`]) warm-started on generated transcripts ([`corpus`], [`sft`]) to
//! call the `code_interpreter` tool on generated math tasks ([`tasks`]), then trained with RL
//! by a step-wise `clawrl` job per reward arm in the real tool-call environment, with
//! integrated (outcome + step-wise process) rewards or outcome-only rewards ([`experiment`]),
//! the process score coming from a rule-based step judge ([`prm`]) behind the job's judge
//! endpoint ([`endpoint`]). Run it with `clawrl run examples/tool_call_agent.toml`.

pub mod corpus;
pub mod endpoint;
pub mod experiment;
pub mod prm;
pub mod sft;
pub mod tasks;
pub mod tokenizer;
