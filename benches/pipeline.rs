//! Pipeline throughput: turns per second of a whole job — scripted environment,
//! scripted judge (3 votes), the fixture policy on rollout workers, a real trainer stepping
//! meanwhile — with 1 replica and with 4, and the scaling ratio; each with admission control off
//! (sessions run freely) and at its default bound (two batches, `env.max_backlog`), with the
//! fraction of samples dropped as stale and the samples trained per second. Not a test: it
//! prints figures.
//!
//! `cargo bench --bench pipeline` (env `PIPELINE_TURNS`, default 600; `PIPELINE_SESSIONS`,
//! default 32; `PIPELINE_SHAPE`: a checkpoint directory instead of the fixture model;
//! `PIPELINE_BACKLOG`: `off`, `default` or a number of samples, to run only that mode).

use std::time::Duration;

use clawrl::job::JobSpec;
use clawrl::pipeline::{run_job, RunOptions, RunReport};

const TASKS: &str = r#"{"id": "a", "instruction": "Say hello.", "replies": ["No, wrong.", "Thanks, great.", "Good."]}
{"id": "b", "instruction": "Count to three.", "replies": ["Wrong.", "Good, thanks.", "No."]}
{"id": "c", "instruction": "Name a color.", "replies": ["Great, thanks!", "Wrong again.", "Thanks."]}
"#;

fn spec(checkpoint: &str, replicas: u32, sessions: u32, turns: u64, backlog: &str) -> String {
    let backlog = match backlog {
        "default" => String::new(),
        "off" => "max_backlog = \"off\"".to_string(),
        n => format!("max_backlog = {n}"),
    };
    format!(
        r#"
kind = "rl"
name = "bench"
[policy]
checkpoint = "{checkpoint}"
replicas = {replicas}
max_new_tokens = 16
max_context = 512
max_batch = 16
[judge]
backend = "scripted"
votes = 3
rules = [
  {{ pattern = "(?i)\\b(wrong|no)\\b", score = -1 }},
  {{ pattern = "(?i)\\b(thanks|great|good)\\b", score = 1 }},
]
default_score = 0
[method]
kind = "binary"
[optim]
batch_size = 16
lr = 1e-4
clip = 0.2
kl = 0.0
staleness = 4
[env]
kind = "scripted"
parallelism = {sessions}
tasks = "tasks.jsonl"
{backlog}
[stop]
max_turns = {turns}
"#
    )
}

fn run(checkpoint: &str, replicas: u32, sessions: u32, turns: u64, backlog: &str) -> RunReport {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tasks.jsonl"), TASKS).unwrap();
    let file = dir.path().join("bench.toml");
    std::fs::write(&file, spec(checkpoint, replicas, sessions, turns, backlog)).unwrap();
    let spec = JobSpec::load(&file).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run_job(
        &spec,
        &file.display().to_string(),
        RunOptions {
            out: dir.path().join("run"),
            job_id: format!("bench-r{replicas}"),
            progress: None,
            poll: Duration::from_millis(50),
        },
    ))
    .unwrap()
}

fn main() {
    let turns: u64 = std::env::var("PIPELINE_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let sessions: u32 = std::env::var("PIPELINE_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let checkpoint = std::env::var("PIPELINE_SHAPE").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny").to_string()
    });
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "pipeline throughput: {checkpoint}, {sessions} sessions, stop at {turns} turns, {cores} CPU cores"
    );
    // A short warm-up so that page cache and allocator are in the same state for every run.
    let _ = run(&checkpoint, 1, 4, 40, "off");
    let modes: Vec<String> = match std::env::var("PIPELINE_BACKLOG") {
        Ok(m) => vec![m],
        Err(_) => vec!["off".into(), "default".into()],
    };
    for mode in &modes {
        let mut rates = Vec::new();
        for replicas in [1u32, 4] {
            let r = run(&checkpoint, replicas, sessions, turns, mode);
            let c = &r.counts;
            // From the job's start to its end (model loading and the final checkpoint excluded).
            let secs = c.elapsed_ms as f64 / 1000.0;
            let rate = c.turns as f64 / secs.max(1e-9);
            let t = &r.trainer;
            let stale = t.dropped_stale as f64 / (t.trained + t.dropped_stale).max(1) as f64;
            let a = &c.admission;
            println!(
                "admission {mode}, replicas {replicas}: {rate:.1} turns/s, {:.1} trained samples/s, \
                 {:.1}% of samples reaching a batch dropped stale ({} turns in {secs:.2} s; {} judged, \
                 {} unjudged; trainer {} steps, version {}; produced {} = trained {} + stale {} + \
                 failed {} + pending {}; {} turns held {:.1} s in all, {} waits expired)",
                t.trained as f64 / secs.max(1e-9),
                100.0 * stale,
                c.turns,
                c.judged,
                c.unjudged,
                t.steps,
                t.version,
                t.produced,
                t.trained,
                t.dropped_stale,
                t.failed,
                t.pending,
                a.held,
                a.held_ms as f64 / 1000.0,
                a.wait_expired,
            );
            rates.push(rate);
        }
        println!(
            "admission {mode}: scaling 4 replicas / 1 replica: {:.2}x (on {cores} cores)",
            rates[1] / rates[0]
        );
    }
}
