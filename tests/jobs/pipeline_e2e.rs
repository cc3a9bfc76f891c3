//! A training job end to end in-process, for each per-turn method: the fixture policy on rollout
//! workers, the scripted environment, the scripted judge, a real trainer. Checks that versions go
//! up and replicas switch to them, the counts balance, every sample's version is recorded and
//! matches its turn's, and the records parse.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use clawrl::job::JobSpec;
use clawrl::model::LinearLayout;
use clawrl::pipeline::parts::LoadedPolicy;
use clawrl::pipeline::{run_job, RunOptions, RunReport};
use clawrl::serve::VersionWeights;
use serde_json::Value;

const TASKS: &str = r#"{"id": "greet", "instruction": "Say hello.", "replies": ["No, wrong. Hint: greet me by name, Ada.", "Thanks, great."]}
{"id": "count", "instruction": "Count to three.", "replies": ["Wrong. Hint: write the digits 1 2 3 only.", "Good, thanks."]}
{"id": "color", "instruction": "Name a color.", "replies": ["Great, thanks!", "Now another, thanks."]}
"#;

fn spec_text(method: &str) -> String {
    spec_with(method, "")
}

/// The spec of `method` with more `[method]` keys.
fn spec_with(method: &str, method_keys: &str) -> String {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");
    // Step-wise jobs: GRPO groups of 4 episodes of one task, and a judge whose votes are
    // flipped at random (per response), so that a group's step rewards differ.
    let (noise, group) = if method == "stepwise" {
        ("noise_rate = 0.3", "group_size = 4")
    } else {
        ("", "")
    };
    // No staleness: sessions that outrun the trainer could otherwise fill both batches with
    // turns of version 0, so the second step must train on turns of version 1 (stale ones are
    // dropped), which the checks below require whatever the machine's speed.
    let staleness = 0;
    format!(
        r#"
kind = "rl"
name = "e2e-{method}"
seed = 3
[policy]
checkpoint = "{fixture}"
replicas = 2
max_new_tokens = 8
max_context = 512
[judge]
backend = "scripted"
votes = 3
timeout_s = 30
rules = [
  {{ pattern = "(?i)\\b(wrong|no)\\b", score = -1 }},
  {{ pattern = "(?i)\\b(thanks|great|good)\\b", score = 1 }},
]
default_score = 0
hint = {{ pattern = "(?i)hint: (.*)" }}
{noise}
[method]
kind = "{method}"
{method_keys}
[optim]
batch_size = 4
lr = 1e-3
clip = 0.2
kl = 0.0
staleness = {staleness}
[env]
kind = "scripted"
parallelism = 3
tasks = "tasks.jsonl"
{group}
[stop]
max_steps = 2
"#
    )
}

struct Records {
    /// (kind, envelope version, record)
    lines: Vec<(String, u64, Value)>,
}

fn read_records(dir: &Path) -> Records {
    let mut lines = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no record files in {}", dir.display());
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let file_version: u64 = name
            .rsplit_once(".v")
            .and_then(|(_, v)| v.strip_suffix(".jsonl"))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("record file name {name}"));
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{name}: {e}"));
            let version = v["version"].as_u64().unwrap();
            assert_eq!(version, file_version, "a record in the wrong version file");
            lines.push((
                v["kind"].as_str().unwrap().to_string(),
                version,
                v["record"].clone(),
            ));
        }
    }
    Records { lines }
}

impl Records {
    fn of(&self, kind: &str) -> Vec<&(String, u64, Value)> {
        self.lines.iter().filter(|l| l.0 == kind).collect()
    }
}

async fn run(method: &str) -> (RunReport, Records) {
    run_spec(method, &spec_text(method)).await
}

async fn run_spec(method: &str, spec: &str) -> (RunReport, Records) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tasks.jsonl"), TASKS).unwrap();
    let file = dir.path().join("job.toml");
    std::fs::write(&file, spec).unwrap();
    let spec = JobSpec::load(&file).unwrap();
    let out = dir.path().join("run");
    let report = tokio::time::timeout(
        Duration::from_secs(240),
        run_job(
            &spec,
            &file.display().to_string(),
            RunOptions {
                out: out.clone(),
                job_id: format!("e2e-{method}"),
                progress: None,
                poll: Duration::from_millis(50),
            },
        ),
    )
    .await
    .expect("the job finishes")
    .unwrap();
    let records = read_records(&report.records_dir);
    // The tempdir goes away at the end of this function; everything needed is read.
    assert!(out.join("checkpoints").exists());
    (report, records)
}

fn check_common(method: &str, r: &RunReport, rec: &Records) {
    let t = &r.trainer;
    // Versions go up, exactly `stop.max_steps` of them, and every replica switched to trained
    // versions.
    assert_eq!((t.steps, t.version), (2, 2), "{method}: {t:?}");
    assert_eq!(r.counts.trainer.steps, t.steps);
    assert_eq!(r.replicas.len(), 2);
    for s in &r.replicas {
        assert!(s.switches >= 2, "{method}: replica never switched: {s:?}");
        assert!(s.version.unwrap() >= 1, "{method}: {s:?}");
        assert_eq!(s.failed, 0, "{method}: {s:?}");
    }
    // Counts balance.
    assert!(t.balanced(), "{method}: {t:?}");
    assert_eq!(t.rejected, 0, "{method}: {t:?}");
    assert!(t.produced > 0);
    assert_eq!(t.produced, r.counts.samples_submitted, "{method}");
    let c = &r.counts;
    assert_eq!(c.turns, c.judged + c.unjudged, "{method}: {c:?}");
    assert_eq!(c.sessions_failed, 0, "{method}: {c:?}");
    assert_eq!(c.records_failed, 0);
    assert_eq!(r.records.written, rec.lines.len() as u64);

    // Records: one turn and one judge record per turn, one sample record per sample.
    let turns = rec.of("turn");
    assert_eq!(turns.len() as u64, c.turns, "{method}");
    assert_eq!(rec.of("judge").len() as u64, c.turns, "{method}");
    let samples = rec.of("sample");
    assert_eq!(samples.len() as u64, t.produced, "{method}");
    assert!(rec.of("trainer_step").len() as u64 >= 1, "{method}");
    let turn_version: HashMap<(String, u64), u64> = turns
        .iter()
        .map(|(_, v, r)| {
            assert_eq!(r["version"].as_u64(), Some(*v));
            assert!(
                r["response_tokens"].as_u64().unwrap() > 0,
                "{method}: empty response"
            );
            (
                (
                    r["session_id"].as_str().unwrap().to_string(),
                    r["turn"].as_u64().unwrap(),
                ),
                *v,
            )
        })
        .collect();
    for (_, v, s) in &samples {
        let key = (
            s["session_id"].as_str().unwrap().to_string(),
            s["turn"].as_u64().unwrap(),
        );
        assert_eq!(
            turn_version.get(&key),
            Some(v),
            "{method}: a sample's version differs from its turn's"
        );
        assert!(*v <= t.version);
    }
    // Sessions used trained versions, not only the initial one.
    assert!(
        turns.iter().any(|(_, v, _)| *v >= 1),
        "{method}: no turn was generated on a trained version"
    );
    for (_, _, j) in rec.of("judge") {
        for key in [
            "session_id",
            "turn",
            "votes",
            "reward",
            "hint_accepted",
            "hint",
            "teacher_version",
        ] {
            assert!(
                j.get(key).is_some(),
                "{method}: judge record lacks {key}: {j}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn binary_job_runs_end_to_end() {
    let (r, rec) = run("binary").await;
    check_common("binary", &r, &rec);
    for (_, _, s) in rec.of("sample") {
        let a = s["advantage_mean"].as_f64().unwrap();
        assert!([-1.0, 0.0, 1.0].contains(&a), "binary advantage {a}");
        assert_eq!(s["opd"], false, "{s}");
    }
    for (_, _, j) in rec.of("judge") {
        assert_eq!(j["hint_accepted"], false, "binary takes no hint votes: {j}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn opd_job_runs_end_to_end() {
    let (r, rec) = run("opd").await;
    check_common("opd", &r, &rec);
    let judged = rec.of("judge");
    let with_hint: Vec<_> = judged
        .iter()
        .filter(|(_, _, j)| j["hint_accepted"] == true)
        .collect();
    assert!(!with_hint.is_empty(), "no hint was accepted");
    // Only turns with an accepted hint give OPD samples, each scored by a teacher version.
    assert_eq!(rec.of("sample").len(), with_hint.len());
    // Each carries the teacher's log-probs for the trainer; its own advantage part is 0.
    for (_, _, s) in rec.of("sample") {
        assert_eq!(s["opd"], true, "{s}");
        assert_eq!(s["advantage_mean"], 0.0, "{s}");
    }
    for (_, _, j) in with_hint {
        assert!(j["teacher_version"].as_u64().is_some(), "{j}");
        assert!(j["hint"].as_str().unwrap().len() > 10);
    }
}

/// A recorded rollout-vs-old gap: mean and max |Δ| (max ≥ mean ≥ 0) over some tokens.
pub(crate) fn check_gap(gap: &Value, what: &str) {
    let (mean_abs, max_abs) = (gap["mean_abs"].as_f64(), gap["max_abs"].as_f64());
    assert!(
        matches!((mean_abs, max_abs), (Some(m), Some(x)) if m >= 0.0 && x >= m),
        "{what}: gap {gap}"
    );
    assert!(gap["mean"].as_f64().is_some(), "{what}: gap {gap}");
    assert!(gap["tokens"].as_u64().unwrap_or(0) > 0, "{what}: gap {gap}");
}

/// Every trainer step record says which OPD loss the learner applied, that `π_old` was its own
/// recomputation, and the rollout-vs-old gap (mean and max |Δ|); the job's trainer counters
/// carry the gap over all steps. Returns the step records.
fn check_step_records<'a>(
    method: &str,
    opd_loss: &str,
    r: &RunReport,
    rec: &'a Records,
) -> Vec<&'a Value> {
    let steps: Vec<&Value> = rec.of("trainer_step").into_iter().map(|l| &l.2).collect();
    for s in &steps {
        assert_eq!(s["opd_loss"], opd_loss, "{method}: {s}");
        assert_eq!(s["old_recomputed"], true, "{method}: {s}");
        check_gap(&s["logprob_gap"], &format!("{method}: {s}"));
    }
    let job_gap = r.trainer.logprob_gap.expect("the job's gap");
    let tokens: u64 = steps
        .iter()
        .map(|s| s["logprob_gap"]["tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(job_gap.tokens as u64, tokens, "{method}");
    let max = steps
        .iter()
        .map(|s| s["logprob_gap"]["max_abs"].as_f64().unwrap())
        .fold(0.0, f64::max);
    // The step records are read back from JSON text, and serde_json's default float parser
    // may land one ulp off the value written (it is exact only with `float_roundtrip`).
    assert!(
        (job_gap.max_abs - max).abs() <= 1e-12 * max.abs(),
        "{method}: {} vs {max}",
        job_gap.max_abs
    );
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn combined_job_runs_end_to_end() {
    let (r, rec) = run("combined").await;
    check_common("combined", &r, &rec);
    check_step_records("combined", "advantage", &r, &rec);
    // Four cases: a sample for every turn with a hint or a non-zero reward.
    let expected = rec
        .of("judge")
        .iter()
        .filter(|(_, _, j)| j["hint_accepted"] == true || j["reward"].as_i64() != Some(0))
        .count();
    assert_eq!(rec.of("sample").len(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stepwise_job_runs_end_to_end() {
    let (r, rec) = run("stepwise").await;
    check_common("stepwise", &r, &rec);
    // Every sample names its GRPO group and step; within each (group, step) bucket of two or
    // more samples the advantages have mean 0 and population standard deviation 1 (a bucket of
    // one keeps its raw reward, or is the one kept of buckets without variance).
    let mut buckets: HashMap<(u64, u64), Vec<f64>> = HashMap::new();
    for (_, _, s) in rec.of("sample") {
        let a = s["advantage_mean"].as_f64().unwrap();
        assert!(a.is_finite(), "{s}");
        let group = s["group"]
            .as_u64()
            .unwrap_or_else(|| panic!("no group: {s}"));
        let step = s["step"].as_u64().unwrap_or_else(|| panic!("no step: {s}"));
        assert_eq!(s["step"], s["turn"], "{s}");
        buckets.entry((group, step)).or_default().push(a);
    }
    let mut checked = 0;
    for (key, a) in &buckets {
        if a.len() < 2 {
            continue;
        }
        let n = a.len() as f64;
        let mean = a.iter().sum::<f64>() / n;
        let std = (a.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(
            mean.abs() < 1e-4 && (std - 1.0).abs() < 1e-4,
            "bucket {key:?}: mean {mean}, population std {std}: {a:?}"
        );
        checked += 1;
    }
    assert!(
        checked >= 1,
        "no bucket of two or more samples: {buckets:?}"
    );
    // Groups are counted: whole ones built (the stop may leave some short), none dropped.
    let g = r
        .counts
        .groups
        .as_ref()
        .expect("a step-wise job has groups");
    assert_eq!(g.size, 4, "{g:?}");
    assert!(g.built >= 1, "{g:?}");
    assert_eq!((g.dropped, g.episodes_discarded), (0, 0), "{g:?}");
    assert_eq!(
        r.counts.episodes_built,
        rec.of("turn")
            .iter()
            .map(|(_, _, t)| t["session_id"].as_str().unwrap())
            .collect::<std::collections::HashSet<_>>()
            .len() as u64,
        "every episode is built in its group"
    );
    for (_, _, j) in rec.of("judge") {
        assert_eq!(j["hint_accepted"], false);
    }
}

/// `method.opd_loss = "topk"`: the teacher's top-k travels with each OPD sample and the trainer
/// applies the top-k loss beside the binary term's; the step records say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn combined_job_with_the_topk_loss_trains() {
    let spec = spec_with("combined", "opd_loss = \"topk\"\ntopk = 8");
    let (r, rec) = run_spec("combined", &spec).await;
    check_common("combined-topk", &r, &rec);
    let steps = check_step_records("combined-topk", "topk", &r, &rec);
    assert!(
        steps.iter().any(|s| s["opd_samples"].as_u64().unwrap() > 0),
        "no step trained an OPD sample: {steps:?}"
    );
    assert!(rec.of("sample").iter().any(|(_, _, s)| s["opd"] == true));
}

/// A `method.topk` beyond the policy's vocabulary is refused when the checkpoint is loaded,
/// naming the key, before any session starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_topk_beyond_the_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tasks.jsonl"), TASKS).unwrap();
    let file = dir.path().join("job.toml");
    std::fs::write(&file, spec_with("opd", "opd_loss = \"topk\"\ntopk = 513")).unwrap();
    let spec = JobSpec::load(&file).unwrap();
    let e = run_job(
        &spec,
        &file.display().to_string(),
        RunOptions {
            out: dir.path().join("run"),
            job_id: "e2e-topk-vocab".into(),
            progress: None,
            poll: Duration::from_millis(50),
        },
    )
    .await
    .expect_err("refused")
    .to_string();
    assert!(
        e.contains("method.topk") && e.contains("513") && e.contains("512"),
        "{e}"
    );
}

/// With `policy.lora` a local job trains a fresh adapter: its rollout workers and its OPD
/// teacher (the current policy, combined method) attach each published adapter to the base they
/// hold, switching versions as a whole-weights job does, and every version is the adapter alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lora_job_serves_and_scores_adapter_versions() {
    let lora = r#"lora = { r = 4, alpha = 8, targets = ["q_proj", "k_proj", "gate_proj"] }"#;
    let spec = spec_text("combined").replacen(
        "max_context = 512\n",
        &format!("max_context = 512\n{lora}\n"),
        1,
    );
    assert!(spec.contains(lora));

    // The job's engine decodes from the learner's frozen base, kept as decoding wants it, and
    // the learner's whole-weights counterpart keeps `[in, out]`, which its optimizer needs.
    let parsed = JobSpec::parse(&spec, "job.toml").unwrap();
    let policy = LoadedPolicy::<clawrl::CpuAutodiff>::load(&parsed, Default::default()).unwrap();
    let VersionWeights::Adapter { base, .. } = policy.version_weights() else {
        panic!("a LoRA job's versions are adapters");
    };
    let decoding = LinearLayout::decoding::<clawrl::CpuBackend>();
    assert_eq!(base.linear_layout(), decoding);
    assert_eq!(policy.serving_model().linear_layout(), decoding);
    // The OPD teacher of a job whose learner is on the CPU reads the same base tensors, not
    // a copy of its own.
    let VersionWeights::Adapter { base: teacher, .. } = policy.cpu_version_weights().unwrap()
    else {
        panic!("a LoRA job's teacher reads adapters");
    };
    let first_weight = |m: &clawrl::model::Qwen3<clawrl::CpuBackend>| {
        let w = m.layers[0].self_attn.q_proj.val();
        w.into_primitive().tensor().bytes().as_ptr()
    };
    assert_eq!(first_weight(&teacher), first_weight(&base));
    let whole = JobSpec::parse(&spec_text("combined"), "job.toml").unwrap();
    let whole = LoadedPolicy::<clawrl::CpuAutodiff>::load(&whole, Default::default()).unwrap();
    assert_eq!(whole.serving_model().linear_layout(), LinearLayout::InOut);

    let (r, rec) = run_spec("combined", &spec).await;
    check_common("combined", &r, &rec);
    assert_eq!(r.trainer.failed_attempts, 0, "{:?}", r.trainer);
    let bytes = r.trainer.published_bytes.expect("versions were published");
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");
    let (cfg, model) = clawrl::model::load_model::<clawrl::CpuBackend>(
        std::path::Path::new(fixture),
        &Default::default(),
    )
    .unwrap();
    let whole = clawrl::model::model_to_safetensors(&model, &cfg)
        .unwrap()
        .len() as u64;
    assert!(bytes * 20 < whole, "a version of {bytes} bytes vs {whole}");
    // The teacher scored on the trained versions too: OPD samples were built after version 1.
    assert!(
        rec.of("judge")
            .iter()
            .any(|(_, _, j)| j["teacher_version"].as_u64().unwrap_or(0) >= 1),
        "no turn was scored by a trained teacher version"
    );
}
