//! Per-token advantages: binary RL (evaluative), OPD (directive) and their combination.
//!
//! Binary RL gives every response token of a turn the turn's scalar reward, after the exclusion
//! rules of docs/design.md §1 pick which turns train. OPD gives token `k` the log-probability gap
//! `teacher_k − old_k`. The combination `A_k = w_binary·r + w_opd·(teacher_k − old_k)` follows the
//! four-case dispatch of docs/design.md §1.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors building advantages from per-token log-probabilities.
#[derive(Debug, Error, PartialEq)]
pub enum AdvantageError {
    /// The teacher and old log-prob lists do not cover the same response tokens.
    #[error("OPD log-probs disagree in length: teacher has {teacher} tokens, old has {old}")]
    LengthMismatch {
        /// Teacher log-prob count.
        teacher: usize,
        /// Old-policy log-prob count.
        old: usize,
    },
    /// A log-prob is NaN or infinite.
    #[error("non-finite {which} log-prob {value} at token {index}")]
    NonFinite {
        /// `"teacher"` or `"old"`.
        which: &'static str,
        /// Token index.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// A weight is NaN or infinite.
    #[error("advantage weight {name} = {value} is not finite")]
    BadWeight {
        /// `"w_binary"` or `"w_opd"`.
        name: &'static str,
        /// The offending value.
        value: f32,
    },
    /// A reward outside `{-1, 0, 1}` was given to the binary term.
    #[error("binary reward {0} is not one of -1, 0, 1")]
    BadReward(i8),
}

/// One main-line turn as the binary-RL selection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryTurn {
    /// The session the turn belongs to.
    pub session_id: String,
    /// The turn's index within its session (order of "first").
    pub turn: u64,
    /// Whether the turn got a next state (and so could be judged).
    pub has_next_state: bool,
    /// The majority-vote reward, `-1`, `0` or `1` (`0` when unjudged).
    pub reward: i8,
}

/// A turn selected for binary RL.
#[derive(Debug, Clone, PartialEq)]
pub struct BinarySample {
    /// Index of the turn in the input slice.
    pub index: usize,
    /// The scalar advantage shared by every response token: the reward.
    pub advantage: f32,
    /// True when the turn is kept only by the "at least one" rule.
    pub at_least_one: bool,
}

/// Selects the turns that train under binary RL (docs/design.md §1).
///
/// A turn without a next state, or with reward `0`, is excluded. "At least one": when a session
/// has no usable turn (next state and reward ±1), its first turn with a next state (lowest
/// `turn`; the earliest in the input on equal `turn`) is kept anyway with its reward (`0`, so it
/// adds no policy gradient but keeps the session represented, e.g. in the KL term). A session with
/// no turn that has a next state contributes nothing. Output is in input order.
pub fn binary_samples(turns: &[BinaryTurn]) -> Vec<BinarySample> {
    let usable = |t: &BinaryTurn| t.has_next_state && t.reward != 0;
    let mut session_has_usable: HashMap<&str, bool> = HashMap::new();
    let mut first_with_next: HashMap<&str, usize> = HashMap::new();
    for (i, t) in turns.iter().enumerate() {
        *session_has_usable.entry(&t.session_id).or_default() |= usable(t);
        if t.has_next_state {
            first_with_next
                .entry(&t.session_id)
                .and_modify(|j| {
                    if t.turn < turns[*j].turn {
                        *j = i;
                    }
                })
                .or_insert(i);
        }
    }
    turns
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            if usable(t) {
                Some(BinarySample {
                    index: i,
                    advantage: t.reward as f32,
                    at_least_one: false,
                })
            } else if !session_has_usable[t.session_id.as_str()]
                && first_with_next.get(t.session_id.as_str()) == Some(&i)
            {
                Some(BinarySample {
                    index: i,
                    advantage: t.reward as f32,
                    at_least_one: true,
                })
            } else {
                None
            }
        })
        .collect()
}

/// OPD per-token advantages: `teacher_k − old_k` (docs/design.md §1).
///
/// `teacher` are the teacher's log-probs of the original response tokens under `s_enhanced`,
/// `old` the old policy's log-probs of the same tokens under `s_t`.
pub fn opd_advantages(teacher: &[f32], old: &[f32]) -> Result<Vec<f32>, AdvantageError> {
    if teacher.len() != old.len() {
        return Err(AdvantageError::LengthMismatch {
            teacher: teacher.len(),
            old: old.len(),
        });
    }
    check_finite("teacher", teacher)?;
    check_finite("old", old)?;
    Ok(teacher.iter().zip(old).map(|(t, o)| t - o).collect())
}

fn check_finite(which: &'static str, xs: &[f32]) -> Result<(), AdvantageError> {
    match xs.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(AdvantageError::NonFinite {
            which,
            index,
            value: xs[index],
        }),
        None => Ok(()),
    }
}

/// The weights of the two terms of the combined advantage; both default to 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdvantageWeights {
    /// Weight of the binary (evaluative) term.
    pub w_binary: f32,
    /// Weight of the OPD (directive) term.
    pub w_opd: f32,
}

impl Default for AdvantageWeights {
    fn default() -> Self {
        Self {
            w_binary: 1.0,
            w_opd: 1.0,
        }
    }
}

/// Which of the four cases of docs/design.md §1 a turn falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CombineCase {
    /// Hint accepted and reward ±1: one sample with both terms.
    Both,
    /// Hint accepted and reward 0: the OPD term only.
    OpdOnly,
    /// No hint and reward ±1: the binary term only.
    BinaryOnly,
    /// Neither: no sample.
    Neither,
}

impl CombineCase {
    /// The case for a turn with this reward and hint decision.
    pub fn of(reward: i8, hint_accepted: bool) -> Self {
        match (hint_accepted, reward != 0) {
            (true, true) => Self::Both,
            (true, false) => Self::OpdOnly,
            (false, true) => Self::BinaryOnly,
            (false, false) => Self::Neither,
        }
    }
}

/// A combined training sample's per-token advantages.
#[derive(Debug, Clone, PartialEq)]
pub struct CombinedSample {
    /// Which case produced it (never [`CombineCase::Neither`]).
    pub case: CombineCase,
    /// One advantage per response token.
    pub advantages: Vec<f32>,
}

/// The combined advantage of one turn, `A_k = w_binary·r + w_opd·(teacher_k − old_k)`, by the
/// four-case dispatch of docs/design.md §1.
///
/// `reward` is the majority-vote reward (`0` for a turn without a next state). `opd` is
/// `Some((teacher, old))` when a hint was accepted and the teacher scored the response, `None`
/// otherwise. `response_len` sizes the binary-only case. Returns `Ok(None)` in the "neither" case.
///
/// Decision: the "at least one" rule belongs to binary-only selection ([`binary_samples`]); in
/// combined mode the four cases are applied as written, so a turn with reward 0 and no hint never
/// yields a sample.
pub fn combine(
    weights: AdvantageWeights,
    reward: i8,
    opd: Option<(&[f32], &[f32])>,
    response_len: usize,
) -> Result<Option<CombinedSample>, AdvantageError> {
    if !weights.w_binary.is_finite() {
        return Err(AdvantageError::BadWeight {
            name: "w_binary",
            value: weights.w_binary,
        });
    }
    if !weights.w_opd.is_finite() {
        return Err(AdvantageError::BadWeight {
            name: "w_opd",
            value: weights.w_opd,
        });
    }
    if !(-1..=1).contains(&reward) {
        return Err(AdvantageError::BadReward(reward));
    }
    let case = CombineCase::of(reward, opd.is_some());
    let binary = weights.w_binary * reward as f32;
    let advantages = match (case, opd) {
        (CombineCase::Neither, _) => return Ok(None),
        (CombineCase::BinaryOnly, _) => vec![binary; response_len],
        (CombineCase::OpdOnly, Some((t, o))) => opd_advantages(t, o)?
            .into_iter()
            .map(|d| weights.w_opd * d)
            .collect(),
        (CombineCase::Both, Some((t, o))) => opd_advantages(t, o)?
            .into_iter()
            .map(|d| binary + weights.w_opd * d)
            .collect(),
        (CombineCase::OpdOnly | CombineCase::Both, None) => unreachable!("case has a hint"),
    };
    Ok(Some(CombinedSample { case, advantages }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(s: &str, turn: u64, next: bool, reward: i8) -> BinaryTurn {
        BinaryTurn {
            session_id: s.into(),
            turn,
            has_next_state: next,
            reward,
        }
    }

    #[test]
    fn binary_excludes_turns_without_next_state_or_with_zero_reward() {
        let turns = [
            turn("a", 0, true, 1),
            turn("a", 1, true, 0), // reward 0: excluded (session has usable turns)
            turn("a", 2, false, 0), // no next state: excluded
            turn("a", 3, true, -1),
        ];
        let got = binary_samples(&turns);
        assert_eq!(
            got,
            vec![
                BinarySample {
                    index: 0,
                    advantage: 1.0,
                    at_least_one: false
                },
                BinarySample {
                    index: 3,
                    advantage: -1.0,
                    at_least_one: false
                },
            ]
        );
    }

    #[test]
    fn binary_at_least_one_keeps_the_first_turn_with_a_next_state() {
        // Session b: no usable turn; its first turn with a next state is turn 1 (turn 0 has none),
        // given out of order in the input.
        let turns = [
            turn("b", 2, true, 0),
            turn("b", 0, false, 0),
            turn("b", 1, true, 0),
            turn("c", 0, false, 0), // session c has no next state at all: nothing
            turn("d", 0, true, 1),
        ];
        let got = binary_samples(&turns);
        assert_eq!(
            got,
            vec![
                BinarySample {
                    index: 2,
                    advantage: 0.0,
                    at_least_one: true
                },
                BinarySample {
                    index: 4,
                    advantage: 1.0,
                    at_least_one: false
                },
            ]
        );
    }

    #[test]
    fn opd_advantage_is_teacher_minus_old() {
        let a = opd_advantages(&[-1.0, -0.5, -2.0], &[-1.5, -0.5, -1.0]).unwrap();
        assert_eq!(a, vec![0.5, 0.0, -1.0]);
        assert_eq!(
            opd_advantages(&[-1.0], &[-1.0, -2.0]),
            Err(AdvantageError::LengthMismatch { teacher: 1, old: 2 })
        );
        assert!(matches!(
            opd_advantages(&[-1.0, f32::NAN], &[-1.0, -2.0]),
            Err(AdvantageError::NonFinite {
                which: "teacher",
                index: 1,
                ..
            })
        ));
    }

    #[test]
    fn combine_four_cases() {
        let w = AdvantageWeights {
            w_binary: 2.0,
            w_opd: 0.5,
        };
        let t = [-1.0f32, -3.0];
        let o = [-2.0f32, -2.0];
        // Hint accepted, reward +1: both terms.
        let s = combine(w, 1, Some((&t, &o)), 2).unwrap().unwrap();
        assert_eq!(s.case, CombineCase::Both);
        assert_eq!(s.advantages, vec![2.0 + 0.5, 2.0 - 0.5]);
        // Hint accepted, reward -1: both terms.
        let s = combine(w, -1, Some((&t, &o)), 2).unwrap().unwrap();
        assert_eq!(s.advantages, vec![-2.0 + 0.5, -2.0 - 0.5]);
        // Hint accepted, reward 0: OPD only.
        let s = combine(w, 0, Some((&t, &o)), 2).unwrap().unwrap();
        assert_eq!(s.case, CombineCase::OpdOnly);
        assert_eq!(s.advantages, vec![0.5, -0.5]);
        // No hint, reward -1: binary only, one value per response token.
        let s = combine(w, -1, None, 3).unwrap().unwrap();
        assert_eq!(s.case, CombineCase::BinaryOnly);
        assert_eq!(s.advantages, vec![-2.0; 3]);
        // Neither: no sample.
        assert_eq!(combine(w, 0, None, 3).unwrap(), None);
    }

    #[test]
    fn combine_defaults_and_bad_input() {
        let d = AdvantageWeights::default();
        assert_eq!((d.w_binary, d.w_opd), (1.0, 1.0));
        let s = combine(d, 1, Some((&[-1.0], &[-1.25])), 1)
            .unwrap()
            .unwrap();
        assert_eq!(s.advantages, vec![1.25]);
        assert_eq!(combine(d, 2, None, 1), Err(AdvantageError::BadReward(2)));
        let bad = AdvantageWeights {
            w_binary: f32::INFINITY,
            w_opd: 1.0,
        };
        assert!(matches!(
            combine(bad, 1, None, 1),
            Err(AdvantageError::BadWeight { .. })
        ));
        assert!(matches!(
            combine(d, 1, Some((&[-1.0], &[])), 1),
            Err(AdvantageError::LengthMismatch { .. })
        ));
    }
}
