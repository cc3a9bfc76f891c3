//! The Linux sandbox that runs the policy's commands (docs/design.md §4: terminal, SWE and tool-call
//! environments): no network; private user, mount, pid, ipc, uts and network namespaces; a
//! private writable work dir mounted at `/work` (the cwd) over a read-only view of the system;
//! rlimits on CPU time, memory, processes and file size; a wall-clock timeout that kills the
//! whole process tree; stdout and stderr captured up to a byte cap with a truncation marker.
//!
//! It is built directly on Linux system calls (no daemon, no setuid helper), one `clone` per
//! command:
//!
//! - the host side ([`run`]) validates the [`SandboxSpec`], hands the work dir to the sandbox
//!   user, plans the mounts ([`plan`]), clones the sandbox init with every namespace at once,
//!   writes its uid/gid maps, then drives stdin, the two capped readers and the deadline;
//! - the sandbox init ([`child`], pid 1 of the new pid namespace) builds the new root from the
//!   plan, pivots into it and forks the command, which drops to the unprivileged sandbox user
//!   (uid/gid 1000 inside, [`HOST_UID`] outside), sets its rlimits and `no_new_privs` and execs.
//!   When the command exits, the init reports its status and exits, and the kernel kills
//!   whatever the command left behind; on timeout the host kills the init, with the same effect.
//!   The init reaps orphans, exits when the host process dies (its end of a pipe closes), runs
//!   none of the host's signal handlers and unmaps its copy of the host's anonymous memory.
//!
//! Each sandbox has its own cgroup where the host offers one ([`cgroup`]: v2, else v1 memory
//! and pids, else none with a warning logged once): its memory limit counts the memory used
//! (`/tmp`, a tmpfs, included), not the address space reserved, so threaded programs run; its
//! pids limit bounds processes and threads. Fork bombs are also contained by `RLIMIT_NPROC`,
//! which binds because the command runs as a non-root host uid inside its own user namespace
//! (the kernel counts processes per user namespace and uid, so sandboxes do not share the
//! budget). Without cgroups, memory bombs are stopped by `RLIMIT_AS` alone. A seccomp filter
//! ([`seccomp`]) refuses the kernel's most exposed calls. Work dirs can be size-capped on the
//! total of their files ([`scratch`]).
//! The work dir is `chown`ed to [`HOST_UID`] before every command so the sandbox can write it;
//! the host (root) keeps full access. Host-side work on a work dir never follows a link the
//! command planted ([`host_fs`]).

mod capture;
mod cgroup;
mod child;
pub mod host_fs;
mod plan;
mod run;
pub mod scratch;
mod seccomp;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::Serialize;

/// The host uid (and gid) the sandboxed command runs as (it is uid/gid 1000 inside).
pub const HOST_UID: u32 = 100_000;

/// The host uid the GUI environment's browser runs as (`crate::env::gui`), apart from
/// [`HOST_UID`] so that a browser and a sandboxed command can never signal, trace or write to
/// each other. No process runs as it before the browser starts; the browser's directory is
/// handed to it.
pub const BROWSER_UID: u32 = 100_001;

/// The gid that goes with [`BROWSER_UID`].
pub const BROWSER_GID: u32 = 100_001;

/// Resource limits of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_CPU` in seconds (SIGXCPU, then SIGKILL one second later).
    pub cpu_secs: u64,
    /// Memory in MiB: the limit of the sandbox's cgroup (memory used, `/tmp` included) where
    /// the host has usable cgroups ([`enforcement`]), else `RLIMIT_AS` of every process. The
    /// `/tmp` tmpfs is capped at half of it (the total of its files).
    pub memory_mb: u64,
    /// Processes and threads the sandbox may have at once (`RLIMIT_NPROC`, and the cgroup's
    /// `pids.max` where there is one).
    pub processes: u64,
    /// `RLIMIT_FSIZE` in MiB: the largest file a process may write.
    pub file_size_mb: u64,
    /// Wall-clock limit; on expiry every process of the sandbox is killed.
    pub timeout: Duration,
    /// Bytes kept of stdout and of stderr each; the rest is drained and counted.
    pub output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_secs: 60,
            memory_mb: 2048,
            processes: 256,
            file_size_mb: 256,
            timeout: Duration::from_secs(60),
            output_bytes: 256 * 1024,
        }
    }
}

/// One command to run in a fresh sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Host directory, mounted read-write at `/work` and used as the cwd. It must exist; its
    /// contents are handed to [`HOST_UID`] (`chown`) before the command runs.
    pub workdir: PathBuf,
    /// argv; `argv[0]` without a `/` is looked up in the sandbox's `PATH`.
    pub command: Vec<String>,
    /// Bytes fed to stdin (then EOF); `None` gives an empty stdin.
    pub stdin: Option<Vec<u8>>,
    /// Extra environment variables, over the defaults (`PATH`, `HOME=/work`, `TMPDIR=/tmp`,
    /// `LANG=C.UTF-8`, `USER=sandbox`, and `CARGO_HOME` when a Rust toolchain is mounted).
    pub env: Vec<(String, String)>,
    pub limits: Limits,
}

impl SandboxSpec {
    /// A spec with default limits, no stdin and no extra environment.
    pub fn new(workdir: impl Into<PathBuf>, command: Vec<String>) -> Self {
        SandboxSpec {
            workdir: workdir.into(),
            command,
            stdin: None,
            env: Vec::new(),
            limits: Limits::default(),
        }
    }
}

/// What a command did.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ExecOutput {
    /// stdout (lossy UTF-8), ending in a truncation marker when it was cut.
    pub stdout: String,
    /// stderr (lossy UTF-8), ending in a truncation marker when it was cut.
    pub stderr: String,
    /// Exit code when the command exited normally (127: not found or not executable).
    pub exit_code: Option<i32>,
    /// The signal that killed the command (e.g. 9 after the timeout or the CPU limit).
    pub signal: Option<i32>,
    /// The wall-clock timeout fired and the sandbox was killed.
    pub timed_out: bool,
    /// stdout or stderr went over `output_bytes` and was cut.
    pub truncated: bool,
    /// Wall-clock time from the clone to the last process's death.
    #[serde(serialize_with = "serialize_secs")]
    pub wall: Duration,
}

fn serialize_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Why a sandbox could not run a command. The command's own failures (non-zero exit, signal,
/// timeout, not found) are not errors: they are reported in [`ExecOutput`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SandboxError {
    /// The spec is malformed (empty command, NUL bytes, bad env name, missing work dir, zero
    /// limits).
    #[error("invalid sandbox spec: {0}")]
    InvalidSpec(String),
    /// This host cannot create the namespaces or the mappings a sandbox needs.
    #[error("sandboxes cannot start on this host: {0}")]
    Unsupported(String),
    /// The sandbox was created but building its file system or dropping privileges failed.
    #[error("sandbox setup failed at {step}: {reason}")]
    Setup { step: String, reason: String },
    /// A host-side operation failed (pipes, work dir ownership, waiting).
    #[error("sandbox host side failed at {step}: {reason}")]
    Host { step: String, reason: String },
}

/// Runs one command in a fresh sandbox and waits for it (at most `limits.timeout`, plus the
/// time to tear the sandbox down). Dropping the future kills the sandbox. Must be polled inside
/// a tokio runtime with the IO and time drivers enabled.
pub fn exec(spec: &SandboxSpec) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
    // Boxed here, so the future's body is compiled once, in this crate: a caller in another
    // crate that awaited the `async fn` itself would compile the whole body again.
    Box::pin(run::exec(spec))
}

/// How a sandbox's memory and process limits are enforced on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Enforcement {
    /// A cgroup v2 per sandbox (`memory.max`, `pids.max`), plus `RLIMIT_NPROC`.
    CgroupV2,
    /// A cgroup per sandbox in the v1 `memory` and `pids` hierarchies, plus `RLIMIT_NPROC`.
    CgroupV1,
    /// No usable cgroups: `RLIMIT_AS` (address space) and `RLIMIT_NPROC` alone.
    Rlimits,
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Enforcement::CgroupV2 => "cgroup v2 (memory used, pids)",
            Enforcement::CgroupV1 => "cgroup v1 (memory used, pids)",
            Enforcement::Rlimits => "rlimits only (address space, processes): no usable cgroups",
        })
    }
}

/// How limits are enforced here (decided once per process; see [`Enforcement`]).
pub fn enforcement() -> Enforcement {
    match cgroup::mode() {
        cgroup::Mode::V2 { .. } => Enforcement::CgroupV2,
        cgroup::Mode::V1 { .. } => Enforcement::CgroupV1,
        cgroup::Mode::Off(_) => Enforcement::Rlimits,
    }
}

/// Whether sandboxes can start here: runs `true` in a sandbox once (cached for the process).
pub fn probe() -> Result<(), SandboxError> {
    static PROBE: OnceLock<Result<(), SandboxError>> = OnceLock::new();
    PROBE.get_or_init(run::probe_once).clone()
}
