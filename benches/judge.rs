//! Judge throughput (a benchmark, not a test).
//!
//! `cargo bench --bench judge` measures judged turns per second with `m = 3` evaluation votes and
//! `hint_m = 3` hint votes per turn, for two backends: `scripted`, and `openai` pointed at a local
//! axum server answering after a fixed latency. For each backend:
//!
//! - closed loop: 64 sessions judge turns back to back for a fixed time; reports turns/s and the
//!   peak number of judge requests in flight;
//! - open loop: 64 sessions each submit a turn every `interval` (a steady offered load) to a
//!   judge pool; reports the offered and achieved rates, latency percentiles, the backlog
//!   (submitted − judged) sampled over time, and whether it grows (last-quarter mean backlog more
//!   than twice the first quarter's and above 64). Pass: it does not grow.
//!
//! Environment: `JUDGE_BENCH_SECS` (default 5) per phase, `JUDGE_BENCH_LATENCY_MS` (default 50),
//! `JUDGE_BENCH_INTERVAL_MS` (default 250, per session).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use clawrl::judge::openai::{OpenAiBackend, OpenAiConfig};
use clawrl::judge::scripted::{ScriptedBackend, ScriptedConfig};
use clawrl::judge::{Judge, JudgeBackend, PromptSet, TurnMaterial, VoteSettings};
use serde_json::{json, Value};

const SESSIONS: usize = 64;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Gauge {
    now: AtomicUsize,
    peak: AtomicUsize,
}

async fn chat(
    State((latency, gauge)): State<(Duration, Arc<Gauge>)>,
    Json(body): Json<Value>,
) -> impl IntoResponse {
    let n = gauge.now.fetch_add(1, Ordering::Relaxed) + 1;
    gauge.peak.fetch_max(n, Ordering::Relaxed);
    tokio::time::sleep(latency).await;
    gauge.now.fetch_sub(1, Ordering::Relaxed);
    let prompt = body["messages"][0]["content"].as_str().unwrap_or("");
    let text = if prompt.contains("[HINT_START]") {
        "The user says what to do.\n\\boxed{1}\n[HINT_START]Ask which folder before deleting.[HINT_END]"
    } else {
        "The user corrects the assistant.\n\\boxed{-1}"
    };
    Json(json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}))
}

fn material(session: usize, turn: usize) -> TurnMaterial {
    TurnMaterial {
        response: format!("Session {session}, turn {turn}: I removed the directory you named."),
        next_state: format!("No, wrong folder (turn {turn}). You should ask which folder first."),
        next_state_role: "user".into(),
    }
}

fn judge(backend: Arc<dyn JudgeBackend>) -> Judge {
    let settings = VoteSettings {
        m: 3,
        hint_m: 3,
        vote_timeout_ms: 30_000,
        ..VoteSettings::default()
    };
    Judge::new(backend, Arc::new(PromptSet::defaults()), settings).unwrap()
}

async fn closed_loop(judge: &Judge, secs: u64) -> (usize, f64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for s in 0..SESSIONS {
        let (judge, done) = (judge.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut t = 0;
            while Instant::now() < deadline {
                let j = judge.judge_turn(material(s, t), true).await;
                assert_eq!(j.reward, -1, "votes: {:?}", j.votes);
                assert!(j.hint.is_some());
                done.fetch_add(1, Ordering::Relaxed);
                t += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n = done.load(Ordering::Relaxed);
    (n, n as f64 / start.elapsed().as_secs_f64())
}

struct OpenLoop {
    offered: f64,
    achieved: f64,
    p50_ms: f64,
    p99_ms: f64,
    backlog_first_quarter: f64,
    backlog_last_quarter: f64,
    backlog_max: usize,
}

async fn open_loop(judge: &Judge, secs: u64, interval: Duration) -> OpenLoop {
    let submitted = Arc::new(AtomicUsize::new(0));
    let judged = Arc::new(AtomicUsize::new(0));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut producers = Vec::new();
    for s in 0..SESSIONS {
        let (judge, submitted, judged, latencies) = (
            judge.clone(),
            submitted.clone(),
            judged.clone(),
            latencies.clone(),
        );
        producers.push(tokio::spawn(async move {
            // Stagger the sessions evenly over one interval.
            let mut next = start + interval * s as u32 / SESSIONS as u32;
            let mut inflight = Vec::new();
            let mut t = 0;
            while next < end {
                tokio::time::sleep_until(next.into()).await;
                submitted.fetch_add(1, Ordering::Relaxed);
                let (judge, judged, latencies) = (judge.clone(), judged.clone(), latencies.clone());
                let m = material(s, t);
                inflight.push(tokio::spawn(async move {
                    let t0 = Instant::now();
                    let _ = judge.judge_turn(m, true).await;
                    latencies
                        .lock()
                        .unwrap()
                        .push(t0.elapsed().as_secs_f64() * 1e3);
                    judged.fetch_add(1, Ordering::Relaxed);
                }));
                next += interval;
                t += 1;
            }
            for h in inflight {
                h.await.unwrap();
            }
        }));
    }
    let mut samples = Vec::new();
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        samples.push(
            submitted.load(Ordering::Relaxed)
                - judged
                    .load(Ordering::Relaxed)
                    .min(submitted.load(Ordering::Relaxed)),
        );
    }
    let achieved = judged.load(Ordering::Relaxed) as f64 / secs as f64;
    for p in producers {
        p.await.unwrap();
    }
    let mut l = latencies.lock().unwrap().clone();
    l.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| l[((l.len() as f64 - 1.0) * p) as usize];
    let q = (samples.len() / 4).max(1);
    let mean = |s: &[usize]| s.iter().sum::<usize>() as f64 / s.len().max(1) as f64;
    OpenLoop {
        offered: SESSIONS as f64 / interval.as_secs_f64(),
        achieved,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        backlog_first_quarter: mean(&samples[..q]),
        backlog_last_quarter: mean(&samples[samples.len() - q..]),
        backlog_max: samples.iter().copied().max().unwrap_or(0),
    }
}

fn report(name: &str, closed: (usize, f64), peak: Option<usize>, open: &OpenLoop) {
    let grows = open.backlog_last_quarter > 2.0 * open.backlog_first_quarter.max(1.0)
        && open.backlog_last_quarter > SESSIONS as f64;
    println!(
        "{name:>9}: closed loop {:>9.1} turns/s ({} turns, 64 sessions, m=3 + 3 hint votes){}",
        closed.1,
        closed.0,
        peak.map(|p| format!(", peak {p} judge requests in flight"))
            .unwrap_or_default()
    );
    println!(
        "{name:>9}: open loop offered {:.1} turns/s, judged {:.1} turns/s, latency p50 {:.1} ms p99 {:.1} ms, backlog first/last quarter {:.1}/{:.1} (max {}) -> {}",
        open.offered,
        open.achieved,
        open.p50_ms,
        open.p99_ms,
        open.backlog_first_quarter,
        open.backlog_last_quarter,
        open.backlog_max,
        if grows { "FAIL: backlog grows" } else { "PASS: keeps up" }
    );
}

fn main() {
    let secs = env_u64("JUDGE_BENCH_SECS", 5);
    let latency = Duration::from_millis(env_u64("JUDGE_BENCH_LATENCY_MS", 50));
    let interval = Duration::from_millis(env_u64("JUDGE_BENCH_INTERVAL_MS", 250));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!(
            "judge bench: {} threads, {secs} s per phase, openai latency {} ms, open-loop interval {} ms per session",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            latency.as_millis(),
            interval.as_millis()
        );
        let scripted_cfg: ScriptedConfig = toml::from_str(
            "rules = [{ pattern = '(?i)wrong', score = -1 }]\nhint = { pattern = '(?i)you should (.+)' }",
        )
        .unwrap();
        let scripted = judge(Arc::new(ScriptedBackend::new(&scripted_cfg).unwrap()));
        let closed = closed_loop(&scripted, secs).await;
        let open = open_loop(&scripted, secs, interval).await;
        report("scripted", closed, None, &open);

        let gauge = Arc::new(Gauge { now: AtomicUsize::new(0), peak: AtomicUsize::new(0) });
        let app = Router::new().route("/v1/chat/completions", post(chat)).with_state((latency, gauge.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let mut cfg = OpenAiConfig::new(url, "judge");
        cfg.max_concurrency = 512;
        let backend = Arc::new(OpenAiBackend::new(cfg).unwrap());
        let openai = judge(backend.clone());
        let closed = closed_loop(&openai, secs).await;
        let peak_closed = backend.peak_in_flight();
        let open = open_loop(&openai, secs, interval).await;
        report("openai", closed, Some(peak_closed), &open);
        println!("   openai: server saw at most {} concurrent requests", gauge.peak.load(Ordering::Relaxed));
    });
}
