//! Policy benchmark on the `benches/shapes/qwen3-20m` shape (random weights, fixed seed):
//! prefill of 512 tokens (batch 1), and decode of 128 new tokens after a 32-token prompt at
//! batch 1 and batch 16 through the generation engine (KV cache on, greedy).
//! Prints one JSON line of tokens/s; `scripts/bench_model.sh` compares it with transformers.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use clawrl::model::{
    spawn_engine, EngineOptions, GenerationRequest, Qwen3, Qwen3Config, SamplingParams,
};
use clawrl::CpuBackend;

type B = CpuBackend;

fn main() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/shapes/qwen3-20m/config.json");
    let cfg = Qwen3Config::from_json(&std::fs::read_to_string(path).unwrap()).unwrap();
    let device = Default::default();
    let model = Arc::new(Qwen3::<B>::init(&cfg, &device, 0));
    let vocab = cfg.vocab_size as u32;
    let prompt = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 7919 + salt * 104729 + 13) % vocab)
            .collect()
    };

    // Prefill: best of 3 after a warm-up.
    let ids = prompt(512, 0);
    let mut cache = model.new_cache(4096);
    let _ = model.prefill(&ids, &mut cache).unwrap();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let mut cache = model.new_cache(4096);
        let t = Instant::now();
        let l = model.prefill(&ids, &mut cache).unwrap();
        let _ = l.into_data();
        best = best.min(t.elapsed().as_secs_f64());
    }
    let prefill_tps = 512.0 / best;

    let engine = spawn_engine(
        model.clone(),
        None,
        EngineOptions {
            max_batch: 16,
            max_context: 4096,
            // Rounds repeat prompts: the measure includes their prefill.
            prefix_cache_bytes: 0,
        },
    );
    let request = |salt: u32| GenerationRequest {
        prompt_ids: prompt(32, salt),
        params: SamplingParams {
            temperature: 0.0,
            max_new_tokens: 128,
            ..Default::default()
        },
        raw_logprobs: None,
    };
    let decode = |batch: usize| -> f64 {
        let t = Instant::now();
        let rxs: Vec<_> = (0..batch)
            .map(|i| engine.submit(request(i as u32 + 1)))
            .collect();
        let mut n = 0;
        for rx in rxs {
            n += rx.blocking_recv().unwrap().unwrap().response_ids.len();
        }
        n as f64 / t.elapsed().as_secs_f64()
    };
    let _ = decode(1);
    let d1 = decode(1);
    let d16 = decode(16);
    println!(
        "{}",
        serde_json::json!({
            "prefill_512_tokens_per_s": prefill_tps,
            "decode_b1_tokens_per_s": d1,
            "decode_b16_tokens_per_s": d16,
            "params": cfg.num_parameters(),
        })
    );
}
