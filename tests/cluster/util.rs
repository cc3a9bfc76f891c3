//! Helpers for the cluster tests: certificates, node configs on runtime-picked loopback ports,
//! node processes started from the built `clawrl` binary, and CLI calls.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_clawrl");

/// A free UDP port on loopback (bound, read, released).
pub fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs the CLI to completion.
pub fn clawrl(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run clawrl")
}

/// Runs the CLI and returns stdout, panicking with stderr on failure.
pub fn clawrl_ok(args: &[&str]) -> String {
    let out = clawrl(args);
    assert!(
        out.status.success(),
        "clawrl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `clawrl cluster init` into `dir/certs` for `nodes`.
pub fn init_certs(dir: &Path, nodes: &[&str]) -> PathBuf {
    let certs = dir.join("certs");
    clawrl_ok(&[
        "cluster",
        "init",
        "--out",
        certs.to_str().unwrap(),
        "--nodes",
        &nodes.join(","),
    ]);
    certs
}

/// Writes a node config; returns its path.
pub fn write_config(
    dir: &Path,
    name: &str,
    port: u16,
    seeds: &[u16],
    roles: &[&str],
    certs: Option<&Path>,
) -> PathBuf {
    let seeds: Vec<String> = seeds.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    let roles: Vec<String> = roles.iter().map(|r| format!("\"{r}\"")).collect();
    let mut text = format!(
        "[node]\nname = \"{name}\"\nlisten = \"127.0.0.1:{port}\"\nseeds = [{}]\nroles = [{}]\ndata_dir = \"data/{name}\"\n",
        seeds.join(", "),
        roles.join(", ")
    );
    if let Some(c) = certs {
        text += &format!(
            "[tls]\nca = \"{0}/ca.pem\"\ncert = \"{0}/{name}.pem\"\nkey = \"{0}/{name}.key\"\n",
            c.display()
        );
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// A node process, killed on drop.
pub struct NodeProc {
    pub child: Child,
    pub log: PathBuf,
}

impl NodeProc {
    /// Starts `clawrl <cmd> --config FILE [extra...]`, logging to `FILE.log`.
    pub fn start(cmd: &str, config: &Path, extra: &[&str]) -> NodeProc {
        let log = config.with_file_name(format!(
            "{}-{}.log",
            config.file_stem().unwrap().to_string_lossy(),
            next_id()
        ));
        let f = std::fs::File::create(&log).unwrap();
        let child = Command::new(BIN)
            .arg(cmd)
            .arg("--config")
            .arg(config)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(f)
            .spawn()
            .expect("spawn node");
        NodeProc { child, log }
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGHUP (a node re-reads its config's `[tls] deny`).
    pub fn hangup(&self) {
        // SAFETY: a plain kill(2) on our own child's pid.
        let r = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGHUP) };
        assert_eq!(r, 0, "SIGHUP to {}", self.child.id());
    }

    /// The node's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

fn next_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The cluster as seen by the node of `config` (`nodes --json`), or None if it does not answer.
pub fn view(config: &Path) -> Option<serde_json::Value> {
    let out = clawrl(&["nodes", "--config", config.to_str().unwrap(), "--json"]);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// Node names in a view.
pub fn node_names(v: &serde_json::Value) -> Vec<String> {
    let mut n: Vec<String> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap().to_string())
        .collect();
    n.sort();
    n
}

/// Members of a group in a view.
pub fn members(v: &serde_json::Value, group: &str) -> Vec<String> {
    v["groups"][group]
        .as_array()
        .map(|a| a.iter().map(|m| m.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Polls `f` every 100 ms until it returns Some or `limit` passes.
pub fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A valid job spec (the fixture policy and terminal tasks, by absolute path) wanting
/// `parallelism` terminal workers.
pub fn job_spec(parallelism: u32) -> String {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    format!(
        r#"kind = "rl"
name = "terminal-demo"
[policy]
checkpoint = "{fixtures}/qwen3-tiny"
[judge]
backend = "scripted"
votes = 3
[method]
kind = "combined"
[optim]
batch_size = 16
lr = 1e-6
clip = 0.2
kl = 0.01
staleness = 2
[env]
kind = "terminal"
parallelism = {parallelism}
tasks = "{fixtures}/env/terminal.jsonl"
[stop]
max_steps = 100
"#
    )
}

/// `status JOB --json` → the job record.
pub fn job_status(config: &Path, job: &str) -> serde_json::Value {
    let out = clawrl_ok(&[
        "status",
        job,
        "--config",
        config.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v[0].clone()
}
