//! The gateway: the OpenAI-compatible server over HTTP, real client SDKs and OpenClaw, load, and weight versions swapped in while it serves.

mod abuse;
mod crash;
mod hot_swap;
mod http;
mod load;
mod never_paused;
mod openai_sdk;
mod openclaw;
mod venv;
mod watch;
