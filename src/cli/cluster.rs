//! `clawrl` subcommands of the cluster area.

use clap::Subcommand;

/// Subcommands of the cluster area.
#[derive(Subcommand)]
pub enum Commands {}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {}
}
