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
    /// Starts the writer thread over `dir` with a queue of `capacity` records. The thread ends
    /// (after writing everything queued) when every handle is dropped; join the returned handle
    /// to wait for that.
    pub fn start(
        dir: &Path,
        capacity: usize,
    ) -> Result<(Self, std::thread::JoinHandle<()>), SinkError> {
        std::fs::create_dir_all(dir).map_err(|e| SinkError::DataDir {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let stats = Arc::new(SinkStats::default());
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
