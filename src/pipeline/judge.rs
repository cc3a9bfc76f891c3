//! The judge as the `PrmVoter` uses it: [`crate::judge::Judge`] behind the actors' [`TurnJudge`]
//! trait.
//!
//! Per-turn methods (`binary`, `opd`, `combined`) judge `(a_t, s_{t+1})` with the personal
//! evaluation prompt (`m` votes) and, when the method has an OPD term, the hint prompt
//! (`hint_m` votes), all concurrently; the record is the judged-turn record of `judge::votes`. `stepwise`
//! judges each step with the step prompt of the environment's kind; its reward is the aggregated
//! process score. A turn without a next state is not sent to the judge: it is recorded as
//! unjudged ("no next state"), as docs/design.md §1 excludes it from the loss.

use clawrl_actors::loops::{BoxFuture, Judgement, Turn, TurnJudge};
use serde_json::{json, Value};

use crate::job::MethodKind;
use crate::judge::{Judge, PromptKind, StepMaterial, StepMessage, TurnMaterial, VoteRecord};

/// Most characters of the history summary a step judge reads.
const HISTORY_CHARS: usize = 4000;

/// The judge adapter.
pub struct PipelineJudge {
    judge: Judge,
    method: MethodKind,
    step_prompt: PromptKind,
}

impl PipelineJudge {
    /// Judges for `method`; `step_prompt` is the step kind `stepwise` uses.
    pub fn new(judge: Judge, method: MethodKind, step_prompt: PromptKind) -> Self {
        PipelineJudge {
            judge,
            method,
            step_prompt,
        }
    }
}

/// The text of a message's content (strings as they are; parts' `text` joined).
pub fn content_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The next state as the judge reads it: each message's text, joined; and the role of the last.
pub fn next_state_text(next_state: &[Value]) -> (String, String) {
    let text = next_state
        .iter()
        .map(content_text)
        .collect::<Vec<_>>()
        .join("\n\n");
    let role = next_state
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        .unwrap_or("user")
        .to_string();
    (text, role)
}

/// The episode's messages before the step, as text.
fn step_messages(turn: &Turn) -> Vec<StepMessage> {
    turn.observation
        .messages
        .iter()
        .map(|m| StepMessage {
            role: m
                .get("role")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            content: content_text(m),
        })
        .collect()
}

/// The history summary: `role: text` lines of `messages`, the oldest dropped until it fits
/// [`HISTORY_CHARS`].
fn history(messages: &[StepMessage]) -> String {
    let mut lines: Vec<String> = messages
        .iter()
        .map(|m| format!("{}: {}", m.role, m.content))
        .collect();
    let mut total: usize = lines.iter().map(|l| l.len() + 1).sum();
    while total > HISTORY_CHARS && lines.len() > 1 {
        total -= lines[0].len() + 1;
        lines.remove(0);
    }
    lines.join("\n")
}

impl TurnJudge for PipelineJudge {
    fn judge<'a>(&'a self, turn: &'a Turn) -> BoxFuture<'a, Result<Judgement, String>> {
        Box::pin(async move {
            if turn.outcome.next_state.is_empty() {
                return Ok(Judgement::unjudged(turn, "no next state"));
            }
            let (next_state, role) = next_state_text(&turn.outcome.next_state);
            if self.method == MethodKind::Stepwise {
                let messages = step_messages(turn);
                let j = self
                    .judge
                    .judge_step(
                        self.step_prompt,
                        StepMaterial {
                            task: turn.instruction.clone(),
                            history: history(&messages),
                            step_index: turn.turn,
                            step: turn.policy.response_text.clone(),
                            result: next_state,
                            results: turn.outcome.next_state.iter().map(content_text).collect(),
                            messages,
                        },
                    )
                    .await;
                let record = json!({
                    "session_id": turn.session_id,
                    "turn": turn.turn,
                    "votes": j.votes,
                    "reward": j.score,
                    "hint_accepted": false,
                    "hint": null,
                    "teacher_version": null,
                    "unjudged": j.unjudged,
                });
                let (failed_votes, truncated_votes) = vote_failures(&j.votes);
                return Ok(Judgement {
                    reward: j.score,
                    hint: None,
                    unjudged: j.unjudged,
                    failed_votes,
                    truncated_votes,
                    record,
                });
            }
            let j = self
                .judge
                .judge_turn(
                    TurnMaterial {
                        response: turn.policy.response_text.clone(),
                        next_state,
                        next_state_role: role,
                    },
                    self.method.uses_hints(),
                )
                .await;
            let record = serde_json::to_value(j.record(&turn.session_id, turn.turn as u64, None))
                .map_err(|e| format!("serializing the judge record: {e}"))?;
            let (failed_votes, truncated_votes) =
                vote_failures(j.votes.iter().chain(&j.hint_votes));
            Ok(Judgement {
                reward: j.reward as f64,
                hint: j.hint,
                unjudged: j.unjudged,
                failed_votes,
                truncated_votes,
                record,
            })
        })
    }
}

/// `(failed, truncated and failed)` among `votes`.
fn vote_failures<'a>(votes: impl IntoIterator<Item = &'a VoteRecord>) -> (u32, u32) {
    votes
        .into_iter()
        .filter(|v| v.error.is_some())
        .fold((0, 0), |(f, t), v| (f + 1, t + u32::from(v.truncated)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::VoteKind;

    #[test]
    fn failed_and_truncated_votes_are_counted() {
        let vote = |score: Option<i8>, truncated: bool| VoteRecord {
            kind: VoteKind::Eval,
            score,
            hint: None,
            raw: String::new(),
            error: score.is_none().then(|| "failed".to_string()),
            truncated,
        };
        // A truncated answer that still parsed is not a failure.
        let votes = [
            vote(Some(1), true),
            vote(None, true),
            vote(None, false),
            vote(Some(-1), false),
        ];
        assert_eq!(vote_failures(&votes), (2, 1));
    }
}
