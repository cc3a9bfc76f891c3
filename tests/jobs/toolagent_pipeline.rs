//! The tool-call agent experiment end to end at a tiny size: the warm start makes the policy
//! emit `code_interpreter` calls that the sandboxed environment parses and runs, each reward arm
//! is a step-wise job whose tool steps the rule-based PRM judges over HTTP and whose trainer
//! steps and checkpoints, and both arms are measured on those checkpoints and plotted, all by
//! the built binary (`clawrl run --json`). Needs the sandbox (root and user namespaces, as in CI); the
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
updates = 2
eval_at = [0, 2]
batch_size = 4
group_size = 2
parallelism = 4
max_steps = 3
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

    // Each arm's job: episodes in the tool-call environment, every tool step judged by the PRM
    // over HTTP (one vote each, none refused or failed), the two trainer steps on step
    // samples, a checkpoint at the measured update, and the measurement taken from it.
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for (r, name) in runs.iter().zip(["integrated", "outcome_only"]) {
        assert_eq!(r["arm"], name);
        let job = &r["job"];
        let (counts, trainer) = (&job["counts"], &job["trainer"]);
        assert_eq!(job["method"], "stepwise");
        assert_eq!(trainer["steps"], 2, "{name}: {trainer}");
        assert!(num(&trainer["trained"]) >= 8.0, "{name}: {trainer}");
        assert_eq!(trainer["published"], 2, "{name}: {trainer}");
        assert!(num(&counts["turns"]) >= 4.0, "{name}: {counts}");
        let judged = num(&counts["judged"]);
        assert!(judged >= 1.0, "no tool step was judged: {counts}");
        let prm = &r["prm"];
        assert_eq!(prm["refused"], 0, "{name}: {prm}");
        assert_eq!(counts["votes_failed"], 0, "{name}: {counts}");
        assert!(
            num(&prm["positive"]) + num(&prm["negative"]) >= judged,
            "{name}: {judged} judged steps, PRM votes {prm}"
        );
        let ckpt = Path::new(job["checkpoint_dir"].as_str().unwrap()).join("step-00000002");
        assert!(
            ckpt.join("model.safetensors").exists(),
            "{}",
            ckpt.display()
        );
        assert_eq!(r["measurements"].as_array().unwrap().len(), 2);
        assert_eq!(r["measurements"][1]["updates"], 2);
        let success = report["success"][name].as_array().unwrap();
        assert!(success.iter().all(|s| (0.0..=1.0).contains(&num(s))));
        // The job's TensorBoard run: the version record, the steps' scalars and the judged
        // steps, every record's CRCs checked.
        let files: Vec<_> = std::fs::read_dir(out.join(name).join("tb"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{name}: {files:?}");
        let bytes = std::fs::read(&files[0]).unwrap();
        let records = clawrl::watch::events::tfrecords(&bytes).unwrap().len();
        assert!(records > 10, "{name}: {records} records");
    }
    for f in [
        "results.json",
        "details.json",
        "success.png",
        "train_tasks.jsonl",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["updates"], serde_json::json!([0, 2]));

    // A second run reuses the cached warm start.
    let again = run(&file, &dir.path().join("run2"));
    assert_eq!(again["sft"]["cached"], true);
}
