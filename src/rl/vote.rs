//! Aggregating judge votes into one score, and choosing the hindsight hint among hint votes.
//!
//! A vote is `Some(score)` when the judge's text held a valid `\boxed{n}` (see `judge::parse`)
//! and `None` when it failed (no box, garbage, a score outside the prompt's set, a backend error
//! or a timeout). Failed votes are ignored by every aggregation here.

use serde::{Deserialize, Serialize};

/// A hint must be longer than this many characters (Unicode scalar values, after trimming) to be
/// accepted (docs/design.md §1: "trimmed hint longer than 10 characters").
pub const MIN_HINT_CHARS: usize = 10;

/// How the `m` votes of one setting are reduced to one score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// The most frequent valid score; a tie for the top count or no valid vote gives 0.
    #[default]
    Majority,
    /// The arithmetic mean of the valid scores; no valid vote gives 0.
    Mean,
}

/// The majority of the valid votes (docs/design.md §1).
///
/// The score with the strictly highest count wins. A tie between the top counts (for example
/// `[1, -1]` or `[1, -1, 0]`) gives `0`, and so does a list with no valid vote. Failed votes
/// (`None`) do not count at all: `[Some(1), None, None]` gives `1`.
pub fn majority_vote(votes: &[Option<i8>]) -> i8 {
    // Scores are single signed digits, so a fixed table indexed by score + 9 covers them all;
    // anything outside -9..=9 cannot come from the parser and is ignored like a failed vote.
    let mut counts = [0usize; 19];
    for v in votes.iter().flatten() {
        if (-9..=9).contains(v) {
            counts[(*v + 9) as usize] += 1;
        }
    }
    let best = counts.iter().copied().max().unwrap_or(0);
    if best == 0 {
        return 0;
    }
    let mut winners = counts.iter().enumerate().filter(|(_, c)| **c == best);
    let (idx, _) = winners.next().expect("best > 0 has a holder");
    if winners.next().is_some() {
        0
    } else {
        idx as i8 - 9
    }
}

/// The mean of the valid votes; `0.0` when no vote is valid.
pub fn mean_vote(votes: &[Option<i8>]) -> f64 {
    let (sum, n) = votes
        .iter()
        .flatten()
        .fold((0i64, 0usize), |(s, n), v| (s + *v as i64, n + 1));
    if n == 0 {
        0.0
    } else {
        sum as f64 / n as f64
    }
}

/// Aggregates votes by the given rule; majority results are returned as `f64` too.
pub fn aggregate(votes: &[Option<i8>], how: Aggregation) -> f64 {
    match how {
        Aggregation::Majority => majority_vote(votes) as f64,
        Aggregation::Mean => mean_vote(votes),
    }
}

/// Chooses the hindsight hint among the hint judge's votes (docs/design.md §1).
///
/// Keeps the votes that say `1` and whose trimmed hint is longer than [`MIN_HINT_CHARS`]
/// characters (counted as Unicode scalar values, so a non-ASCII hint is not favoured by its
/// byte length), then takes the longest. Ties in length go to the earliest vote, so the choice is
/// deterministic for a given vote order. `None` means the turn gives no OPD sample.
pub fn select_hint<'a, I>(votes: I) -> Option<String>
where
    I: IntoIterator<Item = (Option<i8>, Option<&'a str>)>,
{
    let mut best: Option<(usize, &str)> = None;
    for (score, hint) in votes {
        let (Some(1), Some(hint)) = (score, hint) else {
            continue;
        };
        let hint = hint.trim();
        let len = hint.chars().count();
        if len <= MIN_HINT_CHARS {
            continue;
        }
        if best.is_none_or(|(l, _)| len > l) {
            best = Some((len, hint));
        }
    }
    best.map(|(_, h)| h.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn majority_picks_the_most_frequent_valid_score() {
        assert_eq!(majority_vote(&[Some(1), Some(1), Some(-1)]), 1);
        assert_eq!(majority_vote(&[Some(-1), Some(-1), Some(1)]), -1);
        assert_eq!(majority_vote(&[Some(0), Some(0), Some(1)]), 0);
        assert_eq!(
            majority_vote(&[Some(-1), Some(0), Some(-1), Some(1), None]),
            -1
        );
    }

    #[test]
    fn majority_tie_gives_zero() {
        assert_eq!(majority_vote(&[Some(1), Some(-1)]), 0);
        assert_eq!(majority_vote(&[Some(1), Some(-1), Some(0)]), 0);
        assert_eq!(
            majority_vote(&[Some(1), Some(1), Some(-1), Some(-1), Some(0)]),
            0
        );
    }

    #[test]
    fn majority_ignores_failed_votes() {
        assert_eq!(majority_vote(&[Some(1), None, None]), 1);
        assert_eq!(majority_vote(&[None, Some(-1), None]), -1);
    }

    #[test]
    fn majority_with_no_valid_vote_gives_zero() {
        assert_eq!(majority_vote(&[None, None, None]), 0);
        assert_eq!(majority_vote(&[]), 0);
    }

    #[test]
    fn mean_of_valid_votes() {
        assert_eq!(mean_vote(&[Some(1), Some(1), Some(-1)]), 1.0 / 3.0);
        assert_eq!(mean_vote(&[Some(1), None, Some(0)]), 0.5);
        assert_eq!(mean_vote(&[None, None]), 0.0);
        assert_eq!(aggregate(&[Some(1), Some(-1)], Aggregation::Mean), 0.0);
        assert_eq!(
            aggregate(&[Some(1), Some(1), Some(-1)], Aggregation::Majority),
            1.0
        );
    }

    #[test]
    fn hint_selection_keeps_positive_long_hints_and_takes_the_longest() {
        let votes = [
            (Some(1), Some("  short one  ")), // trimmed 9 chars: too short
            (Some(1), Some("use the --force flag")), // 20 chars
            (Some(-1), Some("a much longer hint that says no")), // vote -1: ignored
            (Some(1), Some("  check the path first, please  ")), // 28 chars: longest
            (None, Some("failed vote with an even longer hint text")),
        ];
        assert_eq!(
            select_hint(votes),
            Some("check the path first, please".to_string())
        );
    }

    #[test]
    fn hint_of_exactly_ten_chars_is_rejected_eleven_accepted() {
        assert_eq!(select_hint([(Some(1), Some("0123456789"))]), None);
        assert_eq!(
            select_hint([(Some(1), Some(" 0123456789a "))]),
            Some("0123456789a".into())
        );
        // Counted in characters, not bytes: ten 2-byte characters are still ten.
        assert_eq!(select_hint([(Some(1), Some("éééééééééé"))]), None);
    }

    #[test]
    fn hint_none_when_no_vote_qualifies_and_ties_go_to_the_first() {
        assert_eq!(
            select_hint([(Some(1), None), (Some(-1), Some("x".repeat(50).as_str()))]),
            None
        );
        assert_eq!(select_hint(Vec::<(Option<i8>, Option<&str>)>::new()), None);
        assert_eq!(
            select_hint([
                (Some(1), Some("first hint!!")),
                (Some(1), Some("other hint!!"))
            ]),
            Some("first hint!!".into())
        );
    }
}
