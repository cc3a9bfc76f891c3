//! A `personal` job run by the built binary (`clawrl run --json --out OUT SPEC`): the spec of a
//! small one over the fixture policy, a chat request to it, the gateway address it announces on stderr, the stderr
//! kept for failure messages, and the JSON summary it prints after SIGTERM ([`spawn_run`]
//! starts any job kind the same way). Shared by the `jobs` and `gateway` areas of the test
//! suite.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What differs between the tests' `personal` jobs.
pub struct SpecParams<'a> {
    /// The job's name.
    pub name: &'a str,
    /// Its seed.
    pub seed: u64,
    /// The API key clients must send.
    pub key: &'a str,
    /// Votes per judged turn.
    pub votes: u32,
    /// The KL coefficient (0 turns the reference model off).
    pub kl: f64,
}

/// A `personal` job over the fixture policy serving model `tiny` behind `p.key` (answers of 6
/// tokens), its turns under `<out>/turns`, judged by a scripted judge that scores a next state
/// saying "thanks" +1 and "wrong" −1, trained by binary RL in batches of 2; it runs until
/// stopped (an hour at most).
pub fn spec(out: &Path, p: &SpecParams<'_>) -> String {
    let ck = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny");
    format!(
        r#"
kind = "personal"
name = "{name}"
seed = {seed}
[policy]
checkpoint = {ck:?}
[gateway]
listen = "127.0.0.1:0"
model_name = "tiny"
api_keys = ["{key}"]
data_dir = {turns:?}
default_max_tokens = 6
[judge]
backend = "scripted"
votes = {votes}
rules = [{{ pattern = "(?i)thanks", score = 1 }}, {{ pattern = "(?i)wrong", score = -1 }}]
default_score = 0
[method]
kind = "binary"
[optim]
batch_size = 2
lr = 1e-3
clip = 0.2
kl = {kl:?}
staleness = 8
[stop]
max_hours = 1.0
"#,
        name = p.name,
        seed = p.seed,
        key = p.key,
        votes = p.votes,
        kl = p.kl,
        ck = ck.display().to_string(),
        turns = out.join("turns").display().to_string(),
    )
}

/// One chat completion of model `tiny` (at most 6 tokens) sent with `key` and `headers`,
/// which must succeed: its body and its `X-Clawrl-Version` header.
pub async fn chat(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    messages: serde_json::Value,
    headers: &[(&str, &str)],
) -> (serde_json::Value, String) {
    let mut req = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&serde_json::json!({"model": "tiny", "messages": messages, "max_tokens": 6}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    let header = r
        .headers()
        .get("x-clawrl-version")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.json().await.unwrap(), header)
}

/// The running job; dropped, it is killed.
pub struct PersonalRun {
    child: Child,
    /// `http://ADDR` of its gateway.
    pub base: String,
    log: Arc<Mutex<String>>,
}

/// Starts `clawrl run --json --out OUT SPEC` (stdout piped) with its stderr collected, line by
/// line, into the returned log, each line also handed to `on_line`.
pub fn spawn_run(
    spec: &Path,
    out: &Path,
    mut on_line: impl FnMut(&str) + Send + 'static,
) -> (Child, Arc<Mutex<String>>) {
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
    let log = Arc::new(Mutex::new(String::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            log2.lock().unwrap().push_str(&format!("{line}\n"));
            on_line(&line);
        }
    });
    (child, log)
}

impl PersonalRun {
    /// Starts `clawrl run` on `spec` (its gateway listening on a port of its choosing) and
    /// waits up to `wait` for the address it announces.
    pub fn start(spec: &Path, out: &Path, wait: Duration) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let (child, log) = spawn_run(spec, out, move |line| {
            if let Some(i) = line.find("listening on http://") {
                let rest = &line[i + "listening on ".len()..];
                let _ = tx.send(rest.split_whitespace().next().unwrap().to_string());
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

/// `examples/personal.toml` shortened for the suite: its warm start cached under `cache`, 300
/// steps of a smaller policy (hidden 64, intermediate 192: the path is what the tests check, not
/// how far the example's size learns), and `updates` updates measured at 0 and at the end, 32
/// train and 16 held-out tasks per user.
pub fn shortened_example(cache: &Path, updates: i64) -> toml::Table {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/personal.toml");
    let mut t: toml::Table = toml::from_str(&std::fs::read_to_string(example).unwrap()).unwrap();
    t.insert("cache_dir".into(), cache.display().to_string().into());
    let sft = t["sft"].as_table_mut().unwrap();
    sft.insert("steps".into(), 300.into());
    sft.insert("hidden".into(), 64.into());
    sft.insert("intermediate".into(), 192.into());
    let x = t["experiment"].as_table_mut().unwrap();
    x.insert("updates".into(), updates.into());
    x.insert("eval_at".into(), vec![0, updates].into());
    x.insert("train_tasks_per_user".into(), 32.into());
    x.insert("eval_tasks_per_user".into(), 16.into());
    t
}

/// The [`shortened_example`] run by the built binary as a user runs it, `clawrl run --json --out
/// DIR/run DIR/experiment.toml`: the JSON report it prints, panicking with its stderr if it
/// failed.
pub fn run_experiment(dir: &Path, cache: &Path, updates: i64) -> serde_json::Value {
    run_experiment_with(dir, cache, updates, &[])
}

/// [`run_experiment`] with more arguments to `clawrl run` (such as `--seeds 1,2`).
pub fn run_experiment_with(
    dir: &Path,
    cache: &Path,
    updates: i64,
    args: &[&str],
) -> serde_json::Value {
    let t = shortened_example(cache, updates);
    let file = dir.join("experiment.toml");
    std::fs::write(&file, toml::to_string(&t).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_LOG", "warn")
        .args(["run", "--json", "--out"])
        .arg(dir.join("run"))
        .args(args)
        .arg(&file)
        .output()
        .expect("starting clawrl run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "clawrl run failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout}\n{stderr}"))
}
