//! Off-policy bookkeeping: the staleness bound in weight versions and truncated importance
//! weights between the trainer's and the rollout's log-probs. (The train/serve log-prob gap is
//! measured once, by the learner: `clawrl_actors::loops::LogprobGap`.)

use thiserror::Error;

/// The default cap `C` of truncated importance weights.
pub const DEFAULT_IS_CAP: f32 = 2.0;

/// Errors of the off-policy helpers.
#[derive(Debug, Error, PartialEq)]
pub enum StalenessError {
    /// Two per-token lists differ in length.
    #[error(
        "log-prob lists disagree in length: trainer has {trainer} tokens, rollout has {rollout}"
    )]
    LengthMismatch {
        /// Trainer (old) log-prob count.
        trainer: usize,
        /// Rollout log-prob count.
        rollout: usize,
    },
    /// A log-prob is NaN or infinite.
    #[error("non-finite {which} log-prob {value} at token {index}")]
    NonFinite {
        /// `"trainer"` or `"rollout"`.
        which: &'static str,
        /// Token index.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// The cap must be finite and positive.
    #[error("importance-weight cap must be finite and > 0, got {0}")]
    BadCap(f32),
}

/// Anything that knows which weight versions produced it.
pub trait Versioned {
    /// The oldest weight version that produced any of its tokens.
    fn oldest_version(&self) -> u64;
    /// The newest weight version that produced any of its tokens.
    fn newest_version(&self) -> u64;
}

/// What [`filter_stale`] kept and dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StalenessReport {
    /// Samples kept.
    pub kept: usize,
    /// Samples dropped because their oldest token is more than the bound behind.
    pub dropped_stale: usize,
    /// Samples dropped because they claim a version newer than the trainer's (corrupt input).
    pub dropped_future: usize,
}

/// Keeps the samples whose every token was produced at most `max_lag` versions behind
/// `current_version` (i.e. `current − oldest ≤ max_lag`), and reports what was dropped.
///
/// A sample claiming a version newer than `current_version` cannot be genuine and is dropped
/// too, counted apart. Order is preserved.
pub fn filter_stale<T: Versioned>(
    samples: Vec<T>,
    current_version: u64,
    max_lag: u64,
) -> (Vec<T>, StalenessReport) {
    let mut report = StalenessReport::default();
    let kept: Vec<T> = samples
        .into_iter()
        .filter(|s| {
            if s.newest_version() > current_version {
                report.dropped_future += 1;
                false
            } else if current_version - s.oldest_version().min(current_version) > max_lag {
                report.dropped_stale += 1;
                false
            } else {
                true
            }
        })
        .collect();
    report.kept = kept.len();
    (kept, report)
}

fn check_pair(trainer: &[f32], rollout: &[f32]) -> Result<(), StalenessError> {
    if trainer.len() != rollout.len() {
        return Err(StalenessError::LengthMismatch {
            trainer: trainer.len(),
            rollout: rollout.len(),
        });
    }
    for (which, xs) in [("trainer", trainer), ("rollout", rollout)] {
        if let Some(index) = xs.iter().position(|x| !x.is_finite()) {
            return Err(StalenessError::NonFinite {
                which,
                index,
                value: xs[index],
            });
        }
    }
    Ok(())
}

/// Truncated importance weights `w_k = min(exp(trainer_k − rollout_k), cap)`, correcting for the
/// mismatch between the trainer's recomputed old log-probs and the log-probs the rollout served.
pub fn truncated_importance_weights(
    trainer: &[f32],
    rollout: &[f32],
    cap: f32,
) -> Result<Vec<f32>, StalenessError> {
    if !(cap.is_finite() && cap > 0.0) {
        return Err(StalenessError::BadCap(cap));
    }
    check_pair(trainer, rollout)?;
    Ok(trainer
        .iter()
        .zip(rollout)
        .map(|(t, r)| (t - r).exp().min(cap))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct S(u64, u64);
    impl Versioned for S {
        fn oldest_version(&self) -> u64 {
            self.0
        }
        fn newest_version(&self) -> u64 {
            self.1
        }
    }

    #[test]
    fn staleness_bound_in_versions() {
        let samples = vec![S(10, 10), S(8, 9), S(7, 10), S(11, 11), S(0, 3)];
        let (kept, report) = filter_stale(samples, 10, 2);
        assert_eq!(kept, vec![S(10, 10), S(8, 9)]);
        assert_eq!(
            report,
            StalenessReport {
                kept: 2,
                dropped_stale: 2,
                dropped_future: 1
            }
        );
        // A bound of 0 is strictly on-policy.
        let (kept, report) = filter_stale(vec![S(5, 5), S(4, 5)], 5, 0);
        assert_eq!(kept, vec![S(5, 5)]);
        assert_eq!(report.dropped_stale, 1);
    }

    #[test]
    fn importance_weights_are_truncated_at_the_cap() {
        let w =
            truncated_importance_weights(&[-1.0, -1.0, -3.0], &[-1.0, -2.0, -1.0], DEFAULT_IS_CAP)
                .unwrap();
        assert_eq!(w[0], 1.0);
        assert_eq!(w[1], 2.0); // e^1 ≈ 2.718 truncated to 2
        assert!((w[2] - (-2.0f32).exp()).abs() < 1e-7);
        let w = truncated_importance_weights(&[0.0], &[-1.0], 5.0).unwrap();
        assert!((w[0] - 1f32.exp()).abs() < 1e-6);
    }

    #[test]
    fn importance_weights_reject_bad_input() {
        assert_eq!(
            truncated_importance_weights(&[0.0], &[0.0], 0.0),
            Err(StalenessError::BadCap(0.0))
        );
        assert!(matches!(
            truncated_importance_weights(&[0.0], &[], 2.0),
            Err(StalenessError::LengthMismatch {
                trainer: 1,
                rollout: 0
            })
        ));
        assert!(matches!(
            truncated_importance_weights(&[0.0], &[f32::NEG_INFINITY], 2.0),
            Err(StalenessError::NonFinite {
                which: "rollout",
                index: 0,
                ..
            })
        ));
    }
}
