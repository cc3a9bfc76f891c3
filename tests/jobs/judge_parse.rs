//! Property tests of the judge's vote and hint parsing against adversarial outputs: several boxes,
//! `\boxed{10}`, nested braces, missing end tags, unicode, and 1 MB of text. The parser is checked
//! against independent regex oracles that state docs/design.md §1's rules directly.

use clawrl::judge::{last_boxed_digit, parse_hint, parse_vote, VoteError};
use proptest::prelude::*;
use regex::Regex;

/// Oracle: the last `\boxed{n}` with `n` one signed ASCII digit.
fn oracle_vote(text: &str) -> Option<i8> {
    let re = Regex::new(r"\\boxed\{([+-]?)([0-9])\}").unwrap();
    re.captures_iter(text).last().map(|c| {
        let d = c[2].parse::<i8>().unwrap();
        if &c[1] == "-" {
            -d
        } else {
            d
        }
    })
}

/// Oracle: the last complete hint pair (greedy prefix puts the start tag as far right as an end
/// tag allows; the lazy body stops at the first end tag after it), trimmed, non-empty.
fn oracle_hint(text: &str) -> Option<String> {
    let re = Regex::new(r"(?s)^.*\[HINT_START\](.*?)\[HINT_END\]").unwrap();
    re.captures(text)
        .map(|c| c[1].trim().to_string())
        .filter(|h| !h.is_empty())
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\\boxed{".to_string()),
        Just("\\boxed{1}".to_string()),
        Just("\\boxed{-1}".to_string()),
        Just("\\boxed{+1}".to_string()),
        Just("\\boxed{0}".to_string()),
        Just("\\boxed{7}".to_string()),
        Just("\\boxed{10}".to_string()),
        Just("\\boxed{-}".to_string()),
        Just("\\boxed{ 1 }".to_string()),
        Just("\\boxed{{1}}".to_string()),
        Just("\\boxed{\\boxed{-1}}".to_string()),
        Just("\\boxed".to_string()),
        Just("boxed{1}".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("-".to_string()),
        Just("1".to_string()),
        Just("[HINT_START]".to_string()),
        Just("[HINT_END]".to_string()),
        Just("[HINT_START".to_string()),
        Just("\n".to_string()),
        Just("  ".to_string()),
        Just("é日本語🙂".to_string()),
        Just("\\boxed{١}".to_string()),
        "[a-z ]{0,12}".prop_map(|s| s),
        any::<String>().prop_map(|s| s.chars().take(8).collect()),
    ]
}

fn adversarial() -> impl Strategy<Value = String> {
    prop::collection::vec(piece(), 0..40).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn vote_matches_the_oracle(text in adversarial()) {
        prop_assert_eq!(last_boxed_digit(&text), oracle_vote(&text));
        let allowed = [1i8, -1, 0];
        match oracle_vote(&text) {
            None => prop_assert_eq!(parse_vote(&text, &allowed), Err(VoteError::NoBox)),
            Some(s) if allowed.contains(&s) => prop_assert_eq!(parse_vote(&text, &allowed), Ok(s)),
            Some(s) => prop_assert_eq!(
                parse_vote(&text, &allowed),
                Err(VoteError::NotAllowed { score: s, allowed: allowed.to_vec() })
            ),
        }
    }

    #[test]
    fn hint_matches_the_oracle(text in adversarial()) {
        prop_assert_eq!(parse_hint(&text), oracle_hint(&text));
    }

    #[test]
    fn a_final_valid_box_always_wins(prefix in adversarial(), d in -9i8..=9, tail in "[^\\\\]{0,40}") {
        let text = format!("{prefix}\\boxed{{{d}}}{tail}");
        prop_assert_eq!(last_boxed_digit(&text), Some(d));
    }

    #[test]
    fn a_final_hint_pair_always_wins(prefix in adversarial(), hint in "[a-zA-Z0-9 .,é\n]{0,60}", tail in "[a-z \n]{0,20}") {
        let text = format!("{prefix}[HINT_START]{hint}[HINT_END]{tail}");
        let want = Some(hint.trim().to_string()).filter(|h| !h.is_empty());
        prop_assert_eq!(parse_hint(&text), want);
    }
}

#[test]
fn megabyte_outputs_parse_in_linear_time() {
    // Pathological for a naive "for each open tag, scan to the end" parser: ~150k open boxes and
    // ~87k hint start tags with no closing tags, then one valid answer at the very end.
    let mut text = "\\boxed{".repeat(150_000);
    text.push_str(&"[HINT_START]".repeat(87_000));
    text.push_str("\\boxed{-1} [HINT_START] a hint at the end [HINT_END]");
    assert!(text.len() > 2_000_000);
    assert_eq!(parse_vote(&text, &[1, -1, 0]), Ok(-1));
    assert_eq!(parse_hint(&text).as_deref(), Some("a hint at the end"));

    // 1 MB of unicode prose with boxes of every kind sprinkled through it.
    let chunk = "Le juge dit 日本語 🙂 \\boxed{10} \\boxed{{1}} [HINT_END] \\boxed{1} ";
    let big = chunk.repeat(1_000_000 / chunk.len() + 1);
    assert!(big.len() >= 1_000_000);
    assert_eq!(parse_vote(&big, &[1, -1, 0]), Ok(1));
    assert_eq!(parse_hint(&big), None);

    // A megabyte with no box at all is a failed vote.
    let plain = "x".repeat(1 << 20);
    assert_eq!(parse_vote(&plain, &[1, -1]), Err(VoteError::NoBox));
}
