//! `clawrl` subcommands of the cluster area: certificates (`cluster init`), running a node
//! (`node`, `attach`), and talking to the cluster (`submit`, `status`, `cancel`, `limit`, `nodes`, `ping`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Subcommand;
use clawrl::job::{JobSpec, SpecValidator};
use clawrl_actors::cli::{self as client, BlobReply, BlobRequest, CliReply, CliRequest};
use clawrl_actors::config::NodeConfig;
use clawrl_actors::control::{ControlReply, ControlRequest, JobRecord};
use clawrl_actors::loops::JobCounts;
use clawrl_actors::member::EnvSpec;
use clawrl_actors::node::{Node, NodeOptions};

/// Subcommands of the cluster area.
#[derive(Subcommand)]
pub enum Commands {
    /// Cluster administration.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Run a node from its config file (runs until Ctrl-C / SIGTERM).
    Node {
        /// The node's config file (`cluster.toml`).
        #[arg(long)]
        config: PathBuf,
        /// Environment slots to host, `KIND:COUNT` (needs the `env` role): an environment host
        /// of KIND runs on the node, and Control places up to COUNT sessions of jobs on it;
        /// repeatable.
        #[arg(long = "env")]
        envs: Vec<EnvSpec>,
    },
    /// Join a running cluster as a process hosting environments: a node with the environment
    /// hosts of its `--env` kinds, whose slots Control places jobs on as they run.
    Attach {
        /// This process's node config (name, listen, seeds, tls; roles should include `env`).
        #[arg(long)]
        config: PathBuf,
        /// Environment slots, `KIND:COUNT`; repeatable.
        #[arg(long = "env", required = true)]
        envs: Vec<EnvSpec>,
    },
    /// Submit a job spec to the cluster's Control actor.
    Submit {
        /// The job spec (TOML).
        job: PathBuf,
        /// Config of the node to talk to.
        #[arg(long)]
        config: PathBuf,
    },
    /// Show one job, or all jobs.
    Status {
        /// The job id (`job-N`).
        job: Option<String>,
        /// Config of the node to talk to.
        #[arg(long)]
        config: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job.
    Cancel {
        /// The job id.
        job: String,
        /// Config of the node to talk to.
        #[arg(long)]
        config: PathBuf,
    },
    /// Change when a running job stops: after `--max-steps` trainer optimizer steps in all
    /// (raised or lowered; it replaces the spec's `stop.max_steps`, survives a restart of the
    /// trainer node, and the spec's other stop bounds still hold). Applies to jobs run by the
    /// cluster's trainer nodes (`clawrl submit`).
    Limit {
        /// The job id.
        job: String,
        /// Stop once the trainer has made this many optimizer steps (at least 1).
        #[arg(long)]
        max_steps: u64,
        /// Config of the node to talk to.
        #[arg(long)]
        config: PathBuf,
    },
    /// List the cluster's nodes and process groups.
    Nodes {
        /// Config of the node to talk to.
        #[arg(long)]
        config: PathBuf,
        /// Print `{"nodes":[...],"groups":{...}}`.
        #[arg(long)]
        json: bool,
    },
    /// Move blobs with a node's bulk plane (files are read and written on this machine; their
    /// bytes travel over the CLI's connection).
    Blob {
        #[command(subcommand)]
        cmd: BlobCmd,
    },
    /// Ping every node from a node (remote request/reply round trips).
    Ping {
        /// Config of the node to talk to.
        #[arg(long)]
        config: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `clawrl blob ...`
#[derive(Subcommand)]
pub enum BlobCmd {
    /// Publish a local file's bytes as a blob on the node; prints the blob id and size.
    Publish {
        /// The file (read here, sent to the node).
        path: PathBuf,
        /// Config of the node.
        #[arg(long)]
        config: PathBuf,
    },
    /// Broadcast a blob the node holds to other nodes (relayed).
    Broadcast {
        /// The blob id.
        id: String,
        /// Target node names, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        to: Vec<String>,
        /// Config of the node holding the blob.
        #[arg(long)]
        config: PathBuf,
    },
    /// Fetch a blob the node holds into a local file; prints its size and blake3.
    Save {
        /// The blob id.
        id: String,
        /// The file to write (here; replaced only once every byte arrived and checked).
        path: PathBuf,
        /// Config of the node.
        #[arg(long)]
        config: PathBuf,
    },
}

/// `clawrl cluster ...`
#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Create a cluster CA, one certificate per node and a client certificate.
    Init {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Node names, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
    },
}

/// Longest a `blob publish` or `blob save` may take (a body stalled for `BODY_STALL` fails
/// sooner).
const BLOB_TIMEOUT: Duration = Duration::from_secs(3600);

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn load(config: &std::path::Path) -> anyhow::Result<NodeConfig> {
    Ok(NodeConfig::load(config)?)
}

fn ask(config: &std::path::Path, req: CliRequest) -> anyhow::Result<CliReply> {
    let cfg = load(config)?;
    let reply = runtime()?.block_on(client::request(&cfg, &req, Duration::from_secs(30)))?;
    if let CliReply::Error(e) = &reply {
        bail!("{e}");
    }
    Ok(reply)
}

fn control(config: &std::path::Path, req: ControlRequest) -> anyhow::Result<Vec<JobRecord>> {
    match ask(config, CliRequest::Control(req))? {
        CliReply::Control(ControlReply::Jobs(j)) => Ok(j),
        CliReply::Control(ControlReply::Error(e)) => bail!("{e}"),
        other => bail!("unexpected reply from the node: {other:?}"),
    }
}

fn print_jobs(jobs: &[JobRecord]) {
    if jobs.is_empty() {
        println!("no jobs");
    }
    for j in jobs {
        println!(
            "{}\t{}\t{:?}\ttrainer={}\tenv {} {}/{}\t{}",
            j.id,
            j.needs.name,
            j.state,
            j.placement.trainer.as_deref().unwrap_or("-"),
            j.needs.env_kind,
            j.placement.env_slots.len(),
            j.needs.env_parallelism,
            j.placement.env_slots.join(",")
        );
        if let Some(c) = &j.progress {
            println!("\t{}", progress_line(c));
        }
    }
}

/// One line of a job's reported counts: phase, sessions, turns, and the sample balance
/// `produced = trained + dropped_stale + failed + pending`.
pub fn progress_line(c: &JobCounts) -> String {
    let t = &c.trainer;
    format!(
        "{:?} {:.1}s | sessions {} running, {} started, {} failed, {} lost | turns {} ({} judged, {} unjudged) | samples produced {} = trained {} + dropped_stale {} + failed {} + pending {} | steps {} version {}",
        c.phase,
        c.elapsed_ms as f64 / 1000.0,
        c.sessions_running,
        c.sessions_started,
        c.sessions_failed,
        c.sessions_lost,
        c.turns,
        c.judged,
        c.unjudged,
        t.produced,
        t.trained,
        t.dropped_stale,
        t.failed,
        t.pending,
        t.steps,
        t.version
    ) + &c
        .gave_up
        .as_ref()
        .map(|g| format!(" | gave up: {g}"))
        .unwrap_or_default()
}

fn run_node(config: PathBuf, envs: Vec<EnvSpec>) -> anyhow::Result<()> {
    let cfg = load(&config)?;
    runtime()?.block_on(async move {
        let node = Node::start(
            &cfg,
            NodeOptions {
                validator: Some(Arc::new(SpecValidator)),
                envs: envs.clone(),
            },
        )
        .await?;
        // Jobs across nodes: generation (rollout), episodes (--env), job homes (trainer).
        clawrl::pipeline::distributed::start_node_services(&node, &cfg, &envs).await?;
        node.run_until_signal().await;
        Ok(())
    })
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    match cmd {
        Commands::Cluster {
            cmd: ClusterCmd::Init { out, nodes },
        } => {
            for n in &nodes {
                if !clawrl_actors::config::valid_node_name(n) || n == "client" || n == "ca" {
                    bail!("--nodes: `{n}` is not a usable node name (ASCII letters, digits, '-', '_'; not `ca` or `client`)");
                }
            }
            let written = clawrl_actors::pki::init_cluster(&out, &nodes)?;
            for p in written {
                println!("{}", p.display());
            }
            Ok(())
        }
        Commands::Node { config, envs } => run_node(config, envs),
        Commands::Attach { config, envs } => run_node(config, envs),
        Commands::Submit { job, config } => {
            // Absolute, so that the nodes running the job resolve the spec's relative paths
            // against its directory whatever their working directory.
            let job = std::path::absolute(&job)
                .with_context(|| format!("resolving {}", job.display()))?;
            let file = job.display().to_string();
            let spec = std::fs::read_to_string(&job).with_context(|| format!("reading {file}"))?;
            // Checked here for a quick answer; Control checks again.
            JobSpec::parse(&spec, &file)?;
            let jobs = control(&config, ControlRequest::Submit { file, spec })?;
            print_jobs(&jobs);
            Ok(())
        }
        Commands::Status { job, config, json } => {
            let jobs = control(&config, ControlRequest::Status(job))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&jobs)?);
            } else {
                print_jobs(&jobs);
            }
            Ok(())
        }
        Commands::Cancel { job, config } => {
            print_jobs(&control(&config, ControlRequest::Cancel(job))?);
            Ok(())
        }
        Commands::Limit {
            job,
            max_steps,
            config,
        } => {
            let req = ControlRequest::SetMaxSteps { id: job, max_steps };
            print_jobs(&control(&config, req)?);
            Ok(())
        }
        Commands::Nodes { config, json } => match ask(&config, CliRequest::Nodes)? {
            CliReply::Nodes(view) => {
                if json {
                    println!("{}", serde_json::to_string(&view)?);
                } else {
                    for n in &view.nodes {
                        let envs = if n.envs.is_empty() {
                            String::new()
                        } else {
                            format!("\tenv {}", n.envs.join(","))
                        };
                        println!("{}\t{}\t{}{envs}", n.name, n.addr, n.roles.join(","));
                    }
                    for (g, members) in &view.groups {
                        println!("{g}: {}", members.join(" "));
                    }
                }
                Ok(())
            }
            other => bail!("unexpected reply from the node: {other:?}"),
        },
        Commands::Blob { cmd } => match cmd {
            BlobCmd::Publish { path, config } => {
                let cfg = load(&config)?;
                let blob = runtime()?.block_on(client::publish_blob(&cfg, &path, BLOB_TIMEOUT))?;
                println!("{}\t{}", blob.id, blob.len);
                Ok(())
            }
            BlobCmd::Broadcast { id, to, config } => {
                let req = CliRequest::Blob(BlobRequest::Broadcast { id, targets: to });
                match ask(&config, req)? {
                    CliReply::Blob(BlobReply::Broadcast { delivered, retried }) => {
                        println!("delivered\t{}", delivered.join(","));
                        if !retried.is_empty() {
                            println!("retried\t{}", retried.join(","));
                        }
                        Ok(())
                    }
                    other => bail!("unexpected reply from the node: {other:?}"),
                }
            }
            BlobCmd::Save { id, path, config } => {
                let cfg = load(&config)?;
                let saved =
                    runtime()?.block_on(client::save_blob(&cfg, &id, &path, BLOB_TIMEOUT))?;
                println!("{}\t{}", saved.len, saved.blake3);
                Ok(())
            }
        },
        Commands::Ping { config, json } => match ask(&config, CliRequest::Ping)? {
            CliReply::Ping(results) => {
                if json {
                    println!("{}", serde_json::to_string(&results)?);
                } else {
                    for r in &results {
                        let status = if r.ok { "ok" } else { "FAILED" };
                        println!("{}\t{}\t{status}\t{}", r.group, r.member, r.detail);
                    }
                }
                if results.iter().any(|r| !r.ok) {
                    bail!("some members did not answer");
                }
                Ok(())
            }
            other => bail!("unexpected reply from the node: {other:?}"),
        },
    }
}
