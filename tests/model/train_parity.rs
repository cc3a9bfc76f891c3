//! Parity of one learner step with the PyTorch reference: `train_step_expected.json` (PyTorch
//! autograd + `torch.optim.AdamW`) on the tiny Qwen3 fixture.

use std::path::Path;

use burn::module::AutodiffModule;
use burn::tensor::{Int, Tensor, TensorData};
use clawrl::model::load_model;
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use clawrl::{CpuAutodiff, CpuBackend};
use serde_json::Value;

const DIR: &str = "tests/fixtures/qwen3-tiny";

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(Path::new(DIR).join(name)).unwrap()).unwrap()
}

/// A JSON list of numbers as f32s.
pub(crate) fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// A JSON list of token ids.
pub(crate) fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn rel(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(1e-12)
}

/// The reference step's hyper-parameters (`hyper` of a training fixture) as a learner config.
pub(crate) fn reference_train_config(hyper: &Value) -> TrainConfig {
    let h = |k: &str| hyper[k].as_f64().unwrap();
    TrainConfig {
        lr: h("lr"),
        betas: [0, 1].map(|i| hyper["betas"][i].as_f64().unwrap()),
        adam_eps: h("adam_eps"),
        weight_decay: h("weight_decay"),
        eps_clip: h("eps_clip"),
        eps_clip_high: h("eps_clip_high"),
        kl_coef: h("kl_coef"),
        grad_clip: h("grad_clip_norm"),
        batch_size: 2,
        ..TrainConfig::default()
    }
}

/// The two samples of `train_step_expected.json`, with their old and reference log-probs.
pub(crate) fn reference_samples() -> Vec<Sample> {
    json("train_step_expected.json")["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Sample {
            prompt_ids: u32s(&s["prompt_ids"]),
            response_ids: u32s(&s["response_ids"]),
            advantages: f32s(&s["advantages"]),
            old_logprobs: Some(f32s(&s["old_logprobs"])),
            ref_logprobs: Some(f32s(&s["ref_logprobs"])),
            rollout_logprobs: None,
            opd: None,
            importance: None,
        })
        .collect()
}

#[test]
fn one_step_matches_pytorch_reference() {
    let exp = json("train_step_expected.json");
    let train = reference_train_config(&exp["hyper"]);
    let samples = reference_samples();

    let device = Default::default();
    let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
    let mut learner = BurnLearner::new(cfg, model, train, device, 0);
    let m = learner.step(&samples).unwrap();
    assert_eq!(m.skipped, None);
    assert_eq!((m.step, m.version, m.tokens, m.samples), (1, 1, 32, 2));

    let want = |k: &str| exp[k].as_f64().unwrap();
    for (name, got, tol) in [
        ("loss", m.loss, 1e-4),
        ("pg_loss", m.pg_loss, 1e-4),
        ("kl", m.kl, 1e-4),
        ("grad_norm_before_clip", m.grad_norm, 1e-3),
    ] {
        let r = rel(got, want(name));
        eprintln!("{name}: got {got}, want {}, rel {r:.2e}", want(name));
        assert!(r < tol, "{name}: got {got}, want {}, rel {r}", want(name));
    }
    assert!(
        (m.clip_fraction - want("clip_fraction")).abs() < 1e-9,
        "clip_fraction {}",
        m.clip_fraction
    );

    let after = learner.logprobs(&samples).unwrap();
    for (i, (got, want)) in after
        .iter()
        .zip(exp["logprobs_after_step"].as_array().unwrap())
        .enumerate()
    {
        let want = f32s(want);
        assert_eq!(got.len(), want.len());
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 2e-4, "sample {i} token {k}: {g} vs {w}");
        }
    }

    let probe_ids = u32s(&json("expected.json")["cases"][2]["input_ids"]);
    let n = probe_ids.len();
    let ids = Tensor::<CpuBackend, 2, Int>::from_data(
        TensorData::new(
            probe_ids.iter().map(|&t| t as i64).collect::<Vec<_>>(),
            [1, n],
        ),
        &Default::default(),
    );
    let logits = learner.policy().valid().forward(ids);
    let vocab = logits.dims()[2];
    let last: Vec<f32> = logits
        .slice([0..1, n - 1..n, 0..vocab])
        .into_data()
        .to_vec()
        .unwrap();
    let want = f32s(&exp["probe_last_logits_after_step"]);
    assert_eq!(last.len(), want.len());
    let worst = last
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    eprintln!("probe logits: max abs diff {worst:.2e}");
    assert!(worst < 2e-4, "probe logits differ by up to {worst}");
}
