//! The actor runtime without the LLM crate: the job loops (sessions, admission, rollout, trainer, recorder), the bulk plane, hostile peers of a node, and the node supervisor's restarts.
//!
//! One test binary of modules: every module here shares one build and link of the
//! crates it tests.

mod admission;
mod bulk;
mod loopback;
mod node_hostile;
mod recorder;
mod rollout;
mod session;
mod supervision;
mod trainer;
