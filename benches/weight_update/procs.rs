//! The weight-update bench with every replica in its own OS process (`WU_MODE=procs` or `both`).
//!
//! The bench process is a real cluster node (`bench`, mutual TLS from `clawrl cluster init`) that
//! runs the job's `Trainer` publishing on its bulk plane. It is also the cluster's Control, and
//! each measured configuration is a job submitted to it, placed on `bench` as its home: rollout
//! hosts take versions only from a job's home as Control records it. Each replica is a child process
//! `clawrl node --config FILE` with the `rollout` role, joined to the bench node, running the
//! `RolloutHost` a job's rollout nodes run. Per update: the learner steps, the trainer publishes
//! and the bench offers the announce to every host with `RolloutRequest::Serve` (what
//! `RolloutPool` sends, without waiting for its 250 ms tick); each host fetches the blob from the
//! bench node over QUIC (size and blake3 checked), loads it beside the serving version and
//! switches. The bench asks each host again every [`POLL`] (another `Serve` of the same version,
//! which the host ignores as not newer) until its stats report the new version; latency = the
//! reply that showed the last host serving − the step's end. So a figure is late by at most one
//! poll interval plus one request/reply round trip. Every process shares the machine's cores.

#[path = "../../tests/cluster/util.rs"]
mod cluster_util;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clawrl::model::model_to_safetensors;
use clawrl::model::EngineOptions;
use clawrl::pipeline::distributed::{AdapterServing, RolloutReply, RolloutRequest};
use clawrl::pipeline::learner::PolicyLearner;
use clawrl::serve::{publish_version, VersionWeights};
use clawrl::train::learner::VersionedWeights;
use clawrl_actors::bulk::BulkConfig;
use clawrl_actors::config::NodeConfig;
use clawrl_actors::control::{ControlReply, ControlRequest, JobNeeds, JobValidator};
use clawrl_actors::loops::{
    PolicyReplica, Subscriber, Trainer, TrainerArgs, TrainerConfig, TrainerEvent, TrainerMsg,
    WeightAnnounce,
};
use clawrl_actors::node::{Node, NodeOptions};
use clawrl_actors::rpc;
use cluster_util::NodeProc;
use ractor::{Actor, ActorCell, ActorId};

use super::{learner, loopback, samples, Policy, Row};

/// How often the bench asks each host which version it serves.
pub const POLL: Duration = Duration::from_millis(5);
/// Engine settings of the served policy (as the in-process bench).
const MAX_BATCH: usize = 1;
const MAX_CONTEXT: usize = 64;
/// The most one update (or a host joining) may take before the bench gives up.
const LIMIT: Duration = Duration::from_secs(120);

/// The bench's node and the certificates of the child nodes.
pub struct Cluster {
    dir: tempfile::TempDir,
    certs: PathBuf,
    port: u16,
    node: Node,
}

/// The child node names of one configuration.
fn child_names(shape: &str, replicas: usize) -> Vec<String> {
    (0..replicas)
        .map(|r| format!("{shape}-{replicas}-{r}"))
        .collect()
}

fn rollout_hosts() -> Vec<ActorCell> {
    ractor::pg::get_members(&clawrl_actors::groups::ROLLOUT.to_string())
}

impl Cluster {
    /// Certificates for the bench node and every child of `configs`, and the bench node.
    pub async fn start(configs: &[(String, usize)]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let mut names = vec!["bench".to_string()];
        for (shape, n) in configs {
            names.extend(child_names(shape, *n));
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let certs = cluster_util::init_certs(dir.path(), &refs);
        let port = cluster_util::free_port();
        let file = cluster_util::write_config(
            dir.path(),
            "bench",
            port,
            &[],
            &["control", "trainer"],
            Some(&certs),
        );
        let config = NodeConfig::load(&file).expect("the bench node's config");
        let options = NodeOptions {
            validator: Some(Arc::new(BenchJobs)),
            ..NodeOptions::default()
        };
        let node = Node::start(&config, options)
            .await
            .expect("the bench node starts");
        Cluster {
            dir,
            certs,
            port,
            node,
        }
    }

    /// Stops the bench node.
    pub async fn shutdown(self) {
        self.node.shutdown().await;
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Control's view of a bench job: a trainer node and no environment workers (the bench feeds
/// the trainer itself).
struct BenchJobs;

impl JobValidator for BenchJobs {
    fn validate(&self, _file: &str, _text: &str) -> Result<JobNeeds, String> {
        Ok(JobNeeds {
            name: "weight-update bench".into(),
            env_kind: "bench".into(),
            env_parallelism: 0,
        })
    }
}

/// Submits a bench job to the bench node's Control; returns its id once Control has placed it
/// on `bench`.
async fn submit_job(shape: &str) -> String {
    let control = ractor::pg::get_members(&clawrl_actors::groups::CONTROL.to_string())
        .into_iter()
        .next()
        .expect("the bench node runs Control");
    let submit = ControlRequest::Submit {
        file: format!("{shape}.toml"),
        spec: String::new(),
    };
    let reply: ControlReply = rpc::call(&control, &submit, Duration::from_secs(10))
        .await
        .expect("Control answers");
    let ControlReply::Jobs(jobs) = reply else {
        panic!("Control refused the bench job: {reply:?}");
    };
    let job = jobs.into_iter().next().expect("the submitted job");
    assert_eq!(job.placement.trainer.as_deref(), Some("bench"), "{job:?}");
    job.id
}

/// Children killed on drop (also when the bench panics).
struct Children(Vec<NodeProc>);

impl Children {
    fn logs(&mut self) -> String {
        self.0
            .iter_mut()
            .map(|p| {
                let alive = p.alive();
                format!("--- {} (alive: {alive})\n{}", p.log.display(), p.log_text())
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for p in &mut self.0 {
            p.kill();
        }
    }
}

/// Offers `req` to `host` every [`POLL`] until it reports serving `version` or newer; returns
/// when the reply saying so arrived.
async fn serve_until(
    host: ActorCell,
    req: RolloutRequest,
    version: u64,
) -> Result<Instant, String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let last = match rpc::call::<_, RolloutReply>(&host, &req, Duration::from_secs(10)).await {
            Ok(RolloutReply::Stats(s)) => {
                if s.version.is_some_and(|v| v >= version) {
                    return Ok(Instant::now());
                }
                format!(
                    "serving {:?}, loading {:?}, last error {:?}",
                    s.version, s.loading, s.last_update_error
                )
            }
            Ok(RolloutReply::Refused(e)) => return Err(format!("refused: {e}")),
            Ok(other) => format!("{other:?}"),
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(format!(
                "{} did not serve version {version} within {LIMIT:?}: {last}",
                rpc::actor_label(&host)
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Offers `announce` to every host; the instant the last one was seen serving it.
async fn serve_all(hosts: &[ActorCell], req: RolloutRequest, version: u64) -> Instant {
    let mut set = tokio::task::JoinSet::new();
    for h in hosts {
        set.spawn(serve_until(h.clone(), req.clone(), version));
    }
    let mut last: Option<Instant> = None;
    while let Some(r) = set.join_next().await {
        let at = r.unwrap().unwrap_or_else(|e| panic!("update failed: {e}"));
        last = Some(last.map_or(at, |l| l.max(at)));
    }
    last.expect("at least one host")
}

/// A version published by the trainer: its announce, its step's end, its bytes.
type Published = (WeightAnnounce, Option<Instant>, Bytes);
/// What the trainer's subscriber passes on: a publication, or why a step failed.
type Heard = Result<Published, String>;

/// The next publication of `want` (earlier ones are skipped).
async fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Heard>, want: u64) -> Published {
    loop {
        let p = tokio::time::timeout(LIMIT, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("the trainer did not publish version {want} in {LIMIT:?}"))
            .expect("the trainer is running")
            .unwrap_or_else(|e| panic!("a trainer step failed: {e}"));
        if p.0.version == want {
            return p;
        }
    }
}

/// One configuration: `replicas` child processes, `rounds` updates of `shape`.
pub async fn measure(cluster: &Cluster, shape: &str, replicas: usize, rounds: u32) -> Row {
    // Hosts of earlier configurations may linger in the group until their connection drops.
    let before: HashSet<ActorId> = rollout_hosts().iter().map(|c| c.get_id()).collect();
    let mut children = Children(Vec::new());
    for name in child_names(shape, replicas) {
        let file = cluster_util::write_config(
            cluster.path(),
            &name,
            cluster_util::free_port(),
            &[cluster.port],
            &["rollout"],
            Some(&cluster.certs),
        );
        children.0.push(NodeProc::start("node", &file, &[]));
    }
    let joined = Instant::now();
    let hosts: Vec<ActorCell> = loop {
        let new: Vec<ActorCell> = rollout_hosts()
            .into_iter()
            .filter(|c| !before.contains(&c.get_id()))
            .collect();
        if new.len() == replicas {
            break new;
        }
        if joined.elapsed() > Duration::from_secs(60) {
            panic!(
                "{} of {replicas} rollout hosts joined in 60 s\n{}",
                new.len(),
                children.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    eprintln!(
        "{shape} x{replicas}: {replicas} rollout processes joined in {:.1} s",
        joined.elapsed().as_secs_f64()
    );
    let policy_learner = PolicyLearner::new(learner(shape), 0);
    let versions = super::version_weights(&policy_learner);
    let model_config = policy_learner.model_config().clone();
    let vocab = model_config.vocab_size as u32;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Heard>();
    let step_ms: Arc<Mutex<HashMap<u64, (f64, f64)>>> = Arc::default();
    let subscriber: Subscriber = {
        let step_ms = step_ms.clone();
        Arc::new(move |event: &TrainerEvent| {
            match event {
                TrainerEvent::Published {
                    announce,
                    bytes,
                    step_finished,
                } => {
                    let _ = tx.send(Ok((announce.clone(), *step_finished, bytes.clone())));
                }
                TrainerEvent::Step(s) => {
                    step_ms
                        .lock()
                        .unwrap()
                        .insert(s.version, (s.export_ms, s.publish_ms));
                }
                TrainerEvent::StepFailed { error, .. } => {
                    let _ = tx.send(Err(error.clone()));
                }
                _ => {}
            }
            true
        })
    };
    // The job `samples` names, placed on `bench`; each configuration has its own host processes.
    let job = submit_job(shape).await;
    let (trainer, _) = Actor::spawn(
        None,
        Trainer::<PolicyLearner>::new(),
        TrainerArgs {
            config: TrainerConfig {
                batch_size: 2,
                max_lag: 1000,
                ..TrainerConfig::new(job.clone())
            },
            learner: policy_learner,
            publisher: Arc::new(cluster.node.bulk().clone()),
            subscribers: vec![subscriber],
        },
    )
    .await
    .unwrap();
    // A learner with adapters: its base is published once, and hosts fetch it on the first
    // offer (not part of any timed update).
    let adapter = match &versions {
        VersionWeights::Full => None,
        VersionWeights::Adapter { base, config } => {
            let bytes = model_to_safetensors(base, &model_config).unwrap();
            let weights = VersionedWeights { version: 0, bytes };
            let base = publish_version(cluster.node.bulk(), &weights).unwrap();
            Some(AdapterServing {
                base,
                lora: config.clone(),
            })
        }
    };
    let serve = |announce: WeightAnnounce| RolloutRequest::Serve {
        job: job.clone(),
        model_config: model_config.to_json(),
        max_batch: MAX_BATCH,
        max_context: MAX_CONTEXT,
        prefix_cache_bytes: 0,
        announce,
        adapter: adapter.clone(),
    };
    // Version 0 (the initial weights): every host starts the job's worker and loads it.
    let (v0, _, _) = next(&mut rx, 0).await;
    serve_all(&hosts, serve(v0), 0).await;
    eprintln!("{shape} x{replicas}: every host serves version 0");

    let mut row = Row {
        shape: shape.to_string(),
        mode: "procs",
        replicas,
        blob_mib: 0.0,
        latency_ms: Vec::new(),
        export_ms: Vec::new(),
        publish_ms: Vec::new(),
        load_ref_ms: 0.0,
        fetch_ref_ms: 0.0,
    };
    let mut newest = None;
    for round in 1..=rounds {
        let version = round as u64;
        trainer
            .cast(TrainerMsg::Samples(samples(
                &job,
                vocab,
                version - 1,
                round,
            )))
            .unwrap();
        let (announce, finished, bytes) = next(&mut rx, version).await;
        let finished = finished.expect("a stepped version has its step's end");
        let all = serve_all(&hosts, serve(announce.clone()), version).await;
        row.latency_ms
            .push((all.duration_since(finished)).as_secs_f64() * 1e3);
        let (export, publish) = step_ms.lock().unwrap()[&version];
        row.export_ms.push(export);
        row.publish_ms.push(publish);
        newest = Some((announce, bytes));
    }
    trainer.stop(None);
    let alive = children.0.iter_mut().all(|p| p.alive());
    assert!(alive, "a rollout node died\n{}", children.logs());
    drop(children);

    // References in this run: one load of the newest bytes alone (in this process, nothing else
    // running), and one plain bulk-plane fetch of them between two in-process loopback nodes.
    let (announce, bytes) = newest.expect("at least one round");
    row.blob_mib = bytes.len() as f64 / (1 << 20) as f64;
    let policy = Arc::new(Policy::with_weights(
        model_config.clone(),
        versions,
        None,
        EngineOptions {
            max_batch: MAX_BATCH,
            max_context: MAX_CONTEXT,
            prefix_cache_bytes: 0,
        },
        Default::default(),
    ));
    let b = bytes.clone();
    let t = Instant::now();
    let loaded = tokio::task::spawn_blocking(move || policy.load(announce.version, &b).unwrap())
        .await
        .unwrap();
    row.load_ref_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(loaded);
    let ca = loopback::TestCa::new();
    let book = loopback::Book::default();
    let source = loopback::node(&ca, &book, "source", BulkConfig::new("unset"));
    let probe = loopback::node(&ca, &book, "probe", BulkConfig::new("unset"));
    let blob = source.plane.publish(bytes.clone()).unwrap();
    let t = Instant::now();
    let got = probe.plane.fetch(blob, "source").await.unwrap();
    row.fetch_ref_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(got.len(), bytes.len());
    for n in [&source, &probe] {
        n.endpoint.close(0u32.into(), b"done");
    }
    row
}
