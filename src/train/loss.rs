//! The OpenClaw-RL objective of docs/design.md §1 on tensors (the per-token log-probabilities
//! it takes come from [`crate::model::token_logprobs`]): the asymmetric clipped policy-gradient
//! term, the k3 KL term, and their aggregation
//! (mean over each sample's response tokens, then over samples), with optional per-token
//! truncated importance weights on the policy-gradient term; and the second OPD loss, the reverse
//! KL over the teacher's top-k tokens plus a tail bin ([`topk_reverse_kl`]). Generic over the
//! backend, so the same code runs differentiably under `Autodiff` and plainly for scoring.

use burn::tensor::{backend::Backend, Int, Tensor};

/// The largest log-sum [`tail_logprob`] takes: the tail keeps at least about 1e-7 of the mass,
/// so its log stays finite when the top-k ids hold all of it (or more, through rounding).
pub const TAIL_MAX_LOG_SUM: f64 = -1e-7;

/// The log of the probability mass outside `k` ids: `lp` `[batch, window, k]` log-probs →
/// `[batch, window, 1]` `log(1 − Σ_j exp(lp_j))`.
///
/// The log-sum `x = logsumexp(lp)` is clamped to at most [`TAIL_MAX_LOG_SUM`], then
/// `log(−expm1(x))` is evaluated as `ln(−2τ) − ln(1 − τ)` with `τ = tanh(x / 2)`: the identity
/// `−expm1(x) = −2τ / (1 − τ)` holds for every `x`, and unlike `1 − exp(x)` it keeps full
/// relative precision as `x → 0⁻` (Burn has no `expm1`).
pub fn tail_logprob<B: Backend>(lp: Tensor<B, 3>) -> Tensor<B, 3> {
    // logsumexp over the last dim, shifted by the (constant) row maximum.
    let m = lp.clone().max_dim(2).detach();
    let log_sum = (lp - m.clone()).exp().sum_dim(2).log() + m;
    let tau = (log_sum.clamp_max(TAIL_MAX_LOG_SUM) / 2.0).tanh();
    (tau.clone() * -2.0).log() - (-tau).log1p()
}

/// The top-k distillation loss: per response token, the reverse KL from the student to the
/// teacher over the teacher's `k` most likely ids plus one tail bin for the rest of the mass,
/// summed with `weights`.
///
/// Shapes: `student_logp` `[batch, window, vocab]`, the student's log-softmax under `s`
/// (differentiable); `teacher_ids` `[batch, window, k]` and `teacher_logp` `[batch, window, k]`,
/// the teacher's top-k under `s_enhanced` (constants); `weights` `[batch, window]`.
///
/// Per token: `s_j = student_logp[teacher_ids_j]`, bins `S = [s_1..s_k, tail(s)]` and
/// `T = [t_1..t_k, tail(t)]` ([`tail_logprob`]; each side's bins are log-probs summing to 1), and
/// `kl = Σ_bins exp(S) · (S − T)`. Returns `Σ weights · kl`, one element: with
/// `weights = w_opd · mask / (tokens_i · batch)` the mean over each sample's response tokens,
/// then over the samples. Positions of weight 0 need finite `teacher_logp` (any log-probs
/// summing to less than 1) and give no gradient. The gradient reaches `student_logp` only.
pub fn topk_reverse_kl<B: Backend>(
    student_logp: Tensor<B, 3>,
    teacher_ids: Tensor<B, 3, Int>,
    teacher_logp: Tensor<B, 3>,
    weights: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let student = student_logp.gather(2, teacher_ids);
    let teacher = teacher_logp.detach();
    let s = Tensor::cat(vec![student.clone(), tail_logprob(student)], 2);
    let t = Tensor::cat(vec![teacher.clone(), tail_logprob(teacher)], 2);
    let kl: Tensor<B, 2> = (s.clone().exp() * (s - t)).sum_dim(2).squeeze_dim(2);
    (kl * weights).sum()
}

/// The loss's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossParams {
    /// Lower clip ε (ratio floor `1 - ε`).
    pub eps_clip: f64,
    /// Upper clip ε_high (ratio ceiling `1 + ε_high`).
    pub eps_clip_high: f64,
    /// KL coefficient β_KL.
    pub kl_coef: f64,
}

/// The loss and its parts, each a one-element tensor.
#[derive(Debug, Clone)]
pub struct LossTerms<B: Backend> {
    /// `pg_loss + kl_coef * kl` (differentiable).
    pub loss: Tensor<B, 1>,
    /// The clipped policy-gradient term, aggregated.
    pub pg_loss: Tensor<B, 1>,
    /// The k3 KL estimate, aggregated (zero without reference log-probs).
    pub kl: Tensor<B, 1>,
    /// Fraction of response tokens where the clipped term is the active (strictly larger) one.
    pub clip_fraction: Tensor<B, 1>,
}

/// Computes the docs/design.md §1 loss. Every tensor is `[batch, window]`:
/// `logp_new` (differentiable), `logp_old`, `logp_ref` (when the KL term is on), `advantages`,
/// `mask` (1 on response tokens) and `weights` (`mask / (tokens_i * batch)`).
///
/// Per token: `ratio = exp(new - old)`,
/// `pg = max(-ratio·A, -clamp(ratio, 1-ε, 1+ε_high)·A)`,
/// `kl = exp(d) - 1 - d` with `d = clamp(ref - new, -10, 10)`; then
/// `loss = Σ weights·pg + kl_coef · Σ weights·kl`. Padding positions contribute nothing and no
/// gradient, whatever values they hold. Equal to [`policy_loss_weighted`] without importance
/// weights.
pub fn policy_loss<B: Backend>(
    logp_new: Tensor<B, 2>,
    logp_old: Tensor<B, 2>,
    logp_ref: Option<Tensor<B, 2>>,
    advantages: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    params: &LossParams,
) -> LossTerms<B> {
    policy_loss_weighted(
        logp_new, logp_old, logp_ref, advantages, None, mask, weights, params,
    )
}

/// [`policy_loss`] with per-token importance weights `importance` (`[batch, window]`, each
/// `≥ 0`, e.g. truncated `min(exp(trainer − rollout), C)` from
/// [`crate::rl::staleness::truncated_importance_weights`]) multiplying each token's
/// policy-gradient term: `pg_k = w_k · max(-ratio·A, -clamp(ratio)·A)`. The KL term and the
/// clip fraction are not weighted. `None` weighs every token 1.
///
/// Because `w_k ≥ 0`, `w·max(x, y) = max(w·x, w·y)`: the weighted term equals the unweighted one
/// computed with advantages `w_k·A_k`, which is how a caller that can only pass advantages
/// applies the weights (see `importance_weights_equal_scaled_advantages` below).
#[allow(clippy::too_many_arguments)]
pub fn policy_loss_weighted<B: Backend>(
    logp_new: Tensor<B, 2>,
    logp_old: Tensor<B, 2>,
    logp_ref: Option<Tensor<B, 2>>,
    advantages: Tensor<B, 2>,
    importance: Option<Tensor<B, 2>>,
    mask: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    params: &LossParams,
) -> LossTerms<B> {
    let pad = mask.clone().equal_elem(0.0);
    let log_ratio = (logp_new.clone() - logp_old).mask_fill(pad.clone(), 0.0);
    let ratio = log_ratio.exp();
    let clipped_ratio = ratio
        .clone()
        .clamp(1.0 - params.eps_clip, 1.0 + params.eps_clip_high);
    let unclipped = -(ratio * advantages.clone());
    let clipped = -(clipped_ratio * advantages);
    let clip_active = clipped.clone().greater(unclipped.clone()).float() * mask.clone();
    let clip_fraction = clip_active.sum() / mask.sum();
    let pg = unclipped.max_pair(clipped);
    let pg = match importance {
        Some(w) => pg * w.mask_fill(pad.clone(), 0.0),
        None => pg,
    };
    let pg_loss = (pg * weights.clone()).sum();
    let (kl, loss) = match logp_ref {
        Some(logp_ref) if params.kl_coef > 0.0 => {
            let d = (logp_ref - logp_new).mask_fill(pad, 0.0).clamp(-10.0, 10.0);
            let kl_tok = d.clone().exp() - d - 1.0;
            let kl = (kl_tok * weights).sum();
            let loss = pg_loss.clone() + kl.clone() * params.kl_coef;
            (kl, loss)
        }
        _ => (pg_loss.zeros_like(), pg_loss.clone()),
    };
    LossTerms {
        loss,
        pg_loss,
        kl,
        clip_fraction,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend as B;
    use burn::tensor::activation::log_softmax;
    use burn::tensor::TensorData;

    fn t2(v: &[f32], rows: usize) -> Tensor<B, 2> {
        Tensor::from_data(
            TensorData::new(v.to_vec(), [rows, v.len() / rows]),
            &Default::default(),
        )
    }

    /// The clip range ε 0.2, ε_high 0.28 and the KL coefficient `kl_coef`.
    fn params(kl_coef: f64) -> LossParams {
        LossParams {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
            kl_coef,
        }
    }

    /// [`policy_loss`] of a batch of 2 rows, given row-major as `[new, old, reference,
    /// advantages, mask, weights]`.
    fn loss_2x2(v: [&[f32]; 6], p: &LossParams) -> LossTerms<B> {
        let [new, old, refl, adv, mask, weights] = v.map(|x| t2(x, 2));
        policy_loss(new, old, Some(refl), adv, mask, weights, p)
    }

    fn scalar(t: Tensor<B, 1>) -> f32 {
        t.into_scalar()
    }

    /// Hand-computed per-token values: ratio inside the range, clipped high with A > 0, clipped
    /// low with A < 0, and a KL log-ratio beyond the ±10 clamp.
    #[test]
    fn loss_matches_hand_computation() {
        let p = params(0.5);
        let new = [-1.0f32, -0.5, -2.0, -1.0];
        let old = [-1.1f32, -1.0, -1.0, -1.0];
        let refl = [-1.0f32, -0.5, -2.0, 20.0];
        let adv = [1.0f32, 2.0, -1.0, 0.5];
        let mask = [1.0f32, 1.0, 1.0, 0.0];
        let weights = [1.0 / 4.0, 1.0 / 4.0, 1.0 / 2.0, 0.0];
        let out = loss_2x2([&new, &old, &refl, &adv, &mask, &weights], &p);
        let mut pg = [0f64; 3];
        let mut kl = [0f64; 3];
        let mut clipped = 0;
        for i in 0..3 {
            let r = ((new[i] - old[i]) as f64).exp();
            let a = adv[i] as f64;
            let c = r.clamp(0.8, 1.28);
            pg[i] = (-r * a).max(-c * a);
            if -c * a > -r * a {
                clipped += 1;
            }
            let d = ((refl[i] - new[i]) as f64).clamp(-10.0, 10.0);
            kl[i] = d.exp() - 1.0 - d;
        }
        let pg_loss = (pg[0] + pg[1]) / 4.0 + pg[2] / 2.0;
        let kl_mean = (kl[0] + kl[1]) / 4.0 + kl[2] / 2.0;
        assert_eq!(clipped, 2);
        assert!((scalar(out.pg_loss) as f64 - pg_loss).abs() < 1e-6);
        assert!((scalar(out.kl) as f64 - kl_mean).abs() < 1e-6);
        assert!((scalar(out.loss) as f64 - (pg_loss + 0.5 * kl_mean)).abs() < 1e-6);
        assert!((scalar(out.clip_fraction) - 2.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn kl_is_off_without_reference_or_coefficient() {
        let p = params(0.0);
        let out = policy_loss(
            t2(&[-1.0], 1),
            t2(&[-1.0], 1),
            Some(t2(&[-3.0], 1)),
            t2(&[2.0], 1),
            t2(&[1.0], 1),
            t2(&[1.0], 1),
            &p,
        );
        assert_eq!(scalar(out.kl), 0.0);
        assert!((scalar(out.loss) + 2.0).abs() < 1e-6);
    }

    /// Importance weights multiply each token's clipped term (hand-computed), leave the KL term
    /// alone, ignore padding, and equal training on advantages scaled by the weights — values
    /// and gradients.
    #[test]
    fn importance_weights_multiply_the_pg_term() {
        use burn::backend::Autodiff;
        type AD = Autodiff<B>;
        let p = params(0.3);
        let new = [-1.0f32, -0.5, -2.0, -1.0];
        let old = [-1.1f32, -1.0, -1.0, -1.0];
        let refl = [-1.2f32, -0.4, -2.5, -1.0];
        let adv = [1.0f32, 2.0, -1.0, 0.5];
        let is = [0.5f32, 2.0, 0.0, 7.0]; // the last is padding
        let mask = [1.0f32, 1.0, 1.0, 0.0];
        let weights = [1.0 / 4.0, 1.0 / 4.0, 1.0 / 2.0, 0.0];
        let ad2 = |v: &[f32]| -> Tensor<AD, 2> {
            Tensor::from_data(TensorData::new(v.to_vec(), [2, 2]), &Default::default())
        };
        let grad_of = |scaled: bool| {
            let logp_new = ad2(&new).require_grad();
            let adv_t = if scaled {
                let a: Vec<f32> = adv.iter().zip(&is).map(|(a, w)| a * w).collect();
                ad2(&a)
            } else {
                ad2(&adv)
            };
            let out = policy_loss_weighted(
                logp_new.clone(),
                ad2(&old),
                Some(ad2(&refl)),
                adv_t,
                (!scaled).then(|| ad2(&is)),
                ad2(&mask),
                ad2(&weights),
                &p,
            );
            let grads = out.loss.backward();
            let g: Vec<f32> = logp_new.grad(&grads).unwrap().into_data().to_vec().unwrap();
            let v = |t: Tensor<AD, 1>| -> f32 { t.into_scalar() };
            (v(out.pg_loss), v(out.kl), v(out.loss), g)
        };
        let (pg, kl, loss, g) = grad_of(false);
        let mut expect_pg = 0f64;
        for i in 0..3 {
            let r = ((new[i] - old[i]) as f64).exp();
            let a = adv[i] as f64;
            let tok = (-r * a).max(-r.clamp(0.8, 1.28) * a);
            expect_pg += is[i] as f64 * tok * weights[i] as f64;
        }
        assert!((pg as f64 - expect_pg).abs() < 1e-6, "{pg} vs {expect_pg}");
        // The KL term is the unweighted one.
        let plain = loss_2x2([&new, &old, &refl, &adv, &mask, &weights], &p);
        assert!((kl - scalar(plain.kl)).abs() < 1e-7);
        assert!(
            (scalar(plain.pg_loss) - pg).abs() > 1e-3,
            "weights changed nothing"
        );
        // Scaling the advantages instead gives the same loss and gradient.
        let (pg2, kl2, loss2, g2) = grad_of(true);
        assert!((pg - pg2).abs() < 1e-6 && (kl - kl2).abs() < 1e-7 && (loss - loss2).abs() < 1e-6);
        for (a, b) in g.iter().zip(&g2) {
            assert!((a - b).abs() < 1e-6, "{g:?} vs {g2:?}");
        }
        // A zero weight removes the token's policy gradient (only the KL part is left).
        let kl_only = 0.3 * 0.5 * (1.0 - (refl[2] - new[2]).exp()) as f64;
        assert!((g[2] as f64 - kl_only).abs() < 1e-6, "{}", g[2]);
    }

    /// The fixture of `tests/fixtures/topk_distill` (PyTorch autograd in float64 on the same
    /// float32 inputs): the loss and the gradient norm with respect to the student's logits.
    #[test]
    fn topk_reverse_kl_matches_pytorch() {
        use burn::backend::Autodiff;
        type AD = Autodiff<B>;
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/topk_distill/expected.json"
        );
        let f: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let n = |k: &str| f[k].as_u64().unwrap() as usize;
        let (b, w, v, k) = (n("batch"), n("window"), n("vocab"), n("k"));
        let floats = |key: &str| -> Vec<f32> {
            f[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        let dev = Default::default();
        let logits: Tensor<AD, 3> =
            Tensor::from_data(TensorData::new(floats("student_logits"), [b, w, v]), &dev)
                .require_grad();
        let ids: Vec<i64> = f["teacher_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        let ids: Tensor<AD, 3, Int> = Tensor::from_data(TensorData::new(ids, [b, w, k]), &dev);
        let teacher: Tensor<AD, 3> =
            Tensor::from_data(TensorData::new(floats("teacher_logprobs"), [b, w, k]), &dev);
        // weights = mask / (tokens_i · batch)
        let mask = floats("mask");
        let mut weights = vec![0f32; b * w];
        for i in 0..b {
            let row = &mask[i * w..(i + 1) * w];
            let tokens: f32 = row.iter().sum();
            for t in 0..w {
                weights[i * w + t] = row[t] / (tokens * b as f32);
            }
        }
        let weights: Tensor<AD, 2> = Tensor::from_data(TensorData::new(weights, [b, w]), &dev);
        let loss = topk_reverse_kl(log_softmax(logits.clone(), 2), ids, teacher, weights);
        let value: f32 = loss.clone().into_scalar();
        let grads = loss.backward();
        let g: Vec<f32> = logits.grad(&grads).unwrap().into_data().to_vec().unwrap();
        let grad_norm = g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let (want_loss, want_norm) = (
            f["loss"].as_f64().unwrap(),
            f["grad_norm"].as_f64().unwrap(),
        );
        let loss_err = (value as f64 - want_loss).abs() / want_loss.abs();
        let norm_err = (grad_norm - want_norm).abs() / want_norm.abs();
        eprintln!(
            "top-k loss {value} vs {want_loss} (rel {loss_err:.2e}); grad norm {grad_norm} vs \
             {want_norm} (rel {norm_err:.2e})"
        );
        assert!(
            loss_err < 1e-4,
            "loss {value} vs {want_loss}: {loss_err:.2e}"
        );
        assert!(
            norm_err < 1e-4,
            "grad norm {grad_norm} vs {want_norm}: {norm_err:.2e}"
        );
    }

    /// Hand-computed: two ids holding 0.5 and 0.25 of the student's mass and 0.25 and 0.25 of
    /// the teacher's give tail bins 0.25 and 0.5; the KL is Σ p_s ln(p_s / p_t) over the three.
    /// A teacher whose ids hold all the mass gets the clamped tail ln(1e-7) (finite).
    #[test]
    fn topk_reverse_kl_by_hand_and_the_clamped_tail() {
        let dev = Default::default();
        // Student logits over 4 tokens giving probabilities [0.5, 0.25, 0.125, 0.125].
        let p_s = [0.5f32, 0.25, 0.125, 0.125];
        let logp: Vec<f32> = p_s.iter().map(|p| p.ln()).collect();
        let student: Tensor<B, 3> = Tensor::from_data(TensorData::new(logp, [1, 1, 4]), &dev);
        let ids: Tensor<B, 3, Int> =
            Tensor::from_data(TensorData::new(vec![0i64, 1], [1, 1, 2]), &dev);
        let teacher: Tensor<B, 3> = Tensor::from_data(
            TensorData::new(vec![0.25f32.ln(), 0.25f32.ln()], [1, 1, 2]),
            &dev,
        );
        let kl = topk_reverse_kl(student.clone(), ids.clone(), teacher, t2(&[1.0], 1));
        let want =
            0.5 * (0.5f64 / 0.25).ln() + 0.25 * (0.25f64 / 0.25).ln() + 0.25 * (0.25f64 / 0.5).ln();
        assert!((scalar(kl) as f64 - want).abs() < 1e-6);

        // The teacher's two ids hold all of its mass (rounded): its tail is ln(1e-7).
        let sure: Tensor<B, 3> =
            Tensor::from_data(TensorData::new(vec![0.0f32, -40.0], [1, 1, 2]), &dev);
        let tail: f32 = tail_logprob(sure).into_scalar();
        assert!((tail as f64 - 1e-7f64.ln()).abs() < 1e-3, "{tail}");
        // One id holding all but 1e-5 of the mass (log-prob −1e-5): `1 − exp(x)` in float32
        // would be off by about 0.5 %; the tail is ln(−expm1(−1e-5)) to float32 precision.
        let near: Tensor<B, 3> =
            Tensor::from_data(TensorData::new(vec![-1e-5f32], [1, 1, 1]), &dev);
        let tail: f32 = tail_logprob(near).into_scalar();
        let want = (-(-1e-5f64).exp_m1()).ln();
        assert!((tail as f64 - want).abs() < 1e-5, "{tail} vs {want}");
        // Weight 0 removes a token.
        let kl = topk_reverse_kl(
            student,
            ids,
            Tensor::from_data(TensorData::new(vec![-1.0f32, -2.0], [1, 1, 2]), &dev),
            t2(&[0.0], 1),
        );
        assert_eq!(scalar(kl), 0.0);
    }

    /// Without weights the weighted loss is the plain one.
    #[test]
    fn no_importance_weights_is_the_plain_loss() {
        let p = params(0.0);
        let args = || {
            (
                t2(&[-1.0, -2.0], 1),
                t2(&[-1.3, -1.0], 1),
                t2(&[1.0, -1.0], 1),
            )
        };
        let (n, o, a) = args();
        let plain = policy_loss(n, o, None, a, t2(&[1.0, 1.0], 1), t2(&[0.5, 0.5], 1), &p);
        let (n, o, a) = args();
        let ones = policy_loss_weighted(
            n,
            o,
            None,
            a,
            Some(t2(&[1.0, 1.0], 1)),
            t2(&[1.0, 1.0], 1),
            t2(&[0.5, 0.5], 1),
            &p,
        );
        assert_eq!(scalar(plain.loss), scalar(ones.loss));
    }
}
