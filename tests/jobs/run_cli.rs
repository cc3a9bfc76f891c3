//! `clawrl run` through the binary: the shipped demo runs to its stop condition and prints a
//! JSON summary whose counts balance, the embedded node's Control keeps the job's final counts,
//! bad job specs are refused with errors naming the key and the file, and so is a judge endpoint
//! or key variable that the embedded node does not allow.

use std::path::Path;
use std::process::Command;

fn clawrl() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_clawrl"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_LOG", "warn");
    c
}

#[test]
fn demo_runs_with_a_json_summary_and_control_keeps_the_counts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = clawrl()
        .args(["run", "examples/demo.toml", "--json", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "clawrl run failed: {stderr}");
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    });
    assert_eq!(s["balanced"], true, "{s}");
    assert_eq!(s["method"], "combined");
    let t = &s["trainer"];
    // Exactly the demo's `stop.max_steps`: batches queued beyond it stay pending.
    assert_eq!(t["steps"].as_u64(), Some(3), "{t}");
    assert_eq!(t["version"].as_u64(), Some(3), "{t}");
    // Admission control at its default, batch_size 4 × min(staleness 2 + 1, 2).
    assert_eq!(
        s["counts"]["admission"]["max_backlog"].as_u64(),
        Some(8),
        "{s}"
    );
    let produced = t["produced"].as_u64().unwrap();
    let sum: u64 = ["trained", "dropped_stale", "failed", "pending"]
        .iter()
        .map(|k| t[*k].as_u64().unwrap())
        .sum();
    assert_eq!(produced, sum, "{t}");
    // The train/serve gap over the job: the rollout's log-probs against the trainer's own.
    super::pipeline_e2e::check_gap(&t["logprob_gap"], "the job's summary");
    let turns = s["counts"]["turns"].as_u64().unwrap();
    assert!(turns > 0);
    assert!(Path::new(s["records_dir"].as_str().unwrap()).is_dir());
    assert!(s["final_checkpoint"].as_str().is_some(), "{s}");

    // The embedded Control stored the job with its final counts.
    let id = s["control_id"].as_str().unwrap();
    let jobs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("node/control/jobs.json")).unwrap())
            .unwrap();
    let job = jobs
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == id)
        .expect("Control knows the job");
    assert_eq!(job["progress"]["phase"], "finished", "{job}");
    // The node hosts the job's environment workers, so Control placed it.
    assert_eq!(job["state"], "Placed", "{job}");
    assert_eq!(job["progress"]["turns"].as_u64(), Some(turns));
    assert_eq!(
        job["progress"]["trainer"]["produced"].as_u64(),
        Some(produced)
    );
    // The node config written for `clawrl status --config` parses.
    assert!(std::fs::read_to_string(out.join("node.toml"))
        .unwrap()
        .contains("[node]"));
}

/// The summary table prints the job's train/serve gap on a line of its own.
#[test]
fn the_summary_table_prints_the_train_serve_gap() {
    let dir = tempfile::tempdir().unwrap();
    let o = clawrl()
        .args(["run", "examples/demo.toml", "--out"])
        .arg(dir.path().join("run"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "clawrl run failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("train/serve gap"))
        .unwrap_or_else(|| panic!("no gap line in the summary:\n{stdout}"));
    let number_after = |label: &str| -> f64 {
        let rest = &line[line
            .find(label)
            .unwrap_or_else(|| panic!("{label}: {line}"))
            + label.len()..];
        rest.trim_start()
            .split(|c: char| c == ',' || c.is_whitespace())
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|e| panic!("{label} in {line}: {e}"))
    };
    let (mean_abs, max_abs) = (number_after("mean |Δ|"), number_after("max |Δ|"));
    assert!(mean_abs >= 0.0 && max_abs >= mean_abs, "{line}");
    assert!(line.contains("tokens"), "{line}");
}

fn bad_spec(edit: impl Fn(&str) -> String, key: &str) {
    let dir = tempfile::tempdir().unwrap();
    let demo = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.toml"))
        .unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, edit(&demo)).unwrap();
    let o = clawrl()
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("run"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a bad spec ran: {stderr}");
    assert!(
        stderr.contains(key) && stderr.contains("bad.toml"),
        "the error names neither `{key}` nor the file: {stderr}"
    );
    assert!(o.stdout.is_empty(), "nothing on stdout for a refused spec");
}

#[test]
fn bad_specs_are_refused_naming_the_key_and_file() {
    bad_spec(
        |d| d.replace("lr = 1e-3", "lr = 1e-3\nlerning_rate = 3"),
        "lerning_rate",
    );
    bad_spec(
        |d| d.replace("parallelism = 4", "parallelism = 0"),
        "env.parallelism",
    );
    bad_spec(
        |d| d.replace("batch_size = 4", "batch_size = \"four\""),
        "optim.batch_size",
    );
    bad_spec(|d| d.replace("max_steps = 3", ""), "stop");
    // The OPD loss keys: a top-k of 0, an unknown loss, and a top-k beyond the policy's
    // vocabulary (the fixture has 512 tokens), refused once the checkpoint is loaded: that spec's
    // paths are made absolute so that it loads from the temporary directory.
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/");
    for (keys, key) in [
        ("opd_loss = \"topk\"\ntopk = 0", "method.topk"),
        ("opd_loss = \"top\"", "method.opd_loss"),
        ("opd_loss = \"topk\"\ntopk = 513", "method.topk"),
    ] {
        bad_spec(
            |d| {
                d.replace("w_opd = 1.0", &format!("w_opd = 1.0\n{keys}"))
                    .replace("\"../tests/", &format!("\"{examples}../tests/"))
                    .replace("\"demo/", &format!("\"{examples}demo/"))
            },
            key,
        );
    }
    bad_spec(
        |d| d.replace("tasks = \"demo/tasks.jsonl\"", "tasks = \"missing.jsonl\""),
        "missing.jsonl",
    );
}

/// The demo spec with an `openai` judge at `endpoint` reading its key from `key_env`.
fn with_openai_judge(demo: &str, endpoint: &str, key_env: &str) -> String {
    let start = demo.find("[judge]").unwrap();
    let end = demo.find("[method]").unwrap();
    format!(
        "{}[judge]\nbackend = \"openai\"\nvotes = 1\nendpoint = \"{endpoint}\"\nmodel = \"m\"\n\
         api_key_env = \"{key_env}\"\n\n{}",
        &demo[..start],
        &demo[end..]
    )
}

/// Runs `clawrl run` on `spec` with `args`; returns (success, stderr).
fn run_spec(spec: &str, args: &[&str]) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("judge.toml");
    std::fs::write(&file, spec).unwrap();
    let o = clawrl()
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("run"))
        .args(args)
        .env("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn judge_endpoints_and_key_variables_are_the_nodes_to_allow() {
    let demo = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.toml"))
        .unwrap();
    // A listener the judge would reach if it were built: nothing may connect to it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let local = format!("http://{}/v1", listener.local_addr().unwrap());

    // Not a loopback endpoint: refused by default, naming the key and the value.
    let (ok, stderr) = run_spec(
        &with_openai_judge(
            &demo,
            "https://anywhere.example/v1",
            "AWS_SECRET_ACCESS_KEY",
        ),
        &[],
    );
    assert!(!ok, "ran: {stderr}");
    assert!(
        stderr.contains("judge.endpoint `https://anywhere.example/v1`")
            && stderr.contains("judge.toml"),
        "{stderr}"
    );
    // A loopback endpoint is allowed by default, a key variable is not.
    let spec = with_openai_judge(&demo, &local, "AWS_SECRET_ACCESS_KEY");
    let (ok, stderr) = run_spec(&spec, &[]);
    assert!(!ok, "ran: {stderr}");
    assert!(
        stderr.contains("judge.api_key_env `AWS_SECRET_ACCESS_KEY`"),
        "{stderr}"
    );
    // Allowing another variable, or only another endpoint, does not allow these.
    let (ok, stderr) = run_spec(&spec, &["--allow-judge-key-env", "JUDGE_KEY"]);
    assert!(!ok && stderr.contains("judge.api_key_env"), "{stderr}");
    let (ok, stderr) = run_spec(
        &spec,
        &[
            "--allow-judge-endpoint",
            "https://api.example.com/v1",
            "--allow-judge-key-env",
            "AWS_SECRET_ACCESS_KEY",
        ],
    );
    assert!(!ok && stderr.contains("judge.endpoint"), "{stderr}");
    // Nothing was sent: the judge was never built.
    assert_eq!(
        listener.accept().err().map(|e| e.kind()),
        Some(std::io::ErrorKind::WouldBlock),
        "the refused judge connected"
    );
    // An allowed endpoint entry must have a usable shape.
    let (ok, stderr) = run_spec(&spec, &["--allow-judge-endpoint", "ftp://x"]);
    assert!(
        !ok && stderr.contains("judge.allowed_endpoints[0]"),
        "{stderr}"
    );
}
