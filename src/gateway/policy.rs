//! The gateway's policy: the weight versions it serves, and the switch to a new one without
//! pausing (docs/design.md §2, "serving never pauses for an update").
//!
//! Each version of whole weights is its own generation engine ([`crate::model::engine`]: one
//! scheduler thread over that version's weights), and each adapter version an adapter attached
//! to the one engine over the base (the gateway streams tokens through
//! [`EngineHandle::submit_streaming`](crate::model::engine::EngineHandle::submit_streaming)),
//! loaded and started by the same [`EnginePolicy`] the rollout worker serves, so a version is
//! built one way wherever it is served. A request takes an `Arc` of the version current when it
//! arrives ([`GatewayPolicy::current`]) and finishes on it. [`GatewayPolicy::install`] loads a
//! new version's safetensors on a blocking thread beside the serving one, and only then makes it
//! current: requests never wait for a load and never see a missing model, so there is no 503
//! during an update. The old engine finishes the sequences it runs and stops when its last
//! request lets go of it. Versions never go backwards: an install not newer than the serving
//! version is refused ([`InstallError::Stale`]); installs run one at a time, in arrival order.
//! Which version to load and when to swap is the rule the rollout worker follows too
//! ([`VersionSwap`]); since installs are serialized here, it never has a load running when
//! asked, so it answers load or stale.
//!
//! The training pipeline installs either directly ([`GatewayPolicy::install`], or
//! [`GatewayPolicy::install_announced`] with a [`WeightAnnounce`] whose size is checked) or by
//! subscribing the gateway to its trainer ([`GatewayPolicy::trainer_subscriber`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use burn::module::Module;
use burn::tensor::backend::Backend;
use bytes::Bytes;
use clawrl_actors::loops::{
    Offer, PolicyReplica, Subscriber, TrainerEvent, VersionSwap, WeightAnnounce,
};

use crate::model::engine::EngineOptions;
use crate::model::qwen3::Qwen3;
use crate::model::{LoraConfig, LoraWeights, Qwen3Config};
use crate::serve::{EnginePolicy, ServedVersion, VersionLoadError, VersionWeights};

/// Why a weight version was not installed; the serving version is unchanged in every case.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// Not newer than the version already served.
    #[error("weight version {version} is not newer than the served version {serving}")]
    Stale {
        /// The version offered.
        version: u64,
        /// The version served.
        serving: u64,
    },
    /// The bytes are not those announced (their size differs).
    #[error("weight version {version}: {reason}")]
    Corrupt {
        /// The version offered.
        version: u64,
        /// What differs.
        reason: String,
    },
    /// The bytes are not a usable weights (or adapter) blob for this model.
    #[error("loading weight version {version}: {source}")]
    Load {
        /// The version offered.
        version: u64,
        /// What is wrong with the blob.
        source: VersionLoadError,
    },
    /// The blocking load task died.
    #[error("loading weight version {version}: the load task failed: {message}")]
    Task {
        /// The version offered.
        version: u64,
        /// The join error.
        message: String,
    },
}

/// Counters of a [`GatewayPolicy`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PolicyStats {
    /// The version new requests run on.
    pub version: u64,
    /// Versions switched to since start.
    pub switches: u64,
    /// Installs refused as not newer.
    pub stale_installs: u64,
    /// Installs whose load failed.
    pub failed_installs: u64,
    /// The last load failure.
    pub last_error: Option<String>,
    /// Seconds the last successful install took, from the bytes in hand to new requests
    /// running on the version (loading onto the device included); 0 before the first.
    pub last_install_s: f64,
}

type Loader = dyn Fn(u64, &Bytes) -> Result<ServedVersion, VersionLoadError> + Send + Sync;

struct Inner {
    current: RwLock<Arc<ServedVersion>>,
    /// Serializes installs (one load at a time, checked against the version served after the
    /// previous one switched).
    installing: tokio::sync::Mutex<()>,
    /// The version rule; changed only while `installing` is held.
    swap: Mutex<VersionSwap>,
    loader: Box<Loader>,
    switches: AtomicU64,
    stale: AtomicU64,
    failed: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// `f64` bits of [`PolicyStats::last_install_s`].
    last_install_s: AtomicU64,
}

/// A cloneable handle to the versions a gateway serves; the training pipeline calls
/// [`install`](Self::install) with each new version's exported weights.
#[derive(Clone)]
pub struct GatewayPolicy {
    inner: Arc<Inner>,
}

impl GatewayPolicy {
    /// Serves `model` as `version`. Installed blobs are read with `update_config` (the config the
    /// learner exports under: [`crate::train::learner::BurnLearner::model_config`]) on the device
    /// `model` lives on: as whole weights, or with `adapters` as LoRA adapters of that shape over
    /// `model`'s base (its weights held once, shared by every version); every version's engine
    /// uses `tokenizer` (for stop strings) and `options`.
    pub fn new<B: Backend>(
        model: Qwen3<B>,
        version: u64,
        update_config: Qwen3Config,
        adapters: Option<LoraConfig>,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: EngineOptions,
    ) -> Self
    where
        Qwen3<B>: Send + Sync,
        B::Device: Send + Sync,
    {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let weights = match adapters {
            None => VersionWeights::Full,
            Some(config) => VersionWeights::Adapter {
                base: Box::new(model.clone().without_lora()),
                config,
            },
        };
        let replica =
            EnginePolicy::<B>::with_weights(update_config, weights, tokenizer, options, device);
        let serving = replica.serve_model(version, model);
        let loader = move |version: u64, bytes: &Bytes| replica.load(version, bytes);
        Self::serving(serving, Box::new(loader))
    }

    /// Serves `adapter` as `version`, attached to the engine `base` serves now (its base
    /// weights, shared: requests of both decode in the same batches). Installed blobs are
    /// adapters of the same shape for a model of shape `update_config`, attached to that engine.
    pub fn attached(
        base: &GatewayPolicy,
        adapter: LoraWeights,
        version: u64,
        update_config: Qwen3Config,
    ) -> Self {
        let engine = base.current().engine().base();
        let lora = adapter.config.clone();
        let serving = ServedVersion::new(version, engine.attach(adapter));
        let loader = move |version: u64, bytes: &Bytes| {
            ServedVersion::attach(&engine, &lora, &update_config, version, bytes)
        };
        Self::serving(serving, Box::new(loader))
    }

    fn serving(serving: ServedVersion, loader: Box<Loader>) -> Self {
        let version = serving.version();
        GatewayPolicy {
            inner: Arc::new(Inner {
                current: RwLock::new(Arc::new(serving)),
                installing: tokio::sync::Mutex::new(()),
                swap: Mutex::new(VersionSwap::new(Some(version))),
                loader,
                switches: AtomicU64::new(0),
                stale: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                last_error: Mutex::new(None),
                last_install_s: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    /// The version a request arriving now runs on (hold the `Arc` until the request is done).
    pub fn current(&self) -> Arc<ServedVersion> {
        self.inner
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The version new requests run on.
    pub fn version(&self) -> u64 {
        self.current().version()
    }

    /// Loads `weights` (safetensors, Hugging Face names) as `version` beside the serving version
    /// and switches new requests to it. Requests in flight finish on their version. Returns the
    /// version now served. Must be called from a Tokio runtime.
    pub async fn install(
        &self,
        version: u64,
        weights: impl Into<Bytes>,
    ) -> Result<u64, InstallError> {
        let weights: Bytes = weights.into();
        let _one_at_a_time = self.inner.installing.lock().await;
        let started = std::time::Instant::now();
        match self.swap().offer(version) {
            Offer::Load => {}
            Offer::Stale { newest } => {
                self.inner.stale.fetch_add(1, Ordering::Relaxed);
                return Err(InstallError::Stale {
                    version,
                    serving: newest,
                });
            }
            // `installing` is held, so the previous install has finished its load.
            Offer::Queue { .. } => unreachable!("gateway installs run one at a time"),
        }
        let inner = self.inner.clone();
        let loaded = tokio::task::spawn_blocking(move || (inner.loader)(version, &weights)).await;
        let finished = self.swap().finish(version, matches!(loaded, Ok(Ok(_))));
        debug_assert!(
            finished.as_ref().is_ok_and(|f| f.next.is_none()),
            "{finished:?}"
        );
        let new = match loaded {
            Ok(Ok(served)) => Arc::new(served),
            Ok(Err(source)) => return Err(self.failed(InstallError::Load { version, source })),
            Err(e) => {
                return Err(self.failed(InstallError::Task {
                    version,
                    message: e.to_string(),
                }))
            }
        };
        let old = std::mem::replace(
            &mut *self
                .inner
                .current
                .write()
                .unwrap_or_else(|p| p.into_inner()),
            new,
        );
        // Dropped outside the lock: the old engine stops once its last request is done.
        drop(old);
        self.inner.switches.fetch_add(1, Ordering::Relaxed);
        self.inner
            .last_install_s
            .store(started.elapsed().as_secs_f64().to_bits(), Ordering::Relaxed);
        tracing::info!(version, "gateway switched to a new weight version");
        Ok(version)
    }

    /// As [`install`](Self::install), after checking `bytes` against the announcement's size
    /// (the trainer's own buffer, handed over in-process: see [`WeightAnnounce::check_size`]).
    pub async fn install_announced(
        &self,
        announce: &WeightAnnounce,
        bytes: Bytes,
    ) -> Result<u64, InstallError> {
        let version = announce.version;
        if let Err(e) = announce.check_size(&bytes) {
            return Err(self.failed(InstallError::Corrupt {
                version,
                reason: e.to_string(),
            }));
        }
        self.install(version, bytes).await
    }

    /// A subscriber for the job's `Trainer` that installs every published version here, in the
    /// order published, on a task of the current Tokio runtime (the trainer's loop only queues
    /// it). Refused installs are counted in [`stats`](Self::stats) and logged. Must be called
    /// from a Tokio runtime; the task ends when the trainer drops the subscriber.
    pub fn trainer_subscriber(&self) -> Subscriber {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(WeightAnnounce, Bytes)>();
        let policy = self.clone();
        tokio::spawn(async move {
            while let Some((announce, bytes)) = rx.recv().await {
                // A version names one set of weights within a job, so an announcement of the
                // version already served (the trainer's start-up version 0, or a restarted
                // trainer's checkpoint) needs no install and is not stale.
                if announce.version == policy.version() {
                    continue;
                }
                if let Err(e) = policy.install_announced(&announce, bytes).await {
                    tracing::warn!(error = %e, "trainer version not installed on the gateway");
                }
            }
        });
        Arc::new(move |event| match event {
            TrainerEvent::Published {
                announce, bytes, ..
            } => tx.send((announce.clone(), bytes.clone())).is_ok(),
            _ => true,
        })
    }

    fn swap(&self) -> std::sync::MutexGuard<'_, VersionSwap> {
        self.inner.swap.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failed(&self, e: InstallError) -> InstallError {
        self.inner.failed.fetch_add(1, Ordering::Relaxed);
        tracing::error!(error = %e, "weight install failed; the serving version is unchanged");
        *self
            .inner
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        e
    }

    /// The counters.
    pub fn stats(&self) -> PolicyStats {
        PolicyStats {
            version: self.version(),
            switches: self.inner.switches.load(Ordering::Relaxed),
            stale_installs: self.inner.stale.load(Ordering::Relaxed),
            failed_installs: self.inner.failed.load(Ordering::Relaxed),
            last_error: self
                .inner
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            last_install_s: f64::from_bits(self.inner.last_install_s.load(Ordering::Relaxed)),
        }
    }
}
