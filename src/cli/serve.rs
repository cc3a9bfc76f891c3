//! `clawrl` subcommands of the serving area: `serve`, the OpenAI-compatible gateway over one
//! checkpoint (see [`clawrl::gateway`]).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use clawrl::gateway::{Gateway, GatewayConfig};
use clawrl::model::load_checkpoint;
use clawrl::CpuBackend;

/// Subcommands of the serving area.
#[derive(Subcommand)]
pub enum Commands {
    /// Serve a checkpoint behind an OpenAI-compatible API (chat completions with SSE streaming,
    /// models, healthz, Prometheus metrics), recording main-line turns for training.
    Serve(ServeArgs),
}

/// `clawrl serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Hugging Face Qwen3 checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on (overrides the config's `listen`); port 0 picks a free port.
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Gateway config (TOML; see `clawrl::gateway::GatewayConfig`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Directory of recorded turns (overrides the config's `data_dir`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// An API key clients must send as `Authorization: Bearer KEY` (repeatable); added to the
    /// config's `api_keys` and the `CLAWRL_API_KEYS` variable.
    #[arg(long = "api-key", value_name = "KEY")]
    api_key: Vec<String>,
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {
        Commands::Serve(a) => serve(a),
    }
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = match &a.config {
        Some(p) => GatewayConfig::load(p)?,
        None => GatewayConfig::default(),
    };
    if let Some(l) = a.listen {
        cfg.listen = l;
    }
    if let Some(d) = a.data_dir {
        cfg.data_dir = d;
    }
    cfg.api_keys.extend(a.api_key);
    cfg.validate()?;
    let ck = load_checkpoint::<CpuBackend>(&a.model, &Default::default())
        .with_context(|| format!("loading checkpoint {}", a.model.display()))?;
    let name = a
        .model
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "clawrl".into());
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("binding {}", cfg.listen))?;
        let addr = listener.local_addr()?;
        let gateway = Gateway::new(ck, cfg, &name)?;
        // One machine-readable line on stdout, so scripts and tests can find the port.
        println!("listening on http://{addr} model={}", gateway.model_name());
        tracing::info!(%addr, model = gateway.model_name(), "gateway serving");
        let shutdown = async {
            let ctrl_c = tokio::signal::ctrl_c();
            #[cfg(unix)]
            {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("installing the SIGTERM handler");
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            #[cfg(not(unix))]
            {
                let _ = ctrl_c.await;
            }
        };
        gateway.serve(listener, shutdown).await?;
        anyhow::Ok(())
    })
}
