//! BurnLearner checkpoints: weights, the reference model (when the KL term is on), AdamW's moments,
//! the weight version, the step count, the training config and the RNG state, so that a resumed
//! run's next step equals the uninterrupted run's.
//!
//! Layout under a root directory:
//! ```text
//! ROOT/latest                       name of the newest complete checkpoint ("step-00000042")
//! ROOT/step-00000042/config.json    the model's config
//!                   /model.safetensors      policy weights, Hugging Face names, f32
//!                   /reference.safetensors  reference weights (only with kl_coef > 0)
//!                   /optimizer.safetensors  "<param path>.exp_avg" / ".exp_avg_sq", f32;
//!                                           per-parameter step counts in the metadata
//!                   /trainer_state.json     version, steps, training config, RNG state
//! ```
//! A learner that trains a LoRA adapter (its policy carries adapters, the base frozen) writes
//! the adapters instead of whole weights, so a checkpoint is as small as what trains, and its
//! directory is a PEFT adapter:
//! ```text
//! ROOT/step-00000042/adapter_config.json         the adapter's rank, alpha and targets
//!                   /adapter_model.safetensors   the policy's adapter, PEFT names, f32
//!                   /reference_adapter.safetensors  the reference's (only with kl_coef > 0)
//! ```
//! with `config.json`, `optimizer.safetensors` and `trainer_state.json` as above; the state's
//! `base` is the frozen base's fingerprint ([`Qwen3::base_fingerprint`]). Such a checkpoint is
//! restored onto a learner that holds the same base ([`restore_onto`]); another base is refused.
//!
//! Writes are atomic: a checkpoint is written into a temporary directory (each file written
//! and synced), renamed into place, and only then does `latest` move to it (temporary file,
//! then rename). A crash at any point leaves the previous checkpoint intact and `latest` valid.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::config::TrainConfig;
use super::learner::BurnLearner;
use super::optim::{AdamW, MomentsData};
use crate::model::peft::{
    adapter_config_json, adapter_from_safetensors, adapter_to_safetensors, parse_adapter_config,
    CONFIG_FILE as ADAPTER_CONFIG, WEIGHTS_FILE as ADAPTER_WEIGHTS,
};
use crate::model::{model_from_safetensors, model_to_safetensors, LoraConfig, Qwen3, Qwen3Config};

/// The reference model's adapter in an adapter checkpoint.
const REFERENCE_ADAPTER: &str = "reference_adapter.safetensors";

/// Why saving or restoring a checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Filesystem error on a path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file's content is invalid.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Serialising the weights failed.
    #[error("saving weights: {0}")]
    Save(#[from] crate::model::SaveError),
    /// Loading the weights failed.
    #[error("loading weights from {path}: {source}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: crate::model::LoadError,
    },
    /// An adapter file is malformed or does not fit the model.
    #[error("loading an adapter: {0}")]
    Adapter(#[from] crate::model::AdapterLoadError),
    /// The adapter does not fit the base it is restored onto.
    #[error("attaching the adapter: {0}")]
    Attach(#[from] crate::model::LoraError),
    /// The adapter checkpoint was trained over another base than the learner holds.
    #[error(
        "{path}: the adapters were trained over base {saved}, but the learner's base is {held}: \
         restore them onto the checkpoint they were trained from"
    )]
    OtherBase {
        /// The state file.
        path: PathBuf,
        /// The saved base fingerprint.
        saved: String,
        /// The learner's.
        held: String,
    },
    /// The checkpoint holds another kind of weights (adapters or whole weights), or adapters of
    /// another shape, than the learner it is restored onto trains.
    #[error("{path}: {message}")]
    OtherLayout {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        message: String,
    },
    /// The checkpoint holds adapters and needs a base to restore onto.
    #[error(
        "{path}: the checkpoint holds LoRA adapters: restore it onto a learner holding its base"
    )]
    NeedsBase {
        /// The checkpoint directory.
        path: PathBuf,
    },
    /// Writing an adapter failed.
    #[error("saving an adapter: {0}")]
    AdapterSave(#[from] safetensors::SafeTensorError),
}

/// RNG state: ChaCha8 seed, stream and word position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    /// 32-byte seed, hex.
    pub seed: String,
    /// Stream id.
    pub stream: u64,
    /// Word position (u128 as a decimal string, JSON numbers being f64-safe only to 2^53).
    pub word_pos: String,
}

impl RngState {
    /// Captures `rng`.
    pub fn capture(rng: &ChaCha8Rng) -> Self {
        Self {
            seed: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// Rebuilds the RNG; `None` when the fields are malformed.
    pub fn restore(&self) -> Option<ChaCha8Rng> {
        if self.seed.len() != 64 {
            return None;
        }
        let mut seed = [0u8; 32];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(self.seed.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(self.word_pos.parse().ok()?);
        Some(rng)
    }
}

/// `trainer_state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerState {
    /// Weight version.
    pub version: u64,
    /// Optimizer steps applied.
    pub steps: u64,
    /// Training hyper-parameters.
    pub train: TrainConfig,
    /// RNG state.
    pub rng: RngState,
    /// With adapters: the fingerprint of the frozen base they were trained over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory, synced, then renamed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io(path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = std::fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

fn optimizer_bytes(state: &BTreeMap<String, MomentsData>) -> Result<Vec<u8>, CheckpointError> {
    let mut buffers: Vec<(String, Vec<u8>, usize)> = Vec::new();
    let mut steps = HashMap::new();
    for (path, m) in state {
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        buffers.push((
            format!("{path}.exp_avg"),
            bytes(&m.exp_avg),
            m.exp_avg.len(),
        ));
        buffers.push((
            format!("{path}.exp_avg_sq"),
            bytes(&m.exp_avg_sq),
            m.exp_avg_sq.len(),
        ));
        steps.insert(format!("step:{path}"), m.step.to_string());
    }
    let views = buffers
        .iter()
        .map(|(name, b, n)| {
            TensorView::new(Dtype::F32, vec![*n], b)
                .map(|v| (name.clone(), v))
                .map_err(|e| invalid(Path::new(name), e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // With no tensors, the safetensors crate (0.6) writes metadata after an already closed
    // header (`{},"__metadata__":{}}`), which no reader parses: a learner saved before its
    // first step (no moments yet) writes no metadata.
    let meta = (!steps.is_empty()).then_some(steps);
    safetensors::tensor::serialize(views, meta)
        .map_err(|e| invalid(Path::new("optimizer.safetensors"), e.to_string()))
}

fn optimizer_from_bytes(
    path: &Path,
    bytes: &[u8],
) -> Result<BTreeMap<String, MomentsData>, CheckpointError> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| invalid(path, e.to_string()))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| invalid(path, e.to_string()))?;
    let floats = |name: &str| -> Result<Vec<f32>, CheckpointError> {
        let t = st
            .tensor(name)
            .map_err(|_| invalid(path, format!("missing tensor `{name}`")))?;
        if t.dtype() != Dtype::F32 {
            return Err(invalid(
                path,
                format!("tensor `{name}` is {:?}, expected F32", t.dtype()),
            ));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    let mut out = BTreeMap::new();
    for (key, value) in meta.metadata().iter().flatten() {
        let Some(param) = key.strip_prefix("step:") else {
            continue;
        };
        let step: u64 = value.parse().map_err(|_| {
            invalid(
                path,
                format!("metadata `{key}` is not a step count: {value}"),
            )
        })?;
        let exp_avg = floats(&format!("{param}.exp_avg"))?;
        let exp_avg_sq = floats(&format!("{param}.exp_avg_sq"))?;
        if exp_avg.len() != exp_avg_sq.len() {
            return Err(invalid(
                path,
                format!("moments of `{param}` differ in length"),
            ));
        }
        out.insert(
            param.to_string(),
            MomentsData {
                step,
                exp_avg,
                exp_avg_sq,
            },
        );
    }
    Ok(out)
}

/// Saves `learner` as a new checkpoint under `root` (named after its step count) and points
/// `root/latest` at it; returns the checkpoint's directory. Older checkpoints beyond the newest
/// `keep` are removed (`keep` of 0 keeps everything).
pub fn save<B: AutodiffBackend>(
    learner: &BurnLearner<B>,
    root: &Path,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let name = format!("step-{:08}", learner.steps());
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let cfg = learner.model_config();
    write_synced(&tmp.join("config.json"), cfg.to_json().as_bytes())?;
    let policy = learner.policy().valid();
    let base = match policy.lora_config() {
        None => {
            write_synced(
                &tmp.join("model.safetensors"),
                &model_to_safetensors(&policy, cfg)?,
            )?;
            if let Some(reference) = learner.reference() {
                write_synced(
                    &tmp.join("reference.safetensors"),
                    &model_to_safetensors(reference, cfg)?,
                )?;
            }
            None
        }
        Some(lora) => {
            let json = adapter_config_json(&lora, "");
            let text = serde_json::to_string_pretty(&json).expect("JSON serialises");
            write_synced(&tmp.join(ADAPTER_CONFIG), text.as_bytes())?;
            write_synced(
                &tmp.join(ADAPTER_WEIGHTS),
                &adapter_to_safetensors(&policy.lora_weights(&lora)?)?,
            )?;
            if let Some(reference) = learner.reference() {
                write_synced(
                    &tmp.join(REFERENCE_ADAPTER),
                    &adapter_to_safetensors(&reference.lora_weights(&lora)?)?,
                )?;
            }
            learner.base_fingerprint()
        }
    };
    drop(policy);
    write_synced(
        &tmp.join("optimizer.safetensors"),
        &optimizer_bytes(&learner.optimizer().export_state())?,
    )?;
    let state = TrainerState {
        version: learner.version(),
        steps: learner.steps(),
        train: learner.train_config().clone(),
        rng: RngState::capture(learner.rng_state()),
        base,
    };
    let json = serde_json::to_vec_pretty(&state).expect("state serialises");
    write_synced(&tmp.join("trainer_state.json"), &json)?;
    let dest = root.join(&name);
    if dest.exists() {
        let trash = root.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(&dest, &trash).map_err(io(&dest))?;
        std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
        std::fs::remove_dir_all(&trash).map_err(io(&trash))?;
    } else {
        std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    }
    write_atomic(&root.join("latest"), name.as_bytes())?;
    if keep > 0 {
        prune(root, keep)?;
    }
    Ok(dest)
}

fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    let mut dirs: Vec<String> = std::fs::read_dir(root)
        .map_err(io(root))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    dirs.sort();
    let n = dirs.len().saturating_sub(keep);
    for d in &dirs[..n] {
        let p = root.join(d);
        std::fs::remove_dir_all(&p).map_err(io(&p))?;
    }
    Ok(())
}

/// The directory `root/latest` points at.
pub fn latest(root: &Path) -> Result<PathBuf, CheckpointError> {
    let p = root.join("latest");
    let name = std::fs::read_to_string(&p).map_err(io(&p))?;
    let name = name.trim();
    if !name.starts_with("step-") || name.contains('/') {
        return Err(invalid(&p, format!("does not name a checkpoint: {name:?}")));
    }
    Ok(root.join(name))
}

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(io(path))
}

fn load_weights<B: burn::tensor::backend::Backend>(
    cfg: &Qwen3Config,
    path: &Path,
    device: &B::Device,
) -> Result<Qwen3<B>, CheckpointError> {
    model_from_safetensors(cfg, &read(path)?, device).map_err(|source| CheckpointError::Load {
        path: path.to_path_buf(),
        source,
    })
}

/// Restores the learner saved in checkpoint directory `dir` (a `step-*` directory; see
/// [`latest`]) onto `device`. A checkpoint of adapters needs its base: use [`restore_onto`].
pub fn restore<B: AutodiffBackend>(
    dir: &Path,
    device: &B::Device,
) -> Result<BurnLearner<B>, CheckpointError> {
    if dir.join(ADAPTER_CONFIG).exists() {
        return Err(CheckpointError::NeedsBase {
            path: dir.to_path_buf(),
        });
    }
    restore_parts(dir, device, None)
}

/// Restores the checkpoint in `dir` onto `learner`'s device. A checkpoint of LoRA adapters is
/// attached to `learner`'s frozen base (the policy's and the reference's, their adapters
/// replaced), after checking the base is the one the adapters were trained over; a checkpoint
/// of whole weights is restored as [`restore`] does.
pub fn restore_onto<B: AutodiffBackend>(
    dir: &Path,
    learner: &BurnLearner<B>,
) -> Result<BurnLearner<B>, CheckpointError> {
    // What trains must stay what trains: a learner of whole weights does not take adapters
    // (nor the other way round) because a checkpoint happens to hold them.
    let mismatch = |message: &str| CheckpointError::OtherLayout {
        path: dir.to_path_buf(),
        message: message.to_string(),
    };
    match (
        learner.policy().valid().lora_config(),
        dir.join(ADAPTER_CONFIG).exists(),
    ) {
        (None, true) => Err(mismatch(
            "the checkpoint holds LoRA adapters, but the learner trains whole weights",
        )),
        (Some(_), false) => Err(mismatch(
            "the checkpoint holds whole weights, but the learner trains a LoRA adapter",
        )),
        _ => restore_parts(dir, learner.device(), Some(learner)),
    }
}

fn restore_parts<B: AutodiffBackend>(
    dir: &Path,
    device: &B::Device,
    onto: Option<&BurnLearner<B>>,
) -> Result<BurnLearner<B>, CheckpointError> {
    let cfg_path = dir.join("config.json");
    let cfg_text =
        String::from_utf8(read(&cfg_path)?).map_err(|e| invalid(&cfg_path, e.to_string()))?;
    let cfg = Qwen3Config::from_json(&cfg_text).map_err(|e| invalid(&cfg_path, e.to_string()))?;
    let state_path = dir.join("trainer_state.json");
    let state: TrainerState = serde_json::from_slice(&read(&state_path)?)
        .map_err(|e| invalid(&state_path, e.to_string()))?;
    state
        .train
        .validate(&state_path.display().to_string())
        .map_err(|e| invalid(&state_path, e.to_string()))?;
    let rng = state
        .rng
        .restore()
        .ok_or_else(|| invalid(&state_path, "malformed `rng`"))?;
    let (policy, reference) = match onto.filter(|_| dir.join(ADAPTER_CONFIG).exists()) {
        Some(held) => restore_adapters(dir, &cfg, &state, &state_path, held)?,
        None if dir.join(ADAPTER_CONFIG).exists() => {
            return Err(CheckpointError::NeedsBase {
                path: dir.to_path_buf(),
            })
        }
        None => {
            let policy = load_weights::<B>(&cfg, &dir.join("model.safetensors"), device)?;
            let ref_path = dir.join("reference.safetensors");
            let reference = if ref_path.exists() {
                Some(load_weights::<B::InnerBackend>(&cfg, &ref_path, device)?)
            } else {
                None
            };
            (policy, reference)
        }
    };
    if reference.is_none() && state.train.kl_coef > 0.0 {
        return Err(invalid(
            dir,
            "kl_coef > 0 but the checkpoint holds no reference model",
        ));
    }
    let opt_path = dir.join("optimizer.safetensors");
    let moments = optimizer_from_bytes(&opt_path, &read(&opt_path)?)?;
    let mut optim = AdamW::new(super::learner::adamw_params(&state.train));
    optim.import_state(moments, device);
    Ok(BurnLearner::from_parts(
        cfg,
        policy,
        reference,
        optim,
        state.train,
        device.clone(),
        state.version,
        state.steps,
        rng,
    ))
}

type Restored<B> = (
    Qwen3<B>,
    Option<Qwen3<<B as AutodiffBackend>::InnerBackend>>,
);

/// The policy and reference of an adapter checkpoint, attached to `held`'s base.
fn restore_adapters<B: AutodiffBackend>(
    dir: &Path,
    cfg: &Qwen3Config,
    state: &TrainerState,
    state_path: &Path,
    held: &BurnLearner<B>,
) -> Result<Restored<B>, CheckpointError> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    let text = String::from_utf8_lossy(&read(&cfg_path)?).into_owned();
    let (lora, _, _): (LoraConfig, _, _) =
        parse_adapter_config(&text, &cfg_path.display().to_string())?;
    let held_lora = held.policy().valid().lora_config();
    let same_shape = held_lora.as_ref().is_some_and(|h| {
        h.r == lora.r
            && h.targets == lora.targets
            && (h.alpha - lora.alpha).abs() <= 1e-9 * lora.alpha
    });
    if !same_shape {
        return Err(CheckpointError::OtherLayout {
            path: cfg_path,
            message: format!(
                "the checkpoint's adapter is {lora:?}, but the learner trains {held_lora:?}"
            ),
        });
    }
    let saved = state
        .base
        .clone()
        .ok_or_else(|| invalid(state_path, "an adapter checkpoint without `base`"))?;
    let held_base = held
        .base_fingerprint()
        .expect("a learner with this adapter shape carries adapters");
    if saved != held_base {
        return Err(CheckpointError::OtherBase {
            path: state_path.to_path_buf(),
            saved,
            held: held_base,
        });
    }
    let adapter = |name: &str| -> Result<_, CheckpointError> {
        let path = dir.join(name);
        Ok(adapter_from_safetensors(
            &read(&path)?,
            lora.clone(),
            cfg,
            &path.display().to_string(),
        )?)
    };
    let policy = held
        .policy()
        .clone()
        .without_lora()
        .with_lora(&adapter(ADAPTER_WEIGHTS)?)?;
    let reference = match held.reference() {
        Some(r) if dir.join(REFERENCE_ADAPTER).exists() => Some(
            r.clone()
                .without_lora()
                .with_lora(&adapter(REFERENCE_ADAPTER)?)?,
        ),
        _ => None,
    };
    Ok((policy, reference))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optimizer_state_round_trips_also_before_the_first_step() {
        let empty = BTreeMap::new();
        let path = Path::new("optimizer.safetensors");
        let bytes = optimizer_bytes(&empty).unwrap();
        assert_eq!(optimizer_from_bytes(path, &bytes).unwrap(), empty);
        let state: BTreeMap<String, MomentsData> = [(
            "layers.0.w".to_string(),
            MomentsData {
                step: 3,
                exp_avg: vec![0.5, -1.0],
                exp_avg_sq: vec![0.25, 1.0],
            },
        )]
        .into();
        let bytes = optimizer_bytes(&state).unwrap();
        assert_eq!(optimizer_from_bytes(path, &bytes).unwrap(), state);
    }
}
