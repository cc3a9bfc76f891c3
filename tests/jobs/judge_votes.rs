//! The vote runner: evaluation and hint votes run concurrently, a backend that hangs or errors
//! gives failed votes (never a stall), step judges aggregate by the configured rule, the `model`
//! backend goes through the `ChatGenerator` trait, and a scripted judge built from a TOML config
//! feeds the RL core end to end.

use std::sync::Arc;
use std::time::Duration;

use clawrl::judge::{
    BackendError, ChatGenerator, ChatMessage, GenerateError, Generated, Judge, JudgeBackend,
    JudgeConfig, JudgeRequest, ModelBackend, PromptKind, PromptSet, SamplingParams, StepMaterial,
    TurnMaterial, VoteKind, VoteSettings,
};
use clawrl::rl::{self, AdvantageWeights, Aggregation, CombineCase, EpisodeKind};
use futures::future::BoxFuture;

fn turn(next: &str) -> TurnMaterial {
    TurnMaterial {
        response: "I deleted the folder.".into(),
        next_state: next.into(),
        next_state_role: "user".into(),
    }
}

fn step(result: &str) -> StepMaterial {
    StepMaterial {
        task: "make tests pass".into(),
        history: "opened src/lib.rs".into(),
        step_index: 2,
        step: "cargo test".into(),
        result: result.into(),
        results: vec![result.into()],
        messages: Vec::new(),
    }
}

/// Every call waits until `n` calls are in flight: only a runner that starts all votes at once
/// can finish.
struct Barrier(tokio::sync::Barrier);

impl JudgeBackend for Barrier {
    fn name(&self) -> &str {
        "barrier"
    }
    fn complete<'a>(
        &'a self,
        req: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        Box::pin(async move {
            self.0.wait().await;
            Ok(match req.kind {
                PromptKind::Hint => {
                    "\\boxed{1} [HINT_START]Ask before deleting anything.[HINT_END]".into()
                }
                _ => "\\boxed{-1}".into(),
            })
        })
    }
}

#[tokio::test]
async fn evaluation_and_hint_votes_all_run_at_once() {
    let settings = VoteSettings {
        m: 3,
        hint_m: 4,
        vote_timeout_ms: 60_000,
        ..VoteSettings::default()
    };
    let judge = Judge::new(
        Arc::new(Barrier(tokio::sync::Barrier::new(7))),
        Arc::new(PromptSet::defaults()),
        settings,
    )
    .unwrap();
    let j = tokio::time::timeout(
        Duration::from_secs(20),
        judge.judge_turn(turn("why did you do that"), true),
    )
    .await
    .expect("all 7 votes must be in flight together");
    assert_eq!(j.reward, -1);
    assert_eq!(j.hint.as_deref(), Some("Ask before deleting anything."));
    assert!(j.votes.iter().all(|v| v.kind == VoteKind::Eval));
    assert!(j.hint_votes.iter().all(|v| v.kind == VoteKind::Hint));
}

/// Hangs forever on hint prompts, errors on odd evaluation votes.
struct Flaky;

impl JudgeBackend for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }
    fn complete<'a>(
        &'a self,
        req: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        Box::pin(async move {
            match req.kind {
                PromptKind::Hint => futures::future::pending().await,
                _ if req.vote_index % 2 == 1 => {
                    Err(BackendError::Unreachable("connection refused".into()))
                }
                _ => Ok("\\boxed{1}".into()),
            }
        })
    }
}

#[tokio::test]
async fn hanging_and_erroring_backends_give_failed_votes() {
    let settings = VoteSettings {
        m: 3,
        hint_m: 2,
        vote_timeout_ms: 100,
        ..VoteSettings::default()
    };
    let judge = Judge::new(Arc::new(Flaky), Arc::new(PromptSet::defaults()), settings).unwrap();
    let j = judge.judge_turn(turn("thanks"), true).await;
    assert_eq!(
        j.votes.iter().map(|v| v.score).collect::<Vec<_>>(),
        vec![Some(1), None, Some(1)]
    );
    assert!(j.votes[1]
        .error
        .as_deref()
        .unwrap()
        .contains("connection refused"));
    assert_eq!(j.reward, 1);
    assert!(j
        .hint_votes
        .iter()
        .all(|v| v.error.as_deref() == Some("vote timed out after 100 ms")));
    assert_eq!(j.hint, None);
    assert_eq!(j.unjudged, None, "some votes succeeded");
}

struct Generator;

impl ChatGenerator for Generator {
    fn generate<'a>(
        &'a self,
        messages: &'a [ChatMessage],
        params: &'a SamplingParams,
    ) -> BoxFuture<'a, Result<Generated, GenerateError>> {
        Box::pin(async move {
            assert_eq!(params.temperature, 0.6);
            if messages[0].content.contains("boom") {
                Err("out of KV cache".into())
            } else if messages[0].content.contains("ramble") {
                // Stopped by max_tokens before any verdict.
                Ok(Generated {
                    text: "<think>First, the step".into(),
                    cut_off: true,
                })
            } else {
                Ok(Generated {
                    text: format!("step looks {} \\boxed{{1}}", messages.len()),
                    cut_off: false,
                })
            }
        })
    }
}

#[tokio::test]
async fn the_model_backend_runs_through_a_chat_generator() {
    let judge = Judge::new(
        Arc::new(ModelBackend::new(Arc::new(Generator))),
        Arc::new(PromptSet::defaults()),
        VoteSettings::default(),
    )
    .unwrap();
    let s = judge
        .judge_step(PromptKind::StepSwe, step("2 passed"))
        .await;
    assert_eq!(s.score, 1.0);
    assert_eq!(s.votes.len(), 3);
    assert_eq!(s.votes[0].raw, "step looks 1 \\boxed{1}");
    let s = judge.judge_step(PromptKind::StepSwe, step("boom")).await;
    assert_eq!(s.score, 0.0);
    assert!(s
        .unjudged
        .unwrap()
        .contains("local judge model failed: out of KV cache"));
    // A local answer stopped by max_tokens before its verdict is a failed vote marked truncated.
    let s = judge.judge_step(PromptKind::StepSwe, step("ramble")).await;
    assert!(s.votes.iter().all(|v| v.truncated && v.score.is_none()));
    let why = s.unjudged.unwrap();
    assert!(why.contains("truncated at max_tokens = 4096"), "{why}");
}

#[tokio::test]
async fn scripted_judge_from_config_feeds_the_rl_core() {
    let config: JudgeConfig = toml::from_str(
        r#"
        [backend]
        kind = "scripted"
        default_score = 0
        rules = [
          { pattern = "(?i)\\b(no|wrong|undo)\\b", score = -1 },
          { pattern = "(?i)thanks|perfect", score = 1 },
          { pattern = "error", score = -1, kinds = ["step_terminal"] },
          { pattern = "ok$", score = 1, kinds = ["step_terminal"] },
        ]
        hint = { pattern = "(?i)(?:you should|instead,?) (.+)" }

        [votes]
        m = 3
        hint_m = 2
        step_aggregation = "mean"
        "#,
    )
    .unwrap();
    let judge = config.build(None).unwrap();

    // A correction with a direction: reward -1, hint accepted → both terms.
    let j = judge
        .judge_turn(
            turn("No, undo that. You should move it to the trash instead."),
            true,
        )
        .await;
    assert_eq!(j.reward, -1);
    assert_eq!(j.hint.as_deref(), Some("move it to the trash instead."));
    let teacher = [-0.5f32, -1.0];
    let old = [-1.0f32, -1.0];
    let s = rl::combine(
        config.opd.weights(),
        j.reward,
        j.hint.as_ref().map(|_| (&teacher[..], &old[..])),
        2,
    )
    .unwrap()
    .unwrap();
    assert_eq!(s.case, CombineCase::Both);
    assert_eq!(s.advantages, vec![-0.5, -1.0]);

    // Praise: +1, no hint (the rule does not match) → binary only.
    let j = judge.judge_turn(turn("perfect, thanks"), true).await;
    assert_eq!((j.reward, j.hint.clone()), (1, None));
    let s = rl::combine(AdvantageWeights::default(), j.reward, None, 3)
        .unwrap()
        .unwrap();
    assert_eq!(
        (s.case, s.advantages),
        (CombineCase::BinaryOnly, vec![1.0; 3])
    );

    // Nothing to learn: reward 0, no hint → no sample.
    let j = judge.judge_turn(turn("what time is it"), true).await;
    assert_eq!((j.reward, j.hint.clone()), (0, None));
    assert_eq!(
        rl::combine(AdvantageWeights::default(), j.reward, None, 3).unwrap(),
        None
    );

    // Step judges: terminal rules are restricted to the terminal prompt.
    let ok = judge
        .judge_step(PromptKind::StepTerminal, step("all ok"))
        .await;
    let err = judge
        .judge_step(PromptKind::StepTerminal, step("error: E0432"))
        .await;
    let gui = judge
        .judge_step(PromptKind::StepGui, step("error: E0432"))
        .await;
    assert_eq!((ok.score, err.score, gui.score), (1.0, -1.0, 0.0));
    let r_ok = rl::step_reward(EpisodeKind::Terminal, 1.0, ok.score).unwrap();
    let r_err = rl::step_reward(EpisodeKind::Terminal, 1.0, err.score).unwrap();
    assert_eq!((r_ok, r_err), (2.0, 0.0));
    let z = rl::zscore_buckets(&[
        rl::StepSample {
            group: "task".into(),
            step: 2,
            reward: r_ok,
        },
        rl::StepSample {
            group: "task".into(),
            step: 2,
            reward: r_err,
        },
    ])
    .unwrap();
    assert!(z[0].advantage > 0.0 && z[1].advantage < 0.0);
}

#[tokio::test]
async fn step_scores_aggregate_by_mean_or_majority() {
    let config = |agg: &str| -> JudgeConfig {
        toml::from_str(&format!(
            "backend = {{ kind = \"scripted\", default_score = 1, noise_rate = 0.4, seed = 3 }}\nvotes = {{ m = 5, step_aggregation = \"{agg}\" }}"
        ))
        .unwrap()
    };
    let mean = config("mean")
        .build(None)
        .unwrap()
        .judge_step(PromptKind::StepGui, step("clicked"))
        .await;
    let majority = config("majority")
        .build(None)
        .unwrap()
        .judge_step(PromptKind::StepGui, step("clicked"))
        .await;
    let scores: Vec<Option<i8>> = mean.votes.iter().map(|v| v.score).collect();
    // Same seed, same votes under both rules.
    assert_eq!(
        scores,
        majority.votes.iter().map(|v| v.score).collect::<Vec<_>>()
    );
    assert_eq!(mean.score, rl::aggregate(&scores, Aggregation::Mean));
    assert_eq!(
        majority.score,
        rl::aggregate(&scores, Aggregation::Majority)
    );
    assert!(scores.iter().all(|s| matches!(s, Some(1) | Some(-1))));
}

/// Records the token budget each vote was given.
struct Budgets(std::sync::Mutex<Vec<(PromptKind, u32)>>);

impl JudgeBackend for Budgets {
    fn name(&self) -> &str {
        "budgets"
    }
    fn complete<'a>(
        &'a self,
        req: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        self.0
            .lock()
            .unwrap()
            .push((req.kind, req.params.max_tokens));
        Box::pin(async move {
            Ok(match req.kind {
                PromptKind::Hint => "\\boxed{1} [HINT_START]Be brief.[HINT_END]".into(),
                _ => "\\boxed{1}".into(),
            })
        })
    }
}

/// A thinking judge needs room: by default evaluation votes may write 4096 tokens and hint
/// votes 8192, each configurable on its own.
#[tokio::test]
async fn evaluation_and_hint_votes_have_their_own_token_budgets() {
    for (settings, eval, hint) in [
        (VoteSettings::default(), 4096, 8192),
        (
            VoteSettings {
                max_tokens: 100,
                hint_max_tokens: 300,
                ..VoteSettings::default()
            },
            100,
            300,
        ),
    ] {
        let backend = Arc::new(Budgets(Default::default()));
        let judge = Judge::new(backend.clone(), Arc::new(PromptSet::defaults()), settings).unwrap();
        judge.judge_turn(turn("thanks"), true).await;
        let seen = backend.0.lock().unwrap().clone();
        assert_eq!(seen.len(), 6, "{seen:?}");
        for (kind, budget) in seen {
            let want = if kind == PromptKind::Hint { hint } else { eval };
            assert_eq!(budget, want, "{kind:?}");
        }
    }
}
