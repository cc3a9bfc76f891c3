//! `clawrl sandbox exec` end to end: the JSON it prints, stdin, a persistent `--workdir`,
//! argument errors, that killing the host process (the CLI, with SIGKILL) takes the whole
//! sandbox down instead of leaving `sleep 1000` running, that the host process's environment
//! (which the sandbox init, a fork of it, shares) is out of the command's reach, the size cap
//! of the scratch work dir, and the fallback to rlimits alone where cgroups are not usable
//! (forced with `CLAWRL_SANDBOX_CGROUPS=off`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn clawrl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clawrl"))
}

fn exec_json(args: &[&str], stdin: Option<&[u8]>) -> Value {
    exec_json_env(args, stdin, &[])
}

fn exec_json_env(args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Value {
    let mut cmd = clawrl();
    cmd.envs(env.iter().copied());
    cmd.args(["sandbox", "exec"]).args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(bytes) = stdin {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(bytes).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "clawrl sandbox exec {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON line expected: {text}");
    serde_json::from_str(&text).unwrap()
}

fn processes_in_ns(ns: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path().join("ns/pid"))
                .map(|l| l.to_string_lossy() == ns)
                .unwrap_or(false)
        })
        .count()
}

#[test]
fn exec_prints_the_result_as_json() {
    let v = exec_json(&["--", "sh", "-c", "echo hi; echo oops >&2; exit 3"], None);
    for key in ["stdout", "stderr", "exit_code", "timed_out", "truncated"] {
        assert!(v.get(key).is_some(), "{key} missing in {v}");
    }
    assert_eq!(v["stdout"], "hi\n");
    assert_eq!(v["stderr"], "oops\n");
    assert_eq!(v["exit_code"], 3);
    assert_eq!(v["timed_out"], false);
    assert_eq!(v["truncated"], false);

    let v = exec_json(&["--timeout", "0.5", "--", "sleep", "1000"], None);
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["exit_code"], Value::Null);
    assert_eq!(v["signal"], 9);

    let v = exec_json(&["--stdin", "--", "wc", "-c"], Some(b"12345"));
    assert_eq!(v["stdout"].as_str().unwrap().trim(), "5");

    let v = exec_json(
        &["--output-bytes", "10", "--", "sh", "-c", "seq 1000"],
        None,
    );
    assert_eq!(v["truncated"], true);
    assert!(v["stdout"].as_str().unwrap().contains("output truncated"));

    let bomb = [
        "--memory",
        "128",
        "--",
        "python3",
        "-c",
        "bytearray(512 * 1024 * 1024)",
    ];
    let v = exec_json(&bomb, None);
    if clawrl::sandbox::enforcement() == clawrl::sandbox::Enforcement::Rlimits {
        assert_eq!(v["exit_code"], 1, "{v}");
        assert!(v["stderr"].as_str().unwrap().contains("MemoryError"), "{v}");
    } else {
        assert_eq!(v["signal"], 9, "{v}");
        assert!(
            v["stderr"]
                .as_str()
                .unwrap()
                .contains("the memory limit (128 MiB) was reached"),
            "{v}"
        );
    }
    // Where cgroups are not usable, the address-space limit refuses the allocation.
    let v = exec_json_env(&bomb, None, &[("CLAWRL_SANDBOX_CGROUPS", "off")]);
    assert_eq!(v["exit_code"], 1, "{v}");
    assert!(v["stderr"].as_str().unwrap().contains("MemoryError"), "{v}");
}

/// `clawrl sandbox probe` names how limits are enforced: what this process finds, or rlimits
/// alone when cgroups are switched off.
#[test]
fn probe_names_the_enforcement() {
    for (env, expect) in [
        (None, clawrl::sandbox::enforcement().to_string()),
        (
            Some("off"),
            clawrl::sandbox::Enforcement::Rlimits.to_string(),
        ),
    ] {
        let mut cmd = clawrl();
        cmd.args(["sandbox", "probe"]);
        if let Some(v) = env {
            cmd.env("CLAWRL_SANDBOX_CGROUPS", v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&expect), "{text}");
    }
}

/// The CLI's environment holds a secret; the sandbox init is a fork of the CLI, so its
/// `/proc/1/environ` holds it too. The command sees neither: the init is root's and hidden
/// (`hidepid=2`), and the command's own environment is built from scratch.
#[test]
fn the_hosts_environment_is_out_of_reach() {
    let secret = format!("clawrl-cli-secret-{}", std::process::id());
    let v = exec_json_env(
        &[
            "--",
            "sh",
            "-c",
            "cat /proc/1/environ; env; for f in /proc/[0-9]*/environ; do cat $f; done; echo end",
        ],
        None,
        &[("CLAWRL_NODE_TOKEN", &secret)],
    );
    let all = format!("{}{}", v["stdout"], v["stderr"]);
    assert!(v["stdout"].as_str().unwrap().ends_with("end\n"), "{v}");
    assert!(!all.contains(&secret), "{v}");
}

/// The scratch work dir (no `--workdir`) is a tmpfs of `--disk` MiB: files of the size limit
/// stop at the cap with ENOSPC, and it is gone afterwards.
#[test]
fn the_scratch_work_dir_is_capped() {
    let v = exec_json(
        &[
            "--disk",
            "8",
            "--file-size",
            "1",
            "--",
            "sh",
            "-c",
            "i=0; while [ $i -lt 100 ]; do \
               head -c 1048576 /dev/zero > f$i 2>/dev/null || break; i=$((i+1)); done; \
             echo $i; df -k . | tail -1",
        ],
        None,
    );
    let out = v["stdout"].as_str().unwrap();
    let files: u32 = out.lines().next().unwrap().parse().unwrap();
    assert!((4..=8).contains(&files), "{v}");
    assert!(out.contains("tmpfs"), "{v}");
}

#[test]
fn workdir_persists_across_invocations() {
    let dir = tempfile::tempdir().unwrap();
    let wd = dir.path().to_str().unwrap();
    let v = exec_json(
        &["--workdir", wd, "--", "sh", "-c", "echo kept > note"],
        None,
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let v = exec_json(&["--workdir", wd, "--", "cat", "note"], None);
    assert_eq!(v["stdout"], "kept\n");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("note")).unwrap(),
        "kept\n"
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, needle) in [
        (vec!["--timeout=0", "--", "true"], "--timeout"),
        (
            vec!["--workdir", "/nonexistent/clawrl", "--", "true"],
            "workdir",
        ),
        (vec!["--memory", "0", "--", "true"], "memory_mb"),
        (vec!["--env", "NOEQUALS", "--", "true"], "KEY=VALUE"),
    ] {
        let out = clawrl()
            .args(["sandbox", "exec"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn killing_the_host_kills_the_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = clawrl()
        .args(["sandbox", "exec", "--workdir"])
        .arg(dir.path())
        .args([
            "--",
            "sh",
            "-c",
            "readlink /proc/self/ns/pid > ns.tmp && mv ns.tmp ns; sleep 1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ns_file = dir.path().join("ns");
    wait_for(&ns_file, Duration::from_secs(20));
    let ns = std::fs::read_to_string(&ns_file)
        .unwrap()
        .trim()
        .to_string();
    assert!(processes_in_ns(&ns) >= 2, "the sandbox is not running");
    let host_pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while processes_in_ns(&ns) > 0 {
        assert!(
            Instant::now() < deadline,
            "the sandbox outlived its host process"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The killed host could not remove its sandbox's cgroup; the next host process does (any
    // other CLI these tests run meanwhile may do it first).
    if clawrl::sandbox::enforcement() != clawrl::sandbox::Enforcement::Rlimits {
        let v = exec_json(&["--", "true"], None);
        assert_eq!(v["exit_code"], 0, "{v}");
        let left = sandbox_cgroups_of(host_pid);
        assert!(left.is_empty(), "stale cgroups stay: {left:?}");
    }
}

/// The sandbox cgroups named after host process `pid`, anywhere below `/sys/fs/cgroup`.
fn sandbox_cgroups_of(pid: u32) -> Vec<std::path::PathBuf> {
    let prefix = format!("clawrl-sandbox-{pid}-");
    let mut found = Vec::new();
    let mut stack = vec![(std::path::PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            if !e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                found.push(e.path());
            } else if depth < 6 {
                stack.push((e.path(), depth + 1));
            }
        }
    }
    found
}

fn wait_for(path: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where sandboxes cannot start (here: inside a sandbox, which is not root and may create no
/// namespaces) the CLI fails with a message naming the cause, not a panic.
#[test]
fn where_sandboxes_cannot_start_the_error_is_clear() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_clawrl"), dir.path().join("clawrl")).unwrap();
    let wd = dir.path().to_str().unwrap();
    let v = exec_json(
        &[
            "--workdir",
            wd,
            "--",
            "/work/clawrl",
            "sandbox",
            "exec",
            "--",
            "true",
        ],
        None,
    );
    assert_eq!(v["exit_code"], 1, "{v}");
    let err = v["stderr"].as_str().unwrap();
    assert!(err.contains("sandboxes cannot start on this host"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
