//! A `personal` job run by the built binary (`clawrl run --json --out OUT SPEC`): the gateway
//! address it announces on stderr, the stderr kept for failure messages, and the JSON summary
//! it prints after SIGTERM. Shared by the `jobs` and `serving` test binaries (`#[path]`).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The running job; dropped, it is killed.
pub struct PersonalRun {
    child: Child,
    /// `http://ADDR` of its gateway.
    pub base: String,
    log: Arc<Mutex<String>>,
}

impl PersonalRun {
    /// Starts `clawrl run` on `spec` (its gateway listening on a port of its choosing) and
    /// waits up to `wait` for the address it announces.
    pub fn start(spec: &Path, out: &Path, wait: Duration) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_clawrl"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("RUST_LOG", "warn")
            .args(["run", "--json", "--out"])
            .arg(out)
            .arg(spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting clawrl run");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let log = Arc::new(Mutex::new(String::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log2.lock().unwrap().push_str(&format!("{line}\n"));
                if let Some(i) = line.find("listening on http://") {
                    let rest = &line[i + "listening on ".len()..];
                    let _ = tx.send(rest.split_whitespace().next().unwrap().to_string());
                }
            }
        });
        let mut run = Self {
            child,
            base: String::new(),
            log,
        };
        match rx.recv_timeout(wait) {
            Ok(b) => run.base = b,
            Err(_) => panic!("the job never listened: {}", run.log()),
        }
        run
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGTERM (what Ctrl-C does): the job drains; returns its JSON summary, panicking with
    /// its stderr if it failed.
    pub fn stop(mut self) -> serde_json::Value {
        let pid = self.child.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(killed.success(), "kill -TERM {pid}");
        let mut stdout = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .unwrap();
        let status = self.child.wait().unwrap();
        assert!(
            status.success(),
            "clawrl run failed ({status}): {}",
            self.log()
        );
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout}\n{}", self.log()))
    }
}

impl Drop for PersonalRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
