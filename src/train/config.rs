//! The learner's hyper-parameters (`TRAIN.toml`): the loss and AdamW of docs/design.md §1, with
//! its defaults, parsed strictly (an unknown key is an error naming the key and the file).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::OpdLossKind;

/// Hyper-parameters of one learner: the clipped policy-gradient loss, the KL term, AdamW and the
/// batch size. Field names are the `TRAIN.toml` keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// AdamW learning rate (docs/design.md §1: 1e-5 personal, 1e-6 general).
    pub lr: f64,
    /// AdamW `(β1, β2)`.
    pub betas: [f64; 2],
    /// AdamW epsilon, added to the bias-corrected `sqrt(v)`.
    pub adam_eps: f64,
    /// Decoupled weight decay (`p -= lr * weight_decay * p`).
    pub weight_decay: f64,
    /// Lower clip range ε: the ratio is clamped to `1 - eps_clip`.
    pub eps_clip: f64,
    /// Upper clip range ε_high: the ratio is clamped to `1 + eps_clip_high`.
    pub eps_clip_high: f64,
    /// Coefficient of the k3 KL term; `0` disables the reference model.
    pub kl_coef: f64,
    /// Maximum global L2 norm of the gradient (`0` or less disables clipping).
    pub grad_clip: f64,
    /// Samples per optimizer step.
    pub batch_size: usize,
    /// The loss of the OPD term (`"advantage"`, the default, or `"topk"`); a sample whose OPD
    /// term has the other form is refused by the step.
    pub opd_loss: OpdLossKind,
    /// Whether samples of a batch that share a token prefix run it through the model once
    /// ([`super::packing`]); the loss and gradients are those of the unpacked samples, so it is
    /// on by default.
    pub pack_prefixes: bool,
    /// Whether a step keeps only each decoder layer's input and recomputes the layer's
    /// activations in the backward pass ([`super::recompute`]): the same gradients, one more
    /// forward pass, and a fraction of the memory on long samples. Off by default.
    pub recompute_activations: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            lr: 1e-5,
            betas: [0.9, 0.98],
            adam_eps: 1e-8,
            weight_decay: 0.1,
            eps_clip: 0.2,
            eps_clip_high: 0.28,
            kl_coef: 0.02,
            grad_clip: 1.0,
            batch_size: 16,
            opd_loss: OpdLossKind::Advantage,
            pack_prefixes: true,
            recompute_activations: false,
        }
    }
}

/// Why a training configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read training config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// The TOML is malformed or has an unknown key or a value of the wrong type.
    #[error("invalid training config {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message (it names the key).
        message: String,
    },
    /// A value is out of its valid range.
    #[error("invalid training config {path}: key `{key}` {reason}")]
    Value {
        /// The file.
        path: String,
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl TrainConfig {
    /// Reads and validates a `TRAIN.toml`. Missing keys take the docs/design.md §1 defaults.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses and validates TOML text; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: TrainConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.message().to_string()
                + &e.span()
                    .map(|s| format!(" (at byte {})", s.start))
                    .unwrap_or_default(),
        })?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Checks every value's range; `origin` names the source in errors.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let bad = |key: &'static str, reason: String| ConfigError::Value {
            path: origin.to_string(),
            key,
            reason,
        };
        let finite_nonneg = |key: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(bad(key, format!("must be a finite number >= 0, got {v}")))
            }
        };
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(bad(
                "lr",
                format!("must be a finite number > 0, got {}", self.lr),
            ));
        }
        for b in self.betas {
            if !(0.0..1.0).contains(&b) {
                return Err(bad("betas", format!("values must lie in [0, 1), got {b}")));
            }
        }
        if !(self.adam_eps.is_finite() && self.adam_eps > 0.0) {
            return Err(bad(
                "adam_eps",
                format!("must be a finite number > 0, got {}", self.adam_eps),
            ));
        }
        finite_nonneg("weight_decay", self.weight_decay)?;
        finite_nonneg("eps_clip", self.eps_clip)?;
        if self.eps_clip >= 1.0 {
            return Err(bad(
                "eps_clip",
                format!("must be < 1, got {}", self.eps_clip),
            ));
        }
        finite_nonneg("eps_clip_high", self.eps_clip_high)?;
        finite_nonneg("kl_coef", self.kl_coef)?;
        if !self.grad_clip.is_finite() {
            return Err(bad(
                "grad_clip",
                format!("must be finite, got {}", self.grad_clip),
            ));
        }
        if self.batch_size == 0 {
            return Err(bad("batch_size", "must be at least 1".to_string()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_design() {
        let c = TrainConfig::from_toml_str("", "t.toml").unwrap();
        assert_eq!(c, TrainConfig::default());
        assert_eq!(c.betas, [0.9, 0.98]);
        assert_eq!((c.eps_clip, c.eps_clip_high, c.grad_clip), (0.2, 0.28, 1.0));
    }

    #[test]
    fn unknown_key_is_named_with_file() {
        let err = TrainConfig::from_toml_str("lr = 1e-3\nlearning_rate = 2\n", "TRAIN.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("learning_rate"), "{err}");
        assert!(err.contains("TRAIN.toml"), "{err}");
    }

    #[test]
    fn out_of_range_values_are_refused() {
        for (text, key) in [
            ("lr = 0.0", "lr"),
            ("betas = [0.9, 1.0]", "betas"),
            ("batch_size = 0", "batch_size"),
            ("kl_coef = -1.0", "kl_coef"),
            ("eps_clip = 1.5", "eps_clip"),
        ] {
            let err = TrainConfig::from_toml_str(text, "x.toml")
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }
}
