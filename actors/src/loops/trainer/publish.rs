//! Where the trainer's versions go: [`WeightPublisher`]s put a new version's bytes somewhere
//! fetchable (the bulk plane, the bulk plane with a relay push to the replicas, or nowhere for
//! in-process installs) and name them in a [`WeightAnnounce`]; [`Subscriber`]s hear every
//! [`TrainerEvent`] on the trainer's message loop ([`rollout_subscriber`] forwards published
//! versions to a rollout worker).

use std::sync::Arc;

use ractor::ActorRef;

use super::{ExportedWeights, TrainerEvent};
use crate::bulk::{BulkConfig, BulkPlane, Manifest, PeerConnector};
use crate::loops::rollout::RolloutMsg;
use crate::loops::{PolicyReplica, WeightAnnounce};

/// Where the trainer puts a new version's bytes: the bulk plane, or nowhere (in-process
/// installs only).
pub trait WeightPublisher: Send + Sync + 'static {
    /// Makes `weights` fetchable and returns the announcement that names them.
    fn publish(&self, weights: &ExportedWeights) -> Result<WeightAnnounce, PublishFailed>;
    /// Frees an older version nobody should fetch any more.
    fn retire(&self, _announce: &WeightAnnounce) {}
}

/// Why a version could not be published.
#[derive(Debug, Clone, thiserror::Error)]
#[error("publishing weight version {version}: {reason}")]
pub struct PublishFailed {
    /// The version.
    pub version: u64,
    /// What went wrong.
    pub reason: String,
}

impl<C: PeerConnector> WeightPublisher for BulkPlane<C> {
    fn publish(&self, weights: &ExportedWeights) -> Result<WeightAnnounce, PublishFailed> {
        let blob = BulkPlane::publish(self, weights.bytes.clone()).map_err(|e| PublishFailed {
            version: weights.version,
            reason: e.to_string(),
        })?;
        Ok(WeightAnnounce {
            version: weights.version,
            blob,
            size: weights.bytes.len() as u64,
            source: self.config().local_name.clone(),
        })
    }

    fn retire(&self, announce: &WeightAnnounce) {
        self.remove(&announce.blob);
    }
}

/// A publisher that, after publishing on the bulk plane, pushes the blob to `targets` (node
/// names) through the plane's relay groups ([`BulkPlane::broadcast`]) before the version is
/// announced: the trainer's uplink sends about one copy whatever the number of replicas, and
/// the replicas' fetches find the blob already local. A target the relay could not reach is
/// logged and fetches the blob from the trainer itself when the announcement arrives.
pub struct RelayPublisher<C> {
    plane: BulkPlane<C>,
    targets: std::sync::Mutex<Vec<String>>,
    runtime: tokio::runtime::Handle,
}

impl<C: PeerConnector> RelayPublisher<C> {
    /// A relaying publisher on `plane`; must be called inside a tokio runtime (the broadcast
    /// runs on it, driven from the learner thread).
    pub fn new(plane: BulkPlane<C>, targets: Vec<String>) -> Result<Self, PublishFailed> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| PublishFailed {
            version: 0,
            reason: format!("a relaying publisher needs a tokio runtime: {e}"),
        })?;
        Ok(RelayPublisher {
            plane,
            targets: std::sync::Mutex::new(targets),
            runtime,
        })
    }

    /// Replaces the relay targets (e.g. when replicas join or leave).
    pub fn set_targets(&self, targets: Vec<String>) {
        *self.targets.lock().unwrap_or_else(|p| p.into_inner()) = targets;
    }
}

impl<C: PeerConnector> WeightPublisher for RelayPublisher<C> {
    fn publish(&self, weights: &ExportedWeights) -> Result<WeightAnnounce, PublishFailed> {
        let announce = WeightPublisher::publish(&self.plane, weights)?;
        let targets = self
            .targets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if !targets.is_empty() {
            match self
                .runtime
                .block_on(self.plane.broadcast(announce.blob, &targets))
            {
                Ok(report) => tracing::debug!(
                    version = announce.version,
                    delivered = ?report.delivered,
                    retried = ?report.retried,
                    "weights relayed"
                ),
                Err(e) => tracing::warn!(
                    version = announce.version,
                    "relaying the weights failed for some replicas (they will fetch): {e}"
                ),
            }
        }
        Ok(announce)
    }

    fn retire(&self, announce: &WeightAnnounce) {
        self.plane.remove(&announce.blob);
    }
}

/// A publisher without a bulk plane: the announcement names the blob id the plane would give
/// the bytes (default chunk size) and node `source`; subscribers get the bytes in-process.
#[derive(Debug, Clone)]
pub struct LocalPublisher {
    /// The node named as the source.
    pub source: String,
}

impl WeightPublisher for LocalPublisher {
    fn publish(&self, weights: &ExportedWeights) -> Result<WeightAnnounce, PublishFailed> {
        let manifest = Manifest::build(&weights.bytes, BulkConfig::new(&self.source).chunk_size)
            .map_err(|e| PublishFailed {
                version: weights.version,
                reason: e.to_string(),
            })?;
        Ok(WeightAnnounce {
            version: weights.version,
            blob: manifest.id(),
            size: weights.bytes.len() as u64,
            source: self.source.clone(),
        })
    }
}

/// A subscriber: called on the trainer's message loop for every event, so it must be quick
/// (cast, push to a channel). Returning `false` unsubscribes it.
pub type Subscriber = Arc<dyn Fn(&TrainerEvent) -> bool + Send + Sync>;

/// How a rollout worker subscriber receives new versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// [`RolloutMsg::Announce`]: the worker fetches the bytes through its weight source.
    Announce,
    /// [`RolloutMsg::Install`]: the bytes handed over in-process.
    Install,
}

/// A subscriber forwarding every published version to `worker`; it unsubscribes when the
/// worker is gone.
pub fn rollout_subscriber<P: PolicyReplica>(
    worker: ActorRef<RolloutMsg<P>>,
    delivery: Delivery,
) -> Subscriber {
    Arc::new(move |event| match event {
        TrainerEvent::Published {
            announce, bytes, ..
        } => {
            let msg = match delivery {
                Delivery::Announce => RolloutMsg::Announce(announce.clone(), None),
                Delivery::Install => RolloutMsg::Install(announce.clone(), bytes.clone(), None),
            };
            worker.cast(msg).is_ok()
        }
        _ => true,
    })
}
