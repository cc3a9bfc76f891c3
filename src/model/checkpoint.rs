//! A Hugging Face checkpoint directory: `config.json`, `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), `tokenizer.json`, and the chat template from
//! `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`. Loads it into a
//! [`Checkpoint`] and saves one back in the same layout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use serde_json::Value as Json;

use super::chat::{ChatError, ChatTemplate, Prompt};
use super::config::{ConfigError, Qwen3Config};
use super::qwen3::{LinearLayout, Qwen3};
use super::weights::{model_to_safetensors, SaveError, TensorSource};

/// Why a required file of a checkpoint or adapter directory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file is absent.
    #[error("missing file {path}")]
    Missing {
        /// The path looked for.
        path: PathBuf,
    },
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The required file `path`, read by `read` (as bytes or as text).
pub(crate) fn read_required<T>(
    path: &Path,
    read: impl FnOnce(&Path) -> std::io::Result<T>,
) -> Result<T, ReadError> {
    if !path.exists() {
        return Err(ReadError::Missing {
            path: path.to_path_buf(),
        });
    }
    read(path).map_err(|source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Errors while loading a checkpoint or weights; each names the file or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A required file is absent or could not be read.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// `config.json` is invalid.
    #[error("{file}: {source}")]
    Config {
        /// The config file.
        file: String,
        /// What is wrong.
        source: ConfigError,
    },
    /// A JSON file is malformed.
    #[error("{file}: {message}")]
    Json {
        /// The file.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// A safetensors buffer is malformed.
    #[error("{file}: invalid safetensors: {message}")]
    SafeTensors {
        /// The file (or blob label).
        file: String,
        /// The parser's message.
        message: String,
    },
    /// A weight the config requires is not in the files.
    #[error("tensor {tensor} not found in {file}")]
    MissingTensor {
        /// Hugging Face tensor name.
        tensor: String,
        /// The files searched.
        file: String,
    },
    /// A weight has the wrong shape for the config.
    #[error("tensor {tensor} in {file} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        /// Hugging Face tensor name.
        tensor: String,
        /// The file holding it.
        file: String,
        /// Shape required by the config.
        expected: Vec<usize>,
        /// Shape found.
        found: Vec<usize>,
    },
    /// A weight has a dtype other than bf16, f16 or f32.
    #[error("tensor {tensor} in {file} has unsupported dtype {dtype} (supported: BF16, F16, F32)")]
    UnsupportedDtype {
        /// Hugging Face tensor name.
        tensor: String,
        /// The file holding it.
        file: String,
        /// The dtype found.
        dtype: String,
    },
    /// `tokenizer.json` could not be loaded.
    #[error("{file}: tokenizer: {message}")]
    Tokenizer {
        /// The file.
        file: String,
        /// The tokenizers crate's message.
        message: String,
    },
    /// The chat template is absent or does not compile.
    #[error(transparent)]
    Template(#[from] ChatError),
    /// No chat template was found.
    #[error("no chat template: neither {jinja} nor a \"chat_template\" key in {config}")]
    NoTemplate {
        /// The `chat_template.jinja` path looked for.
        jinja: PathBuf,
        /// The `tokenizer_config.json` path looked in.
        config: PathBuf,
    },
}

/// The tokenizer-side files of a checkpoint, kept verbatim so a save writes them back unchanged.
#[derive(Debug, Clone, Default)]
pub struct TokenizerFiles {
    /// `tokenizer.json` text.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` text, when present.
    pub tokenizer_config_json: Option<String>,
    /// `chat_template.jinja` text, when the template came from that file.
    pub chat_template_jinja: Option<String>,
    /// `generation_config.json` text, when present.
    pub generation_config_json: Option<String>,
}

/// Everything loaded from a checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint<B: Backend> {
    /// The validated config.
    pub config: Qwen3Config,
    /// The model, weights in f32.
    pub model: Qwen3<B>,
    /// The tokenizer from `tokenizer.json`.
    pub tokenizer: tokenizers::Tokenizer,
    /// The compiled chat template.
    pub chat_template: ChatTemplate,
    /// The tokenizer-side files as read, for saving.
    pub files: TokenizerFiles,
}

impl<B: Backend> Checkpoint<B> {
    /// Renders messages (and tools) with the chat template, generation prompt on, and tokenizes.
    pub fn encode_chat(
        &self,
        messages: &minijinja::Value,
        tools: Option<&minijinja::Value>,
    ) -> Result<Prompt, ChatError> {
        self.chat_template.encode(&self.tokenizer, messages, tools)
    }

    /// Token ids that end generation: the `eos_token_id`s of `config.json` and
    /// `generation_config.json`, and the tokenizer config's `eos_token`.
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut ids: BTreeSet<u32> = self.config.eos_token_ids().into_iter().collect();
        if let Some(text) = &self.files.generation_config_json {
            if let Ok(v) = serde_json::from_str::<Json>(text) {
                match v.get("eos_token_id") {
                    Some(Json::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
                    Some(Json::Array(a)) => {
                        ids.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32))
                    }
                    _ => {}
                }
            }
        }
        for (k, v) in self.chat_template.special_tokens() {
            if k == "eos_token" {
                if let Some(id) = self.tokenizer.token_to_id(v) {
                    ids.insert(id);
                }
            }
        }
        ids.into_iter().collect()
    }
}

fn read_text(path: &Path) -> Result<String, LoadError> {
    Ok(read_required(path, |p| std::fs::read_to_string(p))?)
}

fn read_optional(path: &Path) -> Result<Option<String>, LoadError> {
    if path.exists() {
        read_text(path).map(Some)
    } else {
        Ok(None)
    }
}

fn read_bytes(path: &Path) -> Result<Vec<u8>, LoadError> {
    Ok(read_required(path, |p| std::fs::read(p))?)
}

/// Reads and validates `dir/config.json`.
pub fn load_config(dir: &Path) -> Result<Qwen3Config, LoadError> {
    let path = dir.join("config.json");
    let text = read_text(&path)?;
    Qwen3Config::from_json(&text).map_err(|e| LoadError::Config {
        file: path.display().to_string(),
        source: e,
    })
}

/// Reads the weight files of `dir`: the shards of `model.safetensors.index.json` when it
/// exists, else `model.safetensors`. Returns `(file label, bytes)` pairs.
fn read_weight_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, LoadError> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.exists() {
        let text = read_text(&index_path)?;
        let label = index_path.display().to_string();
        let json: Json = serde_json::from_str(&text).map_err(|e| LoadError::Json {
            file: label.clone(),
            message: e.to_string(),
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LoadError::Json {
                file: label.clone(),
                message: "no \"weight_map\" object".into(),
            })?;
        let mut shards = BTreeSet::new();
        for (tensor, file) in map {
            let f = file.as_str().ok_or_else(|| LoadError::Json {
                file: label.clone(),
                message: format!("weight_map[{tensor:?}] is not a file name"),
            })?;
            if f.contains('/') || f.contains("..") {
                return Err(LoadError::Json {
                    file: label.clone(),
                    message: format!("weight_map[{tensor:?}] = {f:?} is not a plain file name"),
                });
            }
            shards.insert(f.to_string());
        }
        let mut out = Vec::new();
        for f in shards {
            let p = dir.join(&f);
            out.push((p.display().to_string(), read_bytes(&p)?));
        }
        Ok(out)
    } else {
        let p = dir.join("model.safetensors");
        Ok(vec![(p.display().to_string(), read_bytes(&p)?)])
    }
}

/// Special-token strings (`bos_token`, `eos_token`, ...) from `tokenizer_config.json`; each is a
/// string or an `{"content": ...}` object.
fn special_tokens(config: &Json) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        let v = match config.get(key) {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(String::from),
            _ => None,
        };
        if let Some(v) = v {
            out.push((key.to_string(), v));
        }
    }
    out
}

/// Loads the tokenizer and chat template of `dir`.
pub fn load_tokenizer_files(
    dir: &Path,
) -> Result<(tokenizers::Tokenizer, ChatTemplate, TokenizerFiles), LoadError> {
    let tok_path = dir.join("tokenizer.json");
    let tokenizer_json = read_text(&tok_path)?;
    let tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json.as_bytes()).map_err(|e| {
        LoadError::Tokenizer {
            file: tok_path.display().to_string(),
            message: e.to_string(),
        }
    })?;
    let cfg_path = dir.join("tokenizer_config.json");
    let tokenizer_config_json = read_optional(&cfg_path)?;
    let tok_cfg: Json = match &tokenizer_config_json {
        Some(t) => serde_json::from_str(t).map_err(|e| LoadError::Json {
            file: cfg_path.display().to_string(),
            message: e.to_string(),
        })?,
        None => Json::Null,
    };
    let jinja_path = dir.join("chat_template.jinja");
    let chat_template_jinja = read_optional(&jinja_path)?;
    let specials = special_tokens(&tok_cfg);
    let chat_template = if let Some(src) = &chat_template_jinja {
        ChatTemplate::new(src, &jinja_path.display().to_string(), specials)?
    } else {
        match tok_cfg.get("chat_template") {
            Some(Json::String(src)) => ChatTemplate::new(
                src,
                &format!("{} (chat_template)", cfg_path.display()),
                specials,
            )?,
            Some(Json::Array(list)) => {
                // A list of named templates: use the one named "default".
                let src = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| LoadError::Json {
                        file: cfg_path.display().to_string(),
                        message: "chat_template list has no \"default\" template".into(),
                    })?;
                ChatTemplate::new(
                    src,
                    &format!("{} (chat_template default)", cfg_path.display()),
                    specials,
                )?
            }
            _ => {
                return Err(LoadError::NoTemplate {
                    jinja: jinja_path,
                    config: cfg_path,
                })
            }
        }
    };
    let generation_config_json = read_optional(&dir.join("generation_config.json"))?;
    Ok((
        tokenizer,
        chat_template,
        TokenizerFiles {
            tokenizer_json,
            tokenizer_config_json,
            chat_template_jinja,
            generation_config_json,
        },
    ))
}

/// Loads only the model of `dir` (config and weights).
pub fn load_model<B: Backend>(
    dir: &Path,
    device: &B::Device,
) -> Result<(Qwen3Config, Qwen3<B>), LoadError> {
    load_model_in(dir, device, LinearLayout::InOut)
}

/// [`load_model`] with the linear weights kept as `layout` says.
pub fn load_model_in<B: Backend>(
    dir: &Path,
    device: &B::Device,
    layout: LinearLayout,
) -> Result<(Qwen3Config, Qwen3<B>), LoadError> {
    let config = load_config(dir)?;
    let buffers = read_weight_files(dir)?;
    let model = TensorSource::new(&buffers)?.build(&config, device, layout)?;
    Ok((config, model))
}

/// The weights of checkpoint directory `dir` built under `config` instead of its own (e.g. the
/// learner's float32 config: [`crate::train::learner::float32_config`]), which must describe the
/// same shapes.
pub fn load_model_as<B: Backend>(
    dir: &Path,
    config: &Qwen3Config,
    device: &B::Device,
) -> Result<Qwen3<B>, LoadError> {
    let buffers = read_weight_files(dir)?;
    TensorSource::new(&buffers)?.build(config, device, LinearLayout::InOut)
}

/// Loads a whole Hugging Face checkpoint directory.
pub fn load_checkpoint<B: Backend>(
    dir: &Path,
    device: &B::Device,
) -> Result<Checkpoint<B>, LoadError> {
    load_checkpoint_in(dir, device, LinearLayout::InOut)
}

/// [`load_checkpoint`] with the linear weights kept as `layout` says (what a model that will
/// not train them, or only serve, may ask for: see [`LinearLayout`]).
pub fn load_checkpoint_in<B: Backend>(
    dir: &Path,
    device: &B::Device,
    layout: LinearLayout,
) -> Result<Checkpoint<B>, LoadError> {
    let (config, model) = load_model_in(dir, device, layout)?;
    let (tokenizer, chat_template, files) = load_tokenizer_files(dir)?;
    Ok(Checkpoint {
        config,
        model,
        tokenizer,
        chat_template,
        files,
    })
}

/// Writes a checkpoint directory in the Hugging Face layout: `config.json`, `model.safetensors`
/// (f32), and the tokenizer files as they were read. Creates `dir` if needed. The config's
/// `dtype`/`torch_dtype` is kept as loaded (see [`super::qwen3::rope_inv_freq`]).
pub fn save_checkpoint_dir<B: Backend>(
    dir: &Path,
    config: &Qwen3Config,
    model: &Qwen3<B>,
    files: &TokenizerFiles,
) -> Result<(), SaveError> {
    let io = |path: &Path| {
        let p = path.display().to_string();
        move |e| SaveError::Io { path: p, source: e }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // The declared dtype is kept even though the weights are written in f32: it decides how
    // `transformers` (and this loader, for the RoPE buffer) computes, so a reload reproduces the
    // same logits.
    let cfg = config;
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).map_err(io(&p))
    };
    write("config.json", cfg.to_json().as_bytes())?;
    write("model.safetensors", &model_to_safetensors(model, config)?)?;
    write("tokenizer.json", files.tokenizer_json.as_bytes())?;
    if let Some(t) = &files.tokenizer_config_json {
        write("tokenizer_config.json", t.as_bytes())?;
    }
    if let Some(t) = &files.chat_template_jinja {
        write("chat_template.jinja", t.as_bytes())?;
    }
    if let Some(t) = &files.generation_config_json {
        write("generation_config.json", t.as_bytes())?;
    }
    Ok(())
}
