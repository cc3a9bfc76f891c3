//! Gateway under load while weights update: N concurrent sessions (default
//! 100) chat with the gateway over HTTP for S seconds (default 60) against the qwen3-tiny
//! fixture, half of the requests streamed, while a real learner trains on a thread beside it and
//! each new version is installed through `GatewayPolicy::install`. Prints the 5xx count (the
//! target is zero), other failures, latency p50/p99 (whole answer; first SSE byte for streams),
//! answers per version and whether any session saw versions go backwards. Then, as the same-run
//! reference, the same load without training or updates, and the p50/p99 ratios.
//!
//! `GATEWAY_BENCH_SESSIONS`, `GATEWAY_BENCH_SECS`, `GATEWAY_BENCH_UPDATE_SECS` (pause between
//! learner steps) and `GATEWAY_BENCH_REFERENCE=0` (skip the reference run) tune it;
//! `scripts/bench_gateway.sh` runs it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clawrl::gateway::{Gateway, GatewayConfig, GatewayPolicy};
use clawrl::model::{load_checkpoint, load_model};
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use clawrl::{CpuAutodiff, CpuBackend};
use serde_json::{json, Value};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

fn env_num(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| {
            eprintln!("{name}={v:?} is not a whole number");
            std::process::exit(2)
        }),
        Err(_) => default,
    }
}

/// What one run measured.
#[derive(Default)]
struct Run {
    ok: u64,
    status_4xx: u64,
    status_5xx: u64,
    transport_errors: u64,
    latencies: Vec<f64>,
    first_bytes: Vec<f64>,
    per_version: BTreeMap<u64, u64>,
    backwards: u64,
    updates: u64,
    wall: f64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One request; returns (status, version, seconds to the whole answer, seconds to first byte).
async fn one(
    http: &reqwest::Client,
    base: &str,
    session: &str,
    messages: &[Value],
    stream: bool,
    seed: u64,
) -> Result<(u16, Option<u64>, f64, f64), String> {
    let t0 = Instant::now();
    let mut resp = http
        .post(format!("{base}/v1/chat/completions"))
        .header("x-session-id", session)
        .json(
            &json!({"model": "qwen3-tiny", "messages": messages, "max_tokens": 16,
                      "seed": seed, "stream": stream}),
        )
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let version = resp
        .headers()
        .get("x-clawrl-version")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut first = None;
    while let Some(_c) = resp.chunk().await.map_err(|e| e.to_string())? {
        first.get_or_insert(t0.elapsed().as_secs_f64());
    }
    let total = t0.elapsed().as_secs_f64();
    Ok((status, version, total, first.unwrap_or(total)))
}

fn run(sessions: u64, secs: u64, update_secs: u64, train: bool) -> Run {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default())
        .expect("loading the fixture checkpoint");
    let cfg = GatewayConfig {
        data_dir: dir.path().join("data"),
        ..Default::default()
    };
    let gw = Gateway::new(ck, cfg, "qwen3-tiny").expect("gateway");
    let policy: GatewayPolicy = gw.policy();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop_server, rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(async move {
        gw.serve(
            listener,
            Box::pin(async {
                let _ = rx.await;
            }),
        )
        .await
    });

    // The trainer: real learner steps beside serving; each version installed on the gateway.
    let stop = Arc::new(AtomicBool::new(false));
    let trainer = train.then(|| {
        let (stop, policy, handle) = (stop.clone(), policy.clone(), rt.handle().clone());
        std::thread::spawn(move || {
            let device = Default::default();
            let (cfg, model) =
                load_model::<CpuAutodiff>(Path::new(FIXTURE), &device).expect("fixture model");
            let train = TrainConfig {
                lr: 1e-2,
                kl_coef: 0.0,
                batch_size: 4,
                ..TrainConfig::default()
            };
            let mut learner = BurnLearner::new(cfg, model, train, device, 3);
            let mut updates = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let v = learner.version() + 1;
                let samples: Vec<Sample> = (0..4u32)
                    .map(|i| {
                        let response: Vec<u32> =
                            (0..16).map(|j| 40 + 3 * (i + j) + v as u32).collect();
                        Sample {
                            prompt_ids: vec![1, 91, 89, 292, 205 + i],
                            advantages: vec![
                                if i.is_multiple_of(2) { 1.0 } else { -1.0 };
                                response.len()
                            ],
                            response_ids: response,
                            old_logprobs: None,
                            ref_logprobs: None,
                            rollout_logprobs: None,
                            opd: None,
                            importance: None,
                        }
                    })
                    .collect();
                learner.step(&samples).expect("learner step");
                let w = learner.export_weights().expect("export");
                handle
                    .block_on(policy.install(w.version, w.bytes))
                    .expect("install");
                updates += 1;
                let until = Instant::now() + Duration::from_secs(update_secs);
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            updates
        })
    });

    let out = Arc::new(Mutex::new(Run::default()));
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .pool_max_idle_per_host(sessions as usize)
        .build()
        .expect("http client");
    rt.block_on(async {
        let mut tasks = Vec::new();
        for s in 0..sessions {
            let (http, base, out) = (http.clone(), base.clone(), out.clone());
            tasks.push(tokio::spawn(async move {
                let session = format!("bench-{s}");
                let mut last_version = 0u64;
                let mut i = 0u64;
                while Instant::now() < end {
                    let messages =
                        vec![json!({"role": "user", "content": format!("session {s} turn {i}")})];
                    let stream = (s + i).is_multiple_of(2);
                    let r = one(&http, &base, &session, &messages, stream, s * 100_000 + i).await;
                    i += 1;
                    let mut o = out.lock().unwrap();
                    match r {
                        Ok((status, version, total, first)) => match status {
                            200..=299 => {
                                o.ok += 1;
                                o.latencies.push(total);
                                if stream {
                                    o.first_bytes.push(first);
                                }
                                if let Some(v) = version {
                                    *o.per_version.entry(v).or_default() += 1;
                                    if v < last_version {
                                        o.backwards += 1;
                                    }
                                    last_version = v;
                                }
                            }
                            500..=599 => o.status_5xx += 1,
                            _ => o.status_4xx += 1,
                        },
                        Err(_) => o.transport_errors += 1,
                    }
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let updates = trainer
        .map(|t| t.join().expect("trainer thread"))
        .unwrap_or(0);
    let _ = stop_server.send(());
    rt.block_on(server)
        .expect("server task")
        .expect("server shutdown");
    let mut o = std::mem::take(&mut *out.lock().unwrap());
    o.updates = updates;
    o.wall = wall;
    o
}

fn report(name: &str, r: &mut Run) -> (f64, f64) {
    let (p50, p99) = (pct(&mut r.latencies, 0.50), pct(&mut r.latencies, 0.99));
    let (f50, f99) = (pct(&mut r.first_bytes, 0.50), pct(&mut r.first_bytes, 0.99));
    println!("{name}:");
    println!(
        "  answers 200: {}  ({:.1}/s over {:.1} s)",
        r.ok,
        r.ok as f64 / r.wall,
        r.wall
    );
    println!(
        "  5xx: {}   4xx: {}   transport errors: {}",
        r.status_5xx, r.status_4xx, r.transport_errors
    );
    println!("  latency (whole answer)  p50 {p50:.3} s   p99 {p99:.3} s");
    println!("  first SSE byte          p50 {f50:.3} s   p99 {f99:.3} s");
    println!(
        "  weight updates installed: {}   answers per version: {:?}   answers older than their session's previous answer: {}",
        r.updates, r.per_version, r.backwards
    );
    (p50, p99)
}

fn main() {
    let sessions = env_num("GATEWAY_BENCH_SESSIONS", 100);
    let secs = env_num("GATEWAY_BENCH_SECS", 60);
    let update_secs = env_num("GATEWAY_BENCH_UPDATE_SECS", 5);
    let reference = env_num("GATEWAY_BENCH_REFERENCE", 1) != 0;
    println!(
        "gateway bench: {sessions} concurrent sessions for {secs} s, qwen3-tiny fixture, \
         a learner step + install every ~{update_secs} s"
    );
    let mut with = run(sessions, secs, update_secs, true);
    let (p50, p99) = report("with training and weight updates", &mut with);
    if reference {
        let mut without = run(sessions, secs, update_secs, false);
        let (r50, r99) = report(
            "reference: same load, no training, no updates",
            &mut without,
        );
        println!(
            "ratio with/without updates: p50 {:.2}   p99 {:.2}   throughput {:.2}",
            p50 / r50,
            p99 / r99,
            (with.ok as f64 / with.wall) / (without.ok as f64 / without.wall)
        );
    }
    println!(
        "RESULT 5xx={} p50={p50:.3}s p99={p99:.3}s updates={} backwards={}",
        with.status_5xx, with.updates, with.backwards
    );
    if with.status_5xx > 0 {
        std::process::exit(1);
    }
}
