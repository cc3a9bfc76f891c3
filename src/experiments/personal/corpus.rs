//! The miniature world's language: homework tasks for the student and grading tasks for the
//! teacher, the response styles a policy may answer in, the style instructions, the users'
//! replies, and the supervised (SFT) corpus built from them.
//!
//! Every text is lower-case words and punctuation separated by single spaces, so that the
//! word-level tokenizer of [`super::tokenizer`] round-trips it exactly. Tasks are arithmetic
//! (`a plus|minus|times b`); a task belongs to the *train* split or the *held-out* split by its
//! numbers ([`Split::of`]), so the prompts measured after training were never trained on.
//!
//! Without an instruction the SFT corpus picks a style uniformly among the user's styles (5 for
//! the student, 6 for the teacher), so the warm-started policy mixes styles and satisfies a user
//! about one time in five or six. With an instruction (half the examples) it answers in the
//! instructed style. The instruction that asks for the user's wanted style is any non-empty
//! combination of that user's directive phrases ([`super::style::directive_phrases`]): the same
//! phrases the simulated users say when they are unhappy, which is what makes their directive
//! feedback usable as an OPD hint.

use rand::seq::IndexedRandom;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::style::{directive_phrases, UserKind};
use clawrl::judge::HINT_PREFIX;

/// The system prompt of every conversation.
pub const SYSTEM_PROMPT: &str = "you are a helpful assistant .";

/// Largest operand of a task.
pub const MAX_OPERAND: u32 = 12;
/// Smallest operand of a task.
pub const MIN_OPERAND: u32 = 2;
/// Every number that can appear in a text lies in `0..=MAX_NUMBER`.
pub const MAX_NUMBER: u32 = 160;

/// An arithmetic operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// `a plus b`.
    Plus,
    /// `a minus b` (a ≥ b).
    Minus,
    /// `a times b`.
    Times,
}

impl Op {
    const ALL: [Op; 3] = [Op::Plus, Op::Minus, Op::Times];

    fn word(self) -> &'static str {
        match self {
            Op::Plus => "plus",
            Op::Minus => "minus",
            Op::Times => "times",
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Op::Plus => "add",
            Op::Minus => "subtract",
            Op::Times => "multiply",
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Op::Plus => "sum",
            Op::Minus => "difference",
            Op::Times => "product",
        }
    }

    fn apply(self, a: u32, b: u32) -> u32 {
        match self {
            Op::Plus => a + b,
            Op::Minus => a - b,
            Op::Times => a * b,
        }
    }
}

/// Which part of the task space a task comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Tasks the RL loop trains on.
    Train,
    /// Tasks only measured on.
    HeldOut,
}

impl Split {
    /// The split of the task with operands `a`, `b`: held out when `(a + 2b) % 4 == 1`
    /// (about a quarter of the operand pairs).
    pub fn of(a: u32, b: u32) -> Split {
        if (a + 2 * b) % 4 == 1 {
            Split::HeldOut
        } else {
            Split::Train
        }
    }
}

/// One task: what the user asks, and the facts the answers are built from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// Whose task it is.
    pub user: UserKind,
    /// The operation.
    pub op: Op,
    /// First operand.
    pub a: u32,
    /// Second operand.
    pub b: u32,
    /// Teacher tasks: the student's wrong result.
    pub wrong: u32,
    /// Teacher tasks: the step holding the mistake (1..=3).
    pub step: u32,
    /// Which phrasing of the question.
    pub phrasing: usize,
}

const STUDENT_QUESTIONS: [&str; 4] = [
    "can you help with my homework ? what is {a} {op} {b} ?",
    "what is {a} {op} {b} ?",
    "quick homework question : what is {a} {op} {b} ?",
    "i need the answer to {a} {op} {b} for class .",
];

const TEACHER_QUESTIONS: [&str; 3] = [
    "please grade my student 's work : they wrote that {a} {op} {b} is {w} in step {k} .",
    "can you write feedback for a student who said {a} {op} {b} is {w} in step {k} ?",
    "grade this homework for me : step {k} says {a} {op} {b} is {w} .",
];

impl Task {
    /// A random task of `user` from `split`.
    pub fn random<R: Rng + ?Sized>(user: UserKind, split: Split, rng: &mut R) -> Task {
        loop {
            let op = *Op::ALL.choose(rng).expect("non-empty");
            let a = rng.random_range(MIN_OPERAND..=MAX_OPERAND);
            let b = rng.random_range(MIN_OPERAND..=MAX_OPERAND);
            let (a, b) = if op == Op::Minus && a < b {
                (b, a)
            } else {
                (a, b)
            };
            if Split::of(a, b) != split {
                continue;
            }
            let c = op.apply(a, b);
            let delta = rng.random_range(1..=3);
            let wrong = if rng.random_bool(0.5) || c < delta {
                c + delta
            } else {
                c - delta
            };
            let phrasing = match user {
                UserKind::Student => rng.random_range(0..STUDENT_QUESTIONS.len()),
                UserKind::Teacher => rng.random_range(0..TEACHER_QUESTIONS.len()),
            };
            return Task {
                user,
                op,
                a,
                b,
                wrong,
                step: rng.random_range(1..=3),
                phrasing,
            };
        }
    }

    /// The correct result.
    pub fn result(&self) -> u32 {
        self.op.apply(self.a, self.b)
    }

    /// A stable id, e.g. `student-times-7-8-p1`.
    pub fn id(&self) -> String {
        match self.user {
            UserKind::Student => format!(
                "student-{}-{}-{}-p{}",
                self.op.word(),
                self.a,
                self.b,
                self.phrasing
            ),
            UserKind::Teacher => format!(
                "teacher-{}-{}-{}-w{}-s{}-p{}",
                self.op.word(),
                self.a,
                self.b,
                self.wrong,
                self.step,
                self.phrasing
            ),
        }
    }

    fn fill(&self, template: &str) -> String {
        template
            .replace("{a}", &self.a.to_string())
            .replace("{b}", &self.b.to_string())
            .replace("{c}", &self.result().to_string())
            .replace("{w}", &self.wrong.to_string())
            .replace("{k}", &self.step.to_string())
            .replace("{op}", self.op.word())
            .replace("{verb}", self.op.verb())
            .replace("{noun}", self.op.noun())
    }

    /// The user's question.
    pub fn question(&self) -> String {
        match self.user {
            UserKind::Student => self.fill(STUDENT_QUESTIONS[self.phrasing]),
            UserKind::Teacher => self.fill(TEACHER_QUESTIONS[self.phrasing]),
        }
    }
}

/// A way to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Style {
    /// Student task: "step 1 : ... final answer : c".
    Steps,
    /// Student task: "1 . ... 2 . ...".
    Numbered,
    /// Student task: formal prose ending with a final answer line.
    Textbook,
    /// Student task: polite assistant prose ("i hope this helps !").
    Assistant,
    /// Student task: casual, like a friend (what the student wants).
    Casual,
    /// Teacher task: "wrong . 5 / 10 .".
    Curt,
    /// Teacher task: formal and generic.
    Formal,
    /// Teacher task: harsh.
    Harsh,
    /// Teacher task: encouraging but generic.
    Encouraging,
    /// Teacher task: names the step, but curt.
    Pointed,
    /// Teacher task: names the step, friendly (what the teacher wants).
    Kind,
}

const STUDENT_STYLES: [Style; 5] = [
    Style::Steps,
    Style::Numbered,
    Style::Textbook,
    Style::Assistant,
    Style::Casual,
];
const TEACHER_STYLES: [Style; 6] = [
    Style::Curt,
    Style::Formal,
    Style::Harsh,
    Style::Encouraging,
    Style::Pointed,
    Style::Kind,
];

impl Style {
    /// The styles a policy may answer `user`'s tasks in.
    pub fn of_user(user: UserKind) -> &'static [Style] {
        match user {
            UserKind::Student => &STUDENT_STYLES,
            UserKind::Teacher => &TEACHER_STYLES,
        }
    }

    /// The style `user` wants.
    #[cfg(test)]
    pub fn wanted(user: UserKind) -> Style {
        match user {
            UserKind::Student => Style::Casual,
            UserKind::Teacher => Style::Kind,
        }
    }

    /// The user whose tasks this style answers.
    pub fn user(self) -> UserKind {
        if STUDENT_STYLES.contains(&self) {
            UserKind::Student
        } else {
            UserKind::Teacher
        }
    }

    fn templates(self) -> &'static [&'static str] {
        match self {
            Style::Steps => &["step 1 : we {verb} {a} and {b} . step 2 : this gives {c} . final answer : {c}"],
            Style::Numbered => &["1 . take {a} and {b} . 2 . {verb} them to get {c} ."],
            Style::Textbook => &["to solve this , we {verb} {a} and {b} . therefore , the result is {c} . final answer : {c}"],
            Style::Assistant => &["the {noun} of {a} and {b} is {c} . i hope this helps ! let me know if you have other questions ."],
            Style::Casual => &[
                "oh its {c} , you just {verb} {a} and {b} lol",
                "yeah so {a} {op} {b} is {c} , pretty easy",
                "its {c} tbh , just {verb} them",
            ],
            Style::Curt => &["wrong . {s} / 10 ."],
            Style::Formal => &["the answer is incorrect . the student should review the material . score : {s} / 10 ."],
            Style::Harsh => &["this is sloppy work . check your math before you hand it in ."],
            Style::Encouraging => &["great effort ! keep practicing and you will get it ."],
            Style::Pointed => &["step {k} is wrong : {a} {op} {b} is {c} , not {w} . {s} / 10 ."],
            Style::Kind => &[
                "nice try ! in step {k} , {a} {op} {b} is {c} , not {w} . you are close !",
                "great work overall ! just check step {k} : {a} {op} {b} is {c} , not {w} . keep it up !",
            ],
        }
    }

    /// A response to `task` in this style (a random variant and score).
    pub fn respond<R: Rng + ?Sized>(self, task: &Task, rng: &mut R) -> String {
        let template = self.templates().choose(rng).expect("non-empty");
        task.fill(template)
            .replace("{s}", &rng.random_range(3..=8).to_string())
    }

    /// An instruction asking for this style. The wanted style of a user is asked for by any
    /// non-empty combination of that user's directive phrases.
    pub fn instruction<R: Rng + ?Sized>(self, rng: &mut R) -> String {
        let fixed = match self {
            Style::Steps => "explain it step by step with a final answer line",
            Style::Numbered => "use a numbered list",
            Style::Textbook => "answer formally and end with a final answer line",
            Style::Assistant => "answer politely like an assistant",
            Style::Curt => "be brief and strict",
            Style::Formal => "be formal",
            Style::Harsh => "be blunt about the mistakes",
            Style::Encouraging => "be encouraging",
            Style::Pointed => "only list the error and the score",
            Style::Casual | Style::Kind => {
                let phrases = directive_phrases(self.user());
                loop {
                    let picked: Vec<&str> = phrases
                        .iter()
                        .copied()
                        .filter(|_| rng.random_bool(0.5))
                        .collect();
                    if !picked.is_empty() {
                        return picked.join(" , ");
                    }
                }
            }
        };
        fixed.to_string()
    }
}

/// How an instruction is attached to a question.
pub fn with_instruction(question: &str, instruction: &str, form: usize) -> String {
    match form % 3 {
        0 => format!("{question}{HINT_PREFIX}{instruction}"),
        1 => format!("{instruction} . {question}"),
        _ => format!("{question} ( {instruction} )"),
    }
}

/// The opening messages of a conversation about `user_text`: the system prompt and the user's
/// message, OpenAI chat format.
pub fn opening(user_text: &str) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": SYSTEM_PROMPT}),
        json!({"role": "user", "content": user_text}),
    ]
}

/// What the student says when unhappy (before the directive).
pub const STUDENT_COMPLAINTS: [&str; 3] = [
    "this reads like a bot wrote it .",
    "my teacher will know an ai wrote this .",
    "nobody i know talks like this .",
];
/// What the teacher says when unhappy (before the directive).
pub const TEACHER_COMPLAINTS: [&str; 3] = [
    "my student will not learn from this .",
    "this feedback is too cold .",
    "this feedback does not help my student .",
];
/// What the student says when happy.
pub const STUDENT_PRAISE: [&str; 2] = ["thanks , that sounds like me !", "perfect , thanks !"];
/// What the teacher says when happy.
pub const TEACHER_PRAISE: [&str; 2] = [
    "perfect , that is kind and specific . thanks !",
    "thanks , my student will like this .",
];
/// The words that introduce a directive in a reply.
pub const DIRECTIVE_LEAD: &str = "next time :";

/// One supervised example.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SftExample {
    /// The prompt messages (system, user).
    pub messages: Vec<Value>,
    /// The target response.
    pub response: String,
    /// Its style.
    pub style: Style,
    /// Whether the prompt carried a style instruction.
    pub instructed: bool,
}

/// One SFT example: a random user and task (either split), an instruction with probability
/// `instruct_rate` (its style uniform, its form one of three), else a uniformly random style.
pub fn sft_example<R: Rng + ?Sized>(instruct_rate: f64, rng: &mut R) -> SftExample {
    let user = *UserKind::ALL.choose(rng).expect("non-empty");
    let split = if rng.random_bool(0.25) {
        Split::HeldOut
    } else {
        Split::Train
    };
    let task = Task::random(user, split, rng);
    let style = *Style::of_user(user).choose(rng).expect("non-empty");
    let instructed = rng.random_bool(instruct_rate);
    let text = if instructed {
        let instruction = style.instruction(rng);
        with_instruction(&task.question(), &instruction, rng.random_range(0..3))
    } else {
        task.question()
    };
    SftExample {
        messages: opening(&text),
        response: style.respond(&task, rng),
        style,
        instructed,
    }
}

/// Texts that together use every word of the world (for building the vocabulary): a large
/// seeded sample of the corpus plus every fixed phrase and every number.
pub fn vocabulary_texts() -> Vec<String> {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    let mut out: Vec<String> = Vec::new();
    for _ in 0..4000 {
        let ex = sft_example(0.5, &mut rng);
        for m in &ex.messages {
            out.push(m["content"].as_str().unwrap_or_default().to_string());
        }
        out.push(ex.response);
    }
    for user in UserKind::ALL {
        for style in Style::of_user(user) {
            out.extend(style.templates().iter().map(|t| t.to_string()));
        }
        out.extend(directive_phrases(user).iter().map(|p| p.to_string()));
    }
    out.extend(STUDENT_QUESTIONS.iter().map(|s| s.to_string()));
    out.extend(TEACHER_QUESTIONS.iter().map(|s| s.to_string()));
    for list in [
        &STUDENT_COMPLAINTS[..],
        &TEACHER_COMPLAINTS[..],
        &STUDENT_PRAISE[..],
        &TEACHER_PRAISE[..],
    ] {
        out.extend(list.iter().map(|s| s.to_string()));
    }
    out.push(DIRECTIVE_LEAD.to_string());
    out.push(HINT_PREFIX.to_string());
    out.push(SYSTEM_PROMPT.to_string());
    out.push("system user assistant".to_string());
    out.push(
        (0..=MAX_NUMBER)
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(" "),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiments::personal::style::{satisfies, UserKind};
    use rand::SeedableRng;

    #[test]
    fn only_the_wanted_style_satisfies_its_user() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for user in UserKind::ALL {
            for _ in 0..50 {
                let task = Task::random(user, Split::Train, &mut rng);
                for &style in Style::of_user(user) {
                    let r = style.respond(&task, &mut rng);
                    assert_eq!(
                        satisfies(user, &r),
                        style == Style::wanted(user),
                        "{style:?}: {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn splits_are_disjoint_and_tasks_consistent() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        for user in UserKind::ALL {
            for split in [Split::Train, Split::HeldOut] {
                for _ in 0..100 {
                    let t = Task::random(user, split, &mut rng);
                    assert_eq!(Split::of(t.a, t.b), split);
                    assert!(t.wrong != t.result() && t.wrong <= MAX_NUMBER);
                    assert!(t.result() <= MAX_NUMBER);
                    assert!((1..=3).contains(&t.step));
                }
            }
        }
    }

    #[test]
    fn corpus_mixes_styles_and_instructions_name_the_style() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut instructed = 0;
        let mut casual_plain = 0;
        let mut student_plain = 0;
        for _ in 0..4000 {
            let ex = sft_example(0.5, &mut rng);
            let user = ex.style.user();
            assert_eq!(
                satisfies(user, &ex.response),
                ex.style == Style::wanted(user)
            );
            if ex.instructed {
                instructed += 1;
            } else if user == UserKind::Student {
                student_plain += 1;
                casual_plain += usize::from(ex.style == Style::Casual);
            }
        }
        assert!((1800..2200).contains(&instructed), "{instructed}");
        let rate = casual_plain as f64 / student_plain as f64;
        assert!(
            (0.15..0.25).contains(&rate),
            "casual rate without instruction {rate}"
        );
        // The wanted style's instruction is made of the user's directive phrases.
        for _ in 0..20 {
            let i = Style::Kind.instruction(&mut rng);
            assert!(i
                .split(" , ")
                .all(|p| directive_phrases(UserKind::Teacher).contains(&p)));
        }
        assert!(with_instruction("q ?", "be formal", 0).ends_with("instruction]\nbe formal"));
    }
}
