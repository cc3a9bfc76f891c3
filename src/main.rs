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
    keep_freed_memory();
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

/// Has glibc keep freed memory for reuse instead of handing it back to the kernel at once.
/// Every tensor op allocates its output, and glibc serves a block above its mmap threshold
/// (128 KiB to start with) from a fresh mapping and unmaps it when freed, so each op over a long
/// prompt faulted in and zeroed new pages: 7% of a 12k-token prefill was the kernel's page-fault
/// path. With blocks up to 64 MiB taken from the heap and up to 256 MiB of free heap kept, that
/// prefill ran 1.11x as fast, at the same peak RSS. A `GLIBC_TUNABLES` the user set wins.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("GLIBC_TUNABLES").is_none() {
        // SAFETY: mallopt only sets the allocator's parameters; no other thread runs yet.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        }
    }
}
