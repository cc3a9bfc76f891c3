//! Checkpoint directories and weight blobs: save/load round trips, shards and dtypes, tied
//! embeddings under autodiff, and clear errors for bad input (each names the file or tensor).

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use clawrl::model::{
    load_checkpoint, load_model, model_from_safetensors, model_from_safetensors_as,
    model_to_safetensors, save_checkpoint_dir, LinearLayout, LoadError, Qwen3, Qwen3Config,
};
use clawrl::{CpuAutodiff, CpuBackend};
use safetensors::{Dtype, SafeTensors};

type B = CpuBackend;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny")
}

const IDS: [i64; 10] = [1, 91, 89, 292, 205, 337, 274, 361, 349, 2];

fn logits<BB: burn::tensor::backend::Backend>(m: &Qwen3<BB>) -> Vec<f32> {
    let input = Tensor::<BB, 2, Int>::from_data(
        TensorData::new(IDS.to_vec(), [1, 10]),
        &Default::default(),
    );
    m.forward(input)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
}

/// A copy of the fixture in a temp dir, with `edit` applied to its files.
fn fixture_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(fixture_dir().join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// The fixture tensors as `name → (dtype, shape, bytes)`.
fn fixture_tensors() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(fixture_dir().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write_st(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn bf16_to(dtype: Dtype, b: &[u8]) -> Vec<u8> {
    b.chunks_exact(2)
        .flat_map(|c| {
            let x = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            match dtype {
                Dtype::F32 => x.to_le_bytes().to_vec(),
                Dtype::F16 => half::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                _ => unreachable!(),
            }
        })
        .collect()
}

#[test]
fn load_save_load_gives_identical_logits() {
    let ck = load_checkpoint::<B>(&fixture_dir(), &Default::default()).unwrap();
    let out = tempfile::tempdir().unwrap();
    save_checkpoint_dir(out.path(), &ck.config, &ck.model, &ck.files).unwrap();
    let ck2 = load_checkpoint::<B>(out.path(), &Default::default()).unwrap();
    assert_eq!(logits(&ck.model), logits(&ck2.model));
    assert_eq!(ck2.config.vocab_size, ck.config.vocab_size);
    assert_eq!(ck2.chat_template.source(), ck.chat_template.source());
    // The saved weights are f32 with HF names and [out, in] layout.
    let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let q = st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(q.dtype(), Dtype::F32);
    assert_eq!(q.shape(), &[64, 64]);
    assert_eq!(
        st.tensor("model.layers.0.mlp.down_proj.weight")
            .unwrap()
            .shape(),
        &[64, 128]
    );
}

#[test]
fn weight_blob_round_trip_is_exact_tied_and_untied() {
    let (cfg, model) = load_model::<B>(&fixture_dir(), &Default::default()).unwrap();
    let blob = model_to_safetensors(&model, &cfg).unwrap();
    let replica = model_from_safetensors::<B>(&cfg, &blob, &Default::default()).unwrap();
    assert_eq!(logits(&model), logits(&replica));

    let mut untied = cfg.clone();
    untied.tie_word_embeddings = false;
    let m = Qwen3::<B>::init(&untied, &Default::default(), 7);
    assert!(m.lm_head.is_some());
    let blob = model_to_safetensors(&m, &untied).unwrap();
    assert!(SafeTensors::deserialize(&blob)
        .unwrap()
        .tensor("lm_head.weight")
        .is_ok());
    let r = model_from_safetensors::<B>(&untied, &blob, &Default::default()).unwrap();
    assert_eq!(logits(&m), logits(&r));
    // A tied config cannot take an untied model.
    assert!(model_to_safetensors(&m, &cfg).is_err());
}

/// The linear weights kept `[out, in]` (read through a transposed view) hold the same values as
/// kept `[in, out]`, whether loaded so or relaid, and back; the logits agree to rounding (the
/// products' sums may be taken in another order), tied and untied.
#[test]
fn both_linear_layouts_hold_the_same_weights() {
    let (cfg, model) = load_model::<B>(&fixture_dir(), &Default::default()).unwrap();
    let mut untied = cfg.clone();
    untied.tie_word_embeddings = false;
    for (cfg, model) in [
        (cfg.clone(), model),
        (
            untied.clone(),
            Qwen3::<B>::init(&untied, &Default::default(), 7),
        ),
    ] {
        let blob = model_to_safetensors(&model, &cfg).unwrap();
        let loaded =
            model_from_safetensors_as::<B>(&cfg, &blob, &Default::default(), LinearLayout::OutIn)
                .unwrap();
        let relaid = model.clone().into_layout(LinearLayout::OutIn);
        let back = relaid.clone().into_layout(LinearLayout::InOut);
        for m in [&loaded, &relaid, &back] {
            assert_eq!(model_to_safetensors(m, &cfg).unwrap(), blob);
            let (want, got) = (logits(&model), logits(m));
            let scale = want.iter().fold(0f32, |s, x| s.max(x.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 * scale, "{g} against {w}");
            }
        }
        assert_eq!(logits(&back), logits(&model));
    }
}

#[test]
fn shards_in_f32_and_f16_load_like_bf16() {
    let base = logits(
        &load_model::<B>(&fixture_dir(), &Default::default())
            .unwrap()
            .1,
    );
    let dir = fixture_copy();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let tensors = fixture_tensors();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let conv = |ts: &[(String, Dtype, Vec<usize>, Vec<u8>)], d: Dtype| -> Vec<_> {
        ts.iter()
            .map(|(n, _, s, by)| (n.clone(), d, s.clone(), bf16_to(d, by)))
            .collect()
    };
    write_st(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &conv(a, Dtype::F32),
    );
    write_st(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &conv(b, Dtype::F16),
    );
    let mut map = serde_json::Map::new();
    for (n, ..) in a {
        map.insert(n.clone(), "model-00001-of-00002.safetensors".into());
    }
    for (n, ..) in b {
        map.insert(n.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let got = logits(&load_model::<B>(dir.path(), &Default::default()).unwrap().1);
    let err = got
        .iter()
        .zip(&base)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err < 1e-5, "sharded f32/f16 logits differ by {err}");
}

#[test]
fn tied_embedding_is_one_parameter_getting_both_gradients() {
    let (cfg, model) = load_model::<CpuAutodiff>(&fixture_dir(), &Default::default()).unwrap();
    assert!(model.lm_head.is_none());
    assert_eq!(model.num_params(), cfg.num_parameters());
    let input = Tensor::<CpuAutodiff, 2, Int>::from_data(
        TensorData::new(IDS.to_vec(), [1, 10]),
        &Default::default(),
    );
    let loss = model.forward(input).narrow(2, 500, 1).sum();
    let grads = loss.backward();
    let g: Vec<f32> = model
        .embed_tokens
        .grad(&grads)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let h = cfg.hidden_size;
    let row_norm = |r: usize| g[r * h..(r + 1) * h].iter().map(|x| x.abs()).sum::<f32>();
    // Row 500 is never an input: its gradient comes only from the LM-head use.
    assert!(row_norm(500) > 0.0);
    // Row 91 is an input and not the head row: its gradient comes from the embedding use.
    assert!(row_norm(91) > 0.0);
    // Row 499 is neither: no gradient.
    assert_eq!(row_norm(499), 0.0);
}

fn load_err(dir: &Path) -> String {
    let e: LoadError = load_checkpoint::<B>(dir, &Default::default()).unwrap_err();
    e.to_string()
}

#[test]
fn bad_input_errors_name_the_file_or_tensor() {
    // Missing file.
    let d = fixture_copy();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("missing file") && e.contains("model.safetensors"),
        "{e}"
    );
    let d = fixture_copy();
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("tokenizer.json"), "{e}");

    // Unknown architecture.
    let d = fixture_copy();
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    std::fs::write(
        d.path().join("config.json"),
        cfg.replace("Qwen3ForCausalLM", "LlamaForCausalLM"),
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("config.json") && e.contains("LlamaForCausalLM"),
        "{e}"
    );

    // Wrong shape.
    let d = fixture_copy();
    let mut ts = fixture_tensors();
    let t = ts
        .iter_mut()
        .find(|t| t.0 == "model.layers.1.self_attn.k_proj.weight")
        .unwrap();
    t.2 = vec![64, 32];
    write_st(&d.path().join("model.safetensors"), &ts);
    let e = load_err(d.path());
    assert!(
        e.contains("model.layers.1.self_attn.k_proj.weight")
            && e.contains("[64, 32]")
            && e.contains("[32, 64]"),
        "{e}"
    );

    // Missing tensor.
    let d = fixture_copy();
    let ts: Vec<_> = fixture_tensors()
        .into_iter()
        .filter(|t| t.0 != "model.norm.weight")
        .collect();
    write_st(&d.path().join("model.safetensors"), &ts);
    let e = load_err(d.path());
    assert!(
        e.contains("model.norm.weight") && e.contains("not found"),
        "{e}"
    );

    // Unsupported dtype.
    let d = fixture_copy();
    let mut ts = fixture_tensors();
    let t = ts.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
    t.1 = Dtype::I16;
    write_st(&d.path().join("model.safetensors"), &ts);
    let e = load_err(d.path());
    assert!(e.contains("model.norm.weight") && e.contains("I16"), "{e}");

    // Corrupt safetensors.
    let d = fixture_copy();
    std::fs::write(d.path().join("model.safetensors"), b"not safetensors").unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("invalid safetensors"),
        "{e}"
    );

    // A template that does not parse, and one that fails to render.
    let d = fixture_copy();
    std::fs::write(
        d.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("chat_template.jinja") && e.contains("does not parse"),
        "{e}"
    );
    let d = fixture_copy();
    std::fs::write(
        d.path().join("chat_template.jinja"),
        "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}",
    )
    .unwrap();
    let ck = load_checkpoint::<B>(d.path(), &Default::default()).unwrap();
    let msgs =
        clawrl::model::chat::parse_json_value(r#"[{"role":"user","content":"hi"}]"#, "m").unwrap();
    let e = ck.encode_chat(&msgs, None).unwrap_err().to_string();
    assert!(
        e.contains("chat_template.jinja") && e.contains("first message must be system"),
        "{e}"
    );

    // A blob with a bad config.
    let mut cfg: Qwen3Config = load_model::<B>(&fixture_dir(), &Default::default())
        .unwrap()
        .0;
    cfg.hidden_act = "gelu".into();
    let e = model_from_safetensors::<B>(&cfg, &[], &Default::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden_act"), "{e}");
}
