//! Device selection through the built binary: `--device` on `model logits`, `generate` and
//! `train-offline`, the `device` key of TRAIN.toml, refusal of unknown device names, and a clear
//! error (never a panic) when CUDA is asked of a binary or machine that cannot provide it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const DIR: &str = "tests/fixtures/qwen3-tiny";

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn messages(dir: &Path) -> PathBuf {
    let p = dir.join("messages.json");
    std::fs::write(&p, r#"[{"role":"user","content":"Say hi."}]"#).unwrap();
    p
}

/// Two short samples, one per line.
fn samples(dir: &Path) -> PathBuf {
    let p = dir.join("s.jsonl");
    let line = |a: f64| {
        serde_json::json!({"prompt_ids": [1, 91, 89], "response_ids": [149, 314],
                           "advantages": [a, a]})
        .to_string()
    };
    std::fs::write(&p, format!("{}\n{}\n", line(1.0), line(-0.5))).unwrap();
    p
}

fn train(dir: &Path, config: Option<&Path>, extra: &[&str]) -> Output {
    let s = samples(dir);
    let out = dir.join("out");
    let mut args = vec![
        "train-offline",
        "--model",
        DIR,
        "--samples",
        s.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ];
    if let Some(c) = config {
        args.extend(["--config", c.to_str().unwrap()]);
    }
    args.extend(extra);
    run(&args)
}

#[test]
fn cpu_is_the_default_device() {
    let tmp = tempfile::tempdir().unwrap();
    let m = messages(tmp.path());
    let args = [
        "model",
        "logits",
        DIR,
        "--messages",
        m.to_str().unwrap(),
        "--json",
    ];
    let default = run(&args);
    assert!(default.status.success(), "{}", stderr(&default));
    let cpu = run(&[&args[..], &["--device", "cpu"]].concat());
    assert!(cpu.status.success(), "{}", stderr(&cpu));
    assert_eq!(default.stdout, cpu.stdout);
    assert!(!default.stdout.is_empty());
}

#[test]
fn unknown_device_names_are_refused_naming_value_and_forms() {
    let tmp = tempfile::tempdir().unwrap();
    let m = messages(tmp.path());
    let m = m.to_str().unwrap();
    for (cmd, value) in [
        (vec!["generate", DIR, "--messages", m], "gpu"),
        (vec!["model", "logits", DIR, "--messages", m], "cuda:x"),
        (vec!["model", "logits", DIR, "--messages", m], "cuda"),
    ] {
        let o = run(&[&cmd[..], &["--device", value]].concat());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{value}: {err}");
        assert!(err.contains(&format!("`{value}`")), "{value}: {err}");
        assert!(err.contains("`cpu` or `cuda:N`"), "{value}: {err}");
    }
    let o = train(tmp.path(), None, &["--device", "gpu"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("`gpu`"), "{}", stderr(&o));
}

#[test]
fn train_toml_device_key_is_read_and_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("TRAIN.toml");
    // A key after `device` is still read: batch_size 1 gives one step per sample.
    std::fs::write(&cfg, "lr = 1e-4\ndevice = \"cpu\" # here\nbatch_size = 1\n").unwrap();
    let o = train(tmp.path(), Some(&cfg), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8(o.stdout).unwrap().lines().count(), 2);

    std::fs::write(&cfg, "device = \"gpu\"\n").unwrap();
    let o = train(tmp.path(), Some(&cfg), &[]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(err.contains("TRAIN.toml") && err.contains("`gpu`"), "{err}");
    assert!(err.contains("`cpu` or `cuda:N`"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A binary built without the `cuda` feature names the missing feature and the build command,
/// for every command and for the TRAIN.toml key, and `--device cpu` overrides the key.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let m = messages(tmp.path());
    let m = m.to_str().unwrap();
    let check = |o: &Output, what: &str| {
        let err = stderr(o);
        assert!(!o.status.success(), "{what}: succeeded");
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains("`cuda:0`"), "{what}: {err}");
        assert!(err.contains("built without CUDA support"), "{what}: {err}");
        assert!(
            err.contains("cargo build --release --features cuda"),
            "{what}: {err}"
        );
        assert!(!err.contains("panicked"), "{what}: {err}");
    };
    let cuda = ["--device", "cuda:0"];
    check(
        &run(&[&["model", "logits", DIR, "--messages", m][..], &cuda].concat()),
        "logits",
    );
    check(
        &run(&[&["generate", DIR, "--messages", m][..], &cuda].concat()),
        "generate",
    );
    check(&train(tmp.path(), None, &cuda), "train-offline");

    let cfg = tmp.path().join("TRAIN.toml");
    std::fs::write(&cfg, "device = \"cuda:0\"\nbatch_size = 1\n").unwrap();
    check(&train(tmp.path(), Some(&cfg), &[]), "TRAIN.toml device");
    let o = train(tmp.path(), Some(&cfg), &["--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8(o.stdout).unwrap().lines().count(), 2);
}

/// A binary built with the `cuda` feature either runs on the GPU or, where there is no usable
/// driver or GPU, ends with the probe's error instead of a panic.
#[cfg(feature = "cuda")]
#[test]
fn cuda_runs_or_fails_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let m = messages(tmp.path());
    let o = run(&[
        "model",
        "logits",
        DIR,
        "--messages",
        m.to_str().unwrap(),
        "--json",
        "--device",
        "cuda:0",
    ]);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    if !o.status.success() {
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("no usable CUDA device `cuda:0`"), "{err}");
    }
}
