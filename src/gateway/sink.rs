//! Where completed main-line turns go: a bounded queue drained by a writer thread that appends
//! one JSON line per turn to `<data_dir>/turns-v<version>.jsonl` (one file per weight version).
//! Serving never writes to disk itself. Nothing is dropped: when the queue is full the sender
//! waits, and the wait is counted.

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
    /// Records accepted.
    pub queued: AtomicU64,
    /// Records written and flushed.
    pub written: AtomicU64,
    /// Times a sender found the queue full and waited.
    pub queue_full: AtomicU64,
    /// Write errors.
    pub write_errors: AtomicU64,
}

/// A cloneable handle to the writer.
#[derive(Clone)]
pub struct TurnSink {
    tx: mpsc::Sender<TurnRecord>,
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
        Ok((
            Self {
                tx,
                stats,
                dir: dir.to_path_buf(),
            },
            join,
        ))
    }

    /// The file records of `version` go to.
    pub fn path(&self, version: u64) -> PathBuf {
        file_for(&self.dir, version)
    }

    /// Counters.
    pub fn stats(&self) -> &SinkStats {
        &self.stats
    }

    /// Queues a record, waiting (and counting the wait) when the queue is full.
    pub async fn send(&self, record: TurnRecord) -> Result<(), SinkError> {
        let record = match self.tx.try_send(record) {
            Ok(()) => {
                self.stats.queued.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(SinkError::Closed),
            Err(mpsc::error::TrySendError::Full(r)) => r,
        };
        self.stats.queue_full.fetch_add(1, Ordering::Relaxed);
        self.tx.send(record).await.map_err(|_| SinkError::Closed)?;
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn file_for(dir: &Path, version: u64) -> PathBuf {
    dir.join(format!("turns-v{version}.jsonl"))
}

fn writer(dir: PathBuf, mut rx: mpsc::Receiver<TurnRecord>, stats: Arc<SinkStats>) {
    let mut files: std::collections::HashMap<u64, std::io::BufWriter<std::fs::File>> =
        Default::default();
    while let Some(first) = rx.blocking_recv() {
        let mut batch = vec![first];
        while let Ok(r) = rx.try_recv() {
            batch.push(r);
        }
        let n = batch.len() as u64;
        let mut ok = true;
        for rec in batch {
            let path = file_for(&dir, rec.version);
            let f = match files.entry(rec.version) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    match std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&path)
                    {
                        Ok(f) => v.insert(std::io::BufWriter::new(f)),
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
            if let Err(e) = writeln!(f, "{line}") {
                tracing::error!(path = %path.display(), error = %e, "cannot write turn");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                ok = false;
            }
        }
        for (v, f) in files.iter_mut() {
            if let Err(e) = f.flush() {
                tracing::error!(version = v, error = %e, "cannot flush turn file");
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                ok = false;
            }
        }
        if ok {
            stats.written.fetch_add(n, Ordering::Relaxed);
        }
    }
}
