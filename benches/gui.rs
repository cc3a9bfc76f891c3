//! GUI environment latency (not a test): episode start with no ready browser (browser launch,
//! page load, first tree and screenshot) and with one ready in the warm pool (page load, tree,
//! screenshot), both against a bare browser launch answering `Browser.getVersion` (the
//! reference); and one `click` step (input events, settle, tree, screenshot) against one bare
//! protocol round trip (`Runtime.evaluate("1")`) on the same page; all in this run, one episode
//! at a time.
//!
//! `cargo bench --bench gui` (optionally `-- N`, episodes per measure, default 10). Prints p50
//! and p99 of each and their ratios.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clawrl::env::gui::cdp::{find_chromium, Browser, LaunchOptions};
use clawrl::env::gui::GuiEnv;
use clawrl::env::EnvOptions;
use clawrl_actors::loops::{Action, Environment, ToolCallAction};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn click(id: u64) -> Action {
    Action {
        content: String::new(),
        tool_calls: vec![ToolCallAction {
            id: "c".into(),
            name: "click".into(),
            arguments: json!({"id": id}),
        }],
        raw: String::new(),
    }
}

/// The id of the first element line containing `what` in the latest state.
fn id_of(text: &str, what: &str) -> u64 {
    text.lines()
        .rev()
        .find(|l| l.contains(what))
        .and_then(|l| l.trim_start().strip_prefix('['))
        .and_then(|l| l.split(']').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `{what}` in the state"))
}

/// A bare browser on `dir` (no pool, no page), with the receiver of its events kept open.
async fn launch_bare(binary: &Path, dir: PathBuf) -> (Browser, UnboundedReceiver<Value>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let options = LaunchOptions {
        binary: binary.to_path_buf(),
        dir,
        width: 1024,
        height: 768,
        timeout: Duration::from_secs(30),
    };
    let browser = Browser::launch(&options, tx).await.expect("launch");
    (browser, rx)
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let root = tempfile::tempdir().expect("tempdir");
    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/env/gui/tasks.jsonl");
    let env_with = |warm_browsers: usize, dir: &str| {
        GuiEnv::load(
            &tasks,
            EnvOptions {
                work_root: Some(root.path().join(dir)),
                warm_browsers,
                ..EnvOptions::default()
            },
        )
        .expect("the gui environment (needs chromium)")
    };
    let env = rt.block_on(async { env_with(0, "cold") });
    let warm_env = rt.block_on(async { env_with(1, "warm") });
    let tickets = env
        .tasks()
        .iter()
        .position(|t| t.id == "tickets")
        .expect("the tickets task");
    let binary = find_chromium().expect("chromium");
    rt.block_on(async {
        let (mut bare, mut start, mut close) = (Vec::new(), Vec::new(), Vec::new());
        let mut warm_start = Vec::new();
        let (mut rtt, mut step) = (Vec::new(), Vec::new());
        for i in 0..n {
            // Reference: a bare browser up to its first answer.
            let dir = root.path().join(format!("bare{i}"));
            let t = Instant::now();
            let (mut b, _events) = launch_bare(&binary, dir).await;
            bare.push(t.elapsed());
            b.kill().await;

            let t = Instant::now();
            let mut ep = env.start(tickets, 0).await.expect("start");
            start.push(t.elapsed());
            for _ in 0..5 {
                let obs = ep.observation();
                let text = obs.messages.last().unwrap()["content"]
                    .as_str()
                    .unwrap()
                    .to_string();
                let plus = id_of(&text, "button \"More child tickets\"");
                let t = Instant::now();
                let out = ep.step(&click(plus)).await.expect("step");
                step.push(t.elapsed());
                assert!(out.next_state[0]["content"]
                    .as_str()
                    .unwrap()
                    .starts_with("click"));
            }
            let t = Instant::now();
            ep.close().await;
            close.push(t.elapsed());

            // The same start with a browser ready in the pool.
            assert_eq!(warm_env.wait_warm(Duration::from_secs(60)).await, 1);
            let t = Instant::now();
            let ep = warm_env.start(tickets, 0).await.expect("start");
            warm_start.push(t.elapsed());
            ep.close().await;

            // Reference: bare protocol round trips on a page.
            let (mut b, _events) = launch_bare(&binary, root.path().join(format!("rtt{i}"))).await;
            let cdp = b.cdp().clone();
            let s = cdp.open_tab().await.expect("a tab");
            for _ in 0..5 {
                let t = Instant::now();
                cdp.call("Runtime.evaluate", json!({"expression": "1"}), Some(&s))
                    .await
                    .expect("evaluate");
                rtt.push(t.elapsed());
            }
            b.kill().await;
        }
        let (b50, b99) = (pct(&mut bare, 0.5), pct(&mut bare, 0.99));
        let (s50, s99) = (pct(&mut start, 0.5), pct(&mut start, 0.99));
        let c50 = pct(&mut close, 0.5);
        let (w50, w99) = (pct(&mut warm_start, 0.5), pct(&mut warm_start, 0.99));
        let stats = warm_env.browser_stats();
        assert_eq!(stats.taken_warm as usize, n, "{stats:?}");
        let (r50, r99) = (pct(&mut rtt, 0.5), pct(&mut rtt, 0.99));
        let (t50, t99) = (pct(&mut step, 0.5), pct(&mut step, 0.99));
        println!("episodes: {n}, click steps: {}", step.len());
        println!(
            "start, cold    p50 {s50:7.1} ms  p99 {s99:7.1} ms | bare launch p50 {b50:7.1} ms  \
             p99 {b99:7.1} ms | ratio p50 {:.2}",
            s50 / b50
        );
        println!(
            "start, warm    p50 {w50:7.1} ms  p99 {w99:7.1} ms | bare launch p50 {b50:7.1} ms  \
             p99 {b99:7.1} ms | ratio p50 {:.2} (cold/warm {:.1}x)",
            w50 / b50,
            s50 / w50
        );
        println!(
            "click step     p50 {t50:7.1} ms  p99 {t99:7.1} ms | bare CDP call p50 {r50:7.2} ms  \
             p99 {r99:7.2} ms | ratio p50 {:.1}",
            t50 / r50
        );
        println!("episode close  p50 {c50:7.1} ms");
    });
}
