//! Token sampling from one row of logits: temperature, top-k, top-p, greedy at temperature 0,
//! and the log-probability the trainer needs.
//!
//! The reported log-prob of a sampled token is under the **temperature-scaled** distribution
//! `softmax(logits / T)` over the full vocabulary, **before** top-k / top-p truncation (at
//! temperature 0, under `softmax(logits)`). That is what scoring the same tokens with the same
//! weights and temperature in one forward pass returns, so old log-probs match.

use std::borrow::Cow;

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::cpu_attention::exp_nonpositive;

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass to keep, in `(0, 1]`; `1` disables.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Generate at most this many tokens.
    pub max_new_tokens: usize,
    /// Token ids that end generation (the id is included in the response).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation once the decoded response contains one.
    pub stop_strings: Vec<String>,
    /// Seed of this request's RNG: the same seed and prompt give the same response.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            seed: 0,
        }
    }
}

/// Invalid sampling parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A parameter is out of range.
    #[error("invalid sampling parameter {name}: {reason}")]
    Invalid {
        /// The parameter.
        name: &'static str,
        /// Why.
        reason: String,
    },
}

impl SamplingParams {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Invalid {
                name: "temperature",
                reason: format!("{} must be finite and >= 0", self.temperature),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::Invalid {
                name: "top_p",
                reason: format!("{} must be in (0, 1]", self.top_p),
            });
        }
        if self.max_new_tokens == 0 {
            return Err(SamplingError::Invalid {
                name: "max_new_tokens",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// `ln Σ eˣ` over one row of logits, in f32: the row's maximum, then the exponentials of
/// `x − max` ([`exp_nonpositive`], within 2 ulp of `exp`) summed in sixteen lanes. The sampler
/// and the trainer's token log-probabilities ([`super::fused::token_logprobs`]) both take it, so
/// a token sampled at temperature 1 carries exactly the log-prob that scoring the same logits
/// gives it.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    let m = row_max(row);
    m + lane_sum(row, |v| exp_nonpositive::<false>(v - m)).ln()
}

/// The row's largest value.
fn row_max(row: &[f32]) -> f32 {
    row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// `Σ f(v)` over the row in sixteen lanes, then the lanes, then the remainder: the order
/// [`log_sum_exp`] sums in, so equal terms give equal sums whoever adds them.
fn lane_sum(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            lanes[l] += f(c[l]);
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for &v in chunks.remainder() {
        sum += f(v);
    }
    sum
}

/// The row divided by the temperature (as is at 0, greedy, and at 1).
fn scaled(logits: &[f32], temperature: f32) -> Cow<'_, [f32]> {
    if temperature > 0.0 && temperature != 1.0 {
        Cow::Owned(logits.iter().map(|x| x / temperature).collect())
    } else {
        Cow::Borrowed(logits)
    }
}

/// `log_softmax(logits / t)` over the whole row (t = 1 when `temperature` is 0).
pub fn log_softmax_scaled(logits: &[f32], temperature: f32) -> Vec<f32> {
    let x = scaled(logits, temperature);
    let lse = log_sum_exp(&x);
    x.iter().map(|v| v - lse).collect()
}

/// A sampled token's log-prob under the model's own distribution, `log_softmax(logits)`: no
/// temperature and no top-k / top-p truncation (what OpenAI-style `logprobs` report; vLLM's
/// default "raw" mode), with the `k` most likely tokens under the same distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawLogprobs {
    /// The sampled token's log-prob.
    pub logprob: f32,
    /// The `k` most likely `(token, log-prob)`, most likely first; equal log-probs keep the
    /// lower id first.
    pub top: Vec<(u32, f32)>,
}

/// [`RawLogprobs`] of `chosen` and the `k` most likely tokens of one row of logits.
pub fn raw_logprobs(logits: &[f32], chosen: u32, k: usize) -> RawLogprobs {
    let logp = log_softmax_scaled(logits, 1.0);
    let by_rank = |a: &usize, b: &usize| logp[*b].total_cmp(&logp[*a]).then(a.cmp(b));
    let mut ids: Vec<usize> = (0..logp.len()).collect();
    let k = k.min(ids.len());
    if k > 0 && k < ids.len() {
        // Partition so the first k are the most likely, then order only those.
        ids.select_nth_unstable_by(k - 1, by_rank);
    }
    ids.truncate(k);
    ids.sort_by(by_rank);
    RawLogprobs {
        logprob: logp[chosen as usize],
        top: ids.into_iter().map(|i| (i as u32, logp[i])).collect(),
    }
}

/// Picks the next token from `logits` (one row, `[vocab]`); returns it with its log-prob (see the
/// module docs for which distribution).
pub fn sample_token<R: Rng + ?Sized>(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut R,
) -> (u32, f32) {
    if params.temperature == 0.0 {
        // Greedy: the first maximum, as torch.argmax.
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        return (best as u32, logits[best] - log_sum_exp(logits));
    }
    let x = scaled(logits, params.temperature);
    if (params.top_k == 0 || params.top_k >= x.len()) && params.top_p >= 1.0 {
        // Nothing truncated: the inverse CDF in id order, over weights `e^(x − max)`; their
        // lane sum is the one `log_sum_exp` takes, so the log-prob is bit for bit its.
        let m = row_max(&x);
        let weights: Vec<f32> = x.iter().map(|&v| exp_nonpositive::<false>(v - m)).collect();
        let lse = m + lane_sum(&weights, |w| w).ln();
        let mass: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let mut u = rng.random::<f64>() * mass;
        for (tok, &w) in weights.iter().enumerate() {
            if u < f64::from(w) {
                return (tok as u32, x[tok] - lse);
            }
            u -= f64::from(w);
        }
        // Rounding left `u` past the last weight: the last token that has any.
        let tok = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        return (tok as u32, x[tok] - lse);
    }
    let lse = log_sum_exp(&x);
    let logp: Vec<f32> = x.iter().map(|v| v - lse).collect();
    // Candidates by decreasing probability.
    let mut order: Vec<usize> = (0..logp.len()).collect();
    order.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
    if params.top_k > 0 && params.top_k < order.len() {
        order.truncate(params.top_k);
    }
    let probs: Vec<f64> = order.iter().map(|&i| (logp[i] as f64).exp()).collect();
    let mut keep = probs.len();
    if params.top_p < 1.0 {
        let total: f64 = probs.iter().sum();
        let mut cum = 0.0;
        for (n, p) in probs.iter().enumerate() {
            cum += p / total;
            if cum >= params.top_p as f64 {
                keep = n + 1;
                break;
            }
        }
    }
    let mass: f64 = probs[..keep].iter().sum();
    let mut u = rng.random::<f64>() * mass;
    for (n, p) in probs[..keep].iter().enumerate() {
        if u < *p {
            let tok = order[n];
            return (tok as u32, logp[tok]);
        }
        u -= p;
    }
    let tok = order[keep - 1];
    (tok as u32, logp[tok])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(t: f32, top_p: f32, top_k: usize) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_p,
            top_k,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_argmax_with_untruncated_logprob() {
        let logits = [0.0, 2.0, 1.0];
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let (t, lp) = sample_token(&logits, &params(0.0, 1.0, 0), &mut rng);
        assert_eq!(t, 1);
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        assert!((lp - (2.0f32.exp() / z).ln()).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_argmax_and_logprob_is_before_truncation() {
        let logits = [0.5, 0.1, 3.0, 2.9];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20 {
            let (t, lp) = sample_token(&logits, &params(2.0, 1.0, 1), &mut rng);
            assert_eq!(t, 2);
            let full = log_softmax_scaled(&logits, 2.0);
            assert_eq!(lp, full[2]);
            assert!(lp < -0.5, "log-prob is not renormalised after truncation");
        }
    }

    #[test]
    fn top_p_only_samples_from_the_nucleus() {
        // probs ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps the first two.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut seen = [0usize; 4];
        for _ in 0..500 {
            seen[sample_token(&logits, &params(1.0, 0.8, 0), &mut rng).0 as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0);
        assert_eq!(seen[2] + seen[3], 0);
    }

    #[test]
    fn raw_logprobs_ignore_temperature_and_rank_the_top_with_ties_by_id() {
        let logits = [1.0, 3.0, 3.0, -2.0, 0.5];
        let full = log_softmax_scaled(&logits, 1.0);
        let r = raw_logprobs(&logits, 4, 3);
        assert_eq!(r.logprob, full[4]);
        assert_eq!(r.top, vec![(1, full[1]), (2, full[2]), (0, full[0])]);
        assert!((r.top.iter().map(|t| t.1.exp()).sum::<f32>() - 0.96006).abs() < 1e-4);
        assert_eq!(raw_logprobs(&logits, 1, 0).top, vec![]);
        assert_eq!(raw_logprobs(&logits, 1, 9).top.len(), 5);
    }

    #[test]
    fn same_seed_same_samples() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            (0..30)
                .map(|_| sample_token(&logits, &params(1.0, 0.95, 20), &mut rng).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    /// Without truncation each token comes up as often as its probability says.
    #[test]
    fn untruncated_sampling_follows_the_softmax() {
        let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5];
        let logp = log_softmax_scaled(&logits, 1.0);
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let draws = 20_000;
        let mut seen = [0usize; 5];
        for _ in 0..draws {
            let (t, lp) = sample_token(&logits, &params(1.0, 1.0, 0), &mut rng);
            assert_eq!(lp, logp[t as usize]);
            seen[t as usize] += 1;
        }
        for (i, &n) in seen.iter().enumerate() {
            let p = f64::from(logp[i].exp());
            let sd = (p * (1.0 - p) / draws as f64).sqrt();
            let f = n as f64 / draws as f64;
            assert!((f - p).abs() < 5.0 * sd, "token {i}: {f} against {p}");
        }
    }
}
