//! The gateway binary (`clawrl serve`) against the official `openai` Python SDK: a venv cached
//! under `target/` gets `openai` from PyPI, then `tests/gateway/openai_sdk_check.py` runs chat,
//! streaming, tools and typed errors. If the venv or pip fails, the test fails and says why.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::venv::run;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A venv with `openai`, created once and cached under `target/`.
fn venv_python() -> PathBuf {
    super::venv::venv_python(
        &Path::new(ROOT).join("target/gateway-openai-venv"),
        "openai",
        "openai",
    )
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn openai_python_sdk_chat_streaming_and_tools() {
    let py = venv_python();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &cfg,
        format!(
            "api_keys = [\"sdk-key\"]\nmodel_name = \"tiny\"\ndata_dir = {:?}\n",
            dir.path().join("data").to_str().unwrap()
        ),
    )
    .unwrap();
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_clawrl"))
            .args(["serve", "--listen", "127.0.0.1:0", "--model"])
            .arg(Path::new(ROOT).join("tests/fixtures/qwen3-tiny"))
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting clawrl serve"),
    );
    let base = super::venv::served_address(&mut child.0);
    run(
        Command::new(&py)
            .arg(Path::new(ROOT).join("tests/gateway/openai_sdk_check.py"))
            .args([&base, "sdk-key", "tiny"]),
        "the openai SDK check",
    );
    // SIGTERM: the gateway ends its sessions and writes their turns before exiting.
    let pid = child.0.id().to_string();
    run(Command::new("kill").args(["-TERM", &pid]), "kill -TERM");
    let status = child.0.wait().unwrap();
    assert!(status.success(), "clawrl serve exited with {status}");
    let turns = std::fs::read_to_string(dir.path().join("data/turns-v0.jsonl")).unwrap();
    let n = turns.lines().count();
    // Main turns: chat + tools (session "sdk", next state = the tool message) + streaming chat +
    // streaming tools (own session) = 4; the errored requests record nothing.
    assert_eq!(n, 4, "{turns}");
}
