//! `clawrl` subcommands of the serving area: `serve`, the OpenAI-compatible gateway over one
//! checkpoint (see [`clawrl::gateway`]), and `dashboard`, the live dashboard of any run
//! directory (see [`clawrl::watch::dashboard`]).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use clawrl::gateway::{Gateway, GatewayConfig};
use clawrl::model::{apply_adapter, load_checkpoint};
use clawrl::CpuBackend;

/// Subcommands of the serving area.
#[derive(Subcommand)]
pub enum Commands {
    /// Serve a checkpoint behind an OpenAI-compatible API (chat completions with SSE streaming,
    /// models, healthz, Prometheus metrics), recording main-line turns for training.
    Serve(ServeArgs),
    /// Serve the dashboard of a run directory (finished or running): GET /dashboard, its data
    /// at GET /dashboard/data behind the API keys.
    Dashboard(DashboardArgs),
}

/// `clawrl dashboard`.
#[derive(Args)]
pub struct DashboardArgs {
    /// The run directory (a job's `--out`).
    #[arg(long)]
    out: PathBuf,
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8100")]
    listen: std::net::SocketAddr,
    /// An API key the page must send (repeatable); added to the comma-separated keys of
    /// `CLAWRL_API_KEYS`, as `clawrl serve` takes them. With none, the data is open.
    #[arg(long = "api-key", value_name = "KEY")]
    api_key: Vec<String>,
}

/// `clawrl serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Hugging Face Qwen3 checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A PEFT LoRA adapter directory applied to the checkpoint for every request.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// A PEFT LoRA adapter directory served as model id NAME beside the checkpoint
    /// (repeatable; as vLLM's `--lora-modules NAME=PATH`): requests name the adapter in
    /// `model`, and requests for any of them share decode batches over the one base. Each
    /// applies to the checkpoint's own weights, not to `--adapter`'s. Added to the config's
    /// `[adapters]`.
    #[arg(long = "lora-module", value_name = "NAME=DIR")]
    lora_module: Vec<String>,
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
        Commands::Dashboard(a) => dashboard(a),
    }
}

fn dashboard(a: DashboardArgs) -> anyhow::Result<()> {
    use clawrl::gateway::auth::ApiKeys;
    use clawrl::watch::dashboard::{standalone_router, DashboardSource};
    if !a.out.is_dir() {
        anyhow::bail!(
            "--out {}: not a directory (give the run directory a job was started with)",
            a.out.display()
        );
    }
    let cfg = GatewayConfig {
        api_keys: a.api_key,
        ..GatewayConfig::default()
    };
    let keys = cfg.resolved_api_keys();
    if keys.iter().any(|k| k.trim().is_empty()) {
        anyhow::bail!("--api-key: keys must not be empty");
    }
    let keys = ApiKeys::new(&keys);
    let source = std::sync::Arc::new(DashboardSource::new(Some(a.out.clone())));
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?;
        if keys.is_open() {
            tracing::warn!(
                "no API key configured (--api-key, CLAWRL_API_KEYS): anyone who reaches {addr} \
                 sees the run's data"
            );
        }
        // One machine-readable line on stdout, so scripts and tests can find the port.
        println!(
            "listening on http://{addr} dashboard of {}",
            a.out.display()
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        axum::serve(listener, standalone_router(source, keys))
            .with_graceful_shutdown(shutdown)
            .await?;
        anyhow::Ok(())
    })
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
    for module in &a.lora_module {
        let Some((name, dir)) = module.split_once('=') else {
            anyhow::bail!("--lora-module {module:?}: expected NAME=DIR");
        };
        if cfg
            .adapters
            .insert(name.to_string(), PathBuf::from(dir))
            .is_some()
        {
            anyhow::bail!("--lora-module: the model id {name:?} is given twice");
        }
    }
    cfg.validate()?;
    let mut ck = load_checkpoint::<CpuBackend>(&a.model, &Default::default())
        .with_context(|| format!("loading checkpoint {}", a.model.display()))?;
    if let Some(dir) = &a.adapter {
        ck.model = apply_adapter(ck.model, &ck.config, dir)?;
    }
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
        gateway.serve(listener, Box::pin(shutdown)).await?;
        anyhow::Ok(())
    })
}
