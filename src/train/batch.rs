//! Training samples and their batch layout: validation of one sample, and the right-padded,
//! masked arrangement of a batch of variable-length samples that the learner turns into tensors.
//! Pure data, no Burn.
//!
//! A sample is `prompt ++ response`. The logits at position `p` predict the token at `p + 1`, so
//! response token `k` of a sample with a `P`-token prompt is scored by the logits at `P + k - 1`.
//! The batch keeps only the *window* of logit positions that some sample's response needs:
//! `start = min(P_i) - 1` up to `max(P_i + R_i) - 2`.

use serde::{Deserialize, Serialize};

/// One training sample: token ids exactly as served and sampled, and one advantage per response
/// token. Optional per-token log-probabilities: `old_logprobs` (recomputed by the trainer when
/// absent), `ref_logprobs` (from the reference model when absent and the KL term is on) and
/// `rollout_logprobs` (what the serving replica reported, to measure the train/serve gap).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The full prompt `s_t` as token ids.
    pub prompt_ids: Vec<u32>,
    /// The response `a_t` as token ids.
    pub response_ids: Vec<u32>,
    /// One advantage per response token.
    pub advantages: Vec<f32>,
    /// `log π_old` per response token; the trainer recomputes it when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_logprobs: Option<Vec<f32>>,
    /// `log π_ref` per response token; from the reference model when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ref_logprobs: Option<Vec<f32>>,
    /// Log-probs reported by the rollout worker, per response token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_logprobs: Option<Vec<f32>>,
    /// An OPD term the learner adds to `advantages` with its old log-probs (see
    /// [`Sample::effective_advantages`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opd: Option<OpdTerm>,
    /// Per-token factors (truncated importance weights) that multiply the whole advantage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub importance: Option<Vec<f32>>,
}

pub use clawrl_actors::loops::{OpdLossKind, OpdTerm, TeacherTopK};

/// Why a sample was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// The prompt has no token (the first response token needs a position to be predicted from).
    #[error("field `prompt_ids` is empty")]
    EmptyPrompt,
    /// The response has no token.
    #[error("field `response_ids` is empty")]
    EmptyResponse,
    /// A per-token field does not have one value per response token.
    #[error("field `{field}` has {got} values but `response_ids` has {expected} tokens")]
    Length {
        /// The field.
        field: &'static str,
        /// Its length.
        got: usize,
        /// The number of response tokens.
        expected: usize,
    },
    /// A value is NaN or infinite.
    #[error("field `{field}` holds a non-finite value ({value}) at index {index}")]
    NonFinite {
        /// The field.
        field: &'static str,
        /// The index within the field.
        index: usize,
        /// The value.
        value: f32,
    },
    /// The teacher's top-k data does not fit the response.
    #[error("{0}")]
    TopK(String),
    /// A token id is outside the model's vocabulary.
    #[error(
        "field `{field}` holds token id {id} at index {index}, outside the vocabulary of {vocab}"
    )]
    TokenOutOfVocab {
        /// The field.
        field: &'static str,
        /// The index within the field.
        index: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
}

impl Sample {
    /// A sample whose every response token carries `advantage`, with no old, reference or
    /// rollout log-probs, no OPD term and no importance weights (supervised data is
    /// `advantage = 1`).
    pub fn new(prompt_ids: Vec<u32>, response_ids: Vec<u32>, advantage: f32) -> Self {
        Sample {
            prompt_ids,
            advantages: vec![advantage; response_ids.len()],
            response_ids,
            old_logprobs: None,
            ref_logprobs: None,
            rollout_logprobs: None,
            opd: None,
            importance: None,
        }
    }

    /// The per-token float fields with their names, present ones only.
    fn float_fields(&self) -> impl Iterator<Item = (&'static str, &[f32])> {
        [
            ("advantages", Some(self.advantages.as_slice())),
            ("old_logprobs", self.old_logprobs.as_deref()),
            ("ref_logprobs", self.ref_logprobs.as_deref()),
            ("rollout_logprobs", self.rollout_logprobs.as_deref()),
            (
                "opd.teacher_logprobs",
                self.opd.as_ref().map(|o| o.teacher_logprobs.as_slice()),
            ),
            ("importance", self.importance.as_deref()),
        ]
        .into_iter()
        .filter_map(|(n, v)| v.map(|v| (n, v)))
    }

    /// Checks lengths, emptiness and finiteness; with `vocab`, also that every id is in range.
    pub fn validate(&self, vocab: Option<usize>) -> Result<(), SampleError> {
        if self.prompt_ids.is_empty() {
            return Err(SampleError::EmptyPrompt);
        }
        if self.response_ids.is_empty() {
            return Err(SampleError::EmptyResponse);
        }
        let expected = self.response_ids.len();
        if let Some(o) = &self.opd {
            if !o.weight.is_finite() {
                return Err(SampleError::NonFinite {
                    field: "opd.weight",
                    index: 0,
                    value: o.weight,
                });
            }
        }
        for (field, values) in self.float_fields() {
            if values.len() != expected {
                return Err(SampleError::Length {
                    field,
                    got: values.len(),
                    expected,
                });
            }
            if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(SampleError::NonFinite {
                    field,
                    index,
                    value,
                });
            }
        }
        let topk = self.opd.as_ref().and_then(|o| o.topk.as_ref());
        if let Some(t) = topk {
            t.check(expected).map_err(SampleError::TopK)?;
        }
        if let Some(vocab) = vocab {
            for (field, ids) in [
                ("prompt_ids", Some(&self.prompt_ids)),
                ("response_ids", Some(&self.response_ids)),
                ("opd.topk.ids", topk.map(|t| &t.ids)),
            ] {
                let Some(ids) = ids else { continue };
                if let Some((index, &id)) =
                    ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab)
                {
                    return Err(SampleError::TokenOutOfVocab {
                        field,
                        index,
                        id,
                        vocab,
                    });
                }
            }
        }
        Ok(())
    }

    /// The advantage the loss uses per response token, given the old log-probs `old` (one per
    /// response token): `(advantages[k] + w_opd · (teacher[k] − old[k])) · importance[k]`, the
    /// OPD part only for an OPD term of the advantage form (the top-k form is a loss of its own,
    /// [`crate::train::loss::topk_reverse_kl`]).
    pub fn effective_advantages(&self, old: &[f32]) -> Vec<f32> {
        let mut a = self.advantages.clone();
        if let Some(o) = self.opd.as_ref().filter(|o| o.topk.is_none()) {
            for ((a, t), old) in a.iter_mut().zip(&o.teacher_logprobs).zip(old) {
                *a += o.weight * (t - old);
            }
        }
        if let Some(w) = &self.importance {
            for (a, w) in a.iter_mut().zip(w) {
                *a *= w;
            }
        }
        a
    }

    /// Prompt plus response length.
    pub fn len(&self) -> usize {
        self.prompt_ids.len() + self.response_ids.len()
    }

    /// True when the sample has no token at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The right-padded, masked layout of a batch. Flat row-major vectors: `input_ids` is
/// `[batch, seq_len]`; every per-token vector is `[batch, window]` over logit positions
/// `window_start .. window_start + window`.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchLayout {
    /// Number of samples.
    pub batch: usize,
    /// Padded sequence length (the longest sample, or more when asked).
    pub seq_len: usize,
    /// First logit position in the window.
    pub window_start: usize,
    /// Number of logit positions in the window.
    pub window: usize,
    /// `[batch, seq_len]` token ids, right-padded with `pad_id`.
    pub input_ids: Vec<i64>,
    /// `[batch, window]` the token each window position predicts (`pad_id` outside responses).
    pub targets: Vec<i64>,
    /// `[batch, window]` 1 on response tokens, 0 elsewhere.
    pub mask: Vec<f32>,
    /// `[batch, window]` `mask / (tokens_i * batch)`: summing `token_loss * weights` is the mean
    /// over each sample's tokens, then over samples.
    pub weights: Vec<f32>,
    /// Per sample: first window index of its response, and its response length.
    pub spans: Vec<(usize, usize)>,
}

/// Why a batch could not be laid out.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayoutError {
    /// No sample.
    #[error("empty batch")]
    Empty,
    /// A sample is invalid.
    #[error("sample {index}: {source}")]
    Sample {
        /// Position in the batch.
        index: usize,
        /// The reason.
        source: SampleError,
    },
    /// `pad_to` is shorter than the longest sample.
    #[error("pad_to {pad_to} is shorter than the longest sample ({longest} tokens)")]
    PadTooShort {
        /// Requested length.
        pad_to: usize,
        /// Longest sample.
        longest: usize,
    },
}

impl BatchLayout {
    /// Lays out `samples` right-padded to the longest one (or to `pad_to`, which must be at
    /// least that long) with `pad_id`. Every sample is validated first.
    pub fn new(
        samples: &[Sample],
        pad_to: Option<usize>,
        pad_id: u32,
        vocab: Option<usize>,
    ) -> Result<Self, LayoutError> {
        if samples.is_empty() {
            return Err(LayoutError::Empty);
        }
        for (index, s) in samples.iter().enumerate() {
            s.validate(vocab)
                .map_err(|source| LayoutError::Sample { index, source })?;
        }
        let longest = samples.iter().map(Sample::len).max().unwrap_or(0);
        let seq_len = match pad_to {
            Some(p) if p < longest => return Err(LayoutError::PadTooShort { pad_to: p, longest }),
            Some(p) => p,
            None => longest,
        };
        let batch = samples.len();
        let window_start = samples
            .iter()
            .map(|s| s.prompt_ids.len())
            .min()
            .unwrap_or(1)
            - 1;
        let window_end = longest - 1; // exclusive: the last token is never a predictor
        let window = window_end - window_start;
        let mut input_ids = vec![pad_id as i64; batch * seq_len];
        let mut targets = vec![pad_id as i64; batch * window];
        let mut mask = vec![0f32; batch * window];
        let mut weights = vec![0f32; batch * window];
        let mut spans = Vec::with_capacity(batch);
        for (b, s) in samples.iter().enumerate() {
            let row = &mut input_ids[b * seq_len..(b + 1) * seq_len];
            for (dst, &id) in row
                .iter_mut()
                .zip(s.prompt_ids.iter().chain(&s.response_ids))
            {
                *dst = id as i64;
            }
            let first = s.prompt_ids.len() - 1 - window_start;
            let n = s.response_ids.len();
            let w = 1.0 / (n as f32 * batch as f32);
            for (k, &id) in s.response_ids.iter().enumerate() {
                let j = b * window + first + k;
                targets[j] = id as i64;
                mask[j] = 1.0;
                weights[j] = w;
            }
            spans.push((first, n));
        }
        Ok(Self {
            batch,
            seq_len,
            window_start,
            window,
            input_ids,
            targets,
            mask,
            weights,
            spans,
        })
    }

    /// Scatters one per-token vector per sample into a `[batch, window]` vector (0 on padding).
    /// `values[i]` must have sample `i`'s response length.
    pub fn scatter<V: AsRef<[f32]>>(&self, values: &[V]) -> Vec<f32> {
        let mut out = vec![0f32; self.batch * self.window];
        for (b, (&(first, n), v)) in self.spans.iter().zip(values).enumerate() {
            let v = v.as_ref();
            debug_assert_eq!(v.len(), n);
            out[b * self.window + first..b * self.window + first + n].copy_from_slice(&v[..n]);
        }
        out
    }

    /// Scatters `width` values per response token (row-major `[tokens, width]`) of each sample
    /// into a `[batch, window, width]` vector; a `None` sample and every padding position hold
    /// `fill`. `values[i]`, when given, must hold sample `i`'s response length × `width` values.
    pub fn scatter_rows<T: Copy>(&self, values: &[Option<&[T]>], width: usize, fill: T) -> Vec<T> {
        let mut out = vec![fill; self.batch * self.window * width];
        for (b, (&(first, n), v)) in self.spans.iter().zip(values).enumerate() {
            let Some(v) = v else { continue };
            debug_assert_eq!(v.len(), n * width);
            let at = (b * self.window + first) * width;
            out[at..at + n * width].copy_from_slice(&v[..n * width]);
        }
        out
    }

    /// Gathers a `[batch, window]` vector back into one per-token vector per sample.
    pub fn gather(&self, flat: &[f32]) -> Vec<Vec<f32>> {
        self.spans
            .iter()
            .enumerate()
            .map(|(b, &(first, n))| {
                flat[b * self.window + first..b * self.window + first + n].to_vec()
            })
            .collect()
    }

    /// Total response tokens in the batch.
    pub fn tokens(&self) -> usize {
        self.spans.iter().map(|s| s.1).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(p: &[u32], r: &[u32]) -> Sample {
        Sample::new(p.to_vec(), r.to_vec(), 1.0)
    }

    #[test]
    fn layout_places_responses_at_shifted_positions() {
        let s = [sample(&[1, 2, 3], &[4, 5]), sample(&[7], &[8, 9, 10])];
        let l = BatchLayout::new(&s, None, 0, Some(16)).unwrap();
        assert_eq!(l.seq_len, 5);
        assert_eq!(l.window_start, 0);
        assert_eq!(l.window, 4);
        assert_eq!(l.input_ids, vec![1, 2, 3, 4, 5, 7, 8, 9, 10, 0]);
        // Sample 0: logits at 2 and 3 predict 4 and 5.
        assert_eq!(&l.targets[..4], &[0, 0, 4, 5]);
        assert_eq!(&l.mask[..4], &[0.0, 0.0, 1.0, 1.0]);
        // Sample 1: logits at 0, 1, 2 predict 8, 9, 10.
        assert_eq!(&l.targets[4..], &[8, 9, 10, 0]);
        assert_eq!(l.spans, vec![(2, 2), (0, 3)]);
        let w: f32 = l.weights.iter().sum();
        assert!((w - 1.0).abs() < 1e-6);
        assert_eq!(l.weights[2], 0.25);
        assert!((l.weights[4] - 1.0 / 6.0).abs() < 1e-7);
        let v = l.scatter(&[vec![0.5, 0.6], vec![1.0, 2.0, 3.0]]);
        assert_eq!(l.gather(&v), vec![vec![0.5, 0.6], vec![1.0, 2.0, 3.0]]);
        // Two values per token; sample 1 absent.
        let rows = l.scatter_rows(&[Some(&[1, 2, 3, 4][..]), None], 2, 9);
        assert_eq!(rows, vec![9, 9, 9, 9, 1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9]);
        assert_eq!(l.tokens(), 5);
    }

    #[test]
    fn extra_padding_only_grows_input() {
        let s = [sample(&[1, 2], &[3])];
        let l = BatchLayout::new(&s, Some(6), 0, None).unwrap();
        assert_eq!(l.input_ids, vec![1, 2, 3, 0, 0, 0]);
        assert_eq!((l.window_start, l.window), (1, 1));
        assert!(matches!(
            BatchLayout::new(&s, Some(2), 0, None),
            Err(LayoutError::PadTooShort { .. })
        ));
    }

    #[test]
    fn bad_samples_are_refused_naming_the_field() {
        let mut s = sample(&[1], &[2, 3]);
        s.advantages.pop();
        assert_eq!(
            s.validate(None),
            Err(SampleError::Length {
                field: "advantages",
                got: 1,
                expected: 2
            })
        );
        let mut s = sample(&[1], &[2, 3]);
        s.old_logprobs = Some(vec![-1.0, f32::NAN]);
        assert!(matches!(
            s.validate(None),
            Err(SampleError::NonFinite {
                field: "old_logprobs",
                index: 1,
                ..
            })
        ));
        assert_eq!(
            sample(&[1], &[]).validate(None),
            Err(SampleError::EmptyResponse)
        );
        assert_eq!(
            sample(&[], &[1]).validate(None),
            Err(SampleError::EmptyPrompt)
        );
        assert!(matches!(
            sample(&[1], &[99]).validate(Some(50)),
            Err(SampleError::TokenOutOfVocab {
                field: "response_ids",
                id: 99,
                ..
            })
        ));
        assert!(matches!(
            BatchLayout::new(&[sample(&[1], &[2]), sample(&[1], &[])], None, 0, None),
            Err(LayoutError::Sample { index: 1, .. })
        ));
    }
}
