//! Scoring: per-token log-probabilities of given responses under the model, in one forward pass
//! per batch. The trainer uses this for old, reference and teacher log-probs; for the same
//! weights it equals what generation reports at temperature 1. [`score_response_topk`] also
//! gives the `k` most likely tokens at every response position (the OPD teacher's top-k).

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::fused::token_logprobs;
use super::qwen3::Qwen3;

/// Log-probs of `response` tokens given `prompt`: `out[i] = log p(response[i] | prompt,
/// response[..i])`. Empty when `response` is empty.
pub fn score_response<B: Backend>(model: &Qwen3<B>, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    score_batch(model, &[(prompt, response)])
        .pop()
        .unwrap_or_default()
}

/// A response scored with the top-k at every response position.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredTopK {
    /// `log p(response[i] | prompt, response[..i])`, one per response token.
    pub logprobs: Vec<f32>,
    /// `k`.
    pub k: usize,
    /// The `k` most likely token ids at each response position, row-major `[tokens, k]`, most
    /// likely first.
    pub ids: Vec<u32>,
    /// Their log-probs, `[tokens, k]`.
    pub topk_logprobs: Vec<f32>,
}

/// [`score_response`] plus the `k` most likely tokens (`1 ≤ k ≤ vocab`) at each response
/// position, from the same forward pass.
///
/// # Panics
/// If `prompt` is empty or `k` is 0 or more than the vocabulary.
pub fn score_response_topk<B: Backend>(
    model: &Qwen3<B>,
    prompt: &[u32],
    response: &[u32],
    k: usize,
) -> ScoredTopK {
    assert!(!prompt.is_empty(), "score_response_topk: empty prompt");
    assert!(
        (1..=model.vocab_size()).contains(&k),
        "score_response_topk: k {k} outside 1..={}",
        model.vocab_size()
    );
    let (p, n) = (prompt.len(), response.len());
    if n == 0 {
        return ScoredTopK {
            logprobs: Vec::new(),
            k,
            ids: Vec::new(),
            topk_logprobs: Vec::new(),
        };
    }
    let device = model.device();
    // Positions p - 1 .. p + n - 1 predict the response tokens.
    let seq: Vec<i64> = prompt.iter().chain(response).map(|&t| t as i64).collect();
    let width = seq.len() - 1;
    let inputs =
        Tensor::<B, 2, Int>::from_data(TensorData::new(seq[..width].to_vec(), [1, width]), &device);
    let logits = model.forward(inputs); // [1, width, vocab]
    let vocab = logits.dims()[2];
    let window = logits.slice([0..1, p - 1..p - 1 + n, 0..vocab]); // [1, n, vocab]
    let targets =
        Tensor::<B, 2, Int>::from_data(TensorData::new(seq[p..].to_vec(), [1, n]), &device);
    // The response's own log-probs as `score_response` gives them; the top-k from the full
    // log-softmax.
    let chosen = token_logprobs(window.clone(), targets).reshape([n]);
    let (top, top_ids) = log_softmax(window, 2).topk_with_indices(k, 2); // [1, n, k] each
    ScoredTopK {
        logprobs: chosen.into_data().convert::<f32>().to_vec().expect("f32"),
        k,
        ids: top_ids
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .expect("int")
            .into_iter()
            .map(|i| i as u32)
            .collect(),
        topk_logprobs: top.into_data().convert::<f32>().to_vec().expect("f32"),
    }
}

/// Scores several `(prompt, response)` pairs in one right-padded forward pass.
///
/// # Panics
/// If a prompt is empty (there is no position to predict the first response token from).
pub fn score_batch<B: Backend>(model: &Qwen3<B>, pairs: &[(&[u32], &[u32])]) -> Vec<Vec<f32>> {
    if pairs.is_empty() {
        return Vec::new();
    }
    assert!(
        pairs.iter().all(|(p, _)| !p.is_empty()),
        "score_batch: empty prompt"
    );
    let lens: Vec<usize> = pairs.iter().map(|(p, r)| p.len() + r.len()).collect();
    let s = *lens.iter().max().expect("non-empty");
    let b = pairs.len();
    // Inputs are the sequence minus its last token; targets are the sequence shifted by one.
    let width = s - 1;
    if width == 0 {
        return pairs.iter().map(|_| Vec::new()).collect();
    }
    let mut inputs = vec![0i64; b * width];
    let mut targets = vec![0i64; b * width];
    for (row, (p, r)) in pairs.iter().enumerate() {
        let seq: Vec<u32> = p.iter().chain(r.iter()).copied().collect();
        for t in 0..seq.len() - 1 {
            inputs[row * width + t] = seq[t] as i64;
            targets[row * width + t] = seq[t + 1] as i64;
        }
    }
    let device = model.device();
    let inputs = Tensor::<B, 2, Int>::from_data(TensorData::new(inputs, [b, width]), &device);
    let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [b, width]), &device);
    let lp = token_logprobs(model.forward(inputs), targets);
    let all: Vec<f32> = lp.into_data().convert::<f32>().to_vec().expect("f32");
    pairs
        .iter()
        .enumerate()
        .map(|(row, (p, r))| {
            let start = row * width + p.len() - 1;
            all[start..start + r.len()].to_vec()
        })
        .collect()
}
