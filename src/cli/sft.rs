//! `clawrl sft`: the personal-agent experiment's warm start. Builds the small Qwen3 policy and
//! its tokenizer in code, supervised-trains it on the synthetic style-conditioned corpus and
//! caches the Hugging Face checkpoint under a hash of the settings (a second run reuses it).

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

use crate::experiments::personal::experiment::ExperimentFile;
use crate::experiments::personal::sft::{warm_start, SftSettings};

/// Subcommands of the sft area.
#[derive(Subcommand)]
pub enum Commands {
    /// Warm-start the personal-agent policy (cached by a hash of its settings) and print the
    /// checkpoint directory.
    Sft {
        /// An experiment file (e.g. examples/personal.toml) whose `[sft]` table and `cache_dir`
        /// to use; the defaults otherwise.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Cache directory (overrides the file's `cache_dir`; default
        /// target/clawrl-cache/personal).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        /// Supervised steps (overrides `sft.steps`).
        #[arg(long)]
        steps: Option<usize>,
        /// Seed (overrides `sft.seed`).
        #[arg(long)]
        seed: Option<u64>,
        /// Retrain even when the cache holds the checkpoint.
        #[arg(long)]
        force: bool,
    },
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    let Commands::Sft {
        config,
        cache_dir,
        steps,
        seed,
        force,
    } = cmd;
    let (mut settings, file_cache) = match &config {
        Some(path) => {
            let f = ExperimentFile::from_file(path)?;
            let dir = f.cache_dir();
            (f.sft, Some(dir))
        }
        None => (SftSettings::default(), None),
    };
    if let Some(s) = steps {
        settings.steps = s;
    }
    if let Some(s) = seed {
        settings.seed = s;
    }
    let cache = cache_dir
        .or(file_cache)
        .unwrap_or_else(|| PathBuf::from("target/clawrl-cache/personal"));
    let out = warm_start(&settings, &cache, force).context("clawrl sft")?;
    println!(
        "{}",
        serde_json::to_string(&out).context("serializing the outcome")?
    );
    Ok(())
}
