//! LoRA adapters against Hugging Face PEFT on the tiny fixture
//! (`tests/fixtures/qwen3-tiny-lora`): logits, greedy tokens and their log-probs with the adapter
//! applied, one adapter-only training step (the base frozen and bit for bit unchanged), the PEFT
//! directory both ways with its refusals, and the command line (`--adapter`, `--lora`,
//! `lora merge`).
//!
//! PEFT computed the adapter's references from the base loaded in float32, so with RoPE
//! frequencies computed in float32 and not rounded to bf16 (as the training fixture's and unlike
//! `qwen3-tiny/expected.json`'s): the model here does the same, and the command-line tests run on
//! a copy of the base whose `config.json` declares float32.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use burn::module::AutodiffModule;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use clawrl::model::peft::{adapter_from_safetensors, adapter_to_safetensors};
use clawrl::model::qwen3::rope_inv_freq;
use clawrl::model::{
    load_adapter, load_checkpoint, load_model, model_from_safetensors, model_to_safetensors,
    save_adapter, spawn_engine, AdapterLoadError, EngineOptions, GenerationRequest, LinearLayout,
    LoraConfig, LoraTarget, LoraWeights, Qwen3, SamplingParams,
};
use clawrl::serve::{EnginePolicy, VersionLoadError, VersionWeights};
use clawrl::train::checkpoint::{self, CheckpointError};
use clawrl::train::learner::BurnLearner;
use clawrl::{CpuAutodiff, CpuBackend};
use clawrl_actors::loops::PolicyReplica;
use serde_json::{json, Value};

use super::cli::{case_files, clawrl};
use super::train_offline_cli::{write_reference_samples, write_train_toml};
use super::train_parity::{f32s, reference_samples, reference_train_config, u32s};

type B = CpuBackend;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}
fn base_dir() -> PathBuf {
    root().join("tests/fixtures/qwen3-tiny")
}
fn adapter_dir() -> PathBuf {
    root().join("tests/fixtures/qwen3-tiny-lora")
}

fn json_file(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The adapter fixture's `expected.json`.
fn expected() -> Value {
    json_file(&adapter_dir().join("expected.json"))
}

/// max |a - b| / max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
    diff / scale
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// The base checkpoint with the fixture adapter applied, computing as a float32 base does.
fn adapted<Bk: burn::tensor::backend::Backend>() -> (clawrl::model::Qwen3Config, Qwen3<Bk>) {
    adapted_in(LinearLayout::InOut)
}

/// [`adapted`] with the base's linear weights kept as `layout` says.
fn adapted_in<Bk: burn::tensor::backend::Backend>(
    layout: LinearLayout,
) -> (clawrl::model::Qwen3Config, Qwen3<Bk>) {
    let (cfg, mut model) = load_model::<Bk>(&base_dir(), &Default::default()).unwrap();
    model.rope_inv_freq = rope_inv_freq(cfg.head_dim(), cfg.rope_theta(), None);
    let peft = load_adapter(&adapter_dir(), &cfg).unwrap();
    let model = model.into_layout(layout);
    (cfg, model.with_lora(&peft.weights).unwrap())
}

/// A copy of the base checkpoint in `dir` whose `config.json` declares float32 (the weights stay
/// the same bf16 values), as PEFT's reference loaded it.
fn float32_base(dir: &Path) -> PathBuf {
    let out = dir.join("qwen3-tiny-f32");
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(base_dir()).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, out.join(p.file_name().unwrap())).unwrap();
    }
    let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(cfg.contains("\"bfloat16\""));
    std::fs::write(
        out.join("config.json"),
        cfg.replace("\"bfloat16\"", "\"float32\""),
    )
    .unwrap();
    out
}

fn last_logits(model: &Qwen3<B>, ids: &[u32]) -> Vec<f32> {
    let n = ids.len();
    let input = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, n]),
        &Default::default(),
    );
    let logits = model.forward(input);
    let v = logits.dims()[2];
    logits
        .narrow(1, n - 1, 1)
        .reshape([v])
        .into_data()
        .to_vec()
        .unwrap()
}

#[test]
fn adapted_logits_greedy_tokens_and_logprobs_match_peft() {
    let (cfg, m) = adapted::<B>();
    let (mut worst_logits, mut worst_lp) = (0f64, 0f64);
    for (i, case) in expected()["cases"].as_array().unwrap().iter().enumerate() {
        let ids = u32s(&case["input_ids"]);
        let want = f32s(&case["last_logits"]);
        let err = rel_err(&last_logits(&m, &ids), &want);
        worst_logits = worst_logits.max(err);
        assert!(err < 1e-4, "case {i}: last_logits relative error {err}");

        // Greedy through the KV cache, as the engine decodes.
        let mut cache = m.new_cache(1024);
        let mut logits = m.prefill(&ids, &mut cache).unwrap();
        let prefill: Vec<f32> = logits.clone().into_data().to_vec().unwrap();
        assert!(rel_err(&prefill, &want) < 1e-4, "case {i}: prefill logits");
        let (mut got_ids, mut got_lp) = (Vec::new(), Vec::new());
        for _ in 0..16 {
            let lp: Vec<f32> = log_softmax(logits, 0).into_data().to_vec().unwrap();
            let (best, &l) = lp
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap();
            got_ids.push(best as u32);
            got_lp.push(l);
            logits = m
                .decode_step(&[best as u32], &mut [&mut cache])
                .unwrap()
                .reshape([cfg.vocab_size]);
        }
        assert_eq!(got_ids, u32s(&case["greedy_16"]), "case {i}: greedy ids");
        let d = max_abs(&got_lp, &f32s(&case["greedy_16_logprobs"]));
        worst_lp = worst_lp.max(d as f64);
        assert!(d < 1e-4, "case {i}: greedy log-probs differ by {d}");
    }
    eprintln!(
        "adapter parity: last_logits max relative error {worst_logits:.2e}, greedy log-probs max \
         abs error {worst_lp:.2e}"
    );
}

/// The base's tensors (every parameter but the adapters), row-major.
fn base_tensors(m: &Qwen3<B>) -> Vec<Vec<f32>> {
    let host = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();
    let host1 = |t: Tensor<B, 1>| t.into_data().to_vec::<f32>().unwrap();
    let mut out = vec![host(m.embed_tokens.val()), host1(m.norm.weight.val())];
    for l in &m.layers {
        let (a, p) = (&l.self_attn, &l.mlp);
        for w in [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &p.gate_proj,
            &p.up_proj,
            &p.down_proj,
        ] {
            out.push(host(w.val()));
        }
        for n in [
            &l.input_layernorm,
            &l.post_attention_layernorm,
            &a.q_norm,
            &a.k_norm,
        ] {
            out.push(host1(n.weight.val()));
        }
    }
    out
}

/// Layer 0's `q_proj` `(A, B)` after the step, flattened, from the fixture.
fn fixture_q_proj_after(exp: &Value) -> (Vec<f32>, Vec<f32>) {
    let t = &exp["layer0_q_proj_adapter_after_step"];
    let flat = |k: &str| -> Vec<f32> {
        t[format!("base_model.model.model.layers.0.self_attn.q_proj.{k}.default.weight")]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(f32s)
            .collect()
    };
    (flat("lora_A"), flat("lora_B"))
}

#[test]
fn adapter_only_step_matches_peft_and_leaves_the_base_unchanged() {
    // A LoRA job's learner keeps its frozen base as decoding wants it: the step must not
    // depend on the order.
    let in_out = adapter_only_step(LinearLayout::InOut);
    let out_in = adapter_only_step(LinearLayout::OutIn);
    assert_eq!(
        in_out, out_in,
        "the base's fingerprint depends on its layout"
    );
}

/// The PEFT fixture's adapter-only step over a base kept as `layout` says; gives the base's
/// fingerprint.
fn adapter_only_step(layout: LinearLayout) -> String {
    eprintln!("base kept {layout:?}");
    let exp = expected()["train_step"].clone();
    let samples = reference_samples();
    let (cfg, model) = adapted_in::<CpuAutodiff>(layout);
    assert_eq!(model.linear_layout(), layout);
    // What a LoRA job's engine decodes from: the learner's base tensors, shared, as they are.
    assert_eq!(model.valid().without_lora().linear_layout(), layout);
    let lora_cfg = load_adapter(&adapter_dir(), &cfg).unwrap().weights.config;
    let base_before = base_tensors(&model.valid());
    let mut learner = BurnLearner::new(
        cfg,
        model,
        reference_train_config(&exp["hyper"]),
        Default::default(),
        0,
    );
    let m = learner.step(&samples).unwrap();
    assert_eq!(m.skipped, None);
    assert_eq!((m.step, m.tokens, m.samples), (1, 32, 2));
    let want = |k: &str| exp[k].as_f64().unwrap();
    for (name, got, tol) in [
        ("loss", m.loss, 1e-4),
        ("pg_loss", m.pg_loss, 1e-4),
        ("kl", m.kl, 1e-4),
        ("grad_norm_before_clip", m.grad_norm, 1e-3),
    ] {
        let r = (got - want(name)).abs() / want(name).abs();
        eprintln!(
            "lora step {name}: got {got}, want {}, rel {r:.2e}",
            want(name)
        );
        assert!(r < tol, "{name}: got {got}, want {}, rel {r}", want(name));
    }

    // Only the adapters have optimizer state: two matrices per target per layer.
    let state = learner.optimizer().export_state();
    assert_eq!(state.len(), 2 * 7 * 2);
    assert!(
        state.keys().all(|k| k.contains("_lora.")),
        "{:?}",
        state.keys()
    );

    let after = learner.logprobs(&samples).unwrap();
    let mut worst = 0f32;
    for (got, want) in after
        .iter()
        .zip(exp["logprobs_after_step"].as_array().unwrap())
    {
        worst = worst.max(max_abs(got, &f32s(want)));
    }
    eprintln!("lora step: log-probs after the step, max abs diff {worst:.2e}");
    assert!(worst < 2e-4, "log-probs after the step differ by {worst}");

    let policy = learner.policy().valid();
    let probe = u32s(&json_file(&base_dir().join("expected.json"))["cases"][2]["input_ids"]);
    let d = max_abs(
        &last_logits(&policy, &probe),
        &f32s(&exp["probe_last_logits_after_step"]),
    );
    eprintln!("lora step: probe logits after the step, max abs diff {d:.2e}");
    assert!(d < 2e-4, "probe logits after the step differ by {d}");

    let trained = policy.lora_weights(&lora_cfg).unwrap();
    let (a, b) = &trained.tensors[&(0, LoraTarget::QProj)];
    let (want_a, want_b) = fixture_q_proj_after(&exp);
    let (da, db) = (max_abs(a, &want_a), max_abs(b, &want_b));
    eprintln!("lora step: layer 0 q_proj A max abs diff {da:.2e}, B {db:.2e}");
    assert!(
        da < 2e-4 && db < 2e-4,
        "q_proj adapter after the step: A {da}, B {db}"
    );

    // The base is frozen: every base tensor bit for bit as before the step.
    let base_after = base_tensors(&policy);
    assert_eq!(base_before.len(), base_after.len());
    for (i, (x, y)) in base_before.iter().zip(&base_after).enumerate() {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "base tensor {i} changed"
        );
    }
    policy.base_fingerprint()
}

#[test]
fn a_fresh_adapter_leaves_the_outputs_unchanged() {
    let (cfg, base) = load_model::<B>(&base_dir(), &Default::default()).unwrap();
    let lora = LoraConfig::parse_cli("4,8,all").unwrap();
    let ids = u32s(&expected()["cases"][0]["input_ids"]);
    let want = last_logits(&base, &ids);
    let m = base.with_lora(&LoraWeights::fresh(&lora, &cfg, 3)).unwrap();
    assert!(m.has_lora());
    // B = 0 makes the adapter's term exactly zero.
    assert_eq!(last_logits(&m, &ids), want);
}

#[test]
fn a_saved_adapter_loads_back_identically_with_peft_keys() {
    let (cfg, m) = adapted::<B>();
    let original = load_adapter(&adapter_dir(), &cfg).unwrap();
    let read_back = m.lora_weights(&original.weights.config).unwrap();
    assert_eq!(read_back, original.weights);
    let tmp = tempfile::tempdir().unwrap();
    save_adapter(tmp.path(), &read_back, "../qwen3-tiny").unwrap();
    let again = load_adapter(tmp.path(), &cfg).unwrap();
    assert_eq!(again.weights, original.weights);
    assert_eq!(
        again.base_model_name_or_path.as_deref(),
        Some("../qwen3-tiny")
    );
    let c = json_file(&tmp.path().join("adapter_config.json"));
    for (k, v) in [
        ("peft_type", json!("LORA")),
        ("task_type", json!("CAUSAL_LM")),
        ("r", json!(4)),
        ("lora_alpha", json!(8)),
        ("lora_dropout", json!(0.0)),
        ("bias", json!("none")),
        ("fan_in_fan_out", json!(false)),
        ("use_rslora", json!(false)),
        ("use_dora", json!(false)),
    ] {
        assert_eq!(c[k], v, "{k}");
    }
    assert_eq!(c["target_modules"].as_array().unwrap().len(), 7);
    // The same tensor names and shapes as PEFT's own file.
    let names = |dir: &Path| {
        let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut v: Vec<(String, Vec<usize>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(tmp.path()), names(&adapter_dir()));
}

/// A copy of the fixture adapter with `edit` applied to its tensors.
fn edited_adapter(
    dir: &Path,
    edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<u8>)>),
) -> PathBuf {
    let bytes = std::fs::read(adapter_dir().join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    let dtype = st.tensors()[0].1.dtype();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("adapter_model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        adapter_dir().join("adapter_config.json"),
        dir.join("adapter_config.json"),
    )
    .unwrap();
    dir.to_path_buf()
}

#[test]
fn broken_adapter_directories_are_refused_by_name() {
    let cfg = clawrl::model::load_config(&base_dir()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let b0 = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight";
    let missing = edited_adapter(&tmp.path().join("missing"), |t| t.retain(|x| x.0 != b0));
    let e = load_adapter(&missing, &cfg).unwrap_err().to_string();
    assert!(e.contains(b0) && e.contains("missing"), "{e}");

    let reshaped = edited_adapter(&tmp.path().join("shape"), |t| {
        let x = t.iter_mut().find(|x| x.0 == b0).unwrap();
        x.1 = vec![x.1[1], x.1[0]];
    });
    let e = load_adapter(&reshaped, &cfg).unwrap_err().to_string();
    assert!(e.contains(b0) && e.contains("shape"), "{e}");

    let extra = edited_adapter(&tmp.path().join("extra"), |t| {
        let mut x = t[0].clone();
        x.0 = "base_model.model.lm_head.lora_A.weight".into();
        t.push(x);
    });
    let e = load_adapter(&extra, &cfg).unwrap_err().to_string();
    assert!(e.contains("lm_head"), "{e}");

    let dora = edited_adapter(&tmp.path().join("dora"), |_| {});
    let mut c = json_file(&dora.join("adapter_config.json"));
    c["use_dora"] = json!(true);
    std::fs::write(dora.join("adapter_config.json"), c.to_string()).unwrap();
    let e = load_adapter(&dora, &cfg).unwrap_err().to_string();
    assert!(e.contains("`use_dora`"), "{e}");
}

/// Case `i`'s messages written under `dir`.
fn messages_of(i: usize, dir: &Path) -> PathBuf {
    let dir = dir.join(format!("case-{i}"));
    std::fs::create_dir_all(&dir).unwrap();
    case_files(i, &dir).1
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `clawrl generate --adapter` (the fixture adapter) on `base`: 16 greedy tokens, as JSON.
fn greedy_16_with_adapter(base: &Path, messages: &Path) -> Value {
    let (ok, out, err) = clawrl(&[
        "generate",
        s(base),
        "--adapter",
        s(&adapter_dir()),
        "--messages",
        s(messages),
        "--max-new-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    ]);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn cli_logits_generate_and_merge_apply_the_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = expected();
    let (base, adapter) = (float32_base(tmp.path()), adapter_dir());
    let m0 = messages_of(0, tmp.path());
    let (ok, out, err) = clawrl(&[
        "model",
        "logits",
        s(&base),
        "--adapter",
        s(&adapter),
        "--messages",
        s(&m0),
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let err = rel_err(
        &f32s(&v["last_logits"]),
        &f32s(&exp["cases"][0]["last_logits"]),
    );
    assert!(err < 1e-4, "model logits --adapter: relative error {err}");

    let m1 = messages_of(1, tmp.path());
    let v = greedy_16_with_adapter(&base, &m1);
    assert_eq!(v["response_ids"], exp["cases"][1]["greedy_16"]);
    let d = max_abs(
        &f32s(&v["logprobs"]),
        &f32s(&exp["cases"][1]["greedy_16_logprobs"]),
    );
    assert!(d < 1e-4, "generate --adapter: log-probs differ by {d}");

    // The merged checkpoint alone computes what base + adapter did.
    let merged = tmp.path().join("merged");
    let merge = || {
        clawrl(&[
            "lora",
            "merge",
            "--base",
            s(&base),
            "--adapter",
            s(&adapter),
            "--out",
            s(&merged),
        ])
    };
    let (ok, _, err) = merge();
    assert!(ok, "{err}");
    let ck = load_checkpoint::<B>(&merged, &Default::default()).unwrap();
    assert!(!ck.model.has_lora());
    let mut worst = 0f64;
    for case in exp["cases"].as_array().unwrap() {
        let e = rel_err(
            &last_logits(&ck.model, &u32s(&case["input_ids"])),
            &f32s(&case["last_logits"]),
        );
        worst = worst.max(e);
    }
    eprintln!("merged checkpoint: last_logits max relative error {worst:.2e}");
    assert!(worst < 1e-4, "merged logits: relative error {worst}");
    // It writes a new directory only.
    let (ok, _, err) = merge();
    assert!(!ok && err.contains("exists"), "{err}");
}

#[test]
fn cli_train_offline_trains_only_an_adapter_and_writes_peft() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = expected()["train_step"].clone();
    // The base fixture's reference step has the same samples and hyper-parameters.
    let samples = write_reference_samples(tmp.path());
    let cfg_file = tmp.path().join("TRAIN.toml");
    write_train_toml(&cfg_file, "");
    let base = base_dir();
    let out = tmp.path().join("trained");
    let (ok, stdout, err) = clawrl(&[
        "train-offline",
        "--model",
        s(&base),
        "--adapter",
        s(&adapter_dir()),
        "--samples",
        s(&samples),
        "--config",
        s(&cfg_file),
        "--out",
        s(&out),
        "--json",
    ]);
    assert!(ok, "{err}");
    let m: Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    let rel = |k: &str, got: &str| {
        (m[got].as_f64().unwrap() - exp[k].as_f64().unwrap()).abs() / exp[k].as_f64().unwrap()
    };
    assert!(rel("loss", "loss") < 1e-4, "{m}");
    assert!(rel("grad_norm_before_clip", "grad_norm") < 1e-3, "{m}");
    // The output is an adapter directory, not a checkpoint.
    assert!(!out.join("model.safetensors").exists());
    let cfg = clawrl::model::load_config(&base).unwrap();
    let trained = load_adapter(&out, &cfg).unwrap();
    let (a, b) = &trained.weights.tensors[&(0, LoraTarget::QProj)];
    let (want_a, want_b) = fixture_q_proj_after(&exp);
    assert!(max_abs(a, &want_a) < 2e-4 && max_abs(b, &want_b) < 2e-4);

    // A fresh adapter on two targets: A Kaiming-uniform, B zero, so B alone moves on the first
    // step (A's gradient is zero while B is).
    let fresh = tmp.path().join("fresh");
    let (ok, _, err) = clawrl(&[
        "train-offline",
        "--model",
        s(&base),
        "--lora",
        "8,16,v_proj,q_proj",
        "--samples",
        s(&samples),
        "--config",
        s(&cfg_file),
        "--out",
        s(&fresh),
        "--seed",
        "3",
    ]);
    assert!(ok, "{err}");
    let trained = load_adapter(&fresh, &cfg).unwrap();
    let c = &trained.weights.config;
    assert_eq!((c.r, c.alpha), (8, 16.0));
    assert_eq!(c.targets, vec![LoraTarget::QProj, LoraTarget::VProj]);
    assert_eq!(trained.weights.tensors.len(), 2 * cfg.num_hidden_layers);
    let start = LoraWeights::fresh(c, &cfg, 3);
    for (key, (a, b)) in &trained.weights.tensors {
        assert!(b.iter().any(|x| *x != 0.0), "{key:?}: B did not move");
        // A only decays: (1 - lr · weight_decay) times its start.
        let a0 = &start.tensors[key].0;
        assert!(a
            .iter()
            .zip(a0)
            .all(|(x, y)| (x - y * (1.0 - 1e-4)).abs() < 1e-6));
    }

    // Bad forms are refused naming the flag or the key.
    let (ok, _, err) = clawrl(&[
        "train-offline",
        "--model",
        s(&base),
        "--lora",
        "0,16,q_proj",
        "--samples",
        s(&samples),
        "--out",
        s(&tmp.path().join("x")),
    ]);
    assert!(!ok && err.contains("lora.r"), "{err}");
    let dropout = edited_adapter(&tmp.path().join("dropout"), |_| {});
    let mut c = json_file(&dropout.join("adapter_config.json"));
    c["lora_dropout"] = json!(0.1);
    std::fs::write(dropout.join("adapter_config.json"), c.to_string()).unwrap();
    let (ok, _, err) = clawrl(&[
        "train-offline",
        "--model",
        s(&base),
        "--adapter",
        s(&dropout),
        "--samples",
        s(&samples),
        "--out",
        s(&tmp.path().join("y")),
    ]);
    assert!(!ok && err.contains("lora_dropout"), "{err}");
    // Inference accepts it: dropout does nothing there.
    let m0 = messages_of(0, tmp.path());
    let (ok, _, err) = clawrl(&[
        "model",
        "logits",
        s(&base),
        "--adapter",
        s(&dropout),
        "--messages",
        s(&m0),
    ]);
    assert!(ok, "{err}");
}

/// `clawrl generate` on `base` (with `adapter` applied when given): 16 greedy tokens' text.
fn greedy_16_text(base: &Path, adapter: Option<&Path>, messages: &Path) -> Value {
    let mut args = vec!["generate", s(base), "--messages", s(messages)];
    if let Some(a) = adapter {
        args.extend(["--adapter", s(a)]);
    }
    args.extend(["--max-new-tokens", "16", "--temperature", "0", "--json"]);
    let (ok, out, err) = clawrl(&args);
    assert!(ok, "{err}");
    serde_json::from_str::<Value>(&out).unwrap()["text"].clone()
}

/// One HTTP/1.1 request with `key` as bearer; returns the status and the body.
fn http(addr: &str, key: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n\
         {body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// `clawrl serve` with `--adapter` applies it to every request, and with `--lora-module` serves
/// each adapter as its own model id beside the checkpoint: each id answers as `generate` with
/// that adapter does, also while requests for all of them run at once, and a key scoped to one
/// id cannot see or use another.
#[test]
fn serve_applies_an_adapter_and_serves_lora_modules_as_model_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let base = float32_base(tmp.path());
    let m1 = messages_of(1, tmp.path());
    let (cfg, with_fixture) = adapted::<B>();
    let bob = tmp.path().join("bob");
    save_adapter(
        &bob,
        &other_adapter(&cfg, &with_fixture.lora_config().unwrap(), 3),
        "qwen3-tiny",
    )
    .unwrap();
    let want_base = greedy_16_text(&base, None, &m1);
    let want_alice = greedy_16_text(&base, Some(&adapter_dir()), &m1);
    let want_bob = greedy_16_text(&base, Some(&bob), &m1);
    assert_ne!(want_base, want_alice);
    assert_ne!(want_base, want_bob);
    let config = tmp.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "api_keys = [\"sk-all\"]\n[adapters]\nalice = {:?}\n\n[[scoped_keys]]\n\
             key = \"sk-alice\"\nmodels = [\"alice\"]\n",
            s(&adapter_dir())
        ),
    )
    .unwrap();

    let serve = |extra: &[&str], data: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_clawrl"))
            .args(["serve", "--model", s(&base), "--listen", "127.0.0.1:0"])
            .args(["--data-dir", s(&tmp.path().join(data))])
            .args(extra)
            .env("RUST_LOG", "warn")
            .env_remove("CLAWRL_API_KEYS")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        {
            use std::io::BufRead;
            let stdout = child.stdout.as_mut().unwrap();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .unwrap();
        }
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        (child, addr)
    };
    let messages: Value = json_file(&m1);
    let chat = |model: &str| {
        json!({"model": model, "messages": messages, "max_tokens": 16, "temperature": 0})
            .to_string()
    };
    let content = |v: &Value| v["choices"][0]["message"]["content"].clone();

    // `--adapter` applies the adapter to the checkpoint itself.
    let (mut child, addr) = serve(&["--adapter", s(&adapter_dir())], "data-1");
    let (status, v) = http(
        &addr,
        "",
        "POST",
        "/v1/chat/completions",
        &chat("qwen3-tiny-f32"),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(status, 200, "{v}");
    assert_eq!(content(&v), want_alice, "{v}");

    // `--lora-module` (and the config's `[adapters]`) serve adapters as model ids.
    let (mut child, addr) = serve(
        &[
            "--config",
            s(&config),
            "--lora-module",
            &format!("bob={}", s(&bob)),
        ],
        "data-2",
    );
    let ids = |key: &str| -> Vec<String> {
        let (status, v) = http(&addr, key, "GET", "/v1/models", "");
        assert_eq!(status, 200, "{v}");
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids("sk-all"), ["qwen3-tiny-f32", "alice", "bob"]);
    assert_eq!(ids("sk-alice"), ["alice"]);
    // Requests for every id at once, so they share decode steps; each answers as alone.
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let asks: Vec<_> = [
            ("sk-all", "qwen3-tiny-f32"),
            ("sk-alice", "alice"),
            ("sk-all", "bob"),
            ("sk-all", "alice"),
        ]
        .into_iter()
        .map(|(key, model)| {
            let (addr, body) = (&addr, chat(model));
            scope.spawn(move || http(addr, key, "POST", "/v1/chat/completions", &body))
        })
        .collect();
        asks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((status, v), (model, want)) in answers.iter().zip([
        ("qwen3-tiny-f32", &want_base),
        ("alice", &want_alice),
        ("bob", &want_bob),
        ("alice", &want_alice),
    ]) {
        assert_eq!(*status, 200, "{model}: {v}");
        assert_eq!(v["model"], model, "{v}");
        assert_eq!(&content(v), want, "{model}: {v}");
    }
    // To a key scoped to `alice`, `bob` and the checkpoint do not exist.
    for other in ["bob", "qwen3-tiny-f32"] {
        let (status, v) = http(
            &addr,
            "sk-alice",
            "POST",
            "/v1/chat/completions",
            &chat(other),
        );
        assert_eq!(status, 404, "{v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        assert!(
            !v.to_string().contains("\"bob\"]"),
            "the id list leaks: {v}"
        );
        let (status, _) = http(&addr, "sk-alice", "GET", &format!("/v1/models/{other}"), "");
        assert_eq!(status, 404);
    }
    let _ = child.kill();
    let _ = child.wait();

    // An adapter that does not fit the checkpoint, or a scoped key naming no served id, stops
    // the gateway before it listens, naming what is wrong.
    for (extra, says) in [
        (
            format!("nobody={}", s(&tmp.path().join("missing"))),
            "adapters.nobody",
        ),
        (format!("bob={}", s(&bob)), "scoped_keys"),
    ] {
        let bad = tmp.path().join("bad.toml");
        std::fs::write(
            &bad,
            "[[scoped_keys]]\nkey = \"k\"\nmodels = [\"carol\"]\n".replace(
                "carol",
                if says == "scoped_keys" {
                    "carol"
                } else {
                    "qwen3-tiny-f32"
                },
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_clawrl"))
            .args(["serve", "--model", s(&base), "--listen", "127.0.0.1:0"])
            .args(["--config", s(&bad), "--lora-module", &extra])
            .args(["--data-dir", s(&tmp.path().join("data-3"))])
            .env_remove("CLAWRL_API_KEYS")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{says}: {err}");
    }
}

/// A learner that trains an adapter publishes the adapter alone; a replica holding the base
/// attaches it and generates exactly as the trained policy scores, and refuses a blob that is
/// not an adapter of the job's shape.
#[test]
fn a_lora_learners_versions_are_adapters_a_replica_attaches_to_its_base() {
    let exp = expected()["train_step"].clone();
    let samples = reference_samples();
    let (cfg, model) = adapted::<CpuAutodiff>();
    let lora = model.valid().lora_config().expect("the fixture adapter");
    assert_eq!(
        lora,
        load_adapter(&adapter_dir(), &cfg).unwrap().weights.config
    );
    let full_size = model_to_safetensors(&model.valid(), &cfg).unwrap().len();
    let mut learner = BurnLearner::new(
        cfg,
        model,
        reference_train_config(&exp["hyper"]),
        Default::default(),
        0,
    );
    learner.step(&samples).unwrap();
    let w = learner.export_weights().unwrap();
    assert_eq!(w.version, 1);
    let policy = learner.policy().valid();
    let mcfg = learner.model_config().clone();
    let read = adapter_from_safetensors(&w.bytes, lora.clone(), &mcfg, "version 1").unwrap();
    assert_eq!(read, policy.lora_weights(&lora).unwrap());
    eprintln!(
        "version blob: {} bytes (adapter), whole weights {} bytes",
        w.bytes.len(),
        full_size
    );
    assert!(
        w.bytes.len() * 4 < full_size,
        "{} vs {full_size}",
        w.bytes.len()
    );

    let replica = |weights| {
        EnginePolicy::<B>::with_weights(
            mcfg.clone(),
            weights,
            None,
            EngineOptions::default(),
            Default::default(),
        )
    };
    let base = policy.clone().without_lora();
    let over_base = replica(VersionWeights::Adapter {
        base: Box::new(base.clone()),
        config: lora.clone(),
    });
    let served = over_base.load(1, &w.bytes.clone().into()).unwrap();
    let plain = replica(VersionWeights::Full)
        .load(0, &model_to_safetensors(&base, &mcfg).unwrap().into())
        .unwrap();
    let prompt = samples[0].prompt_ids.clone();
    let request = || {
        GenerationRequest::new(
            prompt.clone(),
            SamplingParams {
                temperature: 1.0,
                max_new_tokens: 8,
                seed: 11,
                ..Default::default()
            },
        )
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let got = rt.block_on(served.engine().generate(request())).unwrap();
    let on_base = rt.block_on(plain.engine().generate(request())).unwrap();
    let scored = learner
        .logprobs(&[clawrl::train::Sample::new(
            prompt.clone(),
            got.response_ids.clone(),
            0.0,
        )])
        .unwrap();
    let d = max_abs(&got.logprobs, &scored[0]);
    eprintln!("adapter version: served vs trained log-probs, max abs diff {d:.2e}");
    assert!(
        d < 1e-4,
        "served {:?} vs trained {:?}",
        got.logprobs,
        scored[0]
    );
    // The adapter changes what is served: the base alone gives other log-probs.
    assert!(
        got.response_ids != on_base.response_ids
            || max_abs(&got.logprobs, &on_base.logprobs) > 1e-3,
        "the adapter version serves what the base does"
    );

    // Whole weights are not an adapter version.
    let e = over_base
        .load(2, &model_to_safetensors(&policy, &mcfg).unwrap().into())
        .err()
        .expect("whole weights refused");
    assert!(
        matches!(
            e,
            VersionLoadError::Adapter(AdapterLoadError::UnexpectedTensor { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("weight version 2"), "{e}");
    // An adapter of another rank is refused by tensor and shape.
    let other = LoraWeights::fresh(&LoraConfig::parse_cli("2,4,all").unwrap(), &mcfg, 1);
    let e = over_base
        .load(3, &adapter_to_safetensors(&other).unwrap().into())
        .err()
        .expect("another rank refused");
    assert!(
        matches!(
            e,
            VersionLoadError::Adapter(AdapterLoadError::WrongShape { .. })
        ),
        "{e}"
    );
}

/// An adapter checkpoint holds the adapters, not the base: restored onto a learner holding the
/// same base, the next step is the uninterrupted run's; onto another base, with no base, onto a
/// learner of whole weights or of another adapter shape, it is refused, and a learner with an
/// adapter refuses a checkpoint of whole weights.
#[test]
fn an_adapter_checkpoint_resumes_exactly_and_refuses_another_base() {
    let exp = expected()["train_step"].clone();
    let samples = reference_samples();
    let train = reference_train_config(&exp["hyper"]);
    assert!(
        train.kl_coef > 0.0,
        "the reference model is checkpointed too"
    );
    let learner = |seed: u64| {
        let (cfg, model) = adapted::<CpuAutodiff>();
        BurnLearner::new(cfg, model, train.clone(), Default::default(), seed)
    };
    let dir = tempfile::tempdir().unwrap();
    let mut a = learner(0);
    a.step(&samples).unwrap();
    let saved = checkpoint::save(&a, dir.path(), 0).unwrap();
    let names: Vec<String> = std::fs::read_dir(&saved)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for want in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "reference_adapter.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
    }
    assert!(
        !names.iter().any(|n| n == "model.safetensors"),
        "the base was written: {names:?}"
    );
    // The directory is a PEFT adapter.
    let (cfg, _) = load_model::<B>(&base_dir(), &Default::default()).unwrap();
    let peft = load_adapter(&saved, &cfg).unwrap();
    assert_eq!(
        peft.weights,
        a.policy()
            .valid()
            .lora_weights(&peft.weights.config)
            .unwrap()
    );

    let next = a.step(&samples).unwrap();
    // A fresh learner over the same base (its own adapter state) takes the checkpoint's.
    let fresh = learner(7);
    let mut b = checkpoint::restore_onto(&checkpoint::latest(dir.path()).unwrap(), &fresh).unwrap();
    assert_eq!((b.version(), b.steps()), (1, 1));
    let resumed = b.step(&samples).unwrap();
    assert_eq!(
        (resumed.loss.to_bits(), resumed.grad_norm.to_bits()),
        (next.loss.to_bits(), next.grad_norm.to_bits()),
        "resumed {resumed:?} vs uninterrupted {next:?}"
    );
    assert!(a.export_weights().unwrap().bytes == b.export_weights().unwrap().bytes);

    // Without a base, or onto another one, the checkpoint is refused.
    let e = checkpoint::restore::<CpuAutodiff>(&saved, &Default::default()).expect_err("no base");
    assert!(matches!(e, CheckpointError::NeedsBase { .. }), "{e}");
    // The fixture's adapter folded in: a base with other weights.
    let (cfg, model) = adapted::<B>();
    let merged = model_to_safetensors(&model.merge_lora(), &cfg).unwrap();
    let other_base = model_from_safetensors::<CpuAutodiff>(&cfg, &merged, &Default::default())
        .unwrap()
        .with_lora(&LoraWeights::fresh(&peft.weights.config, &cfg, 1))
        .unwrap();
    let other =
        BurnLearner::<CpuAutodiff>::new(cfg, other_base, train.clone(), Default::default(), 0);
    let e = checkpoint::restore_onto(&saved, &other).expect_err("another base");
    assert!(matches!(e, CheckpointError::OtherBase { .. }), "{e}");

    // Onto a learner of whole weights, or of another adapter shape, it is refused too.
    let (cfg, model) = load_model::<CpuAutodiff>(&base_dir(), &Default::default()).unwrap();
    let whole =
        BurnLearner::<CpuAutodiff>::new(cfg.clone(), model, train.clone(), Default::default(), 0);
    let e = checkpoint::restore_onto(&saved, &whole).expect_err("whole weights");
    assert!(matches!(e, CheckpointError::OtherLayout { .. }), "{e}");
    let (_, model) = load_model::<CpuAutodiff>(&base_dir(), &Default::default()).unwrap();
    let rank2 = LoraConfig::parse_cli("2,4,all").unwrap();
    let other_shape = BurnLearner::<CpuAutodiff>::new(
        cfg.clone(),
        model
            .with_lora(&LoraWeights::fresh(&rank2, &cfg, 1))
            .unwrap(),
        train.clone(),
        Default::default(),
        0,
    );
    let e = checkpoint::restore_onto(&saved, &other_shape).expect_err("another rank");
    assert!(
        matches!(e, CheckpointError::OtherLayout { .. }) && e.to_string().contains("r: 2"),
        "{e}"
    );
    // And a learner with an adapter does not take a checkpoint of whole weights.
    let whole_dir = tempfile::tempdir().unwrap();
    let whole_ck = checkpoint::save(&whole, whole_dir.path(), 0).unwrap();
    let e = checkpoint::restore_onto(&whole_ck, &fresh).expect_err("whole into adapter");
    assert!(matches!(e, CheckpointError::OtherLayout { .. }), "{e}");
}

/// A second adapter of the fixture's shape whose `B` is not zero (so it changes the outputs):
/// every tensor drawn from a seeded stream, `B` scaled to move the logits visibly.
fn other_adapter(cfg: &clawrl::model::Qwen3Config, like: &LoraConfig, seed: u64) -> LoraWeights {
    let mut w = LoraWeights::fresh(like, cfg, seed);
    let mut x = seed as f32;
    for (_, b) in w.tensors.values_mut() {
        for v in b.iter_mut() {
            x = (x * 1.618 + 0.37).fract();
            *v = (x - 0.5) * 0.2;
        }
    }
    w
}

/// Rows of one decode batch over different adapters (and the base itself) give each row what
/// its own model gives it decoding alone, with the base's linear weights kept either way; the
/// two layouts agree.
#[test]
fn a_batch_of_rows_over_different_adapters_decodes_as_each_alone() {
    let in_out = mixed_batch_decodes_as_each_alone(LinearLayout::InOut);
    let out_in = mixed_batch_decodes_as_each_alone(LinearLayout::OutIn);
    let d = max_abs(&in_out, &out_in);
    assert!(d < 1e-4, "the layouts' mixed batches differ by {d}");
}

/// The mixed batch's outputs, every step's, each row checked against its model alone.
fn mixed_batch_decodes_as_each_alone(layout: LinearLayout) -> Vec<f32> {
    let (cfg, adapted) = adapted::<B>();
    let lora = adapted.lora_config().unwrap();
    let base = adapted.clone().without_lora().into_layout(layout);
    let with_fixture = base
        .clone()
        .with_lora(&adapted.lora_weights(&lora).unwrap())
        .unwrap();
    let second = base
        .clone()
        .with_lora(&other_adapter(&cfg, &lora, 5))
        .unwrap();
    let models = [&with_fixture, &base, &second, &with_fixture];
    let prompts: [&[u32]; 4] = [
        &[1, 2, 3, 4, 5],
        &[9, 8, 7],
        &[4, 4, 4, 4, 4, 4, 2],
        &[30, 31],
    ];
    let mut together = Vec::new();
    let mut alone = Vec::new();
    for (m, p) in models.iter().zip(prompts) {
        let mut c = m.new_cache(64);
        m.prefill(p, &mut c).unwrap();
        together.push(c);
        let mut c = m.new_cache(64);
        m.prefill(p, &mut c).unwrap();
        alone.push(c);
    }
    let vocab = cfg.vocab_size;
    let mut tokens = vec![11u32, 12, 13, 14];
    let mut outputs = Vec::new();
    for step in 0..3 {
        let mut caches: Vec<_> = together.iter_mut().collect();
        let mixed: Vec<f32> = base
            .decode_step_mixed(&tokens, &mut caches, &models)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap();
        for (i, m) in models.iter().enumerate() {
            let own: Vec<f32> = m
                .decode_step(&tokens[i..=i], &mut [&mut alone[i]])
                .unwrap()
                .into_data()
                .to_vec()
                .unwrap();
            let d = max_abs(&mixed[i * vocab..(i + 1) * vocab], &own);
            assert!(
                d < 1e-4,
                "{layout:?}, step {step} row {i}: max abs diff {d}"
            );
        }
        outputs.extend(mixed);
        tokens = tokens.iter().map(|t| t + 7).collect();
    }
    // The adapters matter: the rows of the base and of each adapter differ.
    let row = |t: &[u32], m: &Qwen3<B>| -> Vec<f32> {
        let mut c = m.new_cache(64);
        m.prefill(t, &mut c).unwrap().into_data().to_vec().unwrap()
    };
    assert!(max_abs(&row(prompts[0], &base), &row(prompts[0], &with_fixture)) > 1e-3);
    assert!(max_abs(&row(prompts[0], &base), &row(prompts[0], &second)) > 1e-3);
    outputs
}

/// One engine serves the base and two attached adapters at once: each request gets what an
/// engine over its own adapted model gives, an adapter that does not fit the base fails its
/// requests by name, and a version's adapter outlives the handle while a request runs on it.
#[test]
fn one_engine_serves_several_adapters_as_separate_engines_would() {
    let (cfg, with_fixture) = adapted::<B>();
    let lora = with_fixture.lora_config().unwrap();
    let base = with_fixture.clone().without_lora();
    let second_weights = other_adapter(&cfg, &lora, 9);
    let second = base.clone().with_lora(&second_weights).unwrap();
    let options = EngineOptions::default();
    let shared = spawn_engine(std::sync::Arc::new(base.clone()), None, options);
    let handles = [
        shared.attach(with_fixture.lora_weights(&lora).unwrap()),
        shared.clone(),
        shared.attach(second_weights),
    ];
    let separate = [
        spawn_engine(std::sync::Arc::new(with_fixture.clone()), None, options),
        spawn_engine(std::sync::Arc::new(base.clone()), None, options),
        spawn_engine(std::sync::Arc::new(second.clone()), None, options),
    ];
    let request = |i: usize| {
        GenerationRequest::new(
            vec![3 + i as u32, 17, 29, 5, 8],
            SamplingParams {
                temperature: 0.0,
                max_new_tokens: 12,
                seed: i as u64,
                ..Default::default()
            },
        )
    };
    // Every request is queued before the first is answered, so they share decode steps.
    let pending: Vec<_> = (0..9).map(|i| handles[i % 3].submit(request(i))).collect();
    let got: Vec<_> = pending
        .into_iter()
        .map(|rx| rx.blocking_recv().unwrap().unwrap())
        .collect();
    for (i, g) in got.iter().enumerate() {
        let want = separate[i % 3].generate_blocking(request(i)).unwrap();
        assert_eq!(g.response_ids, want.response_ids, "request {i}");
        let d = max_abs(&g.logprobs, &want.logprobs);
        assert!(d < 1e-4, "request {i}: log-probs differ by {d}");
    }
    assert_ne!(got[0].response_ids, got[1].response_ids, "adapter 1 = base");
    assert_ne!(got[2].response_ids, got[1].response_ids, "adapter 2 = base");

    // An adapter missing a layer's tensors is refused when a request runs on it.
    let mut broken = with_fixture.lora_weights(&lora).unwrap();
    let first = *broken.tensors.keys().next().unwrap();
    broken.tensors.remove(&first);
    let e = shared
        .attach(broken)
        .generate_blocking(request(0))
        .unwrap_err();
    assert!(
        matches!(&e, clawrl::model::EngineError::Adapter(m) if m.contains("layer 0")),
        "{e}"
    );

    // A request submitted on an adapter handle finishes on that adapter after the handle goes.
    let attached = shared.attach(with_fixture.lora_weights(&lora).unwrap());
    let rx = attached.submit(request(0));
    drop(attached);
    assert_eq!(
        rx.blocking_recv().unwrap().unwrap().response_ids,
        got[0].response_ids
    );
}
