//! Serving never pauses for a weight update: several clients keep generating through a
//! `RolloutWorker` over the Qwen3 engine (fixture model) while a real learner trains on their
//! rollouts and five new versions land. No request fails, each client's versions never go
//! backwards, every version serves, and requests in flight at a switch finish on the version
//! they started with — checked by scoring each response's tokens under every version's weights.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clawrl::model::{
    load_model, model_from_safetensors, score_batch, EngineOptions, GenerationRequest,
    GenerationResult, SamplingParams,
};
use clawrl::serve::{local_announce, EnginePolicy};
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use clawrl::{CpuAutodiff, CpuBackend};
use clawrl_actors::loops::{
    Generated, PolicyReplica, RolloutArgs, RolloutMsg, RolloutWorker, UpdateOutcome,
};
use ractor::Actor;

const DIR: &str = "tests/fixtures/qwen3-tiny";
const CLIENTS: usize = 4;
const UPDATES: u64 = 5;
/// Largest |engine log-prob − scored log-prob| for the weights that produced a token.
const SAME_WEIGHTS_TOL: f32 = 2e-3;

const PROMPTS: [&[u32]; 4] = [
    &[1, 91, 89, 292, 205, 13],
    &[1, 89, 40, 41],
    &[1, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    &[1, 300, 301, 302, 77],
];

struct Served {
    client: usize,
    prompt: Vec<u32>,
    result: Generated<GenerationResult>,
}

type Policy = EnginePolicy<CpuBackend>;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn generation_never_pauses_while_five_weight_versions_land() {
    let started = Instant::now();
    let device = Default::default();
    let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
    let train = TrainConfig {
        lr: 1e-2,
        kl_coef: 0.0,
        batch_size: 4,
        ..TrainConfig::default()
    };
    let mut learner = BurnLearner::new(cfg, model, train, device, 11);
    let mut blobs = vec![learner.export_weights().unwrap()];
    let options = EngineOptions {
        max_batch: 8,
        max_context: 256,
        ..EngineOptions::default()
    };
    let policy = Arc::new(Policy::new(
        learner.model_config().clone(),
        None,
        options,
        Default::default(),
    ));
    let v0 = Arc::new(policy.load(0, &blobs[0].bytes.clone().into()).unwrap());
    let args = RolloutArgs {
        policy,
        source: None,
        initial: Some((0, v0)),
    };
    let (worker, _) = Actor::spawn(None, RolloutWorker::<Policy>::new(), args)
        .await
        .unwrap();

    let log: Arc<Mutex<Vec<Served>>> = Arc::default();
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (worker, log, failures, stop) =
                (worker.clone(), log.clone(), failures.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let prompt = PROMPTS[(client + i as usize) % PROMPTS.len()].to_vec();
                    let request = GenerationRequest {
                        prompt_ids: prompt.clone(),
                        params: SamplingParams {
                            temperature: 1.0,
                            max_new_tokens: 16,
                            seed: client as u64 * 1_000_000 + i,
                            ..SamplingParams::default()
                        },
                        raw_logprobs: None,
                    };
                    i += 1;
                    match ractor::call!(worker, RolloutMsg::Generate, request) {
                        Ok(Ok(result)) => log.lock().unwrap().push(Served {
                            client,
                            prompt,
                            result,
                        }),
                        Ok(Err(e)) => failures.lock().unwrap().push(format!("{client}: {e}")),
                        Err(e) => failures.lock().unwrap().push(format!("{client}: {e}")),
                    }
                }
            })
        })
        .collect();

    // Version 0 serves every client before the first update lands.
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.lock().unwrap().len() < CLIENTS {
        assert!(
            Instant::now() < deadline,
            "no rollout completed on version 0"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    for version in 1..=UPDATES {
        // Train on the latest rollouts with a scripted reward (favour even token ids).
        let samples: Vec<Sample> = {
            let log = log.lock().unwrap();
            log.iter()
                .rev()
                .take(4)
                .map(|s| {
                    let r = &s.result.output.response_ids;
                    let even = r.iter().filter(|t| *t % 2 == 0).count();
                    let a = if 2 * even >= r.len() { 1.0 } else { -1.0 };
                    Sample {
                        prompt_ids: s.prompt.clone(),
                        response_ids: r.clone(),
                        advantages: vec![a; r.len()],
                        old_logprobs: None,
                        ref_logprobs: None,
                        rollout_logprobs: Some(s.result.output.logprobs.clone()),
                        opd: None,
                        importance: None,
                    }
                })
                .collect()
        };
        assert!(
            !samples.is_empty(),
            "no rollout completed before update {version}"
        );
        let metrics = tokio::task::block_in_place(|| learner.step(&samples)).unwrap();
        assert_eq!((metrics.version, metrics.skipped), (version, None));
        let weights = learner.export_weights().unwrap();
        let (announce, bytes) = local_announce(&weights, "trainer").unwrap();
        blobs.push(weights);
        let outcome = ractor::call!(worker, |port| RolloutMsg::Install(
            announce,
            bytes,
            Some(port)
        ))
        .unwrap();
        assert_eq!(outcome, UpdateOutcome::Switched { version });
        // Let every client be served by the new version before the next one lands.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let done: BTreeSet<usize> = log
                .lock()
                .unwrap()
                .iter()
                .filter(|s| s.result.version == version)
                .map(|s| s.client)
                .collect();
            if done.len() == CLIENTS {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "clients starved on version {version}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }

    let stats = ractor::call!(worker, RolloutMsg::Stats).unwrap();
    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "failed requests: {failures:?}");
    let log = log.lock().unwrap();
    assert_eq!(stats.completed, log.len() as u64);
    assert_eq!(
        (stats.failed, stats.in_flight, stats.switches),
        (0, 0, UPDATES)
    );

    // Versions never go backwards for any client, and every version served.
    for client in 0..CLIENTS {
        let versions: Vec<u64> = log
            .iter()
            .filter(|s| s.client == client)
            .map(|s| s.result.version)
            .collect();
        assert!(
            versions.windows(2).all(|w| w[0] <= w[1]),
            "client {client} went backwards: {versions:?}"
        );
    }
    let per_version: BTreeMap<u64, usize> = log.iter().fold(BTreeMap::new(), |mut m, s| {
        *m.entry(s.result.version).or_default() += 1;
        m
    });
    assert_eq!(
        per_version.keys().copied().collect::<Vec<_>>(),
        (0..=UPDATES).collect::<Vec<_>>()
    );

    // Provenance: each response's log-probs are those of the version it names, and for requests
    // that were in flight across a switch, not those of the version serving when they finished.
    let models: Vec<_> = blobs
        .iter()
        .map(|w| {
            model_from_safetensors::<CpuBackend>(
                learner.model_config(),
                &w.bytes,
                &Default::default(),
            )
            .unwrap()
        })
        .collect();
    let max_diff = |s: &Served, v: u64| -> f32 {
        let scored = score_batch(
            &models[v as usize],
            &[(&s.prompt[..], &s.result.output.response_ids[..])],
        );
        scored[0]
            .iter()
            .zip(&s.result.output.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    };
    let mut crossed = 0;
    for s in log.iter() {
        let own = max_diff(s, s.result.version);
        assert!(
            own < SAME_WEIGHTS_TOL,
            "a response tagged version {} does not score as that version (max diff {own})",
            s.result.version
        );
        if s.result.serving_at_finish > s.result.version {
            crossed += 1;
            let later = max_diff(s, s.result.serving_at_finish);
            assert!(
                later > SAME_WEIGHTS_TOL,
                "versions {} and {} give the same log-probs: the update changed nothing",
                s.result.version,
                s.result.serving_at_finish
            );
        }
    }
    assert!(crossed > 0, "no request was in flight across a switch");
    eprintln!(
        "{} requests from {CLIENTS} clients, per version {per_version:?}, {crossed} crossed a \
         switch, {:.1} s",
        log.len(),
        started.elapsed().as_secs_f64()
    );
}
