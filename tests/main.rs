//! The integration tests of the `clawrl` package, one binary of modules, one per area, so that
//! the generic Burn, actor and serde code they use is compiled and linked once rather than once
//! per area. (`sandbox_attacks` and `sandbox_init_memory` keep their own processes: each
//! measures its process's peak memory.)

mod cluster;
mod env;
mod gateway;
mod jobs;
mod model;
#[path = "support/personal_run.rs"]
mod personal_run;
