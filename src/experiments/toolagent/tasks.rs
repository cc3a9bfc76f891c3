//! The experiment's math tasks: `a op1 b op2 c` with small operands (2..=9 by default) and
//! `+`, `-`, `*` ("what is 47+29*18 ?"), with the exact answer and the
//! intermediate quantity a step-by-step solution computes first (the sub-expression Python
//! evaluates first: `b op2 c` when only `op2` is `*`, else `a op1 b`). Generated from a seed;
//! the train and held-out sets are disjoint by construction (a held-out task never equals a
//! train task). [`GenTask::math_task`] is the JSONL task the tool-call environment reads.

use std::collections::HashSet;

use rand::Rng;
use serde::{Deserialize, Serialize};

use clawrl::env::tool_call::MathTask;

/// The second call's source of a two-step solution, given what the first call printed.
pub type SecondCall<'a> = Box<dyn Fn(&str) -> String + 'a>;

/// An operator of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// `+`.
    Add,
    /// `-`.
    Sub,
    /// `*`.
    Mul,
}

impl Op {
    /// Every operator.
    pub const ALL: [Op; 3] = [Op::Add, Op::Sub, Op::Mul];

    /// The Python symbol.
    pub fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
        }
    }

    /// `x op y`.
    pub fn apply(self, x: i64, y: i64) -> i64 {
        match self {
            Op::Add => x + y,
            Op::Sub => x - y,
            Op::Mul => x * y,
        }
    }
}

/// One generated task.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GenTask {
    /// The operands.
    pub operands: [i64; 3],
    /// The operators, left to right.
    pub ops: [Op; 2],
}

impl GenTask {
    /// Draws a task with operands in `lo..=hi`.
    pub fn random(rng: &mut impl Rng, lo: i64, hi: i64) -> GenTask {
        GenTask {
            operands: [
                rng.random_range(lo..=hi),
                rng.random_range(lo..=hi),
                rng.random_range(lo..=hi),
            ],
            ops: [
                Op::ALL[rng.random_range(0..3)],
                Op::ALL[rng.random_range(0..3)],
            ],
        }
    }

    /// The question text (the expression as written in Python, so that the tiny policy
    /// copies it rather than translating words).
    pub fn question(&self) -> String {
        format!("what is {} ?", self.expression())
    }

    /// The whole expression as Python source (`"47*29+18"`).
    pub fn expression(&self) -> String {
        let [a, b, c] = self.operands;
        format!("{a}{}{b}{}{c}", self.ops[0].symbol(), self.ops[1].symbol())
    }

    /// Whether Python evaluates `b op2 c` first (only `op2` binds tighter).
    pub fn right_first(&self) -> bool {
        self.ops[1] == Op::Mul && self.ops[0] != Op::Mul
    }

    /// The intermediate quantity: the sub-expression evaluated first.
    pub fn intermediate(&self) -> i64 {
        let [a, b, c] = self.operands;
        if self.right_first() {
            self.ops[1].apply(b, c)
        } else {
            self.ops[0].apply(a, b)
        }
    }

    /// The answer, with Python's precedence.
    pub fn answer(&self) -> i64 {
        let [a, _, c] = self.operands;
        let m = self.intermediate();
        if self.right_first() {
            self.ops[0].apply(a, m)
        } else {
            self.ops[1].apply(m, c)
        }
    }

    /// The first sub-expression's source and the second call's source given the first's
    /// printed value.
    pub fn two_step(&self) -> (String, SecondCall<'_>) {
        let [a, b, c] = self.operands;
        let [o1, o2] = [self.ops[0].symbol(), self.ops[1].symbol()];
        if self.right_first() {
            (
                format!("{b}{o2}{c}"),
                Box::new(move |v: &str| format!("{a}{o1}{v}")),
            )
        } else {
            (
                format!("{a}{o1}{b}"),
                Box::new(move |v: &str| format!("{v}{o2}{c}")),
            )
        }
    }

    /// An id: the expression spelled in the characters a task id allows (`8-2*5` is
    /// `8_minus_2_times_5`).
    pub fn id(&self) -> String {
        let word = |op: Op| match op {
            Op::Add => "plus",
            Op::Sub => "minus",
            Op::Mul => "times",
        };
        let [a, b, c] = self.operands;
        format!("{a}_{}_{b}_{}_{c}", word(self.ops[0]), word(self.ops[1]))
    }

    /// The task as the tool-call environment reads it.
    pub fn math_task(&self) -> MathTask {
        MathTask {
            id: self.id(),
            question: self.question(),
            answer: self.answer().to_string(),
        }
    }
}

/// `train` train tasks and `held_out` held-out tasks drawn from `seed`, all distinct; operands
/// in `lo..=hi`. Panics only if the operand range cannot hold that many distinct tasks.
pub fn task_sets(
    seed: u64,
    lo: i64,
    hi: i64,
    train: usize,
    held_out: usize,
) -> (Vec<GenTask>, Vec<GenTask>) {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x7a5c_0001);
    let mut seen = HashSet::new();
    let mut draw = |n: usize| {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let t = GenTask::random(&mut rng, lo, hi);
            if seen.insert(t.clone()) {
                out.push(t);
            }
        }
        out
    };
    let held = draw(held_out);
    let tr = draw(train);
    (tr, held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn t(a: i64, o1: Op, b: i64, o2: Op, c: i64) -> GenTask {
        GenTask {
            operands: [a, b, c],
            ops: [o1, o2],
        }
    }

    #[test]
    fn answers_follow_python_precedence() {
        let x = t(47, Op::Add, 29, Op::Mul, 18);
        assert_eq!(x.expression(), "47+29*18");
        assert_eq!(x.question(), "what is 47+29*18 ?");
        assert!(x.right_first());
        assert_eq!(x.intermediate(), 522);
        assert_eq!(x.answer(), 569);
        let y = t(47, Op::Mul, 29, Op::Sub, 18);
        assert_eq!((y.intermediate(), y.answer()), (1363, 1345));
        let z = t(10, Op::Sub, 29, Op::Sub, 18);
        assert_eq!((z.intermediate(), z.answer()), (-19, -37));
        let w = t(12, Op::Mul, 11, Op::Mul, 10);
        assert_eq!((w.intermediate(), w.answer()), (132, 1320));
        let (first, second) = x.two_step();
        assert_eq!(first, "29*18");
        assert_eq!(second("522"), "47+522");
        let (first, second) = z.two_step();
        assert_eq!(first, "10-29");
        assert_eq!(second("-19"), "-19-18");
        assert_eq!(x.math_task().answer, "569");
    }

    #[test]
    fn generated_answers_match_an_independent_evaluator() {
        // Precedence climbing over the expression text, written separately from `answer`.
        fn eval(src: &str) -> i64 {
            let mut nums = vec![];
            let mut ops = vec![];
            let mut cur = String::new();
            for ch in src.chars() {
                if ch.is_ascii_digit() {
                    cur.push(ch);
                } else {
                    nums.push(cur.parse::<i64>().unwrap());
                    cur.clear();
                    ops.push(ch);
                }
            }
            nums.push(cur.parse().unwrap());
            // Fold the products first.
            let mut terms = vec![nums[0]];
            let mut signs = vec![];
            for (op, n) in ops.iter().zip(&nums[1..]) {
                if *op == '*' {
                    let last = terms.pop().unwrap();
                    terms.push(last * n);
                } else {
                    signs.push(*op);
                    terms.push(*n);
                }
            }
            let mut acc = terms[0];
            for (s, v) in signs.iter().zip(&terms[1..]) {
                acc = if *s == '+' { acc + v } else { acc - v };
            }
            acc
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for _ in 0..500 {
            let x = GenTask::random(&mut rng, 2, 99);
            assert_eq!(x.answer(), eval(&x.expression()), "{}", x.expression());
        }
    }

    #[test]
    fn task_sets_are_reproducible_and_disjoint() {
        let (a, b) = task_sets(3, 2, 99, 200, 50);
        assert_eq!((a.len(), b.len()), (200, 50));
        let (a2, b2) = task_sets(3, 2, 99, 200, 50);
        assert_eq!((a.clone(), b.clone()), (a2, b2));
        let train: HashSet<_> = a.iter().collect();
        assert!(b.iter().all(|x| !train.contains(x)));
        assert_ne!(task_sets(4, 2, 99, 200, 50).0, a);
    }
}
