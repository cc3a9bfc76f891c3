//! The warm browser pool of a GUI environment: browsers launched ahead of time, each in a work
//! dir of its own, so that starting an episode opens its page in a browser that is already up
//! instead of waiting for a launch (about half a second on 2 cores).
//!
//! Every browser still serves exactly one episode and dies with it (no profile, storage or
//! crash is shared between episodes); the pool only moves the launch off the episode's start.
//! Browsers alive — idle in the pool, being launched, or in an episode — together never
//! exceed the environment's browser limit: each holds a permit of the same semaphore. An
//! episode start takes an idle browser first; a refill launches one only with a permit that is
//! free at that moment, so a waiting episode never queues behind a refill. Refills follow every
//! take and every episode close. A browser that died while idle is found when its page fails
//! to open; the episode then launches a fresh one (counted in [`PoolStats::discarded`]).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::cdp::{CdpError, LaunchOptions};
use super::page::Launched;
use crate::env::workdir::{WorkDir, WorkDirPool};

/// A browser with its work dir (the browser's profile is under `<dir>/browser`) and the permit
/// that counts it against the environment's browser limit.
pub struct Leased {
    /// The browser (declared first: dropped, and so killed, before its dir is removed).
    pub launched: Launched,
    /// Its work dir.
    pub workdir: WorkDir,
    /// Its place under the browser limit.
    pub permit: OwnedSemaphorePermit,
    /// Whether it came ready from the pool (false: launched for this start).
    pub warm: bool,
}

/// Why no browser could be had.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The episode's work dir could not be created.
    #[error("creating the work dir: {0}")]
    WorkDir(#[from] std::io::Error),
    /// The browser did not start.
    #[error(transparent)]
    Launch(#[from] CdpError),
}

/// Counters of a [`BrowserPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Browsers idle and ready now.
    pub ready: usize,
    /// Episode starts served by a ready browser.
    pub taken_warm: u64,
    /// Episode starts that launched their own (none was ready).
    pub launched_cold: u64,
    /// Refill launches that failed (logged; the next take or close tries again).
    pub refill_failures: u64,
    /// Ready browsers found dead when their page was opened, and replaced.
    pub discarded: u64,
}

/// How a pool's browsers are launched, each in a directory of its own.
#[derive(Clone, Debug)]
pub struct BrowserSpec {
    /// The Chromium executable.
    pub binary: PathBuf,
    /// The viewport, in CSS pixels (width, height).
    pub viewport: (u32, u32),
    /// How long a command may wait for its reply.
    pub timeout: Duration,
}

impl BrowserSpec {
    /// The launch options of a browser whose directory is `dir`.
    fn launch_options(&self, dir: PathBuf) -> LaunchOptions {
        LaunchOptions {
            binary: self.binary.clone(),
            dir,
            width: self.viewport.0,
            height: self.viewport.1,
            timeout: self.timeout,
        }
    }
}

/// Browsers launched ahead for one environment.
pub struct BrowserPool {
    spec: BrowserSpec,
    workdirs: Arc<WorkDirPool>,
    permits: Arc<Semaphore>,
    target: usize,
    idle: Mutex<VecDeque<Leased>>,
    launching: Mutex<usize>,
    ready_signal: Notify,
    taken_warm: AtomicU64,
    launched_cold: AtomicU64,
    refill_failures: AtomicU64,
    discarded: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl BrowserPool {
    /// A pool keeping `target` browsers ready, launching them as `spec` says with work dirs
    /// from `workdirs` under the limit `permits`. Warming starts at once when called inside a
    /// Tokio runtime, else at the first [`BrowserPool::take`].
    pub fn new(
        spec: BrowserSpec,
        workdirs: Arc<WorkDirPool>,
        permits: Arc<Semaphore>,
        target: usize,
    ) -> Arc<BrowserPool> {
        let pool = Arc::new(BrowserPool {
            spec,
            workdirs,
            permits,
            target,
            idle: Mutex::new(VecDeque::new()),
            launching: Mutex::new(0),
            ready_signal: Notify::new(),
            taken_warm: AtomicU64::new(0),
            launched_cold: AtomicU64::new(0),
            refill_failures: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            pool.refill();
        }
        pool
    }

    /// The counters now.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            ready: lock(&self.idle).len(),
            taken_warm: self.taken_warm.load(Ordering::Relaxed),
            launched_cold: self.launched_cold.load(Ordering::Relaxed),
            refill_failures: self.refill_failures.load(Ordering::Relaxed),
            discarded: self.discarded.load(Ordering::Relaxed),
        }
    }

    /// How many browsers the pool keeps ready.
    pub fn target(&self) -> usize {
        self.target
    }

    /// The viewport the browsers are opened with.
    pub fn viewport(&self) -> (u32, u32) {
        self.spec.viewport
    }

    async fn launch(&self, permit: OwnedSemaphorePermit, warm: bool) -> Result<Leased, LeaseError> {
        let workdir = self.workdirs.take()?;
        let opts = self.spec.launch_options(workdir.path().join("browser"));
        let launched = Launched::launch(&opts).await?;
        Ok(Leased {
            launched,
            workdir,
            permit,
            warm,
        })
    }

    /// A browser for one episode: a ready one if there is one, else one launched now (waiting
    /// for a place under the limit, or for a refill to become ready, whichever comes first).
    pub async fn take(self: &Arc<Self>) -> Result<Leased, LeaseError> {
        loop {
            // Registered before looking, so that a refill landing in between still wakes us.
            let ready = self.ready_signal.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            // (Popped in a statement of its own: the guard must be gone before `refill`.)
            let popped = lock(&self.idle).pop_front();
            if let Some(leased) = popped {
                self.taken_warm.fetch_add(1, Ordering::Relaxed);
                self.refill();
                return Ok(leased);
            }
            tokio::select! {
                _ = &mut ready => continue,
                permit = Arc::clone(&self.permits).acquire_owned() => {
                    let permit = permit.expect("the browser semaphore is never closed");
                    self.launched_cold.fetch_add(1, Ordering::Relaxed);
                    let leased = self.launch(permit, false).await;
                    self.refill();
                    return leased;
                }
            }
        }
    }

    /// Counts a ready browser that turned out dead.
    pub fn discarded(&self) {
        self.discarded.fetch_add(1, Ordering::Relaxed);
    }

    /// Launches browsers in the background until `target` are ready or launching, as far as
    /// free places under the limit allow. Needs a Tokio runtime.
    pub fn refill(self: &Arc<Self>) {
        loop {
            {
                let mut launching = lock(&self.launching);
                if lock(&self.idle).len() + *launching >= self.target {
                    return;
                }
                let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() else {
                    return;
                };
                *launching += 1;
                let pool: Weak<BrowserPool> = Arc::downgrade(self);
                let this = Arc::clone(self);
                tokio::spawn(async move {
                    let leased = this.launch(permit, true).await;
                    drop(this);
                    // The environment may be gone meanwhile: then the browser is dropped here,
                    // which kills it, and its work dir is removed.
                    let Some(pool) = pool.upgrade() else { return };
                    *lock(&pool.launching) -= 1;
                    match leased {
                        Ok(l) => {
                            lock(&pool.idle).push_back(l);
                            pool.ready_signal.notify_one();
                        }
                        Err(e) => {
                            pool.refill_failures.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!("launching a warm browser failed: {e}");
                        }
                    }
                });
            }
        }
    }
}
