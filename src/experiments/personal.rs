//! The personal-agent experiment in miniature: a small Qwen3 policy warm-started on
//! a synthetic, style-conditioned corpus ([`sft`], [`corpus`], [`tokenizer`]), simulated users
//! with deterministic taste ([`style`] for their rules, [`users`] for the conversations), and the
//! experiment driver that runs a `personal` job per method (binary RL, OPD, their combination),
//! with the simulated users as HTTP clients of its gateway, and measures the personalization
//! score on exactly the measured weight versions ([`experiment`], plotted by [`plot`]).

pub mod corpus;
pub mod experiment;
pub mod plot;
pub mod sft;
pub mod style;
pub mod tokenizer;
pub mod users;
