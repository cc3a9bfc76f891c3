//! `clawrl check`: the checks that prove a build on a device. `check parity` runs the reference
//! fixture (a Hugging Face checkpoint with PyTorch's outputs, `tests/fixtures/qwen3-tiny`) on
//! the given device: prompt ids, last logits, greedy tokens and their log-probs, and one
//! training step of the docs/design.md §1 loss with AdamW, each against the fixture's
//! tolerances. `check speed` measures generation, prefill and training throughput of a
//! checkpoint on the device. Both print one JSON object; `check parity` exits non-zero when any
//! tolerance is exceeded.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use burn::module::AutodiffModule;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use clap::{Subcommand, ValueEnum};
use minijinja::Value;
use serde_json::json;

use clawrl::device::{Device, InferenceTask, TrainingTask};
use clawrl::model::chat::parse_json_value;
use clawrl::model::{
    load_checkpoint, load_model, load_model_in, spawn_engine, EngineHandle, EngineOptions,
    GenerationRequest, LinearLayout, LoraConfig, LoraTarget, LoraWeights, Qwen3, SamplingParams,
    StreamEvent,
};
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};

/// Subcommands of the check area.
#[derive(Subcommand)]
pub enum Commands {
    /// Prove a build on a device: parity with the PyTorch reference, and throughput.
    Check {
        #[command(subcommand)]
        cmd: CheckCommand,
    },
}

/// `clawrl check ...`.
#[derive(Subcommand)]
pub enum CheckCommand {
    /// Run the reference fixture on a device and compare with PyTorch's outputs.
    Parity {
        /// Fixture directory: a checkpoint with `expected.json` and `train_step_expected.json`.
        fixture: PathBuf,
        /// Compute device: `cpu` or `cuda:N` (needs a build with `--features cuda`).
        #[arg(long, default_value_t = Device::Cpu)]
        device: Device,
    },
    /// Measure throughput of a checkpoint on a device (median of `--rounds` after a warm-up).
    Speed {
        /// Checkpoint directory (its weights are used as they are; random ones do).
        model: PathBuf,
        /// What to measure.
        #[arg(long)]
        workload: Workload,
        /// Compute device: `cpu` or `cuda:N` (needs a build with `--features cuda`).
        #[arg(long, default_value_t = Device::Cpu)]
        device: Device,
        /// Sequences at once (generate, train).
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Prompt tokens per sequence.
        #[arg(long, default_value_t = 128)]
        prompt: usize,
        /// New tokens per sequence (generate) or response tokens per sequence (train).
        #[arg(long, default_value_t = 128)]
        new_tokens: usize,
        /// Timed rounds after the warm-up; the median is reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Train: the first this many prompt tokens are the same in every sequence (a shared
        /// system prompt), the rest differ.
        #[arg(long, default_value_t = 0)]
        shared_prefix: usize,
        /// Train: run every sequence whole, without packing shared prefixes.
        #[arg(long)]
        no_packing: bool,
        /// Train: keep only each decoder layer's input and recompute its activations in the
        /// backward pass (`[optim] recompute_activations`).
        #[arg(long)]
        recompute_activations: bool,
        /// Generate, decode: attach this many fresh LoRA adapters (rank `--adapter-rank` on
        /// every linear layer, alpha twice the rank) to the one engine and spread the requests
        /// over them (request `i` on adapter `i mod N`); 0 runs the base alone. Train: 1 trains
        /// such an adapter over the frozen base, kept as a LoRA job keeps it.
        #[arg(long, default_value_t = 0)]
        adapters: usize,
        /// The rank of `--adapters`.
        #[arg(long, default_value_t = 16)]
        adapter_rank: usize,
    },
}

/// A throughput workload of `check speed`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Workload {
    /// Greedy generation through the engine (KV cache on): `batch` requests of `prompt` tokens,
    /// `new_tokens` each; tokens/s counts generated tokens.
    Generate,
    /// As `generate`, timing the decode steps alone: from the moment every request has its
    /// first token (the prefills are done) to the last token; tokens/s counts the tokens after
    /// each request's first (decode speed after a `prompt`-token prompt).
    Decode,
    /// One forward pass over `prompt` tokens at batch 1, filling the KV cache; tokens/s counts
    /// prompt tokens.
    Prefill,
    /// One learner step (forward, backward, global-norm clip, AdamW) on `batch` sequences of
    /// `prompt + new_tokens` tokens; tokens/s counts all sequence tokens.
    Train,
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    let Commands::Check { cmd } = cmd;
    match cmd {
        CheckCommand::Parity { fixture, device } => {
            let started = Instant::now();
            let model = device.run_inference(ModelParity { dir: &fixture })??;
            let train = device.run_training(StepParity { dir: &fixture })??;
            let pass = model["pass"] == json!(true) && train["pass"] == json!(true);
            println!(
                "{}",
                json!({
                    "device": device.to_string(),
                    "model": model,
                    "train": train,
                    "seconds": started.elapsed().as_secs_f64(),
                    "pass": pass,
                })
            );
            if !pass {
                bail!("{} disagrees with the reference fixture", device);
            }
            Ok(())
        }
        CheckCommand::Speed {
            model,
            workload,
            device,
            batch,
            prompt,
            new_tokens,
            rounds,
            shared_prefix,
            no_packing,
            recompute_activations,
            adapters,
            adapter_rank,
        } => {
            anyhow::ensure!(batch >= 1, "--batch must be at least 1");
            anyhow::ensure!(prompt >= 1, "--prompt must be at least 1");
            anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
            anyhow::ensure!(
                shared_prefix <= prompt,
                "--shared-prefix ({shared_prefix}) is longer than --prompt ({prompt})"
            );
            let train_only = shared_prefix > 0 || no_packing || recompute_activations;
            anyhow::ensure!(
                !train_only || matches!(workload, Workload::Train),
                "--shared-prefix, --no-packing and --recompute-activations apply to --workload \
                 train only"
            );
            anyhow::ensure!(
                adapters == 0
                    || matches!(workload, Workload::Generate | Workload::Decode)
                    || (adapters == 1 && matches!(workload, Workload::Train)),
                "--adapters applies to --workload generate and decode, and to train as 1 (a \
                 learner trains one adapter)"
            );
            let adapters = match adapters {
                0 => None,
                n => Some((
                    n,
                    LoraConfig::new(
                        adapter_rank,
                        2.0 * adapter_rank as f64,
                        LoraTarget::ALL.to_vec(),
                    )
                    .map_err(|e| anyhow::anyhow!("--adapter-rank: {e}"))?,
                )),
            };
            let shape = Shape {
                dir: &model,
                batch,
                prompt,
                new_tokens,
                rounds,
                shared_prefix,
                packing: !no_packing,
                recompute_activations,
                adapters: adapters.clone(),
            };
            let rates = match workload {
                Workload::Generate => device.run_inference(GenerateSpeed(shape, false))??,
                Workload::Decode => device.run_inference(GenerateSpeed(shape, true))??,
                Workload::Prefill => device.run_inference(PrefillSpeed(shape))??,
                Workload::Train => device.run_training(TrainSpeed(shape))??,
            };
            println!(
                "{}",
                json!({
                    "device": device.to_string(),
                    "workload": format!("{workload:?}").to_lowercase(),
                    "batch": batch,
                    "prompt": prompt,
                    "new_tokens": new_tokens,
                    "shared_prefix": shared_prefix,
                    "packing": !no_packing,
                    "recompute_activations": recompute_activations,
                    "adapters": adapters.as_ref().map_or(0, |(n, _)| *n),
                    "adapter_rank": adapters.as_ref().map(|(_, c)| c.r),
                    "dtype": "float32",
                    "tokens_per_s": median(&rates),
                    "rounds_tokens_per_s": rates,
                    "peak_rss_mib": peak_rss_mib(),
                })
            );
            Ok(())
        }
    }
}

/// This process's peak resident memory (Linux `VmHWM`), in MiB; `null` where unknown.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The median of a non-empty list.
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn read_fixture_json(dir: &Path, name: &str) -> anyhow::Result<Value> {
    let path = dir.join(name);
    let what = path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {what}"))?;
    Ok(parse_json_value(&text, &what)?)
}

fn attr(v: &Value, key: &str) -> anyhow::Result<Value> {
    let a = v
        .get_attr(key)
        .map_err(|e| anyhow::anyhow!("reading `{key}`: {e}"))?;
    anyhow::ensure!(!a.is_undefined(), "the fixture has no `{key}`");
    Ok(a)
}

fn floats(v: &Value, key: &str) -> anyhow::Result<Vec<f64>> {
    attr(v, key)?
        .try_iter()
        .map_err(|e| anyhow::anyhow!("`{key}` is not a list: {e}"))?
        .map(|x| f64::try_from(x).map_err(|e| anyhow::anyhow!("`{key}`: {e}")))
        .collect()
}

fn ids(v: &Value, key: &str) -> anyhow::Result<Vec<u32>> {
    attr(v, key)?
        .try_iter()
        .map_err(|e| anyhow::anyhow!("`{key}` is not a list: {e}"))?
        .map(|x| u32::try_from(x).map_err(|e| anyhow::anyhow!("`{key}`: {e}")))
        .collect()
}

fn number(v: &Value, key: &str) -> anyhow::Result<f64> {
    f64::try_from(attr(v, key)?).map_err(|e| anyhow::anyhow!("`{key}`: {e}"))
}

fn list(v: &Value, key: &str) -> anyhow::Result<Vec<Value>> {
    Ok(attr(v, key)?
        .try_iter()
        .map_err(|e| anyhow::anyhow!("`{key}` is not a list: {e}"))?
        .collect())
}

/// max |a - b| / max |b| (the fixture's measure for logits).
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    max_abs(got, want) / scale.max(1e-30)
}

/// max |a - b|; infinite when the lengths differ.
fn max_abs(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
}

fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> anyhow::Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("reading a tensor: {e:?}"))
}

fn id_tensor<B: Backend>(ids: &[u32], device: &B::Device) -> Tensor<B, 2, Int> {
    let n = ids.len();
    Tensor::from_data(
        TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, n]),
        device,
    )
}

/// Model parity: for every case of `expected.json`, the rendered prompt's ids, the last logits
/// of a full forward (1e-4 relative), and 16 greedy tokens through the KV cache (exact) with
/// their log-probs (1e-4 absolute).
struct ModelParity<'a> {
    dir: &'a Path,
}

impl InferenceTask for ModelParity<'_> {
    type Output = anyhow::Result<serde_json::Value>;
    fn run<B: Backend>(self, device: B::Device) -> Self::Output
    where
        Qwen3<B>: Send + Sync,
    {
        let ck = load_checkpoint::<B>(self.dir, &device)
            .with_context(|| format!("loading {}", self.dir.display()))?;
        let expected = read_fixture_json(self.dir, "expected.json")?;
        let vocab = ck.config.vocab_size;
        let mut cases = Vec::new();
        let mut pass = true;
        for case in list(&expected, "cases")? {
            let tools = case.get_attr("tools").ok().filter(|t| !t.is_none());
            let prompt = ck.encode_chat(&attr(&case, "messages")?, tools.as_ref())?;
            let want_ids = ids(&case, "input_ids")?;
            let ids_equal = prompt.ids == want_ids;

            let n = want_ids.len();
            let hidden = ck
                .model
                .forward_hidden(id_tensor::<B>(&want_ids, &device))
                .narrow(1, n - 1, 1);
            let last = to_vec(ck.model.head(hidden))?;
            let logits_rel = rel_err(&last, &floats(&case, "last_logits")?);

            let want_greedy = ids(&case, "greedy_16")?;
            let want_lp = floats(&case, "greedy_16_logprobs")?;
            let mut cache = ck.model.new_cache(n + want_greedy.len() + 1);
            let mut logits = ck.model.prefill(&want_ids, &mut cache)?;
            let (mut greedy, mut lps) = (Vec::new(), Vec::new());
            for _ in 0..want_greedy.len() {
                let lp = to_vec(log_softmax(logits, 0))?;
                let (best, l) = lp
                    .iter()
                    .copied()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .context("empty logits")?;
                greedy.push(best as u32);
                lps.push(l);
                logits = ck
                    .model
                    .decode_step(&[best as u32], &mut [&mut cache])?
                    .reshape([vocab]);
            }
            let greedy_equal = greedy == want_greedy;
            let lp_abs = max_abs(&lps, &want_lp);
            let ok = ids_equal && logits_rel < 1e-4 && greedy_equal && lp_abs < 1e-4;
            pass &= ok;
            cases.push(json!({
                "prompt_ids_equal": ids_equal,
                "last_logits_rel_err": logits_rel,
                "greedy_equal": greedy_equal,
                "greedy_logprobs_max_abs_err": lp_abs,
                "pass": ok,
            }));
        }
        Ok(json!({
            "tolerances": {"last_logits_rel": 1e-4, "greedy_logprobs_abs": 1e-4},
            "cases": cases,
            "pass": pass,
        }))
    }
}

/// Training-step parity: one learner step on the two samples of `train_step_expected.json`
/// with its hyper-parameters; loss, pg_loss and kl within 1e-4 relative, the gradient norm
/// within 1e-3 relative, the clip fraction exact, and after the step the samples' log-probs
/// and case 2's last logits within 2e-4 absolute.
struct StepParity<'a> {
    dir: &'a Path,
}

impl TrainingTask for StepParity<'_> {
    type Output = anyhow::Result<serde_json::Value>;
    fn run<B: AutodiffBackend>(self, device: B::Device) -> Self::Output {
        let exp = read_fixture_json(self.dir, "train_step_expected.json")?;
        let hyper = attr(&exp, "hyper")?;
        let h = |k: &str| number(&hyper, k);
        let betas = floats(&hyper, "betas")?;
        anyhow::ensure!(betas.len() == 2, "`hyper.betas` needs two values");
        let train = TrainConfig {
            lr: h("lr")?,
            betas: [betas[0], betas[1]],
            adam_eps: h("adam_eps")?,
            weight_decay: h("weight_decay")?,
            eps_clip: h("eps_clip")?,
            eps_clip_high: h("eps_clip_high")?,
            kl_coef: h("kl_coef")?,
            grad_clip: h("grad_clip_norm")?,
            batch_size: 2,
            ..TrainConfig::default()
        };
        let f32s = |v: &Value, k: &str| -> anyhow::Result<Vec<f32>> {
            Ok(floats(v, k)?.into_iter().map(|x| x as f32).collect())
        };
        let samples = list(&exp, "samples")?
            .iter()
            .map(|s| {
                Ok(Sample {
                    prompt_ids: ids(s, "prompt_ids")?,
                    response_ids: ids(s, "response_ids")?,
                    advantages: f32s(s, "advantages")?,
                    old_logprobs: Some(f32s(s, "old_logprobs")?),
                    ref_logprobs: Some(f32s(s, "ref_logprobs")?),
                    rollout_logprobs: None,
                    opd: None,
                    importance: None,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;

        let (cfg, model) = load_model::<B>(self.dir, &device)
            .with_context(|| format!("loading {}", self.dir.display()))?;
        let mut learner = BurnLearner::new(cfg, model, train, device.clone(), 0);
        let m = learner.step(&samples)?;
        if let Some(why) = &m.skipped {
            bail!("the step was skipped: {why}");
        }
        let rel = |got: f64, want: f64| (got - want).abs() / want.abs().max(1e-12);
        let loss = rel(m.loss, number(&exp, "loss")?);
        let pg = rel(m.pg_loss, number(&exp, "pg_loss")?);
        let kl = rel(m.kl, number(&exp, "kl")?);
        let grad = rel(m.grad_norm, number(&exp, "grad_norm_before_clip")?);
        let clip = (m.clip_fraction - number(&exp, "clip_fraction")?).abs();

        let after = learner.logprobs(&samples)?;
        let want_after = list(&exp, "logprobs_after_step")?;
        anyhow::ensure!(
            want_after.len() == after.len(),
            "`logprobs_after_step` has {} rows for {} samples",
            want_after.len(),
            after.len()
        );
        let mut after_abs = 0f64;
        for (got, want) in after.iter().zip(&want_after) {
            let want: Vec<f64> = want
                .try_iter()
                .map_err(|e| anyhow::anyhow!("`logprobs_after_step`: {e}"))?
                .map(|x| f64::try_from(x).map_err(|e| anyhow::anyhow!("{e}")))
                .collect::<anyhow::Result<_>>()?;
            after_abs = after_abs.max(max_abs(got, &want));
        }

        let probe = ids(
            &list(&read_fixture_json(self.dir, "expected.json")?, "cases")?
                .get(2)
                .context("`expected.json` has no case 2")?
                .clone(),
            "input_ids",
        )?;
        let n = probe.len();
        let policy = learner.policy().valid();
        let logits = policy.forward(id_tensor(&probe, &policy.device()));
        let vocab = logits.dims()[2];
        let last = to_vec(logits.slice([0..1, n - 1..n, 0..vocab]))?;
        let probe_abs = max_abs(&last, &floats(&exp, "probe_last_logits_after_step")?);

        let pass = loss < 1e-4
            && pg < 1e-4
            && kl < 1e-4
            && grad < 1e-3
            && clip < 1e-9
            && after_abs < 2e-4
            && probe_abs < 2e-4;
        Ok(json!({
            "tolerances": {"loss_pg_kl_rel": 1e-4, "grad_norm_rel": 1e-3, "after_step_abs": 2e-4},
            "loss_rel_err": loss,
            "pg_loss_rel_err": pg,
            "kl_rel_err": kl,
            "grad_norm_rel_err": grad,
            "clip_fraction_abs_err": clip,
            "logprobs_after_step_max_abs_err": after_abs,
            "probe_logits_after_step_max_abs_err": probe_abs,
            "pass": pass,
        }))
    }
}

/// The sizes of a `check speed` run.
struct Shape<'a> {
    dir: &'a Path,
    batch: usize,
    prompt: usize,
    new_tokens: usize,
    rounds: usize,
    /// Train: leading prompt tokens common to every sequence.
    shared_prefix: usize,
    /// Train: whether the learner packs shared prefixes.
    packing: bool,
    /// Train: whether the learner recomputes activations in the backward pass.
    recompute_activations: bool,
    /// Generate: how many adapters of which shape the requests are spread over. Train: the
    /// shape of the one adapter trained.
    adapters: Option<(usize, LoraConfig)>,
}

/// Deterministic prompt ids spread over the vocabulary (the same formula as the reference
/// benchmark script).
fn prompt_ids(n: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104729 + 13) % vocab) as u32)
        .collect()
}

/// Runs `warm` once (kernel compilation, allocator), then `round` `rounds` times; returns
/// tokens/s of each timed round, `round` returning the tokens it produced.
fn timed(
    rounds: usize,
    warm: impl FnOnce() -> anyhow::Result<usize>,
    mut round: impl FnMut() -> anyhow::Result<usize>,
) -> anyhow::Result<Vec<f64>> {
    warm()?;
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            let n = round()?;
            Ok(n as f64 / t.elapsed().as_secs_f64())
        })
        .collect()
}

/// Generation speed; with `.1`, of the decode steps alone.
struct GenerateSpeed<'a>(Shape<'a>, bool);

impl InferenceTask for GenerateSpeed<'_> {
    type Output = anyhow::Result<Vec<f64>>;
    fn run<B: Backend>(self, device: B::Device) -> Self::Output
    where
        Qwen3<B>: Send + Sync,
    {
        let (s, decode_only) = (self.0, self.1);
        let (cfg, model) = load_model::<B>(s.dir, &device)
            .with_context(|| format!("loading {}", s.dir.display()))?;
        let engine = spawn_engine(
            Arc::new(model.into_layout(LinearLayout::decoding::<B>())),
            None,
            EngineOptions {
                max_batch: s.batch,
                max_context: s.prompt + s.new_tokens + 1,
                // Each round repeats the prompt: generation is measured with its prefill.
                prefix_cache_bytes: 0,
            },
        );
        let vocab = cfg.vocab_size;
        // Fresh adapters (`B` zero): their outputs equal the base's, their cost is any
        // adapter's of that shape.
        let handles: Vec<EngineHandle> = match &s.adapters {
            None => vec![engine.clone()],
            Some((n, lora)) => (0..*n)
                .map(|k| engine.attach(LoraWeights::fresh(lora, &cfg, k as u64 + 1)))
                .collect(),
        };
        // All requests at once, so the engine batches them; `new` tokens each. Returns the
        // tokens counted and the seconds they took (see `Workload`).
        let generate = |new: usize| -> anyhow::Result<(usize, f64)> {
            let t0 = Instant::now();
            let mut rxs: Vec<_> = (0..s.batch)
                .map(|i| {
                    handles[i % handles.len()].submit_streaming(GenerationRequest::new(
                        prompt_ids(s.prompt, i + 1, vocab),
                        SamplingParams {
                            temperature: 0.0,
                            max_new_tokens: new,
                            ..Default::default()
                        },
                    ))
                })
                .collect();
            let next = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<StreamEvent>| match rx
                .blocking_recv()
            {
                Some(StreamEvent::Token { .. }) => Ok(None),
                Some(StreamEvent::Finished(r)) => Ok(Some(r.response_ids.len())),
                Some(StreamEvent::Failed(e)) => Err(anyhow::Error::from(e)),
                None => Err(anyhow::anyhow!("the engine stopped")),
            };
            // Every request's first token: the prefills are done.
            let mut done = vec![None; rxs.len()];
            for (rx, d) in rxs.iter_mut().zip(&mut done) {
                *d = next(rx)?;
            }
            let t1 = Instant::now();
            let mut n = 0;
            for (rx, d) in rxs.iter_mut().zip(done) {
                n += match d {
                    Some(len) => len,
                    None => loop {
                        if let Some(len) = next(rx)? {
                            break len;
                        }
                    },
                };
            }
            Ok(if decode_only {
                (n - s.batch, t1.elapsed().as_secs_f64())
            } else {
                (n, t0.elapsed().as_secs_f64())
            })
        };
        generate(s.new_tokens.min(4))?;
        (0..s.rounds)
            .map(|_| {
                let (n, secs) = generate(s.new_tokens)?;
                Ok(n as f64 / secs)
            })
            .collect()
    }
}

struct PrefillSpeed<'a>(Shape<'a>);

impl InferenceTask for PrefillSpeed<'_> {
    type Output = anyhow::Result<Vec<f64>>;
    fn run<B: Backend>(self, device: B::Device) -> Self::Output
    where
        Qwen3<B>: Send + Sync,
    {
        let s = self.0;
        let (cfg, model) = load_model::<B>(s.dir, &device)
            .with_context(|| format!("loading {}", s.dir.display()))?;
        // As the generation engine's owners keep its weights.
        let model = model.into_layout(LinearLayout::decoding::<B>());
        let ids = prompt_ids(s.prompt, 0, cfg.vocab_size);
        let prefill = || -> anyhow::Result<usize> {
            let mut cache = model.new_cache(s.prompt);
            // Reading the logits back waits for the device to finish.
            to_vec(model.prefill(&ids, &mut cache)?)?;
            Ok(s.prompt)
        };
        timed(s.rounds, prefill, prefill)
    }
}

struct TrainSpeed<'a>(Shape<'a>);

impl TrainingTask for TrainSpeed<'_> {
    type Output = anyhow::Result<Vec<f64>>;
    fn run<B: AutodiffBackend>(self, device: B::Device) -> Self::Output {
        let s = self.0;
        // With an adapter, the base is frozen and kept as a LoRA job keeps it.
        let layout = match s.adapters {
            None => LinearLayout::InOut,
            Some(_) => LinearLayout::decoding::<B::InnerBackend>(),
        };
        let (cfg, model) = load_model_in::<B>(s.dir, &device, layout)
            .with_context(|| format!("loading {}", s.dir.display()))?;
        let model = match &s.adapters {
            None => model,
            Some((_, lora)) => model.with_lora(&LoraWeights::fresh(lora, &cfg, 1))?,
        };
        let vocab = cfg.vocab_size;
        let train = TrainConfig {
            lr: 1e-5,
            kl_coef: 0.02,
            batch_size: s.batch,
            pack_prefixes: s.packing,
            recompute_activations: s.recompute_activations,
            ..TrainConfig::default()
        };
        let mut learner = BurnLearner::new(cfg, model, train, device, 0);
        let r = s.new_tokens.max(1);
        let shared = prompt_ids(s.shared_prefix, 0, vocab);
        let samples: Vec<Sample> = (0..s.batch)
            .map(|b| {
                let own = prompt_ids(s.prompt + r - s.shared_prefix, b + 1, vocab);
                let seq = [shared.as_slice(), own.as_slice()].concat();
                Sample {
                    prompt_ids: seq[..s.prompt].to_vec(),
                    response_ids: seq[s.prompt..].to_vec(),
                    advantages: (0..r)
                        .map(|k| if b % 2 == 0 { 1.0 } else { -1.0 } + 0.01 * k as f32)
                        .collect(),
                    old_logprobs: Some((0..r).map(|k| -9.0 + 0.001 * k as f32).collect()),
                    ref_logprobs: Some((0..r).map(|k| -9.0 - 0.001 * k as f32).collect()),
                    rollout_logprobs: None,
                    opd: None,
                    importance: None,
                }
            })
            .collect();
        let tokens: usize = samples.iter().map(Sample::len).sum();
        // The step reads its metrics back from the device, so it has finished on return.
        let mut step = || -> anyhow::Result<usize> {
            let m = learner.step(&samples)?;
            if let Some(why) = m.skipped {
                bail!("the step was skipped: {why}");
            }
            Ok(tokens)
        };
        step()?;
        timed(s.rounds, || Ok(0), step)
    }
}
