//! The tool-call agent experiment end to end at a tiny size: the warm start makes the policy
//! emit `code_interpreter` calls that the sandboxed environment parses and runs, an RL update
//! moves the policy, and both reward arms run and are measured and plotted, all by the built
//! binary (`clawrl run --json`). Needs the sandbox (root and user namespaces, as in CI); the
//! full-size experiment is `clawrl run examples/tool_call_agent.toml`.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const TINY: &str = r#"
kind = "tool_call_experiment"

[tasks]
train = 40
held_out = 4

[sft]
layers = 1
hidden = 32
heads = 2
kv_heads = 1
intermediate = 64
max_positions = 160
steps = 150
batch_size = 8
lr = 1e-2

[sft.mixture]
direct_rate = 0.0
two_call_rate = 0.0
slip_rate = 0.0

[experiment]
arms = ["integrated", "outcome_only"]
updates = 1
eval_at = [0, 1]
tasks_per_update = 2
group_size = 2
max_tool_calls = 2
eval_samples = 2
temperature = 0.5
max_new_tokens = 48
"#;

/// `clawrl run --json --out OUT FILE`, which must succeed: its JSON report.
fn run(file: &Path, out: &Path) -> Value {
    let done = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .env("RUST_LOG", "warn")
        .args(["run", "--json", "--out"])
        .arg(out)
        .arg(file)
        .output()
        .expect("starting clawrl run");
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "clawrl run failed: {stderr}");
    let stdout = String::from_utf8_lossy(&done.stdout);
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout}\n{stderr}"))
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn warm_start_calls_the_interpreter_and_both_arms_train() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tiny.toml");
    let cache = dir.path().join("cache");
    std::fs::write(
        &file,
        format!("cache_dir = {:?}\n{TINY}", cache.display().to_string()),
    )
    .unwrap();
    let out = dir.path().join("run");
    let report = run(&file, &out);
    assert_eq!(report["sft"]["cached"], false);
    assert!(num(&report["sft"]["final_nll"]).is_finite());

    // The warm start calls the tool, and its calls are parsed and executed by python3 in the
    // sandbox (their tool messages carry exit code 0 and what the code printed).
    let base = &report["runs"][0]["measurements"][0];
    assert_eq!(base["updates"], 0);
    assert!(
        num(&base["tool_use"]) > 0.0,
        "no tool call at the warm start: {base}"
    );
    assert!(num(&base["calls_ran"]) > 0.0, "no tool call ran: {base}");

    // Both arms ran their update on samples and were measured twice.
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for (r, name) in runs.iter().zip(["integrated", "outcome_only"]) {
        assert_eq!(r["arm"], name);
        assert_eq!(r["measurements"].as_array().unwrap().len(), 2);
        assert_eq!(r["measurements"][1]["updates"], 1);
        let u = &r["updates"][0];
        assert_eq!(u["episodes"], 4);
        assert!(num(&u["steps"]) >= 4.0 && num(&u["trained"]) >= 1.0, "{u}");
        // A non-finite loss or gradient norm serializes as null, which `num` refuses.
        assert!(
            num(&u["loss"]).is_finite() && num(&u["grad_norm"]).is_finite(),
            "{u}"
        );
        // The update moved the policy on what it trained on.
        assert!(num(&u["shift"]) > 1e-6, "the policy did not move: {u}");
        let success = report["success"][name].as_array().unwrap();
        assert!(success.iter().all(|s| (0.0..=1.0).contains(&num(s))));
    }
    for f in ["results.json", "details.json", "success.png"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["updates"], serde_json::json!([0, 1]));

    // Each arm's TensorBoard run: one event file holding the version record, the step's ten
    // scalars and the PRM's step scores, every record's CRCs checked.
    for name in ["integrated", "outcome_only"] {
        let files: Vec<_> = std::fs::read_dir(out.join("tb").join(name))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{name}: {files:?}");
        let bytes = std::fs::read(&files[0]).unwrap();
        let records = clawrl::watch::events::tfrecords(&bytes).unwrap().len();
        assert!(records > 10, "{name}: {records} records");
    }

    // A second run reuses the cached warm start.
    let again = run(&file, &dir.path().join("run2"));
    assert_eq!(again["sft"]["cached"], true);
}
