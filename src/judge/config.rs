//! The job config's `[judge]` table: which backend, how many votes, prompt overrides and the OPD
//! teacher, validated into a ready [`Judge`].
//!
//! ```toml
//! [judge]
//! backend = { kind = "openai", url = "http://127.0.0.1:8000/v1", model = "qwen3-8b", api_key_env = "JUDGE_KEY" }
//! votes = { m = 3, hint_m = 3, temperature = 0.6 }
//! prompts = { hint = "..." }          # optional replacements, see `prompt`
//! opd = { teacher = "current_policy", w_binary = 1.0, w_opd = 1.0 }
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::backend::{ChatGenerator, JudgeBackend, ModelBackend};
use super::local::EngineGenerator;
use super::openai::{OpenAiBackend, OpenAiConfig, OpenAiConfigError};
use super::prompt::{PromptError, PromptOverrides, PromptSet};
use super::scripted::{ScriptedBackend, ScriptedConfig, ScriptedError};
use super::votes::{Judge, VoteSettings, VoteSettingsError};
use crate::model::EngineOptions;
use crate::rl::AdvantageWeights;

/// Where a `model` judge's weights come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "source")]
pub enum ModelSource {
    /// The job's initial policy checkpoint, frozen.
    FrozenInitial,
    /// Any Hugging Face checkpoint directory.
    Checkpoint {
        /// The directory.
        path: PathBuf,
    },
}

/// The judge backend selection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum BackendConfig {
    /// Rules from config.
    Scripted(ScriptedConfig),
    /// An OpenAI-compatible endpoint.
    Openai(OpenAiConfig),
    /// A local model served by a rollout-worker pool.
    Model {
        /// Which weights.
        #[serde(flatten)]
        source: ModelSource,
    },
}

/// The OPD teacher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Teacher {
    /// The current policy (the paper's self-distillation).
    #[default]
    CurrentPolicy,
    /// The frozen initial checkpoint.
    FrozenInitial,
}

/// OPD settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OpdConfig {
    /// The teacher that scores responses under `s_enhanced`.
    pub teacher: Teacher,
    /// Weight of the binary term.
    pub w_binary: f32,
    /// Weight of the OPD term.
    pub w_opd: f32,
}

impl Default for OpdConfig {
    fn default() -> Self {
        let w = AdvantageWeights::default();
        Self {
            teacher: Teacher::default(),
            w_binary: w.w_binary,
            w_opd: w.w_opd,
        }
    }
}

impl OpdConfig {
    /// The advantage weights.
    pub fn weights(&self) -> AdvantageWeights {
        AdvantageWeights {
            w_binary: self.w_binary,
            w_opd: self.w_opd,
        }
    }
}

/// The `[judge]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    /// The backend.
    pub backend: BackendConfig,
    /// Vote settings.
    #[serde(default)]
    pub votes: VoteSettings,
    /// Prompt replacements.
    #[serde(default)]
    pub prompts: PromptOverrides,
    /// OPD settings.
    #[serde(default)]
    pub opd: OpdConfig,
}

/// Errors turning a [`JudgeConfig`] into a [`Judge`].
#[derive(Debug, Error)]
pub enum JudgeConfigError {
    /// A prompt template is invalid.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// Vote settings out of range.
    #[error(transparent)]
    Votes(#[from] VoteSettingsError),
    /// The scripted rules are invalid.
    #[error(transparent)]
    Scripted(#[from] ScriptedError),
    /// The openai backend config is invalid.
    #[error(transparent)]
    OpenAi(#[from] OpenAiConfigError),
    /// A `model` backend was configured but no generator was supplied.
    #[error(
        "judge.backend kind = \"model\" needs a local chat generator ({0:?}); none was supplied"
    )]
    NoGenerator(ModelSource),
    /// The judge checkpoint could not be loaded.
    #[error("judge.backend: cannot load the judge model from {path}: {message}")]
    Load {
        /// The checkpoint directory.
        path: PathBuf,
        /// The load error.
        message: String,
    },
    /// An OPD weight is not finite.
    #[error("judge.opd.{0} must be finite")]
    BadWeight(&'static str),
}

impl JudgeConfig {
    /// Validates everything and builds the judge. `generator` serves a `model` backend; without
    /// one, a `checkpoint` source is loaded here (CPU backend, default engine options) and a
    /// `frozen_initial` source is an error (the caller owns the initial policy and must pass its
    /// generator). Other backends ignore `generator`.
    pub fn build(
        &self,
        generator: Option<Arc<dyn ChatGenerator>>,
    ) -> Result<Judge, JudgeConfigError> {
        if !self.opd.w_binary.is_finite() {
            return Err(JudgeConfigError::BadWeight("w_binary"));
        }
        if !self.opd.w_opd.is_finite() {
            return Err(JudgeConfigError::BadWeight("w_opd"));
        }
        let prompts = Arc::new(PromptSet::new(&self.prompts)?);
        let backend: Arc<dyn JudgeBackend> = match &self.backend {
            BackendConfig::Scripted(c) => Arc::new(ScriptedBackend::new(c)?),
            BackendConfig::Openai(c) => Arc::new(OpenAiBackend::new(c.clone())?),
            BackendConfig::Model { source } => match (generator, source) {
                (Some(g), _) => Arc::new(ModelBackend::new(g)),
                (None, ModelSource::Checkpoint { path }) => {
                    let g =
                        EngineGenerator::load(path, EngineOptions::default(), 0).map_err(|e| {
                            JudgeConfigError::Load {
                                path: path.clone(),
                                message: e.to_string(),
                            }
                        })?;
                    Arc::new(ModelBackend::new(Arc::new(g)))
                }
                (None, ModelSource::FrozenInitial) => {
                    return Err(JudgeConfigError::NoGenerator(source.clone()))
                }
            },
        };
        Ok(Judge::new(backend, prompts, self.votes.clone())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_builds_each_backend() {
        let c: JudgeConfig = toml::from_str(
            r#"
            backend = { kind = "scripted", default_score = 1 }
            votes = { m = 5 }
            "#,
        )
        .unwrap();
        let j = c.build(None).unwrap();
        assert_eq!(
            (j.backend_name(), j.settings().m, j.settings().hint_m),
            ("scripted", 5, 3)
        );

        let c: JudgeConfig = toml::from_str(
            r#"
            backend = { kind = "openai", url = "https://judge.example/v1", model = "m", max_retries = 4 }
            opd = { teacher = "frozen_initial", w_opd = 0.5 }
            "#,
        )
        .unwrap();
        assert_eq!(c.opd.teacher, Teacher::FrozenInitial);
        assert_eq!(
            c.opd.weights(),
            AdvantageWeights {
                w_binary: 1.0,
                w_opd: 0.5
            }
        );
        assert_eq!(c.build(None).unwrap().backend_name(), "openai");

        let c: JudgeConfig = toml::from_str(
            r#"backend = { kind = "model", source = "checkpoint", path = "/no/such/ckpt" }"#,
        )
        .unwrap();
        assert_eq!(
            c.backend,
            BackendConfig::Model {
                source: ModelSource::Checkpoint {
                    path: "/no/such/ckpt".into()
                }
            }
        );
        let e = c.build(None).unwrap_err();
        assert!(matches!(e, JudgeConfigError::Load { .. }), "{e}");
        assert!(e.to_string().contains("/no/such/ckpt"), "{e}");
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");
        let c: JudgeConfig = toml::from_str(&format!(
            "backend = {{ kind = \"model\", source = \"checkpoint\", path = \"{fixture}\" }}"
        ))
        .unwrap();
        assert_eq!(c.build(None).unwrap().backend_name(), "model");
        let c: JudgeConfig =
            toml::from_str(r#"backend = { kind = "model", source = "frozen_initial" }"#).unwrap();
        assert!(matches!(
            c.build(None),
            Err(JudgeConfigError::NoGenerator(ModelSource::FrozenInitial))
        ));
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        assert!(toml::from_str::<JudgeConfig>(r#"backend = { kind = "nope" }"#).is_err());
        assert!(
            toml::from_str::<JudgeConfig>("backend = { kind = \"scripted\" }\nvotez = {}").is_err()
        );
        let c: JudgeConfig = toml::from_str(
            r#"
            backend = { kind = "scripted" }
            prompts = { personal_eval = "{{ response }} {{ next_state }} {{ oops }}" }
            "#,
        )
        .unwrap();
        let e = c.build(None).unwrap_err();
        assert!(e.to_string().contains("personal_eval"), "{e}");
        let c: JudgeConfig =
            toml::from_str("backend = { kind = \"scripted\" }\nvotes = { m = 0, hint_m = 0 }")
                .unwrap();
        assert!(matches!(c.build(None), Err(JudgeConfigError::Votes(_))));
    }
}
