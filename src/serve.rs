//! Serving: the generation engine as a [`PolicyReplica`] for the `clawrl-actors`
//! [`RolloutWorker`](clawrl_actors::loops::RolloutWorker), and the trainer-side helpers that turn
//! a learner's [`VersionedWeights`] into a weight announcement.
//!
//! Each loaded version of whole weights is its own engine (its own scheduler thread over its
//! own weights). A request holds an `Arc` to the version it started on, so an old version's
//! engine finishes the sequences it is running and stops when its last request is done; the new
//! version's engine serves every request that arrives after the switch.
//!
//! A version is either whole weights or, in a job that trains a LoRA adapter, the adapter
//! alone ([`VersionWeights`]): then the replica runs one engine over the base, and each version
//! is an adapter attached to it ([`EngineHandle::attach`]). Requests of every version decode in
//! the same batches, and a version's adapter is detached once its last request is done.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use bytes::Bytes;
use clawrl_actors::bulk::{
    BulkConfig, BulkPlane, Manifest, ManifestError, PeerConnector, PublishError,
};
use clawrl_actors::loops::{PolicyReplica, WeightAnnounce};

use crate::model::peft::adapter_from_safetensors;
use crate::model::{
    model_from_shared_safetensors, spawn_engine, AdapterLoadError, EngineError, EngineHandle,
    EngineOptions, GenerationRequest, GenerationResult, LinearLayout, LoadError, LoraConfig,
    LoraError, Qwen3, Qwen3Config,
};
use crate::train::learner::VersionedWeights;

/// One loaded weight version: an engine handle whose requests run on those weights.
pub struct ServedVersion {
    version: u64,
    engine: EngineHandle,
}

impl ServedVersion {
    /// Weight version `version`, served by `engine`.
    pub fn new(version: u64, engine: EngineHandle) -> Self {
        ServedVersion { version, engine }
    }

    /// Weight version `version` whose blob `bytes` is an adapter of shape `lora` for a model of
    /// shape `config`, attached to `engine`'s base weights.
    pub fn attach(
        engine: &EngineHandle,
        lora: &LoraConfig,
        config: &Qwen3Config,
        version: u64,
        bytes: &[u8],
    ) -> Result<Self, VersionLoadError> {
        let file = format!("the adapter of weight version {version}");
        let adapter = adapter_from_safetensors(bytes, lora.clone(), config, &file)?;
        Ok(ServedVersion::new(version, engine.attach(adapter)))
    }

    /// The weight version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The engine serving it.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }
}

/// What a weight version's blob holds.
pub enum VersionWeights<B: Backend> {
    /// Every weight: safetensors with Hugging Face names (any of bf16/f16/f32), as
    /// [`crate::train::learner::BurnLearner::export_weights`] writes them.
    Full,
    /// A LoRA adapter of this shape (an `adapter_model.safetensors`, PEFT names), attached to
    /// `base`; every version shares `base`'s tensors.
    Adapter {
        /// The frozen base, without adapters.
        base: Box<Qwen3<B>>,
        /// The adapter's rank, alpha and targets.
        config: LoraConfig,
    },
}

impl<B: Backend> VersionWeights<B> {
    /// The model weight version `version`'s blob `bytes` describes, read under `config` on
    /// `device`. Whole weights kept as the blob stores them are views of it, not copies
    /// ([`model_from_shared_safetensors`]).
    pub fn model(
        &self,
        config: &Qwen3Config,
        version: u64,
        bytes: &Bytes,
        device: &B::Device,
    ) -> Result<Qwen3<B>, VersionLoadError> {
        match self {
            VersionWeights::Full => Ok(model_from_shared_safetensors::<B>(
                config,
                bytes,
                device,
                LinearLayout::decoding::<B>(),
            )?),
            VersionWeights::Adapter { base, config: lora } => {
                let file = format!("the adapter of weight version {version}");
                let adapter = adapter_from_safetensors(bytes, lora.clone(), config, &file)?;
                Ok((**base).clone().with_lora(&adapter)?)
            }
        }
    }
}

/// Why a weight version could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum VersionLoadError {
    /// Whole weights that are not a usable safetensors blob for the model.
    #[error(transparent)]
    Weights(#[from] LoadError),
    /// An adapter blob that is not one of the job's shape.
    #[error(transparent)]
    Adapter(#[from] AdapterLoadError),
    /// The adapter does not fit the base.
    #[error("attaching the adapter: {0}")]
    Attach(#[from] LoraError),
}

/// A policy replica over the Qwen3 generation engine. Weight blobs are read as `weights` says,
/// with `config`, the config they were exported under (the learner's
/// [`model_config`](crate::train::learner::BurnLearner::model_config)).
pub struct EnginePolicy<B: Backend = crate::CpuBackend> {
    config: Qwen3Config,
    weights: VersionWeights<B>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    options: EngineOptions,
    device: B::Device,
    /// With adapter versions, the one engine over the base that every version attaches to.
    base_engine: Option<EngineHandle>,
}

impl<B: Backend> EnginePolicy<B> {
    /// A replica building engines with `options` on `device` from whole-weight blobs;
    /// `tokenizer` is needed only for stop strings.
    pub fn new(
        config: Qwen3Config,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: EngineOptions,
        device: B::Device,
    ) -> Self {
        Self::with_weights(config, VersionWeights::Full, tokenizer, options, device)
    }

    /// As [`new`](Self::new), reading blobs as `weights` says.
    pub fn with_weights(
        config: Qwen3Config,
        weights: VersionWeights<B>,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: EngineOptions,
        device: B::Device,
    ) -> Self
    where
        Qwen3<B>: Send + Sync,
    {
        let base_engine = match &weights {
            VersionWeights::Full => None,
            VersionWeights::Adapter { base, .. } => Some(spawn_engine(
                Arc::new((**base).clone()),
                tokenizer.clone(),
                options,
            )),
        };
        EnginePolicy {
            config,
            weights,
            tokenizer,
            options,
            device,
            base_engine,
        }
    }

    /// The model config weight blobs are read with.
    pub fn config(&self) -> &Qwen3Config {
        &self.config
    }

    /// Serves `model` as `version`, with this replica's tokenizer and options: with adapter
    /// versions, `model`'s adapters attached to the base engine; else its own engine. The
    /// gateway's starting version comes this way.
    pub fn serve_model(&self, version: u64, model: Qwen3<B>) -> ServedVersion
    where
        Qwen3<B>: Send + Sync,
    {
        if let (Some(engine), VersionWeights::Adapter { config, .. }) =
            (&self.base_engine, &self.weights)
        {
            if let Ok(adapter) = model.lora_weights(config) {
                return ServedVersion {
                    version,
                    engine: engine.attach(adapter),
                };
            }
        }
        // Whole weights get an engine of their own, kept as a decode step runs fastest (a
        // copy when `model` shares its weights, as the learner's starting policy does; every
        // later version is a copy anyway).
        let model = model.into_layout(LinearLayout::decoding::<B>());
        let engine = spawn_engine(Arc::new(model), self.tokenizer.clone(), self.options);
        ServedVersion { version, engine }
    }
}

impl<B: Backend> PolicyReplica for EnginePolicy<B>
where
    Qwen3<B>: Send + Sync,
    B::Device: Send + Sync,
{
    type Request = GenerationRequest;
    type Output = GenerationResult;
    type GenerateError = EngineError;
    type Loaded = ServedVersion;
    type LoadError = VersionLoadError;

    fn load(&self, version: u64, weights: &Bytes) -> Result<ServedVersion, VersionLoadError> {
        match (&self.weights, &self.base_engine) {
            (VersionWeights::Adapter { config: lora, .. }, Some(engine)) => {
                ServedVersion::attach(engine, lora, &self.config, version, weights)
            }
            _ => {
                let model = self
                    .weights
                    .model(&self.config, version, weights, &self.device)?;
                Ok(self.serve_model(version, model))
            }
        }
    }

    async fn generate(
        &self,
        loaded: Arc<ServedVersion>,
        request: GenerationRequest,
    ) -> Result<GenerationResult, EngineError> {
        loaded.engine.generate(request).await
    }
}

/// The announcement of `weights` as held by node `source`, with the blob id the bulk plane
/// gives it under its default chunk size (for in-process installs, where no plane is involved).
pub fn local_announce(
    weights: &VersionedWeights,
    source: &str,
) -> Result<(WeightAnnounce, Bytes), ManifestError> {
    let manifest = Manifest::build(&weights.bytes, BulkConfig::new(source).chunk_size)?;
    Ok((
        announce(weights, manifest.id(), source),
        Bytes::from(weights.bytes.clone()),
    ))
}

/// Publishes `weights` on this node's bulk plane and returns the announcement to broadcast.
pub fn publish_version<C: PeerConnector>(
    plane: &BulkPlane<C>,
    weights: &VersionedWeights,
) -> Result<WeightAnnounce, PublishError> {
    let blob = plane.publish(Bytes::from(weights.bytes.clone()))?;
    Ok(announce(weights, blob, &plane.config().local_name))
}

/// As [`publish_version`], pinned: the blob is never evicted for others, only removed (a LoRA
/// job's base, which rollout hosts that join later must still find).
pub fn publish_pinned<C: PeerConnector>(
    plane: &BulkPlane<C>,
    weights: &VersionedWeights,
) -> Result<WeightAnnounce, PublishError> {
    let blob = plane.publish_pinned(Bytes::from(weights.bytes.clone()))?;
    Ok(announce(weights, blob, &plane.config().local_name))
}

fn announce(
    weights: &VersionedWeights,
    blob: clawrl_actors::bulk::BlobId,
    source: &str,
) -> WeightAnnounce {
    WeightAnnounce {
        version: weights.version,
        blob,
        size: weights.bytes.len() as u64,
        source: source.to_string(),
    }
}
