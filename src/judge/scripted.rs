//! The `scripted` backend: judge text produced by rules from the job config, for simulations and
//! tests.
//!
//! Evaluation and step prompts: the first rule whose regex matches the chosen field of the
//! material gives the score (`default_score` when none matches; with no default the text holds no
//! box, which is a failed vote). Hint prompts: the hint rule's regex is applied to the next state;
//! when it matches, its replacement template (default `$1`, the first capture group) is the hint
//! and the text says `\boxed{1}` with the hint between the markers; otherwise `\boxed{-1}`.
//! A noise rate flips votes to emulate an imperfect judge: a score `s` becomes `-s` (so `0`
//! stays `0`), a hint answer becomes a bare `\boxed{-1}`, and a no-hint answer becomes a bare
//! `\boxed{1}` (which carries no hint). The noise is drawn from a ChaCha RNG seeded with the
//! configured seed, the prompt kind, the rendered prompt and the vote index, so a run is
//! reproducible no matter how the concurrent votes interleave.

use futures::future::BoxFuture;
use rand::{Rng, SeedableRng};
use regex::Regex;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::backend::{BackendError, JudgeBackend, JudgeRequest};
use super::prompt::PromptKind;

/// Which text a rule matches against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MatchOn {
    /// The next state of a turn, or the result of a step.
    #[default]
    Subject,
    /// The response of a turn, or the action of a step.
    Action,
    /// The whole rendered prompt.
    Prompt,
}

/// One scoring rule: `pattern` (a regex) → `score`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreRule {
    /// The regex (Rust `regex` syntax; `(?i)` for case-insensitive).
    pub pattern: String,
    /// The score it gives: one signed digit.
    pub score: i8,
    /// What it matches against (default: the next state / step result).
    #[serde(default)]
    pub on: MatchOn,
    /// Restricts the rule to these prompt kinds (default: every evaluation and step kind).
    #[serde(default)]
    pub kinds: Option<Vec<PromptKind>>,
}

/// How the hint judge extracts a hint from the next state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HintRule {
    /// The regex applied to the next state.
    pub pattern: String,
    /// Replacement template for the hint (`$1`, `${name}`…); default `$1`.
    #[serde(default = "default_hint_template")]
    pub template: String,
}

fn default_hint_template() -> String {
    "$1".into()
}

/// The `[judge.backend]` table of a scripted judge.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedConfig {
    /// Scoring rules, first match wins.
    #[serde(default)]
    pub rules: Vec<ScoreRule>,
    /// The score when no rule matches; `None` makes that a failed vote.
    #[serde(default)]
    pub default_score: Option<i8>,
    /// The hint rule; `None` means the hint judge always answers `\boxed{-1}`.
    #[serde(default)]
    pub hint: Option<HintRule>,
    /// Probability in `[0, 1]` that a vote is flipped.
    #[serde(default)]
    pub noise_rate: f64,
    /// Seed of the noise.
    #[serde(default)]
    pub seed: u64,
}

/// Errors validating a scripted config.
#[derive(Debug, Error)]
pub enum ScriptedError {
    /// A rule's regex does not compile.
    #[error("scripted judge rule {index}: bad pattern `{pattern}`: {source}")]
    BadPattern {
        /// Rule index (`hint` rule: `usize::MAX`).
        index: usize,
        /// The pattern.
        pattern: String,
        /// The regex error.
        #[source]
        source: regex::Error,
    },
    /// A score that is not one signed digit.
    #[error("scripted judge {what}: score {score} is not one signed digit (-9..=9)")]
    BadScore {
        /// Which rule (`rule 2`, `default_score`).
        what: String,
        /// The score.
        score: i8,
    },
    /// The hint regex has no capture group while the template refers to one.
    #[error(
        "scripted judge hint pattern `{0}` has no capture group for the default template `$1`"
    )]
    HintWithoutGroup(String),
    /// The noise rate is not a probability.
    #[error("scripted judge noise_rate must be in [0, 1], got {0}")]
    BadNoise(f64),
}

struct CompiledRule {
    regex: Regex,
    score: i8,
    on: MatchOn,
    kinds: Option<Vec<PromptKind>>,
}

/// The scripted backend (see the module doc).
pub struct ScriptedBackend {
    rules: Vec<CompiledRule>,
    default_score: Option<i8>,
    hint: Option<(Regex, String)>,
    noise_rate: f64,
    seed: u64,
}

impl ScriptedBackend {
    /// Validates and compiles a config.
    pub fn new(config: &ScriptedConfig) -> Result<Self, ScriptedError> {
        let digit = |what: String, score: i8| {
            if (-9..=9).contains(&score) {
                Ok(())
            } else {
                Err(ScriptedError::BadScore { what, score })
            }
        };
        let mut rules = Vec::with_capacity(config.rules.len());
        for (index, r) in config.rules.iter().enumerate() {
            digit(format!("rule {index}"), r.score)?;
            let regex = Regex::new(&r.pattern).map_err(|source| ScriptedError::BadPattern {
                index,
                pattern: r.pattern.clone(),
                source,
            })?;
            rules.push(CompiledRule {
                regex,
                score: r.score,
                on: r.on,
                kinds: r.kinds.clone(),
            });
        }
        if let Some(s) = config.default_score {
            digit("default_score".into(), s)?;
        }
        let hint = match &config.hint {
            None => None,
            Some(h) => {
                let regex = Regex::new(&h.pattern).map_err(|source| ScriptedError::BadPattern {
                    index: usize::MAX,
                    pattern: h.pattern.clone(),
                    source,
                })?;
                if h.template == "$1" && regex.captures_len() < 2 {
                    return Err(ScriptedError::HintWithoutGroup(h.pattern.clone()));
                }
                Some((regex, h.template.clone()))
            }
        };
        if !(0.0..=1.0).contains(&config.noise_rate) {
            return Err(ScriptedError::BadNoise(config.noise_rate));
        }
        Ok(Self {
            rules,
            default_score: config.default_score,
            hint,
            noise_rate: config.noise_rate,
            seed: config.seed,
        })
    }

    fn flips(&self, request: &JudgeRequest) -> bool {
        if self.noise_rate == 0.0 {
            return false;
        }
        let mut h = blake3::Hasher::new();
        h.update(&self.seed.to_le_bytes());
        h.update(request.kind.name().as_bytes());
        for m in &request.messages {
            h.update(m.role.as_bytes());
            h.update(&[0]);
            h.update(m.content.as_bytes());
            h.update(&[0]);
        }
        h.update(&request.vote_index.to_le_bytes());
        let mut rng = rand_chacha::ChaCha8Rng::from_seed(*h.finalize().as_bytes());
        rng.random::<f64>() < self.noise_rate
    }

    /// The judge text for one request (pure: the same request always gives the same text).
    pub fn answer(&self, request: &JudgeRequest) -> String {
        let flip = self.flips(request);
        if request.kind == PromptKind::Hint {
            let found = self.hint.as_ref().and_then(|(re, template)| {
                let caps = re.captures(request.material.subject())?;
                let mut hint = String::new();
                caps.expand(template, &mut hint);
                Some(hint)
            });
            return match (found, flip) {
                (Some(hint), false) => {
                    format!("The next state says how to do better.\n\\boxed{{1}}\n[HINT_START]\n{hint}\n[HINT_END]")
                }
                (Some(_), true) => "Noise: no hint given.\n\\boxed{-1}".into(),
                (None, false) => "The next state gives no direction.\n\\boxed{-1}".into(),
                (None, true) => "Noise: a hint vote without a hint.\n\\boxed{1}".into(),
            };
        }
        let matched = self.rules.iter().enumerate().find(|(_, r)| {
            if r.kinds.as_ref().is_some_and(|k| !k.contains(&request.kind)) {
                return false;
            }
            let text = match (r.on, &request.material) {
                (MatchOn::Subject, m) => m.subject(),
                (MatchOn::Action, m) => m.action(),
                (MatchOn::Prompt, _) => {
                    // Only built when a rule asks for it.
                    let joined: String = request
                        .messages
                        .iter()
                        .map(|m| m.content.as_str())
                        .collect::<Vec<_>>()
                        .join("\n");
                    return r.regex.is_match(&joined);
                }
            };
            r.regex.is_match(text)
        });
        let (why, score) = match matched {
            Some((i, r)) => (format!("rule {i} matched"), Some(r.score)),
            None => ("no rule matched".into(), self.default_score),
        };
        match score {
            None => format!("Scripted judge: {why}, no verdict."),
            Some(s) => {
                let s = if flip { -s } else { s };
                format!("Scripted judge: {why}.\n\\boxed{{{s}}}")
            }
        }
    }
}

impl JudgeBackend for ScriptedBackend {
    fn name(&self) -> &str {
        "scripted"
    }

    fn complete<'a>(
        &'a self,
        request: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        let text = self.answer(request);
        Box::pin(async move { Ok(text) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::backend::{ChatMessage, SamplingParams};
    use crate::judge::parse::{parse_hint, parse_vote};
    use crate::judge::prompt::{Material, TurnMaterial};

    fn req(kind: PromptKind, next: &str, vote_index: u32) -> JudgeRequest {
        JudgeRequest {
            kind,
            material: Material::Turn(TurnMaterial {
                response: "resp".into(),
                next_state: next.into(),
                next_state_role: "user".into(),
            }),
            messages: vec![ChatMessage::user(format!("judge: {next}"))],
            params: SamplingParams {
                temperature: 0.6,
                top_p: 1.0,
                max_tokens: 64,
                seed: None,
            },
            vote_index,
        }
    }

    fn config() -> ScriptedConfig {
        toml::from_str(
            r#"
            default_score = 0
            rules = [
              { pattern = "(?i)\\b(no|wrong|again)\\b", score = -1 },
              { pattern = "(?i)thanks", score = 1 },
            ]
            hint = { pattern = "(?i)you should (.+?)(?:\\.|$)" }
            "#,
        )
        .unwrap()
    }

    #[test]
    fn rules_give_scores_first_match_wins() {
        let b = ScriptedBackend::new(&config()).unwrap();
        let vote = |next: &str| {
            parse_vote(
                &b.answer(&req(PromptKind::PersonalEval, next, 0)),
                &[1, -1, 0],
            )
        };
        assert_eq!(vote("no, that is wrong"), Ok(-1));
        assert_eq!(vote("thanks!"), Ok(1));
        assert_eq!(vote("no thanks"), Ok(-1));
        assert_eq!(vote("ok"), Ok(0));
        let strict = ScriptedBackend::new(&ScriptedConfig {
            default_score: None,
            ..config()
        })
        .unwrap();
        assert!(parse_vote(
            &strict.answer(&req(PromptKind::PersonalEval, "ok", 0)),
            &[1, -1, 0]
        )
        .is_err());
    }

    #[test]
    fn hint_rule_extracts_a_hint() {
        let b = ScriptedBackend::new(&config()).unwrap();
        let text = b.answer(&req(
            PromptKind::Hint,
            "Wrong. You should use ls -a to show hidden files.",
            0,
        ));
        assert_eq!(parse_vote(&text, &[1, -1]), Ok(1));
        assert_eq!(
            parse_hint(&text),
            Some("use ls -a to show hidden files".into())
        );
        let text = b.answer(&req(PromptKind::Hint, "fine", 0));
        assert_eq!(parse_vote(&text, &[1, -1]), Ok(-1));
        assert_eq!(parse_hint(&text), None);
    }

    #[test]
    fn noise_flips_at_the_configured_rate_reproducibly() {
        let noisy = ScriptedBackend::new(&ScriptedConfig {
            noise_rate: 0.25,
            seed: 7,
            ..config()
        })
        .unwrap();
        let n = 4000;
        let flips = || -> Vec<bool> {
            (0..n)
                .map(|i| {
                    parse_vote(
                        &noisy.answer(&req(PromptKind::PersonalEval, "thanks", i)),
                        &[1, -1, 0],
                    ) == Ok(-1)
                })
                .collect()
        };
        let flipped = flips();
        let rate = flipped.iter().filter(|f| **f).count() as f64 / n as f64;
        assert!((rate - 0.25).abs() < 0.03, "flip rate {rate}");
        assert_eq!(flipped, flips(), "same seed, same flips");
        let always = ScriptedBackend::new(&ScriptedConfig {
            noise_rate: 1.0,
            ..config()
        })
        .unwrap();
        assert_eq!(
            parse_vote(
                &always.answer(&req(PromptKind::PersonalEval, "thanks", 0)),
                &[1, -1, 0]
            ),
            Ok(-1)
        );
        assert_eq!(
            parse_vote(
                &always.answer(&req(PromptKind::PersonalEval, "ok", 0)),
                &[1, -1, 0]
            ),
            Ok(0)
        );
        let t = always.answer(&req(PromptKind::Hint, "You should retry.", 0));
        assert_eq!((parse_vote(&t, &[1, -1]), parse_hint(&t)), (Ok(-1), None));
    }

    #[test]
    fn bad_configs_are_refused() {
        let bad = |c: ScriptedConfig| ScriptedBackend::new(&c).err().expect("refused");
        let e = bad(ScriptedConfig {
            rules: vec![ScoreRule {
                pattern: "(".into(),
                score: 1,
                on: MatchOn::Subject,
                kinds: None,
            }],
            ..Default::default()
        });
        assert!(
            matches!(e, ScriptedError::BadPattern { index: 0, .. }),
            "{e}"
        );
        let e = bad(ScriptedConfig {
            rules: vec![ScoreRule {
                pattern: "x".into(),
                score: 10,
                on: MatchOn::Subject,
                kinds: None,
            }],
            ..Default::default()
        });
        assert!(matches!(e, ScriptedError::BadScore { .. }), "{e}");
        let e = bad(ScriptedConfig {
            hint: Some(HintRule {
                pattern: "no group".into(),
                template: "$1".into(),
            }),
            ..Default::default()
        });
        assert!(matches!(e, ScriptedError::HintWithoutGroup(_)), "{e}");
        assert!(matches!(
            bad(ScriptedConfig {
                noise_rate: 1.5,
                ..Default::default()
            }),
            ScriptedError::BadNoise(_)
        ));
        assert!(
            toml::from_str::<ScriptedConfig>("rulez = []").is_err(),
            "unknown keys refused"
        );
    }
}
