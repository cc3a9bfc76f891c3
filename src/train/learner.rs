//! The learner: owns the policy (differentiable), AdamW's state, and a frozen reference model
//! when the KL term is on. [`Learner::step`] runs one optimizer step of the docs/design.md §1 objective on
//! a batch of samples; [`Learner::export_weights`] hands out the current weights as one
//! safetensors blob under Hugging Face names, tagged with a version that grows by one per applied
//! step.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::batch::{BatchLayout, LayoutError, Sample};
use super::config::TrainConfig;
use super::loss::{policy_loss, token_logprobs, LossParams};
use super::optim::{clip_coefficient, global_grad_norm, AdamW, AdamWParams};
use crate::model::qwen3::rope_inv_freq;
use crate::model::{model_to_safetensors, Qwen3, Qwen3Config, SaveError};

/// Token id used to right-pad batches (any id works: padding is after every real token and
/// masked out of the loss).
pub const PAD_ID: u32 = 0;

/// Why a step could not run.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The batch is empty or a sample is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A sample is longer than the model's context.
    #[error("sample {index} has {len} tokens, more than the model's {max} positions")]
    TooLong {
        /// Position in the batch.
        index: usize,
        /// Its length.
        len: usize,
        /// The model's maximum.
        max: usize,
    },
}

/// Statistics of `rollout_logprobs - old_logprobs` over the tokens that have rollout log-probs:
/// the train/serve mismatch.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LogprobGap {
    /// Mean of `rollout - old`.
    pub mean: f64,
    /// Mean of `|rollout - old|`.
    pub mean_abs: f64,
    /// Largest `|rollout - old|`.
    pub max_abs: f64,
    /// Tokens measured.
    pub tokens: usize,
}

/// What one call to [`Learner::step`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    /// Optimizer steps applied so far, this one included when applied.
    pub step: u64,
    /// Weight version after the call.
    pub version: u64,
    /// Total loss `pg_loss + kl_coef * kl`.
    pub loss: f64,
    /// Clipped policy-gradient term.
    pub pg_loss: f64,
    /// k3 KL estimate (0 when the KL term is off).
    pub kl: f64,
    /// Fraction of response tokens where the clipped term was active.
    pub clip_fraction: f64,
    /// Global gradient L2 norm before clipping (NaN when the step was skipped before backward).
    pub grad_norm: f64,
    /// Response tokens in the batch.
    pub tokens: usize,
    /// Samples in the batch.
    pub samples: usize,
    /// Rollout-vs-old log-prob gap, when some sample carried rollout log-probs.
    pub rollout_gap: Option<LogprobGap>,
    /// Why the update was skipped (non-finite loss or gradient); `None` when it was applied.
    pub skipped: Option<String>,
}

/// One published weight version: safetensors bytes with Hugging Face tensor names (f32).
#[derive(Debug, Clone)]
pub struct VersionedWeights {
    /// Monotonically increasing version (0 = the initial weights).
    pub version: u64,
    /// The safetensors blob.
    pub bytes: Vec<u8>,
    /// blake3 hash of `bytes`, hex.
    pub hash: String,
}

/// The learner. `B` is the autodiff backend (default: CPU).
pub struct Learner<B: AutodiffBackend = crate::CpuAutodiff> {
    model_config: Qwen3Config,
    train: TrainConfig,
    policy: Qwen3<B>,
    reference: Option<Qwen3<B::InnerBackend>>,
    optim: AdamW<B::InnerBackend>,
    device: B::Device,
    version: u64,
    steps: u64,
    rng: ChaCha8Rng,
}

impl<B: AutodiffBackend> std::fmt::Debug for Learner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learner")
            .field("train", &self.train)
            .field("version", &self.version)
            .field("steps", &self.steps)
            .field("reference", &self.reference.is_some())
            .finish_non_exhaustive()
    }
}

pub(crate) fn adamw_params(t: &TrainConfig) -> AdamWParams {
    AdamWParams {
        lr: t.lr,
        betas: t.betas,
        eps: t.adam_eps,
        weight_decay: t.weight_decay,
    }
}

/// The learner computes in float32 whatever dtype the checkpoint was stored in, exactly as a
/// float32 PyTorch model does: the config it keeps (and writes into checkpoints, and hands to
/// replicas through [`Learner::model_config`]) declares `float32`, and the RoPE inverse
/// frequencies are the unrounded float32 ones. (`transformers` rounds that buffer to the
/// checkpoint dtype only when the model is loaded in that dtype; the reference training step of
/// `train_step_expected.json` runs in float32 and uses the unrounded buffer.)
pub fn float32_config(cfg: &Qwen3Config) -> Qwen3Config {
    let mut cfg = cfg.clone();
    let mut declared = false;
    for key in ["dtype", "torch_dtype"] {
        if cfg.extra.contains_key(key) {
            cfg.extra
                .insert(key.to_string(), serde_json::Value::String("float32".into()));
            declared = true;
        }
    }
    if !declared {
        cfg.extra.insert(
            "torch_dtype".into(),
            serde_json::Value::String("float32".into()),
        );
    }
    cfg
}

impl<B: AutodiffBackend> Learner<B> {
    /// A learner starting from `policy` at version 0. When `train.kl_coef > 0`, a frozen copy of
    /// `policy` becomes the reference model. `seed` seeds the learner's RNG. The model is used
    /// in float32 (see [`float32_config`]).
    pub fn new(
        model_config: Qwen3Config,
        mut policy: Qwen3<B>,
        train: TrainConfig,
        device: B::Device,
        seed: u64,
    ) -> Self {
        let model_config = float32_config(&model_config);
        policy.rope_inv_freq = rope_inv_freq(
            model_config.head_dim(),
            model_config.rope_theta(),
            model_config.storage_dtype(),
        );
        let reference = (train.kl_coef > 0.0).then(|| policy.valid());
        Self {
            optim: AdamW::new(adamw_params(&train)),
            model_config,
            train,
            policy,
            reference,
            device,
            version: 0,
            steps: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Rebuilds a learner from saved parts (used by checkpoint restore).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        model_config: Qwen3Config,
        policy: Qwen3<B>,
        reference: Option<Qwen3<B::InnerBackend>>,
        optim: AdamW<B::InnerBackend>,
        train: TrainConfig,
        device: B::Device,
        version: u64,
        steps: u64,
        rng: ChaCha8Rng,
    ) -> Self {
        Self {
            model_config,
            train,
            policy,
            reference,
            optim,
            device,
            version,
            steps,
            rng,
        }
    }

    /// The model's config.
    pub fn model_config(&self) -> &Qwen3Config {
        &self.model_config
    }

    /// The training hyper-parameters.
    pub fn train_config(&self) -> &TrainConfig {
        &self.train
    }

    /// The current weight version (0 before any applied step).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Optimizer steps applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The differentiable policy.
    pub fn policy(&self) -> &Qwen3<B> {
        &self.policy
    }

    /// The frozen reference model, when the KL term is on.
    pub fn reference(&self) -> Option<&Qwen3<B::InnerBackend>> {
        self.reference.as_ref()
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &AdamW<B::InnerBackend> {
        &self.optim
    }

    /// The device.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The learner's RNG (for sample order and anything else random); saved in checkpoints.
    pub fn rng(&mut self) -> &mut ChaCha8Rng {
        &mut self.rng
    }

    /// The RNG, read-only.
    pub fn rng_state(&self) -> &ChaCha8Rng {
        &self.rng
    }

    fn layout(&self, samples: &[Sample], pad_to: Option<usize>) -> Result<BatchLayout, StepError> {
        let layout = BatchLayout::new(samples, pad_to, PAD_ID, Some(self.model_config.vocab_size))?;
        let max = self.model_config.max_position_embeddings;
        if let Some((index, s)) = samples.iter().enumerate().find(|(_, s)| s.len() > max) {
            return Err(StepError::TooLong {
                index,
                len: s.len(),
                max,
            });
        }
        Ok(layout)
    }

    /// Per-token log-probs of each sample's response under the current policy (no gradient).
    pub fn logprobs(&self, samples: &[Sample]) -> Result<Vec<Vec<f32>>, StepError> {
        let layout = self.layout(samples, None)?;
        let lp = window_logprobs(&self.policy.valid(), &layout);
        Ok(layout.gather(&to_vec(lp)))
    }

    /// Per-token log-probs of each sample's response under the reference model, or `None` when
    /// the KL term is off.
    pub fn reference_logprobs(
        &self,
        samples: &[Sample],
    ) -> Result<Option<Vec<Vec<f32>>>, StepError> {
        let Some(reference) = &self.reference else {
            return Ok(None);
        };
        let layout = self.layout(samples, None)?;
        let lp = window_logprobs(reference, &layout);
        Ok(Some(layout.gather(&to_vec(lp))))
    }

    /// One optimizer step on `samples` (one batch). See [`Learner::step_padded`].
    pub fn step(&mut self, samples: &[Sample]) -> Result<StepMetrics, StepError> {
        self.step_padded(samples, None)
    }

    /// One optimizer step on `samples`, right-padded to `pad_to` tokens (at least the longest
    /// sample; `None` = the longest).
    ///
    /// `old_logprobs` absent on a sample: the policy's own log-probs before the update (ratio 1).
    /// `ref_logprobs` absent and KL on: the reference model's. A non-finite loss or gradient norm
    /// leaves the weights, the optimizer state and the version untouched and is reported in
    /// [`StepMetrics::skipped`].
    pub fn step_padded(
        &mut self,
        samples: &[Sample],
        pad_to: Option<usize>,
    ) -> Result<StepMetrics, StepError> {
        let layout = self.layout(samples, pad_to)?;
        let device = self.device.clone();
        let (b, w) = (layout.batch, layout.window);
        let floats = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [b, w]), &device);

        // Forward with gradient.
        let logp_new = window_logprobs(&self.policy, &layout);
        let new_host = to_vec(logp_new.clone().detach());

        // Old log-probs: given, else the policy's own (identical to a recomputation, since the
        // weights have not changed yet).
        let old_per_sample: Vec<Vec<f32>> = samples
            .iter()
            .zip(layout.gather(&new_host))
            .map(|(s, own)| s.old_logprobs.clone().unwrap_or(own))
            .collect();
        let logp_old = floats(layout.scatter(&old_per_sample));

        // Reference log-probs: given, else from the reference model.
        let logp_ref = if self.train.kl_coef > 0.0 {
            let computed = if samples.iter().any(|s| s.ref_logprobs.is_none()) {
                let reference = self.reference.get_or_insert_with(|| self.policy.valid());
                Some(layout.gather(&to_vec(window_logprobs(reference, &layout))))
            } else {
                None
            };
            let per_sample: Vec<Vec<f32>> = samples
                .iter()
                .enumerate()
                .map(|(i, s)| match &s.ref_logprobs {
                    Some(r) => r.clone(),
                    None => computed.as_ref().expect("computed when missing")[i].clone(),
                })
                .collect();
            Some(floats(layout.scatter(&per_sample)))
        } else {
            None
        };

        // The OPD term takes these same old log-probs (the policy before the update, at
        // temperature 1), never the rollout's.
        let adv: Vec<Vec<f32>> = samples
            .iter()
            .zip(&old_per_sample)
            .map(|(s, old)| s.effective_advantages(old))
            .collect();
        let terms = policy_loss(
            logp_new,
            logp_old,
            logp_ref,
            floats(layout.scatter(&adv)),
            floats(layout.mask.clone()),
            floats(layout.weights.clone()),
            &LossParams {
                eps_clip: self.train.eps_clip,
                eps_clip_high: self.train.eps_clip_high,
                kl_coef: self.train.kl_coef,
            },
        );
        let scalar = |t: Tensor<B, 1>| -> f64 { t.detach().into_scalar().elem() };
        let loss_value = scalar(terms.loss.clone());
        let mut metrics = StepMetrics {
            step: self.steps,
            version: self.version,
            loss: loss_value,
            pg_loss: scalar(terms.pg_loss),
            kl: scalar(terms.kl),
            clip_fraction: scalar(terms.clip_fraction),
            grad_norm: f64::NAN,
            tokens: layout.tokens(),
            samples: samples.len(),
            rollout_gap: rollout_gap(samples, &old_per_sample),
            skipped: None,
        };
        if !loss_value.is_finite() {
            metrics.skipped = Some(format!("non-finite loss ({loss_value})"));
            return Ok(metrics);
        }

        let grads = GradientsParams::from_grads(terms.loss.backward(), &self.policy);
        let norm = global_grad_norm(&self.policy, &grads);
        metrics.grad_norm = norm;
        if !norm.is_finite() {
            metrics.skipped = Some(format!("non-finite gradient norm ({norm})"));
            return Ok(metrics);
        }
        let coef = clip_coefficient(norm, self.train.grad_clip);
        let policy = self.policy.clone();
        self.policy = self.optim.step(policy, grads, coef);
        self.steps += 1;
        self.version += 1;
        metrics.step = self.steps;
        metrics.version = self.version;
        Ok(metrics)
    }

    /// The current weights as one safetensors blob with Hugging Face names, and their version.
    pub fn export_weights(&self) -> Result<VersionedWeights, SaveError> {
        let bytes = model_to_safetensors(&self.policy.valid(), &self.model_config)?;
        let hash = blake3::hash(&bytes).to_hex().to_string();
        Ok(VersionedWeights {
            version: self.version,
            bytes,
            hash,
        })
    }
}

/// Per-token log-probs of each sample's response under any `model` (e.g. a serving replica),
/// computed exactly as the learner computes its own: one right-padded forward pass.
pub fn sample_logprobs<B: Backend>(
    model: &Qwen3<B>,
    samples: &[Sample],
) -> Result<Vec<Vec<f32>>, LayoutError> {
    let layout = BatchLayout::new(samples, None, PAD_ID, Some(model.vocab_size()))?;
    Ok(layout.gather(&to_vec(window_logprobs(model, &layout))))
}

/// Log-probs `[batch, window]` of each window position's target under `model`.
pub fn window_logprobs<B: Backend>(model: &Qwen3<B>, layout: &BatchLayout) -> Tensor<B, 2> {
    let device = model.device();
    let (b, l, s, w) = (
        layout.batch,
        layout.seq_len,
        layout.window_start,
        layout.window,
    );
    let ids =
        Tensor::<B, 2, Int>::from_data(TensorData::new(layout.input_ids.clone(), [b, l]), &device);
    let targets =
        Tensor::<B, 2, Int>::from_data(TensorData::new(layout.targets.clone(), [b, w]), &device);
    let hidden = model.forward_hidden(ids);
    let h = hidden.dims()[2];
    let logits = model.head(hidden.slice([0..b, s..s + w, 0..h]));
    token_logprobs(logits, targets)
}

fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .expect("float tensor converts to f32")
}

fn rollout_gap(samples: &[Sample], old: &[Vec<f32>]) -> Option<LogprobGap> {
    let (mut sum, mut sum_abs, mut max_abs, mut n) = (0f64, 0f64, 0f64, 0usize);
    for (s, old) in samples.iter().zip(old) {
        if let Some(r) = &s.rollout_logprobs {
            for (r, o) in r.iter().zip(old) {
                let d = (*r - *o) as f64;
                sum += d;
                sum_abs += d.abs();
                max_abs = max_abs.max(d.abs());
                n += 1;
            }
        }
    }
    (n > 0).then(|| LogprobGap {
        mean: sum / n as f64,
        mean_abs: sum_abs / n as f64,
        max_abs,
        tokens: n,
    })
}
