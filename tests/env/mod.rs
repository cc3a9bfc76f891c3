//! Environments: episodes and sessions over the sandbox, the SWE repositories, the GUI browser, and `clawrl sandbox`.
//!
//! One test binary of modules: every module here shares one build and link of the
//! crates it tests.

mod browser_confinement;
mod episodes;
mod gui;
mod sandbox_cli;
mod sessions;
mod swe;
