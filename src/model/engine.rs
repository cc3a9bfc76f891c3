//! The generation engine: one scheduler thread that owns all sequence state and batches
//! concurrent requests. Callers hold an [`EngineHandle`] and send commands with a oneshot reply
//! (the whole result) or a stream ([`EngineHandle::submit_streaming`]: each token as sampled).
//! Between decode steps the scheduler admits waiting requests (prefilling each into its own
//! [`KvCache`]) and retires finished ones (dropping their cache), so sequences join and leave a
//! running batch. The weights are shared behind an `Arc` and never copied per sequence.
//!
//! Each request has its own seeded RNG, so its output does not depend on what it is batched with
//! (up to floating-point differences between batch shapes). Log-probs are those of
//! [`super::sampling`]: under `softmax(logits / T)`, before top-k/top-p truncation; a request
//! may also ask for raw log-probs (under `softmax(logits)`) with the most likely alternatives.
//!
//! Adapters: [`EngineHandle::attach`] gives the engine a LoRA adapter over its base weights and
//! returns a handle whose requests run with it. Sequences of any adapters, and of the base, are
//! decoded in one batch: the base products once for every row, each adapter's over its own rows
//! ([`Qwen3::decode_step_mixed`]). A sequence keeps the adapter it was admitted with to its end;
//! the engine forgets an adapter (and its cached prefixes) once its last handle is dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::kv_cache::{KvCache, LayerKv};
use super::lora::LoraWeights;
use super::prefix_cache::PrefixIndex;
use super::qwen3::Qwen3;
use super::sampling::{raw_logprobs, sample_token, RawLogprobs, SamplingError, SamplingParams};

/// Engine-wide limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Most sequences decoded together in one step.
    pub max_batch: usize,
    /// Most positions (prompt + response) one sequence may hold; its KV cache never grows past
    /// this (capped at the model's `max_position_embeddings`).
    pub max_context: usize,
    /// Bytes of prompt keys and values kept for reuse by later prompts with the same prefix
    /// (blocks of [`PREFIX_BLOCK_TOKENS`]); 0 turns the prefix cache off.
    pub prefix_cache_bytes: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_batch: 16,
            max_context: 4096,
            prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
        }
    }
}

/// Tokens per prefix-cache block: a prompt reuses whole blocks only, so a shared prefix loses
/// at most this many tokens less one; smaller blocks mean more tensors to join per reuse.
pub const PREFIX_BLOCK_TOKENS: usize = 64;

/// The default prefix-cache budget, 1 GiB: for Qwen3-0.6B in float32 (224 KiB of keys and
/// values per token: 28 layers × 2 × 8 heads × 128 × 4 bytes) about 4.7k tokens; a whole 12k
/// agent prompt of a small model (the 2-layer long-context bench shape: 512 bytes a token).
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 1 << 30;

/// One generation request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The tokenized prompt.
    pub prompt_ids: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
    /// `Some(k)`: also report each sampled token's [`RawLogprobs`] with its `k` most likely
    /// alternatives (`k` ≤ [`MAX_TOP_LOGPROBS`]); `None`: only the sampling log-probs.
    pub raw_logprobs: Option<usize>,
}

/// The most alternatives a request may ask for per token (as OpenAI's `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl GenerationRequest {
    /// A request for `prompt_ids` sampled with `params`, reporting no raw log-probs.
    pub fn new(prompt_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            prompt_ids,
            params,
            raw_logprobs: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was sampled (it is the last response id).
    Stop,
    /// The decoded response contains a stop string.
    StopString,
    /// `max_new_tokens` were generated.
    Length,
    /// The sequence reached the maximum context.
    ContextFull,
}

/// The outcome of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationResult {
    /// Sampled ids (a final stop token included).
    pub response_ids: Vec<u32>,
    /// Log-prob of each sampled id under the temperature-scaled distribution, before top-k /
    /// top-p truncation.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Prompt tokens whose keys and values came from the prefix cache instead of a prefill.
    pub cached_tokens: usize,
    /// Per sampled id, its [`RawLogprobs`] when the request asked for them; empty otherwise.
    pub raw_logprobs: Vec<RawLogprobs>,
}

/// A request the engine refused or could not finish.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The sampling parameters are invalid.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The prompt is empty.
    #[error("empty prompt")]
    EmptyPrompt,
    /// A prompt token is outside the vocabulary.
    #[error("prompt token {token} at position {position} is outside the vocabulary of {vocab}")]
    BadToken {
        /// The id.
        token: u32,
        /// Where.
        position: usize,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The prompt leaves no room for even one new token.
    #[error("prompt of {len} tokens leaves no room in the maximum context of {max}")]
    PromptTooLong {
        /// Prompt length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// More alternatives per token were asked for than [`MAX_TOP_LOGPROBS`].
    #[error("{asked} top log-probs per token asked for; at most {MAX_TOP_LOGPROBS}")]
    TooManyTopLogprobs {
        /// What was asked.
        asked: usize,
    },
    /// Stop strings were given but the engine has no tokenizer to decode with.
    #[error("stop strings need an engine with a tokenizer")]
    NoTokenizer,
    /// The request's adapter could not be attached to the engine's base weights.
    #[error("the adapter does not fit the served model: {0}")]
    Adapter(String),
    /// The engine thread is gone.
    #[error("the generation engine has shut down")]
    Closed,
}

/// One event of a streamed request ([`EngineHandle::submit_streaming`]), in order: a `Token`
/// per sampled id, the moment it is sampled, then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// One sampled id and its log-prob (as in [`GenerationResult::logprobs`]).
    Token {
        /// The id.
        id: u32,
        /// Its log-prob.
        logprob: f32,
        /// Its raw log-probs, when the request asked for them.
        raw: Option<RawLogprobs>,
    },
    /// Generation ended; the result repeats every id and log-prob sent as `Token`s.
    Finished(GenerationResult),
    /// The request was refused (nothing was sampled).
    Failed(EngineError),
}

/// Where a request's outcome goes.
enum Reply {
    /// The whole result at the end.
    Once(oneshot::Sender<Result<GenerationResult, EngineError>>),
    /// Every token as it is sampled, then the result.
    Stream(mpsc::UnboundedSender<StreamEvent>),
}

impl Reply {
    /// Whether the caller has gone away (the request is then cancelled).
    fn is_closed(&self) -> bool {
        match self {
            Reply::Once(tx) => tx.is_closed(),
            Reply::Stream(tx) => tx.is_closed(),
        }
    }

    fn token(&self, id: u32, logprob: f32, raw: Option<&RawLogprobs>) {
        if let Reply::Stream(tx) = self {
            let _ = tx.send(StreamEvent::Token {
                id,
                logprob,
                raw: raw.cloned(),
            });
        }
    }

    fn send(self, result: Result<GenerationResult, EngineError>) {
        match self {
            Reply::Once(tx) => {
                let _ = tx.send(result);
            }
            Reply::Stream(tx) => {
                let _ = tx.send(match result {
                    Ok(r) => StreamEvent::Finished(r),
                    Err(e) => StreamEvent::Failed(e),
                });
            }
        }
    }
}

/// Which weights a request runs on: [`BASE`] for the engine's own, else an attached adapter.
type AdapterKey = u64;

/// The engine's own weights.
const BASE: AdapterKey = 0;

/// Adapter keys, unique in the process (so never reused by an engine).
static NEXT_ADAPTER: AtomicU64 = AtomicU64::new(BASE + 1);

enum Command {
    Generate(GenerationRequest, AdapterKey, Reply),
    Attach(AdapterKey, Box<LoraWeights>),
    Detach(AdapterKey),
}

/// An adapter attached to an engine; detaches it when the last handle using it is dropped.
struct Attached {
    key: AdapterKey,
    tx: mpsc::UnboundedSender<Command>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Detach(self.key));
    }
}

/// A cheap, cloneable handle to a running engine, running its requests on the engine's own
/// weights or on one attached adapter ([`EngineHandle::attach`]). The engine stops when every
/// handle is dropped and its running sequences are done.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    adapter: Option<Arc<Attached>>,
}

impl EngineHandle {
    fn key(&self) -> AdapterKey {
        self.adapter.as_ref().map_or(BASE, |a| a.key)
    }

    /// A handle to the same engine whose requests run on its own weights, without this
    /// handle's adapter.
    pub fn base(&self) -> EngineHandle {
        EngineHandle {
            tx: self.tx.clone(),
            adapter: None,
        }
    }

    /// A handle to the same engine whose requests run with `adapter` attached to the engine's
    /// base weights (its own weights without any adapter they carry). The adapter's tensors are
    /// built on the engine thread before any request of the new handle; if they do not fit the
    /// base, its requests fail with [`EngineError::Adapter`]. Dropping the last clone of the
    /// new handle detaches the adapter once its sequences are done.
    pub fn attach(&self, adapter: LoraWeights) -> EngineHandle {
        let key = NEXT_ADAPTER.fetch_add(1, Ordering::Relaxed);
        // If the engine is gone, requests on the new handle report `Closed`.
        let _ = self.tx.send(Command::Attach(key, Box::new(adapter)));
        EngineHandle {
            tx: self.tx.clone(),
            adapter: Some(Arc::new(Attached {
                key,
                tx: self.tx.clone(),
            })),
        }
    }

    /// Submits a request; the receiver resolves when it finishes (await it, or
    /// `blocking_recv` it outside async code).
    pub fn submit(
        &self,
        request: GenerationRequest,
    ) -> oneshot::Receiver<Result<GenerationResult, EngineError>> {
        let (tx, rx) = oneshot::channel();
        // If the engine is gone, `tx` is dropped and the receiver reports it.
        let _ = self
            .tx
            .send(Command::Generate(request, self.key(), Reply::Once(tx)));
        rx
    }

    /// Submits a request whose tokens are reported as they are sampled (see [`StreamEvent`]).
    /// Dropping the receiver cancels the request at the next decode step. If the engine is
    /// gone, the receiver yields `Failed(EngineError::Closed)`.
    pub fn submit_streaming(
        &self,
        request: GenerationRequest,
    ) -> mpsc::UnboundedReceiver<StreamEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Err(mpsc::error::SendError(Command::Generate(_, _, reply))) = self
            .tx
            .send(Command::Generate(request, self.key(), Reply::Stream(tx)))
        {
            reply.send(Err(EngineError::Closed));
        }
        rx
    }

    /// Generates (async).
    pub async fn generate(
        &self,
        request: GenerationRequest,
    ) -> Result<GenerationResult, EngineError> {
        self.submit(request)
            .await
            .map_err(|_| EngineError::Closed)?
    }

    /// Generates, blocking the calling (non-async) thread.
    pub fn generate_blocking(
        &self,
        request: GenerationRequest,
    ) -> Result<GenerationResult, EngineError> {
        self.submit(request)
            .blocking_recv()
            .map_err(|_| EngineError::Closed)?
    }
}

/// Starts an engine thread over shared weights. `tokenizer` is needed only for stop strings.
pub fn spawn_engine<B: Backend>(
    model: Arc<Qwen3<B>>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    options: EngineOptions,
) -> EngineHandle
where
    Qwen3<B>: Send + Sync,
{
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("clawrl-generate".into())
        .spawn(move || Scheduler::new(model, tokenizer, options).run(rx))
        .expect("spawning the engine thread");
    EngineHandle { tx, adapter: None }
}

/// One sequence being decoded.
struct Active<B: Backend> {
    /// The weights it runs on: the engine's own, or an adapter's.
    model: Arc<Qwen3<B>>,
    params: SamplingParams,
    raw_k: Option<usize>,
    raw: Vec<RawLogprobs>,
    rng: StdRng,
    cache: KvCache<B>,
    cached_tokens: usize,
    response: Vec<u32>,
    logprobs: Vec<f32>,
    reply: Reply,
}

/// A request waiting for room in the batch.
struct Waiting<B: Backend> {
    request: GenerationRequest,
    key: AdapterKey,
    weights: Result<Arc<Qwen3<B>>, EngineError>,
    reply: Reply,
}

/// The scheduler state, owned by the engine thread.
pub struct Scheduler<B: Backend> {
    model: Arc<Qwen3<B>>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    options: EngineOptions,
    /// Requests not yet admitted, each with the weights it runs on (resolved when it arrived,
    /// so an adapter detached after that still serves it).
    waiting: VecDeque<Waiting<B>>,
    active: Vec<Active<B>>,
    /// Attached adapters: the engine's base with each one's tensors (or why they did not fit).
    adapters: HashMap<AdapterKey, Result<Arc<Qwen3<B>>, String>>,
    /// Prompt blocks' keys and values, per layer; `None` when the budget is 0.
    prefix: Option<PrefixIndex<Vec<LayerKv<B>>>>,
}

impl<B: Backend> Scheduler<B> {
    fn new(
        model: Arc<Qwen3<B>>,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: EngineOptions,
    ) -> Self {
        Self {
            model,
            tokenizer,
            options,
            waiting: VecDeque::new(),
            active: Vec::new(),
            adapters: HashMap::new(),
            prefix: (options.prefix_cache_bytes > 0)
                .then(|| PrefixIndex::new(PREFIX_BLOCK_TOKENS, options.prefix_cache_bytes)),
        }
    }

    fn max_context(&self) -> usize {
        self.options
            .max_context
            .min(self.model.max_position_embeddings)
    }

    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        let mut open = true;
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                if !open {
                    return;
                }
                match rx.blocking_recv() {
                    Some(c) => self.accept(c),
                    None => return,
                }
            }
            // Take every command already queued, without blocking.
            while open {
                match rx.try_recv() {
                    Ok(c) => self.accept(c),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            self.admit();
            self.step();
        }
    }

    fn accept(&mut self, c: Command) {
        match c {
            Command::Generate(request, key, reply) => {
                let weights = self.weights(key);
                self.waiting.push_back(Waiting {
                    request,
                    key,
                    weights,
                    reply,
                })
            }
            Command::Attach(key, weights) => {
                // The base's tensors are shared, not copied: only the adapter's are new.
                let model = (*self.model)
                    .clone()
                    .without_lora()
                    .with_lora(&weights)
                    .map(Arc::new)
                    .map_err(|e| e.to_string());
                self.adapters.insert(key, model);
            }
            Command::Detach(key) => {
                // Sequences admitted with it hold their own `Arc` and finish on it.
                self.adapters.remove(&key);
                if let Some(index) = &mut self.prefix {
                    index.forget(key);
                }
            }
        }
    }

    /// The weights requests with `key` run on.
    fn weights(&self, key: AdapterKey) -> Result<Arc<Qwen3<B>>, EngineError> {
        if key == BASE {
            return Ok(self.model.clone());
        }
        match self.adapters.get(&key) {
            Some(Ok(model)) => Ok(model.clone()),
            Some(Err(e)) => Err(EngineError::Adapter(e.clone())),
            None => Err(EngineError::Adapter("it was detached".into())),
        }
    }

    fn validate(&self, req: &GenerationRequest) -> Result<(), EngineError> {
        req.params.validate()?;
        if req.prompt_ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(asked) = req.raw_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(EngineError::TooManyTopLogprobs { asked });
        }
        let vocab = self.model.vocab_size();
        if let Some((position, &token)) = req
            .prompt_ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(EngineError::BadToken {
                token,
                position,
                vocab,
            });
        }
        if req.prompt_ids.len() >= self.max_context() {
            return Err(EngineError::PromptTooLong {
                len: req.prompt_ids.len(),
                max: self.max_context(),
            });
        }
        if !req.params.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::NoTokenizer);
        }
        Ok(())
    }

    /// Prefills waiting requests while the batch has room; each gets its first token.
    fn admit(&mut self) {
        while self.active.len() < self.options.max_batch.max(1) {
            let Some(Waiting {
                request: req,
                key,
                weights,
                reply,
            }) = self.waiting.pop_front()
            else {
                return;
            };
            if reply.is_closed() {
                continue;
            }
            let model = match self.validate(&req).and(weights) {
                Ok(model) => model,
                Err(e) => {
                    reply.send(Err(e));
                    continue;
                }
            };
            let (mut cache, cached_tokens) = self.cached_prefix(key, &req.prompt_ids);
            let logits = model
                .prefill(&req.prompt_ids[cached_tokens..], &mut cache)
                .expect("validated prompt fits the cache");
            self.remember_prefix(key, &req.prompt_ids, cached_tokens, &cache);
            let row: Vec<f32> = logits.into_data().convert::<f32>().to_vec().expect("f32");
            let mut seq = Active {
                model,
                rng: StdRng::seed_from_u64(req.params.seed),
                params: req.params,
                raw_k: req.raw_logprobs,
                raw: Vec::new(),
                cache,
                cached_tokens,
                response: Vec::new(),
                logprobs: Vec::new(),
                reply,
            };
            if let Some(reason) = self.push_sample(&mut seq, &row) {
                self.finish(seq, reason);
            } else {
                self.active.push(seq);
            }
        }
    }

    /// A new sequence cache holding the longest prefix of `prompt` cached for the weights of
    /// `key`, and its length.
    fn cached_prefix(&mut self, key: AdapterKey, prompt: &[u32]) -> (KvCache<B>, usize) {
        let cache = self.model.new_cache(self.max_context());
        let Some(index) = &mut self.prefix else {
            return (cache, 0);
        };
        let hit = index.lookup(key, prompt);
        if hit.tokens == 0 {
            index.unpin(&hit);
            return (cache, 0);
        }
        let layers = (0..self.model.num_layers())
            .map(|l| {
                let (ks, vs): (Vec<_>, Vec<_>) = hit
                    .keys
                    .iter()
                    .map(|key| index.value(*key).expect("a hit's blocks are pinned")[l].clone())
                    .unzip();
                (Tensor::cat(ks, 2), Tensor::cat(vs, 2))
            })
            .collect();
        // The joined tensors are the sequence's own, so the blocks need no pin past this point.
        index.unpin(&hit);
        (cache.with_prefix(layers, hit.tokens), hit.tokens)
    }

    /// Caches the whole blocks of `prompt` after the first `cached` tokens for the weights of
    /// `key`, copied out of the sequence's `cache` (which holds the whole prompt).
    fn remember_prefix(
        &mut self,
        key: AdapterKey,
        prompt: &[u32],
        cached: usize,
        cache: &KvCache<B>,
    ) {
        // A detached adapter's blocks could never be looked up again.
        if key != BASE && !self.adapters.contains_key(&key) {
            return;
        }
        let Some(index) = &mut self.prefix else {
            return;
        };
        let block = index.block_tokens();
        index.insert(key, prompt, cached / block, |i| {
            let layers = cache.copy_range(i * block..(i + 1) * block);
            let bytes = layers
                .iter()
                .map(|(k, v)| (k.shape().num_elements() + v.shape().num_elements()) * 4)
                .sum();
            (layers, bytes)
        });
    }

    /// Samples the next token of `seq` from `row`; returns a finish reason if it is done.
    fn push_sample(&self, seq: &mut Active<B>, row: &[f32]) -> Option<FinishReason> {
        let (tok, lp) = sample_token(row, &seq.params, &mut seq.rng);
        seq.response.push(tok);
        seq.logprobs.push(lp);
        if let Some(k) = seq.raw_k {
            seq.raw.push(raw_logprobs(row, tok, k));
        }
        seq.reply.token(tok, lp, seq.raw_k.and(seq.raw.last()));
        if seq.params.stop_token_ids.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        if !seq.params.stop_strings.is_empty() {
            if let Some(tk) = &self.tokenizer {
                if let Ok(text) = tk.decode(&seq.response, false) {
                    if seq.params.stop_strings.iter().any(|s| text.contains(s)) {
                        return Some(FinishReason::StopString);
                    }
                }
            }
        }
        if seq.response.len() >= seq.params.max_new_tokens {
            return Some(FinishReason::Length);
        }
        // Prompt plus response may not exceed the maximum context (the just-sampled token is
        // not in the cache yet).
        if seq.cache.len() + 1 >= seq.cache.max_len() {
            return Some(FinishReason::ContextFull);
        }
        None
    }

    fn finish(&self, seq: Active<B>, reason: FinishReason) {
        let Active {
            response,
            logprobs,
            reply,
            cached_tokens,
            raw,
            ..
        } = seq; // the cache is dropped here, freeing its memory
        reply.send(Ok(GenerationResult {
            response_ids: response,
            logprobs,
            finish_reason: reason,
            cached_tokens,
            raw_logprobs: raw,
        }));
    }

    /// One decode step over every active sequence.
    fn step(&mut self) {
        // Drop sequences whose caller has gone away.
        self.active.retain(|s| !s.reply.is_closed());
        if self.active.is_empty() {
            return;
        }
        let tokens: Vec<u32> = self
            .active
            .iter()
            .map(|s| *s.response.last().expect("active sequences have a token"))
            .collect();
        // One set of weights for the whole batch decodes as it always did; a batch of several
        // runs the base products once and each adapter's over its rows.
        let models: Vec<Arc<Qwen3<B>>> = self.active.iter().map(|s| s.model.clone()).collect();
        let logits = {
            let mut caches: Vec<&mut KvCache<B>> =
                self.active.iter_mut().map(|s| &mut s.cache).collect();
            let base = &self.model;
            let decoded = crate::device::on_compute_pool::<B, _>(|| {
                if models.iter().all(|m| Arc::ptr_eq(m, &models[0])) {
                    models[0].decode_step(&tokens, &mut caches)
                } else {
                    let rows: Vec<&Qwen3<B>> = models.iter().map(|m| m.as_ref()).collect();
                    base.decode_step_mixed(&tokens, &mut caches, &rows)
                }
            });
            decoded.expect("room was checked when the token was sampled")
        };
        let vocab = self.model.vocab_size();
        let all: Vec<f32> = logits.into_data().convert::<f32>().to_vec().expect("f32");
        let active = std::mem::take(&mut self.active);
        for (i, mut seq) in active.into_iter().enumerate() {
            match self.push_sample(&mut seq, &all[i * vocab..(i + 1) * vocab]) {
                Some(reason) => self.finish(seq, reason),
                None => self.active.push(seq),
            }
        }
    }
}
