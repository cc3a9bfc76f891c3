//! Faults of a job, in-process: a rollout worker that dies is routed around (sessions keep
//! getting turns from the others), and a job restarted on the same run directory resumes its
//! trainer from the last checkpoint with the version counting on, the replicas switching to the
//! resumed lineage.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use clawrl::job::JobSpec;
use clawrl::model::{load_checkpoint, EngineOptions, SamplingParams};
use clawrl::pipeline::policy::ChatPolicy;
use clawrl::pipeline::{run_job, RunOptions, RunReport};
use clawrl::serve::EnginePolicy;
use clawrl::CpuBackend;
use clawrl_actors::loops::{Observation, PolicyReplica, RolloutArgs, RolloutWorker, TurnPolicy};
use ractor::Actor;
use serde_json::json;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_rollout_worker_is_routed_around() {
    let ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    let bytes = std::fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap();
    let tokenizer = Arc::new(ck.tokenizer);
    let mut workers = Vec::new();
    for _ in 0..2 {
        let p = EnginePolicy::<CpuBackend>::new(
            ck.config.clone(),
            Some(tokenizer.clone()),
            EngineOptions::default(),
            Default::default(),
        );
        let loaded = Arc::new(p.load(0, &bytes.clone().into()).unwrap());
        let (w, _) = Actor::spawn(
            None,
            RolloutWorker::new(),
            RolloutArgs {
                policy: Arc::new(p),
                source: None,
                initial: Some((0, loaded)),
            },
        )
        .await
        .unwrap();
        workers.push(w);
    }
    let policy = ChatPolicy::new(
        workers.clone(),
        Arc::new(ck.chat_template),
        tokenizer,
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 6,
            stop_token_ids: vec![2],
            stop_strings: vec![],
            seed: 1,
        },
        512,
        Duration::from_secs(30),
    );
    let obs = Observation {
        messages: vec![json!({"role": "user", "content": "hello"})],
        tools: vec![],
        template_kwargs: Default::default(),
    };
    let before = policy.act(&obs).await.unwrap();
    assert!(!before.response_ids.is_empty());
    assert_eq!(before.logprobs.len(), before.response_ids.len());
    // The prompt ids are the template's rendering, exactly.
    assert!(before.prompt_text.ends_with("<|im_start|>assistant\n"));
    workers[0].kill();
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..4 {
        let t = policy.act(&obs).await.expect("the live worker answers");
        assert_eq!(t.version, 0);
        assert!(!t.response_ids.is_empty());
    }
    workers[1].kill();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let e = policy.act(&obs).await.unwrap_err();
    assert!(e.to_string().contains("no rollout worker answered"), "{e}");
}

fn spec_text(max_steps: u64) -> String {
    format!(
        r#"
kind = "rl"
seed = 5
[policy]
checkpoint = "{FIXTURE}"
replicas = 2
max_new_tokens = 6
max_context = 512
[judge]
backend = "scripted"
votes = 1
rules = [{{ pattern = "(?i)wrong", score = -1 }}, {{ pattern = "(?i)thanks", score = 1 }}]
[method]
kind = "binary"
[optim]
batch_size = 4
lr = 1e-3
clip = 0.2
kl = 0.0
staleness = 8
[env]
kind = "scripted"
parallelism = 2
tasks = "tasks.jsonl"
[stop]
max_steps = {max_steps}
"#
    )
}

async fn run(dir: &Path, id: &str) -> RunReport {
    let file = dir.join("job.toml");
    let spec = JobSpec::load(&file).unwrap();
    tokio::time::timeout(
        Duration::from_secs(240),
        run_job(
            &spec,
            &file.display().to_string(),
            RunOptions {
                out: dir.join("run"),
                job_id: id.into(),
                progress: None,
                poll: Duration::from_millis(50),
            },
        ),
    )
    .await
    .expect("the job finishes")
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_job_resumes_from_its_checkpoint_and_versions_count_on() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tasks.jsonl"),
        "{\"id\":\"a\",\"instruction\":\"hi\",\"replies\":[\"wrong\",\"thanks\"]}\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("job.toml"), spec_text(2)).unwrap();
    let first = run(dir.path(), "r1").await;
    assert!(first.final_checkpoint.is_some());
    assert_eq!(first.trainer.resumed_from, None);
    let v1 = first.trainer.version;
    assert!(v1 >= 2);

    // "The trainer died": a new job on the same run directory (the stop bound counts the
    // trainer's steps, resumed ones included).
    std::fs::write(
        dir.path().join("job.toml"),
        spec_text(first.trainer.steps + 2),
    )
    .unwrap();
    let second = run(dir.path(), "r2").await;
    assert_eq!(
        second.trainer.resumed_from,
        Some(v1),
        "{:?}",
        second.trainer
    );
    assert!(second.trainer.version > v1, "{:?}", second.trainer);
    assert!(second.trainer.balanced());
    // Replicas switched to the resumed lineage: every turn of the second job is at v1 or later.
    for s in &second.replicas {
        assert!(s.version.unwrap() >= v1, "{s:?}");
    }
    let dirs = std::fs::read_dir(&second.records_dir).unwrap();
    let mut seen = 0;
    for f in dirs {
        let f = f.unwrap().path();
        if !f.file_name().unwrap().to_string_lossy().starts_with("r2.") {
            continue;
        }
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if v["kind"] == "turn" {
                assert!(v["version"].as_u64().unwrap() >= v1, "{v}");
                seen += 1;
            }
        }
    }
    assert!(seen > 0);
}
