//! The warm start's transcripts: how a solver of a task behaves, drawn from a mixture so that
//! the warm-started policy is a plausible but imperfect tool user.
//!
//! - **direct** (`direct_rate`): answers `\boxed{N}` at once with a guessed `N` that is not the
//!   answer (a tiny model cannot multiply in its head);
//! - **one call**: `print(<the whole expression>)`, then the printed value boxed;
//! - **two calls** (`two_call_rate` of the tool users): `print(<the sub-expression Python
//!   evaluates first>)`, then `print(<its printed value> op <the remaining operand>)`, then the
//!   value boxed.
//!
//! Each call's code slips with probability `slip_rate`: one operand digit is replaced or one
//! operator swapped. The transcript stays consistent with what the slipped code prints (the
//! tool output is what Python prints for it, rendered exactly as the environment renders it,
//! and later steps use that value), so a slip leads to a wrong final answer.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::tasks::GenTask;
use super::tokenizer::call_text;
use crate::experiments::warm_start::named_key;
use clawrl::env::exec::render_output;
use clawrl::sandbox::ExecOutput;

/// The mixture of behaviours.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Mixture {
    /// Fraction of transcripts that answer without the tool.
    #[serde(deserialize_with = "direct_rate")]
    pub direct_rate: f64,
    /// Fraction of tool-using transcripts that take two calls.
    #[serde(deserialize_with = "two_call_rate")]
    pub two_call_rate: f64,
    /// Probability that a call's code slips.
    #[serde(deserialize_with = "slip_rate")]
    pub slip_rate: f64,
}

// The mixture is read inside the flattened part of `[sft]`: each key names itself in errors.
fn direct_rate<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    named_key("mixture.direct_rate", d)
}

fn two_call_rate<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    named_key("mixture.two_call_rate", d)
}

fn slip_rate<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    named_key("mixture.slip_rate", d)
}

impl Default for Mixture {
    fn default() -> Self {
        Self {
            direct_rate: 0.2,
            two_call_rate: 0.5,
            slip_rate: 0.2,
        }
    }
}

/// One message of a transcript after the question.
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    /// The policy's message (trained on).
    Assistant(String),
    /// The tool's answer (context only).
    Tool(String),
}

/// A question and what follows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Transcript {
    /// The question.
    pub question: String,
    /// The messages after it.
    pub segments: Vec<Segment>,
}

/// Evaluates a Python expression of integers with `+`, `-`, `*` and unary minus (what the
/// transcripts' code holds); `None` when it is not one.
pub fn eval_expression(src: &str) -> Option<i64> {
    // Tokens: signed numbers and binary operators.
    let b = src.as_bytes();
    let mut i = 0;
    let mut nums: Vec<i64> = Vec::new();
    let mut ops: Vec<u8> = Vec::new();
    loop {
        let mut neg = false;
        while i < b.len() && b[i] == b'-' {
            neg = !neg;
            i += 1;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if start == i {
            return None;
        }
        let digits = &src[start..i];
        if digits.len() > 1 && digits.starts_with('0') {
            return None; // Python 3 refuses leading zeros.
        }
        let v: i64 = digits.parse().ok()?;
        nums.push(if neg { -v } else { v });
        if i == b.len() {
            break;
        }
        match b[i] {
            c @ (b'+' | b'-' | b'*') => ops.push(c),
            _ => return None,
        }
        i += 1;
    }
    let mut terms = vec![nums[0]];
    let mut signs = Vec::new();
    for (op, n) in ops.iter().zip(&nums[1..]) {
        if *op == b'*' {
            let last = terms.pop()?;
            terms.push(last.checked_mul(*n)?);
        } else {
            signs.push(*op);
            terms.push(*n);
        }
    }
    let mut acc = terms[0];
    for (s, v) in signs.iter().zip(&terms[1..]) {
        acc = if *s == b'+' {
            acc.checked_add(*v)?
        } else {
            acc.checked_sub(*v)?
        };
    }
    Some(acc)
}

/// `code` with one slip: a digit replaced (never by a leading zero) or a binary operator
/// swapped; the result still evaluates.
pub fn slip(code: &str, rng: &mut impl Rng) -> String {
    let chars: Vec<char> = code.chars().collect();
    let digits: Vec<usize> = (0..chars.len())
        .filter(|&i| chars[i].is_ascii_digit())
        .collect();
    let binops: Vec<usize> = (1..chars.len())
        .filter(|&i| "+-*".contains(chars[i]) && chars[i - 1].is_ascii_digit())
        .collect();
    let mut out = chars.clone();
    if !binops.is_empty() && rng.random_bool(0.3) {
        let i = binops[rng.random_range(0..binops.len())];
        let others: Vec<char> = "+-*".chars().filter(|&c| c != chars[i]).collect();
        out[i] = others[rng.random_range(0..others.len())];
    } else {
        let i = digits[rng.random_range(0..digits.len())];
        let leading = i == 0 || !chars[i - 1].is_ascii_digit();
        let next_is_digit = i + 1 < chars.len() && chars[i + 1].is_ascii_digit();
        let lo = if leading && next_is_digit { 1 } else { 0 };
        loop {
            let d = char::from(b'0' + rng.random_range(lo..10u8));
            if d != chars[i] {
                out[i] = d;
                break;
            }
        }
    }
    out.into_iter().collect()
}

/// The tool message a successful `print` of `value` gets, exactly as the environment renders
/// it.
pub fn printed(value: i64) -> String {
    render_output(
        &ExecOutput {
            stdout: format!("{value}\n"),
            stderr: String::new(),
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            truncated: false,
            wall: std::time::Duration::ZERO,
        },
        4096,
    )
    .0
}

/// The boxed answer message.
pub fn boxed(value: i64) -> String {
    format!("\\boxed{{{value}}}")
}

/// Appends one call of `code` (slipped with probability `mix.slip_rate`) and its output;
/// returns the printed value.
fn call(code: String, mix: &Mixture, segments: &mut Vec<Segment>, rng: &mut impl Rng) -> i64 {
    let code = if rng.random_bool(mix.slip_rate) {
        slip(&code, rng)
    } else {
        code
    };
    let v = eval_expression(&code).expect("generated code evaluates");
    segments.push(Segment::Assistant(call_text(&format!("print({code})"))));
    segments.push(Segment::Tool(printed(v)));
    v
}

/// One transcript for `task`.
pub fn transcript(task: &GenTask, mix: &Mixture, rng: &mut impl Rng) -> Transcript {
    let answer = task.answer();
    let mut segments = Vec::new();
    if rng.random_bool(mix.direct_rate) {
        let spread = (answer.abs() / 4).max(10);
        let mut guess = answer;
        while guess == answer {
            guess = answer + rng.random_range(-spread..=spread);
        }
        segments.push(Segment::Assistant(boxed(guess)));
        return Transcript {
            question: task.question(),
            segments,
        };
    }
    let v = if rng.random_bool(mix.two_call_rate) {
        let (first, second) = task.two_step();
        let v1 = call(first, mix, &mut segments, rng);
        call(second(&v1.to_string()), mix, &mut segments, rng)
    } else {
        call(task.expression(), mix, &mut segments, rng)
    };
    segments.push(Segment::Assistant(boxed(v)));
    Transcript {
        question: task.question(),
        segments,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_evaluator_follows_python() {
        assert_eq!(eval_expression("47+29*18"), Some(569));
        assert_eq!(eval_expression("-19-18"), Some(-37));
        assert_eq!(eval_expression("47+-19"), Some(28));
        assert_eq!(eval_expression("47--19"), Some(66));
        assert_eq!(eval_expression("2*-3*4"), Some(-24));
        assert_eq!(eval_expression("07+1"), None);
        assert_eq!(eval_expression("1+"), None);
        assert_eq!(eval_expression("print(1)"), None);
    }

    #[test]
    fn slips_change_the_code_and_still_evaluate() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for _ in 0..300 {
            let t = GenTask::random(&mut rng, 2, 99);
            let s = slip(&t.expression(), &mut rng);
            assert_ne!(s, t.expression());
            assert!(eval_expression(&s).is_some(), "{s}");
        }
    }

    #[test]
    fn transcripts_follow_the_mixture() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        let mix = Mixture::default();
        let (mut direct, mut two, mut right, n) = (0, 0, 0, 2000);
        for _ in 0..n {
            let t = GenTask::random(&mut rng, 2, 99);
            let tr = transcript(&t, &mix, &mut rng);
            let Some(Segment::Assistant(last)) = tr.segments.last() else {
                panic!("a transcript ends with the policy's answer")
            };
            right += usize::from(clawrl::env::answer::answer_matches(
                last,
                &t.answer().to_string(),
            ));
            match tr.segments.len() {
                1 => direct += 1,
                5 => two += 1,
                3 => {}
                k => panic!("{k} segments"),
            }
            for s in &tr.segments {
                if let Segment::Tool(text) = s {
                    assert!(text.starts_with("exit code: 0\nstdout:\n"));
                }
            }
        }
        let f = |k: usize| k as f64 / n as f64;
        assert!((f(direct) - 0.2).abs() < 0.04, "{direct}");
        assert!((f(two) - 0.4).abs() < 0.04, "{two}");
        // Correct: tool users without slips: 0.8 * (0.5 * 0.8 + 0.5 * 0.64) = 0.576.
        assert!((f(right) - 0.576).abs() < 0.05, "{right}");
        let tr = transcript(
            &GenTask::random(&mut rng, 2, 99),
            &Mixture {
                direct_rate: 0.0,
                two_call_rate: 0.0,
                slip_rate: 0.0,
            },
            &mut rng,
        );
        assert!(matches!(&tr.segments[0], Segment::Assistant(c) if c.starts_with("<tool_call>")));
    }
}
