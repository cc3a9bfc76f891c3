//! Final answers of math tasks: taking the answer out of the policy's last plain message and
//! comparing it with the reference by normalised numeric value.
//!
//! The rule, exactly:
//!
//! 1. **Which text.** The content of the `\boxed{...}` (or `\fbox{...}`) that starts last in the
//!    message, braces balanced; without a box, the last number in the message (see 2 for what a
//!    number looks like; a fraction `a/b` counts as one number).
//! 2. **Parsing.** Whitespace, `$`, `\!`, `\,`, `\ ` and a trailing `.` are removed, as is an outer
//!    `\text{...}`/`\mathrm{...}`. Accepted forms: an optional sign (`+`, `-`, `−`), digits with
//!    optional `,` thousands separators in groups of three (`1,000`, `12,345.5`), an optional
//!    decimal part (`0.50`, `.5`), an optional exponent (`1e3`, `2.5E-2`), and fractions
//!    `a/b` or `\frac{a}{b}` / `\dfrac{a}{b}` / `\tfrac{a}{b}` of two such numbers with an
//!    optional sign in front. A trailing `%` is *not* stripped (`50%` is not `0.5` and not `50`).
//! 3. **Comparison.** Numbers are exact rationals when written without an exponent (`0.50` =
//!    `1/2` = `\frac{2}{4}`); two exact values match when equal. Otherwise (an exponent, or a
//!    value too large for 128-bit exact arithmetic) they match when
//!    `|a − b| ≤ 1e-9 · max(1, |a|, |b|)`. Anything that does not parse does not match.

/// A parsed number: an exact fraction when possible, else a float.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Number {
    /// `num / den` in lowest terms, `den > 0`.
    Exact {
        /// Numerator.
        num: i128,
        /// Denominator (positive).
        den: i128,
    },
    /// A value only known approximately.
    Approx(f64),
}

impl Number {
    /// The value as a float.
    pub fn to_f64(self) -> f64 {
        match self {
            Number::Exact { num, den } => num as f64 / den as f64,
            Number::Approx(x) => x,
        }
    }

    fn exact(num: i128, den: i128) -> Option<Number> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1) as i128;
        let (mut n, mut d) = (num / g, den / g);
        if d < 0 {
            n = n.checked_neg()?;
            d = d.checked_neg()?;
        }
        Some(Number::Exact { num: n, den: d })
    }

    fn div(self, other: Number) -> Option<Number> {
        if let (Number::Exact { num: a, den: b }, Number::Exact { num: c, den: d }) = (self, other)
        {
            if let (Some(n), Some(m)) = (a.checked_mul(d), b.checked_mul(c)) {
                return Number::exact(n, m);
            }
        }
        let d = other.to_f64();
        if d == 0.0 {
            return None;
        }
        let x = self.to_f64() / d;
        x.is_finite().then_some(Number::Approx(x))
    }

    fn neg(self) -> Option<Number> {
        Some(match self {
            Number::Exact { num, den } => Number::Exact {
                num: num.checked_neg()?,
                den,
            },
            Number::Approx(x) => Number::Approx(-x),
        })
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Whether two numbers match by the rule in the module docs.
pub fn numbers_match(a: Number, b: Number) -> bool {
    match (a, b) {
        (Number::Exact { .. }, Number::Exact { .. }) => a == b,
        _ => {
            let (x, y) = (a.to_f64(), b.to_f64());
            (x - y).abs() <= 1e-9 * 1f64.max(x.abs()).max(y.abs())
        }
    }
}

/// The content of the last `\boxed{...}` / `\fbox{...}` in `text` (braces balanced), if any.
pub fn last_boxed(text: &str) -> Option<&str> {
    let mut best: Option<&str> = None;
    let mut best_at = 0usize;
    for marker in ["\\boxed{", "\\fbox{"] {
        for (at, _) in text.match_indices(marker) {
            let start = at + marker.len();
            if let Some(inner) = balanced(&text[start..]) {
                if best.is_none() || at >= best_at {
                    best = Some(inner);
                    best_at = at;
                }
            }
        }
    }
    best
}

/// The text up to the brace that closes an already opened `{`.
fn balanced(s: &str) -> Option<&str> {
    let mut depth = 1usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[..i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The final-answer text of a message: the last box's content, else the last number.
pub fn extract_answer(text: &str) -> Option<String> {
    if let Some(b) = last_boxed(text) {
        return Some(b.trim().to_string());
    }
    last_number(text).map(str::to_string)
}

fn last_number(text: &str) -> Option<&str> {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| {
        let num = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+";
        regex::Regex::new(&format!(
            r"[-+−]?(?:{num})(?:[eE][-+]?\d+)?(?:\s*/\s*(?:{num}))?"
        ))
        .expect("valid regex")
    });
    re.find_iter(text).last().map(|m| m.as_str())
}

/// Parses an answer text into a number by the rule in the module docs.
pub fn parse_number(text: &str) -> Option<Number> {
    let mut s: String = text
        .replace("\\!", "")
        .replace("\\,", "")
        .replace("\\ ", "")
        .replace("\\left", "")
        .replace("\\right", "")
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '$')
        .collect();
    for wrapper in ["\\text{", "\\mathrm{", "\\mathbf{"] {
        if let Some(rest) = s.strip_prefix(wrapper) {
            if let Some(inner) = balanced(rest) {
                if inner.len() + 1 == rest.len() {
                    s = inner.to_string();
                }
            }
        }
    }
    let s = s.strip_suffix('.').unwrap_or(&s);
    parse_signed(s)
}

fn parse_signed(s: &str) -> Option<Number> {
    for minus in ["-", "−"] {
        if let Some(rest) = s.strip_prefix(minus) {
            return parse_unsigned(rest)?.neg();
        }
    }
    parse_unsigned(s.strip_prefix('+').unwrap_or(s))
}

fn parse_unsigned(s: &str) -> Option<Number> {
    for frac in ["\\frac{", "\\dfrac{", "\\tfrac{"] {
        if let Some(rest) = s.strip_prefix(frac) {
            let a = balanced(rest)?;
            let rest = rest[a.len() + 1..].strip_prefix('{')?;
            let b = balanced(rest)?;
            if rest.len() != b.len() + 1 {
                return None;
            }
            return parse_signed(a)?.div(parse_signed(b)?);
        }
    }
    if let Some((a, b)) = s.split_once('/') {
        return parse_signed(a)?.div(parse_signed(b)?);
    }
    parse_decimal(s)
}

/// Digits with optional thousands separators, decimal part and exponent.
fn parse_decimal(s: &str) -> Option<Number> {
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, f),
        None => (mantissa, ""),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let int_digits = if int.contains(',') {
        let groups: Vec<&str> = int.split(',').collect();
        let first_ok = (1..=3).contains(&groups[0].len());
        let rest_ok = groups[1..].iter().all(|g| g.len() == 3);
        if !first_ok || !rest_ok {
            return None;
        }
        groups.concat()
    } else {
        int.to_string()
    };
    if !int_digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if let Some(e) = exponent {
        let e_ok = {
            let d = e.strip_prefix(['+', '-']).unwrap_or(e);
            !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())
        };
        if !e_ok {
            return None;
        }
        let x: f64 = format!("0{int_digits}.{frac}0e{e}").parse().ok()?;
        return x.is_finite().then_some(Number::Approx(x));
    }
    let digits = format!("{int_digits}{frac}");
    let exact = digits.parse::<i128>().ok().and_then(|n| {
        let den = 10i128.checked_pow(u32::try_from(frac.len()).ok()?)?;
        Number::exact(n, den)
    });
    exact.or_else(|| {
        let x: f64 = format!("0{int_digits}.{frac}0").parse().ok()?;
        x.is_finite().then_some(Number::Approx(x))
    })
}

/// Whether the policy's final message `response` answers `expected`: both parse by the rule in
/// the module docs and match.
pub fn answer_matches(response: &str, expected: &str) -> bool {
    let (Some(given), Some(want)) = (
        extract_answer(response).as_deref().and_then(parse_number),
        parse_number(expected),
    ) else {
        return false;
    };
    numbers_match(given, want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Number {
        parse_number(s).unwrap_or_else(|| panic!("{s:?} should parse"))
    }

    fn same(a: &str, b: &str) -> bool {
        numbers_match(n(a), n(b))
    }

    #[test]
    fn integers_signs_and_separators() {
        assert_eq!(n("42"), Number::Exact { num: 42, den: 1 });
        assert_eq!(n("-3"), Number::Exact { num: -3, den: 1 });
        assert_eq!(n("−3"), Number::Exact { num: -3, den: 1 });
        assert_eq!(n("+7"), Number::Exact { num: 7, den: 1 });
        assert_eq!(n("1,000"), Number::Exact { num: 1000, den: 1 });
        assert_eq!(
            n("12,345,678"),
            Number::Exact {
                num: 12_345_678,
                den: 1
            }
        );
        assert_eq!(n(" 1 000 "), Number::Exact { num: 1000, den: 1 });
        assert!(parse_number("1,00").is_none());
        assert!(parse_number("1,0000").is_none());
        assert!(parse_number(",100").is_none());
    }

    #[test]
    fn decimals_trailing_dots_and_fractions() {
        assert!(same("0.50", "1/2"));
        assert!(same(".5", "0.5"));
        assert!(same("2.", "2"));
        assert!(same("12,345.50", "24691/2"));
        assert!(same("\\frac{2}{4}", "0.5"));
        assert!(same("\\dfrac{-3}{6}", "-1/2"));
        assert!(same("-\\frac{3}{6}", "-0.5"));
        assert!(same("3 / 4", "0.75"));
        assert!(!same("0.333333", "1/3"));
        assert!(!same("1/2", "0.51"));
        assert!(parse_number("1/0").is_none());
        assert!(parse_number("\\frac{1}{2}x").is_none());
    }

    #[test]
    fn exponents_and_huge_values_compare_approximately() {
        assert!(same("1e3", "1000"));
        assert!(same("2.5E-2", "0.025"));
        assert!(!same("1e3", "1001"));
        let big = "123456789012345678901234567890123456789012345";
        assert!(matches!(n(big), Number::Approx(_)));
        assert!(same(
            big,
            "1.23456789012345678901234567890123456789012345e44"
        ));
    }

    #[test]
    fn latex_wrappers_and_junk() {
        assert!(same("$\\text{12}$", "12"));
        assert!(same("1\\,000", "1000"));
        assert!(parse_number("50%").is_none());
        assert!(parse_number("abc").is_none());
        assert!(parse_number("").is_none());
        assert!(parse_number("-").is_none());
        assert!(parse_number("1.2.3").is_none());
        assert!(parse_number("x=3").is_none());
    }

    #[test]
    fn boxed_answers_win_and_the_last_box_counts() {
        assert_eq!(
            last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c"),
            Some("\\frac{1}{2}")
        );
        assert_eq!(last_boxed("\\fbox{3} then \\boxed{4}"), Some("4"));
        assert_eq!(last_boxed("\\boxed{unclosed"), None);
        assert_eq!(
            extract_answer("so 7 apples, \\boxed{8}").as_deref(),
            Some("8")
        );
        assert_eq!(extract_answer("no box").as_deref(), None);
    }

    #[test]
    fn without_a_box_the_last_number_counts() {
        assert_eq!(extract_answer("3 + 4 = 7.").as_deref(), Some("7"));
        assert_eq!(
            extract_answer("It costs 1,000 dollars").as_deref(),
            Some("1,000")
        );
        assert_eq!(extract_answer("the answer is -3").as_deref(), Some("-3"));
        assert_eq!(extract_answer("half: 1/2").as_deref(), Some("1/2"));
        assert_eq!(extract_answer("x = 2.5e3").as_deref(), Some("2.5e3"));
    }

    #[test]
    fn answer_matching_end_to_end() {
        assert!(answer_matches("The total is \\boxed{1,000}.", "1000"));
        assert!(answer_matches("So the probability is 0.50.", "1/2"));
        assert!(answer_matches("\\boxed{\\frac{1}{2}}", "0.5"));
        assert!(answer_matches("Final answer: -3", "-3"));
        assert!(!answer_matches("Final answer: 3", "-3"));
        assert!(!answer_matches(
            "I computed 12 but the answer is \\boxed{13}",
            "12"
        ));
        assert!(!answer_matches("no answer at all", "12"));
        assert!(!answer_matches("\\boxed{12}", "not a number"));
        assert!(!answer_matches("", "0"));
    }
}
