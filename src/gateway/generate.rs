//! Token-by-token generation for the gateway: one scheduler thread that batches every
//! concurrent request (streaming or not) and reports each sampled token as it is sampled.
//!
//! The model's [`crate::model::engine`] returns a whole response per request; real SSE
//! streaming needs every token the moment it exists, so this scheduler drives the same model
//! pieces ([`Qwen3::prefill`], [`Qwen3::decode_step`], [`sample_token`]) with the same rules
//! (validation, seeded per-request RNG, stop ids, stop strings, bounded context) and sends a
//! [`TokenEvent`] per token. Sequences join and leave between decode steps; a request whose
//! receiver is dropped (client gone) leaves at the next step.

use std::collections::VecDeque;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::sync::mpsc;

use crate::model::engine::{EngineError, EngineOptions, FinishReason};
use crate::model::kv_cache::KvCache;
use crate::model::qwen3::Qwen3;
use crate::model::sampling::{sample_token, SamplingParams};

/// What the scheduler reports for one request, in order: tokens, then exactly one `Done` or
/// `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// One sampled token and its log-prob (see [`crate::model::sampling`]).
    Token {
        /// The id.
        id: u32,
        /// Its log-prob.
        logprob: f32,
    },
    /// Generation ended.
    Done(FinishReason),
    /// The request was refused.
    Failed(EngineError),
}

struct Job {
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    events: mpsc::UnboundedSender<TokenEvent>,
}

/// A cloneable handle to the streaming scheduler; it stops when every handle is dropped and its
/// sequences are done.
#[derive(Clone)]
pub struct StreamingEngine {
    tx: mpsc::UnboundedSender<Job>,
}

impl StreamingEngine {
    /// Starts the scheduler thread over shared weights. `tokenizer` is needed for stop strings.
    pub fn spawn<B: Backend>(
        model: Arc<Qwen3<B>>,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: EngineOptions,
    ) -> Self
    where
        Qwen3<B>: Send + Sync,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("clawrl-gateway-generate".into())
            .spawn(move || {
                Scheduler {
                    model,
                    tokenizer,
                    options,
                    waiting: VecDeque::new(),
                    active: Vec::new(),
                }
                .run(rx)
            })
            .expect("spawning the gateway generation thread");
        Self { tx }
    }

    /// Submits a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn submit(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
    ) -> mpsc::UnboundedReceiver<TokenEvent> {
        let (events, rx) = mpsc::unbounded_channel();
        if let Err(e) = self.tx.send(Job {
            prompt_ids,
            params,
            events,
        }) {
            let _ = e.0.events.send(TokenEvent::Failed(EngineError::Closed));
        }
        rx
    }
}

struct Active<B: Backend> {
    params: SamplingParams,
    rng: StdRng,
    cache: KvCache<B>,
    response: Vec<u32>,
    events: mpsc::UnboundedSender<TokenEvent>,
}

struct Scheduler<B: Backend> {
    model: Arc<Qwen3<B>>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    options: EngineOptions,
    waiting: VecDeque<Job>,
    active: Vec<Active<B>>,
}

impl<B: Backend> Scheduler<B> {
    fn max_context(&self) -> usize {
        self.options
            .max_context
            .min(self.model.max_position_embeddings)
    }

    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Job>) {
        let mut open = true;
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                if !open {
                    return;
                }
                match rx.blocking_recv() {
                    Some(j) => self.waiting.push_back(j),
                    None => return,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            self.admit();
            self.step();
        }
    }

    fn validate(&self, job: &Job) -> Result<(), EngineError> {
        job.params.validate()?;
        if job.prompt_ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab = self.model.vocab_size();
        if let Some((position, &token)) = job
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
        if job.prompt_ids.len() >= self.max_context() {
            return Err(EngineError::PromptTooLong {
                len: job.prompt_ids.len(),
                max: self.max_context(),
            });
        }
        if !job.params.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::NoTokenizer);
        }
        Ok(())
    }

    fn admit(&mut self) {
        while self.active.len() < self.options.max_batch.max(1) {
            let Some(job) = self.waiting.pop_front() else {
                return;
            };
            if job.events.is_closed() {
                continue;
            }
            if let Err(e) = self.validate(&job) {
                let _ = job.events.send(TokenEvent::Failed(e));
                continue;
            }
            let mut cache = self.model.new_cache(self.max_context());
            let logits = self
                .model
                .prefill(&job.prompt_ids, &mut cache)
                .expect("validated prompt fits the cache");
            let row: Vec<f32> = logits.into_data().convert::<f32>().to_vec().expect("f32");
            let mut seq = Active {
                rng: StdRng::seed_from_u64(job.params.seed),
                params: job.params,
                cache,
                response: Vec::new(),
                events: job.events,
            };
            match self.push_sample(&mut seq, &row) {
                Some(reason) => {
                    let _ = seq.events.send(TokenEvent::Done(reason));
                }
                None => self.active.push(seq),
            }
        }
    }

    /// Samples and reports the next token of `seq`; returns a finish reason if it is done.
    fn push_sample(&self, seq: &mut Active<B>, row: &[f32]) -> Option<FinishReason> {
        let (tok, lp) = sample_token(row, &seq.params, &mut seq.rng);
        seq.response.push(tok);
        let _ = seq.events.send(TokenEvent::Token {
            id: tok,
            logprob: lp,
        });
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
        if seq.cache.len() + 1 >= seq.cache.max_len() {
            return Some(FinishReason::ContextFull);
        }
        None
    }

    fn step(&mut self) {
        self.active.retain(|s| !s.events.is_closed());
        if self.active.is_empty() {
            return;
        }
        let tokens: Vec<u32> = self
            .active
            .iter()
            .map(|s| *s.response.last().expect("active sequences have a token"))
            .collect();
        let logits = {
            let mut caches: Vec<&mut KvCache<B>> =
                self.active.iter_mut().map(|s| &mut s.cache).collect();
            self.model
                .decode_step(&tokens, &mut caches)
                .expect("room was checked when the token was sampled")
        };
        let vocab = self.model.vocab_size();
        let all: Vec<f32> = logits.into_data().convert::<f32>().to_vec().expect("f32");
        let active = std::mem::take(&mut self.active);
        for (i, mut seq) in active.into_iter().enumerate() {
            match self.push_sample(&mut seq, &all[i * vocab..(i + 1) * vocab]) {
                Some(reason) => {
                    let _ = seq.events.send(TokenEvent::Done(reason));
                }
                None => self.active.push(seq),
            }
        }
    }
}
