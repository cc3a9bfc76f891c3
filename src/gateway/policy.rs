//! The gateway's policy: the weight versions it serves, and the switch to a new one without
//! pausing (docs/design.md §2, "serving never pauses for an update").
//!
//! Each version is its own generation engine ([`crate::model::engine`]: one scheduler thread
//! over that version's weights; the gateway streams tokens through
//! [`EngineHandle::submit_streaming`]). A request takes an `Arc` of the version current when it
//! arrives ([`GatewayPolicy::current`]) and finishes on it. [`GatewayPolicy::install`] loads a
//! new version's safetensors on a blocking thread beside the serving one, and only then makes it
//! current: requests never wait for a load and never see a missing model, so there is no 503
//! during an update. The old engine finishes the sequences it runs and stops when its last
//! request lets go of it. Versions never go backwards: an install not newer than the serving
//! version is refused ([`InstallError::Stale`]); installs run one at a time, in arrival order.
//!
//! The training pipeline installs either directly ([`GatewayPolicy::install`], or
//! [`GatewayPolicy::install_announced`] with a [`WeightAnnounce`] whose size and hash are
//! checked) or by subscribing the gateway to its trainer
//! ([`GatewayPolicy::trainer_subscriber`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use burn::module::Module;
use burn::tensor::backend::Backend;
use bytes::Bytes;
use clawrl_actors::loops::{content_hash, Subscriber, TrainerEvent, WeightAnnounce};

use crate::model::engine::{spawn_engine, EngineHandle, EngineOptions};
use crate::model::qwen3::Qwen3;
use crate::model::{model_from_safetensors, LoadError, Qwen3Config};

/// One served weight version.
pub struct ServingVersion {
    version: u64,
    engine: EngineHandle,
}

impl ServingVersion {
    /// The weight version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The engine generating with it.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }
}

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
    /// The bytes are not those announced (size or blake3 hash differ).
    #[error("weight version {version}: {reason}")]
    Corrupt {
        /// The version offered.
        version: u64,
        /// What differs.
        reason: String,
    },
    /// The bytes are not a usable safetensors blob for this model.
    #[error("loading weight version {version}: {source}")]
    Load {
        /// The version offered.
        version: u64,
        /// What is wrong with the blob.
        source: LoadError,
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

type Loader = dyn Fn(&[u8]) -> Result<EngineHandle, LoadError> + Send + Sync;

struct Inner {
    current: RwLock<Arc<ServingVersion>>,
    /// Serializes installs (one load at a time, checked against the version served after the
    /// previous one switched).
    installing: tokio::sync::Mutex<()>,
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
    /// learner exports under: [`crate::train::learner::Learner::model_config`]) on the device
    /// `model` lives on; every version's engine uses `tokenizer` (for stop strings) and
    /// `options`.
    pub fn new<B: Backend>(
        model: Qwen3<B>,
        version: u64,
        update_config: Qwen3Config,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: EngineOptions,
    ) -> Self
    where
        Qwen3<B>: Send + Sync,
        B::Device: Send + Sync,
    {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let engine = spawn_engine(Arc::new(model), tokenizer.clone(), options);
        let loader = move |bytes: &[u8]| -> Result<EngineHandle, LoadError> {
            let model = model_from_safetensors::<B>(&update_config, bytes, &device)?;
            Ok(spawn_engine(Arc::new(model), tokenizer.clone(), options))
        };
        GatewayPolicy {
            inner: Arc::new(Inner {
                current: RwLock::new(Arc::new(ServingVersion { version, engine })),
                installing: tokio::sync::Mutex::new(()),
                loader: Box::new(loader),
                switches: AtomicU64::new(0),
                stale: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                last_error: Mutex::new(None),
                last_install_s: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    /// The version a request arriving now runs on (hold the `Arc` until the request is done).
    pub fn current(&self) -> Arc<ServingVersion> {
        self.inner
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The version new requests run on.
    pub fn version(&self) -> u64 {
        self.current().version
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
        let serving = self.version();
        if version <= serving {
            self.inner.stale.fetch_add(1, Ordering::Relaxed);
            return Err(InstallError::Stale { version, serving });
        }
        let inner = self.inner.clone();
        let loaded = tokio::task::spawn_blocking(move || (inner.loader)(&weights)).await;
        let engine = match loaded {
            Ok(Ok(engine)) => engine,
            Ok(Err(source)) => return Err(self.failed(InstallError::Load { version, source })),
            Err(e) => {
                return Err(self.failed(InstallError::Task {
                    version,
                    message: e.to_string(),
                }))
            }
        };
        let new = Arc::new(ServingVersion { version, engine });
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
    /// and blake3 hash.
    pub async fn install_announced(
        &self,
        announce: &WeightAnnounce,
        bytes: Bytes,
    ) -> Result<u64, InstallError> {
        let version = announce.version;
        if bytes.len() as u64 != announce.size {
            return Err(self.failed(InstallError::Corrupt {
                version,
                reason: format!("{} bytes, {} announced", bytes.len(), announce.size),
            }));
        }
        let hash = content_hash(&bytes);
        if hash != announce.hash {
            return Err(self.failed(InstallError::Corrupt {
                version,
                reason: format!("blake3 {hash}, {} announced", announce.hash),
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
