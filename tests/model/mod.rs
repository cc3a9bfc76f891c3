//! The policy and the trainer: Qwen3 checkpoints, parity with the reference fixtures, the engine, the learner, and their CLI commands.

mod checkpoint;
mod cli;
mod device_cli;
mod engine;
mod lora;
mod parity;
mod train_learner;
mod train_offline_cli;
mod train_parity;
