//! Host side of one sandboxed command: prepares the work dir and the plan, clones the sandbox
//! init into new namespaces, writes its id maps, feeds stdin, captures the output, enforces the
//! wall-clock deadline and reaps. The init is killed if the future is dropped.

use std::ffi::c_long;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::unix::pipe;

use super::capture::{capture, Captured};
use super::cgroup::{self, Cgroup};
use super::child::{self, Exec, Fds, INSIDE_ID};
use super::plan::{self, Plan};
use super::{ExecOutput, SandboxError, SandboxSpec, HOST_UID};

fn host_err(step: impl Into<String>, e: impl std::fmt::Display) -> SandboxError {
    SandboxError::Host {
        step: step.into(),
        reason: e.to_string(),
    }
}

/// Hands the work dir and everything in it to the sandbox user, never following a link
/// ([`super::host_fs::hand_over`]).
fn hand_over(dir: &Path) -> Result<(), SandboxError> {
    super::host_fs::hand_over(dir, HOST_UID, HOST_UID)
        .map_err(|e| host_err("handing the work dir to the sandbox user", e))
}

/// Raises this process's soft fd limit to the hard one, once: a sandbox holds six host fds
/// while it runs, so hundreds of concurrent sandboxes need more than the usual 1024.
fn raise_fd_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain getrlimit/setrlimit on a local struct.
        unsafe {
            let mut rl: libc::rlimit = std::mem::zeroed();
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
                rl.rlim_cur = rl.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
            }
        }
    });
}

/// Whether an id is mapped in one of this process's `/proc/self/{uid,gid}_map` files.
fn id_mapped(map: &str, id: u32) -> bool {
    map.lines().any(|l| {
        let f: Vec<u64> = l
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        f.len() == 3 && f[0] <= id as u64 && (id as u64) < f[0] + f[2]
    })
}

/// The host side needs root (it writes arbitrary id maps and chowns the work dir) and the
/// sandbox ids mapped in its user namespace. Checked once.
fn host_check() -> Result<(), SandboxError> {
    static CHECK: std::sync::OnceLock<Result<(), SandboxError>> = std::sync::OnceLock::new();
    CHECK
        .get_or_init(|| {
            // SAFETY: geteuid has no preconditions.
            let euid = unsafe { libc::geteuid() };
            if euid != 0 {
                return Err(SandboxError::Unsupported(format!(
                    "the sandbox host must run as root (it maps ids and mounts); euid is {euid}"
                )));
            }
            for file in ["uid_map", "gid_map"] {
                let path = format!("/proc/self/{file}");
                let map = std::fs::read_to_string(&path)
                    .map_err(|e| SandboxError::Unsupported(format!("reading {path}: {e}")))?;
                for id in [0, HOST_UID] {
                    if !id_mapped(&map, id) {
                        return Err(SandboxError::Unsupported(format!(
                            "id {id} is not mapped in this process's user namespace ({path})"
                        )));
                    }
                }
            }
            Ok(())
        })
        .clone()
}

/// Validates the spec, hands the work dir over, creates the sandbox's cgroup (when the host
/// has usable cgroups) and builds the plan.
fn prepare(spec: &SandboxSpec) -> Result<(Plan, Option<Cgroup>), SandboxError> {
    raise_fd_limit();
    host_check()?;
    let workdir = plan::validate(spec)?;
    hand_over(&workdir)?;
    let mode = cgroup::mode();
    let plan = plan::build(spec, &workdir, mode.limits_memory())?;
    let cg = Cgroup::create(mode, spec.limits.memory_mb, spec.limits.processes)
        .map_err(|e| host_err("creating the sandbox's cgroup", e))?;
    Ok((plan, cg))
}

fn pipe_cloexec() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two fds pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(host_err("pipe", io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The cloned init. Killed (and reaped on a thread) if dropped before it was reaped.
struct Init {
    pid: libc::pid_t,
    pidfd: Option<AsyncFd<OwnedFd>>,
    reaped: bool,
    /// The host's end of the sync pipe.
    sync: Option<std::fs::File>,
    /// The sandbox's cgroup, removed once the init is reaped (every process of the sandbox is
    /// gone by then: the kernel reaps a pid namespace's processes before its init).
    cgroup: Option<Cgroup>,
}

impl Init {
    fn kill(&self) {
        if !self.reaped {
            // SAFETY: the pid is our unreaped child, so it cannot have been reused.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }

    fn try_reap(&mut self) -> io::Result<Option<i32>> {
        let mut status = 0;
        // SAFETY: plain waitpid on our own child.
        let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if r == self.pid {
            self.reaped = true;
            return Ok(Some(status));
        }
        Ok(None)
    }

    /// Waits until the init has exited and reaps it; returns its wait status.
    async fn wait(&mut self) -> io::Result<i32> {
        loop {
            if let Some(s) = self.try_reap()? {
                return Ok(s);
            }
            match &self.pidfd {
                Some(fd) => {
                    let mut ready = fd.readable().await?;
                    ready.clear_ready();
                }
                None => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }
}

impl Drop for Init {
    fn drop(&mut self) {
        let cgroup = self.cgroup.take();
        if !self.reaped {
            self.kill();
            if !matches!(self.try_reap(), Ok(Some(_))) {
                let pid = self.pid;
                std::thread::spawn(move || {
                    let mut status = 0;
                    // SAFETY: blocking waitpid on our own killed child.
                    unsafe { libc::waitpid(pid, &mut status, 0) };
                    remove_cgroup(cgroup);
                });
                return;
            }
        }
        remove_cgroup(cgroup);
    }
}

/// Removes a sandbox's cgroup after its init was reaped; a failure leaves an empty cgroup
/// behind, which is logged.
fn remove_cgroup(cg: Option<Cgroup>) {
    if let Some(cg) = cg {
        if let Err(e) = cg.remove() {
            tracing::warn!("sandbox: {e}");
        }
    }
}

/// Host ends of the pipes.
struct HostEnds {
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    report: OwnedFd,
}

/// Clones the init with every namespace, moves it into its cgroup, writes its id maps and lets
/// it go.
fn spawn(plan: &Plan, cgroup: Option<Cgroup>) -> Result<(Init, HostEnds), SandboxError> {
    let (in_r, in_w) = pipe_cloexec()?;
    let (out_r, out_w) = pipe_cloexec()?;
    let (err_r, err_w) = pipe_cloexec()?;
    let (sync_r, sync_w) = pipe_cloexec()?;
    let (rep_r, rep_w) = pipe_cloexec()?;
    let fds = Fds {
        stdin: in_r.as_raw_fd(),
        stdout: out_w.as_raw_fd(),
        stderr: err_w.as_raw_fd(),
        sync: sync_r.as_raw_fd(),
        report: rep_w.as_raw_fd(),
    };
    let ex = Exec::new(plan);
    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP
        | libc::SIGCHLD;
    // SAFETY: a fork-like clone (no shared memory); the child runs only `child::init`, which
    // makes system calls on data prepared above and never returns.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags as c_long,
            0 as c_long,
            0 as c_long,
            0 as c_long,
            0 as c_long,
        )
    };
    if pid == 0 {
        // SAFETY: we are the freshly cloned child with the namespaces above.
        unsafe { child::init(&ex, &fds) }
    }
    if pid < 0 {
        let e = io::Error::last_os_error();
        return Err(SandboxError::Unsupported(format!(
            "clone with new user, mount, pid, network, ipc and uts namespaces: {e}"
        )));
    }
    let pid = pid as libc::pid_t;
    drop((in_r, out_w, err_w, sync_r, rep_w));
    // SAFETY: pidfd_open on our unreaped child; the result is a new fd we own.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let pidfd = if raw >= 0 {
        // SAFETY: pidfd_open returned a new fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
        // SAFETY: the AsyncFd owns the fd, which stays open until it is dropped.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.ok()
    } else {
        None
    };
    let mut init = Init {
        pid,
        pidfd,
        reaped: false,
        sync: None,
        cgroup,
    };
    // Before the init is let go: everything the sandbox starts is in the cgroup.
    if let Some(cg) = &init.cgroup {
        cg.join(pid)
            .map_err(|e| host_err("moving the sandbox into its cgroup", e))?;
    }
    let map = format!("0 0 1\n{INSIDE_ID} {HOST_UID} 1\n");
    for file in ["uid_map", "gid_map"] {
        std::fs::write(format!("/proc/{pid}/{file}"), &map)
            .map_err(|e| SandboxError::Unsupported(format!("writing the sandbox's {file}: {e}")))?;
    }
    let mut sync = std::fs::File::from(sync_w);
    io::Write::write_all(&mut sync, b"g").map_err(|e| host_err("starting the sandbox init", e))?;
    // Kept open until the init is reaped: if this process dies, the init sees EOF and exits,
    // which kills the whole sandbox.
    init.sync = Some(sync);
    Ok((
        init,
        HostEnds {
            stdin: in_w,
            stdout: out_r,
            stderr: err_r,
            report: rep_r,
        },
    ))
}

/// A parsed report record.
enum Record {
    Setup { step: u32, errno: i32 },
    Exec { candidate: u32, errno: i32 },
    Status(i32),
}

fn parse_reports(bytes: &[u8]) -> Vec<Record> {
    bytes
        .chunks_exact(12)
        .filter_map(|c| {
            let kind = u32::from_ne_bytes(c[0..4].try_into().ok()?);
            let a = u32::from_ne_bytes(c[4..8].try_into().ok()?);
            let b = i32::from_ne_bytes(c[8..12].try_into().ok()?);
            match kind {
                child::REPORT_SETUP => Some(Record::Setup { step: a, errno: b }),
                child::REPORT_EXEC => Some(Record::Exec {
                    candidate: a,
                    errno: b,
                }),
                child::REPORT_STATUS => Some(Record::Status(b)),
                _ => None,
            }
        })
        .collect()
}

fn step_name(plan: &Plan, step: u32) -> String {
    use child::*;
    match step {
        STEP_FDS => "arranging fds".into(),
        STEP_PRIVATE => "making mounts private".into(),
        STEP_BASE => "mounting the scratch root".into(),
        STEP_PIVOT_BASE => "pivoting into the scratch root".into(),
        STEP_NEWROOT => "mounting the new root".into(),
        STEP_DETACH_OLD => "detaching the host root".into(),
        STEP_PIVOT_NEW => "pivoting into the new root".into(),
        STEP_RO_ROOT => "making / and /dev read-only".into(),
        STEP_HOSTNAME => "setting the hostname".into(),
        STEP_FORK => "forking the command".into(),
        STEP_RLIMIT => "setting rlimits".into(),
        STEP_IDS => "dropping to the sandbox user".into(),
        STEP_NNP => "setting no_new_privs".into(),
        STEP_CHDIR => "entering /work".into(),
        STEP_SIGNALS => "resetting signals".into(),
        STEP_SECCOMP => "installing the seccomp filter".into(),
        STEP_CGROUP_NS => "entering a cgroup namespace".into(),
        s if s >= STEP_OP => plan
            .ops
            .get((s - STEP_OP) as usize)
            .map(|o| o.describe())
            .unwrap_or_else(|| format!("step {s}")),
        s => format!("step {s}"),
    }
}

pub(super) async fn exec(spec: &SandboxSpec) -> Result<ExecOutput, SandboxError> {
    let light = SandboxSpec {
        workdir: spec.workdir.clone(),
        command: spec.command.clone(),
        stdin: None,
        env: spec.env.clone(),
        limits: spec.limits.clone(),
    };
    let (plan, cgroup) = tokio::task::spawn_blocking(move || prepare(&light))
        .await
        .map_err(|e| host_err("preparing the sandbox", e))??;
    let limits = &spec.limits;
    let started = Instant::now();
    let (mut init, ends) = spawn(&plan, cgroup)?;
    let deadline = tokio::time::Instant::now() + limits.timeout;

    let stdin = pipe::Sender::from_owned_fd(ends.stdin).map_err(|e| host_err("stdin pipe", e))?;
    let stdout =
        pipe::Receiver::from_owned_fd(ends.stdout).map_err(|e| host_err("stdout pipe", e))?;
    let stderr =
        pipe::Receiver::from_owned_fd(ends.stderr).map_err(|e| host_err("stderr pipe", e))?;
    let mut report =
        pipe::Receiver::from_owned_fd(ends.report).map_err(|e| host_err("report pipe", e))?;

    let feed = async move {
        let mut stdin = stdin;
        if let Some(bytes) = &spec.stdin {
            // The command may exit without reading: a broken pipe is not an error.
            let _ = stdin.write_all(bytes).await;
        }
        drop(stdin);
    };
    let reports = async move {
        let mut buf = Vec::new();
        report.read_to_end(&mut buf).await.map(|_| buf)
    };
    let waited = async {
        match tokio::time::timeout_at(deadline, init.wait()).await {
            Ok(r) => r.map(|s| (s, false)),
            Err(_) => {
                init.kill();
                init.wait().await.map(|s| (s, true))
            }
        }
    };
    let (waited, out, err, reports, ()) = tokio::join!(
        waited,
        capture(stdout, limits.output_bytes),
        capture(stderr, limits.output_bytes),
        reports,
        feed
    );
    let (init_status, timed_out) = waited.map_err(|e| host_err("waiting for the sandbox", e))?;
    let out = out.map_err(|e| host_err("reading stdout", e))?;
    let err = err.map_err(|e| host_err("reading stderr", e))?;
    let reports = reports.map_err(|e| host_err("reading the init's reports", e))?;
    let wall = started.elapsed();
    // The init is reaped: read the cgroup's OOM count, then remove it on a blocking thread
    // without waiting (an rmdir of a memory cgroup can take milliseconds; a cgroup a dying
    // host could not remove is swept by the next one).
    let cgroup = init.cgroup.take();
    let oom_kills = cgroup.as_ref().map_or(0, Cgroup::oom_kills);
    if cgroup.is_some() {
        tokio::task::spawn_blocking(move || remove_cgroup(cgroup));
    }
    let mut result = finish(&plan, init_status, timed_out, out, err, &reports, wall)?;
    if oom_kills > 0 {
        result.stderr.push_str(&format!(
            "clawrl sandbox: the memory limit ({} MiB) was reached; the kernel killed {oom_kills} \
             process(es)\n",
            limits.memory_mb
        ));
    }
    Ok(result)
}

fn finish(
    plan: &Plan,
    init_status: i32,
    timed_out: bool,
    out: Captured,
    err: Captured,
    reports: &[u8],
    wall: Duration,
) -> Result<ExecOutput, SandboxError> {
    let truncated = out.truncated() || err.truncated();
    let mut stderr = err.into_text();
    let mut exit_code = None;
    let mut signal = None;
    let mut status_seen = false;
    for r in parse_reports(reports) {
        match r {
            Record::Setup { step, errno } => {
                return Err(SandboxError::Setup {
                    step: step_name(plan, step),
                    reason: io::Error::from_raw_os_error(errno).to_string(),
                })
            }
            Record::Exec { candidate, errno } => {
                let what = plan
                    .exec_candidates
                    .get(candidate as usize)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let e = io::Error::from_raw_os_error(errno);
                let prog = plan
                    .argv
                    .first()
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if errno == libc::ENOENT {
                    stderr.push_str(&format!("clawrl sandbox: {prog}: command not found\n"));
                } else {
                    stderr.push_str(&format!("clawrl sandbox: cannot execute {what}: {e}\n"));
                }
            }
            Record::Status(s) => {
                status_seen = true;
                if libc::WIFEXITED(s) {
                    exit_code = Some(libc::WEXITSTATUS(s));
                } else if libc::WIFSIGNALED(s) {
                    signal = Some(libc::WTERMSIG(s));
                }
            }
        }
    }
    if !status_seen {
        if timed_out {
            signal = Some(libc::SIGKILL);
        } else if libc::WIFEXITED(init_status) && libc::WEXITSTATUS(init_status) == 125 {
            return Err(SandboxError::Setup {
                step: "starting the sandbox init".into(),
                reason: "the init could not arrange its fds or lost the host".into(),
            });
        } else if libc::WIFSIGNALED(init_status) {
            signal = Some(libc::WTERMSIG(init_status));
        } else {
            return Err(host_err(
                "waiting for the sandbox",
                format!("the init ended without reporting (wait status {init_status})"),
            ));
        }
    }
    Ok(ExecOutput {
        stdout: out.into_text(),
        stderr,
        exit_code,
        signal,
        timed_out,
        truncated,
        wall,
    })
}

/// Runs `true` in a sandbox over a scratch work dir, on its own thread and runtime.
pub(super) fn probe_once() -> Result<(), SandboxError> {
    std::thread::spawn(|| {
        // A fresh private dir: one someone made beforehand is never used (it is chowned and
        // bind-mounted by root).
        let dir = super::host_fs::private_dir(&std::env::temp_dir(), "clawrl-sandbox-probe-")
            .map_err(|e| host_err("creating the probe work dir", e))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| host_err("building the probe runtime", e))?;
        let mut spec = SandboxSpec::new(&dir, vec!["true".into()]);
        spec.limits.timeout = Duration::from_secs(10);
        let r = rt.block_on(super::exec(&spec));
        let _ = std::fs::remove_dir_all(&dir);
        let out = r?;
        match out.exit_code {
            Some(0) => Ok(()),
            _ => Err(SandboxError::Unsupported(format!(
                "`true` in a sandbox did not exit 0: {out:?}"
            ))),
        }
    })
    .join()
    .map_err(|_| host_err("probe", "the probe thread panicked"))?
}
