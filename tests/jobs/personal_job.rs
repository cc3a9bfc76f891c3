//! The `personal` job kind through the binary: `clawrl run` serves the fixture policy over the
//! gateway, sessions driven over HTTP are judged by a scripted judge from the user's next
//! message and trained on (batch 2), the gateway then answers with a newer weight version, side
//! turns give no samples, and at SIGTERM the job drains and prints a summary whose counts
//! balance, with judge records on disk.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::personal_run::{self, PersonalRun, SpecParams};

const KEY: &str = "sk-personal-test";

fn spec(out: &Path) -> String {
    personal_run::spec(
        out,
        &SpecParams {
            name: "personal-test",
            seed: 3,
            key: KEY,
            votes: 1,
            kl: 0.0,
        },
    )
}

async fn chat(
    http: &reqwest::Client,
    base: &str,
    messages: Value,
    headers: &[(&str, &str)],
) -> (Value, String) {
    personal_run::chat(http, base, KEY, messages, headers).await
}

fn content(body: &Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personal_job_trains_from_gateway_turns_and_serves_the_new_version() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = dir.path().join("personal.toml");
    std::fs::write(&job, spec(&out)).unwrap();
    let run = PersonalRun::start(&job, &out, Duration::from_secs(60));
    let base = run.base.clone();
    let http = reqwest::Client::new();

    // Three sessions of three main turns: the user praises turn 0, corrects turn 1, and ends
    // the session (turn 2 is kept without a next state, so unjudged). A side session runs too.
    for s in 0..3 {
        let sid = format!("user-{s}");
        let h = [("X-Session-Id", sid.as_str())];
        let mut messages = vec![json!({"role": "user", "content": format!("Explain item {s}.")})];
        let (b, _) = chat(&http, &base, json!(messages), &h).await;
        assert_eq!(b["session_id"], sid.as_str());
        messages.push(json!({"role": "assistant", "content": content(&b)}));
        messages.push(json!({"role": "user", "content": "Thanks, that helps!"}));
        let (b, _) = chat(&http, &base, json!(messages), &h).await;
        messages.push(json!({"role": "assistant", "content": content(&b)}));
        messages.push(json!({"role": "user", "content": "That is wrong, try again."}));
        let side = [("X-Session-Id", "side-task"), ("X-Turn-Type", "side")];
        chat(
            &http,
            &base,
            json!([{"role": "user", "content": "Summarize: thanks"}]),
            &side,
        )
        .await;
        let done = [("X-Session-Id", sid.as_str()), ("X-Session-Done", "1")];
        chat(&http, &base, json!(messages), &done).await;
    }

    // 6 judged turns with reward ±1 → 6 samples → 3 steps of 2; the gateway installs them.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (body, header) = loop {
        let probe = [("X-Turn-Type", "side")];
        let (b, h) = chat(
            &http,
            &base,
            json!([{"role": "user", "content": "hi"}]),
            &probe,
        )
        .await;
        if b["version"].as_u64().unwrap_or(0) >= 1 {
            break (b, h);
        }
        if Instant::now() > deadline {
            panic!("the gateway never served a trained version: {}", run.log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(header, body["version"].as_u64().unwrap().to_string());

    // Ctrl-C equivalent: drain and print the summary.
    let s = run.stop();
    assert_eq!(s["stopped_by"], "interrupted", "{s}");
    assert_eq!(s["balanced"], true, "{s}");
    let t = &s["trainer"];
    assert!(t["steps"].as_u64().unwrap() >= 1, "{t}");
    assert_eq!(t["produced"], 6, "binary: the ±1 turns only: {t}");
    let c = &s["counts"];
    assert_eq!(c["turns"], 9, "main turns only: {c}");
    assert_eq!(c["sessions_started"], 3, "{c}");
    assert_eq!(s["turns_with_next_state"], 6, "{s}");
    assert_eq!(
        (c["judged"].as_u64(), c["unjudged"].as_u64()),
        (Some(6), Some(3))
    );
    assert_eq!(c["samples_submitted"], 6, "{c}");
    assert!(s["gateway"]["version"].as_u64().unwrap() >= 1, "{s}");

    // Records: a judge record per main turn, a sample record per sample, trainer steps; nothing
    // of the side session.
    let mut kinds = std::collections::HashMap::<String, usize>::new();
    for e in std::fs::read_dir(out.join("records")).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        assert!(
            !text.contains("side-task"),
            "a side turn reached the records"
        );
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            *kinds
                .entry(v["kind"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
        }
    }
    assert_eq!(kinds.get("judge"), Some(&9), "{kinds:?}");
    assert_eq!(kinds.get("sample"), Some(&6), "{kinds:?}");
    assert!(
        kinds.get("trainer_step").copied().unwrap_or(0) >= 1,
        "{kinds:?}"
    );
}
