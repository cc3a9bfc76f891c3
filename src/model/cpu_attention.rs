//! The CPU kernels of the attention: [`super::attention`]'s tiled causal attention, forward
//! ([`attention_forward`]) and flash-attention backward ([`attention_backward`]), each one pass
//! over raw `f32` slices, for the Flex backend.
//!
//! Built from tensor ops, each query tile's score block is written, masked, exponentiated,
//! summed and multiplied in separate passes over memory; at a 12k-token prompt those passes
//! are most of a prefill. Here each query row walks the keys in blocks of [`key_block`] with
//! an online softmax (running maximum `m`, running sum `l`, output accumulator rescaled when
//! `m` grows, as flash attention does), so a score lives in L1 from its dot product to its
//! weight on `V`:
//!
//! ```text
//! for each key block J:   s_j = q·k_j · scale          (j ∈ J, j ≤ the row's position)
//!                         m' = max(m, max_j s_j)
//!                         acc = acc · e^(m − m') + Σ_j e^(s_j − m') v_j
//!                         l   = l   · e^(m − m') + Σ_j e^(s_j − m')
//! o = acc / l,  lse = m + ln l
//! ```
//!
//! Query rows go in tiles of [`QUERY_TILE`] that share each key block while it is in cache,
//! and tiles run on rayon's pool. Every row's result depends only on its own query, the keys
//! up to its position and the fixed key-block boundaries (multiples of [`key_block`] from
//! position 0), never on which tile or call it was computed in: a prompt prefilled in two
//! parts (a prefix-cache hit) gets bit-identical rows to one prefilled whole.
//!
//! The arithmetic is written for the compiler to vectorise: keys are transposed to `[d, n]` so
//! the dot products run along the keys, and the exponential is a branch-free polynomial
//! instead of a libm call: the forward keeps its scores in base 2 ([`exp2_nonpositive`]), the
//! backward recomputes its probabilities in base e ([`exp_nonpositive`]). On x86-64 with AVX2 and FMA (checked at run
//! time) the kernel is compiled a second time for them; the `gemm` crate Burn multiplies with
//! dispatches the same way.

use rayon::prelude::*;

use super::cpu_tensor::filled;

/// Keys per block of the forward for heads `d` wide: as many as make 64 KiB of `Kᵀ` (and as
/// much of `V`, within L2) for heads of 16 and 32, else 256; four rows' scores over them (at
/// most 16 KiB) stay in L1. The kernel is compiled for each of the three sizes: with the block
/// a constant, a 12k-token prefill's forward took 0.93 of the time it took with the same block
/// read at run time. Measured on a 12k-token causal prompt (4 heads of 16, 2 threads): blocks of
/// 1024 took 0.86 of the time of blocks of 256, once four rows share each key load (fewer
/// rescales and per-block passes). Heads of 64 and more keep blocks of 256.
pub fn key_block(d: usize) -> usize {
    match d {
        0..=16 => 1024,
        17..=32 => 512,
        _ => 256,
    }
}

/// Query rows that share each key block.
pub const QUERY_TILE: usize = 64;

/// Rows per block of the backward's key tiles.
const ROW_BLOCK: usize = 256;

/// Below this many score elements (`b · h · t · n`) the kernel runs on the calling thread: a
/// decode step's few rows are not worth a hand-off to the pool.
const PARALLEL_FROM: usize = 1 << 16;

/// The dimensions of one attention call: queries `[b, h, t, d]`, keys and values
/// `[b, h, n, d]`, all row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Batch.
    pub b: usize,
    /// Query heads. The backward takes keys and values repeated to them; the forward also
    /// takes fewer, shared key heads ([`attention_forward`]).
    pub h: usize,
    /// Query rows.
    pub t: usize,
    /// Keys.
    pub n: usize,
    /// Head dimension.
    pub d: usize,
}

/// `softmax(Q Kᵀ / √d) V` with its per-row log-sum-exp: `(o [b, h, t, d], lse [b, h, t])`.
///
/// Keys and values may have fewer heads than the queries, `[b, kv, n, d]` with `kv` dividing
/// `h` (grouped-query attention): query head `i` of a batch row reads key head
/// `i / (h / kv)`, so the shared heads are never copied out to every query head.
///
/// With `Some(offset)`, query row `r` is position `offset + r` and sees keys `0..=offset + r`
/// (needs `offset + t <= n`); with `None` every row sees all `n` keys.
///
/// # Panics
/// When a slice's length is not the one `dims` gives, or the causal rows run past `n`.
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: Dims,
    mask_from: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let Dims { b, h, t, n, d } = dims;
    assert_eq!(
        q.len(),
        b * h * t * d,
        "attention_forward: q is not [b, h, t, d]"
    );
    let kv = k.len().checked_div(b * n * d).unwrap_or(h);
    assert!(
        kv > 0 && h.is_multiple_of(kv) && k.len() == b * kv * n * d,
        "attention_forward: k is not [b, kv, n, d] with kv dividing h"
    );
    assert_eq!(v.len(), k.len(), "attention_forward: v is not shaped as k");
    // The key head of query head `i` (counted over the batch rows' heads).
    let key_head = |i: usize| (i / h) * kv + (i % h) / (h / kv);
    if let Some(offset) = mask_from {
        assert!(
            offset + t <= n,
            "attention_forward: causal rows past the keys"
        );
    }
    let mut o = vec![0f32; b * h * t * d];
    let mut lse = vec![0f32; b * h * t];
    if t == 0 || d == 0 {
        return (o, lse);
    }
    assert!(n > 0, "attention_forward: rows with no key to attend to");
    let kernel = Kernel::detect();
    let heads = b * h;
    let work = heads * t * n;
    if mask_from.is_none() && t <= FEW_ROWS {
        // A decode step: transposing every cached key would cost as much as attending to it.
        let head = |(i, (oh, lh)): (usize, (&mut [f32], &mut [f32]))| {
            let j = key_head(i);
            let (rows, keys) = (i * t * d..(i + 1) * t * d, j * n * d..(j + 1) * n * d);
            kernel.few_rows(&q[rows], &k[keys.clone()], &v[keys], d, oh, lh)
        };
        let outputs: Vec<(&mut [f32], &mut [f32])> =
            o.chunks_mut(t * d).zip(lse.chunks_mut(t)).collect();
        if work >= PARALLEL_FROM {
            outputs.into_par_iter().enumerate().for_each(head);
        } else {
            outputs.into_iter().enumerate().for_each(head);
        }
        return (o, lse);
    }
    // Kᵀ per head, [d, n], so that a row's dot products with the keys run along the keys.
    let kt = transpose_heads(k, n, d, work >= PARALLEL_FROM);
    let tile = |(index, (o_tile, lse_tile)): (usize, (&mut [f32], &mut [f32]))| {
        let tiles_per_head = t.div_ceil(QUERY_TILE);
        let (head, first) = (
            index / tiles_per_head,
            (index % tiles_per_head) * QUERY_TILE,
        );
        let rows = lse_tile.len();
        let j = key_head(head);
        let job = Tile {
            q: &q[(head * t + first) * d..(head * t + first + rows) * d],
            kt: &kt[j * n * d..(j + 1) * n * d],
            v: &v[j * n * d..(j + 1) * n * d],
            n,
            d,
            positions: mask_from.map(|offset| offset + first),
        };
        kernel.forward(&job, o_tile, lse_tile);
    };
    // Tiles never straddle heads: each head's rows are cut into tiles of QUERY_TILE.
    let mut tiles: Vec<(&mut [f32], &mut [f32])> =
        Vec::with_capacity(heads * t.div_ceil(QUERY_TILE));
    for (o_head, lse_head) in o.chunks_mut(t * d).zip(lse.chunks_mut(t)) {
        tiles.extend(
            o_head
                .chunks_mut(QUERY_TILE * d)
                .zip(lse_head.chunks_mut(QUERY_TILE)),
        );
    }
    if work >= PARALLEL_FROM {
        tiles.into_par_iter().enumerate().for_each(tile);
    } else {
        tiles.into_iter().enumerate().for_each(tile);
    }
    (o, lse)
}

/// At most this many query rows per head that see every key (a decode step: one row, or a
/// head group's few) go through [`Kernel::few_rows`], which reads the keys as they are stored.
const FEW_ROWS: usize = 4;

/// Keys per tile of the key-side gradient pass.
const KEY_TILE: usize = 32;

/// The gradients `(dq [b, h, t, d], dk [b, h, n, d], dv [b, h, n, d])` of causal attention
/// whose `t` query rows are the last `t` of the `n` key positions (row `r` is position
/// `n − t + r`; `t = n` is causal from position 0), for the upstream gradient `d_o`
/// `[b, h, t, d]`, given the forward's `o` and `lse` ([`attention_forward`] with
/// `Some(n − t)`). Probabilities are recomputed from `lse`, never stored (the flash-attention
/// backward):
///
/// ```text
/// P = exp(S − lse)    D_r = dO_r · O_r    dS = P ∘ (dO Vᵀ − D)
/// dQ = dS K · scale   dK = dSᵀ Q · scale  dV = Pᵀ dO
/// ```
///
/// One pass over key tiles: a tile computes `P` and `dS` once for the rows that see its keys,
/// owns its keys' `dK` and `dV`, and adds its share of `dQ` into a buffer of the thread running
/// it; the threads' buffers are summed at the end, so no two threads ever add into one row.
///
/// # Panics
/// When a slice's length is not the one `dims` gives, or `dims.t > dims.n`.
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    dims: Dims,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims { b, h, t, n, d } = dims;
    assert!(t <= n, "attention_backward: more query rows than keys");
    let offset = n - t;
    let (rows_len, keys_len) = (b * h * t * d, b * h * n * d);
    for (name, x) in [("q", q), ("o", o), ("d_o", d_o)] {
        assert_eq!(
            x.len(),
            rows_len,
            "attention_backward: {name} is not [b, h, t, d]"
        );
    }
    for (name, x) in [("k", k), ("v", v)] {
        assert_eq!(
            x.len(),
            keys_len,
            "attention_backward: {name} is not [b, h, n, d]"
        );
    }
    assert_eq!(
        lse.len(),
        b * h * t,
        "attention_backward: lse is not [b, h, t]"
    );
    let (mut dk, mut dv) = (vec![0f32; keys_len], vec![0f32; keys_len]);
    if t == 0 || d == 0 {
        return (vec![0f32; rows_len], dk, dv);
    }
    let kernel = Kernel::detect();
    let parallel = b * h * t * n >= PARALLEL_FROM;
    let delta: Vec<f32> = d_o
        .chunks_exact(d)
        .zip(o.chunks_exact(d))
        .map(|(g, y)| g.iter().zip(y).map(|(a, b)| a * b).sum())
        .collect();
    let (qt, d_ot) = (
        transpose_heads(q, t, d, parallel),
        transpose_heads(d_o, t, d, parallel),
    );
    let keys_per_head = n.div_ceil(KEY_TILE);
    let key_tile =
        |mut dq: Vec<f32>, (index, (dk_tile, dv_tile)): (usize, (&mut [f32], &mut [f32]))| {
            let (i, first) = (index / keys_per_head, (index % keys_per_head) * KEY_TILE);
            let keys = dk_tile.len() / d;
            let tile = GradKeys {
                k: &head_of(n * d, k, i)[first * d..(first + keys) * d],
                v: &head_of(n * d, v, i)[first * d..(first + keys) * d],
                q: head_of(t * d, q, i),
                d_o: head_of(t * d, d_o, i),
                qt: head_of(t * d, &qt, i),
                d_ot: head_of(t * d, &d_ot, i),
                lse: &lse[i * t..(i + 1) * t],
                delta: &delta[i * t..(i + 1) * t],
                rows: t,
                offset,
                d,
                first,
            };
            let dq_head = &mut dq[i * t * d..(i + 1) * t * d];
            kernel.key_grads(&tile, dk_tile, dv_tile, dq_head);
            dq
        };
    // Tiles never straddle heads.
    let dkv_tiles: Vec<(&mut [f32], &mut [f32])> = dk
        .chunks_mut(n * d)
        .zip(dv.chunks_mut(n * d))
        .flat_map(|(a, b)| a.chunks_mut(KEY_TILE * d).zip(b.chunks_mut(KEY_TILE * d)))
        .collect();
    let mut dq = if parallel {
        dkv_tiles
            .into_par_iter()
            .enumerate()
            // Each split of the work sums into a buffer of its own: far fewer splits than tiles.
            .with_min_len(dkv_len_per_split(b * h * keys_per_head))
            .fold(|| vec![0f32; rows_len], key_tile)
            .reduce_with(|mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            })
            .unwrap_or_else(|| vec![0f32; rows_len])
    } else {
        dkv_tiles
            .into_iter()
            .enumerate()
            .fold(vec![0f32; rows_len], key_tile)
    };
    let scale = (d as f32).powf(-0.5);
    dq.iter_mut().for_each(|x| *x *= scale);
    (dq, dk, dv)
}

/// Key tiles per split of the parallel backward: enough splits to balance two to a few dozen
/// threads, few enough that their `dQ` buffers stay a small part of the work.
fn dkv_len_per_split(tiles: usize) -> usize {
    (tiles / (4 * rayon::current_num_threads().max(1))).max(1)
}

/// Head `i`'s block of `x`, `size` floats a head.
fn head_of(size: usize, x: &[f32], i: usize) -> &[f32] {
    &x[i * size..(i + 1) * size]
}

/// Each head's `[n, d]` block of `x` transposed to `[d, n]`.
fn transpose_heads(x: &[f32], n: usize, d: usize, parallel: bool) -> Vec<f32> {
    if n == 0 || d == 0 {
        return vec![0f32; x.len()];
    }
    filled(x.len(), n * d, parallel, |h, xth| {
        let xh = &x[h * n * d..][..n * d];
        for (j, row) in xh.chunks_exact(d).enumerate() {
            for (c, &e) in row.iter().enumerate() {
                xth[c * n + j] = e;
            }
        }
    })
}

/// One query tile's inputs: its rows of `q` (`[rows, d]`), its head's `Kᵀ` (`[d, n]`) and `V`
/// (`[n, d]`), and the position of its first row when causal.
struct Tile<'a> {
    q: &'a [f32],
    kt: &'a [f32],
    v: &'a [f32],
    n: usize,
    d: usize,
    positions: Option<usize>,
}

/// A key tile of the backward: its keys' rows of `K` and `V` (`[keys, d]`), its head's `Q` and
/// `dO` (`[rows, d]`), `Qᵀ` and `dOᵀ` (`[d, rows]`), every row's `lse` and `D`; key `j` is
/// position `first + j`, and query row `r` is position `offset + r`.
struct GradKeys<'a> {
    k: &'a [f32],
    v: &'a [f32],
    q: &'a [f32],
    d_o: &'a [f32],
    qt: &'a [f32],
    d_ot: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
    rows: usize,
    offset: usize,
    d: usize,
    first: usize,
}

/// Which compilation of the kernel this CPU runs.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    /// The baseline target's instructions.
    Portable,
    /// AVX2 with fused multiply-add.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

impl Kernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Kernel::Avx2Fma;
        }
        Kernel::Portable
    }

    fn forward(self, tile: &Tile<'_>, o: &mut [f32], lse: &mut [f32]) {
        match key_block(tile.d) {
            1024 => self.forward_in::<1024>(tile, o, lse),
            512 => self.forward_in::<512>(tile, o, lse),
            _ => self.forward_in::<256>(tile, o, lse),
        }
    }

    fn forward_in<const KB: usize>(self, tile: &Tile<'_>, o: &mut [f32], lse: &mut [f32]) {
        match self {
            Kernel::Portable => forward_kernel::<false, KB>(tile, o, lse),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` chose this variant only after the CPU reported AVX2 and FMA.
            Kernel::Avx2Fma => unsafe { avx2_fma::forward::<KB>(tile, o, lse) },
        }
    }

    fn few_rows(self, q: &[f32], k: &[f32], v: &[f32], d: usize, o: &mut [f32], lse: &mut [f32]) {
        match self {
            Kernel::Portable => few_rows_kernel::<false>(q, k, v, d, o, lse),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `forward`.
            Kernel::Avx2Fma => unsafe { avx2_fma::few_rows(q, k, v, d, o, lse) },
        }
    }

    fn key_grads(self, tile: &GradKeys<'_>, dk: &mut [f32], dv: &mut [f32], dq: &mut [f32]) {
        match self {
            Kernel::Portable => key_grad_kernel::<false>(tile, dk, dv, dq),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `forward`.
            Kernel::Avx2Fma => unsafe { avx2_fma::key_grads(tile, dk, dv, dq) },
        }
    }
}

/// The kernels compiled for AVX2 with FMA; callers check the CPU first.
#[cfg(target_arch = "x86_64")]
mod avx2_fma {
    use super::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn forward<const KB: usize>(tile: &Tile<'_>, o: &mut [f32], lse: &mut [f32]) {
        forward_kernel::<true, KB>(tile, o, lse)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn few_rows(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        d: usize,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        few_rows_kernel::<true>(q, k, v, d, o, lse)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn key_grads(
        tile: &GradKeys<'_>,
        dk: &mut [f32],
        dv: &mut [f32],
        dq: &mut [f32],
    ) {
        key_grad_kernel::<true>(tile, dk, dv, dq)
    }
}

/// `a · b + c`, fused where the kernel was compiled with FMA (one rounding), else two
/// roundings; `mul_add` without the instruction would be a libm call.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Query rows whose weights go through `V` together: each value row loaded is used four times.
const ROW_GROUP: usize = 4;

/// The online-softmax forward of one tile, its rows written to `o [rows, d]` and `lse [rows]`.
#[inline(always)]
fn forward_kernel<const FMA: bool, const KB: usize>(
    tile: &Tile<'_>,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (n, d) = (tile.n, tile.d);
    let rows = lse.len();
    // Scores in base 2, `q·k / √d · log₂e`, so that each weight `e^(s − m)` is `2^(s₂ − m₂)`:
    // the exponential then needs no `ln 2` range reduction (two multiply-adds fewer per score;
    // 0.94 of the forward's time). The output is the same softmax; `lse` goes back to base e.
    let scale = (d as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0f32; rows];
    // Keys per block: `key_block(d)`, a constant here.
    let kb = KB;
    let mut scores = vec![0f32; ROW_GROUP * kb];
    // The group's queries times `scale`, `[ROW_GROUP, d]`.
    let mut scaled = vec![0f32; ROW_GROUP * d];
    o.fill(0.0);
    // The keys row `r` sees in the block from `block`: up to its position, or all.
    let end = |r: usize, block: usize| match tile.positions {
        Some(first) => (first + r + 1).min(block + kb),
        None => (block + kb).min(n),
    };
    let keys = tile.positions.map_or(n, |first| first + rows);
    for block in (0..keys).step_by(kb) {
        for group in (0..rows).step_by(ROW_GROUP) {
            let members = (rows - group).min(ROW_GROUP);
            // Rows are in position order, so the group's last row sees the most keys.
            let width = end(group + members - 1, block).saturating_sub(block);
            if width == 0 {
                continue;
            }
            let scale_row = |scaled: &mut [f32], r: usize| {
                for (x, &qc) in scaled.iter_mut().zip(&tile.q[r * d..(r + 1) * d]) {
                    *x = qc * scale;
                }
            };
            // A full group's scores over the block's `width` keys come at once, each key row of
            // `Kᵀ` loaded once for the four queries; a row's scores are the same multiply-adds
            // in the same order either way.
            let full = members == ROW_GROUP;
            if full {
                for (g, x) in scaled.chunks_exact_mut(d).enumerate() {
                    scale_row(x, group + g);
                }
                dot_group::<FMA>(&scaled, tile.kt, n, block, width, &mut scores, kb);
            }
            for (g, s) in scores.chunks_exact_mut(kb).take(members).enumerate() {
                let r = group + g;
                let s = &mut s[..width];
                let own = end(r, block).saturating_sub(block);
                if !full {
                    scale_row(&mut scaled[..d], r);
                    dot_rows::<FMA>(&scaled[..d], tile.kt, n, block, &mut s[..own]);
                }
                // Keys past the row's position weigh exactly 0 (a multiply-add of 0 leaves the
                // sum as it is), so the row's result is the same in any group.
                s[own..].fill(0.0);
                if own == 0 {
                    continue;
                }
                let s = &mut s[..own];
                let m_new = max[r].max(slice_max(s));
                let rescale = (max[r] - m_new).exp2();
                if rescale != 1.0 {
                    for a in &mut o[r * d..(r + 1) * d] {
                        *a *= rescale;
                    }
                }
                let block_sum = exp2_shifted::<FMA>(s, m_new);
                sum[r] = madd::<FMA>(sum[r], rescale, block_sum);
                max[r] = m_new;
            }
            let acc = &mut o[group * d..(group + members) * d];
            let values = &tile.v[block * d..];
            weigh_group::<FMA>(&scores, kb, values, width, d, members, acc);
        }
    }
    for r in 0..rows {
        let inv = 1.0 / sum[r];
        for a in &mut o[r * d..(r + 1) * d] {
            *a *= inv;
        }
        lse[r] = (max[r] + sum[r].log2()) * std::f32::consts::LN_2;
    }
}

/// A few query rows `q [t, d]` of one head against all of its keys `k` and values `v [n, d]`,
/// stored as they are: each score is a dot product along `d` in eight lanes, then the row's
/// weights in base 2 as in [`forward_kernel`], all `n` of them at once (no mask, so no blocks),
/// and their sum over `V`. Writes `o [t, d]` and `lse [t]`.
#[inline(always)]
fn few_rows_kernel<const FMA: bool>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let n = k.len() / d;
    let scale = (d as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let mut scores = vec![0f32; n];
    let mut scaled = vec![0f32; d];
    for (r, (o_row, lse_r)) in o.chunks_exact_mut(d).zip(lse.iter_mut()).enumerate() {
        for (x, &qc) in scaled.iter_mut().zip(&q[r * d..(r + 1) * d]) {
            *x = qc * scale;
        }
        for (s, key) in scores.iter_mut().zip(k.chunks_exact(d)) {
            *s = dot_lanes::<FMA>(&scaled, key);
        }
        let m = slice_max(&scores);
        let sum = exp2_shifted::<FMA>(&mut scores, m);
        o_row.fill(0.0);
        weigh_values::<FMA, 1>(&scores, n, v, n, d, o_row);
        let inv = 1.0 / sum;
        for a in o_row.iter_mut() {
            *a *= inv;
        }
        *lse_r = (m + sum.log2()) * std::f32::consts::LN_2;
    }
}

/// `a · b` summed in eight lanes (so the compiler vectorises it), then the lanes in order.
#[inline(always)]
fn dot_lanes<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut pairs = a.chunks_exact(8).zip(b.chunks_exact(8));
    for (x, y) in &mut pairs {
        for l in 0..8 {
            lanes[l] = madd::<FMA>(x[l], y[l], lanes[l]);
        }
    }
    let whole = a.len() - a.len() % 8;
    let mut total = lanes.iter().sum::<f32>();
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        total = madd::<FMA>(*x, *y, total);
    }
    total
}

/// The gradients one key tile gives: for each block of rows that see its keys, each key's
/// probabilities over those rows and `dS`, then `dV += Pᵀ dO` and `dK += dSᵀ Q` for four keys
/// at a time, and the block's rows `dQ += dS K` (unscaled: the caller scales the sum of every
/// tile's share) into `dq [rows, d]`. Rows before a key's position weigh 0. Blocks are walked by
/// position; a row's index in the tile's slices is its position less `offset`.
#[inline(always)]
fn key_grad_kernel<const FMA: bool>(
    tile: &GradKeys<'_>,
    dk: &mut [f32],
    dv: &mut [f32],
    dq: &mut [f32],
) {
    let (rows, offset, d, first) = (tile.rows, tile.offset, tile.d, tile.first);
    let end = offset + rows;
    let keys = dk.len() / d;
    let scale = (d as f32).powf(-0.5);
    let mut probs = vec![0f32; ROW_GROUP * ROW_BLOCK];
    let mut grads = vec![0f32; ROW_GROUP * ROW_BLOCK];
    let mut dp = vec![0f32; ROW_BLOCK];
    let mut scaled = vec![0f32; d];
    // The block's dS by row: [ROW_BLOCK rows, KEY_TILE keys].
    let mut ds_rows = vec![0f32; ROW_BLOCK * KEY_TILE];
    dk.fill(0.0);
    dv.fill(0.0);
    for block in (first.max(offset)..end).step_by(ROW_BLOCK) {
        let width = (block + ROW_BLOCK).min(end) - block;
        let local = block - offset;
        let (lse, delta) = (
            &tile.lse[local..local + width],
            &tile.delta[local..local + width],
        );
        for group in (0..keys).step_by(ROW_GROUP) {
            let members = (keys - group).min(ROW_GROUP);
            let groups = probs
                .chunks_exact_mut(ROW_BLOCK)
                .zip(grads.chunks_exact_mut(ROW_BLOCK));
            for (g, (p, ds)) in groups.take(members).enumerate() {
                let j = group + g;
                // Rows before the key's position do not see it.
                let skip = (first + j).saturating_sub(block).min(width);
                let (p, ds) = (&mut p[..width], &mut ds[..width]);
                for (x, &kc) in scaled.iter_mut().zip(&tile.k[j * d..(j + 1) * d]) {
                    *x = kc * scale;
                }
                dot_rows::<FMA>(&scaled, tile.qt, rows, local, p);
                dot_rows::<FMA>(
                    &tile.v[j * d..(j + 1) * d],
                    tile.d_ot,
                    rows,
                    local,
                    &mut dp[..width],
                );
                for r in 0..width {
                    let pr = exp_nonpositive::<FMA>(p[r] - lse[r]);
                    p[r] = pr;
                    ds[r] = pr * (dp[r] - delta[r]);
                }
                p[..skip].fill(0.0);
                ds[..skip].fill(0.0);
                for (r, &x) in ds.iter().enumerate() {
                    ds_rows[r * KEY_TILE + j] = x;
                }
            }
            let (dv_acc, dk_acc) = (
                &mut dv[group * d..(group + members) * d],
                &mut dk[group * d..(group + members) * d],
            );
            let (d_o, q) = (&tile.d_o[local * d..], &tile.q[local * d..]);
            weigh_group::<FMA>(&probs, ROW_BLOCK, d_o, width, d, members, dv_acc);
            weigh_group::<FMA>(&grads, ROW_BLOCK, q, width, d, members, dk_acc);
        }
        // dQ of the block's rows over this tile's keys, four rows at a time.
        let dq_rows = &mut dq[local * d..(local + width) * d];
        for (g, acc) in dq_rows.chunks_mut(ROW_GROUP * d).enumerate() {
            let members = acc.len() / d;
            let weights = &ds_rows[g * ROW_GROUP * KEY_TILE..];
            weigh_group::<FMA>(weights, KEY_TILE, tile.k, keys, d, members, acc);
        }
    }
    for x in dk.iter_mut() {
        *x *= scale;
    }
}

/// [`weigh_values`] for `members` rows of `p [ROW_GROUP, stride]`: four at once when the
/// group is full, one by one otherwise.
#[inline(always)]
fn weigh_group<const FMA: bool>(
    p: &[f32],
    stride: usize,
    v: &[f32],
    width: usize,
    d: usize,
    members: usize,
    acc: &mut [f32],
) {
    if members == ROW_GROUP {
        weigh_values::<FMA, ROW_GROUP>(p, stride, v, width, d, acc);
    } else {
        for (g, a) in acc.chunks_exact_mut(d).take(members).enumerate() {
            weigh_values::<FMA, 1>(&p[g * stride..], stride, v, width, d, a);
        }
    }
}

/// `s[j] = q · k_{first + j}` for the keys of `kt [d, n]` (transposed). Sixty-four keys at a
/// time stay in registers while the dimensions stream by: eight independent sums, each key
/// row of `Kᵀ` read once, `s` written once.
#[inline(always)]
fn dot_rows<const FMA: bool>(q: &[f32], kt: &[f32], n: usize, first: usize, s: &mut [f32]) {
    const W: usize = 64;
    let len = s.len();
    let whole = len - len % W;
    for j in (0..whole).step_by(W) {
        let mut regs = [0f32; W];
        for (c, &qc) in q.iter().enumerate() {
            let keys: &[f32; W] = kt[c * n + first + j..c * n + first + j + W]
                .try_into()
                .expect("W floats");
            for l in 0..W {
                regs[l] = madd::<FMA>(qc, keys[l], regs[l]);
            }
        }
        s[j..j + W].copy_from_slice(&regs);
    }
    let tail = &mut s[whole..];
    tail.fill(0.0);
    for (c, &qc) in q.iter().enumerate() {
        let keys = &kt[c * n + first + whole..c * n + first + len];
        for (x, &kj) in tail.iter_mut().zip(keys) {
            *x = madd::<FMA>(qc, kj, *x);
        }
    }
}

/// [`dot_rows`] for a group of rows: `s[g · stride + j] = q_g · k_{first + j}` for
/// `q [ROW_GROUP, d]` and `j < width`. Sixteen keys of the group's four rows stay in registers
/// (eight sums) while the dimensions stream by, each row's sums in the order [`dot_rows`] makes
/// them; wider, they spill (measured: 32 keys took five times as long).
#[inline(always)]
fn dot_group<const FMA: bool>(
    q: &[f32],
    kt: &[f32],
    n: usize,
    first: usize,
    width: usize,
    s: &mut [f32],
    stride: usize,
) {
    const W: usize = 16;
    let d = q.len() / ROW_GROUP;
    let whole = width - width % W;
    for j in (0..whole).step_by(W) {
        let mut regs = [[0f32; W]; ROW_GROUP];
        for c in 0..d {
            let keys: &[f32; W] = kt[c * n + first + j..c * n + first + j + W]
                .try_into()
                .expect("W floats");
            for (g, reg) in regs.iter_mut().enumerate() {
                let qc = q[g * d + c];
                for l in 0..W {
                    reg[l] = madd::<FMA>(qc, keys[l], reg[l]);
                }
            }
        }
        for (g, reg) in regs.iter().enumerate() {
            s[g * stride + j..g * stride + j + W].copy_from_slice(reg);
        }
    }
    for g in 0..ROW_GROUP {
        let tail = &mut s[g * stride + whole..g * stride + width];
        tail.fill(0.0);
        for c in 0..d {
            let qc = q[g * d + c];
            let keys = &kt[c * n + first + whole..c * n + first + width];
            for (x, &kj) in tail.iter_mut().zip(keys) {
                *x = madd::<FMA>(qc, kj, *x);
            }
        }
    }
}

/// `acc_g += Σ_j p_g[j] v_j` for `G` rows at once: `p [G, stride]` holds each row's weights
/// (`width` used), `v [.., d]` the values from the block's first key, `acc [G, d]` the rows'
/// accumulators. Sixteen dimensions at a time stay in registers while the keys stream by, so
/// each row's sums form independent chains and each value row is loaded once for `G` rows.
#[inline(always)]
fn weigh_values<const FMA: bool, const G: usize>(
    p: &[f32],
    stride: usize,
    v: &[f32],
    width: usize,
    d: usize,
    acc: &mut [f32],
) {
    const W: usize = 16;
    let weights: [&[f32]; G] = std::array::from_fn(|g| &p[g * stride..g * stride + width]);
    let whole = d - d % W;
    for c in (0..whole).step_by(W) {
        let mut regs = [[0f32; W]; G];
        for (g, reg) in regs.iter_mut().enumerate() {
            reg.copy_from_slice(&acc[g * d + c..g * d + c + W]);
        }
        for j in 0..width {
            let vj: &[f32; W] = v[j * d + c..j * d + c + W].try_into().expect("W floats");
            for (reg, w) in regs.iter_mut().zip(&weights) {
                let pj = w[j];
                for l in 0..W {
                    reg[l] = madd::<FMA>(pj, vj[l], reg[l]);
                }
            }
        }
        for (g, reg) in regs.iter().enumerate() {
            acc[g * d + c..g * d + c + W].copy_from_slice(reg);
        }
    }
    for c in whole..d {
        for (g, w) in weights.iter().enumerate() {
            let mut x = acc[g * d + c];
            for (j, &pj) in w.iter().enumerate() {
                x = madd::<FMA>(pj, v[j * d + c], x);
            }
            acc[g * d + c] = x;
        }
    }
}

/// The largest element (`-inf` for none), eight running lanes so the compiler can vectorise
/// (a float reduction in one accumulator would have to keep its order).
#[inline(always)]
fn slice_max(s: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = s.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let mut m = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &x in chunks.remainder() {
        m = m.max(x);
    }
    m
}

/// Replaces each `s_j` with `2^(s_j − m)` (every `s_j ≤ m`) and returns their sum, summed in
/// sixteen lanes (two independent polynomial chains per step).
#[inline(always)]
fn exp2_shifted<const FMA: bool>(s: &mut [f32], m: f32) -> f32 {
    const W: usize = 16;
    let mut lanes = [0f32; W];
    let mut chunks = s.chunks_exact_mut(W);
    for chunk in &mut chunks {
        for (lane, x) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *x = exp2_nonpositive::<FMA>(*x - m);
            *lane += *x;
        }
    }
    let mut total: f32 = lanes.iter().sum();
    for x in chunks.into_remainder() {
        *x = exp2_nonpositive::<FMA>(*x - m);
        total += *x;
    }
    total
}

/// 1.5 · 2²³: adding it rounds a float below 2²² to an integer held in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// `p · 2ⁿ` for `shifted = n + ROUND` (`n` an integer from −126 to 0): the low bits of
/// `shifted` hold `n` over `ROUND`'s mantissa, and `n + 127` is the biased exponent of `2ⁿ`.
#[inline(always)]
fn times_pow2(p: f32, shifted: f32) -> f32 {
    let n_bits = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    p * f32::from_bits(((n_bits + 127) as u32) << 23)
}

/// `e^x` for `x ≤ 0`, within 2 ulp, in arithmetic the compiler vectorises (libm's `expf` is a
/// call per element). `x = n ln 2 + f` with `n` rounded to nearest, so `|f| ≤ ln 2 / 2`; `e^f`
/// is a polynomial of degree 6 there (one multiply-add fewer than the Taylor series of degree 7
/// that the same accuracy would need), and `2ⁿ` is built in the exponent bits. Inputs below
/// −87 (where `2ⁿ` would leave the normal range) give `e^−87 ≈ 1.6e−38`, a weight no softmax row
/// can notice against its maximum's 1. The backward's probabilities use it.
#[inline(always)]
pub fn exp_nonpositive<const FMA: bool>(x: f32) -> f32 {
    // ln 2 split so that `n · LN2_HI` is exact for every `n` here (its 9 significant bits).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -87.0 { -87.0 } else { x };
    let shifted = madd::<FMA>(x, std::f32::consts::LOG2_E, ROUND);
    let n = shifted - ROUND;
    let f = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, x));
    // Degree 6, interpolating e^f at the 7 Chebyshev nodes of [−ln 2 / 2, ln 2 / 2]: 2.5e-9
    // from e^f there in exact arithmetic (Taylor to the same degree: 1.7e-7), so the f32
    // rounding of the evaluation is what is left.
    let mut p = 0.001_394_110_8;
    for c in [0.008_375_126, 0.041_666_35, 0.166_664_15, 0.5, 1.0, 1.0] {
        p = madd::<FMA>(p, f, c);
    }
    times_pow2(p, shifted)
}

/// `2^x` for `x ≤ 0`, as [`exp_nonpositive`] without the `ln 2` reduction: `x = n + f` with `n`
/// rounded to nearest, so `|f| ≤ 1/2`, and `2^f` is a polynomial of degree 6 interpolating it at
/// the 7 Chebyshev nodes of [−1/2, 1/2] (1.9e-8 from `2^f` there with these f32
/// coefficients). Inputs below −125 give `2^−125`. The forward's weights use it.
#[inline(always)]
pub fn exp2_nonpositive<const FMA: bool>(x: f32) -> f32 {
    let x = if x < -125.0 { -125.0 } else { x };
    let shifted = x + ROUND;
    let f = x - (shifted - ROUND);
    let mut p = 0.000_154_614_45;
    for c in [
        0.001_340_042_8,
        0.009_618_057,
        0.055_503_27,
        0.240_226_5,
        std::f32::consts::LN_2,
        1.0,
    ] {
        p = madd::<FMA>(p, f, c);
    }
    times_pow2(p, shifted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The softmax-weighted sum written out in f64 with a full score row, for comparison.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dims: Dims,
        mask_from: Option<usize>,
    ) -> (Vec<f64>, Vec<f64>) {
        let Dims { b, h, t, n, d } = dims;
        let mut o = vec![0f64; b * h * t * d];
        let mut lse = vec![0f64; b * h * t];
        for head in 0..b * h {
            for r in 0..t {
                let keys = mask_from.map_or(n, |offset| offset + r + 1);
                let qr = &q[(head * t + r) * d..(head * t + r + 1) * d];
                let s: Vec<f64> = (0..keys)
                    .map(|j| {
                        let kj = &k[(head * n + j) * d..(head * n + j + 1) * d];
                        qr.iter()
                            .zip(kj)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, x) in s.iter().enumerate() {
                    let p = (x - m).exp() / l;
                    for c in 0..d {
                        o[(head * t + r) * d + c] += p * v[(head * n + j) * d + c] as f64;
                    }
                }
                lse[head * t + r] = m + l.ln();
            }
        }
        (o, lse)
    }

    fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn worst_error(got: &[f32], want: &[f64]) -> f64 {
        got.iter()
            .zip(want)
            .map(|(&g, &w)| (g as f64 - w).abs() / (1.0 + w.abs()))
            .fold(0.0, f64::max)
    }

    /// Causal from 0, causal from an offset (a prefill after cached keys), and unmasked (a
    /// decode step), over shapes that leave partial key blocks, query tiles and dimension quads.
    #[test]
    fn matches_the_full_softmax_in_every_mode() {
        let cases = [
            (
                Dims {
                    b: 1,
                    h: 2,
                    t: 300,
                    n: 300,
                    d: 16,
                },
                Some(0),
            ),
            (
                Dims {
                    b: 2,
                    h: 3,
                    t: 45,
                    n: 600,
                    d: 7,
                },
                Some(555),
            ),
            (
                Dims {
                    b: 1,
                    h: 4,
                    t: 2,
                    n: 521,
                    d: 64,
                },
                None,
            ),
            (
                Dims {
                    b: 1,
                    h: 1,
                    t: 1,
                    n: 1,
                    d: 5,
                },
                Some(0),
            ),
            // Unmasked with more rows than `FEW_ROWS`: the blocked kernel, not `few_rows`.
            (
                Dims {
                    b: 1,
                    h: 2,
                    t: FEW_ROWS + 5,
                    n: 1100,
                    d: 16,
                },
                None,
            ),
            // `few_rows` with a head width that is not a multiple of its eight lanes.
            (
                Dims {
                    b: 2,
                    h: 2,
                    t: 3,
                    n: 77,
                    d: 13,
                },
                None,
            ),
        ];
        for (i, (dims, mask_from)) in cases.into_iter().enumerate() {
            let Dims { b, h, t, n, d } = dims;
            let q = pseudo_random(b * h * t * d, 3 * i as u64 + 1);
            let k = pseudo_random(b * h * n * d, 3 * i as u64 + 2);
            let v = pseudo_random(b * h * n * d, 3 * i as u64 + 3);
            let (o, lse) = attention_forward(&q, &k, &v, dims, mask_from);
            let (want_o, want_lse) = reference(&q, &k, &v, dims, mask_from);
            assert!(
                worst_error(&o, &want_o) < 2e-6,
                "case {i}: o off by {}",
                worst_error(&o, &want_o)
            );
            assert!(
                worst_error(&lse, &want_lse) < 2e-6,
                "case {i}: lse off by {}",
                worst_error(&lse, &want_lse)
            );
        }
    }

    /// Shared key heads (grouped-query attention) give exactly what the same keys repeated to
    /// every query head give, causal and unmasked, over two batch rows.
    #[test]
    fn shared_key_heads_equal_repeated_ones() {
        let (b, h, kv, n, d) = (2, 6, 2, 140, 16);
        let k = pseudo_random(b * kv * n * d, 21);
        let v = pseudo_random(b * kv * n * d, 22);
        // Head i of each batch row is a copy of key head i / (h / kv).
        let repeat = |x: &[f32]| -> Vec<f32> {
            (0..b * h)
                .flat_map(|i| {
                    let j = (i / h) * kv + (i % h) / (h / kv);
                    x[j * n * d..(j + 1) * n * d].to_vec()
                })
                .collect()
        };
        for (t, mask_from) in [(100, Some(40)), (2, None), (20, None)] {
            let dims = Dims { b, h, t, n, d };
            let q = pseudo_random(b * h * t * d, 23 + t as u64);
            let shared = attention_forward(&q, &k, &v, dims, mask_from);
            let repeated = attention_forward(&q, &repeat(&k), &repeat(&v), dims, mask_from);
            assert_eq!(shared, repeated, "{t} rows, mask {mask_from:?}");
        }
    }

    /// A prompt's last rows computed alone against the same keys (a prefix-cache hit) are
    /// bit-identical to the same rows of the whole prompt's call.
    #[test]
    fn rows_do_not_depend_on_how_the_prompt_was_split() {
        let (h, n, d) = (2, 700, 16);
        let q = pseudo_random(h * n * d, 11);
        let k = pseudo_random(h * n * d, 12);
        let v = pseudo_random(h * n * d, 13);
        let whole = attention_forward(
            &q,
            &k,
            &v,
            Dims {
                b: 1,
                h,
                t: n,
                n,
                d,
            },
            Some(0),
        )
        .0;
        let from = 517;
        let tail_q: Vec<f32> = (0..h)
            .flat_map(|head| q[(head * n + from) * d..(head + 1) * n * d].to_vec())
            .collect();
        let tail = attention_forward(
            &tail_q,
            &k,
            &v,
            Dims {
                b: 1,
                h,
                t: n - from,
                n,
                d,
            },
            Some(from),
        )
        .0;
        for head in 0..h {
            assert_eq!(
                &tail[head * (n - from) * d..(head + 1) * (n - from) * d],
                &whole[(head * n + from) * d..(head + 1) * n * d],
                "head {head}"
            );
        }
    }

    /// The gradients of the causal attention in f64 with full matrices: `(dq, dk, dv)` for the
    /// upstream gradient `d_o`, query row `r` at position `n − t + r`.
    fn reference_grads(q: &[f32], k: &[f32], v: &[f32], d_o: &[f32], dims: Dims) -> [Vec<f64>; 3] {
        let Dims { b, h, t, n, d } = dims;
        let offset = n - t;
        let scale = 1.0 / (d as f64).sqrt();
        let at = |x: &[f32], i: usize| x[i] as f64;
        let (mut dq, mut dk, mut dv) = (
            vec![0f64; q.len()],
            vec![0f64; k.len()],
            vec![0f64; k.len()],
        );
        for head in 0..b * h {
            let row = |r: usize| head * t + r;
            let key = |j: usize| head * n + j;
            for r in 0..t {
                let seen = offset + r;
                let s: Vec<f64> = (0..=seen)
                    .map(|j| {
                        (0..d)
                            .map(|c| at(q, row(r) * d + c) * at(k, key(j) * d + c))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / l).collect();
                let o: Vec<f64> = (0..d)
                    .map(|c| (0..=seen).map(|j| p[j] * at(v, key(j) * d + c)).sum())
                    .collect();
                let delta: f64 = (0..d).map(|c| at(d_o, row(r) * d + c) * o[c]).sum();
                for j in 0..=seen {
                    let dp: f64 = (0..d)
                        .map(|c| at(d_o, row(r) * d + c) * at(v, key(j) * d + c))
                        .sum();
                    let ds = p[j] * (dp - delta);
                    for c in 0..d {
                        dv[key(j) * d + c] += p[j] * at(d_o, row(r) * d + c);
                        dq[row(r) * d + c] += ds * at(k, key(j) * d + c) * scale;
                        dk[key(j) * d + c] += ds * at(q, row(r) * d + c) * scale;
                    }
                }
            }
        }
        [dq, dk, dv]
    }

    /// The backward's three gradients against full matrices in f64, over shapes that leave
    /// partial key blocks, key tiles, query tiles, row groups and dimension groups, causal from
    /// position 0 and with queries that continue earlier keys (a packed row after its prefix).
    #[test]
    fn the_backward_matches_full_matrices() {
        for (i, dims) in [
            Dims {
                b: 1,
                h: 2,
                t: 300,
                n: 300,
                d: 16,
            },
            Dims {
                b: 2,
                h: 1,
                t: 37,
                n: 37,
                d: 20,
            },
            Dims {
                b: 1,
                h: 1,
                t: 1,
                n: 1,
                d: 3,
            },
            Dims {
                b: 2,
                h: 2,
                t: 45,
                n: 330,
                d: 16,
            },
            Dims {
                b: 1,
                h: 1,
                t: 3,
                n: 40,
                d: 8,
            },
        ]
        .into_iter()
        .enumerate()
        {
            let rows = dims.b * dims.h * dims.t * dims.d;
            let keys = dims.b * dims.h * dims.n * dims.d;
            let seed = |s: u64| 10 * i as u64 + s;
            let (q, d_o) = (pseudo_random(rows, seed(1)), pseudo_random(rows, seed(4)));
            let (k, v) = (pseudo_random(keys, seed(2)), pseudo_random(keys, seed(3)));
            let (o, lse) = attention_forward(&q, &k, &v, dims, Some(dims.n - dims.t));
            let got = attention_backward(&q, &k, &v, &o, &lse, &d_o, dims);
            let want = reference_grads(&q, &k, &v, &d_o, dims);
            for (name, g, w) in [
                ("dq", &got.0, &want[0]),
                ("dk", &got.1, &want[1]),
                ("dv", &got.2, &want[2]),
            ] {
                let e = worst_error(g, w);
                assert!(e < 1e-5, "case {i}: {name} off by {e}");
            }
        }
    }

    /// The polynomial exponentials against libm's over their whole domains.
    #[test]
    fn the_exponentials_are_within_two_point_five_e_minus_7() {
        // Both variants of `ours` against `reference` from 0 down to `lowest`, relative error.
        fn check(name: &str, ours: [fn(f32) -> f32; 2], reference: fn(f64) -> f64, lowest: f32) {
            let mut x = 0.0f32;
            while x > lowest {
                let want = reference(x as f64);
                for got in ours.map(|f| f(x)) {
                    let error = ((got as f64 - want) / want).abs();
                    assert!(error < 2.5e-7, "{name}({x}): {got} vs {want}");
                }
                x -= 0.0123;
            }
            for f in ours {
                assert_eq!(f(0.0), 1.0, "{name}(0)");
            }
            assert!(ours[0](f32::NEG_INFINITY) < 1e-37, "{name}(-inf)");
        }
        check(
            "exp",
            [exp_nonpositive::<false>, exp_nonpositive::<true>],
            f64::exp,
            -87.0,
        );
        check(
            "exp2",
            [exp2_nonpositive::<false>, exp2_nonpositive::<true>],
            f64::exp2,
            -125.0,
        );
    }
}
