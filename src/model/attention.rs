//! Causal self-attention over a whole sequence (training and scoring), and over rows that
//! continue a shared prefix ([`prefixed_attention`], packed training), that never materialises
//! the `n × n` score matrix, forward or backward.
//!
//! The sequence is cut into query tiles of `t` rows. A tile attends to the keys up to its own
//! last row (causality), so it holds one `[b, h, t, ≤n]` score block at a time, sized by
//! [`TILE_ELEMENTS`]. The forward keeps each row's log-sum-exp `lse = m + ln Σ exp(s − m)`; the
//! backward (the flash-attention backward) recomputes each tile's probabilities from it instead
//! of storing them:
//!
//! ```text
//! P = exp(S − lse)            S = Q Kᵀ · scale, masked above the diagonal
//! D = rowsum(dO ∘ O)
//! dV += Pᵀ dO    dS = P ∘ (dO Vᵀ − D)    dQ = dS K · scale    dK += dSᵀ Q · scale
//! ```
//!
//! Under autodiff the op is one graph node whose state is `q, k, v, o, lse` (`O(n·d)` memory);
//! Burn's own attention would keep every `[n, n]` probability matrix for the backward, which for
//! a 12k-token agent prompt is gigabytes per layer.
//!
//! Rust has no specialisation, so [`causal_attention`] takes any backend and routes by type: the
//! autodiff backends this crate trains on (`Autodiff<Flex>`, and `Autodiff<Cuda>` with the `cuda`
//! feature) get the custom backward; every other backend runs the same tiled forward. On the CPU
//! backend the forward is one kernel over the raw floats ([`super::cpu_attention`]); elsewhere it
//! is built from tensor ops.

use std::any::TypeId;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, Tensor, TensorData, TensorPrimitive};

use super::cpu_attention::{attention_backward, attention_forward, Dims};
use super::cpu_tensor::floats;
use super::fused::{record, repeat_kv};
use super::matmul::{cast, matmul};

/// The most score elements (`b · h · t · keys`) one tile holds: 2 Mi f32 is 8 MiB, and the
/// backward keeps about four such blocks live. Measured on 2 CPU cores at 4k tokens (4 heads
/// of 16), 2 Mi ran forward + backward in 1.0 s against 1.7 s for 16 Mi: smaller blocks stay
/// nearer the cache, until per-op overhead takes over.
pub const TILE_ELEMENTS: usize = 2 << 20;

/// The tile budget on a GPU: 128 Mi elements (512 MiB). There a tile costs a dozen kernel
/// launches whatever its size, so fewer, larger tiles win; 4k tokens of 16 heads take two.
pub const GPU_TILE_ELEMENTS: usize = 128 << 20;

/// [`GPU_TILE_ELEMENTS`] on the CUDA backends, [`TILE_ELEMENTS`] elsewhere.
fn tile_budget<B: Backend>() -> usize {
    if crate::device::is_cuda::<B>() {
        GPU_TILE_ELEMENTS
    } else {
        TILE_ELEMENTS
    }
}

/// Query rows per tile for `q [b, h, n, d]`: as many as [`TILE_ELEMENTS`] allows against all
/// `n` keys, at least 16 and at most `n`.
fn tile_rows(b: usize, h: usize, n: usize, budget: usize) -> usize {
    (budget / (b * h * n).max(1)).max(16).min(n.max(1))
}

/// Causal scaled-dot-product attention, `softmax(Q Kᵀ / √d, causal) V`: queries
/// `q [b, h, t, d]` are the last `t` of the `n` positions of `k, v [b, h, n, d]` (keys and values
/// already repeated to the query heads), so query row `r` is position `n − t + r` and sees the
/// keys up to it → `[b, h, t, d]`. `t = n` is causal self-attention from position 0; `t < n` is
/// a packed row after the shared prefix it continues (see [`crate::train::packing`]).
///
/// # Panics
/// When `t > n`.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> Tensor<B, 4> {
    tiled(q, k, v, tile_budget::<B>())
}

/// [`causal_attention`] with tiles of at most `budget` score elements.
fn tiled<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    budget: usize,
) -> Tensor<B, 4> {
    let (q, k, v) = match tracked::<B, crate::CpuBackend>(q, k, v, budget) {
        Ok(o) => return o,
        Err(qkv) => qkv,
    };
    #[cfg(feature = "cuda")]
    let (q, k, v) = match tracked::<B, crate::device::CudaBackend>(q, k, v, budget) {
        Ok(o) => return o,
        Err(qkv) => qkv,
    };
    let offset = query_offset(&q, &k);
    forward(q, k, v, Some(offset), budget).0
}

/// The position of the first query row when the queries are the last rows of the keys' span.
fn query_offset<B: Backend>(q: &Tensor<B, 4>, k: &Tensor<B, 4>) -> usize {
    let (t, n) = (q.dims()[2], k.dims()[2]);
    assert!(t <= n, "causal attention: {t} query rows but only {n} keys");
    n - t
}

/// Runs the autodiff op when `B` is `Autodiff<I>`; hands the inputs back otherwise.
#[allow(clippy::type_complexity)]
fn tracked<B: Backend, I: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    budget: usize,
) -> Result<Tensor<B, 4>, (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>)> {
    if TypeId::of::<B>() != TypeId::of::<Autodiff<I>>() {
        return Err((q, k, v));
    }
    let o = autodiff_op::<I>(cast(q), cast(k), cast(v), budget);
    Ok(cast(o))
}

/// Attention of queries against cached keys and values, for generation (forward only):
/// `q [b, h, t, d]`, `k, v [b, kv, n, d]` → `[b, h, t, d]`, where `kv` divides `h` (each key
/// head shared by `h / kv` query heads; the CPU kernel reads shared heads in place, other
/// backends repeat them first). With `Some(offset)` query row `r` is
/// position `offset + r` and sees keys `0..=offset + r` (a prefill, `n = offset + t`); with
/// `None` every row sees all `n` keys (a decode step whose rows are one token's query heads).
/// Every backend's prefill and decode take it: Burn's own attention materialises the score
/// matrix, and on CUDA multiplies on TF32 (see [`super::matmul`]).
pub fn cached_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    offset: Option<usize>,
) -> Tensor<B, 4> {
    forward(q, k, v, offset, tile_budget::<B>()).0
}

/// The tiled forward of queries `q [b, h, t, d]` against `k, v [b, kv, n, d]` (`kv` dividing
/// `h`), causal from position `mask_from` when given (see [`cached_attention`]):
/// `(o [b, h, t, d], lse [b, h, t, 1])`.
fn forward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask_from: Option<usize>,
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    if TypeId::of::<B>() == TypeId::of::<crate::CpuBackend>() {
        return on_cpu(q, k, v, mask_from);
    }
    let heads = q.dims()[1];
    forward_ops(
        q,
        repeat_kv(k, heads),
        repeat_kv(v, heads),
        mask_from,
        budget,
    )
}

/// [`forward`] built from tensor ops (every backend but the CPU one).
fn forward_ops<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask_from: Option<usize>,
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, t, d] = q.dims();
    let n = k.dims()[2];
    let q = q * (d as f64).powf(-0.5);
    let rows = tile_rows(b, h, n, budget);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..t).step_by(rows) {
        let end = (start + rows).min(t);
        // A causal tile needs the keys up to its last row's position only.
        let keys = mask_from.map_or(n, |offset| offset + end);
        let qi = q.clone().slice([0..b, 0..h, start..end, 0..d]);
        let kj = k.clone().slice([0..b, 0..h, 0..keys, 0..d]);
        let vj = v.clone().slice([0..b, 0..h, 0..keys, 0..d]);
        let s = scores(qi, kj, mask_from.map(|offset| offset + start));
        let m = s.clone().max_dim(3);
        let p = row_sub(s, m.clone()).exp();
        let l = p.clone().sum_dim(3);
        outs.push(matmul(p, vj) / l.clone());
        lses.push(m + l.log());
    }
    (Tensor::cat(outs, 2), Tensor::cat(lses, 2))
}

/// [`forward`] on the CPU backend: the same tiles as one kernel over the raw floats
/// ([`super::cpu_attention`]).
fn on_cpu<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask_from: Option<usize>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, t, d] = q.dims();
    let n = k.dims()[2];
    let device = q.device();
    let dims = Dims { b, h, t, n, d };
    let (o, lse) = attention_forward(&floats(q), &floats(k), &floats(v), dims, mask_from);
    (
        Tensor::from_data(TensorData::new(o, [b, h, t, d]), &device),
        Tensor::from_data(TensorData::new(lse, [b, h, t, 1]), &device),
    )
}

/// `qi [b, h, t, d]` (already scaled by `1/√d`) against `kj [b, h, keys, d]` → the scores
/// `[b, h, t, keys]`. With `Some(first)` row `r` is position `first + r`, and a key after it is
/// `-inf`.
fn scores<B: Backend>(qi: Tensor<B, 4>, kj: Tensor<B, 4>, first: Option<usize>) -> Tensor<B, 4> {
    let [_, _, t, _] = qi.dims();
    let keys = kj.dims()[2];
    let s = matmul(qi, kj.swap_dims(2, 3));
    let Some(first) = first else { return s };
    // Row r is position first + r; key j is masked when j > first + r.
    let mask = Tensor::<B, 2, Bool>::tril_mask([t, keys], first as i64, &s.device());
    s.mask_fill(mask.unsqueeze::<4>(), f32::NEG_INFINITY)
}

/// `x [b, h, t, k] − r [b, h, t, 1]` row by row, on 2-d views: Flex broadcasts a per-row column
/// over a matrix with SIMD but walks a 4-d broadcast element by element (measured 4× slower).
fn row_sub<B: Backend>(x: Tensor<B, 4>, r: Tensor<B, 4>) -> Tensor<B, 4> {
    let [b, h, t, k] = x.dims();
    (x.reshape([b * h * t, k]) - r.reshape([b * h * t, 1])).reshape([b, h, t, k])
}

/// The gradients `(dq [b, h, t, d], dk [b, h, n, d], dv [b, h, n, d])` of the tiled attention
/// (queries the last `t` of `n` positions, as in [`causal_attention`]) for `d_o [b, h, t, d]`.
fn backward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    o: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    if TypeId::of::<B>() == TypeId::of::<crate::CpuBackend>() {
        return backward_on_cpu(q, k, v, o, lse, d_o);
    }
    backward_ops(q, k, v, o, lse, d_o, budget)
}

/// [`backward`] built from tensor ops (every backend but the CPU one).
fn backward_ops<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    o: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, t, d] = q.dims();
    let n = k.dims()[2];
    let offset = query_offset(&q, &k);
    let scale = (d as f64).powf(-0.5);
    // S = (q·scale) Kᵀ, so dK takes the scaled queries and dQ = dS K · scale.
    let q = q * scale;
    let tile = tile_rows(b, h, n, budget);
    let delta = (d_o.clone() * o).sum_dim(3);
    let mut dk = k.zeros_like();
    let mut dv = v.zeros_like();
    let mut dqs = Vec::new();
    for start in (0..t).step_by(tile) {
        let end = (start + tile).min(t);
        let rows = [0..b, 0..h, start..end, 0..d];
        // Row `start + r` is position `offset + start + r`: it sees the keys up to there.
        let keys = [0..b, 0..h, 0..offset + end, 0..d];
        let qi = q.clone().slice(rows.clone());
        let d_oi = d_o.clone().slice(rows.clone());
        let kj = k.clone().slice(keys.clone());
        let vj = v.clone().slice(keys.clone());
        let lse_i = lse.clone().slice([0..b, 0..h, start..end, 0..1]);
        let delta_i = delta.clone().slice([0..b, 0..h, start..end, 0..1]);
        let p = row_sub(scores(qi.clone(), kj.clone(), Some(offset + start)), lse_i).exp();
        let dv_j = matmul(p.clone().swap_dims(2, 3), d_oi.clone());
        let dp = matmul(d_oi, vj.swap_dims(2, 3));
        let ds = p * row_sub(dp, delta_i);
        dqs.push(matmul(ds.clone(), kj) * scale);
        let dk_j = matmul(ds.swap_dims(2, 3), qi);
        dk = dk
            .clone()
            .slice_assign(keys.clone(), dk.slice(keys.clone()) + dk_j);
        dv = dv.clone().slice_assign(keys.clone(), dv.slice(keys) + dv_j);
    }
    (Tensor::cat(dqs, 2), dk, dv)
}

/// [`backward`] on the CPU backend: one kernel over the raw floats
/// ([`super::cpu_attention::attention_backward`]).
fn backward_on_cpu<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    o: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, t, d] = q.dims();
    let n = k.dims()[2];
    let device = q.device();
    let dims = Dims { b, h, t, n, d };
    let (dq, dk, dv) = attention_backward(
        &floats(q),
        &floats(k),
        &floats(v),
        &floats(o),
        &floats(lse),
        &floats(d_o),
        dims,
    );
    let tensor =
        |x: Vec<f32>, rows: usize| Tensor::from_data(TensorData::new(x, [b, h, rows, d]), &device);
    (tensor(dq, t), tensor(dk, n), tensor(dv, n))
}

/// The autodiff node: forward on the inner backend, gradients by [`backward`].
#[derive(Debug)]
struct TiledCausal;

/// What the backward needs: the inputs, the output, the per-row log-sum-exp, and the tile
/// budget.
type State<I> = ([FloatTensor<I>; 5], usize);

impl<I: Backend> Backward<I, 3> for TiledCausal {
    type State = State<I>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_o = grads.consume::<I>(&ops.node);
        let (tensors, budget) = ops.state;
        let [q, k, v, o, lse] = tensors.map(inner::<I>);
        let (dq, dk, dv) = backward(q, k, v, o, lse, inner::<I>(d_o), budget);
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = parent {
                grads.register::<I>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

fn inner<I: Backend>(p: FloatTensor<I>) -> Tensor<I, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn autodiff_op<I: Backend>(
    q: Tensor<Autodiff<I>, 4>,
    k: Tensor<Autodiff<I>, 4>,
    v: Tensor<Autodiff<I>, 4>,
    budget: usize,
) -> Tensor<Autodiff<I>, 4> {
    let offset = query_offset(&q, &k);
    let (q, k, v) = (
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
    );
    let (o, lse) = forward(
        inner::<I>(q.primitive.clone()),
        inner::<I>(k.primitive.clone()),
        inner::<I>(v.primitive.clone()),
        Some(offset),
        budget,
    );
    let o = o.into_primitive().tensor();
    let lse = lse.into_primitive().tensor();
    let state = || {
        let [q, k, v] = [&q, &k, &v].map(|t| t.primitive.clone());
        ([q, k, v, o.clone(), lse], budget)
    };
    record(TiledCausal, [&q, &k, &v], state, o.clone())
}

/// Attention of rows that continue one shared prefix (a packed batch, see
/// [`crate::train::packing`]): queries `q [r, h, l, d]`, row `i`'s at positions `p..p + l`; the
/// prefix's keys and values `prefix_k, prefix_v [1, h, p, d]`; each row's own
/// `own_k, own_v [r, h, l, d]` → `[r, h, l, d]`. Row `i` sees the whole prefix and causally its
/// own keys, never another row's: it equals [`causal_attention`] of `q[i]` against
/// `prefix ++ own[i]`.
///
/// The prefix is held once, not once per row, forward and backward: each row's keys are
/// assembled for its own call and dropped after it. Broadcasting the prefix to every row
/// instead would keep `r` copies of a 12k-token prefix's keys per layer for the backward.
pub fn prefixed_attention<B: Backend>(
    q: Tensor<B, 4>,
    prefix_k: Tensor<B, 4>,
    prefix_v: Tensor<B, 4>,
    own_k: Tensor<B, 4>,
    own_v: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let budget = tile_budget::<B>();
    let args = [q, prefix_k, prefix_v, own_k, own_v];
    let args = match prefixed_tracked::<B, crate::CpuBackend>(args, budget) {
        Ok(o) => return o,
        Err(args) => args,
    };
    #[cfg(feature = "cuda")]
    let args = match prefixed_tracked::<B, crate::device::CudaBackend>(args, budget) {
        Ok(o) => return o,
        Err(args) => args,
    };
    prefixed_forward(args, budget).0
}

/// Row `i`'s keys and values: the prefix's, then its own, `[1, h, p + l, d]` each.
fn row_keys<B: Backend>(
    [prefix_k, prefix_v, own_k, own_v]: [&Tensor<B, 4>; 4],
    i: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [_, h, l, d] = own_k.dims();
    let own = |x: &Tensor<B, 4>| x.clone().slice([i..i + 1, 0..h, 0..l, 0..d]);
    (
        Tensor::cat(vec![prefix_k.clone(), own(own_k)], 2),
        Tensor::cat(vec![prefix_v.clone(), own(own_v)], 2),
    )
}

/// [`prefixed_attention`]'s forward, row by row: `(o [r, h, l, d], lse [r, h, l, 1])`.
fn prefixed_forward<B: Backend>(
    args: [Tensor<B, 4>; 5],
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    if TypeId::of::<B>() == TypeId::of::<crate::CpuBackend>() {
        return prefixed_forward_cpu(args);
    }
    prefixed_forward_ops(args, budget)
}

/// [`prefixed_forward`] from tensor ops (every backend but the CPU one).
fn prefixed_forward_ops<B: Backend>(
    [q, pk, pv, ok, ov]: [Tensor<B, 4>; 5],
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [r, h, l, d] = q.dims();
    let p = pk.dims()[2];
    let (mut outs, mut lses) = (Vec::with_capacity(r), Vec::with_capacity(r));
    for i in 0..r {
        let (k, v) = row_keys([&pk, &pv, &ok, &ov], i);
        let qi = q.clone().slice([i..i + 1, 0..h, 0..l, 0..d]);
        let (o, lse) = forward(qi, k, v, Some(p), budget);
        outs.push(o);
        lses.push(lse);
    }
    (Tensor::cat(outs, 0), Tensor::cat(lses, 0))
}

/// The gradients of [`prefixed_attention`]'s five inputs for `d_o [r, h, l, d]`, row by row:
/// each row's key gradient splits into its share of the prefix's (summed over rows) and its
/// own.
fn prefixed_backward<B: Backend>(
    args: [Tensor<B, 4>; 5],
    o: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    budget: usize,
) -> [Tensor<B, 4>; 5] {
    if TypeId::of::<B>() == TypeId::of::<crate::CpuBackend>() {
        return prefixed_backward_cpu(args, o, lse, d_o);
    }
    prefixed_backward_ops(args, o, lse, d_o, budget)
}

/// [`prefixed_backward`] from tensor ops (every backend but the CPU one).
fn prefixed_backward_ops<B: Backend>(
    [q, pk, pv, ok, ov]: [Tensor<B, 4>; 5],
    o: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    budget: usize,
) -> [Tensor<B, 4>; 5] {
    let [r, h, l, d] = q.dims();
    let p = pk.dims()[2];
    let (mut dpk, mut dpv) = (pk.zeros_like(), pv.zeros_like());
    let (mut dq, mut dok, mut dov) = (Vec::new(), Vec::new(), Vec::new());
    let (prefix, own) = ([0..1, 0..h, 0..p, 0..d], [0..1, 0..h, p..p + l, 0..d]);
    for i in 0..r {
        let rows = [i..i + 1, 0..h, 0..l, 0..d];
        let (k, v) = row_keys([&pk, &pv, &ok, &ov], i);
        let (dqi, dk, dv) = backward(
            q.clone().slice(rows.clone()),
            k,
            v,
            o.clone().slice(rows.clone()),
            lse.clone().slice([i..i + 1, 0..h, 0..l, 0..1]),
            d_o.clone().slice(rows),
            budget,
        );
        dpk = dpk + dk.clone().slice(prefix.clone());
        dpv = dpv + dv.clone().slice(prefix.clone());
        dok.push(dk.slice(own.clone()));
        dov.push(dv.slice(own.clone()));
        dq.push(dqi);
    }
    [
        Tensor::cat(dq, 0),
        dpk,
        dpv,
        Tensor::cat(dok, 0),
        Tensor::cat(dov, 0),
    ]
}

/// The sizes of a prefixed call: rows `r`, heads `h`, prefix `p`, row length `l`, head width
/// `d`.
#[derive(Clone, Copy)]
struct Prefixed {
    r: usize,
    h: usize,
    p: usize,
    l: usize,
    d: usize,
}

impl Prefixed {
    fn of<B: Backend>(q: &Tensor<B, 4>, prefix_k: &Tensor<B, 4>) -> Self {
        let [r, h, l, d] = q.dims();
        Prefixed {
            r,
            h,
            p: prefix_k.dims()[2],
            l,
            d,
        }
    }

    /// One row's call of the kernels: `l` queries after `p + l` keys.
    fn dims(self) -> Dims {
        Dims {
            b: 1,
            h: self.h,
            t: self.l,
            n: self.p + self.l,
            d: self.d,
        }
    }

    /// Row `i`'s keys (or values) `[h, p + l, d]`: per head the prefix's `p` rows, then its own
    /// `l`, copied once from the raw floats of `prefix [1, h, p, d]` and `own [r, h, l, d]`.
    fn row_keys(self, prefix: &[f32], own: &[f32], i: usize) -> Vec<f32> {
        let Prefixed { h, p, l, d, .. } = self;
        let mut k = Vec::with_capacity(h * (p + l) * d);
        for head in 0..h {
            k.extend_from_slice(&prefix[head * p * d..(head + 1) * p * d]);
            let at = (i * h + head) * l * d;
            k.extend_from_slice(&own[at..at + l * d]);
        }
        k
    }
}

/// [`prefixed_forward`] on the CPU backend: each row's keys assembled once from the raw
/// floats, straight into the kernel ([`super::cpu_attention`]).
fn prefixed_forward_cpu<B: Backend>(args: [Tensor<B, 4>; 5]) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let s = Prefixed::of(&args[0], &args[1]);
    let device = args[0].device();
    let [q, pk, pv, ok, ov] = args.map(floats);
    let (rows, row_lse) = (s.h * s.l * s.d, s.h * s.l);
    let (mut o, mut lse) = (
        Vec::with_capacity(s.r * rows),
        Vec::with_capacity(s.r * row_lse),
    );
    for i in 0..s.r {
        let (k, v) = (s.row_keys(&pk, &ok, i), s.row_keys(&pv, &ov, i));
        let qi = &q[i * rows..(i + 1) * rows];
        let (oi, lse_i) = attention_forward(qi, &k, &v, s.dims(), Some(s.p));
        o.extend(oi);
        lse.extend(lse_i);
    }
    (
        Tensor::from_data(TensorData::new(o, [s.r, s.h, s.l, s.d]), &device),
        Tensor::from_data(TensorData::new(lse, [s.r, s.h, s.l, 1]), &device),
    )
}

/// [`prefixed_backward`] on the CPU backend: each row's kernel call on its assembled keys, its
/// key gradients split between the prefix's (summed over rows) and its own.
fn prefixed_backward_cpu<B: Backend>(
    args: [Tensor<B, 4>; 5],
    o: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
) -> [Tensor<B, 4>; 5] {
    let s = Prefixed::of(&args[0], &args[1]);
    let Prefixed { r, h, p, l, d } = s;
    let device = args[0].device();
    let [q, pk, pv, ok, ov] = args.map(floats);
    let (o, lse, d_o) = (floats(o), floats(lse), floats(d_o));
    let (rows, n) = (h * l * d, p + l);
    let mut dq = Vec::with_capacity(r * rows);
    let (mut dpk, mut dpv) = (vec![0f32; h * p * d], vec![0f32; h * p * d]);
    let (mut dok, mut dov) = (Vec::with_capacity(r * rows), Vec::with_capacity(r * rows));
    for i in 0..r {
        let (k, v) = (s.row_keys(&pk, &ok, i), s.row_keys(&pv, &ov, i));
        let at = i * rows..(i + 1) * rows;
        let (dqi, dk, dv) = attention_backward(
            &q[at.clone()],
            &k,
            &v,
            &o[at.clone()],
            &lse[i * h * l..(i + 1) * h * l],
            &d_o[at],
            s.dims(),
        );
        dq.extend(dqi);
        for head in 0..h {
            let prefix = head * p * d..(head + 1) * p * d;
            for (grads, shared, own) in [(&dk, &mut dpk, &mut dok), (&dv, &mut dpv, &mut dov)] {
                let g = &grads[head * n * d..(head + 1) * n * d];
                shared[prefix.clone()]
                    .iter_mut()
                    .zip(&g[..p * d])
                    .for_each(|(x, y)| *x += y);
                own.extend_from_slice(&g[p * d..]);
            }
        }
    }
    let tensor =
        |x: Vec<f32>, shape: [usize; 4]| Tensor::from_data(TensorData::new(x, shape), &device);
    [
        tensor(dq, [r, h, l, d]),
        tensor(dpk, [1, h, p, d]),
        tensor(dpv, [1, h, p, d]),
        tensor(dok, [r, h, l, d]),
        tensor(dov, [r, h, l, d]),
    ]
}

/// Runs [`prefixed_attention`]'s autodiff op when `B` is `Autodiff<I>`; hands the inputs back
/// otherwise.
fn prefixed_tracked<B: Backend, I: Backend>(
    args: [Tensor<B, 4>; 5],
    budget: usize,
) -> Result<Tensor<B, 4>, [Tensor<B, 4>; 5]> {
    if TypeId::of::<B>() != TypeId::of::<Autodiff<I>>() {
        return Err(args);
    }
    let args = args.map(|t| cast::<B, Autodiff<I>, 4>(t).into_primitive().tensor());
    let (o, lse) = prefixed_forward(args.clone().map(|t| inner::<I>(t.primitive)), budget);
    let o = o.into_primitive().tensor();
    let lse = lse.into_primitive().tensor();
    let state = || {
        let [q, pk, pv, ok, ov] = args.each_ref().map(|t| t.primitive.clone());
        ([q, pk, pv, ok, ov, o.clone(), lse], budget)
    };
    let out: Tensor<Autodiff<I>, 4> = record(PrefixedRows, args.each_ref(), state, o.clone());
    Ok(cast(out))
}

/// The autodiff node of [`prefixed_attention`]: forward row by row on the inner backend,
/// gradients by [`prefixed_backward`].
#[derive(Debug)]
struct PrefixedRows;

impl<I: Backend> Backward<I, 5> for PrefixedRows {
    /// The five inputs, the output, the per-row log-sum-exp, and the tile budget.
    type State = ([FloatTensor<I>; 7], usize);

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_o = grads.consume::<I>(&ops.node);
        let ([q, pk, pv, ok, ov, o, lse], budget) = ops.state;
        let inputs = [q, pk, pv, ok, ov].map(inner::<I>);
        let g = prefixed_backward(inputs, inner(o), inner(lse), inner(d_o), budget);
        for (parent, grad) in ops.parents.into_iter().zip(g) {
            if let Some(node) = parent {
                grads.register::<I>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{Distribution, Tolerance};

    type Ad = crate::CpuAutodiff;

    fn reference<B: Backend>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        let opts = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        };
        burn::tensor::module::attention_fallback(q, k, v, None, None, opts)
    }

    fn inputs<B: Backend>(shape: [usize; 4], seed: u64) -> [Tensor<B, 4>; 3] {
        B::seed(&Default::default(), seed);
        let dev = Default::default();
        [0, 1, 2].map(|_| Tensor::random(shape, Distribution::Normal(0.0, 1.0), &dev))
    }

    /// One tile, and many tiles (a budget of 16 rows of 300 keys), agree with the materialised
    /// reference, forward and every input gradient.
    #[test]
    fn tiled_matches_the_full_score_matrix_forward_and_backward() {
        for (shape, budget) in [
            ([1, 2, 7, 8], TILE_ELEMENTS),
            ([2, 3, 300, 16], 2 * 3 * 16 * 300),
        ] {
            let [q, k, v] = inputs::<Ad>(shape, 7);
            let go =
                Tensor::<Ad, 4>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default());
            let run = |f: &dyn Fn(Tensor<Ad, 4>, Tensor<Ad, 4>, Tensor<Ad, 4>) -> Tensor<Ad, 4>| {
                let (q, k, v) = (
                    q.clone().detach().require_grad(),
                    k.clone().detach().require_grad(),
                    v.clone().detach().require_grad(),
                );
                let o = f(q.clone(), k.clone(), v.clone());
                let grads = (o.clone() * go.clone()).sum().backward();
                let g = |t: &Tensor<Ad, 4>| t.grad(&grads).unwrap();
                (o.inner(), g(&q), g(&k), g(&v))
            };
            let ours = run(&|q, k, v| tiled(q, k, v, budget));
            let want = run(&|q, k, v| reference(q, k, v));
            let tol = Tolerance::<f32>::absolute(2e-5);
            ours.0
                .into_data()
                .assert_approx_eq::<f32>(&want.0.into_data(), tol);
            ours.1
                .into_data()
                .assert_approx_eq::<f32>(&want.1.into_data(), tol);
            ours.2
                .into_data()
                .assert_approx_eq::<f32>(&want.2.into_data(), tol);
            ours.3
                .into_data()
                .assert_approx_eq::<f32>(&want.3.into_data(), tol);
        }
    }

    /// Queries that continue earlier keys (a packed row after its prefix): the autodiff op's
    /// output and input gradients equal the materialised reference, whose causal mask aligns
    /// the last query with the last key.
    #[test]
    fn queries_after_earlier_keys_match_the_reference_forward_and_backward() {
        let dev = Default::default();
        let [_, k, v] = inputs::<Ad>([2, 2, 70, 16], 11);
        let q = Tensor::<Ad, 4>::random([2, 2, 9, 16], Distribution::Normal(0.0, 1.0), &dev);
        let go = Tensor::<Ad, 4>::random([2, 2, 9, 16], Distribution::Normal(0.0, 1.0), &dev);
        let run = |f: &dyn Fn(Tensor<Ad, 4>, Tensor<Ad, 4>, Tensor<Ad, 4>) -> Tensor<Ad, 4>| {
            let (q, k, v) = (
                q.clone().detach().require_grad(),
                k.clone().detach().require_grad(),
                v.clone().detach().require_grad(),
            );
            let o = f(q.clone(), k.clone(), v.clone());
            let grads = (o.clone() * go.clone()).sum().backward();
            let g = |t: &Tensor<Ad, 4>| t.grad(&grads).unwrap();
            [o.inner(), g(&q), g(&k), g(&v)]
        };
        let ours = run(&|q, k, v| causal_attention(q, k, v));
        let want = run(&|q, k, v| reference(q, k, v));
        for (name, (a, b)) in ["o", "dq", "dk", "dv"]
            .iter()
            .zip(ours.into_iter().zip(want))
        {
            assert_eq!(a.dims(), b.dims(), "{name}");
            a.into_data()
                .assert_approx_eq::<f32>(&b.into_data(), Tolerance::absolute(2e-5));
        }
    }

    /// The tensor-op forward and backward (the CUDA path) equal the CPU kernels, causal from 0
    /// and after earlier keys, over several tiles.
    #[test]
    fn the_tensor_op_path_equals_the_cpu_kernels() {
        type B = crate::CpuBackend;
        for (t, n) in [(40, 40), (13, 50)] {
            let [_, k, v] = inputs::<B>([1, 2, n, 8], 5);
            let [q, d_o, _] = inputs::<B>([1, 2, t, 8], 6);
            let budget = 2 * 8 * n; // 8 rows a tile
            let offset = Some(n - t);
            let (o, lse) = forward(q.clone(), k.clone(), v.clone(), offset, budget);
            let (o_ops, lse_ops) = forward_ops(q.clone(), k.clone(), v.clone(), offset, budget);
            let tol = Tolerance::<f32>::absolute(2e-5);
            o_ops
                .into_data()
                .assert_approx_eq::<f32>(&o.clone().into_data(), tol);
            lse_ops
                .into_data()
                .assert_approx_eq::<f32>(&lse.clone().into_data(), tol);
            let args = (q, k, v, o, lse, d_o);
            let kernel = backward(
                args.0.clone(),
                args.1.clone(),
                args.2.clone(),
                args.3.clone(),
                args.4.clone(),
                args.5.clone(),
                budget,
            );
            let ops = backward_ops(args.0, args.1, args.2, args.3, args.4, args.5, budget);
            for (a, b) in [(ops.0, kernel.0), (ops.1, kernel.1), (ops.2, kernel.2)] {
                a.into_data().assert_approx_eq::<f32>(&b.into_data(), tol);
            }
        }
    }

    /// Rows after a shared prefix: output and every input gradient equal the attention of each
    /// row against its own copy of the prefix's keys.
    #[test]
    fn prefixed_rows_equal_each_row_against_its_own_copy_of_the_prefix() {
        let dev = Default::default();
        let (r, h, p, l, d) = (3, 2, 40, 7, 8);
        let normal = |shape: [usize; 4]| {
            Tensor::<Ad, 4>::random(shape, Distribution::Normal(0.0, 1.0), &dev)
        };
        let (q, pk, pv) = (
            normal([r, h, l, d]),
            normal([1, h, p, d]),
            normal([1, h, p, d]),
        );
        let (ok, ov, go) = (
            normal([r, h, l, d]),
            normal([r, h, l, d]),
            normal([r, h, l, d]),
        );
        let run = |packed: bool| {
            let leaves = [&q, &pk, &pv, &ok, &ov].map(|t| t.clone().detach().require_grad());
            let [q, pk, pv, ok, ov] = leaves.clone();
            let o = if packed {
                prefixed_attention(q, pk, pv, ok, ov)
            } else {
                let copy = |x: Tensor<Ad, 4>| x.expand([r, h, p, d]);
                let k = Tensor::cat(vec![copy(pk), ok], 2);
                let v = Tensor::cat(vec![copy(pv), ov], 2);
                causal_attention(q, k, v)
            };
            let grads = (o.clone() * go.clone()).sum().backward();
            let mut out = vec![o.inner()];
            out.extend(leaves.iter().map(|t| t.grad(&grads).unwrap()));
            out
        };
        let names = ["o", "dq", "d prefix k", "d prefix v", "d own k", "d own v"];
        for (name, (a, b)) in names.iter().zip(run(true).into_iter().zip(run(false))) {
            assert_eq!(a.dims(), b.dims(), "{name}");
            a.into_data()
                .assert_approx_eq::<f32>(&b.into_data(), Tolerance::absolute(2e-5));
        }
        // Without autodiff, the same forward.
        type B = crate::CpuBackend;
        let plain = |t: &Tensor<Ad, 4>| t.clone().inner();
        let o: Tensor<B, 4> =
            prefixed_attention(plain(&q), plain(&pk), plain(&pv), plain(&ok), plain(&ov));
        o.into_data()
            .assert_approx_eq::<f32>(&run(true)[0].clone().into_data(), Tolerance::absolute(1e-6));
    }

    /// The tensor-op forward and backward of prefixed rows (the CUDA path) equal the CPU ones.
    #[test]
    fn prefixed_rows_by_tensor_ops_equal_the_cpu_path() {
        type B = crate::CpuBackend;
        let dev = Default::default();
        let (r, h, p, l, d) = (3, 2, 37, 6, 8);
        let normal =
            |shape: [usize; 4]| Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &dev);
        let args = [
            normal([r, h, l, d]),
            normal([1, h, p, d]),
            normal([1, h, p, d]),
            normal([r, h, l, d]),
            normal([r, h, l, d]),
        ];
        let d_o = normal([r, h, l, d]);
        let budget = 2 * 8 * (p + l);
        let tol = Tolerance::<f32>::absolute(2e-5);
        let (o, lse) = prefixed_forward_cpu(args.clone());
        let (o_ops, lse_ops) = prefixed_forward_ops(args.clone(), budget);
        o_ops
            .into_data()
            .assert_approx_eq::<f32>(&o.clone().into_data(), tol);
        lse_ops
            .into_data()
            .assert_approx_eq::<f32>(&lse.clone().into_data(), tol);
        let cpu = prefixed_backward_cpu(args.clone(), o.clone(), lse.clone(), d_o.clone());
        let ops = prefixed_backward_ops(args, o, lse, d_o, budget);
        for (a, b) in ops.into_iter().zip(cpu) {
            assert_eq!(a.dims(), b.dims());
            a.into_data().assert_approx_eq::<f32>(&b.into_data(), tol);
        }
    }

    /// The inference backend takes the same tiled forward; it equals Burn's attention.
    #[test]
    fn untracked_forward_equals_burns_attention() {
        type B = crate::CpuBackend;
        let [q, k, v] = inputs::<B>([1, 2, 200, 16], 3);
        let opts = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        };
        let want = attention(q.clone(), k.clone(), v.clone(), None, None, opts);
        causal_attention(q, k, v)
            .into_data()
            .assert_approx_eq::<f32>(&want.into_data(), Tolerance::absolute(2e-5));
    }

    /// A prefill of 5 tokens after 9 cached ones, and a decode step whose rows are one token's
    /// query heads, each equal Burn's attention over the same keys.
    #[test]
    fn cached_attention_equals_burns_attention() {
        type B = crate::CpuBackend;
        let dev = Default::default();
        let [q, k, v] = inputs::<B>([1, 2, 14, 16], 9);
        let q = q.slice([0..1, 0..2, 9..14, 0..16]);
        // Burn's causal mask aligns the last query with the last key (a prefill after a cache).
        let causal = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        };
        let want = attention(q.clone(), k.clone(), v.clone(), None, None, causal);
        cached_attention(q.clone(), k.clone(), v.clone(), Some(9))
            .into_data()
            .assert_approx_eq::<f32>(&want.into_data(), Tolerance::absolute(2e-5));
        let all = AttentionModuleOptions {
            is_causal: false,
            ..causal
        };
        let q = Tensor::<B, 4>::random([1, 2, 4, 16], Distribution::Normal(0.0, 1.0), &dev);
        let want = attention(q.clone(), k.clone(), v.clone(), None, None, all);
        cached_attention(q, k, v, None)
            .into_data()
            .assert_approx_eq::<f32>(&want.into_data(), Tolerance::absolute(2e-5));
    }

    #[test]
    fn tiles_are_bounded_by_the_element_budget() {
        assert_eq!(tile_rows(1, 1, 10, TILE_ELEMENTS), 10);
        assert_eq!(tile_rows(2, 3, 300, 2 * 3 * 16 * 300), 16);
        // The budget decides while it allows 16 rows; below that a tile keeps 16 rows.
        let t = tile_rows(1, 4, 4_000, TILE_ELEMENTS);
        assert!(t > 16 && 4 * t * 4_000 <= TILE_ELEMENTS, "{t}");
        assert_eq!(tile_rows(2, 16, 12_000, TILE_ELEMENTS), 16);
    }
}
