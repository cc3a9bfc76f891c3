//! The key/value cache of one sequence, kept outside the model so that any number of sequences
//! share one set of weights. Its memory is bounded by the sequence's maximum context (appending
//! past it is an error) and released when the cache is dropped.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Errors of cache-backed model calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvCacheError {
    /// No tokens were given.
    #[error("no tokens to feed")]
    Empty,
    /// The sequence would exceed its maximum context.
    #[error("context full: {len} cached + {adding} new tokens exceed the maximum of {max}")]
    Full {
        /// Tokens already cached.
        len: usize,
        /// Tokens being added.
        adding: usize,
        /// The bound.
        max: usize,
    },
}

/// One layer's keys and values, each `[1, kv_heads, positions, head_dim]`.
pub type LayerKv<B> = (Tensor<B, 4>, Tensor<B, 4>);

/// Per-layer keys and values of one sequence, each `[1, kv_heads, len, head_dim]`.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
    len: usize,
    max_len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `num_layers` layers holding at most `max_len` positions.
    pub fn new(num_layers: usize, max_len: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
            max_len,
        }
    }

    /// This empty cache holding `len` positions already: `layers[l]` are layer `l`'s keys and
    /// values, each `[1, kv_heads, len, head_dim]` (a reused prompt prefix).
    pub(crate) fn with_prefix(mut self, layers: Vec<LayerKv<B>>, len: usize) -> Self {
        assert_eq!(layers.len(), self.layers.len(), "one (k, v) per layer");
        assert!(
            self.is_empty() && len <= self.max_len,
            "a prefix fits an empty cache"
        );
        self.layers = layers.into_iter().map(Some).collect();
        self.len = len;
        self
    }

    /// Layer by layer, the keys and values of `positions` as tensors of their own. A slice is a
    /// view that keeps the whole sequence's buffer alive; adding it to zeros makes a copy on
    /// every backend, so what is kept is what is counted.
    pub(crate) fn copy_range(&self, positions: std::ops::Range<usize>) -> Vec<LayerKv<B>> {
        assert!(positions.end <= self.len, "copying cached positions only");
        let own = |t: &Tensor<B, 4>| {
            let [b, h, _, d] = t.dims();
            let view = t.clone().slice([0..b, 0..h, positions.clone(), 0..d]);
            view.zeros_like() + view
        };
        self.layers
            .iter()
            .map(|slot| {
                let (k, v) = slot
                    .as_ref()
                    .expect("every layer holds the cached positions");
                (own(k), own(v))
            })
            .collect()
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bound on cached positions.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Fails when `adding` more positions would not fit.
    pub fn check_room(&self, adding: usize) -> Result<(), KvCacheError> {
        if self.len + adding > self.max_len {
            return Err(KvCacheError::Full {
                len: self.len,
                adding,
                max: self.max_len,
            });
        }
        Ok(())
    }

    /// Appends `k`, `v` (`[1, kv_heads, s, d]`) to layer `layer` and returns the layer's full
    /// keys and values. The length only moves on [`KvCache::advance`], after all layers.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let slot = &mut self.layers[layer];
        let (k_all, v_all) = match slot.take() {
            None => (k, v),
            Some((k0, v0)) => (Tensor::cat(vec![k0, k], 2), Tensor::cat(vec![v0, v], 2)),
        };
        *slot = Some((k_all.clone(), v_all.clone()));
        (k_all, v_all)
    }

    /// Records that `n` positions were appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
