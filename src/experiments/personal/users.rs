//! Simulated users as an [`Environment`]: the personal-agent experiment's *student* (wants
//! homework answers that do not read as AI-written) and *teacher* (wants grading feedback that is
//! specific and friendly).
//!
//! An episode opens with the system prompt and the user's question. After each assistant message
//! the user replies with an *evaluative* sentence (praise when the response satisfies every rule
//! of [`crate::experiments::personal::style`], a complaint otherwise) and, when unhappy, usually a *directive*
//! one: `"next time : <what to change> ."`, naming exactly the rules that failed. The directive
//! is what an OPD hint judge extracts; with probability `1 - directive_rate` an unhappy user
//! only complains. The episode ends when the user is satisfied or after `max_turns` replies.
//! There is no verifiable outcome (docs/design.md §4: personal agents are judged by the PRM only).

use std::sync::Arc;

use clawrl_actors::loops::{
    Action, BoxFuture, EnvError, Environment, Episode, Observation, StepOutcome,
};
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;

use crate::experiments::personal::corpus::{
    opening, Split, Task, DIRECTIVE_LEAD, STUDENT_COMPLAINTS, STUDENT_PRAISE, TEACHER_COMPLAINTS,
    TEACHER_PRAISE,
};
use crate::experiments::personal::style::{directive, problems, Problem, UserKind};

/// How the simulated users behave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UserSettings {
    /// Probability that an unhappy reply also says what to change.
    pub directive_rate: f64,
    /// Replies per episode before the user leaves.
    pub max_turns: u32,
}

impl Default for UserSettings {
    fn default() -> Self {
        Self {
            directive_rate: 0.8,
            max_turns: 1,
        }
    }
}

/// Why a personal environment could not be built.
#[derive(Debug, Error, PartialEq)]
pub enum PersonalEnvError {
    /// No task.
    #[error("personal environment: the task set is empty")]
    NoTasks,
    /// `directive_rate` is not a probability.
    #[error("personal environment: directive_rate must lie in [0, 1], got {0}")]
    DirectiveRate(f64),
    /// `max_turns` is 0.
    #[error("personal environment: max_turns must be at least 1")]
    MaxTurns,
}

/// A user's reply to one response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserReply {
    /// The reply text.
    pub text: String,
    /// Whether the response satisfied the user.
    pub satisfied: bool,
    /// What the user objected to.
    pub problems: Vec<Problem>,
    /// The directive part, when the reply has one.
    pub directive: Option<String>,
}

/// How `user` replies to `response` (the randomness picks phrasings and whether an unhappy
/// reply carries a directive).
pub fn reply<R: Rng + ?Sized>(
    user: UserKind,
    response: &str,
    directive_rate: f64,
    rng: &mut R,
) -> UserReply {
    let problems = problems(user, response);
    let (complaints, praise): (&[&str], &[&str]) = match user {
        UserKind::Student => (&STUDENT_COMPLAINTS, &STUDENT_PRAISE),
        UserKind::Teacher => (&TEACHER_COMPLAINTS, &TEACHER_PRAISE),
    };
    if problems.is_empty() {
        return UserReply {
            text: praise.choose(rng).expect("non-empty").to_string(),
            satisfied: true,
            problems,
            directive: None,
        };
    }
    let complaint = complaints.choose(rng).expect("non-empty");
    let directive = directive(user, &problems).filter(|_| rng.random_bool(directive_rate));
    let text = match &directive {
        Some(d) => format!("{complaint} {DIRECTIVE_LEAD} {d} ."),
        None => complaint.to_string(),
    };
    UserReply {
        text,
        satisfied: false,
        problems,
        directive,
    }
}

/// The student and teacher as an environment over a fixed task set.
#[derive(Debug, Clone)]
pub struct PersonalEnv {
    tasks: Arc<Vec<Task>>,
    settings: UserSettings,
}

impl PersonalEnv {
    /// An environment over `tasks`.
    pub fn new(tasks: Vec<Task>, settings: UserSettings) -> Result<Self, PersonalEnvError> {
        if tasks.is_empty() {
            return Err(PersonalEnvError::NoTasks);
        }
        if !(0.0..=1.0).contains(&settings.directive_rate) {
            return Err(PersonalEnvError::DirectiveRate(settings.directive_rate));
        }
        if settings.max_turns == 0 {
            return Err(PersonalEnvError::MaxTurns);
        }
        Ok(Self {
            tasks: Arc::new(tasks),
            settings,
        })
    }

    /// `per_user` random tasks of each user from `split`, students first, drawn with `seed`.
    pub fn sample_tasks(split: Split, per_user: usize, seed: u64) -> Vec<Task> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        UserKind::ALL
            .iter()
            .flat_map(|&u| {
                (0..per_user)
                    .map(|_| Task::random(u, split, &mut rng))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The tasks.
    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }

    /// Starts an episode synchronously (what [`Environment::start`] does).
    pub fn episode(&self, index: usize, seed: u64) -> Result<PersonalEpisode, EnvError> {
        let task = self.tasks.get(index).ok_or(EnvError::NoSuchTask {
            index,
            count: self.tasks.len(),
        })?;
        let question = task.question();
        Ok(PersonalEpisode {
            id: task.id(),
            instruction: format!(
                "answer the {}'s message the way this {} likes",
                task.user.name(),
                task.user.name()
            ),
            user: task.user,
            messages: opening(&question),
            rng: ChaCha8Rng::seed_from_u64(seed),
            settings: self.settings.clone(),
            turns: 0,
            done: false,
        })
    }
}

impl Environment for PersonalEnv {
    fn kind(&self) -> &str {
        "personal"
    }

    fn task_count(&self) -> usize {
        self.tasks.len()
    }

    fn max_steps(&self) -> u32 {
        self.settings.max_turns
    }

    fn start(&self, index: usize, seed: u64) -> BoxFuture<'_, Result<Box<dyn Episode>, EnvError>> {
        let ep = self
            .episode(index, seed)
            .map(|e| Box::new(e) as Box<dyn Episode>);
        Box::pin(async move { ep })
    }
}

/// One conversation with a simulated user.
#[derive(Debug)]
pub struct PersonalEpisode {
    id: String,
    instruction: String,
    user: UserKind,
    messages: Vec<Value>,
    rng: ChaCha8Rng,
    settings: UserSettings,
    turns: u32,
    done: bool,
}

impl PersonalEpisode {
    /// Applies an action synchronously (what [`Episode::step`] does).
    pub fn apply(&mut self, action: &Action) -> Result<(StepOutcome, UserReply), EnvError> {
        if self.done {
            return Err(EnvError::Finished {
                task: self.id.clone(),
            });
        }
        self.messages
            .push(json!({"role": "assistant", "content": action.content}));
        let r = reply(
            self.user,
            &action.content,
            self.settings.directive_rate,
            &mut self.rng,
        );
        let next = json!({"role": "user", "content": r.text});
        self.messages.push(next.clone());
        self.turns += 1;
        self.done = r.satisfied || self.turns >= self.settings.max_turns;
        let outcome = StepOutcome {
            next_state: vec![next],
            done: self.done,
            outcome: None,
            info: json!({
                "user": self.user.name(),
                "satisfied": r.satisfied,
                "problems": r.problems,
                "directive": r.directive,
            }),
        };
        Ok((outcome, r))
    }
}

impl Episode for PersonalEpisode {
    fn task_id(&self) -> &str {
        &self.id
    }

    fn instruction(&self) -> &str {
        &self.instruction
    }

    fn observation(&self) -> Observation {
        Observation {
            messages: self.messages.clone(),
            ..Observation::default()
        }
    }

    fn step<'a>(&'a mut self, action: &'a Action) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        let out = self.apply(action).map(|(o, _)| o);
        Box::pin(async move { out })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn act(text: &str) -> Action {
        Action {
            content: text.into(),
            tool_calls: Vec::new(),
            raw: text.into(),
        }
    }

    #[test]
    fn replies_are_evaluative_and_directive() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let r = reply(
            UserKind::Student,
            "step 1 : add 2 and 3 . final answer : 5",
            1.0,
            &mut rng,
        );
        assert!(!r.satisfied);
        assert!(
            STUDENT_COMPLAINTS.iter().any(|c| r.text.starts_with(c)),
            "{}",
            r.text
        );
        assert!(
            r.text.ends_with(
                "next time : drop the final answer line , no numbered steps , keep it casual like a friend ."
            ),
            "{}",
            r.text
        );
        let r = reply(UserKind::Teacher, "great effort !", 1.0, &mut rng);
        assert_eq!(
            r.directive.as_deref(),
            Some("point to the exact step with the mistake")
        );
        let r = reply(UserKind::Teacher, "nice ! check step 2 .", 1.0, &mut rng);
        assert!(r.satisfied && r.directive.is_none() && TEACHER_PRAISE.contains(&r.text.as_str()));
        // Without directives an unhappy user only complains.
        let r = reply(UserKind::Student, "final answer : 5", 0.0, &mut rng);
        assert!(STUDENT_COMPLAINTS.contains(&r.text.as_str()));
    }

    #[tokio::test]
    async fn episodes_follow_the_environment_contract() {
        let tasks = PersonalEnv::sample_tasks(Split::Train, 2, 5);
        assert_eq!(tasks.len(), 4);
        let env = PersonalEnv::new(
            tasks,
            UserSettings {
                directive_rate: 1.0,
                max_turns: 2,
            },
        )
        .unwrap();
        assert_eq!(
            (env.kind(), env.task_count(), env.max_steps()),
            ("personal", 4, 2)
        );
        assert!(matches!(
            env.start(9, 0).await,
            Err(EnvError::NoSuchTask { index: 9, count: 4 })
        ));
        let mut ep = env.start(0, 1).await.unwrap();
        let obs = ep.observation();
        assert_eq!(obs.messages.len(), 2);
        assert_eq!(obs.messages[1]["role"], "user");
        let out = ep.step(&act("1 . add them . 2 . done .")).await.unwrap();
        assert!(!out.done && out.outcome.is_none());
        assert_eq!(out.next_state[0]["role"], "user");
        let obs = ep.observation();
        assert_eq!(obs.messages.len(), 4);
        assert_eq!(obs.messages[2]["role"], "assistant");
        let out = ep.step(&act("yeah its 5 lol")).await.unwrap();
        assert!(out.done);
        assert_eq!(out.info["satisfied"], true);
        assert!(matches!(
            ep.step(&act("again")).await,
            Err(EnvError::Finished { .. })
        ));
        ep.close().await;
        assert_eq!(
            PersonalEnv::new(Vec::new(), UserSettings::default()).unwrap_err(),
            PersonalEnvError::NoTasks
        );
    }
}
