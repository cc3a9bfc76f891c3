//! `clawrl train-offline` through the built binary: the fixture's PyTorch step reproduced from
//! JSONL + TRAIN.toml (metrics and the written checkpoint), recomputed old/reference log-probs,
//! and refusal of bad samples and bad config keys.

use std::path::Path;
use std::process::Command;

use burn::tensor::{Int, Tensor, TensorData};
use clawrl::model::load_model;
use clawrl::CpuBackend;
use serde_json::{json, Value};

const DIR: &str = "tests/fixtures/qwen3-tiny";

fn fixture(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(Path::new(DIR).join(name)).unwrap()).unwrap()
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// TRAIN.toml with the reference step's hyper-parameters, then `extra`.
pub(crate) fn write_train_toml(path: &Path, extra: &str) {
    let h = &fixture("train_step_expected.json")["hyper"];
    let text = format!(
        "lr = {}\nbetas = [{}, {}]\nadam_eps = {}\nweight_decay = {}\neps_clip = {}\neps_clip_high = {}\nkl_coef = {}\ngrad_clip = {}\nbatch_size = 2\n{extra}",
        h["lr"], h["betas"][0], h["betas"][1], h["adam_eps"], h["weight_decay"], h["eps_clip"],
        h["eps_clip_high"], h["kl_coef"], h["grad_clip_norm"]
    );
    std::fs::write(path, text).unwrap();
}

/// The reference step's samples as `dir/s.jsonl`, with their old and reference log-probs.
pub(crate) fn write_reference_samples(dir: &Path) -> std::path::PathBuf {
    let lines: Vec<String> = fixture("train_step_expected.json")["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            json!({
                "prompt_ids": s["prompt_ids"], "response_ids": s["response_ids"],
                "advantages": s["advantages"], "old_logprobs": s["old_logprobs"],
                "ref_logprobs": s["ref_logprobs"],
            })
            .to_string()
        })
        .collect();
    let samples = dir.join("s.jsonl");
    std::fs::write(&samples, lines.join("\n") + "\n").unwrap();
    samples
}

#[test]
fn offline_step_reproduces_the_reference_and_writes_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = fixture("train_step_expected.json");
    let samples = write_reference_samples(tmp.path());
    let cfg = tmp.path().join("TRAIN.toml");
    write_train_toml(&cfg, "");
    let out = tmp.path().join("out");
    let o = run(&[
        "train-offline",
        "--model",
        DIR,
        "--samples",
        samples.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    let steps: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 1, "{stdout}");
    let s = &steps[0];
    for k in [
        "step",
        "loss",
        "pg_loss",
        "kl",
        "clip_fraction",
        "grad_norm",
    ] {
        assert!(s.get(k).is_some(), "missing {k}: {s}");
    }
    assert_eq!(s["step"], 1);
    let rel = |k: &str, e: &str| {
        let (g, w) = (s[k].as_f64().unwrap(), exp[e].as_f64().unwrap());
        (g - w).abs() / w.abs()
    };
    assert!(rel("loss", "loss") < 1e-4 && rel("kl", "kl") < 1e-4, "{s}");
    assert!(rel("grad_norm", "grad_norm_before_clip") < 1e-3, "{s}");

    // The written checkpoint is the updated model: its probe logits are the reference's.
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let (_, model) = load_model::<CpuBackend>(&out, &Default::default()).unwrap();
    let ids: Vec<i64> = fixture("expected.json")["cases"][2]["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect();
    let n = ids.len();
    let logits = model.forward(Tensor::<CpuBackend, 2, Int>::from_data(
        TensorData::new(ids, [1, n]),
        &Default::default(),
    ));
    let v = logits.dims()[2];
    let last: Vec<f32> = logits
        .slice([0..1, n - 1..n, 0..v])
        .into_data()
        .to_vec()
        .unwrap();
    for (g, w) in last
        .iter()
        .zip(exp["probe_last_logits_after_step"].as_array().unwrap())
    {
        assert!((*g as f64 - w.as_f64().unwrap()).abs() < 2e-4);
    }
}

#[test]
fn recomputes_missing_logprobs_and_steps_per_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let samples = tmp.path().join("s.jsonl");
    let mut text = String::new();
    for (i, r) in [[40u32, 41, 2], [300, 301, 2], [77, 78, 2]]
        .iter()
        .enumerate()
    {
        let a = if i == 1 { -1.0 } else { 1.0 };
        text += &json!({"prompt_ids": [1, 89, 95], "response_ids": r, "advantages": [a, a, a]})
            .to_string();
        text += "\n";
    }
    std::fs::write(&samples, text).unwrap();
    let cfg = tmp.path().join("TRAIN.toml");
    std::fs::write(&cfg, "lr = 1e-3\nkl_coef = 0.05\nbatch_size = 2\n").unwrap();
    let out = tmp.path().join("nested/out");
    let o = run(&[
        "train-offline",
        "--model",
        DIR,
        "--samples",
        samples.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
        "--epochs",
        "2",
        "--shuffle",
        "--seed",
        "3",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let steps: Vec<Value> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // 3 samples, batches of 2, two epochs: 2 + 2 steps.
    assert_eq!(steps.len(), 4);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i as u64 + 1);
        assert!(s.get("skipped").is_none());
    }
    // First step: old = the policy's own and reference = the initial policy → ratio 1, KL 0.
    assert_eq!(steps[0]["clip_fraction"], 0.0);
    assert!(steps[0]["kl"].as_f64().unwrap().abs() < 1e-7);
    // Later steps: the policy has moved away from the reference.
    assert!(steps[3]["kl"].as_f64().unwrap() > 0.0);
    assert!(out.join("model.safetensors").exists());
    // Running again over an existing --out replaces it.
    let o = run(&[
        "train-offline",
        "--model",
        DIR,
        "--samples",
        samples.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8(o.stdout).unwrap().starts_with("step"));
}

#[test]
fn bad_samples_and_config_are_refused_with_line_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let good = json!({"prompt_ids": [1, 2], "response_ids": [3, 4], "advantages": [1.0, 1.0]});
    let cfg = tmp.path().join("TRAIN.toml");
    std::fs::write(&cfg, "batch_size = 1\n").unwrap();
    let out = tmp.path().join("out");
    let cases = [
        (
            r#"{"prompt_ids":[1],"response_ids":[3,4],"advantages":[1.0],"old_logprobs":[-1,-1]}"#,
            "field `advantages` has 1 values but `response_ids` has 2",
        ),
        (
            r#"{"prompt_ids":[1],"response_ids":[3,4],"advantages":[1.0,1.0],"old_logprobs":[-1]}"#,
            "field `old_logprobs` has 1 values",
        ),
        (
            r#"{"prompt_ids":[1],"response_ids":[3],"advantages":[1.0],"ref_logprobs":[NaN]}"#,
            "field `ref_logprobs[0]`: non-finite",
        ),
        (
            r#"{"prompt_ids":[1],"response_ids":[3],"advantages":[Infinity]}"#,
            "field `advantages[0]`: non-finite",
        ),
        (
            r#"{"prompt_ids":[1],"response_ids":[],"advantages":[]}"#,
            "field `response_ids` is empty",
        ),
        (
            r#"{"prompt_ids":[1],"response_ids":[3],"advantages":[1e40]}"#,
            "field `advantages` holds a non-finite",
        ),
        (
            r#"{"prompt_ids":[1],"response_ids":[100000],"advantages":[1]}"#,
            "outside the vocabulary",
        ),
    ];
    for (bad, needle) in cases {
        let samples = tmp.path().join("s.jsonl");
        std::fs::write(&samples, format!("{good}\n{bad}\n")).unwrap();
        let o = run(&[
            "train-offline",
            "--model",
            DIR,
            "--samples",
            samples.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{bad} accepted");
        assert!(
            err.contains("s.jsonl:2:") && err.contains(needle),
            "{bad}: {err}"
        );
        assert!(o.stdout.is_empty(), "trained before refusing: {bad}");
        assert!(!out.exists());
    }

    let samples = tmp.path().join("s.jsonl");
    std::fs::write(&samples, format!("{good}\n")).unwrap();
    write_train_toml(&cfg, "learning_rate = 0.1\n");
    let o = run(&[
        "train-offline",
        "--model",
        DIR,
        "--samples",
        samples.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("learning_rate") && err.contains("TRAIN.toml"),
        "{err}"
    );
}
