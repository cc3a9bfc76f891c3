//! Admission control of a job's sessions: backpressure from the trainer, so that environment
//! sessions do not produce turns the staleness bound will throw away.
//!
//! A sample is dropped as stale when, at the moment the trainer forms its batch, the trainer is
//! more than `max_lag` versions ahead of the sample's tokens. Every sample ahead of it in the
//! pipeline costs the trainer `1 / batch_size` of a step, so a turn produced while `backlog`
//! samples are on their way to the trainer is trained about `backlog / batch_size` versions
//! later: with `backlog < batch_size × (max_lag + 1)` it is still within the bound if the
//! backlog drains first in, first out. It does not quite: a turn of an episode held between its
//! turns waits for the episode while younger work passes it, and replicas install a new
//! version a moment after it is published; so a bound at that value still loses some samples,
//! and a job's default (`env.max_backlog` in the root crate) is two batches. The [`Gate`] keeps
//! the backlog under the bound it is given.
//!
//! - **What counts** ([`Backlog`]): samples queued at the trainer (the step in flight
//!   included), turns of ended episodes being judged or built, turns of episodes still running
//!   (or of finished episodes waiting for a build group), and turns admitted but not yet
//!   produced. A turn counts as one sample: every method makes at most one sample of a turn, so
//!   the count errs on the side of holding back.
//! - **The rule** ([`admits`]): a turn, or a new session, goes ahead while the backlog is below
//!   `max_backlog`, **or** while the samples certain to reach the trainer without any new turn
//!   (queued there, or in ended episodes) plus the turns already admitted are fewer than
//!   `batch_size`. The second clause is what makes a refusal safe: when the gate holds anything
//!   back, either the trainer has a full batch of work that needs no new turn, so it steps (or
//!   drops) and the backlog shrinks, or admitted turns are on their way and will free their
//!   places; held sessions never wait on each other, and a step-wise build group waiting for
//!   more episodes cannot hold the job up. When the trainer is short of a batch, only as many
//!   turns as it is short of go ahead at once.
//! - **Bounded waits.** A held turn waits at most `max_wait`, then goes ahead anyway (counted in
//!   [`AdmissionCounts::wait_expired`]). When the job drains, [`Gate::open_all`] releases every
//!   waiter and admits everything after, so the stop condition never waits on the gate.
//! - **Never serving.** The gate sits between a session and its policy ([`GatedPolicy`]); the
//!   rollout workers and whatever else they serve are never held.
//!
//! Admission is atomic and ordered: waiting turns go ahead one at a time, oldest session first
//! (sessions are numbered as they start), each reserving its turn under the gate's lock. So a
//! gate that opens by one lets one turn through, not every waiting session at once, and the
//! episodes begun first finish first: an episode's early turns do not age while younger
//! episodes overtake it. A new session starts only when the gate would admit a turn and no turn
//! is waiting.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::env::{BoxFuture, Observation};
use super::session::{PolicyError, PolicyTurn, TurnPolicy};

/// How much work may be on its way to the trainer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionSettings {
    /// Most samples on their way to the trainer before turns and new sessions wait (≥
    /// `batch_size`).
    pub max_backlog: u64,
    /// The trainer's batch size (≥ 1).
    pub batch_size: u64,
    /// Longest one turn waits for admission (> 0); after it the turn goes ahead.
    pub max_wait: Duration,
}

/// A bad [`AdmissionSettings`] value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("admission: `{key}` {reason}")]
pub struct AdmissionError {
    /// The setting.
    pub key: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl AdmissionSettings {
    /// The backlog the staleness bound can use: `batch_size × (max_lag + 1)` samples.
    pub fn staleness_bound(batch_size: u64, max_lag: u64) -> u64 {
        batch_size.saturating_mul(max_lag.saturating_add(1))
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<(), AdmissionError> {
        if self.batch_size == 0 {
            return Err(AdmissionError {
                key: "batch_size",
                reason: "must be at least 1".into(),
            });
        }
        if self.max_backlog < self.batch_size {
            return Err(AdmissionError {
                key: "max_backlog",
                reason: format!(
                    "{} is below the batch size {}: the trainer could never form a batch from \
                     the work admitted",
                    self.max_backlog, self.batch_size
                ),
            });
        }
        if self.max_wait.is_zero() {
            return Err(AdmissionError {
                key: "max_wait",
                reason: "must be more than zero".into(),
            });
        }
        Ok(())
    }
}

/// Where the work on its way to the trainer is (in samples; a turn counts as one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backlog {
    /// Samples at the trainer not yet trained or dropped (the step in flight included).
    pub trainer_pending: u64,
    /// Turns of ended episodes not yet handed to the trainer (being judged or built): they
    /// reach it without any new turn.
    pub settling: u64,
    /// Turns of episodes still running, or of finished episodes waiting for a build group.
    pub open: u64,
    /// Turns admitted and not yet produced.
    pub admitted: u64,
}

impl Backlog {
    /// Everything on its way to the trainer.
    pub fn total(&self) -> u64 {
        self.trainer_pending + self.settling + self.open + self.admitted
    }

    /// What reaches the trainer without any new turn.
    pub fn certain(&self) -> u64 {
        self.trainer_pending + self.settling
    }
}

/// Whether one more turn (or a new session) may go ahead (see the module docs).
pub fn admits(settings: &AdmissionSettings, backlog: &Backlog) -> bool {
    backlog.total() < settings.max_backlog
        || backlog.certain() + backlog.admitted < settings.batch_size
}

/// What the gate did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionCounts {
    /// The bound (`max_backlog`); 0 when the job has no admission control.
    pub max_backlog: u64,
    /// The backlog at the last update.
    pub backlog: u64,
    /// Turns admitted.
    pub admitted: u64,
    /// Of those, turns that had to wait.
    pub held: u64,
    /// Milliseconds turns spent waiting, all together.
    pub held_ms: u64,
    /// Held turns that went ahead after `max_wait` without being admitted.
    pub wait_expired: u64,
    /// Times a session start was put off because the backlog was full (a slot left empty is
    /// checked again at every poll).
    pub starts_deferred: u64,
}

/// The gate's state, behind its lock.
#[derive(Default)]
struct GateState {
    /// The backlog as the supervisor last saw it (`admitted` is kept below).
    base: Backlog,
    /// Admitted turns not yet produced, per session.
    admitted: HashMap<String, u64>,
    admitted_total: u64,
    /// Draining: everything goes ahead.
    open: bool,
    /// Turns waiting, by (session priority, ticket): the first goes ahead next.
    waiting: BTreeSet<(u64, u64)>,
    next_ticket: u64,
    counts: AdmissionCounts,
}

impl GateState {
    fn backlog(&self) -> Backlog {
        Backlog {
            admitted: self.admitted_total,
            ..self.base
        }
    }

    fn admit(&mut self, session: &str) {
        *self.admitted.entry(session.to_string()).or_default() += 1;
        self.admitted_total += 1;
        self.counts.admitted += 1;
    }
}

/// The admission gate a job supervisor keeps up to date and its sessions' policies wait on.
pub struct Gate {
    settings: AdmissionSettings,
    state: Mutex<GateState>,
    changed: Notify,
}

impl Gate {
    /// A gate with `settings` (checked).
    pub fn new(settings: AdmissionSettings) -> Result<Arc<Gate>, AdmissionError> {
        settings.validate()?;
        let state = GateState {
            counts: AdmissionCounts {
                max_backlog: settings.max_backlog,
                ..AdmissionCounts::default()
            },
            ..GateState::default()
        };
        Ok(Arc::new(Gate {
            settings,
            state: Mutex::new(state),
            changed: Notify::new(),
        }))
    }

    /// Its settings.
    pub fn settings(&self) -> &AdmissionSettings {
        &self.settings
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The supervisor's view of the backlog changed (`base.admitted` is ignored: the gate
    /// counts admitted turns itself).
    pub fn update(&self, base: Backlog) {
        {
            let mut s = self.lock();
            s.base = base;
            s.counts.backlog = s.backlog().total();
        }
        self.changed.notify_waiters();
    }

    /// A turn of `session` arrived: one admitted turn of it is no longer in flight.
    pub fn produced(&self, session: &str) {
        {
            let mut s = self.lock();
            let mut gone = false;
            if let Some(n) = s.admitted.get_mut(session) {
                if *n > 0 {
                    *n -= 1;
                    gone = true;
                }
            }
            if gone {
                s.admitted_total -= 1;
            }
        }
        self.changed.notify_waiters();
    }

    /// `session` ended: whatever it had admitted will never arrive.
    pub fn ended(&self, session: &str) {
        {
            let mut s = self.lock();
            if let Some(n) = s.admitted.remove(session) {
                s.admitted_total -= n;
            }
        }
        self.changed.notify_waiters();
    }

    /// The job is draining: release every waiter and admit everything from now on.
    pub fn open_all(&self) {
        self.lock().open = true;
        self.changed.notify_waiters();
    }

    /// Whether a new session may start now (reserves nothing: its turns are admitted one by
    /// one). A refusal is counted in [`AdmissionCounts::starts_deferred`].
    pub fn admits_start(&self) -> bool {
        let mut s = self.lock();
        if s.open || (s.waiting.is_empty() && admits(&self.settings, &s.backlog())) {
            return true;
        }
        s.counts.starts_deferred += 1;
        false
    }

    /// The backlog now.
    pub fn backlog(&self) -> Backlog {
        self.lock().backlog()
    }

    /// The counters.
    pub fn counts(&self) -> AdmissionCounts {
        self.lock().counts.clone()
    }

    /// Waits until one more turn of `session` may go ahead (at most `max_wait`; waiting turns
    /// go ahead lowest `priority` first), and counts it as admitted until [`Gate::produced`]
    /// or [`Gate::ended`]. Dropping the future while it waits admits nothing.
    pub async fn admit(&self, session: &str, priority: u64) {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.settings.max_wait;
        let mut ticket: Option<Waiting<'_>> = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a change between the check and the wait wakes it.
            changed.as_mut().enable();
            {
                let mut s = self.lock();
                let key = match &ticket {
                    Some(w) => w.key,
                    None => {
                        s.next_ticket += 1;
                        (priority, s.next_ticket)
                    }
                };
                let first = s.waiting.iter().next().is_none_or(|k| *k >= key);
                if s.open || (first && admits(&self.settings, &s.backlog())) {
                    s.waiting.remove(&key);
                    s.admit(session);
                    if ticket.is_some() {
                        s.counts.held += 1;
                        s.counts.held_ms += started.elapsed().as_millis() as u64;
                    }
                    drop(s);
                    if let Some(w) = ticket.take() {
                        std::mem::forget(w);
                        // The next waiter may go ahead too.
                        self.changed.notify_waiters();
                    }
                    return;
                }
                if ticket.is_none() {
                    s.waiting.insert(key);
                    ticket = Some(Waiting { gate: self, key });
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                let mut s = self.lock();
                if let Some(w) = ticket.take() {
                    s.waiting.remove(&w.key);
                    std::mem::forget(w);
                }
                s.admit(session);
                s.counts.held += 1;
                s.counts.held_ms += started.elapsed().as_millis() as u64;
                s.counts.wait_expired += 1;
                drop(s);
                self.changed.notify_waiters();
                return;
            }
        }
    }
}

/// A waiting turn's place in line; leaving (the future dropped) gives the place up.
struct Waiting<'a> {
    gate: &'a Gate,
    key: (u64, u64),
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.gate.lock().waiting.remove(&self.key);
        self.gate.changed.notify_waiters();
    }
}

/// A session's policy behind the gate: each turn is admitted before the policy is asked.
pub struct GatedPolicy {
    inner: Arc<dyn TurnPolicy>,
    gate: Arc<Gate>,
    session: String,
    priority: u64,
}

impl GatedPolicy {
    /// `inner` for session `session`, admitted through `gate`; among waiting turns, lower
    /// `priority` goes first (the job gives each session its start number).
    pub fn new(
        inner: Arc<dyn TurnPolicy>,
        gate: Arc<Gate>,
        session: impl Into<String>,
        priority: u64,
    ) -> Self {
        GatedPolicy {
            inner,
            gate,
            session: session.into(),
            priority,
        }
    }
}

impl TurnPolicy for GatedPolicy {
    fn act<'a>(
        &'a self,
        observation: &'a Observation,
    ) -> BoxFuture<'a, Result<PolicyTurn, PolicyError>> {
        Box::pin(async move {
            self.gate.admit(&self.session, self.priority).await;
            self.inner.act(observation).await
        })
    }
}
