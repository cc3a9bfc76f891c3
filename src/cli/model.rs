//! `clawrl` subcommands of the model area.

use clap::Subcommand;

/// Subcommands of the model area.
#[derive(Subcommand)]
pub enum Commands {}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {}
}
