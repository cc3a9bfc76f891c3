//! `clawrl` subcommands of the model area: `model inspect` (config summary and parameter
//! count), `model init` (random weights of a given shape), `model logits` (prompt text, ids and last-position logits for a message list) and
//! `generate` (one reply through the generation engine), for anyone checking a checkpoint, and
//! `lora merge` (a checkpoint with a PEFT adapter folded into its weights).
//! `logits` and `generate` run on the `--device` they are given (CPU by default), with the PEFT
//! adapter of `--adapter` when given.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use clap::{Args, Subcommand};
use serde_json::json;

use clawrl::device::{Device, InferenceTask};
use clawrl::model::chat::{parse_json_value, validate_messages, validate_tools};
use clawrl::model::checkpoint::load_tokenizer_files;
use clawrl::model::{
    apply_adapter, load_adapter, load_checkpoint, load_model, save_checkpoint_dir, spawn_engine,
    Checkpoint, EngineOptions, FinishReason, GenerationRequest, LinearLayout, Qwen3, Qwen3Config,
    SamplingParams,
};
use clawrl::CpuBackend;

/// Subcommands of the model area.
#[derive(Subcommand)]
pub enum Commands {
    /// Inspect or probe a Hugging Face Qwen3 checkpoint directory.
    Model {
        #[command(subcommand)]
        cmd: ModelCommand,
    },
    /// Generate one assistant reply for a message list (temperature 0 = greedy).
    Generate(GenerateArgs),
    /// LoRA adapters in Hugging Face PEFT's format.
    Lora {
        #[command(subcommand)]
        cmd: LoraCommand,
    },
}

/// `clawrl lora ...`.
#[derive(Subcommand)]
pub enum LoraCommand {
    /// Write a checkpoint whose weights are the base's with the adapter folded in
    /// (`W + alpha / r · B A`), loadable without PEFT.
    Merge {
        /// The base checkpoint directory.
        #[arg(long)]
        base: PathBuf,
        /// The PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`).
        #[arg(long)]
        adapter: PathBuf,
        /// The checkpoint directory to write; it must not exist yet.
        #[arg(long)]
        out: PathBuf,
    },
}

/// `clawrl model ...`.
#[derive(Subcommand)]
pub enum ModelCommand {
    /// Print the config summary and the parameter count.
    Inspect {
        /// Checkpoint directory.
        dir: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a checkpoint with random weights: a Hugging Face `config.json` shape and the
    /// tokenizer files of another directory (for tests and benchmarks of a shape no one has
    /// trained).
    Init {
        /// A Qwen3 `config.json`.
        #[arg(long)]
        config: PathBuf,
        /// A directory with `tokenizer.json` (and `tokenizer_config.json` for the template).
        #[arg(long)]
        tokenizer: PathBuf,
        /// The checkpoint directory to write; it must not exist yet.
        #[arg(long)]
        out: PathBuf,
        /// Seed of the weights (normal with the config's `initializer_range`, norms at 1).
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Render the chat template, tokenize, and print the logits after the prompt.
    Logits {
        /// The model and the prompt.
        #[command(flatten)]
        prompt: PromptArgs,
        /// Print `{"prompt_text","input_ids","last_logits"}`.
        #[arg(long)]
        json: bool,
    },
}

/// The model and the prompt of `clawrl model logits` and `clawrl generate`.
#[derive(Args)]
pub struct PromptArgs {
    /// Checkpoint directory.
    dir: PathBuf,
    /// OpenAI-style message list (JSON file).
    #[arg(long)]
    messages: PathBuf,
    /// Tool schemas (JSON list).
    #[arg(long)]
    tools: Option<PathBuf>,
    /// Compute device: `cpu` or `cuda:N` (needs a build with `--features cuda`).
    #[arg(long, default_value_t = Device::Cpu)]
    device: Device,
    /// A PEFT LoRA adapter directory to apply to the checkpoint.
    #[arg(long)]
    adapter: Option<PathBuf>,
}

/// Arguments of `clawrl generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// The model and the prompt.
    #[command(flatten)]
    prompt: PromptArgs,
    /// Most new tokens.
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Extra stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print `{"response_ids","text","logprobs","finish_reason"}`.
    #[arg(long)]
    json: bool,
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {
        Commands::Model {
            cmd: ModelCommand::Inspect { dir, json },
        } => inspect(&dir, json),
        Commands::Model {
            cmd:
                ModelCommand::Init {
                    config,
                    tokenizer,
                    out,
                    seed,
                },
        } => init(&config, &tokenizer, &out, seed),
        Commands::Model {
            cmd: ModelCommand::Logits { prompt, json },
        } => prompt.device.run_inference(LogitsTask {
            prompt: &prompt,
            json,
        })?,
        Commands::Generate(args) => args.prompt.device.run_inference(GenerateTask(args))?,
        Commands::Lora {
            cmd: LoraCommand::Merge { base, adapter, out },
        } => merge(&base, &adapter, &out),
    }
}

/// `model logits` as backend-generic work.
struct LogitsTask<'a> {
    prompt: &'a PromptArgs,
    json: bool,
}

impl InferenceTask for LogitsTask<'_> {
    type Output = anyhow::Result<()>;
    fn run<B: Backend>(self, device: B::Device) -> anyhow::Result<()>
    where
        Qwen3<B>: Send + Sync,
    {
        logits::<B>(&self, &device)
    }
}

/// `generate` as backend-generic work.
struct GenerateTask(GenerateArgs);

impl InferenceTask for GenerateTask {
    type Output = anyhow::Result<()>;
    fn run<B: Backend>(self, device: B::Device) -> anyhow::Result<()>
    where
        Qwen3<B>: Send + Sync,
    {
        generate::<B>(self.0, &device)
    }
}

fn merge(base: &Path, adapter: &Path, out: &Path) -> anyhow::Result<()> {
    if out.exists() {
        bail!(
            "{} exists; lora merge writes a new directory only",
            out.display()
        );
    }
    let ck = load_checkpoint::<CpuBackend>(base, &Default::default())
        .with_context(|| format!("loading {}", base.display()))?;
    let peft = load_adapter(adapter, &ck.config)?;
    let model = ck
        .model
        .with_lora(&peft.weights)
        .with_context(|| format!("applying {}", adapter.display()))?
        .merge_lora();
    save_checkpoint_dir(out, &ck.config, &model, &ck.files)?;
    let c = &peft.weights.config;
    println!(
        "{}",
        json!({"out": out.display().to_string(), "r": c.r, "lora_alpha": c.alpha,
               "targets": c.targets.iter().map(|t| t.name()).collect::<Vec<_>>()})
    );
    Ok(())
}

fn init(config: &Path, tokenizer: &Path, out: &Path, seed: u64) -> anyhow::Result<()> {
    if out.exists() {
        bail!(
            "{} exists; model init writes a new directory only",
            out.display()
        );
    }
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let cfg = Qwen3Config::from_json(&text).with_context(|| format!("{}", config.display()))?;
    let (tok, _, files) = load_tokenizer_files(tokenizer)?;
    let ids = tok.get_vocab_size(true);
    if ids > cfg.vocab_size {
        bail!(
            "the tokenizer in {} has {ids} ids, more than the config's vocab_size {}",
            tokenizer.display(),
            cfg.vocab_size
        );
    }
    let device = Default::default();
    let model = Qwen3::<CpuBackend>::init(&cfg, &device, seed);
    save_checkpoint_dir(out, &cfg, &model, &files)?;
    println!(
        "{}",
        json!({"out": out.display().to_string(), "parameters": model.num_params()})
    );
    Ok(())
}

fn inspect(dir: &Path, as_json: bool) -> anyhow::Result<()> {
    let (cfg, model) = load_model::<CpuBackend>(dir, &Default::default())
        .with_context(|| format!("loading {}", dir.display()))?;
    let params = model.num_params();
    let summary = json!({
        "architecture": "Qwen3ForCausalLM",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads(),
        "head_dim": cfg.head_dim(),
        "rope_theta": cfg.rope_theta(),
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.storage_dtype(),
        "eos_token_ids": cfg.eos_token_ids(),
        "parameters": params,
    });
    if as_json {
        println!("{summary}");
    } else {
        println!("{}: Qwen3ForCausalLM", dir.display());
        for (k, v) in summary.as_object().expect("an object") {
            if k != "architecture" {
                println!("  {k}: {v}");
            }
        }
        println!("  parameters (millions): {:.2}", params as f64 / 1e6);
    }
    Ok(())
}

/// Loads the checkpoint (with the adapter of `adapter` applied) and renders + tokenizes the
/// messages (and tools) files.
fn load_and_encode<B: Backend>(
    args: &PromptArgs,
    device: &B::Device,
) -> anyhow::Result<(Checkpoint<B>, clawrl::model::Prompt)> {
    let PromptArgs {
        dir,
        messages,
        tools,
        adapter,
        ..
    } = args;
    let mut ck =
        load_checkpoint::<B>(dir, device).with_context(|| format!("loading {}", dir.display()))?;
    if let Some(a) = adapter {
        ck.model = apply_adapter(ck.model, &ck.config, a)?;
    }
    let what = messages.display().to_string();
    let text = std::fs::read_to_string(messages).with_context(|| format!("reading {what}"))?;
    let msgs = parse_json_value(&text, &what)?;
    validate_messages(&msgs, &what)?;
    let tools = match tools.as_deref() {
        Some(p) => {
            let what = p.display().to_string();
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {what}"))?;
            let t = parse_json_value(&text, &what)?;
            validate_tools(&t, &what)?;
            Some(t)
        }
        None => None,
    };
    let prompt = ck.encode_chat(&msgs, tools.as_ref())?;
    Ok((ck, prompt))
}

fn logits<B: Backend>(task: &LogitsTask<'_>, device: &B::Device) -> anyhow::Result<()> {
    let as_json = task.json;
    let (ck, prompt) = load_and_encode::<B>(task.prompt, device)?;
    let n = prompt.ids.len();
    anyhow::ensure!(n > 0, "the rendered prompt is empty");
    let input = Tensor::<B, 2, Int>::from_data(
        TensorData::new(prompt.ids.iter().map(|&t| t as i64).collect(), [1, n]),
        device,
    );
    let hidden = ck.model.forward_hidden(input).narrow(1, n - 1, 1);
    let last: Vec<f32> = ck
        .model
        .head(hidden)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    if as_json {
        println!(
            "{}",
            json!({"prompt_text": prompt.text, "input_ids": prompt.ids, "last_logits": last})
        );
    } else {
        println!("prompt ({n} tokens):\n{}", prompt.text);
        let mut top: Vec<(usize, f32)> = last.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        println!("top next tokens:");
        for (id, l) in top.into_iter().take(10) {
            let tok = ck.tokenizer.id_to_token(id as u32).unwrap_or_default();
            println!("  {id:>8} {l:>10.4} {tok:?}");
        }
    }
    Ok(())
}

fn generate<B: Backend>(a: GenerateArgs, device: &B::Device) -> anyhow::Result<()>
where
    Qwen3<B>: Send + Sync,
{
    let (ck, prompt) = load_and_encode::<B>(&a.prompt, device)?;
    let stop_token_ids = ck.stop_token_ids();
    let tokenizer = Arc::new(ck.tokenizer);
    let max_context = ck.config.max_position_embeddings;
    let engine = spawn_engine(
        Arc::new(ck.model.into_layout(LinearLayout::decoding::<B>())),
        Some(tokenizer.clone()),
        EngineOptions {
            max_batch: 1,
            max_context,
            ..EngineOptions::default()
        },
    );
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        max_new_tokens: a.max_new_tokens,
        stop_token_ids: stop_token_ids.clone(),
        stop_strings: a.stop.clone(),
        seed: a.seed,
    };
    let r = engine.generate_blocking(GenerationRequest {
        prompt_ids: prompt.ids,
        params,
        raw_logprobs: None,
    })?;
    // The text leaves out a final stop token and anything from a stop string on.
    let mut ids: &[u32] = &r.response_ids;
    if r.finish_reason == FinishReason::Stop {
        ids = &ids[..ids.len() - 1];
    }
    let mut text = tokenizer
        .decode(ids, false)
        .map_err(|e| anyhow::anyhow!("decoding the response: {e}"))?;
    if r.finish_reason == FinishReason::StopString {
        if let Some(cut) = a.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
        }
    }
    let finish = serde_json::to_value(r.finish_reason)?;
    if a.json {
        println!(
            "{}",
            json!({"response_ids": r.response_ids, "text": text, "logprobs": r.logprobs,
                   "finish_reason": finish})
        );
    } else {
        println!("{text}");
        eprintln!(
            "[{} tokens, finish: {}]",
            r.response_ids.len(),
            finish.as_str().unwrap_or_default()
        );
    }
    Ok(())
}
