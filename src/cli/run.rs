//! `clawrl run JOB.toml`: the embedded default. One in-process node with every role (its Control
//! actor knows the job and shows its counts to `clawrl status --config <out>/node.toml` while it
//! runs), the job's loops run to the stop condition with progress bars, then a summary table
//! (`--json`: a machine-readable summary on stdout instead).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use clawrl::job::{JobKind, JobSpec, SpecValidator, PERSONAL_ENV_KIND};
use clawrl::pipeline::gateway_job::{
    run_gateway_job, GatewayJobOptions, GatewayJobReport, OnListening,
};
use clawrl::pipeline::{run_job, RunOptions, RunReport};
use clawrl_actors::config::{JudgeAccess, NodeConfig};
use clawrl_actors::control::{ControlReply, ControlRequest};
use clawrl_actors::loops::{JobCounts, JobPhase, ProgressReport, TrainerStats};
use clawrl_actors::member::EnvSpec;
use clawrl_actors::node::{Node, NodeOptions};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::experiments::personal::experiment::{Seeds, SeedsError};
use crate::experiments::{personal, toolagent, ExperimentKind};

/// Subcommands of this area.
#[derive(Subcommand)]
pub enum Commands {
    /// Run a job spec (JOB.toml) to its stop condition on one in-process node with every role.
    Run {
        /// The job spec.
        job: PathBuf,
        /// The run directory: records, checkpoints, the node's config and data (default
        /// `runs/<name>-<unix time>`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print a JSON summary on stdout (no progress bars).
        #[arg(long)]
        json: bool,
        /// The embedded node's QUIC listen address (port 0 picks one; the chosen one is written
        /// to `<out>/node.toml`).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// An endpoint the job's judge may call (repeatable): `loopback` or an http(s) URL
        /// prefix, as the node config's `[judge] allowed_endpoints`. Given at all, the list is
        /// exactly these; default: `loopback`.
        #[arg(long = "allow-judge-endpoint", value_name = "URL")]
        allow_judge_endpoint: Vec<String>,
        /// An environment variable the job's judge may read its API key from (repeatable), as
        /// the node config's `[judge] allowed_key_envs`; default: none.
        #[arg(long = "allow-judge-key-env", value_name = "NAME")]
        allow_judge_key_env: Vec<String>,
        /// Experiment files only: run every method once per seed (comma-separated, e.g.
        /// `1,2,3`) and report mean ± standard deviation; default: the file's one seed. The
        /// tool-call experiment takes one seed.
        #[arg(long, value_name = "SEEDS", value_parser = parse_seeds)]
        seeds: Option<Seeds>,
    },
}

/// `--seeds`: comma-separated experiment seeds, at least one, none repeated.
fn parse_seeds(s: &str) -> Result<Seeds, SeedsError> {
    s.parse()
}

/// The `[judge]` access of the embedded node: the `--allow-judge-*` flags over the defaults.
fn judge_access(endpoints: Vec<String>, key_envs: Vec<String>) -> JudgeAccess {
    let d = JudgeAccess::default();
    JudgeAccess {
        allowed_endpoints: if endpoints.is_empty() {
            d.allowed_endpoints
        } else {
            endpoints
        },
        allowed_key_envs: key_envs,
    }
}

/// What a finished job reports, by its kind.
#[derive(Serialize)]
#[serde(untagged)]
enum Report {
    /// An `rl` job.
    Rl(Box<RunReport>),
    /// A `personal` job.
    Personal(Box<GatewayJobReport>),
}

impl Report {
    fn counts(&self) -> &JobCounts {
        match self {
            Report::Rl(r) => &r.counts,
            Report::Personal(r) => &r.counts,
        }
    }
}

/// The JSON summary of `clawrl run --json`.
#[derive(Serialize)]
struct Summary<'a> {
    /// Control's id of the job.
    control_id: &'a str,
    /// The spec file.
    spec: String,
    /// The run directory.
    out: &'a Path,
    /// Whether produced = trained + dropped_stale + failed + pending.
    balanced: bool,
    #[serde(flatten)]
    report: &'a Report,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Runs one subcommand of this area.
pub fn run(cmd: Commands) -> anyhow::Result<()> {
    let Commands::Run {
        job,
        out,
        json,
        listen,
        allow_judge_endpoint,
        allow_judge_key_env,
        seeds,
    } = cmd;
    // An experiment is a file of its own kind; anything else is a job spec.
    match ExperimentKind::of_file(&job) {
        Some(ExperimentKind::Personal) => {
            personal::experiment::cli_main(&job, out, json, seeds.as_ref())?;
            Ok(())
        }
        Some(ExperimentKind::ToolCall) => {
            let seed = match seeds.as_ref().map(|s| s.0.as_slice()) {
                None => None,
                Some([one]) => Some(*one),
                Some(_) => bail!(
                    "--seeds: the tool-call experiment runs one seed at a time; give one seed \
                     per run (its results go to --out)"
                ),
            };
            toolagent::experiment::cli_main(&job, out, json, seed)?;
            Ok(())
        }
        None if seeds.is_some() => bail!(
            "--seeds applies to experiment files (kind = \"personal_experiment\" or \
             \"tool_call_experiment\"); {} is a job spec",
            job.display()
        ),
        None => {
            let node = EmbeddedNode::new(
                listen,
                judge_access(allow_judge_endpoint, allow_judge_key_env),
            )?;
            let spec = JobSpec::load(&job)?;
            run_embedded(spec, &job, out, json, &node)
        }
    }
}

/// What `clawrl run` configures its embedded node with.
struct EmbeddedNode {
    /// `--listen`.
    listen: String,
    /// `--allow-judge-endpoint`, `--allow-judge-key-env`.
    judge: JudgeAccess,
}

impl EmbeddedNode {
    /// Checks the flags as a node's config file is checked (so a bad `--allow-judge-*` entry is
    /// named before a spec is even read).
    fn new(listen: String, judge: JudgeAccess) -> anyhow::Result<Self> {
        let text = node_config_text(&listen, Path::new("node"), &judge);
        NodeConfig::parse(&text, Path::new("(the embedded node)"))
            .context("--listen, --allow-judge-endpoint or --allow-judge-key-env")?;
        Ok(Self { listen, judge })
    }

    /// The node's config, parsed (and so checked) as a node's file is.
    fn config(&self, node_file: &Path, data_dir: &Path) -> anyhow::Result<NodeConfig> {
        let text = node_config_text(&self.listen, data_dir, &self.judge);
        Ok(NodeConfig::parse(&text, node_file)?)
    }

    /// Refuses a spec whose judge asks for what this node does not allow, before the node
    /// starts and so before the judge sends anything.
    fn check_judge(&self, spec: &JobSpec, file: &str) -> anyhow::Result<()> {
        clawrl::judge::access::check(&spec.judge, &self.judge)
            .with_context(|| format!("job spec {file}"))
    }
}

fn toml_strings(v: &[String]) -> String {
    toml::Value::Array(v.iter().cloned().map(toml::Value::String).collect()).to_string()
}

fn node_config_text(listen: &str, data_dir: &Path, judge: &JudgeAccess) -> String {
    format!(
        "# The embedded node of a `clawrl run`. `clawrl status --config <this file>` asks its Control.\n\
         [node]\nname = \"local\"\nlisten = \"{listen}\"\nseeds = []\n\
         roles = [\"control\", \"trainer\", \"rollout\", \"judge\", \"env\"]\ndata_dir = {:?}\n\n\
         [judge]\nallowed_endpoints = {}\nallowed_key_envs = {}\n",
        data_dir.display().to_string(),
        toml_strings(&judge.allowed_endpoints),
        toml_strings(&judge.allowed_key_envs),
    )
}

async fn control_call(req: &ControlRequest) -> anyhow::Result<ControlReply> {
    let cell = ractor::pg::get_members(&clawrl_actors::groups::CONTROL.to_string())
        .into_iter()
        .next()
        .context("the embedded node has no Control actor")?;
    Ok(clawrl_actors::rpc::call(&cell, req, Duration::from_secs(10)).await?)
}

struct Bars {
    multi: MultiProgress,
    steps: ProgressBar,
    turns: ProgressBar,
    counts: ProgressBar,
}

impl Bars {
    fn new(spec: &JobSpec, hidden: bool) -> Self {
        let multi = MultiProgress::with_draw_target(if hidden {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr_with_hz(5)
        });
        let bar = |len: Option<u64>, what: &str| {
            let style = match len {
                Some(_) => ProgressStyle::with_template(&format!(
                    "{{elapsed_precise}} {what:>13} [{{bar:30}}] {{pos}}/{{len}} {{msg}}"
                )),
                None => ProgressStyle::with_template(&format!(
                    "{{elapsed_precise}} {what:>13} {{pos}} {{msg}}"
                )),
            }
            .expect("valid template")
            .progress_chars("=> ");
            let b = multi.add(ProgressBar::new(len.unwrap_or(0)));
            b.set_style(style);
            b
        };
        let steps = bar(spec.stop.max_steps, "trainer steps");
        let turns = bar(spec.stop.max_turns, "turns");
        let counts = multi.add(ProgressBar::new_spinner());
        counts.set_style(ProgressStyle::with_template("{spinner} {msg}").expect("valid template"));
        Bars {
            multi,
            steps,
            turns,
            counts,
        }
    }

    fn update(&self, c: &JobCounts) {
        let t = &c.trainer;
        self.steps.set_position(t.steps);
        self.steps.set_message(format!("version {}", t.version));
        self.turns.set_position(c.turns);
        self.turns.set_message(format!(
            "judged {} unjudged {} · sessions {} running, {} failed, {} lost",
            c.judged, c.unjudged, c.sessions_running, c.sessions_failed, c.sessions_lost
        ));
        self.counts.set_message(format!(
            "samples: produced {} = trained {} + stale {} + failed {} + pending {} · records {}{}",
            t.produced,
            t.trained,
            t.dropped_stale,
            t.failed,
            t.pending,
            c.records_written,
            match c.phase {
                JobPhase::Running => "",
                JobPhase::Draining => " · draining",
                JobPhase::Finished => " · finished",
            }
        ));
        self.counts.tick();
    }

    fn finish(&self) {
        for b in [&self.steps, &self.turns, &self.counts] {
            b.finish();
        }
        let _ = self.multi.clear();
    }
}

/// The run directory ([`crate::experiments::run_dir`]), created and made absolute. A job's
/// directory may hold an earlier run of it, which the job resumes.
fn run_dir(out: Option<PathBuf>, name: &str) -> anyhow::Result<PathBuf> {
    let out = crate::experiments::run_dir(out, name);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    std::path::absolute(&out).with_context(|| format!("resolving {}", out.display()))
}

/// Resolves on Ctrl-C or SIGTERM.
async fn interrupted() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn print_personal_table(r: &GatewayJobReport, out: &Path, balanced: bool) {
    let c = &r.counts;
    let g = &r.serving;
    let several = r.agents.len() > 1;
    let models = r
        .agents
        .iter()
        .map(|a| format!("{} (v{})", a.model, a.gateway.version))
        .collect::<Vec<_>>()
        .join(", ");
    let mut rows: Vec<(String, String)> = vec![
        ("job".into(), format!("{} (method {})", r.job, r.method)),
        (
            "gateway".into(),
            format!("http://{} serving {models}", r.addr),
        ),
        (
            "wall time".into(),
            format!("{:.1} s, stopped by {}", r.wall_s, r.stopped_by),
        ),
        (
            "sessions".into(),
            format!(
                "{} opened = {} ended by their client + {} ended idle or at shutdown + {} open; \
                 {} turns abandoned mid-stream (never trained on); {} answers with a 5xx status",
                g.sessions.started,
                g.sessions.ended_done,
                g.sessions.ended_idle,
                g.open_sessions,
                g.turns_abandoned,
                g.responses_5xx
            ),
        ),
        (
            "turn files".into(),
            format!(
                "{} answers journaled, {} complete turns written, {} write errors, in {}; at \
                 start {} torn lines cut, {} answered turns a crash took before their next \
                 state recorded as lost",
                g.served_written,
                g.records_written,
                g.record_write_errors,
                r.turns_dir.display(),
                g.torn_lines_cut,
                g.lost_by_crash
            ),
        ),
    ];
    for a in &r.agents {
        let c = &a.counts;
        let t = &a.trainer;
        let key = |k: &str| {
            if several {
                format!("{} {k}", a.model)
            } else {
                k.to_string()
            }
        };
        let agent_balanced = t.produced == t.trained + t.dropped_stale + t.failed + t.pending;
        rows.extend([
            (
                key("main turns"),
                format!(
                    "{} in {} sessions ({} with a next state; {} judged, {} unjudged; \
                     {} votes failed, {} of them cut off at max_tokens){}",
                    c.turns,
                    c.sessions_started,
                    a.turns_with_next_state,
                    c.judged,
                    c.unjudged,
                    c.votes_failed,
                    c.votes_truncated,
                    history_note(c)
                ),
            ),
            (key("samples"), samples_line(t, agent_balanced && balanced)),
            (
                key("trainer"),
                format!(
                    "{} steps, version {}; served v{} ({} switches, {} failed installs); \
                     stopped by {}",
                    t.steps,
                    t.version,
                    a.gateway.version,
                    a.gateway.switches,
                    a.gateway.failed_installs,
                    a.stopped_by
                ),
            ),
            (key("train/serve gap"), gap_line(t)),
            (
                key("records"),
                format!(
                    "{} written, {} failed, in {}; at start {} torn lines cut, {} turns a \
                     crash took before judging recorded as lost",
                    a.records.written,
                    c.records_failed,
                    a.records_dir.display(),
                    a.records.torn_lines_cut,
                    a.records.lost_by_crash
                ),
            ),
            (
                key("checkpoint"),
                a.final_checkpoint
                    .as_ref()
                    .map_or("none".into(), |p| p.display().to_string()),
            ),
        ]);
    }
    rows.push(("run dir".into(), out.display().to_string()));
    print_rows(&rows, c.last_error.as_deref());
}

/// The trainer's sample books: produced = trained + dropped stale + failed + pending.
fn samples_line(t: &TrainerStats, balanced: bool) -> String {
    format!(
        "{} produced = {} trained + {} dropped stale + {} failed + {} pending ({})",
        t.produced,
        t.trained,
        t.dropped_stale,
        t.failed,
        t.pending,
        if balanced { "balanced" } else { "NOT BALANCED" }
    )
}

/// What a summary says of the turns whose prompt rewrote the previous step's prompt and
/// response (`JobCounts::history_rewritten`); nothing when none did.
fn history_note(c: &JobCounts) -> String {
    if c.history_rewritten == 0 {
        String::new()
    } else {
        format!(
            "; {} whose prompt rewrote the history the policy saw and wrote (the chat \
             template or the client)",
            c.history_rewritten
        )
    }
}

/// A summary table: one `key  value` line per row, the job's last error after them, between
/// two rules.
fn print_rows<K: AsRef<str>>(rows: &[(K, String)], last_error: Option<&str>) {
    let w = rows
        .iter()
        .map(|(k, _)| k.as_ref().len())
        .max()
        .unwrap_or(0);
    println!("{:-<1$}", "", w + 60);
    for (k, v) in rows {
        println!("{:<w$}  {v}", k.as_ref());
    }
    if let Some(e) = last_error {
        println!("{:<w$}  {e}", "last error");
    }
    println!("{:-<1$}", "", w + 60);
}

/// Runs `spec` on the embedded node: the node starts with every role under `<out>/node`, the
/// job is submitted to its Control (which shows the counts to `clawrl status --config
/// <out>/node.toml`), then run by its kind's runner with progress bars (hidden with `--json`)
/// and its counts reported to Control; a summary follows.
fn run_embedded(
    spec: JobSpec,
    job: &Path,
    out: Option<PathBuf>,
    json: bool,
    embedded: &EmbeddedNode,
) -> anyhow::Result<()> {
    let file = job.display().to_string();
    embedded.check_judge(&spec, &file)?;
    let name = spec.display_name(&file);
    let out = run_dir(out, &name)?;
    let spec_text = std::fs::read_to_string(job).with_context(|| format!("reading {file}"))?;
    let node_file = out.join("node.toml");
    let cfg = embedded.config(&node_file, &out.join("node"))?;
    // The environment slots this process runs the job's sessions on (an `rl` job's sessions,
    // in process; a `personal` job's gateway), offered to Control so that it places the job.
    let envs = vec![match spec.kind {
        JobKind::Rl => EnvSpec {
            kind: spec.env.kind.name().into(),
            count: spec.env.parallelism,
        },
        JobKind::Personal => EnvSpec {
            kind: PERSONAL_ENV_KIND.into(),
            count: 1,
        },
    }];
    runtime()?.block_on(async move {
        let node = Node::start(
            &cfg,
            NodeOptions {
                validator: Some(Arc::new(SpecValidator)),
                envs,
            },
        )
        .await?;
        // The real port, so that `clawrl status --config <out>/node.toml` reaches this node.
        std::fs::write(
            &node_file,
            node_config_text(&node.addr().to_string(), &out.join("node"), &cfg.judge),
        )
        .with_context(|| format!("writing {}", node_file.display()))?;
        let id = match control_call(&ControlRequest::Submit {
            file: file.clone(),
            spec: spec_text,
        })
        .await?
        {
            ControlReply::Jobs(j) if !j.is_empty() => j[0].id.clone(),
            ControlReply::Jobs(_) => {
                node.shutdown().await;
                bail!("Control accepted the job but returned no record")
            }
            ControlReply::Error(e) => {
                node.shutdown().await;
                bail!("{e}")
            }
        };
        let bars = Arc::new(Bars::new(&spec, json));
        let progress = control_progress(&id, bars.clone());
        let method = spec.method.kind.name();
        let result = match spec.kind {
            JobKind::Rl => {
                if !json {
                    eprintln!(
                        "clawrl run: {id} ({name}, method {method}), records and checkpoints in {}",
                        out.display()
                    );
                }
                let options = RunOptions {
                    out: out.clone(),
                    job_id: id.clone(),
                    progress: Some(progress),
                    poll: POLL,
                };
                run_job(&spec, &file, options)
                    .await
                    .map(|r| Report::Rl(Box::new(r)))
                    .map_err(anyhow::Error::new)
            }
            JobKind::Personal => {
                let announce_id = id.clone();
                let on_listening: OnListening = Box::new(move |addr, model| {
                    // One line on stderr in every mode, so scripts and tests can find the port.
                    eprintln!(
                        "clawrl run: {announce_id} (method {method}) listening on http://{addr} \
                         model={model}"
                    );
                });
                let options = GatewayJobOptions {
                    out: out.clone(),
                    job_id: id.clone(),
                    progress: Some(progress),
                    poll: POLL,
                    on_listening: Some(on_listening),
                };
                run_gateway_job(&spec, &file, options, Box::pin(interrupted()))
                    .await
                    .map(|r| Report::Personal(Box::new(r)))
                    .map_err(anyhow::Error::new)
            }
        };
        bars.finish();
        let report = match result {
            Ok(r) => r,
            Err(e) => {
                node.shutdown().await;
                return Err(e.context(format!("running job spec {file}")));
            }
        };
        // Control keeps the final counts.
        let _ = control_call(&ControlRequest::Progress {
            id: id.clone(),
            counts: Box::new(report.counts().clone()),
        })
        .await;
        node.shutdown().await;
        let balanced = report.counts().balanced();
        if json {
            let s = Summary {
                control_id: &id,
                spec: file.clone(),
                out: &out,
                balanced,
                report: &report,
            };
            println!("{}", serde_json::to_string_pretty(&s)?);
        } else {
            match &report {
                Report::Rl(r) => print_table(r, &out, balanced),
                Report::Personal(r) => print_personal_table(r, &out, balanced),
            }
        }
        if let Some(why) = &report.counts().gave_up {
            bail!("job {id} ({file}) gave up: {why}");
        }
        Ok(())
    })
}

/// How often a running job's counts are polled.
const POLL: Duration = Duration::from_millis(200);

/// The progress report of a job on the embedded node: the bars, and Control about once a
/// second (always the final counts).
fn control_progress(id: &str, bars: Arc<Bars>) -> ProgressReport {
    let id = id.to_string();
    let last_sent = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    Arc::new(move |c: &JobCounts| {
        bars.update(c);
        let now = t0.elapsed().as_millis() as u64;
        let due = now.saturating_sub(last_sent.load(Ordering::Relaxed)) >= 1000;
        if due || c.phase == JobPhase::Finished {
            last_sent.store(now, Ordering::Relaxed);
            let req = ControlRequest::Progress {
                id: id.clone(),
                counts: Box::new(c.clone()),
            };
            tokio::spawn(async move {
                if let Err(e) = control_call(&req).await {
                    tracing::debug!("reporting progress to Control: {e}");
                }
            });
        }
    })
}

/// The summary's train/serve gap: rollout log-probs against the trainer's own before each
/// update, over every trained token that had them.
fn gap_line(t: &TrainerStats) -> String {
    match &t.logprob_gap {
        Some(g) => format!(
            "rollout vs trainer log-probs: mean |Δ| {:.4}, max |Δ| {:.4}, mean Δ {:+.4} over {} tokens",
            g.mean_abs, g.max_abs, g.mean, g.tokens
        ),
        None => "not measured (no trained sample carried rollout log-probs)".into(),
    }
}

fn print_table(r: &RunReport, out: &Path, balanced: bool) {
    let c = &r.counts;
    let t = &r.trainer;
    let rows: Vec<(&str, String)> = vec![
        ("job", format!("{} (method {})", r.job, r.method)),
        (
            "wall time",
            format!("{:.1} s, {:.2} turns/s", r.wall_s, r.turns_per_s),
        ),
        (
            "sessions",
            format!(
                "{} started, {} finished, {} failed, {} restarted, {} lost",
                c.sessions_started,
                c.sessions_finished,
                c.sessions_failed,
                c.sessions_restarted,
                c.sessions_lost
            ),
        ),
        (
            "turns",
            format!(
                "{} ({} judged, {} unjudged; {} votes failed, {} of them cut off at max_tokens){}",
                c.turns,
                c.judged,
                c.unjudged,
                c.votes_failed,
                c.votes_truncated,
                history_note(c)
            ),
        ),
        (
            "admission",
            if c.admission.max_backlog == 0 {
                "off".to_string()
            } else {
                let a = &c.admission;
                format!(
                    "backlog <= {} samples: {} of {} turns held ({:.1} s in all, {} waited out), \
                     {} session starts put off",
                    a.max_backlog,
                    a.held,
                    a.admitted,
                    a.held_ms as f64 / 1000.0,
                    a.wait_expired,
                    a.starts_deferred
                )
            },
        ),
        (
            "groups",
            match &c.groups {
                None => "none (each episode is built alone)".to_string(),
                Some(g) => format!(
                    "{} episodes each: {} started, {} built whole, {} built short at the stop, \
                     {} dropped whole ({} episodes discarded)",
                    g.size, g.started, g.built, g.short, g.dropped, g.episodes_discarded
                ),
            },
        ),
        ("samples", samples_line(t, balanced)),
        (
            "trainer",
            format!(
                "{} steps, version {}{}",
                t.steps,
                t.version,
                t.resumed_from
                    .map(|v| format!(" (resumed from {v})"))
                    .unwrap_or_default()
            ),
        ),
        ("train/serve gap", gap_line(t)),
        (
            "replicas",
            r.replicas
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    format!(
                        "#{i}: v{} ({} requests, {} switches)",
                        s.version.map_or("-".into(), |v| v.to_string()),
                        s.requests,
                        s.switches
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        ),
        (
            "records",
            format!(
                "{} written ({} waits on a full queue, {} failed) in {}",
                r.records.written,
                r.records.waited_full,
                c.records_failed,
                r.records_dir.display()
            ),
        ),
        (
            "checkpoint",
            r.final_checkpoint
                .as_ref()
                .map_or("none".into(), |p| p.display().to_string()),
        ),
        ("run dir", out.display().to_string()),
    ];
    print_rows(&rows, c.last_error.as_deref());
}
