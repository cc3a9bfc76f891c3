//! The learner: the OpenClaw-RL objective of docs/design.md §1 in Burn. It owns the batch layout of
//! variable-length samples ([`batch`]), the loss ([`loss`]), a `torch.optim.AdamW`-exact optimizer
//! with a global gradient-norm clip ([`optim`]), the training configuration ([`config`]),
//! shared-prefix packing of a batch ([`packing`]), activation recomputation (`recompute`), the
//! learner itself with versioned weight export ([`learner`]), checkpoints ([`checkpoint`]) and
//! the JSONL sample reader used by offline training ([`samples`]).

pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod learner;
pub mod loss;
pub mod optim;
pub mod packing;
mod recompute;
pub mod samples;

pub use crate::model::token_logprobs;
pub use batch::{BatchLayout, OpdLossKind, OpdTerm, Sample, SampleError, TeacherTopK};
pub use config::{ConfigError, TrainConfig};
pub use loss::{policy_loss, topk_reverse_kl, LossParams, LossTerms};
