//! The sandbox under attack: a fork bomb, a 1,000-thread bomb, a memory bomb, writes outside
//! the work dir, reads of `/root` and of a stand-in for the node's TLS key, a connection to a
//! listener on 127.0.0.1, `sleep 1000`, 100 MB of stdout, `unshare -Ur`, ptrace of a sibling,
//! `mount -t tmpfs`, writes to `/proc/sys`, reading another process's `environ`, filling the
//! work dir and `/tmp` with files of the size limit, and a file descriptor left open by the
//! host are each contained and reported, the host is unchanged, and the test process keeps
//! running. Plus the normal cases the environments rely on: exit codes, stdin, stderr,
//! signals, files in the work dir persisting between commands, a program with 64 threads and
//! `cargo build` of a small crate under the default limits.

use std::path::Path;
use std::time::{Duration, Instant};

use clawrl::env::workdir::WorkDirPool;
use clawrl::sandbox::{self, Enforcement, ExecOutput, Limits, SandboxError, SandboxSpec};

fn sh(workdir: &Path, script: &str) -> SandboxSpec {
    SandboxSpec::new(workdir, vec!["/bin/sh".into(), "-c".into(), script.into()])
}

/// Runs `spec` with `CLAWRL_TEST_RUN` set to a value unique to this run (see
/// [`processes_in_ns`]).
async fn run(spec: &SandboxSpec) -> ExecOutput {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    sandbox::probe().expect("sandboxes must be able to start on this host");
    let mut spec = spec.clone();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    spec.env.push((
        "CLAWRL_TEST_RUN".into(),
        format!("{}-{n}", std::process::id()),
    ));
    sandbox::exec(&spec)
        .await
        .unwrap_or_else(|e| panic!("sandbox failed for {:?}: {e}", spec.command))
}

/// What a sandboxed shell prints to name its sandbox for [`processes_in_ns`].
const WHOAMI: &str = "echo $(readlink /proc/self/ns/pid)/$CLAWRL_TEST_RUN";

fn limits(timeout_s: u64) -> Limits {
    Limits {
        timeout: Duration::from_secs(timeout_s),
        ..Limits::default()
    }
}

/// Host processes of one sandbox, named `pid:[4026532xxx]/<run>` (as [`WHOAMI`] prints it):
/// in that pid namespace and with `CLAWRL_TEST_RUN=<run>` in their environment. The namespace
/// alone is not enough: once a sandbox is gone its namespace's number is free, and another
/// test's sandbox may get it.
fn processes_in_ns(whoami: &str) -> Vec<String> {
    let (ns, run) = whoami.split_once('/').expect("pid:[N]/run");
    assert!(!run.is_empty(), "{whoami}");
    let mark = format!("CLAWRL_TEST_RUN={run}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(link) = std::fs::read_link(e.path().join("ns/pid")) else {
            continue;
        };
        let environ = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let ours = environ.split(|&b| b == 0).any(|v| v == mark.as_bytes());
        if link.to_string_lossy() == ns && ours {
            found.push(name);
        }
    }
    found
}

fn host_can_spawn() -> bool {
    std::process::Command::new("true")
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_stdin_stderr_and_signals() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sh(dir.path(), "cat; echo to-stderr >&2; exit 3");
    spec.stdin = Some(b"hello from stdin\n".to_vec());
    let out = run(&spec).await;
    assert_eq!(out.stdout, "hello from stdin\n");
    assert_eq!(out.stderr, "to-stderr\n");
    assert_eq!(out.exit_code, Some(3));
    assert_eq!(out.signal, None);
    assert!(!out.timed_out && !out.truncated);

    let out = run(&SandboxSpec::new(dir.path(), vec!["false".into()])).await;
    assert_eq!(out.exit_code, Some(1));
    let out = run(&SandboxSpec::new(dir.path(), vec!["true".into()])).await;
    assert_eq!(out.exit_code, Some(0));

    let out = run(&sh(dir.path(), "kill -TERM $$; sleep 5")).await;
    assert_eq!(out.exit_code, None);
    assert_eq!(out.signal, Some(libc::SIGTERM));

    let out = run(&SandboxSpec::new(
        dir.path(),
        vec!["no-such-program-here".into()],
    ))
    .await;
    assert_eq!(out.exit_code, Some(127));
    assert!(out.stderr.contains("command not found"), "{}", out.stderr);

    // Without stdin the command reads EOF at once.
    let out = run(&sh(dir.path(), "wc -c")).await;
    assert_eq!(out.stdout.trim(), "0");

    // Environment: defaults and additions.
    let mut spec = sh(
        dir.path(),
        "echo $HOME $FOO; pwd; id -u; cat /proc/sys/kernel/hostname",
    );
    spec.env.push(("FOO".into(), "bar".into()));
    let out = run(&spec).await;
    assert_eq!(out.stdout, "/work bar\n/work\n1000\nsandbox\n", "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_dir_files_persist_between_commands() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("from-host.txt"), "host\n").unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(dir.path().join("src/lib.py"), "x = 1\n").unwrap();

    let out = run(&sh(
        dir.path(),
        "echo data > f.txt && mkdir -p sub && echo x > sub/y && \
         echo more >> from-host.txt && echo 'x = 2' > src/lib.py && ls",
    ))
    .await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    let out = run(&sh(dir.path(), "cat f.txt sub/y from-host.txt src/lib.py")).await;
    assert_eq!(out.stdout, "data\nx\nhost\nmore\nx = 2\n", "{out:?}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("f.txt")).unwrap(),
        "data\n"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("sub/y")).unwrap(),
        "x\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_bomb_is_contained() {
    let dir = tempfile::tempdir().unwrap();
    // RLIMIT_NPROC binds: a process that forks as much as it can gets at most `processes`.
    let mut spec = SandboxSpec::new(
        dir.path(),
        vec![
            "python3".into(),
            "-c".into(),
            "import os, time\n\
             n = 0\n\
             for _ in range(200):\n\
             \x20   try:\n\
             \x20       pid = os.fork()\n\
             \x20   except OSError:\n\
             \x20       break\n\
             \x20   if pid == 0:\n\
             \x20       time.sleep(30)\n\
             \x20       os._exit(0)\n\
             \x20   n += 1\n\
             print(n, flush=True)\n\
             os._exit(0)\n"
                .into(),
        ],
    );
    spec.limits = Limits {
        processes: 16,
        ..limits(20)
    };
    let started = Instant::now();
    let out = run(&spec).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    let forked: u32 = out.stdout.trim().parse().unwrap();
    assert!(forked < 16, "forked {forked} children with processes=16");
    assert!(!out.timed_out);
    // The 30 s sleepers died with the sandbox.
    assert!(started.elapsed() < Duration::from_secs(20));

    // The classic bomb runs until the timeout, the host can still fork meanwhile, and no
    // process of the sandbox's pid namespace outlives it.
    let mut spec = sh(
        dir.path(),
        &format!("{WHOAMI}; bomb() {{ bomb | bomb & }}; bomb; wait"),
    );
    spec.limits = Limits {
        processes: 64,
        ..limits(3)
    };
    let during = tokio::spawn(async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        tokio::task::spawn_blocking(host_can_spawn).await.unwrap()
    });
    let out = run(&spec).await;
    assert!(
        during.await.unwrap(),
        "the host could not fork during the bomb"
    );
    let ns = out.stdout.lines().next().unwrap_or_default().to_string();
    assert!(ns.starts_with("pid:["), "{out:?}");
    assert!(
        out.timed_out || out.exit_code.is_some(),
        "bomb result: {out:?}"
    );
    assert_eq!(processes_in_ns(&ns), Vec::<String>::new());
    assert!(host_can_spawn());
}

/// How a command stopped by the memory limit ends: with a cgroup the kernel kills it (and the
/// sandbox says why on stderr); with `RLIMIT_AS` alone the allocation fails (`MemoryError`).
fn assert_memory_stopped(out: &ExecOutput) {
    match sandbox::enforcement() {
        Enforcement::Rlimits => {
            assert_eq!(out.exit_code, Some(1), "{out:?}");
            assert!(out.stderr.contains("MemoryError"), "{}", out.stderr);
        }
        Enforcement::CgroupV1 | Enforcement::CgroupV2 => {
            assert_eq!(out.signal, Some(libc::SIGKILL), "{out:?}");
            assert!(
                out.stderr.contains("the memory limit (") && out.stderr.contains("was reached"),
                "{}",
                out.stderr
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_bomb_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SandboxSpec::new(
        dir.path(),
        vec![
            "python3".into(),
            "-c".into(),
            "a = []\nwhile True:\n    a.append(bytearray(16 * 1024 * 1024))\n".into(),
        ],
    );
    spec.limits = Limits {
        memory_mb: 256,
        ..limits(20)
    };
    let out = run(&spec).await;
    assert!(!out.timed_out, "{out:?}");
    assert_memory_stopped(&out);

    // One allocation over the limit is stopped at once.
    let mut spec = SandboxSpec::new(
        dir.path(),
        vec![
            "python3".into(),
            "-c".into(),
            "b = bytearray(512 * 1024 * 1024)".into(),
        ],
    );
    spec.limits = Limits {
        memory_mb: 128,
        ..limits(20)
    };
    let out = run(&spec).await;
    assert!(!out.timed_out, "{out:?}");
    assert_memory_stopped(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_outside_the_work_dir_fail() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let marker = format!("clawrl-escape-{}", std::process::id());
    let targets = [
        format!("/{marker}"),
        format!("/usr/{marker}"),
        format!("/usr/bin/{marker}"),
        format!("/etc/{marker}"),
        format!("/work/../{marker}"),
        format!("/dev/{marker}"),
        format!("/proc/{marker}"),
        format!("{}/{marker}", dir.path().display()),
    ];
    let mut script = String::new();
    for t in &targets {
        script.push_str(&format!(
            "if echo x > '{t}' 2>/dev/null; then echo 'WROTE {t}'; else echo 'denied {t}'; fi\n"
        ));
    }
    // Modifying the system fails as well.
    script.push_str(
        "if rm -f /usr/bin/env 2>/dev/null && [ ! -e /usr/bin/env ]; then echo 'WROTE rm'; else echo 'denied rm'; fi\n\
         if echo h > /proc/sys/kernel/hostname 2>/dev/null; then echo 'WROTE hostname'; else echo 'denied hostname'; fi\n\
         if mount -t tmpfs none /usr 2>/dev/null; then echo 'WROTE mount'; else echo 'denied mount'; fi\n\
         if unshare -Urm true 2>/dev/null; then echo 'WROTE userns'; else echo 'denied userns'; fi\n",
    );
    // /tmp is writable but private to this sandbox.
    script.push_str(&format!("echo tmp > /tmp/{marker} && echo 'tmp ok'\n"));
    let out = run(&sh(&work, &script)).await;
    assert!(!out.stdout.contains("WROTE"), "{}", out.stdout);
    assert_eq!(out.stdout.matches("denied").count(), targets.len() + 4);
    assert!(out.stdout.contains("tmp ok"));
    for t in &targets {
        let host = Path::new(t);
        if !t.starts_with("/work") {
            assert!(!host.exists(), "{t} exists on the host");
        }
    }
    assert!(!Path::new(&format!("/tmp/{marker}")).exists());
    assert!(!dir.path().join(&marker).exists());
    assert!(Path::new("/usr/bin/env").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_and_tls_key_are_invisible() {
    let secrets = tempfile::tempdir().unwrap();
    let key = secrets.path().join("node.key");
    std::fs::write(&key, "-----BEGIN PRIVATE KEY----- SECRET-KEY-MATERIAL\n").unwrap();
    let work = tempfile::tempdir().unwrap();
    let script = format!(
        "cat '{key}' 2>&1; ls -a /root 2>&1; cat /root/.bashrc 2>&1; cat /etc/shadow 2>&1; \
         cat /proc/1/root'{key}' 2>&1; \
         find / -name node.key -not -path '/proc/*' 2>/dev/null; echo searched",
        key = key.display()
    );
    let mut spec = sh(work.path(), &script);
    spec.limits = limits(20);
    let out = run(&spec).await;
    assert!(
        !out.stdout.contains("SECRET-KEY-MATERIAL"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("searched"), "{out:?}");
    assert!(out.stdout.contains("/root"), "{}", out.stdout);
    assert!(
        !out.stdout
            .lines()
            .any(|l| l.ends_with("node.key") && !l.contains(':')),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_network_even_to_localhost() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SandboxSpec::new(
        dir.path(),
        vec![
            "python3".into(),
            "-c".into(),
            format!(
                "import socket\n\
                 try:\n\
                 \x20   socket.create_connection(('127.0.0.1', {port}), timeout=3)\n\
                 \x20   print('CONNECTED')\n\
                 except OSError as e:\n\
                 \x20   print('refused', e.errno)\n\
                 print(open('/proc/net/dev').read().count(':'))\n"
            ),
        ],
    );
    spec.limits = limits(20);
    let out = run(&spec).await;
    assert!(!out.stdout.contains("CONNECTED"), "{out:?}");
    assert!(out.stdout.starts_with("refused"), "{out:?}");
    // Only the loopback device exists in the sandbox's network namespace.
    assert_eq!(out.stdout.lines().nth(1), Some("1"), "{out:?}");
    let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(accepted.is_err(), "the listener got a connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_1000_times_out_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sh(dir.path(), &format!("{WHOAMI}; sleep 1000 & sleep 1000"));
    spec.limits = Limits {
        timeout: Duration::from_millis(800),
        ..Limits::default()
    };
    let started = Instant::now();
    let out = run(&spec).await;
    assert!(out.timed_out, "{out:?}");
    assert_eq!(out.exit_code, None);
    assert_eq!(out.signal, Some(libc::SIGKILL));
    assert!(started.elapsed() < Duration::from_secs(30));
    let ns = out.stdout.trim().to_string();
    assert!(ns.starts_with("pid:["), "{out:?}");
    assert!(processes_in_ns(&ns).is_empty());
}

fn peak_rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabytes_of_stdout_are_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sh(
        dir.path(),
        "head -c 100000000 /dev/zero | tr '\\0' a; echo done >&2",
    );
    spec.limits = Limits {
        output_bytes: 64 * 1024,
        ..limits(60)
    };
    let before = peak_rss_kib();
    let out = run(&spec).await;
    let after = peak_rss_kib();
    assert!(!out.timed_out, "{:?}", out.wall);
    assert_eq!(out.exit_code, Some(0));
    assert!(out.truncated);
    assert_eq!(out.stderr, "done\n");
    assert!(out.stdout.starts_with("aaaa"));
    assert!(
        out.stdout
            .ends_with("[clawrl sandbox: output truncated: 65536 of 100000000 bytes shown]\n"),
        "{}",
        &out.stdout[out.stdout.len() - 100..]
    );
    assert!(out.stdout.len() < 65536 + 200);
    // The 100 MB were drained, not kept.
    assert!(
        after - before < 50 * 1024,
        "peak RSS grew by {} KiB",
        after - before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let err = sandbox::exec(&SandboxSpec::new(dir.path(), vec![]))
        .await
        .unwrap_err();
    assert!(matches!(err, SandboxError::InvalidSpec(_)), "{err}");
    let err = sandbox::exec(&SandboxSpec::new(
        dir.path().join("missing"),
        vec!["true".into()],
    ))
    .await
    .unwrap_err();
    assert!(
        matches!(err, SandboxError::InvalidSpec(ref m) if m.contains("missing")),
        "{err}"
    );
    let mut spec = SandboxSpec::new(dir.path(), vec!["true".into()]);
    spec.env.push(("A=B".into(), "c".into()));
    let err = sandbox::exec(&spec).await.unwrap_err();
    assert!(matches!(err, SandboxError::InvalidSpec(_)), "{err}");
    let mut spec = SandboxSpec::new(dir.path(), vec!["true".into()]);
    spec.limits.timeout = Duration::MAX;
    let err = sandbox::exec(&spec).await.unwrap_err();
    assert!(
        matches!(err, SandboxError::InvalidSpec(ref m) if m.contains("timeout")),
        "{err}"
    );
    let mut spec = SandboxSpec::new(dir.path(), vec!["true".into()]);
    spec.limits.memory_mb = 0;
    let err = sandbox::exec(&spec).await.unwrap_err();
    assert!(
        matches!(err, SandboxError::InvalidSpec(ref m) if m.contains("memory_mb")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_future_kills_the_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ns");
    let spec = sh(dir.path(), &format!("{WHOAMI} > ns; exec sleep 1000"));
    let r = tokio::time::timeout(Duration::from_millis(1500), run(&spec)).await;
    assert!(r.is_err(), "sleep 1000 finished?");
    let ns = std::fs::read_to_string(&marker).unwrap().trim().to_string();
    assert!(ns.starts_with("pid:["), "{ns}");
    // The kill is immediate; the reap happens on a thread.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_in_ns(&ns).is_empty() {
        assert!(
            Instant::now() < deadline,
            "sandbox survived its dropped future"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_and_file_size_limits_bind() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sh(dir.path(), "while :; do :; done");
    spec.limits = Limits {
        cpu_secs: 1,
        ..limits(30)
    };
    let out = run(&spec).await;
    assert!(!out.timed_out, "{out:?}");
    assert!(
        matches!(out.signal, Some(libc::SIGXCPU) | Some(libc::SIGKILL)),
        "{out:?}"
    );

    let mut spec = sh(dir.path(), "head -c 5000000 /dev/zero > big; echo $?");
    spec.limits = Limits {
        file_size_mb: 1,
        ..limits(30)
    };
    let out = run(&spec).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    // head dies of SIGXFSZ (128 + 25) or reports EFBIG.
    assert_ne!(out.stdout.trim(), "0", "{out:?}");
    let size = std::fs::metadata(dir.path().join("big")).unwrap().len();
    assert!(size <= 1024 * 1024, "wrote {size} bytes with a 1 MiB limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_processes_die_with_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = run(&sh(
        dir.path(),
        &format!("{WHOAMI}; (sleep 100; echo late > late.txt) & echo started"),
    ))
    .await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert!(!out.timed_out);
    assert!(started.elapsed() < Duration::from_secs(30));
    let ns = out.stdout.lines().next().unwrap_or_default();
    assert!(processes_in_ns(ns).is_empty());
    assert!(!dir.path().join("late.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_stdin_does_not_block() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SandboxSpec::new(dir.path(), vec!["true".into()]);
    spec.stdin = Some(vec![b'x'; 4 * 1024 * 1024]);
    spec.limits = limits(30);
    let out = run(&spec).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert!(!out.timed_out);

    let mut spec = sh(dir.path(), "wc -c");
    spec.stdin = Some(vec![b'x'; 4 * 1024 * 1024]);
    spec.limits = limits(30);
    let out = run(&spec).await;
    assert_eq!(out.stdout.trim(), "4194304", "{out:?}");
}

/// The seccomp filter behind the namespaces: each call below is one an unprivileged process
/// may otherwise make (tracing or reading the memory of its own child, the keyring,
/// userfaultfd) or that reaches a wide kernel surface (mount, bpf, perf_event_open, kexec,
/// module loading, a new user namespace); each fails with EPERM, and `clone3` with ENOSYS so
/// the C library falls back to `clone`. Ordinary programs still run: 64 Python threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seccomp_filter_refuses_the_kernels_exposed_calls() {
    if std::env::consts::ARCH != "x86_64" {
        return; // the syscall numbers below are x86_64's
    }
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import ctypes, errno, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
child = subprocess.Popen(["sleep", "30"])
buf = ctypes.create_string_buffer(8)
local = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
remote = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
calls = [
    ("ptrace_attach_child", 101, 16, child.pid, 0, 0),
    ("process_vm_readv_child", 310, child.pid, local, 1, remote, 1, 0),
    ("mount_tmpfs", 165, b"none", b"/tmp", b"tmpfs", 0, 0),
    ("bpf", 321, 0, 0, 0),
    ("perf_event_open", 298, 0, 0, -1, -1, 0),
    ("keyctl_session_keyring", 250, 0, -3, 0),
    ("add_key", 248, b"user", b"k", b"v", 1, -3),
    ("userfaultfd", 323, 0),
    ("kexec_load", 246, 0, 0, 0, 0),
    ("init_module", 175, 0, 0, b""),
    ("unshare_newuser", 272, 0x10000000),
    ("setns", 308, 0, 0),
    ("clone3", 435, 0, 0),
]
for name, nr, *args in calls:
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    e = ctypes.get_errno()
    print(name, "ok" if r >= 0 else errno.errorcode.get(e, str(e)))
child.kill()
done = []
threads = [threading.Thread(target=lambda: done.append(1)) for _ in range(64)]
for t in threads: t.start()
for t in threads: t.join()
print("threads", len(done))
"#;
    let spec = SandboxSpec::new(
        dir.path(),
        vec!["python3".into(), "-c".into(), script.into()],
    );
    let out = run(&spec).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    let lines: std::collections::BTreeMap<&str, &str> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once(' '))
        .collect();
    for name in [
        "ptrace_attach_child",
        "process_vm_readv_child",
        "mount_tmpfs",
        "bpf",
        "perf_event_open",
        "keyctl_session_keyring",
        "add_key",
        "userfaultfd",
        "kexec_load",
        "init_module",
        "unshare_newuser",
        "setns",
    ] {
        assert_eq!(lines.get(name), Some(&"EPERM"), "{name}: {}", out.stdout);
    }
    assert_eq!(lines.get("clone3"), Some(&"ENOSYS"), "{}", out.stdout);
    assert_eq!(lines.get("threads"), Some(&"64"), "{}", out.stdout);
}

/// A Python program that starts `n` threads which wait on an event, prints how many started
/// before the first refusal, then releases them: no sleep, no race.
fn thread_program(n: u32) -> String {
    format!(
        "import threading\n\
         ev = threading.Event()\n\
         ts = []\n\
         err = ''\n\
         for _ in range({n}):\n\
         \x20   t = threading.Thread(target=ev.wait)\n\
         \x20   try:\n\
         \x20       t.start()\n\
         \x20   except RuntimeError as e:\n\
         \x20       err = str(e)\n\
         \x20       break\n\
         \x20   ts.append(t)\n\
         ev.set()\n\
         for t in ts:\n\
         \x20   t.join()\n\
         print(len(ts), err, flush=True)\n"
    )
}

/// Ordinary programs under the default limits: 64 Python threads (each reserves an 8 MiB
/// stack, which an address-space limit counts), also under a 256 MiB memory limit where a
/// cgroup counts memory used; and `cargo build` of a new crate, offline, with the host's
/// toolchain mounted read-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threaded_programs_and_cargo_build_run() {
    let dir = tempfile::tempdir().unwrap();
    let py = |memory_mb: u64| {
        let mut spec = SandboxSpec::new(
            dir.path(),
            vec!["python3".into(), "-c".into(), thread_program(64)],
        );
        spec.limits.memory_mb = memory_mb;
        spec
    };
    let out = run(&py(Limits::default().memory_mb)).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert_eq!(out.stdout.trim(), "64", "{out:?}");
    if sandbox::enforcement() != Enforcement::Rlimits {
        let out = run(&py(256)).await;
        assert_eq!(out.stdout.trim(), "64", "{out:?}");
    }

    let mut spec = sh(
        dir.path(),
        "set -e; cargo new --offline --vcs none hello >/dev/null 2>&1; cd hello; \
         cargo build --offline 2>&1 | tail -1; ./target/debug/hello",
    );
    spec.limits = limits(120);
    let out = run(&spec).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert!(out.stdout.contains("Finished"), "{out:?}");
    assert!(out.stdout.ends_with("Hello, world!\n"), "{out:?}");
    assert!(dir.path().join("hello/target/debug/hello").is_file());
}

/// 1,000 threads under the default limits: the sandbox's process budget (RLIMIT_NPROC, and
/// its cgroup's pids limit) refuses the rest, the program still ends normally, the host can
/// still fork meanwhile, and nothing of the sandbox outlives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_thread_bomb_is_contained() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "import os\nprint(os.readlink('/proc/self/ns/pid') + '/' + os.environ['CLAWRL_TEST_RUN'], \
         flush=True)\n{}",
        thread_program(1000)
    );
    let mut spec = SandboxSpec::new(dir.path(), vec!["python3".into(), "-c".into(), script]);
    spec.limits = limits(60);
    let out = run(&spec).await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    let mut lines = out.stdout.lines();
    let ns = lines.next().unwrap_or_default().to_string();
    let (started, err) = lines.next().unwrap_or_default().split_once(' ').unwrap();
    let started: u64 = started.parse().unwrap();
    assert!(
        started < Limits::default().processes,
        "{started} threads with processes = {}",
        Limits::default().processes
    );
    assert!(started >= 32, "only {started} threads: {out:?}");
    assert!(err.contains("can't start new thread"), "{out:?}");
    assert!(host_can_spawn());
    assert!(ns.starts_with("pid:["), "{out:?}");
    assert_eq!(processes_in_ns(&ns), Vec::<String>::new());
}

/// A new user namespace (where the command would be root again) is refused, by the seccomp
/// filter and by the sandbox's `max_user_namespaces` of 0; the command stays uid 1000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unshare_ur_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&sh(
        dir.path(),
        "unshare -Ur id -u 2>&1; echo rc=$?; unshare -U -r -m -p -f id -u 2>&1; echo rc=$?; id -u",
    ))
    .await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{out:?}");
    for (err, rc) in [(lines[0], lines[1]), (lines[2], lines[3])] {
        assert!(err.contains("Operation not permitted"), "{out:?}");
        assert_ne!(rc, "rc=0", "{out:?}");
    }
    assert_eq!(lines[4], "1000", "{out:?}");
}

/// A process cannot trace a sibling (not its own child): `PTRACE_ATTACH`, `PTRACE_SEIZE` and
/// `process_vm_readv` all fail with EPERM, and the sibling runs on untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ptrace_of_a_sibling_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tracer = r#"
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
pid = int(sys.argv[1])
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
for name, nr, *args in [
    ("attach", 101, 16, pid, 0, 0),
    ("seize", 101, 0x4206, pid, 0, 0),
    ("vm_readv", 310, pid, iov, 1, iov, 1, 0),
]:
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    print(name, "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"), flush=True)
state = open(f"/proc/{pid}/stat").read().split(") ")[1].split()[0]
print("sibling", state)
"#;
    std::fs::write(dir.path().join("tracer.py"), tracer).unwrap();
    let out = run(&sh(
        dir.path(),
        "sleep 30 & S=$!; python3 tracer.py $S; kill $S",
    ))
    .await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    for name in ["attach", "seize", "vm_readv"] {
        assert!(
            out.stdout.lines().any(|l| l == format!("{name} EPERM")),
            "{name}: {out:?}"
        );
    }
    // Sleeping, not stopped by a tracer.
    assert!(out.stdout.contains("sibling S"), "{out:?}");
}

/// `mount -t tmpfs` fails, and no mount appears on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_tmpfs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("mount-target-work");
    std::fs::create_dir(&work).unwrap();
    let out = run(&sh(
        &work,
        "mkdir -p m; mount -t tmpfs none /work/m 2>/dev/null; echo rc=$?; \
         mount -t tmpfs none /tmp 2>/dev/null; echo rc=$?; \
         python3 -c 'import ctypes, os; l = ctypes.CDLL(None, use_errno=True); \
           r = l.mount(b\"none\", b\"/work/m\", b\"tmpfs\", 0, None); \
           print(r, os.strerror(ctypes.get_errno()))'; \
         grep -c ' /work/m ' /proc/self/mountinfo",
    ))
    .await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{out:?}");
    assert_ne!(lines[0], "rc=0", "{out:?}");
    assert_ne!(lines[1], "rc=0", "{out:?}");
    assert_eq!(lines[2], "-1 Operation not permitted", "{out:?}");
    assert_eq!(lines[3], "0", "{out:?}");
    let host_mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !host_mounts.contains("mount-target-work"),
        "a mount appeared on the host"
    );
}

/// Writes to `/proc/sys` fail (the command has no capability and the files are root's), and
/// the host's values stay what they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proc_sys_writes_are_refused() {
    let files = [
        "/proc/sys/kernel/panic",
        "/proc/sys/vm/swappiness",
        "/proc/sys/kernel/hostname",
        "/proc/sys/kernel/pid_max",
    ];
    let before: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut script = String::new();
    for (f, v) in files.iter().zip(&before) {
        // A value different from the host's, so that a write that got through would show.
        let new = match v.trim().parse::<u64>() {
            Ok(n) => (n.saturating_sub(1).max(1) + 7).to_string(),
            Err(_) => "clawrl-escaped".into(),
        };
        script.push_str(&format!(
            "if echo {new} > {f} 2>/dev/null; then echo 'WROTE {f}'; else echo 'denied {f}'; fi\n"
        ));
    }
    let out = run(&sh(dir.path(), &script)).await;
    assert_eq!(out.stdout.matches("denied").count(), files.len(), "{out:?}");
    for (f, v) in files.iter().zip(&before) {
        assert_eq!(&std::fs::read_to_string(f).unwrap(), v, "{f} changed");
    }
}

/// Another process's environment is out of reach: a host process's (its pid does not exist in
/// the sandbox's pid namespace), and the sandbox init's (a fork of this test process, so it
/// holds this process's environment; `hidepid=2` hides it, being root's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_environ_is_unreadable() {
    let secret = format!("clawrl-env-secret-{}", std::process::id());
    let mut host = std::process::Command::new("sleep")
        .arg("60")
        .env("CLAWRL_TEST_SECRET", &secret)
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let host_pid = host.id();
    // This process's own environment is in the init; cargo gives every test one of these.
    let mine = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| "/".into());
    let dir = tempfile::tempdir().unwrap();
    let out = run(&sh(
        dir.path(),
        &format!(
            "cat /proc/{host_pid}/environ 2>&1; cat /proc/1/environ 2>&1; \
             for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done 2>/dev/null; echo end"
        ),
    ))
    .await;
    host.kill().unwrap();
    host.wait().unwrap();
    assert!(out.stdout.ends_with("end\n"), "{out:?}");
    assert!(!out.stdout.contains(&secret), "{}", out.stdout);
    assert!(
        !out.stdout.contains(&format!("CARGO_MANIFEST_DIR={mine}")),
        "{}",
        out.stdout
    );
    // The command's own environment is readable (the loop above ran).
    assert!(out.stdout.contains("HOME=/work"), "{}", out.stdout);
}

/// Files of the size limit, as many as a loop can write, fill a capped work dir and `/tmp` only
/// up to their caps (ENOSPC after), which bound the total; the work dir is a file system of its
/// own, so none of it reached the host disk, and nothing is left once it is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filling_the_work_dir_and_tmp_stops_at_the_caps() {
    let parent = tempfile::tempdir().unwrap();
    let pool = WorkDirPool::new(parent.path(), "fill-", 0, Some(32)).unwrap();
    let wd = pool.take().unwrap();
    assert!(pool.capped(), "the work dir pool could not mount its tmpfs");
    use std::os::unix::fs::MetadataExt;
    assert_ne!(
        std::fs::metadata(wd.path()).unwrap().dev(),
        std::fs::metadata(pool.root()).unwrap().dev(),
        "the capped work dir is on the host's file system"
    );
    // Writes 1 MiB files (the size limit) into `dir` until one fails, with `memory_mb` as the
    // memory limit; checks that the loop stopped on ENOSPC within `cap_mb`.
    let fill = |dir: &'static str, memory_mb: u64, cap_mb: u64| {
        let mut spec = sh(
            wd.path(),
            &format!(
                "i=0; err=; while [ $i -lt 1000 ]; do \
                   err=$(head -c 1048576 /dev/zero 2>&1 > {dir}/f$i) || break; i=$((i+1)); \
                 done; echo files $i; echo \"$err\""
            ),
        );
        spec.limits = Limits {
            file_size_mb: 1,
            memory_mb,
            ..limits(60)
        };
        async move {
            let out = run(&spec).await;
            assert_eq!(out.exit_code, Some(0), "{out:?}");
            let files: u64 = out.stdout.lines().next().unwrap()[6..].parse().unwrap();
            assert!(
                (cap_mb / 2..=cap_mb).contains(&files),
                "{files} files of 1 MiB in {cap_mb} MiB of {dir}: {out:?}"
            );
            assert!(out.stdout.contains("No space left on device"), "{out:?}");
        }
    };
    fill("/work", 256, 32).await;
    let total: u64 = std::fs::read_dir(wd.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(total <= 32 << 20, "{total} bytes in a 32 MiB work dir");
    // /tmp: half of a 128 MiB memory limit.
    fill("/tmp", 128, 64).await;

    let path = wd.path().to_path_buf();
    wd.remove().await.unwrap();
    assert!(!path.exists());
    assert_eq!(std::fs::read_dir(pool.root()).unwrap().count(), 0);
    let host_mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!host_mounts.contains(&path.display().to_string()));
}

/// A file descriptor the host left open without close-on-exec (here: a file holding a secret)
/// is not inherited: the command starts with stdin, stdout and stderr only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inherited_fd_is_not_inherited() {
    use std::os::unix::ffi::OsStrExt;
    let secrets = tempfile::tempdir().unwrap();
    let key = secrets.path().join("inherited.key");
    std::fs::write(&key, "INHERITED-SECRET\n").unwrap();
    let c = std::ffi::CString::new(key.as_os_str().as_bytes()).unwrap();
    // SAFETY: a plain open of a C string; the fd is closed below. No O_CLOEXEC on purpose.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY) };
    assert!(fd >= 0);
    let dir = tempfile::tempdir().unwrap();
    let out = run(&SandboxSpec::new(
        dir.path(),
        vec![
            "python3".into(),
            "-c".into(),
            format!(
                "import os\n\
                 print(sorted(int(f) for f in os.listdir('/proc/self/fd')))\n\
                 for fd in [{fd}] + list(range(3, 64)):\n\
                 \x20   try:\n\
                 \x20       print(os.read(fd, 100))\n\
                 \x20   except OSError:\n\
                 \x20       pass\n\
                 print('end')\n"
            ),
        ],
    ))
    .await;
    // SAFETY: `fd` was opened above and is closed once.
    unsafe { libc::close(fd) };
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    // 3 is the descriptor listdir itself opened.
    assert_eq!(out.stdout, "[0, 1, 2, 3]\nend\n", "{out:?}");
}
