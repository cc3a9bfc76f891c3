//! Parity of the Qwen3 policy with Hugging Face `transformers` on the tiny fixture
//! (`tests/fixtures/qwen3-tiny/expected.json`): prompt text, input ids, last logits, greedy
//! continuation and its log-probs, for all four cases; the greedy continuation with the linear
//! weights kept either way ([`LinearLayout`]).

use std::path::{Path, PathBuf};

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use clawrl::model::{load_checkpoint, Checkpoint, LinearLayout};
use clawrl::CpuBackend;
use minijinja::Value;

type B = CpuBackend;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny")
}

/// The fixture cases, parsed with key order kept (as Python's json does).
fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v.get_attr("cases").unwrap().try_iter().unwrap().collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.try_iter()
        .unwrap()
        .map(|x| f64::try_from(x).unwrap())
        .collect()
}

fn ints(v: &Value) -> Vec<u32> {
    v.try_iter()
        .unwrap()
        .map(|x| u32::try_from(x).unwrap())
        .collect()
}

fn tools_of(case: &Value) -> Option<Value> {
    let t = case.get_attr("tools").unwrap();
    (!t.is_none()).then_some(t)
}

fn load() -> Checkpoint<B> {
    load_checkpoint::<B>(&fixture_dir(), &Default::default()).expect("fixture loads")
}

/// max |a - b| / max |b|.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()));
    diff / scale
}

#[test]
fn prompt_text_and_ids_match_transformers() {
    let ck = load();
    for (i, case) in cases().iter().enumerate() {
        let tools = tools_of(case);
        let p = ck
            .encode_chat(&case.get_attr("messages").unwrap(), tools.as_ref())
            .unwrap();
        let want = case.get_attr("prompt_text").unwrap();
        assert_eq!(p.text, want.as_str().unwrap(), "case {i}: prompt text");
        assert_eq!(
            p.ids,
            ints(&case.get_attr("input_ids").unwrap()),
            "case {i}: ids"
        );
    }
}

#[test]
fn last_logits_match_transformers() {
    let ck = load();
    for (i, case) in cases().iter().enumerate() {
        let ids = ints(&case.get_attr("input_ids").unwrap());
        let n = ids.len();
        let input = Tensor::<B, 2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, n]),
            &Default::default(),
        );
        let logits = ck.model.forward(input);
        let v = ck.config.vocab_size;
        let last: Vec<f32> = logits
            .narrow(1, n - 1, 1)
            .reshape([v])
            .into_data()
            .to_vec()
            .unwrap();
        let want = floats(&case.get_attr("last_logits").unwrap());
        let err = rel_err(&last, &want);
        assert!(err < 1e-4, "case {i}: last_logits relative error {err}");
    }
}

#[test]
fn kv_cache_greedy_matches_transformers() {
    let ck = load();
    for layout in [LinearLayout::InOut, LinearLayout::OutIn] {
        greedy_matches_transformers(&ck, layout);
    }
}

/// The prefill's logits, and 16 greedy steps with their log-probs, of every case.
fn greedy_matches_transformers(ck: &Checkpoint<B>, layout: LinearLayout) {
    let m = &ck.model.clone().into_layout(layout);
    for (i, case) in cases().iter().enumerate() {
        let ids = ints(&case.get_attr("input_ids").unwrap());
        let want_ids = ints(&case.get_attr("greedy_16").unwrap());
        let want_lp = floats(&case.get_attr("greedy_16_logprobs").unwrap());
        let mut cache = m.new_cache(1024);
        let mut logits = m.prefill(&ids, &mut cache).unwrap();
        let want_last = floats(&case.get_attr("last_logits").unwrap());
        let got_last: Vec<f32> = logits.clone().into_data().to_vec().unwrap();
        assert!(
            rel_err(&got_last, &want_last) < 1e-4,
            "case {i}, {layout:?}: prefill logits"
        );
        let mut got_ids = Vec::new();
        let mut got_lp = Vec::new();
        for _ in 0..16 {
            let lp: Vec<f32> = log_softmax(logits, 0).into_data().to_vec().unwrap();
            let (best, &l) = lp
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.partial_cmp(b.1).unwrap())
                .unwrap();
            got_ids.push(best as u32);
            got_lp.push(l);
            let out = m.decode_step(&[best as u32], &mut [&mut cache]).unwrap();
            logits = out.reshape([ck.config.vocab_size]);
        }
        assert_eq!(got_ids, want_ids, "case {i}, {layout:?}: greedy ids");
        for (k, (g, w)) in got_lp.iter().zip(&want_lp).enumerate() {
            assert!(
                (*g as f64 - w).abs() < 1e-4,
                "case {i}, {layout:?}, step {k}: logprob {g} vs {w}"
            );
        }
    }
}
