//! Parsing a judge's text into a vote and a hint, exactly as docs/design.md §1 says.
//!
//! - A vote is the **last** `\boxed{n}` whose content is exactly one signed ASCII digit
//!   (`1`, `-1`, `+1`, `0`, …). Boxes holding anything else (`\boxed{10}`, `\boxed{ 1 }`,
//!   `\boxed{yes}`, a nested box's outer braces) are not votes and are skipped, so
//!   `\boxed{1} … \boxed{10}` reads as `1`. With no such box the vote fails.
//! - A score outside the prompt's allowed set (e.g. `\boxed{5}`, or `\boxed{0}` for the hint
//!   judge) is a failed vote.
//! - A hint is the text of the last complete `[HINT_START]…[HINT_END]` pair: from the last
//!   `[HINT_START]` that an `[HINT_END]` follows, to the first `[HINT_END]` after it (so an
//!   unterminated trailing `[HINT_START]` is ignored, and a stray extra `[HINT_END]` does not
//!   extend the hint), possibly spanning lines, trimmed; an empty hint is no hint.
//!
//! Both scans are linear in the text length (substring search plus constant work per match).

use thiserror::Error;

const BOX_OPEN: &str = "\\boxed{";
const HINT_START: &str = "[HINT_START]";
const HINT_END: &str = "[HINT_END]";

/// Why a judge's text did not give a vote.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VoteError {
    /// No `\boxed{n}` with `n` one signed digit in the text.
    #[error("no \\boxed{{n}} with n one signed digit")]
    NoBox,
    /// The last valid box holds a score the prompt does not allow.
    #[error("score {score} is not one of the allowed {allowed:?}")]
    NotAllowed {
        /// The parsed score.
        score: i8,
        /// The prompt's allowed scores.
        allowed: Vec<i8>,
    },
}

/// The last `\boxed{n}` in `text` with `n` one signed ASCII digit, if any.
pub fn last_boxed_digit(text: &str) -> Option<i8> {
    let bytes = text.as_bytes();
    let mut found = None;
    for (pos, _) in text.match_indices(BOX_OPEN) {
        let rest = &bytes[pos + BOX_OPEN.len()..];
        let (sign, digits) = match rest.first() {
            Some(b'-') => (-1i8, &rest[1..]),
            Some(b'+') => (1, &rest[1..]),
            _ => (1, rest),
        };
        if let [d @ b'0'..=b'9', b'}', ..] = digits {
            found = Some(sign * (d - b'0') as i8);
        }
    }
    found
}

/// Parses a vote: the last valid box, which must hold one of `allowed`.
pub fn parse_vote(text: &str, allowed: &[i8]) -> Result<i8, VoteError> {
    let score = last_boxed_digit(text).ok_or(VoteError::NoBox)?;
    if allowed.contains(&score) {
        Ok(score)
    } else {
        Err(VoteError::NotAllowed {
            score,
            allowed: allowed.to_vec(),
        })
    }
}

/// Parses the last `[HINT_START]…[HINT_END]` in `text`, trimmed; `None` when there is no
/// complete pair or the hint is empty after trimming.
pub fn parse_hint(text: &str) -> Option<String> {
    // The last start tag that some end tag follows is the last one before the last end tag; its
    // hint runs to the first end tag after it.
    let last_end = text.rfind(HINT_END)?;
    let start = text[..last_end].rfind(HINT_START)? + HINT_START.len();
    let len = text[start..]
        .find(HINT_END)
        .expect("the last end tag follows");
    let hint = text[start..start + len].trim();
    (!hint.is_empty()).then(|| hint.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVAL: &[i8] = &[1, -1, 0];
    const HINT: &[i8] = &[1, -1];

    #[test]
    fn votes_take_the_last_single_digit_box() {
        assert_eq!(parse_vote("reasoning... \\boxed{1}", EVAL), Ok(1));
        assert_eq!(parse_vote("\\boxed{1} then \\boxed{-1}", EVAL), Ok(-1));
        assert_eq!(parse_vote("\\boxed{+1}", EVAL), Ok(1));
        assert_eq!(parse_vote("\\boxed{0}", EVAL), Ok(0));
        assert_eq!(parse_vote("\\boxed{-0}", EVAL), Ok(0));
        // Boxes that do not hold one signed digit are skipped.
        assert_eq!(
            parse_vote("\\boxed{-1} and finally \\boxed{10}", EVAL),
            Ok(-1)
        );
        assert_eq!(parse_vote("\\boxed{\\boxed{1}}", EVAL), Ok(1));
    }

    #[test]
    fn failed_votes() {
        assert_eq!(
            parse_vote("I think it is good", EVAL),
            Err(VoteError::NoBox)
        );
        assert_eq!(parse_vote("\\boxed{10}", EVAL), Err(VoteError::NoBox));
        assert_eq!(parse_vote("\\boxed{ 1 }", EVAL), Err(VoteError::NoBox));
        assert_eq!(parse_vote("\\boxed{1", EVAL), Err(VoteError::NoBox));
        assert_eq!(parse_vote("\\boxed{--1}", EVAL), Err(VoteError::NoBox));
        assert_eq!(parse_vote("\\boxed{١}", EVAL), Err(VoteError::NoBox)); // Arabic-Indic one
        assert_eq!(parse_vote("\\boxed{}", EVAL), Err(VoteError::NoBox));
        assert_eq!(
            parse_vote("\\boxed{5}", EVAL),
            Err(VoteError::NotAllowed {
                score: 5,
                allowed: EVAL.to_vec()
            })
        );
        assert_eq!(
            parse_vote("\\boxed{0}", HINT),
            Err(VoteError::NotAllowed {
                score: 0,
                allowed: HINT.to_vec()
            })
        );
        // The last valid box decides, even if an earlier one was allowed.
        assert!(parse_vote("\\boxed{1} no wait \\boxed{7}", EVAL).is_err());
    }

    #[test]
    fn hints_take_the_last_complete_pair_trimmed() {
        assert_eq!(
            parse_hint("\\boxed{1}\n[HINT_START]\n  Use the flag.\n  Then retry.\n[HINT_END]"),
            Some("Use the flag.\n  Then retry.".into())
        );
        assert_eq!(
            parse_hint("[HINT_START]a[HINT_END] [HINT_START]b[HINT_END]"),
            Some("b".into())
        );
        assert_eq!(
            parse_hint("[HINT_START]a[HINT_END] [HINT_START]unterminated"),
            Some("a".into())
        );
        assert_eq!(
            parse_hint("[HINT_START]a [HINT_START]b[HINT_END]"),
            Some("b".into())
        );
        assert_eq!(parse_hint("[HINT_START]   [HINT_END]"), None);
        assert_eq!(parse_hint("no hint here [HINT_END]"), None);
        assert_eq!(parse_hint("[HINT_START] never closed"), None);
        assert_eq!(
            parse_hint("[HINT_START] 日本語のヒント [HINT_END]"),
            Some("日本語のヒント".into())
        );
    }
}
