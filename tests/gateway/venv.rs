//! Commands the serving tests run (failing with their output), the address a `clawrl serve`
//! child announces, and the Python virtual
//! environments they need, each created once under `target/` with one package from PyPI. If the
//! venv or pip fails, the test fails and says why.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// Runs `cmd` to completion and returns its stdout; panics naming `what` and showing the
/// output if it cannot start or fails.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The python of the venv at `dir`, created with `package` unless `module` already imports.
pub fn venv_python(dir: &Path, module: &str, package: &str) -> PathBuf {
    let py = dir.join("bin/python");
    let ready = py.exists()
        && Command::new(&py)
            .args(["-c", &format!("import {module}")])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    if !ready {
        run(
            Command::new("python3")
                .args(["-m", "venv", "--clear"])
                .arg(dir),
            "creating the venv (python3 -m venv)",
        );
        run(
            Command::new(&py).args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                package,
            ]),
            &format!("pip install {package} (PyPI must be reachable)"),
        );
    }
    py
}

/// The `http://ADDR` a `clawrl serve` child (stdout piped) prints on its first line.
pub fn served_address(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout piped"))
        .read_line(&mut line)
        .unwrap();
    line.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string()
}
