//! The vote runner: `m` judge votes per setting, all concurrent, never stalling; aggregation; and
//! the judged-turn record.
//!
//! For a turn, the `m` evaluation votes and the `hint_m` hint votes are all started at once
//! (tokio futures joined together). Every vote is bounded by `vote_timeout_ms`; a backend error,
//! a timeout or text that does not parse is a failed vote, kept with its raw text and reason. A
//! turn whose every vote failed is recorded as unjudged with the reasons, reward 0, no hint.
//!
//! Aggregation: the personal turn reward is the majority of the valid evaluation votes (DESIGN
//! §1 fixes it); step judges aggregate by the configured rule (`step_aggregation`, default mean,
//! as the general-agent formula `Σ r_i / m` reads). Hint choice is [`crate::rl::select_hint`].

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::backend::{BackendError, ChatMessage, JudgeBackend, JudgeRequest, SamplingParams};
use super::parse::{parse_hint, parse_vote};
use super::prompt::{Material, PromptKind, PromptSet, StepMaterial, TurnMaterial};
use crate::rl::{aggregate, majority_vote, select_hint, Aggregation};

/// How many votes to take and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VoteSettings {
    /// Evaluation votes per turn or step (`m`); 0 disables binary judging.
    pub m: usize,
    /// Hint votes per turn; 0 disables OPD.
    pub hint_m: usize,
    /// Sampling temperature of every vote.
    pub temperature: f32,
    /// Nucleus mass of every vote.
    pub top_p: f32,
    /// Maximum tokens of an evaluation vote's answer (a thinking judge needs room: cut off, it
    /// is a failed vote).
    pub max_tokens: u32,
    /// Maximum tokens of a hint vote's answer (it writes a hint after its reasoning).
    pub hint_max_tokens: u32,
    /// Aggregation of step-judge votes.
    pub step_aggregation: Aggregation,
    /// Time limit of one vote (all retries included), in milliseconds.
    pub vote_timeout_ms: u64,
    /// Base of the per-vote seeds sent to backends that honour one (`None`: no seed).
    pub seed: Option<u64>,
}

impl Default for VoteSettings {
    fn default() -> Self {
        Self {
            m: 3,
            hint_m: 3,
            temperature: 0.6,
            top_p: 1.0,
            max_tokens: 4096,
            hint_max_tokens: 8192,
            step_aggregation: Aggregation::Mean,
            vote_timeout_ms: 180_000,
            seed: None,
        }
    }
}

/// Errors validating [`VoteSettings`].
#[derive(Debug, Error, PartialEq)]
pub enum VoteSettingsError {
    /// A setting out of range.
    #[error("judge.votes.{key} = {value} is invalid: {why}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// Its value.
        value: String,
        /// The rule.
        why: &'static str,
    },
}

impl VoteSettings {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), VoteSettingsError> {
        let bad = |key, value: String, why| Err(VoteSettingsError::Invalid { key, value, why });
        if self.m == 0 && self.hint_m == 0 {
            return bad("m", "0".into(), "m and hint_m cannot both be 0");
        }
        if self.m > 64 || self.hint_m > 64 {
            return bad(
                "m",
                format!("{}/{}", self.m, self.hint_m),
                "at most 64 votes per setting",
            );
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                self.temperature.to_string(),
                "must be finite and >= 0",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p.to_string(), "must be in (0, 1]");
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "0".into(), "must be > 0");
        }
        if self.hint_max_tokens == 0 {
            return bad("hint_max_tokens", "0".into(), "must be > 0");
        }
        if self.vote_timeout_ms == 0 {
            return bad("vote_timeout_ms", "0".into(), "must be > 0");
        }
        Ok(())
    }
}

/// Whether a vote was an evaluation vote or a hint vote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VoteKind {
    /// Evaluation (binary / step score).
    Eval,
    /// OPD hint.
    Hint,
}

/// One vote as recorded: its score (`None` when failed), hint, raw text and failure reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteRecord {
    /// Evaluation or hint vote.
    pub kind: VoteKind,
    /// The parsed score; `None` for a failed vote.
    pub score: Option<i8>,
    /// The parsed hint (hint votes only).
    pub hint: Option<String>,
    /// The judge's raw text (empty when the backend gave none).
    pub raw: String,
    /// Why the vote failed, if it did.
    pub error: Option<String>,
    /// The answer was cut off at the vote's `max_tokens` (it counts when it parses anyway).
    #[serde(default)]
    pub truncated: bool,
}

/// The judgement of one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnJudgement {
    /// Evaluation votes, in vote order.
    pub votes: Vec<VoteRecord>,
    /// Hint votes, in vote order.
    pub hint_votes: Vec<VoteRecord>,
    /// The majority reward (`0` on a tie, with no valid vote, or when unjudged).
    pub reward: i8,
    /// The accepted hint, if any.
    pub hint: Option<String>,
    /// Set when every vote failed: the distinct reasons.
    pub unjudged: Option<String>,
}

/// The judgement of one step of a general agent.
#[derive(Debug, Clone, PartialEq)]
pub struct StepJudgement {
    /// The votes, in order.
    pub votes: Vec<VoteRecord>,
    /// The aggregated process score (`0` with no valid vote).
    pub score: f64,
    /// Set when every vote failed: the distinct reasons.
    pub unjudged: Option<String>,
}

/// The JSONL record of one judged turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgedTurnRecord {
    /// The session.
    pub session_id: String,
    /// The turn within the session.
    pub turn: u64,
    /// Every vote (evaluation then hint), with raw text.
    pub votes: Vec<VoteRecord>,
    /// The reward.
    pub reward: i8,
    /// Whether a hint was accepted.
    pub hint_accepted: bool,
    /// The accepted hint.
    pub hint: Option<String>,
    /// The teacher's weight version used for OPD, when a teacher scored the turn.
    pub teacher_version: Option<u64>,
    /// Why the turn is unjudged, when it is.
    pub unjudged: Option<String>,
}

impl TurnJudgement {
    /// The record of this judgement.
    pub fn record(
        &self,
        session_id: &str,
        turn: u64,
        teacher_version: Option<u64>,
    ) -> JudgedTurnRecord {
        JudgedTurnRecord {
            session_id: session_id.to_string(),
            turn,
            votes: self.votes.iter().chain(&self.hint_votes).cloned().collect(),
            reward: self.reward,
            hint_accepted: self.hint.is_some(),
            hint: self.hint.clone(),
            teacher_version,
            unjudged: self.unjudged.clone(),
        }
    }
}

impl JudgedTurnRecord {
    /// One JSON line (without the newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("records serialize")
    }
}

/// Runs judge votes against one backend with one prompt set.
#[derive(Clone)]
pub struct Judge {
    backend: Arc<dyn JudgeBackend>,
    prompts: Arc<PromptSet>,
    settings: VoteSettings,
}

impl std::fmt::Debug for Judge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Judge")
            .field("backend", &self.backend.name())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Judge {
    /// A judge; `settings` are validated.
    pub fn new(
        backend: Arc<dyn JudgeBackend>,
        prompts: Arc<PromptSet>,
        settings: VoteSettings,
    ) -> Result<Self, VoteSettingsError> {
        settings.validate()?;
        Ok(Self {
            backend,
            prompts,
            settings,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &VoteSettings {
        &self.settings
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    /// Judges one personal-agent turn: `m` evaluation votes and, when `with_hint`, `hint_m` hint
    /// votes, all concurrently.
    pub async fn judge_turn(&self, material: TurnMaterial, with_hint: bool) -> TurnJudgement {
        let material = Material::Turn(material);
        let hint_m = if with_hint { self.settings.hint_m } else { 0 };
        let (votes, hint_votes) = futures::join!(
            self.run_votes(PromptKind::PersonalEval, &material, self.settings.m),
            self.run_votes(PromptKind::Hint, &material, hint_m),
        );
        let scores: Vec<Option<i8>> = votes.iter().map(|v| v.score).collect();
        let hint = select_hint(hint_votes.iter().map(|v| (v.score, v.hint.as_deref())));
        let unjudged = all_failed(votes.iter().chain(&hint_votes));
        TurnJudgement {
            reward: majority_vote(&scores),
            votes,
            hint_votes,
            hint,
            unjudged,
        }
    }

    /// Judges one step of a general agent with the step prompt of `kind` (a step kind).
    pub async fn judge_step(&self, kind: PromptKind, material: StepMaterial) -> StepJudgement {
        let votes = self
            .run_votes(kind, &Material::Step(material), self.settings.m.max(1))
            .await;
        let scores: Vec<Option<i8>> = votes.iter().map(|v| v.score).collect();
        let score = aggregate(&scores, self.settings.step_aggregation);
        let unjudged = all_failed(votes.iter());
        StepJudgement {
            votes,
            score,
            unjudged,
        }
    }

    async fn run_votes(&self, kind: PromptKind, material: &Material, n: usize) -> Vec<VoteRecord> {
        if n == 0 {
            return Vec::new();
        }
        let vote_kind = if kind == PromptKind::Hint {
            VoteKind::Hint
        } else {
            VoteKind::Eval
        };
        let failed = |raw: String, error: String| VoteRecord {
            kind: vote_kind,
            score: None,
            hint: None,
            raw,
            error: Some(error),
            truncated: false,
        };
        let content = match self.prompts.render(kind, material) {
            Ok(c) => c,
            Err(e) => {
                return (0..n)
                    .map(|_| failed(String::new(), e.to_string()))
                    .collect()
            }
        };
        let timeout = Duration::from_millis(self.settings.vote_timeout_ms);
        let requests: Vec<JudgeRequest> = (0..n as u32)
            .map(|i| JudgeRequest {
                kind,
                material: material.clone(),
                messages: vec![ChatMessage::user(content.clone())],
                params: SamplingParams {
                    temperature: self.settings.temperature,
                    top_p: self.settings.top_p,
                    max_tokens: match vote_kind {
                        VoteKind::Eval => self.settings.max_tokens,
                        VoteKind::Hint => self.settings.hint_max_tokens,
                    },
                    seed: self.settings.seed.map(|s| s.wrapping_add(i as u64)),
                },
                vote_index: i,
            })
            .collect();
        join_all(requests.iter().map(|req| async move {
            let raw = match tokio::time::timeout(timeout, self.backend.complete(req)).await {
                Err(_) => {
                    return failed(
                        String::new(),
                        format!("vote timed out after {} ms", timeout.as_millis()),
                    )
                }
                Ok(Err(BackendError::Truncated { max_tokens, text })) => {
                    let vote = match parse_vote(&text, kind.allowed_scores()) {
                        Err(e) => {
                            failed(text, format!("truncated at max_tokens = {max_tokens}: {e}"))
                        }
                        Ok(score) => VoteRecord {
                            kind: vote_kind,
                            score: Some(score),
                            hint: (vote_kind == VoteKind::Hint)
                                .then(|| parse_hint(&text))
                                .flatten(),
                            raw: text,
                            error: None,
                            truncated: false,
                        },
                    };
                    return VoteRecord {
                        truncated: true,
                        ..vote
                    };
                }
                Ok(Err(e)) => return failed(String::new(), e.to_string()),
                Ok(Ok(raw)) => raw,
            };
            match parse_vote(&raw, kind.allowed_scores()) {
                Err(e) => failed(raw, e.to_string()),
                Ok(score) => {
                    let hint = if vote_kind == VoteKind::Hint {
                        parse_hint(&raw)
                    } else {
                        None
                    };
                    VoteRecord {
                        kind: vote_kind,
                        score: Some(score),
                        hint,
                        raw,
                        error: None,
                        truncated: false,
                    }
                }
            }
        }))
        .await
    }
}

fn all_failed<'a>(votes: impl Iterator<Item = &'a VoteRecord>) -> Option<String> {
    let mut reasons: Vec<&str> = Vec::new();
    let mut any = false;
    for v in votes {
        any = true;
        match &v.error {
            None => return None,
            Some(e) if !reasons.contains(&e.as_str()) => reasons.push(e),
            Some(_) => {}
        }
    }
    any.then(|| format!("every judge vote failed: {}", reasons.join("; ")))
}
