//! Watching a `personal` job learn. While the job trains, headless Chromium loads the gateway's
//! `/dashboard#key=...` (every request the page makes is forwarded to the gateway by the test
//! over the DevTools `Fetch` domain: the browser itself has no network): the plots hold one
//! point per trainer step, the version shown advances when the job installs a new one, no
//! request leaves the gateway's origin and the page's script logs no error. After the job,
//! Python's `tensorboard` reads `<out>/tb/` back and its scalars equal the trainer-step records,
//! and `clawrl dashboard --out` serves the finished run (401 without the key), then the same run
//! with a torn last line, an empty run and a run holding only half a line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use clawrl::env::gui::cdp::{find_chromium, Browser, Cdp, LaunchOptions};
use serde_json::{json, Value};

use crate::personal_run::{self, PersonalRun, SpecParams};

const KEY: &str = "sk-watch-test";
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn spec(out: &Path) -> String {
    personal_run::spec(
        out,
        &SpecParams {
            name: "watch-test",
            seed: 5,
            key: KEY,
            votes: 2,
            kl: 0.02,
        },
    )
}

/// The user corrects the answer.
const WRONG: &str = "That is wrong, try again.";
/// The user praises the answer.
const THANKS: &str = "Thanks, that helps!";

/// One session whose first two turns the user answers with `replies` (the scripted judge
/// scores praise +1 and a correction −1): two judged ±1 turns, so one step of the job's batch
/// of 2; the third turn ends it unjudged.
async fn session(http: &reqwest::Client, base: &str, name: &str, replies: [&str; 2]) {
    let h = [("X-Session-Id", name)];
    let mut messages = vec![json!({"role": "user", "content": format!("Explain {name}.")})];
    for reply in replies {
        let (b, _) = personal_run::chat(http, base, KEY, json!(messages), &h).await;
        let content = b["choices"][0]["message"]["content"].as_str().unwrap_or("");
        messages.push(json!({"role": "assistant", "content": content}));
        messages.push(json!({"role": "user", "content": reply}));
    }
    let done = [("X-Session-Id", name), ("X-Session-Done", "1")];
    personal_run::chat(http, base, KEY, json!(messages), &done).await;
}

/// The version the gateway serves.
async fn serving_version(http: &reqwest::Client, base: &str) -> u64 {
    let h: Value = http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    h["version"].as_u64().unwrap()
}

/// Polls `probe` every 100 ms until it returns `Some`, failing after `secs` with `what`.
async fn until<T, F, Fut>(secs: u64, what: impl Fn() -> String, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out: {}", what());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The run's records (complete lines only).
fn records(out: &Path) -> Vec<Value> {
    let mut all = Vec::new();
    let Ok(dir) = std::fs::read_dir(out.join("records")) else {
        return all;
    };
    for e in dir {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        for line in complete.lines() {
            all.push(serde_json::from_str(line).unwrap());
        }
    }
    all
}

/// The run's `trainer_step` records, by step.
fn step_records(out: &Path) -> BTreeMap<u64, Value> {
    records(out)
        .into_iter()
        .filter(|v| v["kind"] == "trainer_step")
        .map(|v| (v["record"]["step"].as_u64().unwrap(), v["record"].clone()))
        .collect()
}

/// The versions that served at least one judged turn.
fn judged_versions(out: &Path) -> usize {
    records(out)
        .iter()
        .filter(|v| v["kind"] == "judge" && v["record"]["unjudged"].is_null())
        .map(|v| v["version"].as_u64().unwrap())
        .collect::<BTreeSet<_>>()
        .len()
}

/// A tab of `browser` whose every request is answered by forwarding it to the real server.
struct ProxiedTab {
    cdp: Cdp,
    session: String,
    /// Script errors: exceptions, `console.error`/`console.assert`, JavaScript log errors.
    errors: Arc<Mutex<Vec<String>>>,
    /// Every URL the page requested.
    urls: Arc<Mutex<Vec<String>>>,
}

async fn forward(
    http: &reqwest::Client,
    req: &Value,
) -> Result<(u16, Vec<Value>, Vec<u8>), String> {
    let method = reqwest::Method::from_bytes(req["method"].as_str().unwrap_or("GET").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut r = http.request(method, req["url"].as_str().unwrap_or(""));
    if let Some(h) = req["headers"].as_object() {
        for (k, v) in h {
            r = r.header(k.as_str(), v.as_str().unwrap_or(""));
        }
    }
    if let Some(body) = req["postData"].as_str() {
        r = r.body(body.to_string());
    }
    let resp = r.send().await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| json!({"name": k.as_str(), "value": v.to_str().unwrap_or("")}))
        .collect();
    let body = resp.bytes().await.map_err(|e| e.to_string())?.to_vec();
    Ok((status, headers, body))
}

impl ProxiedTab {
    async fn open(
        browser: &Browser,
        mut events: tokio::sync::mpsc::UnboundedReceiver<Value>,
        url: &str,
    ) -> Self {
        let cdp = browser.cdp().clone();
        let errors = Arc::new(Mutex::new(Vec::new()));
        let urls = Arc::new(Mutex::new(Vec::new()));
        let http = reqwest::Client::new();
        {
            let (cdp, errors, urls) = (cdp.clone(), errors.clone(), urls.clone());
            tokio::spawn(async move {
                while let Some(ev) = events.recv().await {
                    let session = ev["sessionId"].as_str().map(str::to_string);
                    let p = &ev["params"];
                    match ev["method"].as_str().unwrap_or("") {
                        "Fetch.requestPaused" => {
                            let (cdp, http, p) = (cdp.clone(), http.clone(), p.clone());
                            urls.lock()
                                .unwrap()
                                .push(p["request"]["url"].as_str().unwrap_or("").to_string());
                            tokio::spawn(async move {
                                let id = p["requestId"].clone();
                                let (method, params) = match forward(&http, &p["request"]).await {
                                    Ok((status, headers, body)) => (
                                        "Fetch.fulfillRequest",
                                        json!({"requestId": id, "responseCode": status,
                                               "responseHeaders": headers,
                                               "body": base64::engine::general_purpose::STANDARD.encode(body)}),
                                    ),
                                    Err(_) => (
                                        "Fetch.failRequest",
                                        json!({"requestId": id, "errorReason": "ConnectionRefused"}),
                                    ),
                                };
                                let _ = cdp.call(method, params, session.as_deref()).await;
                            });
                        }
                        "Runtime.exceptionThrown" => errors.lock().unwrap().push(p.to_string()),
                        "Runtime.consoleAPICalled"
                            if matches!(p["type"].as_str(), Some("error" | "assert")) =>
                        {
                            errors.lock().unwrap().push(p.to_string())
                        }
                        "Log.entryAdded"
                            if p["entry"]["level"] == "error"
                                && p["entry"]["source"] == "javascript" =>
                        {
                            errors.lock().unwrap().push(p.to_string())
                        }
                        _ => {}
                    }
                }
            });
        }
        let session = cdp.open_tab().await.unwrap();
        let s = Some(session.as_str());
        for (method, params) in [
            (
                "Fetch.enable",
                json!({"patterns": [{"urlPattern": "*", "requestStage": "Request"}]}),
            ),
            ("Runtime.enable", json!({})),
            ("Log.enable", json!({})),
            ("Page.enable", json!({})),
            (
                "Emulation.setDeviceMetricsOverride",
                json!({"width": 1280, "height": 860, "deviceScaleFactor": 1, "mobile": false}),
            ),
        ] {
            cdp.call(method, params, s).await.unwrap();
        }
        let nav = cdp
            .call("Page.navigate", json!({"url": url}), s)
            .await
            .unwrap();
        assert!(nav.get("errorText").is_none(), "loading {url}: {nav}");
        ProxiedTab {
            cdp,
            session,
            errors,
            urls,
        }
    }

    /// The page's state: the version shown and each plot's point count.
    async fn state(&self) -> Value {
        let expr = r##"JSON.stringify((() => {
            const t = (id) => { const e = document.getElementById(id); return e ? e.textContent : null; };
            const n = (id) => { const e = document.getElementById(id); return e ? Number(e.dataset.points) : -1; };
            return { version: t("serving-version"), status: t("status"), message: t("message"),
                     loss: n("plot-loss"), kl: n("plot-kl"), reward: n("plot-reward"),
                     versions: n("plot-version"), recent: document.querySelectorAll("#recent tr").length };
        })())"##;
        let r = self
            .cdp
            .call(
                "Runtime.evaluate",
                json!({"expression": expr, "returnByValue": true}),
                Some(&self.session),
            )
            .await
            .unwrap();
        serde_json::from_str(r["result"]["value"].as_str().unwrap_or("null")).unwrap_or(Value::Null)
    }

    async fn screenshot(&self, path: &Path) {
        let r = self
            .cdp
            .call(
                "Page.captureScreenshot",
                json!({"format": "png"}),
                Some(&self.session),
            )
            .await
            .unwrap();
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }
}

/// The version the page shows.
fn shown_version(state: &Value) -> Option<u64> {
    state["version"].as_str().and_then(|v| v.parse().ok())
}

/// Python's `tensorboard` reading `dir`: tag → [(step, value)].
fn tensorboard_scalars(dir: &Path) -> BTreeMap<String, Vec<(u64, f64)>> {
    let py = super::venv::venv_python(
        &Path::new(ROOT).join("target/tensorboard-venv"),
        "tensorboard",
        "tensorboard",
    );
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
ea.Reload()
print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}))
"#;
    let out = super::venv::run(
        Command::new(py).args(["-c", script]).arg(dir),
        "reading the event files with tensorboard's EventAccumulator",
    );
    let v: BTreeMap<String, Vec<(u64, f64)>> = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("EventAccumulator printed no JSON ({e}): {out}"));
    v
}

/// A `clawrl` command serving on a free port behind [`KEY`]; killed when dropped.
struct Served {
    child: std::process::Child,
    base: String,
}

impl Served {
    fn start(args: &[&std::ffi::OsStr]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_clawrl"))
            .args(args)
            .args(["--listen", "127.0.0.1:0", "--api-key", KEY])
            .env_remove("CLAWRL_API_KEYS")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let base = super::venv::served_address(&mut child);
        Served { child, base }
    }

    /// `clawrl dashboard --out DIR`.
    fn dashboard(out: &Path) -> Self {
        Self::start(&["dashboard".as_ref(), "--out".as_ref(), out.as_os_str()])
    }

    async fn data(&self, http: &reqwest::Client) -> Value {
        let r = http
            .get(format!("{}/dashboard/data", self.base))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn assert_keyed(http: &reqwest::Client, base: &str) {
    let page = http.get(format!("{base}/dashboard")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains("plot-loss"), "{html}");
    // Self-contained: nothing is loaded from elsewhere.
    for outside in ["src=\"http", "href=\"http", "<link", "@import"] {
        assert!(!html.contains(outside), "the page loads {outside}...");
    }
    let data = format!("{base}/dashboard/data");
    assert_eq!(http.get(&data).send().await.unwrap().status(), 401);
    let wrong = http
        .get(&data)
        .bearer_auth("sk-wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_personal_job_is_watched_in_a_browser_and_in_tensorboard() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = dir.path().join("watch.toml");
    std::fs::write(&job, spec(&out)).unwrap();
    let run = PersonalRun::start(&job, &out, Duration::from_secs(60));
    let base = run.base.clone();
    let http = reqwest::Client::new();
    let (h, b, o) = (&http, base.as_str(), out.as_path());
    assert_keyed(&http, &base).await;

    // Two sessions: two steps, version 2 served.
    session(&http, &base, "a", [THANKS, WRONG]).await;
    session(&http, &base, "b", [THANKS, WRONG]).await;
    until(
        120,
        || format!("version 2 never served: {}", run.log()),
        || async move { (serving_version(h, b).await >= 2).then_some(()) },
    )
    .await;

    // The page, while the job trains.
    let (tx, events) = tokio::sync::mpsc::unbounded_channel();
    let opts = LaunchOptions {
        binary: find_chromium().unwrap(),
        dir: dir.path().join("browser"),
        width: 1280,
        height: 860,
        timeout: Duration::from_secs(30),
    };
    let mut browser = Browser::launch(&opts, tx).await.unwrap();
    let tab = ProxiedTab::open(&browser, events, &format!("{base}/dashboard#key={KEY}")).await;

    // As many points as trainer steps, and the version served.
    let t = &tab;
    let (steps, v) = until(
        60,
        || format!("the page never caught up: {}", run.log()),
        || async move {
            let v = serving_version(h, b).await;
            let steps = step_records(o).len() as i64;
            let rewards = judged_versions(o) as i64;
            let s = t.state().await;
            // One loss and KL point per step, one reward point per version that served a
            // judged turn.
            (s["loss"] == steps
                && s["kl"] == steps
                && s["reward"] == rewards
                && shown_version(&s) == Some(v))
            .then_some((steps, v))
        },
    )
    .await;
    assert!(steps >= 2, "{steps}");
    let s = tab.state().await;
    // The table: the last judged turns (four judged and two unjudged so far).
    assert_eq!(s["recent"], 6, "{s}");

    // A new version is installed: the page shows it without reloading.
    session(&http, &base, "c", [THANKS, THANKS]).await;
    let v2 = until(
        120,
        || format!("no version after {v}: {}", run.log()),
        || async move {
            let now = serving_version(h, b).await;
            (now > v).then_some(now)
        },
    )
    .await;
    let shown = until(
        60,
        || format!("the page never showed version {v2}"),
        || async move {
            let s = t.state().await;
            (shown_version(&s) == Some(v2)).then_some(s)
        },
    )
    .await;
    assert!(shown["loss"].as_i64().unwrap() >= steps, "{shown}");
    until(
        60,
        || "the page never plotted the last step and its turns".into(),
        || async move {
            let (steps, rewards) = (step_records(o).len() as i64, judged_versions(o) as i64);
            let s = t.state().await;
            (s["loss"] == steps && s["kl"] == steps && s["reward"] == rewards).then_some(())
        },
    )
    .await;
    let png = Path::new(ROOT).join("target/dashboard-screenshot.png");
    tab.screenshot(&png).await;
    assert!(std::fs::metadata(&png).unwrap().len() > 10_000);
    let errors = tab.errors.lock().unwrap().clone();
    assert!(
        errors.is_empty(),
        "the page's script logged errors: {errors:?}"
    );
    let origin = format!("{base}/");
    let urls = tab.urls.lock().unwrap().clone();
    assert!(
        urls.iter().any(|u| u.ends_with("/dashboard/data")),
        "{urls:?}"
    );
    assert!(urls.iter().all(|u| u.starts_with(&origin)), "{urls:?}");
    browser.kill().await;

    // The job ends; TensorBoard reads back what the records say.
    let summary = run.stop();
    let steps = step_records(&out);
    assert_eq!(
        steps.len() as u64,
        summary["agents"][0]["trainer"]["steps"].as_u64().unwrap(),
        "{summary}"
    );
    let tb = tensorboard_scalars(&out.join("tb"));
    let tags: BTreeSet<&str> = tb.keys().map(String::as_str).collect();
    for tag in [
        "train/loss",
        "train/pg_loss",
        "train/kl",
        "train/clip_fraction",
        "train/grad_norm",
        "train/samples_trained",
        "train/samples_dropped_stale",
        "train/version",
        "train/step_ms",
        "judge/reward_mean",
        "judge/hint_accepted_rate",
        "judge/failed_vote_rate",
        "judge/turns_judged",
    ] {
        assert!(tags.contains(tag), "{tag} missing from {tags:?}");
    }
    // `a.b` reads a nested field.
    let field =
        |r: &Value, key: &str| -> Option<f64> { key.split('.').fold(r, |v, k| &v[k]).as_f64() };
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/pg_loss", "pg_loss"),
        ("train/kl", "kl"),
        ("train/clip_fraction", "clip_fraction"),
        ("train/grad_norm", "grad_norm"),
        ("train/logprob_gap", "logprob_gap.mean_abs"),
        ("train/logprob_gap_max", "logprob_gap.max_abs"),
        ("train/samples_trained", "kept"),
        ("train/samples_dropped_stale", "dropped_stale"),
        ("train/version", "version"),
        ("train/step_ms", "step_ms"),
    ] {
        let want: Vec<(u64, f32)> = steps
            .iter()
            .filter_map(|(s, r)| field(r, key).map(|v| (*s, v as f32)))
            .collect();
        let got: Vec<(u64, f32)> = tb
            .get(tag)
            .map(|v| v.iter().map(|(s, x)| (*s, *x as f32)).collect())
            .unwrap_or_default();
        assert_eq!(got, want, "{tag} against the records' {key}");
    }
    // A judged turn counts in the aggregate of the first step after its record (turns judged
    // after the last step are in none).
    let judged: f64 = tb["judge/turns_judged"].iter().map(|(_, n)| n).sum();
    let records = summary["counts"]["judged"].as_f64().unwrap();
    assert!(judged >= 1.0 && judged <= records, "{judged} of {records}");
    assert!(tb["judge/reward_mean"]
        .iter()
        .all(|(_, r)| (-1.0..=1.0).contains(r)));
    assert!(tb["judge/failed_vote_rate"].iter().all(|(_, r)| *r == 0.0));

    // The finished run through `clawrl dashboard`.
    let cmd = Served::dashboard(&out);
    assert_keyed(&http, &cmd.base).await;
    let d = cmd.data(&http).await;
    assert_eq!(d["steps"].as_array().unwrap().len(), steps.len(), "{d}");
    assert_eq!(d["message"], Value::Null, "{d}");
    assert_eq!(d["torn_lines"], 0);
    let last = steps.values().last().unwrap();
    assert_eq!(d["serving_version"], last["version"], "{d}");
    // A torn last line (a writer stopped mid-line) is skipped and counted.
    let newest: PathBuf = std::fs::read_dir(out.join("records"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&newest)
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"version\":9,\"kind\":\"trainer_st").unwrap();
    let d = cmd.data(&http).await;
    assert_eq!(d["torn_lines"], 1, "{d}");
    assert_eq!(d["steps"].as_array().unwrap().len(), steps.len(), "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_or_half_written_run_gives_an_empty_dashboard_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let cmd = Served::dashboard(dir.path());
    assert_keyed(&http, &cmd.base).await;
    let d = cmd.data(&http).await;
    assert!(d["steps"].as_array().unwrap().is_empty(), "{d}");
    let msg = d["message"].as_str().unwrap();
    assert!(msg.contains("No records yet"), "{msg}");

    let records = dir.path().join("records");
    std::fs::create_dir_all(&records).unwrap();
    std::fs::write(
        records.join("job.v00000000.jsonl"),
        "{\"version\":0,\"kind\":\"jud",
    )
    .unwrap();
    let d = cmd.data(&http).await;
    assert_eq!(d["torn_lines"], 1, "{d}");
    assert!(d["recent"].as_array().unwrap().is_empty(), "{d}");
    let msg = d["message"].as_str().unwrap();
    assert!(msg.contains("No trainer step or judged turn"), "{msg}");

    // `clawrl serve` has no run: live data only, saying so.
    let model = Path::new(ROOT).join("tests/fixtures/qwen3-tiny");
    let turns = dir.path().join("turns");
    let serve = Served::start(&[
        "serve".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--data-dir".as_ref(),
        turns.as_os_str(),
    ]);
    assert_keyed(&http, &serve.base).await;
    let d = serve.data(&http).await;
    assert_eq!(d["serving_version"], 0, "{d}");
    assert_eq!(d["live"]["version"], 0, "{d}");
    assert!(
        d["message"].as_str().unwrap().contains("only serves"),
        "{d}"
    );

    // Not a directory: refused, saying so.
    let o = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .args(["dashboard", "--out"])
        .arg(dir.path().join("missing"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a directory"), "{err}");
}
