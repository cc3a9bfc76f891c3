//! The generation engine and scoring on the tiny fixture: batched greedy equals the reference,
//! scoring equals generation log-probs, seeded sampling is reproducible and batch-independent,
//! and every finish reason is reached.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clawrl::model::{
    load_checkpoint, score_batch, score_response, score_response_topk, spawn_engine, EngineError,
    EngineHandle, EngineOptions, FinishReason, GenerationRequest, SamplingParams, StreamEvent,
};
use clawrl::CpuBackend;

type B = CpuBackend;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny")
}

struct Case {
    ids: Vec<u32>,
    greedy: Vec<u32>,
    greedy_lp: Vec<f64>,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let u = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            ids: u(&c["input_ids"]),
            greedy: u(&c["greedy_16"]),
            greedy_lp: c["greedy_16_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect(),
        })
        .collect()
}

fn engine(max_batch: usize, max_context: usize) -> (EngineHandle, Arc<clawrl::model::Qwen3<B>>) {
    engine_with_cache(max_batch, max_context, 0)
}

fn engine_with_cache(
    max_batch: usize,
    max_context: usize,
    prefix_cache_bytes: usize,
) -> (EngineHandle, Arc<clawrl::model::Qwen3<B>>) {
    let ck = load_checkpoint::<B>(&fixture_dir(), &Default::default()).unwrap();
    let model = Arc::new(ck.model);
    let h = spawn_engine(
        model.clone(),
        Some(Arc::new(ck.tokenizer)),
        EngineOptions {
            max_batch,
            max_context,
            prefix_cache_bytes,
        },
    );
    (h, model)
}

fn req(ids: &[u32], temperature: f32, max_new: usize, seed: u64) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: ids.to_vec(),
        params: SamplingParams {
            temperature,
            max_new_tokens: max_new,
            seed,
            ..Default::default()
        },
        raw_logprobs: None,
    }
}

#[test]
fn concurrent_greedy_requests_match_reference_and_join_and_leave() {
    let (h, _) = engine(3, 1024);
    let cases = cases();
    // Different lengths so sequences leave at different steps; 4 requests with a batch of 3,
    // so the last one joins a running batch when the first leaves.
    let lens = [16, 5, 11, 16];
    let rxs: Vec<_> = cases
        .iter()
        .zip(lens)
        .map(|(c, n)| h.submit(req(&c.ids, 0.0, n, 0)))
        .collect();
    for ((c, n), rx) in cases.iter().zip(lens).zip(rxs) {
        let r = rx.blocking_recv().unwrap().unwrap();
        assert_eq!(r.response_ids, c.greedy[..n], "greedy ids");
        assert_eq!(r.finish_reason, FinishReason::Length);
        for (g, w) in r.logprobs.iter().zip(&c.greedy_lp) {
            assert!((*g as f64 - w).abs() < 1e-4, "logprob {g} vs {w}");
        }
    }
}

/// A prompt that extends a cached one computes only its new tokens, and answers exactly as an
/// engine without the cache: the same greedy ids, log-probs within float rounding. Requests
/// that share the prefix at the same time share its blocks.
#[test]
fn the_prefix_cache_reuses_whole_blocks_and_changes_no_answer() {
    let (cached, _) = engine_with_cache(4, 1024, 64 << 20);
    let (plain, _) = engine(4, 1024);
    // A long shared prefix (2 blocks of 64 and a partial third), then different endings.
    let base: Vec<u32> = cases()
        .iter()
        .flat_map(|c| c.ids.clone())
        .cycle()
        .take(150)
        .collect();
    let ending = |k: u32| -> Vec<u32> { base.iter().copied().chain(k * 7..k * 7 + 20).collect() };
    let greedy = |h: &EngineHandle, ids: &[u32]| h.submit(req(ids, 0.0, 8, 0));

    let first = greedy(&cached, &base).blocking_recv().unwrap().unwrap();
    assert_eq!(
        first.cached_tokens, 0,
        "nothing is cached before the first prompt"
    );
    let prompts: Vec<Vec<u32>> = (1..4).map(ending).collect();
    let rxs: Vec<_> = prompts.iter().map(|p| greedy(&cached, p)).collect();
    for (p, rx) in prompts.iter().zip(rxs) {
        let got = rx.blocking_recv().unwrap().unwrap();
        let want = greedy(&plain, p).blocking_recv().unwrap().unwrap();
        assert_eq!(
            got.cached_tokens, 128,
            "the two whole blocks of the shared prefix"
        );
        assert_eq!(want.cached_tokens, 0);
        assert_eq!(got.response_ids, want.response_ids, "greedy ids");
        for (g, w) in got.logprobs.iter().zip(&want.logprobs) {
            assert!((g - w).abs() < 1e-4, "logprob {g} vs {w}");
        }
    }
    // A 200-token prompt caches its own third block; asked again, it reuses three blocks
    // (its last token always runs: its logits give the first answer token).
    let long: Vec<u32> = base.iter().copied().chain(300..350).collect();
    let once = greedy(&cached, &long).blocking_recv().unwrap().unwrap();
    let twice = greedy(&cached, &long).blocking_recv().unwrap().unwrap();
    assert_eq!((once.cached_tokens, twice.cached_tokens), (128, 192));
    assert_eq!(once.response_ids, twice.response_ids);
}

#[test]
fn scoring_equals_generation_logprobs() {
    let (h, model) = engine(4, 1024);
    let cases = cases();
    // Sampled at temperature 1: scoring (a plain forward pass) gives the same log-probs.
    let results: Vec<_> = cases
        .iter()
        .map(|c| h.submit(req(&c.ids, 1.0, 12, 42)))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|rx| rx.blocking_recv().unwrap().unwrap())
        .collect();
    let pairs: Vec<(&[u32], &[u32])> = cases
        .iter()
        .zip(&results)
        .map(|(c, r)| (c.ids.as_slice(), r.response_ids.as_slice()))
        .collect();
    let scored = score_batch(&model, &pairs);
    for (r, s) in results.iter().zip(&scored) {
        assert_eq!(r.logprobs.len(), s.len());
        for (a, b) in r.logprobs.iter().zip(s) {
            assert!((a - b).abs() < 1e-4, "generation {a} vs scoring {b}");
        }
    }
    // And the greedy reference continuation scores to the reference log-probs.
    let c = &cases[0];
    let s = score_response(&model, &c.ids, &c.greedy);
    for (a, b) in s.iter().zip(&c.greedy_lp) {
        assert!((*a as f64 - b).abs() < 1e-4);
    }
}

#[test]
fn raw_logprobs_are_the_models_own_distribution_with_its_top_tokens() {
    let (h, model) = engine(4, 1024);
    let c = &cases()[2];
    // Sampled at temperature 0.7 with top-k 5: the raw log-probs ignore both.
    let mut r = req(&c.ids, 0.7, 10, 3);
    r.params.top_k = 5;
    r.raw_logprobs = Some(4);
    let out = h.generate_blocking(r.clone()).unwrap();
    assert_eq!(out.raw_logprobs.len(), out.response_ids.len());
    let reference = score_response_topk(&model, &c.ids, &out.response_ids, 4);
    for (i, raw) in out.raw_logprobs.iter().enumerate() {
        assert!((raw.logprob - reference.logprobs[i]).abs() < 1e-4);
        assert_eq!(raw.top.len(), 4);
        for (j, &(id, lp)) in raw.top.iter().enumerate() {
            assert_eq!(id, reference.ids[i * 4 + j], "token {i}, rank {j}");
            assert!((lp - reference.topk_logprobs[i * 4 + j]).abs() < 1e-4);
        }
        // The sampled token is under its sampling distribution, tempered: not the raw one.
        assert!((out.logprobs[i] - raw.logprob).abs() > 1e-6);
    }
    // Streamed, each token carries the same raw log-probs as the result.
    let mut rx = h.submit_streaming(r);
    let mut streamed = Vec::new();
    let finished = loop {
        match rx.blocking_recv().expect("a result ends the stream") {
            StreamEvent::Token { raw, .. } => streamed.push(raw.expect("asked for")),
            StreamEvent::Finished(f) => break f,
            StreamEvent::Failed(e) => panic!("refused: {e}"),
        }
    };
    assert_eq!(finished, out);
    assert_eq!(streamed, out.raw_logprobs);
    // None unless asked, and at most 20 alternatives.
    assert!(h
        .generate_blocking(req(&c.ids, 0.7, 3, 3))
        .unwrap()
        .raw_logprobs
        .is_empty());
    let mut r = req(&c.ids, 0.7, 3, 3);
    r.raw_logprobs = Some(21);
    assert!(matches!(
        h.generate_blocking(r),
        Err(EngineError::TooManyTopLogprobs { asked: 21 })
    ));
}

#[test]
fn seeded_sampling_is_reproducible_and_batch_independent() {
    let (h, _) = engine(8, 1024);
    let cases = cases();
    let alone = h.generate_blocking(req(&cases[1].ids, 0.9, 16, 7)).unwrap();
    let again = h.generate_blocking(req(&cases[1].ids, 0.9, 16, 7)).unwrap();
    assert_eq!(alone.response_ids, again.response_ids);
    // The same request inside a batch of others.
    let rxs: Vec<_> = [0usize, 1, 2, 3]
        .iter()
        .map(|&i| h.submit(req(&cases[i].ids, 0.9, 16, if i == 1 { 7 } else { 99 })))
        .collect();
    let batched: Vec<_> = rxs
        .into_iter()
        .map(|rx| rx.blocking_recv().unwrap().unwrap())
        .collect();
    assert_eq!(batched[1].response_ids, alone.response_ids);
    let other = h.generate_blocking(req(&cases[1].ids, 0.9, 16, 8)).unwrap();
    assert_ne!(other.response_ids, alone.response_ids);
}

#[test]
fn finish_reasons_and_bounds() {
    let (h, _) = engine(4, 30);
    let c = &cases()[0]; // 23 prompt tokens
                         // Stop token: the 4th greedy token.
    let mut r = req(&c.ids, 0.0, 16, 0);
    r.params.stop_token_ids = vec![c.greedy[3]];
    let out = h.generate_blocking(r).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.response_ids, c.greedy[..4]);
    // Context: 23 + 7 = 30 positions; the 7th token is sampled but cannot be fed.
    let out = h.generate_blocking(req(&c.ids, 0.0, 16, 0)).unwrap();
    assert_eq!(out.finish_reason, FinishReason::ContextFull);
    assert_eq!(out.response_ids, c.greedy[..7]);
    // Stop string: the decoded text of the greedy tokens of case 0 contains "W".
    let mut r = req(&c.ids, 0.0, 16, 0);
    r.params.stop_strings = vec!["W".into()];
    let out = h.generate_blocking(r).unwrap();
    assert_eq!(out.finish_reason, FinishReason::StopString);
    assert!(out.response_ids.len() < 7);
    // Rejections.
    let long: Vec<u32> = (0..30).map(|i| 10 + i).collect();
    assert!(matches!(
        h.generate_blocking(req(&long, 0.0, 4, 0)),
        Err(EngineError::PromptTooLong { len: 30, max: 30 })
    ));
    assert!(matches!(
        h.generate_blocking(req(&[5000], 0.0, 4, 0)),
        Err(EngineError::BadToken { token: 5000, .. })
    ));
    assert!(matches!(
        h.generate_blocking(req(&c.ids, -1.0, 4, 0)),
        Err(EngineError::Sampling(_))
    ));
}
