//! `clawrl` subcommands of the train area.

use clap::Subcommand;

/// Subcommands of the train area.
#[derive(Subcommand)]
pub enum Commands {}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {}
}
