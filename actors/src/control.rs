//! The cluster's `Control` actor: accepts, validates, stores, places, cancels and reports jobs.
//!
//! There is one per cluster, on the node with the `control` role, in group
//! [`crate::groups::CONTROL`]. Job specs are validated by a [`JobValidator`] the binary supplies
//! (the spec format belongs to the LLM/RL crate). Placement ([`place`]) is a pure function: a
//! trainer node from the nodes with the `trainer` role, and environment slots of the job's kind
//! from the slots nodes offer in their descriptions (`--env KIND:N`: `<node>/env.<KIND>.<i>`),
//! each slot serving one job. Control watches the process groups and re-places running jobs
//! when nodes join or leave, so capacity attached at runtime is used without a restart. Jobs
//! are kept in `data_dir/control/jobs.json`. Running the training pipeline behind a job is not
//! part of this crate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use serde::{Deserialize, Serialize};

use crate::authority::{self, Need, Places};
use crate::config::Role;
use crate::member::{MemberInfo, MemberReply, MemberRequest};
use crate::rpc::{self, Caller, Rpc};

/// What a validated job needs from the cluster.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JobNeeds {
    /// The job's kind or name, for display.
    pub name: String,
    /// Environment kind (slots of that kind are placed).
    pub env_kind: String,
    /// How many environment slots (sessions at once) the job wants.
    pub env_parallelism: u32,
}

/// Validates a job spec (`file` is for messages); returns what the job needs or an error that
/// names the offending key and the file.
pub trait JobValidator: Send + Sync + 'static {
    /// Validates `text`, read from `file`.
    fn validate(&self, file: &str, text: &str) -> Result<JobNeeds, String>;
}

/// A job's state.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum JobState {
    /// No trainer node or no environment slot yet.
    Waiting,
    /// Placed, with fewer environment slots than asked for.
    Partial,
    /// Placed with every environment slot asked for.
    Placed,
    /// Cancelled by a user.
    Cancelled,
}

/// Where a job runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Placement {
    /// The node that hosts the job's trainer.
    pub trainer: Option<String>,
    /// The environment slots (`<node>/env.<kind>.<i>`) serving the job (`env_workers` in
    /// stores written before slots had that name).
    #[serde(alias = "env_workers")]
    pub env_slots: Vec<String>,
}

/// A stored job.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JobRecord {
    /// The job id (`job-N`).
    pub id: String,
    /// The file the spec came from.
    pub file: String,
    /// The spec text as submitted.
    pub spec: String,
    /// What it needs.
    pub needs: JobNeeds,
    /// Its state.
    pub state: JobState,
    /// Its placement.
    pub placement: Placement,
    /// Submission time, seconds since the Unix epoch.
    pub submitted_unix: u64,
    /// The running job's counts, as its supervisor last reported them.
    #[serde(default)]
    pub progress: Option<crate::loops::job::JobCounts>,
    /// A trainer-step limit set after submission ([`ControlRequest::SetMaxSteps`]); it
    /// replaces the spec's `stop.max_steps` wherever the job runs, restarts included.
    #[serde(default)]
    pub max_steps: Option<u64>,
}

/// A request to Control.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ControlRequest {
    /// Validate, store and place a job spec read from `file`.
    Submit {
        /// The spec's file name (for messages).
        file: String,
        /// The spec text.
        spec: String,
    },
    /// One job, or all jobs when `None`.
    Status(Option<String>),
    /// Cancel a job.
    Cancel(String),
    /// Stop a job once its trainer has made `max_steps` optimizer steps, replacing the
    /// spec's `stop.max_steps` (raised or lowered; the job's other stop bounds still hold).
    SetMaxSteps {
        /// The job id.
        id: String,
        /// The new limit (at least 1).
        max_steps: u64,
    },
    /// All jobs.
    List,
    /// A job's supervisor reports its counts (shown by `status`); accepted only from the
    /// job's trainer node.
    Progress {
        /// The job id.
        id: String,
        /// The counts.
        counts: Box<crate::loops::job::JobCounts>,
    },
}

/// Control's reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ControlReply {
    /// Jobs (one for submit, status of one job, or cancel).
    Jobs(Vec<JobRecord>),
    /// The request failed.
    Error(String),
}

/// The resources placement can draw from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pool {
    /// Nodes with the trainer role.
    pub trainer_nodes: BTreeSet<String>,
    /// Environment slots of live nodes, by kind.
    pub env: BTreeMap<String, BTreeSet<String>>,
}

/// Places (or re-places) one job: keeps what is still alive, fills up from free resources.
/// `busy` are slots already serving other jobs; `load` counts jobs per trainer node.
pub fn place(
    needs: &JobNeeds,
    current: &Placement,
    pool: &Pool,
    busy: &BTreeSet<String>,
    load: &BTreeMap<String, usize>,
) -> (Placement, JobState) {
    let trainer = current
        .trainer
        .clone()
        .filter(|t| pool.trainer_nodes.contains(t))
        .or_else(|| {
            pool.trainer_nodes
                .iter()
                .min_by_key(|n| (load.get(*n).copied().unwrap_or(0), (*n).clone()))
                .cloned()
        });
    let live = pool.env.get(&needs.env_kind);
    let mut env_slots: Vec<String> = current
        .env_slots
        .iter()
        .filter(|w| live.is_some_and(|l| l.contains(*w)))
        .cloned()
        .collect();
    let want = needs.env_parallelism as usize;
    if let Some(live) = live {
        for w in live {
            if env_slots.len() >= want {
                break;
            }
            if !busy.contains(w) && !env_slots.contains(w) {
                env_slots.push(w.clone());
            }
        }
    }
    env_slots.truncate(want);
    let state = match (&trainer, env_slots.len()) {
        (None, _) | (_, 0) => JobState::Waiting,
        (Some(_), n) if n < want => JobState::Partial,
        _ => JobState::Placed,
    };
    (Placement { trainer, env_slots }, state)
}

/// Messages of the Control actor: cluster requests, and an internal re-placement tick.
pub struct Control;

/// Arguments of [`Control`].
pub struct ControlArgs {
    /// The spec validator.
    pub validator: Arc<dyn JobValidator>,
    /// Where jobs are stored (`jobs.json` inside).
    pub dir: PathBuf,
    /// The actor's label (for logs).
    pub label: String,
    /// This node's name (the node of requests from this process).
    pub node: String,
}

/// Control's state.
pub struct ControlState {
    args: ControlArgs,
    jobs: BTreeMap<u64, JobRecord>,
    next_id: u64,
    /// Described node members by label, with the actor that answered (a node restarted under
    /// the same name is described again).
    known: HashMap<String, (ractor::ActorId, MemberInfo)>,
}

const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(2);

impl JobRecord {
    /// Whether the job still holds (or waits for) slots: not cancelled, not finished.
    pub fn is_active(&self) -> bool {
        let finished = self
            .progress
            .as_ref()
            .is_some_and(|p| p.phase == crate::loops::job::JobPhase::Finished);
        self.state != JobState::Cancelled && !finished
    }
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl ControlState {
    fn store_path(&self) -> PathBuf {
        self.args.dir.join("jobs.json")
    }

    /// Stores the jobs crash-safely: a private temporary file, fsynced, renamed over
    /// `jobs.json`, then the directory fsynced so the rename itself survives a crash.
    fn persist(&self) {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let jobs: Vec<&JobRecord> = self.jobs.values().collect();
        let write = || -> std::io::Result<()> {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.args.dir)?;
            let tmp = self.args.dir.join("jobs.json.tmp");
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(&jobs)?)?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.store_path())?;
            std::fs::File::open(&self.args.dir)?.sync_all()
        };
        if let Err(e) = write() {
            tracing::error!(
                "control: cannot store jobs in {}: {e}",
                self.store_path().display()
            );
        }
    }

    /// Asks every member of the node group who it is (members not described yet, or restarted
    /// since) and builds the placement pool from the members that answer: trainer nodes, and
    /// each node's environment slots.
    async fn refresh_pool(&mut self) -> Pool {
        let mut live = BTreeSet::new();
        let mut pending = tokio::task::JoinSet::new();
        for cell in ractor::pg::get_members(&crate::groups::NODES.to_string()) {
            let label = rpc::actor_label(&cell);
            let id = cell.get_id();
            live.insert(label.clone());
            if self.known.get(&label).is_none_or(|(known, _)| *known != id) {
                pending.spawn(async move {
                    let r: Result<MemberReply, _> =
                        rpc::call(&cell, &MemberRequest::Describe, DESCRIBE_TIMEOUT).await;
                    (label, id, r)
                });
            }
        }
        while let Some(Ok((label, id, r))) = pending.join_next().await {
            match r {
                Ok(MemberReply::Info(info)) => {
                    self.known.insert(label, (id, info));
                }
                Ok(other) => tracing::warn!("control: {label} answered {other:?} to Describe"),
                Err(e) => tracing::warn!("control: {e}"),
            }
        }
        self.known.retain(|l, _| live.contains(l));
        let mut pool = Pool::default();
        for (_, info) in self.known.values() {
            if info.roles.contains(&Role::Trainer) {
                pool.trainer_nodes.insert(info.node.clone());
            }
            for e in &info.envs {
                pool.env
                    .entry(e.kind.clone())
                    .or_default()
                    .extend(info.env_slots(&e.kind));
            }
        }
        pool
    }

    async fn replace_all(&mut self) {
        let pool = self.refresh_pool().await;
        let mut changed = false;
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        for id in ids {
            // A cancelled or finished job keeps the placement it ran with: nodes leaving
            // afterwards (a node shutting down) must not rewrite its history.
            if !self.jobs[&id].is_active() {
                continue;
            }
            let (busy, load) = self.usage(id);
            let job = &self.jobs[&id];
            let (placement, state) = place(&job.needs, &job.placement, &pool, &busy, &load);
            let job = self.jobs.get_mut(&id).expect("id taken from the map");
            if placement != job.placement || state != job.state {
                tracing::info!(
                    "control: {} {:?} trainer={:?} env slots {}/{}",
                    job.id,
                    state,
                    placement.trainer,
                    placement.env_slots.len(),
                    job.needs.env_parallelism
                );
                job.placement = placement;
                job.state = state;
                changed = true;
            }
        }
        if changed {
            self.persist();
        }
    }

    /// Workers held and trainer load of every active job other than `except`.
    fn usage(&self, except: u64) -> (BTreeSet<String>, BTreeMap<String, usize>) {
        let mut busy = BTreeSet::new();
        let mut load = BTreeMap::new();
        for (id, j) in &self.jobs {
            if *id == except || !j.is_active() {
                continue;
            }
            busy.extend(j.placement.env_slots.iter().cloned());
            if let Some(t) = &j.placement.trainer {
                *load.entry(t.clone()).or_insert(0) += 1;
            }
        }
        (busy, load)
    }

    fn find(&self, id: &str) -> Option<u64> {
        self.jobs.iter().find(|(_, j)| j.id == id).map(|(k, _)| *k)
    }

    async fn handle_request(&mut self, req: ControlRequest, caller: &Caller) -> ControlReply {
        match req {
            ControlRequest::Submit { file, spec } => {
                let needs = match self.args.validator.validate(&file, &spec) {
                    Ok(n) => n,
                    Err(e) => return ControlReply::Error(e),
                };
                let n = self.next_id;
                self.next_id += 1;
                let id = format!("job-{n}");
                tracing::info!("control: accepted {id} ({}) from {file}", needs.name);
                self.jobs.insert(
                    n,
                    JobRecord {
                        id,
                        file,
                        spec,
                        needs,
                        state: JobState::Waiting,
                        placement: Placement::default(),
                        submitted_unix: now_unix(),
                        progress: None,
                        max_steps: None,
                    },
                );
                self.persist();
                self.replace_all().await;
                ControlReply::Jobs(vec![self.jobs[&n].clone()])
            }
            ControlRequest::Status(Some(id)) => match self.find(&id) {
                Some(k) => ControlReply::Jobs(vec![self.jobs[&k].clone()]),
                None => ControlReply::Error(format!("no job `{id}`")),
            },
            ControlRequest::Status(None) | ControlRequest::List => {
                ControlReply::Jobs(self.jobs.values().cloned().collect())
            }
            ControlRequest::Progress { id, counts } => match self.find(&id) {
                Some(k) => {
                    let from = caller.node(&self.args.node);
                    let places = Places::of(&self.jobs[&k].placement);
                    if let Err(e) = authority::check(&id, from, Need::Home, &places) {
                        tracing::warn!(job = %id, "control: progress refused: {e}");
                        return ControlReply::Error(e.to_string());
                    }
                    let j = self.jobs.get_mut(&k).expect("found above");
                    let finished = counts.phase == crate::loops::job::JobPhase::Finished;
                    j.progress = Some(*counts);
                    if finished {
                        self.persist();
                    }
                    ControlReply::Jobs(vec![self.jobs[&k].clone()])
                }
                None => ControlReply::Error(format!("no job `{id}`")),
            },
            ControlRequest::SetMaxSteps { id, max_steps } => match self.find(&id) {
                _ if max_steps == 0 => ControlReply::Error("max_steps must be at least 1".into()),
                Some(k) if !self.jobs[&k].is_active() => ControlReply::Error(format!(
                    "job `{id}` has ended; its step limit cannot change"
                )),
                Some(k) => {
                    let j = self.jobs.get_mut(&k).expect("found above");
                    j.max_steps = Some(max_steps);
                    tracing::info!("control: {id} now stops at {max_steps} trainer steps");
                    self.persist();
                    ControlReply::Jobs(vec![self.jobs[&k].clone()])
                }
                None => ControlReply::Error(format!("no job `{id}`")),
            },
            ControlRequest::Cancel(id) => match self.find(&id) {
                Some(k) => {
                    let j = self.jobs.get_mut(&k).expect("found above");
                    if j.state != JobState::Cancelled {
                        j.state = JobState::Cancelled;
                        // The slots are freed; the trainer node stays on record, as the
                        // home that drains the job and reports its final counts.
                        j.placement.env_slots.clear();
                        tracing::info!("control: cancelled {id}");
                        self.persist();
                        // Freed slots may complete other jobs.
                        self.replace_all().await;
                    }
                    ControlReply::Jobs(vec![self.jobs[&k].clone()])
                }
                None => ControlReply::Error(format!("no job `{id}`")),
            },
        }
    }
}

/// Parses a `jobs.json`: the jobs by number, and the next free number.
fn parse_jobs(bytes: &[u8]) -> Result<(BTreeMap<u64, JobRecord>, u64), String> {
    let jobs: Vec<JobRecord> = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let mut map = BTreeMap::new();
    let mut next_id = 1;
    for j in jobs {
        let n: u64 =
            j.id.strip_prefix("job-")
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("a bad job id `{}`", j.id))?;
        next_id = next_id.max(n + 1);
        map.insert(n, j);
    }
    Ok((map, next_id))
}

impl Actor for Control {
    type Msg = Rpc;
    type State = ControlState;
    type Arguments = ControlArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Rpc>,
        args: ControlArgs,
    ) -> Result<ControlState, ActorProcessingErr> {
        let path = args.dir.join("jobs.json");
        let (map, next_id) = match std::fs::read(&path) {
            Ok(bytes) => match parse_jobs(&bytes) {
                Ok(loaded) => loaded,
                Err(e) => {
                    // A corrupt store must not keep Control (and so the node) down: it is
                    // kept aside for a person to inspect and Control starts with no jobs.
                    let aside = args.dir.join(format!("jobs.json.corrupt-{}", now_unix()));
                    std::fs::rename(&path, &aside).map_err(|re| {
                        format!(
                            "control: {} is corrupt ({e}) and cannot be moved aside: {re}",
                            path.display()
                        )
                    })?;
                    tracing::error!(
                        "control: {} is corrupt ({e}); moved to {} and starting with no jobs",
                        path.display(),
                        aside.display()
                    );
                    (BTreeMap::new(), 1)
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (BTreeMap::new(), 1),
            Err(e) => return Err(format!("control: cannot read {}: {e}", path.display()).into()),
        };
        if !map.is_empty() {
            tracing::info!("control: loaded {} jobs from {}", map.len(), path.display());
        }
        ractor::pg::join(crate::groups::CONTROL.to_string(), vec![myself.get_cell()]);
        ractor::pg::monitor_scope(ractor::pg::DEFAULT_SCOPE.to_string(), myself.get_cell());
        Ok(ControlState {
            args,
            jobs: map,
            next_id,
            known: HashMap::new(),
        })
    }

    async fn post_start(
        &self,
        _myself: ActorRef<Rpc>,
        state: &mut ControlState,
    ) -> Result<(), ActorProcessingErr> {
        state.replace_all().await;
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Rpc>,
        msg: Rpc,
        state: &mut ControlState,
    ) -> Result<(), ActorProcessingErr> {
        let reply = match rpc::decode::<ControlRequest>(&msg.request) {
            Ok(req) => state.handle_request(req, &msg.caller).await,
            Err(e) => ControlReply::Error(format!("malformed control request: {e}")),
        };
        rpc::reply(msg.reply, &reply);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Rpc>,
        evt: SupervisionEvent,
        state: &mut ControlState,
    ) -> Result<(), ActorProcessingErr> {
        // Control has no children; the events it gets are process-group changes, which may
        // free or bring slots: re-place every running job.
        if let SupervisionEvent::ProcessGroupChanged(_) = evt {
            state.replace_all().await;
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Rpc>,
        state: &mut ControlState,
    ) -> Result<(), ActorProcessingErr> {
        ractor::pg::demonitor_scope(ractor::pg::DEFAULT_SCOPE.to_string(), myself.get_id());
        tracing::info!("control {} stopped", state.args.label);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs(n: u32) -> JobNeeds {
        JobNeeds {
            name: "t".into(),
            env_kind: "terminal".into(),
            env_parallelism: n,
        }
    }

    fn pool(trainers: &[&str], env: &[&str]) -> Pool {
        Pool {
            trainer_nodes: trainers.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([(
                "terminal".to_string(),
                env.iter().map(|s| s.to_string()).collect(),
            )]),
        }
    }

    struct AnySpec;
    impl JobValidator for AnySpec {
        fn validate(&self, _file: &str, _text: &str) -> Result<JobNeeds, String> {
            Ok(needs(1))
        }
    }

    async fn spawn_control(dir: &std::path::Path) -> ActorRef<Rpc> {
        let (control, _) = Actor::spawn(
            None,
            Control,
            ControlArgs {
                validator: Arc::new(AnySpec),
                dir: dir.to_path_buf(),
                label: "test".into(),
                node: "here".into(),
            },
        )
        .await
        .expect("control starts");
        control
    }

    async fn ask(control: &ActorRef<Rpc>, req: &ControlRequest) -> ControlReply {
        rpc::call(&control.get_cell(), req, Duration::from_secs(10))
            .await
            .expect("control answers")
    }

    /// A corrupt `jobs.json` is moved aside and Control starts empty; what it stores next is
    /// private to the node's user and parses back.
    #[tokio::test]
    async fn a_corrupt_store_is_moved_aside_and_the_new_one_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("jobs.json"), b"[{\"id\": \"job-1\", tor").unwrap();
        let control = spawn_control(dir.path()).await;
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().any(|n| n.starts_with("jobs.json.corrupt-")),
            "{names:?}"
        );
        let submit = ControlRequest::Submit {
            file: "j.toml".into(),
            spec: "x".into(),
        };
        let ControlReply::Jobs(jobs) = ask(&control, &submit).await else {
            panic!("submit refused")
        };
        assert_eq!(jobs[0].id, "job-1");
        let store = dir.path().join("jobs.json");
        let mode = std::fs::metadata(&store).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        let (stored, next) = parse_jobs(&std::fs::read(&store).unwrap()).unwrap();
        assert_eq!((stored.len(), next), (1, 2));
        control.stop(None);
    }

    /// A step limit set after submission is stored with the job; nonsense is refused by name.
    #[tokio::test]
    async fn the_step_limit_is_stored_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let control = spawn_control(dir.path()).await;
        let submit = ControlRequest::Submit {
            file: "j.toml".into(),
            spec: "x".into(),
        };
        assert!(matches!(
            ask(&control, &submit).await,
            ControlReply::Jobs(_)
        ));
        let set = |id: &str, max_steps| ControlRequest::SetMaxSteps {
            id: id.into(),
            max_steps,
        };
        match ask(&control, &set("job-1", 0)).await {
            ControlReply::Error(e) => assert!(e.contains("max_steps"), "{e}"),
            r => panic!("{r:?}"),
        }
        match ask(&control, &set("job-9", 5)).await {
            ControlReply::Error(e) => assert!(e.contains("job-9"), "{e}"),
            r => panic!("{r:?}"),
        }
        let ControlReply::Jobs(jobs) = ask(&control, &set("job-1", 5)).await else {
            panic!("refused")
        };
        assert_eq!(jobs[0].max_steps, Some(5));
        control.stop_and_wait(None, None).await.unwrap();
        // It is stored, so it survives Control's restart.
        let (stored, _) =
            parse_jobs(&std::fs::read(dir.path().join("jobs.json")).unwrap()).unwrap();
        assert_eq!(stored[&1].max_steps, Some(5));
        // An ended job's limit cannot change.
        let control = spawn_control(dir.path()).await;
        assert!(matches!(
            ask(&control, &ControlRequest::Cancel("job-1".into())).await,
            ControlReply::Jobs(_)
        ));
        match ask(&control, &set("job-1", 7)).await {
            ControlReply::Error(e) => assert!(e.contains("ended"), "{e}"),
            r => panic!("{r:?}"),
        }
        control.stop(None);
    }

    #[test]
    fn only_running_jobs_are_active() {
        let mut job = JobRecord {
            id: "job-1".into(),
            file: "j.toml".into(),
            spec: String::new(),
            needs: needs(1),
            state: JobState::Placed,
            placement: Placement::default(),
            submitted_unix: 0,
            progress: None,
            max_steps: None,
        };
        assert!(job.is_active());
        let mut counts = crate::loops::job::JobCounts {
            phase: crate::loops::job::JobPhase::Draining,
            ..Default::default()
        };
        job.progress = Some(counts.clone());
        assert!(job.is_active(), "a draining job still holds its slots");
        counts.phase = crate::loops::job::JobPhase::Finished;
        job.progress = Some(counts);
        assert!(
            !job.is_active(),
            "a finished job keeps its placement and frees its slots"
        );
        job.progress = None;
        job.state = JobState::Cancelled;
        assert!(!job.is_active());
    }

    #[test]
    fn waits_without_trainer_or_slots() {
        let (p, s) = place(
            &needs(2),
            &Placement::default(),
            &pool(&[], &["w/1"]),
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        assert_eq!(s, JobState::Waiting);
        assert_eq!(p.trainer, None);
        let (_, s) = place(
            &needs(2),
            &Placement::default(),
            &pool(&["a"], &[]),
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        assert_eq!(s, JobState::Waiting);
    }

    #[test]
    fn fills_up_skips_busy_and_keeps_current_slots() {
        let pl = pool(&["a", "b"], &["w/1", "w/2", "w/3"]);
        let busy = BTreeSet::from(["w/1".to_string()]);
        let load = BTreeMap::from([("a".to_string(), 1)]);
        let (p, s) = place(&needs(2), &Placement::default(), &pl, &busy, &load);
        assert_eq!(s, JobState::Placed);
        assert_eq!(p.trainer.as_deref(), Some("b"));
        assert_eq!(p.env_slots, vec!["w/2", "w/3"]);
        // A slot that left is replaced only if a free one exists.
        let pl2 = pool(&["a", "b"], &["w/1", "w/3"]);
        let (p2, s2) = place(&needs(2), &p, &pl2, &busy, &load);
        assert_eq!(p2.env_slots, vec!["w/3"]);
        assert_eq!(s2, JobState::Partial);
        // A new slot joins: the job picks it up without losing w/3.
        let pl3 = pool(&["a", "b"], &["w/1", "w/3", "w/9"]);
        let (p3, s3) = place(&needs(2), &p2, &pl3, &busy, &load);
        assert_eq!(p3.env_slots, vec!["w/3", "w/9"]);
        assert_eq!(s3, JobState::Placed);
    }

    #[test]
    fn a_lost_trainer_node_is_replaced() {
        let cur = Placement {
            trainer: Some("gone".into()),
            env_slots: vec![],
        };
        let (p, _) = place(
            &needs(1),
            &cur,
            &pool(&["b"], &["w/1"]),
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        assert_eq!(p.trainer.as_deref(), Some("b"));
    }
}
