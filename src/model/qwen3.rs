//! The Qwen3 decoder as a Burn module: embedding, `num_hidden_layers` pre-norm blocks
//! (RMSNorm → grouped-query attention with per-head q/k RMSNorm and RoPE → residual; RMSNorm →
//! SwiGLU MLP → residual), a final RMSNorm and a tied or untied LM head.
//!
//! Weights are stored the Burn way, `[in, out]` (Hugging Face stores `[out, in]`; the loaders in
//! [`super::weights`] transpose). With tied embeddings the LM head multiplies by the transpose of
//! the one `embed_tokens` parameter, so under autodiff both uses accumulate into it.
//!
//! Two ways in: [`Qwen3::forward`] runs full causal attention over a batch from position 0 (for
//! training and scoring), and [`Qwen3::prefill`] / [`Qwen3::decode_step`] run against a
//! [`KvCache`] kept outside the model (for generation), so many sequences share one set of weights.
//!
//! Each of a block's seven linear layers may carry a low-rank adapter ([`super::lora`]) beside
//! its base weight; without one, the layer is the plain product. A decode step may also run a
//! batch whose rows use different adapters over the one base ([`Qwen3::decode_step_mixed`]):
//! every row shares the base product, and each row adds its own adapter's.

use std::any::TypeId;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::module::embedding;
use burn::tensor::{Int, Tensor, TensorData};
use rayon::prelude::*;

use super::attention::{cached_attention, causal_attention, prefixed_attention};
use super::config::Qwen3Config;
use super::cpu_matmul::{self, AdapterRows};
use super::cpu_tensor::{floats, Floats};
use super::fused::{repeat_kv, rms_norm, rope_heads_first, swap_heads, swiglu};
use super::kv_cache::{KvCache, KvCacheError};
use super::lora::Lora;
use super::matmul::matmul;
use crate::{CpuAutodiff, CpuBackend};

/// Root-mean-square layer norm over the last dimension (no bias, no mean subtraction).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Per-channel scale, `[dim]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square before the square root.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// `[..., dim]` → `[..., dim]`: `x / sqrt(mean(x²) + eps) * weight`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        rms_norm(x, self.weight.val(), self.eps)
    }
}

/// `[b, s, in]` × `[in, out]` → `[b, s, out]`, plus the low-rank adapter's `[b, s, out]` when
/// the layer has one (`W x + (alpha / r) · B (A x)`, see [`Lora::forward`]).
fn linear<B: Backend>(
    x: Tensor<B, 3>,
    w: &Param<Tensor<B, 2>>,
    lora: Option<&Lora<B>>,
) -> Tensor<B, 3> {
    let [b, s, i] = x.dims();
    let w = w.val();
    let o = w.dims()[1];
    let x = x.reshape([b * s, i]);
    let y = match lora {
        None => matmul(x, w),
        Some(lora) => matmul(x.clone(), w) + lora.forward(x),
    };
    y.reshape([b, s, o])
}

/// Whose low-rank adapters a block applies.
enum Mix<'a, B: Backend> {
    /// The block's own adapters, on every row.
    Own,
    /// Each group of batch rows (indices into dimension 0) takes the adapters of its block, the
    /// same block of another model over the same base weights; the base product is this block's
    /// own, computed once for every row.
    Rows(&'a [(&'a [usize], &'a DecoderLayer<B>)]),
}

// Written out: the derive would require `B: Copy`.
impl<B: Backend> Clone for Mix<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Mix<'_, B> {}

/// [`linear`] under `mix`: `own` is the layer's own adapter, and `pick` finds the same layer's
/// adapter in another model's block.
///
/// Row groups run as two products whatever their number: the groups' `A`s side by side
/// (`[in, R]`, `R` the sum of their ranks) take every row, a mask keeps each row's own group's
/// columns, scaled by its `alpha / r`, and the groups' `B`s stacked (`[R, out]`) finish the
/// product: row `i` of group `g` gets `scaling_g · (x_i A_g) B_g`.
fn adapted<'a, B: Backend>(
    x: Tensor<B, 3>,
    w: &Param<Tensor<B, 2>>,
    own: Option<&Lora<B>>,
    mix: Mix<'a, B>,
    pick: impl Fn(&'a DecoderLayer<B>) -> Option<&'a Lora<B>>,
) -> Tensor<B, 3> {
    let groups = match mix {
        Mix::Own => return linear(x, w, own),
        Mix::Rows(groups) => groups,
    };
    let y = linear(x.clone(), w, None);
    let present: Vec<(&[usize], &Lora<B>)> = groups
        .iter()
        .filter_map(|(rows, layer)| pick(layer).map(|lora| (*rows, lora)))
        .collect();
    if present.is_empty() {
        return y;
    }
    let [b, s, i] = x.dims();
    let o = y.dims()[2];
    if TypeId::of::<B>() == TypeId::of::<CpuBackend>() {
        return y + cpu_adapted_delta(&x, &present, o);
    }
    let ranks: usize = present.iter().map(|(_, l)| l.a.dims()[1]).sum();
    // Row `row`'s positions are rows `row * s ..` of the flattened `[b * s, in]`.
    let mut mask = vec![0f32; b * s * ranks];
    let mut first = 0;
    for (rows, lora) in &present {
        let r = lora.a.dims()[1];
        for &row in *rows {
            for p in row * s..(row + 1) * s {
                mask[p * ranks + first..p * ranks + first + r].fill(lora.scaling as f32);
            }
        }
        first += r;
    }
    let device = x.device();
    let mask = Tensor::<B, 2>::from_data(TensorData::new(mask, [b * s, ranks]), &device);
    let a = Tensor::cat(present.iter().map(|(_, l)| l.a.val()).collect(), 1);
    let bs = Tensor::cat(present.iter().map(|(_, l)| l.b.val()).collect(), 0);
    let delta = matmul(matmul(x.reshape([b * s, i]), a) * mask, bs);
    y + delta.reshape([b, s, o])
}

/// [`adapted`]'s low-rank sum on the CPU backend's raw floats, each group over its own rows
/// ([`cpu_matmul::adapter_delta`]). The generic path concatenates every group's `A` and `B` at
/// every call: at a batch of 16 rows over 4 adapters of rank 16, about 14 MB copied per decode
/// step, a third of what the base weights take to read.
fn cpu_adapted_delta<B: Backend>(
    x: &Tensor<B, 3>,
    present: &[(&[usize], &Lora<B>)],
    o: usize,
) -> Tensor<B, 3> {
    let [b, s, i] = x.dims();
    let xs = floats(x.clone());
    let weights: Vec<(Floats, Floats)> = present
        .iter()
        .map(|(_, l)| (floats(l.a.val()), floats(l.b.val())))
        .collect();
    let groups: Vec<AdapterRows> = present
        .iter()
        .zip(&weights)
        .map(|((rows, lora), (a, bm))| AdapterRows {
            // Row `row`'s positions are rows `row * s ..` of the flattened `[b * s, in]`.
            rows: rows
                .iter()
                .flat_map(|&row| row * s..(row + 1) * s)
                .collect(),
            a,
            b: bm,
            rank: lora.a.dims()[1],
            scaling: lora.scaling as f32,
        })
        .collect();
    let delta = cpu_matmul::adapter_delta(&xs, b * s, i, o, &groups);
    Tensor::from_data(TensorData::new(delta, [b, s, o]), &x.device())
}

/// RoPE inverse frequencies `1 / theta^(2i / head_dim)` for `i < head_dim / 2`, computed in f32
/// as Hugging Face does, then rounded to `round_to` (the checkpoint's dtype) when that is bf16 or
/// f16: `transformers` casts the whole module, this buffer included, to the checkpoint dtype on
/// load, and the reference logits are computed with that rounded buffer.
pub fn rope_inv_freq(head_dim: usize, theta: f64, round_to: Option<&str>) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / head_dim as f32;
            let f = 1.0 / (theta as f32).powf(exponent);
            match round_to {
                Some("bfloat16") => half::bf16::from_f32(f).to_f32(),
                Some("float16") => half::f16::from_f32(f).to_f32(),
                _ => f,
            }
        })
        .collect()
}

/// RoPE tables for the given positions (f32 angles, as Hugging Face): returns `(cos, sin)`,
/// each `[positions.len(), 2 * inv_freq.len()]` flattened row-major, with the half-width table
/// repeated twice along the row.
pub fn rope_tables(positions: &[usize], inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let width = 2 * inv_freq.len();
    let mut cos = Vec::with_capacity(positions.len() * width);
    let mut sin = Vec::with_capacity(positions.len() * width);
    for &p in positions {
        for _ in 0..2 {
            for f in inv_freq {
                let a = f * p as f32;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
    }
    (cos, sin)
}

/// Grouped-query self-attention with per-head q/k RMSNorm.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[hidden, heads * head_dim]`.
    pub q_proj: Param<Tensor<B, 2>>,
    /// `[hidden, kv_heads * head_dim]`.
    pub k_proj: Param<Tensor<B, 2>>,
    /// `[hidden, kv_heads * head_dim]`.
    pub v_proj: Param<Tensor<B, 2>>,
    /// `[heads * head_dim, hidden]`.
    pub o_proj: Param<Tensor<B, 2>>,
    /// Low-rank adapter on `q_proj` (`None`: the base weight alone).
    pub q_lora: Option<Lora<B>>,
    /// Low-rank adapter on `k_proj`.
    pub k_lora: Option<Lora<B>>,
    /// Low-rank adapter on `v_proj`.
    pub v_lora: Option<Lora<B>>,
    /// Low-rank adapter on `o_proj`.
    pub o_lora: Option<Lora<B>>,
    /// RMSNorm over each query head.
    pub q_norm: RmsNorm<B>,
    /// RMSNorm over each key head.
    pub k_norm: RmsNorm<B>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
}

impl<B: Backend> Attention<B> {
    /// Projects `x [b, s, hidden]` to `(q [b, heads, s, d], k [b, kv_heads, s, d],
    /// v [b, kv_heads, s, d])`, with q/k normalised and rotated by `cos`/`sin` (broadcastable to
    /// `[b, 1, s, d]`).
    fn qkv(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        mix: Mix<'_, B>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
        let [b, s, _] = x.dims();
        let (nq, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = adapted(x.clone(), &self.q_proj, self.q_lora.as_ref(), mix, |l| {
            l.self_attn.q_lora.as_ref()
        });
        let k = adapted(x.clone(), &self.k_proj, self.k_lora.as_ref(), mix, |l| {
            l.self_attn.k_lora.as_ref()
        });
        let v = adapted(x, &self.v_proj, self.v_lora.as_ref(), mix, |l| {
            l.self_attn.v_lora.as_ref()
        });
        let (q, k, v) = (
            q.reshape([b, s, nq, d]),
            k.reshape([b, s, nkv, d]),
            v.reshape([b, s, nkv, d]),
        );
        let q = rope_heads_first(self.q_norm.forward(q), cos.clone(), sin.clone());
        let k = rope_heads_first(self.k_norm.forward(k), cos, sin);
        (q, k, swap_heads(v))
    }

    /// Repeats each key/value head `heads / kv_heads` times: `[b, kv, s, d]` → `[b, heads, s, d]`.
    fn repeat_kv(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        repeat_kv(x, self.num_heads)
    }

    /// `[b, heads, s, d]` → `[b, s, hidden]` through `o_proj`.
    fn output(&self, o: Tensor<B, 4>, mix: Mix<'_, B>) -> Tensor<B, 3> {
        let [b, h, s, d] = o.dims();
        adapted(
            swap_heads(o).reshape([b, s, h * d]),
            &self.o_proj,
            self.o_lora.as_ref(),
            mix,
            |l| l.self_attn.o_lora.as_ref(),
        )
    }

    /// Full causal self-attention from position 0: `x [b, s, hidden]` → `[b, s, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        let (q, k, v) = self.qkv(x, cos, sin, Mix::Own);
        let o = causal_attention(q, self.repeat_kv(k), self.repeat_kv(v));
        self.output(o, Mix::Own)
    }

    /// Attention of a shared prefix and the rows that continue it (a packed batch):
    /// `prefix [1, p, hidden]` at positions `0..p` attends causally to itself; each row of
    /// `rows [r, l, hidden]` at positions `p..p + l` attends to the whole prefix and causally to
    /// itself, never to another row. `rope_*` are the `(cos, sin)` of those positions. →
    /// `([1, p, hidden], [r, l, hidden])`.
    pub fn forward_prefixed(
        &self,
        prefix: Tensor<B, 3>,
        rows: Tensor<B, 3>,
        rope_prefix: (Tensor<B, 4>, Tensor<B, 4>),
        rope_rows: (Tensor<B, 4>, Tensor<B, 4>),
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (qp, kp, vp) = self.qkv(prefix, rope_prefix.0, rope_prefix.1, Mix::Own);
        let (kp, vp) = (self.repeat_kv(kp), self.repeat_kv(vp));
        let op = causal_attention(qp, kp.clone(), vp.clone());
        let (qr, kr, vr) = self.qkv(rows, rope_rows.0, rope_rows.1, Mix::Own);
        let or = prefixed_attention(qr, kp, vp, self.repeat_kv(kr), self.repeat_kv(vr));
        (self.output(op, Mix::Own), self.output(or, Mix::Own))
    }
}

/// The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[hidden, intermediate]`.
    pub gate_proj: Param<Tensor<B, 2>>,
    /// `[hidden, intermediate]`.
    pub up_proj: Param<Tensor<B, 2>>,
    /// `[intermediate, hidden]`.
    pub down_proj: Param<Tensor<B, 2>>,
    /// Low-rank adapter on `gate_proj` (`None`: the base weight alone).
    pub gate_lora: Option<Lora<B>>,
    /// Low-rank adapter on `up_proj`.
    pub up_lora: Option<Lora<B>>,
    /// Low-rank adapter on `down_proj`.
    pub down_lora: Option<Lora<B>>,
}

impl<B: Backend> Mlp<B> {
    /// `[b, s, hidden]` → `[b, s, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_mix(x, Mix::Own)
    }

    fn forward_mix(&self, x: Tensor<B, 3>, mix: Mix<'_, B>) -> Tensor<B, 3> {
        let gate = adapted(
            x.clone(),
            &self.gate_proj,
            self.gate_lora.as_ref(),
            mix,
            |l| l.mlp.gate_lora.as_ref(),
        );
        let up = adapted(x, &self.up_proj, self.up_lora.as_ref(), mix, |l| {
            l.mlp.up_lora.as_ref()
        });
        adapted(
            swiglu(gate, up),
            &self.down_proj,
            self.down_lora.as_ref(),
            mix,
            |l| l.mlp.down_lora.as_ref(),
        )
    }
}

/// One pre-norm decoder block.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Self-attention.
    pub self_attn: Attention<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    /// The MLP.
    pub mlp: Mlp<B>,
}

impl<B: Backend> DecoderLayer<B> {
    /// `[b, s, hidden]` → `[b, s, hidden]` with full causal attention.
    pub fn forward(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        let h = x.clone()
            + self
                .self_attn
                .forward(self.input_layernorm.forward(x), cos, sin);
        self.feed_forward(h, Mix::Own)
    }

    /// A shared prefix `[1, p, hidden]` and the rows `[r, l, hidden]` that continue it, through
    /// the block (see [`Attention::forward_prefixed`]).
    pub fn forward_prefixed(
        &self,
        prefix: Tensor<B, 3>,
        rows: Tensor<B, 3>,
        rope_prefix: (Tensor<B, 4>, Tensor<B, 4>),
        rope_rows: (Tensor<B, 4>, Tensor<B, 4>),
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (ap, ar) = self.self_attn.forward_prefixed(
            self.input_layernorm.forward(prefix.clone()),
            self.input_layernorm.forward(rows.clone()),
            rope_prefix,
            rope_rows,
        );
        (
            self.feed_forward(prefix + ap, Mix::Own),
            self.feed_forward(rows + ar, Mix::Own),
        )
    }

    /// The block's second half on the attention's residual `h`: `h + mlp(norm(h))`.
    fn feed_forward(&self, h: Tensor<B, 3>, mix: Mix<'_, B>) -> Tensor<B, 3> {
        h.clone()
            + self
                .mlp
                .forward_mix(self.post_attention_layernorm.forward(h), mix)
    }
}

/// The Qwen3 causal language model.
#[derive(Module, Debug)]
pub struct Qwen3<B: Backend> {
    /// Token embedding `[vocab, hidden]`; also the LM head when embeddings are tied.
    pub embed_tokens: Param<Tensor<B, 2>>,
    /// Decoder blocks.
    pub layers: Vec<DecoderLayer<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    /// Untied LM head `[hidden, vocab]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    /// RoPE inverse frequencies, `[head_dim / 2]` (see [`rope_inv_freq`]).
    #[module(skip)]
    pub rope_inv_freq: Vec<f32>,
    /// Longest supported sequence.
    pub max_position_embeddings: usize,
}

/// Shapes of every weight, in Hugging Face names and `[out, in]` orientation for linear layers.
pub fn hf_weight_shapes(cfg: &Qwen3Config) -> Vec<(String, Vec<usize>)> {
    let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (nq, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![nq * d, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![nkv * d, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![nkv * d, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, nq * d]),
            (format!("{p}.self_attn.q_norm.weight"), vec![d]),
            (format!("{p}.self_attn.k_norm.weight"), vec![d]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
        ]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Supplies one weight by Hugging Face name and shape (see [`Qwen3::build`]), row-major; when
/// the flag is set, a 2-D weight comes transposed (`[in, out]` for a linear layer's
/// `[out, in]`), so that a source can decode and transpose in one pass.
pub type WeightGetter<'a, E> = dyn FnMut(&str, &[usize], bool) -> Result<WeightData, E> + 'a;

/// The f32 elements of one weight as a [`WeightGetter`] hands them over.
pub enum WeightData {
    /// Decoded into a vector of their own.
    Owned(Vec<f32>),
    /// Little-endian f32 bytes, 4-byte aligned, in a buffer the source shares: the tensor
    /// keeps a reference into the buffer instead of a copy, so the buffer lives as long as
    /// the tensor (a replica's received version, which its bulk store holds anyway).
    Shared(bytes::Bytes),
}

impl From<Vec<f32>> for WeightData {
    fn from(v: Vec<f32>) -> Self {
        WeightData::Owned(v)
    }
}

impl WeightData {
    /// Whether `bytes` may be [`WeightData::Shared`]: their f32 values read in place only on a
    /// little-endian host and at an address a `f32` may sit at.
    pub fn shareable(bytes: &[u8]) -> bool {
        cfg!(target_endian = "little")
            && bytes.len().is_multiple_of(4)
            && (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>())
    }

    /// The tensor data of `shape`, sharing the bytes when they are shared.
    fn into_tensor_data(self, shape: &[usize]) -> TensorData {
        match self {
            WeightData::Owned(v) => TensorData::new(v, shape.to_vec()),
            WeightData::Shared(b) => TensorData::from_bytes(
                burn::tensor::Bytes::from_shared(b, burn::tensor::AllocationProperty::Native),
                shape.to_vec(),
                burn::tensor::DType::F32,
            ),
        }
    }

    /// The values in a vector of their own (a copy when shared).
    fn into_vec(self) -> Vec<f32> {
        match self {
            WeightData::Owned(v) => v,
            WeightData::Shared(b) => {
                let (words, _) = b.as_chunks::<4>();
                words.iter().map(|w| f32::from_le_bytes(*w)).collect()
            }
        }
    }
}

impl<B: Backend> Qwen3<B> {
    /// A randomly initialised model: normal(0, `initializer_range`) weights drawn from a
    /// ChaCha8 stream seeded by `seed` (Box-Muller), unit norms. The same seed and config give
    /// the same weights on every backend and run, whatever else draws random numbers.
    pub fn init(cfg: &Qwen3Config, device: &B::Device, seed: u64) -> Self {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let std = cfg.initializer_range;
        Self::build(cfg, device, &mut |name, shape, transposed| {
            let n: usize = shape.iter().product();
            if name.ends_with("norm.weight") {
                return Ok::<_, std::convert::Infallible>(vec![1.0; n].into());
            }
            // Drawn in Hugging Face order whatever the layout asked, so a seed means one model.
            let w: Vec<f32> = (0..n)
                .map(|_| {
                    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                    let u2: f64 = rng.random();
                    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * std) as f32
                })
                .collect();
            Ok(match (transposed, shape) {
                (true, &[r, c]) => transpose(&w, r, c),
                _ => w,
            }
            .into())
        })
        .unwrap_or_else(|e| match e {})
    }

    /// Builds the model from weights given in Hugging Face names and layout: `get(name, shape,
    /// transposed)` returns the f32 data of that tensor (`shape` is `[out, in]` for linear
    /// layers, which are asked for transposed: Burn keeps them `[in, out]`).
    pub fn build<E>(
        cfg: &Qwen3Config,
        device: &B::Device,
        get: &mut WeightGetter<'_, E>,
    ) -> Result<Self, E> {
        Self::build_as(cfg, device, LinearLayout::InOut, get)
    }

    /// [`build`](Self::build), keeping the linear weights as `layout` says (asked for
    /// transposed only for [`LinearLayout::InOut`]).
    pub fn build_as<E>(
        cfg: &Qwen3Config,
        device: &B::Device,
        layout: LinearLayout,
        get: &mut WeightGetter<'_, E>,
    ) -> Result<Self, E> {
        let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let eps = cfg.rms_norm_eps;
        let mut vector = |name: &str, n: usize| -> Result<Param<Tensor<B, 1>>, E> {
            let data = get(name, &[n], false)?;
            Ok(Param::from_tensor(Tensor::<B, 1>::from_data(
                data.into_tensor_data(&[n]),
                device,
            )))
        };
        let mut norms = Vec::new();
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            norms.push((
                vector(&format!("{p}.input_layernorm.weight"), h)?,
                vector(&format!("{p}.self_attn.q_norm.weight"), d)?,
                vector(&format!("{p}.self_attn.k_norm.weight"), d)?,
                vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            ));
        }
        let final_norm = vector("model.norm.weight", h)?;
        let embed = get("model.embed_tokens.weight", &[cfg.vocab_size, h], false)?;
        // Linear weights: HF [out, in] → Burn [in, out], kept as `layout` says.
        let transposed = layout == LinearLayout::InOut;
        let mut matrix = |name: &str, out: usize, inp: usize| -> Result<Param<Tensor<B, 2>>, E> {
            let data = get(name, &[out, inp], transposed)?;
            Ok(Param::from_tensor(layout.tensor(
                data,
                [out, inp],
                transposed,
                device,
            )))
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (l, (in_norm, q_norm, k_norm, post_norm)) in norms.into_iter().enumerate() {
            let p = format!("model.layers.{l}");
            layers.push(DecoderLayer {
                input_layernorm: RmsNorm {
                    weight: in_norm,
                    eps,
                },
                self_attn: Attention {
                    q_proj: matrix(&format!("{p}.self_attn.q_proj.weight"), nq * d, h)?,
                    k_proj: matrix(&format!("{p}.self_attn.k_proj.weight"), nkv * d, h)?,
                    v_proj: matrix(&format!("{p}.self_attn.v_proj.weight"), nkv * d, h)?,
                    o_proj: matrix(&format!("{p}.self_attn.o_proj.weight"), h, nq * d)?,
                    q_lora: None,
                    k_lora: None,
                    v_lora: None,
                    o_lora: None,
                    q_norm: RmsNorm {
                        weight: q_norm,
                        eps,
                    },
                    k_norm: RmsNorm {
                        weight: k_norm,
                        eps,
                    },
                    num_heads: nq,
                    num_kv_heads: nkv,
                    head_dim: d,
                },
                post_attention_layernorm: RmsNorm {
                    weight: post_norm,
                    eps,
                },
                mlp: Mlp {
                    gate_proj: matrix(&format!("{p}.mlp.gate_proj.weight"), i, h)?,
                    up_proj: matrix(&format!("{p}.mlp.up_proj.weight"), i, h)?,
                    down_proj: matrix(&format!("{p}.mlp.down_proj.weight"), h, i)?,
                    gate_lora: None,
                    up_lora: None,
                    down_lora: None,
                },
            });
        }
        let embed_tokens = Param::from_tensor(Tensor::<B, 2>::from_data(
            embed.into_tensor_data(&[cfg.vocab_size, h]),
            device,
        ));
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(matrix("lm_head.weight", cfg.vocab_size, h)?)
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm: RmsNorm {
                weight: final_norm,
                eps,
            },
            lm_head,
            rope_inv_freq: rope_inv_freq(d, cfg.rope_theta(), cfg.storage_dtype()),
            max_position_embeddings: cfg.max_position_embeddings,
        })
    }

    /// This model with its linear weights (each block's seven, and an untied LM head) kept as
    /// `layout` says. The weights' values are the same, and so is every product up to the order
    /// of its sums; a weight already kept so is left as it is.
    pub fn into_layout(mut self, layout: LinearLayout) -> Self {
        for layer in &mut self.layers {
            let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
            for w in [
                &mut a.q_proj,
                &mut a.k_proj,
                &mut a.v_proj,
                &mut a.o_proj,
                &mut m.gate_proj,
                &mut m.up_proj,
                &mut m.down_proj,
            ] {
                layout.apply(w);
            }
        }
        if let Some(w) = &mut self.lm_head {
            layout.apply(w);
        }
        self
    }

    /// How this model keeps its linear weights (read off its first block's `q_proj`; every
    /// constructor and [`into_layout`](Self::into_layout) keeps them all one way).
    pub fn linear_layout(&self) -> LinearLayout {
        match self.layers.first() {
            Some(layer) => LinearLayout::of(&layer.self_attn.q_proj.val()),
            None => LinearLayout::InOut,
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.embed_tokens.dims()[0]
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn head_dim(&self) -> usize {
        self.layers[0].self_attn.head_dim
    }

    /// The device the weights live on.
    pub fn device(&self) -> B::Device {
        self.embed_tokens.val().device()
    }

    /// `(cos, sin)` as `[1, 1, s, d]` for positions `start..start + s`.
    pub(crate) fn rope(&self, start: usize, s: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let positions: Vec<usize> = (start..start + s).collect();
        self.rope_at(&positions, [1, 1, s])
    }

    fn rope_at(&self, positions: &[usize], lead: [usize; 3]) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let d = self.head_dim();
        let (cos, sin) = rope_tables(positions, &self.rope_inv_freq);
        let device = self.device();
        let shape = [lead[0], lead[1], lead[2], d];
        (
            Tensor::from_data(TensorData::new(cos, shape), &device),
            Tensor::from_data(TensorData::new(sin, shape), &device),
        )
    }

    /// Final norm and LM head: `[b, s, hidden]` → `[b, s, vocab]`.
    pub fn head(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = self.norm.forward(hidden);
        match &self.lm_head {
            Some(w) => linear(x, w, None),
            None => {
                let [b, s, h] = x.dims();
                let w = self.embed_tokens.val();
                let v = w.dims()[0];
                matmul(x.reshape([b * s, h]), w.transpose()).reshape([b, s, v])
            }
        }
    }

    /// The token embeddings the decoder stack starts from: `input_ids [b, s]` → `[b, s, hidden]`.
    pub fn embed(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        embedding(self.embed_tokens.val(), input_ids)
    }

    /// Runs the decoder stack (without final norm / head): `input_ids [b, s]` → `[b, s, hidden]`.
    pub fn forward_hidden(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let s = input_ids.dims()[1];
        let (cos, sin) = self.rope(0, s);
        let mut x = self.embed(input_ids);
        for layer in &self.layers {
            x = layer.forward(x, cos.clone(), sin.clone());
        }
        x
    }

    /// The decoder stack (without final norm / head) over a shared prefix and the rows that
    /// continue it: `prefix [1, p]` runs once at positions `0..p`; row `i` of `rows [r, l]` runs
    /// at positions `p..p + l`, seeing the prefix and causally itself. → hidden states
    /// `([1, p, hidden], [r, l, hidden])`, each equal to what the unpacked sequence
    /// `prefix ++ rows[i]` gives at the same position ([`Qwen3::forward_hidden`]).
    pub fn forward_hidden_prefixed(
        &self,
        prefix: Tensor<B, 2, Int>,
        rows: Tensor<B, 2, Int>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (p, l) = (prefix.dims()[1], rows.dims()[1]);
        let (rope_prefix, rope_rows) = (self.rope(0, p), self.rope(p, l));
        let mut xp = self.embed(prefix);
        let mut xr = self.embed(rows);
        for layer in &self.layers {
            (xp, xr) = layer.forward_prefixed(xp, xr, rope_prefix.clone(), rope_rows.clone());
        }
        (xp, xr)
    }

    /// `input_ids [batch, seq]` → logits `[batch, seq, vocab]`: full causal attention, positions
    /// from 0, no cache. Right-padded batches are fine (attention is causal, so padding never
    /// influences earlier positions).
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.head(self.forward_hidden(input_ids))
    }

    /// Feeds `ids` (the whole prompt, or more tokens of a sequence) through the model, appending
    /// their keys and values to `cache`; returns the logits `[vocab]` after the last id.
    pub fn prefill(
        &self,
        ids: &[u32],
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 1>, KvCacheError> {
        let s = ids.len();
        if s == 0 {
            return Err(KvCacheError::Empty);
        }
        cache.check_room(s)?;
        let device = self.device();
        let start = cache.len();
        let (cos, sin) = self.rope(start, s);
        let ids_i: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids_i, [1, s]), &device);
        let mut x = embedding(self.embed_tokens.val(), input);
        for (l, layer) in self.layers.iter().enumerate() {
            let attn = &layer.self_attn;
            let (q, k, v) = attn.qkv(
                layer.input_layernorm.forward(x.clone()),
                cos.clone(),
                sin.clone(),
                Mix::Own,
            );
            let (k_all, v_all) = cache.append(l, k, v);
            let o = cached_attention(q, k_all, v_all, Some(start));
            let h = x + attn.output(o, Mix::Own);
            x = layer.feed_forward(h, Mix::Own);
        }
        cache.advance(s);
        let last = x.narrow(1, s - 1, 1);
        Ok(self.head(last).reshape([self.vocab_size()]))
    }

    /// One decode step for a batch of sequences: `tokens[i]` is the next token of the sequence
    /// whose cache is `caches[i]` (which may have different lengths). Returns logits
    /// `[n, vocab]` for the position after each token.
    pub fn decode_step(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache<B>],
    ) -> Result<Tensor<B, 2>, KvCacheError> {
        self.decode(tokens, caches, None)
    }

    /// [`decode_step`](Self::decode_step) where row `i` runs on `models[i]`: a model over this
    /// one's base weights (the same tensors, as [`Qwen3::without_lora`] and
    /// [`Qwen3::with_lora`] share them) with its own adapters, or `self`. The base products
    /// run once over the whole batch, and each model's adapters over its own rows, so a batch
    /// of many adapters costs one base pass. Only the adapters of `models` are read: that every
    /// model shares `self`'s base weights is the caller's rule.
    pub fn decode_step_mixed(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache<B>],
        models: &[&Qwen3<B>],
    ) -> Result<Tensor<B, 2>, KvCacheError> {
        assert_eq!(
            tokens.len(),
            models.len(),
            "decode_step_mixed: one model per token"
        );
        self.decode(tokens, caches, Some(models))
    }

    fn decode(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache<B>],
        models: Option<&[&Qwen3<B>]>,
    ) -> Result<Tensor<B, 2>, KvCacheError> {
        let n = tokens.len();
        assert_eq!(n, caches.len(), "decode_step: one cache per token");
        if n == 0 {
            return Err(KvCacheError::Empty);
        }
        for c in caches.iter() {
            c.check_room(1)?;
        }
        let device = self.device();
        let positions: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        // cos/sin [n, 1, 1, d]: one row per sequence.
        let (cos, sin) = self.rope_at(&positions, [n, 1, 1]);
        let ids_i: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids_i, [n, 1]), &device);
        let groups = models.map(row_groups);
        let mut x = embedding(self.embed_tokens.val(), input);
        for (l, layer) in self.layers.iter().enumerate() {
            let blocks: Vec<(&[usize], &DecoderLayer<B>)>;
            let mix = match &groups {
                None => Mix::Own,
                Some(groups) => {
                    blocks = groups
                        .iter()
                        .map(|(rows, m)| (rows.as_slice(), &m.layers[l]))
                        .collect();
                    Mix::Rows(&blocks)
                }
            };
            let attn = &layer.self_attn;
            let (q, k, v) = attn.qkv(
                layer.input_layernorm.forward(x.clone()),
                cos.clone(),
                sin.clone(),
                mix,
            );
            let (nq, nkv, d) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
            let groups = nq / nkv;
            let mut outs = Vec::with_capacity(n);
            for (i, cache) in caches.iter_mut().enumerate() {
                let ki = k.clone().narrow(0, i, 1);
                let vi = v.clone().narrow(0, i, 1);
                let (k_all, v_all) = cache.append(l, ki, vi);
                // The single query of each head group attends to the same key/value head, so the
                // group's queries become the query axis: [1, kv, groups, d]. No causal mask
                // needed: one new token sees its whole past.
                let qi = q.clone().narrow(0, i, 1).reshape([1, nkv, groups, d]);
                let o = cached_attention(qi, k_all, v_all, None);
                outs.push(o.reshape([1, nq, 1, d]));
            }
            let o = Tensor::cat(outs, 0);
            let h = x + attn.output(o, mix);
            x = layer.feed_forward(h, mix);
        }
        for c in caches.iter_mut() {
            c.advance(1);
        }
        Ok(self.head(x).reshape([n, self.vocab_size()]))
    }

    /// A new empty cache for one sequence of at most `max_len` tokens (capped at
    /// `max_position_embeddings`).
    pub fn new_cache(&self, max_len: usize) -> KvCache<B> {
        KvCache::new(self.num_layers(), max_len.min(self.max_position_embeddings))
    }
}

/// The rows of a batch grouped by the model they run on (models compared by address, so two
/// rows of one model share its adapters' products): `(row indices, model)` in order of first
/// appearance.
fn row_groups<'a, B: Backend>(models: &[&'a Qwen3<B>]) -> Vec<(Vec<usize>, &'a Qwen3<B>)> {
    let mut groups: Vec<(Vec<usize>, &Qwen3<B>)> = Vec::new();
    for (i, &m) in models.iter().enumerate() {
        match groups.iter_mut().find(|(_, g)| std::ptr::eq(*g, m)) {
            Some((rows, _)) => rows.push(i),
            None => groups.push((vec![i], m)),
        }
    }
    groups
}

/// How a model keeps a linear weight `W [in, out]` in memory. Products read either in place,
/// so the choice changes speed, never values.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LinearLayout {
    /// `[in, out]`, row-major: how the learner keeps the weights it trains (its optimizer
    /// updates a parameter and its gradient as two buffers of the same order).
    InOut,
    /// `[out, in]` (Hugging Face's order), read through a transposed view. Only the CPU
    /// backend's tensors, with or without autodiff, are kept so; on any other backend this is
    /// [`InOut`](Self::InOut). A learner keeps in it only weights it does not train (a LoRA
    /// job's frozen base): the products read either order in place, the optimizer does not.
    OutIn,
}

impl LinearLayout {
    /// The layout a tensor of backend `B` is kept in when this one is asked for.
    pub(crate) fn on<B: Backend>(self) -> Self {
        if cpu_kind::<B>().is_some() {
            self
        } else {
            LinearLayout::InOut
        }
    }

    /// The layout a decode step on backend `B` runs fastest from: [`OutIn`](Self::OutIn) on
    /// the CPU backend where a few rows times a transposed weight have the faster kernel
    /// ([`cpu_matmul::transposed_weights_decode_faster`]), else [`InOut`](Self::InOut). The
    /// generation engine's owners load their weights this way.
    pub fn decoding<B: Backend>() -> Self {
        match cpu_matmul::transposed_weights_decode_faster() {
            true => LinearLayout::OutIn.on::<B>(),
            false => LinearLayout::InOut,
        }
    }

    /// The `[in, out]` tensor for a linear weight given as Hugging Face's `[out, in]` data
    /// (`transposed`: already as `[in, out]`).
    fn tensor<B: Backend>(
        self,
        data: WeightData,
        [out, inp]: [usize; 2],
        transposed: bool,
        device: &B::Device,
    ) -> Tensor<B, 2> {
        match (self.on::<B>(), transposed) {
            (LinearLayout::InOut, true) => {
                Tensor::from_data(data.into_tensor_data(&[inp, out]), device)
            }
            (LinearLayout::OutIn, false) => {
                Tensor::<B, 2>::from_data(data.into_tensor_data(&[out, inp]), device).transpose()
            }
            (layout, true) => {
                let t = transpose(&data.into_vec(), inp, out);
                layout.tensor(t.into(), [out, inp], false, device)
            }
            (layout, false) => {
                let t = transpose(&data.into_vec(), out, inp);
                layout.tensor(t.into(), [out, inp], true, device)
            }
        }
    }

    /// Whether the `[in, out]` tensor `w` is kept as this layout asks.
    fn holds<B: Backend>(self, w: &Tensor<B, 2>) -> bool {
        Self::of(w) == self.on::<B>()
    }

    /// How the `[in, out]` tensor `w` is kept.
    fn of<B: Backend>(w: &Tensor<B, 2>) -> Self {
        let cpu: Option<Tensor<CpuBackend, 2>> = match cpu_kind::<B>() {
            Some(CpuKind::Plain) => Some(super::matmul::cast(w.clone())),
            Some(CpuKind::Autodiff) => {
                Some(super::matmul::cast::<B, CpuAutodiff, 2>(w.clone()).inner())
            }
            None => None,
        };
        match cpu.map(|t| t.into_primitive().tensor().layout().strides().to_vec()) {
            Some(strides) if strides[0] == 1 && w.dims()[1] > 1 => LinearLayout::OutIn,
            _ => LinearLayout::InOut,
        }
    }

    /// Keeps the parameter `w` this way.
    fn apply<B: Backend>(self, w: &mut Param<Tensor<B, 2>>) {
        let t = w.val();
        if self.holds(&t) {
            return;
        }
        let [inp, out] = t.dims();
        // Read in the view's logical order: `[in, out]`, row-major.
        let data = t.clone().into_data().convert::<f32>().into_vec::<f32>();
        let data = data.expect("a float tensor's data as f32");
        *w = Param::from_tensor(self.tensor(data.into(), [out, inp], true, &t.device()));
    }
}

/// Which CPU backend `B` is, if it is one.
#[derive(Clone, Copy)]
enum CpuKind {
    /// [`CpuBackend`].
    Plain,
    /// [`CpuAutodiff`], the learner's backend over it.
    Autodiff,
}

fn cpu_kind<B: Backend>() -> Option<CpuKind> {
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CpuBackend>() {
        Some(CpuKind::Plain)
    } else if b == TypeId::of::<CpuAutodiff>() {
        Some(CpuKind::Autodiff)
    } else {
        None
    }
}

/// Transposes a row-major `[r, c]` matrix into a row-major `[c, r]` one.
pub(crate) fn transpose(v: &[f32], r: usize, c: usize) -> Vec<f32> {
    transpose_as(v, r, c)
}

/// The row-major `[c, r]` transpose of a row-major `[r, c]` matrix of words, as words of
/// another kind (f32 values from a blob's little-endian bytes, or the other way).
pub(crate) fn transpose_as<T: Word, U: Word>(v: &[T], r: usize, c: usize) -> Vec<U> {
    let mut out = vec![U::from_bits(0); r * c];
    transpose_words(v, r, c, &mut out);
    out
}

/// Output rows per band of a transpose.
const TILE: usize = 32;

/// A four-byte element a transpose moves: an f32, or the little-endian bytes of one.
///
/// # Safety
///
/// An implementor is four bytes whose memory, on a little-endian machine, is the f32 bits
/// `bits` gives: a transpose moves the words as they lie in memory.
pub(crate) unsafe trait Word: Copy + Send + Sync {
    /// The f32 bits this word stands for.
    fn bits(self) -> u32;
    /// The word standing for f32 bits `bits`.
    fn from_bits(bits: u32) -> Self;
}

// SAFETY: an f32 is its bits.
unsafe impl Word for f32 {
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

// SAFETY: four bytes whose little-endian reading is the bits.
unsafe impl Word for [u8; 4] {
    fn bits(self) -> u32 {
        u32::from_le_bytes(self)
    }
    fn from_bits(bits: u32) -> Self {
        bits.to_le_bytes()
    }
}

/// Transposes a row-major `[r, c]` matrix of words into `out`, which holds the row-major
/// `[c, r]` result, converting each word's kind on the way. Output rows are filled in bands of
/// [`TILE`] on the rayon pool. Where the CPU has AVX, each band moves 8 × 8 blocks through
/// registers (eight loads, 24 shuffles, eight stores), and only the edges of a matrix whose
/// sides are not multiples of 8 go element by element (about 2 ns an element); elsewhere a band
/// reads the input [`TILE`] rows at a time, so both sides stay within a few cache lines per
/// element where a plain double loop strides one of them across the whole matrix.
pub(crate) fn transpose_words<T: Word, U: Word>(v: &[T], r: usize, c: usize, out: &mut [U]) {
    assert_eq!(v.len(), r * c, "a [{r}, {c}] matrix");
    assert_eq!(out.len(), r * c, "room for its [{c}, {r}] transpose");
    if r == 0 || c == 0 {
        return;
    }
    let word = |x: T| U::from_bits(x.bits());
    #[cfg(all(target_arch = "x86_64", target_endian = "little"))]
    let blocks = std::arch::is_x86_feature_detected!("avx");
    #[cfg(not(all(target_arch = "x86_64", target_endian = "little")))]
    let blocks = false;
    out.par_chunks_mut(TILE * r)
        .enumerate()
        .for_each(|(band, rows)| {
            let (j0, cols) = (band * TILE, rows.len() / r);
            let (full_i, full_j) = match blocks {
                true => (r / 8 * 8, cols / 8 * 8),
                false => (0, 0),
            };
            #[cfg(target_arch = "x86_64")]
            for i0 in (0..full_i).step_by(8) {
                for k0 in (0..full_j).step_by(8) {
                    // SAFETY: AVX is present (`blocks`); rows i0..i0 + 8 of `v` hold columns
                    // j0 + k0..j0 + k0 + 8, and output rows k0..k0 + 8 of the band hold
                    // elements i0..i0 + 8 (`full_i` ≤ r, `full_j` ≤ cols). Both kinds of word
                    // are four bytes whose memory is the f32's bits (`Word`'s contract).
                    unsafe {
                        transpose_8x8_avx(
                            v.as_ptr().add(i0 * c + j0 + k0).cast(),
                            c,
                            rows.as_mut_ptr().add(k0 * r + i0).cast(),
                            r,
                        )
                    };
                }
            }
            // Everything outside whole blocks (all of it without AVX), TILE input rows at a time.
            for i0 in (0..r).step_by(TILE) {
                for i in i0..(i0 + TILE).min(r) {
                    let from = if i < full_i { full_j } else { 0 };
                    for k in from..cols {
                        rows[k * r + i] = word(v[i * c + j0 + k]);
                    }
                }
            }
        });
}

/// Transposes the 8 × 8 block at `src` (rows `src_stride` floats apart) into `dst` (rows
/// `dst_stride` floats apart): `dst[k][i] = src[i][k]`.
///
/// # Safety
///
/// The CPU must have AVX; `src` must be readable and `dst` writable for 8 rows of 8 floats at
/// their strides (`dst` needs no alignment).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_8x8_avx(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees the eight rows of eight floats on both sides.
    unsafe {
        let row = |i: usize| _mm256_loadu_ps(src.add(i * src_stride));
        let (a, b, c, d) = (row(0), row(1), row(2), row(3));
        let (e, f, g, h) = (row(4), row(5), row(6), row(7));
        // Per 128-bit lane: pairs of rows interleaved, then quads.
        let (ab_lo, ab_hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        let (cd_lo, cd_hi) = (_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
        let (ef_lo, ef_hi) = (_mm256_unpacklo_ps(e, f), _mm256_unpackhi_ps(e, f));
        let (gh_lo, gh_hi) = (_mm256_unpacklo_ps(g, h), _mm256_unpackhi_ps(g, h));
        // Columns 0|4, 1|5, 2|6, 3|7 of rows a..d, and of rows e..h.
        let q0 = _mm256_shuffle_ps::<0x44>(ab_lo, cd_lo);
        let q1 = _mm256_shuffle_ps::<0xEE>(ab_lo, cd_lo);
        let q2 = _mm256_shuffle_ps::<0x44>(ab_hi, cd_hi);
        let q3 = _mm256_shuffle_ps::<0xEE>(ab_hi, cd_hi);
        let q4 = _mm256_shuffle_ps::<0x44>(ef_lo, gh_lo);
        let q5 = _mm256_shuffle_ps::<0xEE>(ef_lo, gh_lo);
        let q6 = _mm256_shuffle_ps::<0x44>(ef_hi, gh_hi);
        let q7 = _mm256_shuffle_ps::<0xEE>(ef_hi, gh_hi);
        // Low lanes make columns 0..4, high lanes columns 4..8.
        let out = |k: usize, x: __m256| _mm256_storeu_ps(dst.add(k * dst_stride), x);
        out(0, _mm256_permute2f128_ps::<0x20>(q0, q4));
        out(1, _mm256_permute2f128_ps::<0x20>(q1, q5));
        out(2, _mm256_permute2f128_ps::<0x20>(q2, q6));
        out(3, _mm256_permute2f128_ps::<0x20>(q3, q7));
        out(4, _mm256_permute2f128_ps::<0x31>(q0, q4));
        out(5, _mm256_permute2f128_ps::<0x31>(q1, q5));
        out(6, _mm256_permute2f128_ps::<0x31>(q2, q6));
        out(7, _mm256_permute2f128_ps::<0x31>(q3, q7));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The word transpose (whole 8 × 8 blocks through registers where the CPU has AVX, edges
    /// element by element) puts every element where the definition says, in both directions
    /// between f32 values and their little-endian bytes, for sides that are and are not
    /// multiples of 8 and bands that are and are not whole.
    #[test]
    fn the_word_transpose_puts_every_element_in_its_place_at_every_shape() {
        let shapes = [
            (1, 1),
            (3, 5),
            (8, 8),
            (9, 8),
            (8, 9),
            (16, 40),
            (33, 70),
            (64, 3),
            (100, 257),
            (40, 32),
        ];
        for (r, c) in shapes {
            let v: Vec<f32> = (0..r * c)
                .map(|i| (i as f32).mul_add(0.37, -11.0) * if i % 3 == 0 { -1.0 } else { 1.0 })
                .collect();
            let mut got = vec![[9u8; 4]; r * c];
            transpose_words(&v, r, c, &mut got);
            let back: Vec<f32> = transpose_as(&got, c, r);
            let same: Vec<f32> = transpose(&v, r, c);
            for i in 0..r {
                for k in 0..c {
                    let x = v[i * c + k];
                    assert_eq!(got[k * r + i], x.to_le_bytes(), "[{r}, {c}] ({i}, {k})");
                    assert_eq!(
                        same[k * r + i].to_bits(),
                        x.to_bits(),
                        "[{r}, {c}] ({i}, {k})"
                    );
                }
            }
            assert_eq!(back, v, "[{r}, {c}] there and back");
        }
    }
}
