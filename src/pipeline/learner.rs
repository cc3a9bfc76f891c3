//! The Qwen3 learner behind the job's [`Trainer`](clawrl_actors::loops::Trainer): it implements
//! the actors crate's [`Learner`](clawrl_actors::loops::Learner) trait over
//! [`crate::train::learner::BurnLearner`] (optimizer steps of the docs/design.md §1 objective, versioned
//! safetensors export, atomic checkpoints under [`crate::train::checkpoint`]).
//!
//! Truncated importance weights (the trainer's staleness mode `importance`) are computed here:
//! `w_k = min(exp(trainer_k − rollout_k), C)` from the policy's log-probs before the update and
//! the sample's rollout log-probs ([`crate::rl::staleness::truncated_importance_weights`]). They
//! multiply the token's policy-gradient term; since `w ≥ 0` that is exactly the unweighted term
//! with advantage `w_k·A_k` ([`crate::train::loss::policy_loss_weighted`] documents and tests the
//! identity), which is how they reach [`crate::train::learner::BurnLearner::step`]. The KL term is
//! not weighted, nor is an OPD term of the top-k form (a loss of its own, not an advantage).
//!
//! Replicas must load the exported weights with [`PolicyLearner::model_config`] (the learner's
//! float32 config), not the checkpoint's original config.

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use bytes::Bytes;
use clawrl_actors::loops::{
    ExportedWeights, Importance, ImportanceSummary, Learner, SampleLimits, StepReport, TrainSample,
};

use crate::model::{Qwen3Config, SaveError};
use crate::rl::staleness::{truncated_importance_weights, StalenessError};
use crate::train::checkpoint::{self, CheckpointError};
use crate::train::learner::{BurnLearner, StepError};
use crate::train::Sample;

/// Why a learner operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PolicyLearnerError {
    /// The step refused the batch (layout, a sample too long for the model).
    #[error("training step: {0}")]
    Step(#[from] StepError),
    /// A sample to weight carries no rollout log-probs.
    #[error(
        "sample {index} ({session}#{turn}): truncated importance weights need rollout log-probs"
    )]
    MissingRolloutLogprobs {
        /// Position in the batch.
        index: usize,
        /// Its session.
        session: String,
        /// Its turn.
        turn: u32,
    },
    /// The importance weights could not be computed.
    #[error("sample {index} ({session}#{turn}): importance weights: {source}")]
    Importance {
        /// Position in the batch.
        index: usize,
        /// Its session.
        session: String,
        /// Its turn.
        turn: u32,
        /// Why.
        source: StalenessError,
    },
    /// A weight was not finite or was negative.
    #[error("importance cap {0} must be finite and > 0")]
    BadCap(f32),
    /// Exporting the weights failed.
    #[error("exporting weights: {0}")]
    Export(#[from] SaveError),
    /// Saving or restoring a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Versions only grow.
    #[error("cannot move the weight version from {from} to {to}: versions only grow")]
    Version {
        /// The current version.
        from: u64,
        /// The version asked for.
        to: u64,
    },
}

/// The trainer's learner over the Qwen3 policy (CPU by default).
pub struct PolicyLearner<B: AutodiffBackend = crate::CpuAutodiff> {
    inner: BurnLearner<B>,
    keep_checkpoints: usize,
}

impl<B: AutodiffBackend> std::fmt::Debug for PolicyLearner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyLearner")
            .field("inner", &self.inner)
            .field("keep_checkpoints", &self.keep_checkpoints)
            .finish()
    }
}

impl<B: AutodiffBackend> PolicyLearner<B> {
    /// Wraps `inner`; checkpoints beyond the newest `keep_checkpoints` are removed (0 keeps all).
    pub fn new(inner: BurnLearner<B>, keep_checkpoints: usize) -> Self {
        PolicyLearner {
            inner,
            keep_checkpoints,
        }
    }

    /// The learner.
    pub fn inner(&self) -> &BurnLearner<B> {
        &self.inner
    }

    /// The config replicas must load exported weights with.
    pub fn model_config(&self) -> &Qwen3Config {
        self.inner.model_config()
    }

    /// The batch as the learner's samples, with their importance weights (which multiply the
    /// whole advantage, an OPD term of the advantage form included); also the weights' summary.
    fn samples(
        &self,
        batch: &[TrainSample],
        importance: &[Importance],
    ) -> Result<(Vec<Sample>, Option<ImportanceSummary>), PolicyLearnerError> {
        let mut samples: Vec<Sample> = batch
            .iter()
            .map(|s| Sample {
                prompt_ids: s.prompt_ids.clone(),
                response_ids: s.response_ids.clone(),
                advantages: s.advantages.clone(),
                old_logprobs: None,
                ref_logprobs: None,
                rollout_logprobs: s.rollout_logprobs.clone(),
                opd: s.opd.clone(),
                importance: None,
            })
            .collect();
        let weighted: Vec<(usize, f32)> = importance
            .iter()
            .enumerate()
            .filter_map(|(i, imp)| match imp {
                Importance::Truncated { cap } => Some((i, *cap)),
                Importance::None => None,
            })
            .collect();
        if weighted.is_empty() {
            return Ok((samples, None));
        }
        // The policy's log-probs before the update: what the step's own recomputation gives.
        let chosen: Vec<Sample> = weighted.iter().map(|&(i, _)| samples[i].clone()).collect();
        let trainer = self.inner.logprobs(&chosen)?;
        let (mut tokens, mut sum, mut truncated) = (0usize, 0f64, 0usize);
        for (&(index, cap), trainer) in weighted.iter().zip(&trainer) {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(PolicyLearnerError::BadCap(cap));
            }
            let s = &batch[index];
            let rollout = s.rollout_logprobs.as_ref().ok_or_else(|| {
                PolicyLearnerError::MissingRolloutLogprobs {
                    index,
                    session: s.session_id.clone(),
                    turn: s.turn,
                }
            })?;
            let w = truncated_importance_weights(trainer, rollout, cap).map_err(|source| {
                PolicyLearnerError::Importance {
                    index,
                    session: s.session_id.clone(),
                    turn: s.turn,
                    source,
                }
            })?;
            samples[index].importance = Some(w.clone());
            tokens += w.len();
            sum += w.iter().map(|&w| w as f64).sum::<f64>();
            truncated += trainer
                .iter()
                .zip(rollout)
                .filter(|(t, r)| (*t - *r).exp() > cap)
                .count();
        }
        let summary = ImportanceSummary {
            tokens,
            mean: sum / tokens.max(1) as f64,
            truncated,
        };
        Ok((samples, Some(summary)))
    }
}

impl<B: AutodiffBackend> Learner for PolicyLearner<B>
where
    BurnLearner<B>: Send + 'static,
{
    type Error = PolicyLearnerError;

    fn version(&self) -> u64 {
        self.inner.version()
    }

    fn steps(&self) -> u64 {
        self.inner.steps()
    }

    fn limits(&self) -> SampleLimits {
        let cfg = self.inner.model_config();
        SampleLimits {
            vocab: Some(cfg.vocab_size),
            max_tokens: Some(cfg.max_position_embeddings),
        }
    }

    fn step(
        &mut self,
        batch: &[TrainSample],
        importance: &[Importance],
    ) -> Result<StepReport, PolicyLearnerError> {
        let (samples, summary) = self.samples(batch, importance)?;
        let m = self.inner.step(&samples)?;
        Ok(StepReport {
            version: m.version,
            steps: self.inner.steps(),
            skipped: m.skipped,
            loss: m.loss,
            pg_loss: m.pg_loss,
            kl: m.kl,
            clip_fraction: m.clip_fraction,
            grad_norm: m.grad_norm,
            opd_loss: m.opd_loss,
            opd_samples: m.opd_samples,
            old_recomputed: m.old_recomputed,
            logprob_gap: m.logprob_gap,
            tokens: m.tokens,
            packing_ratio: m.packing_ratio,
            importance: summary,
        })
    }

    fn export(&self, reuse: Vec<u8>) -> Result<ExportedWeights, PolicyLearnerError> {
        let w = self.inner.export_weights_into(reuse)?;
        Ok(ExportedWeights {
            version: w.version,
            bytes: Bytes::from(w.bytes),
        })
    }

    fn save_checkpoint(&mut self, root: &Path) -> Result<PathBuf, PolicyLearnerError> {
        Ok(checkpoint::save(&self.inner, root, self.keep_checkpoints)?)
    }

    fn resume(&mut self, root: &Path) -> Result<bool, PolicyLearnerError> {
        if !root.join("latest").exists() {
            return Ok(false);
        }
        let dir = checkpoint::latest(root)?;
        self.inner = checkpoint::restore_onto(&dir, &self.inner)?;
        Ok(true)
    }

    fn advance_version(&mut self, to: u64) -> Result<(), PolicyLearnerError> {
        let l = &self.inner;
        if to <= l.version() {
            return Err(PolicyLearnerError::Version {
                from: l.version(),
                to,
            });
        }
        self.inner = BurnLearner::from_parts(
            l.model_config().clone(),
            l.policy().clone(),
            l.reference().cloned(),
            l.optimizer().clone(),
            l.train_config().clone(),
            l.device().clone(),
            to,
            l.steps(),
            l.rng_state().clone(),
        );
        Ok(())
    }
}
