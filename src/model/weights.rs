//! Weights in safetensors form: reading Hugging Face tensors (bf16, f16 or f32; one file or
//! shards) into a [`Qwen3`] and writing a model back as f32 safetensors with Hugging Face names
//! and `[out, in]` linear layout.

use std::collections::HashMap;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use safetensors::{Dtype, SafeTensors};

use super::checkpoint::LoadError;
use super::config::Qwen3Config;
use super::lora::{base_and_adapter, effective_weight, LoraTarget};
use super::qwen3::{hf_weight_shapes, transpose, Qwen3};

/// Errors while serializing a model.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The safetensors writer failed.
    #[error("safetensors: {0}")]
    SafeTensors(#[from] safetensors::SafeTensorError),
    /// The model does not have the shape the config describes.
    #[error("model does not match its config at tensor {tensor}: {reason}")]
    Mismatch {
        /// The Hugging Face tensor name.
        tensor: String,
        /// What differs.
        reason: String,
    },
    /// Writing a file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Decodes raw little-endian tensor bytes of a float dtype to f32.
pub fn decode_f32(
    dtype: Dtype,
    bytes: &[u8],
    tensor: &str,
    file: &str,
) -> Result<Vec<f32>, LoadError> {
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        other => {
            return Err(LoadError::UnsupportedDtype {
                tensor: tensor.to_string(),
                file: file.to_string(),
                dtype: format!("{other:?}"),
            })
        }
    })
}

/// A set of parsed safetensors buffers, each with a label (its file name) for errors.
pub(crate) struct TensorSource<'a> {
    files: Vec<(String, SafeTensors<'a>)>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl<'a> TensorSource<'a> {
    /// Parses each `(label, bytes)` buffer.
    pub(crate) fn new<T: AsRef<[u8]>>(buffers: &'a [(String, T)]) -> Result<Self, LoadError> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (label, bytes) in buffers {
            let st =
                SafeTensors::deserialize(bytes.as_ref()).map_err(|e| LoadError::SafeTensors {
                    file: label.clone(),
                    message: e.to_string(),
                })?;
            for name in st.names() {
                index.insert(name.to_string(), files.len());
            }
            files.push((label.clone(), st));
        }
        Ok(Self { files, index })
    }

    fn files_label(&self) -> String {
        self.files
            .iter()
            .map(|(l, _)| l.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The f32 data of `name`, checked against `shape`.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let Some(&i) = self.index.get(name) else {
            return Err(LoadError::MissingTensor {
                tensor: name.to_string(),
                file: self.files_label(),
            });
        };
        let (label, st) = &self.files[i];
        let view = st.tensor(name).map_err(|e| LoadError::SafeTensors {
            file: label.clone(),
            message: e.to_string(),
        })?;
        if view.shape() != shape {
            return Err(LoadError::WrongShape {
                tensor: name.to_string(),
                file: label.clone(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        decode_f32(view.dtype(), view.data(), name, label)
    }

    /// Builds the model from these tensors.
    pub(crate) fn build<B: Backend>(
        &self,
        cfg: &Qwen3Config,
        device: &B::Device,
    ) -> Result<Qwen3<B>, LoadError> {
        Qwen3::build(cfg, device, &mut |name, shape| self.get(name, shape))
    }
}

/// Loads a model from one safetensors buffer (Hugging Face names, any of bf16/f16/f32).
pub fn model_from_safetensors<B: Backend>(
    cfg: &Qwen3Config,
    bytes: &[u8],
    device: &B::Device,
) -> Result<Qwen3<B>, LoadError> {
    cfg.validate().map_err(|e| LoadError::Config {
        file: "<config>".into(),
        source: e,
    })?;
    let buffers = [("<safetensors blob>".to_string(), bytes)];
    TensorSource::new(&buffers)?.build(cfg, device)
}

fn tensor_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .expect("converted to f32")
}

/// A named f32 tensor: `(Hugging Face name, shape, row-major data)`.
pub type HfTensor = (String, Vec<usize>, Vec<f32>);

/// Every weight of `model` in Hugging Face names and layout (`[out, in]` for linear layers), f32;
/// adapters are merged into the weights they adapt.
pub fn model_hf_tensors<B: Backend>(
    model: &Qwen3<B>,
    cfg: &Qwen3Config,
) -> Result<Vec<HfTensor>, SaveError> {
    let mut have: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
    let mut put2 = |name: String, w: Tensor<B, 2>, transposed: bool| {
        let [r, c] = w.dims();
        let data = tensor_f32(w);
        if transposed {
            have.insert(name, (vec![c, r], transpose(&data, r, c)));
        } else {
            have.insert(name, (vec![r, c], data));
        }
    };
    put2(
        "model.embed_tokens.weight".into(),
        model.embed_tokens.val(),
        false,
    );
    if let Some(w) = &model.lm_head {
        put2("lm_head.weight".into(), w.val(), true);
    }
    // A layer with an adapter is written as the weight it applies, `W + scaling · A B`.
    for (l, layer) in model.layers.iter().enumerate() {
        for t in LoraTarget::ALL {
            let (w, lora) = base_and_adapter(layer, t);
            put2(
                format!("model.layers.{l}.{}.weight", t.hf_path()),
                effective_weight(w, lora),
                true,
            );
        }
    }
    let mut put1 = |name: String, w: Tensor<B, 1>| {
        let n = w.dims()[0];
        have.insert(name, (vec![n], tensor_f32(w)));
    };
    for (l, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        put1(
            format!("{p}.input_layernorm.weight"),
            layer.input_layernorm.weight.val(),
        );
        put1(
            format!("{p}.post_attention_layernorm.weight"),
            layer.post_attention_layernorm.weight.val(),
        );
        put1(
            format!("{p}.self_attn.q_norm.weight"),
            layer.self_attn.q_norm.weight.val(),
        );
        put1(
            format!("{p}.self_attn.k_norm.weight"),
            layer.self_attn.k_norm.weight.val(),
        );
    }
    put1("model.norm.weight".into(), model.norm.weight.val());

    let mut out = Vec::new();
    for (name, shape) in hf_weight_shapes(cfg) {
        let Some((got_shape, data)) = have.remove(&name) else {
            return Err(SaveError::Mismatch {
                tensor: name,
                reason: "the model has no such weight (tied/untied head differs?)".into(),
            });
        };
        if got_shape != shape {
            return Err(SaveError::Mismatch {
                tensor: name,
                reason: format!("shape {got_shape:?}, config says {shape:?}"),
            });
        }
        out.push((name, shape, data));
    }
    if let Some(name) = have.keys().next() {
        return Err(SaveError::Mismatch {
            tensor: name.clone(),
            reason: "the config has no such weight".into(),
        });
    }
    Ok(out)
}

/// Serializes `model` as one f32 safetensors buffer with Hugging Face tensor names.
pub fn model_to_safetensors<B: Backend>(
    model: &Qwen3<B>,
    cfg: &Qwen3Config,
) -> Result<Vec<u8>, SaveError> {
    Ok(f32_safetensors(model_hf_tensors(model, cfg)?)?)
}

/// Serializes named f32 tensors as one safetensors buffer, with the `format = pt` metadata
/// PyTorch loaders expect.
pub fn f32_safetensors(tensors: Vec<HfTensor>) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, d)| {
            let b: Vec<u8> = d.iter().flat_map(|x| x.to_le_bytes()).collect();
            (n, s, b)
        })
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (n, s, b) in &bytes {
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)?,
        ));
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(views, Some(meta))
}
