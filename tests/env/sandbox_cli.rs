//! `clawrl sandbox exec` end to end: the JSON it prints, stdin, a persistent `--workdir`,
//! argument errors, and that killing the host process (the CLI, with SIGKILL) takes the whole
//! sandbox down instead of leaving `sleep 1000` running.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn clawrl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clawrl"))
}

fn exec_json(args: &[&str], stdin: Option<&[u8]>) -> Value {
    let mut cmd = clawrl();
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

    let v = exec_json(
        &[
            "--memory",
            "128",
            "--",
            "python3",
            "-c",
            "bytearray(512 * 1024 * 1024)",
        ],
        None,
    );
    assert_eq!(v["exit_code"], 1);
    assert!(v["stderr"].as_str().unwrap().contains("MemoryError"));
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
