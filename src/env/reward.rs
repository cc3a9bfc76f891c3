//! How the pipeline turns the episodes of general-agent environments into step advantages
//! (docs/design.md §1, "General agents: step-wise rewards"): groups of `n` samples per task, each step's
//! PRM votes aggregated and combined with the episode outcome by the kind's formula
//! ([`crate::rl::stepwise::step_reward`]), then z-scored within (group, step index) buckets
//! ([`crate::rl::stepwise::zscore_buckets`]). [`RewardMode::OutcomeOnly`] drops the process
//! score for comparison. Pure functions: no IO, no clock.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::rl::stepwise::{step_reward, zscore_buckets, EpisodeKind, StepSample, StepwiseError};
use crate::rl::vote::{aggregate, Aggregation};

/// Samples per task in a group unless configured otherwise.
pub const DEFAULT_GROUP_SIZE: usize = 8;

/// Which rewards the steps get.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardMode {
    /// Outcome plus each step's process score (the paper's integrated reward).
    #[default]
    Integrated,
    /// The outcome alone at every step (the comparison baseline).
    OutcomeOnly,
}

/// Why rewards could not be computed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RewardError {
    /// An outcome is not a finite value in `[-1, 1]`.
    #[error("episode {episode}: outcome must be a finite value in [-1, 1], got {outcome}")]
    Outcome {
        /// The episode's index in the input.
        episode: usize,
        /// The value.
        outcome: f64,
    },
    /// A group does not hold the expected number of episodes.
    #[error("group `{group}` has {got} episodes, expected {want} (retry the missing ones)")]
    IncompleteGroup {
        /// The group.
        group: String,
        /// How many it has.
        got: usize,
        /// How many it should have.
        want: usize,
    },
    /// The group size is zero.
    #[error("the group size must be at least 1")]
    GroupSize,
    /// The step-wise arithmetic refused a value.
    #[error(transparent)]
    Stepwise(#[from] StepwiseError),
}

/// One finished episode as the reward computation sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoredEpisode {
    /// The group it belongs to (the samples of one task in one round).
    pub group: String,
    /// Its outcome as the environment reported it: `+1` success, `-1` failure (or a score in
    /// `[-1, 1]`).
    pub outcome: f64,
    /// The PRM votes of each step, in step order (`None`: a failed vote). A step without votes
    /// (no next state) has process score 0.
    pub step_votes: Vec<Vec<Option<i8>>>,
}

/// The advantage of one step of one episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepAdvantage {
    /// The episode's index in the input.
    pub episode: usize,
    /// The step index within the episode.
    pub step: u32,
    /// The step's reward before normalisation.
    pub reward: f64,
    /// Its advantage after z-scoring in its (group, step index) bucket.
    pub advantage: f64,
}

/// One episode of a group plan: which task to start, with which seed, in which group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    /// The task index.
    pub task: usize,
    /// The sample's index within its group (`0..n`).
    pub sample: usize,
    /// The seed to start the episode with.
    pub seed: u64,
    /// The group id.
    pub group: String,
}

/// The step rewards of one episode with outcome `outcome` (in `[-1, 1]`).
///
/// Terminal, GUI and SWE take the outcome as `o = (outcome + 1) / 2` in `[0, 1]`, so their
/// formula `(2o − 1) + prm` gives `outcome + prm`; tool-call and general agents use `outcome + prm`
/// directly. `prm` is the step's votes aggregated by `aggregation` (majority or mean). In
/// [`RewardMode::OutcomeOnly`] `prm` is 0 at every step.
pub fn episode_step_rewards(
    kind: EpisodeKind,
    mode: RewardMode,
    aggregation: Aggregation,
    outcome: f64,
    step_votes: &[Vec<Option<i8>>],
) -> Result<Vec<f64>, RewardError> {
    if !outcome.is_finite() || !(-1.0..=1.0).contains(&outcome) {
        return Err(RewardError::Outcome {
            episode: 0,
            outcome,
        });
    }
    let o = match kind {
        EpisodeKind::Terminal | EpisodeKind::Gui | EpisodeKind::Swe => (outcome + 1.0) / 2.0,
        EpisodeKind::ToolCall | EpisodeKind::General => outcome,
    };
    step_votes
        .iter()
        .map(|votes| {
            let prm = match mode {
                RewardMode::Integrated => aggregate(votes, aggregation),
                RewardMode::OutcomeOnly => 0.0,
            };
            Ok(step_reward(kind, o, prm)?)
        })
        .collect()
}

/// Every step's advantage: rewards by [`episode_step_rewards`], z-scored within (group, step
/// index) buckets by [`zscore_buckets`] (zero-variance buckets dropped, keeping at least one;
/// single-sample buckets keep their raw reward). Output is in (episode, step) order and leaves
/// out dropped steps.
pub fn group_advantages(
    kind: EpisodeKind,
    mode: RewardMode,
    aggregation: Aggregation,
    episodes: &[ScoredEpisode],
) -> Result<Vec<StepAdvantage>, RewardError> {
    let mut samples = Vec::new();
    let mut origin = Vec::new();
    for (e, ep) in episodes.iter().enumerate() {
        let rewards = episode_step_rewards(kind, mode, aggregation, ep.outcome, &ep.step_votes)
            .map_err(|err| match err {
                RewardError::Outcome { outcome, .. } => RewardError::Outcome {
                    episode: e,
                    outcome,
                },
                other => other,
            })?;
        for (s, r) in rewards.into_iter().enumerate() {
            samples.push(StepSample {
                group: ep.group.clone(),
                step: s as u32,
                reward: r,
            });
            origin.push((e, s as u32));
        }
    }
    let scored = zscore_buckets(&samples)?;
    Ok(scored
        .into_iter()
        .map(|z| StepAdvantage {
            episode: origin[z.index].0,
            step: origin[z.index].1,
            reward: samples[z.index].reward,
            advantage: z.advantage,
        })
        .collect())
}

/// Checks that every group holds exactly `n` episodes, so that no partial group is normalised
/// (a failed episode is retried into its group first).
pub fn check_groups(episodes: &[ScoredEpisode], n: usize) -> Result<(), RewardError> {
    if n == 0 {
        return Err(RewardError::GroupSize);
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in episodes {
        *counts.entry(e.group.as_str()).or_default() += 1;
    }
    match counts.into_iter().find(|(_, c)| *c != n) {
        Some((g, c)) => Err(RewardError::IncompleteGroup {
            group: g.to_string(),
            got: c,
            want: n,
        }),
        None => Ok(()),
    }
}

/// The episodes of round `round` over `tasks` tasks with `n` samples each: group
/// `r{round}-t{task}`, distinct reproducible seeds. A retry of a member uses
/// [`retry_seed`] and keeps its group.
pub fn group_plan(tasks: usize, n: usize, round: u64) -> Result<Vec<GroupMember>, RewardError> {
    if n == 0 {
        return Err(RewardError::GroupSize);
    }
    let mut out = Vec::with_capacity(tasks * n);
    for task in 0..tasks {
        for sample in 0..n {
            out.push(GroupMember {
                task,
                sample,
                seed: mix(round, task as u64, sample as u64, 0),
                group: format!("r{round}-t{task}"),
            });
        }
    }
    Ok(out)
}

/// The seed of retry number `attempt` (1, 2, ...) of a member.
pub fn retry_seed(member: &GroupMember, round: u64, attempt: u32) -> u64 {
    mix(
        round,
        member.task as u64,
        member.sample as u64,
        attempt as u64,
    )
}

fn mix(a: u64, b: u64, c: u64, d: u64) -> u64 {
    // splitmix64 over the four inputs in turn.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for v in [a, b, c, d] {
        x = x.wrapping_add(v).wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x = z ^ (z >> 31);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::stepwise::ZSCORE_EPS;

    fn ep(group: &str, outcome: f64, votes: &[&[i8]]) -> ScoredEpisode {
        ScoredEpisode {
            group: group.into(),
            outcome,
            step_votes: votes
                .iter()
                .map(|v| v.iter().map(|x| Some(*x)).collect())
                .collect(),
        }
    }

    #[test]
    fn step_rewards_follow_the_kind_formula() {
        let votes = vec![
            vec![Some(1), Some(1), Some(-1)],
            vec![Some(-1), None, Some(-1)],
            vec![],
        ];
        let r = episode_step_rewards(
            EpisodeKind::Terminal,
            RewardMode::Integrated,
            Aggregation::Majority,
            1.0,
            &votes,
        )
        .unwrap();
        assert_eq!(r, vec![2.0, 0.0, 1.0]);
        let r = episode_step_rewards(
            EpisodeKind::Swe,
            RewardMode::Integrated,
            Aggregation::Mean,
            -1.0,
            &votes,
        )
        .unwrap();
        assert!((r[0] - (-1.0 + 1.0 / 3.0)).abs() < 1e-12);
        assert_eq!(&r[1..], &[-2.0, -1.0]);
        let r = episode_step_rewards(
            EpisodeKind::ToolCall,
            RewardMode::Integrated,
            Aggregation::Mean,
            -1.0,
            &votes,
        )
        .unwrap();
        assert!((r[0] - (-1.0 + 1.0 / 3.0)).abs() < 1e-12);
        let r = episode_step_rewards(
            EpisodeKind::Terminal,
            RewardMode::OutcomeOnly,
            Aggregation::Majority,
            -1.0,
            &votes,
        )
        .unwrap();
        assert_eq!(r, vec![-1.0, -1.0, -1.0]);
        assert!(matches!(
            episode_step_rewards(
                EpisodeKind::Terminal,
                RewardMode::Integrated,
                Aggregation::Majority,
                2.0,
                &votes
            ),
            Err(RewardError::Outcome { .. })
        ));
        assert!(episode_step_rewards(
            EpisodeKind::General,
            RewardMode::Integrated,
            Aggregation::Majority,
            f64::NAN,
            &votes
        )
        .is_err());
    }

    #[test]
    fn advantages_are_normalised_per_group_and_step_index() {
        // Group g: two episodes, outcomes +1 and -1.
        //   step 0 votes: +1 / +1   → rewards 2, 0   → population std 1, z = ±1/(1+eps)
        //   step 1 votes: -1 / +1   → rewards 0, 0   → zero variance, dropped
        //   step 2: only the first episode has it → keeps its raw reward 1 (no votes)
        // Group h: one episode, one step → raw reward.
        let eps = [
            ep("g", 1.0, &[&[1], &[-1], &[]]),
            ep("g", -1.0, &[&[1], &[1]]),
            ep("h", -1.0, &[&[0]]),
        ];
        let a = group_advantages(
            EpisodeKind::Terminal,
            RewardMode::Integrated,
            Aggregation::Majority,
            &eps,
        )
        .unwrap();
        let s = 1.0 + ZSCORE_EPS;
        let got: Vec<(usize, u32, f64, f64)> = a
            .iter()
            .map(|x| (x.episode, x.step, x.reward, x.advantage))
            .collect();
        assert_eq!(got.len(), 4);
        assert_eq!((got[0].0, got[0].1, got[0].2), (0, 0, 2.0));
        assert!((got[0].3 - 1.0 / s).abs() < 1e-12);
        assert_eq!((got[1].0, got[1].1, got[1].2, got[1].3), (0, 2, 1.0, 1.0));
        assert_eq!((got[2].0, got[2].1, got[2].2), (1, 0, 0.0));
        assert!((got[2].3 + 1.0 / s).abs() < 1e-12);
        assert_eq!((got[3].0, got[3].1, got[3].2, got[3].3), (2, 0, -1.0, -1.0));
    }

    #[test]
    fn outcome_only_ignores_votes() {
        let eps = [ep("g", 1.0, &[&[-1], &[-1]]), ep("g", -1.0, &[&[1], &[1]])];
        let a = group_advantages(
            EpisodeKind::Swe,
            RewardMode::OutcomeOnly,
            Aggregation::Majority,
            &eps,
        )
        .unwrap();
        assert_eq!(a.len(), 4);
        for x in &a {
            let sign = if x.episode == 0 { 1.0 } else { -1.0 };
            assert_eq!(x.reward, sign);
            assert!(x.advantage * sign > 0.0);
        }
        // The integrated reward of the same episodes ties them at every step: +1 outcome with
        // -1 votes (0) against -1 outcome with +1 votes (0); every bucket is dropped but one
        // sample is kept, with advantage 0.
        let b = group_advantages(
            EpisodeKind::Swe,
            RewardMode::Integrated,
            Aggregation::Majority,
            &eps,
        )
        .unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].advantage, 0.0);
    }

    #[test]
    fn bad_outcomes_name_the_episode() {
        let eps = [ep("g", 1.0, &[&[1]]), ep("g", 3.0, &[&[1]])];
        assert_eq!(
            group_advantages(
                EpisodeKind::General,
                RewardMode::Integrated,
                Aggregation::Mean,
                &eps
            ),
            Err(RewardError::Outcome {
                episode: 1,
                outcome: 3.0
            })
        );
    }

    #[test]
    fn groups_must_be_whole() {
        let eps = [ep("a", 1.0, &[]), ep("a", 1.0, &[]), ep("b", 1.0, &[])];
        assert_eq!(
            check_groups(&eps, 2),
            Err(RewardError::IncompleteGroup {
                group: "b".into(),
                got: 1,
                want: 2
            })
        );
        assert!(check_groups(&eps[..2], 2).is_ok());
        assert_eq!(check_groups(&eps, 0), Err(RewardError::GroupSize));
    }

    #[test]
    fn group_plan_has_n_members_per_task_with_distinct_seeds() {
        let plan = group_plan(3, DEFAULT_GROUP_SIZE, 5).unwrap();
        assert_eq!(plan.len(), 24);
        assert!(plan.iter().filter(|m| m.group == "r5-t1").count() == 8);
        let seeds: std::collections::HashSet<u64> = plan.iter().map(|m| m.seed).collect();
        assert_eq!(seeds.len(), 24);
        assert_eq!(plan, group_plan(3, 8, 5).unwrap());
        assert_ne!(plan[0].seed, group_plan(3, 8, 6).unwrap()[0].seed);
        assert_ne!(retry_seed(&plan[0], 5, 1), plan[0].seed);
        assert_ne!(retry_seed(&plan[0], 5, 1), retry_seed(&plan[0], 5, 2));
        assert!(group_plan(1, 0, 0).is_err());
    }
}
