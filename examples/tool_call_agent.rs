//! The tool-call agent experiment: warm-start a small policy to call the
//! `code_interpreter` tool, continue with RL in the sandboxed tool-call environment with
//! integrated (outcome + step-wise process) rewards and with outcome-only rewards, and print
//! the held-out success rate of each after the configured numbers of updates.
//!
//! ```sh
//! cargo run --release --example tool_call_agent [-- [CONFIG.toml] [--out DIR] [--seed N]]
//! ```
//!
//! `CONFIG.toml` defaults to `examples/tool_call_agent.toml`; `--seed` overrides
//! `experiment.seed`; results go to `DIR` (default `runs/tool-call-agent-<unix time>`):
//! `results.json`, `details.json` and `success.png`. `RUST_LOG=info` shows each update.

use std::path::PathBuf;
use std::process::ExitCode;

use clawrl::toolagent::experiment::{run, summary_table, ExperimentFile};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut config = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/tool_call_agent.toml"
    ));
    let mut out: Option<PathBuf> = None;
    let mut seed: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => match args.next() {
                Some(v) => out = Some(PathBuf::from(v)),
                None => return usage("--out needs a directory"),
            },
            "--seed" => match args.next().map(|v| v.parse::<u64>()) {
                Some(Ok(v)) => seed = Some(v),
                _ => return usage("--seed needs a whole number"),
            },
            "-h" | "--help" => return usage(""),
            other if other.starts_with('-') => return usage(&format!("unknown option {other}")),
            other => config = PathBuf::from(other),
        }
    }
    let mut file = match ExperimentFile::from_file(&config) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(s) = seed {
        file.experiment.seed = s;
    }
    let run_dir = out.unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        PathBuf::from("runs").join(format!("tool-call-agent-{secs}"))
    });
    match run(&file, &run_dir) {
        Ok(report) => {
            println!("{}", summary_table(&report));
            println!(
                "warm start {} ({}), {:.0} s in all; results.json, details.json and success.png in {}",
                report.sft.dir.display(),
                if report.sft.cached { "cached" } else { "trained now" },
                report.seconds,
                run_dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(problem: &str) -> ExitCode {
    if !problem.is_empty() {
        eprintln!("error: {problem}");
    }
    eprintln!("usage: tool_call_agent [CONFIG.toml] [--out DIR] [--seed N]");
    if problem.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}
