//! The gateway switches weight versions without pausing: streaming and non-streaming clients
//! keep chatting over HTTP while five versions, each a real learner step of the fixture model,
//! are installed through [`GatewayPolicy::install`]. No request fails, every response names its
//! version (body, SSE chunks, `X-Clawrl-Version`), each client's versions never go backwards,
//! every version serves, and each recorded turn's log-probs are those of the version it names —
//! also for requests that were in flight across a switch. A sixth version arrives the way the
//! trainer delivers it (a subscriber hearing `Published`; a corrupt copy is refused). The same
//! holds when the versions are LoRA adapters attached to the one engine over the base. Also: the
//! engine's per-token stream.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clawrl::gateway::{Gateway, GatewayConfig, GatewayPolicy, InstallError, TurnRecord};
use clawrl::model::engine::StreamEvent;
use clawrl::model::peft::adapter_from_safetensors;
use clawrl::model::{
    load_checkpoint, load_model, model_from_safetensors, score_batch, spawn_engine, EngineError,
    EngineOptions, GenerationRequest, LoraConfig, LoraWeights, SamplingParams,
};
use clawrl::serve::local_announce;
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use clawrl::{CpuAutodiff, CpuBackend};
use clawrl_actors::loops::TrainerEvent;
use serde_json::{json, Value};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");
const UPDATES: u64 = 5;
/// One more version, delivered the trainer's way (a subscriber hearing `Published`).
const LAST: u64 = UPDATES + 1;
/// Largest |served log-prob − scored log-prob| under the weights that produced a token.
const SAME_WEIGHTS_TOL: f32 = 2e-3;

/// One answered request, as the client saw it.
#[derive(Debug)]
struct Answer {
    client: usize,
    session: String,
    version: u64,
    /// The gateway's version when the answer was complete.
    serving_at_end: u64,
}

/// Sends one chat request; returns the version it names (checked consistent across the body or
/// every SSE chunk and the header), or what went wrong.
async fn chat(
    http: &reqwest::Client,
    base: &str,
    session: &str,
    stream: bool,
    seed: u64,
) -> Result<u64, String> {
    let body = json!({
        "model": "qwen3-tiny",
        "messages": [{"role": "user", "content": format!("tell me about {seed}")}],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": seed,
        "stream": stream,
    });
    let mut resp = http
        .post(format!("{base}/v1/chat/completions"))
        .header("x-session-id", session)
        .header("x-session-done", "true")
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status();
    let header: Option<u64> = resp
        .headers()
        .get("x-clawrl-version")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    if status != 200 {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("status {status}: {text}"));
    }
    let header = header.ok_or("no x-clawrl-version header")?;
    let mut versions = BTreeSet::new();
    if stream {
        let mut raw = Vec::new();
        while let Some(c) = resp.chunk().await.map_err(|e| format!("stream: {e}"))? {
            raw.extend_from_slice(&c);
        }
        let text = String::from_utf8(raw).map_err(|e| e.to_string())?;
        let mut done = false;
        for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(line).map_err(|e| format!("chunk: {e}"))?;
            versions.insert(v["version"].as_u64().ok_or("a chunk without version")?);
        }
        if !done {
            return Err("stream ended without [DONE]".into());
        }
    } else {
        let v: Value = resp.json().await.map_err(|e| format!("body: {e}"))?;
        versions.insert(v["version"].as_u64().ok_or("no version in the body")?);
    }
    if versions.len() != 1 || !versions.contains(&header) {
        return Err(format!("header says {header}, body says {versions:?}"));
    }
    Ok(header)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_switches_five_weight_versions_without_pausing() {
    switch_versions(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_switches_five_adapter_versions_without_pausing() {
    switch_versions(Some(LoraConfig::parse_cli("4,8,all").unwrap())).await;
}

/// The gateway switching versions under load: whole weights, or with `lora` adapters of that
/// shape over the fixture (the learner trains a fresh one; the gateway starts from the same).
async fn switch_versions(lora: Option<LoraConfig>) {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();

    // Five new versions: real learner steps on the fixture model (favour even token ids).
    let (cfg, mut model) = load_model::<CpuAutodiff>(Path::new(FIXTURE), &device).unwrap();
    let fresh = lora.as_ref().map(|l| LoraWeights::fresh(l, &cfg, 1));
    if let Some(f) = &fresh {
        model = model.with_lora(f).unwrap();
    }
    let train = TrainConfig {
        lr: 2e-2,
        kl_coef: 0.0,
        batch_size: 2,
        ..TrainConfig::default()
    };
    let mut learner = BurnLearner::new(cfg, model, train, device, 5);
    let mut blobs = Vec::new();
    for v in 1..=LAST {
        let samples: Vec<Sample> = (0..2u32)
            .map(|i| {
                let response: Vec<u32> = (0..8).map(|j| 40 + 7 * (i + j + v as u32)).collect();
                let a = if v.is_multiple_of(2) { 1.0 } else { -1.0 };
                Sample::new(vec![1, 91, 89, 292, 205 + i], response, a)
            })
            .collect();
        let m = tokio::task::block_in_place(|| learner.step(&samples)).unwrap();
        assert_eq!(m.version, v);
        blobs.push(learner.export_weights().unwrap());
    }

    let mut ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    if let Some(f) = &fresh {
        ck.model = ck.model.with_lora(f).unwrap();
    }
    let gcfg = GatewayConfig {
        data_dir: dir.path().join("data"),
        max_batch: 8,
        max_context: Some(512),
        adapter_versions: lora.clone(),
        ..GatewayConfig::default()
    };
    let gw = Gateway::new(ck, gcfg, "qwen3-tiny").unwrap();
    let policy: GatewayPolicy = gw.policy();
    let turns: Vec<_> = (0..=LAST).map(|v| gw.turns_path(v)).collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop_server, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        gw.serve(
            listener,
            Box::pin(async {
                let _ = rx.await;
            }),
        )
        .await
        .unwrap();
    });

    // Four clients, two streaming, two not, chatting back to back.
    let answers: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let http = reqwest::Client::new();
    let clients: Vec<_> = (0..4usize)
        .map(|client| {
            let (answers, failures, stop, http, base, policy) = (
                answers.clone(),
                failures.clone(),
                stop.clone(),
                http.clone(),
                base.clone(),
                policy.clone(),
            );
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let session = format!("c{client}-{i}");
                    let seed = client as u64 * 1_000_000 + i;
                    i += 1;
                    match chat(&http, &base, &session, client.is_multiple_of(2), seed).await {
                        Ok(version) => answers.lock().unwrap().push(Answer {
                            client,
                            session,
                            version,
                            serving_at_end: policy.version(),
                        }),
                        Err(e) => failures.lock().unwrap().push(format!("{session}: {e}")),
                    }
                }
            })
        })
        .collect();

    let wait_all_on = |version: u64| {
        let answers = answers.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let on: BTreeSet<usize> = answers
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|a| a.version == version)
                    .map(|a| a.client)
                    .collect();
                if on.len() == 4 {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "clients starved on version {version}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    wait_all_on(0).await;
    for v in 1..=UPDATES {
        let w = &blobs[v as usize - 1];
        assert_eq!(policy.install(v, w.bytes.clone()).await.unwrap(), v);
        assert_eq!(policy.version(), v);
        wait_all_on(v).await;
    }
    // Versions never go backwards, and a bad blob changes nothing.
    match policy.install(3, blobs[2].bytes.clone()).await {
        Err(InstallError::Stale { version, serving }) => assert_eq!((version, serving), (3, 5)),
        other => panic!("an older version was accepted: {other:?}"),
    }
    match policy.install(6, b"not safetensors".to_vec()).await {
        Err(InstallError::Load { version: 6, .. }) => {}
        other => panic!("a garbage blob was accepted: {other:?}"),
    }
    assert_eq!(policy.version(), UPDATES);
    let stats = policy.stats();
    assert_eq!(
        (stats.switches, stats.stale_installs, stats.failed_installs),
        (UPDATES, 1, 1)
    );
    // The trainer's way in: a subscriber installs a published version whose bytes have the
    // announced size, and refuses one whose bytes do not.
    let subscriber = policy.trainer_subscriber();
    let (announce, bytes) = local_announce(&blobs[LAST as usize - 1], "trainer").unwrap();
    let mut corrupt = announce.clone();
    corrupt.size += 1;
    for a in [corrupt, announce] {
        assert!(subscriber(&TrainerEvent::Published {
            announce: a,
            bytes: bytes.clone(),
            step_finished: None,
        }));
    }
    wait_all_on(LAST).await;
    assert_eq!(policy.version(), LAST);
    let stats = policy.stats();
    assert_eq!((stats.switches, stats.failed_installs), (LAST, 2));
    assert!(
        stats
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("the announcement says")),
        "{stats:?}"
    );
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let _ = stop_server.send(());
    server.await.unwrap();

    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "failed requests: {failures:?}");
    let answers = answers.lock().unwrap();
    for client in 0..4 {
        let versions: Vec<u64> = answers
            .iter()
            .filter(|a| a.client == client)
            .map(|a| a.version)
            .collect();
        assert!(
            versions.windows(2).all(|w| w[0] <= w[1]),
            "client {client} went backwards: {versions:?}"
        );
    }

    // Provenance: every turn is recorded in its version's file, and its log-probs are those of
    // that version's weights (version 0: the checkpoint as loaded, a fresh adapter computing as
    // the base; later: the learner's export, whole or an adapter over the checkpoint).
    let ck0 = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    let mut models = vec![ck0.model.clone()];
    for w in &blobs {
        let mcfg = learner.model_config();
        models.push(match &lora {
            None => {
                model_from_safetensors::<CpuBackend>(mcfg, &w.bytes, &Default::default()).unwrap()
            }
            Some(l) => {
                let adapter = adapter_from_safetensors(&w.bytes, l.clone(), mcfg, "a version");
                ck0.model.clone().with_lora(&adapter.unwrap()).unwrap()
            }
        });
    }
    let mut records: BTreeMap<String, TurnRecord> = BTreeMap::new();
    for (v, path) in turns.iter().enumerate() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for line in text.lines() {
            let r: TurnRecord = serde_json::from_str(line).unwrap();
            assert_eq!(r.version, v as u64, "a turn in the wrong version's file");
            records.insert(r.session_id.clone(), r);
        }
    }
    let max_diff = |r: &TurnRecord, v: u64| -> f32 {
        let scored = score_batch(
            &models[v as usize],
            &[(&r.prompt_ids[..], &r.response_ids[..])],
        );
        scored[0]
            .iter()
            .zip(&r.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    };
    let mut per_version: BTreeMap<u64, usize> = BTreeMap::new();
    let mut crossed = 0;
    for a in answers.iter() {
        let r = records
            .get(&a.session)
            .unwrap_or_else(|| panic!("session {} was not recorded", a.session));
        assert_eq!(r.version, a.version);
        *per_version.entry(a.version).or_default() += 1;
        let own = max_diff(r, a.version);
        assert!(
            own < SAME_WEIGHTS_TOL,
            "a turn answered as version {} does not score as that version (max diff {own})",
            a.version
        );
        if a.serving_at_end > a.version && crossed < 8 {
            crossed += 1;
            let later = max_diff(r, a.serving_at_end);
            assert!(
                later > SAME_WEIGHTS_TOL,
                "versions {} and {} give the same log-probs: the update changed nothing",
                a.version,
                a.serving_at_end
            );
        }
    }
    assert_eq!(
        per_version.keys().copied().collect::<Vec<_>>(),
        (0..=LAST).collect::<Vec<_>>(),
        "every version serves"
    );
    eprintln!(
        "{} answers over {} versions ({per_version:?}), {crossed} checked across a switch, {:.1?}",
        answers.len(),
        LAST + 1,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_streams_each_token_then_the_result() {
    let ck = load_checkpoint::<CpuBackend>(Path::new(FIXTURE), &Default::default()).unwrap();
    let engine = spawn_engine(
        Arc::new(ck.model),
        None,
        EngineOptions {
            max_batch: 4,
            max_context: 128,
            ..EngineOptions::default()
        },
    );
    let request = GenerationRequest {
        prompt_ids: vec![1, 91, 89, 292, 205, 13],
        params: SamplingParams {
            temperature: 1.0,
            max_new_tokens: 12,
            seed: 7,
            ..SamplingParams::default()
        },
        raw_logprobs: None,
    };
    let whole = engine.generate(request.clone()).await.unwrap();
    let mut rx = engine.submit_streaming(request);
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    let finished = loop {
        match rx.recv().await.expect("the stream ends with a result") {
            StreamEvent::Token { id, logprob, raw } => {
                assert_eq!(raw, None, "raw log-probs only when asked");
                ids.push(id);
                lps.push(logprob);
            }
            StreamEvent::Finished(r) => break r,
            StreamEvent::Failed(e) => panic!("refused: {e}"),
        }
    };
    assert!(rx.recv().await.is_none(), "nothing after the result");
    assert_eq!((&finished.response_ids, &finished.logprobs), (&ids, &lps));
    assert_eq!(finished, whole, "streaming changes nothing but delivery");

    let mut bad = engine.submit_streaming(GenerationRequest {
        prompt_ids: Vec::new(),
        params: SamplingParams::default(),
        raw_logprobs: None,
    });
    assert_eq!(
        bad.recv().await,
        Some(StreamEvent::Failed(EngineError::EmptyPrompt))
    );
    assert!(bad.recv().await.is_none());
}
