//! The RL core: the pure arithmetic of the OpenClaw-RL method (docs/design.md §1).
//!
//! Everything here is plain data in, plain data out: no Burn, no actors, no IO and no clock, in
//! the spirit of quinn's protocol core. It owns vote aggregation and hint selection ([`vote`]),
//! binary / OPD / combined per-token advantages ([`advantage`]), step-wise reward composition and
//! the (task group, step index) z-scoring ([`stepwise`]), and staleness filtering plus truncated
//! importance weights ([`staleness`]). The judge produces the votes, the learner consumes the
//! advantages; both call into this module and nothing here calls out.

pub mod advantage;
pub mod staleness;
pub mod stepwise;
pub mod vote;

pub use advantage::{
    binary_samples, combine, opd_advantages, AdvantageError, AdvantageWeights, BinarySample,
    BinaryTurn, CombineCase, CombinedSample,
};
pub use staleness::{
    filter_stale, truncated_importance_weights, StalenessError, StalenessReport, Versioned,
    DEFAULT_IS_CAP,
};
pub use stepwise::{step_reward, zscore_buckets, EpisodeKind, StepSample, StepwiseError, ZScored};
pub use vote::{aggregate, majority_vote, mean_vote, select_hint, Aggregation, MIN_HINT_CHARS};
