//! The gateway over real HTTP on 127.0.0.1 with the qwen3-tiny fixture: OpenAI wire format,
//! token-by-token SSE, sessions and the JSONL records (exact ids), sessions inferred from resent
//! conversations, auth, limits and errors, and least privilege: sessions scoped by API key, the
//! session cap, refused message keys, the key checked before the body is read, `/metrics` behind
//! the key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clawrl::gateway::{EndPolicy, Gateway, GatewayConfig, TurnEnd, TurnRecord, TurnType};
use clawrl::model::{load_checkpoint, score_response_topk, ChatTemplate};
use clawrl::CpuBackend;
use serde_json::{json, Value};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

pub(crate) struct Server {
    pub(crate) base: String,
    turns: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Server {
    pub(crate) async fn start(cfg: GatewayConfig) -> Self {
        Self::start_with_template(cfg, None).await
    }

    /// As [`start`](Self::start), with the fixture's chat template replaced by `template`.
    async fn start_with_template(mut cfg: GatewayConfig, template: Option<&str>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        cfg.data_dir = dir.path().join("data");
        let mut ck =
            load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
        if let Some(t) = template {
            ck.chat_template = ChatTemplate::new(t, "test template", Vec::new()).unwrap();
        }
        let gw = Gateway::new(ck, cfg, "qwen3-tiny").unwrap();
        let turns = gw.turns_path(0);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            gw.serve(
                listener,
                Box::pin(async {
                    let _ = rx.await;
                }),
            )
            .await
            .unwrap();
        });
        Self {
            base,
            turns,
            stop: Some(stop),
            task: Some(task),
            _dir: dir,
        }
    }

    /// Stops the server; every open session ends and every record is written.
    pub(crate) async fn shutdown(&mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap();
    }

    pub(crate) fn records(&self) -> Vec<TurnRecord> {
        match std::fs::read_to_string(&self.turns) {
            Ok(t) => t
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Waits until at least `n` records are on disk.
    async fn wait_records(&self, n: usize) -> Vec<TurnRecord> {
        for _ in 0..200 {
            let r = self.records();
            if r.len() >= n {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("expected {n} records, have {:?}", self.records().len());
    }
}

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(format!("{FIXTURE}/tokenizer.json")).unwrap()
}

/// The served text of a record: its ids decoded, a final stop token (`<|im_end|>` = 2) excluded.
fn decode_record(r: &TurnRecord) -> String {
    let ids = match r.response_ids.last() {
        Some(2) => &r.response_ids[..r.response_ids.len() - 1],
        _ => &r.response_ids[..],
    };
    tokenizer().decode(ids, false).unwrap()
}

pub(crate) fn body(extra: Value) -> Value {
    let mut b = json!({
        "model": "qwen3-tiny",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 7,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

pub(crate) async fn post(base: &str, b: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut rq = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(b);
    for (k, v) in headers {
        rq = rq.header(*k, *v);
    }
    rq.send().await.unwrap()
}

/// Reads an SSE body into its `data:` payloads.
async fn sse_events(mut resp: reqwest::Response) -> Vec<String> {
    let mut buf = String::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        buf.push_str(std::str::from_utf8(&c).unwrap());
    }
    buf.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(|d| d.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_record_exact_tokens_and_next_states() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let h = [("X-Session-Id", "alice")];
    let r = post(&s.base, &body(json!({})), &h).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-session-id"], "alice");
    let a1: Value = r.json().await.unwrap();
    assert_eq!(a1["session_id"], "alice");
    assert_eq!(a1["turn_type"], "main");
    assert_eq!(a1["object"], "chat.completion");
    let msg1 = a1["choices"][0]["message"].clone();
    assert_eq!(msg1["role"], "assistant");
    let served1 = msg1["content"].as_str().unwrap().to_string();
    assert!(a1["usage"]["completion_tokens"].as_u64().unwrap() >= 1);

    // A side turn in between: served, never recorded.
    let side = post(
        &s.base,
        &body(json!({"turn_type": "side", "session_id": "alice"})),
        &[],
    )
    .await;
    assert_eq!(side.status(), 200);
    let side: Value = side.json().await.unwrap();
    assert_eq!(side["turn_type"], "side");

    // The next main request's last message is the next state of turn 1; it also ends the session.
    let next = json!({"role": "user", "content": "No, shorter please."});
    let b2 = body(json!({"messages": [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": served1},
        next,
    ]}));
    let r = post(
        &s.base,
        &b2,
        &[("X-Session-Id", "alice"), ("X-Session-Done", "1")],
    )
    .await;
    assert_eq!(r.status(), 200);
    let a2: Value = r.json().await.unwrap();
    let recs = s.wait_records(2).await;
    assert_eq!(recs.len(), 2, "the side turn is not recorded");
    let (t1, t2) = (&recs[0], &recs[1]);
    assert_eq!(t1.next_state.as_ref(), Some(&next));
    assert_eq!(
        t2.next_state, None,
        "the last turn is kept without next state"
    );
    // Exact tokens: the recorded ids decode to the text served, and the prompt ids are the
    // tokenization of the rendered prompt.
    assert_eq!(decode_record(t1), served1);
    assert_eq!(
        decode_record(t2),
        a2["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let tk = tokenizer();
    for t in [t1, t2] {
        assert_eq!(t.logprobs.len(), t.response_ids.len());
        assert!(t.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        assert_eq!(tk.decode(&t.prompt_ids, false).unwrap(), t.prompt_text);
        assert_eq!(
            tk.encode(t.prompt_text.as_str(), false).unwrap().get_ids(),
            &t.prompt_ids[..]
        );
        assert!(t.prompt_text.ends_with("<|im_start|>assistant\n"));
        assert_eq!(t.session_id, "alice");
    }
    assert!(t2.prompt_text.contains("No, shorter please."));

    let m = reqwest::get(format!("{}/metrics", s.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "clawrl_gateway_main_turns_total 2",
        "clawrl_gateway_side_turns_total 1",
        "clawrl_gateway_turns_with_next_state_total 1",
        "clawrl_gateway_last_turns_kept_total 1",
        "clawrl_gateway_sessions_ended_done_total 1",
        "clawrl_gateway_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 3",
    ] {
        assert!(m.contains(line), "{line} missing from\n{m}");
    }
    assert!(m.contains("clawrl_gateway_request_seconds_bucket"));
    s.shutdown().await;
}

/// The assistant message of a non-streaming answer, as a client resends it.
async fn served_message(r: reqwest::Response) -> (String, Value) {
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-session-id"));
    let a: Value = r.json().await.unwrap();
    let sid = a["session_id"].as_str().unwrap().to_string();
    (sid, a["choices"][0]["message"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_conversations_without_session_headers_land_in_one_session() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let sys = json!({"role": "system", "content": "You are a helpful agent."});
    let u1 = json!({"role": "user", "content": "Hello there"});
    let ctx = |n: u32| {
        json!({"role": "user", "content": format!(
            "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nstep {n}\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")})
    };
    // A request of another conversation, to be told apart.
    let (other, _) = served_message(
        post(
            &s.base,
            &body(json!({"messages": [{"role": "user", "content": "Unrelated"}]})),
            &[],
        )
        .await,
    )
    .await;
    let (sid, m1) =
        served_message(post(&s.base, &body(json!({"messages": [sys, u1, ctx(1)]})), &[]).await)
            .await;
    assert_ne!(sid, other);
    // Turn 2 drops the internal-context message of turn 1 (as OpenClaw does) and sends its new
    // user message as content parts.
    let u2 = json!({"role": "user", "content": [{"type": "text", "text": "No, "},
                                                  {"type": "text", "text": "shorter please."}]});
    let (sid2, m2) = served_message(
        post(
            &s.base,
            &body(json!({"messages": [sys, u1, m1, u2, ctx(2)]})),
            &[],
        )
        .await,
    )
    .await;
    // Turn 3 resends the history (the `openai` SDK appending to its list).
    let u3 = json!({"role": "user", "content": "Thanks."});
    let (sid3, _) = served_message(
        post(
            &s.base,
            &body(json!({"messages": [sys, u1, m1, u2, m2, u3]})),
            &[],
        )
        .await,
    )
    .await;
    assert_eq!((sid2.as_str(), sid3.as_str()), (sid.as_str(), sid.as_str()));
    let m = reqwest::get(format!("{}/metrics", s.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "clawrl_gateway_sessions_started_total 2",
        "clawrl_gateway_sessions_inferred_total 2",
        "clawrl_gateway_turns_with_next_state_total 2",
        "clawrl_gateway_turns_superseded_total 0",
    ] {
        assert!(m.contains(line), "{line} missing from\n{m}");
    }
    // A regeneration of turn 2 (its request again) extends turn 1 again: the same session, and
    // the pending turn 3 is closed without a next state.
    let (sid4, _) = served_message(
        post(
            &s.base,
            &body(json!({"messages": [sys, u1, m1, u2, ctx(2)]})),
            &[],
        )
        .await,
    )
    .await;
    assert_eq!(sid4, sid);
    s.shutdown().await;
    let recs: Vec<TurnRecord> = s
        .records()
        .into_iter()
        .filter(|r| r.session_id == sid)
        .collect();
    assert_eq!(recs.len(), 4, "four turns of one session");
    assert_eq!(recs[0].next_messages, vec![u2.clone(), ctx(2)]);
    assert_eq!(recs[0].next_state, Some(ctx(2)));
    assert_eq!(recs[0].end, Some(TurnEnd::NextState));
    assert_eq!(recs[1].next_messages, vec![u3.clone()]);
    assert_eq!(recs[1].next_state, Some(u3));
    assert_eq!(recs[1].end, Some(TurnEnd::NextState));
    assert_eq!(
        (recs[2].next_state.as_ref(), recs[2].end),
        (None, Some(TurnEnd::Superseded))
    );
    assert_eq!(
        (recs[3].next_state.as_ref(), recs[3].end),
        (None, Some(TurnEnd::IdleTimeout))
    );
    // Each record is the turn served for that request.
    assert_eq!(recs[0].response, m1);
    assert_eq!(recs[1].response, m2);
    assert!(recs[2].prompt_text.contains("Thanks."));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_token_by_token_and_matches_the_full_answer() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let b = body(json!({"max_tokens": 16, "seed": 3}));
    let full: Value = post(&s.base, &b, &[("X-Session-Id", "full")])
        .await
        .json()
        .await
        .unwrap();
    let full_text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    let mut sb = b.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = post(&s.base, &sb, &[("X-Session-Id", "streamed")]).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.headers()["x-session-id"], "streamed");
    let events = sse_events(r).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut content_chunks = 0;
    for c in &chunks {
        assert_eq!(c["session_id"], "streamed");
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            if !t.is_empty() {
                content_chunks += 1;
            }
            text.push_str(t);
        }
    }
    assert_eq!(text, full_text, "same seed, same text, streamed or not");
    assert!(
        content_chunks > 2,
        "{content_chunks} content chunks: not token by token"
    );
    let fin = chunks
        .iter()
        .find(|c| !c["choices"][0]["finish_reason"].is_null())
        .unwrap();
    assert!(["stop", "length"].contains(&fin["choices"][0]["finish_reason"].as_str().unwrap()));
    let usage = chunks.last().unwrap();
    assert_eq!(
        usage["usage"]["completion_tokens"],
        full["usage"]["completion_tokens"]
    );

    s.shutdown().await;
    let recs = s.records();
    assert_eq!(
        recs.len(),
        2,
        "both sessions' last turns are kept at shutdown"
    );
    let streamed = recs.iter().find(|r| r.session_id == "streamed").unwrap();
    assert_eq!(decode_record(streamed), text);
    let f = recs.iter().find(|r| r.session_id == "full").unwrap();
    assert_eq!(f.response_ids, streamed.response_ids);
}

/// `logprobs` / `top_logprobs`: each served token's log-prob under the model's own distribution
/// (what scoring the answer in one forward pass gives, whatever the temperature), its most
/// likely alternatives, and its exact bytes (read together as UTF-8, the served text); streamed,
/// the chunks carry the same entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_the_models_own_with_exact_bytes_streamed_or_not() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let b = body(json!({"max_tokens": 16, "seed": 5, "logprobs": true, "top_logprobs": 3}));
    let full: Value = post(&s.base, &b, &[("X-Session-Id", "lp")])
        .await
        .json()
        .await
        .unwrap();
    let entries = full["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content")
        .clone();
    let mut sb = b.clone();
    sb["stream"] = json!(true);
    let events = sse_events(post(&s.base, &sb, &[("X-Session-Id", "lp-stream")]).await).await;
    let mut streamed = Vec::new();
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        if let Some(a) = c["choices"][0]["logprobs"]["content"].as_array() {
            streamed.extend(a.iter().cloned());
        }
    }
    assert_eq!(
        streamed, entries,
        "same seed: the same entries, streamed or not"
    );
    let plain: Value = post(&s.base, &body(json!({})), &[("X-Turn-Type", "side")])
        .await
        .json()
        .await
        .unwrap();
    assert!(plain["choices"][0]["logprobs"].is_null(), "only when asked");
    s.shutdown().await;

    let rec = s
        .records()
        .into_iter()
        .find(|r| r.session_id == "lp")
        .unwrap();
    let served = match rec.response_ids.last() {
        Some(2) => rec.response_ids.len() - 1,
        _ => rec.response_ids.len(),
    };
    assert_eq!(entries.len(), served, "one entry per served token");
    let bytes: Vec<u8> = entries
        .iter()
        .flat_map(|e| e["bytes"].as_array().unwrap().iter())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(String::from_utf8_lossy(&bytes), decode_record(&rec));
    let ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    let reference = score_response_topk(&ck.model, &rec.prompt_ids, &rec.response_ids, 3);
    for (i, e) in entries.iter().enumerate() {
        let lp = e["logprob"].as_f64().unwrap() as f32;
        assert!((lp - reference.logprobs[i]).abs() < 1e-4, "token {i}");
        // The record keeps the sampling log-prob, at temperature 0.8: another number.
        assert!((lp - rec.logprobs[i]).abs() > 1e-6);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        for (j, t) in top.iter().enumerate() {
            let want = reference.topk_logprobs[i * 3 + j];
            assert!((t["logprob"].as_f64().unwrap() as f32 - want).abs() < 1e-4);
            let tb: Vec<u8> = t["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            let id = reference.ids[i * 3 + j];
            assert_eq!(String::from_utf8_lossy(&tb), t["token"].as_str().unwrap());
            if !tb.is_empty() && std::str::from_utf8(&tb).is_ok() {
                assert_eq!(tokenizer().decode(&[id], false).unwrap().as_bytes(), tb);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_served_text() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let b = body(json!({"max_tokens": 24, "seed": 11}));
    let full: Value = post(&s.base, &b, &[]).await.json().await.unwrap();
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 8, "{text:?}");
    let stop: String = chars[5..8].iter().collect();
    let expect = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut sb = b.clone();
        sb["stop"] = json!([stop]);
        sb["stream"] = json!(stream);
        let r = post(&s.base, &sb, &[]).await;
        let got = if stream {
            sse_events(r)
                .await
                .iter()
                .filter(|e| *e != "[DONE]")
                .filter_map(|e| {
                    let v: Value = serde_json::from_str(e).unwrap();
                    v["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(String::from)
                })
                .collect::<String>()
        } else {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(got, expect, "stream={stream} stop={stop:?}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_end_and_the_last_turn_is_dropped_when_configured() {
    let mut s = Server::start(GatewayConfig {
        idle_timeout_secs: 0.2,
        on_session_end: EndPolicy::Drop,
        default_turn_type: TurnType::Side,
        ..Default::default()
    })
    .await;
    // Named session, no turn type: main even though the default is side.
    let a: Value = post(&s.base, &body(json!({"session_id": "bob"})), &[])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(a["turn_type"], "main");
    // No session, no turn type: the configured default, with a fresh session id.
    let b: Value = post(&s.base, &body(json!({})), &[])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(b["turn_type"], "side");
    assert!(b["session_id"].as_str().unwrap().starts_with("sess-"));
    let mut dropped = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let m = reqwest::get(format!("{}/metrics", s.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("clawrl_gateway_last_turns_dropped_total 1")
            && m.contains("clawrl_gateway_sessions_open 0")
        {
            dropped = true;
            break;
        }
    }
    assert!(dropped, "the idle session's last turn was not dropped");
    s.shutdown().await;
    assert!(s.records().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_histories_render_arguments_as_the_model_wrote_them() {
    let mut s = Server::start(GatewayConfig::default()).await;
    // Raw text: key order as a client sends it (serde_json's `json!` would sort keys).
    let b = r#"{"model": "qwen3-tiny", "max_tokens": 4, "seed": 1,
        "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Show "}, {"type": "text", "text": "a.txt"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\", \"limit\": 3}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]}"#;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .header("content-type", "application/json")
        .header("X-Session-Id", "tools")
        .header("X-Session-Done", "true")
        .body(b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let recs = s.wait_records(1).await;
    let p = &recs[0].prompt_text;
    assert!(p.contains("<|im_start|>user\nShow a.txt<|im_end|>"), "{p}");
    assert!(
        p.contains("{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.txt\", \"limit\": 3}}"),
        "{p}"
    );
    assert!(
        p.contains("<tool_response>\nhello\n</tool_response>"),
        "{p}"
    );
    assert!(
        p.contains("{\"type\": \"function\", \"function\": {\"name\": \"read_file\", \"description\": \"Read a file\""),
        "{p}"
    );
    s.shutdown().await;
}

/// A request that names the weight version it must be answered by is served by exactly that
/// version, or refused with 409 (the serving version in the answer's header) before it touches
/// any session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_pinned_to_another_version_is_refused() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let r = post(&s.base, &body(json!({})), &[("X-Clawrl-Version", "0")]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-clawrl-version"], "0");
    let r = post(&s.base, &body(json!({})), &[("X-Clawrl-Version", "3")]).await;
    assert_eq!(r.headers()["x-clawrl-version"], "0");
    let v: Value = {
        assert_eq!(r.status(), 409);
        r.json().await.unwrap()
    };
    assert_eq!(v["error"]["code"], "version_mismatch", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("version 3"));
    let m = error_of(
        post(&s.base, &body(json!({})), &[("X-Clawrl-Version", "latest")]).await,
        400,
    )
    .await;
    assert!(m.contains("X-Clawrl-Version"), "{m}");
    s.shutdown().await;
    // The refused requests opened no session: only the served main turn is recorded.
    assert_eq!(s.records().len(), 1);
}

async fn error_of(r: reqwest::Response, status: u16) -> String {
    assert_eq!(r.status().as_u16(), status);
    let v: Value = r.json().await.unwrap();
    let e = &v["error"];
    assert!(e["type"].is_string() && e["code"].is_string(), "{v}");
    e["message"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_limits_and_bad_requests() {
    std::env::set_var("CLAWRL_GATEWAY_TEST_KEYS", "env-key-1, env-key-2");
    let mut s = Server::start(GatewayConfig {
        api_keys: vec!["cfg-key".into()],
        api_keys_env: "CLAWRL_GATEWAY_TEST_KEYS".into(),
        max_body_bytes: 2048,
        ..Default::default()
    })
    .await;
    let ok = body(json!({"max_tokens": 2}));
    let c = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", s.base);

    // 401 without a key, with a wrong one, and on /v1/models; both key sources work.
    let m = error_of(c.post(&url).json(&ok).send().await.unwrap(), 401).await;
    assert!(m.contains("API key"), "{m}");
    error_of(
        c.post(&url)
            .bearer_auth("nope")
            .json(&ok)
            .send()
            .await
            .unwrap(),
        401,
    )
    .await;
    error_of(
        c.get(format!("{}/v1/models", s.base)).send().await.unwrap(),
        401,
    )
    .await;
    for key in ["cfg-key", "env-key-2"] {
        let r = c
            .post(&url)
            .bearer_auth(key)
            .json(&ok)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{key}");
    }
    let models: Value = c
        .get(format!("{}/v1/models", s.base))
        .bearer_auth("cfg-key")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "qwen3-tiny");
    // healthz stays open.
    let h: Value = reqwest::get(format!("{}/healthz", s.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");

    let authed = |b: reqwest::RequestBuilder| b.bearer_auth("cfg-key");
    // 413 over the body limit.
    let big = body(json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]}));
    let m = error_of(authed(c.post(&url)).json(&big).send().await.unwrap(), 413).await;
    assert!(m.contains("2048"), "{m}");
    // 400 with a message for malformed JSON and for a wrong shape.
    let m = error_of(
        authed(c.post(&url))
            .header("content-type", "application/json")
            .body("{\"model\": \"qwen3-tiny\", \"messages\": [")
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(m.contains("malformed JSON"), "{m}");
    let m = error_of(
        authed(c.post(&url))
            .json(&json!({"model": "qwen3-tiny", "messages": [{"content": "no role"}]}))
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(m.contains("role"), "{m}");
    let m = error_of(
        authed(c.post(&url))
            .json(&json!({"messages": []}))
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(m.contains("model"), "{m}");
    // 404 for an unknown model (chat and models/{id}).
    let m = error_of(
        authed(c.post(&url))
            .json(&body(json!({"model": "gpt-9"})))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    assert!(m.contains("gpt-9"), "{m}");
    error_of(
        authed(c.get(format!("{}/v1/models/gpt-9", s.base)))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    // Sampling parameters are validated.
    for (bad, param) in [
        (json!({"temperature": 3.0}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (json!({"n": 2}), "n"),
        (json!({"turn_type": "sideways"}), "turn"),
    ] {
        let m = error_of(
            authed(c.post(&url))
                .json(&body(bad.clone()))
                .send()
                .await
                .unwrap(),
            400,
        )
        .await;
        assert!(m.contains(param), "{bad}: {m}");
    }
    // A prompt longer than the context is a 400, streaming or not.
    for stream in [false, true] {
        let long = body(
            json!({"stream": stream, "messages": [{"role": "user", "content": "word ".repeat(300)}]}),
        );
        let r = authed(c.post(&url)).json(&long).send().await.unwrap();
        // 300 words fit in the 2048-byte body but not in 512 positions.
        let m = error_of(r, 400).await;
        assert!(m.contains("maximum context"), "{m}");
    }
    let m = c
        .get(format!("{}/metrics", s.base))
        .bearer_auth("env-key-1")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("clawrl_gateway_errors_total{kind=\"invalid_api_key\"} 3"),
        "{m}"
    );
    assert!(m.contains("clawrl_gateway_errors_total{kind=\"payload_too_large\"} 1"));
    assert!(m.contains("clawrl_gateway_errors_total{kind=\"model_not_found\"} 2"));
    s.shutdown().await;
}

/// A gateway with two keys, `key-a` and `key-b`, and `cfg`'s other settings.
async fn two_keys(cfg: GatewayConfig) -> Server {
    Server::start(GatewayConfig {
        api_keys: vec!["key-a".into(), "key-b".into()],
        ..cfg
    })
    .await
}

pub(crate) async fn post_as(
    base: &str,
    key: &str,
    b: &Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut rq = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(b);
    for (k, v) in headers {
        rq = rq.header(*k, *v);
    }
    rq.send().await.unwrap()
}

pub(crate) async fn metrics_as(base: &str, key: &str) -> String {
    let r = reqwest::Client::new()
        .get(format!("{base}/metrics"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_feedback_never_reaches_another_keys_turns() {
    let mut s = two_keys(GatewayConfig::default()).await;
    // A has a turn pending in two sessions.
    let mut served = std::collections::HashMap::new();
    for sid in ["feedback", "ending"] {
        let a1: Value = post_as(&s.base, "key-a", &body(json!({})), &[("X-Session-Id", sid)])
            .await
            .json()
            .await
            .unwrap();
        let text = a1["choices"][0]["message"]["content"].as_str().unwrap();
        served.insert(sid.to_string(), text.to_string());
    }
    let history = |sid: &str, last: &Value| {
        body(json!({"messages": [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": served[sid]},
            last,
        ]}))
    };
    // B, knowing the ids, praises A's answer in one session and ends the other.
    let praise = json!({"role": "user", "content": "perfect, thanks!"});
    let h = [("X-Session-Id", "feedback")];
    let r = post_as(&s.base, "key-b", &history("feedback", &praise), &h).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-session-id"], "feedback");
    let h = [("X-Session-Id", "ending"), ("X-Session-Done", "1")];
    let r = post_as(&s.base, "key-b", &body(json!({"turn_type": "side"})), &h).await;
    assert_eq!(r.status(), 200);
    // A's own next messages are the next states of A's turns.
    let fix = json!({"role": "user", "content": "No, shorter please."});
    for sid in ["feedback", "ending"] {
        let h = [("X-Session-Id", sid), ("X-Session-Done", "1")];
        let r = post_as(&s.base, "key-a", &history(sid, &fix), &h).await;
        assert_eq!(r.status(), 200);
    }
    let m = metrics_as(&s.base, "key-a").await;
    assert!(m.contains("clawrl_gateway_sessions_started_total 3"), "{m}");
    s.shutdown().await;
    // What is recorded (and so judged) as each turn's next state.
    let recs = s.records();
    assert_eq!(recs.len(), 5, "A's two turns in each session and B's one");
    for sid in ["feedback", "ending"] {
        let first_of_a = recs
            .iter()
            .find(|r| {
                r.session_id == sid
                    && !r.prompt_text.contains("perfect")
                    && !r.prompt_text.contains("shorter")
            })
            .unwrap();
        assert_eq!(
            (first_of_a.next_state.as_ref(), first_of_a.end),
            (Some(&fix), Some(TurnEnd::NextState)),
            "{sid}"
        );
    }
    for r in &recs {
        assert_ne!(
            r.next_state.as_ref(),
            Some(&praise),
            "B's praise judged A's turn"
        );
    }
    let of_b = recs
        .iter()
        .find(|r| r.prompt_text.contains("perfect"))
        .unwrap();
    assert_eq!(
        (of_b.next_state.as_ref(), of_b.end),
        (None, Some(TurnEnd::IdleTimeout)),
        "B's turn ends with B's own session, at shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_leaves_no_session() {
    let mut s = Server::start(GatewayConfig {
        max_sessions_per_key: 1,
        ..Default::default()
    })
    .await;
    // 300 words do not fit the fixture's 512 positions: the engine refuses, streaming or not.
    for (stream, sid) in [(false, "refused"), (true, "refused-stream")] {
        let long = body(json!({"stream": stream,
            "messages": [{"role": "user", "content": "word ".repeat(300)}]}));
        let r = post(&s.base, &long, &[("X-Session-Id", sid)]).await;
        assert!(error_of(r, 400).await.contains("maximum context"));
    }
    let m = reqwest::get(format!("{}/metrics", s.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("clawrl_gateway_sessions_open 0"), "{m}");
    assert!(m.contains("clawrl_gateway_sessions_started_total 0"), "{m}");
    // Nor does it take a place under the cap (1 here): a new session still opens.
    let r = post(&s.base, &body(json!({})), &[("X-Session-Id", "served")]).await;
    assert_eq!(r.status(), 200);
    s.shutdown().await;
    let recs = s.records();
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].session_id, "served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_sessions_are_capped_per_key() {
    let mut s = two_keys(GatewayConfig {
        max_sessions_per_key: 2,
        idle_timeout_secs: 60.0,
        ..Default::default()
    })
    .await;
    let ok = body(json!({"max_tokens": 2}));
    for sid in ["s1", "s2"] {
        let r = post_as(&s.base, "key-a", &ok, &[("X-Session-Id", sid)]).await;
        assert_eq!(r.status(), 200, "{sid}");
    }
    // A third session of key A is refused, named or not, with the cap and a Retry-After.
    for h in [&[("X-Session-Id", "s3")][..], &[]] {
        let r = post_as(&s.base, "key-a", &ok, h).await;
        let retry: u64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
        let v: Value = r.json().await.unwrap();
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("max_sessions_per_key = 2"), "{m}");
        assert_eq!(v["error"]["code"], "too_many_sessions");
    }
    // Open sessions go on; a side turn opens no session so is served; key B has its own cap.
    let r = post_as(&s.base, "key-a", &ok, &[("X-Session-Id", "s1")]).await;
    assert_eq!(r.status(), 200);
    let side = [("X-Session-Id", "s3"), ("X-Turn-Type", "side")];
    assert_eq!(post_as(&s.base, "key-a", &ok, &side).await.status(), 200);
    let r = post_as(&s.base, "key-b", &ok, &[("X-Session-Id", "s3")]).await;
    assert_eq!(r.status(), 200);
    // Ending one of A's sessions makes room.
    let done = [("X-Session-Id", "s1"), ("X-Session-Done", "1")];
    assert_eq!(post_as(&s.base, "key-a", &ok, &done).await.status(), 200);
    let r = post_as(&s.base, "key-a", &ok, &[("X-Session-Id", "s3")]).await;
    assert_eq!(r.status(), 200);
    let m = metrics_as(&s.base, "key-b").await;
    assert!(m.contains("clawrl_gateway_sessions_open 3"), "{m}");
    assert!(
        m.contains("clawrl_gateway_errors_total{kind=\"too_many_sessions\"} 2"),
        "{m}"
    );
    assert!(m.contains("clawrl_gateway_sessions_refused_total 2"), "{m}");
    assert!(
        m.contains(
            "clawrl_gateway_requests_total{route=\"/v1/chat/completions\",status=\"429\"} 2"
        ),
        "{m}"
    );
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_message_keys_are_refused_and_nulls_are_absent() {
    let mut s = Server::start(GatewayConfig::default()).await;
    // A key the gateway does not understand, at the message or the tool-call level: 400 naming
    // it (such a field would otherwise be recorded, however large, past the context check).
    let call = json!({"id": "call_1", "type": "function",
        "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}});
    let mut odd_call = call.clone();
    odd_call["function"]["strict"] = json!(true);
    let mut extra_call = call.clone();
    extra_call["cache_hint"] = json!("x");
    for (messages, key) in [
        (
            json!([{"role": "user", "content": "hi", "stash": "x".repeat(100_000)}]),
            "stash",
        ),
        (
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "ok", "refusal": "I will not"},
                   {"role": "user", "content": "go on"}]),
            "refusal",
        ),
        (
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": null, "tool_calls": [extra_call]}]),
            "cache_hint",
        ),
        (
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": null, "tool_calls": [odd_call]}]),
            "strict",
        ),
    ] {
        let r = post(&s.base, &body(json!({"messages": messages})), &[]).await;
        let v: Value = r.json().await.unwrap();
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(&format!("{key:?}")), "{key}: {v}");
        assert_eq!(v["error"]["code"], "unsupported_message_key", "{v}");
    }
    let m = error_of(
        post(
            &s.base,
            &body(json!({"messages": [{"role": "user", "content": "hi",
                "name": "n".repeat(2000)}]})),
            &[],
        )
        .await,
        400,
    )
    .await;
    assert!(m.contains("\"name\" is longer than 1024 bytes"), "{m}");

    // Malformed tool-call arguments in history and a content part of another type: 400 naming
    // the message, the tool call and the field.
    for (arguments, why) in [
        (json!("{\"path\": "), "is not valid JSON"),
        (json!("[1, 2]"), "must hold a JSON object"),
        (json!(7), "must be a JSON object or a string holding one"),
    ] {
        let mut bad_call = call.clone();
        bad_call["function"]["arguments"] = arguments;
        let messages = json!([{"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [call.clone(), bad_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"}]);
        let m = error_of(
            post(&s.base, &body(json!({"messages": messages})), &[]).await,
            400,
        )
        .await;
        assert!(
            m.contains("message 1, tool call 1, function: \"arguments\"") && m.contains(why),
            "{m}"
        );
    }
    let image = json!([{"role": "user", "content": [{"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]);
    let m = error_of(
        post(&s.base, &body(json!({"messages": image})), &[]).await,
        400,
    )
    .await;
    assert!(
        m.contains("message 0: content part 1 has the type \"image_url\", which is not supported"),
        "{m}"
    );

    // What real clients send is served: the SDK's dump of an answer (refusal, audio,
    // function_call, annotations as null), a tool result's name, reasoning_content.
    let history = json!([
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}], "name": "ann"},
        {"role": "assistant", "content": null, "refusal": null, "audio": null,
         "function_call": null, "annotations": null, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "index": 0,
            "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": "hello"},
    ]);
    let r = post(
        &s.base,
        &body(json!({"messages": history})),
        &[("X-Session-Id", "real"), ("X-Session-Done", "1")],
    )
    .await;
    assert_eq!(r.status(), 200);
    let recs = s.wait_records(1).await;
    let recorded = serde_json::to_value(&recs[0].messages).unwrap();
    let assistant = recorded[2].as_object().unwrap();
    for gone in ["refusal", "audio", "function_call", "annotations"] {
        assert!(!assistant.contains_key(gone), "{gone} recorded: {recorded}");
    }
    assert_eq!(assistant["reasoning_content"], "Use the tool.");
    assert_eq!(recorded[3]["name"], "read_file");
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_is_refused_before_the_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = Server::start(GatewayConfig {
        api_keys: vec!["right".into()],
        ..Default::default()
    })
    .await;
    let addr = s.base.strip_prefix("http://").unwrap().to_string();
    for auth in ["", "Authorization: Bearer wrong\r\n"] {
        let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
        // A body of 1 MiB (under the 4 MiB limit) is announced and never sent: a gateway that
        // read the body before the key would wait for it and answer nothing.
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n{auth}\r\n{{\"model\": ",
            1 << 20
        );
        c.write_all(head.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .expect("no answer while the body is still unsent")
            .unwrap();
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 401"), "{auth:?}: {text}");
        assert!(text.contains("invalid_api_key"), "{text}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_the_key_unless_public() {
    let mut s = two_keys(GatewayConfig::default()).await;
    let url = format!("{}/metrics", s.base);
    let r = reqwest::get(&url).await.unwrap();
    assert!(error_of(r, 401).await.contains("API key"));
    let r = reqwest::Client::new()
        .get(&url)
        .bearer_auth("nope")
        .send()
        .await
        .unwrap();
    error_of(r, 401).await;
    assert!(metrics_as(&s.base, "key-b")
        .await
        .contains("clawrl_gateway_errors_total{kind=\"invalid_api_key\"} 2"));
    s.shutdown().await;

    let mut s = two_keys(GatewayConfig {
        metrics_public: true,
        ..Default::default()
    })
    .await;
    let r = reqwest::get(format!("{}/metrics", s.base)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r
        .text()
        .await
        .unwrap()
        .contains("clawrl_gateway_sessions_open"));
    // The API itself still needs the key.
    let r = post(&s.base, &body(json!({})), &[]).await;
    error_of(r, 401).await;
    s.shutdown().await;
}

/// Roles the chat template does not know are refused naming the message; OpenAI's `developer`
/// role is rendered as the system prompt. The context defaults to the model's
/// `max_position_embeddings` (512 for the fixture): a longer conversation gets a 400, and a
/// config asking for more than the model has is refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_are_checked_and_the_context_is_the_models() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let wizard = body(json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "wizard", "content": "abracadabra"},
    ]}));
    let e = error_of(post(&s.base, &wizard, &[]).await, 400).await;
    assert!(e.contains("message 1") && e.contains("wizard"), "{e}");

    let dev = body(json!({"messages": [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Hello there"},
    ]}));
    let r = post(
        &s.base,
        &dev,
        &[("X-Session-Id", "d"), ("X-Session-Done", "1")],
    )
    .await;
    assert_eq!(r.status(), 200);
    let rec = &s.wait_records(1).await[0];
    assert!(
        rec.prompt_text
            .starts_with("<|im_start|>system\nAnswer in one word.<|im_end|>"),
        "{}",
        rec.prompt_text
    );

    // About 600 tokens of prompt: past the fixture's 512 positions.
    let long = body(json!({"messages": [
        {"role": "user", "content": "lorem ipsum dolor sit amet ".repeat(120)},
    ]}));
    let e = error_of(post(&s.base, &long, &[]).await, 400).await;
    assert!(e.contains("512"), "{e}");
    s.shutdown().await;

    let ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = GatewayConfig {
        max_context: Some(4096),
        data_dir: dir.path().to_path_buf(),
        ..Default::default()
    };
    let e = Gateway::new(ck, cfg, "qwen3-tiny").err().expect("refused");
    assert!(
        e.to_string().contains("max_position_embeddings (512)"),
        "{e}"
    );
}

/// A field that would change the answer and is not supported is refused with a 400 whose
/// `param` names it, instead of being ignored; informational fields and no-op values pass; and
/// `chat_template_kwargs` reach the template (Qwen3's `enable_thinking` switch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_are_refused_and_template_kwargs_reach_the_template() {
    let mut s = Server::start(GatewayConfig::default()).await;
    for (extra, name) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"logit_bias": {"5": 10}}), "logit_bias"),
        (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
        (json!({"presence_penalty": -1.0}), "presence_penalty"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (
            json!({"chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs",
        ),
        (
            json!({"stream_options": {"include_usage": true, "x": 1}}),
            "stream_options.x",
        ),
    ] {
        let r = post(&s.base, &body(extra.clone()), &[]).await;
        assert_eq!(r.status(), 400, "{extra}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], name, "{extra}: {v}");
    }
    let ok = body(json!({
        "user": "u-1", "metadata": {"app": "t"}, "store": false, "parallel_tool_calls": true,
        "prompt_cache_key": "k", "frequency_penalty": 0, "presence_penalty": 0.0,
        "logprobs": false, "top_logprobs": 0, "tool_choice": "auto",
    }));
    let r = post(&s.base, &ok, &[("X-Turn-Type", "side")]).await;
    assert_eq!(r.status(), 200);
    s.shutdown().await;

    let template = concat!(
        "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
        "{%- if enable_thinking is defined and enable_thinking is false %}",
        "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
    );
    let mut s = Server::start_with_template(GatewayConfig::default(), Some(template)).await;
    for (sid, kwargs) in [
        ("on", json!({})),
        ("off", json!({"enable_thinking": false})),
    ] {
        let b = body(json!({"chat_template_kwargs": kwargs}));
        let r = post(
            &s.base,
            &b,
            &[("X-Session-Id", sid), ("X-Session-Done", "1")],
        )
        .await;
        assert_eq!(r.status(), 200);
    }
    let recs = s.wait_records(2).await;
    let prompt = |sid: &str| {
        recs.iter()
            .find(|r| r.session_id == sid)
            .unwrap()
            .prompt_text
            .clone()
    };
    assert!(
        prompt("on").ends_with("<|im_start|>assistant\n"),
        "{}",
        prompt("on")
    );
    assert!(
        prompt("off").ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{}",
        prompt("off")
    );
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_returned_apart_streamed_or_not_and_accepted_back() {
    // A template whose generation prompt opens a `<think>` block (the prefix format of Qwen3
    // thinking templates): the answer starts inside the reasoning.
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{FIXTURE}/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let original = fixture["chat_template"].as_str().unwrap();
    let open = "{{- '<|im_start|>assistant\\n' }}{%- endif %}\n";
    assert!(
        original.ends_with(open),
        "the fixture's generation prompt moved"
    );
    let template = format!(
        "{}{{{{- '<|im_start|>assistant\\n<think>\\n' }}}}{{%- endif %}}\n",
        &original[..original.len() - open.len()]
    );
    let mut s = Server::start_with_template(GatewayConfig::default(), Some(&template)).await;
    let b = body(json!({"max_tokens": 16, "seed": 5}));
    let full: Value = post(&s.base, &b, &[("X-Session-Id", "full")])
        .await
        .json()
        .await
        .unwrap();
    let message = &full["choices"][0]["message"];
    let reasoning = message["reasoning_content"]
        .as_str()
        .unwrap_or_else(|| panic!("no reasoning_content: {message}"))
        .to_string();
    assert!(!reasoning.is_empty());

    let mut sb = b.clone();
    sb["stream"] = json!(true);
    let events = sse_events(post(&s.base, &sb, &[("X-Session-Id", "streamed")]).await).await;
    let (mut streamed_reasoning, mut streamed_content) = (String::new(), String::new());
    let mut reasoning_chunks = 0;
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let delta = &c["choices"][0]["delta"];
        if let Some(r) = delta["reasoning_content"].as_str() {
            assert!(
                streamed_content.is_empty(),
                "reasoning after the answer began"
            );
            reasoning_chunks += 1;
            streamed_reasoning.push_str(r);
        }
        if let Some(t) = delta["content"].as_str() {
            streamed_content.push_str(t);
        }
    }
    assert_eq!(streamed_reasoning, reasoning, "same seed, same reasoning");
    assert_eq!(
        streamed_content,
        message["content"].as_str().unwrap_or(""),
        "same seed, same answer"
    );
    assert!(
        reasoning_chunks > 2,
        "{reasoning_chunks} reasoning chunks: not streamed as it came"
    );

    // Accepted back in history; the next turn continues the session.
    let mut next = body(json!({"max_tokens": 4}));
    next["messages"] = json!([
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": message["content"], "reasoning_content": reasoning},
        {"role": "user", "content": "thanks"},
    ]);
    let r = post(&s.base, &next, &[("X-Session-Id", "full")]).await;
    assert_eq!(r.status(), 200);

    s.shutdown().await;
    let recs = s.records();
    // The served tokens are exactly what was split, and the record keeps the split message.
    let first = recs
        .iter()
        .find(|r| r.session_id == "full" && r.response["reasoning_content"].is_string())
        .expect("the first turn's record");
    let decoded = decode_record(first);
    let (want_reasoning, want_content) =
        clawrl::gateway::reasoning::split_reasoning(&first.prompt_text, &decoded);
    assert_eq!(want_reasoning.as_deref(), Some(reasoning.as_str()));
    assert_eq!(want_content, message["content"].as_str().unwrap_or(""));
    assert_eq!(first.response["reasoning_content"], json!(reasoning));
    assert!(first.prompt_text.ends_with("<think>\n"));
}
