//! The personal-agent experiment end to end: a shortened run (small warm start, few updates)
//! computes scores for every method, and combined improves over the warm start. The full run of
//! `examples/personal.toml` is `--ignored` (it takes minutes).

use std::path::{Path, PathBuf};

use clawrl::personal::experiment::{run, ExperimentFile};

fn example() -> ExperimentFile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/personal.toml");
    ExperimentFile::from_file(&path).expect("examples/personal.toml is valid")
}

fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("personal-sft-cache")
}

/// Trains (or finds) the shortened warm start once, whichever test asks first.
fn warm(f: &ExperimentFile) -> clawrl::personal::sft::SftOutcome {
    static ONCE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONCE.lock().unwrap_or_else(|e| e.into_inner());
    clawrl::personal::sft::warm_start(&f.sft, &cache(), false).unwrap()
}

#[test]
#[ignore = "the full experiment takes minutes; run with --ignored"]
fn full_run_of_the_example() {
    let mut f = match std::env::var("PERSONAL_TOML") {
        Ok(p) => ExperimentFile::from_file(Path::new(&p)).unwrap(),
        Err(_) => example(),
    };
    if let Some(lr) = std::env::var("PERSONAL_LR")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        f.experiment.lr = lr;
    }
    if let Ok(dir) = std::env::var("PERSONAL_CACHE") {
        f.cache_dir = Some(dir.into());
    }
    let out = tempfile::tempdir().unwrap();
    let report = run(&f, out.path()).unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}

/// The shortened experiment: a smaller warm start, 4 updates, measured at 0 and 4.
fn short() -> ExperimentFile {
    let mut f = example();
    f.cache_dir = Some(cache());
    f.sft.steps = 300;
    f.experiment.updates = 4;
    f.experiment.eval_at = vec![0, 4];
    f.experiment.eval_tasks_per_user = 16;
    f.experiment.train_tasks_per_user = 32;
    f.experiment.max_rounds = 3;
    f
}

#[test]
fn warm_start_is_a_cached_hf_checkpoint() {
    use clawrl::personal::sft::warm_start;
    let f = short();
    let first = warm(&f);
    let again = warm_start(&f.sft, &cache(), false).unwrap();
    assert!(again.cached, "the second warm start reuses the cache");
    assert_eq!(first.dir, again.dir);
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(first.dir.join(file).exists(), "{file} is written");
    }
    let ck = clawrl::model::load_checkpoint::<clawrl::CpuBackend>(&first.dir, &Default::default())
        .unwrap();
    assert_eq!(ck.config.num_hidden_layers, f.sft.layers);
    assert_eq!(ck.stop_token_ids(), vec![2]);
    // Other settings are another cache entry.
    let mut other = f.sft.clone();
    other.seed += 1;
    assert_ne!(other.cache_key(), f.sft.cache_key());
}

#[test]
fn shortened_run_computes_scores_and_combined_improves() {
    let f = short();
    warm(&f);
    let out = tempfile::tempdir().unwrap();
    let report = run(&f, out.path()).unwrap();
    let text = std::fs::read_to_string(out.path().join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["updates"], serde_json::json!([0, 4]));
    for m in ["binary", "opd", "combined"] {
        let s = v["scores"][m].as_array().unwrap();
        assert_eq!(s.len(), 2, "{m}");
        assert!(s.iter().all(|x| (0.0..=1.0).contains(&x.as_f64().unwrap())));
        // Every method starts from the same warm start, measured with the same seeds.
        assert_eq!(s[0], v["scores"]["binary"][0]);
    }
    let png = std::fs::read(out.path().join("scores.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    let c = &report.results.scores["combined"];
    println!("{}", serde_json::to_string(&report.results).unwrap());
    assert!(c[1] > c[0], "combined improves over the warm start: {c:?}");
    for r in &report.runs {
        assert_eq!(r.updates.len(), 4);
        assert!(r.updates.iter().all(|u| u.trained > 0), "{:?}", r.method);
    }
    // Each method's TensorBoard run: one event file, its version record and then at least the
    // ten scalars of each of the 4 steps, every record's CRCs checked.
    for m in ["binary", "opd", "combined"] {
        let files: Vec<_> = std::fs::read_dir(out.path().join("tb").join(m))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{m}: {files:?}");
        assert!(files[0].to_str().unwrap().contains("tfevents"), "{files:?}");
        let bytes = std::fs::read(&files[0]).unwrap();
        let records = clawrl::watch::events::tfrecords(&bytes).unwrap().len();
        assert!(records > 4 * 10, "{m}: {records} records");
    }
}
