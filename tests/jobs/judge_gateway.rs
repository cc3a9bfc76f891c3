//! The `openai` judge backend against clawrl's own gateway (`clawrl serve`) serving the fixture
//! model, whose untrained output is noise: every vote reaches the server, comes back as text with
//! no valid `\boxed{}`, and counts as a failed vote, so the turn is recorded as unjudged with the
//! reason and reward 0 (the failed-vote path over real HTTP).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

use clawrl::judge::openai::{OpenAiBackend, OpenAiConfig};
use clawrl::judge::{Judge, PromptOverrides, PromptSet, TurnMaterial, VoteSettings};

/// Kills the server when the test ends, however it ends.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `clawrl serve` on a free port and returns it with its base URL and model name.
fn start_gateway(data_dir: &std::path::Path) -> (Server, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_clawrl"))
        .args(["serve", "--model", "tests/fixtures/qwen3-tiny"])
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start clawrl serve");
    let stdout = child.stdout.take().unwrap();
    let server = Server(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    // "listening on http://ADDR model=NAME"
    let rest = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line from clawrl serve: {line:?}"));
    let (url, model) = rest.split_once(" model=").expect("model name in the line");
    (server, format!("{url}/v1"), model.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noise_from_our_own_gateway_gives_failed_votes_and_an_unjudged_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url, model) = start_gateway(dir.path());
    let mut config = OpenAiConfig::new(url, model);
    config.max_retries = 1;
    let backend = Arc::new(OpenAiBackend::new(config).unwrap());
    // The fixture's context is 512 tokens: short prompts, so the gateway generates (noise)
    // instead of refusing an over-long prompt.
    let prompts = PromptSet::new(&PromptOverrides {
        personal_eval: Some(
            "Reply: {{ response }}\nNext ({{ next_state_role }}): {{ next_state }}\nVerdict \\boxed{1|-1|0}:".into(),
        ),
        hint: Some("Reply: {{ response }}\nNext ({{ next_state_role }}): {{ next_state }}\nHint?".into()),
        ..Default::default()
    })
    .unwrap();
    let settings = VoteSettings {
        m: 3,
        hint_m: 2,
        max_tokens: 12,
        hint_max_tokens: 12,
        seed: Some(7),
        ..VoteSettings::default()
    };
    let judge = Judge::new(backend, Arc::new(prompts), settings).unwrap();
    let j = judge
        .judge_turn(
            TurnMaterial {
                response: "ls".into(),
                next_state: "no, the hidden files too".into(),
                next_state_role: "user".into(),
            },
            true,
        )
        .await;

    assert_eq!((j.votes.len(), j.hint_votes.len()), (3, 2));
    for v in j.votes.iter().chain(&j.hint_votes) {
        assert_eq!(v.score, None, "noise parsed as a vote: {:?}", v.raw);
        let err = v.error.clone().expect("a failed vote carries its reason");
        // The gateway answered (a parse failure, not a transport failure).
        assert!(err.contains("no \\boxed"), "{err}");
    }
    assert_eq!((j.reward, j.hint.clone()), (0, None));
    let reason = j.unjudged.clone().expect("the turn is unjudged");
    assert!(reason.contains("no \\boxed"), "{reason}");
    let record = j.record("s", 0, None);
    assert!(!record.hint_accepted && record.unjudged.is_some());
}
