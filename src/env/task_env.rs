//! The environment every work-dir kind (terminal, SWE, tool-call, GUI) is: a task set read from
//! a file, the kind's own state built from the options, and episodes that each take one task
//! and a work dir. [`TaskEnv`] holds the task set and is the [`Environment`]; a kind supplies
//! how its tasks load and how an episode of one starts ([`TaskKind`]).

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use clawrl_actors::loops::{BoxFuture, EnvError, Environment, Episode};

use super::tasks::TaskError;
use super::workdir::{WorkDir, WorkDirPool};
use super::{EnvBuildError, EnvKind, EnvOptions};

/// What one kind of environment adds to its task set.
pub trait TaskKind: Sized + Send + Sync + 'static {
    /// One task.
    type Task: Send + Sync + 'static;

    /// The kind: its name is [`Environment::kind`] and prefixes the work dirs' root.
    const KIND: EnvKind;

    /// Reads and validates the task set at `path`.
    fn load_tasks(path: &Path) -> Result<Vec<Self::Task>, TaskError>;

    /// The kind's state under `options` (already validated), its episodes taking their work
    /// dirs from `pool`.
    fn build(options: &EnvOptions, pool: Arc<WorkDirPool>) -> Result<Self, EnvBuildError>;

    /// The step limit of an episode.
    fn max_steps(&self) -> u32;

    /// Starts an episode of `task`; its deadline counts from `started`.
    fn start(
        &self,
        task: Arc<Self::Task>,
        started: Instant,
    ) -> impl Future<Output = Result<Box<dyn Episode>, EnvError>> + Send;
}

/// An environment of kind `K` over a task set.
pub struct TaskEnv<K: TaskKind> {
    tasks: Vec<Arc<K::Task>>,
    pub(super) kind: K,
}

impl<K: TaskKind> TaskEnv<K> {
    /// Reads the tasks at `path` and builds the environment over them ([`TaskEnv::new`]).
    pub fn load(path: &Path, options: EnvOptions) -> Result<Self, EnvBuildError> {
        Self::new(K::load_tasks(path)?, options)
    }

    /// An environment over `tasks` (at least one): validates `options`, prepares the work dir
    /// pool and builds the kind's state.
    pub fn new(tasks: Vec<K::Task>, options: EnvOptions) -> Result<Self, EnvBuildError> {
        let pool = options.prepare(K::KIND.name(), tasks.len())?;
        let kind = K::build(&options, pool)?;
        Ok(Self {
            tasks: tasks.into_iter().map(Arc::new).collect(),
            kind,
        })
    }

    /// The tasks.
    pub fn tasks(&self) -> &[Arc<K::Task>] {
        &self.tasks
    }
}

impl<K: TaskKind> Environment for TaskEnv<K> {
    fn kind(&self) -> &str {
        K::KIND.name()
    }

    fn task_count(&self) -> usize {
        self.tasks.len()
    }

    fn max_steps(&self) -> u32 {
        self.kind.max_steps()
    }

    fn start(&self, index: usize, _seed: u64) -> BoxFuture<'_, Result<Box<dyn Episode>, EnvError>> {
        Box::pin(async move {
            let started = Instant::now();
            let task = self.tasks.get(index).ok_or(EnvError::NoSuchTask {
                index,
                count: self.tasks.len(),
            })?;
            self.kind.start(Arc::clone(task), started).await
        })
    }
}

/// The error of an episode of task `task` that failed to start, for `reason`.
pub(crate) fn setup_error(task: &str, reason: String) -> EnvError {
    EnvError::Setup {
        task: task.to_string(),
        reason,
    }
}

/// A fresh work dir from `pool` for an episode of task `task`.
pub(crate) fn take_workdir(pool: &Arc<WorkDirPool>, task: &str) -> Result<WorkDir, EnvError> {
    pool.take()
        .map_err(|e| setup_error(task, format!("creating the work dir: {e}")))
}
