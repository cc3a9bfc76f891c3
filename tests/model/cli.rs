//! The model-area command line, run through the built binary on the tiny fixture.

use std::path::{Path, PathBuf};
use std::process::Command;

use clawrl::model::load_config;
use minijinja::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny")
}

/// Runs the built binary: `(success, stdout, stderr)`.
pub(crate) fn clawrl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Case `i` of expected.json (key order kept) and its messages/tools written to files.
pub(crate) fn case_files(i: usize, dir: &Path) -> (serde_json::Value, PathBuf, Option<PathBuf>) {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    let ordered: Value = serde_json::from_str(&text).unwrap();
    let case = ordered
        .get_attr("cases")
        .unwrap()
        .get_item_by_index(i)
        .unwrap();
    let m = dir.join("messages.json");
    std::fs::write(
        &m,
        serde_json::to_string(&case.get_attr("messages").unwrap()).unwrap(),
    )
    .unwrap();
    let tools = case.get_attr("tools").unwrap();
    let t = (!tools.is_none()).then(|| {
        let p = dir.join("tools.json");
        std::fs::write(&p, serde_json::to_string(&tools).unwrap()).unwrap();
        p
    });
    let plain: serde_json::Value = serde_json::from_str(&text).unwrap();
    (plain["cases"][i].clone(), m, t)
}

#[test]
fn inspect_prints_config_and_parameter_count() {
    let dir = fixture_dir();
    let (ok, out, err) = clawrl(&["model", "inspect", dir.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cfg = load_config(&dir).unwrap();
    assert_eq!(v["parameters"], cfg.num_parameters());
    assert_eq!(v["hidden_size"], 64);
    assert_eq!(v["num_key_value_heads"], 2);
    assert_eq!(v["tie_word_embeddings"], true);
}

#[test]
fn logits_with_tools_match_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let (case, m, t) = case_files(3, tmp.path());
    let dir = fixture_dir();
    let t = t.expect("case 3 has tools");
    let (ok, out, err) = clawrl(&[
        "model",
        "logits",
        dir.to_str().unwrap(),
        "--messages",
        m.to_str().unwrap(),
        "--tools",
        t.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["prompt_text"], case["prompt_text"]);
    assert_eq!(v["input_ids"], case["input_ids"]);
    let got = v["last_logits"].as_array().unwrap();
    let want = case["last_logits"].as_array().unwrap();
    let scale = want
        .iter()
        .fold(0f64, |m, x| m.max(x.as_f64().unwrap().abs()));
    for (g, w) in got.iter().zip(want) {
        assert!((g.as_f64().unwrap() - w.as_f64().unwrap()).abs() / scale < 1e-4);
    }
}

#[test]
fn greedy_generate_matches_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let (case, m, _) = case_files(1, tmp.path());
    let dir = fixture_dir();
    let (ok, out, err) = clawrl(&[
        "generate",
        dir.to_str().unwrap(),
        "--messages",
        m.to_str().unwrap(),
        "--max-new-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["response_ids"], case["greedy_16"]);
    assert_eq!(v["finish_reason"], "length");
    assert!(v["text"].is_string());
    let got = v["logprobs"].as_array().unwrap();
    for (g, w) in got
        .iter()
        .zip(case["greedy_16_logprobs"].as_array().unwrap())
    {
        assert!((g.as_f64().unwrap() - w.as_f64().unwrap()).abs() < 1e-4);
    }
    // Seeded sampling is reproducible across processes.
    let args = [
        "generate",
        dir.to_str().unwrap(),
        "--messages",
        m.to_str().unwrap(),
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--json",
    ];
    let (a, b) = (clawrl(&args).1, clawrl(&args).1);
    assert_eq!(a, b);
}

#[test]
fn bad_inputs_fail_with_clear_messages() {
    let dir = fixture_dir();
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.json");
    let (ok, _, err) = clawrl(&[
        "model",
        "logits",
        dir.to_str().unwrap(),
        "--messages",
        missing.to_str().unwrap(),
        "--json",
    ]);
    assert!(!ok);
    assert!(err.contains("nope.json"), "{err}");
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, r#"{"role": "user"}"#).unwrap();
    let (ok, _, err) = clawrl(&[
        "generate",
        dir.to_str().unwrap(),
        "--messages",
        bad.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        err.contains("bad.json") && err.contains("list of messages"),
        "{err}"
    );
    let (ok, _, err) = clawrl(&["model", "inspect", tmp.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("config.json"), "{err}");
}

/// `check parity` on the CPU agrees with the fixture and says so in JSON; the same check on a
/// copy whose reference logits were moved fails, naming the case.
#[test]
fn check_parity_passes_on_the_fixture_and_fails_on_a_moved_reference() {
    let (ok, out, err) = clawrl(&["check", "parity", fixture_dir().to_str().unwrap()]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["pass"], true, "{v}");
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["model"]["cases"].as_array().unwrap().len(), 4);
    assert!(v["train"]["loss_rel_err"].as_f64().unwrap() < 1e-4, "{v}");

    let tmp = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture_dir()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, tmp.path().join(f.file_name().unwrap())).unwrap();
    }
    let path = tmp.path().join("expected.json");
    let mut exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let l = &mut exp["cases"][1]["last_logits"][7];
    *l = (l.as_f64().unwrap() + 0.5).into();
    std::fs::write(&path, exp.to_string()).unwrap();
    let (ok, out, _) = clawrl(&["check", "parity", tmp.path().to_str().unwrap()]);
    assert!(!ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["pass"], false);
    assert_eq!(v["model"]["cases"][0]["pass"], true);
    assert_eq!(v["model"]["cases"][1]["pass"], false, "{v}");
    assert_eq!(v["train"]["pass"], true);
}

/// `model init` writes a checkpoint of the given shape that loads and generates; it never
/// writes over an existing directory and refuses a tokenizer with more ids than the vocabulary.
#[test]
fn model_init_writes_a_loadable_random_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let config = fixture_dir().join("config.json");
    let out = dir.path().join("model");
    let init = |cfg: &Path, out: &Path| {
        clawrl(&[
            "model",
            "init",
            "--config",
            cfg.to_str().unwrap(),
            "--tokenizer",
            fixture_dir().to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--seed",
            "3",
        ])
    };
    let (ok, stdout, stderr) = init(&config, &out);
    assert!(ok, "{stderr}");
    let printed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let (ok, inspected, stderr) = clawrl(&["model", "inspect", out.to_str().unwrap(), "--json"]);
    assert!(ok, "{stderr}");
    let inspected: serde_json::Value = serde_json::from_str(&inspected).unwrap();
    assert_eq!(
        printed["parameters"], inspected["parameters"],
        "{inspected}"
    );
    assert_eq!(
        load_config(&out).unwrap(),
        load_config(&fixture_dir()).unwrap()
    );
    let (ok, _, stderr) = init(&config, &out);
    assert!(!ok && stderr.contains("exists"), "{stderr}");

    let mut small: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    small["vocab_size"] = 100.into();
    let small_cfg = dir.path().join("small.json");
    std::fs::write(&small_cfg, small.to_string()).unwrap();
    let (ok, _, stderr) = init(&small_cfg, &dir.path().join("small"));
    assert!(!ok && stderr.contains("vocab_size 100"), "{stderr}");
}

/// `check speed` reports the `generate` and `decode` workloads as one JSON line each, with a
/// rate per timed round.
#[test]
fn check_speed_reports_generation_and_decode_alone() {
    let dir = fixture_dir();
    for workload in ["generate", "decode"] {
        let (ok, out, err) = clawrl(&[
            "check",
            "speed",
            dir.to_str().unwrap(),
            "--workload",
            workload,
            "--batch",
            "2",
            "--prompt",
            "8",
            "--new-tokens",
            "6",
            "--rounds",
            "2",
        ]);
        assert!(ok, "{workload}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["workload"], workload);
        assert_eq!(v["rounds_tokens_per_s"].as_array().unwrap().len(), 2);
        assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    }
}
