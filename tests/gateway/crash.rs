//! Nothing answered is lost when the gateway process is killed: `clawrl serve` answers main turns
//! in several sessions (streamed and not), none of which has its next state yet, so each lives
//! only in the session table; a second after the last answer the process gets SIGKILL, and every
//! answer is in the served journal (`served-v0.jsonl`, mode 0600), its token ids decoding to
//! exactly the text the client was given.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use clawrl::gateway::TurnRecord;
use serde_json::{json, Value};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

/// The text of recorded ids, a final stop token (`<|im_end|>` = 2) excluded: a record's ids must
/// decode to exactly what the client received.
fn decode(ids: &[u32]) -> String {
    let tok = tokenizers::Tokenizer::from_file(format!("{FIXTURE}/tokenizer.json")).unwrap();
    let ids = match ids.last() {
        Some(2) => &ids[..ids.len() - 1],
        _ => ids,
    };
    tok.decode(ids, false).unwrap()
}

#[test]
fn answered_turns_survive_a_sigkill_in_the_served_journal() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &cfg,
        format!(
            "api_keys = [\"k\"]\nmodel_name = \"tiny\"\ndata_dir = {:?}\n",
            data.to_str().unwrap()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model",
            FIXTURE,
            "--config",
        ])
        .arg(&cfg)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting clawrl serve");
    let base = super::venv::served_address(&mut child);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let answers: Vec<(String, String)> = rt.block_on(async {
        let client = reqwest::Client::new();
        let mut answers = Vec::new();
        for i in 0..4 {
            let stream = i % 2 == 1;
            let session = format!("s{i}");
            let resp = client
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("k")
                .header("X-Session-Id", &session)
                .json(&json!({
                    "model": "tiny",
                    "messages": [{"role": "user", "content": format!("question {i}")}],
                    "max_tokens": 10,
                    "temperature": 0.9,
                    "seed": i,
                    "stream": stream,
                }))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let text = if stream {
                let body = resp.text().await.unwrap();
                body.lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter(|d| *d != "[DONE]")
                    .map(|d| serde_json::from_str::<Value>(d).unwrap())
                    .filter_map(|v| {
                        v["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(String::from)
                    })
                    .collect::<String>()
            } else {
                let v: Value = resp.json().await.unwrap();
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or("")
                    .to_string()
            };
            answers.push((session, text));
        }
        answers
    });

    // The durability contract: what was answered more than a second ago is on disk.
    std::thread::sleep(Duration::from_secs(1));
    child.kill().unwrap();
    child.wait().unwrap();

    let served = data.join("served-v0.jsonl");
    let mode = std::fs::metadata(&served).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "served journal mode {mode:o}");
    let records: Vec<TurnRecord> = std::fs::read_to_string(&served)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line parses"))
        .collect();
    assert_eq!(records.len(), answers.len(), "{records:?}");
    for (session, text) in &answers {
        let r = records
            .iter()
            .find(|r| &r.session_id == session)
            .unwrap_or_else(|| panic!("session {session} lost"));
        assert_eq!(&decode(&r.response_ids), text, "session {session}");
        assert_eq!(r.response_ids.len(), r.logprobs.len());
        assert!(r.next_state.is_none() && r.end.is_none());
    }
    // None of them had completed, so the turn file holds none.
    let turns = data.join("turns-v0.jsonl");
    assert!(
        !Path::new(&turns).exists() || std::fs::read_to_string(&turns).unwrap().is_empty(),
        "a pending turn was recorded as complete"
    );
}
