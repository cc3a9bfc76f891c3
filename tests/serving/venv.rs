//! Python virtual environments the serving tests need, each created once under `target/` with
//! one package from PyPI. If the venv or pip fails, the test fails and says why.

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(cmd: &mut Command, what: &str) {
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
