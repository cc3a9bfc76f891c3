//! The `clawrl` command line. Each area owns its subcommands in `src/cli/<area>.rs`; this file
//! only parses and dispatches.

use clap::{Parser, Subcommand};

mod cli;
mod experiments;

#[derive(Parser)]
#[command(name = "clawrl", version, about = "Online RL for LLM agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Cluster(cli::cluster::Commands),
    #[command(flatten)]
    Model(cli::model::Commands),
    #[command(flatten)]
    Train(cli::train::Commands),
    #[command(flatten)]
    Serve(cli::serve::Commands),
    #[command(flatten)]
    Sandbox(cli::sandbox::Commands),
    #[command(flatten)]
    Sft(cli::sft::Commands),
    #[command(flatten)]
    Run(cli::run::Commands),
    #[command(flatten)]
    Check(cli::check::Commands),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Progress bars of `run` and `sft` would be interleaved with info logs: those two default
    // to warnings only (RUST_LOG still overrides).
    let quiet = matches!(cli.command, Command::Run(_) | Command::Sft(_));
    cli::init_tracing(if quiet { "warn" } else { "info" });
    match cli.command {
        Command::Cluster(c) => cli::cluster::run(c),
        Command::Model(c) => cli::model::run(c),
        Command::Train(c) => cli::train::run(c),
        Command::Serve(c) => cli::serve::run(c),
        Command::Sandbox(c) => cli::sandbox::run(c),
        Command::Sft(c) => cli::sft::run(c),
        Command::Run(c) => cli::run::run(c),
        Command::Check(c) => cli::check::run(c),
    }
}
