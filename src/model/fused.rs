//! The decoder's elementwise chains, each as one op: RMSNorm ([`rms_norm`]), RoPE with the heads
//! moved before the positions ([`rope_heads_first`]), SwiGLU's `silu(gate) · up` ([`swiglu`]),
//! the move of heads before positions or back ([`swap_heads`]), the key/value heads repeated for
//! the query heads they serve ([`repeat_kv`]), and the log-probabilities of target tokens under
//! logits ([`token_logprobs`]).
//!
//! Built from Burn tensor ops, each chain is several passes over memory (RMSNorm: a square, a
//! mean, a square root, a reciprocal and two broadcast products; RoPE: a transposed view, two
//! halves, a negation, a concatenation, two broadcast products and a sum; SiLU: a sigmoid through
//! `exp`), most of them strided, and under autodiff every pass is also a graph node with its
//! own backward pass. Profiled on a 2-core machine they were about a fifth of a training step.
//!
//! Rust has no specialisation, so each op routes by the backend's type:
//!
//! - the CPU backend ([`crate::CpuBackend`]) runs one pass over the raw floats;
//! - autodiff over it ([`crate::CpuAutodiff`]) runs the same pass forward and records one graph
//!   node whose backward is again one pass (the gradients derived below);
//! - every other backend (CUDA) runs the tensor ops, and its autodiff differentiates them.
//!
//! Each CPU pass does the arithmetic of the tensor ops, in the same order where it matters:
//! RoPE and the repeated heads are bit-identical; RMSNorm sums its squares in sixteen lanes
//! instead of Burn's order, SwiGLU's sigmoid uses [`exp_nonpositive`] (within 2 ulp of `exp`),
//! and the log-probabilities sum their exponentials in sixteen lanes with it, all within a few
//! ulp.
//! Every row's result depends on that row alone, so a prompt prefilled in parts (a prefix-cache
//! hit) gets the same rows as one prefilled whole.

use std::any::TypeId;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Int, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use rayon::prelude::*;

use super::cpu_attention::exp_nonpositive;
use super::cpu_tensor::{filled, floats, primitive_floats as host};
use super::matmul::cast;
use super::sampling::log_sum_exp;
use crate::{CpuAutodiff, CpuBackend};

/// Below this many elements a pass runs on the calling thread: a decode step's few rows are not
/// worth a hand-off to the pool.
const PARALLEL_FROM: usize = 1 << 15;

/// Which implementation a backend runs.
enum Route {
    /// One pass over the raw floats.
    Cpu,
    /// The CPU pass, recorded as one autodiff node.
    CpuAutodiff,
    /// Burn tensor ops.
    Ops,
}

fn route<B: Backend>() -> Route {
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CpuBackend>() {
        Route::Cpu
    } else if b == TypeId::of::<CpuAutodiff>() {
        Route::CpuAutodiff
    } else {
        Route::Ops
    }
}

/// A tensor from row-major `f32`s.
fn tensor<B: Backend, const D: usize>(
    x: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(x, shape), device)
}

/// A CPU tensor of `shape` from row-major elements.
fn primitive(x: Vec<f32>, shape: Shape) -> FloatTensor<CpuBackend> {
    CpuBackend::float_from_data(TensorData::new(x, shape), &Default::default())
}

/// Hands each tracked parent its gradient (elements and shape).
fn register<const N: usize>(
    grads: &mut Gradients,
    parents: [Option<NodeId>; N],
    grad: [(Vec<f32>, Shape); N],
) {
    for (parent, (g, shape)) in parents.into_iter().zip(grad) {
        if let Some(id) = parent {
            grads.register::<CpuBackend>(id, primitive(g, shape));
        }
    }
}

/// Records `y`, computed on the inner backend from `inputs`, as the output of one autodiff node
/// `op`; `state` (what its backward needs) is built only when some input is tracked.
pub(super) fn record<I, O, const N: usize, const D: usize>(
    op: O,
    inputs: [&FloatTensor<Autodiff<I>>; N],
    state: impl FnOnce() -> O::State,
    y: FloatTensor<I>,
) -> Tensor<Autodiff<I>, D>
where
    I: Backend,
    O: Backward<I, N>,
{
    let nodes = inputs.map(|t| t.node.clone());
    let node = match op
        .prepare::<NoCheckpointing>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    Tensor::from_primitive(TensorPrimitive::Float(node))
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

/// `x [..., dim]` → `x / sqrt(mean(x²) + eps) · weight`, over the last dimension; `weight [dim]`.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    match route::<B>() {
        Route::Ops => rms_norm_ops(x, weight, eps),
        Route::Cpu => {
            let shape = x.dims();
            let device = x.device();
            let y = rms_norm_rows(&floats(x), &floats(weight), eps as f32);
            tensor(y, shape, &device)
        }
        Route::CpuAutodiff => cast(rms_norm_tracked(cast(x), cast(weight), eps as f32)),
    }
}

/// [`rms_norm`] as tensor ops.
fn rms_norm_ops<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let var = x.clone().powi_scalar(2).mean_dim(D - 1);
    let inv = (var + eps).sqrt().recip();
    x * inv * weight.unsqueeze::<D>()
}

/// `1 / sqrt(mean(row²) + eps)`, the squares summed in sixteen lanes.
#[inline(always)]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mut lanes = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            lanes[l] += c[l] * c[l];
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for x in chunks.remainder() {
        sum += x * x;
    }
    1.0 / (sum / row.len() as f32 + eps).sqrt()
}

/// The forward over rows of `w.len()` elements.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    let rows_per = (PARALLEL_FROM / dim).max(1);
    filled(
        x.len(),
        rows_per * dim,
        x.len() >= PARALLEL_FROM,
        |c, out| {
            let x = &x[c * rows_per * dim..][..out.len()];
            for (xr, yr) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
                let inv = inv_rms(xr, eps);
                for ((y, x), w) in yr.iter_mut().zip(xr).zip(w) {
                    *y = x * inv * w;
                }
            }
        },
    )
}

/// The gradients `(dx, dw)` of [`rms_norm_rows`] for `dy`. With `r = 1/sqrt(mean(x²) + eps)`
/// and `g = dy · w` per row of `D` elements:
///
/// ```text
/// dx = r · g − x · r³ · (Σ g·x) / D        dw = Σ_rows dy · x · r
/// ```
///
/// `dw` is summed over fixed blocks of rows, then the blocks in order, so it does not depend on
/// the thread count.
fn rms_norm_grads(x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let dim = w.len();
    let rows_per = (PARALLEL_FROM / dim).max(1);
    let block = rows_per * dim;
    let mut dx = vec![0f32; x.len()];
    let mut partial = vec![0f32; x.len().div_ceil(block) * dim];
    let work = |(c, (out, dw)): (usize, (&mut [f32], &mut [f32]))| {
        let at = c * block;
        let (x, dy) = (&x[at..][..out.len()], &dy[at..][..out.len()]);
        for ((xr, dyr), dxr) in x
            .chunks_exact(dim)
            .zip(dy.chunks_exact(dim))
            .zip(out.chunks_exact_mut(dim))
        {
            let r = inv_rms(xr, eps);
            let gx: f32 = xr
                .iter()
                .zip(dyr)
                .zip(w)
                .map(|((x, dy), w)| dy * w * x)
                .sum();
            let k = r * r * r * gx / dim as f32;
            for (((dx, x), dy), (w, dw)) in dxr
                .iter_mut()
                .zip(xr)
                .zip(dyr)
                .zip(w.iter().zip(dw.iter_mut()))
            {
                *dx = r * dy * w - x * k;
                *dw += dy * x * r;
            }
        }
    };
    let pairs = dx
        .chunks_mut(block)
        .zip(partial.chunks_mut(dim))
        .enumerate();
    if x.len() >= PARALLEL_FROM {
        pairs.collect::<Vec<_>>().into_par_iter().for_each(work);
    } else {
        pairs.for_each(work);
    }
    let mut dw = vec![0f32; dim];
    for p in partial.chunks_exact(dim) {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
    (dx, dw)
}

/// The autodiff node of [`rms_norm`] on the CPU backend.
#[derive(Debug)]
struct RmsNormNode;

impl Backward<CpuBackend, 2> for RmsNormNode {
    /// `x`, `weight` and `eps`.
    type State = (FloatTensor<CpuBackend>, FloatTensor<CpuBackend>, f32);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<CpuBackend>(&ops.node);
        let (x, w, eps) = ops.state;
        let (shape, wshape) = (x.shape(), w.shape());
        let (dx, dw) = rms_norm_grads(&host(x), &host(w), &host(dy), eps);
        register(
            grads,
            ops.parents.map(|p| p.map(|n| n.id)),
            [(dx, shape), (dw, wshape)],
        );
    }
}

fn rms_norm_tracked<const D: usize>(
    x: Tensor<CpuAutodiff, D>,
    weight: Tensor<CpuAutodiff, 1>,
    eps: f32,
) -> Tensor<CpuAutodiff, D> {
    let (x, w) = (
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
    );
    let shape = x.primitive.shape();
    let y = rms_norm_rows(&host(x.primitive.clone()), &host(w.primitive.clone()), eps);
    let y = primitive(y, shape);
    record(
        RmsNormNode,
        [&x, &w],
        || (x.primitive.clone(), w.primitive.clone(), eps),
        y,
    )
}

// ---------------------------------------------------------------------------------------------
// RoPE

/// Puts the heads before the positions and applies RoPE: `x [b, s, h, d]`, `cos`/`sin`
/// `[b or 1, 1, s, d]` → `[b, h, s, d]`, each head's `x · cos + rotate(x) · sin`, where
/// `rotate(x) = [−x₂, x₁]` for the halves `x₁`, `x₂` of its `d` dimensions. `cos` and `sin` are
/// constants: no gradient flows to them.
pub fn rope_heads_first<B: Backend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
) -> Tensor<B, 4> {
    match route::<B>() {
        Route::Ops => rope_ops(x, cos, sin),
        Route::Cpu => {
            let dims = RopeDims::of(x.dims(), cos.dims(), sin.dims());
            let device = x.device();
            let y = rope_rows(&floats(x), &floats(cos), &floats(sin), dims);
            tensor(y, [dims.b, dims.h, dims.s, dims.d], &device)
        }
        Route::CpuAutodiff => cast(rope_tracked(cast(x), cast(cos), cast(sin))),
    }
}

/// [`rope_heads_first`] as tensor ops.
fn rope_ops<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
    let x = x.swap_dims(1, 2);
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos + rotated * sin
}

/// The layout of one RoPE call: `x [b, s, h, d]` and tables `[tables, 1, s, d]`, where
/// `tables` is 1 (shared by every batch row) or `b`.
#[derive(Debug, Clone, Copy)]
struct RopeDims {
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    tables: usize,
}

impl RopeDims {
    /// # Panics
    /// When the tables do not fit `x`: a caller's bug.
    fn of(x: [usize; 4], cos: [usize; 4], sin: [usize; 4]) -> Self {
        let [b, s, h, d] = x;
        let tables = cos[0];
        assert!(
            cos == [tables, 1, s, d] && sin == cos && (tables == 1 || tables == b) && d % 2 == 0,
            "rope: cos/sin {cos:?} do not fit x {x:?}"
        );
        RopeDims { b, s, h, d, tables }
    }

    /// Where position `si` of batch row `bi` starts in the tables.
    fn table(&self, bi: usize, si: usize) -> usize {
        let t = if self.tables == 1 { 0 } else { bi };
        (t * self.s + si) * self.d
    }
}

/// The forward, `x [b, s, h, d]` → `[b, h, s, d]`: each product rounded, then their sum, as the
/// tensor ops do, so the result is bit-identical to theirs.
fn rope_rows(x: &[f32], cos: &[f32], sin: &[f32], dims: RopeDims) -> Vec<f32> {
    let RopeDims { s, h, d, .. } = dims;
    let half = d / 2;
    // One chunk per (batch row, head): its `s` positions.
    filled(x.len(), s * d, x.len() >= PARALLEL_FROM, |bh, dst| {
        let (bi, hi) = (bh / h, bh % h);
        for (si, dst) in dst.chunks_exact_mut(d).enumerate() {
            let src = &x[((bi * s + si) * h + hi) * d..][..d];
            let at = dims.table(bi, si);
            let (c, sn) = (&cos[at..at + d], &sin[at..at + d]);
            for i in 0..half {
                dst[i] = src[i] * c[i] + (-src[i + half]) * sn[i];
                dst[i + half] = src[i + half] * c[i + half] + src[i] * sn[i + half];
            }
        }
    })
}

/// The gradient of [`rope_rows`], `dy [b, h, s, d]` → `dx [b, s, h, d]`. RoPE is linear in
/// `x`, and its transpose rotates back: `dx₁ = dy₁ · cos₁ + dy₂ · sin₂`,
/// `dx₂ = dy₂ · cos₂ − dy₁ · sin₁`, the two products each rounded as the tensor ops' backward
/// rounds them.
fn rope_grads(dy: &[f32], cos: &[f32], sin: &[f32], dims: RopeDims) -> Vec<f32> {
    let RopeDims { s, h, d, .. } = dims;
    let half = d / 2;
    // One chunk per (batch row, position): its `h` heads.
    filled(dy.len(), h * d, dy.len() >= PARALLEL_FROM, |bs, dst| {
        let (bi, si) = (bs / s, bs % s);
        let at = dims.table(bi, si);
        let (c, sn) = (&cos[at..at + d], &sin[at..at + d]);
        for (hi, dst) in dst.chunks_exact_mut(d).enumerate() {
            let src = &dy[((bi * h + hi) * s + si) * d..][..d];
            for i in 0..half {
                dst[i] = src[i] * c[i] + src[i + half] * sn[i + half];
                dst[i + half] = src[i + half] * c[i + half] + -(src[i] * sn[i]);
            }
        }
    })
}

/// The autodiff node of [`rope_heads_first`] on the CPU backend.
#[derive(Debug)]
struct RopeNode;

impl Backward<CpuBackend, 1> for RopeNode {
    /// The tables and the layout.
    type State = (FloatTensor<CpuBackend>, FloatTensor<CpuBackend>, RopeDims);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<CpuBackend>(&ops.node);
        let (cos, sin, dims) = ops.state;
        let dx = rope_grads(&host(dy), &host(cos), &host(sin), dims);
        let shape = Shape::from([dims.b, dims.s, dims.h, dims.d]);
        register(grads, ops.parents.map(|p| p.map(|n| n.id)), [(dx, shape)]);
    }
}

fn rope_tracked(
    x: Tensor<CpuAutodiff, 4>,
    cos: Tensor<CpuAutodiff, 4>,
    sin: Tensor<CpuAutodiff, 4>,
) -> Tensor<CpuAutodiff, 4> {
    let dims = RopeDims::of(x.dims(), cos.dims(), sin.dims());
    let table = |t: Tensor<CpuAutodiff, 4>| t.into_primitive().tensor().primitive;
    let (cos, sin) = (table(cos), table(sin));
    let x = x.into_primitive().tensor();
    let y = rope_rows(
        &host(x.primitive.clone()),
        &host(cos.clone()),
        &host(sin.clone()),
        dims,
    );
    let y = primitive(y, Shape::from([dims.b, dims.h, dims.s, dims.d]));
    record(RopeNode, [&x], || (cos, sin, dims), y)
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

/// `silu(gate) · up = gate · σ(gate) · up`, elementwise over tensors of one shape.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "swiglu: gate and up differ in shape"
    );
    match route::<B>() {
        Route::Ops => silu(gate) * up,
        Route::Cpu => {
            let shape = gate.dims();
            let device = gate.device();
            tensor(swiglu_rows(&floats(gate), &floats(up)), shape, &device)
        }
        Route::CpuAutodiff => cast(swiglu_tracked(cast(gate), cast(up))),
    }
}

/// `σ(x) = 1 / (1 + e^−x)`, from `t = e^−|x|` (never overflows): `1 / (1 + t)` for `x ≥ 0`,
/// `t / (1 + t)` below.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let t = exp_nonpositive::<false>(-x.abs());
    let num = if x >= 0.0 { 1.0 } else { t };
    num / (1.0 + t)
}

/// The forward, `gate · σ(gate) · up` (the SiLU product rounded first, as `silu(g) · u` does).
fn swiglu_rows(gate: &[f32], up: &[f32]) -> Vec<f32> {
    const CHUNK: usize = 1 << 12;
    filled(gate.len(), CHUNK, gate.len() >= PARALLEL_FROM, |c, out| {
        let (g, u) = (
            &gate[c * CHUNK..][..out.len()],
            &up[c * CHUNK..][..out.len()],
        );
        for ((y, g), u) in out.iter_mut().zip(g).zip(u) {
            *y = g * sigmoid(*g) * u;
        }
    })
}

/// The gradients `(d_gate, d_up)` of [`swiglu_rows`] for `dy`:
///
/// ```text
/// d_up = dy · g · σ(g)        d_gate = dy · u · σ(g) · (1 + g · (1 − σ(g)))
/// ```
fn swiglu_grads(gate: &[f32], up: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let n = gate.len();
    let mut both = vec![0f32; 2 * n];
    let (dg, du) = both.split_at_mut(n);
    const CHUNK: usize = 1 << 12;
    let work = |(c, (dg, du)): (usize, (&mut [f32], &mut [f32]))| {
        let at = c * CHUNK;
        let (g, u, dy) = (
            &gate[at..][..dg.len()],
            &up[at..][..dg.len()],
            &dy[at..][..dg.len()],
        );
        for i in 0..dg.len() {
            let s = sigmoid(g[i]);
            du[i] = dy[i] * (g[i] * s);
            dg[i] = dy[i] * u[i] * (s * (1.0 + g[i] * (1.0 - s)));
        }
    };
    let pairs = dg.chunks_mut(CHUNK).zip(du.chunks_mut(CHUNK)).enumerate();
    if n >= PARALLEL_FROM {
        pairs.collect::<Vec<_>>().into_par_iter().for_each(work);
    } else {
        pairs.for_each(work);
    }
    let du = both.split_off(n);
    (both, du)
}

/// The autodiff node of [`swiglu`] on the CPU backend.
#[derive(Debug)]
struct SwigluNode;

impl Backward<CpuBackend, 2> for SwigluNode {
    /// `gate` and `up`.
    type State = (FloatTensor<CpuBackend>, FloatTensor<CpuBackend>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<CpuBackend>(&ops.node);
        let (gate, up) = ops.state;
        let shape = gate.shape();
        let (dg, du) = swiglu_grads(&host(gate), &host(up), &host(dy));
        register(
            grads,
            ops.parents.map(|p| p.map(|n| n.id)),
            [(dg, shape.clone()), (du, shape)],
        );
    }
}

fn swiglu_tracked<const D: usize>(
    gate: Tensor<CpuAutodiff, D>,
    up: Tensor<CpuAutodiff, D>,
) -> Tensor<CpuAutodiff, D> {
    let (g, u) = (gate.into_primitive().tensor(), up.into_primitive().tensor());
    let shape = g.primitive.shape();
    let y = primitive(
        swiglu_rows(&host(g.primitive.clone()), &host(u.primitive.clone())),
        shape,
    );
    record(
        SwigluNode,
        [&g, &u],
        || (g.primitive.clone(), u.primitive.clone()),
        y,
    )
}

// ---------------------------------------------------------------------------------------------
// Heads and positions swapped

/// `x [b, p, q, d]` → `[b, q, p, d]`, stored contiguously: a sequence's heads moved before its
/// positions (`p` positions, `q` heads) or back after them. As a Burn view the swap is free, but
/// the op that reads it next walks it element by element through a generic strided iterator;
/// here each run of `d` floats is one copy. Its own gradient is the same swap, back.
pub fn swap_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    match route::<B>() {
        Route::Ops => x.swap_dims(1, 2),
        Route::Cpu => {
            let [b, p, q, d] = x.dims();
            let device = x.device();
            tensor(swap_rows(&floats(x), [b, p, q, d]), [b, q, p, d], &device)
        }
        Route::CpuAutodiff => cast(swap_heads_tracked(cast(x))),
    }
}

/// The copy of [`swap_heads`] over raw floats.
fn swap_rows(x: &[f32], [_, p, q, d]: [usize; 4]) -> Vec<f32> {
    if x.is_empty() {
        return Vec::new();
    }
    // One chunk per (batch row, index along `q`): its `p` runs of `d`.
    filled(x.len(), p * d, x.len() >= PARALLEL_FROM, |bq, dst| {
        let (bi, qi) = (bq / q, bq % q);
        for (pi, run) in dst.chunks_exact_mut(d).enumerate() {
            run.copy_from_slice(&x[((bi * p + pi) * q + qi) * d..][..d]);
        }
    })
}

/// The autodiff node of [`swap_heads`] on the CPU backend.
#[derive(Debug)]
struct SwapNode;

impl Backward<CpuBackend, 1> for SwapNode {
    /// The input's shape `[b, p, q, d]`.
    type State = [usize; 4];

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<CpuBackend>(&ops.node);
        let [b, p, q, d] = ops.state;
        let dx = swap_rows(&host(dy), [b, q, p, d]);
        register(
            grads,
            ops.parents.map(|p| p.map(|n| n.id)),
            [(dx, Shape::from(ops.state))],
        );
    }
}

fn swap_heads_tracked(x: Tensor<CpuAutodiff, 4>) -> Tensor<CpuAutodiff, 4> {
    let [b, p, q, d] = x.dims();
    let x = x.into_primitive().tensor();
    let y = primitive(
        swap_rows(&host(x.primitive.clone()), [b, p, q, d]),
        Shape::from([b, q, p, d]),
    );
    record(SwapNode, [&x], || [b, p, q, d], y)
}

// ---------------------------------------------------------------------------------------------
// Key/value heads repeated for the query heads

/// Repeats each key/value head to the query heads it serves: `[b, kv, n, d]` →
/// `[b, heads, n, d]`, head `i` a copy of head `i / (heads / kv)`. On the CPU each output head
/// is one copy, the heads in parallel; the gradient sums each group of `heads / kv` heads back
/// into the head they copy, in order.
pub fn repeat_kv<B: Backend>(x: Tensor<B, 4>, heads: usize) -> Tensor<B, 4> {
    let [b, kv, n, d] = x.dims();
    assert!(
        kv > 0 && heads.is_multiple_of(kv),
        "repeat_kv: {kv} key heads do not divide {heads}"
    );
    let groups = heads / kv;
    if groups == 1 {
        return x;
    }
    match route::<B>() {
        Route::Ops => x
            .unsqueeze_dim::<5>(2)
            .expand([b, kv, groups, n, d])
            .reshape([b, heads, n, d]),
        Route::Cpu => {
            let device = x.device();
            let y = repeat_rows(&floats(x), groups, n * d);
            tensor(y, [b, heads, n, d], &device)
        }
        Route::CpuAutodiff => cast(repeat_kv_tracked(cast(x), groups)),
    }
}

/// Heads of `len` floats, each repeated `groups` times in place: head `i` of the output is head
/// `i / groups` of `x`.
fn repeat_rows(x: &[f32], groups: usize, len: usize) -> Vec<f32> {
    let n = x.len() * groups;
    filled(n, len, n >= PARALLEL_FROM, |i, dst| {
        dst.copy_from_slice(&x[(i / groups) * len..][..len]);
    })
}

/// The gradient of [`repeat_rows`]: each group of `groups` heads of `dy`, summed in order.
fn repeat_grads(dy: &[f32], groups: usize, len: usize) -> Vec<f32> {
    let n = dy.len() / groups;
    filled(n, len, n >= PARALLEL_FROM, |i, dst| {
        for r in 0..groups {
            let src = &dy[(i * groups + r) * len..][..len];
            dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
        }
    })
}

/// The autodiff node of [`repeat_kv`] on the CPU backend.
#[derive(Debug)]
struct RepeatKvNode;

impl Backward<CpuBackend, 1> for RepeatKvNode {
    /// The input's shape `[b, kv, n, d]` and the heads per key/value head.
    type State = ([usize; 4], usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<CpuBackend>(&ops.node);
        let ([b, kv, n, d], groups) = ops.state;
        let dx = repeat_grads(&host(dy), groups, n * d);
        register(
            grads,
            ops.parents.map(|p| p.map(|n| n.id)),
            [(dx, Shape::from([b, kv, n, d]))],
        );
    }
}

fn repeat_kv_tracked(x: Tensor<CpuAutodiff, 4>, groups: usize) -> Tensor<CpuAutodiff, 4> {
    let [b, kv, n, d] = x.dims();
    let x = x.into_primitive().tensor();
    let y = primitive(
        repeat_rows(&host(x.primitive.clone()), groups, n * d),
        Shape::from([b, kv * groups, n, d]),
    );
    record(RepeatKvNode, [&x], || ([b, kv, n, d], groups), y)
}

// ---------------------------------------------------------------------------------------------
// Log-probabilities of target tokens

/// `log_softmax(logits)` at each position's target: `logits [b, s, vocab]`, `targets [b, s]`
/// (ids below `vocab`) → `[b, s]`. On the CPU each row is one pass for its maximum and one for
/// `lse = max + ln Σ e^(x − max)` ([`log_sum_exp`], the sampler's), and the result
/// `x[target] − lse`; the `[b, s, vocab]` log-softmax is never written. Under autodiff the node
/// keeps the logits and each row's `lse`, and its backward writes
/// `dx = g · (onehot(target) − e^(x − lse))` in one pass.
pub fn token_logprobs<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 2> {
    let [b, s, vocab] = logits.dims();
    assert_eq!(
        targets.dims(),
        [b, s],
        "token_logprobs: targets do not match the logits' rows"
    );
    match route::<B>() {
        Route::Ops => log_softmax(logits, 2)
            .gather(2, targets.reshape([b, s, 1]))
            .reshape([b, s]),
        Route::Cpu => {
            let device = logits.device();
            let targets = target_ids(targets, vocab);
            let (logp, _) = target_rows(&floats(logits), vocab, &targets);
            tensor(logp, [b, s], &device)
        }
        Route::CpuAutodiff => {
            let targets = target_ids(targets, vocab);
            cast(token_logprobs_tracked(cast(logits), targets))
        }
    }
}

/// The target ids as indices, each checked against the vocabulary.
fn target_ids<B: Backend>(targets: Tensor<B, 2, Int>, vocab: usize) -> Vec<usize> {
    let ids = targets
        .into_data()
        .convert::<i64>()
        .into_vec::<i64>()
        .expect("converted to i64");
    ids.into_iter()
        .map(|t| match usize::try_from(t) {
            Ok(t) if t < vocab => t,
            _ => panic!("token_logprobs: target id {t} outside a vocabulary of {vocab}"),
        })
        .collect()
}

/// `(x[target] − lse, lse)` for each row of `vocab` logits.
fn target_rows(x: &[f32], vocab: usize, targets: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let row = |(xr, &t): (&[f32], &usize)| {
        let lse = log_sum_exp(xr);
        (xr[t] - lse, lse)
    };
    if x.len() >= PARALLEL_FROM {
        x.par_chunks_exact(vocab)
            .zip(targets.par_iter())
            .map(row)
            .unzip()
    } else {
        x.chunks_exact(vocab).zip(targets).map(row).unzip()
    }
}

/// `dx = g · (onehot(target) − e^(x − lse))`, row by row.
fn target_grads(x: &[f32], vocab: usize, targets: &[usize], lse: &[f32], g: &[f32]) -> Vec<f32> {
    filled(x.len(), vocab, x.len() >= PARALLEL_FROM, |r, dx| {
        let (xr, gr) = (&x[r * vocab..][..vocab], g[r]);
        for (d, &v) in dx.iter_mut().zip(xr) {
            *d = -gr * exp_nonpositive::<false>((v - lse[r]).min(0.0));
        }
        dx[targets[r]] += gr;
    })
}

/// The autodiff node of [`token_logprobs`] on the CPU backend.
#[derive(Debug)]
struct TokenLogprobsNode;

impl Backward<CpuBackend, 1> for TokenLogprobsNode {
    /// The logits, their row length, the targets and each row's `lse`.
    type State = (FloatTensor<CpuBackend>, usize, Vec<usize>, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let g = grads.consume::<CpuBackend>(&ops.node);
        let (x, vocab, targets, lse) = ops.state;
        let shape = x.shape();
        let dx = target_grads(&host(x), vocab, &targets, &lse, &host(g));
        register(grads, ops.parents.map(|p| p.map(|n| n.id)), [(dx, shape)]);
    }
}

fn token_logprobs_tracked(
    logits: Tensor<CpuAutodiff, 3>,
    targets: Vec<usize>,
) -> Tensor<CpuAutodiff, 2> {
    let [b, s, vocab] = logits.dims();
    let x = logits.into_primitive().tensor();
    let (logp, lse) = target_rows(&host(x.primitive.clone()), vocab, &targets);
    let y = primitive(logp, Shape::from([b, s]));
    record(
        TokenLogprobsNode,
        [&x],
        || (x.primitive.clone(), vocab, targets, lse),
        y,
    )
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    fn random<B: Backend, const D: usize>(shape: [usize; D], scale: f64) -> Tensor<B, D> {
        Tensor::random(shape, Distribution::Normal(0.0, scale), &Default::default())
    }

    /// The largest `|a − b|` over the largest `|b|`.
    fn relative<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
        let (a, b) = (floats(a), floats(b));
        assert_eq!(a.len(), b.len());
        let diff = a
            .iter()
            .zip(b.iter())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        diff / b.iter().map(|y| y.abs()).fold(f32::MIN_POSITIVE, f32::max)
    }

    /// The same values in a fresh autodiff leaf that requires its gradient.
    fn leaf<const D: usize>(x: &Tensor<CpuBackend, D>) -> Tensor<CpuAutodiff, D> {
        Tensor::from_data(x.to_data(), &Default::default()).require_grad()
    }

    fn grad<const D: usize>(
        x: &Tensor<CpuAutodiff, D>,
        grads: &<CpuAutodiff as burn::tensor::backend::AutodiffBackend>::Gradients,
    ) -> Tensor<CpuBackend, D> {
        x.grad(grads).expect("the leaf received a gradient")
    }

    /// A loss whose gradient is not uniform: `Σ y · r` for a fixed random `r`.
    fn weigh<const D: usize>(
        y: Tensor<CpuAutodiff, D>,
        r: &Tensor<CpuBackend, D>,
    ) -> Tensor<CpuAutodiff, 1> {
        (y * leaf(r).detach()).sum()
    }

    #[test]
    fn rms_norm_matches_the_tensor_ops_forward_and_backward() {
        // 300 rows of 64 (the parallel path, and a dimension the 16 lanes divide) and 5 rows of
        // 37 (the remainder loop, on the calling thread).
        for (rows, dim) in [(300, 64), (5, 37)] {
            let x = random::<CpuBackend, 3>([3, rows / 3 + 1, dim], 2.0);
            let w = random::<CpuBackend, 1>([dim], 1.0) + 1.0;
            let eps = 1e-6;
            let fused = rms_norm(x.clone(), w.clone(), eps);
            let ops = rms_norm_ops(x.clone(), w.clone(), eps);
            assert!(relative(fused, ops.clone()) < 1e-6);

            let r = random::<CpuBackend, 3>(ops.dims(), 1.0);
            let (xa, wa) = (leaf(&x), leaf(&w));
            let g_fused = weigh(rms_norm(xa.clone(), wa.clone(), eps), &r).backward();
            let (xb, wb) = (leaf(&x), leaf(&w));
            let g_ops = weigh(rms_norm_ops(xb.clone(), wb.clone(), eps), &r).backward();
            let dx = relative(grad(&xa, &g_fused), grad(&xb, &g_ops));
            let dw = relative(grad(&wa, &g_fused), grad(&wb, &g_ops));
            assert!(dx < 1e-5 && dw < 1e-5, "dx {dx:e}, dw {dw:e}");
        }
    }

    #[test]
    fn rms_norm_leaves_an_untracked_weight_without_a_gradient() {
        // A frozen base weight (a LoRA job) is not a graph leaf: only `x` gets a gradient.
        let x = leaf(&random::<CpuBackend, 2>([4, 8], 1.0));
        let w: Tensor<CpuAutodiff, 1> = Tensor::ones([8], &Default::default());
        let grads = rms_norm(x.clone(), w.clone(), 1e-6).sum().backward();
        assert!(x.grad(&grads).is_some());
        assert!(w.grad(&grads).is_none());
    }

    #[test]
    fn rope_is_bit_identical_to_the_tensor_ops_forward_and_backward() {
        let (b, s, h, d) = (2, 33, 3, 16);
        let positions: Vec<usize> = (5..5 + s).collect();
        let inv_freq = super::super::qwen3::rope_inv_freq(d, 10_000.0, None);
        let (cos, sin) = super::super::qwen3::rope_tables(&positions, &inv_freq);
        let table = |v: Vec<f32>| {
            Tensor::<CpuBackend, 4>::from_data(
                TensorData::new(v, [1, 1, s, d]),
                &Default::default(),
            )
        };
        let (cos, sin) = (table(cos), table(sin));
        // One table for every row, and one table per row.
        for tables in [1, b] {
            let (cos, sin) = (
                cos.clone().repeat_dim(0, tables),
                sin.clone().repeat_dim(0, tables),
            );
            let x = random::<CpuBackend, 4>([b, s, h, d], 1.0);
            let fused = rope_heads_first(x.clone(), cos.clone(), sin.clone());
            let ops = rope_ops(x.clone(), cos.clone(), sin.clone());
            assert_eq!(floats(fused).to_vec(), floats(ops.clone()).to_vec());

            let r = random::<CpuBackend, 4>(ops.dims(), 1.0);
            let (ca, sa) = (leaf(&cos).detach(), leaf(&sin).detach());
            let xa = leaf(&x);
            let g_fused =
                weigh(rope_heads_first(xa.clone(), ca.clone(), sa.clone()), &r).backward();
            let xb = leaf(&x);
            let g_ops = weigh(rope_ops(xb.clone(), ca, sa), &r).backward();
            assert_eq!(
                floats(grad(&xa, &g_fused)).to_vec(),
                floats(grad(&xb, &g_ops)).to_vec()
            );
        }
    }

    #[test]
    fn swap_heads_is_the_swapped_view_forward_and_backward() {
        let x = random::<CpuBackend, 4>([2, 37, 3, 16], 1.0);
        let fused = swap_heads(x.clone());
        let view = x.clone().swap_dims(1, 2);
        assert_eq!(fused.dims(), [2, 3, 37, 16]);
        assert_eq!(floats(fused).to_vec(), floats(view.clone()).to_vec());

        let r = random::<CpuBackend, 4>(view.dims(), 1.0);
        let xa = leaf(&x);
        let g_fused = weigh(swap_heads(xa.clone()), &r).backward();
        let xb = leaf(&x);
        let g_ops = weigh(xb.clone().swap_dims(1, 2), &r).backward();
        assert_eq!(
            floats(grad(&xa, &g_fused)).to_vec(),
            floats(grad(&xb, &g_ops)).to_vec()
        );
    }

    #[test]
    fn swiglu_matches_the_tensor_ops_forward_and_backward() {
        // Gates far out on both sides (σ saturating to 0 and 1) as well as near 0; enough elements
        // for the parallel path.
        let g = random::<CpuBackend, 2>([64, 700], 6.0);
        let u = random::<CpuBackend, 2>([64, 700], 1.0);
        let fused = swiglu(g.clone(), u.clone());
        let ops = silu(g.clone()) * u.clone();
        assert!(relative(fused, ops.clone()) < 1e-6);

        let r = random::<CpuBackend, 2>(ops.dims(), 1.0);
        let (ga, ua) = (leaf(&g), leaf(&u));
        let g_fused = weigh(swiglu(ga.clone(), ua.clone()), &r).backward();
        let (gb, ub) = (leaf(&g), leaf(&u));
        let g_ops = weigh(silu(gb.clone()) * ub.clone(), &r).backward();
        let dg = relative(grad(&ga, &g_fused), grad(&gb, &g_ops));
        let du = relative(grad(&ua, &g_fused), grad(&ub, &g_ops));
        assert!(dg < 1e-5 && du < 1e-5, "d_gate {dg:e}, d_up {du:e}");
    }

    /// The log-softmax at the targets, as `log_softmax` and `gather` give it, forward and
    /// backward; with a vocabulary the sixteen lanes do not divide and rows far apart in scale.
    #[test]
    fn token_logprobs_matches_the_tensor_ops_forward_and_backward() {
        let (b, s, vocab) = (3, 40, 1003);
        let x = random::<CpuBackend, 3>([b, s, vocab], 8.0);
        let ids: Vec<i64> = (0..b * s).map(|i| (i * 7919 % vocab) as i64).collect();
        let targets = || {
            Tensor::<CpuBackend, 2, Int>::from_data(
                TensorData::new(ids.clone(), [b, s]),
                &Default::default(),
            )
        };
        let ops = |x: Tensor<CpuBackend, 3>| {
            log_softmax(x, 2)
                .gather(2, targets().reshape([b, s, 1]))
                .reshape([b, s])
        };
        let fused = token_logprobs(x.clone(), targets());
        assert!(relative(fused, ops(x.clone())) < 1e-6);

        let ad_targets = || {
            Tensor::<CpuAutodiff, 2, Int>::from_data(
                TensorData::new(ids.clone(), [b, s]),
                &Default::default(),
            )
        };
        let r = random::<CpuBackend, 2>([b, s], 1.0);
        let xa = leaf(&x);
        let g_fused = weigh(token_logprobs(xa.clone(), ad_targets()), &r).backward();
        let xb = leaf(&x);
        let y_ops = log_softmax(xb.clone(), 2)
            .gather(2, ad_targets().reshape([b, s, 1]))
            .reshape([b, s]);
        let g_ops = weigh(y_ops, &r).backward();
        let dx = relative(grad(&xa, &g_fused), grad(&xb, &g_ops));
        assert!(dx < 1e-5, "dx {dx:e}");
    }

    #[test]
    fn token_logprobs_are_log_softmax_at_the_targets() {
        let logits: Tensor<CpuBackend, 3> = Tensor::from_data(
            TensorData::new(vec![0.0f32, 1.0, 2.0, 3.0, 3.0, 3.0], [1, 2, 3]),
            &Default::default(),
        );
        let targets: Tensor<CpuBackend, 2, Int> =
            Tensor::from_data(TensorData::new(vec![2i64, 0], [1, 2]), &Default::default());
        let lp = token_logprobs(logits, targets)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let lse = (1f32 + 1f32.exp() + 2f32.exp()).ln();
        assert!((lp[0] - (2.0 - lse)).abs() < 1e-6);
        assert!((lp[1] - (1f32 / 3.0).ln()).abs() < 1e-6);
    }

    #[test]
    #[should_panic(expected = "target id 3 outside a vocabulary of 3")]
    fn token_logprobs_refuses_a_target_outside_the_vocabulary() {
        let logits = random::<CpuBackend, 3>([1, 1, 3], 1.0);
        let targets: Tensor<CpuBackend, 2, Int> =
            Tensor::from_data(TensorData::new(vec![3i64], [1, 1]), &Default::default());
        token_logprobs(logits, targets);
    }

    #[test]
    fn repeat_kv_matches_the_tensor_ops_forward_and_backward() {
        // 2 key heads for 8 query heads, enough elements for the parallel path; and one
        // sequence of 3 key heads for 6 on the calling thread.
        for ([b, kv, n, d], heads) in [([2, 2, 70, 64], 8), ([1, 3, 5, 4], 6)] {
            let x = random::<CpuBackend, 4>([b, kv, n, d], 1.0);
            let ops = |x: Tensor<CpuBackend, 4>| {
                x.unsqueeze_dim::<5>(2)
                    .expand([b, kv, heads / kv, n, d])
                    .reshape([b, heads, n, d])
            };
            assert_eq!(
                floats(repeat_kv(x.clone(), heads)).to_vec(),
                floats(ops(x.clone())).to_vec()
            );
            let r = random::<CpuBackend, 4>([b, heads, n, d], 1.0);
            let xa = leaf(&x);
            let g_fused = weigh(repeat_kv(xa.clone(), heads), &r).backward();
            let xb = leaf(&x);
            let y_ops = xb
                .clone()
                .unsqueeze_dim::<5>(2)
                .expand([b, kv, heads / kv, n, d])
                .reshape([b, heads, n, d]);
            let g_ops = weigh(y_ops, &r).backward();
            let dx = relative(grad(&xa, &g_fused), grad(&xb, &g_ops));
            assert!(dx < 1e-6, "dx {dx:e}");
        }
    }

    /// A token sampled at temperature 1 carries the log-prob that scoring its logits gives,
    /// bit for bit.
    #[test]
    fn a_sampled_token_carries_the_scored_log_prob() {
        use rand::SeedableRng;
        let logits = random::<CpuBackend, 3>([1, 1, 5000], 3.0);
        let row = floats(logits.clone()).to_vec();
        let params = super::super::sampling::SamplingParams::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for _ in 0..5 {
            let (tok, lp) = super::super::sampling::sample_token(&row, &params, &mut rng);
            let targets: Tensor<CpuBackend, 2, Int> = Tensor::from_data(
                TensorData::new(vec![i64::from(tok)], [1, 1]),
                &Default::default(),
            );
            let scored = floats(token_logprobs(logits.clone(), targets))[0];
            assert_eq!(lp.to_bits(), scored.to_bits(), "{lp} against {scored}");
        }
    }
}
