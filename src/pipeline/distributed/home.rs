//! The job home: the job runner of a `trainer` node runs each job Control placed on it to its
//! stop condition (and resumes it after a restart), judging its turns itself or on the judge
//! hosts ([`Judging`]), and the node services a `clawrl node` starts for its roles.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clawrl_actors::bulk::{BlobId, BulkPlane};
use clawrl_actors::config::{NodeConfig, Role};
use clawrl_actors::control::{ControlReply, ControlRequest, JobRecord, JobState as PlacedState};
use clawrl_actors::loops::{
    JobCounts, JobMsg, JobPhase, ProgressReport, RelayPublisher, TrainSample, TurnJudge,
    TurnSource, WeightPublisher,
};
use clawrl_actors::member::EnvSpec;
use clawrl_actors::node::{Node, NodeConnector};
use futures::future::BoxFuture;
use ractor::{Actor, ActorRef};

use super::env_host::{EnvHost, EnvHostArgs};
use super::judge_host::{JudgeHost, JudgeHostArgs};
use super::remote_env::RemoteEnvironment;
use super::remote_judge::RemoteJudge;
use super::remote_policy::{RemoteChatPolicy, RolloutPool};
use super::rollout_host::{RolloutHost, RolloutHostArgs};
use super::wire::AdapterServing;
use super::{control_call, lock, RUNNER_POLL};
use crate::env::EnvKind;
use crate::job::{JobKind, JobSpec};
use crate::judge::JudgeAccess;
use crate::model::model_to_safetensors;
use crate::pipeline::parts::{JobParts, LoadedPolicy};
use crate::pipeline::{sampling_params, RunError};
use crate::serve::{publish_pinned, VersionWeights};
use crate::train::learner::VersionedWeights;
use crate::CpuAutodiff;

/// Runs one job placed on this node to its stop condition (see the module docs). Returns its
/// final counts; `stop` set from outside (a cancel) makes a waiting job give up and a running
/// one drain.
pub async fn run_placed_job(
    node: &Node,
    record: &JobRecord,
    out: PathBuf,
    progress: ProgressReport,
    stop: Arc<AtomicBool>,
    supervisor: Arc<Mutex<Option<ActorRef<JobMsg<TrainSample>>>>>,
    judging: &Judging,
) -> Result<JobCounts, RunError> {
    let job_id = record.id.clone();
    let file = record.file.clone();
    let mut spec = JobSpec::parse(&record.spec, &file)?;
    // A limit set through Control after submission replaces the spec's.
    if let Some(m) = record.max_steps {
        spec.stop.max_steps = Some(m);
    }
    // A home that judges its turns itself must grant the spec's judge endpoint and key
    // variable in its `[judge]`, or the job is refused here, before any actor starts and
    // before its judge sends anything; the judge hosts check their own grants.
    if let Judging::Here(access) = judging {
        crate::judge::access::check(&spec.judge, access)?;
    }
    if spec.kind != JobKind::Rl {
        return Err(RunError::Actor {
            what: "job runner",
            message: "only `rl` jobs run across nodes; a `personal` job runs with `clawrl run`"
                .into(),
        });
    }
    let waiting = |what: &str| {
        let counts = JobCounts {
            last_error: Some(format!("waiting for {what}")),
            ..Default::default()
        };
        progress(&counts);
    };

    // The environment, on the hosts Control placed.
    let (kind, task_count, max_steps) = loop {
        if stop.load(Ordering::Relaxed) {
            return Err(RunError::Actor {
                what: "job",
                message: "cancelled before it started".into(),
            });
        }
        match RemoteEnvironment::describe(&job_id, &file, &spec, &record.spec).await {
            Ok(Some(d)) => break d,
            Ok(None) => {
                waiting(&format!("an environment host of kind `{}`", spec.env.kind));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                return Err(RunError::Env {
                    kind: spec.env.kind,
                    tasks: spec.resolve(&spec.env.tasks),
                    message: e,
                })
            }
        }
    };
    let env = Arc::new(RemoteEnvironment {
        job: job_id.clone(),
        file: file.clone(),
        spec: record.spec.clone(),
        kind,
        task_count,
        max_steps,
        timeout: Duration::from_secs_f64(spec.env.episode_timeout_s.unwrap_or(600.0)),
        open: Default::default(),
        next: AtomicUsize::new(0),
    });

    // The judge: this node's own, or the judge hosts' once one has built the job's judge.
    let remote_judge: Option<Arc<dyn TurnJudge>> = match judging {
        Judging::Here(_) => None,
        Judging::OnJudgeNodes => {
            let judge = RemoteJudge {
                job: job_id.clone(),
                file: file.clone(),
                spec: record.spec.clone(),
                timeout: Duration::from_secs_f64(spec.judge.timeout_s) + JUDGE_CALL_MARGIN,
                next: AtomicUsize::new(0),
            };
            loop {
                if stop.load(Ordering::Relaxed) {
                    return Err(RunError::Actor {
                        what: "job",
                        message: "cancelled before it started".into(),
                    });
                }
                match judge.prepare().await {
                    Ok(true) => break,
                    Ok(false) => {
                        waiting("a judge node (a node with the `judge` role)");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(RunError::Judge(e)),
                }
            }
            Some(Arc::new(judge))
        }
    };

    let policy = LoadedPolicy::<CpuAutodiff>::load(&spec, Default::default())?;

    // Generation on the rollout hosts, the OPD teacher here, the trainer publishing on this
    // node's bulk plane.
    // The trainer pushes each version through the bulk plane's relay groups to the rollout
    // hosts' nodes before announcing it (its uplink sends about one copy whatever their
    // number); a node the relay misses fetches from the trainer's node when offered.
    let relay = Arc::new(
        RelayPublisher::new(node.bulk().clone(), Vec::new()).map_err(|e| RunError::Actor {
            what: "weight publisher",
            message: e.to_string(),
        })?,
    );
    // A job that trains an adapter publishes its frozen base once, pinned (versions and other
    // jobs' blobs never evict it); hosts fetch it when they start serving the job, then install
    // each version's adapter over it.
    let adapter = match policy.version_weights() {
        VersionWeights::Full => None,
        VersionWeights::Adapter { base, config } => {
            let weights =
                model_to_safetensors(&base, &policy.model_config).map_err(|e| RunError::Actor {
                    what: "the adapter's base",
                    message: e.to_string(),
                })?;
            let base = publish_pinned(
                node.bulk(),
                &VersionedWeights {
                    version: 0,
                    bytes: weights,
                },
            )
            .map_err(|e| RunError::Actor {
                what: "publishing the adapter's base",
                message: e.to_string(),
            })?;
            Some(AdapterServing { base, lora: config })
        }
    };
    // The base blob leaves this node's store when the job ends, however it ends.
    let _base_blob = adapter.as_ref().map(|a| PublishedBlob {
        plane: node.bulk().clone(),
        blob: a.base.blob,
    });
    let pool = RolloutPool::start(
        &job_id,
        &policy.model_config,
        policy.engine,
        adapter,
        Some(relay.clone()),
    );
    let chat = RemoteChatPolicy {
        job: job_id.clone(),
        template: policy.template.clone(),
        tokenizer: policy.tokenizer.clone(),
        params: sampling_params(&spec, policy.stop_ids.clone()),
        max_context: policy.engine.max_context,
        next: AtomicUsize::new(0),
        next_seed: AtomicU64::new(spec.seed),
    };
    let publisher: Arc<dyn WeightPublisher> = relay;
    let subscribers = vec![pool.subscriber()];
    let parts =
        match JobParts::start(&spec, &file, &job_id, &out, policy, publisher, subscribers).await {
            Ok(p) => p,
            Err(e) => {
                pool.release().await;
                return Err(e);
            }
        };
    waiting("a rollout worker serving the job's first version");
    if !pool.wait_serving(&stop).await {
        parts.abort();
        pool.release().await;
        return Err(RunError::Actor {
            what: "job",
            message: "cancelled before it started".into(),
        });
    }
    let source = TurnSource::Sessions {
        env,
        policy: Arc::new(chat),
    };
    let (job, done) = match parts
        .spawn_job_judged_by(
            source,
            Some(progress.clone()),
            Duration::from_millis(200),
            remote_judge,
        )
        .await
    {
        Ok(j) => j,
        Err(e) => {
            parts.abort();
            pool.release().await;
            return Err(e);
        }
    };
    *lock(&supervisor) = Some(job.clone());
    if stop.load(Ordering::Relaxed) {
        let _ = job.cast(JobMsg::Stop);
    }

    let counts = done.await.map_err(|_| RunError::Lost)?;
    let finished = parts.finish().await;
    pool.release().await;
    finished?;
    Ok(counts)
}

/// Where a job home's turns are judged.
#[derive(Clone)]
pub enum Judging {
    /// On this node (it has the `judge` role), under these grants.
    Here(JudgeAccess),
    /// On the cluster's judge hosts.
    OnJudgeNodes,
}

impl Judging {
    /// Where `config`'s node judges the turns of the jobs it is home to.
    pub fn of(config: &NodeConfig) -> Judging {
        if config.has_role(Role::Judge) {
            Judging::Here(config.judge.clone())
        } else {
            Judging::OnJudgeNodes
        }
    }
}

/// How much longer than the judge's own time limit a call to a judge host may take (the
/// voter's limit cuts the turn first; this only ends calls to a host that went silent).
const JUDGE_CALL_MARGIN: Duration = Duration::from_secs(10);

/// A blob this job published on its node's bulk plane, removed from the store when dropped.
struct PublishedBlob {
    plane: BulkPlane<NodeConnector>,
    blob: BlobId,
}

impl Drop for PublishedBlob {
    fn drop(&mut self) {
        self.plane.remove(&self.blob);
    }
}

/// Sends `counts` to Control as job `id`'s progress, retrying a while (the final counts must
/// arrive, or Control would run the job again).
async fn report(id: &str, counts: &JobCounts, attempts: u32) -> bool {
    for _ in 0..attempts {
        let req = ControlRequest::Progress {
            id: id.to_string(),
            counts: Box::new(counts.clone()),
        };
        match control_call(&req).await {
            Ok(ControlReply::Jobs(_)) => return true,
            Ok(ControlReply::Error(e)) => {
                tracing::warn!("reporting {id} to Control: {e}");
                return false;
            }
            Err(e) => tracing::debug!("reporting {id} to Control: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// A job this node runs.
struct Running {
    stop: Arc<AtomicBool>,
    supervisor: Arc<Mutex<Option<ActorRef<JobMsg<TrainSample>>>>>,
    task: tokio::task::JoinHandle<()>,
    /// The step limit Control recorded that the job runs with now.
    max_steps: Option<u64>,
}

impl Running {
    fn stop(&self) {
        if !self.stop.swap(true, Ordering::Relaxed) {
            if let Some(j) = lock(&self.supervisor).as_ref() {
                let _ = j.cast(JobMsg::Stop);
            }
        }
    }

    /// Hands a step limit Control recorded after the launch to the job's supervisor. Before
    /// the supervisor exists the job is still being built from the record it was launched
    /// with, so the limit is left unapplied and tried again on the next poll.
    fn follow_max_steps(&mut self, id: &str, max_steps: Option<u64>) {
        let Some(m) = max_steps else { return };
        if self.max_steps == Some(m) {
            return;
        }
        if let Some(j) = lock(&self.supervisor).as_ref() {
            match j.cast(JobMsg::SetMaxSteps(m)) {
                Ok(()) => self.max_steps = Some(m),
                Err(e) => tracing::warn!(job = %id, "changing the step limit: {e}"),
            }
        }
    }
}

/// The job runner of a trainer node (see the module docs).
pub struct JobRunner;

impl JobRunner {
    /// Starts the runner's loop on `node`; run directories go under `data_dir/jobs`.
    pub fn start(node: Node, data_dir: PathBuf, judging: Judging) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut running: HashMap<String, Running> = HashMap::new();
            loop {
                tokio::time::sleep(RUNNER_POLL).await;
                running.retain(|_, r| !r.task.is_finished());
                let jobs = match control_call(&ControlRequest::List).await {
                    Ok(ControlReply::Jobs(j)) => j,
                    _ => continue,
                };
                for j in jobs {
                    let mine = j.placement.trainer.as_deref() == Some(node.name());
                    if let Some(r) = running.get_mut(&j.id) {
                        if j.state == PlacedState::Cancelled || !mine {
                            r.stop();
                        } else {
                            r.follow_max_steps(&j.id, j.max_steps);
                        }
                        continue;
                    }
                    if !mine || !j.is_active() || j.state == PlacedState::Waiting {
                        continue;
                    }
                    running.insert(j.id.clone(), Self::launch(&node, &data_dir, &judging, j));
                }
            }
        })
    }

    fn launch(
        node: &Node,
        data_dir: &std::path::Path,
        judging: &Judging,
        record: JobRecord,
    ) -> Running {
        let max_steps = record.max_steps;
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = Arc::new(Mutex::new(None));
        let out = data_dir.join("jobs").join(&record.id);
        let (node, s, sup) = (node.clone(), stop.clone(), supervisor.clone());
        let judging = judging.clone();
        tracing::info!(job = %record.id, "running job {} here ({})", record.id, out.display());
        let task = tokio::spawn(async move {
            let id = record.id.clone();
            // Progress goes to Control in order, at most about once a second.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<JobCounts>();
            let reporter_id = id.clone();
            let reporter = tokio::spawn(async move {
                while let Some(mut c) = rx.recv().await {
                    while let Ok(newer) = rx.try_recv() {
                        c = newer;
                    }
                    report(&reporter_id, &c, 1).await;
                    tokio::time::sleep(Duration::from_millis(1000)).await;
                }
            });
            let progress: ProgressReport = Arc::new(move |c: &JobCounts| {
                if c.phase != JobPhase::Finished {
                    let _ = tx.send(c.clone());
                }
            });
            let result = run_placed_job(&node, &record, out, progress, s, sup, &judging).await;
            reporter.abort();
            let counts = match result {
                Ok(c) => {
                    tracing::info!(
                        job = %id,
                        "finished: {} turns, {} steps, version {}",
                        c.turns,
                        c.trainer.steps,
                        c.trainer.version
                    );
                    c
                }
                Err(e) => {
                    let why = format!("the job could not run on node {}: {e}", node.name());
                    tracing::error!(job = %id, "{why}");
                    JobCounts {
                        phase: JobPhase::Finished,
                        last_error: Some(why.clone()),
                        gave_up: Some(why),
                        ..Default::default()
                    }
                }
            };
            if !report(&id, &counts, 120).await {
                tracing::error!(job = %id, "Control never took the final counts");
            }
        });
        Running {
            stop,
            supervisor,
            task,
            max_steps,
        }
    }
}

/// Why a node's job services could not start.
#[derive(Debug, thiserror::Error)]
#[error("starting the {what}: {message}")]
pub struct ServicesError {
    what: String,
    message: String,
}

/// Starts what a `clawrl node` runs for jobs, by its roles: a [`RolloutHost`] (`rollout`), an
/// [`EnvHost`] per environment kind of `envs`, the [`JobRunner`] (`trainer`) and a
/// [`JudgeHost`] (`judge`).
pub fn start_node_services<'a>(
    node: &'a Node,
    config: &'a NodeConfig,
    envs: &'a [EnvSpec],
) -> BoxFuture<'a, Result<(), ServicesError>> {
    // Boxed here, so the future's body is compiled once, in this crate: a caller in another
    // crate that awaited the `async fn` itself would compile the whole body again.
    Box::pin(start_node_services_body(node, config, envs))
}

async fn start_node_services_body(
    node: &Node,
    config: &NodeConfig,
    envs: &[EnvSpec],
) -> Result<(), ServicesError> {
    let err = |what: String| {
        move |e: ractor::SpawnErr| ServicesError {
            what,
            message: e.to_string(),
        }
    };
    if config.has_role(Role::Rollout) {
        let what = format!("{}/rollout", node.name());
        Actor::spawn(
            Some(what.clone()),
            RolloutHost,
            RolloutHostArgs {
                source: Arc::new(node.bulk().clone()),
                node: node.name().to_string(),
            },
        )
        .await
        .map_err(err(what))?;
    }
    // Every `--env` kind is one this build has, or the node does not start.
    let mut kinds = Vec::new();
    for e in envs {
        let kind: EnvKind =
            e.kind
                .parse()
                .map_err(|e: crate::env::UnknownEnvKind| ServicesError {
                    what: format!("{}/envhost", node.name()),
                    message: format!("--env: {e}"),
                })?;
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    for kind in kinds {
        let what = format!("{}/envhost.{kind}", node.name());
        Actor::spawn(
            Some(what.clone()),
            EnvHost,
            EnvHostArgs {
                kind,
                work_root: config.data_dir.join("env"),
                node: node.name().to_string(),
            },
        )
        .await
        .map_err(err(what))?;
    }
    if config.has_role(Role::Trainer) {
        JobRunner::start(node.clone(), config.data_dir.clone(), Judging::of(config));
    }
    if config.has_role(Role::Judge) {
        let what = format!("{}/judge", node.name());
        Actor::spawn(
            Some(what.clone()),
            JudgeHost,
            JudgeHostArgs {
                access: config.judge.clone(),
                node: node.name().to_string(),
            },
        )
        .await
        .map_err(err(what))?;
    }
    Ok(())
}
