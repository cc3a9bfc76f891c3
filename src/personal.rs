//! The personal-agent experiment in miniature: a small Qwen3 policy warm-started on
//! a synthetic, style-conditioned corpus ([`sft`], [`corpus`], [`tokenizer`]), simulated users
//! with deterministic taste ([`style`]; the environment is `crate::env::personal`), and the
//! experiment driver that trains with binary RL, OPD and their combination and measures the
//! personalization score ([`experiment`], plotted by [`plot`]).

pub mod corpus;
pub mod experiment;
pub mod plot;
pub mod sft;
pub mod style;
pub mod tokenizer;
