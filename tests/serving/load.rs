//! Load: 20 concurrent sessions talk to the gateway for 10 s (mixed streaming and not, with
//! next states), over real HTTP with the qwen3-tiny fixture. Zero 5xx, every answer 200, and
//! every main turn served ends up recorded, through a deliberately tiny record queue.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl::gateway::{Gateway, GatewayConfig};
use clawrl::model::load_checkpoint;
use clawrl::CpuBackend;
use serde_json::json;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_sessions_for_ten_seconds_without_5xx() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = GatewayConfig {
        data_dir: dir.path().join("data"),
        record_queue: 2,
        ..Default::default()
    };
    let ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    let gw = Gateway::new(ck, cfg, "qwen3-tiny").unwrap();
    let turns = gw.turns_path(0);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        gw.serve(listener, async {
            let _ = rx.await;
        })
        .await
        .unwrap()
    });

    let ok = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(10);
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for s in 0..20u64 {
        let (client, base, ok) = (client.clone(), base.clone(), ok.clone());
        tasks.push(tokio::spawn(async move {
            let mut messages = vec![json!({"role": "user", "content": format!("session {s}")})];
            let mut i = 0u64;
            // At least one turn per session, then until the deadline.
            loop {
                let stream = (s + i).is_multiple_of(2);
                let r = client
                    .post(format!("{base}/v1/chat/completions"))
                    .header("X-Session-Id", format!("load-{s}"))
                    .json(
                        &json!({"model": "qwen3-tiny", "messages": messages, "max_tokens": 6,
                                  "seed": s * 1000 + i, "stream": stream}),
                    )
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                assert!(status < 500, "5xx: {status}");
                assert_eq!(status, 200);
                let text = r.text().await.unwrap();
                assert!(
                    !stream || text.trim_end().ends_with("data: [DONE]"),
                    "{text}"
                );
                ok.fetch_add(1, Ordering::Relaxed);
                // Keep the prompt short: the last assistant turn is dropped from the history.
                messages =
                    vec![json!({"role": "user", "content": format!("session {s} turn {i}")})];
                i += 1;
                if Instant::now() >= end {
                    break;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let served = ok.load(Ordering::Relaxed);
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!metrics.contains("status=\"5"), "{metrics}");
    let _ = stop.send(());
    server.await.unwrap();
    let records = std::fs::read_to_string(&turns).unwrap();
    let lines: Vec<serde_json::Value> = records
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as u64, served, "every main turn is recorded");
    let with_next = lines.iter().filter(|l| !l["next_state"].is_null()).count() as u64;
    assert_eq!(
        with_next,
        served - 20,
        "all but each session's last turn have a next state"
    );
}
