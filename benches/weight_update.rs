//! Weight-update latency: from the end of a trainer step (the learner's optimizer step returns)
//! until every replica serves the new version, through the real path:
//!
//! 1. the `Trainer` actor's learner thread exports the weights (safetensors, f32) and publishes
//!    them on the trainer node's bulk plane (manifest + blake3 per chunk);
//! 2. the trainer announces the version to its subscribers; each replica's `RolloutWorker` gets
//!    `RolloutMsg::Announce`;
//! 3. each worker fetches the blob from the trainer node over QUIC on loopback (its own node,
//!    its own endpoint, mutual TLS), verifies size and content hash, loads it into a new engine
//!    beside the serving one on a blocking thread, and switches.
//!
//! Latency = the last replica's switch − the step's end. All nodes are in this one process on one
//! machine (they share its cores), so with 4 replicas the 4 fetches and 4 loads compete for the
//! same CPUs; on separate machines they would run in parallel. Two ways to move the bytes:
//! `fetch` (the trainer publishes; every replica fetches from the trainer: a star) and, for
//! more than one replica, `relay` (`RelayPublisher`: the trainer pushes the blob through a
//! relay chain to the replicas' nodes before announcing; their fetches are then local).
//!
//! Shapes: the test fixture `tests/fixtures/qwen3-tiny` and `benches/shapes/qwen3-20m` (random
//! weights), each also with a LoRA adapter (`20m-lora16`: rank 16 on every linear layer), whose
//! versions are the adapter alone, attached by each replica to the base it holds (fetched once
//! in `procs` mode). Reference in the same run: one replica's load of the same bytes alone
//! (`EnginePolicy::load`), and one plain bulk-plane fetch of the blob, to say where the time goes.
//!
//! `WU_MODE=procs` (or `both`: the two in one run) measures the same with every replica in its
//! own OS process: the bench is a real cluster node running the `Trainer`, each replica a child
//! `clawrl node` with the `rollout` role (its `RolloutHost`), offered each version with
//! `RolloutRequest::Serve` and polled every 5 ms until it serves it (mode `procs`; see
//! `weight_update/procs.rs`).
//!
//! `WU_ROUNDS` (default 3) updates per configuration; `WU_SHAPES` (default `tiny,20m`);
//! `WU_REPLICAS` (default `1,4`); `WU_MODE` (`inproc` (default), `procs`, `both`). Prints one
//! JSON line per configuration and a table.

#[path = "../actors/tests/runtime/loopback.rs"]
mod loopback;
#[path = "weight_update/procs.rs"]
mod procs;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use clawrl::model::{
    load_model, EngineOptions, LoraConfig, LoraTarget, LoraWeights, Qwen3, Qwen3Config,
};
use clawrl::pipeline::learner::PolicyLearner;
use clawrl::serve::{EnginePolicy, VersionWeights};
use clawrl::train::learner::BurnLearner;
use clawrl::train::TrainConfig;
use clawrl::{CpuAutodiff, CpuBackend};
use clawrl_actors::bulk::BulkConfig;
use clawrl_actors::loops::{
    PolicyReplica, RelayPublisher, RolloutArgs, RolloutMsg, RolloutWorker, TrainSample, Trainer,
    TrainerArgs, TrainerConfig, TrainerEvent, TrainerMsg, UpdateOutcome,
};
use ractor::{Actor, ActorRef};

type Policy = EnginePolicy<CpuBackend>;

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The learner of `shape`: `tiny` (the test fixture) or `20m` (`benches/shapes/qwen3-20m`,
/// random weights), either with `-loraR` (e.g. `20m-lora16`): a fresh rank-R adapter on every
/// linear layer (alpha 2R), so that versions are the adapter alone.
fn learner(shape: &str) -> BurnLearner<CpuAutodiff> {
    let device = Default::default();
    let train = TrainConfig {
        lr: 1e-4,
        kl_coef: 0.0,
        ..TrainConfig::default()
    };
    let (base, rank) = match shape.split_once("-lora") {
        Some((base, r)) => (base, Some(r.parse::<usize>().expect("WU_SHAPES: -loraR"))),
        None => (shape, None),
    };
    let (cfg, model) = match base {
        "tiny" => load_model::<CpuAutodiff>(Path::new("tests/fixtures/qwen3-tiny"), &device)
            .expect("the fixture model loads"),
        "20m" => {
            let text = std::fs::read_to_string("benches/shapes/qwen3-20m/config.json")
                .expect("benches/shapes/qwen3-20m/config.json");
            let cfg = Qwen3Config::from_json(&text).expect("valid config");
            let model = Qwen3::<CpuAutodiff>::init(&cfg, &device, 0);
            (cfg, model)
        }
        other => panic!("WU_SHAPES: unknown shape {other:?} (expected tiny or 20m, -loraR)"),
    };
    let model = match rank {
        None => model,
        Some(r) => {
            let lora = LoraConfig::new(r, 2.0 * r as f64, LoraTarget::ALL.to_vec())
                .expect("a valid adapter shape");
            model
                .with_lora(&LoraWeights::fresh(&lora, &cfg, 1))
                .expect("the adapter fits")
        }
    };
    BurnLearner::new(cfg, model, train, device, 1)
}

/// How the learner's versions are read: whole weights, or its adapters over its frozen base.
fn version_weights(learner: &PolicyLearner) -> VersionWeights<CpuBackend> {
    let policy = learner.inner().policy().valid();
    match policy.lora_config() {
        None => VersionWeights::Full,
        Some(config) => VersionWeights::Adapter {
            base: Box::new(policy.without_lora()),
            config,
        },
    }
}

/// Switch instants per (version, replica).
type Switches = Arc<Mutex<HashMap<(u64, usize), Instant>>>;

#[derive(Default)]
struct StepTimes {
    finished: HashMap<u64, Instant>,
    export_ms: HashMap<u64, f64>,
    publish_ms: HashMap<u64, f64>,
}

/// Two samples of job `job` for a learner at `version`, different every round.
fn samples(job: &str, vocab: u32, version: u64, round: u32) -> Vec<TrainSample> {
    (0..2u32)
        .map(|i| {
            let ids = |n: u32, off: u32| -> Vec<u32> {
                (0..n)
                    .map(|k| (k * 7919 + off * 104_729 + round * 31 + i) % vocab)
                    .collect()
            };
            TrainSample {
                job: job.into(),
                session_id: format!("s{i}"),
                turn: round,
                version,
                prompt_ids: ids(16, 1),
                response_ids: ids(16, 2),
                advantages: vec![if i == 0 { 1.0 } else { -1.0 }; 16],
                rollout_logprobs: None,
                opd: None,
            }
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

async fn wait_all(switches: &Switches, version: u64, replicas: usize) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        {
            let s = switches.lock().unwrap();
            let got: Vec<Instant> = (0..replicas)
                .filter_map(|r| s.get(&(version, r)).copied())
                .collect();
            if got.len() == replicas {
                return got.into_iter().max().unwrap();
            }
        }
        assert!(
            Instant::now() < deadline,
            "version {version} did not reach every replica"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

struct Row {
    shape: String,
    mode: &'static str,
    replicas: usize,
    blob_mib: f64,
    latency_ms: Vec<f64>,
    export_ms: Vec<f64>,
    publish_ms: Vec<f64>,
    load_ref_ms: f64,
    fetch_ref_ms: f64,
}

async fn measure(shape: &str, replicas: usize, relay: bool, rounds: u32) -> Row {
    let policy_learner = PolicyLearner::new(learner(shape), 0);
    let model_config = policy_learner.model_config().clone();
    let vocab = model_config.vocab_size as u32;
    let ca = loopback::TestCa::new();
    let book = loopback::Book::default();
    let trainer_node = loopback::node(&ca, &book, "trainer", BulkConfig::new("unset"));
    let options = EngineOptions {
        max_batch: 1,
        max_context: 64,
        prefix_cache_bytes: 0,
    };
    let policy = Arc::new(Policy::with_weights(
        model_config.clone(),
        version_weights(&policy_learner),
        None,
        options,
        Default::default(),
    ));
    let mut nodes = Vec::new();
    let mut workers: Vec<ActorRef<RolloutMsg<Policy>>> = Vec::new();
    for r in 0..replicas {
        let mut cfg = BulkConfig::new("unset");
        cfg.capacity = 1 << 30;
        let node = loopback::node(&ca, &book, &format!("replica{r}"), cfg);
        let (w, _) = Actor::spawn(
            None,
            RolloutWorker::<Policy>::new(),
            RolloutArgs {
                policy: policy.clone(),
                source: Some(Arc::new(node.plane.clone())),
                initial: None,
            },
        )
        .await
        .unwrap();
        workers.push(w);
        nodes.push(node);
    }

    let switches: Switches = Arc::default();
    let times: Arc<Mutex<StepTimes>> = Arc::default();
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let blob: Arc<Mutex<Option<(clawrl_actors::loops::WeightAnnounce, bytes::Bytes)>>> =
        Arc::default();
    let subscriber = {
        let (workers, switches, times, failures, blob) = (
            workers.clone(),
            switches.clone(),
            times.clone(),
            failures.clone(),
            blob.clone(),
        );
        Arc::new(move |event: &TrainerEvent| {
            match event {
                TrainerEvent::Published {
                    announce,
                    bytes,
                    step_finished,
                } => {
                    if let Some(t) = step_finished {
                        times.lock().unwrap().finished.insert(announce.version, *t);
                    }
                    *blob.lock().unwrap() = Some((announce.clone(), bytes.clone()));
                    for (r, w) in workers.iter().enumerate() {
                        let (tx, rx) = ractor::concurrency::oneshot();
                        let _ = w.cast(RolloutMsg::Announce(announce.clone(), Some(tx.into())));
                        let (switches, failures) = (switches.clone(), failures.clone());
                        tokio::spawn(async move {
                            match rx.await {
                                Ok(UpdateOutcome::Switched { version }) => {
                                    switches
                                        .lock()
                                        .unwrap()
                                        .insert((version, r), Instant::now());
                                }
                                other => failures.lock().unwrap().push(format!("{other:?}")),
                            }
                        });
                    }
                }
                TrainerEvent::Step(s) => {
                    let mut t = times.lock().unwrap();
                    t.export_ms.insert(s.version, s.export_ms);
                    t.publish_ms.insert(s.version, s.publish_ms);
                }
                _ => {}
            }
            true
        }) as clawrl_actors::loops::Subscriber
    };
    let config = TrainerConfig {
        batch_size: 2,
        max_lag: 1000,
        ..TrainerConfig::new("bench")
    };
    let (trainer, _) = Actor::spawn(
        None,
        Trainer::<PolicyLearner>::new(),
        TrainerArgs {
            config,
            learner: policy_learner,
            publisher: if relay {
                let names = (0..replicas).map(|r| format!("replica{r}")).collect();
                Arc::new(RelayPublisher::new(trainer_node.plane.clone(), names).unwrap())
            } else {
                Arc::new(trainer_node.plane.clone())
            },
            subscribers: vec![subscriber],
        },
    )
    .await
    .unwrap();
    wait_all(&switches, 0, replicas).await;

    let mut row = Row {
        shape: shape.to_string(),
        mode: if relay { "relay" } else { "fetch" },
        replicas,
        blob_mib: 0.0,
        latency_ms: Vec::new(),
        export_ms: Vec::new(),
        publish_ms: Vec::new(),
        load_ref_ms: 0.0,
        fetch_ref_ms: 0.0,
    };
    for round in 1..=rounds {
        trainer
            .cast(TrainerMsg::Samples(samples(
                "bench",
                vocab,
                round as u64 - 1,
                round,
            )))
            .unwrap();
        let all = wait_all(&switches, round as u64, replicas).await;
        let t = times.lock().unwrap();
        let finished = t.finished[&(round as u64)];
        row.latency_ms.push((all - finished).as_secs_f64() * 1e3);
        row.export_ms.push(t.export_ms[&(round as u64)]);
        row.publish_ms.push(t.publish_ms[&(round as u64)]);
    }
    let failures = failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "updates failed: {failures:?}");

    // References: one load of the newest bytes alone, one plain fetch by a fresh node.
    let (announce, bytes) = blob.lock().unwrap().clone().unwrap();
    row.blob_mib = bytes.len() as f64 / (1 << 20) as f64;
    let p = policy.clone();
    let b = bytes.clone();
    let t = Instant::now();
    let loaded = tokio::task::spawn_blocking(move || p.load(announce.version, &b).unwrap())
        .await
        .unwrap();
    row.load_ref_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(loaded);
    let probe = loopback::node(&ca, &book, "probe", BulkConfig::new("unset"));
    let t = Instant::now();
    let got = probe.plane.fetch(announce.blob, "trainer").await.unwrap();
    row.fetch_ref_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(got.len(), bytes.len());

    trainer.stop(None);
    for w in workers {
        w.stop(None);
    }
    for n in nodes.iter().chain([&trainer_node, &probe]) {
        n.endpoint.close(0u32.into(), b"done");
    }
    row
}

fn main() {
    let rounds: u32 = std::env::var("WU_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let shapes = env_list("WU_SHAPES", "tiny,20m");
    let replicas: Vec<usize> = env_list("WU_REPLICAS", "1,4")
        .iter()
        .map(|r| r.parse().expect("WU_REPLICAS: comma-separated counts"))
        .collect();
    let mode = std::env::var("WU_MODE").unwrap_or_else(|_| "inproc".to_string());
    let (inproc, separate) = match mode.as_str() {
        "inproc" => (true, false),
        "procs" => (false, true),
        "both" => (true, true),
        other => panic!("WU_MODE: unknown mode {other:?} (expected inproc, procs or both)"),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let cluster = separate.then(|| {
        let configs: Vec<(String, usize)> = shapes
            .iter()
            .flat_map(|s| replicas.iter().map(move |&n| (s.clone(), n)))
            .collect();
        rt.block_on(procs::Cluster::start(&configs))
    });
    let mut rows = Vec::new();
    for shape in &shapes {
        let modes = replicas.iter().flat_map(|&n| {
            let own = inproc.then_some((n, "fetch"));
            let relay = (inproc && n > 1).then_some((n, "relay"));
            let procs = separate.then_some((n, "procs"));
            own.into_iter().chain(relay).chain(procs)
        });
        for (n, mode) in modes {
            let row = match (mode, &cluster) {
                ("procs", Some(c)) => rt.block_on(procs::measure(c, shape, n, rounds)),
                _ => rt.block_on(measure(shape, n, mode == "relay", rounds)),
            };
            let mut l = row.latency_ms.clone();
            let mut e = row.export_ms.clone();
            let mut p = row.publish_ms.clone();
            println!(
                "{}",
                serde_json::json!({
                    "bench": "weight_update",
                    "shape": row.shape,
                    "mode": row.mode,
                    "replicas": row.replicas,
                    "blob_mib": row.blob_mib,
                    "rounds": rounds,
                    "latency_ms": row.latency_ms,
                    "latency_ms_median": median(&mut l),
                    "export_ms_median": median(&mut e),
                    "publish_ms_median": median(&mut p),
                    "ref_load_ms": row.load_ref_ms,
                    "ref_fetch_ms": row.fetch_ref_ms,
                })
            );
            rows.push(row);
        }
    }
    println!();
    println!(
        "{:<12} {:<6} {:>8} {:>9} {:>12} {:>10} {:>10} {:>10} {:>10} {:>14}",
        "shape",
        "mode",
        "replicas",
        "blob MiB",
        "latency p50",
        "max",
        "export",
        "publish",
        "ref load",
        "ref fetch (1)"
    );
    for row in &rows {
        let mut l = row.latency_ms.clone();
        let max = l.iter().cloned().fold(0.0, f64::max);
        let mut e = row.export_ms.clone();
        let mut p = row.publish_ms.clone();
        println!(
            "{:<12} {:<6} {:>8} {:>9.2} {:>10.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>12.1}ms",
            row.shape,
            row.mode,
            row.replicas,
            row.blob_mib,
            median(&mut l),
            max,
            median(&mut e),
            median(&mut p),
            row.load_ref_ms,
            row.fetch_ref_ms
        );
    }
    // Scaling ratio per shape: 4 replicas vs 1 (same run).
    for shape in &shapes {
        let find = |n: usize, mode: &str| {
            rows.iter()
                .find(|r| &r.shape == shape && r.replicas == n && r.mode == mode)
                .map(|r| median(&mut r.latency_ms.clone()))
        };
        if let (Some(one), Some(four)) = (find(1, "fetch"), find(4, "fetch")) {
            println!(
                "{shape}: latency with 4 replicas / with 1 = {:.2} (fetch)",
                four / one
            );
        }
        if let (Some(one), Some(four)) = (find(1, "fetch"), find(4, "relay")) {
            println!(
                "{shape}: latency with 4 replicas (relay) / with 1 = {:.2}",
                four / one
            );
        }
        if let (Some(one), Some(four)) = (find(1, "procs"), find(4, "procs")) {
            println!(
                "{shape}: latency with 4 replica processes / with 1 = {:.2}",
                four / one
            );
        }
        for &n in &replicas {
            if let (Some(own), Some(sep)) = (find(n, "fetch"), find(n, "procs")) {
                println!(
                    "{shape}: latency with {n} replica processes / {n} replicas in this process = {:.2}",
                    sep / own
                );
            }
        }
    }
    if let Some(c) = cluster {
        rt.block_on(c.shutdown());
    }
}
