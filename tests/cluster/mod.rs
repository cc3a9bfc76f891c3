//! Cluster tests: `clawrl node` processes on loopback with mutual TLS, jobs placed across them, and their faults.

mod faults;
mod intruder;
mod jobs;
mod mesh;
mod tls;
mod util;
