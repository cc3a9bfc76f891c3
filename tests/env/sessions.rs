//! 256 concurrent terminal episodes on one node, each an `EnvSession` actor driven by a
//! scripted policy (no model): every one finishes with outcome +1, every work dir is removed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clawrl::env::{build_environment, EnvKind, EnvOptions};
use clawrl_actors::loops::{
    Action, BoxFuture, EndReason, EnvSession, Observation, PolicyError, PolicyTurn, SessionArgs,
    SessionEvent, ToolCallAction, TurnPolicy,
};
use ractor::Actor;
use serde_json::json;

const SESSIONS: usize = 256;

/// The work-dir roots environments of `kind` made under `work_root` (each a fresh
/// `clawrl-env-<kind>-<random>`).
fn pool_roots(work_root: &Path, kind: &str) -> Vec<PathBuf> {
    let prefix = format!("clawrl-env-{kind}-");
    std::fs::read_dir(work_root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&prefix)
        })
        .collect()
}

/// Writes the file on the first turn, submits on the second.
struct Scripted;

impl TurnPolicy for Scripted {
    fn act<'a>(
        &'a self,
        observation: &'a Observation,
    ) -> BoxFuture<'a, Result<PolicyTurn, PolicyError>> {
        Box::pin(async move {
            let acted = observation
                .messages
                .iter()
                .any(|m| m["role"] == "assistant");
            let (name, arguments) = if acted {
                ("submit", json!({}))
            } else {
                (
                    "shell_exec",
                    json!({"command": "echo 'hello world' > hello.txt"}),
                )
            };
            Ok(PolicyTurn {
                action: Action {
                    content: String::new(),
                    tool_calls: vec![ToolCallAction {
                        id: "c".into(),
                        name: name.into(),
                        arguments,
                    }],
                    raw: String::new(),
                },
                ..PolicyTurn::default()
            })
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_terminal_sessions_all_finish_with_success() {
    let root = tempfile::tempdir().unwrap();
    let tasks =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/env/terminal.jsonl");
    let env = build_environment(
        EnvKind::Terminal,
        &tasks,
        EnvOptions {
            work_root: Some(root.path().to_path_buf()),
            warm_workdirs: SESSIONS,
            ..EnvOptions::default()
        },
    )
    .unwrap();
    let ended: Arc<Mutex<Vec<(String, EndReason, u32)>>> = Arc::default();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let policy: Arc<dyn TurnPolicy> = Arc::new(Scripted);
    let mut handles = Vec::new();
    for i in 0..SESSIONS {
        let ended = Arc::clone(&ended);
        let tx = tx.clone();
        let args = SessionArgs {
            session_id: format!("s{i}"),
            env: Arc::clone(&env),
            task_index: 0,
            seed: i as u64,
            policy: Arc::clone(&policy),
            deadline: Duration::from_secs(300),
            max_steps: None,
            report: Arc::new(move |ev| {
                if let SessionEvent::Ended {
                    session_id,
                    reason,
                    turns,
                    ..
                } = ev
                {
                    ended.lock().unwrap().push((session_id, reason, turns));
                    let _ = tx.send(());
                }
            }),
        };
        let (_actor, handle) = Actor::spawn(None, EnvSession, args).await.unwrap();
        handles.push(handle);
    }
    drop(tx);
    let wait = async {
        for _ in 0..SESSIONS {
            rx.recv().await.expect("a session ended");
        }
    };
    tokio::time::timeout(Duration::from_secs(600), wait)
        .await
        .expect("all sessions end within 10 minutes");
    for h in handles {
        h.await.unwrap();
    }
    let ended = ended.lock().unwrap();
    assert_eq!(ended.len(), SESSIONS);
    let mut ids: Vec<&str> = ended.iter().map(|(s, _, _)| s.as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), SESSIONS, "each session ends exactly once");
    for (id, reason, turns) in ended.iter() {
        assert_eq!(
            reason,
            &EndReason::Done { outcome: Some(1.0) },
            "session {id}"
        );
        assert_eq!(*turns, 2, "session {id}");
    }
    // Every episode's work dir was removed on close; only empty pool dirs are left.
    let pools = pool_roots(root.path(), "terminal");
    assert_eq!(pools.len(), 1, "{pools:?}");
    for e in std::fs::read_dir(&pools[0]).unwrap() {
        let p = e.unwrap().path();
        assert_eq!(std::fs::read_dir(&p).unwrap().count(), 0, "{p:?} not empty");
    }
}
