//! The `scripted` environment: simulated users that answer with fixed replies, for tests, demos
//! and pipeline benchmarks.
//!
//! A task set is a JSONL file, one task a line: `{"id": "...", "instruction": "...", "replies":
//! ["...", ...]}` (optionally `"system": "..."`). An episode starts with the instruction as the
//! user's message (after the system prompt, when given); the policy's `t`-th action is answered
//! with `replies[t]` as the next user message, which is the turn's next state `s_{t+1}`. The
//! episode is done after the last reply, so a task with `n` replies has `n` turns. There is no
//! verifiable outcome (`outcome` is always `None`): the PRM judge alone scores turns, as for a
//! personal agent.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clawrl_actors::loops::{
    Action, BoxFuture, EnvError, Environment, Episode, Observation, StepOutcome,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::exec::assistant_message;
use super::EnvKind;

/// One scripted task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedTask {
    /// Stable id.
    pub id: String,
    /// The user's first message.
    pub instruction: String,
    /// The user's replies, one per policy turn (at least one).
    pub replies: Vec<String>,
    /// An optional system prompt.
    #[serde(default)]
    pub system: Option<String>,
}

/// Why a task set could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ScriptedEnvError {
    /// The file could not be read.
    #[error("scripted tasks {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// A line is not a valid task.
    #[error("scripted tasks {path}, line {line}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The file holds no task.
    #[error("scripted tasks {0}: no tasks")]
    Empty(PathBuf),
}

/// A scripted task set.
#[derive(Clone, Debug)]
pub struct ScriptedEnv {
    tasks: Arc<Vec<ScriptedTask>>,
    max_steps: u32,
}

impl ScriptedEnv {
    /// A task set from tasks in memory (each must have an id and at least one reply).
    pub fn new(tasks: Vec<ScriptedTask>) -> Result<Self, String> {
        if tasks.is_empty() {
            return Err("no tasks".into());
        }
        for (i, t) in tasks.iter().enumerate() {
            validate(t).map_err(|m| format!("task {i}: {m}"))?;
        }
        let max_steps = tasks.iter().map(|t| t.replies.len()).max().unwrap_or(1) as u32;
        Ok(ScriptedEnv {
            tasks: Arc::new(tasks),
            max_steps,
        })
    }

    /// Loads a JSONL task file (blank lines are skipped).
    pub fn load(path: &Path) -> Result<Self, ScriptedEnvError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScriptedEnvError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut tasks = Vec::new();
        let mut ids = std::collections::HashSet::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let invalid = |message: String| ScriptedEnvError::Invalid {
                path: path.to_path_buf(),
                line: i + 1,
                message,
            };
            let task: ScriptedTask =
                serde_json::from_str(line).map_err(|e| invalid(e.to_string()))?;
            validate(&task).map_err(invalid)?;
            if !ids.insert(task.id.clone()) {
                return Err(invalid(format!("duplicate task id `{}`", task.id)));
            }
            tasks.push(task);
        }
        if tasks.is_empty() {
            return Err(ScriptedEnvError::Empty(path.to_path_buf()));
        }
        Ok(ScriptedEnv::new(tasks).expect("validated above"))
    }

    /// The tasks.
    pub fn tasks(&self) -> &[ScriptedTask] {
        &self.tasks
    }
}

fn validate(t: &ScriptedTask) -> Result<(), String> {
    if t.id.trim().is_empty() {
        return Err("`id` must not be empty".into());
    }
    if t.replies.is_empty() {
        return Err(format!(
            "task `{}`: `replies` must hold at least one reply",
            t.id
        ));
    }
    Ok(())
}

impl Environment for ScriptedEnv {
    fn kind(&self) -> &str {
        EnvKind::Scripted.name()
    }

    fn task_count(&self) -> usize {
        self.tasks.len()
    }

    fn max_steps(&self) -> u32 {
        self.max_steps
    }

    fn start(&self, index: usize, _seed: u64) -> BoxFuture<'_, Result<Box<dyn Episode>, EnvError>> {
        Box::pin(async move {
            let task = self.tasks.get(index).ok_or(EnvError::NoSuchTask {
                index,
                count: self.tasks.len(),
            })?;
            let mut messages = Vec::new();
            if let Some(s) = &task.system {
                messages.push(json!({"role": "system", "content": s}));
            }
            messages.push(json!({"role": "user", "content": task.instruction}));
            Ok(Box::new(ScriptedEpisode {
                task: task.clone(),
                messages,
                step: 0,
            }) as Box<dyn Episode>)
        })
    }
}

/// One scripted conversation.
struct ScriptedEpisode {
    task: ScriptedTask,
    messages: Vec<Value>,
    step: usize,
}

impl Episode for ScriptedEpisode {
    fn task_id(&self) -> &str {
        &self.task.id
    }

    fn instruction(&self) -> &str {
        &self.task.instruction
    }

    fn observation(&self) -> Observation {
        Observation {
            messages: self.messages.clone(),
            ..Observation::default()
        }
    }

    fn step<'a>(&'a mut self, action: &'a Action) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        Box::pin(async move {
            let Some(reply) = self.task.replies.get(self.step) else {
                return Err(EnvError::Finished {
                    task: self.task.id.clone(),
                });
            };
            let user = json!({"role": "user", "content": reply});
            self.messages.push(assistant_message(action));
            self.messages.push(user.clone());
            self.step += 1;
            Ok(StepOutcome {
                next_state: vec![user],
                done: self.step >= self.task.replies.len(),
                outcome: None,
                info: json!({"step": self.step}),
            })
        })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tasks() -> Vec<ScriptedTask> {
        vec![ScriptedTask {
            id: "t0".into(),
            instruction: "say hi".into(),
            replies: vec!["wrong, again".into(), "thanks".into()],
            system: Some("be nice".into()),
        }]
    }

    #[tokio::test]
    async fn an_episode_answers_each_action_with_the_next_reply_then_ends() {
        let env = ScriptedEnv::new(tasks()).unwrap();
        assert_eq!(
            (env.kind(), env.task_count(), env.max_steps()),
            ("scripted", 1, 2)
        );
        let mut ep = env.start(0, 1).await.unwrap();
        assert_eq!(ep.observation().messages.len(), 2);
        let a = Action {
            content: "hello".into(),
            tool_calls: vec![],
            raw: "hello".into(),
        };
        let o = ep.step(&a).await.unwrap();
        assert!(!o.done);
        assert_eq!(o.next_state[0]["content"], "wrong, again");
        let obs = ep.observation();
        assert_eq!(
            obs.messages[2],
            json!({"role": "assistant", "content": "hello"})
        );
        assert_eq!(obs.messages[3]["role"], "user");
        let o = ep.step(&a).await.unwrap();
        assert!(o.done && o.outcome.is_none());
        assert!(matches!(ep.step(&a).await, Err(EnvError::Finished { .. })));
        ep.close().await;
        assert!(matches!(
            env.start(5, 0).await.err(),
            Some(EnvError::NoSuchTask { index: 5, count: 1 })
        ));
    }

    #[test]
    fn bad_task_files_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"instruction\":\"x\",\"replies\":[\"y\"]}\n\n{\"id\":\"b\",\"instruction\":\"x\",\"replies\":[]}\n",
        )
        .unwrap();
        let e = ScriptedEnv::load(&p).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("replies"), "{e}");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"instruction\":\"x\",\"replies\":[\"y\"],\"extra\":1}\n",
        )
        .unwrap();
        let e = ScriptedEnv::load(&p).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("extra"), "{e}");
        std::fs::write(&p, "\n").unwrap();
        assert!(matches!(
            ScriptedEnv::load(&p),
            Err(ScriptedEnvError::Empty(_))
        ));
    }
}
