//! Weights in safetensors form: reading Hugging Face tensors (bf16, f16 or f32; one file or
//! shards) into a [`Qwen3`] and writing a model back as f32 safetensors with Hugging Face names
//! and `[out, in]` linear layout.

use std::collections::HashMap;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use bytes::Bytes;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use super::checkpoint::LoadError;
use super::config::Qwen3Config;
use super::cpu_tensor::{host_floats, HostFloats};
use super::lora::{base_and_adapter, effective_weight, LoraTarget};
use super::qwen3::{
    hf_weight_shapes, transpose, transpose_as, transpose_words, LinearLayout, Qwen3, WeightData,
};

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
    /// Per file, the shared buffer its f32 tensors may be handed out of without a copy
    /// ([`WeightData::Shared`]); `None`: every tensor is decoded into a vector of its own.
    owners: Vec<Option<Bytes>>,
}

impl<'a> TensorSource<'a> {
    /// Parses each `(label, bytes)` buffer; every tensor will be a copy.
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
        let owners = vec![None; files.len()];
        Ok(Self {
            files,
            index,
            owners,
        })
    }

    /// Parses each `(label, bytes)` buffer; an f32 tensor asked for as stored will share its
    /// buffer's memory instead of being copied (see [`TensorSource::build`] for when).
    pub(crate) fn shared(buffers: &'a [(String, Bytes)]) -> Result<Self, LoadError> {
        let mut source = Self::new(buffers)?;
        source.owners = buffers.iter().map(|(_, b)| Some(b.clone())).collect();
        Ok(source)
    }

    fn files_label(&self) -> String {
        self.files
            .iter()
            .map(|(l, _)| l.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The f32 data of `name`, checked against `shape`; a 2-D tensor comes transposed when
    /// `transposed` is set, decoded and transposed in one pass for f32 data. With `share`, an
    /// f32 tensor of a shared buffer that needs no transposing comes as a view of the buffer.
    pub(crate) fn get(
        &self,
        name: &str,
        shape: &[usize],
        transposed: bool,
        share: bool,
    ) -> Result<WeightData, LoadError> {
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
        let owner = self.owners[i].as_ref().filter(|_| share);
        match (transposed, shape, owner) {
            (false, _, Some(owner))
                if view.dtype() == Dtype::F32 && WeightData::shareable(view.data()) =>
            {
                Ok(WeightData::Shared(owner.slice_ref(view.data())))
            }
            (true, &[r, c], _) if view.dtype() == Dtype::F32 => {
                let (words, _) = view.data().as_chunks::<4>();
                Ok(transpose_as::<[u8; 4], f32>(words, r, c).into())
            }
            (true, &[r, c], _) => {
                Ok(transpose(&decode_f32(view.dtype(), view.data(), name, label)?, r, c).into())
            }
            _ => Ok(decode_f32(view.dtype(), view.data(), name, label)?.into()),
        }
    }

    /// Builds the model from these tensors, its linear weights kept as `layout` says. Tensors
    /// of a shared buffer are views of it only when the model keeps every linear weight as
    /// stored (`[out, in]`, on the CPU backend): were some copied, the views would keep the
    /// whole buffer alive beside the copies.
    pub(crate) fn build<B: Backend>(
        &self,
        cfg: &Qwen3Config,
        device: &B::Device,
        layout: LinearLayout,
    ) -> Result<Qwen3<B>, LoadError> {
        let share = layout.on::<B>() == LinearLayout::OutIn;
        Qwen3::build_as(cfg, device, layout, &mut |name, shape, transposed| {
            self.get(name, shape, transposed, share)
        })
    }
}

/// Loads a model from one safetensors buffer (Hugging Face names, any of bf16/f16/f32).
pub fn model_from_safetensors<B: Backend>(
    cfg: &Qwen3Config,
    bytes: &[u8],
    device: &B::Device,
) -> Result<Qwen3<B>, LoadError> {
    model_from_safetensors_as(cfg, bytes, device, LinearLayout::InOut)
}

/// [`model_from_safetensors`], the linear weights kept as `layout` says.
pub fn model_from_safetensors_as<B: Backend>(
    cfg: &Qwen3Config,
    bytes: &[u8],
    device: &B::Device,
    layout: LinearLayout,
) -> Result<Qwen3<B>, LoadError> {
    validate(cfg)?;
    let buffers = [("<safetensors blob>".to_string(), bytes)];
    TensorSource::new(&buffers)?.build(cfg, device, layout)
}

/// `cfg`, checked before a blob is read under it.
fn validate(cfg: &Qwen3Config) -> Result<(), LoadError> {
    cfg.validate().map_err(|e| LoadError::Config {
        file: "<config>".into(),
        source: e,
    })
}

/// [`model_from_safetensors_as`] from a shared blob: when the model keeps its weights as the
/// blob stores them (f32, linear layers `[out, in]` on the CPU backend), its tensors are views
/// of the blob, which then lives as long as they do; otherwise each tensor is a copy.
pub fn model_from_shared_safetensors<B: Backend>(
    cfg: &Qwen3Config,
    bytes: &Bytes,
    device: &B::Device,
    layout: LinearLayout,
) -> Result<Qwen3<B>, LoadError> {
    validate(cfg)?;
    let buffers = [("<safetensors blob>".to_string(), bytes.clone())];
    TensorSource::shared(&buffers)?.build(cfg, device, layout)
}

/// A named f32 tensor: `(Hugging Face name, shape, row-major data)`.
pub type HfTensor = (String, Vec<usize>, Vec<f32>);

/// A named tensor as safetensors stores it: `(name, shape, little-endian f32 bytes)`.
type LeTensor = (String, Vec<usize>, Vec<u8>);

/// f32 values as little-endian bytes.
fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .map(|x| x.to_le_bytes())
        .collect::<Vec<[u8; 4]>>()
        .into_flattened()
}

/// One weight on its way into a safetensors buffer: its elements on the host, and whether it
/// is a linear layer's Burn `[in, out]` matrix to be written in Hugging Face `[out, in]` order.
struct Outgoing {
    floats: HostFloats,
    /// The `[rows, cols]` of the matrix held, when it is written transposed.
    transpose: Option<[usize; 2]>,
    shape: Vec<usize>,
}

impl Outgoing {
    /// Writes the weight's little-endian f32 bytes into `slot` (its place in the buffer).
    fn write(&self, slot: &mut [u8]) {
        let (words, rest) = slot.as_chunks_mut::<4>();
        debug_assert!(rest.is_empty());
        match self.transpose {
            Some([r, c]) => transpose_words(&self.floats[..], r, c, words),
            None => {
                for (w, x) in words.iter_mut().zip(self.floats.iter()) {
                    *w = x.to_le_bytes();
                }
            }
        }
    }
}

/// Every weight of `model` by Hugging Face name; adapters are merged into the weights they
/// adapt.
fn outgoing_weights<B: Backend>(model: &Qwen3<B>) -> HashMap<String, Outgoing> {
    let mut have = HashMap::new();
    let mut put2 = |name: String, w: Tensor<B, 2>, transposed: bool| {
        let [r, c] = w.dims();
        let (transpose, shape) = match transposed {
            true => (Some([r, c]), vec![c, r]),
            false => (None, vec![r, c]),
        };
        let floats = host_floats(w);
        have.insert(
            name,
            Outgoing {
                floats,
                transpose,
                shape,
            },
        );
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
        let shape = w.dims().to_vec();
        let floats = host_floats(w);
        have.insert(
            name,
            Outgoing {
                floats,
                transpose: None,
                shape,
            },
        );
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
    have
}

/// Serializes `model` as one f32 safetensors buffer with Hugging Face tensor names and
/// `[out, in]` linear layers, in the layout `safetensors::serialize` gives (tensors sorted by
/// name, the header padded to 8 bytes). Each weight is written once, straight from the model's
/// buffer into its place in the result (transposed on the way for linear layers), instead of
/// through intermediate copies: every fresh buffer of this size costs its page faults again.
pub fn model_to_safetensors<B: Backend>(
    model: &Qwen3<B>,
    cfg: &Qwen3Config,
) -> Result<Vec<u8>, SaveError> {
    model_to_safetensors_into(model, cfg, Vec::new())
}

/// [`model_to_safetensors`] written into `out`'s memory (its contents are discarded); when its
/// capacity suffices no new memory is taken, and memory written before costs no page faults.
pub fn model_to_safetensors_into<B: Backend>(
    model: &Qwen3<B>,
    cfg: &Qwen3Config,
    mut out: Vec<u8>,
) -> Result<Vec<u8>, SaveError> {
    let mut have = outgoing_weights(model);
    let mut weights = Vec::new();
    for (name, shape) in hf_weight_shapes(cfg) {
        let Some(w) = have.remove(&name) else {
            return Err(SaveError::Mismatch {
                tensor: name,
                reason: "the model has no such weight (tied/untied head differs?)".into(),
            });
        };
        if w.shape != shape {
            return Err(SaveError::Mismatch {
                tensor: name,
                reason: format!("shape {:?}, config says {shape:?}", w.shape),
            });
        }
        weights.push((name, w));
    }
    if let Some(name) = have.keys().next() {
        return Err(SaveError::Mismatch {
            tensor: name.clone(),
            reason: "the config has no such weight".into(),
        });
    }
    weights.sort_by(|(a, _), (b, _)| a.cmp(b));

    let mut infos = Vec::with_capacity(weights.len());
    let mut offset = 0;
    for (name, w) in &weights {
        let len = 4 * w.floats.len();
        infos.push((
            name.clone(),
            TensorInfo {
                dtype: Dtype::F32,
                shape: w.shape.clone(),
                data_offsets: (offset, offset + len),
            },
        ));
        offset += len;
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let header = Metadata::new(Some(meta), infos)?;
    let mut header = serde_json::to_vec(&header).map_err(|e| SaveError::Mismatch {
        tensor: "the safetensors header".into(),
        reason: e.to_string(),
    })?;
    header.resize(header.len().next_multiple_of(8), b' ');

    // Zeroed, then filled exactly once below. Fresh memory comes zeroed from the allocator.
    let start = 8 + header.len();
    let len = start + offset;
    if out.capacity() >= len {
        out.clear();
        out.resize(len, 0);
    } else {
        out = vec![0u8; len];
    }
    out[..8].copy_from_slice(&(header.len() as u64).to_le_bytes());
    out[8..start].copy_from_slice(&header);
    let mut rest = &mut out[start..];
    for (_, w) in &weights {
        let (slot, tail) = rest.split_at_mut(4 * w.floats.len());
        w.write(slot);
        rest = tail;
    }
    Ok(out)
}

/// Serializes named f32 tensors as one safetensors buffer, with the `format = pt` metadata
/// PyTorch loaders expect.
pub fn f32_safetensors(tensors: Vec<HfTensor>) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    le_safetensors(
        tensors
            .into_iter()
            .map(|(n, s, d)| (n, s, le_bytes(&d)))
            .collect(),
    )
}

fn le_safetensors(tensors: Vec<LeTensor>) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let mut views = Vec::with_capacity(tensors.len());
    for (n, s, b) in &tensors {
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)?,
        ));
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(views, Some(meta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    /// The fixture's shape with an untied head, so that every kind of weight is written.
    fn config() -> Qwen3Config {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/qwen3-tiny/config.json"
        );
        let mut cfg = Qwen3Config::from_json(&std::fs::read_to_string(path).unwrap()).unwrap();
        cfg.tie_word_embeddings = false;
        cfg
    }

    #[test]
    fn the_one_pass_writer_gives_the_bytes_of_the_safetensors_serializer() {
        let cfg = config();
        // Every weight distinct, recorded in Hugging Face order as the model is built from it.
        let mut recorded: Vec<HfTensor> = Vec::new();
        let mut next = 0.0f32;
        let model = Qwen3::<CpuBackend>::build(&cfg, &Default::default(), &mut |name, shape, t| {
            let n: usize = shape.iter().product();
            let w: Vec<f32> = (0..n).map(|k| next + k as f32 * 1e-3).collect();
            next += 1.0;
            recorded.push((name.to_string(), shape.to_vec(), w.clone()));
            Ok::<_, std::convert::Infallible>(
                match (t, shape) {
                    (true, &[r, c]) => transpose(&w, r, c),
                    _ => w,
                }
                .into(),
            )
        })
        .unwrap();
        let expected = f32_safetensors(recorded).unwrap();
        let got = model_to_safetensors(&model, &cfg).unwrap();
        assert!(
            got == expected,
            "the bytes differ from safetensors::serialize's"
        );
        // And they load back into the same weights.
        let back = model_from_safetensors::<CpuBackend>(&cfg, &got, &Default::default()).unwrap();
        assert!(model_to_safetensors(&back, &cfg).unwrap() == got);
    }

    /// Where `w`'s elements live.
    fn storage<const D: usize>(w: Tensor<CpuBackend, D>) -> std::ops::Range<usize> {
        let p = w.into_primitive().tensor();
        let b = p.bytes();
        b.as_ptr() as usize..b.as_ptr() as usize + b.len()
    }

    /// A model read from a shared blob in the `[out, in]` layout keeps every weight as a view
    /// of the blob: the same values as a copying load, no copy, and a weight written to (an
    /// in-place op on a tensor nothing else holds) is copied first, leaving the blob as it was.
    /// In the `[in, out]` layout every weight is a copy, so the blob can be dropped.
    #[test]
    fn a_shared_blob_is_read_in_place_and_never_written() {
        let cfg = config();
        let device = Default::default();
        let blob = Bytes::from(
            model_to_safetensors(&Qwen3::<CpuBackend>::init(&cfg, &device, 3), &cfg).unwrap(),
        );
        let whole = blob.as_ptr() as usize..blob.as_ptr() as usize + blob.len();
        let inside = |r: std::ops::Range<usize>| whole.start <= r.start && r.end <= whole.end;

        let viewed =
            model_from_shared_safetensors::<CpuBackend>(&cfg, &blob, &device, LinearLayout::OutIn)
                .unwrap();
        assert_eq!(model_to_safetensors(&viewed, &cfg).unwrap(), blob.to_vec());
        let weights = [
            storage(viewed.embed_tokens.val()),
            storage(viewed.layers[0].self_attn.q_proj.val()),
            storage(viewed.layers[1].mlp.down_proj.val()),
            storage(viewed.lm_head.as_ref().unwrap().val()),
            storage(viewed.norm.weight.val()),
        ];
        assert!(weights.into_iter().all(inside), "a weight was copied");
        let copied =
            model_from_safetensors_as::<CpuBackend>(&cfg, &blob, &device, LinearLayout::OutIn)
                .unwrap();
        assert!(!inside(storage(copied.embed_tokens.val())));

        let before = blob.to_vec();
        let norm = viewed.norm.weight.val();
        drop(viewed);
        let written = norm.mul_scalar(2.0);
        assert!(!inside(storage(written.clone())));
        assert_eq!(blob.to_vec(), before, "writing a view changed the blob");
        drop((written, copied));

        let learner =
            model_from_shared_safetensors::<CpuBackend>(&cfg, &blob, &device, LinearLayout::InOut)
                .unwrap();
        assert!(!inside(storage(learner.embed_tokens.val())));
        assert!(!inside(storage(learner.norm.weight.val())));
        assert!(blob.is_unique(), "an [in, out] model still holds the blob");
    }

    #[test]
    fn transposing_in_tiles_matches_the_definition() {
        for (r, c) in [(1, 1), (3, 70), (65, 33), (32, 32), (100, 7)] {
            let v: Vec<f32> = (0..r * c).map(|k| k as f32).collect();
            let t = transpose(&v, r, c);
            for i in 0..r {
                for j in 0..c {
                    assert_eq!(t[j * r + i], v[i * c + j], "[{r}, {c}] at ({i}, {j})");
                }
            }
        }
    }
}
