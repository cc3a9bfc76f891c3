//! The learner: owns the policy (differentiable), AdamW's state, and a frozen reference model
//! when the KL term is on. [`BurnLearner::step`] runs one optimizer step of the docs/design.md §1 objective on
//! a batch of samples; [`BurnLearner::export_weights`] hands out the current weights as one
//! safetensors blob under Hugging Face names, tagged with a version that grows by one per applied
//! step.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::batch::{BatchLayout, LayoutError, OpdLossKind, Sample};
use super::config::TrainConfig;
use super::loss::{policy_loss, topk_reverse_kl, LossParams};
use super::optim::{clip_coefficient, global_grad_norm, AdamW, AdamWParams};
use super::packing::{PackedGroup, Packing};
use super::recompute::Trunk;
use crate::model::peft::adapter_to_safetensors;
use crate::model::qwen3::rope_inv_freq;
use crate::model::token_logprobs;
use crate::model::{model_to_safetensors_into, Qwen3, Qwen3Config, SaveError};

/// Token id used to right-pad batches (any id works: padding is after every real token and
/// masked out of the loss).
pub const PAD_ID: u32 = 0;

/// Why a step could not run.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The batch is empty or a sample is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A sample's OPD term has another form than the learner's `opd_loss`.
    #[error(
        "sample {index} carries an OPD term of the {found} form, but this learner's opd_loss is \
         {expected}"
    )]
    OpdLoss {
        /// Position in the batch.
        index: usize,
        /// The learner's OPD loss.
        expected: &'static str,
        /// The sample's.
        found: &'static str,
    },
    /// Top-k OPD terms of one batch must share `k`.
    #[error(
        "sample {index} has a teacher top-k of k = {k}, another sample of the batch k = {first}"
    )]
    TopKMismatch {
        /// Position in the batch.
        index: usize,
        /// Its k.
        k: u32,
        /// The first top-k sample's k.
        first: u32,
    },
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

pub use clawrl_actors::loops::LogprobGap;

/// What one call to [`BurnLearner::step`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    /// Optimizer steps applied so far, this one included when applied.
    pub step: u64,
    /// Weight version after the call.
    pub version: u64,
    /// Total loss `pg_loss + kl_coef * kl + topk_kl`.
    pub loss: f64,
    /// Clipped policy-gradient term.
    pub pg_loss: f64,
    /// k3 KL estimate (0 when the KL term is off).
    pub kl: f64,
    /// The top-k OPD term, `w_opd`-weighted and aggregated (0 without top-k OPD samples).
    pub topk_kl: f64,
    /// The learner's OPD loss.
    pub opd_loss: OpdLossKind,
    /// Samples that carried an OPD term.
    pub opd_samples: usize,
    /// Whether `π_old` was the learner's own recomputation for every sample (no sample brought
    /// `old_logprobs`).
    pub old_recomputed: bool,
    /// Fraction of response tokens where the clipped term was active.
    pub clip_fraction: f64,
    /// Global gradient L2 norm before clipping (NaN when the step was skipped before backward).
    pub grad_norm: f64,
    /// Response tokens in the batch.
    pub tokens: usize,
    /// Samples in the batch.
    pub samples: usize,
    /// Tokens the forward pass computed over tokens the samples hold ([`Packing::ratio`]):
    /// below 1 when shared prefixes ran once, above 1 by the padding otherwise.
    pub packing_ratio: f64,
    /// Rollout-vs-old log-prob gap, when some sample carried rollout log-probs.
    pub logprob_gap: Option<LogprobGap>,
    /// Why the update was skipped (non-finite loss or gradient); `None` when it was applied.
    pub skipped: Option<String>,
}

/// One published weight version: safetensors bytes (f32) with Hugging Face tensor names, or for
/// a learner that trains a LoRA adapter, the adapter alone with PEFT's names (see
/// [`BurnLearner::export_weights`]).
#[derive(Debug, Clone)]
pub struct VersionedWeights {
    /// Monotonically increasing version (0 = the initial weights).
    pub version: u64,
    /// The safetensors blob.
    pub bytes: Vec<u8>,
}

/// The learner. `B` is the autodiff backend (default: CPU).
pub struct BurnLearner<B: AutodiffBackend = crate::CpuAutodiff> {
    model_config: Qwen3Config,
    train: TrainConfig,
    policy: Qwen3<B>,
    reference: Option<Qwen3<B::InnerBackend>>,
    optim: AdamW<B::InnerBackend>,
    device: B::Device,
    version: u64,
    steps: u64,
    rng: ChaCha8Rng,
    /// [`Qwen3::base_fingerprint`] of a policy with adapters, once computed: its base is frozen,
    /// so no step changes it.
    base_fingerprint: std::sync::OnceLock<String>,
}

impl<B: AutodiffBackend> std::fmt::Debug for BurnLearner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnLearner")
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
/// replicas through [`BurnLearner::model_config`]) declares `float32`, and the RoPE inverse
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

impl<B: AutodiffBackend> BurnLearner<B> {
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
            base_fingerprint: std::sync::OnceLock::new(),
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
            base_fingerprint: std::sync::OnceLock::new(),
        }
    }

    /// The blake3 fingerprint of the policy's frozen base ([`Qwen3::base_fingerprint`]) when it
    /// carries adapters, hashed once per learner; `None` for a policy trained whole, whose
    /// weights every step changes.
    pub fn base_fingerprint(&self) -> Option<String> {
        if !self.policy.has_lora() {
            return None;
        }
        Some(
            self.base_fingerprint
                .get_or_init(|| self.policy.valid().base_fingerprint())
                .clone(),
        )
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

    /// How the forward pass runs `samples`: packed by shared prefix when the configuration
    /// says so, else (and always with an explicit `pad_to`) as the padded layout.
    fn packing(&self, samples: &[Sample], layout: &BatchLayout, pad_to: Option<usize>) -> Packing {
        if self.train.pack_prefixes && pad_to.is_none() {
            Packing::packed(samples, layout, PAD_ID)
        } else {
            Packing::plain(samples, layout)
        }
    }

    /// Per-token log-probs of each sample's response under the current policy (no gradient).
    pub fn logprobs(&self, samples: &[Sample]) -> Result<Vec<Vec<f32>>, StepError> {
        let layout = self.layout(samples, None)?;
        let packing = self.packing(samples, &layout, None);
        let lp = window_logprobs(&self.policy.valid(), &layout, &packing);
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
        let packing = self.packing(samples, &layout, None);
        let lp = window_logprobs(reference, &layout, &packing);
        Ok(Some(layout.gather(&to_vec(lp))))
    }

    /// One optimizer step on `samples` (one batch). See [`BurnLearner::step_padded`].
    pub fn step(&mut self, samples: &[Sample]) -> Result<StepMetrics, StepError> {
        self.step_padded(samples, None)
    }

    /// One optimizer step on `samples`, right-padded to `pad_to` tokens (at least the longest
    /// sample; `None` = the longest, and samples sharing a prefix packed when the configuration
    /// says so).
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
        let packing = self.packing(samples, &layout, pad_to);
        let topk_k = self.check_opd_terms(samples)?;
        let device = self.device.clone();
        let (b, w) = (layout.batch, layout.window);
        let floats = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [b, w]), &device);

        // Forward with gradient: the logits `[b, w, vocab]` over the window, and the log-probs
        // `[b, w]` of the sampled tokens. Recomputing activations, the graph starts at the
        // stack's output, and the stack's gradients come layer by layer after the loss's.
        let (trunk, logits) = if self.train.recompute_activations {
            let (trunk, logits) = Trunk::forward(&self.policy, &layout, &packing);
            (Some(trunk), logits)
        } else {
            (None, window_logits(&self.policy, &layout, &packing))
        };
        let targets = Tensor::<B, 2, Int>::from_data(
            TensorData::new(layout.targets.clone(), [b, w]),
            &device,
        );
        let logp_new = token_logprobs(logits.clone(), targets);
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
                Some(layout.gather(&to_vec(window_logprobs(reference, &layout, &packing))))
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
        // The top-k OPD term, a loss of its own beside the policy-gradient one.
        let topk_kl =
            topk_k.map(|k| topk_term(samples, &layout, k, log_softmax(logits, 2), &device));
        let scalar = |t: Tensor<B, 1>| -> f64 { t.detach().into_scalar().elem() };
        let loss = match &topk_kl {
            Some(t) => terms.loss.clone() + t.clone(),
            None => terms.loss.clone(),
        };
        let loss_value = scalar(loss.clone());
        let mut metrics = StepMetrics {
            step: self.steps,
            version: self.version,
            loss: loss_value,
            pg_loss: scalar(terms.pg_loss),
            kl: scalar(terms.kl),
            topk_kl: topk_kl.map_or(0.0, scalar),
            opd_loss: self.train.opd_loss,
            opd_samples: samples.iter().filter(|s| s.opd.is_some()).count(),
            old_recomputed: samples.iter().all(|s| s.old_logprobs.is_none()),
            clip_fraction: scalar(terms.clip_fraction),
            grad_norm: f64::NAN,
            tokens: layout.tokens(),
            samples: samples.len(),
            packing_ratio: packing.ratio(),
            logprob_gap: LogprobGap::measure(samples.iter().zip(&old_per_sample).flat_map(
                |(s, old)| {
                    s.rollout_logprobs
                        .iter()
                        .flat_map(move |r| r.iter().copied().zip(old.iter().copied()))
                },
            )),
            skipped: None,
        };
        if !loss_value.is_finite() {
            metrics.skipped = Some(format!("non-finite loss ({loss_value})"));
            return Ok(metrics);
        }

        let grads = match trunk {
            Some(trunk) => trunk.backward(&self.policy, loss.backward()),
            None => GradientsParams::from_grads(loss.backward(), &self.policy),
        };
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

    /// Checks that every OPD term has the form of the learner's `opd_loss`, and that top-k terms
    /// share one `k`; returns that `k` when some sample has a top-k term.
    fn check_opd_terms(&self, samples: &[Sample]) -> Result<Option<u32>, StepError> {
        let expected = self.train.opd_loss;
        let mut first = None;
        for (index, s) in samples.iter().enumerate() {
            let Some(o) = &s.opd else { continue };
            let found = OpdLossKind::of(o);
            if found != expected {
                return Err(StepError::OpdLoss {
                    index,
                    expected: expected.name(),
                    found: found.name(),
                });
            }
            if let Some(t) = &o.topk {
                match first {
                    None => first = Some(t.k),
                    Some(k) if k != t.k => {
                        return Err(StepError::TopKMismatch {
                            index,
                            k: t.k,
                            first: k,
                        })
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(first)
    }

    /// The current weights as one safetensors blob, and their version. What trains is what
    /// travels: the whole model with Hugging Face names, or when the policy carries LoRA adapters
    /// (its base frozen), only the adapters, as an `adapter_model.safetensors` with PEFT names
    /// (a replica holding the base attaches them: [`crate::serve::VersionWeights::Adapter`]).
    pub fn export_weights(&self) -> Result<VersionedWeights, SaveError> {
        self.export_weights_into(Vec::new())
    }

    /// [`export_weights`](Self::export_weights), whole weights written into `reuse` when it is
    /// large enough (memory that was written before: no page faults).
    pub fn export_weights_into(&self, reuse: Vec<u8>) -> Result<VersionedWeights, SaveError> {
        let policy = self.policy.valid();
        let bytes = match policy.lora_config() {
            None => model_to_safetensors_into(&policy, &self.model_config, reuse)?,
            Some(lora) => {
                let weights = policy
                    .lora_weights(&lora)
                    .map_err(|e| SaveError::Mismatch {
                        tensor: "the LoRA adapters".into(),
                        reason: e.to_string(),
                    })?;
                adapter_to_safetensors(&weights)?
            }
        };
        Ok(VersionedWeights {
            version: self.version,
            bytes,
        })
    }
}

/// Per-token log-probs of each sample's response under any `model` (e.g. a serving replica),
/// computed as the learner computes its own by default: samples sharing a prefix packed.
pub fn sample_logprobs<B: Backend>(
    model: &Qwen3<B>,
    samples: &[Sample],
) -> Result<Vec<Vec<f32>>, LayoutError> {
    let layout = BatchLayout::new(samples, None, PAD_ID, Some(model.vocab_size()))?;
    let packing = Packing::packed(samples, &layout, PAD_ID);
    Ok(layout.gather(&to_vec(window_logprobs(model, &layout, &packing))))
}

/// Log-probs `[batch, window]` of each window position's target under `model`, the forward
/// pass run as `packing` says.
pub fn window_logprobs<B: Backend>(
    model: &Qwen3<B>,
    layout: &BatchLayout,
    packing: &Packing,
) -> Tensor<B, 2> {
    let (b, w) = (layout.batch, layout.window);
    let targets = Tensor::<B, 2, Int>::from_data(
        TensorData::new(layout.targets.clone(), [b, w]),
        &model.device(),
    );
    token_logprobs(window_logits(model, layout, packing), targets)
}

/// Logits `[batch, window, vocab]` at the window's positions under `model`: each of
/// `packing`'s groups runs through the decoder stack, its prefix once and its rows after it,
/// and the hidden states at the window's positions are gathered from them before the head.
pub fn window_logits<B: Backend>(
    model: &Qwen3<B>,
    layout: &BatchLayout,
    packing: &Packing,
) -> Tensor<B, 3> {
    let device = model.device();
    // Every group's hidden states as rows of one `[computed, hidden]` matrix, in the order
    // `packing.window_rows` indexes.
    let mut states = Vec::with_capacity(2 * packing.groups.len());
    for g in &packing.groups {
        match group_ids(g, &device) {
            (Some(prefix), rows) => {
                let (prefix, rows) = model.forward_hidden_prefixed(prefix, rows);
                states.push(flatten(prefix));
                states.push(flatten(rows));
            }
            (None, rows) => states.push(flatten(model.forward_hidden(rows))),
        }
    }
    window_head(model, layout, packing, states)
}

/// The logits `[batch, window, vocab]` from `states`, every group's hidden states at the
/// stack's output as rows of one `[computed, hidden]` matrix in the order `packing.window_rows`
/// indexes (each group's prefix, then its rows): the window's rows gathered, then the head.
pub(crate) fn window_head<B: Backend>(
    model: &Qwen3<B>,
    layout: &BatchLayout,
    packing: &Packing,
    states: Vec<Tensor<B, 2>>,
) -> Tensor<B, 3> {
    let (b, w) = (layout.batch, layout.window);
    let index = Tensor::<B, 1, Int>::from_data(
        TensorData::new(packing.window_rows.clone(), [b * w]),
        &model.device(),
    );
    let hidden = Tensor::cat(states, 0).select(0, index);
    let h = hidden.dims()[1];
    model.head(hidden.reshape([b, w, h]))
}

/// A packed group's token ids as tensors on `device`: the prefix `[1, prefix_len]` when it has
/// one, and the rows `[rows, len]`.
pub(crate) fn group_ids<B: Backend>(
    g: &PackedGroup,
    device: &B::Device,
) -> (Option<Tensor<B, 2, Int>>, Tensor<B, 2, Int>) {
    let ids = |v: &[i64], shape: [usize; 2]| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v.to_vec(), shape), device)
    };
    let p = g.prefix.len();
    (
        (p > 0).then(|| ids(&g.prefix, [1, p])),
        ids(&g.rest, [g.rows(), g.len]),
    )
}

/// `[a, s, hidden]` → `[a · s, hidden]`.
pub(crate) fn flatten<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 2> {
    let [a, s, h] = x.dims();
    x.reshape([a * s, h])
}

/// The top-k OPD term of a batch ([`topk_reverse_kl`]) from the student's log-softmax
/// `logp_all` `[b, w, vocab]`: each top-k sample's teacher ids and log-probs laid out
/// `[b, w, k]`, weighted `w_opd · mask / (tokens_i · batch)`; other samples weigh 0 (their
/// positions, like padding, hold uniform log-probs `−ln(k + 1)`, finite with a finite tail).
fn topk_term<B: Backend>(
    samples: &[Sample],
    layout: &BatchLayout,
    k: u32,
    logp_all: Tensor<B, 3>,
    device: &B::Device,
) -> Tensor<B, 1> {
    let (b, w, k) = (layout.batch, layout.window, k as usize);
    let topk: Vec<_> = samples
        .iter()
        .map(|s| {
            s.opd
                .as_ref()
                .and_then(|o| o.topk.as_ref().map(|t| (o.weight, t)))
        })
        .collect();
    let ids: Vec<Vec<i64>> = topk
        .iter()
        .map(|t| {
            t.map_or(Vec::new(), |(_, t)| {
                t.ids.iter().map(|&i| i as i64).collect()
            })
        })
        .collect();
    let ids = layout.scatter_rows(
        &ids.iter()
            .zip(&topk)
            .map(|(v, t)| t.map(|_| v.as_slice()))
            .collect::<Vec<_>>(),
        k,
        0,
    );
    let logp = layout.scatter_rows(
        &topk
            .iter()
            .map(|t| t.map(|(_, t)| t.logprobs.as_slice()))
            .collect::<Vec<_>>(),
        k,
        -((k + 1) as f32).ln(),
    );
    let mut weights = layout.weights.clone();
    for (row, t) in weights.chunks_mut(w).zip(&topk) {
        let wt = t.map_or(0.0, |(weight, _)| weight);
        row.iter_mut().for_each(|x| *x *= wt);
    }
    topk_reverse_kl(
        logp_all,
        Tensor::<B, 3, Int>::from_data(TensorData::new(ids, [b, w, k]), device),
        Tensor::<B, 3>::from_data(TensorData::new(logp, [b, w, k]), device),
        Tensor::<B, 2>::from_data(TensorData::new(weights, [b, w]), device),
    )
}

fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .expect("float tensor converts to f32")
}
