//! Real crashes of `clawrl run`: the process gets SIGKILL while its job is held open (an `rl`
//! job under a step limit it cannot reach; a `personal` job under HTTP load from concurrent
//! sessions, which runs until stopped) once its records show a trainer step and its checkpoint
//! (and, under load, a client holds an answer 1.5 s old), and is then re-run on the
//! same `--out` until a clean stop. Then every record and journal file parses (a torn last line
//! the kill left, or one the test leaves where the kill did not, is cut and counted by the
//! re-run), every answer a client got more than a
//! second before the kill is in the served journal by exact token ids, the trainer resumed from
//! the last checkpoint with versions counting on, and the counts balance with what the crash
//! lost counted: its journaled samples replayed (`recovered`), its turns never judged recorded
//! as `lost` by the recorder, its answered turns that never got their next state recorded as
//! lost by the gateway; the re-run's JSON summary reports both repairs (`records`, `serving`).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clawrl::gateway::logprobs::TokenBytes;
use clawrl::gateway::{TurnEnd, TurnRecord};
use clawrl_actors::loops::{read_records, RecordLine};
use serde_json::{json, Value};

use crate::personal_run::{self, PersonalRun, SpecParams};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

/// Generous: every wait ends as soon as its condition holds.
const LONG: Duration = Duration::from_secs(300);

/// A step limit no test reaches: the job stays open until it is killed.
const HELD_OPEN: u64 = 1_000_000;

/// Polls `f` every 50 ms until it gives a value; panics naming `what` after [`LONG`].
fn wait_for<T>(what: &str, log: impl Fn() -> String, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + LONG;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what} never happened:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The files of `dir` whose names satisfy `keep`, in name order.
fn files(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(d) => d
            .map(|e| e.unwrap().path())
            .filter(|p| keep(&p.file_name().unwrap().to_string_lossy()))
            .collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

/// The job's record files: `(prefix, complete lines, torn tail)` of each.
fn record_files(out: &Path) -> Vec<(String, Vec<RecordLine>, bool)> {
    files(&out.join("records"), |n| n.ends_with(".jsonl"))
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let prefix = name[..name.rfind(".v").expect("a versioned name")].to_string();
            let f = read_records(&p).unwrap_or_err(&p);
            (prefix, f.lines, f.torn_tail)
        })
        .collect()
}

trait UnwrapOrErr<T> {
    fn unwrap_or_err(self, p: &Path) -> T;
}

impl<T, E: std::fmt::Display> UnwrapOrErr<T> for Result<T, E> {
    fn unwrap_or_err(self, p: &Path) -> T {
        self.unwrap_or_else(|e| panic!("{} does not parse: {e}", p.display()))
    }
}

/// Whether a trainer step is on record and a checkpoint is complete.
fn stepped_and_checkpointed(out: &Path) -> bool {
    out.join("checkpoints/latest").exists()
        && record_files(out)
            .iter()
            .any(|(_, lines, _)| lines.iter().any(|l| l.kind == "trainer_step"))
}

/// `(version, steps)` of the newest complete checkpoint.
fn checkpoint(out: &Path) -> (u64, u64) {
    let root = out.join("checkpoints");
    let name = std::fs::read_to_string(root.join("latest")).unwrap();
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join(name.trim()).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    (
        state["version"].as_u64().unwrap(),
        state["steps"].as_u64().unwrap(),
    )
}

/// Samples in the trainer's pending journal (a torn last line is no sample).
fn journaled(out: &Path) -> u64 {
    std::fs::read_to_string(out.join("checkpoints/pending.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).is_ok())
        .count() as u64
}

/// The newest version a trainer step of the records reached.
fn newest_step_version(out: &Path) -> u64 {
    record_files(out)
        .iter()
        .flat_map(|(_, lines, _)| lines.iter())
        .filter(|l| l.kind == "trainer_step")
        .map(|l| l.version)
        .max()
        .unwrap()
}

/// `turn` records less `judge` and `lost` ones, per (session, turn), over every record file:
/// what is left is what a crash took before the turn was judged.
fn unsettled_turns(out: &Path) -> u64 {
    let mut open: HashMap<(String, u64), i64> = HashMap::new();
    for (_, lines, _) in record_files(out) {
        for l in lines {
            let delta = match l.kind.as_str() {
                "turn" => 1,
                "judge" | "lost" => -1,
                _ => continue,
            };
            let key = (
                l.record["session_id"].as_str().unwrap().to_string(),
                l.record["turn"].as_u64().unwrap(),
            );
            *open.entry(key).or_default() += delta;
        }
    }
    assert!(
        open.values().all(|n| *n >= 0),
        "a judge record without its turn: {open:?}"
    );
    open.values().map(|n| *n as u64).sum()
}

/// Checks that every record file parses whole: no torn tail is left.
fn assert_records_whole(out: &Path) {
    for (prefix, lines, torn) in record_files(out) {
        assert!(!torn, "a torn line left in a {prefix} record file");
        assert!(lines.iter().all(|l| !l.kind.is_empty()));
    }
}

/// Leaves a torn last line in `path`, as a kill in the middle of a write does (the kill rarely
/// lands inside one), unless one is there already.
fn tear(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    if text.is_empty() || text.ends_with('\n') {
        let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
        std::io::Write::write_all(&mut f, b"{\"version\":0,\"kind\":\"tu").unwrap();
    }
}

fn first_record_file(out: &Path) -> PathBuf {
    files(&out.join("records"), |n| n.ends_with(".jsonl"))
        .into_iter()
        .next()
        .unwrap()
}

fn torn_record_files(out: &Path) -> u64 {
    record_files(out).iter().filter(|(_, _, t)| *t).count() as u64
}

/// A child process's stdout, collected on a thread, and its stderr, kept for messages.
struct Proc {
    child: Child,
    stdout: Option<std::thread::JoinHandle<String>>,
    log: Arc<Mutex<String>>,
}

impl Proc {
    /// `clawrl run --json --out OUT SPEC`.
    fn run(spec: &Path, out: &Path) -> Self {
        let (mut child, log) = personal_run::spawn_run(spec, out, |_| {});
        let mut stdout = child.stdout.take().unwrap();
        let stdout = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s
        });
        Proc {
            child,
            stdout: Some(stdout),
            log,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits (bounded) for the process to end by itself; its JSON summary.
    fn summary(mut self) -> Value {
        let log = self.log.clone();
        let child = &mut self.child;
        let status = wait_for(
            "the re-run's end",
            || log.lock().unwrap().clone(),
            || child.try_wait().unwrap(),
        );
        let log = self.log();
        assert!(status.success(), "clawrl run failed ({status}): {log}");
        let stdout = self.stdout.take().unwrap().join().unwrap();
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout}\n{log}"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rl_spec(max_steps: u64) -> String {
    format!(
        r#"kind = "rl"
name = "crash-run-rl"
seed = 13
[policy]
checkpoint = "{FIXTURE}"
max_new_tokens = 6
max_context = 512
[judge]
backend = "scripted"
votes = 1
rules = [{{ pattern = "(?i)wrong", score = -1 }}, {{ pattern = "(?i)thanks", score = 1 }}]
[method]
kind = "binary"
[optim]
batch_size = 2
lr = 1e-3
clip = 0.2
kl = 0.0
staleness = 1000
checkpoint_every = 1
[env]
kind = "scripted"
parallelism = 2
tasks = "tasks.jsonl"
[stop]
max_steps = {max_steps}
"#
    )
}

#[test]
fn an_rl_run_killed_with_sigkill_resumes_on_the_same_out_with_nothing_missing() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tasks.jsonl"),
        concat!(
            "{\"id\":\"a\",\"instruction\":\"Say hello.\",\"replies\":[\"No, wrong.\",\"Thanks, great.\"]}\n",
            "{\"id\":\"b\",\"instruction\":\"Count to three.\",\"replies\":[\"Good, thanks.\",\"Wrong again.\"]}\n",
        ),
    )
    .unwrap();
    let job = dir.path().join("job.toml");
    let out = dir.path().join("run");

    // Held open by its step limit; killed once a step and its checkpoint are on disk.
    std::fs::write(&job, rl_spec(HELD_OPEN)).unwrap();
    let first = Proc::run(&job, &out);
    wait_for(
        "a trainer step and a checkpoint",
        || first.log(),
        || stepped_and_checkpointed(&out).then_some(()),
    );
    drop(first); // SIGKILL, then reaped

    // What the kill left, a torn line included.
    tear(&first_record_file(&out));
    let (ck_version, ck_steps) = checkpoint(&out);
    let journal = journaled(&out);
    let torn = torn_record_files(&out);
    assert!(torn >= 1);
    let unsettled = unsettled_turns(&out);
    let newest = newest_step_version(&out);
    let crashed: Vec<String> = record_files(&out).into_iter().map(|f| f.0).collect();

    // The re-run on the same `--out` ends by itself two steps past the checkpoint.
    std::fs::write(&job, rl_spec(ck_steps + 2)).unwrap();
    let s = Proc::run(&job, &out).summary();
    let t = &s["trainer"];
    assert_eq!(t["resumed_from"].as_u64(), Some(ck_version), "{t}");
    assert_eq!(t["steps"].as_u64(), Some(ck_steps + 2), "{t}");
    assert!(
        t["version"].as_u64().unwrap() > newest,
        "versions count on: {t}"
    );
    let job_id = s["job"].as_str().unwrap().to_string();
    assert!(
        !crashed.contains(&job_id),
        "the re-run records under a new prefix"
    );
    for (prefix, lines, _) in record_files(&out) {
        for l in lines.iter().filter(|l| l.kind == "trainer_step") {
            if prefix == job_id {
                assert!(l.version > newest, "a re-run step at {}", l.version);
            }
        }
    }

    // Every record file parses whole; the torn lines the kill left were cut and counted.
    assert_records_whole(&out);
    let r = &s["records"];
    assert_eq!(r["torn_lines_cut"].as_u64(), Some(torn), "{r}");
    // Counts balance, with what the crash lost counted: the journaled samples replayed, the
    // turns it never judged recorded as lost, and every turn now judged or lost.
    assert_eq!(s["balanced"], true, "{s}");
    assert_eq!(t["recovered"].as_u64(), Some(journal), "{t}");
    let c = &s["counts"];
    assert_eq!(
        t["produced"].as_u64().unwrap(),
        c["samples_submitted"].as_u64().unwrap() + journal,
        "{s}"
    );
    assert_eq!(r["lost_by_crash"].as_u64(), Some(unsettled), "{r}");
    assert_eq!(unsettled_turns(&out), 0, "a turn neither judged nor lost");
    eprintln!(
        "rl crash: checkpoint v{ck_version} (step {ck_steps}), newest step v{newest}; \
         {torn} torn record files, {journal} journaled samples, {unsettled} turns lost"
    );
    assert_eq!(
        c["turns"].as_u64().unwrap(),
        c["judged"].as_u64().unwrap() + c["unjudged"].as_u64().unwrap(),
        "{c}"
    );
}

const KEY: &str = "sk-crash-run";

/// An answer a client received: its session, the messages its request carried, its content,
/// the exact bytes of each token it was given (`logprobs`: every sampled token but a final stop
/// token, reasoning included), and when it arrived.
#[derive(Debug, Clone)]
struct Answer {
    session: String,
    messages: usize,
    text: String,
    tokens: Vec<Vec<u8>>,
    at: Instant,
}

/// The bytes of each token of `logprobs.content` entries.
fn token_bytes(entries: &Value) -> Vec<Vec<u8>> {
    entries
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    e["bytes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|b| b.as_u64().unwrap() as u8)
                        .collect()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether recorded `ids` are exactly the tokens the client was given (a final stop token,
/// which has no entry, aside).
fn same_tokens(bytes: &TokenBytes, ids: &[u32], got: &[Vec<u8>]) -> bool {
    let n = got.len();
    (ids.len() == n || ids.len() == n + 1)
        && ids[..n]
            .iter()
            .zip(got)
            .all(|(&id, b)| bytes.of(id) == b.as_slice())
}

/// One chat completion (streamed or not) with its tokens' log-probs; `None` once the server is
/// gone.
async fn ask(
    http: &reqwest::Client,
    base: &str,
    session: &str,
    messages: &[Value],
    stream: bool,
    done: bool,
) -> Option<(String, Vec<Vec<u8>>)> {
    let mut req = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(KEY)
        .header("X-Session-Id", session)
        .json(
            &json!({"model": "tiny", "messages": messages, "max_tokens": 6, "stream": stream,
            "logprobs": true}),
        );
    if done {
        req = req.header("X-Session-Done", "1");
    }
    let resp = req.send().await.ok()?;
    if resp.status() != 200 {
        return None;
    }
    if stream {
        let body = resp.text().await.ok()?;
        if !body.contains("data: [DONE]") {
            return None;
        }
        let (mut text, mut tokens) = (String::new(), Vec::new());
        for d in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if d == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(d).ok()?;
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
            }
            tokens.extend(token_bytes(&v["choices"][0]["logprobs"]["content"]));
        }
        Some((text, tokens))
    } else {
        let v: Value = resp.json().await.ok()?;
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        Some((text, token_bytes(&v["choices"][0]["logprobs"]["content"])))
    }
}

/// A client: conversations of four main turns (praised, corrected, praised, then ended), one
/// after another, streamed every other turn, until `stop` or the server is gone. Clients 3 and
/// 4 walk away after their second answer: it waits for its next state until the kill.
async fn client(i: usize, base: String, stop: Arc<AtomicBool>, got: Arc<Mutex<Vec<Answer>>>) {
    let http = reqwest::Client::new();
    for k in 0.. {
        let session = format!("crash-run-c{i}-{k}");
        let mut messages = vec![json!({"role": "user", "content": format!("Question {i}.{k}?")})];
        for t in 0..4 {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let Some((text, tokens)) =
                ask(&http, &base, &session, &messages, (i + t) % 2 == 1, t == 3).await
            else {
                return;
            };
            got.lock().unwrap().push(Answer {
                session: session.clone(),
                messages: messages.len(),
                text: text.clone(),
                tokens,
                at: Instant::now(),
            });
            if i >= 3 && t == 1 {
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                return;
            }
            messages.push(json!({"role": "assistant", "content": text}));
            let next = if t % 2 == 0 {
                "Thanks, that helps!"
            } else {
                "That is wrong, try again."
            };
            messages.push(json!({"role": "user", "content": next}));
        }
    }
}

/// Every record of the gateway's journals `{served,turns}-v*.jsonl` in `data`; torn tails
/// counted, not parsed.
fn journal(data: &Path, which: &str) -> (Vec<TurnRecord>, u64) {
    let mut recs = Vec::new();
    let mut torn = 0;
    for p in files(data, |n| {
        n.starts_with(&format!("{which}-v")) && n.ends_with(".jsonl")
    }) {
        let text = std::fs::read_to_string(&p).unwrap();
        let complete = match text.rfind('\n') {
            Some(i) => &text[..i + 1],
            None => "",
        };
        if complete.len() < text.len() {
            torn += 1;
        }
        for l in complete.lines().filter(|l| !l.trim().is_empty()) {
            recs.push(serde_json::from_str(l).unwrap_or_err(&p));
        }
    }
    (recs, torn)
}

/// What pairs an answered turn with its complete record.
fn key(r: &TurnRecord) -> (String, u64, u64, Vec<u32>, Vec<u32>) {
    (
        r.session_id.clone(),
        r.version,
        r.created,
        r.prompt_ids.clone(),
        r.response_ids.clone(),
    )
}

/// Answered turns without a complete record.
fn incomplete(served: &[TurnRecord], turns: &[TurnRecord]) -> u64 {
    let mut complete: HashMap<_, usize> = HashMap::new();
    for r in turns {
        *complete.entry(key(r)).or_default() += 1;
    }
    served
        .iter()
        .filter(|r| match complete.get_mut(&key(r)) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .count() as u64
}

/// A counter of the gateway's `/metrics`.
async fn metric(base: &str, name: &str) -> u64 {
    let text = reqwest::Client::new()
        .get(format!("{base}/metrics"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}")) as u64
}

#[test]
fn a_personal_run_killed_under_load_loses_no_answer_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let data = out.join("turns");
    let job = dir.path().join("personal.toml");
    let spec = personal_run::spec(
        &out,
        &SpecParams {
            name: "crash-run-personal",
            seed: 17,
            key: KEY,
            votes: 1,
            kl: 0.0,
        },
    )
    .replace("staleness = 8\n", "staleness = 8\ncheckpoint_every = 1\n");
    assert!(spec.contains("checkpoint_every = 1"));
    std::fs::write(&job, &spec).unwrap();
    let tok = tokenizers::Tokenizer::from_file(format!("{FIXTURE}/tokenizer.json")).unwrap();
    let bytes = TokenBytes::new(&tok);

    // Five concurrent sessions load the job (it runs until stopped); SIGKILL once a trainer
    // step and its checkpoint are on disk.
    let run = PersonalRun::start(&job, &out, LONG);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let got = Arc::new(Mutex::new(Vec::<Answer>::new()));
    let clients: Vec<_> = (0..5)
        .map(|i| rt.spawn(client(i, run.base.clone(), stop.clone(), got.clone())))
        .collect();
    // An answer more than a second old by then, or "a second before the kill" tests nothing.
    let answered_long_ago = || {
        let got = got.lock().unwrap();
        got.iter()
            .any(|a| a.at.elapsed() > Duration::from_millis(1500))
    };
    wait_for(
        "a trainer step, a checkpoint, and an answer 1.5 s old",
        || run.log(),
        || (stepped_and_checkpointed(&out) && answered_long_ago()).then_some(()),
    );
    let killed_at = Instant::now();
    drop(run); // SIGKILL, then reaped
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        rt.block_on(c).unwrap();
    }
    let answers = got.lock().unwrap().clone();

    // What the kill left, torn lines included.
    tear(&first_record_file(&out));
    tear(&files(&data, |n| n.starts_with("served-v"))[0]);
    let (ck_version, _) = checkpoint(&out);
    let journal_samples = journaled(&out);
    let torn_records = torn_record_files(&out);
    let newest = newest_step_version(&out);
    let (served, torn_served) = journal(&data, "served");
    assert!(torn_records >= 1 && torn_served >= 1);
    let (turns, torn_turns) = journal(&data, "turns");
    let lost = incomplete(&served, &turns);
    let unsettled = unsettled_turns(&out);

    // Every answer received more than a second before the kill is in the served journal, its
    // ids exactly the tokens the client got.
    let old: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.at + Duration::from_secs(1) < killed_at)
        .collect();
    assert!(!old.is_empty(), "no answer came a second before the kill");
    for a in &old {
        let found = served.iter().any(|r| {
            r.session_id == a.session
                && serde_json::to_value(&r.messages)
                    .unwrap()
                    .as_array()
                    .map(|m| m.len())
                    == Some(a.messages)
                && same_tokens(&bytes, &r.response_ids, &a.tokens)
        });
        assert!(
            found,
            "an answer ({:?}) is missing from the served journal: {a:?}",
            a.text
        );
    }

    // The re-run on the same `--out`: the trainer resumes, the gateway serves its lineage.
    let run = PersonalRun::start(&job, &out, LONG);
    let base = run.base.clone();
    let (torn_cut, lost_counted) = rt.block_on(async {
        (
            metric(&base, "clawrl_gateway_journal_torn_lines_cut_total").await,
            metric(&base, "clawrl_gateway_turns_lost_by_crash_total").await,
        )
    });
    let served_version = rt.block_on(async {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + LONG;
        loop {
            let (b, _) = personal_run::chat(
                &http,
                &base,
                KEY,
                json!([{"role": "user", "content": "hi"}]),
                &[("X-Turn-Type", "side")],
            )
            .await;
            let v = b["version"].as_u64().unwrap();
            if v > newest {
                break v;
            }
            assert!(
                Instant::now() < deadline,
                "never served the resumed lineage"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let s = run.stop();

    // The trainer resumed from the last checkpoint; versions count on.
    let t = &s["agents"][0]["trainer"];
    assert_eq!(t["resumed_from"].as_u64(), Some(ck_version), "{t}");
    assert!(served_version > newest && t["version"].as_u64().unwrap() > newest);

    // Every file parses whole; the torn lines were cut and counted.
    assert_records_whole(&out);
    assert_eq!(
        s["agents"][0]["records"]["torn_lines_cut"].as_u64(),
        Some(torn_records)
    );
    let (served_after, torn) = journal(&data, "served");
    assert_eq!(torn, 0);
    let (turns_after, torn) = journal(&data, "turns");
    assert_eq!(torn, 0);
    assert_eq!(torn_cut, torn_served + torn_turns);

    // Counts balance with what the crash lost counted: every answered turn has its complete
    // record, those the crash took recorded as lost; journaled samples replayed; turns the
    // pipeline never judged recorded as lost.
    assert!(
        lost >= 2,
        "the walked-away answers wait for their next state"
    );
    assert_eq!(lost_counted, lost);
    assert_eq!(incomplete(&served_after, &turns_after), 0);
    // The summary says what the restart repaired, as `/metrics` did, and the journals balance:
    // what was there, plus what the crash lost (recorded now), plus what the re-run wrote.
    let g = &s["serving"];
    assert_eq!(g["torn_lines_cut"].as_u64(), Some(torn_cut), "{g}");
    assert_eq!(g["lost_by_crash"].as_u64(), Some(lost), "{g}");
    let n = |v: &Value| v.as_u64().unwrap();
    assert_eq!(
        turns_after.len() as u64,
        turns.len() as u64 + lost + n(&g["records_written"]),
        "{g}"
    );
    assert_eq!(
        served_after.len() as u64,
        served.len() as u64 + n(&g["served_written"]),
        "{g}"
    );
    assert_eq!(
        n(&g["served_written"]),
        n(&g["sessions"]["main_turns"]),
        "{g}"
    );
    assert_eq!(n(&g["record_write_errors"]), 0, "{g}");
    let marked = turns_after
        .iter()
        .filter(|r| r.end == Some(TurnEnd::Lost))
        .count() as u64;
    assert_eq!(marked, lost);
    assert_eq!(s["balanced"], true, "{s}");
    assert_eq!(t["recovered"].as_u64(), Some(journal_samples), "{t}");
    assert_eq!(
        t["produced"].as_u64().unwrap(),
        s["counts"]["samples_submitted"].as_u64().unwrap() + journal_samples,
        "{s}"
    );
    assert_eq!(
        s["agents"][0]["records"]["lost_by_crash"].as_u64(),
        Some(unsettled)
    );
    assert_eq!(unsettled_turns(&out), 0, "a turn neither judged nor lost");
    eprintln!(
        "personal crash: {} answers ({} a second before the kill), {} served; checkpoint \
         v{ck_version}, newest step v{newest}; {torn_records} torn record files, {} torn \
         journals; {journal_samples} journaled samples; {lost} answered turns and {unsettled} \
         tapped turns lost",
        answers.len(),
        old.len(),
        served.len(),
        torn_served + torn_turns
    );
}
