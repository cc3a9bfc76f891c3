//! `clawrl sandbox exec`: runs one command in the Linux sandbox ([`clawrl::sandbox`]) and
//! prints `{"stdout","stderr","exit_code","signal","timed_out","truncated","wall"}` as one JSON
//! line. The command's own failures are in the JSON; the exit status is non-zero only when the
//! sandbox itself could not run (bad arguments, no namespaces).

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use clawrl::sandbox::{self, Limits, SandboxSpec};

/// Subcommands of the sandbox area.
#[derive(Subcommand)]
pub enum Commands {
    /// Run commands in the sandbox (no network, read-only system, rlimits, timeout).
    Sandbox {
        #[command(subcommand)]
        cmd: SandboxCommand,
    },
}

/// `clawrl sandbox ...`.
#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Run one command and print its result as JSON.
    Exec(ExecArgs),
    /// Check that sandboxes can start on this host.
    Probe,
}

/// Arguments of `clawrl sandbox exec`.
#[derive(Args)]
pub struct ExecArgs {
    /// Wall-clock timeout in seconds (the whole process tree is killed).
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Memory limit in MiB: of the sandbox's cgroup (memory used, /tmp included) where the host
    /// has usable cgroups, else an address-space limit per process. /tmp (a tmpfs) holds half of it.
    #[arg(long, default_value_t = Limits::default().memory_mb)]
    memory: u64,
    /// CPU-time limit in seconds.
    #[arg(long, default_value_t = Limits::default().cpu_secs)]
    cpu: u64,
    /// Processes and threads the command may have at once.
    #[arg(long, default_value_t = Limits::default().processes)]
    processes: u64,
    /// Largest file the command may write, in MiB.
    #[arg(long, default_value_t = Limits::default().file_size_mb)]
    file_size: u64,
    /// Bytes kept of stdout and of stderr each.
    #[arg(long, default_value_t = Limits::default().output_bytes)]
    output_bytes: usize,
    /// Host directory mounted at /work (its contents are chowned to the sandbox user; its size
    /// is not capped). Without it a fresh empty directory is used, capped by --disk, and removed
    /// afterwards.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Size cap in MiB of the fresh work dir (a tmpfs; the total of its files) when --workdir is
    /// not given.
    #[arg(long, default_value_t = 1024)]
    disk: u64,
    /// Feed this process's stdin to the command.
    #[arg(long)]
    stdin: bool,
    /// Extra environment variable KEY=VALUE (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {
        Commands::Sandbox { cmd } => match cmd {
            SandboxCommand::Exec(a) => exec(a),
            SandboxCommand::Probe => {
                sandbox::probe()?;
                println!(
                    "sandboxes can start on this host; memory and processes limited by {}",
                    sandbox::enforcement()
                );
                Ok(())
            }
        },
    }
}

fn exec(a: ExecArgs) -> anyhow::Result<()> {
    if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= 1e9) {
        bail!(
            "--timeout must be a positive number of seconds, got {}",
            a.timeout
        );
    }
    let env = a
        .env
        .iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => bail!("--env {kv:?} is not KEY=VALUE"),
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let stdin = if a.stdin {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading stdin")?;
        Some(buf)
    } else {
        None
    };
    let scratch = match &a.workdir {
        Some(_) => None,
        None => Some(make_scratch(a.disk)?),
    };
    let workdir = a
        .workdir
        .clone()
        .or_else(|| scratch.clone())
        .expect("one is set");
    let spec = SandboxSpec {
        workdir,
        command: a.command,
        stdin,
        env,
        limits: Limits {
            cpu_secs: a.cpu,
            memory_mb: a.memory,
            processes: a.processes,
            file_size_mb: a.file_size,
            timeout: Duration::from_secs_f64(a.timeout),
            output_bytes: a.output_bytes,
        },
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(sandbox::exec(&spec));
    if let Some(dir) = scratch {
        let _ = sandbox::scratch::unmount(&dir);
        let _ = std::fs::remove_dir_all(dir);
    }
    let out = result?;
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// A fresh private scratch work dir (never one that existed before: it is chowned and
/// mounted), a tmpfs of `disk_mb` MiB.
fn make_scratch(disk_mb: u64) -> anyhow::Result<PathBuf> {
    let tmp = std::env::temp_dir();
    let dir = sandbox::host_fs::private_dir(&tmp, "clawrl-sandbox-")
        .with_context(|| format!("creating a scratch work dir in {}", tmp.display()))?;
    if let Err(e) = sandbox::scratch::mount_capped(&dir, disk_mb) {
        let _ = std::fs::remove_dir(&dir);
        // A host that cannot mount cannot start sandboxes either: say so when that is why.
        sandbox::probe()?;
        return Err(e).context("capping the scratch work dir (--disk)");
    }
    Ok(dir)
}
