//! The actor runtime without the LLM crate: the job loops (sessions, admission, rollout, trainer, recorder), the bulk plane, and hostile peers of a node.
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
mod trainer;
