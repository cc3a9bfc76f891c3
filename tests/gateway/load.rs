//! Load: 100 concurrent sessions talk for 60 s to the gateway of a `personal` job (`clawrl run`,
//! the qwen3-tiny fixture) while its trainer trains on what they say, over real HTTP, streamed
//! and not, with next states, through a deliberately tiny record queue. A quarter of the clients
//! leave mid-stream at random (after one to three content chunks of a 64-token answer) and ask
//! again. No answer is a 5xx, and the books balance, read from the job once every client is
//! done and again from its summary once it stopped:
//! - every session opened is ended by its client, ended idle (or at shutdown), or still open;
//! - every main turn served is completed with a next state, kept without one, or pending in an
//!   open session;
//! - every request a client sent ended as a served main turn or an abandoned one;
//! - every served turn is journaled and recorded, every answer a client got whole is in the turn
//!   files with its content, and every abandoned turn is recorded as such and never reaches the
//!   job (which judges and trains on exactly the served turns, session by session).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clawrl::gateway::{TurnEnd, TurnRecord};
use clawrl_actors::loops::read_records;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::personal_run::{self, PersonalRun, SpecParams};

const KEY: &str = "sk-load";
const CLIENTS: usize = 100;
/// How long the clients keep starting turns: the requirement, not a guess at speed.
const LOAD: Duration = Duration::from_secs(60);
/// The tokens a leaving client asks for: a stream long enough to leave in the middle of.
const LONG_ANSWER: u32 = 64;
/// Generous: every wait ends as soon as its condition holds.
const LONG: Duration = Duration::from_secs(300);

/// What the clients saw, all together.
#[derive(Default)]
struct Seen {
    /// Requests answered whole (streamed to `[DONE]`, or a JSON body).
    whole: u64,
    /// Streams a client left before the end.
    left: u64,
    /// Statuses other than 200, and transport errors, with the client that got them.
    failures: Vec<String>,
    /// `(session, content)` of every answer received whole.
    answers: Vec<(String, String)>,
    /// The newest weight version that answered.
    newest_version: u64,
}

/// The content of an SSE body's chunks so far, and whether `[DONE]` came.
fn sse_content(body: &str) -> (Vec<String>, bool, u64) {
    let (mut pieces, mut done, mut version) = (Vec::new(), false, 0);
    for d in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d == "[DONE]" {
            done = true;
            continue;
        }
        // A line cut by the read so far is not a chunk yet.
        let Ok(v) = serde_json::from_str::<Value>(d) else {
            continue;
        };
        version = version.max(v["version"].as_u64().unwrap_or(0));
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            if !c.is_empty() {
                pieces.push(c.to_string());
            }
        }
    }
    (pieces, done, version)
}

/// One client: conversations of four main turns (praised, corrected, praised, then ended with
/// `X-Session-Done`), one after another, every other turn streamed, until the load's end. A
/// leaving client (`leaves`) asks for a long streamed answer about one attempt in three and
/// drops it after one to three content chunks, then asks again; one that came whole before it
/// could leave is an answer like any other.
async fn client(i: usize, base: String, end: Instant, leaves: bool, seen: Arc<Mutex<Seen>>) {
    let http = reqwest::Client::new();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(i as u64);
    for k in 0.. {
        let session = format!("load-c{i}-{k}");
        let mut messages = vec![json!({"role": "user", "content": format!("Question {i}.{k}?")})];
        // A long answer can also come whole (the client read it late, or the model stopped
        // early): then it stays in the history. Decoded text can take several times its tokens
        // when encoded again (one run's history of three reached 537 tokens), so a conversation
        // holds at most one, and the prompt stays inside the fixture's 512 positions.
        let mut long_kept = false;
        for t in 0..4 {
            let (text, long) = loop {
                if Instant::now() >= end {
                    return;
                }
                let leave_after = (leaves && !long_kept && rng.random_ratio(1, 3))
                    .then(|| rng.random_range(1..=3));
                let stream = leave_after.is_some() || (i + t) % 2 == 1;
                let max_tokens = if leave_after.is_some() {
                    LONG_ANSWER
                } else {
                    6
                };
                let mut req = http
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth(KEY)
                    .header("X-Session-Id", &session)
                    .json(&json!({"model": "tiny", "messages": messages,
                                  "max_tokens": max_tokens, "stream": stream}));
                if t == 3 {
                    req = req.header("X-Session-Done", "1");
                }
                let fail = |what: String| {
                    seen.lock()
                        .unwrap()
                        .failures
                        .push(format!("client {i}: {what}"))
                };
                let mut r = match req.send().await {
                    Ok(r) => r,
                    Err(e) => return fail(format!("sending: {e}")),
                };
                if r.status() != 200 {
                    let status = r.status();
                    let body = r.text().await.unwrap_or_default();
                    return fail(format!("status {status}: {body}"));
                }
                if !stream {
                    let v: Value = match r.json().await {
                        Ok(v) => v,
                        Err(e) => return fail(format!("reading an answer: {e}")),
                    };
                    let mut s = seen.lock().unwrap();
                    s.newest_version = s.newest_version.max(v["version"].as_u64().unwrap_or(0));
                    let text = v["choices"][0]["message"]["content"].as_str();
                    break (text.unwrap_or("").to_string(), false);
                }
                // Streamed: read chunk by chunk, leaving after `leave_after` content chunks.
                let mut body = String::new();
                let whole = loop {
                    match r.chunk().await {
                        Ok(Some(c)) => body.push_str(&String::from_utf8_lossy(&c)),
                        Ok(None) => break true,
                        Err(e) => return fail(format!("reading a stream: {e}")),
                    }
                    let (pieces, done, _) = sse_content(&body);
                    if !done && leave_after.is_some_and(|n| pieces.len() >= n) {
                        break false;
                    }
                };
                let (pieces, done, version) = sse_content(&body);
                let mut s = seen.lock().unwrap();
                s.newest_version = s.newest_version.max(version);
                if !whole {
                    drop(r); // leaves mid-stream
                    s.left += 1;
                    continue; // and asks again
                }
                if !done {
                    drop(s);
                    return fail(format!("a stream ended without [DONE]: {body}"));
                }
                break (pieces.concat(), leave_after.is_some());
            };
            long_kept |= long;
            {
                let mut s = seen.lock().unwrap();
                s.whole += 1;
                s.answers.push((session.clone(), text.clone()));
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

/// The gateway's `/metrics` as name → value (series with labels keep them in the name).
async fn metrics(base: &str) -> HashMap<String, f64> {
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
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            Some((name.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// Every record of the gateway's `{which}-v*.jsonl` files in `data` (each line must parse).
fn journal(data: &Path, which: &str) -> Vec<TurnRecord> {
    let mut recs = Vec::new();
    for e in std::fs::read_dir(data).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with(&format!("{which}-v")) && name.ends_with(".jsonl")) {
            continue;
        }
        for l in std::fs::read_to_string(&p).unwrap().lines() {
            recs.push(
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", p.display())),
            );
        }
    }
    recs
}

/// The job's `turn` records, counted by session.
fn job_turns(out: &Path) -> HashMap<String, u64> {
    let mut n = HashMap::new();
    for e in std::fs::read_dir(out.join("records")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "jsonl") {
            continue;
        }
        let f = read_records(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!f.torn_tail, "{} ends torn", p.display());
        for l in f.lines.iter().filter(|l| l.kind == "turn") {
            *n.entry(l.record["session_id"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    n
}

#[test]
fn a_hundred_sessions_for_a_minute_while_training_without_5xx_and_the_books_balance() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = dir.path().join("load.toml");
    let spec = personal_run::spec(
        &out,
        &SpecParams {
            name: "load",
            seed: 23,
            key: KEY,
            votes: 1,
            kl: 0.0,
        },
    )
    // One key for every client: room for each client's request and the streams it left.
    .replace(
        "default_max_tokens = 6\n",
        "default_max_tokens = 6\nmax_in_flight_per_key = 1024\nrecord_queue = 2\n",
    );
    assert!(spec.contains("record_queue = 2"));
    std::fs::write(&job, &spec).unwrap();

    let run = PersonalRun::start(&job, &out, LONG);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let started = Instant::now();
    let end = started + LOAD;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| rt.spawn(client(i, run.base.clone(), end, i % 4 == 3, seen.clone())))
        .collect();
    for c in clients {
        rt.block_on(c).unwrap();
    }
    let load_s = started.elapsed().as_secs_f64();

    // Every client is done; once the streams they left have ended too, the session table
    // accounts for everything.
    let m = rt.block_on(async {
        let deadline = Instant::now() + LONG;
        loop {
            let m = metrics(&run.base).await;
            if m["clawrl_gateway_requests_in_flight"] == 0.0 {
                break m;
            }
            assert!(Instant::now() < deadline, "requests never finished: {m:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let five = m
        .iter()
        .filter(|(k, _)| k.starts_with("clawrl_gateway_requests_total") && k.contains("status=\"5"))
        .collect::<Vec<_>>();
    assert!(five.is_empty(), "5xx answers: {five:?}");
    let g = |name: &str| m[name] as u64;
    let open = g("clawrl_gateway_sessions_open");
    assert_eq!(
        g("clawrl_gateway_sessions_started_total"),
        g("clawrl_gateway_sessions_ended_done_total")
            + g("clawrl_gateway_sessions_ended_idle_total")
            + open,
        "sessions opened = ended + open: {m:?}"
    );
    let settled = g("clawrl_gateway_turns_with_next_state_total")
        + g("clawrl_gateway_last_turns_kept_total")
        + g("clawrl_gateway_last_turns_dropped_total");
    let main = g("clawrl_gateway_main_turns_total");
    assert!(
        settled <= main && main - settled <= open,
        "each main turn is settled or the one pending turn of an open session: {m:?}"
    );

    let s = run.stop();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(seen.failures.is_empty(), "{:#?}", seen.failures);

    // The gateway's books once it stopped (shutdown ended every open session).
    let sv = &s["serving"];
    let n = |v: &Value| {
        v.as_u64()
            .unwrap_or_else(|| panic!("not a count: {v} in {sv}"))
    };
    let ss = &sv["sessions"];
    assert_eq!(n(&sv["responses_5xx"]), 0, "{sv}");
    assert_eq!(n(&sv["open_sessions"]), 0, "{sv}");
    assert_eq!(
        n(&ss["started"]),
        n(&ss["ended_done"]) + n(&ss["ended_idle"]),
        "{sv}"
    );
    assert_eq!(
        n(&ss["started"]),
        g("clawrl_gateway_sessions_started_total"),
        "{sv}"
    );
    let main = n(&ss["main_turns"]);
    assert_eq!(
        main,
        n(&ss["with_next_state"]) + n(&ss["kept_without_next_state"]) + n(&ss["dropped"]),
        "{sv}"
    );
    let abandoned = n(&sv["turns_abandoned"]);
    assert_eq!(
        main + abandoned,
        seen.whole + seen.left,
        "every request is a served turn or an abandoned one: {sv}"
    );
    assert!(abandoned <= seen.left, "{sv}");
    assert!(abandoned >= 1, "no stream was cut mid-answer: {sv}");
    assert_eq!(n(&sv["streams_aborted"]), abandoned, "{sv}");
    assert_eq!(n(&sv["served_written"]), main, "{sv}");
    assert_eq!(n(&sv["records_written"]), main + abandoned, "{sv}");
    assert_eq!(n(&sv["record_write_errors"]), 0, "{sv}");

    // On disk: every served turn journaled and recorded; every answer a client got whole is in
    // the turn files; the abandoned ones recorded as such.
    let data = out.join("turns");
    let served = journal(&data, "served");
    let turns = journal(&data, "turns");
    assert_eq!(served.len() as u64, main);
    assert_eq!(turns.len() as u64, main + abandoned);
    let cut: Vec<&TurnRecord> = turns
        .iter()
        .filter(|r| r.end == Some(TurnEnd::Abandoned))
        .collect();
    assert_eq!(cut.len() as u64, abandoned);
    assert!(cut.iter().all(|r| r.finish_reason == "abandoned"));
    let mut recorded: HashMap<(String, String), i64> = HashMap::new();
    for r in turns.iter().filter(|r| r.end != Some(TurnEnd::Abandoned)) {
        let content = r.response["content"].as_str().unwrap_or("").to_string();
        *recorded.entry((r.session_id.clone(), content)).or_default() += 1;
    }
    for a in &seen.answers {
        let left = recorded
            .get_mut(a)
            .unwrap_or_else(|| panic!("an answer is not in the turn files: {a:?}"));
        *left -= 1;
        assert!(
            *left >= 0,
            "an answer recorded fewer times than received: {a:?}"
        );
    }

    // The job got exactly the served turns, session by session: never an abandoned one.
    let c = &s["counts"];
    assert_eq!(n(&c["turns"]), main, "{c}");
    let mut want: HashMap<String, u64> = HashMap::new();
    for r in turns.iter().filter(|r| r.end != Some(TurnEnd::Abandoned)) {
        *want.entry(r.session_id.clone()).or_default() += 1;
    }
    assert_eq!(job_turns(&out), want, "the job's turns by session");
    assert_eq!(s["balanced"], true, "{s}");
    assert_eq!(n(&c["turns"]), n(&c["judged"]) + n(&c["unjudged"]), "{c}");

    // It trained while serving: a version it published answered a client.
    let t = &s["agents"][0]["trainer"];
    assert!(n(&t["steps"]) >= 1, "{t}");
    assert!(n(&s["agents"][0]["gateway"]["switches"]) >= 1, "{s}");
    assert!(
        seen.newest_version >= 1,
        "no trained version answered a client"
    );
    eprintln!(
        "load: {CLIENTS} sessions at a time for {load_s:.1} s: {} sessions, {} answers whole, {} \
         streams left ({abandoned} cut mid-answer), {main} main turns, 0 5xx; trainer {} steps \
         (v{}), newest version a client saw v{}",
        n(&ss["started"]),
        seen.whole,
        seen.left,
        n(&t["steps"]),
        n(&t["version"]),
        seen.newest_version,
    );
}
