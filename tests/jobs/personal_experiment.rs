//! The personal-agent experiment end to end, through the real path: a shortened run (small warm
//! start, few updates) by the built binary, each method a `personal` job whose gateway the
//! simulated users talk to over HTTP; its turns are judged and trained on, new versions are
//! served, every method gets scores and combined improves over the warm start. The full run of
//! `examples/personal.toml` is `--ignored` (it takes minutes).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::personal_run;

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/personal.toml")
}

/// `examples/personal.toml` as a TOML table.
fn example() -> toml::Table {
    toml::from_str(&std::fs::read_to_string(example_path()).unwrap()).unwrap()
}

fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("personal-sft-cache")
}

/// `clawrl ARGS`, which must succeed and print one JSON value.
fn clawrl_json(args: &[&std::ffi::OsStr]) -> Value {
    let done = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_LOG", "warn")
        .args(args)
        .output()
        .expect("starting clawrl");
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "clawrl {args:?} failed: {stderr}");
    let stdout = String::from_utf8_lossy(&done.stdout);
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout}\n{stderr}"))
}

/// `clawrl sft` of the shortened warm start ([`personal_run::shortened_example`]'s `[sft]`, the
/// one [`personal_run::run_experiment`] asks for), cached under [`cache`]: its outcome.
fn sft() -> Value {
    let cache = cache();
    // Written once per test process: tests call this at once, and none may read it half written.
    static FILE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let file = FILE.get_or_init(|| {
        let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("personal-shortened.toml");
        let t = personal_run::shortened_example(&cache, 1);
        std::fs::write(&file, toml::to_string(&t).unwrap()).unwrap();
        file
    });
    clawrl_json(&[
        "sft".as_ref(),
        "--config".as_ref(),
        file.as_os_str(),
        "--cache-dir".as_ref(),
        cache.as_os_str(),
    ])
}

/// Trains (or finds) the shortened warm start once, whichever test asks first.
fn warm() -> Value {
    static ONCE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONCE.lock().unwrap_or_else(|e| e.into_inner());
    sft()
}

#[test]
#[ignore = "the full experiment takes minutes; run with --ignored"]
fn full_run_of_the_example() {
    let mut t: toml::Table = match std::env::var("PERSONAL_TOML") {
        Ok(p) => toml::from_str(&std::fs::read_to_string(p).unwrap()).unwrap(),
        Err(_) => example(),
    };
    if let Some(lr) = std::env::var("PERSONAL_LR")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
    {
        t["experiment"]
            .as_table_mut()
            .unwrap()
            .insert("lr".into(), lr.into());
    }
    if let Ok(dir) = std::env::var("PERSONAL_CACHE") {
        t.insert("cache_dir".into(), dir.into());
    }
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("experiment.toml");
    std::fs::write(&file, toml::to_string(&t).unwrap()).unwrap();
    let run = out.path().join("run");
    let report = clawrl_json(&[
        "run".as_ref(),
        "--json".as_ref(),
        "--out".as_ref(),
        run.as_os_str(),
        file.as_os_str(),
    ]);
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}

#[test]
fn warm_start_is_a_cached_hf_checkpoint() {
    let first = warm();
    let again = sft();
    assert_eq!(
        again["cached"], true,
        "the second warm start reuses the cache"
    );
    assert_eq!(first["dir"], again["dir"]);
    let dir = PathBuf::from(first["dir"].as_str().unwrap());
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(dir.join(file).exists(), "{file} is written");
    }
    let ck =
        clawrl::model::load_checkpoint::<clawrl::CpuBackend>(&dir, &Default::default()).unwrap();
    let sft = &personal_run::shortened_example(&cache(), 1)["sft"];
    assert_eq!(
        ck.config.num_hidden_layers as i64,
        sft["layers"].as_integer().unwrap()
    );
    assert_eq!(
        ck.config.hidden_size as i64,
        sft["hidden"].as_integer().unwrap()
    );
    assert_eq!(ck.stop_token_ids(), vec![2]);
}

#[test]
fn shortened_run_goes_through_the_gateway_judge_and_trainer_and_combined_improves() {
    const UPDATES: u64 = 4;
    warm();
    let dir = tempfile::tempdir().unwrap();
    let report = personal_run::run_experiment(dir.path(), &cache(), UPDATES as i64);
    let out = dir.path().join("run");
    let text = std::fs::read_to_string(out.join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["updates"], serde_json::json!([0, UPDATES]));
    for m in ["binary", "opd", "combined"] {
        let s = v["scores"][m].as_array().unwrap();
        assert_eq!(s.len(), 2, "{m}");
        assert!(s.iter().all(|x| (0.0..=1.0).contains(&x.as_f64().unwrap())));
        // Every method's job starts from the same warm start, measured with the same seeds.
        assert_eq!(s[0], v["scores"]["binary"][0]);
    }
    let png = std::fs::read(out.join("scores.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    let batch = example()["experiment"]["batch_size"].as_integer().unwrap() as u64;
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    for r in runs {
        let m = r["method"].as_str().unwrap();
        let job = &r["job"];
        let c = &job["counts"];
        let n = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("{m}: {v}"));
        // The users' turns went through the gateway (recorded there, with next states) ...
        assert!(n(&c["turns"]) >= UPDATES * batch / 2, "{m}: {c}");
        assert_eq!(n(&job["turns_with_next_state"]), n(&c["turns"]), "{m}");
        let turn_files = std::fs::read_dir(out.join(m).join("turns"))
            .unwrap()
            .count();
        assert!(turn_files > 0, "{m}: no turn files");
        // ... were judged by the job's voters ...
        assert_eq!(
            n(&c["judged"]) + n(&c["unjudged"]),
            n(&c["turns"]),
            "{m}: {c}"
        );
        assert!(n(&c["judged"]) > 0, "{m}");
        // ... and trained on by its trainer, exactly to the measured version.
        let t = &job["agents"][0]["trainer"];
        assert_eq!(n(&t["steps"]), UPDATES, "{m}: {t}");
        assert_eq!(n(&t["trained"]), UPDATES * batch, "{m}: {t}");
        assert_eq!(
            r["updates"].as_array().unwrap().len() as u64,
            UPDATES,
            "{m}"
        );
        // New versions were installed while the users talked: at least two served them.
        let served = r["served_by_version"].as_object().unwrap();
        assert!(served.len() >= 2, "{m}: served by {served:?}");
        assert!(n(&job["agents"][0]["gateway"]["version"]) >= UPDATES, "{m}");
        // The measurements were answered by exactly the versions they name.
        let ms: Vec<u64> = r["measurements"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| n(&x["updates"]))
            .collect();
        assert_eq!(ms, vec![0, UPDATES], "{m}");
        // The job's TensorBoard run has an event file.
        let tb: Vec<_> = std::fs::read_dir(out.join(m).join("tb"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(
            tb.iter().any(|p| p.to_str().unwrap().contains("tfevents")),
            "{m}: {tb:?}"
        );
    }
    let c = &v["scores"]["combined"];
    println!("{}", serde_json::to_string(&v).unwrap());
    assert!(
        c[1].as_f64() > c[0].as_f64(),
        "combined improves over the warm start: {c}"
    );
}

#[test]
fn two_seeds_report_mean_std_and_each_seeds_scores_and_counts() {
    const UPDATES: i64 = 2;
    warm();
    let dir = tempfile::tempdir().unwrap();
    let report =
        personal_run::run_experiment_with(dir.path(), &cache(), UPDATES, &["--seeds", "5,6"]);
    let out = dir.path().join("run");
    let text = std::fs::read_to_string(out.join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["updates"], serde_json::json!([0, UPDATES]));
    assert_eq!(v["seeds"], serde_json::json!([5, 6]));
    for m in ["binary", "opd", "combined"] {
        let mean = v["scores"][m].as_array().unwrap();
        let std = v["std"][m].as_array().unwrap();
        assert_eq!((mean.len(), std.len()), (2, 2), "{m}");
        let per = |s: &str| -> Vec<f64> {
            v["per_seed"][m][s]
                .as_array()
                .unwrap_or_else(|| panic!("{m} seed {s}: {v}"))
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        let (a, b) = (per("5"), per("6"));
        for i in 0..2 {
            let want = (a[i] + b[i]) / 2.0;
            assert!((mean[i].as_f64().unwrap() - want).abs() < 1e-9, "{m}: {v}");
            // The sample std of two values is |a − b| / √2.
            let sd = (a[i] - b[i]).abs() / 2f64.sqrt();
            assert!((std[i].as_f64().unwrap() - sd).abs() < 1e-9, "{m}: {v}");
        }
    }
    let png = std::fs::read(out.join("scores.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    // Each seed ran every method to the measured version, its counts kept per update.
    for s in ["5", "6"] {
        let runs = report["per_seed"][s]["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 3, "seed {s}");
        for r in runs {
            assert_eq!(r["updates"].as_array().unwrap().len() as i64, UPDATES);
            assert_eq!(
                r["job"]["agents"][0]["trainer"]["steps"].as_i64(),
                Some(UPDATES)
            );
        }
        assert!(out.join(format!("seed-{s}/results.json")).exists());
    }
}
