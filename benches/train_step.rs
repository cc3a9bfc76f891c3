//! Training-throughput benchmark (not a test): one learner step (forward, backward, global-norm
//! clip, AdamW) of the docs/design.md §1 loss on the `qwen3-20m` shape with random weights, batch 8 ×
//! 256 tokens (128 prompt + 128 response), the train workload of `benches/shapes/README.md`.
//! Prints one JSON line: tokens/s (all sequence tokens per second of step time) and peak RSS.
//! `scripts/bench_train.sh` runs it beside the PyTorch reference and prints the ratios.

use std::time::Instant;

use clawrl::model::{Qwen3, Qwen3Config};
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use clawrl::CpuAutodiff;

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<f64>().ok())
            })
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn main() {
    let steps: usize = std::env::var("BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let text = std::fs::read_to_string("benches/shapes/qwen3-20m/config.json").expect("config");
    let cfg = Qwen3Config::from_json(&text).expect("valid config");
    let device = Default::default();
    let model = Qwen3::<CpuAutodiff>::init(&cfg, &device, 0);
    let train = TrainConfig {
        lr: 1e-5,
        kl_coef: 0.02,
        batch_size: 8,
        ..TrainConfig::default()
    };
    let mut learner = BurnLearner::new(cfg.clone(), model, train, device, 0);
    let v = cfg.vocab_size as u64;
    let tok = |i: u64, salt: u64| ((i * 7919 + salt * 104729 + 13) % v) as u32;
    let samples: Vec<Sample> = (0..8u64)
        .map(|b| Sample {
            prompt_ids: (0..128).map(|i| tok(i, b + 1)).collect(),
            response_ids: (128..256).map(|i| tok(i, b + 1)).collect(),
            advantages: (0..128)
                .map(|k| if b % 2 == 0 { 1.0 } else { -1.0 } + 0.01 * k as f32)
                .collect(),
            old_logprobs: Some((0..128).map(|k| -9.0 + 0.001 * k as f32).collect()),
            ref_logprobs: Some((0..128).map(|k| -9.0 - 0.001 * k as f32).collect()),
            rollout_logprobs: None,
            opd: None,
            importance: None,
        })
        .collect();
    let tokens = samples.iter().map(Sample::len).sum::<usize>();
    // Warm-up step, then timed steps.
    learner.step(&samples).expect("step");
    let mut best = f64::INFINITY;
    for _ in 0..steps {
        let t0 = Instant::now();
        let m = learner.step(&samples).expect("step");
        assert!(m.skipped.is_none(), "{m:?}");
        best = best.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "{}",
        serde_json::json!({
            "tokens_per_step": tokens,
            "step_seconds": best,
            "tokens_per_s": tokens as f64 / best,
            "peak_rss_mib": peak_rss_mib(),
        })
    );
}
