//! The optimizer: the global gradient-norm clip of `torch.nn.utils.clip_grad_norm_` and an AdamW
//! that follows `torch.optim.AdamW` (single-tensor path) operation for operation, over every
//! float parameter of a Burn module. State is keyed by the parameter's module path (e.g.
//! `layers.0.attn.q_proj.weight`), so it survives reloading the module from a checkpoint, where
//! parameter ids are new.

use std::any::TypeId;
use std::collections::BTreeMap;
use std::mem::MaybeUninit;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use rayon::prelude::*;

use crate::model::cpu_tensor::floats;
use crate::CpuBackend;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// Learning rate.
    pub lr: f64,
    /// `(β1, β2)`.
    pub betas: [f64; 2],
    /// Epsilon added to the bias-corrected `sqrt(v)`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// The moments of one parameter, flattened.
#[derive(Debug, Clone)]
struct Moments<B: Backend> {
    step: u64,
    exp_avg: Tensor<B, 1>,
    exp_avg_sq: Tensor<B, 1>,
}

/// One parameter's optimizer state as plain data (for checkpoints).
#[derive(Debug, Clone, PartialEq)]
pub struct MomentsData {
    /// Number of updates this parameter has received.
    pub step: u64,
    /// First moment, flattened row-major.
    pub exp_avg: Vec<f32>,
    /// Second moment, flattened row-major.
    pub exp_avg_sq: Vec<f32>,
}

/// AdamW with decoupled weight decay, exactly as `torch.optim.AdamW`:
/// `p *= 1 - lr·wd`; `m = lerp(m, g, 1-β1)`; `v = β2·v + (1-β2)·g²`;
/// `denom = sqrt(v)/sqrt(1-β2^t) + eps`; `p -= lr/(1-β1^t) · m/denom`.
/// `B` is the inner (non-autodiff) backend the state lives on.
#[derive(Debug, Clone)]
pub struct AdamW<B: Backend> {
    params: AdamWParams,
    state: BTreeMap<String, Moments<B>>,
}

impl<B: Backend> AdamW<B> {
    /// A fresh optimizer with no state.
    pub fn new(params: AdamWParams) -> Self {
        Self {
            params,
            state: BTreeMap::new(),
        }
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &AdamWParams {
        &self.params
    }

    /// Replaces the hyper-parameters (the state is kept).
    pub fn set_params(&mut self, params: AdamWParams) {
        self.params = params;
    }

    /// Exports the state, per parameter path.
    pub fn export_state(&self) -> BTreeMap<String, MomentsData> {
        self.state
            .iter()
            .map(|(k, m)| {
                (
                    k.clone(),
                    MomentsData {
                        step: m.step,
                        exp_avg: m
                            .exp_avg
                            .to_data()
                            .convert::<f32>()
                            .to_vec()
                            .unwrap_or_default(),
                        exp_avg_sq: m
                            .exp_avg_sq
                            .to_data()
                            .convert::<f32>()
                            .to_vec()
                            .unwrap_or_default(),
                    },
                )
            })
            .collect()
    }

    /// Replaces the state with `state` (as produced by [`AdamW::export_state`]).
    pub fn import_state(&mut self, state: BTreeMap<String, MomentsData>, device: &B::Device) {
        self.state = state
            .into_iter()
            .map(|(k, d)| {
                let n = d.exp_avg.len();
                (
                    k,
                    Moments {
                        step: d.step,
                        exp_avg: Tensor::from_data(TensorData::new(d.exp_avg, [n]), device),
                        exp_avg_sq: Tensor::from_data(TensorData::new(d.exp_avg_sq, [n]), device),
                    },
                )
            })
            .collect();
    }

    /// Applies one update to every float parameter of `module` that has a gradient in `grads`,
    /// after multiplying the gradient by `grad_scale` (the clip coefficient; 1 for none).
    pub fn step<AB, M>(&mut self, module: M, grads: GradientsParams, grad_scale: f64) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let mut mapper = StepMapper::<AB> {
            params: self.params,
            state: &mut self.state,
            grads,
            grad_scale,
            path: Vec::new(),
        };
        module.map(&mut mapper)
    }
}

struct StepMapper<'a, AB: AutodiffBackend> {
    params: AdamWParams,
    state: &'a mut BTreeMap<String, Moments<AB::InnerBackend>>,
    grads: GradientsParams,
    grad_scale: f64,
    path: Vec<String>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for StepMapper<'_, AB> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<AB::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let p = tensor.inner();
        let shape = p.shape();
        let n = shape.num_elements();
        let grad = grad.reshape([n]);
        let key = self.path.join(".");
        let device = grad.device();
        let moments = self.state.remove(&key).unwrap_or_else(|| Moments {
            step: 0,
            exp_avg: Tensor::zeros([n], &device),
            exp_avg_sq: Tensor::zeros([n], &device),
        });
        let step = moments.step + 1;
        let rule = Update::new(&self.params, step, self.grad_scale);
        let p = p.reshape([n]);
        let (p, exp_avg, exp_avg_sq) =
            if TypeId::of::<AB::InnerBackend>() == TypeId::of::<CpuBackend>() {
                let (p, m, v) = rule.apply_floats(
                    &floats(p),
                    &floats(grad),
                    &floats(moments.exp_avg),
                    &floats(moments.exp_avg_sq),
                );
                let t = |x: Vec<f32>| Tensor::from_data(TensorData::new(x, [n]), &device);
                (t(p), t(m), t(v))
            } else {
                rule.apply(p, grad, moments.exp_avg, moments.exp_avg_sq)
            };
        self.state.insert(
            key,
            Moments {
                step,
                exp_avg,
                exp_avg_sq,
            },
        );
        let mut updated = Tensor::<AB, D>::from_inner(p.reshape(shape));
        if require_grad {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// A chunk of an output the update writes.
type Out<'a> = &'a mut [MaybeUninit<f32>];

/// One parameter's AdamW update at step `t`, the scalars of `torch.optim.AdamW` computed in f64
/// and applied in f32, in its order: `g *= grad_scale`; `p *= 1 − lr·wd`;
/// `m = lerp(m, g, 1 − β1)`; `v = β2·v + (1 − β2)·g²`; `denom = sqrt(v)/sqrt(1 − β2^t) + eps`;
/// `p −= lr/(1 − β1^t) · m/denom`.
#[derive(Debug, Clone, Copy)]
struct Update {
    grad_scale: f64,
    decay: f64,
    /// The lerp weight `1 − β1`.
    w: f64,
    beta2: f64,
    sqrt_bias_correction2: f64,
    eps: f64,
    step_size: f64,
}

impl Update {
    fn new(h: &AdamWParams, step: u64, grad_scale: f64) -> Self {
        let [beta1, beta2] = h.betas;
        Self {
            grad_scale,
            decay: 1.0 - h.lr * h.weight_decay,
            w: 1.0 - beta1,
            beta2,
            sqrt_bias_correction2: (1.0 - beta2.powi(step as i32)).sqrt(),
            eps: h.eps,
            step_size: h.lr / (1.0 - beta1.powi(step as i32)),
        }
    }

    /// The update as tensor ops: `(p, m, v)` after it.
    fn apply<B: Backend>(
        &self,
        p: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        exp_avg: Tensor<B, 1>,
        exp_avg_sq: Tensor<B, 1>,
    ) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
        let grad = if self.grad_scale != 1.0 {
            grad.mul_scalar(self.grad_scale)
        } else {
            grad
        };
        // Decoupled weight decay first, on the parameter itself.
        let p = if self.decay != 1.0 {
            p.mul_scalar(self.decay)
        } else {
            p
        };
        // exp_avg.lerp_(grad, 1 - β1), i.e. m + w(g - m) (torch's form for w < 0.5).
        let exp_avg = if self.w < 0.5 {
            exp_avg.clone() + (grad.clone() - exp_avg).mul_scalar(self.w)
        } else {
            grad.clone() - (grad.clone() - exp_avg).mul_scalar(1.0 - self.w)
        };
        // exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1-β2).
        let exp_avg_sq =
            exp_avg_sq.mul_scalar(self.beta2) + grad.square().mul_scalar(1.0 - self.beta2);
        let denom = exp_avg_sq
            .clone()
            .sqrt()
            .div_scalar(self.sqrt_bias_correction2)
            .add_scalar(self.eps);
        let p = p - (exp_avg.clone() / denom).mul_scalar(self.step_size);
        (p, exp_avg, exp_avg_sq)
    }

    /// [`Update::apply`] over raw floats in one pass (the CPU backend), chunks in parallel:
    /// the same f32 operations in the same order, element by element.
    fn apply_floats(
        &self,
        p: &[f32],
        grad: &[f32],
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        const CHUNK: usize = 1 << 14;
        let n = p.len();
        assert!(
            grad.len() == n && exp_avg.len() == n && exp_avg_sq.len() == n,
            "AdamW: a parameter of {n} elements with moments or gradient of another size"
        );
        let f = |x: f64| x as f32;
        let (scale, decay, w, beta2) =
            (f(self.grad_scale), f(self.decay), f(self.w), f(self.beta2));
        let (one_minus_w, one_minus_beta2) = (f(1.0 - self.w), f(1.0 - self.beta2));
        let (sqrt_bc2, eps, step_size) = (
            f(self.sqrt_bias_correction2),
            f(self.eps),
            f(self.step_size),
        );
        let (scaled, decayed, lerp_up) = (self.grad_scale != 1.0, self.decay != 1.0, self.w < 0.5);
        let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| Vec::with_capacity(n));
        let [po, mo, vo] = &mut out;
        let run = |(c, ((po, mo), vo)): (usize, ((Out<'_>, Out<'_>), Out<'_>))| {
            let at = c * CHUNK;
            for i in 0..po.len() {
                let j = at + i;
                let g = if scaled { grad[j] * scale } else { grad[j] };
                let p = if decayed { p[j] * decay } else { p[j] };
                let m = exp_avg[j];
                let m = if lerp_up {
                    m + (g - m) * w
                } else {
                    g - (g - m) * one_minus_w
                };
                let v = exp_avg_sq[j] * beta2 + g * g * one_minus_beta2;
                let denom = v.sqrt() / sqrt_bc2 + eps;
                po[i].write(p - m / denom * step_size);
                mo[i].write(m);
                vo[i].write(v);
            }
        };
        let chunks = po.spare_capacity_mut()[..n]
            .par_chunks_mut(CHUNK)
            .zip(mo.spare_capacity_mut()[..n].par_chunks_mut(CHUNK))
            .zip(vo.spare_capacity_mut()[..n].par_chunks_mut(CHUNK))
            .enumerate();
        chunks.for_each(run);
        for v in &mut out {
            // Safety: the chunks covered all `n` elements of each output, and wrote each.
            unsafe { v.set_len(n) };
        }
        let [p, m, v] = out;
        (p, m, v)
    }
}

/// The global L2 norm of the gradients of every float parameter of `module` (parameters without
/// a gradient count as zero), accumulated in f64 (on the CPU backend each square too).
pub fn global_grad_norm<AB, M>(module: &M, grads: &GradientsParams) -> f64
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    struct NormVisitor<'a, AB: AutodiffBackend> {
        grads: &'a GradientsParams,
        sum_sq: f64,
        _b: std::marker::PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for NormVisitor<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
                self.sum_sq += if TypeId::of::<AB::InnerBackend>() == TypeId::of::<CpuBackend>() {
                    // One parallel pass over the raw floats, summed in f64.
                    floats(g)
                        .par_chunks(1 << 14)
                        .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
                        .sum::<f64>()
                } else {
                    g.square().sum().into_scalar().elem()
                };
            }
        }
    }
    let mut v = NormVisitor::<AB> {
        grads,
        sum_sq: 0.0,
        _b: std::marker::PhantomData,
    };
    module.visit(&mut v);
    v.sum_sq.sqrt()
}

/// The gradient multiplier of `torch.nn.utils.clip_grad_norm_`: `min(1, max_norm / (norm + 1e-6))`;
/// 1 when `max_norm <= 0` (clipping off).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuAutodiff as AB;
    use burn::module::Module;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        a: Param<Tensor<B, 2>>,
        b: Param<Tensor<B, 1>>,
    }

    fn two(a: [[f32; 2]; 2], b: [f32; 3]) -> Two<AB> {
        let d = Default::default();
        Two {
            a: Param::from_tensor(Tensor::from_floats(a, &d)),
            b: Param::from_tensor(Tensor::from_floats(b, &d)),
        }
    }

    /// loss = Σ a² + Σ 3b, so grad a = 2a and grad b = 3.
    fn grads(m: &Two<AB>) -> GradientsParams {
        let loss = m.a.val().square().sum() + m.b.val().sum().mul_scalar(3.0);
        GradientsParams::from_grads(loss.backward(), m)
    }

    /// Reference AdamW in f64, written from the torch formulas.
    fn reference(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], t: i32, h: &AdamWParams) {
        for i in 0..p.len() {
            p[i] *= 1.0 - h.lr * h.weight_decay;
            m[i] += (1.0 - h.betas[0]) * (g[i] - m[i]);
            v[i] = h.betas[1] * v[i] + (1.0 - h.betas[1]) * g[i] * g[i];
            let denom = v[i].sqrt() / (1.0 - h.betas[1].powi(t)).sqrt() + h.eps;
            p[i] -= h.lr / (1.0 - h.betas[0].powi(t)) * m[i] / denom;
        }
    }

    /// AdamW with β1 0.9 and ε 1e-8.
    fn params(lr: f64, beta2: f64, weight_decay: f64) -> AdamWParams {
        AdamWParams {
            lr,
            betas: [0.9, beta2],
            eps: 1e-8,
            weight_decay,
        }
    }

    #[test]
    fn adamw_follows_torch_formulas_over_steps_with_clipping() {
        let h = params(0.05, 0.98, 0.1);
        let mut model = two([[1.0, -2.0], [0.5, 3.0]], [0.1, -0.2, 0.3]);
        let mut opt = AdamW::<crate::CpuBackend>::new(h);
        let mut pa: Vec<f64> = vec![1.0, -2.0, 0.5, 3.0];
        let mut pb: Vec<f64> = vec![0.1, -0.2, 0.3];
        let (mut ma, mut va, mut mb, mut vb) =
            (vec![0.0; 4], vec![0.0; 4], vec![0.0; 3], vec![0.0; 3]);
        for t in 1..=3 {
            let g = grads(&model);
            let norm = global_grad_norm(&model, &g);
            let ga: Vec<f64> = pa.iter().map(|x| 2.0 * x).collect();
            let gb = vec![3.0; 3];
            let ref_norm = (ga.iter().chain(&gb).map(|x| x * x).sum::<f64>()).sqrt();
            assert!((norm - ref_norm).abs() < 1e-4 * ref_norm);
            let coef = clip_coefficient(norm, 1.0);
            assert!(coef < 1.0);
            model = opt.step(model, g, coef);
            let ga: Vec<f64> = ga.iter().map(|x| x * coef).collect();
            let gb: Vec<f64> = gb.iter().map(|x| x * coef).collect();
            reference(&mut pa, &mut ma, &mut va, &ga, t, &h);
            reference(&mut pb, &mut mb, &mut vb, &gb, t, &h);
            let got_a = model.a.val().into_data().to_vec::<f32>().unwrap();
            let got_b = model.b.val().into_data().to_vec::<f32>().unwrap();
            for (x, y) in got_a.iter().zip(&pa).chain(got_b.iter().zip(&pb)) {
                assert!((*x as f64 - y).abs() < 1e-5, "step {t}: {x} vs {y}");
            }
            assert!(model.a.val().is_require_grad());
        }
        let state = opt.export_state();
        assert_eq!(state.keys().collect::<Vec<_>>(), vec!["a", "b"]);
        assert_eq!(state["a"].step, 3);
    }

    #[test]
    fn state_round_trips_through_export() {
        let h = params(0.01, 0.999, 0.0);
        let model = two([[1.0, 2.0], [3.0, 4.0]], [1.0, 1.0, 1.0]);
        let mut a = AdamW::<crate::CpuBackend>::new(h);
        let model = a.step(
            model,
            grads(&two([[1.0, 2.0], [3.0, 4.0]], [1.0, 1.0, 1.0])),
            1.0,
        );
        let mut b = AdamW::<crate::CpuBackend>::new(h);
        b.import_state(a.export_state(), &Default::default());
        let g1 = grads(&model);
        let g2 = grads(&model);
        let m1 = a.step(model.clone(), g1, 1.0);
        let m2 = b.step(model, g2, 1.0);
        assert_eq!(m1.a.val().into_data(), m2.a.val().into_data());
        assert_eq!(a.export_state(), b.export_state());
    }

    #[test]
    fn clip_coefficient_is_torchs() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert!((clip_coefficient(4.0, 1.0) - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
        assert_eq!(clip_coefficient(4.0, 0.0), 1.0);
    }

    /// The one-pass update over raw floats does what the tensor ops do, on a parameter large
    /// enough for several parallel chunks, with clipping and weight decay, at both lerp forms.
    #[test]
    fn the_cpu_update_is_the_tensor_ops_update() {
        use burn::tensor::Distribution;
        type B = crate::CpuBackend;
        let n = 70_001;
        let d = Default::default();
        let r = |s: f64| Tensor::<B, 1>::random([n], Distribution::Normal(0.0, s), &d);
        let (p, g, m) = (r(1.0), r(0.1), r(0.01));
        let v = r(1e-3).abs();
        for (beta1, grad_scale) in [(0.9, 0.37), (0.3, 1.0)] {
            let h = AdamWParams {
                lr: 1e-3,
                betas: [beta1, 0.999],
                eps: 1e-8,
                weight_decay: 0.01,
            };
            let rule = Update::new(&h, 3, grad_scale);
            let want = rule.apply(p.clone(), g.clone(), m.clone(), v.clone());
            let got = rule.apply_floats(
                &floats(p.clone()),
                &floats(g.clone()),
                &floats(m.clone()),
                &floats(v.clone()),
            );
            for (got, want) in [(got.0, want.0), (got.1, want.1), (got.2, want.2)] {
                let want = want.into_data().to_vec::<f32>().unwrap();
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-6), "{a} against {b}");
                }
            }
        }
    }
}
