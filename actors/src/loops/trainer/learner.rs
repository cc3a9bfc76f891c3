//! The trainer's learner thread: the [`Learner`] contract, and the OS thread that owns the
//! learner for the actor's whole life. On start it resumes from the newest checkpoint and, when
//! `<dir>/published` records a version above it, advances past that version (versions only
//! grow); then it runs [`Job`]s in order: a step (then export and publish the new version, then
//! an optional checkpoint) or a checkpoint alone, and casts each outcome back to the actor. A
//! panic on the thread reaches the actor as [`TrainerMsg::LearnerLost`].

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ractor::ActorRef;
use tokio::sync::oneshot;

#[cfg(doc)]
use super::Trainer;
use super::{
    ExportedWeights, Importance, SampleLimits, StepDone, StepReport, TrainSample, TrainerMsg,
    WeightPublisher,
};
use crate::loops::WeightAnnounce;

/// The learner behind a [`Trainer`], implemented by the root crate (and by small deterministic
/// learners in tests). Every method runs on the trainer's learner thread.
pub trait Learner: Send + 'static {
    /// Why an operation failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The current weight version (grows by one per applied step).
    fn version(&self) -> u64;
    /// Optimizer steps applied so far.
    fn steps(&self) -> u64;
    /// What a sample must satisfy to be accepted.
    fn limits(&self) -> SampleLimits;
    /// One optimizer step on `batch`; `importance[i]` says how to weight sample `i`.
    fn step(
        &mut self,
        batch: &[TrainSample],
        importance: &[Importance],
    ) -> Result<StepReport, Self::Error>;
    /// The current weights. `reuse` is memory the caller has no more use for (a retired
    /// version's blob, or empty): written into when large enough, it spares the export the
    /// page faults of fresh memory.
    fn export(&self, reuse: Vec<u8>) -> Result<ExportedWeights, Self::Error>;
    /// Saves a checkpoint under `root` atomically (a crash leaves the previous one valid) and
    /// makes it the one [`Learner::resume`] finds; returns its directory.
    fn save_checkpoint(&mut self, root: &Path) -> Result<PathBuf, Self::Error>;
    /// Replaces the learner's state with the newest checkpoint under `root`; `Ok(false)` when
    /// `root` holds none.
    fn resume(&mut self, root: &Path) -> Result<bool, Self::Error>;
    /// Sets the version to `to` (> the current one) without touching the weights.
    fn advance_version(&mut self, to: u64) -> Result<(), Self::Error>;
}

/// Work for the learner thread.
pub(super) enum Job {
    Step {
        batch: Arc<Vec<TrainSample>>,
        importance: Vec<Importance>,
        checkpoint: Option<PathBuf>,
    },
    Checkpoint(PathBuf),
}

/// What the learner thread reports after start.
pub(super) struct Started {
    pub(super) version: u64,
    pub(super) steps: u64,
    pub(super) limits: SampleLimits,
    pub(super) resumed_from: Option<u64>,
    pub(super) initial: Result<(WeightAnnounce, Bytes), String>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn published_mark(root: &Path) -> PathBuf {
    root.join("published")
}

/// Records `version` as published under `root` (temporary file, synced, renamed).
fn write_published(root: &Path, version: u64) -> Result<(), String> {
    use std::io::Write;
    std::fs::create_dir_all(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let path = published_mark(root);
    let tmp = root.join(".published.tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(version.to_string().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| format!("{}: {e}", path.display()))
}

fn read_published(root: &Path) -> Result<Option<u64>, String> {
    let path = published_mark(root);
    match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| {
            format!(
                "{}: expected a version number, found {:?}",
                path.display(),
                text.trim()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The blobs of the versions this learner published last, kept so that the memory of one
/// nobody holds any more (retired from the publisher, out of every replica's hands) is written
/// again by the next export: touching fresh pages costs about ten times rewriting touched ones
/// (60 against 6 ms for 85 MiB on the 2-core VMs this project is built on). At most `keep`
/// blobs are held. A blob still held elsewhere costs nothing here; of those nobody else holds,
/// [`Published::prune`] keeps one, so the memory this adds is one spare blob.
struct Published {
    blobs: VecDeque<Bytes>,
    keep: usize,
}

impl Published {
    fn new(keep: usize) -> Self {
        Published {
            blobs: VecDeque::new(),
            keep: keep.max(1),
        }
    }

    /// The memory of the oldest blob nobody else holds, or an empty vector.
    fn spare(&mut self) -> Vec<u8> {
        let Some(i) = self.blobs.iter().position(Bytes::is_unique) else {
            return Vec::new();
        };
        // Only this thread holds the blob, so nobody can clone it between the check and here.
        match self.blobs.remove(i).map(Bytes::try_into_mut) {
            Some(Ok(memory)) => memory.into(),
            _ => Vec::new(),
        }
    }

    fn push(&mut self, blob: Bytes) {
        self.blobs.push_back(blob);
        while self.blobs.len() > self.keep {
            self.blobs.pop_front();
        }
        self.prune();
    }

    /// Drops every blob nobody else holds but the newest such one (the spare).
    fn prune(&mut self) {
        let mut spare_kept = false;
        for i in (0..self.blobs.len()).rev() {
            if self.blobs[i].is_unique() {
                if spare_kept {
                    self.blobs.remove(i);
                }
                spare_kept = true;
            }
        }
    }
}

/// How often an idle learner thread lets go of versions nobody holds any more.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

fn export_and_publish<L: Learner>(
    learner: &L,
    publisher: &dyn WeightPublisher,
    root: Option<&Path>,
    published: &mut Published,
) -> (Result<(WeightAnnounce, Bytes), String>, f64, f64) {
    let t = Instant::now();
    let weights = match learner.export(published.spare()) {
        Ok(w) => w,
        Err(e) => {
            return (
                Err(format!("exporting the weights: {e}")),
                ms(t.elapsed()),
                0.0,
            )
        }
    };
    let export_ms = ms(t.elapsed());
    let t = Instant::now();
    let result = publisher
        .publish(&weights)
        .map_err(|e| e.to_string())
        .and_then(|announce| {
            if let Some(root) = root {
                write_published(root, announce.version)?;
            }
            published.push(weights.bytes.clone());
            Ok((announce, weights.bytes))
        });
    (result, export_ms, ms(t.elapsed()))
}

/// Resumes, then announces the starting version; runs on the learner thread.
fn start_learner<L: Learner>(
    learner: &mut L,
    publisher: &dyn WeightPublisher,
    root: Option<&Path>,
    published: &mut Published,
) -> Result<Started, String> {
    let mut resumed_from = None;
    if let Some(root) = root {
        if learner
            .resume(root)
            .map_err(|e| format!("resuming from {}: {e}", root.display()))?
        {
            resumed_from = Some(learner.version());
        }
        if let Some(published) = read_published(root)? {
            if published > learner.version() {
                // Versions after the checkpoint were served and are lost with the old trainer:
                // the resumed weights become the next version above them.
                learner
                    .advance_version(published + 1)
                    .map_err(|e| format!("advancing the version past {published}: {e}"))?;
            }
        }
    }
    let (initial, _, _) = export_and_publish(learner, publisher, root, published);
    Ok(Started {
        version: learner.version(),
        steps: learner.steps(),
        limits: learner.limits(),
        resumed_from,
        initial,
    })
}

/// Saves a checkpoint under `root`; answers the version it holds and its directory.
fn save_checkpoint<L: Learner>(learner: &mut L, root: &Path) -> Result<(u64, PathBuf), String> {
    learner
        .save_checkpoint(root)
        .map(|p| (learner.version(), p))
        .map_err(|e| format!("checkpoint under {}: {e}", root.display()))
}

/// The learner's thread; `keep_published` is how many versions the trainer keeps published.
pub(super) fn learner_thread<L: Learner>(
    mut learner: L,
    publisher: Arc<dyn WeightPublisher>,
    root: Option<PathBuf>,
    started: oneshot::Sender<Result<Started, String>>,
    jobs: std_mpsc::Receiver<Job>,
    me: ActorRef<TrainerMsg>,
    keep_published: usize,
) {
    // One more than the trainer keeps: the blob it retired last, whose memory the next export
    // may reuse.
    let mut published = Published::new(keep_published + 1);
    let run = std::panic::AssertUnwindSafe(|| {
        let start = start_learner(
            &mut learner,
            publisher.as_ref(),
            root.as_deref(),
            &mut published,
        );
        let ok = start.is_ok();
        if started.send(start).is_err() || !ok {
            return;
        }
        loop {
            let job = match jobs.recv_timeout(PRUNE_EVERY) {
                Ok(job) => job,
                Err(std_mpsc::RecvTimeoutError::Timeout) => {
                    published.prune();
                    continue;
                }
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            };
            match job {
                Job::Step {
                    batch,
                    importance,
                    checkpoint,
                } => {
                    let t = Instant::now();
                    let result = learner.step(&batch, &importance).map_err(|e| e.to_string());
                    let step_finished = Instant::now();
                    let step_ms = ms(step_finished - t);
                    let applied = matches!(&result, Ok(r) if r.skipped.is_none());
                    let (published, export_ms, publish_ms) = if applied {
                        let (p, e, u) = export_and_publish(
                            &learner,
                            publisher.as_ref(),
                            root.as_deref(),
                            &mut published,
                        );
                        (Some(p), e, u)
                    } else {
                        (None, 0.0, 0.0)
                    };
                    let done = StepDone {
                        result,
                        published,
                        step_finished,
                        step_ms,
                        export_ms,
                        publish_ms,
                    };
                    if me.cast(TrainerMsg::StepDone(Box::new(done))).is_err() {
                        return;
                    }
                    if let (true, Some(root)) = (applied, checkpoint) {
                        let r = save_checkpoint(&mut learner, &root);
                        if me.cast(TrainerMsg::CheckpointDone(r)).is_err() {
                            return;
                        }
                    }
                }
                Job::Checkpoint(root) => {
                    let r = save_checkpoint(&mut learner, &root);
                    if me.cast(TrainerMsg::CheckpointDone(r)).is_err() {
                        return;
                    }
                }
            }
        }
    });
    if let Err(panic) = std::panic::catch_unwind(run) {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        let _ = me.cast(TrainerMsg::LearnerLost(what));
    }
}
