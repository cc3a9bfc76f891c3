//! The sandbox init is a fork of the host process (which may hold a model in memory and
//! signal handlers). It releases its copy of the host's anonymous memory once the command runs,
//! so a long command does not pin copy-on-write pages of the host, and it never runs the host's
//! handlers (a tokio SIGCHLD handler here). A separate test binary, because it allocates
//! 256 MiB, which would disturb the memory measurement in `sandbox_attacks`.

use std::time::{Duration, Instant};

use clawrl::sandbox::{self, ExecOutput, SandboxSpec};

async fn run(spec: &SandboxSpec) -> ExecOutput {
    sandbox::probe().expect("sandboxes must be able to start on this host");
    sandbox::exec(spec).await.expect("sandbox exec")
}

fn processes_in_ns(ns: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(link) = std::fs::read_link(e.path().join("ns/pid")) {
            if link.to_string_lossy() == ns {
                found.push(name);
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_init_does_not_pin_host_memory() {
    // 256 MiB of touched host memory; the sandbox init is a fork of this process.
    let big = vec![7u8; 256 << 20];
    let dir = tempfile::tempdir().unwrap();
    let spec = SandboxSpec::new(
        dir.path(),
        vec![
            "/bin/sh".into(),
            "-c".into(),
            "readlink /proc/self/ns/pid > ns.tmp && mv ns.tmp ns; sleep 3".into(),
        ],
    );
    let task = tokio::spawn(async move { run(&spec).await });
    let ns_file = dir.path().join("ns");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ns_file.exists() {
        assert!(Instant::now() < deadline, "the command never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ns = std::fs::read_to_string(&ns_file)
        .unwrap()
        .trim()
        .to_string();
    let mut init_rss = None;
    for pid in processes_in_ns(&ns) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.split_whitespace().next().unwrap_or("").to_string())
        };
        if field("Uid:").as_deref() == Some("0") {
            init_rss = field("VmRSS:").and_then(|v| v.parse::<u64>().ok());
        }
    }
    let out = task.await.unwrap();
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    let rss = init_rss.expect("the sandbox init was not found");
    assert!(
        rss < 64 * 1024,
        "the init holds {rss} KiB of the host's memory"
    );
    assert_eq!(big[12345], 7);
}

/// Hosts often have a SIGCHLD handler (tokio::process installs one). The init is a fork of the
/// host and gets SIGCHLD when the command exits; it must not run the host's handler (whose data
/// it has unmapped) and must still report the command's status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_sigchld_handler_does_not_break_the_init() {
    let _sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for code in [0, 3, 42] {
        let spec = SandboxSpec::new(
            dir.path(),
            vec![
                "/bin/sh".into(),
                "-c".into(),
                format!("sleep 0.1 & sleep 0.2; exit {code}"),
            ],
        );
        let out = run(&spec).await;
        assert_eq!(out.exit_code, Some(code), "{out:?}");
        assert_eq!(out.signal, None, "{out:?}");
    }
}
