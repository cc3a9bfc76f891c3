//! Matrix products at full float32 precision on every backend this crate runs on.
//!
//! Burn 0.21's CUDA matmul (cubek) feeds float32 operands to TF32 tensor cores whenever the GPU
//! has them: each operand keeps 10 of float32's 23 mantissa bits, and there is no switch to turn
//! that off. Logits then move by about 1e-3 relative. On the CUDA backends every product here is
//! therefore computed the "3xTF32" way. Each operand is split `a = hi + lo`, where `hi` keeps the
//! leading bits (exactly representable in TF32) and `lo = a − hi` the rest, and
//!
//! ```text
//! a · b ≈ (hi_a · lo_b + lo_a · hi_b) + hi_a · hi_b
//! ```
//!
//! The dropped `lo_a · lo_b` is below 2⁻²⁰ of each term, and the TF32 rounding of a `lo` costs
//! at most 2⁻²⁰ of its operand; every product accumulates in float32. Three tensor-core products
//! still cost less than one float32 product on the CUDA cores.
//!
//! The split is Veltkamp's: `t = a · (2¹⁴ + 1)`, `hi = t − (t − a)`. It leaves `hi` at most 10
//! significant bits, or 11 if the kernel compiler fuses `a · c − a` into one FMA; TF32's
//! significand holds 11, so the tensor cores see `hi` unchanged either way.
//!
//! Under autodiff the product is one graph node whose backward computes `dA = dC · Bᵀ` and
//! `dB = Aᵀ · dC` the same way (Burn's own backward would run those on TF32 too). CPU backends
//! run one plain product: their float32 matmul is exact. On the CPU backend every product, and
//! under autodiff both of its gradients through the same node, runs
//! [`super::cpu_matmul::product`]: a decode step's few rows on its kernels, the rest on the GEMM
//! written straight into a fresh buffer.

// Without the `cuda` feature the three-product path runs only in this module's tests.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::any::{Any, TypeId};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::{CpuAutodiff, CpuBackend};

/// Veltkamp's splitter for float32 keeping at most 10 significant bits in `hi`: `2^14 + 1`.
const SPLITTER: f64 = 16_385.0;

/// `a [..., m, k]` × `b [..., k, n]` → `[..., m, n]` in float32 precision on every backend.
/// Batch dimensions must match (no broadcasting), which every caller in the model satisfies.
pub fn matmul<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    #[cfg(feature = "cuda")]
    if TypeId::of::<B>() == TypeId::of::<crate::device::CudaAutodiff>() {
        use crate::device::CudaBackend;
        return cast(tracked::<CudaBackend, D>(cast(a), cast(b)));
    }
    if TypeId::of::<B>() == TypeId::of::<CpuAutodiff>() {
        return cast(tracked::<CpuBackend, D>(cast(a), cast(b)));
    }
    product(a, b)
}

/// The product on a backend without autodiff: the three-product sum where the backend's own
/// matmul rounds (CUDA), [`super::cpu_matmul`]'s on the CPU backend, else the backend's own.
fn product<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    if native_matmul_is_inexact::<B>() {
        return split_product(a, b);
    }
    if TypeId::of::<B>() == TypeId::of::<CpuBackend>() {
        let (a, b) = (cast::<B, CpuBackend, D>(a), cast::<B, CpuBackend, D>(b));
        return cast(super::cpu_matmul::product(&a, &b).unwrap_or_else(|| a.matmul(b)));
    }
    a.matmul(b)
}

/// Whether `B`'s own matmul rounds float32 operands (the CUDA backends), so that products must
/// go through [`matmul`] rather than through Burn ops that multiply internally (its attention).
pub fn native_matmul_is_inexact<B: Backend>() -> bool {
    crate::device::is_cuda::<B>()
}

/// `Tensor<A, D>` as `Tensor<B, D>` when `A` and `B` are the same type (checked by the caller
/// through `TypeId`; a mismatch is a bug and panics).
pub(crate) fn cast<A: Backend, B: Backend, const D: usize>(t: Tensor<A, D>) -> Tensor<B, D> {
    let boxed: Box<dyn Any> = Box::new(t.into_primitive());
    match boxed.downcast::<TensorPrimitive<B>>() {
        Ok(p) => Tensor::from_primitive(*p),
        Err(_) => unreachable!("cast between different backends"),
    }
}

/// `(hi, lo)` with `hi + lo == a` exactly and `hi` at most 11 significant bits.
fn split<B: Backend, const D: usize>(a: Tensor<B, D>) -> (Tensor<B, D>, Tensor<B, D>) {
    let t = a.clone() * SPLITTER;
    let hi = t.clone() - (t - a.clone());
    let lo = a - hi.clone();
    (hi, lo)
}

/// The three-product sum for any raw product `mm` (the backend's matmul; tests pass an emulated
/// TF32 one). The two small terms are added first.
fn three_products<B: Backend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
    mm: impl Fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, D>,
) -> Tensor<B, D> {
    let (a_hi, a_lo) = split(a);
    let (b_hi, b_lo) = split(b);
    (mm(a_hi.clone(), b_lo) + mm(a_lo, b_hi.clone())) + mm(a_hi, b_hi)
}

/// The float32-precise product on a backend whose matmul runs on TF32.
fn split_product<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    three_products(a, b, |x, y| x.matmul(y))
}

/// The autodiff node of a product: [`product`] forward, and both input gradients by it
/// (`dA = dC · Bᵀ`, `dB = Aᵀ · dC`, the transposes read in place). It keeps `A` only when `B`
/// takes a gradient and `B` only when `A` does, as Burn's own product does, so a frozen
/// weight's input is not held for the backward.
#[derive(Debug)]
struct Product<const D: usize>;

impl<I: Backend, const D: usize> Backward<I, 2> for Product<D> {
    type State = (Option<FloatTensor<I>>, Option<FloatTensor<I>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_c = inner::<I, D>(grads.consume::<I>(&ops.node));
        let (a, b) = ops.state;
        let [a_node, b_node] = ops.parents;
        if let (Some(node), Some(b)) = (a_node, b) {
            let da = product(d_c.clone(), inner::<I, D>(b).transpose());
            grads.register::<I>(node.id, da.into_primitive().tensor());
        }
        if let (Some(node), Some(a)) = (b_node, a) {
            let db = product(inner::<I, D>(a).transpose(), d_c);
            grads.register::<I>(node.id, db.into_primitive().tensor());
        }
    }
}

fn inner<I: Backend, const D: usize>(p: FloatTensor<I>) -> Tensor<I, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// [`product`] as one autodiff node ([`Product`]).
fn tracked<I: Backend, const D: usize>(
    a: Tensor<Autodiff<I>, D>,
    b: Tensor<Autodiff<I>, D>,
) -> Tensor<Autodiff<I>, D> {
    let (da, db) = (a.dims(), b.dims());
    assert!(
        da[..D - 2] == db[..D - 2],
        "matmul: batch dimensions must match, got {da:?} × {db:?}"
    );
    let (a, b) = (a.into_primitive().tensor(), b.into_primitive().tensor());
    let c = product(
        inner::<I, D>(a.primitive.clone()),
        inner::<I, D>(b.primitive.clone()),
    )
    .into_primitive()
    .tensor();
    let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
    let node = match Product::<D>
        .prepare::<NoCheckpointing>([a.node.clone(), b.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                b_tracked.then_some(a.primitive),
                a_tracked.then_some(b.primitive),
            ),
            c,
        ),
        OpsKind::UnTracked(prep) => prep.finish(c),
    };
    Tensor::from_primitive(TensorPrimitive::Float(node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, TensorData, Tolerance};

    type B = crate::CpuBackend;
    type Ad = crate::CpuAutodiff;

    /// Float32 values over many binades, signs and zero.
    fn values(n: usize) -> Vec<f32> {
        let mut x = 0x2545_f491_u32;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let m = f32::from_bits(0x3f80_0000 | (x >> 9)); // [1, 2)
                let e = ((x % 40) as i32) - 20;
                let s = if x & 1 == 0 { 1.0 } else { -1.0 };
                if i % 97 == 0 {
                    0.0
                } else {
                    s * m * 2f32.powi(e)
                }
            })
            .collect()
    }

    #[test]
    fn the_split_is_exact_and_its_high_part_fits_tf32() {
        let v = values(4096);
        let a =
            Tensor::<B, 1>::from_data(TensorData::new(v.clone(), [v.len()]), &Default::default());
        let (hi, lo) = split(a);
        let hi = hi.into_data().to_vec::<f32>().unwrap();
        let lo = lo.into_data().to_vec::<f32>().unwrap();
        for ((x, h), l) in v.iter().zip(&hi).zip(&lo) {
            assert_eq!(h + l, *x, "hi {h} + lo {l} must be exactly {x}");
            // TF32 keeps the sign, the 8 exponent bits and the top 10 of 23 mantissa bits.
            assert_eq!(
                h.to_bits() & 0x1fff,
                0,
                "hi {h} of {x} has more bits than TF32"
            );
            assert!(
                l.abs() <= x.abs() * 2f32.powi(-10),
                "lo {l} of {x} is too large"
            );
        }
    }

    /// A TF32 tensor-core product emulated on the CPU: both operands truncated to 10 mantissa
    /// bits (what the hardware does to float32 bits it is fed), then multiplied in float32.
    fn tf32_product<const D: usize>(x: Tensor<B, D>, y: Tensor<B, D>) -> Tensor<B, D> {
        let truncate = |t: Tensor<B, D>| {
            let dims = t.dims();
            let v: Vec<f32> = t
                .into_data()
                .to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(|f| f32::from_bits(f.to_bits() & !0x1fff))
                .collect();
            Tensor::<B, D>::from_data(TensorData::new(v, dims), &Default::default())
        };
        truncate(x).matmul(truncate(y))
    }

    fn exact(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                    .sum();
            }
        }
        c
    }

    /// The largest error against the float64 product, relative to the largest entry.
    fn error(got: Tensor<B, 2>, want: &[f64]) -> f64 {
        let got = got.into_data().to_vec::<f32>().unwrap();
        let scale = want.iter().fold(0f64, |s, w| s.max(w.abs()));
        got.iter()
            .zip(want)
            .fold(0f64, |e, (g, w)| e.max((*g as f64 - w).abs()))
            / scale
    }

    /// On emulated TF32 hardware one product is off by ~1e-3 (the drift measured on an H200);
    /// the three-product sum is as close to the exact result as float32 accumulation allows.
    #[test]
    fn three_tf32_products_give_float32_accuracy() {
        let (m, k, n) = (48, 512, 40);
        let dev = Default::default();
        B::seed(&dev, 11);
        let a = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &dev);
        let b = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &dev);
        let av = a.clone().into_data().to_vec::<f32>().unwrap();
        let bv = b.clone().into_data().to_vec::<f32>().unwrap();
        let want = exact(&av, &bv, m, k, n);
        let one = error(tf32_product(a.clone(), b.clone()), &want);
        let three = error(three_products(a.clone(), b.clone(), tf32_product), &want);
        let float32 = error(a.matmul(b), &want);
        eprintln!("one TF32 product {one:e}, three {three:e}, float32 {float32:e}");
        assert!(
            one > 1e-4,
            "one TF32 product should be visibly off: {one:e}"
        );
        assert!(
            three < 4.0 * float32.max(1e-7),
            "three TF32 products: {three:e}, plain float32: {float32:e}"
        );
    }

    /// The autodiff node gives Burn's own product and gradients, for 2-d and batched 4-d inputs.
    #[test]
    fn the_tracked_product_has_the_gradients_of_a_plain_one() {
        fn check<const D: usize>(da: [usize; D], db: [usize; D]) {
            let dev = Default::default();
            Ad::seed(&dev, 5);
            let a = Tensor::<Ad, D>::random(da, Distribution::Normal(0.0, 1.0), &dev);
            let b = Tensor::<Ad, D>::random(db, Distribution::Normal(0.0, 1.0), &dev);
            let run = |f: &dyn Fn(Tensor<Ad, D>, Tensor<Ad, D>) -> Tensor<Ad, D>| {
                let (a, b) = (
                    a.clone().detach().require_grad(),
                    b.clone().detach().require_grad(),
                );
                let c = f(a.clone(), b.clone());
                let grads = (c.clone() * c.clone()).sum().backward();
                (c.inner(), a.grad(&grads).unwrap(), b.grad(&grads).unwrap())
            };
            let ours = run(&|a, b| tracked::<B, D>(a, b));
            let want = run(&|a, b| a.matmul(b));
            let tol = Tolerance::<f32>::relative(1e-5).set_absolute(1e-4);
            for (got, want) in [ours.0, ours.1, ours.2]
                .into_iter()
                .zip([want.0, want.1, want.2])
            {
                got.into_data()
                    .assert_approx_eq::<f32>(&want.into_data(), tol);
            }
        }
        check([6, 9], [9, 5]);
        // More rows than the few-row kernels take: the GEMM, forward and backward.
        check([70, 33], [33, 21]);
        check([2, 3, 7, 4], [2, 3, 4, 6]);
    }

    /// A product with a frozen operand gives the other its gradient, as Burn's does.
    #[test]
    fn the_tracked_product_skips_a_frozen_operand() {
        let dev = Default::default();
        Ad::seed(&dev, 6);
        let x = Tensor::<Ad, 2>::random([64, 24], Distribution::Normal(0.0, 1.0), &dev);
        let w = Tensor::<Ad, 2>::random([24, 10], Distribution::Normal(0.0, 1.0), &dev);
        let run = |f: &dyn Fn(Tensor<Ad, 2>, Tensor<Ad, 2>) -> Tensor<Ad, 2>| {
            let x = x.clone().detach().require_grad();
            let c = f(x.clone(), w.clone().detach());
            let grads = (c.clone() * c).sum().backward();
            x.grad(&grads).unwrap()
        };
        let ours = run(&|a, b| tracked::<B, 2>(a, b));
        let want = run(&|a, b| a.matmul(b));
        ours.into_data().assert_approx_eq::<f32>(
            &want.into_data(),
            Tolerance::<f32>::relative(1e-5).set_absolute(1e-4),
        );
    }
}
