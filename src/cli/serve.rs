//! `clawrl` subcommands of the serving area.

use clap::Subcommand;

/// Subcommands of the serving area.
#[derive(Subcommand)]
pub enum Commands {}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {}
}
