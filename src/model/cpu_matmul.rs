//! The CPU backend's matrix products ([`product`]). Most go to the GEMM (the `gemm` crate,
//! which Burn's CPU backend also calls), written straight into their output ([`gemm_times`]).
//! Products of a few rows by a weight have kernels of their own: a decode step's `x [m, k] · W`
//! (one row per sequence in the batch) or a short prefill's, up to [`MAX_ROWS`] rows, where `W`
//! is a linear layer's `[k, n]` (row-major) or the tied LM head's `embedᵀ` (the `[n, k]`
//! embedding read transposed).
//!
//! The general GEMM (the `gemm` crate, through Burn's CPU backend) serves these shapes poorly:
//! it packs the whole weight before multiplying a handful of rows by it, reads the transposed
//! head column by column, and runs products under about 7 M multiply-adds (every attention
//! projection of a decode step) on one thread. A decode step's products only need the weight
//! streamed once, at memory speed, on every core:
//!
//! - **Row-major `W`** ([`rows_times`]): `R ≤ 16` rows of `x` (interleaved so that one load
//!   feeds all `R`) times `16 · C` columns of `W`, `R · C` accumulators of 16 lanes in
//!   registers; more rows go through in groups while the weight's tile is in cache.
//!   The rows of `W` are taken in blocks of [`K_BLOCK`]; within a block every column panel is
//!   done before the next block starts, so each of the block's rows is read front to back, a
//!   few sequential streams; a narrow tile asks for the weight of the panel after next as it
//!   goes (walking one narrow panel down all `k` rows instead touches a new page every row and
//!   stalls on memory). Between blocks the accumulators wait in the output.
//! - **Transposed `W`** ([`rows_dot`]): each output is a dot product of a row of `x` with a
//!   contiguous row of the embedding; two embedding rows and eight rows of `x` at a time,
//!   sixteen lanes each, summed across lanes at the end.
//!
//! Columns (or embedding rows) are split in contiguous ranges across the rayon pool when the
//! weight holds at least [`PARALLEL_FROM`] elements. [`adapter_delta`] runs a mixed batch's
//! low-rank adapters through the row-major kernel (or, without AVX-512, the GEMM), each adapter
//! over its own rows.
//!
//! Each output sums its `k` products in an order that depends on `k` alone (row-major: one
//! fused multiply-add chain from `k = 0` up; transposed: sixteen lanes, or eight, then a fixed
//! tree), so a row's result does not depend on the other rows, the batch size or the thread
//! count. It is not the GEMM's order: a decode step and a prefill of the same tokens agree to
//! rounding, as they did before (the GEMM has its own path for one row).
//!
//! Both kernels use AVX-512 where the CPU has it. On a CPU with AVX2 and FMA but not AVX-512,
//! only the transposed kernel runs ([`rows_dot8`]: eight lanes, three rows of the weight by four
//! rows of `x` per tile): a row-major kernel of eight lanes lost to the GEMM there, because a
//! block of `W`'s rows is that many read streams, while a transposed `W` is read front to back
//! in one. The generation engine's weights are therefore kept `[out, in]` on such CPUs
//! ([`transposed_weights_decode_faster`], `LinearLayout::decoding`). Elsewhere, and for more
//! than [`MAX_ROWS`] rows, the product goes to the GEMM.

// The kernels exist for x86-64 only; elsewhere every product stays with the GEMM.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use burn::tensor::{DType, Shape, Tensor, TensorData, TensorPrimitive};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::CpuBackend;

/// The most rows of `x` these kernels take; more go to the GEMM. Prefilling a prompt of `m`
/// tokens of the 20 M-parameter shape with them against without (interleaved, two runs):
/// 17 tokens 1.37–1.44× the tokens/s, 32 tokens 1.16–1.22×, 40 tokens 1.02–1.08×, 48 tokens
/// 0.97–1.01×.
pub const MAX_ROWS: usize = 40;

/// Rows of `W` per block of the row-major kernel.
const K_BLOCK: usize = 32;

/// Weights with fewer elements run on the calling thread: handing a product of 256 K
/// multiply-adds to the pool costs about what the second core saves.
const PARALLEL_FROM: usize = 1 << 18;

/// How the right-hand operand lies in memory.
#[derive(Clone, Copy)]
pub enum Rhs<'a> {
    /// `W [k, n]`, row `i` at `w[i · ld ..]`.
    RowMajor { w: &'a [f32], ld: usize },
    /// `W = Eᵀ` for `E [n, k]`, row `j` of `E` at `w[j · ld ..]`.
    Transposed { w: &'a [f32], ld: usize },
}

/// `x [m, k] · W [k, n]` for a CPU tensor pair: up to [`MAX_ROWS`] rows through this module's
/// kernels when the CPU has AVX-512 and `W` lies as one of [`Rhs`]'s two layouts, every other
/// product through the GEMM ([`gemm_times`]). `None` for what neither takes (not 2-d, not
/// float32, empty); the caller then runs Burn's own product.
pub fn product<const D: usize>(
    a: &Tensor<CpuBackend, D>,
    b: &Tensor<CpuBackend, D>,
) -> Option<Tensor<CpuBackend, D>> {
    if D != 2 {
        return None;
    }
    let [m, k] = [a.dims()[0], a.dims()[1]];
    let n = b.dims()[1];
    if m == 0 || k == 0 || n == 0 || b.dims()[0] != k {
        return None;
    }
    let lhs = a.clone().into_primitive().tensor();
    let rhs = b.clone().into_primitive().tensor();
    if lhs.dtype() != DType::F32 || rhs.dtype() != DType::F32 {
        return None;
    }
    let y = match few_rows(&lhs, &rhs, m, k, n) {
        Some(y) => y,
        None => gemm_times(&lhs, &rhs, m, k, n),
    };
    let y = TensorData::new(y, Shape::new([m, n]));
    let y: Tensor<CpuBackend, 2> = Tensor::from_data(y, &Default::default());
    Some(Tensor::from_primitive(TensorPrimitive::Float(
        y.into_primitive().tensor(),
    )))
}

/// [`times`] for a product of at most [`MAX_ROWS`] rows whose `W` lies as [`Rhs`] says, where
/// this CPU has a kernel for that layout; `None` otherwise.
fn few_rows(lhs: &FlexTensor, rhs: &FlexTensor, m: usize, k: usize, n: usize) -> Option<Vec<f32>> {
    if m > MAX_ROWS || kernels() == Kernels::None {
        return None;
    }
    let layout = rhs.layout();
    let (strides, start) = (layout.strides(), layout.start_offset());
    let storage = &rhs.storage::<f32>()[start..];
    let w = match (strides[0], strides[1]) {
        (ld, 1) if ld >= n as isize => Rhs::RowMajor {
            w: storage,
            ld: ld as usize,
        },
        (1, ld) if ld >= k as isize => Rhs::Transposed {
            w: storage,
            ld: ld as usize,
        },
        _ => return None,
    };
    if !kernels().takes(&w) {
        return None;
    }
    let x = super::cpu_tensor::primitive_floats(lhs.clone());
    times(&x, m, k, w, n)
}

/// Products of at least this many multiply-adds run the GEMM on the whole pool (Burn's CPU
/// backend waits until `192³`, about 7 M, which leaves a short prefill's products on one core).
const GEMM_PARALLEL_FROM: usize = 1 << 21;

/// `a [m, k] · b [k, n]` by the `gemm` crate, either operand strided (a transposed view is read
/// in place), into a new row-major buffer.
///
/// Burn's CPU backend makes the same call, but first zeroes the output on the calling thread and
/// then copies it into a second buffer to realign it (a byte vector's alignment is 1): two
/// single-threaded passes over every product's output, a tenth of a training step's time. The
/// GEMM with `read_dst = false` writes every element of its output (its first pass over the
/// inner dimension stores without loading, and `k = 0` stores zeros), so the buffer starts
/// uninitialised.
fn gemm_times(lhs: &FlexTensor, rhs: &FlexTensor, m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    // Safety: the GEMM writes all `m × n` elements of `out` (above); it reads both operands
    // within their layouts, which Burn keeps inside their buffers.
    unsafe {
        gemm_into(lhs, rhs, m, k, n, out.as_mut_ptr());
        out.set_len(m * n);
    }
    out
}

/// The GEMM call of [`gemm_times`], writing `m × n` floats row-major at `dst` without reading
/// them.
///
/// # Safety
///
/// `dst` must be valid for `m × n` writes; the operands' layouts must lie inside their buffers.
unsafe fn gemm_into(
    lhs: &FlexTensor,
    rhs: &FlexTensor,
    m: usize,
    k: usize,
    n: usize,
    dst: *mut f32,
) {
    let operand = |t: &FlexTensor| {
        let layout = t.layout();
        let strides = layout.strides();
        let ptr = t.storage::<f32>()[layout.start_offset()..].as_ptr();
        (ptr, strides[0], strides[1])
    };
    let (a, a_rs, a_cs) = operand(lhs);
    let (b, b_rs, b_cs) = operand(rhs);
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= GEMM_PARALLEL_FROM {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // Safety: as the caller promises.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            false,
            a,
            a_cs,
            a_rs,
            b,
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Which of this module's kernels the CPU runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kernels {
    /// Both layouts, sixteen lanes.
    Avx512,
    /// The transposed layout, eight lanes.
    Avx2,
    /// None: every product goes to the GEMM.
    None,
}

impl Kernels {
    /// Whether a product with this right-hand operand runs here.
    fn takes(self, w: &Rhs<'_>) -> bool {
        match self {
            Kernels::Avx512 => true,
            Kernels::Avx2 => matches!(w, Rhs::Transposed { .. }),
            Kernels::None => false,
        }
    }
}

/// The kernels this CPU runs.
fn kernels() -> Kernels {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Kernels::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Kernels::Avx2;
        }
    }
    Kernels::None
}

/// Whether a few rows times a linear weight run faster on this CPU with the weight stored
/// `[out, in]` and read transposed (a CPU with AVX2 and FMA but not AVX-512, where only the
/// transposed kernel runs) than stored `[in, out]`.
pub fn transposed_weights_decode_faster() -> bool {
    kernels() == Kernels::Avx2
}

/// `x [m, k]` (row-major) times `w`: `[m, n]` row-major, or `None` where this CPU has no kernel
/// for `w`'s layout.
///
/// Panics when `m` is 0 or above [`MAX_ROWS`], or `w` is too short for `k × n`.
pub fn times(x: &[f32], m: usize, k: usize, w: Rhs<'_>, n: usize) -> Option<Vec<f32>> {
    assert!(
        (1..=MAX_ROWS).contains(&m),
        "{m} rows for a few-row product"
    );
    assert!(
        x.len() >= m * k,
        "x holds {} of {m} × {k} elements",
        x.len()
    );
    match w {
        Rhs::RowMajor { w, ld } => assert!(ld >= n && w.len() >= (k - 1) * ld + n),
        Rhs::Transposed { w, ld } => assert!(ld >= k && w.len() >= (n - 1) * ld + k),
    }
    let kernels = kernels();
    if !kernels.takes(&w) {
        return None;
    }
    let mut out = vec![0.0f32; m * n];
    #[cfg(target_arch = "x86_64")]
    match (kernels, w) {
        (Kernels::Avx512, Rhs::RowMajor { w, ld }) => rows_times(x, m, k, w, ld, n, &mut out),
        (Kernels::Avx512, Rhs::Transposed { w, ld }) => rows_dot(x, m, k, w, ld, n, &mut out),
        (Kernels::Avx2, Rhs::Transposed { w, ld }) => rows_dot8(x, m, k, w, ld, n, &mut out),
        _ => unreachable!("`takes` admitted no other pair"),
    }
    Some(out)
}

/// Rows of a batch that take one low-rank adapter.
pub struct AdapterRows<'a> {
    /// Indices of the rows, into the input's `m`.
    pub rows: Vec<usize>,
    /// `A [k, rank]`, row-major.
    pub a: &'a [f32],
    /// `B [rank, n]`, row-major.
    pub b: &'a [f32],
    pub rank: usize,
    /// `alpha / r`.
    pub scaling: f32,
}

/// `delta [m, n]` for `x [m, k]`: each group's rows get `(scaling · x_row A) B` of their own
/// adapter, every other row zeros. Each group reads only its own `A` and `B` (row-major, in
/// place) and multiplies only its own rows: through the row-major kernel where the CPU has it,
/// else through the GEMM.
pub fn adapter_delta(
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    groups: &[AdapterRows<'_>],
) -> Vec<f32> {
    let mut delta = vec![0.0f32; m * n];
    for g in groups {
        for rows in g.rows.chunks(MAX_ROWS) {
            let mut xg = Vec::with_capacity(rows.len() * k);
            for &r in rows {
                xg.extend_from_slice(&x[r * k..(r + 1) * k]);
            }
            let mut h = row_major_times(&xg, rows.len(), k, g.a, g.rank);
            h.iter_mut().for_each(|v| *v *= g.scaling);
            let d = row_major_times(&h, rows.len(), g.rank, g.b, n);
            for (&r, d) in rows.iter().zip(d.chunks(n)) {
                delta[r * n..(r + 1) * n]
                    .iter_mut()
                    .zip(d)
                    .for_each(|(o, v)| *o += v);
            }
        }
    }
    delta
}

/// `x [m, k] · W [k, n]` for a row-major `W` (`n` apart) and `1 ≤ m ≤ MAX_ROWS`: [`times`]
/// where this CPU has the row-major kernel, else the GEMM on the calling thread.
fn row_major_times(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    if let Some(y) = times(x, m, k, Rhs::RowMajor { w, ld: n }, n) {
        return y;
    }
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    // Safety: `times` checked that `x` holds `m × k` and `w` `k × n` floats; the GEMM writes all
    // `m × n` elements of `out` without reading them (see `gemm_times`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        out.set_len(m * n);
    }
    out
}

/// The output, written by several threads at disjoint places.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// Safety: each task writes only its own columns (or embedding rows) of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element `offset` places in.
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Splits `0..n` into one contiguous range per pool thread, each a whole number of `align`
/// units, and runs `f` on each (on the calling thread alone for a small weight).
fn split(n: usize, align: usize, weight: usize, f: impl Fn(usize, usize) + Sync) {
    let threads = rayon::current_num_threads();
    if weight < PARALLEL_FROM || threads == 1 {
        return f(0, n);
    }
    let per = n.div_ceil(align).div_ceil(threads) * align;
    (0..threads).into_par_iter().for_each(|t| {
        let (start, end) = ((t * per).min(n), ((t + 1) * per).min(n));
        if start < end {
            f(start, end);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Row-major W

/// A tile kernel, [`tile`] for some `R` and `C`.
#[cfg(target_arch = "x86_64")]
type TileFn = unsafe fn(*const f32, *const f32, usize, usize, *mut f32, usize, usize, bool);

/// The tile for `r` rows of `x` and `c` vectors of columns.
#[cfg(target_arch = "x86_64")]
fn tile_fn(r: usize, c: usize) -> TileFn {
    macro_rules! tiles {
        ($($r:literal, $c:literal);*) => {
            match (r, c) {
                $(($r, $c) => tile::<$r, $c>,)*
                _ => unreachable!("no tile of {r} rows by {c} vectors"),
            }
        };
    }
    tiles!(1, 4; 2, 4; 3, 4; 4, 4; 5, 2; 6, 2; 7, 2; 8, 2; 8, 1; 9, 1; 10, 1; 11, 1; 12, 1;
        13, 1; 14, 1; 15, 1; 16, 1)
}

/// Rows of `x` that go through a tile together.
#[cfg(target_arch = "x86_64")]
struct RowGroup {
    /// The first row.
    start: usize,
    /// How many rows.
    rows: usize,
    /// `xs[i · rows + r] = x[start + r, i]`: the values one row of W meets, side by side.
    xs: Vec<f32>,
    tile: TileFn,
}

/// `x [m, k] · W [k, n]` into `out [m, n]`. Up to 16 rows are one group, with `16 · C` columns
/// per tile by the row count: at least 16 accumulators where the rows allow (so the fused
/// multiply-adds' latency is hidden), at most 16 registers of them. More rows are split into
/// groups of 8 to 16 with one vector of columns each; each block of W's rows, one panel at a
/// time, goes through every group while it is in the first-level cache, so W is still read
/// from memory once.
#[cfg(target_arch = "x86_64")]
fn rows_times(x: &[f32], m: usize, k: usize, w: &[f32], ld: usize, n: usize, out: &mut [f32]) {
    let count = m.div_ceil(16);
    let vectors = match m {
        1..=4 => 4,
        5..=8 => 2,
        _ => 1,
    };
    let groups: Vec<RowGroup> = (0..count)
        .map(|g| {
            let (start, end) = (g * m / count, (g + 1) * m / count);
            let rows = end - start;
            let mut xs = vec![0.0f32; k * rows];
            for r in 0..rows {
                let row = &x[(start + r) * k..(start + r + 1) * k];
                for (i, v) in row.iter().enumerate() {
                    xs[i * rows + r] = *v;
                }
            }
            RowGroup {
                start,
                rows,
                xs,
                tile: tile_fn(rows, vectors),
            }
        })
        .collect();
    let width = 16 * vectors;
    let y = OutPtr(out.as_mut_ptr());
    split(n, width, k * n, |start, end| {
        for k0 in (0..k).step_by(K_BLOCK) {
            let rows = K_BLOCK.min(k - k0);
            for c0 in (start..end).step_by(width) {
                for g in &groups {
                    // Safety: AVX-512 was detected (`times`); the tile reads rows
                    // `k0..k0 + rows` and columns `c0..c0 + cols` of W (within `w`, checked in
                    // `times`) and writes the group's rows, columns `c0..c0 + cols`, of the
                    // output, which this task owns.
                    unsafe {
                        (g.tile)(
                            g.xs.as_ptr().add(k0 * g.rows),
                            w.as_ptr().add(k0 * ld + c0),
                            ld,
                            rows,
                            y.at(g.start * n + c0),
                            n,
                            (end - c0).min(width),
                            k0 == 0,
                        );
                    }
                }
            }
        }
    });
}

/// One tile: `acc[r][j] (+)= Σ_i xs[i · R + r] · W[i, 16 j ..]` for `i < rows`, the first
/// `cols` columns (the last vector masked), added to what the output holds unless `first`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const C: usize>(
    xs: *const f32,
    w: *const f32,
    ld: usize,
    rows: usize,
    out: *mut f32,
    ld_out: usize,
    cols: usize,
    first: bool,
) {
    // A vector past `cols` has an empty mask and touches no memory; its address may lie past
    // the end of W or of the output, hence the wrapping offsets below.
    let masks: [__mmask16; C] = std::array::from_fn(|j| lanes(cols.saturating_sub(16 * j)));
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    if !first {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_maskz_loadu_ps(masks[j], out.wrapping_add(r * ld_out + 16 * j));
            }
        }
    }
    for i in 0..rows {
        let row = w.add(i * ld);
        if C < 4 {
            for j in 0..C {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(PREFETCH_AHEAD + 16 * j).cast());
            }
        }
        let wv: [__m512; C] =
            std::array::from_fn(|j| _mm512_maskz_loadu_ps(masks[j], row.wrapping_add(16 * j)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*xs.add(i * R + r));
            for (a, wv) in acc.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(xv, *wv, *a);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (j, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.wrapping_add(r * ld_out + 16 * j), masks[j], *a);
        }
    }
}

/// How far ahead along a row of W a narrow tile (fewer than four vectors) asks for the weight,
/// in floats: four cache lines, where the tile of the panel after next reads. Two panels of one
/// vector are too narrow for the hardware prefetcher to follow 32 rows at once; with the hint,
/// 16 rows by a `512 × 1536` weight out of cache took 185–194 µs against 267–297 without.
/// Tiles of four vectors read a quarter of a kilobyte per row and gained nothing from it.
const PREFETCH_AHEAD: usize = 64;

/// The first `min(n, 16)` lanes.
#[cfg(target_arch = "x86_64")]
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

// ---------------------------------------------------------------------------------------------
// Transposed W

/// Rows of `x` per pass over an embedding row pair.
const DOT_ROWS: usize = 8;

/// `out[r, j] = x[r] · E[j]` for `E [n, k]` row-major (`ld` apart).
#[cfg(target_arch = "x86_64")]
fn rows_dot(x: &[f32], m: usize, k: usize, e: &[f32], ld: usize, n: usize, out: &mut [f32]) {
    let y = OutPtr(out.as_mut_ptr());
    split(n, 2, k * n, |start, end| {
        for j in (start..end).step_by(2) {
            let pair = (end - j).min(2);
            for r0 in (0..m).step_by(DOT_ROWS) {
                let rows = DOT_ROWS.min(m - r0);
                // Safety: AVX-512 was detected (`times`); rows `j..j + pair` of E lie in `e`
                // (checked in `times`), rows `r0..r0 + rows` of x in `x`, and this task owns
                // columns `j..j + pair` of the output.
                unsafe {
                    dot(
                        x.as_ptr().add(r0 * k),
                        rows,
                        k,
                        e.as_ptr().add(j * ld),
                        ld,
                        pair,
                        y.at(r0 * n + j),
                        n,
                    );
                }
            }
        }
    });
}

/// `out[r · ld_out + p] = x[r] · E[p]` for `r < rows ≤ 8`, `p < pair ≤ 2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn dot(
    x: *const f32,
    rows: usize,
    k: usize,
    e: *const f32,
    ld: usize,
    pair: usize,
    out: *mut f32,
    ld_out: usize,
) {
    // `acc[r][p]`: row `r` of x with row `p` of the pair, sixteen lanes.
    let mut acc = [[_mm512_setzero_ps(); 2]; DOT_ROWS];
    let second = if pair == 2 { e.add(ld) } else { e };
    for i in (0..k).step_by(16) {
        let mask = lanes(k - i);
        let e0 = _mm512_maskz_loadu_ps(mask, e.add(i));
        let e1 = _mm512_maskz_loadu_ps(mask, second.add(i));
        for (r, [a0, a1]) in acc.iter_mut().enumerate().take(rows) {
            let xv = _mm512_maskz_loadu_ps(mask, x.add(r * k + i));
            *a0 = _mm512_fmadd_ps(e0, xv, *a0);
            *a1 = _mm512_fmadd_ps(e1, xv, *a1);
        }
    }
    for (r, acc) in acc.iter().enumerate().take(rows) {
        for (p, a) in acc.iter().enumerate().take(pair) {
            *out.add(r * ld_out + p) = _mm512_reduce_add_ps(*a);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Transposed W, eight lanes

/// `out[r, j] = x[r] · E[j]` for `E [n, k]` row-major (`ld` apart), on AVX2 and FMA.
///
/// Tiles of `J` rows of `E` by `R ≤ 4` rows of `x` keep `J · R` sums of eight lanes in
/// registers while `k` streams by (`J` loads of `E` and `R` of `x` per `J · R` fused
/// multiply-adds). Each block of `E`'s rows goes through every group of `x`'s rows while it is
/// in the first-level cache, so `E` is read from memory once, front to back. `J` is 3 with
/// four rows (twelve sums, three `E` vectors and one of `x`: all sixteen registers), and more
/// with fewer rows, where the sums alone would not hide the multiply-adds' latency.
#[cfg(target_arch = "x86_64")]
fn rows_dot8(x: &[f32], m: usize, k: usize, e: &[f32], ld: usize, n: usize, out: &mut [f32]) {
    let block = match m {
        1 => 6,
        2 => 4,
        _ => 3,
    };
    let y = OutPtr(out.as_mut_ptr());
    split(n, block, k * n, |start, end| {
        for j in (start..end).step_by(block) {
            let rows_of_e = (end - j).min(block);
            for r0 in (0..m).step_by(4) {
                let rows = (m - r0).min(4);
                // Safety: AVX2 and FMA were detected (`times`); rows `j..j + rows_of_e` of E
                // lie in `e` (checked in `times`), rows `r0..r0 + rows` of x in `x`, and this
                // task owns columns `j..j + rows_of_e` of the output.
                unsafe {
                    dot8_fn(rows_of_e, rows)(
                        x.as_ptr().add(r0 * k),
                        k,
                        e.as_ptr().add(j * ld),
                        ld,
                        y.at(r0 * n + j),
                        n,
                    );
                }
            }
        }
    });
}

/// A tile of [`rows_dot8`], [`dot8`] for some `J` and `R`.
#[cfg(target_arch = "x86_64")]
type Dot8Fn = unsafe fn(*const f32, usize, *const f32, usize, *mut f32, usize);

/// The tile for `j` rows of E by `r` rows of x.
#[cfg(target_arch = "x86_64")]
fn dot8_fn(j: usize, r: usize) -> Dot8Fn {
    macro_rules! tiles {
        ($($j:literal, $r:literal);*) => {
            match (j, r) {
                $(($j, $r) => dot8::<$j, $r>,)*
                _ => unreachable!("no tile of {j} rows of E by {r} of x"),
            }
        };
    }
    tiles!(1, 1; 2, 1; 3, 1; 4, 1; 5, 1; 6, 1; 1, 2; 2, 2; 3, 2; 4, 2; 1, 3; 2, 3; 3, 3;
        1, 4; 2, 4; 3, 4)
}

/// `out[r · ld_out + p] = x[r] · E[p]` for `r < R`, `p < J`, `x`'s rows `k` apart: eight lanes
/// per sum along `k`, then a fixed tree across the lanes, then the last `k mod 8` products in
/// order, so a sum's order depends on `k` alone.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot8<const J: usize, const R: usize>(
    x: *const f32,
    k: usize,
    e: *const f32,
    ld: usize,
    out: *mut f32,
    ld_out: usize,
) {
    // `acc[r][p]`: row `r` of x with row `p` of E.
    let mut acc = [[_mm256_setzero_ps(); J]; R];
    let whole = k - k % 8;
    for i in (0..whole).step_by(8) {
        let ev: [__m256; J] = std::array::from_fn(|p| _mm256_loadu_ps(e.add(p * ld + i)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(r * k + i));
            for (a, ev) in acc.iter_mut().zip(&ev) {
                *a = _mm256_fmadd_ps(*ev, xv, *a);
            }
        }
    }
    let zero = _mm256_setzero_ps();
    for (g, rows) in acc.chunks(4).enumerate() {
        for p in 0..J {
            let lane = |i: usize| rows.get(i).map_or(zero, |row| row[p]);
            let mut sums = [0.0f32; 4];
            _mm_storeu_ps(
                sums.as_mut_ptr(),
                sum_lanes(lane(0), lane(1), lane(2), lane(3)),
            );
            for (i, &sum) in sums.iter().enumerate().take(rows.len()) {
                let r = 4 * g + i;
                let mut s = sum;
                for t in whole..k {
                    s = (*x.add(r * k + t)).mul_add(*e.add(p * ld + t), s);
                }
                *out.add(r * ld_out + p) = s;
            }
        }
    }
}

/// The sums of the eight lanes of each of `a`, `b`, `c`, `d`, in that order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_lanes(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(
        _mm256_castps256_ps128(abcd),
        _mm256_extractf128_ps::<1>(abcd),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// `x · W` in float64, `W` given by element.
    fn reference(
        x: &[f32],
        m: usize,
        k: usize,
        n: usize,
        w: impl Fn(usize, usize) -> f32,
    ) -> Vec<f64> {
        let mut y = vec![0.0f64; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * k + i] as f64 * w(i, c) as f64).sum();
            }
        }
        y
    }

    fn assert_close(got: &[f32], want: &[f64], k: usize) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // A sum of k float32 products of magnitude ≤ 0.25.
            let tol = 1e-6 * (k as f64).sqrt() + 1e-6 * w.abs();
            assert!((*g as f64 - w).abs() <= tol, "element {i}: {g} against {w}");
        }
    }

    #[test]
    fn row_major_products_match_float64_for_every_row_count_and_ragged_shapes() {
        if kernels() != Kernels::Avx512 {
            return;
        }
        // Column counts that end mid-vector and mid-panel, row counts of every tile shape, and
        // `k` that ends mid-block; a row stride wider than `n` (a view of a wider weight).
        for (k, n, ld) in [
            (37, 21, 21),
            (70, 130, 133),
            (512, 512, 512),
            (600, 700, 700),
        ] {
            let w = draw((k - 1) * ld + n, 7);
            for m in 1..=MAX_ROWS {
                let x = draw(m * k, m as u64);
                let got = times(&x, m, k, Rhs::RowMajor { w: &w, ld }, n).unwrap();
                assert_close(&got, &reference(&x, m, k, n, |i, c| w[i * ld + c]), k);
            }
        }
    }

    #[test]
    fn transposed_products_match_float64_for_every_row_count_and_ragged_shapes() {
        if kernels() == Kernels::None {
            return;
        }
        for (k, n, ld) in [(37, 21, 37), (70, 131, 75), (512, 1000, 512)] {
            let e = draw((n - 1) * ld + k, 9);
            for m in 1..=MAX_ROWS {
                let x = draw(m * k, 100 + m as u64);
                let got = times(&x, m, k, Rhs::Transposed { w: &e, ld }, n).unwrap();
                assert_close(&got, &reference(&x, m, k, n, |i, c| e[c * ld + i]), k);
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_whatever_rows_share_its_batch() {
        let (k, n) = (300, 900);
        let w = draw(k * n, 3);
        let e = draw(n * k, 4);
        let x = draw(MAX_ROWS * k, 5);
        for rhs in [
            Rhs::RowMajor { w: &w, ld: n },
            Rhs::Transposed { w: &e, ld: k },
        ] {
            if !kernels().takes(&rhs) {
                continue;
            }
            let all = times(&x, MAX_ROWS, k, rhs, n).unwrap();
            for m in 1..MAX_ROWS {
                let some = times(&x, m, k, rhs, n).unwrap();
                assert_eq!(some, all[..m * n], "{m} rows");
            }
        }
    }

    /// Each group's rows get `(scaling · x A) B` of their own adapter, a row in no group gets
    /// zeros, on every CPU (the row-major kernel or the GEMM).
    #[test]
    fn adapter_deltas_go_to_their_own_rows_only() {
        let (m, k, n) = (7, 40, 33);
        let x = draw(m * k, 1);
        let adapters = [
            (3, 0.5f32, draw(k * 3, 2), draw(3 * n, 3)),
            (5, 2.0, draw(k * 5, 4), draw(5 * n, 5)),
        ];
        let rows = [vec![0, 4, 5], vec![2, 6]];
        let groups: Vec<AdapterRows> = adapters
            .iter()
            .zip(&rows)
            .map(|((rank, scaling, a, b), rows)| AdapterRows {
                rows: rows.clone(),
                a,
                b,
                rank: *rank,
                scaling: *scaling,
            })
            .collect();
        let delta = adapter_delta(&x, m, k, n, &groups);
        for r in 0..m {
            let got = &delta[r * n..(r + 1) * n];
            match rows.iter().position(|rows| rows.contains(&r)) {
                None => assert!(got.iter().all(|&v| v == 0.0), "row {r} has no adapter"),
                Some(g) => {
                    let (rank, scaling, a, b) = &adapters[g];
                    let xr = &x[r * k..(r + 1) * k];
                    let h = reference(xr, 1, k, *rank, |i, c| a[i * rank + c]);
                    for (c, got) in got.iter().enumerate() {
                        let want: f64 = (0..*rank)
                            .map(|j| *scaling as f64 * h[j] * b[j * n + c] as f64)
                            .sum();
                        assert!(
                            (*got as f64 - want).abs() <= 1e-5,
                            "row {r} col {c}: {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn tensor_products_take_both_layouts_and_tall_ones_through_the_gemm() {
        let device = Default::default();
        let random = |shape: [usize; 2]| {
            Tensor::<CpuBackend, 2>::random(shape, burn::tensor::Distribution::Default, &device)
        };
        let close = |got: Tensor<CpuBackend, 2>, want: Tensor<CpuBackend, 2>| {
            let diff = (got - want).abs().max().into_scalar();
            assert!(diff < 1e-5, "{diff}");
        };
        let (x, w, e) = (random([3, 64]), random([64, 40]), random([40, 64]));
        for rhs in [w.clone(), e.clone().transpose()] {
            close(product(&x, &rhs).expect("a product"), x.clone().matmul(rhs));
        }
        // More rows than the kernels take, and operands read transposed in place (the
        // gradients' `dC · Bᵀ` and `Aᵀ · dC`).
        let tall = random([MAX_ROWS + 30, 64]);
        let wide = random([64, MAX_ROWS + 30]);
        for (a, b) in [
            (tall.clone(), w.clone()),
            (tall.clone(), e.clone().transpose()),
            (wide.clone().transpose(), w),
            (wide.transpose(), e.transpose()),
        ] {
            close(product(&a, &b).expect("a product"), a.matmul(b));
        }
    }

    /// The GEMM writes every element of its output and reads none: a buffer of NaNs comes back
    /// as the product, and with `k = 0` as zeros.
    #[test]
    fn the_gemm_writes_its_whole_output_without_reading_it() {
        let device = Default::default();
        for (m, k, n) in [(70, 33, 21), (300, 600, 130), (5, 0, 7)] {
            let a = Tensor::<CpuBackend, 2>::random(
                [m, k],
                burn::tensor::Distribution::Default,
                &device,
            );
            let b = Tensor::<CpuBackend, 2>::random(
                [k, n],
                burn::tensor::Distribution::Default,
                &device,
            );
            let (pa, pb) = (
                a.clone().into_primitive().tensor(),
                b.clone().into_primitive().tensor(),
            );
            let mut out = vec![f32::NAN; m * n];
            // Safety: `out` holds `m × n` floats; the operands are fresh contiguous tensors.
            unsafe { gemm_into(&pa, &pb, m, k, n, out.as_mut_ptr()) };
            let want = if k == 0 {
                vec![0.0; m * n]
            } else {
                a.matmul(b).into_data().to_vec::<f32>().unwrap()
            };
            for (g, w) in out.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} against {w}");
            }
        }
    }
}
