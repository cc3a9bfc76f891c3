//! Serving: the OpenAI-compatible gateway over HTTP, real client SDKs and OpenClaw, load, and weight versions swapped in while it serves.
//!
//! One test binary of modules: every module here shares one build and link of the
//! crates it tests.

mod abuse;
mod crash;
mod hot_swap;
mod http;
mod load;
mod never_paused;
mod openai_sdk;
mod openclaw;
#[path = "../support/personal_run.rs"]
mod personal_run;
mod venv;
mod watch;
