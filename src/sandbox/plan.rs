//! Host side, before the clone: validates a [`SandboxSpec`] and turns it into a [`Plan`], every
//! string the sandbox init and the command need already converted to C strings, so that the
//! code after the clone never allocates.

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use super::{SandboxError, SandboxSpec};

/// Where the old root is reachable while the new one is built, and where the new one is built.
pub(super) const OLD: &str = "/oldroot";
pub(super) const NEW: &str = "/newroot";
/// Mount point of the rust toolchain, when the host has one.
const RUST_AT: &str = "/opt/rust";

/// The default `PATH` inside the sandbox.
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Host directories (or merged-usr symlinks) that form the read-only system view.
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// Entries of the host's `/etc` that are visible (read-only) when they exist: what the dynamic
/// loader, shells, Python, Perl, git and TLS clients read. `passwd`, `group`, `hosts`,
/// `hostname` and `resolv.conf` are synthetic; everything else in `/etc` (`shadow`,
/// `environment`, `ssl/private`, service configs) is absent.
const ETC_ENTRIES: &[&str] = &[
    "alternatives",
    "bash.bashrc",
    "ca-certificates.conf",
    "debian_version",
    "fonts",
    "gai.conf",
    "gitconfig",
    "host.conf",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "magic",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "perl",
    "profile",
    "protocols",
    "services",
    "ssl/certs",
    "ssl/openssl.cnf",
    "terminfo",
    "timezone",
];

/// One step of building the new root, executed in order by the sandbox init.
#[derive(Debug)]
pub(super) enum Op {
    /// `mkdir(path, 0755)`.
    Mkdir(CString),
    /// An empty file to bind a file onto.
    Touch(CString),
    /// `symlink(target, link)`.
    Symlink { target: CString, link: CString },
    /// A file with fixed contents (mode 0644).
    Write { path: CString, contents: Vec<u8> },
    /// A tmpfs with the given mount data; `nosuid,nodev` always, `noexec` on request.
    Tmpfs {
        dst: CString,
        data: CString,
        noexec: bool,
    },
    /// A recursive bind mount, made read-only (recursively) when `readonly`, always
    /// `nosuid,nodev` except for device nodes.
    Bind {
        src: CString,
        dst: CString,
        readonly: bool,
        device: bool,
    },
    /// Writes a value into an existing file (a sysctl of the sandbox's namespaces); a missing
    /// file (an older kernel) is skipped.
    Sysctl { path: CString, value: &'static [u8] },
    /// A fresh procfs for the new pid namespace, showing only the sandbox user's processes
    /// (`hidepid=2`: the init, a fork of the host process, stays invisible).
    Proc { dst: CString, data: CString },
}

impl Op {
    /// A short description for error messages.
    pub(super) fn describe(&self) -> String {
        let s = |c: &CString| c.to_string_lossy().into_owned();
        match self {
            Op::Mkdir(p) => format!("mkdir {}", s(p)),
            Op::Touch(p) => format!("create {}", s(p)),
            Op::Symlink { link, .. } => format!("symlink {}", s(link)),
            Op::Write { path, .. } => format!("write {}", s(path)),
            Op::Tmpfs { dst, .. } => format!("mount tmpfs on {}", s(dst)),
            Op::Bind { src, dst, .. } => format!("bind {} on {}", s(src), s(dst)),
            Op::Proc { dst, .. } => format!("mount proc on {}", s(dst)),
            Op::Sysctl { path, .. } => format!("write {}", s(path)),
        }
    }
}

/// Everything the code after the clone needs.
#[derive(Debug)]
pub(super) struct Plan {
    pub ops: Vec<Op>,
    /// Paths to try with `execve`, in `PATH` order (one entry when argv[0] has a `/`).
    pub exec_candidates: Vec<CString>,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    /// `(resource, limit)` pairs set on the command (soft and hard alike, except CPU).
    pub rlimits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    /// Keeps the strings the fixed paths point to.
    pub fixed: Fixed,
    /// The seccomp filters the command runs under.
    pub seccomp: &'static super::seccomp::Programs,
}

/// Fixed C strings used by the init.
#[derive(Debug)]
pub(super) struct Fixed {
    pub root: CString,
    pub tmp: CString,
    pub tmp_old: CString,
    pub old: CString,
    pub new: CString,
    pub dot: CString,
    pub work: CString,
    pub tmpfs: CString,
    pub base_data: CString,
    pub new_data: CString,
    pub dev: CString,
    pub hostname: CString,
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("fixed strings have no NUL")
}

fn cpath(p: &Path) -> Result<CString, SandboxError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| SandboxError::InvalidSpec(format!("path {} contains a NUL byte", p.display())))
}

fn in_new(p: &str) -> CString {
    cstr(&format!("{NEW}{p}"))
}

fn in_old(p: &Path) -> Result<CString, SandboxError> {
    let mut s = OLD.as_bytes().to_vec();
    s.extend_from_slice(p.as_os_str().as_bytes());
    CString::new(s)
        .map_err(|_| SandboxError::InvalidSpec(format!("path {} contains a NUL byte", p.display())))
}

/// Validates the spec. Returns the canonical work dir.
pub(super) fn validate(spec: &SandboxSpec) -> Result<PathBuf, SandboxError> {
    let bad = |m: String| Err(SandboxError::InvalidSpec(m));
    if spec.command.is_empty() {
        return bad("command is empty".into());
    }
    if spec.command[0].is_empty() {
        return bad("command[0] (the program) is empty".into());
    }
    for (i, a) in spec.command.iter().enumerate() {
        if a.contains('\0') {
            return bad(format!("command[{i}] contains a NUL byte"));
        }
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return bad(format!(
                "environment variable name {k:?} is empty or has '=' or NUL"
            ));
        }
        if v.contains('\0') {
            return bad(format!(
                "environment variable {k} has a NUL byte in its value"
            ));
        }
    }
    let l = &spec.limits;
    for (name, v) in [
        ("cpu_secs", l.cpu_secs),
        ("memory_mb", l.memory_mb),
        ("processes", l.processes),
        ("file_size_mb", l.file_size_mb),
    ] {
        if v == 0 {
            return bad(format!("limits.{name} is 0"));
        }
    }
    if l.memory_mb > (1 << 30) || l.file_size_mb > (1 << 30) {
        return bad("limits.memory_mb and limits.file_size_mb must be below 2^30 MiB".into());
    }
    if l.timeout.is_zero() {
        return bad("limits.timeout is 0".into());
    }
    if l.timeout > Duration::from_secs(366 * 86400) {
        return bad(format!("limits.timeout {:?} is over a year", l.timeout));
    }
    if l.output_bytes == 0 {
        return bad("limits.output_bytes is 0".into());
    }
    let wd = std::fs::canonicalize(&spec.workdir).map_err(|e| {
        SandboxError::InvalidSpec(format!("workdir {}: {e}", spec.workdir.display()))
    })?;
    if !wd.is_dir() {
        return bad(format!("workdir {} is not a directory", wd.display()));
    }
    if wd == Path::new("/") {
        return bad("workdir must not be /".into());
    }
    Ok(wd)
}

/// The host's rust toolchain (the sysroot of `rustc`), mounted read-only at `/opt/rust` when
/// found. `CLAWRL_SANDBOX_RUST_SYSROOT` overrides the lookup (empty: none).
fn rust_sysroot() -> Option<&'static Path> {
    static SYSROOT: OnceLock<Option<PathBuf>> = OnceLock::new();
    SYSROOT
        .get_or_init(|| {
            if let Some(v) = std::env::var_os("CLAWRL_SANDBOX_RUST_SYSROOT") {
                return (!v.is_empty())
                    .then(|| PathBuf::from(v))
                    .filter(|p| p.is_dir());
            }
            let out = std::process::Command::new("rustc")
                .args(["--print", "sysroot"])
                .stdin(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .output()
                .ok()?;
            if !out.status.success() {
                return None;
            }
            let s = String::from_utf8(out.stdout).ok()?;
            let p = PathBuf::from(s.trim());
            p.join("bin").join("rustc").is_file().then_some(p)
        })
        .as_deref()
}

fn etc_files(hostname: &str) -> Vec<(&'static str, String)> {
    vec![
        (
            "passwd",
            "root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/work:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                .to_string(),
        ),
        (
            "group",
            "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n".to_string(),
        ),
        (
            "hosts",
            format!("127.0.0.1 localhost {hostname}\n::1 localhost ip6-localhost\n"),
        ),
        ("hostname", format!("{hostname}\n")),
        ("resolv.conf", String::new()),
    ]
}

/// Adds the ops that make the host path `host` (a dir, file or symlink) visible read-only at
/// the same path in the new root; parents are created as needed.
fn expose(ops: &mut Vec<Op>, made: &mut Vec<PathBuf>, host: &Path) -> Result<(), SandboxError> {
    let Ok(meta) = std::fs::symlink_metadata(host) else {
        return Ok(());
    };
    if let Some(parent) = host.parent() {
        mkdirs(ops, made, parent);
    }
    let dst = in_new(&host.to_string_lossy());
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(host).map_err(|e| SandboxError::Host {
            step: format!("readlink {}", host.display()),
            reason: e.to_string(),
        })?;
        ops.push(Op::Symlink {
            target: cpath(&target)?,
            link: dst,
        });
    } else if meta.is_dir() {
        ops.push(Op::Mkdir(dst.clone()));
        made.push(host.to_path_buf());
        ops.push(Op::Bind {
            src: in_old(host)?,
            dst,
            readonly: true,
            device: false,
        });
    } else if meta.is_file() {
        ops.push(Op::Touch(dst.clone()));
        ops.push(Op::Bind {
            src: in_old(host)?,
            dst,
            readonly: true,
            device: false,
        });
    }
    Ok(())
}

/// `mkdir -p` of `dir` inside the new root (as ops), remembering what exists.
fn mkdirs(ops: &mut Vec<Op>, made: &mut Vec<PathBuf>, dir: &Path) {
    let mut chain: Vec<&Path> = dir.ancestors().collect();
    chain.reverse();
    for d in chain {
        if d == Path::new("/") || made.iter().any(|m| m == d) {
            continue;
        }
        ops.push(Op::Mkdir(in_new(&d.to_string_lossy())));
        made.push(d.to_path_buf());
    }
}

/// The size of a sandbox's `/tmp` in MiB for a memory limit of `memory_mb`: half, at least 1.
pub(super) fn tmp_mb(memory_mb: u64) -> u64 {
    (memory_mb / 2).max(1)
}

/// Builds the plan for a validated spec whose canonical work dir is `workdir`. With
/// `memory_by_cgroup` the sandbox's cgroup limits the memory it uses, and no address-space
/// limit is set (thread stacks and allocator arenas reserve far more address space than they
/// use, so `RLIMIT_AS` stops ordinary threaded programs long before their memory runs out).
pub(super) fn build(
    spec: &SandboxSpec,
    workdir: &Path,
    memory_by_cgroup: bool,
) -> Result<Plan, SandboxError> {
    let hostname = "sandbox";
    let limits = &spec.limits;
    let mut ops = Vec::new();
    let mut made: Vec<PathBuf> = Vec::new();

    // The system, read-only.
    for d in SYSTEM_DIRS {
        expose(&mut ops, &mut made, Path::new(d))?;
    }
    // A minimal /etc.
    mkdirs(&mut ops, &mut made, Path::new("/etc"));
    for e in ETC_ENTRIES {
        expose(&mut ops, &mut made, &Path::new("/etc").join(e))?;
    }
    if let Ok(rd) = std::fs::read_dir("/etc") {
        let mut pythons: Vec<PathBuf> = rd
            .flatten()
            .filter(|e| e.file_name().as_bytes().starts_with(b"python"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for p in pythons {
            expose(&mut ops, &mut made, &p)?;
        }
    }
    for (name, contents) in etc_files(hostname) {
        ops.push(Op::Write {
            path: in_new(&format!("/etc/{name}")),
            contents: contents.into_bytes(),
        });
    }
    // The rust toolchain, when the host has one.
    let rust = rust_sysroot();
    if let Some(sysroot) = rust {
        mkdirs(&mut ops, &mut made, Path::new(RUST_AT));
        ops.push(Op::Bind {
            src: in_old(sysroot)?,
            dst: in_new(RUST_AT),
            readonly: true,
            device: false,
        });
    }
    // /dev: a few device nodes and the usual links.
    mkdirs(&mut ops, &mut made, Path::new("/dev"));
    ops.push(Op::Tmpfs {
        dst: in_new("/dev"),
        data: cstr("mode=0755,size=64k"),
        noexec: true,
    });
    for d in ["null", "zero", "full", "random", "urandom", "tty"] {
        let host = Path::new("/dev").join(d);
        if host.exists() {
            let dst = in_new(&format!("/dev/{d}"));
            ops.push(Op::Touch(dst.clone()));
            ops.push(Op::Bind {
                src: in_old(&host)?,
                dst,
                readonly: false,
                device: true,
            });
        }
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        ops.push(Op::Symlink {
            target: cstr(target),
            link: in_new(&format!("/dev/{link}")),
        });
    }
    ops.push(Op::Mkdir(in_new("/dev/shm")));
    ops.push(Op::Tmpfs {
        dst: in_new("/dev/shm"),
        data: cstr(&format!("mode=1777,size={}m", limits.memory_mb.min(64))),
        noexec: true,
    });
    // /proc, /tmp, /work, /var/tmp.
    mkdirs(&mut ops, &mut made, Path::new("/proc"));
    ops.push(Op::Proc {
        dst: in_new("/proc"),
        data: cstr("hidepid=2"),
    });
    // No nested user namespaces: without one the sandbox user can create no namespace at all,
    // which keeps that kernel surface out of reach (the limit is per user namespace).
    ops.push(Op::Sysctl {
        path: in_new("/proc/sys/user/max_user_namespaces"),
        value: b"0\n",
    });
    // /tmp: a tmpfs capped at half the memory limit, on the total of its files. Its pages
    // count against the sandbox's memory cgroup, so the cap makes filling it fail with ENOSPC
    // while the processes still have the other half.
    mkdirs(&mut ops, &mut made, Path::new("/tmp"));
    ops.push(Op::Tmpfs {
        dst: in_new("/tmp"),
        data: cstr(&format!("mode=1777,size={}m", tmp_mb(limits.memory_mb))),
        noexec: false,
    });
    mkdirs(&mut ops, &mut made, Path::new("/var"));
    ops.push(Op::Symlink {
        target: cstr("/tmp"),
        link: in_new("/var/tmp"),
    });
    mkdirs(&mut ops, &mut made, Path::new("/work"));
    ops.push(Op::Bind {
        src: in_old(workdir)?,
        dst: in_new("/work"),
        readonly: false,
        device: false,
    });

    // Environment.
    let mut env: Vec<(String, String)> = vec![
        (
            "PATH".into(),
            match rust {
                Some(_) => format!("{SYSTEM_PATH}:{RUST_AT}/bin"),
                None => SYSTEM_PATH.to_string(),
            },
        ),
        ("HOME".into(), "/work".into()),
        ("TMPDIR".into(), "/tmp".into()),
        ("LANG".into(), "C.UTF-8".into()),
        ("USER".into(), "sandbox".into()),
        ("LOGNAME".into(), "sandbox".into()),
        ("HOSTNAME".into(), hostname.into()),
    ];
    if rust.is_some() {
        env.push(("CARGO_HOME".into(), "/tmp/cargo".into()));
    }
    for (k, v) in &spec.env {
        match env.iter_mut().find(|(ek, _)| ek == k) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((k.clone(), v.clone())),
        }
    }
    let envp = env
        .iter()
        .map(|(k, v)| CString::new(format!("{k}={v}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| SandboxError::InvalidSpec("environment has a NUL byte".into()))?;
    let argv = spec
        .command
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| SandboxError::InvalidSpec("command has a NUL byte".into()))?;

    // execvp-style candidates, resolved inside the sandbox.
    let prog = &spec.command[0];
    let exec_candidates = if prog.contains('/') {
        vec![CString::new(prog.as_bytes())
            .map_err(|_| SandboxError::InvalidSpec("command[0] has a NUL byte".into()))?]
    } else {
        let path = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_str())
            .unwrap_or(SYSTEM_PATH);
        let mut c = Vec::new();
        for dir in path.split(':') {
            let dir = if dir.is_empty() { "." } else { dir };
            let full = Path::new(dir).join(OsStr::new(prog));
            c.push(cpath(&full)?);
        }
        c
    };

    let mb = 1024 * 1024;
    let lim = |v: u64| libc::rlimit {
        rlim_cur: v,
        rlim_max: v,
    };
    let mut rlimits = vec![
        (libc::RLIMIT_CORE, lim(0)),
        (
            libc::RLIMIT_CPU,
            libc::rlimit {
                rlim_cur: limits.cpu_secs,
                rlim_max: limits.cpu_secs.saturating_add(1),
            },
        ),
        (libc::RLIMIT_NPROC, lim(limits.processes)),
        (libc::RLIMIT_FSIZE, lim(limits.file_size_mb * mb)),
        (libc::RLIMIT_NOFILE, lim(1024)),
    ];
    if !memory_by_cgroup {
        rlimits.push((libc::RLIMIT_AS, lim(limits.memory_mb * mb)));
    }

    let fixed = Fixed {
        root: cstr("/"),
        tmp: cstr("/tmp"),
        tmp_old: cstr(&format!("/tmp{OLD}")),
        old: cstr(OLD),
        new: cstr(NEW),
        dot: cstr("."),
        work: cstr("/work"),
        tmpfs: cstr("tmpfs"),
        base_data: cstr("mode=0755,size=64k"),
        new_data: cstr("mode=0755,size=1m"),
        dev: cstr("/dev"),
        hostname: cstr(hostname),
    };
    let seccomp = super::seccomp::programs().map_err(SandboxError::Unsupported)?;
    Ok(Plan {
        ops,
        exec_candidates,
        argv,
        envp,
        rlimits,
        fixed,
        seccomp,
    })
}
