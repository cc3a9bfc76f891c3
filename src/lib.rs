//! clawrl: online reinforcement learning for LLM agents from the signals their own use produces.
//!
//! The root crate knows LLMs and RL: the Qwen3 policy in Burn ([`model`]), the pure RL core
//! ([`rl`]), the judge ([`judge`]) and the learner ([`train`]). The actor system and the QUIC
//! cluster runtime live in the `clawrl-actors` crate, which knows no LLM. The experiments in
//! miniature (the personal agent, the tool-call agent) are part of the `clawrl` program
//! (`src/experiments/`), not of this library: they use it as any other user would.

pub mod device;
pub mod env;
pub mod gateway;
pub mod job;
pub mod judge;
pub mod model;
pub mod pipeline;
pub mod rl;
pub mod sandbox;
pub mod serve;
pub mod train;
pub mod watch;

/// The default CPU backend (Burn's pure-Rust Flex backend).
pub type CpuBackend = burn::backend::Flex;
/// The CPU backend with automatic differentiation, used by the learner.
pub type CpuAutodiff = burn::backend::Autodiff<CpuBackend>;
