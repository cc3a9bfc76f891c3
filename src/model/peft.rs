//! The Hugging Face PEFT adapter directory, both ways: `adapter_config.json` and
//! `adapter_model.safetensors` read into [`LoraWeights`] (with every option this model does not
//! implement refused by name), and written back so that PEFT's `PeftModel.from_pretrained`
//! loads them.
//!
//! Tensor names are PEFT's saved names for a Qwen3 causal LM,
//! `base_model.model.model.layers.N.<self_attn|mlp>.<target>.lora_A.weight` (`[r, in]`) and
//! `...lora_B.weight` (`[out, r]`); the adapter name (`default`) that PEFT uses in memory is not
//! part of the saved names.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use safetensors::SafeTensors;
use serde_json::{json, Value as Json};

use super::checkpoint::{read_required, ReadError};
use super::config::Qwen3Config;
use super::lora::{LoraConfig, LoraError, LoraTarget, LoraWeights};
use super::qwen3::Qwen3;
use super::weights::{decode_f32, f32_safetensors};

/// The adapter's configuration file.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's weights.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// An adapter directory as read.
#[derive(Debug, Clone, PartialEq)]
pub struct PeftAdapter {
    /// The adapter's tensors and shape.
    pub weights: LoraWeights,
    /// `lora_dropout`: accepted whatever its value, since dropout does nothing at inference;
    /// training with this crate always uses none, so `train-offline` refuses a non-zero value.
    pub lora_dropout: f64,
    /// `base_model_name_or_path`, when given.
    pub base_model_name_or_path: Option<String>,
}

/// Why an adapter directory could not be loaded; each names the file, and the key or tensor at
/// fault.
#[derive(Debug, thiserror::Error)]
pub enum AdapterLoadError {
    /// A required file is absent or could not be read.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// `adapter_config.json` is not JSON, or a key has the wrong type or value.
    #[error("{file}: `{key}`: {message}")]
    Config {
        /// The config file.
        file: String,
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The config asks for a PEFT option this model does not implement.
    #[error("{file}: `{key}` = {value} is not supported: {why}")]
    Unsupported {
        /// The config file.
        file: String,
        /// The key.
        key: String,
        /// Its value, as JSON.
        value: String,
        /// What is supported instead.
        why: &'static str,
    },
    /// The safetensors file is malformed.
    #[error("{file}: invalid safetensors: {message}")]
    SafeTensors {
        /// The file.
        file: String,
        /// The parser's message.
        message: String,
    },
    /// A tensor is not a LoRA matrix of a configured target of an existing layer.
    #[error("{file}: unexpected tensor {tensor}: {why}")]
    UnexpectedTensor {
        /// The file.
        file: String,
        /// The tensor's name.
        tensor: String,
        /// Why it does not belong.
        why: String,
    },
    /// A configured target lacks its `lora_A` or `lora_B` in some layer.
    #[error("{file}: tensor {tensor} is missing")]
    MissingTensor {
        /// The file.
        file: String,
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor's shape does not fit the rank and the model.
    #[error("{file}: tensor {tensor} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        /// The file.
        file: String,
        /// The tensor's name.
        tensor: String,
        /// `[r, in]` or `[out, r]`.
        expected: Vec<usize>,
        /// What the file holds.
        found: Vec<usize>,
    },
    /// A tensor's dtype is not a float one.
    #[error(transparent)]
    Dtype(#[from] super::checkpoint::LoadError),
    /// The adapter does not fit the model.
    #[error("{dir}: {source}")]
    Attach {
        /// The adapter directory.
        dir: PathBuf,
        /// The cause.
        source: LoraError,
    },
}

/// Why an adapter directory could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AdapterSaveError {
    /// Writing a file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The safetensors writer failed.
    #[error("safetensors: {0}")]
    SafeTensors(#[from] safetensors::SafeTensorError),
}

/// PEFT's saved name of one adapter matrix (`which` is `lora_A` or `lora_B`).
pub fn tensor_name(layer: usize, target: LoraTarget, which: &str) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.{which}.weight",
        target.hf_path()
    )
}

/// Splits a saved name into `(layer, target, which)`, or says why it is not one.
fn parse_tensor_name(name: &str) -> Result<(usize, LoraTarget, &str), String> {
    let rest = name
        .strip_prefix("base_model.model.model.layers.")
        .ok_or("not under base_model.model.model.layers")?;
    let (layer, rest) = rest.split_once('.').ok_or("no layer index")?;
    let layer: usize = layer.parse().map_err(|_| "no layer index")?;
    let (path, which) = rest
        .strip_suffix(".weight")
        .and_then(|r| r.rsplit_once('.'))
        .filter(|(_, w)| *w == "lora_A" || *w == "lora_B")
        .ok_or("not a lora_A.weight or lora_B.weight")?;
    let target = LoraTarget::ALL
        .into_iter()
        .find(|t| t.hf_path() == path)
        .ok_or_else(|| format!("`{path}` is not an adaptable linear layer"))?;
    Ok((layer, target, which))
}

/// True when a JSON value leaves an option at its default: absent, null, false, an empty list,
/// object or string.
fn unset(v: Option<&Json>) -> bool {
    match v {
        None | Some(Json::Null) | Some(Json::Bool(false)) => true,
        Some(Json::Array(a)) => a.is_empty(),
        Some(Json::Object(o)) => o.is_empty(),
        Some(Json::String(s)) => s.is_empty(),
        Some(_) => false,
    }
}

/// Options this model leaves at PEFT's defaults, and what it does instead.
const MUST_BE_UNSET: &[(&str, &str)] = &[
    ("use_dora", "DoRA is not implemented; only plain LoRA"),
    (
        "use_rslora",
        "rank-stabilised scaling is not implemented; scaling is lora_alpha / r",
    ),
    (
        "modules_to_save",
        "only the LoRA matrices are loaded; no fully trained modules",
    ),
    (
        "fan_in_fan_out",
        "weights are stored [out, in] as in torch.nn.Linear",
    ),
    ("lora_bias", "adapters have no bias"),
    ("layers_to_transform", "every layer carries the adapter"),
    ("layers_pattern", "every layer carries the adapter"),
    ("rank_pattern", "one rank for every layer"),
    ("alpha_pattern", "one alpha for every layer"),
    (
        "exclude_modules",
        "target_modules must name exactly the adapted layers",
    ),
    (
        "layer_replication",
        "the model's layers are used as they are",
    ),
    ("trainable_token_indices", "embeddings carry no adapter"),
    ("target_parameters", "only linear modules carry adapters"),
    ("use_qalora", "QA-LoRA is not implemented"),
    (
        "alora_invocation_tokens",
        "activated LoRA is not implemented",
    ),
];

/// Parses `adapter_config.json`; `file` names it in errors.
pub fn parse_adapter_config(
    text: &str,
    file: &str,
) -> Result<(LoraConfig, f64, Option<String>), AdapterLoadError> {
    let config_err = |key: &str, message: String| AdapterLoadError::Config {
        file: file.to_string(),
        key: key.to_string(),
        message,
    };
    let v: Json = serde_json::from_str(text).map_err(|e| config_err("(file)", e.to_string()))?;
    let obj = v
        .as_object()
        .ok_or_else(|| config_err("(file)", "not a JSON object".into()))?;
    let unsupported = |key: &str, why: &'static str| AdapterLoadError::Unsupported {
        file: file.to_string(),
        key: key.to_string(),
        value: obj.get(key).map(Json::to_string).unwrap_or_default(),
        why,
    };
    match obj.get("peft_type").and_then(Json::as_str) {
        Some("LORA") => {}
        _ => return Err(unsupported("peft_type", "only \"LORA\" adapters")),
    }
    for &(key, why) in MUST_BE_UNSET {
        if !unset(obj.get(key)) {
            return Err(unsupported(key, why));
        }
    }
    match obj.get("bias") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) if s == "none" => {}
        Some(_) => return Err(unsupported("bias", "only \"none\": adapters have no bias")),
    }
    let r = obj
        .get("r")
        .and_then(Json::as_u64)
        .ok_or_else(|| config_err("r", "must be a whole number".into()))? as usize;
    let alpha = obj
        .get("lora_alpha")
        .and_then(Json::as_f64)
        .ok_or_else(|| config_err("lora_alpha", "must be a number".into()))?;
    let dropout = match obj.get("lora_dropout") {
        None | Some(Json::Null) => 0.0,
        Some(d) => d
            .as_f64()
            .filter(|d| (0.0..1.0).contains(d))
            .ok_or_else(|| config_err("lora_dropout", format!("{d} is not in [0, 1)")))?,
    };
    let targets = match obj.get("target_modules") {
        Some(Json::String(s)) if s == "all-linear" => LoraTarget::ALL.to_vec(),
        Some(Json::Array(list)) => list
            .iter()
            .map(|t| {
                t.as_str().and_then(LoraTarget::from_name).ok_or_else(|| {
                    config_err(
                        "target_modules",
                        format!(
                            "{t} is not one of {}",
                            LoraTarget::ALL.map(LoraTarget::name).join(", ")
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(config_err(
                "target_modules",
                format!(
                    "{} must be a list of module names or \"all-linear\" (patterns are not \
                     supported)",
                    other.map(Json::to_string).unwrap_or("absent".into())
                ),
            ))
        }
    };
    let config = LoraConfig::new(r, alpha, targets).map_err(|e| {
        let key = match e.key {
            "lora.r" => "r",
            "lora.alpha" => "lora_alpha",
            _ => "target_modules",
        };
        config_err(key, e.message)
    })?;
    let base = obj
        .get("base_model_name_or_path")
        .and_then(Json::as_str)
        .map(String::from);
    Ok((config, dropout, base))
}

fn read(path: &Path) -> Result<Vec<u8>, AdapterLoadError> {
    Ok(read_required(path, |p| std::fs::read(p))?)
}

/// Reads the adapter directory `dir` for a model of shape `model`: the config, then every
/// tensor, checked against the rank, the targets and the model's layers and features.
pub fn load_adapter(dir: &Path, model: &Qwen3Config) -> Result<PeftAdapter, AdapterLoadError> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = String::from_utf8_lossy(&read(&cfg_path)?).into_owned();
    let (config, lora_dropout, base_model_name_or_path) =
        parse_adapter_config(&text, &cfg_path.display().to_string())?;
    let st_path = dir.join(WEIGHTS_FILE);
    let bytes = read(&st_path)?;
    let weights = adapter_from_safetensors(&bytes, config, model, &st_path.display().to_string())?;
    Ok(PeftAdapter {
        weights,
        lora_dropout,
        base_model_name_or_path,
    })
}

/// The adapter of shape `config` held in `bytes` (an `adapter_model.safetensors`, PEFT tensor
/// names), for a model of shape `model`: every tensor is checked against the rank, the targets
/// and the model's layers and features, and every configured matrix must be present. `file`
/// names the bytes in errors.
pub fn adapter_from_safetensors(
    bytes: &[u8],
    config: LoraConfig,
    model: &Qwen3Config,
    file: &str,
) -> Result<LoraWeights, AdapterLoadError> {
    let file = file.to_string();
    let st = SafeTensors::deserialize(bytes).map_err(|e| AdapterLoadError::SafeTensors {
        file: file.clone(),
        message: e.to_string(),
    })?;
    let unexpected = |tensor: &str, why: String| AdapterLoadError::UnexpectedTensor {
        file: file.clone(),
        tensor: tensor.to_string(),
        why,
    };
    let mut found: HashMap<(usize, LoraTarget, bool), Vec<f32>> = HashMap::new();
    for (name, view) in st.tensors() {
        let (layer, target, which) = parse_tensor_name(&name).map_err(|w| unexpected(&name, w))?;
        if layer >= model.num_hidden_layers {
            return Err(unexpected(
                &name,
                format!("the model has {} layers", model.num_hidden_layers),
            ));
        }
        if !config.targets.contains(&target) {
            return Err(unexpected(
                &name,
                format!("`{}` is not in target_modules", target.name()),
            ));
        }
        let (inp, out) = target.features(model);
        let is_a = which == "lora_A";
        let expected = if is_a {
            vec![config.r, inp]
        } else {
            vec![out, config.r]
        };
        if view.shape() != expected {
            return Err(AdapterLoadError::WrongShape {
                file: file.clone(),
                tensor: name,
                expected,
                found: view.shape().to_vec(),
            });
        }
        let data = decode_f32(view.dtype(), view.data(), &name, &file)?;
        found.insert((layer, target, is_a), data);
    }
    let mut tensors = BTreeMap::new();
    for layer in 0..model.num_hidden_layers {
        for &t in &config.targets {
            let mut take = |is_a: bool| {
                found.remove(&(layer, t, is_a)).ok_or_else(|| {
                    let which = if is_a { "lora_A" } else { "lora_B" };
                    AdapterLoadError::MissingTensor {
                        file: file.clone(),
                        tensor: tensor_name(layer, t, which),
                    }
                })
            };
            let a = take(true)?;
            let b = take(false)?;
            tensors.insert((layer, t), (a, b));
        }
    }
    Ok(LoraWeights { config, tensors })
}

/// `weights` as an `adapter_model.safetensors` (f32, PEFT tensor names): what
/// [`adapter_from_safetensors`] reads back.
pub fn adapter_to_safetensors(
    weights: &LoraWeights,
) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let r = weights.config.r;
    let mut named = Vec::with_capacity(2 * weights.tensors.len());
    for ((layer, t), (a, b)) in &weights.tensors {
        named.push((
            tensor_name(*layer, *t, "lora_A"),
            vec![r, a.len() / r],
            a.clone(),
        ));
        named.push((
            tensor_name(*layer, *t, "lora_B"),
            vec![b.len() / r, r],
            b.clone(),
        ));
    }
    f32_safetensors(named)
}

/// Reads the adapter directory `dir` and attaches it to `model` (whose shape is `cfg`), freezing
/// the base (see [`Qwen3::with_lora`]).
pub fn apply_adapter<B: Backend>(
    model: Qwen3<B>,
    cfg: &Qwen3Config,
    dir: &Path,
) -> Result<Qwen3<B>, AdapterLoadError> {
    let adapter = load_adapter(dir, cfg)?;
    model
        .with_lora(&adapter.weights)
        .map_err(|source| AdapterLoadError::Attach {
            dir: dir.to_path_buf(),
            source,
        })
}

/// `adapter_config.json` for `config`: every key PEFT reads when it loads a LoRA adapter, at the
/// values this model implements (no dropout, no bias, plain scaling, every layer).
pub fn adapter_config_json(config: &LoraConfig, base_model_name_or_path: &str) -> Json {
    // PEFT's own files give lora_alpha as an integer; keep that form when alpha is whole.
    let alpha = if config.alpha.fract() == 0.0 && config.alpha < 1e15 {
        json!(config.alpha as u64)
    } else {
        json!(config.alpha)
    };
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": alpha,
        "target_modules": config.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": true,
        "inference_mode": true,
        "revision": null,
    })
}

/// Writes `weights` as a PEFT adapter directory (creating `dir`): `adapter_config.json` and
/// `adapter_model.safetensors` in f32.
pub fn save_adapter(
    dir: &Path,
    weights: &LoraWeights,
    base_model_name_or_path: &str,
) -> Result<(), AdapterSaveError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| AdapterSaveError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let st = dir.join(WEIGHTS_FILE);
    std::fs::write(&st, adapter_to_safetensors(weights)?).map_err(io(&st))?;
    let cfg = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&adapter_config_json(
        &weights.config,
        base_model_name_or_path,
    ))
    .expect("a JSON value serialises");
    std::fs::write(&cfg, text + "\n").map_err(io(&cfg))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = "tests/fixtures/qwen3-tiny-lora/adapter_config.json";

    fn fixture_config() -> serde_json::Map<String, Json> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn parse(obj: &serde_json::Map<String, Json>) -> Result<LoraConfig, String> {
        parse_adapter_config(
            &Json::Object(obj.clone()).to_string(),
            "adapter_config.json",
        )
        .map(|(c, _, _)| c)
        .map_err(|e| e.to_string())
    }

    #[test]
    fn the_fixture_config_parses() {
        let c = parse(&fixture_config()).unwrap();
        assert_eq!((c.r, c.alpha, c.targets.len()), (4, 8.0, 7));
    }

    #[test]
    fn unsupported_options_are_refused_by_key() {
        for (key, value) in [
            ("use_dora", json!(true)),
            ("use_rslora", json!(true)),
            ("modules_to_save", json!(["lm_head"])),
            ("bias", json!("all")),
            ("layers_to_transform", json!([0])),
            ("rank_pattern", json!({"q_proj": 8})),
            ("alpha_pattern", json!({"q_proj": 8})),
            ("fan_in_fan_out", json!(true)),
            ("peft_type", json!("IA3")),
            ("target_modules", json!(".*proj")),
            ("target_modules", json!(["q_proj", "lm_head"])),
            ("r", json!(0)),
            ("lora_dropout", json!(1.5)),
        ] {
            let mut obj = fixture_config();
            obj.insert(key.into(), value.clone());
            let e = parse(&obj).unwrap_err();
            assert!(e.contains(&format!("`{key}`")), "{key} = {value}: {e}");
        }
        let mut obj = fixture_config();
        obj.insert("lora_dropout".into(), json!(0.05));
        let (_, dropout, _) =
            parse_adapter_config(&Json::Object(obj).to_string(), "adapter_config.json").unwrap();
        assert_eq!(dropout, 0.05);
    }

    #[test]
    fn tensor_names_round_trip() {
        for t in LoraTarget::ALL {
            let n = tensor_name(3, t, "lora_B");
            assert_eq!(parse_tensor_name(&n).unwrap(), (3, t, "lora_B"));
        }
        assert!(parse_tensor_name("base_model.model.lm_head.lora_A.weight").is_err());
        assert!(parse_tensor_name(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
        )
        .is_err());
    }
}
