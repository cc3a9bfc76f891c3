//! Training samples from judged episodes, per method (docs/design.md §1), and the OPD teacher.
//!
//! - `binary`: [`crate::rl::binary_samples`] picks the turns of an episode (next state and
//!   reward ±1, else the session's first turn with a next state, "at least one"); every response
//!   token gets the reward.
//! - `opd`: a turn with an accepted hint gets `w_opd · (teacher_k − old_k)`; others give nothing.
//! - `combined`: the four cases of [`crate::rl::CombineCase`]: the binary term `w_binary · r`
//!   per token plus, with an accepted hint, the OPD term.
//! - `stepwise`: each step's reward is [`crate::rl::step_reward`] of the episode outcome and the
//!   step's process score (0 for a step without a next state) times `method.w_process`; rewards
//!   are z-scored in (group, step index) buckets over the episodes of one GRPO group, which the
//!   job builds together ([`crate::rl::zscore_buckets`]). Steps without a next state are left
//!   out, except the final step of an episode that ended with an outcome (a final answer), which
//!   is rewarded with the outcome alone.
//!
//! The teacher is a rollout worker over [`TeacherScorer`]: its "generation" is scoring the
//! original response under `s_enhanced` with [`crate::judge::TeacherModel`] (the hint on the last
//! user message, re-rendered with the same template and tools). When the teacher is the current
//! policy, the trainer's new versions are installed on it like on any replica (without pausing);
//! a frozen teacher keeps version 0. `old_k` is the trainer's own log-prob before the update (at
//! temperature 1, like the teacher), so a sample carries the teacher's log-probs
//! ([`OpdTerm`]) and the trainer computes the term; the rollout's log-probs are tempered and
//! maybe from an older version. With `method.opd_loss = "topk"` the teacher also returns its
//! top-k tokens and log-probs at every response position, and the sample carries them
//! ([`clawrl_actors::loops::TeacherTopK`], `k × 2` numbers per token) for the trainer's top-k loss. Every sample
//! carries the version of its tokens.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use clawrl_actors::loops::{
    BoxFuture, Built, EndReason, EpisodeTurns, OpdTerm, PolicyReplica, RolloutMsg, SampleBuilder,
    TrainSample,
};
use ractor::ActorRef;

use crate::job::MethodKind;
use crate::judge::{TeacherError, TeacherModel, TeacherScore};
use crate::model::{ChatTemplate, Qwen3, Qwen3Config};
use crate::rl::{
    binary_samples, step_reward, zscore_buckets, AdvantageWeights, BinaryTurn, CombineCase,
    EpisodeKind, StepSample,
};
use crate::serve::{VersionLoadError, VersionWeights};
use crate::CpuBackend;

/// One teacher scoring request: the original messages and tools of `s_t`, the hint, and the
/// response ids to score.
pub struct TeacherRequest {
    /// `s_t` as chat messages.
    pub messages: Vec<serde_json::Value>,
    /// The tools `s_t` was rendered with.
    pub tools: Vec<serde_json::Value>,
    /// The extra template variables `s_t` was rendered with.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The accepted hint.
    pub hint: String,
    /// The response `a_t`.
    pub response_ids: Vec<u32>,
}

/// Why the teacher could not score.
#[derive(Debug, thiserror::Error)]
pub enum TeacherScoreError {
    /// Building or scoring `s_enhanced` failed.
    #[error(transparent)]
    Teacher(#[from] TeacherError),
    /// The scoring task died.
    #[error("the teacher's scoring task failed: {0}")]
    Task(String),
}

/// The OPD teacher as a policy replica: versions load like the policy's, "generation" scores
/// (with the top-k at every response position when `topk` is set).
pub struct TeacherScorer {
    config: Qwen3Config,
    weights: VersionWeights<CpuBackend>,
    template: Arc<ChatTemplate>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    topk: Option<usize>,
}

impl TeacherScorer {
    /// A teacher reading weight blobs as `weights` says under `config` (the learner's export
    /// config); with `topk = Some(k)` each score also carries the teacher's top-k
    /// (`1 ≤ k ≤ vocab`).
    pub fn new(
        config: Qwen3Config,
        weights: VersionWeights<CpuBackend>,
        template: Arc<ChatTemplate>,
        tokenizer: Arc<tokenizers::Tokenizer>,
        topk: Option<usize>,
    ) -> Self {
        TeacherScorer {
            config,
            weights,
            template,
            tokenizer,
            topk,
        }
    }
}

impl PolicyReplica for TeacherScorer {
    type Request = TeacherRequest;
    type Output = TeacherScore;
    type GenerateError = TeacherScoreError;
    type Loaded = Qwen3<CpuBackend>;
    type LoadError = VersionLoadError;

    fn load(&self, version: u64, weights: &Bytes) -> Result<Qwen3<CpuBackend>, VersionLoadError> {
        self.weights
            .model(&self.config, version, weights, &Default::default())
    }

    async fn generate(
        &self,
        loaded: Arc<Qwen3<CpuBackend>>,
        request: TeacherRequest,
    ) -> Result<TeacherScore, TeacherScoreError> {
        let template = self.template.clone();
        let tokenizer = self.tokenizer.clone();
        let topk = self.topk;
        tokio::task::spawn_blocking(move || {
            let teacher = TeacherModel {
                model: &loaded,
                template: &template,
                tokenizer: &tokenizer,
            };
            let messages = minijinja::Value::from_serialize(&request.messages);
            let tools = (!request.tools.is_empty())
                .then(|| minijinja::Value::from_serialize(&request.tools));
            teacher
                .score(
                    &messages,
                    tools.as_ref(),
                    &request.template_kwargs,
                    &request.hint,
                    &request.response_ids,
                    topk,
                )
                .map_err(TeacherScoreError::from)
        })
        .await
        .map_err(|e| TeacherScoreError::Task(e.to_string()))?
    }
}

/// A rollout worker over the teacher.
pub type TeacherWorker = ActorRef<RolloutMsg<TeacherScorer>>;

/// The sample builder of a job.
pub struct MethodBuilder {
    job: String,
    method: MethodKind,
    weights: AdvantageWeights,
    teacher: Option<TeacherWorker>,
    step_kind: EpisodeKind,
    /// Step-wise: the weight of a step's process score in its reward.
    w_process: f64,
    timeout: Duration,
}

impl MethodBuilder {
    /// A builder for `method`. `teacher` is required for `opd` and `combined`.
    pub fn new(
        job: impl Into<String>,
        method: MethodKind,
        weights: AdvantageWeights,
        teacher: Option<TeacherWorker>,
        step_kind: EpisodeKind,
    ) -> Result<Self, String> {
        if method.uses_hints() && teacher.is_none() {
            return Err(format!("method `{}` needs an OPD teacher", method.name()));
        }
        Ok(MethodBuilder {
            job: job.into(),
            method,
            weights,
            teacher,
            step_kind,
            w_process: 1.0,
            timeout: Duration::from_secs(600),
        })
    }

    /// Step-wise: each step's reward takes `w` times its process score (default 1; 0: the
    /// outcome alone).
    pub fn with_process_weight(mut self, w: f64) -> Self {
        self.w_process = w;
        self
    }
}

fn sample(job: &str, jt: &clawrl_actors::loops::JudgedTurn, advantages: Vec<f32>) -> TrainSample {
    with_opd(job, jt, advantages, None)
}

/// A sample whose OPD term (if any) the trainer resolves with its own old log-probs.
fn with_opd(
    job: &str,
    jt: &clawrl_actors::loops::JudgedTurn,
    advantages: Vec<f32>,
    opd: Option<OpdTerm>,
) -> TrainSample {
    let t = &jt.turn;
    TrainSample {
        job: job.to_string(),
        session_id: t.session_id.clone(),
        turn: t.turn,
        version: t.policy.version,
        prompt_ids: t.policy.prompt_ids.clone(),
        response_ids: t.policy.response_ids.clone(),
        advantages,
        rollout_logprobs: Some(t.policy.logprobs.clone()),
        opd,
    }
}

/// The reward term a turn's judgement gives (`-1`, `0`, `1`; unjudged turns give 0).
fn reward_of(jt: &clawrl_actors::loops::JudgedTurn) -> i8 {
    if jt.judgement.unjudged.is_some() || jt.turn.outcome.next_state.is_empty() {
        0
    } else {
        jt.judgement.reward.round().clamp(-1.0, 1.0) as i8
    }
}

async fn teacher_score(
    teacher: &TeacherWorker,
    jt: &clawrl_actors::loops::JudgedTurn,
    hint: &str,
    timeout: Duration,
) -> Result<(u64, TeacherScore), String> {
    let t = &jt.turn;
    let request = TeacherRequest {
        messages: t.observation.messages.clone(),
        tools: t.observation.tools.clone(),
        template_kwargs: t.observation.template_kwargs.clone(),
        hint: hint.to_string(),
        response_ids: t.policy.response_ids.clone(),
    };
    match teacher
        .call(|port| RolloutMsg::Generate(request, port), Some(timeout))
        .await
    {
        Ok(ractor::rpc::CallResult::Success(Ok(g))) => Ok((g.version, g.output)),
        Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(e.to_string()),
        Ok(other) => Err(format!("the teacher did not answer: {other:?}")),
        Err(e) => Err(format!("the teacher is gone: {e}")),
    }
}

impl MethodBuilder {
    async fn build_episodes(
        &self,
        episodes: &[EpisodeTurns],
    ) -> Result<Built<TrainSample>, String> {
        let mut samples = Vec::new();
        let mut teacher_versions = HashMap::new();
        match self.method {
            MethodKind::Binary => {
                for ep in episodes {
                    let turns: Vec<BinaryTurn> = ep
                        .turns
                        .iter()
                        .map(|jt| BinaryTurn {
                            session_id: jt.turn.session_id.clone(),
                            turn: jt.turn.turn as u64,
                            has_next_state: !jt.turn.outcome.next_state.is_empty(),
                            reward: reward_of(jt),
                        })
                        .collect();
                    for b in binary_samples(&turns) {
                        let jt = &ep.turns[b.index];
                        let adv = self.weights.w_binary * b.advantage;
                        samples.push(sample(
                            &self.job,
                            jt,
                            vec![adv; jt.turn.policy.response_ids.len()],
                        ));
                    }
                }
            }
            MethodKind::Opd | MethodKind::Combined => {
                let teacher = self.teacher.as_ref().expect("checked in new");
                for ep in episodes {
                    for jt in &ep.turns {
                        let n = jt.turn.policy.response_ids.len();
                        if n == 0 {
                            continue;
                        }
                        let reward = if self.method == MethodKind::Combined {
                            reward_of(jt)
                        } else {
                            0
                        };
                        let teacher_score = match jt.judgement.hint.as_deref() {
                            Some(h) => {
                                let (v, score) =
                                    teacher_score(teacher, jt, h, self.timeout).await?;
                                teacher_versions
                                    .insert((jt.turn.session_id.clone(), jt.turn.turn), v);
                                Some(score)
                            }
                            None => None,
                        };
                        let w_binary = if self.method == MethodKind::Opd {
                            0.0
                        } else {
                            self.weights.w_binary
                        };
                        // The binary term is known here; the OPD term needs the trainer's old
                        // log-probs, so it travels as the teacher's log-probs.
                        if CombineCase::of(reward, teacher_score.is_some()) == CombineCase::Neither
                        {
                            continue;
                        }
                        if let Some(t) = &teacher_score {
                            let who =
                                format!("session {} turn {}", jt.turn.session_id, jt.turn.turn);
                            if t.logprobs.len() != n {
                                return Err(format!(
                                    "{who}: the teacher scored {} tokens of {n}",
                                    t.logprobs.len()
                                ));
                            }
                            if let Some(top) = &t.topk {
                                top.check(n)
                                    .map_err(|e| format!("{who}: the teacher's top-k: {e}"))?;
                            }
                        }
                        let opd = teacher_score.map(|t| OpdTerm {
                            weight: self.weights.w_opd,
                            teacher_logprobs: t.logprobs,
                            topk: t.topk,
                        });
                        let base = vec![w_binary * reward as f32; n];
                        samples.push(with_opd(&self.job, jt, base, opd));
                    }
                }
            }
            MethodKind::Stepwise => {
                let mut steps = Vec::new();
                let mut refs = Vec::new();
                for ep in episodes {
                    let has_outcome = matches!(ep.reason, EndReason::Done { outcome: Some(_) });
                    let o = match ep.reason {
                        EndReason::Done { outcome: Some(o) } => o,
                        _ => match self.step_kind {
                            // No verifiable outcome: a failed pass for the ±1 kinds.
                            EpisodeKind::Terminal | EpisodeKind::Gui | EpisodeKind::Swe => -1.0,
                            _ => 0.0,
                        },
                    };
                    let o = match self.step_kind {
                        // These formulas take the outcome in [0, 1]; environments give [-1, 1].
                        EpisodeKind::Terminal | EpisodeKind::Gui | EpisodeKind::Swe => {
                            ((o + 1.0) / 2.0).clamp(0.0, 1.0)
                        }
                        _ => o,
                    };
                    let last = ep.turns.len().saturating_sub(1);
                    for (i, jt) in ep.turns.iter().enumerate() {
                        // A step without a next state has no process score; it is still a step
                        // of the episode when it is the one that ended it with an outcome (a
                        // final answer): it is rewarded with the outcome alone.
                        let final_step = i == last && has_outcome;
                        if (jt.turn.outcome.next_state.is_empty() && !final_step)
                            || jt.turn.policy.response_ids.is_empty()
                        {
                            continue;
                        }
                        let prm = if jt.judgement.unjudged.is_some() {
                            0.0
                        } else {
                            jt.judgement.reward
                        };
                        let r = step_reward(self.step_kind, o, self.w_process * prm)
                            .map_err(|e| e.to_string())?;
                        // The job builds one GRPO group at a time; an episode outside a group
                        // (a job without groups) is bucketed by its task.
                        steps.push(StepSample {
                            group: ep
                                .group
                                .map_or_else(|| ep.task_id.clone(), |g| format!("g{g}")),
                            step: jt.turn.turn,
                            reward: r,
                        });
                        refs.push(jt);
                    }
                }
                for z in zscore_buckets(&steps).map_err(|e| e.to_string())? {
                    let jt = refs[z.index];
                    let n = jt.turn.policy.response_ids.len();
                    samples.push(sample(&self.job, jt, vec![z.advantage as f32; n]));
                }
            }
        }
        Ok(Built {
            samples,
            teacher_versions,
        })
    }
}

/// A cheap handle the job calls builds through.
pub struct SharedBuilder(pub Arc<MethodBuilder>);

impl SampleBuilder<TrainSample> for SharedBuilder {
    fn build(
        &self,
        episodes: Arc<Vec<EpisodeTurns>>,
    ) -> BoxFuture<'static, Result<Built<TrainSample>, String>> {
        let b = self.0.clone();
        Box::pin(async move { b.build_episodes(&episodes).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clawrl_actors::loops::{JudgedTurn, Judgement, PolicyTurn, StepOutcome, Turn};
    use serde_json::json;

    /// An episode of one judged tool step (process score `prm`) and a final answer with
    /// outcome `outcome`, in group 0.
    fn episode(id: &str, prm: f64, outcome: f64) -> EpisodeTurns {
        let turn = |i: u32, next: Vec<serde_json::Value>, reward: f64| JudgedTurn {
            turn: Turn {
                session_id: id.into(),
                task_id: "t".into(),
                task_index: 0,
                instruction: "what is 2+3 ?".into(),
                turn: i,
                observation: Default::default(),
                policy: PolicyTurn {
                    response_ids: vec![7, 8],
                    ..Default::default()
                },
                outcome: StepOutcome {
                    next_state: next,
                    ..Default::default()
                },
                history_kept: None,
            },
            judgement: Judgement {
                reward,
                hint: None,
                unjudged: None,
                failed_votes: 0,
                truncated_votes: 0,
                record: json!({}),
            },
        };
        EpisodeTurns {
            session_id: id.into(),
            task_id: "t".into(),
            group: Some(0),
            reason: EndReason::Done {
                outcome: Some(outcome),
            },
            turns: vec![
                turn(0, vec![json!({"role": "tool", "content": "5"})], prm),
                turn(1, Vec::new(), 0.0),
            ],
        }
    }

    async fn step0_advantages(w_process: f64) -> Vec<f32> {
        let kind = EpisodeKind::ToolCall;
        let builder = MethodBuilder::new("j", MethodKind::Stepwise, Default::default(), None, kind)
            .unwrap()
            .with_process_weight(w_process);
        // Same outcome, opposite process scores at step 0, and a solved third episode.
        let eps = vec![
            episode("a", 1.0, -1.0),
            episode("b", -1.0, -1.0),
            episode("c", 1.0, 1.0),
        ];
        let built = builder.build_episodes(&eps).await.unwrap();
        built
            .samples
            .iter()
            .filter(|s| s.turn == 0)
            .map(|s| s.advantages[0])
            .collect()
    }

    #[tokio::test]
    async fn the_process_weight_scales_the_step_score_and_zero_leaves_the_outcome_alone() {
        let integrated = step0_advantages(1.0).await;
        assert_eq!(integrated.len(), 3);
        assert!(integrated[0] > integrated[1], "{integrated:?}");
        let outcome_only = step0_advantages(0.0).await;
        assert_eq!(outcome_only[0], outcome_only[1], "{outcome_only:?}");
        assert!(outcome_only[2] > outcome_only[0], "{outcome_only:?}");
    }
}
