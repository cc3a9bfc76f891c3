//! The Qwen3 model configuration, read from a Hugging Face `config.json` and validated.
//!
//! Field names follow Hugging Face so that `config.json` deserializes directly; unknown keys are
//! ignored (and kept on save through [`Qwen3Config::extra`]). RoPE theta comes from `rope_theta`
//! or, in newer `transformers` versions, from `rope_parameters.rope_theta`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Errors found while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The JSON did not parse or a key had the wrong type.
    #[error("config.json: {0}")]
    Json(#[from] serde_json::Error),
    /// The architecture is not Qwen3.
    #[error("config.json: unsupported architecture {0:?} (expected Qwen3ForCausalLM / model_type qwen3)")]
    Architecture(String),
    /// A key has a value the model cannot use.
    #[error("config.json: invalid `{key}`: {reason}")]
    Invalid {
        /// The offending key.
        key: &'static str,
        /// Why it is rejected.
        reason: String,
    },
}

/// Hugging Face `rope_parameters` (transformers ≥ 5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// The RoPE base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// The RoPE variant; only `"default"` is supported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    /// Any other keys, kept on save.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A Qwen3 decoder configuration (the keys of Hugging Face `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Qwen3Config {
    /// Hugging Face architecture names; must contain `Qwen3ForCausalLM` when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    /// Must be `qwen3` when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Epsilon of every RMSNorm.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base (older transformers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// RoPE parameters (transformers ≥ 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Longest sequence the model supports (prompt plus generated tokens).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Must be `silu`.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Qwen3 has no q/k/v bias; `true` is rejected.
    #[serde(default)]
    pub attention_bias: bool,
    /// End-of-sequence token id(s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<Value>,
    /// Standard deviation for random initialisation.
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    /// Sliding-window attention is not supported and must be off.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Every other key of `config.json`, preserved on save.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    32768
}
fn default_act() -> String {
    "silu".to_string()
}
fn default_init_range() -> f64 {
    0.02
}

impl Qwen3Config {
    /// Parses and validates `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let cfg: Qwen3Config = serde_json::from_str(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Serializes back to `config.json` text (pretty-printed).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a config always serializes")
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Number of key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The RoPE base: `rope_theta`, else `rope_parameters.rope_theta`, else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref().and_then(|p| p.rope_theta))
            .unwrap_or(10000.0)
    }

    /// The dtype the checkpoint declares (`dtype`, or `torch_dtype` in older files), e.g.
    /// `"bfloat16"`.
    pub fn storage_dtype(&self) -> Option<&str> {
        ["dtype", "torch_dtype"]
            .iter()
            .find_map(|k| self.extra.get(*k).and_then(|v| v.as_str()))
    }

    /// End-of-sequence token ids declared by the config (an int or a list).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Number of scalar parameters of the model this config describes.
    pub fn num_parameters(&self) -> usize {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (nq, nkv) = (self.num_attention_heads, self.num_kv_heads());
        let attn = h * nq * hd + 2 * h * nkv * hd + nq * hd * h + 2 * hd;
        let mlp = 3 * h * i;
        let layer = attn + mlp + 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + self.num_hidden_layers * layer + h + head
    }

    /// Checks that the model can be built from this config.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(archs) = &self.architectures {
            if !archs.iter().any(|a| a == "Qwen3ForCausalLM") {
                return Err(ConfigError::Architecture(archs.join(", ")));
            }
        }
        if let Some(mt) = &self.model_type {
            if mt != "qwen3" {
                return Err(ConfigError::Architecture(mt.clone()));
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads()),
            ("head_dim", self.head_dim()),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    reason: "must be positive".into(),
                });
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err(ConfigError::Invalid {
                key: "num_key_value_heads",
                reason: format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_kv_heads(),
                    self.num_attention_heads
                ),
            });
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ConfigError::Invalid {
                key: "head_dim",
                reason: format!("{} is odd; RoPE needs an even head width", self.head_dim()),
            });
        }
        if self.hidden_act != "silu" {
            return Err(ConfigError::Invalid {
                key: "hidden_act",
                reason: format!("{:?} is not supported (only silu)", self.hidden_act),
            });
        }
        if self.attention_bias {
            return Err(ConfigError::Invalid {
                key: "attention_bias",
                reason: "attention bias is not supported by Qwen3".into(),
            });
        }
        if self.use_sliding_window {
            return Err(ConfigError::Invalid {
                key: "use_sliding_window",
                reason: "sliding-window attention is not supported".into(),
            });
        }
        if let Some(p) = &self.rope_parameters {
            if let Some(t) = &p.rope_type {
                if t != "default" {
                    return Err(ConfigError::Invalid {
                        key: "rope_parameters",
                        reason: format!("rope_type {t:?} is not supported (only default)"),
                    });
                }
            }
        }
        let theta = self.rope_theta();
        if !(theta.is_finite() && theta > 1.0) {
            return Err(ConfigError::Invalid {
                key: "rope_theta",
                reason: format!("{theta} must be a finite number > 1"),
            });
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ConfigError::Invalid {
                key: "rms_norm_eps",
                reason: format!("{} must be positive", self.rms_norm_eps),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_theta_from_either_key() {
        let a = r#"{"vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_theta":500.0}"#;
        assert_eq!(Qwen3Config::from_json(a).unwrap().rope_theta(), 500.0);
        let b = r#"{"vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_parameters":{"rope_theta":700.0,"rope_type":"default"}}"#;
        assert_eq!(Qwen3Config::from_json(b).unwrap().rope_theta(), 700.0);
    }

    #[test]
    fn rejects_unknown_architecture_and_bad_gqa() {
        let a = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":8,"hidden_size":8,
            "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2}"#;
        let e = Qwen3Config::from_json(a).unwrap_err().to_string();
        assert!(e.contains("LlamaForCausalLM"), "{e}");
        let b = r#"{"vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":3,"num_key_value_heads":2,"head_dim":4}"#;
        let e = Qwen3Config::from_json(b).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }
}
