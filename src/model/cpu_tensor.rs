//! The CPU backend's tensors as plain `f32` slices, for the kernels that work on raw floats
//! ([`super::cpu_attention`], [`super::fused`]) and for writing weights out
//! ([`super::weights`], through [`host_floats`], which any backend may call); and new buffers
//! for those kernels' outputs, written in parallel ([`filled`]).
//!
//! Reading a tensor through `into_data` copies its buffer whenever another handle shares it
//! (a residual kept for the backward, a cached key), and copies again to realign it. A
//! contiguous `f32` tensor of the CPU backend already is a row-major slice: [`floats`] lends
//! that buffer and copies only a strided view or another element type.

use std::any::TypeId;
use std::mem::MaybeUninit;
use std::ops::Deref;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::matmul::cast;
use crate::CpuBackend;

/// A CPU tensor's elements, row-major, read as `&[f32]`.
pub struct Floats(FlexTensor);

impl Deref for Floats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        self.0
            .as_slice::<f32>()
            .expect("Floats holds a contiguous f32 tensor")
    }
}

/// A tensor's elements on the host, row-major `f32`.
pub enum HostFloats {
    /// The CPU backend's own buffer, lent ([`floats`]).
    Lent(Floats),
    /// Read out of another backend's tensor.
    Read(Vec<f32>),
}

impl Deref for HostFloats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            HostFloats::Lent(f) => f,
            HostFloats::Read(v) => v,
        }
    }
}

/// The elements of `x` on the host: a CPU tensor's buffer lent without a copy, any other
/// backend's copied out through `into_data`.
pub fn host_floats<B: Backend, const D: usize>(x: Tensor<B, D>) -> HostFloats {
    if TypeId::of::<B>() == TypeId::of::<CpuBackend>() {
        HostFloats::Lent(floats(x))
    } else {
        HostFloats::Read(
            x.into_data()
                .convert::<f32>()
                .into_vec()
                .expect("converted to f32"),
        )
    }
}

/// The elements of `x`, which must be a tensor of the CPU backend ([`crate::CpuBackend`]; the
/// caller routes by type, and another backend is a bug that panics).
pub fn floats<B: Backend, const D: usize>(x: Tensor<B, D>) -> Floats {
    let x: Tensor<CpuBackend, D> = cast(x);
    primitive_floats(x.into_primitive().tensor())
}

/// [`floats`] of a primitive (an autodiff node's saved input or incoming gradient).
pub fn primitive_floats(p: FloatTensor<CpuBackend>) -> Floats {
    if p.dtype() == DType::F32 {
        // No copy when the tensor is contiguous from the start of its own buffer.
        Floats(p.to_contiguous())
    } else {
        Floats(FlexTensor::from_data(p.into_data().convert::<f32>()))
    }
}

/// `n` floats written by `f` over chunks of `chunk` (the last may be shorter), each chunk zeroed
/// first by the thread that fills it: on rayon's pool when `parallel`, else on the calling
/// thread. `vec![0.0; n]` would zero the whole buffer on the calling thread before any chunk
/// starts, a serial pass over memory the chunks then write again.
pub fn filled(
    n: usize,
    chunk: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    let fill = |(i, c): (usize, &mut [MaybeUninit<f32>])| {
        c.fill(MaybeUninit::new(0.0));
        // Safety: every element of `c` was just written.
        let c = unsafe { &mut *(c as *mut [MaybeUninit<f32>] as *mut [f32]) };
        f(i, c);
    };
    let spare = &mut v.spare_capacity_mut()[..n];
    if parallel {
        spare
            .par_chunks_mut(chunk.max(1))
            .enumerate()
            .for_each(fill);
    } else {
        spare.chunks_mut(chunk.max(1)).enumerate().for_each(fill);
    }
    // Safety: the chunks cover all `n` elements, and each was initialised.
    unsafe { v.set_len(n) };
    v
}
