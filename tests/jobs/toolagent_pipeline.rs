//! The tool-call agent experiment end to end at a tiny size: the warm start makes the policy
//! emit `code_interpreter` calls that the sandboxed environment parses and runs, an RL update
//! moves the policy, and both reward arms run and are measured and plotted. Needs the sandbox
//! (root and user namespaces, as in CI); the full-size experiment is
//! `cargo run --release --example tool_call_agent`.

use clawrl::rl::EpisodeKind;
use clawrl::toolagent::experiment::{run, ExperimentFile};

const TINY: &str = r#"
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

#[test]
fn warm_start_calls_the_interpreter_and_both_arms_train() {
    let _ = EpisodeKind::ToolCall;
    let dir = tempfile::tempdir().unwrap();
    let mut file = ExperimentFile::from_toml_str(TINY, "tiny.toml").unwrap();
    file.cache_dir = Some(dir.path().join("cache"));
    let out = dir.path().join("run");
    let report = run(&file, &out).unwrap();
    assert!(!report.sft.cached);
    assert!(report.sft.final_nll.is_finite());

    // The warm start calls the tool, and its calls are parsed and executed by python3 in the
    // sandbox (their tool messages carry exit code 0 and what the code printed).
    let base = &report.runs[0].measurements[0];
    assert_eq!(base.updates, 0);
    assert!(
        base.tool_use > 0.0,
        "no tool call at the warm start: {base:?}"
    );
    assert!(base.calls_ran > 0.0, "no tool call ran: {base:?}");

    // Both arms ran their update on samples and were measured twice.
    assert_eq!(report.runs.len(), 2);
    for (r, name) in report.runs.iter().zip(["integrated", "outcome_only"]) {
        assert_eq!(r.arm, name);
        assert_eq!(r.measurements.len(), 2);
        assert_eq!(r.measurements[1].updates, 1);
        let u = &r.updates[0];
        assert_eq!(u.episodes, 4);
        assert!(u.steps >= 4 && u.trained >= 1, "{u:?}");
        assert!(u.loss.is_finite() && u.grad_norm.is_finite(), "{u:?}");
        // The update moved the policy on what it trained on.
        assert!(u.shift > 1e-6, "the policy did not move: {u:?}");
        assert!(report.success[name].iter().all(|s| (0.0..=1.0).contains(s)));
    }
    for f in ["results.json", "details.json", "success.png"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let results: serde_json::Value =
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
    let again = run(&file, &dir.path().join("run2")).unwrap();
    assert!(again.sft.cached);
}
