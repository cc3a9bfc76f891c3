//! The `openai` judge backend against a real HTTP server on 127.0.0.1 (axum) that returns
//! scripted texts: exact votes, hints and aggregation; retries on 500; timeouts; garbage bodies;
//! an unreachable endpoint; the API key header; and the concurrency limit. No case may stall.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clawrl::judge::openai::{OpenAiBackend, OpenAiConfig};
use clawrl::judge::{Judge, PromptSet, TurnMaterial, VoteSettings};
use serde_json::{json, Value};

#[derive(Default)]
struct Server {
    /// Requests seen per (case, kind, seed).
    attempts: Mutex<HashMap<(String, &'static str, u64), usize>>,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    bodies: Mutex<Vec<Value>>,
    auth: Mutex<Vec<Option<String>>>,
}

fn completion(text: &str) -> Response {
    finished(text, "stop")
}

fn finished(text: &str, finish_reason: &str) -> Response {
    Json(json!({
        "id": "x", "object": "chat.completion", "model": "judge",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}]
    }))
    .into_response()
}

async fn chat(
    State(s): State<Arc<Server>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let prompt = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let kind = if prompt.contains("[HINT_START]") {
        "hint"
    } else {
        "eval"
    };
    let seed = body["seed"].as_u64().unwrap_or(0);
    let vote = seed % 100; // seeds are base + vote index; tests use base 1000
    let case = [
        "CASE_EXACT",
        "CASE_RETRY",
        "CASE_500",
        "CASE_SLOW",
        "CASE_GARBAGE",
        "CASE_LIMIT",
        "CASE_TIE",
        "CASE_CUT",
    ]
    .into_iter()
    .find(|c| prompt.contains(c))
    .unwrap_or("OTHER")
    .to_string();
    let attempt = {
        let mut a = s.attempts.lock().unwrap();
        let n = a.entry((case.clone(), kind, seed)).or_default();
        *n += 1;
        *n
    };
    s.bodies.lock().unwrap().push(body.clone());
    s.auth.lock().unwrap().push(
        headers
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_string()),
    );
    let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    s.peak.fetch_max(now, Ordering::SeqCst);
    let out = match (case.as_str(), kind) {
        ("CASE_EXACT", "eval") => completion(["Good. \\boxed{1}", "Hmm \\boxed{1} no: \\boxed{-1}", "\\boxed{10} then \\boxed{1}"][vote as usize]),
        ("CASE_EXACT", "hint") => completion(
            [
                "\\boxed{1}\n[HINT_START]\nList hidden files too.\n[HINT_END]",
                "\\boxed{1}\n[HINT_START]Use ls -la so hidden files and sizes show.[HINT_END]",
                "\\boxed{-1} [HINT_START]a longer hint that must be ignored since the vote is -1[HINT_END]",
            ][vote as usize],
        ),
        ("CASE_TIE", "eval") => completion(["\\boxed{1}", "\\boxed{-1}", "no verdict at all"][vote as usize]),
        ("CASE_RETRY", _) if attempt == 1 => (StatusCode::INTERNAL_SERVER_ERROR, "try again").into_response(),
        ("CASE_RETRY", "eval") => completion("\\boxed{-1}"),
        ("CASE_500", _) => (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response(),
        ("CASE_SLOW", _) => {
            tokio::time::sleep(Duration::from_secs(5)).await;
            completion("\\boxed{1}")
        }
        ("CASE_GARBAGE", _) => (StatusCode::OK, "<html>not json</html>").into_response(),
        // Cut off at max_tokens: after the verdict, then mid-reasoning; the third is whole.
        ("CASE_CUT", "eval") => match vote {
            0 => finished("The user thanked it. \\boxed{1} Also, the", "length"),
            1 => finished("<think>Let me weigh whether the reply", "length"),
            _ => completion("\\boxed{1}"),
        },
        ("CASE_LIMIT", _) => {
            // Hold until two requests are in flight (bounded wait), so the peak is observed.
            for _ in 0..200 {
                if s.in_flight.load(Ordering::SeqCst) >= 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
            completion("\\boxed{1}")
        }
        _ => completion("\\boxed{-1}"),
    };
    s.in_flight.fetch_sub(1, Ordering::SeqCst);
    out
}

async fn serve() -> (String, Arc<Server>) {
    let state = Arc::new(Server::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/v1"), state)
}

fn config(url: &str) -> OpenAiConfig {
    let mut c = OpenAiConfig::new(url, "judge-model");
    c.request_timeout_ms = 300;
    c.connect_timeout_ms = 300;
    c.max_retries = 2;
    c.backoff_initial_ms = 5;
    c.backoff_max_ms = 20;
    c
}

fn judge(backend: OpenAiBackend, m: usize, hint_m: usize) -> (Judge, Arc<OpenAiBackend>) {
    let backend = Arc::new(backend);
    let settings = VoteSettings {
        m,
        hint_m,
        seed: Some(1000),
        vote_timeout_ms: 10_000,
        ..VoteSettings::default()
    };
    (
        Judge::new(backend.clone(), Arc::new(PromptSet::defaults()), settings).unwrap(),
        backend,
    )
}

fn turn(case: &str) -> TurnMaterial {
    TurnMaterial {
        response: "Here are the files: a.txt b.txt".into(),
        next_state: format!("{case}: you missed the hidden ones"),
        next_state_role: "user".into(),
    }
}

#[tokio::test]
async fn votes_hints_and_aggregation_come_out_exact() {
    let (url, server) = serve().await;
    std::env::set_var("CLAWRL_TEST_JUDGE_KEY", "sk-test-123");
    let mut c = config(&url);
    c.api_key_env = Some("CLAWRL_TEST_JUDGE_KEY".into());
    let (judge, _) = judge(OpenAiBackend::new(c).unwrap(), 3, 3);
    let j = judge.judge_turn(turn("CASE_EXACT"), true).await;

    let scores: Vec<Option<i8>> = j.votes.iter().map(|v| v.score).collect();
    assert_eq!(scores, vec![Some(1), Some(-1), Some(1)]);
    assert_eq!(j.reward, 1);
    assert_eq!(
        j.votes[1].raw, "Hmm \\boxed{1} no: \\boxed{-1}",
        "raw text kept verbatim"
    );
    let hint_scores: Vec<Option<i8>> = j.hint_votes.iter().map(|v| v.score).collect();
    assert_eq!(hint_scores, vec![Some(1), Some(1), Some(-1)]);
    assert_eq!(
        j.hint_votes[0].hint.as_deref(),
        Some("List hidden files too.")
    );
    assert_eq!(
        j.hint.as_deref(),
        Some("Use ls -la so hidden files and sizes show.")
    );
    assert_eq!(j.unjudged, None);

    let record = j.record("s1", 4, Some(7));
    let line: Value = serde_json::from_str(&record.to_json_line()).unwrap();
    assert_eq!(line["session_id"], "s1");
    assert_eq!(line["turn"], 4);
    assert_eq!(line["reward"], 1);
    assert_eq!(line["hint_accepted"], true);
    assert_eq!(line["hint"], "Use ls -la so hidden files and sizes show.");
    assert_eq!(line["teacher_version"], 7);
    assert_eq!(line["votes"].as_array().unwrap().len(), 6);
    assert_eq!(line["votes"][2]["raw"], "\\boxed{10} then \\boxed{1}");
    assert_eq!(line["votes"][5]["score"], -1);

    // The wire format: model, sampling parameters, per-vote seeds, bearer key.
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 6);
    for b in &bodies {
        assert_eq!(b["model"], "judge-model");
        assert!((b["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6);
        assert_eq!(b["messages"][0]["role"], "user");
    }
    let mut seeds: Vec<u64> = bodies.iter().map(|b| b["seed"].as_u64().unwrap()).collect();
    seeds.sort();
    assert_eq!(seeds, vec![1000, 1000, 1001, 1001, 1002, 1002]);
    assert!(server
        .auth
        .lock()
        .unwrap()
        .iter()
        .all(|a| a.as_deref() == Some("Bearer sk-test-123")));
}

#[tokio::test]
async fn ties_and_failed_votes_give_zero() {
    let (url, _) = serve().await;
    let (judge, _) = judge(OpenAiBackend::new(config(&url)).unwrap(), 3, 0);
    let j = judge.judge_turn(turn("CASE_TIE"), true).await;
    let scores: Vec<Option<i8>> = j.votes.iter().map(|v| v.score).collect();
    assert_eq!(scores, vec![Some(1), Some(-1), None]);
    assert_eq!(j.reward, 0, "1 vs -1 is a tie");
    assert!(j.votes[2].error.as_deref().unwrap().contains("no \\boxed"));
    assert_eq!(j.votes[2].raw, "no verdict at all");
    assert!(j.hint_votes.is_empty());
    assert_eq!(j.unjudged, None);
}

#[tokio::test]
async fn server_errors_are_retried_with_backoff() {
    let (url, server) = serve().await;
    let (judge, _) = judge(OpenAiBackend::new(config(&url)).unwrap(), 3, 0);
    let j = judge.judge_turn(turn("CASE_RETRY"), false).await;
    assert_eq!(
        j.votes.iter().map(|v| v.score).collect::<Vec<_>>(),
        vec![Some(-1); 3]
    );
    assert_eq!(j.reward, -1);
    let attempts = server.attempts.lock().unwrap();
    for seed in 1000..1003 {
        assert_eq!(
            attempts[&("CASE_RETRY".to_string(), "eval", seed)],
            2,
            "one 500 then success"
        );
    }
}

#[tokio::test]
async fn persistent_errors_exhaust_retries_and_leave_the_turn_unjudged() {
    let (url, server) = serve().await;
    let (judge, _) = judge(OpenAiBackend::new(config(&url)).unwrap(), 2, 1);
    let j = judge.judge_turn(turn("CASE_500"), true).await;
    assert!(j
        .votes
        .iter()
        .chain(&j.hint_votes)
        .all(|v| v.score.is_none()));
    assert_eq!((j.reward, j.hint.clone()), (0, None));
    let reason = j.unjudged.expect("unjudged");
    assert!(
        reason.contains("HTTP 500") && reason.contains("down"),
        "{reason}"
    );
    let attempts = server.attempts.lock().unwrap();
    assert_eq!(
        attempts[&("CASE_500".to_string(), "eval", 1000)],
        3,
        "1 try + 2 retries"
    );
    assert_eq!(attempts[&("CASE_500".to_string(), "hint", 1000)], 3);
}

#[tokio::test]
async fn slow_answers_time_out_and_garbage_is_a_failed_vote() {
    let (url, server) = serve().await;
    let mut c = config(&url);
    c.max_retries = 1;
    let (judge, _) = judge(OpenAiBackend::new(c).unwrap(), 2, 0);
    let j = judge.judge_turn(turn("CASE_SLOW"), false).await;
    let reason = j.unjudged.expect("unjudged");
    assert!(reason.contains("timed out"), "{reason}");
    assert!(j
        .votes
        .iter()
        .all(|v| v.score.is_none() && v.raw.is_empty()));

    let j = judge.judge_turn(turn("CASE_GARBAGE"), false).await;
    let reason = j.unjudged.expect("unjudged");
    assert!(reason.contains("unreadable response"), "{reason}");
    // An unreadable 2xx body is not retried.
    assert_eq!(
        server.attempts.lock().unwrap()[&("CASE_GARBAGE".to_string(), "eval", 1000)],
        1
    );
}

#[tokio::test]
async fn the_vote_timeout_bounds_a_vote_whatever_the_backend_does() {
    let (url, _) = serve().await;
    let mut c = config(&url);
    c.request_timeout_ms = 60_000;
    let backend = Arc::new(OpenAiBackend::new(c).unwrap());
    let settings = VoteSettings {
        m: 1,
        hint_m: 0,
        vote_timeout_ms: 200,
        ..VoteSettings::default()
    };
    let judge = Judge::new(backend, Arc::new(PromptSet::defaults()), settings).unwrap();
    let j = judge.judge_turn(turn("CASE_SLOW"), false).await;
    assert!(j.unjudged.unwrap().contains("vote timed out after 200 ms"));
}

#[tokio::test]
async fn an_unreachable_endpoint_gives_failed_votes_not_a_stall() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (judge, _) = judge(
        OpenAiBackend::new(config(&format!("http://127.0.0.1:{port}/v1"))).unwrap(),
        3,
        3,
    );
    let j = judge.judge_turn(turn("CASE_EXACT"), true).await;
    let reason = j.unjudged.expect("unjudged");
    assert!(reason.contains("unreachable"), "{reason}");
    assert_eq!(j.votes.len() + j.hint_votes.len(), 6);
}

#[tokio::test]
async fn the_concurrency_limit_holds() {
    let (url, server) = serve().await;
    let mut c = config(&url);
    c.max_concurrency = 2;
    c.request_timeout_ms = 10_000;
    let (judge, backend) = judge(OpenAiBackend::new(c).unwrap(), 3, 3);
    let j = judge.judge_turn(turn("CASE_LIMIT"), true).await;
    assert_eq!(
        j.votes.iter().map(|v| v.score).collect::<Vec<_>>(),
        vec![Some(1); 3]
    );
    assert_eq!(server.peak.load(Ordering::SeqCst), 2);
    assert_eq!(backend.peak_in_flight(), 2);
}

/// An answer cut off at `max_tokens` (`finish_reason: "length"`) is marked truncated: it counts
/// when its verdict came before the cut, and is a failed vote saying so when it did not.
#[tokio::test]
async fn answers_cut_off_at_max_tokens_are_marked_truncated() {
    let (url, _) = serve().await;
    let (judge, _) = judge(OpenAiBackend::new(config(&url)).unwrap(), 3, 0);
    let j = judge.judge_turn(turn("CASE_CUT"), false).await;
    let v = &j.votes;
    assert_eq!((v[0].score, v[0].truncated), (Some(1), true), "{v:?}");
    assert_eq!((v[1].score, v[1].truncated), (None, true), "{v:?}");
    let why = v[1].error.as_deref().unwrap_or_default();
    assert!(why.starts_with("truncated at max_tokens = 4096"), "{why}");
    assert!(
        v[1].raw.contains("Let me weigh"),
        "the cut text is kept: {v:?}"
    );
    assert_eq!((v[2].score, v[2].truncated), (Some(1), false), "{v:?}");
    assert_eq!(j.reward, 1);
    assert!(j.unjudged.is_none());
}
