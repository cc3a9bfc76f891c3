//! Low-rank adapters (LoRA) on the policy's linear layers: the adapter configuration
//! (`lora = { r, alpha, targets }`), the adapted layer [`Lora`], and the operations on a whole
//! [`Qwen3`]: attaching adapters (which freezes the base), reading them back as plain data, and
//! merging them into the base weights.
//!
//! An adapted layer computes `W x + (alpha / r) · B (A x)` with `A` `[r, in]` and `B` `[out, r]`
//! in Hugging Face PEFT's orientation. Inside the model they are stored the Burn way, transposed
//! (`A` `[in, r]`, `B` `[r, out]`), as the base weights are. The file format of an adapter lives
//! in [`super::peft`].

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::config::Qwen3Config;
use super::matmul::matmul;
use super::qwen3::{transpose, DecoderLayer, Qwen3};

/// A linear layer of a decoder block that can carry an adapter, named as Hugging Face names its
/// module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    QProj,
    /// `self_attn.k_proj`.
    KProj,
    /// `self_attn.v_proj`.
    VProj,
    /// `self_attn.o_proj`.
    OProj,
    /// `mlp.gate_proj`.
    GateProj,
    /// `mlp.up_proj`.
    UpProj,
    /// `mlp.down_proj`.
    DownProj,
}

impl LoraTarget {
    /// Every target, in the order of a block's forward pass.
    pub const ALL: [LoraTarget; 7] = [
        Self::QProj,
        Self::KProj,
        Self::VProj,
        Self::OProj,
        Self::GateProj,
        Self::UpProj,
        Self::DownProj,
    ];

    /// The module's name (`q_proj`, ..., `down_proj`), as `target_modules` lists it.
    pub fn name(self) -> &'static str {
        match self {
            Self::QProj => "q_proj",
            Self::KProj => "k_proj",
            Self::VProj => "v_proj",
            Self::OProj => "o_proj",
            Self::GateProj => "gate_proj",
            Self::UpProj => "up_proj",
            Self::DownProj => "down_proj",
        }
    }

    /// The target named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The module's path under `model.layers.N` (`self_attn.q_proj`, `mlp.down_proj`, ...).
    pub fn hf_path(self) -> &'static str {
        match self {
            Self::QProj => "self_attn.q_proj",
            Self::KProj => "self_attn.k_proj",
            Self::VProj => "self_attn.v_proj",
            Self::OProj => "self_attn.o_proj",
            Self::GateProj => "mlp.gate_proj",
            Self::UpProj => "mlp.up_proj",
            Self::DownProj => "mlp.down_proj",
        }
    }

    /// `(in, out)` features of this layer in a model of shape `cfg`.
    pub fn features(self, cfg: &Qwen3Config) -> (usize, usize) {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.num_attention_heads * cfg.head_dim();
        let kv = cfg.num_kv_heads() * cfg.head_dim();
        match self {
            Self::QProj => (h, q),
            Self::KProj | Self::VProj => (h, kv),
            Self::OProj => (q, h),
            Self::GateProj | Self::UpProj => (h, i),
            Self::DownProj => (i, h),
        }
    }
}

/// The adapter's shape: `[policy] lora = { r, alpha, targets }`. Dropout is always 0. Parsed
/// strictly: an unknown key, `r = 0`, a non-positive `alpha`, an unknown, repeated or empty
/// target list are errors naming the key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawLoraConfig", into = "RawLoraConfig")]
pub struct LoraConfig {
    /// The rank: `A` is `[r, in]`, `B` is `[out, r]`.
    pub r: usize,
    /// The scale numerator: the adapter's output is multiplied by `alpha / r`.
    pub alpha: f64,
    /// The adapted layers of every block, in [`LoraTarget::ALL`] order, without repeats.
    pub targets: Vec<LoraTarget>,
}

/// [`LoraConfig`] as written in TOML, before validation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLoraConfig {
    r: usize,
    alpha: f64,
    targets: Vec<String>,
}

impl TryFrom<RawLoraConfig> for LoraConfig {
    type Error = LoraConfigError;
    fn try_from(raw: RawLoraConfig) -> Result<Self, LoraConfigError> {
        let targets = raw
            .targets
            .iter()
            .map(|t| {
                LoraTarget::from_name(t).ok_or_else(|| LoraConfigError {
                    key: "lora.targets",
                    message: format!(
                        "unknown target `{t}` (known: {})",
                        LoraTarget::ALL.map(LoraTarget::name).join(", ")
                    ),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        LoraConfig::new(raw.r, raw.alpha, targets)
    }
}

impl From<LoraConfig> for RawLoraConfig {
    fn from(c: LoraConfig) -> Self {
        Self {
            r: c.r,
            alpha: c.alpha,
            targets: c.targets.iter().map(|t| t.name().to_string()).collect(),
        }
    }
}

/// Why an adapter configuration was refused; names the key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct LoraConfigError {
    /// The key (`lora.r`, `lora.alpha`, `lora.targets`, or `--lora`).
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}

impl LoraConfig {
    /// A validated configuration; `targets` are put in [`LoraTarget::ALL`] order.
    pub fn new(
        r: usize,
        alpha: f64,
        mut targets: Vec<LoraTarget>,
    ) -> Result<Self, LoraConfigError> {
        let bad = |key, message: String| Err(LoraConfigError { key, message });
        if r == 0 {
            return bad("lora.r", "must be at least 1".into());
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            return bad("lora.alpha", format!("{alpha} must be a number > 0"));
        }
        if targets.is_empty() {
            return bad("lora.targets", "must name at least one layer".into());
        }
        targets.sort();
        if let Some(w) = targets.windows(2).find(|w| w[0] == w[1]) {
            return bad("lora.targets", format!("`{}` is listed twice", w[0].name()));
        }
        Ok(Self { r, alpha, targets })
    }

    /// Parses the command-line form `R,ALPHA,TARGET[,TARGET...]`, e.g. `16,32,q_proj,v_proj`
    /// (`all` for every target).
    pub fn parse_cli(text: &str) -> Result<Self, LoraConfigError> {
        let bad = |message: String| LoraConfigError {
            key: "--lora",
            message,
        };
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        if parts.len() < 3 {
            return Err(bad(format!(
                "`{text}`: expected R,ALPHA,TARGET[,TARGET...], e.g. 16,32,q_proj,v_proj"
            )));
        }
        let r = parts[0]
            .parse()
            .map_err(|_| bad(format!("rank `{}` is not a whole number", parts[0])))?;
        let alpha = parts[1]
            .parse()
            .map_err(|_| bad(format!("alpha `{}` is not a number", parts[1])))?;
        let targets = if parts[2..] == ["all"] {
            LoraTarget::ALL.to_vec()
        } else {
            parts[2..]
                .iter()
                .map(|t| {
                    LoraTarget::from_name(t).ok_or_else(|| {
                        bad(format!(
                            "unknown target `{t}` (known: {}, or `all`)",
                            LoraTarget::ALL.map(LoraTarget::name).join(", ")
                        ))
                    })
                })
                .collect::<Result<_, _>>()?
        };
        Self::new(r, alpha, targets).map_err(|e| bad(e.to_string()))
    }

    /// `alpha / r`, the factor on the adapter's output.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.r as f64
    }
}

/// One layer's adapter: `x ↦ (alpha / r) · B (A x)`.
#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// `[in, r]`: PEFT's `lora_A.weight` (`[r, in]`) transposed.
    pub a: Param<Tensor<B, 2>>,
    /// `[r, out]`: PEFT's `lora_B.weight` (`[out, r]`) transposed.
    pub b: Param<Tensor<B, 2>>,
    /// `alpha / r`.
    pub scaling: f64,
}

impl<B: Backend> Lora<B> {
    /// An adapter from PEFT-layout data: `a` is `[r, in]`, `b` is `[out, r]`, row-major.
    pub fn from_peft(
        a: &[f32],
        b: &[f32],
        (inp, out): (usize, usize),
        r: usize,
        scaling: f64,
        device: &B::Device,
    ) -> Self {
        let param = |data: Vec<f32>, shape: [usize; 2]| {
            Param::from_tensor(Tensor::from_data(TensorData::new(data, shape), device))
        };
        Self {
            a: param(transpose(a, r, inp), [inp, r]),
            b: param(transpose(b, out, r), [r, out]),
            scaling,
        }
    }

    /// `x [n, in]` → `[n, out]`: `scaling · (x A) B`, in PEFT's order of operations
    /// (`lora_B(lora_A(x)) * scaling`).
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        matmul(matmul(x, self.a.val()), self.b.val()).mul_scalar(self.scaling)
    }

    /// `[in, out]`: what merging adds to the base weight, `scaling · A B` (PEFT's
    /// `B @ A * scaling`, transposed).
    pub fn delta(&self) -> Tensor<B, 2> {
        matmul(self.a.val(), self.b.val()).mul_scalar(self.scaling)
    }

    /// `(A [r, in], B [out, r])` row-major, in PEFT's layout.
    pub fn to_peft(&self) -> (Vec<f32>, Vec<f32>) {
        let [inp, r] = self.a.dims();
        let out = self.b.dims()[1];
        let host = |t: Tensor<B, 2>| -> Vec<f32> {
            t.into_data()
                .convert::<f32>()
                .to_vec()
                .expect("float tensor converts to f32")
        };
        (
            transpose(&host(self.a.val()), inp, r),
            transpose(&host(self.b.val()), r, out),
        )
    }
}

/// A whole model's adapters as plain data, in PEFT's layout.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraWeights {
    /// Rank, alpha and targets.
    pub config: LoraConfig,
    /// `(layer, target)` → `(A [r, in], B [out, r])`, row-major f32; one entry for every layer
    /// and every target of `config`.
    pub tensors: BTreeMap<(usize, LoraTarget), (Vec<f32>, Vec<f32>)>,
}

impl LoraWeights {
    /// A fresh adapter for a model of shape `model`, as PEFT initialises one: every `A` drawn
    /// Kaiming-uniform with `a = sqrt(5)`, i.e. uniform in `±1 / sqrt(in)` (gain
    /// `sqrt(2 / (1 + 5))` times `sqrt(3 / in)`), from a ChaCha8 stream seeded with `seed`; every
    /// `B` zero, so the adapted model starts equal to the base.
    pub fn fresh(config: &LoraConfig, model: &Qwen3Config, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let r = config.r;
        let mut tensors = BTreeMap::new();
        for layer in 0..model.num_hidden_layers {
            for &t in &config.targets {
                let (inp, out) = t.features(model);
                let bound = 1.0 / (inp as f32).sqrt();
                let a = (0..r * inp)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                tensors.insert((layer, t), (a, vec![0.0; out * r]));
            }
        }
        Self {
            config: config.clone(),
            tensors,
        }
    }
}

/// Why adapters could not be attached to or read from a model.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// An adapter the configuration names is absent.
    #[error("layer {layer} has no `{target}` adapter")]
    Missing {
        /// The block.
        layer: usize,
        /// The target's name.
        target: &'static str,
    },
    /// An adapter tensor has the wrong number of elements for the model.
    #[error("layer {layer} `{target}`: {which} has {found} values, the model needs {expected}")]
    WrongSize {
        /// The block.
        layer: usize,
        /// The target's name.
        target: &'static str,
        /// `lora_A` or `lora_B`.
        which: &'static str,
        /// Values required.
        expected: usize,
        /// Values given.
        found: usize,
    },
    /// An adapter is given for a layer the model does not have.
    #[error("adapter for layer {layer}, but the model has {layers} layers")]
    NoSuchLayer {
        /// The block.
        layer: usize,
        /// The model's blocks.
        layers: usize,
    },
}

/// The base weight of `t` in `layer` and its adapter slot.
fn slot<B: Backend>(
    layer: &mut DecoderLayer<B>,
    t: LoraTarget,
) -> (&mut Param<Tensor<B, 2>>, &mut Option<Lora<B>>) {
    let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
    match t {
        LoraTarget::QProj => (&mut a.q_proj, &mut a.q_lora),
        LoraTarget::KProj => (&mut a.k_proj, &mut a.k_lora),
        LoraTarget::VProj => (&mut a.v_proj, &mut a.v_lora),
        LoraTarget::OProj => (&mut a.o_proj, &mut a.o_lora),
        LoraTarget::GateProj => (&mut m.gate_proj, &mut m.gate_lora),
        LoraTarget::UpProj => (&mut m.up_proj, &mut m.up_lora),
        LoraTarget::DownProj => (&mut m.down_proj, &mut m.down_lora),
    }
}

/// The base weight of `t` in `layer` and its adapter, if any.
pub fn base_and_adapter<B: Backend>(
    layer: &DecoderLayer<B>,
    t: LoraTarget,
) -> (&Param<Tensor<B, 2>>, Option<&Lora<B>>) {
    let (a, m) = (&layer.self_attn, &layer.mlp);
    match t {
        LoraTarget::QProj => (&a.q_proj, a.q_lora.as_ref()),
        LoraTarget::KProj => (&a.k_proj, a.k_lora.as_ref()),
        LoraTarget::VProj => (&a.v_proj, a.v_lora.as_ref()),
        LoraTarget::OProj => (&a.o_proj, a.o_lora.as_ref()),
        LoraTarget::GateProj => (&m.gate_proj, m.gate_lora.as_ref()),
        LoraTarget::UpProj => (&m.up_proj, m.up_lora.as_ref()),
        LoraTarget::DownProj => (&m.down_proj, m.down_lora.as_ref()),
    }
}

/// The adapter of `t` in `layer`, if any.
pub fn adapter_of<B: Backend>(layer: &DecoderLayer<B>, t: LoraTarget) -> Option<&Lora<B>> {
    base_and_adapter(layer, t).1
}

/// The weight a linear layer applies: its base `w` `[in, out]`, plus the adapter's
/// `scaling · A B` when it has one.
pub fn effective_weight<B: Backend>(
    w: &Param<Tensor<B, 2>>,
    lora: Option<&Lora<B>>,
) -> Tensor<B, 2> {
    match lora {
        None => w.val(),
        Some(l) => w.val() + l.delta(),
    }
}

impl<B: Backend> Qwen3<B> {
    /// The model with `weights` attached and its base frozen: every base parameter stops
    /// requiring a gradient, so under autodiff only the adapters get gradients (and optimizer
    /// state), and the base stays bit for bit as loaded. Adapters already attached to other
    /// targets stay.
    pub fn with_lora(self, weights: &LoraWeights) -> Result<Self, LoraError> {
        let cfg = &weights.config;
        let layers = self.layers.len();
        if let Some(&(layer, _)) = weights.tensors.keys().find(|(l, _)| *l >= layers) {
            return Err(LoraError::NoSuchLayer { layer, layers });
        }
        let device = self.device();
        let mut model = self.no_grad();
        for (l, layer) in model.layers.iter_mut().enumerate() {
            for &t in &cfg.targets {
                let Some((a, b)) = weights.tensors.get(&(l, t)) else {
                    return Err(LoraError::Missing {
                        layer: l,
                        target: t.name(),
                    });
                };
                let (w, adapter) = slot(layer, t);
                let [inp, out] = w.dims();
                for (which, data, expected) in
                    [("lora_A", a, cfg.r * inp), ("lora_B", b, out * cfg.r)]
                {
                    if data.len() != expected {
                        return Err(LoraError::WrongSize {
                            layer: l,
                            target: t.name(),
                            which,
                            expected,
                            found: data.len(),
                        });
                    }
                }
                *adapter = Some(Lora::from_peft(
                    a,
                    b,
                    (inp, out),
                    cfg.r,
                    cfg.scaling(),
                    &device,
                ));
            }
        }
        Ok(model)
    }

    /// The adapters of `config`'s targets as plain data (for saving them).
    pub fn lora_weights(&self, config: &LoraConfig) -> Result<LoraWeights, LoraError> {
        let mut tensors = BTreeMap::new();
        for (l, layer) in self.layers.iter().enumerate() {
            for &t in &config.targets {
                let lora = adapter_of(layer, t).ok_or(LoraError::Missing {
                    layer: l,
                    target: t.name(),
                })?;
                tensors.insert((l, t), lora.to_peft());
            }
        }
        Ok(LoraWeights {
            config: config.clone(),
            tensors,
        })
    }

    /// Whether any layer carries an adapter.
    pub fn has_lora(&self) -> bool {
        self.layers.iter().any(|layer| {
            LoraTarget::ALL
                .into_iter()
                .any(|t| adapter_of(layer, t).is_some())
        })
    }

    /// The model with every adapter dropped: the base alone, its weights shared with `self`'s
    /// (tensors are reference-counted, so no weight is copied).
    pub fn without_lora(mut self) -> Self {
        for layer in &mut self.layers {
            for t in LoraTarget::ALL {
                slot(layer, t).1.take();
            }
        }
        self
    }

    /// The shape of the adapters this model carries, read from them: the targets adapted in
    /// the first block, its rank and `alpha = scaling · r`; `None` without adapters. Every
    /// block carries the same adapters ([`Qwen3::with_lora`] attaches them so).
    pub fn lora_config(&self) -> Option<LoraConfig> {
        let first = self.layers.first()?;
        let targets: Vec<LoraTarget> = LoraTarget::ALL
            .into_iter()
            .filter(|&t| adapter_of(first, t).is_some())
            .collect();
        let lora = adapter_of(first, *targets.first()?)?;
        let r = lora.a.dims()[1];
        LoraConfig::new(r, lora.scaling * r as f64, targets).ok()
    }

    /// A blake3 hash of the base weights (adapters excluded), in module order, each tensor's
    /// shape and f32 values: what an adapter checkpoint records to refuse a different base.
    /// Reads one tensor at a time.
    pub fn base_fingerprint(&self) -> String {
        struct Hasher<'a, B: Backend>(&'a mut blake3::Hasher, std::marker::PhantomData<B>);
        impl<B: Backend> ModuleVisitor<B> for Hasher<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let t = param.val();
                for d in t.dims() {
                    self.0.update(&(d as u64).to_le_bytes());
                }
                let data = t.into_data().convert::<f32>();
                self.0.update(data.as_bytes());
            }
        }
        let base = self.clone().without_lora();
        let mut h = blake3::Hasher::new();
        base.visit(&mut Hasher::<B>(&mut h, std::marker::PhantomData));
        h.finalize().to_hex().to_string()
    }

    /// Folds every adapter into its base weight (`W + scaling · A B`) and drops the adapters:
    /// the plain model that computes what the adapted one did.
    pub fn merge_lora(mut self) -> Self {
        for layer in &mut self.layers {
            for t in LoraTarget::ALL {
                let (w, adapter) = slot(layer, t);
                if let Some(lora) = adapter.take() {
                    *w = Param::from_tensor(w.val() + lora.delta());
                }
            }
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<LoraConfig, String> {
        #[derive(Deserialize)]
        struct Doc {
            lora: LoraConfig,
        }
        toml::from_str::<Doc>(text)
            .map(|d| d.lora)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn config_parses_and_orders_targets() {
        let c = parse("lora = { r = 16, alpha = 32, targets = [\"v_proj\", \"q_proj\"] }").unwrap();
        assert_eq!(c.r, 16);
        assert_eq!(c.scaling(), 2.0);
        assert_eq!(c.targets, vec![LoraTarget::QProj, LoraTarget::VProj]);
    }

    #[test]
    fn config_refusals_name_the_key() {
        let e = parse("lora = { r = 4, alpha = 8, targets = [\"q_proj\"], dropout = 0.1 }")
            .unwrap_err();
        assert!(e.contains("dropout"), "{e}");
        let e = parse("lora = { r = 0, alpha = 8, targets = [\"q_proj\"] }").unwrap_err();
        assert!(e.contains("lora.r"), "{e}");
        let e = parse("lora = { r = 4, alpha = 8, targets = [\"x_proj\"] }").unwrap_err();
        assert!(e.contains("lora.targets") && e.contains("x_proj"), "{e}");
        let e = parse("lora = { r = 4, alpha = 8, targets = [] }").unwrap_err();
        assert!(e.contains("lora.targets"), "{e}");
        let e = parse("lora = { r = 4, alpha = 0, targets = [\"q_proj\"] }").unwrap_err();
        assert!(e.contains("lora.alpha"), "{e}");
        let e =
            parse("lora = { r = 4, alpha = 8, targets = [\"q_proj\", \"q_proj\"] }").unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn cli_form_parses() {
        let c = LoraConfig::parse_cli("16,32,q_proj,v_proj").unwrap();
        assert_eq!((c.r, c.alpha), (16, 32.0));
        assert_eq!(c.targets, vec![LoraTarget::QProj, LoraTarget::VProj]);
        assert_eq!(LoraConfig::parse_cli("8,16,all").unwrap().targets.len(), 7);
        for bad in ["16,32", "x,32,q_proj", "16,32,lm_head", "0,32,q_proj"] {
            let e = LoraConfig::parse_cli(bad).unwrap_err();
            assert_eq!(e.key, "--lora", "{bad}: {e}");
        }
    }

    #[test]
    fn fresh_adapter_is_kaiming_uniform_a_and_zero_b() {
        let model = Qwen3Config::from_json(
            &std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/qwen3-tiny/config.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let cfg = LoraConfig::parse_cli("4,8,all").unwrap();
        let w = LoraWeights::fresh(&cfg, &model, 7);
        assert_eq!(w.tensors.len(), 7 * model.num_hidden_layers);
        for ((_, t), (a, b)) in &w.tensors {
            let (inp, out) = t.features(&model);
            assert_eq!((a.len(), b.len()), (4 * inp, out * 4));
            let bound = 1.0 / (inp as f32).sqrt();
            assert!(a.iter().all(|x| x.abs() <= bound));
            // Spread over the interval, not collapsed near 0.
            assert!(a.iter().any(|x| x.abs() > 0.8 * bound));
            assert!(b.iter().all(|x| *x == 0.0));
        }
        assert_eq!(w, LoraWeights::fresh(&cfg, &model, 7));
        assert_ne!(w, LoraWeights::fresh(&cfg, &model, 8));
    }
}
