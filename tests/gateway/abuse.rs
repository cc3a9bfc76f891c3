//! The gateway under abuse, over real sockets: a request head or body that stalls is cut off
//! (idle and half-open connections included), the connection cap holds new connections back
//! until one closes, a key past its in-flight cap gets 429 while another key is served, a
//! client that leaves mid-stream gets its turn recorded as abandoned, and 2,000 idle
//! connections do not keep a normal client from its answer.
//!
//! No test guesses at speed: every wait has a generous bound that only a broken gateway hits,
//! and what must not happen is checked after the event that would have caused it.

use std::time::{Duration, Instant};

use clawrl::gateway::{GatewayConfig, TurnEnd};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::http::{body, metrics_as, post, post_as, Server};

/// Long enough for anything a working gateway does here, however loaded the machine.
const BOUND: Duration = Duration::from_secs(60);
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

fn addr(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

/// Reads until the server closes the connection; returns what it sent. Panics past [`BOUND`].
async fn read_to_close(c: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(BOUND, c.read_to_end(&mut out))
        .await
        .expect("the server never closed the connection")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

fn chat_head(len: usize, key: Option<&str>) -> String {
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}Content-Length: {len}\r\n\r\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_heads_and_bodies_are_cut_off() {
    let mut s = Server::start(GatewayConfig {
        header_read_timeout_secs: 0.5,
        body_read_timeout_secs: 0.5,
        ..Default::default()
    })
    .await;
    // A connection that never sends a byte, and one that stops inside its headers.
    let mut silent = TcpStream::connect(addr(&s)).await.unwrap();
    let mut half = TcpStream::connect(addr(&s)).await.unwrap();
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let t0 = Instant::now();
    read_to_close(&mut silent).await;
    read_to_close(&mut half).await;
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "cut before the timeout"
    );
    // A body that stops short: 408, and the connection is closed.
    let mut slow = TcpStream::connect(addr(&s)).await.unwrap();
    slow.write_all(format!("{}{{\"model\":", chat_head(200, None)).as_bytes())
        .await
        .unwrap();
    let answer = read_to_close(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    // A head past the limit (64 KiB by default) gets 431.
    let mut big = TcpStream::connect(addr(&s)).await.unwrap();
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(100 << 10)
    );
    let _ = big.write_all(head.as_bytes()).await;
    let answer = read_to_close(&mut big).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // A normal request is still answered.
    let r = post(&s.base, &body(json!({"max_tokens": 2})), &[]).await;
    assert_eq!(r.status(), 200);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_until_one_closes() {
    let mut s = Server::start(GatewayConfig {
        max_connections: 3,
        ..Default::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(addr(&s)).await.unwrap());
    }
    // A fourth connection is accepted by the kernel but not served while three are open.
    let mut fourth = TcpStream::connect(addr(&s)).await.unwrap();
    fourth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(300), fourth.read(&mut buf)).await;
    assert!(early.is_err(), "served past the connection cap");
    // One of the three goes: the fourth is served.
    drop(held.pop());
    let answer = read_to_close(&mut fourth).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(held);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_past_its_in_flight_cap_gets_429_and_other_keys_are_served() {
    let mut s = Server::start(GatewayConfig {
        api_keys: vec!["key-a".into(), "key-b".into()],
        max_in_flight_per_key: 1,
        // A's body is held back for as long as the test takes: with the default 30 s, a slow
        // machine could answer A with 408 (freeing its slot) before a poll saw the cap.
        body_read_timeout_secs: BOUND.as_secs_f64() * 4.0,
        ..Default::default()
    })
    .await;
    // Key A's one request in flight: its body is still arriving.
    let req = body(json!({"max_tokens": 2})).to_string();
    let mut a1 = TcpStream::connect(addr(&s)).await.unwrap();
    a1.write_all(chat_head(req.len(), Some("key-a")).as_bytes())
        .await
        .unwrap();
    a1.write_all(&req.as_bytes()[..5]).await.unwrap();
    // The server may not have read the head yet: poll until A's second request is refused.
    // The polls are side turns, which open no session: main ones would each open a session
    // and, on a slow machine, fill the key's session cap (another 429) before A's head is read.
    let deadline = Instant::now() + BOUND;
    let side = [("X-Turn-Type", "side")];
    let mut polls = 0u32;
    let refused = loop {
        let r = post_as(&s.base, "key-a", &body(json!({"max_tokens": 2})), &side).await;
        polls += 1;
        if r.status() == 429 {
            break r;
        }
        assert_eq!(r.status(), 200);
        if Instant::now() >= deadline {
            // Say what became of the held request: answered (and so its slot freed), closed,
            // or still waiting for its body.
            let mut got = vec![0u8; 512];
            let held = match tokio::time::timeout(Duration::from_secs(1), a1.read(&mut got)).await {
                Ok(Ok(0)) => "closed by the server".to_string(),
                Ok(Ok(n)) => format!("answered: {:?}", String::from_utf8_lossy(&got[..n])),
                Ok(Err(e)) => format!("read error: {e}"),
                Err(_) => "no answer yet".to_string(),
            };
            panic!("never refused after {polls} polls; the held request: {held}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(refused.headers()["retry-after"], "1");
    let e: Value = refused.json().await.unwrap();
    assert_eq!(e["error"]["code"], "too_many_requests_in_flight");
    // Key B is not held back by A.
    let r = post_as(&s.base, "key-b", &body(json!({"max_tokens": 2})), &[]).await;
    assert_eq!(r.status(), 200);
    // A's first request completes; then A is served again.
    a1.write_all(&req.as_bytes()[5..]).await.unwrap();
    let mut head = vec![0u8; 12];
    tokio::time::timeout(BOUND, a1.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let deadline = Instant::now() + BOUND;
    loop {
        let r = post_as(&s.base, "key-a", &body(json!({"max_tokens": 2})), &[]).await;
        if r.status() == 200 {
            break;
        }
        // The first request's slot is let go when its answer is complete.
        assert_eq!(r.status(), 429);
        assert!(Instant::now() < deadline, "the slot was never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_leaves_an_abandoned_turn_never_trained_on() {
    let mut s = Server::start(GatewayConfig {
        api_keys: vec!["k".into()],
        ..Default::default()
    })
    .await;
    // Each attempt asks for as many tokens as the 512-position fixture holds and leaves after
    // the first content chunk. An attempt counts only if the stream was cut: a machine could in
    // principle stall the client for the whole generation, so up to three are made.
    let mut cut = None;
    for attempt in 0..3 {
        let sid = format!("leave-{attempt}");
        let b = body(json!({"max_tokens": 480, "stream": true}));
        let mut r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", s.base))
            .bearer_auth("k")
            .header("X-Session-Id", &sid)
            .json(&b)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut seen = String::new();
        while !seen.contains("\"content\":\"") || seen.matches("data: ").count() < 2 {
            match r.chunk().await.unwrap() {
                Some(c) => seen.push_str(&String::from_utf8_lossy(&c)),
                None => break,
            }
        }
        drop(r);
        // Wait for the request to end: cut (and then already counted as abandoned) or, for a
        // client stalled past the whole generation, complete.
        let deadline = Instant::now() + BOUND;
        let abandoned = loop {
            let m = metrics_as(&s.base, "k").await;
            if m.contains("clawrl_gateway_requests_in_flight 0") {
                break m.contains("clawrl_gateway_turns_abandoned_total 1");
            }
            assert!(Instant::now() < deadline, "the stream never ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if abandoned {
            cut = Some(sid);
            break;
        }
    }
    let sid = cut.expect("no attempt was cut mid-stream");
    let m = metrics_as(&s.base, "k").await;
    assert!(m.contains("clawrl_gateway_streams_aborted_total 1"), "{m}");
    s.shutdown().await;
    let recs = s.records();
    let turn = recs
        .iter()
        .find(|r| r.session_id == sid)
        .expect("the abandoned turn is recorded");
    assert_eq!(turn.end, Some(TurnEnd::Abandoned));
    assert_eq!(turn.finish_reason, "abandoned");
    assert!(turn.next_state.is_none());
    assert!(
        !turn.response_ids.is_empty() && turn.response_ids.len() < 480,
        "{} tokens: the sequence ran on after the client left",
        turn.response_ids.len()
    );
    assert_eq!(turn.logprobs.len(), turn.response_ids.len());
    assert_eq!(
        recs.iter().filter(|r| r.session_id == sid).count(),
        1,
        "one record of the abandoned turn"
    );
}

/// Calls `router` in process with a request of `method` to `uri` carrying `body`, with key `k`.
fn call(
    router: &axum::Router,
    method: &str,
    uri: &str,
    body: String,
) -> impl std::future::Future<Output = Result<axum::response::Response, std::convert::Infallible>> {
    use hyper::service::Service as _;
    let req = axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .header("Authorization", "Bearer k")
        .header("Content-Type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    hyper_util::service::TowerToHyperService::new(router.clone()).call(req)
}

/// The counter or gauge `name` of the gateway behind `router`.
async fn metric(router: &axum::Router, name: &str) -> u64 {
    use http_body_util::BodyExt as _;
    let r = call(router, "GET", "/metrics", String::new())
        .await
        .unwrap();
    let m = r.into_body().collect().await.unwrap().to_bytes();
    let m = String::from_utf8_lossy(&m);
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{m}")) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_before_its_answer_leaves_an_abandoned_turn_not_a_request_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let ck = clawrl::model::load_checkpoint::<clawrl::CpuBackend>(
        std::path::Path::new(FIXTURE),
        &Default::default(),
    )
    .unwrap();
    let gw = clawrl::gateway::Gateway::new(
        ck,
        GatewayConfig {
            api_keys: vec!["k".into()],
            data_dir: dir.path().join("data"),
            ..Default::default()
        },
        "qwen3-tiny",
    )
    .unwrap();
    let turns = gw.turns_path(0);
    let router = gw.router();
    let counter = gw.counter();
    let mut sids = Vec::new();
    // The request is driven in process, not over a socket, so that it leaves at a known point:
    // its handler is polled until the request is being generated, then dropped at once (no
    // await between), as a server drops the handler of a client who left. An attempt counts
    // only if the answer was not whole by then: a machine could in principle stall this thread
    // for the whole generation, so up to three are made. Both kinds of answer are left so.
    for stream in [false, true] {
        let mut left = None;
        for attempt in 0..3 {
            let sid = format!("leave-{stream}-{attempt}");
            let req = body(json!({"max_tokens": 480, "stream": stream}));
            let mut req = req.as_object().unwrap().clone();
            req.insert("session_id".into(), json!(sid));
            let before = counter.counts().turns_abandoned;
            let mut handler = Box::pin(call(
                &router,
                "POST",
                "/v1/chat/completions",
                Value::Object(req).to_string(),
            ));
            let deadline = Instant::now() + BOUND;
            let answered = loop {
                if futures::poll!(&mut handler).is_ready() {
                    break true;
                }
                if counter.counts().requests_in_flight > 0 {
                    break false;
                }
                assert!(Instant::now() < deadline, "the request never started");
                tokio::task::yield_now().await;
            };
            drop(handler);
            if answered {
                continue;
            }
            // The request ends: recorded as abandoned, or, for an answer whole before the
            // handler was dropped, served.
            let deadline = Instant::now() + BOUND;
            while counter.counts().requests_in_flight > 0 {
                assert!(
                    Instant::now() < deadline,
                    "the request never ended (stream: {stream})"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if counter.counts().turns_abandoned > before {
                left = Some(sid);
                break;
            }
        }
        let sid =
            left.unwrap_or_else(|| panic!("no attempt left before its answer (stream: {stream})"));
        assert_eq!(
            metric(&router, "clawrl_gateway_turns_abandoned_total").await,
            counter.counts().turns_abandoned
        );
        sids.push(sid);
    }
    drop(router);
    // Serving with an immediate shutdown writes every queued record.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    gw.serve(listener, Box::pin(async {})).await.unwrap();
    let text = std::fs::read_to_string(&turns).unwrap();
    let recs: Vec<clawrl::gateway::TurnRecord> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for sid in &sids {
        let left: Vec<_> = recs.iter().filter(|r| &r.session_id == sid).collect();
        assert_eq!(left.len(), 1, "one record of the turn left ({sid})");
        let turn = left[0];
        assert_eq!(turn.end, Some(TurnEnd::Abandoned));
        assert_eq!(turn.finish_reason, "abandoned");
        assert!(turn.next_state.is_none());
        assert!(
            turn.response_ids.len() < 480,
            "{} tokens: the sequence ran on after the client left",
            turn.response_ids.len()
        );
        assert_eq!(turn.logprobs.len(), turn.response_ids.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_idle_connections_do_not_keep_a_client_from_its_answer() {
    let mut s = Server::start(GatewayConfig::default()).await;
    let b = body(json!({"max_tokens": 4}));
    let t0 = Instant::now();
    assert_eq!(
        post(&s.base, &b, &[("X-Turn-Type", "side")]).await.status(),
        200
    );
    let usual = t0.elapsed();
    let mut idle = Vec::with_capacity(2000);
    for _ in 0..2000 {
        idle.push(TcpStream::connect(addr(&s)).await.unwrap());
    }
    let t0 = Instant::now();
    let r = tokio::time::timeout(BOUND, post(&s.base, &b, &[("X-Turn-Type", "side")]))
        .await
        .expect("no answer with 2,000 idle connections open");
    assert_eq!(r.status(), 200);
    eprintln!(
        "answer with 2,000 idle connections open: {:?} (alone: {usual:?})",
        t0.elapsed()
    );
    drop(idle);
    s.shutdown().await;
}
