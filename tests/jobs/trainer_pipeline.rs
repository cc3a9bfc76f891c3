//! The trainer actor over the real Qwen3 learner (fixture model) and a `RolloutWorker` over the
//! generation engine: rollouts become samples, every two samples the trainer steps, the replica
//! switches to each new version, the served weights are the trainer's (hash of the checkpointed
//! weights = hash the replica verified), the train/serve log-prob gap is small, and after the
//! trainer is killed a fresh one resumes from the checkpoint: the version counts on and the next
//! step equals the uninterrupted run's. Also: truncated importance weights in the real learner
//! equal training on advantages scaled by them.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use clawrl::model::{load_model, EngineOptions, GenerationRequest, SamplingParams};
use clawrl::pipeline::learner::PolicyLearner;
use clawrl::rl::staleness::truncated_importance_weights;
use clawrl::serve::EnginePolicy;
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use clawrl::{CpuAutodiff, CpuBackend};
use clawrl_actors::loops::{
    rollout_subscriber, Delivery, Importance, Learner as _, LocalPublisher, RolloutArgs,
    RolloutMsg, RolloutWorker, TrainSample, Trainer, TrainerArgs, TrainerConfig, TrainerEvent,
    TrainerMsg, TrainerStats,
};
use ractor::{Actor, ActorRef};

const DIR: &str = "tests/fixtures/qwen3-tiny";
type Policy = EnginePolicy<CpuBackend>;

fn learner(seed: u64) -> BurnLearner<CpuAutodiff> {
    let device = Default::default();
    let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
    let train = TrainConfig {
        lr: 1e-2,
        kl_coef: 0.0,
        ..TrainConfig::default()
    };
    BurnLearner::new(cfg, model, train, device, seed)
}

async fn serving(w: &ActorRef<RolloutMsg<Policy>>, version: u64) {
    for _ in 0..1000 {
        let s = ractor::call!(w, RolloutMsg::Stats).unwrap();
        assert_eq!(s.failed_updates, 0, "{:?}", s.last_update_error);
        if s.version == Some(version) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the replica never served version {version}");
}

/// Two rollouts from the replica as samples (reward: +1 when most response ids are even).
async fn rollouts(w: &ActorRef<RolloutMsg<Policy>>, round: u32) -> Vec<TrainSample> {
    let mut out = Vec::new();
    for i in 0..2u32 {
        let prompt = vec![1, 91 + i, 89, 292, 205 + round, 13];
        let request = GenerationRequest {
            prompt_ids: prompt.clone(),
            params: SamplingParams {
                temperature: 1.0,
                max_new_tokens: 8,
                seed: (round * 2 + i) as u64,
                ..SamplingParams::default()
            },
            raw_logprobs: None,
        };
        let g = ractor::call!(w, RolloutMsg::Generate, request)
            .unwrap()
            .unwrap();
        let r = g.output.response_ids;
        let even = r.iter().filter(|t| *t % 2 == 0).count();
        let a = if 2 * even >= r.len() { 1.0 } else { -1.0 };
        out.push(TrainSample {
            job: "pipeline".into(),
            session_id: format!("s{i}"),
            turn: round,
            version: g.version,
            prompt_ids: prompt,
            advantages: vec![a; r.len()],
            response_ids: r,
            rollout_logprobs: Some(g.output.logprobs),
            opd: None,
        });
    }
    out
}

type Heard = Arc<Mutex<Vec<TrainerEvent>>>;

async fn trainer(
    cfg: &TrainerConfig,
    worker: &ActorRef<RolloutMsg<Policy>>,
    heard: &Heard,
) -> ActorRef<TrainerMsg> {
    let h = heard.clone();
    let args = TrainerArgs {
        config: cfg.clone(),
        learner: PolicyLearner::new(learner(7), 2),
        publisher: Arc::new(LocalPublisher {
            source: "trainer".into(),
        }),
        subscribers: vec![
            rollout_subscriber(worker.clone(), Delivery::Install),
            Arc::new(move |e: &TrainerEvent| {
                h.lock().unwrap().push(e.clone());
                true
            }),
        ],
    };
    Actor::spawn(None, Trainer::<PolicyLearner>::new(), args)
        .await
        .unwrap()
        .0
}

async fn idle(t: &ActorRef<TrainerMsg>) -> TrainerStats {
    let s = ractor::call_t!(t, TrainerMsg::Idle, 120_000).unwrap();
    assert!(s.balanced(), "{s:?}");
    assert_eq!(s.last_error, None);
    s
}

/// The bytes the trainer published as `version`.
fn published_bytes(heard: &Heard, version: u64) -> Bytes {
    heard
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find_map(|e| match e {
            TrainerEvent::Published {
                announce, bytes, ..
            } if announce.version == version => {
                assert_eq!(announce.size, bytes.len() as u64);
                Some(bytes.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("version {version} was never published"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_serves_the_trainers_versions_and_a_restart_counts_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = learner(7).model_config().clone();
    let policy = Arc::new(Policy::new(
        config,
        None,
        EngineOptions {
            max_batch: 4,
            max_context: 128,
            ..EngineOptions::default()
        },
        Default::default(),
    ));
    let worker = Actor::spawn(
        None,
        RolloutWorker::<Policy>::new(),
        RolloutArgs {
            policy,
            source: None,
            initial: None,
        },
    )
    .await
    .unwrap()
    .0;
    let cfg = TrainerConfig {
        batch_size: 2,
        max_lag: 0,
        checkpoint_dir: Some(dir.path().to_path_buf()),
        ..TrainerConfig::new("pipeline")
    };
    let heard: Heard = Arc::default();
    let t = trainer(&cfg, &worker, &heard).await;
    // The trainer announces its starting version; the replica installs it.
    serving(&worker, 0).await;

    let mut batches = Vec::new();
    for version in 1..=2u64 {
        let batch = rollouts(&worker, version as u32).await;
        assert!(batch.iter().all(|s| s.version == version - 1));
        batches.push(batch.clone());
        t.cast(TrainerMsg::Samples(batch)).unwrap();
        let s = idle(&t).await;
        assert_eq!(
            (s.version, s.trained, s.checkpoints),
            (version, 2 * version, version)
        );
        serving(&worker, version).await;
    }
    // The checkpoint of version 2 holds the weights published as version 2.
    let v2 = published_bytes(&heard, 2);
    let ckpt = std::fs::read(dir.path().join("step-00000002/model.safetensors")).unwrap();
    assert!(
        ckpt[..] == v2[..],
        "the checkpoint differs from the published version 2"
    );
    let g = ractor::call!(
        worker,
        RolloutMsg::Generate,
        GenerationRequest {
            prompt_ids: vec![1, 2, 3],
            params: SamplingParams::default(),
            raw_logprobs: None,
        }
    )
    .unwrap()
    .unwrap();
    assert_eq!(g.version, 2);
    // Samples generated by the version being trained: train and serve agree per token.
    let gaps: Vec<f64> = heard
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            TrainerEvent::Step(s) => Some(s.logprob_gap.unwrap().mean_abs),
            _ => None,
        })
        .collect();
    assert_eq!(gaps.len(), 2);
    assert!(gaps.iter().all(|g| *g < 5e-3), "train/serve gap {gaps:?}");

    // The trainer dies; a fresh one (initial weights) resumes from the checkpoint.
    t.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let heard: Heard = Arc::default();
    let t = trainer(&cfg, &worker, &heard).await;
    let s = idle(&t).await;
    assert_eq!((s.resumed_from, s.version, s.steps), (Some(2), 2, 2));
    assert!(
        published_bytes(&heard, 2) == v2,
        "the resumed trainer's version 2 differs from the one it checkpointed"
    );
    let batch = rollouts(&worker, 3).await;
    batches.push(batch.clone());
    t.cast(TrainerMsg::Samples(batch)).unwrap();
    let s = idle(&t).await;
    assert_eq!((s.version, s.steps), (3, 3));
    serving(&worker, 3).await;

    // The resumed run's step equals the uninterrupted run's.
    let mut reference = learner(7);
    for b in &batches {
        let samples: Vec<Sample> = b
            .iter()
            .map(|s| Sample {
                prompt_ids: s.prompt_ids.clone(),
                response_ids: s.response_ids.clone(),
                advantages: s.advantages.clone(),
                old_logprobs: None,
                ref_logprobs: None,
                rollout_logprobs: s.rollout_logprobs.clone(),
                opd: None,
                importance: None,
            })
            .collect();
        reference.step(&samples).unwrap();
    }
    let expected = reference.export_weights().unwrap();
    assert_eq!(expected.version, 3);
    assert!(
        published_bytes(&heard, 3)[..] == expected.bytes[..],
        "the trainer's version 3 differs from the reference learner's"
    );
}

#[test]
fn importance_weights_scale_the_policy_gradient_in_the_real_learner() {
    let sample = |rollout: Vec<f32>| TrainSample {
        job: "j".into(),
        session_id: "s".into(),
        turn: 0,
        version: 0,
        prompt_ids: vec![1, 91, 89, 292],
        response_ids: vec![205, 13, 40, 41],
        advantages: vec![1.0, -1.0, 1.0, 0.5],
        rollout_logprobs: Some(rollout),
        opd: None,
    };
    let mut weighted = PolicyLearner::new(learner(3), 0);
    let probe = sample(vec![0.0; 4]);
    let as_sample = |s: &TrainSample| Sample {
        prompt_ids: s.prompt_ids.clone(),
        response_ids: s.response_ids.clone(),
        advantages: s.advantages.clone(),
        old_logprobs: None,
        ref_logprobs: None,
        rollout_logprobs: s.rollout_logprobs.clone(),
        opd: None,
        importance: None,
    };
    let trainer = weighted.inner().logprobs(&[as_sample(&probe)]).unwrap()[0].clone();
    // Rollout log-probs: one token far less likely (weight truncated at 2), one more likely
    // (weight e^-0.5), two equal (weight 1).
    let rollout = vec![trainer[0] - 3.0, trainer[1] + 0.5, trainer[2], trainer[3]];
    let s = sample(rollout.clone());
    let report = weighted
        .step(
            std::slice::from_ref(&s),
            &[Importance::Truncated { cap: 2.0 }],
        )
        .unwrap();
    let summary = report.importance.unwrap();
    assert_eq!((summary.tokens, summary.truncated), (4, 1));
    let w = truncated_importance_weights(&trainer, &rollout, 2.0).unwrap();
    let mean = w.iter().map(|&x| x as f64).sum::<f64>() / 4.0;
    assert!((summary.mean - mean).abs() < 1e-6);
    assert!((w[1] - (-0.5f32).exp()).abs() < 1e-5 && w[0] == 2.0);

    // The same step with the advantages scaled by hand.
    let mut scaled = learner(3);
    let mut manual = as_sample(&s);
    for (a, w) in manual.advantages.iter_mut().zip(&w) {
        *a *= w;
    }
    scaled.step(&[manual]).unwrap();
    let a = weighted.export(Vec::new()).unwrap();
    assert!(a.bytes[..] == scaled.export_weights().unwrap().bytes[..]);
    // And it differs from the unweighted step.
    let mut plain = PolicyLearner::new(learner(3), 0);
    plain
        .step(std::slice::from_ref(&s), &[Importance::None])
        .unwrap();
    assert!(plain.export(Vec::new()).unwrap().bytes[..] != a.bytes[..]);
}
