//! Where main-line turns go: a bounded queue drained by a writer thread that appends one JSON
//! line per turn to `<data_dir>/turns-v<version>.jsonl` when the turn is complete (its next state
//! arrived or its session ended), and, the moment a turn is answered, one line to
//! `<data_dir>/served-v<version>.jsonl`, the journal of what clients were given: a turn still
//! waiting for its next state lives only in the session table, and a crash must not lose it.
//! Serving never writes to disk itself. Nothing is dropped: when the queue is full the sender
//! waits, and the wait is counted. Durability follows `appendfsync everysec`: every batch is
//! written and flushed at once (a killed process loses nothing written), and the files are
//! fsynced at most one second after a write (a lost machine loses at most that second). Files
//! are created 0600.
//!
//! At start the sink repairs what a crash left ([`TurnSink::start`]): a torn last line (a write
//! cut short) is cut from every journal, logged and counted in [`SinkStats::torn_lines_cut`];
//! then every answered turn in the served journal without its complete record (it waited for
//! its next state when the process died) is appended to the turn file as it was answered, with
//! `end` [`TurnEnd::Lost`], and counted in [`SinkStats::lost_by_crash`], so what the crash lost
//! is in the books once (the next start finds it paired). With `on_session_end = "drop"` a
//! dropped last turn has no complete record either, so the two cannot be told apart: then only
//! torn lines are repaired.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::session::TurnEnd;

/// One recorded main-line turn (docs/design.md §1): the prompt ids exactly as served, the sampled ids,
/// their log-probs, the version, the messages, and the next state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// The session.
    pub session_id: String,
    /// Weight version that produced every response token.
    pub version: u64,
    /// The served model name.
    pub model: String,
    /// The request messages (key order kept).
    pub messages: minijinja::Value,
    /// The request tools, if any.
    pub tools: Option<minijinja::Value>,
    /// The request's `chat_template_kwargs` (extra template variables the prompt was rendered
    /// with); empty when it gave none.
    #[serde(default)]
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The rendered prompt text.
    pub prompt_text: String,
    /// `s_t`: the prompt ids exactly as fed to the model.
    pub prompt_ids: Vec<u32>,
    /// `a_t`: the sampled ids (a final stop token included).
    pub response_ids: Vec<u32>,
    /// Per-token rollout log-probs, one per response id.
    pub logprobs: Vec<f32>,
    /// The assistant message as served.
    pub response: serde_json::Value,
    /// OpenAI finish reason.
    pub finish_reason: String,
    /// Unix time (seconds) the turn was served.
    pub created: u64,
    /// `s_{t+1}`: the last message of the next state, or `None`.
    pub next_state: Option<serde_json::Value>,
    /// Every message of the next state, in order (the last is `next_state`): the next main
    /// request's last message when it named the session, every message after this turn's
    /// response when the session was inferred.
    #[serde(default)]
    pub next_messages: Vec<serde_json::Value>,
    /// Why the turn left the session table.
    pub end: Option<TurnEnd>,
}

/// The sink could not start.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The data directory cannot be created.
    #[error("cannot create data dir {path}: {source}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The writer is gone (it failed to write; see the log).
    #[error("the turn writer has stopped")]
    Closed,
}

/// Counters of the sink.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Complete turns accepted.
    pub queued: AtomicU64,
    /// Complete turns written and flushed.
    pub written: AtomicU64,
    /// Answered turns written to the served journal and flushed.
    pub served_written: AtomicU64,
    /// Times a sender found the queue full and waited.
    pub queue_full: AtomicU64,
    /// Write errors.
    pub write_errors: AtomicU64,
    /// Torn last lines (left by a crash) cut from the journals at start.
    pub torn_lines_cut: AtomicU64,
    /// Answered turns found at start without their complete record (a crash took them while
    /// they waited for their next state), recorded with end [`TurnEnd::Lost`].
    pub lost_by_crash: AtomicU64,
}

/// What the writer is handed.
enum Item {
    /// A complete turn, for `turns-v<version>.jsonl`.
    Turn(TurnRecord),
    /// A turn as answered, for `served-v<version>.jsonl`.
    Served(TurnRecord),
    /// A second passed: fsync what was written since the last fsync.
    Tick,
}

/// The files a record goes to.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Journal {
    Turns,
    Served,
}

/// A cloneable handle to the writer.
#[derive(Clone)]
pub struct TurnSink {
    tx: mpsc::Sender<Item>,
    stats: Arc<SinkStats>,
    dir: PathBuf,
}

impl TurnSink {
    /// Starts the writer thread over `dir` with a queue of `capacity` records, after repairing
    /// what a crash left there (torn lines; with `reconcile`, answered turns never completed:
    /// see the module doc). The thread ends (after writing everything queued) when every handle
    /// is dropped; join the returned handle to wait for that.
    pub fn start(
        dir: &Path,
        capacity: usize,
        reconcile: bool,
    ) -> Result<(Self, std::thread::JoinHandle<()>), SinkError> {
        std::fs::create_dir_all(dir).map_err(|e| SinkError::DataDir {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let stats = Arc::new(SinkStats::default());
        recover(dir, reconcile, &stats);
        let s2 = stats.clone();
        let d2 = dir.to_path_buf();
        let join = std::thread::Builder::new()
            .name("clawrl-gateway-turns".into())
            .spawn(move || writer(d2, rx, s2))
            .expect("spawning the turn writer");
        // The ticker holds no sender, so the writer still ends when the last handle goes.
        let weak = tx.downgrade();
        std::thread::Builder::new()
            .name("clawrl-gateway-fsync".into())
            .spawn(move || loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
                match weak.upgrade() {
                    // A full queue means the writer is busy and will sync on its own.
                    Some(tx) => drop(tx.try_send(Item::Tick)),
                    None => break,
                }
            })
            .expect("spawning the turn fsync ticker");
        Ok((
            Self {
                tx,
                stats,
                dir: dir.to_path_buf(),
            },
            join,
        ))
    }

    /// The file complete turns of `version` go to.
    pub fn path(&self, version: u64) -> PathBuf {
        file_for(&self.dir, Journal::Turns, version)
    }

    /// The journal of turns of `version` as answered.
    pub fn served_path(&self, version: u64) -> PathBuf {
        file_for(&self.dir, Journal::Served, version)
    }

    /// Counters.
    pub fn stats(&self) -> &SinkStats {
        &self.stats
    }

    /// The counters, shared: holding them does not keep the writer running.
    pub fn shared_stats(&self) -> Arc<SinkStats> {
        self.stats.clone()
    }

    /// Queues a complete turn, waiting (and counting the wait) when the queue is full.
    pub async fn send(&self, record: TurnRecord) -> Result<(), SinkError> {
        self.queue(Item::Turn(record)).await
    }

    /// Queues a turn as it was just answered, for the served journal.
    pub async fn send_served(&self, record: TurnRecord) -> Result<(), SinkError> {
        self.queue(Item::Served(record)).await
    }

    async fn queue(&self, item: Item) -> Result<(), SinkError> {
        let turn = matches!(item, Item::Turn(_));
        let item = match self.tx.try_send(item) {
            Ok(()) => None,
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(SinkError::Closed),
            Err(mpsc::error::TrySendError::Full(r)) => Some(r),
        };
        if let Some(item) = item {
            self.stats.queue_full.fetch_add(1, Ordering::Relaxed);
            self.tx.send(item).await.map_err(|_| SinkError::Closed)?;
        }
        if turn {
            self.stats.queued.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

fn file_for(dir: &Path, journal: Journal, version: u64) -> PathBuf {
    let prefix = match journal {
        Journal::Turns => "turns",
        Journal::Served => "served",
    };
    dir.join(format!("{prefix}-v{version}.jsonl"))
}

/// The journals in `dir`: which, their version, their path.
fn journals(dir: &Path) -> std::io::Result<Vec<(Journal, u64, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".jsonl") else {
            continue;
        };
        let (journal, v) = if let Some(v) = stem.strip_prefix("turns-v") {
            (Journal::Turns, v)
        } else if let Some(v) = stem.strip_prefix("served-v") {
            (Journal::Served, v)
        } else {
            continue;
        };
        if let (Ok(v), true) = (v.parse(), entry.file_type()?.is_file()) {
            out.push((journal, v, entry.path()));
        }
    }
    Ok(out)
}

/// What pairs an answered turn with its complete record: the fields both copies share.
fn turn_key(r: &TurnRecord) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        &r.session_id,
        r.version,
        r.created,
        &r.prompt_ids,
        &r.response_ids,
    )
        .hash(&mut h);
    h.finish()
}

/// The records of a journal (every line must parse: torn tails are cut first).
fn read_journal(path: &Path) -> Result<Vec<TurnRecord>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("reading {}: {e}", path.display())),
    };
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// Repairs `dir` at start: cuts torn tails, then (with `reconcile`) appends every answered turn
/// that has no complete record to its turn file with end [`TurnEnd::Lost`]. Counted in `stats`.
fn recover(dir: &Path, reconcile: bool, stats: &SinkStats) {
    use std::os::unix::fs::OpenOptionsExt;

    let files = match journals(dir) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(dir = %dir.display(), error = %e, "cannot list the turn journals");
            return;
        }
    };
    for (_, _, path) in &files {
        let cut = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .and_then(|mut f| clawrl_actors::loops::recorder::cut_torn_tail(&mut f));
        match cut {
            Ok(0) => {}
            Ok(n) => {
                tracing::warn!(path = %path.display(), "a torn last line (a crash mid-write): cut its last {n} bytes");
                stats.torn_lines_cut.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot check the last line");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if !reconcile {
        return;
    }
    let versions: std::collections::BTreeSet<u64> = files
        .iter()
        .filter(|(j, _, _)| *j == Journal::Served)
        .map(|(_, v, _)| *v)
        .collect();
    for v in versions {
        let turns_path = file_for(dir, Journal::Turns, v);
        let (served, done) = match (
            read_journal(&file_for(dir, Journal::Served, v)),
            read_journal(&turns_path),
        ) {
            (Ok(s), Ok(d)) => (s, d),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot pair answered turns with complete ones");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        let mut complete: std::collections::HashMap<u64, usize> = Default::default();
        for r in &done {
            *complete.entry(turn_key(r)).or_default() += 1;
        }
        let lost: Vec<TurnRecord> = served
            .into_iter()
            .filter(|r| match complete.get_mut(&turn_key(r)) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            })
            .collect();
        if lost.is_empty() {
            continue;
        }
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&turns_path)
            .and_then(|f| {
                let mut w = std::io::BufWriter::new(f);
                for mut r in lost.iter().cloned() {
                    r.end = Some(TurnEnd::Lost);
                    let line = serde_json::to_string(&r).expect("records serialize");
                    writeln!(w, "{line}")?;
                }
                w.flush()?;
                w.get_ref().sync_data()
            });
        match written {
            Ok(()) => {
                tracing::warn!(
                    path = %turns_path.display(),
                    "{} answered turns were never completed (the process stopped while they waited for their next state): recorded as lost",
                    lost.len()
                );
                stats
                    .lost_by_crash
                    .fetch_add(lost.len() as u64, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::error!(path = %turns_path.display(), error = %e, "cannot record the lost turns");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// An open journal file, and whether it holds writes not yet fsynced.
struct Open {
    file: std::io::BufWriter<std::fs::File>,
    unsynced: bool,
}

fn writer(dir: PathBuf, mut rx: mpsc::Receiver<Item>, stats: Arc<SinkStats>) {
    use std::os::unix::fs::OpenOptionsExt;

    let mut files: std::collections::HashMap<(Journal, u64), Open> = Default::default();
    let mut last_sync = std::time::Instant::now();
    while let Some(first) = rx.blocking_recv() {
        let mut batch = vec![first];
        while let Ok(r) = rx.try_recv() {
            batch.push(r);
        }
        let (mut turns, mut served) = (0u64, 0u64);
        let mut ticked = false;
        let mut ok = true;
        for item in batch {
            let (journal, rec) = match item {
                Item::Turn(r) => (Journal::Turns, r),
                Item::Served(r) => (Journal::Served, r),
                Item::Tick => {
                    ticked = true;
                    continue;
                }
            };
            let path = file_for(&dir, journal, rec.version);
            let open = match files.entry((journal, rec.version)) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    match std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .mode(0o600)
                        .open(&path)
                    {
                        Ok(f) => v.insert(Open {
                            file: std::io::BufWriter::new(f),
                            unsynced: false,
                        }),
                        Err(e) => {
                            tracing::error!(path = %path.display(), error = %e, "cannot open turn file");
                            stats.write_errors.fetch_add(1, Ordering::Relaxed);
                            ok = false;
                            continue;
                        }
                    }
                }
            };
            let line = serde_json::to_string(&rec).expect("records serialize");
            if let Err(e) = writeln!(open.file, "{line}") {
                tracing::error!(path = %path.display(), error = %e, "cannot write turn");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                ok = false;
                continue;
            }
            open.unsynced = true;
            match journal {
                Journal::Turns => turns += 1,
                Journal::Served => served += 1,
            }
        }
        for ((_, v), open) in files.iter_mut() {
            if let Err(e) = open.file.flush() {
                tracing::error!(version = v, error = %e, "cannot flush turn file");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                ok = false;
            }
        }
        // A write is fsynced by the next tick (they come a second apart), or sooner by a batch
        // arriving a second after the last fsync.
        if ticked || last_sync.elapsed() >= std::time::Duration::from_secs(1) {
            for ((_, v), open) in files.iter_mut().filter(|(_, o)| o.unsynced) {
                if let Err(e) = open.file.get_ref().sync_data() {
                    tracing::error!(version = v, error = %e, "cannot fsync turn file");
                    stats.write_errors.fetch_add(1, Ordering::Relaxed);
                    ok = false;
                }
                open.unsynced = false;
            }
            last_sync = std::time::Instant::now();
        }
        if ok {
            stats.written.fetch_add(turns, Ordering::Relaxed);
            stats.served_written.fetch_add(served, Ordering::Relaxed);
        }
    }
    for ((_, v), open) in files.iter_mut().filter(|(_, o)| o.unsynced) {
        if let Err(e) = open.file.get_ref().sync_data() {
            tracing::error!(version = v, error = %e, "cannot fsync turn file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(session: &str, created: u64, ids: &[u32]) -> TurnRecord {
        TurnRecord {
            session_id: session.into(),
            version: 2,
            model: "m".into(),
            messages: minijinja::Value::from_serialize(
                serde_json::json!([{"role": "user", "content": "hi"}]),
            ),
            tools: None,
            template_kwargs: Default::default(),
            prompt_text: "hi".into(),
            prompt_ids: vec![1, 2],
            response_ids: ids.to_vec(),
            logprobs: vec![-0.5; ids.len()],
            response: serde_json::json!({"role": "assistant", "content": "x"}),
            finish_reason: "stop".into(),
            created,
            next_state: None,
            next_messages: Vec::new(),
            end: None,
        }
    }

    fn lines(path: &Path) -> Vec<TurnRecord> {
        read_journal(path).unwrap()
    }

    /// A crash left three answered turns, one of them complete, and a torn line in the turn
    /// file: the next start cuts the torn line and records the other two as lost, counted;
    /// the start after finds them paired.
    #[test]
    fn a_start_records_answered_turns_a_crash_left_incomplete_as_lost_once() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            record("a", 1, &[5, 6]),
            record("b", 1, &[7]),
            record("a", 2, &[5, 6]),
        );
        let served: String = [&a, &b, &c]
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        std::fs::write(dir.path().join("served-v2.jsonl"), served).unwrap();
        let mut done = a.clone();
        done.next_state = Some(serde_json::json!({"role": "user", "content": "thanks"}));
        done.end = Some(TurnEnd::NextState);
        let turns = dir.path().join("turns-v2.jsonl");
        std::fs::write(
            &turns,
            serde_json::to_string(&done).unwrap() + "\n{\"session_id\":\"b\",\"ver",
        )
        .unwrap();

        let stats = SinkStats::default();
        recover(dir.path(), true, &stats);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (load(&stats.torn_lines_cut), load(&stats.lost_by_crash)),
            (1, 2)
        );
        let got = lines(&turns);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], done);
        for (r, want) in got[1..].iter().zip([&b, &c]) {
            assert_eq!(r.end, Some(TurnEnd::Lost));
            assert_eq!(
                (&r.session_id, r.created, &r.response_ids),
                (&want.session_id, want.created, &want.response_ids)
            );
        }

        let again = SinkStats::default();
        recover(dir.path(), true, &again);
        assert_eq!(
            (load(&again.torn_lines_cut), load(&again.lost_by_crash)),
            (0, 0)
        );
        assert_eq!(lines(&turns).len(), 3);
    }

    /// Without reconciling (dropped last turns have no complete record either) only torn lines
    /// are repaired.
    #[test]
    fn without_reconciling_only_torn_lines_are_cut() {
        let dir = tempfile::tempdir().unwrap();
        let served = serde_json::to_string(&record("a", 1, &[5])).unwrap() + "\n{\"sess";
        std::fs::write(dir.path().join("served-v2.jsonl"), served).unwrap();
        let stats = SinkStats::default();
        recover(dir.path(), false, &stats);
        assert_eq!(stats.torn_lines_cut.load(Ordering::Relaxed), 1);
        assert_eq!(stats.lost_by_crash.load(Ordering::Relaxed), 0);
        assert!(!dir.path().join("turns-v2.jsonl").exists());
        assert_eq!(lines(&dir.path().join("served-v2.jsonl")).len(), 1);
    }
}
