//! Environment throughput: terminal steps per second with 1, 64 and 256 concurrent episodes on
//! this node, each step one `shell_exec` of `echo step` in a fresh sandbox (scripted actions, no
//! model), against the same commands run as plain `bash -c` subprocesses at the same
//! concurrency (the reference, in the same run).
//!
//! `cargo bench --bench env` (optionally `-- STEPS_PER_SESSION_SCALE`, default 1). Prints one
//! line per concurrency: steps/s sandboxed, steps/s unsandboxed, their ratio, and the episode
//! start+close cost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl::env::terminal::{TerminalEnv, TerminalTask};
use clawrl::env::EnvOptions;
use clawrl_actors::loops::{Action, Environment, ToolCallAction};
use serde_json::json;

fn step_action() -> Action {
    Action {
        content: String::new(),
        tool_calls: vec![ToolCallAction {
            id: "c".into(),
            name: "shell_exec".into(),
            arguments: json!({"command": "echo step"}),
        }],
        raw: String::new(),
    }
}

/// Runs `sessions` episodes at once, each taking `steps` steps; returns (wall time of the
/// stepping phase, mean start+close time per episode).
async fn sandboxed(env: Arc<TerminalEnv>, sessions: usize, steps: usize) -> (Duration, Duration) {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..sessions {
        let env = Arc::clone(&env);
        tasks.push(tokio::spawn(async move {
            let s0 = Instant::now();
            let mut ep = env.start(0, i as u64).await.expect("start");
            let start = s0.elapsed();
            let a = step_action();
            for _ in 0..steps {
                let out = ep.step(&a).await.expect("step");
                assert!(!out.done);
                assert_eq!(out.info["commands"][0]["exit_code"], 0);
            }
            let c0 = Instant::now();
            ep.close().await;
            start + c0.elapsed()
        }));
    }
    let mut overhead = Duration::ZERO;
    for t in tasks {
        overhead += t.await.expect("session task");
    }
    (t0.elapsed(), overhead / sessions as u32)
}

async fn unsandboxed(sessions: usize, steps: usize) -> Duration {
    let t0 = Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(sessions));
    let mut tasks = Vec::new();
    for _ in 0..sessions {
        let slots = Arc::clone(&slots);
        tasks.push(tokio::spawn(async move {
            for _ in 0..steps {
                let _s = slots.acquire().await.expect("open");
                let out = tokio::process::Command::new("/bin/bash")
                    .args(["-c", "echo step"])
                    .output()
                    .await
                    .expect("bash");
                assert!(out.status.success());
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    t0.elapsed()
}

fn main() {
    let scale: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let root = std::env::temp_dir().join(format!("clawrl-bench-env-{}", std::process::id()));
    println!(
        "env bench: terminal steps/s ({} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("sessions  steps  sandboxed steps/s  plain bash steps/s  ratio  start+close ms");
    for (sessions, steps) in [(1usize, 100usize), (64, 8), (256, 4)] {
        let steps = steps * scale;
        let task = TerminalTask {
            id: "bench".into(),
            instruction: "echo".into(),
            files: vec![],
            setup_script: None,
            check: "true".into(),
        };
        let env = Arc::new(
            TerminalEnv::new(
                vec![task],
                EnvOptions {
                    work_root: Some(root.clone()),
                    warm_workdirs: sessions,
                    max_concurrent_commands: sessions,
                    max_steps: Some(steps as u32 + 1),
                    ..EnvOptions::default()
                },
            )
            .expect("env"),
        );
        let (wall, overhead) = rt.block_on(sandboxed(Arc::clone(&env), sessions, steps));
        let plain = rt.block_on(unsandboxed(sessions, steps));
        let total = (sessions * steps) as f64;
        let sps = total / wall.as_secs_f64();
        let pps = total / plain.as_secs_f64();
        println!(
            "{sessions:>8}  {:>5}  {sps:>17.1}  {pps:>18.1}  {:>5.2}  {:>14.2}",
            sessions * steps,
            pps / sps,
            overhead.as_secs_f64() * 1e3
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
