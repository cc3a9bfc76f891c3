//! Step-wise rewards for general agents (terminal, GUI, SWE, tool-call) and their z-scoring.
//!
//! Each step of an episode gets a process score from the PRM judge; the step reward combines it
//! with the episode outcome by the agent kind's formula (docs/design.md §1). Advantages are then z-scored
//! within buckets of samples sharing the same task group and the same step index.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The epsilon added to the standard deviation when z-scoring, and the threshold below which a
/// bucket's standard deviation counts as zero.
pub const ZSCORE_EPS: f64 = 1e-6;

/// Errors of step-wise reward composition.
#[derive(Debug, Error, PartialEq)]
pub enum StepwiseError {
    /// A value is NaN or infinite.
    #[error("step-wise {what} is not finite: {value}")]
    NonFinite {
        /// What the value is (`"outcome"`, `"prm"`, `"reward of sample 3"`...).
        what: String,
        /// The offending value.
        value: f64,
    },
    /// An outcome outside what the agent kind allows.
    #[error("{kind:?} outcome must be in [0, 1] (pass = 1, fail = 0), got {outcome}")]
    OutcomeOutOfRange {
        /// The agent kind.
        kind: EpisodeKind,
        /// The offending outcome.
        outcome: f64,
    },
}

/// The kind of agent, which selects the step-reward formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EpisodeKind {
    /// Terminal agents: `(2o − 1) + prm`, `o` in `[0, 1]`.
    Terminal,
    /// GUI agents: `prm + (±1 outcome)`.
    Gui,
    /// SWE agents: `prm + (±1 outcome)`.
    Swe,
    /// Tool-call agents: the general formula `o + prm`.
    ToolCall,
    /// Any other agent: `R = o + Σ r_i / m`.
    General,
}

/// The reward of one step: the episode outcome combined with the step's process score.
///
/// - `Terminal`: `(2o − 1) + prm`, with `o` in `[0, 1]` (the check script's pass flag or pass
///   fraction).
/// - `Gui`, `Swe`: `prm + (±1 outcome)`; the outcome is given as `o` in `[0, 1]` (pass = 1,
///   fail = 0) and mapped to `2o − 1`, so a pass adds `+1` and a failure `−1`. (With a binary
///   outcome this is the same arithmetic as the terminal formula; it is kept as its own kind so
///   that configs say what they mean.)
/// - `ToolCall`, `General`: `o + prm`, with any finite `o`; the caller passes `prm = Σ r_i / m`,
///   i.e. [`crate::rl::vote::mean_vote`] or the configured aggregation of the step's votes.
pub fn step_reward(kind: EpisodeKind, outcome: f64, prm: f64) -> Result<f64, StepwiseError> {
    if !outcome.is_finite() {
        return Err(StepwiseError::NonFinite {
            what: "outcome".into(),
            value: outcome,
        });
    }
    if !prm.is_finite() {
        return Err(StepwiseError::NonFinite {
            what: "prm".into(),
            value: prm,
        });
    }
    match kind {
        EpisodeKind::Terminal | EpisodeKind::Gui | EpisodeKind::Swe => {
            if !(0.0..=1.0).contains(&outcome) {
                return Err(StepwiseError::OutcomeOutOfRange { kind, outcome });
            }
            Ok((2.0 * outcome - 1.0) + prm)
        }
        EpisodeKind::ToolCall | EpisodeKind::General => Ok(outcome + prm),
    }
}

/// One step sample to be z-scored.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSample {
    /// The task group (samples of the same task, e.g. the rollouts of one prompt).
    pub group: String,
    /// The step index within its episode.
    pub step: u32,
    /// The step reward from [`step_reward`].
    pub reward: f64,
}

/// A sample that survives z-scoring.
#[derive(Debug, Clone, PartialEq)]
pub struct ZScored {
    /// Index of the sample in the input slice.
    pub index: usize,
    /// Its advantage.
    pub advantage: f64,
}

/// Z-scores rewards within (task group, step index) buckets (docs/design.md §1).
///
/// - `advantage = (r − mean) / (std + 1e-6)` with the *population* standard deviation
///   (divided by `n`), as the reference implementation computes it; a bucket's advantages then
///   have mean 0 and population standard deviation 1 (up to the epsilon).
/// - A single-sample bucket keeps its raw reward as its advantage.
/// - A bucket of two or more samples whose standard deviation is below `1e-6` carries no signal
///   and is dropped, except that the output is never empty when the input is not ("keep at least
///   one"): if every bucket would be dropped, the first sample of the input is kept, with
///   advantage `0` (its z-score).
///
/// Output is in input order.
pub fn zscore_buckets(samples: &[StepSample]) -> Result<Vec<ZScored>, StepwiseError> {
    if let Some((i, s)) = samples
        .iter()
        .enumerate()
        .find(|(_, s)| !s.reward.is_finite())
    {
        return Err(StepwiseError::NonFinite {
            what: format!("reward of sample {i}"),
            value: s.reward,
        });
    }
    let mut buckets: HashMap<(&str, u32), Vec<usize>> = HashMap::new();
    for (i, s) in samples.iter().enumerate() {
        buckets
            .entry((s.group.as_str(), s.step))
            .or_default()
            .push(i);
    }
    let mut advantage: Vec<Option<f64>> = vec![None; samples.len()];
    for members in buckets.values() {
        let n = members.len();
        if n == 1 {
            advantage[members[0]] = Some(samples[members[0]].reward);
            continue;
        }
        let mean = members.iter().map(|&i| samples[i].reward).sum::<f64>() / n as f64;
        let var = members
            .iter()
            .map(|&i| (samples[i].reward - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        let std = var.sqrt();
        if std < ZSCORE_EPS {
            continue;
        }
        for &i in members {
            advantage[i] = Some((samples[i].reward - mean) / (std + ZSCORE_EPS));
        }
    }
    let mut out: Vec<ZScored> = advantage
        .iter()
        .enumerate()
        .filter_map(|(index, a)| a.map(|advantage| ZScored { index, advantage }))
        .collect();
    if out.is_empty() && !samples.is_empty() {
        out.push(ZScored {
            index: 0,
            advantage: 0.0,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(group: &str, step: u32, reward: f64) -> StepSample {
        StepSample {
            group: group.into(),
            step,
            reward,
        }
    }

    #[test]
    fn step_reward_formulas() {
        assert_eq!(step_reward(EpisodeKind::Terminal, 1.0, 0.5).unwrap(), 1.5);
        assert_eq!(step_reward(EpisodeKind::Terminal, 0.0, 0.5).unwrap(), -0.5);
        assert_eq!(step_reward(EpisodeKind::Terminal, 0.5, -1.0).unwrap(), -1.0);
        assert_eq!(step_reward(EpisodeKind::Gui, 1.0, -1.0).unwrap(), 0.0);
        assert_eq!(step_reward(EpisodeKind::Swe, 0.0, -1.0).unwrap(), -2.0);
        assert_eq!(
            step_reward(EpisodeKind::General, 1.0, 1.0 / 3.0).unwrap(),
            1.0 + 1.0 / 3.0
        );
        assert_eq!(step_reward(EpisodeKind::ToolCall, 0.0, -1.0).unwrap(), -1.0);
    }

    #[test]
    fn step_reward_rejects_bad_outcomes() {
        assert!(matches!(
            step_reward(EpisodeKind::Swe, -1.0, 0.0),
            Err(StepwiseError::OutcomeOutOfRange { .. })
        ));
        assert!(matches!(
            step_reward(EpisodeKind::Terminal, 2.0, 0.0),
            Err(StepwiseError::OutcomeOutOfRange { .. })
        ));
        assert!(step_reward(EpisodeKind::General, f64::NAN, 0.0).is_err());
        assert!(step_reward(EpisodeKind::General, 0.0, f64::INFINITY).is_err());
    }

    #[test]
    fn zscore_within_group_and_step_index() {
        // Population standard deviations (divided by n, as the reference computes them):
        // Bucket (g, 0): rewards 1, 3 → mean 2, std 1.
        // Bucket (g, 1): rewards 0, 0, 6 → mean 2, std √8 (Bessel's n − 1 would give √12).
        // Bucket (h, 0): a different group with the same step index is its own bucket.
        let samples = [
            s("g", 0, 1.0),
            s("g", 1, 0.0),
            s("g", 0, 3.0),
            s("g", 1, 0.0),
            s("g", 1, 6.0),
            s("h", 0, 2.0),
            s("h", 0, 4.0),
        ];
        let out = zscore_buckets(&samples).unwrap();
        let one = 1.0 + ZSCORE_EPS;
        let sq8 = 8f64.sqrt() + ZSCORE_EPS;
        let want = [
            (0, -1.0 / one),
            (1, -2.0 / sq8),
            (2, 1.0 / one),
            (3, -2.0 / sq8),
            (4, 4.0 / sq8),
            (5, -1.0 / one),
            (6, 1.0 / one),
        ];
        // Each bucket's advantages: mean 0, population standard deviation 1.
        for bucket in [&[0usize, 2][..], &[1, 3, 4], &[5, 6]] {
            let a: Vec<f64> = bucket.iter().map(|&i| out[i].advantage).collect();
            let n = a.len() as f64;
            let mean = a.iter().sum::<f64>() / n;
            let std = (a.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(
                mean.abs() < 1e-12 && (std - 1.0).abs() < 1e-5,
                "{bucket:?}: {mean} {std}"
            );
        }
        assert_eq!(out.len(), want.len());
        for (got, (i, a)) in out.iter().zip(want) {
            assert_eq!(got.index, i);
            assert!(
                (got.advantage - a).abs() < 1e-12,
                "sample {i}: {} vs {a}",
                got.advantage
            );
        }
    }

    #[test]
    fn single_sample_bucket_keeps_its_raw_value() {
        let out = zscore_buckets(&[s("g", 0, 0.75), s("g", 1, 1.0), s("g", 1, 2.0)]).unwrap();
        assert_eq!(
            out[0],
            ZScored {
                index: 0,
                advantage: 0.75
            }
        );
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn zero_variance_bucket_is_dropped() {
        let out = zscore_buckets(&[
            s("g", 0, 1.0),
            s("g", 0, 1.0),
            s("g", 1, 0.0),
            s("g", 1, 2.0),
        ])
        .unwrap();
        assert_eq!(out.iter().map(|z| z.index).collect::<Vec<_>>(), vec![2, 3]);
    }

    #[test]
    fn all_zero_variance_keeps_at_least_one() {
        let out = zscore_buckets(&[
            s("g", 0, 1.0),
            s("g", 0, 1.0),
            s("h", 2, -1.0),
            s("h", 2, -1.0),
        ])
        .unwrap();
        assert_eq!(
            out,
            vec![ZScored {
                index: 0,
                advantage: 0.0
            }]
        );
        assert_eq!(zscore_buckets(&[]).unwrap(), vec![]);
    }

    #[test]
    fn zscore_rejects_non_finite_rewards() {
        assert!(zscore_buckets(&[s("g", 0, f64::NAN)]).is_err());
    }
}
