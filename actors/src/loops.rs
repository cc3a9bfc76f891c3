//! The loops of docs/design.md §2 as actors that know no LLM: a [`rollout::RolloutWorker`] serves
//! generate requests from a policy replica and swaps weight versions without pausing, and a
//! [`recorder::Recorder`] writes JSONL records off the hot path.
//!
//! The root crate plugs its model in through the small traits here: [`PolicyReplica`] (load a
//! version from weight bytes; generate on a loaded version) and [`WeightSource`] (fetch the bytes
//! a [`WeightAnnounce`] names, e.g. from the bulk plane). The worker, not the trait, owns the
//! version rules: loads run beside the serving version, new requests go to the newest loaded
//! version, requests in flight finish on the version they started with, and versions never go
//! backwards.

pub mod admission;
pub mod env;
pub mod groups;
pub mod job;
pub mod recorder;
pub mod rollout;
pub mod session;
pub mod swap;
pub mod trainer;
pub mod voter;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::bulk::{BlobId, BulkPlane, PeerConnector};

pub use admission::{
    admits, AdmissionCounts, AdmissionError, AdmissionSettings, Backlog, Gate, GatedPolicy,
};
pub use env::{
    Action, BoxFuture, EnvError, Environment, Episode, Observation, StepOutcome, ToolCallAction,
};
pub use groups::{GroupCounts, GroupId, Groups, Settled};
pub use job::{
    spawn_job, Built, EpisodeTurns, JobArgs, JobCounts, JobMsg, JobPhase, JobSample, JobSettings,
    JobSupervisor, ProgressReport, SampleBuilder, StopCause, StopCondition, TrainerCounts,
    TrainerLink, TurnSource,
};
pub use recorder::{
    read_records, RecordFile, RecordLine, RecordTap, Recorder, RecorderConfig, RecorderHandle,
    RecorderMsg, RecorderStats,
};
pub use rollout::{
    Generated, RolloutArgs, RolloutError, RolloutMsg, RolloutStats, RolloutWorker, UpdateOutcome,
};
pub use session::{
    keeps_history, EndReason, EnvSession, PolicyError, PolicyTurn, SessionArgs, SessionEvent,
    SessionMsg, SessionReport, Turn, TurnPolicy,
};
pub use swap::{LoadFinished, LoadOutcome, Offer, SwapError, VersionSwap};
pub use trainer::{
    rollout_subscriber, Delivery, ExportedWeights, Importance, ImportanceSummary, Learner,
    LocalPublisher, LogprobGap, OpdLossKind, OpdTerm, PublishFailed, RelayPublisher, SampleLimits,
    StalenessMode, StepEvent, StepReport, Subscriber, TeacherTopK, TrainSample, Trainer,
    TrainerArgs, TrainerConfig, TrainerEvent, TrainerMsg, TrainerStartError, TrainerStats,
    WeightPublisher,
};
pub use voter::{JudgedTurn, Judgement, PrmVoter, TurnJudge, VoterArgs, VoterMsg, VoterStats};

/// A policy replica: the root crate's model behind the [`rollout::RolloutWorker`].
///
/// A loaded version ([`PolicyReplica::Loaded`]) is immutable and shared: every request holds an
/// `Arc` to the version it started on, so an old version lives exactly as long as its last
/// request in flight.
pub trait PolicyReplica: Send + Sync + 'static {
    /// One generate request.
    type Request: Send + 'static;
    /// Its result.
    type Output: Send + 'static;
    /// Why a request failed.
    type GenerateError: std::error::Error + Send + 'static;
    /// One loaded, servable weight version.
    type Loaded: Send + Sync + 'static;
    /// Why weight bytes could not be loaded.
    type LoadError: std::error::Error + Send + Sync + 'static;

    /// Builds a servable version from a weight blob. Blocking and possibly slow: the worker
    /// calls it on a blocking thread, never on its message loop. The blob is shared (its
    /// bulk-plane copy), so the version may keep views of it rather than copies.
    fn load(&self, version: u64, weights: &Bytes) -> Result<Self::Loaded, Self::LoadError>;

    /// Generates `request` on `loaded`.
    fn generate(
        &self,
        loaded: Arc<Self::Loaded>,
        request: Self::Request,
    ) -> impl Future<Output = Result<Self::Output, Self::GenerateError>> + Send;
}

/// A new weight version, announced by the trainer: a small message; the bytes travel on the
/// bulk plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightAnnounce {
    /// The version (strictly increasing per job).
    pub version: u64,
    /// The bulk-plane blob holding the weights.
    pub blob: BlobId,
    /// Size of the blob in bytes.
    pub size: u64,
    /// The node to fetch the blob from when it is not already local.
    pub source: String,
}

impl WeightAnnounce {
    /// Checks that `bytes` have the announced size. That is all there is to check: bytes fetched
    /// through a [`WeightSource`] were verified against [`WeightAnnounce::blob`], which commits
    /// to every byte, and bytes handed over in-process are the trainer's own buffer, never
    /// outside input.
    pub fn check_size(&self, bytes: &[u8]) -> Result<(), WeightMismatch> {
        if bytes.len() as u64 != self.size {
            return Err(WeightMismatch {
                blob: self.blob,
                got: bytes.len() as u64,
                announced: self.size,
            });
        }
        Ok(())
    }
}

/// Why weight bytes are not the ones a [`WeightAnnounce`] names: their size differs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("blob {blob} has {got} bytes, the announcement says {announced}")]
pub struct WeightMismatch {
    /// The blob announced.
    pub blob: BlobId,
    /// The size of the bytes in hand.
    pub got: u64,
    /// The size announced.
    pub announced: u64,
}

/// Why the bytes of a version could not be obtained.
#[derive(Debug, Clone, thiserror::Error)]
#[error("fetching blob {blob} (version {version}) from {source_node}: {reason}")]
pub struct FetchError {
    /// The version announced.
    pub version: u64,
    /// The blob.
    pub blob: BlobId,
    /// The node asked.
    pub source_node: String,
    /// What went wrong.
    pub reason: String,
}

/// A boxed fetch in progress.
pub type FetchFuture<'a> = Pin<Box<dyn Future<Output = Result<Bytes, FetchError>> + Send + 'a>>;

/// Where a rollout worker gets the bytes of an announced version.
pub trait WeightSource: Send + Sync + 'static {
    /// The blob `announce` names, verified against [`WeightAnnounce::blob`]: a blob id is the
    /// hash of a manifest holding the length and every chunk's blake3, so bytes that match it
    /// are the announced bytes (the worker then checks only the size).
    fn fetch_weights<'a>(&'a self, announce: &'a WeightAnnounce) -> FetchFuture<'a>;
    /// The worker serves a newer version than `announce`'s, whose bytes it fetched here: the
    /// source may let go of what it kept of them (requests still running on that version
    /// hold their own reference).
    fn release(&self, _announce: &WeightAnnounce) {}
}

impl<C: PeerConnector> WeightSource for BulkPlane<C> {
    fn fetch_weights<'a>(&'a self, announce: &'a WeightAnnounce) -> FetchFuture<'a> {
        Box::pin(async move {
            BulkPlane::fetch(self, announce.blob, &announce.source)
                .await
                .map_err(|e| FetchError {
                    version: announce.version,
                    blob: announce.blob,
                    source_node: announce.source.clone(),
                    reason: e.to_string(),
                })
        })
    }

    /// Drops a fetched version's blob from this node's store, so that a replica node holds the
    /// versions it serves rather than every version until the store evicts. A blob published
    /// on this node itself (a worker beside the trainer) stays, for the others to fetch.
    fn release(&self, announce: &WeightAnnounce) {
        if announce.source != self.config().local_name {
            self.remove(&announce.blob);
        }
    }
}

impl<S: WeightSource> WeightSource for Arc<S> {
    fn fetch_weights<'a>(&'a self, announce: &'a WeightAnnounce) -> FetchFuture<'a> {
        S::fetch_weights(self, announce)
    }

    fn release(&self, announce: &WeightAnnounce) {
        S::release(self, announce)
    }
}
