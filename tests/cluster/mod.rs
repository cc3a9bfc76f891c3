//! Cluster tests: `clawrl node` processes on loopback with mutual TLS, jobs placed across them, and their faults.
//!
//! One test binary of modules: every module here shares one build and link of the
//! crates it tests.

mod faults;
mod intruder;
mod jobs;
mod mesh;
mod tls;
mod util;
