//! The `RolloutWorker`: one policy replica's actor. It serves generate requests and applies new
//! weight versions without ever pausing.
//!
//! - A request runs on its own task over an `Arc` of the version current when it arrived; the
//!   result names that version ([`Generated::version`]). The message loop never waits on a
//!   generation.
//! - An update (an [`WeightAnnounce`] fetched through the worker's [`WeightSource`], or bytes
//!   handed over in-process with [`RolloutMsg::Install`]) is fetched (the source verifies the
//!   bytes against the announced blob id), size-checked and loaded on a blocking thread beside
//!   the serving version; only then does the worker switch.
//!   New requests go to the new version; requests in flight keep theirs.
//! - Versions never go backwards: an announcement not newer than every version served, loading
//!   or queued is ignored and counted ([`RolloutStats::stale_updates`]). One load runs at a
//!   time; a newer update arriving meanwhile waits, replacing (and counting as superseded) any
//!   older one waiting. These decisions are the pure rule of [`super::swap`]; the worker holds
//!   the payloads (bytes, reply ports) beside it.
//! - A failed fetch, size check or load leaves the serving version in place; it is counted,
//!   kept in [`RolloutStats::last_update_error`], logged, and answered to whoever asked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::{Deserialize, Serialize};

use super::swap::{LoadOutcome, Offer, VersionSwap};
use super::{PolicyReplica, WeightAnnounce, WeightSource};
use crate::bulk::BlobId;

/// A result with the version of the weights that produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generated<O> {
    /// The version every token of `output` was generated with (the one current when the request
    /// arrived).
    pub version: u64,
    /// The version the worker was serving when the request finished (≥ `version`).
    pub serving_at_finish: u64,
    /// The policy's output.
    pub output: O,
}

/// Why a generate request failed.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError<E: std::error::Error> {
    /// The worker has no version loaded yet.
    #[error("the rollout worker has no weight version loaded yet")]
    NoVersion,
    /// The policy refused or failed the request.
    #[error("generation on version {version} failed: {source}")]
    Generate {
        /// The version it ran on.
        version: u64,
        /// The policy's error.
        source: E,
    },
}

/// How an update ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateOutcome {
    /// The worker now serves this version to new requests.
    Switched {
        /// The new version.
        version: u64,
    },
    /// Not newer than a version already served, loading or queued: ignored.
    Stale {
        /// The version offered.
        version: u64,
        /// The newest version the worker knew of.
        newest: u64,
    },
    /// A newer update arrived while this one waited for the load in progress: never loaded.
    Superseded {
        /// The version offered.
        version: u64,
        /// The version that replaced it.
        by: u64,
    },
    /// Fetching, verifying or loading failed; the previous version keeps serving.
    Failed {
        /// The version offered.
        version: u64,
        /// What went wrong.
        error: String,
    },
}

/// Counters of one worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStats {
    /// The version new requests run on (`None` before the first load).
    pub version: Option<u64>,
    /// The version being loaded, if any.
    pub loading: Option<u64>,
    /// Requests accepted.
    pub requests: u64,
    /// Requests that returned an output.
    pub completed: u64,
    /// Requests that returned an error.
    pub failed: u64,
    /// Requests running now.
    pub in_flight: u64,
    /// Versions switched to.
    pub switches: u64,
    /// Updates ignored because they were not newer.
    pub stale_updates: u64,
    /// Updates replaced by a newer one before they were loaded.
    pub superseded_updates: u64,
    /// Updates whose fetch, size check or load failed.
    pub failed_updates: u64,
    /// The last of those failures.
    pub last_update_error: Option<String>,
}

/// What a generate request is answered with.
pub type GenerateReply<P> = Result<
    Generated<<P as PolicyReplica>::Output>,
    RolloutError<<P as PolicyReplica>::GenerateError>,
>;

/// Messages of a [`RolloutWorker`].
pub enum RolloutMsg<P: PolicyReplica> {
    /// Generate on the current version.
    Generate(P::Request, RpcReplyPort<GenerateReply<P>>),
    /// A new version was published: fetch it through the worker's [`WeightSource`], verify,
    /// load beside the current one, switch. The port, if any, gets the outcome.
    Announce(WeightAnnounce, Option<RpcReplyPort<UpdateOutcome>>),
    /// As `Announce`, with the trainer's bytes handed over in-process (size-checked).
    Install(WeightAnnounce, Bytes, Option<RpcReplyPort<UpdateOutcome>>),
    /// The worker's counters.
    Stats(RpcReplyPort<RolloutStats>),
    /// Internal: a load task finished.
    #[doc(hidden)]
    Loaded(u64, Result<Arc<P::Loaded>, String>),
}

impl<P: PolicyReplica> ractor::Message for RolloutMsg<P> {}

/// How a [`RolloutWorker`] starts.
pub struct RolloutArgs<P: PolicyReplica> {
    /// The replica.
    pub policy: Arc<P>,
    /// Where announced versions are fetched from (`None`: only [`RolloutMsg::Install`] works).
    pub source: Option<Arc<dyn WeightSource>>,
    /// A version already loaded to serve from the start, if any.
    pub initial: Option<(u64, Arc<P::Loaded>)>,
}

/// The rollout worker actor (behaviour only; see the module docs).
pub struct RolloutWorker<P>(std::marker::PhantomData<fn() -> P>);

impl<P> RolloutWorker<P> {
    /// The actor value to spawn.
    pub fn new() -> Self {
        RolloutWorker(std::marker::PhantomData)
    }
}

impl<P> Default for RolloutWorker<P> {
    fn default() -> Self {
        Self::new()
    }
}

/// An update waiting or running.
struct Update {
    announce: WeightAnnounce,
    bytes: Option<Bytes>,
    reply: Option<RpcReplyPort<UpdateOutcome>>,
    /// Whether the bytes are fetched from the worker's source (set when the load starts).
    fetched: bool,
}

/// Counters shared with request tasks.
#[derive(Default)]
struct Shared {
    serving: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    in_flight: AtomicU64,
}

/// The worker's state.
pub struct RolloutState<P: PolicyReplica> {
    policy: Arc<P>,
    source: Option<Arc<dyn WeightSource>>,
    current: Option<(u64, Arc<P::Loaded>)>,
    /// The announcement of the serving version when its bytes came from `source`, released
    /// there once a newer version serves.
    current_fetched: Option<WeightAnnounce>,
    /// Which version serves, loads and waits; `loading` and `queued` hold their payloads.
    swap: VersionSwap,
    loading: Option<Update>,
    queued: Option<Update>,
    shared: Arc<Shared>,
    stats: RolloutStats,
}

impl<P: PolicyReplica> RolloutState<P> {
    /// Lets the weight source drop the blob of `announce`, unless it is `serving`: two
    /// versions of the same bytes (a resumed trainer re-publishes its checkpoint) name one
    /// blob, which must stay while either serves.
    fn release(&self, announce: &WeightAnnounce, serving: Option<BlobId>) {
        if let Some(source) = &self.source {
            if serving != Some(announce.blob) {
                source.release(announce);
            }
        }
    }

    fn offer(&mut self, myself: &ActorRef<RolloutMsg<P>>, update: Update) {
        let version = update.announce.version;
        match self.swap.offer(version) {
            Offer::Stale { newest } => {
                self.stats.stale_updates += 1;
                tracing::debug!(
                    version,
                    newest,
                    "ignoring a weight version not newer than {newest}"
                );
                reply(update.reply, UpdateOutcome::Stale { version, newest });
            }
            Offer::Queue { superseded } => {
                if let Some(old) = self.queued.replace(update) {
                    debug_assert_eq!(superseded, Some(old.announce.version));
                    self.stats.superseded_updates += 1;
                    let outcome = UpdateOutcome::Superseded {
                        version: old.announce.version,
                        by: version,
                    };
                    reply(old.reply, outcome);
                }
            }
            Offer::Load => self.start_load(myself, update),
        }
    }

    /// Loads `update`, which the swap rule has just marked as loading.
    fn start_load(&mut self, myself: &ActorRef<RolloutMsg<P>>, mut update: Update) {
        let announce = update.announce.clone();
        let bytes = update.bytes.take();
        update.fetched = bytes.is_none();
        let source = self.source.clone();
        let policy = self.policy.clone();
        let me = myself.clone();
        self.stats.loading = Some(announce.version);
        self.loading = Some(update);
        tokio::spawn(async move {
            let version = announce.version;
            let result = load(policy, source, announce, bytes).await;
            // If the worker is gone, nobody needs the version.
            let _ = me.cast(RolloutMsg::Loaded(version, result));
        });
    }

    fn finish_load(
        &mut self,
        myself: &ActorRef<RolloutMsg<P>>,
        version: u64,
        result: Result<Arc<P::Loaded>, String>,
    ) {
        let finished = match self.swap.finish(version, result.is_ok()) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(version, "{e}");
                return;
            }
        };
        let Some(update) = self.loading.take() else {
            tracing::warn!(version, "a load finished that was never started");
            return;
        };
        self.stats.loading = None;
        let outcome = match result {
            Ok(loaded) => {
                let previous = self.current.replace((version, loaded)).map(|c| c.0);
                debug_assert_eq!(finished.outcome, LoadOutcome::Switched { previous });
                let fetched = update.fetched.then(|| update.announce.clone());
                if let Some(old) = std::mem::replace(&mut self.current_fetched, fetched) {
                    self.release(&old, Some(update.announce.blob));
                }
                self.shared.serving.store(version, Ordering::Release);
                self.stats.version = Some(version);
                self.stats.switches += 1;
                tracing::info!(version, ?previous, "serving a new weight version");
                UpdateOutcome::Switched { version }
            }
            Err(error) => {
                // The blob of a version that failed to load serves nothing; offered again, the
                // version is fetched again.
                if update.fetched {
                    self.release(
                        &update.announce,
                        self.current_fetched.as_ref().map(|a| a.blob),
                    );
                }
                self.stats.failed_updates += 1;
                self.stats.last_update_error = Some(error.clone());
                tracing::warn!(version, serving = ?self.stats.version, "weight update failed: {error}");
                UpdateOutcome::Failed { version, error }
            }
        };
        reply(update.reply, outcome);
        if finished.next.is_some() {
            if let Some(next) = self.queued.take() {
                self.start_load(myself, next);
            }
        }
    }

    fn generate(&mut self, request: P::Request, port: RpcReplyPort<GenerateReply<P>>) {
        self.stats.requests += 1;
        let Some((version, loaded)) = self.current.clone() else {
            self.shared.failed.fetch_add(1, Ordering::Relaxed);
            let _ = port.send(Err(RolloutError::NoVersion));
            return;
        };
        let policy = self.policy.clone();
        let shared = self.shared.clone();
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let result = policy.generate(loaded, request).await;
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            let result = match result {
                Ok(output) => {
                    shared.completed.fetch_add(1, Ordering::Relaxed);
                    Ok(Generated {
                        version,
                        serving_at_finish: shared.serving.load(Ordering::Acquire),
                        output,
                    })
                }
                Err(source) => {
                    shared.failed.fetch_add(1, Ordering::Relaxed);
                    Err(RolloutError::Generate { version, source })
                }
            };
            // A caller that stopped waiting is not an error of the worker.
            let _ = port.send(result);
        });
    }

    fn snapshot(&self) -> RolloutStats {
        let mut s = self.stats.clone();
        s.completed = self.shared.completed.load(Ordering::Relaxed);
        s.failed = self.shared.failed.load(Ordering::Relaxed);
        s.in_flight = self.shared.in_flight.load(Ordering::Relaxed);
        s
    }
}

fn reply(port: Option<RpcReplyPort<UpdateOutcome>>, outcome: UpdateOutcome) {
    if let Some(port) = port {
        let _ = port.send(outcome);
    }
}

/// Fetches (unless given), verifies and loads one version; the error is a readable message.
async fn load<P: PolicyReplica>(
    policy: Arc<P>,
    source: Option<Arc<dyn WeightSource>>,
    announce: WeightAnnounce,
    bytes: Option<Bytes>,
) -> Result<Arc<P::Loaded>, String> {
    let version = announce.version;
    let bytes = match bytes {
        Some(b) => b,
        None => {
            let source = source.ok_or_else(|| {
                format!("version {version}: announced, but this worker has no weight source")
            })?;
            source
                .fetch_weights(&announce)
                .await
                .map_err(|e| e.to_string())?
        }
    };
    // Loading is CPU work: off the async runtime.
    tokio::task::spawn_blocking(move || {
        announce
            .check_size(&bytes)
            .map_err(|e| format!("version {version}: {e}"))?;
        policy
            .load(version, &bytes)
            .map_err(|e| format!("version {version}: loading the weights failed: {e}"))
    })
    .await
    .map_err(|e| format!("version {version}: the load task died: {e}"))?
    .map(Arc::new)
}

impl<P: PolicyReplica> Actor for RolloutWorker<P> {
    type Msg = RolloutMsg<P>;
    type State = RolloutState<P>;
    type Arguments = RolloutArgs<P>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: RolloutArgs<P>,
    ) -> Result<RolloutState<P>, ActorProcessingErr> {
        let shared = Arc::new(Shared::default());
        let mut stats = RolloutStats::default();
        if let Some((v, _)) = &args.initial {
            shared.serving.store(*v, Ordering::Release);
            stats.version = Some(*v);
        }
        Ok(RolloutState {
            policy: args.policy,
            source: args.source,
            swap: VersionSwap::new(args.initial.as_ref().map(|(v, _)| *v)),
            current: args.initial,
            current_fetched: None,
            loading: None,
            queued: None,
            shared,
            stats,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut RolloutState<P>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RolloutMsg::Generate(request, port) => state.generate(request, port),
            RolloutMsg::Announce(announce, port) => state.offer(
                &myself,
                Update {
                    announce,
                    bytes: None,
                    reply: port,
                    fetched: false,
                },
            ),
            RolloutMsg::Install(announce, bytes, port) => state.offer(
                &myself,
                Update {
                    announce,
                    bytes: Some(bytes),
                    reply: port,
                    fetched: false,
                },
            ),
            RolloutMsg::Stats(port) => {
                let _ = port.send(state.snapshot());
            }
            RolloutMsg::Loaded(version, result) => state.finish_load(&myself, version, result),
        }
        Ok(())
    }
}
