//! `clawrl` subcommands of the train area: `train-offline`, which trains a Hugging Face
//! checkpoint on recorded samples (also the way to replay a run) and writes the updated
//! checkpoint. It trains on the device of `--device` or of the `device` key of TRAIN.toml
//! (CPU by default). With `--adapter DIR` (a PEFT adapter) or `--lora R,ALPHA,TARGETS` (a fresh
//! one) it trains only that LoRA adapter, the base frozen, and writes a PEFT adapter directory.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use clap::{Args, Subcommand};
use rand::seq::SliceRandom;

use clawrl::device::{take_device_key, Device, TrainingTask};
use clawrl::model::{load_adapter, load_checkpoint, save_adapter, save_checkpoint_dir};
use clawrl::model::{LoraConfig, LoraWeights};
use clawrl::train::learner::{BurnLearner, StepMetrics};
use clawrl::train::samples::read_samples;
use clawrl::train::TrainConfig;

/// Subcommands of the train area.
#[derive(Subcommand)]
pub enum Commands {
    /// Train a checkpoint offline on recorded samples (JSONL), one optimizer step per batch.
    TrainOffline(OfflineArgs),
}

/// The arguments of `train-offline`.
#[derive(Args)]
pub struct OfflineArgs {
    /// Hugging Face checkpoint directory to start from.
    #[arg(long)]
    model: PathBuf,
    /// JSONL samples: `{"prompt_ids","response_ids","advantages","old_logprobs"?,"ref_logprobs"?}`.
    #[arg(long)]
    samples: PathBuf,
    /// TRAIN.toml (lr, betas, adam_eps, weight_decay, eps_clip, eps_clip_high, kl_coef,
    /// grad_clip, batch_size, device); defaults from docs/design.md §1 when omitted.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Compute device, `cpu` or `cuda:N` (CUDA needs a build with `--features cuda`);
    /// overrides the `device` key of TRAIN.toml; `cpu` when neither is given.
    #[arg(long)]
    device: Option<Device>,
    /// Directory for the updated Hugging Face checkpoint, or with `--adapter` / `--lora` the
    /// trained PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`).
    #[arg(long)]
    out: PathBuf,
    /// Train only this PEFT LoRA adapter (the base stays frozen).
    #[arg(long, conflicts_with = "lora")]
    adapter: Option<PathBuf>,
    /// Train only a fresh LoRA adapter `R,ALPHA,TARGET[,TARGET...]` (e.g.
    /// `16,32,q_proj,v_proj`; `all` for every linear layer of the blocks): A drawn
    /// Kaiming-uniform from `--seed`, B zero.
    #[arg(long, value_parser = parse_lora)]
    lora: Option<LoraConfig>,
    /// Passes over the samples.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Shuffle the samples at the start of every epoch (seeded by `--seed`).
    #[arg(long)]
    shuffle: bool,
    /// Seed of the learner's RNG.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object per step instead of a text line.
    #[arg(long)]
    json: bool,
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {
        Commands::TrainOffline(args) => train_offline(args),
    }
}

fn parse_lora(text: &str) -> Result<LoraConfig, String> {
    LoraConfig::parse_cli(text).map_err(|e| e.message)
}

fn print_step(m: &StepMetrics, json: bool) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if json {
        let mut v = serde_json::json!({
            "step": m.step,
            "loss": m.loss,
            "pg_loss": m.pg_loss,
            "kl": m.kl,
            "clip_fraction": m.clip_fraction,
            "grad_norm": m.grad_norm,
        });
        if let Some(why) = &m.skipped {
            v["skipped"] = serde_json::Value::String(why.clone());
        }
        writeln!(stdout, "{v}")?;
    } else if let Some(why) = &m.skipped {
        writeln!(stdout, "step {} skipped: {why}", m.step)?;
    } else {
        writeln!(
            stdout,
            "step {:>4}  loss {:+.6}  pg {:+.6}  kl {:.6}  clip {:.3}  grad_norm {:.4}  tokens {}",
            m.step, m.loss, m.pg_loss, m.kl, m.clip_fraction, m.grad_norm, m.tokens
        )?;
    }
    stdout.flush()?;
    Ok(())
}

fn train_offline(args: OfflineArgs) -> anyhow::Result<()> {
    if args.epochs == 0 {
        bail!("--epochs must be at least 1");
    }
    let (train, config_device) = match &args.config {
        Some(p) => read_train_config(p)?,
        None => (TrainConfig::default(), None),
    };
    let device = args.device.or(config_device).unwrap_or_default();
    device.run_training(OfflineRun { args, train })?
}

/// Reads TRAIN.toml: its `device` key, then the rest through the learner's strict parser.
fn read_train_config(path: &Path) -> anyhow::Result<(TrainConfig, Option<Device>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read training config {}", path.display()))?;
    let origin = path.display().to_string();
    let (device, rest) = take_device_key(&text, &origin)?;
    Ok((TrainConfig::from_toml_str(&rest, &origin)?, device))
}

/// `train-offline` after its arguments are checked, as backend-generic work.
struct OfflineRun {
    args: OfflineArgs,
    train: TrainConfig,
}

impl TrainingTask for OfflineRun {
    type Output = anyhow::Result<()>;
    fn run<B: AutodiffBackend>(self, device: B::Device) -> anyhow::Result<()> {
        train_offline_on::<B>(self, device)
    }
}

fn train_offline_on<B: AutodiffBackend>(run: OfflineRun, device: B::Device) -> anyhow::Result<()> {
    let OfflineRun { args, train } = run;
    let mut ckpt = load_checkpoint::<B>(&args.model, &device)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let lora = match (args.adapter, args.lora) {
        (None, None) => None,
        (Some(dir), _) => {
            let peft = load_adapter(&dir, &ckpt.config)?;
            // Training here has no dropout; an adapter configured with some would be trained
            // differently from what its config says.
            if peft.lora_dropout != 0.0 {
                bail!(
                    "{}: `lora_dropout` = {}: train-offline trains without dropout; set it to 0 \
                     to train this adapter",
                    dir.display(),
                    peft.lora_dropout
                );
            }
            Some(peft.weights)
        }
        (None, Some(cfg)) => Some(LoraWeights::fresh(&cfg, &ckpt.config, args.seed)),
    };
    if let Some(w) = &lora {
        ckpt.model = ckpt.model.with_lora(w)?;
    }
    let mut samples = read_samples(&args.samples, Some(ckpt.config.vocab_size))?;
    let max = ckpt.config.max_position_embeddings;
    if let Some((i, s)) = samples.iter().enumerate().find(|(_, s)| s.len() > max) {
        bail!(
            "{}: sample {} has {} tokens, more than the model's {max} positions",
            args.samples.display(),
            i + 1,
            s.len()
        );
    }
    tracing::info!(
        samples = samples.len(),
        batch_size = train.batch_size,
        epochs = args.epochs,
        "training offline"
    );
    let batch_size = train.batch_size;
    let mut learner = BurnLearner::new(ckpt.config.clone(), ckpt.model, train, device, args.seed);
    let mut skipped = 0usize;
    for _ in 0..args.epochs {
        if args.shuffle {
            samples.shuffle(learner.rng());
        }
        for batch in samples.chunks(batch_size) {
            let m = learner.step(batch)?;
            if m.skipped.is_some() {
                skipped += 1;
                tracing::warn!(reason = m.skipped.as_deref().unwrap_or(""), "step skipped");
            }
            print_step(&m, args.json)?;
        }
    }
    match &lora {
        None => write_atomically(&args.out, |tmp| {
            save_checkpoint_dir(
                tmp,
                learner.model_config(),
                &learner.policy().valid(),
                &ckpt.files,
            )
            .with_context(|| format!("writing checkpoint to {}", tmp.display()))
        })?,
        Some(w) => write_atomically(&args.out, |tmp| {
            let trained = learner.policy().valid().lora_weights(&w.config)?;
            save_adapter(tmp, &trained, &args.model.display().to_string())
                .with_context(|| format!("writing the adapter to {}", tmp.display()))
        })?,
    }
    tracing::info!(
        out = %args.out.display(),
        steps = learner.steps(),
        skipped,
        version = learner.version(),
        adapter = lora.is_some(),
        "wrote the updated model"
    );
    Ok(())
}

/// Runs `write` on a temporary sibling directory of `out`, then renames it into place.
fn write_atomically(
    out: &Path,
    write: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let name = out
        .file_name()
        .with_context(|| format!("--out {} has no directory name", out.display()))?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    write(&tmp)?;
    if out.exists() {
        let trash = parent.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(out, &trash).with_context(|| format!("moving aside {}", out.display()))?;
        std::fs::rename(&tmp, out).with_context(|| format!("renaming into {}", out.display()))?;
        std::fs::remove_dir_all(&trash)?;
    } else {
        std::fs::rename(&tmp, out).with_context(|| format!("renaming into {}", out.display()))?;
    }
    Ok(())
}
