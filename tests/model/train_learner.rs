//! BurnLearner behaviour on the tiny Qwen3 fixture: versioned weight export, checkpoint resume,
//! batching invariance, recomputed old log-probs, the rollout gap and skipped steps.

use std::path::Path;

use clawrl::model::{load_model, model_from_safetensors};
use clawrl::train::checkpoint;
use clawrl::train::learner::{sample_logprobs, BurnLearner};
use clawrl::train::{OpdLossKind, Sample, TrainConfig};
use clawrl::{CpuAutodiff, CpuBackend};
use rand::Rng;

const DIR: &str = "tests/fixtures/qwen3-tiny";

fn learner(kl_coef: f64) -> BurnLearner {
    learner_with(kl_coef, OpdLossKind::Advantage)
}

fn learner_with(kl_coef: f64, opd_loss: OpdLossKind) -> BurnLearner {
    let device = Default::default();
    let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
    let train = TrainConfig {
        lr: 1e-3,
        kl_coef,
        batch_size: 3,
        opd_loss,
        ..TrainConfig::default()
    };
    BurnLearner::new(cfg, model, train, device, 7)
}

/// Three samples of different prompt and response lengths with mixed-sign advantages.
fn samples() -> Vec<Sample> {
    let mk = |p: &[u32], r: &[u32], a: f32| Sample {
        prompt_ids: p.to_vec(),
        response_ids: r.to_vec(),
        advantages: (0..r.len()).map(|k| a + 0.1 * k as f32).collect(),
        old_logprobs: None,
        ref_logprobs: None,
        rollout_logprobs: None,
        opd: None,
        importance: None,
    };
    vec![
        mk(&[1, 91, 89, 292, 205, 13], &[40, 41, 42, 2], 1.0),
        mk(&[1, 89], &[300, 301, 302, 303, 304, 305, 2], -1.0),
        mk(&[1, 7, 8, 9, 10, 11, 12, 13, 14, 15], &[77, 2], 0.5),
    ]
}

/// A second batch: the first one's responses with noisy old log-probs so that ratios clip.
fn samples_with_old(l: &BurnLearner) -> Vec<Sample> {
    let mut s = samples();
    let own = l.logprobs(&s).unwrap();
    for (i, (s, own)) in s.iter_mut().zip(own).enumerate() {
        s.old_logprobs = Some(
            own.iter()
                .enumerate()
                .map(|(k, x)| x + 0.3 * (((i * 7 + k * 3) % 5) as f32 - 2.0))
                .collect(),
        );
    }
    s
}

#[test]
fn exported_weights_are_versioned_and_replicas_match_exactly() {
    let mut l = learner(0.0);
    let s = samples();
    let w0 = l.export_weights().unwrap();
    assert_eq!(w0.version, 0);
    let mut last = w0.version;
    for _ in 0..2 {
        let m = l.step(&s).unwrap();
        assert_eq!(m.skipped, None);
        let w = l.export_weights().unwrap();
        assert_eq!(w.version, last + 1);
        last = w.version;
        let replica =
            model_from_safetensors::<CpuBackend>(l.model_config(), &w.bytes, &Default::default())
                .unwrap();
        let theirs = sample_logprobs(&replica, &s).unwrap();
        assert_eq!(
            theirs,
            l.logprobs(&s).unwrap(),
            "replica log-probs differ at version {last}"
        );
    }
    // The weights moved: version 0's replica disagrees.
    let replica0 =
        model_from_safetensors::<CpuBackend>(l.model_config(), &w0.bytes, &Default::default())
            .unwrap();
    assert_ne!(
        sample_logprobs(&replica0, &s).unwrap(),
        l.logprobs(&s).unwrap()
    );
}

#[test]
fn resumed_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = learner(0.05);
    a.step(&samples()).unwrap();
    let _: u64 = a.rng().random();
    let saved = checkpoint::save(&a, dir.path(), 2).unwrap();
    assert_eq!(checkpoint::latest(dir.path()).unwrap(), saved);
    // No temporary leftovers.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");

    let mut b: BurnLearner = checkpoint::restore(&saved, &Default::default()).unwrap();
    assert_eq!((b.version(), b.steps()), (a.version(), a.steps()));
    assert_eq!(b.rng().random::<u64>(), a.rng().random::<u64>());

    let batch = samples_with_old(&a);
    let ma = a.step(&batch).unwrap();
    let mb = b.step(&batch).unwrap();
    assert_eq!(ma, mb);
    assert!(ma.clip_fraction > 0.0 && ma.kl > 0.0, "{ma:?}");
    assert_eq!(
        a.export_weights().unwrap().bytes,
        b.export_weights().unwrap().bytes,
        "weights after the resumed step differ"
    );
    // A third step also agrees (optimizer moments were restored, not just weights).
    let mc = a.step(&samples()).unwrap();
    let md = b.step(&samples()).unwrap();
    assert_eq!(mc, md);

    // Older checkpoints are pruned to `keep`.
    checkpoint::save(&a, dir.path(), 2).unwrap();
    checkpoint::save(&b, dir.path(), 2).unwrap(); // same step: replaced in place
    let mut e = learner(0.0);
    e.step(&samples()).unwrap();
    e.step(&samples()).unwrap();
    e.step(&samples()).unwrap();
    e.step(&samples()).unwrap();
    checkpoint::save(&e, dir.path(), 2).unwrap();
    let mut steps: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    steps.sort();
    assert_eq!(steps, vec!["step-00000003", "step-00000004"]);
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-12)
}

#[test]
fn loss_is_invariant_to_order_and_padding() {
    let base = {
        let l = learner(0.05);
        samples_with_old(&l)
    };
    let mut reversed = base.clone();
    reversed.reverse();
    let rotated = vec![base[1].clone(), base[2].clone(), base[0].clone()];
    let longest = base.iter().map(Sample::len).max().unwrap();

    let mut ref_l = learner(0.05);
    let m0 = ref_l.step(&base).unwrap();
    let w0 = ref_l.export_weights().unwrap().bytes;
    for (batch, pad) in [
        (&base, Some(longest + 9)),
        (&reversed, None),
        (&rotated, Some(longest + 3)),
    ] {
        let mut l = learner(0.05);
        let m = l.step_padded(batch, pad).unwrap();
        for (name, x, y) in [
            ("loss", m.loss, m0.loss),
            ("pg_loss", m.pg_loss, m0.pg_loss),
            ("kl", m.kl, m0.kl),
            ("clip_fraction", m.clip_fraction, m0.clip_fraction),
            ("grad_norm", m.grad_norm, m0.grad_norm),
        ] {
            assert!(close(x, y, 1e-5), "{name}: {x} vs {y} (pad {pad:?})");
        }
        // Updated weights agree to float rounding.
        let a = model_from_safetensors::<CpuBackend>(l.model_config(), &w0, &Default::default())
            .unwrap();
        let pa = sample_logprobs(&a, &base).unwrap();
        let pb = l.logprobs(&base).unwrap();
        for (x, y) in pa.iter().flatten().zip(pb.iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}

#[test]
fn missing_old_logprobs_are_the_policys_own_and_rollout_gap_is_reported() {
    let mut l = learner(0.0);
    let mut s = samples();
    let own = l.logprobs(&s).unwrap();
    for (s, own) in s.iter_mut().zip(&own) {
        s.rollout_logprobs = Some(own.iter().map(|x| x - 0.25).collect());
    }
    let m = l.step(&s).unwrap();
    // Ratio 1 everywhere: nothing clips and pg_loss is minus the mean advantage.
    assert_eq!(m.clip_fraction, 0.0);
    let mean_adv: f64 = s
        .iter()
        .map(|s| s.advantages.iter().map(|&a| a as f64).sum::<f64>() / s.advantages.len() as f64)
        .sum::<f64>()
        / s.len() as f64;
    assert!(
        close(m.pg_loss, -mean_adv, 1e-5),
        "{} vs {}",
        m.pg_loss,
        -mean_adv
    );
    assert_eq!(m.kl, 0.0);
    let gap = m.logprob_gap.unwrap();
    assert_eq!(gap.tokens, 13);
    assert!(
        (gap.mean + 0.25).abs() < 1e-5
            && (gap.mean_abs - 0.25).abs() < 1e-5
            && (gap.max_abs - 0.25).abs() < 1e-5,
        "{gap:?}"
    );
    assert!(m.old_recomputed, "no sample brought old log-probs");
    assert!(m.grad_norm > 0.0 && m.tokens == 13);
}

#[test]
fn non_finite_loss_skips_the_step_and_leaves_weights_untouched() {
    let mut l = learner(0.0);
    let mut s = samples();
    // old log-probs far below the new ones: the ratio overflows to inf, and with a negative
    // advantage the unclipped term is +inf.
    s[1].old_logprobs = Some(vec![-200.0; s[1].response_ids.len()]);
    let before = l.export_weights().unwrap();
    let m = l.step(&s).unwrap();
    assert!(
        m.skipped
            .as_deref()
            .unwrap_or("")
            .contains("non-finite loss"),
        "{m:?}"
    );
    assert_eq!((m.step, m.version), (0, 0));
    let after = l.export_weights().unwrap();
    assert!(before.bytes == after.bytes);
    assert_eq!(after.version, 0);
    assert!(l.optimizer().export_state().is_empty());
    // The learner still trains on good data afterwards.
    let m = l.step(&samples()).unwrap();
    assert_eq!((m.skipped, m.version), (None, 1));
}

#[test]
fn invalid_batches_are_refused() {
    let mut l = learner(0.0);
    let mut s = samples();
    s[2].response_ids.push(9999);
    s[2].advantages.push(0.0);
    let err = l.step(&s).unwrap_err().to_string();
    assert!(err.contains("sample 2") && err.contains("9999"), "{err}");
    let err = l.step(&[]).unwrap_err().to_string();
    assert!(err.contains("empty batch"), "{err}");
}

/// The OPD term is `teacher − log π_old` with the trainer's own old log-probs (temperature 1),
/// never the rollout's. With the teacher equal to the current policy under the original prompt,
/// every OPD advantage is 0 even for a response sampled at temperature 0.7, whose rollout
/// log-probs differ from the policy's by far more; the step then has no gradient.
#[test]
fn the_opd_term_uses_the_trainers_old_logprobs_not_the_rollouts() {
    use clawrl::model::SamplingParams;
    use clawrl::model::{load_checkpoint, spawn_engine, EngineOptions, GenerationRequest};
    use clawrl::train::OpdTerm;
    use std::sync::Arc;

    let ck = load_checkpoint::<CpuBackend>(Path::new(DIR), &Default::default()).unwrap();
    let prompt: Vec<u32> = vec![1, 91, 89, 292, 205, 13, 2, 1, 40];
    let engine = spawn_engine(
        Arc::new(ck.model.clone()),
        None,
        EngineOptions {
            max_batch: 1,
            max_context: 512,
            ..EngineOptions::default()
        },
    );
    let generated = engine
        .submit(GenerationRequest {
            prompt_ids: prompt.clone(),
            params: SamplingParams {
                temperature: 0.7,
                max_new_tokens: 12,
                seed: 11,
                ..Default::default()
            },
            raw_logprobs: None,
        })
        .blocking_recv()
        .unwrap()
        .unwrap();
    let mut sample = Sample {
        prompt_ids: prompt,
        response_ids: generated.response_ids.clone(),
        advantages: vec![0.0; generated.response_ids.len()],
        old_logprobs: None,
        ref_logprobs: None,
        rollout_logprobs: Some(generated.logprobs.clone()),
        opd: None,
        importance: None,
    };
    // The teacher: the current policy scoring the original prompt (no hint), as the trainer's
    // model computes it.
    let mut l = learner(0.0);
    let teacher = l.logprobs(std::slice::from_ref(&sample)).unwrap()[0].clone();
    let tempered_gap = teacher
        .iter()
        .zip(&generated.logprobs)
        .map(|(t, r)| (t - r).abs())
        .fold(0f32, f32::max);
    assert!(
        tempered_gap > 1e-2,
        "the rollout's log-probs are tempered: {tempered_gap}"
    );
    sample.opd = Some(OpdTerm {
        weight: 1.0,
        teacher_logprobs: teacher,
        topk: None,
    });

    let old = l.logprobs(std::slice::from_ref(&sample)).unwrap();
    for a in sample.effective_advantages(&old[0]) {
        assert!(a.abs() < 1e-6, "OPD advantage {a}");
    }
    let m = l.step(&[sample]).unwrap();
    assert!(m.skipped.is_none(), "{m:?}");
    assert!(m.grad_norm < 1e-4, "no advantage, no gradient: {m:?}");
}

/// The top-k OPD loss in a learner step (`opd_loss = "topk"`): a teacher that is the policy
/// itself on the same prompt gives a zero KL and no gradient, whatever the window offsets of the
/// samples; a teacher on another prompt gives a positive KL whose value the step adds to the
/// loss, weighted by `w_opd`, beside the policy-gradient term; samples of the other form, or
/// top-k data of another `k`, are refused.
#[test]
fn the_topk_opd_loss_is_a_term_of_its_own() {
    use burn::module::AutodiffModule;
    use clawrl::model::score_response_topk;
    use clawrl::train::learner::StepError;
    use clawrl::train::{OpdTerm, TeacherTopK};

    let topk_learner = || learner_with(0.0, OpdLossKind::Topk);
    let k = 8;
    // The teacher's top-k of each sample's response, scored by the learner's own policy on
    // `prompt_of(sample)`.
    let with_teacher = |l: &BurnLearner, prompt_of: &dyn Fn(&Sample) -> Vec<u32>, weight: f32| {
        let policy = l.policy().valid();
        let mut s = samples();
        for s in &mut s {
            s.advantages.iter_mut().for_each(|a| *a = 0.0);
            let t = score_response_topk(&policy, &prompt_of(s), &s.response_ids, k);
            s.opd = Some(OpdTerm {
                weight,
                teacher_logprobs: t.logprobs,
                topk: Some(TeacherTopK {
                    k: k as u32,
                    ids: t.ids,
                    logprobs: t.topk_logprobs,
                }),
            });
        }
        s
    };

    // Teacher = student: KL 0, no gradient.
    let mut l = topk_learner();
    let same = with_teacher(&l, &|s| s.prompt_ids.clone(), 1.0);
    let m = l.step(&same).unwrap();
    assert_eq!((m.opd_loss, m.opd_samples), (OpdLossKind::Topk, 3));
    assert!(m.topk_kl.abs() < 1e-5, "{m:?}");
    assert!(m.grad_norm < 1e-4, "{m:?}");

    // A teacher that saw another prompt: a positive KL, in the loss with weight w_opd.
    let other = |s: &Sample| {
        let mut p = vec![1, 300, 301];
        p.extend_from_slice(&s.prompt_ids[1..]);
        p
    };
    let (mut a, mut b) = (topk_learner(), topk_learner());
    let m1 = a.step(&with_teacher(&a, &other, 1.0)).unwrap();
    let m2 = b.step(&with_teacher(&b, &other, 0.5)).unwrap();
    assert!(m1.topk_kl > 1e-3, "{m1:?}");
    assert!((m2.topk_kl - 0.5 * m1.topk_kl).abs() < 1e-5 * m1.topk_kl.max(1.0));
    assert!((m1.loss - (m1.pg_loss + m1.topk_kl)).abs() < 1e-6, "{m1:?}");
    assert!(m1.grad_norm > 1e-4, "{m1:?}");

    // The advantage form under a top-k learner, and mixed k in one batch, are refused.
    let mut l = topk_learner();
    let mut mixed = with_teacher(&l, &other, 1.0);
    mixed[2].opd.as_mut().unwrap().topk = None;
    assert!(matches!(
        l.step(&mixed),
        Err(StepError::OpdLoss { index: 2, .. })
    ));
    let mut uneven = with_teacher(&l, &other, 1.0);
    let n = uneven[1].response_ids.len();
    let t = uneven[1].opd.as_mut().unwrap().topk.as_mut().unwrap();
    t.k = 1;
    t.ids.truncate(n);
    t.logprobs.truncate(n);
    assert!(matches!(
        l.step(&uneven),
        Err(StepError::TopKMismatch { index: 1, .. })
    ));
    // And a top-k sample under an advantage learner.
    let mut plain = learner(0.0);
    assert!(matches!(
        plain.step(&with_teacher(&plain, &other, 1.0)),
        Err(StepError::OpdLoss { index: 0, .. })
    ));
}

/// Three samples that share a 20-token prefix, with remainders of 3, 9 and 5 tokens (the
/// prefix covers part of the first prompt only).
fn prefixed_samples() -> Vec<Sample> {
    let prefix: Vec<u32> = (0..20).map(|i| 30 + 11 * i).collect();
    let mk = |tail: &[u32], response: &[u32], a: f32| Sample {
        prompt_ids: [prefix.as_slice(), tail].concat(),
        response_ids: response.to_vec(),
        advantages: (0..response.len()).map(|k| a - 0.2 * k as f32).collect(),
        old_logprobs: None,
        ref_logprobs: None,
        rollout_logprobs: None,
        opd: None,
        importance: None,
    };
    vec![
        mk(&[5], &[40, 2], 1.0),
        mk(&[6, 7, 8, 9], &[300, 301, 302, 303, 2], -0.5),
        mk(&[6, 7], &[77, 78, 2], 0.7),
    ]
}

/// Shared-prefix packing changes the order of the arithmetic, never the result: the log-probs
/// and the gradient of every parameter a weighted loss touches, and a whole learner step (loss,
/// KL, gradient norm, updated weights), equal those of the unpacked samples.
#[test]
fn packed_prefixes_give_the_unpacked_loss_and_gradients() {
    use burn::module::Param;
    use burn::tensor::{Tensor, TensorData};
    use clawrl::train::learner::{window_logprobs, PAD_ID};
    use clawrl::train::packing::Packing;
    use clawrl::train::BatchLayout;

    let device = Default::default();
    let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
    let samples = prefixed_samples();
    let layout = BatchLayout::new(&samples, None, PAD_ID, Some(cfg.vocab_size)).unwrap();
    let packed = Packing::packed(&samples, &layout, PAD_ID);
    assert_eq!(packed.groups.len(), 1, "{packed:?}");
    assert_eq!(packed.groups[0].prefix.len(), 20);
    assert!(packed.ratio() < 1.0, "{}", packed.ratio());

    let (b, w) = (layout.batch, layout.window);
    let run = |packing: &Packing| {
        let lp = window_logprobs(&model, &layout, packing);
        let weights = Tensor::<CpuAutodiff, 2>::from_data(
            TensorData::new(layout.weights.clone(), [b, w]),
            &device,
        );
        let values = layout.gather(
            &lp.clone()
                .inner()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap(),
        );
        let grads = (lp * weights).sum().backward();
        let layer = model.layers.len() - 1;
        let params: Vec<(&str, &Param<Tensor<CpuAutodiff, 2>>)> = vec![
            ("embed_tokens", &model.embed_tokens),
            ("layers.0.q_proj", &model.layers[0].self_attn.q_proj),
            ("layers.0.k_proj", &model.layers[0].self_attn.k_proj),
            ("layers.0.v_proj", &model.layers[0].self_attn.v_proj),
            ("layers.last.o_proj", &model.layers[layer].self_attn.o_proj),
            ("layers.last.down_proj", &model.layers[layer].mlp.down_proj),
        ];
        let g: Vec<(String, Vec<f32>)> = params
            .into_iter()
            .map(|(name, p)| {
                let g = p.val().grad(&grads).expect("a gradient");
                (
                    name.to_string(),
                    g.into_data().convert::<f32>().to_vec().unwrap(),
                )
            })
            .collect();
        let norm = model.layers[0].input_layernorm.weight.val().grad(&grads);
        let norm: Vec<f32> = norm.unwrap().into_data().convert::<f32>().to_vec().unwrap();
        (values, g, norm)
    };
    let (lp_packed, g_packed, n_packed) = run(&packed);
    let (lp_plain, g_plain, n_plain) = run(&Packing::plain(&samples, &layout));
    for (x, y) in lp_packed.iter().flatten().zip(lp_plain.iter().flatten()) {
        assert!(close(*x as f64, *y as f64, 1e-5), "log-prob {x} vs {y}");
    }
    let mut all = g_packed.into_iter().zip(g_plain).collect::<Vec<_>>();
    all.push((
        ("layers.0.input_layernorm".to_string(), n_packed),
        ("".to_string(), n_plain),
    ));
    for ((name, a), (_, b)) in all {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        assert!(scale > 0.0, "{name}: no gradient reached it");
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() as f64)
            .fold(0.0, f64::max);
        assert!(
            worst <= 1e-5 * scale,
            "{name}: gradients differ by {worst:e} (largest {scale:e})"
        );
    }

    // A whole step, packed and not.
    let step = |pack_prefixes: bool| {
        let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
        let train = TrainConfig {
            lr: 1e-3,
            kl_coef: 0.05,
            batch_size: 3,
            pack_prefixes,
            ..TrainConfig::default()
        };
        let mut l = BurnLearner::new(cfg, model, train, device, 7);
        let m = l.step(&samples).unwrap();
        (m, l.logprobs(&samples).unwrap())
    };
    let ((mp, after_p), (mu, after_u)) = (step(true), step(false));
    assert!(
        mp.packing_ratio < 1.0 && mu.packing_ratio >= 1.0,
        "{mp:?} {mu:?}"
    );
    for (name, x, y) in [
        ("loss", mp.loss, mu.loss),
        ("pg_loss", mp.pg_loss, mu.pg_loss),
        ("kl", mp.kl, mu.kl),
        ("grad_norm", mp.grad_norm, mu.grad_norm),
    ] {
        assert!(close(x, y, 1e-5), "{name}: packed {x} vs unpacked {y}");
    }
    for (x, y) in after_p.iter().flatten().zip(after_u.iter().flatten()) {
        assert!((x - y).abs() < 1e-5, "after the step: {x} vs {y}");
    }
}

/// Recomputing activations changes the order of the gradient arithmetic, never the step: two
/// whole learner steps (loss, KL, gradient norm, then the updated log-probs) equal the stored
/// graph's, for unpacked samples, packed ones (whose prefix feeds its rows' attention in every
/// layer), and an adapter trained over a frozen base (its second step the first with `A`'s
/// gradients, since a fresh adapter's `B` is zero).
#[test]
fn recomputed_activations_give_the_stored_graphs_steps() {
    use clawrl::model::{LoraConfig, LoraWeights};

    let device = Default::default();
    let run = |samples: &[Sample], lora: bool, recompute: bool| {
        let (cfg, model) = load_model::<CpuAutodiff>(Path::new(DIR), &device).unwrap();
        let model = if lora {
            let c = LoraConfig::parse_cli("4,8,all").unwrap();
            model.with_lora(&LoraWeights::fresh(&c, &cfg, 3)).unwrap()
        } else {
            model
        };
        let train = TrainConfig {
            lr: 1e-3,
            kl_coef: 0.05,
            batch_size: samples.len(),
            recompute_activations: recompute,
            ..TrainConfig::default()
        };
        let mut l = BurnLearner::new(cfg, model, train, device, 7);
        let before = l.logprobs(samples).unwrap();
        let metrics = [l.step(samples).unwrap(), l.step(samples).unwrap()];
        (metrics, before, l.logprobs(samples).unwrap())
    };
    for (what, samples, lora) in [
        ("unpacked", samples(), false),
        ("packed", prefixed_samples(), false),
        ("adapter, packed", prefixed_samples(), true),
    ] {
        let (m_r, before, after_r) = run(&samples, lora, true);
        let (m_s, _, after_s) = run(&samples, lora, false);
        for (r, s) in m_r.iter().zip(&m_s) {
            assert_eq!((&r.skipped, &s.skipped), (&None, &None), "{what}");
            for (name, x, y) in [
                ("loss", r.loss, s.loss),
                ("pg_loss", r.pg_loss, s.pg_loss),
                ("kl", r.kl, s.kl),
                ("grad_norm", r.grad_norm, s.grad_norm),
            ] {
                assert!(
                    close(x, y, 1e-5),
                    "{what}, step {}: {name} recomputed {x} vs stored {y}",
                    r.step
                );
            }
        }
        let mut moved = 0f32;
        for ((x, y), b) in after_r
            .iter()
            .flatten()
            .zip(after_s.iter().flatten())
            .zip(before.iter().flatten())
        {
            assert!((x - y).abs() < 1e-5, "{what}, after the steps: {x} vs {y}");
            moved = moved.max((x - b).abs());
        }
        assert!(
            moved > 1e-3,
            "{what}: the steps left the log-probs as they were"
        );
    }
}
