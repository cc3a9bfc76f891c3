//! Subcommands of the `clawrl` binary, one module per area.

pub mod check;
pub mod cluster;
pub mod model;
pub mod run;
pub mod sandbox;
pub mod serve;
pub mod sft;
pub mod train;

/// Logs go to stderr through `tracing`; `RUST_LOG` filters them (default `default_level`).
pub fn init_tracing(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
