//! The trainer actor with a small real learner: a unigram policy over 16 tokens (logits `z`,
//! `π = softmax(z)`), trained by gradient descent on the importance-weighted policy-gradient
//! loss `mean_i mean_k −w_ik·A_ik·log π(y_ik)`. Its weights are the f32 bytes of `z`, so every
//! version is a distinct, checkable blob. Tests: counts balance, batching, staleness drop and
//! truncated importance weights, refused samples, announce order and weight hashes, a rollout
//! worker switching over the bulk plane on loopback QUIC, steps off the message loop, failed
//! steps retried then counted, checkpoint + resume with the version counting on.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use clawrl_actors::bulk::{BulkConfig, Manifest};
use clawrl_actors::loops::{
    rollout_subscriber, Delivery, ExportedWeights, Importance, ImportanceSummary, Learner,
    LocalPublisher, LogprobGap, OpdLossKind, PolicyReplica, RelayPublisher, RolloutArgs,
    RolloutMsg, RolloutWorker, SampleLimits, StalenessMode, StepReport, TrainSample, Trainer,
    TrainerArgs, TrainerConfig, TrainerEvent, TrainerMsg, TrainerStats, WeightPublisher,
};
use ractor::{Actor, ActorRef};

const VOCAB: usize = 16;
const LR: f32 = 0.5;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct LearnError(String);

/// Test controls shared with the learner on its thread.
#[derive(Default)]
struct Controls {
    /// Fail this many step calls.
    fail: AtomicU32,
    /// Skip (non-finite loss) this many step calls.
    skip: AtomicU32,
    /// When set, the next step blocks until the sender sends or is dropped.
    gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    /// Importance summaries of every applied step.
    importance: Mutex<Vec<Option<ImportanceSummary>>>,
    /// The capacity of the memory each export was handed to reuse.
    reused: Mutex<Vec<usize>>,
}

struct Unigram {
    z: Vec<f32>,
    version: u64,
    steps: u64,
    controls: Arc<Controls>,
}

impl Unigram {
    fn new(controls: Arc<Controls>) -> Self {
        Unigram {
            z: (0..VOCAB).map(|i| (i as f32 * 0.37).sin()).collect(),
            version: 0,
            steps: 0,
            controls,
        }
    }

    fn logp(z: &[f32]) -> Vec<f32> {
        let max = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
        z.iter().map(|v| v - lse).collect()
    }
}

fn to_bytes(z: &[f32]) -> Vec<u8> {
    z.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Learner for Unigram {
    type Error = LearnError;

    fn version(&self) -> u64 {
        self.version
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn limits(&self) -> SampleLimits {
        SampleLimits {
            vocab: Some(VOCAB),
            max_tokens: Some(64),
        }
    }

    fn step(
        &mut self,
        batch: &[TrainSample],
        importance: &[Importance],
    ) -> Result<StepReport, LearnError> {
        if let Some(gate) = self.controls.gate.lock().unwrap().take() {
            let _ = gate.recv();
        }
        let take = |c: &AtomicU32| {
            c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        };
        if take(&self.controls.fail) {
            return Err(LearnError("injected failure".into()));
        }
        assert_eq!(batch.len(), importance.len());
        let logp = Self::logp(&self.z);
        let p: Vec<f32> = logp.iter().map(|l| l.exp()).collect();
        let mut grad = vec![0f32; VOCAB];
        let mut loss = 0f64;
        let mut gap_pairs = Vec::new();
        let (mut w_sum, mut w_n, mut truncated) = (0f64, 0usize, 0usize);
        let n = batch.len() as f32;
        for (s, imp) in batch.iter().zip(importance) {
            let t = s.response_ids.len() as f32;
            for (k, &y) in s.response_ids.iter().enumerate() {
                let lp = logp[y as usize];
                if let Some(r) = &s.rollout_logprobs {
                    gap_pairs.push((r[k], lp));
                }
                let w = match imp {
                    Importance::None => 1.0,
                    Importance::Truncated { cap } => {
                        let r = s
                            .rollout_logprobs
                            .as_ref()
                            .expect("weighted samples have them");
                        let raw = (lp - r[k]).exp();
                        w_sum += raw.min(*cap) as f64;
                        w_n += 1;
                        truncated += usize::from(raw > *cap);
                        raw.min(*cap)
                    }
                };
                let c = w * s.advantages[k] / (t * n);
                loss -= (c * lp) as f64;
                for (v, g) in grad.iter_mut().enumerate() {
                    *g += c * (p[v] - if v == y as usize { 1.0 } else { 0.0 });
                }
            }
        }
        let grad_norm = grad.iter().map(|g| (g * g) as f64).sum::<f64>().sqrt();
        let summary = (w_n > 0).then(|| ImportanceSummary {
            tokens: w_n,
            mean: w_sum / w_n as f64,
            truncated,
        });
        let skipped = take(&self.controls.skip).then(|| "non-finite loss (NaN)".to_string());
        if skipped.is_none() {
            for (z, g) in self.z.iter_mut().zip(&grad) {
                *z -= LR * g;
            }
            self.version += 1;
            self.steps += 1;
            self.controls.importance.lock().unwrap().push(summary);
        }
        Ok(StepReport {
            version: self.version,
            steps: self.steps,
            skipped,
            loss,
            pg_loss: loss,
            kl: 0.0,
            clip_fraction: 0.0,
            grad_norm,
            opd_loss: OpdLossKind::Advantage,
            opd_samples: 0,
            old_recomputed: true,
            logprob_gap: LogprobGap::measure(gap_pairs),
            tokens: batch.iter().map(|s| s.response_ids.len()).sum(),
            // No forward pass: each token is counted once.
            packing_ratio: 1.0,
            importance: summary,
        })
    }

    fn export(&self, reuse: Vec<u8>) -> Result<ExportedWeights, LearnError> {
        self.controls.reused.lock().unwrap().push(reuse.capacity());
        let mut out = reuse;
        out.clear();
        out.extend_from_slice(&to_bytes(&self.z));
        Ok(ExportedWeights {
            version: self.version,
            bytes: Bytes::from(out),
        })
    }

    fn save_checkpoint(&mut self, root: &Path) -> Result<PathBuf, LearnError> {
        let e = |e: std::io::Error| LearnError(e.to_string());
        let dir = root.join(format!("step-{:08}", self.steps));
        let tmp = root.join(format!(".step-{:08}.tmp", self.steps));
        std::fs::create_dir_all(&tmp).map_err(e)?;
        std::fs::write(tmp.join("z.bin"), to_bytes(&self.z)).map_err(e)?;
        std::fs::write(
            tmp.join("state"),
            format!("{} {}", self.version, self.steps),
        )
        .map_err(e)?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(e)?;
        }
        std::fs::rename(&tmp, &dir).map_err(e)?;
        std::fs::write(
            root.join(".latest.tmp"),
            dir.file_name().unwrap().as_encoded_bytes(),
        )
        .map_err(e)?;
        std::fs::rename(root.join(".latest.tmp"), root.join("latest")).map_err(e)?;
        Ok(dir)
    }

    fn resume(&mut self, root: &Path) -> Result<bool, LearnError> {
        let e = |e: std::io::Error| LearnError(e.to_string());
        let Ok(name) = std::fs::read_to_string(root.join("latest")) else {
            return Ok(false);
        };
        let dir = root.join(name.trim());
        self.z = from_bytes(&std::fs::read(dir.join("z.bin")).map_err(e)?);
        let state = std::fs::read_to_string(dir.join("state")).map_err(e)?;
        let mut it = state.split(' ').map(|v| v.parse::<u64>().unwrap());
        self.version = it.next().unwrap();
        self.steps = it.next().unwrap();
        Ok(true)
    }

    fn advance_version(&mut self, to: u64) -> Result<(), LearnError> {
        assert!(to > self.version);
        self.version = to;
        Ok(())
    }
}

fn sample(version: u64, session: &str, turn: u32, ids: &[u32], adv: f32) -> TrainSample {
    TrainSample {
        job: "job-a".into(),
        session_id: session.into(),
        turn,
        version,
        prompt_ids: vec![1, 2],
        response_ids: ids.to_vec(),
        advantages: vec![adv; ids.len()],
        rollout_logprobs: None,
        opd: None,
    }
}

/// Every event a subscriber heard, in order.
type Heard = Arc<Mutex<Vec<TrainerEvent>>>;

fn recorder() -> (Heard, clawrl_actors::loops::Subscriber) {
    let heard: Heard = Arc::default();
    let h = heard.clone();
    (
        heard,
        Arc::new(move |e: &TrainerEvent| {
            h.lock().unwrap().push(e.clone());
            true
        }),
    )
}

fn config(batch: usize) -> TrainerConfig {
    TrainerConfig {
        batch_size: batch,
        ..TrainerConfig::new("job-a")
    }
}

async fn spawn(
    config: TrainerConfig,
    learner: Unigram,
    publisher: Arc<dyn WeightPublisher>,
    subscribers: Vec<clawrl_actors::loops::Subscriber>,
) -> ActorRef<TrainerMsg> {
    let args = TrainerArgs {
        config,
        learner,
        publisher,
        subscribers,
    };
    Actor::spawn(None, Trainer::<Unigram>::new(), args)
        .await
        .unwrap()
        .0
}

fn local() -> Arc<dyn WeightPublisher> {
    Arc::new(LocalPublisher {
        source: "trainer".into(),
    })
}

async fn idle(t: &ActorRef<TrainerMsg>) -> TrainerStats {
    let s = ractor::call_t!(t, TrainerMsg::Idle, 20_000).unwrap();
    assert!(s.balanced(), "counts do not balance: {s:?}");
    s
}

fn published_versions(heard: &Heard) -> Vec<u64> {
    heard
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            TrainerEvent::Published { announce, .. } => Some(announce.version),
            _ => None,
        })
        .collect()
}

/// The unigram's weights after training on `batches` in order from the initial weights.
fn replay(batches: &[Vec<TrainSample>]) -> Vec<f32> {
    let mut u = Unigram::new(Arc::default());
    for b in batches {
        u.step(b, &vec![Importance::None; b.len()]).unwrap();
    }
    u.z
}

#[tokio::test]
async fn batches_count_and_announce_in_order() {
    let (heard, sub) = recorder();
    let t = spawn(config(4), Unigram::new(Arc::default()), local(), vec![sub]).await;
    let all: Vec<TrainSample> = (0..10)
        .map(|i| {
            sample(
                0,
                "s",
                i,
                &[3 + i % 5, 4],
                if i % 2 == 0 { 1.0 } else { -1.0 },
            )
        })
        .collect();
    t.cast(TrainerMsg::Samples(all[..3].to_vec())).unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.produced, s.trained, s.pending, s.version, s.steps),
        (3, 0, 3, 0, 0)
    );
    t.cast(TrainerMsg::Samples(all[3..].to_vec())).unwrap();
    let s = idle(&t).await;
    // Batches of 4 from samples at version 0: both steps are within the default lag of 2.
    assert_eq!(
        (s.produced, s.trained, s.pending, s.version, s.steps),
        (10, 8, 2, 2, 2)
    );
    t.cast(TrainerMsg::Flush).unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.produced, s.trained, s.pending, s.dropped_stale),
        (10, 10, 0, 0)
    );
    assert_eq!((s.version, s.published), (3, Some(3)));

    // Version 0 at start, then one version per step, each after its step event.
    let events = heard.lock().unwrap().clone();
    assert_eq!(published_versions(&heard), vec![0, 1, 2, 3]);
    let mut last_step = 0;
    for e in &events {
        match e {
            TrainerEvent::Step(step) => {
                assert_eq!(step.version, last_step + 1);
                assert!(step.loss.is_finite() && step.grad_norm > 0.0);
                last_step = step.version;
            }
            TrainerEvent::Published {
                announce, bytes, ..
            } => {
                assert_eq!(
                    announce.version, last_step,
                    "published before its step event"
                );
                assert_eq!(announce.size, bytes.len() as u64);
                // The announcement names the bytes by their content.
                let manifest = Manifest::build(bytes, BulkConfig::new("trainer").chunk_size);
                assert_eq!(announce.blob, manifest.unwrap().id());
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    // The published bytes are the weights of training on the batches in arrival order.
    let TrainerEvent::Published { bytes, .. } = events.last().unwrap() else {
        panic!()
    };
    let expected = replay(&[all[..4].to_vec(), all[4..8].to_vec(), all[8..].to_vec()]);
    assert_eq!(from_bytes(bytes), expected);
    let sizes: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            TrainerEvent::Step(s) => Some(s.kept),
            _ => None,
        })
        .collect();
    assert_eq!(sizes, vec![4, 4, 2]);
}

/// An export writes into the memory of a retired version once nothing holds that version any
/// more (here a subscriber keeping every version's bytes, as a replica serving views of them
/// does), and never while something does.
#[tokio::test]
async fn exports_reuse_the_memory_of_versions_nobody_holds() {
    let controls = Arc::new(Controls::default());
    let held: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let h = held.clone();
    let holder: clawrl_actors::loops::Subscriber = Arc::new(move |e: &TrainerEvent| {
        if let TrainerEvent::Published { bytes, .. } = e {
            h.lock().unwrap().push(bytes.clone());
        }
        true
    });
    let t = spawn(
        config(1),
        Unigram::new(controls.clone()),
        local(),
        vec![holder],
    )
    .await;
    for i in 0..4 {
        t.cast(TrainerMsg::Samples(vec![sample(
            i,
            "s",
            i as u32,
            &[3],
            1.0,
        )]))
        .unwrap();
        idle(&t).await;
    }
    // Version 0 at start and one per step, every one still held.
    assert_eq!(*controls.reused.lock().unwrap(), vec![0; 5]);
    held.lock().unwrap().clear();
    t.cast(TrainerMsg::Samples(vec![sample(4, "s", 4, &[3], 1.0)]))
        .unwrap();
    let s = idle(&t).await;
    assert_eq!(s.published, Some(5));
    let reused = controls.reused.lock().unwrap().clone();
    assert!(
        reused[5] >= VOCAB * 4,
        "the sixth export got {} bytes to reuse",
        reused[5]
    );
}

#[tokio::test]
async fn stale_samples_are_dropped_and_counted() {
    let (heard, sub) = recorder();
    let cfg = TrainerConfig {
        max_lag: 1,
        ..config(2)
    };
    let t = spawn(cfg, Unigram::new(Arc::default()), local(), vec![sub]).await;
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "a", 0, &[3], 1.0),
        sample(0, "a", 1, &[4], 1.0),
    ]))
    .unwrap();
    assert_eq!(idle(&t).await.version, 1);
    // Lag 1: kept.
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "b", 0, &[3], 1.0),
        sample(1, "b", 1, &[4], 1.0),
    ]))
    .unwrap();
    assert_eq!(idle(&t).await.version, 2);
    // Lag 2 > 1: dropped; the batch fills from fresh samples.
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "c", 0, &[3], 1.0),
        sample(2, "c", 1, &[4], 1.0),
        sample(0, "c", 2, &[5], 1.0),
        sample(1, "c", 3, &[6], 1.0),
    ]))
    .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.produced, s.trained, s.dropped_stale, s.pending),
        (8, 6, 2, 0)
    );
    assert_eq!(s.version, 3);
    let last = heard
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find_map(|e| match e {
            TrainerEvent::Step(s) => Some(s.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        (last.kept, last.dropped_stale, last.oldest_version),
        (2, 2, 1)
    );
}

#[tokio::test]
async fn importance_mode_weights_stale_samples_instead_of_dropping() {
    let controls = Arc::new(Controls::default());
    let cfg = TrainerConfig {
        max_lag: 0,
        staleness: StalenessMode::Importance { cap: 1.5 },
        ..config(2)
    };
    let learner = Unigram::new(controls.clone());
    let initial = Unigram::logp(&learner.z);
    let t = spawn(cfg, learner, local(), vec![]).await;
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "a", 0, &[3], 1.0),
        sample(0, "a", 1, &[9], 1.0),
    ]))
    .unwrap();
    assert_eq!(idle(&t).await.version, 1);
    // Version 0 samples are now stale (lag 1 > 0). One carries rollout log-probs: kept with
    // weights; one does not: dropped. A fresh sample completes the batch unweighted.
    let mut with = sample(0, "b", 0, &[3, 9], 1.0);
    // Rollout log-probs far below the trainer's for token 3 (weight truncated at the cap) and
    // equal to version 0's for token 9.
    with.rollout_logprobs = Some(vec![initial[3] - 5.0, initial[9]]);
    let without = sample(0, "b", 1, &[4], 1.0);
    let fresh = sample(1, "b", 2, &[5], 1.0);
    t.cast(TrainerMsg::Samples(vec![with, without, fresh]))
        .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.trained, s.dropped_stale, s.importance_weighted),
        (4, 1, 1)
    );
    let summaries = controls.importance.lock().unwrap().clone();
    assert_eq!(summaries[0], None);
    let summary = summaries[1].expect("the second step weighted a sample");
    assert_eq!((summary.tokens, summary.truncated), (2, 1));
    // Token 9's weight is exp(logp_v1(9) − logp_v0(9)): not 1, since version 1 moved it.
    assert!(
        summary.mean < 1.5 && (summary.mean - 1.25).abs() > 1e-3,
        "{summary:?}"
    );
}

#[tokio::test]
async fn invalid_samples_are_refused_not_produced() {
    let t = spawn(config(2), Unigram::new(Arc::default()), local(), vec![]).await;
    let mut other_job = sample(0, "a", 0, &[3], 1.0);
    other_job.job = "job-b".into();
    let future = sample(5, "a", 1, &[3], 1.0);
    let mut short_adv = sample(0, "a", 2, &[3, 4], 1.0);
    short_adv.advantages.pop();
    let out_of_vocab = sample(0, "a", 3, &[99], 1.0);
    let mut nan = sample(0, "a", 4, &[3], 1.0);
    nan.advantages[0] = f32::NAN;
    let empty = sample(0, "a", 5, &[], 1.0);
    let too_long = TrainSample {
        prompt_ids: vec![1; 64],
        ..sample(0, "a", 6, &[3], 1.0)
    };
    let good = sample(0, "a", 7, &[3], 1.0);
    t.cast(TrainerMsg::Samples(vec![
        other_job,
        future,
        short_adv,
        out_of_vocab,
        nan,
        empty,
        too_long,
        good,
    ]))
    .unwrap();
    let s = idle(&t).await;
    assert_eq!((s.rejected, s.produced, s.pending), (7, 1, 1));
    let why = s.last_rejection.unwrap();
    assert!(why.contains("a#6") && why.contains("65 tokens"), "{why}");
}

#[tokio::test]
async fn the_message_loop_answers_while_a_step_runs() {
    let controls = Arc::new(Controls::default());
    let (release, gate) = std::sync::mpsc::channel::<()>();
    *controls.gate.lock().unwrap() = Some(gate);
    let t = spawn(config(2), Unigram::new(controls), local(), vec![]).await;
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "a", 0, &[3], 1.0),
        sample(0, "a", 1, &[4], 1.0),
    ]))
    .unwrap();
    // The step is blocked on the gate; samples and stats are still handled.
    t.cast(TrainerMsg::Samples(vec![sample(0, "b", 0, &[5], 1.0)]))
        .unwrap();
    let s = ractor::call_t!(t, TrainerMsg::Stats, 5_000).unwrap();
    assert_eq!((s.produced, s.in_step, s.pending, s.trained), (3, 2, 3, 0));
    assert!(s.balanced());
    release.send(()).unwrap();
    let s = idle(&t).await;
    assert_eq!((s.trained, s.pending, s.version), (2, 1, 1));
}

#[tokio::test]
async fn failed_steps_put_samples_back_then_count_them() {
    let controls = Arc::new(Controls::default());
    let (heard, sub) = recorder();
    let t = spawn(
        config(2),
        Unigram::new(controls.clone()),
        local(),
        vec![sub],
    )
    .await;
    // One failure: retried, then trained.
    controls.fail.store(1, Ordering::SeqCst);
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "a", 0, &[3], 1.0),
        sample(0, "a", 1, &[4], 1.0),
    ]))
    .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.trained, s.failed, s.failed_attempts, s.version),
        (2, 0, 1, 1)
    );
    // Three failures (the default attempts): given up on, counted with the reason.
    controls.fail.store(3, Ordering::SeqCst);
    t.cast(TrainerMsg::Samples(vec![
        sample(1, "b", 0, &[3], 1.0),
        sample(1, "b", 1, &[4], 1.0),
    ]))
    .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.trained, s.failed, s.failed_attempts, s.pending),
        (2, 2, 4, 0)
    );
    assert!(s
        .last_error
        .as_deref()
        .unwrap()
        .contains("injected failure"));
    // A skipped update (non-finite loss): counted as failed at once, version unchanged.
    controls.skip.store(1, Ordering::SeqCst);
    t.cast(TrainerMsg::Samples(vec![
        sample(1, "c", 0, &[3], 1.0),
        sample(1, "c", 1, &[4], 1.0),
    ]))
    .unwrap();
    let s = idle(&t).await;
    assert_eq!((s.trained, s.failed, s.version), (2, 4, 1));
    assert!(s.last_error.as_deref().unwrap().contains("non-finite"));
    let failures: Vec<(u32, bool)> = heard
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            TrainerEvent::StepFailed {
                attempt, gave_up, ..
            } => Some((*attempt, *gave_up)),
            _ => None,
        })
        .collect();
    assert_eq!(
        failures,
        vec![(1, false), (1, false), (2, false), (3, true), (1, true)]
    );
}

#[tokio::test]
async fn resume_from_checkpoint_keeps_versions_counting_up() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainerConfig {
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: 2,
        max_lag: 10,
        ..config(1)
    };
    let (heard, sub) = recorder();
    let t = spawn(
        cfg.clone(),
        Unigram::new(Arc::default()),
        local(),
        vec![sub],
    )
    .await;
    for i in 0..3 {
        t.cast(TrainerMsg::Samples(vec![sample(
            i,
            "a",
            i as u32,
            &[3 + i as u32],
            1.0,
        )]))
        .unwrap();
        idle(&t).await;
    }
    let s = idle(&t).await;
    assert_eq!(
        (s.version, s.checkpoints, s.checkpoint_version),
        (3, 1, Some(2))
    );
    // A blob id is a content address: equal ids, equal weights.
    let blob_of = |heard: &Heard, v: u64| {
        heard
            .lock()
            .unwrap()
            .iter()
            .find_map(|e| match e {
                TrainerEvent::Published { announce, .. } if announce.version == v => {
                    Some(announce.blob)
                }
                _ => None,
            })
            .unwrap()
    };
    let (v2_blob, v3_blob) = (blob_of(&heard, 2), blob_of(&heard, 3));
    // The trainer dies without a word.
    t.kill();
    tokio::time::sleep(Duration::from_millis(100)).await;

    // A fresh trainer (initial weights) on the same directory resumes the checkpoint of
    // version 2; version 3 was served and is lost, so the resumed weights become version 4.
    // The sample trained only into version 3 is replayed from the journal: version 5 is the
    // lost version 3's weights again.
    let (heard, sub) = recorder();
    let t = spawn(
        cfg.clone(),
        Unigram::new(Arc::default()),
        local(),
        vec![sub],
    )
    .await;
    let s = idle(&t).await;
    assert_eq!(
        (s.resumed_from, s.recovered, s.produced, s.trained),
        (Some(2), 1, 1, 1)
    );
    assert_eq!((s.version, s.steps), (5, 3));
    assert_eq!(blob_of(&heard, 5), v3_blob);
    let first = heard.lock().unwrap()[0].clone();
    let TrainerEvent::Published { announce, .. } = first else {
        panic!("{first:?}")
    };
    assert_eq!((announce.version, announce.blob), (4, v2_blob));
    // Samples of the lost version 3 are genuine: accepted.
    t.cast(TrainerMsg::Samples(vec![sample(3, "b", 0, &[7], 1.0)]))
        .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.version, s.steps, s.trained, s.checkpoint_version),
        (6, 4, 2, Some(6))
    );
    // A requested checkpoint, then a clean restart continues from version 6 exactly.
    let path = ractor::call_t!(t, TrainerMsg::Checkpoint, 10_000)
        .unwrap()
        .unwrap();
    assert!(path.ends_with("step-00000004"), "{path:?}");
    t.stop(None);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = spawn(cfg, Unigram::new(Arc::default()), local(), vec![]).await;
    let s = idle(&t).await;
    assert_eq!((s.resumed_from, s.version, s.steps), (Some(6), 6, 4));
    assert_eq!((s.recovered, s.produced), (0, 0));
}

#[tokio::test]
async fn samples_pending_at_a_crash_are_recovered() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainerConfig {
        checkpoint_dir: Some(dir.path().to_path_buf()),
        ..config(2)
    };
    let t = spawn(cfg.clone(), Unigram::new(Arc::default()), local(), vec![]).await;
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "a", 0, &[3], 1.0),
        sample(0, "a", 1, &[4], 1.0),
        sample(0, "a", 2, &[5], -1.0),
    ]))
    .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.version, s.checkpoint_version, s.pending),
        (1, Some(1), 1)
    );
    t.cast(TrainerMsg::Samples(vec![sample(1, "b", 0, &[6], 1.0)]))
        .unwrap();
    let s = idle(&t).await;
    assert_eq!(
        (s.version, s.checkpoint_version, s.pending),
        (2, Some(2), 0)
    );
    t.cast(TrainerMsg::Samples(vec![sample(2, "c", 0, &[7], 1.0)]))
        .unwrap();
    idle(&t).await;
    t.kill();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Only the sample no checkpoint covers comes back; it completes a batch with a new one.
    // The journal is the checkpoint directory's: a re-run under a new job id (as `clawrl run`
    // gets) takes it as its own.
    let cfg = TrainerConfig {
        job: "job-b".into(),
        ..cfg
    };
    let t = spawn(cfg, Unigram::new(Arc::default()), local(), vec![]).await;
    let s = idle(&t).await;
    assert_eq!((s.resumed_from, s.recovered, s.pending), (Some(2), 1, 1));
    assert_eq!(s.rejected, 0, "{s:?}");
    let d = TrainSample {
        job: "job-b".into(),
        ..sample(2, "d", 0, &[8], 1.0)
    };
    t.cast(TrainerMsg::Samples(vec![d])).unwrap();
    let s = idle(&t).await;
    assert_eq!((s.produced, s.trained, s.version), (2, 2, 3));
}

/// blake3 of `bytes`, hex: what a [`HashReplica`] serves.
fn fingerprint(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// A replica whose "model" is the weight bytes: it serves their hash.
#[derive(Default)]
struct HashReplica;

impl PolicyReplica for HashReplica {
    type Request = ();
    type Output = String;
    type GenerateError = LearnError;
    type Loaded = String;
    type LoadError = LearnError;

    fn load(&self, _version: u64, weights: &Bytes) -> Result<String, LearnError> {
        Ok(fingerprint(weights))
    }

    async fn generate(&self, loaded: Arc<String>, _: ()) -> Result<String, LearnError> {
        Ok(loaded.to_string())
    }
}

async fn wait_serving(w: &ActorRef<RolloutMsg<HashReplica>>, version: u64) -> String {
    for _ in 0..400 {
        let s = ractor::call!(w, RolloutMsg::Stats).unwrap();
        if s.version == Some(version) {
            let g = ractor::call!(w, |p| RolloutMsg::Generate((), p))
                .unwrap()
                .unwrap();
            assert_eq!(g.version, version);
            return g.output;
        }
        assert_eq!(s.failed_updates, 0, "{:?}", s.last_update_error);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("worker never served version {version}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_workers_fetch_versions_over_the_bulk_plane() {
    let ca = crate::loopback::TestCa::new();
    let book = crate::loopback::Book::default();
    let trainer_node = crate::loopback::node(&ca, &book, "trainer", BulkConfig::new("unset"));
    let replica_node = crate::loopback::node(&ca, &book, "replica", BulkConfig::new("unset"));
    let remote = Actor::spawn(
        None,
        RolloutWorker::<HashReplica>::new(),
        RolloutArgs {
            policy: Arc::new(HashReplica),
            source: Some(Arc::new(replica_node.plane.clone())),
            initial: None,
        },
    )
    .await
    .unwrap()
    .0;
    let local_worker = Actor::spawn(
        None,
        RolloutWorker::<HashReplica>::new(),
        RolloutArgs {
            policy: Arc::new(HashReplica),
            source: None,
            initial: None,
        },
    )
    .await
    .unwrap()
    .0;
    let (heard, sub) = recorder();
    let cfg = TrainerConfig {
        keep_published: 1,
        ..config(2)
    };
    let plane = Arc::new(trainer_node.plane.clone());
    let t = spawn(cfg, Unigram::new(Arc::default()), plane.clone(), vec![sub]).await;
    // Subscribing hears the newest version at once.
    t.cast(TrainerMsg::Subscribe(
        rollout_subscriber(remote.clone(), Delivery::Announce),
        None,
    ))
    .unwrap();
    t.cast(TrainerMsg::Subscribe(
        rollout_subscriber(local_worker.clone(), Delivery::Install),
        None,
    ))
    .unwrap();
    assert_eq!(
        wait_serving(&remote, 0).await,
        wait_serving(&local_worker, 0).await
    );
    for round in 0..2u32 {
        t.cast(TrainerMsg::Samples(vec![
            sample(round as u64, "a", 2 * round, &[3], 1.0),
            sample(round as u64, "a", 2 * round + 1, &[8], -1.0),
        ]))
        .unwrap();
        idle(&t).await;
        wait_serving(&remote, round as u64 + 1).await;
    }
    let hashes: Vec<(u64, String)> = heard
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            TrainerEvent::Published {
                announce, bytes, ..
            } => Some((announce.version, fingerprint(bytes))),
            _ => None,
        })
        .collect();
    assert_eq!(
        hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    let served = wait_serving(&remote, 2).await;
    assert_eq!(served, hashes[2].1);
    assert_eq!(wait_serving(&local_worker, 2).await, hashes[2].1);
    // Only the newest version stays on the trainer's plane.
    assert_eq!(plane.stats().blobs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaying_publisher_delivers_before_announcing_and_sends_one_copy() {
    let ca = crate::loopback::TestCa::new();
    let book = crate::loopback::Book::default();
    let trainer_node = crate::loopback::node(&ca, &book, "trainer", BulkConfig::new("unset"));
    let replicas: Vec<_> = (0..2)
        .map(|r| {
            crate::loopback::node(&ca, &book, &format!("replica{r}"), BulkConfig::new("unset"))
        })
        .collect();
    let mut workers = Vec::new();
    for node in &replicas {
        let (w, _) = Actor::spawn(
            None,
            RolloutWorker::<HashReplica>::new(),
            RolloutArgs {
                policy: Arc::new(HashReplica),
                source: Some(Arc::new(node.plane.clone())),
                initial: None,
            },
        )
        .await
        .unwrap();
        workers.push(w);
    }
    // When a version is announced, every replica's plane already holds its bytes.
    let planes: Vec<_> = replicas.iter().map(|n| n.plane.clone()).collect();
    let held: Arc<Mutex<Vec<(u64, bool)>>> = Arc::default();
    let h = held.clone();
    let check: clawrl_actors::loops::Subscriber = Arc::new(move |e: &TrainerEvent| {
        if let TrainerEvent::Published { announce, .. } = e {
            let all = planes.iter().all(|p| p.get(&announce.blob).is_some());
            h.lock().unwrap().push((announce.version, all));
        }
        true
    });
    let mut subscribers = vec![check];
    for w in &workers {
        subscribers.push(rollout_subscriber(w.clone(), Delivery::Announce));
    }
    let publisher = RelayPublisher::new(
        trainer_node.plane.clone(),
        vec!["replica0".into(), "replica1".into()],
    )
    .unwrap();
    let t = spawn(
        config(2),
        Unigram::new(Arc::default()),
        Arc::new(publisher),
        subscribers,
    )
    .await;
    t.cast(TrainerMsg::Samples(vec![
        sample(0, "a", 0, &[3], 1.0),
        sample(0, "a", 1, &[8], -1.0),
    ]))
    .unwrap();
    idle(&t).await;
    let mut hashes = Vec::new();
    for w in &workers {
        hashes.push(wait_serving(w, 1).await);
    }
    assert_eq!(hashes[0], hashes[1]);
    assert_eq!(*held.lock().unwrap(), vec![(0, true), (1, true)]);
    // A relay chain: the trainer sent one copy of each version (VOCAB f32 weights), the
    // first replica forwarded it, and the workers' fetches were local.
    let blob = (VOCAB * 4) as u64;
    assert_eq!(trainer_node.plane.stats().bytes_sent, 2 * blob);
    assert_eq!(replicas[0].plane.stats().bytes_sent, 2 * blob);
    assert_eq!(replicas[1].plane.stats().bytes_sent, 0);
}

#[tokio::test]
async fn the_step_limit_is_exact_and_samples_beyond_it_stay_pending() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainerConfig {
        checkpoint_dir: Some(dir.path().to_path_buf()),
        max_lag: 10,
        max_steps: Some(2),
        ..config(2)
    };
    let (heard, sub) = recorder();
    let t = spawn(
        cfg.clone(),
        Unigram::new(Arc::default()),
        local(),
        vec![sub],
    )
    .await;
    let samples: Vec<TrainSample> = (0..7)
        .map(|i| sample(0, "a", i, &[3 + i % 4], 1.0))
        .collect();
    t.cast(TrainerMsg::Samples(samples)).unwrap();
    // Three full batches wait, but the limit is two steps: idle answers with the rest pending.
    let s = idle(&t).await;
    assert_eq!(
        (s.steps, s.version, s.trained, s.pending, s.dropped_stale),
        (2, 2, 4, 3, 0)
    );
    // Neither a flush nor more samples make it step again; everything is still counted.
    t.cast(TrainerMsg::Flush).unwrap();
    t.cast(TrainerMsg::Samples(vec![sample(2, "b", 0, &[5], 1.0)]))
        .unwrap();
    let s = idle(&t).await;
    assert_eq!((s.steps, s.produced, s.trained, s.pending), (2, 8, 4, 4));
    let steps = heard
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, TrainerEvent::Step(_)))
        .count();
    assert_eq!(steps, 2);
    // The pending samples are journaled with the checkpoint: a trainer resumed with a higher
    // limit trains them, and stops at its own limit.
    ractor::call_t!(t, TrainerMsg::Checkpoint, 10_000)
        .unwrap()
        .unwrap();
    t.stop(None);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let cfg = TrainerConfig {
        max_steps: Some(3),
        ..cfg
    };
    let t = spawn(cfg, Unigram::new(Arc::default()), local(), vec![]).await;
    let s = idle(&t).await;
    assert_eq!(
        (s.resumed_from, s.recovered, s.steps, s.trained, s.pending),
        (Some(2), 4, 3, 2, 2)
    );

    // A limit of zero steps is refused.
    let bad = TrainerConfig {
        max_steps: Some(0),
        ..config(2)
    };
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("max_steps"), "{e}");
}
