//! The simulated users' taste, as deterministic rules: what a *student* (homework answers that
//! do not read as AI-written) and a *teacher* (grading feedback that is specific and friendly)
//! object to in a response, the directive phrase each objection becomes in the user's reply, and
//! the personalization score built on the same rules.
//!
//! A response *satisfies* a user when it has no [`Problem`] under that user's rules. The
//! personalization score of a set of responses is the fraction that satisfy their user
//! ([`personalization_score`]). The rules read the decoded response text, case-insensitively.

use std::sync::OnceLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

/// Which simulated user a task belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UserKind {
    /// Wants homework answers that read as written by a student: no "Final Answer" line, no
    /// step lists, no assistant phrases, casual.
    Student,
    /// Wants grading feedback that is specific (names the step with the mistake) and friendly
    /// (encouraging, never harsh).
    Teacher,
}

impl UserKind {
    /// Both kinds.
    pub const ALL: [UserKind; 2] = [UserKind::Student, UserKind::Teacher];

    /// `student` / `teacher`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Student => "student",
            Self::Teacher => "teacher",
        }
    }
}

/// One thing a user objects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Problem {
    /// Student: a "final answer" line.
    FinalAnswer,
    /// Student: a step list ("step 1 :", "1 . ...").
    StepList,
    /// Student: an assistant phrase ("i hope this helps", "let me know if").
    AssistantPhrase,
    /// Student: no casual marker ("yeah", "just", "tbh", "lol", "kinda", "pretty easy").
    NotCasual,
    /// Teacher: harsh words ("wrong", "incorrect", "sloppy", "careless", "lazy").
    Harsh,
    /// Teacher: no friendly marker ("nice", "great", "good job", "well done", "you are close",
    /// "keep it up").
    NotFriendly,
    /// Teacher: does not name the step with the mistake ("step 2").
    NotSpecific,
}

impl Problem {
    /// The directive phrase a user says about this problem (the part of the reply the hint
    /// judge extracts). Phrases of one user join with `" , "`.
    pub fn directive(self) -> &'static str {
        match self {
            Self::FinalAnswer => "drop the final answer line",
            Self::StepList => "no numbered steps",
            Self::AssistantPhrase | Self::NotCasual => "keep it casual like a friend",
            Self::Harsh => "do not be harsh",
            Self::NotFriendly => "be friendly",
            Self::NotSpecific => "point to the exact step with the mistake",
        }
    }
}

/// The directive phrases of a user, in a fixed order (each appears once).
pub fn directive_phrases(user: UserKind) -> &'static [&'static str] {
    match user {
        UserKind::Student => &[
            "drop the final answer line",
            "no numbered steps",
            "keep it casual like a friend",
        ],
        UserKind::Teacher => &[
            "do not be harsh",
            "be friendly",
            "point to the exact step with the mistake",
        ],
    }
}

struct Rules {
    final_answer: Regex,
    step_list: Regex,
    assistant: Regex,
    casual: Regex,
    harsh: Regex,
    friendly: Regex,
    specific: Regex,
}

fn rules() -> &'static Rules {
    static RULES: OnceLock<Rules> = OnceLock::new();
    RULES.get_or_init(|| {
        let re = |p: &str| Regex::new(p).expect("the style rules are valid regexes");
        Rules {
            final_answer: re(r"(?i)\bfinal\s+answer\b"),
            // "step 1", or a numbered item ("1 ." / "2 )") at the start or after a sentence end.
            step_list: re(r"(?i)\bstep\s+\d+\b|(?:^|[.:!?]\s+)\d+\s*[.)]\s+[a-z]"),
            assistant: re(r"(?i)\bi hope this helps\b|\blet me know if\b"),
            casual: re(r"(?i)\b(?:yeah|just|tbh|lol|kinda|pretty easy)\b"),
            harsh: re(r"(?i)\b(?:wrong|incorrect|sloppy|careless|lazy)\b"),
            friendly: re(r"(?i)\b(?:nice|great|good job|well done|you are close|keep it up)\b"),
            specific: re(r"(?i)\bstep\s+\d+\b"),
        }
    })
}

/// Every problem `user` has with `response`, in a fixed order; empty means satisfied.
pub fn problems(user: UserKind, response: &str) -> Vec<Problem> {
    let r = rules();
    let mut out = Vec::new();
    match user {
        UserKind::Student => {
            if r.final_answer.is_match(response) {
                out.push(Problem::FinalAnswer);
            }
            if r.step_list.is_match(response) {
                out.push(Problem::StepList);
            }
            if r.assistant.is_match(response) {
                out.push(Problem::AssistantPhrase);
            }
            if !r.casual.is_match(response) {
                out.push(Problem::NotCasual);
            }
        }
        UserKind::Teacher => {
            if r.harsh.is_match(response) {
                out.push(Problem::Harsh);
            }
            if !r.friendly.is_match(response) {
                out.push(Problem::NotFriendly);
            }
            if !r.specific.is_match(response) {
                out.push(Problem::NotSpecific);
            }
        }
    }
    out
}

/// Whether `response` satisfies `user` (no problem at all).
pub fn satisfies(user: UserKind, response: &str) -> bool {
    problems(user, response).is_empty()
}

/// The directive of a reply to a response with these problems: the distinct phrases, in the
/// order of [`directive_phrases`], joined with `" , "`; `None` when there is no problem.
pub fn directive(user: UserKind, problems: &[Problem]) -> Option<String> {
    let wanted: Vec<&str> = problems.iter().map(|p| p.directive()).collect();
    let parts: Vec<&str> = directive_phrases(user)
        .iter()
        .copied()
        .filter(|p| wanted.contains(p))
        .collect();
    (!parts.is_empty()).then(|| parts.join(" , "))
}

/// The personalization score: the fraction of `(user, response)` pairs whose response satisfies
/// its user's rules; `0` for an empty set.
pub fn personalization_score<'a>(pairs: impl IntoIterator<Item = (UserKind, &'a str)>) -> f64 {
    let (mut n, mut ok) = (0usize, 0usize);
    for (user, response) in pairs {
        n += 1;
        ok += usize::from(satisfies(user, response));
    }
    if n == 0 {
        0.0
    } else {
        ok as f64 / n as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn student_rules() {
        use Problem::*;
        let s = UserKind::Student;
        assert_eq!(
            problems(s, "oh its 56 , you just multiply 7 by 8 lol"),
            vec![]
        );
        assert_eq!(
            problems(
                s,
                "step 1 : multiply 7 and 8 . step 2 : that gives 56 . final answer : 56"
            ),
            vec![FinalAnswer, StepList, NotCasual]
        );
        assert_eq!(
            problems(s, "1 . take 7 and 8 . 2 . multiply them to get 56 ."),
            vec![StepList, NotCasual]
        );
        assert_eq!(
            problems(s, "the product of 7 and 8 is 56 . i hope this helps !"),
            vec![AssistantPhrase, NotCasual]
        );
        // A number ending a sentence is not a list item.
        assert!(satisfies(s, "yeah so 7 times 8 is 56 . pretty easy"));
        assert!(!satisfies(s, "yeah the final answer is 56"));
    }

    #[test]
    fn teacher_rules() {
        use Problem::*;
        let t = UserKind::Teacher;
        assert!(satisfies(
            t,
            "nice try ! in step 2 , 7 times 8 is 56 , not 54 . you are close !"
        ));
        assert_eq!(
            problems(t, "wrong . 5 / 10 ."),
            vec![Harsh, NotFriendly, NotSpecific]
        );
        assert_eq!(
            problems(t, "great effort ! keep practicing and you will get it ."),
            vec![NotSpecific]
        );
        assert_eq!(
            problems(t, "step 2 is wrong : 7 times 8 is 56 , not 54 ."),
            vec![Harsh, NotFriendly]
        );
    }

    #[test]
    fn directives_follow_the_problems() {
        use Problem::*;
        assert_eq!(directive(UserKind::Student, &[]), None);
        assert_eq!(
            directive(
                UserKind::Student,
                &[NotCasual, FinalAnswer, AssistantPhrase]
            )
            .unwrap(),
            "drop the final answer line , keep it casual like a friend"
        );
        assert_eq!(
            directive(UserKind::Teacher, &[NotSpecific]).unwrap(),
            "point to the exact step with the mistake"
        );
    }

    #[test]
    fn score_is_the_satisfied_fraction() {
        let pairs = [
            (UserKind::Student, "yeah its 5"),
            (UserKind::Student, "final answer : 5"),
            (UserKind::Teacher, "well done ! check step 1 ."),
            (UserKind::Teacher, "sloppy ."),
        ];
        assert_eq!(personalization_score(pairs), 0.5);
        assert_eq!(personalization_score([]), 0.0);
    }
}
