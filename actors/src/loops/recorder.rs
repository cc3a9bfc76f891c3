//! The `Recorder`: JSONL records (turns, judge results, trainer steps) written by a background
//! thread, never by the code that produces them.
//!
//! - **Files.** One file per job prefix and weight version: `<dir>/<prefix>.v<version:08>.jsonl`,
//!   opened in append mode. A record goes to the file of the version it names, so the stream
//!   rotates as versions advance, and a late record of an older version still lands beside its
//!   peers. Each line is `{"version":V,"kind":K,"record":R}`.
//! - **Order.** One writer drains one FIFO queue: within a file, lines appear in the order the
//!   records were accepted.
//! - **Backpressure, never silent drops.** The queue is bounded. [`RecorderHandle::try_record`]
//!   never waits: on a full queue it returns [`RecordError::Full`] (the record is *not*
//!   accepted) and counts it in [`RecorderStats::rejected_full`], so the caller decides and the
//!   metric shows it. [`RecorderHandle::record`] waits for room instead and counts each wait in
//!   [`RecorderStats::waited_full`]. Serving and judging use `try_record`.
//! - **Nothing accepted is lost.** Stopping the actor closes the queue (later records get
//!   [`RecordError::Closed`]), drains every record already accepted, flushes and closes the
//!   files. A record the disk refused is counted in [`RecorderStats::write_errors`] with the
//!   error kept in [`RecorderStats::last_error`].
//! - **Durable within a second.** Written lines reach the OS as soon as the queue is idle
//!   (a killed process loses nothing the writer wrote), and every file with new lines is
//!   fsynced at least every [`RecorderConfig::sync_interval`] (1 s by default), as Redis's
//!   `appendfsync everysec` does, so a machine crash loses at most that much.
//! - **Torn lines are cut.** A crash can leave a file's last line half written. When the
//!   recorder opens a file that does not end in a newline, it cuts the torn tail back to the
//!   last complete line, logs it and counts it in [`RecorderStats::torn_lines_cut`], so every
//!   line of every file parses. At start it does the same for every record file already in its
//!   directory, whatever its prefix (a job re-run on the same run directory records under a new
//!   prefix, so the crashed run's files would otherwise never be reopened): a record directory
//!   belongs to one job's recorder at a time.
//! - **What a crash lost is counted.** Every turn a job produces gets a `turn` record at once
//!   and a `judge` record when its episode is settled; a turn the process died holding has the
//!   first and not the second. At start the recorder pairs them over every file in its
//!   directory and, for each `turn` record (keyed by `session_id` and `turn`) left without a
//!   `judge` or `lost` record, writes a `lost` record (`{session_id, turn, reason}`, in its own
//!   file of that turn's version) and counts it in [`RecorderStats::lost_by_crash`], so the
//!   books say what the crash lost, once: a later start finds it paired.
//! - **Private.** Record files are created with mode 0600.
//! - **Taps.** A [`RecordTap`] installed with [`RecorderHandle::tap`] sees every record the
//!   writer writes, in the order written, on the writer's thread: derived logs (training
//!   scalars) follow the records without a second reader.
//! - **Reading back.** [`read_records`] parses one record file; a last line without its
//!   newline (a writer stopped mid-line) is skipped and reported, never an error.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

/// Where and how a [`Recorder`] writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecorderConfig {
    /// Directory of the JSONL files (created if missing).
    pub dir: PathBuf,
    /// File name prefix, e.g. the job id (letters, digits, `-`, `_`, `.`).
    pub prefix: String,
    /// Records the queue holds before it pushes back.
    pub capacity: usize,
    /// Version files kept open at once (the oldest is closed first).
    pub max_open: usize,
    /// The longest a written line waits for its fsync.
    pub sync_interval: Duration,
}

impl RecorderConfig {
    /// Defaults: a queue of 4096 records, 4 open files, an fsync every second.
    pub fn new(dir: impl Into<PathBuf>, prefix: impl Into<String>) -> Self {
        RecorderConfig {
            dir: dir.into(),
            prefix: prefix.into(),
            capacity: 4096,
            max_open: 4,
            sync_interval: Duration::from_secs(1),
        }
    }

    /// The file that records of `version` go to.
    pub fn path(&self, version: u64) -> PathBuf {
        version_path(&self.dir, &self.prefix, version)
    }
}

fn version_path(dir: &Path, prefix: &str, version: u64) -> PathBuf {
    dir.join(format!("{prefix}.v{version:08}.jsonl"))
}

/// Why a recorder could not start.
#[derive(Debug, thiserror::Error)]
pub enum RecorderStartError {
    /// A bad setting.
    #[error("recorder config: {0}")]
    Config(String),
    /// The directory could not be created.
    #[error("creating the record directory {dir}: {source}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
}

/// Why a record was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The queue is full (counted in [`RecorderStats::rejected_full`]).
    #[error("the record queue is full ({capacity} records)")]
    Full {
        /// The queue's capacity.
        capacity: usize,
    },
    /// The recorder has stopped (counted in [`RecorderStats::rejected_closed`]).
    #[error("the recorder has stopped")]
    Closed,
    /// The record could not be serialized.
    #[error("serializing a {kind:?} record: {source}")]
    Serialize {
        /// The record's kind.
        kind: String,
        /// The serde error.
        source: serde_json::Error,
    },
}

/// Counters of one recorder (a snapshot).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecorderStats {
    /// Records accepted into the queue.
    pub accepted: u64,
    /// Records written to their file.
    pub written: u64,
    /// Records refused because the queue was full.
    pub rejected_full: u64,
    /// Records refused because the recorder had stopped.
    pub rejected_closed: u64,
    /// Times [`RecorderHandle::record`] had to wait for room.
    pub waited_full: u64,
    /// Accepted records the disk refused.
    pub write_errors: u64,
    /// Files opened (a new version, or an evicted one reopened).
    pub files_opened: u64,
    /// Torn last lines (left by a crash) cut from files when they were opened.
    #[serde(default)]
    pub torn_lines_cut: u64,
    /// fsyncs of the record files.
    #[serde(default)]
    pub syncs: u64,
    /// Turns found at start recorded without a judge record (their process died holding them),
    /// each now recorded as `lost`.
    #[serde(default)]
    pub lost_by_crash: u64,
    /// The last write error.
    pub last_error: Option<String>,
}

impl RecorderStats {
    /// Records accepted but not yet written nor failed.
    pub fn queued(&self) -> u64 {
        self.accepted
            .saturating_sub(self.written)
            .saturating_sub(self.write_errors)
    }
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    written: AtomicU64,
    rejected_full: AtomicU64,
    rejected_closed: AtomicU64,
    waited_full: AtomicU64,
    write_errors: AtomicU64,
    files_opened: AtomicU64,
    torn_lines_cut: AtomicU64,
    syncs: AtomicU64,
    lost_by_crash: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl Counters {
    fn snapshot(&self) -> RecorderStats {
        RecorderStats {
            accepted: self.accepted.load(Ordering::Acquire),
            written: self.written.load(Ordering::Acquire),
            rejected_full: self.rejected_full.load(Ordering::Relaxed),
            rejected_closed: self.rejected_closed.load(Ordering::Relaxed),
            waited_full: self.waited_full.load(Ordering::Relaxed),
            write_errors: self.write_errors.load(Ordering::Acquire),
            files_opened: self.files_opened.load(Ordering::Relaxed),
            torn_lines_cut: self.torn_lines_cut.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            lost_by_crash: self.lost_by_crash.load(Ordering::Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

enum Item {
    Line {
        version: u64,
        text: String,
    },
    Flush(oneshot::Sender<()>),
    /// A tap to install; it sees the records written after it.
    Tap(Box<dyn RecordTap>),
    /// The sync interval's tick: fsync whatever was written since the last fsync.
    Sync,
    Close,
}

#[derive(Serialize)]
struct Envelope<'a, T: ?Sized> {
    version: u64,
    kind: &'a str,
    record: &'a T,
}

/// One line of a record file, read back: `{"version":V,"kind":K,"record":R}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RecordLine {
    /// The weight version the record names.
    pub version: u64,
    /// The record's kind (`turn`, `judge`, `sample`, `trainer_step`, ...).
    pub kind: String,
    /// The record itself.
    pub record: serde_json::Value,
}

/// Sees every record a [`Recorder`] writes, in order, on the writer's thread. It must not
/// block for long: the writer waits for it.
pub trait RecordTap: Send + 'static {
    /// A record was written to its file.
    fn record(&mut self, line: &RecordLine);
    /// The files were flushed to the OS (a good time to flush derived files too).
    fn flush(&mut self) {}
}

/// A record file read back by [`read_records`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordFile {
    /// Its complete lines, in file order.
    pub lines: Vec<RecordLine>,
    /// A last line without its newline was skipped (a writer stopped mid-line, or is writing
    /// it now).
    pub torn_tail: bool,
}

/// Why a record file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadRecordsError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// A complete line is not a record.
    #[error("{path}:{line}: not a record: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// The JSON error.
        source: serde_json::Error,
    },
}

/// Parses the records of `text` (the contents of `path`, named in errors). Only complete lines
/// (ended by a newline) are records: the writer appends a line's newline last, so a tail
/// without one is a line still being written or cut by a crash; it is skipped and reported in
/// [`RecordFile::torn_tail`].
pub fn parse_records(path: &Path, text: &str) -> Result<RecordFile, ReadRecordsError> {
    let (complete, tail) = match text.rfind('\n') {
        Some(i) => (&text[..i + 1], &text[i + 1..]),
        None => ("", text),
    };
    let mut lines = Vec::new();
    for (i, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str(line).map_err(|source| ReadRecordsError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })?;
        lines.push(parsed);
    }
    Ok(RecordFile {
        lines,
        torn_tail: !tail.is_empty(),
    })
}

/// Reads the record file at `path` (see [`parse_records`]).
pub fn read_records(path: &Path) -> Result<RecordFile, ReadRecordsError> {
    let bytes = std::fs::read(path).map_err(|source| ReadRecordsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_records(path, &String::from_utf8_lossy(&bytes))
}

/// A cheap, cloneable sender of records to a running recorder.
#[derive(Clone)]
pub struct RecorderHandle {
    tx: mpsc::Sender<Item>,
    capacity: usize,
    counters: Arc<Counters>,
}

impl RecorderHandle {
    fn line<T: Serialize + ?Sized>(
        version: u64,
        kind: &str,
        record: &T,
    ) -> Result<Item, RecordError> {
        let text = serde_json::to_string(&Envelope {
            version,
            kind,
            record,
        })
        .map_err(|source| RecordError::Serialize {
            kind: kind.to_string(),
            source,
        })?;
        Ok(Item::Line { version, text })
    }

    /// Queues a record without waiting; a full queue is an explicit, counted refusal.
    pub fn try_record<T: Serialize + ?Sized>(
        &self,
        version: u64,
        kind: &str,
        record: &T,
    ) -> Result<(), RecordError> {
        let item = Self::line(version, kind, record)?;
        match self.tx.try_send(item) {
            Ok(()) => self.count_handed(true),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.counters.rejected_full.fetch_add(1, Ordering::Relaxed);
                Err(RecordError::Full {
                    capacity: self.capacity,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => self.count_handed(false),
        }
    }

    /// Counts a record handed to the queue: accepted when `taken`, else refused because the
    /// recorder is gone.
    fn count_handed(&self, taken: bool) -> Result<(), RecordError> {
        if taken {
            self.counters.accepted.fetch_add(1, Ordering::AcqRel);
            Ok(())
        } else {
            self.counters
                .rejected_closed
                .fetch_add(1, Ordering::Relaxed);
            Err(RecordError::Closed)
        }
    }

    /// Queues a record, waiting for room when the queue is full (each wait is counted).
    pub async fn record<T: Serialize + ?Sized>(
        &self,
        version: u64,
        kind: &str,
        record: &T,
    ) -> Result<(), RecordError> {
        let item = Self::line(version, kind, record)?;
        let item = match self.tx.try_send(item) {
            Ok(()) => return self.count_handed(true),
            Err(mpsc::error::TrySendError::Full(item)) => {
                self.counters.waited_full.fetch_add(1, Ordering::Relaxed);
                item
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return self.count_handed(false),
        };
        let taken = self.tx.send(item).await.is_ok();
        self.count_handed(taken)
    }

    /// Waits until every record accepted before this call is written and flushed to its file.
    pub async fn flush(&self) -> Result<(), RecordError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Item::Flush(tx))
            .await
            .map_err(|_| RecordError::Closed)?;
        rx.await.map_err(|_| RecordError::Closed)
    }

    /// Installs `tap`: it sees every record accepted after this call, as it is written.
    pub async fn tap(&self, tap: Box<dyn RecordTap>) -> Result<(), RecordError> {
        self.tx
            .send(Item::Tap(tap))
            .await
            .map_err(|_| RecordError::Closed)
    }

    /// The counters now.
    pub fn stats(&self) -> RecorderStats {
        self.counters.snapshot()
    }
}

/// The writer: owns the open files; runs on a blocking thread.
struct Writer {
    dir: PathBuf,
    prefix: String,
    max_open: usize,
    open: BTreeMap<u64, BufWriter<File>>,
    counters: Arc<Counters>,
    sync_interval: Duration,
    /// Lines were written since the last fsync.
    dirty: bool,
    last_sync: Instant,
    taps: Vec<Box<dyn RecordTap>>,
}

/// Cuts a torn last line (one without its newline) off `file`; returns the bytes cut (0 when
/// the file is empty or ends in a newline). Scans back from the end in blocks, so only the
/// torn tail is read. The file must be open for reading and writing.
pub fn cut_torn_tail(file: &mut File) -> std::io::Result<u64> {
    const BLOCK: u64 = 64 * 1024;
    let len = file.metadata()?.len();
    let mut end = len;
    let mut buf = vec![0u8; BLOCK as usize];
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            let keep = start + i as u64 + 1;
            if keep < len {
                file.set_len(keep)?;
                file.sync_data()?;
            }
            return Ok(len - keep);
        }
        end = start;
    }
    // No newline at all: the whole file is one torn line.
    if len > 0 {
        file.set_len(0)?;
        file.sync_data()?;
    }
    Ok(len)
}

/// Whether `name` is a record file's: `<prefix>.v<8 or more digits>.jsonl`.
fn is_record_file(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".jsonl") else {
        return false;
    };
    let Some(i) = stem.rfind(".v") else {
        return false;
    };
    let digits = &stem[i + 2..];
    i > 0 && digits.len() >= 8 && digits.bytes().all(|b| b.is_ascii_digit())
}

/// The record files in `dir`, any prefix, in name order.
fn record_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file() && is_record_file(&entry.file_name().to_string_lossy()) {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

impl Writer {
    /// Runs once, before any record is written: cuts the torn tail of every record file in the
    /// directory, then records as `lost` every turn left without a judge (or lost) record.
    fn recover(&mut self) {
        let files = match record_files(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                self.fail(0, format!("listing {}: {e}", self.dir.display()));
                return;
            }
        };
        // (session, turn) → (the turn's version, turn records less judge and lost records).
        let mut open: std::collections::HashMap<(String, u64), (u64, i64)> = Default::default();
        for path in files {
            let cut = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .and_then(|mut f| cut_torn_tail(&mut f));
            match cut {
                Ok(0) => {}
                Ok(cut) => {
                    tracing::warn!(
                        "recorder: {} ended in a torn line (a crash mid-write); cut its last {cut} bytes",
                        path.display()
                    );
                    self.counters.torn_lines_cut.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.fail(
                        0,
                        format!("checking the last line of {}: {e}", path.display()),
                    );
                    continue;
                }
            }
            let file = match read_records(&path) {
                Ok(f) => f,
                Err(e) => {
                    self.fail(0, e.to_string());
                    continue;
                }
            };
            for line in file.lines {
                let delta = match line.kind.as_str() {
                    "turn" => 1,
                    "judge" | "lost" => -1,
                    _ => continue,
                };
                let r = &line.record;
                let (Some(session), Some(turn)) = (
                    r.get("session_id").and_then(serde_json::Value::as_str),
                    r.get("turn").and_then(serde_json::Value::as_u64),
                ) else {
                    continue;
                };
                let e = open
                    .entry((session.to_string(), turn))
                    .or_insert((line.version, 0));
                if delta > 0 {
                    e.0 = line.version;
                }
                e.1 += delta;
            }
        }
        let mut lost: Vec<_> = open.into_iter().filter(|(_, (_, n))| *n > 0).collect();
        lost.sort();
        let mut count = 0u64;
        for ((session_id, turn), (version, n)) in lost {
            let record = serde_json::json!({
                "session_id": session_id,
                "turn": turn,
                "reason": "the process stopped before the turn was judged (a crash)",
            });
            let text = serde_json::to_string(&Envelope {
                version,
                kind: "lost",
                record: &record,
            })
            .expect("a lost record serializes");
            for _ in 0..n {
                self.counters.accepted.fetch_add(1, Ordering::AcqRel);
                self.write(version, &text);
                count += 1;
            }
        }
        if count > 0 {
            self.counters
                .lost_by_crash
                .fetch_add(count, Ordering::Relaxed);
            tracing::warn!(
                "recorder: {count} turns in {} were recorded without a judge record (their process stopped holding them); recorded as lost",
                self.dir.display()
            );
            self.flush_all(true);
        }
    }

    fn fail(&self, lines: u64, error: String) {
        self.counters
            .write_errors
            .fetch_add(lines, Ordering::AcqRel);
        tracing::error!("recorder: {error}");
        *self
            .counters
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(error);
    }

    fn file(&mut self, version: u64) -> Result<&mut BufWriter<File>, String> {
        if !self.open.contains_key(&version) {
            while self.open.len() >= self.max_open {
                let (v, mut f) = self.open.pop_first().expect("non-empty");
                if let Err(e) = f.flush() {
                    let path = version_path(&self.dir, &self.prefix, v);
                    self.fail(0, format!("flushing {}: {e}", path.display()));
                }
            }
            let path = version_path(&self.dir, &self.prefix, version);
            let mut f = OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| format!("opening {}: {e}", path.display()))?;
            let cut = cut_torn_tail(&mut f)
                .map_err(|e| format!("checking the last line of {}: {e}", path.display()))?;
            if cut > 0 {
                tracing::warn!(
                    "recorder: {} ended in a torn line (a crash mid-write); cut its last {cut} bytes",
                    path.display()
                );
                self.counters.torn_lines_cut.fetch_add(1, Ordering::Relaxed);
            }
            self.counters.files_opened.fetch_add(1, Ordering::Relaxed);
            self.open.insert(version, BufWriter::new(f));
        }
        Ok(self.open.get_mut(&version).expect("just opened"))
    }

    fn write(&mut self, version: u64, text: &str) {
        let path = version_path(&self.dir, &self.prefix, version);
        let result = self.file(version).and_then(|f| {
            f.write_all(text.as_bytes())
                .and_then(|()| f.write_all(b"\n"))
                .map_err(|e| format!("writing {}: {e}", path.display()))
        });
        match result {
            Ok(()) => {
                self.dirty = true;
                self.counters.written.fetch_add(1, Ordering::AcqRel);
                if !self.taps.is_empty() {
                    match serde_json::from_str::<RecordLine>(text) {
                        Ok(line) => self.taps.iter_mut().for_each(|t| t.record(&line)),
                        Err(e) => tracing::warn!("recorder: a written line does not parse: {e}"),
                    }
                }
            }
            Err(e) => self.fail(1, e),
        }
    }

    /// Flushes every open file to the OS; with `sync`, to the disk too.
    fn flush_all(&mut self, sync: bool) {
        let mut errors = Vec::new();
        for (v, f) in &mut self.open {
            let result = f.flush().and_then(|()| {
                if sync {
                    f.get_ref().sync_data()
                } else {
                    Ok(())
                }
            });
            if let Err(e) = result {
                let path = version_path(&self.dir, &self.prefix, *v);
                errors.push(format!("flushing {}: {e}", path.display()));
            }
        }
        for e in errors {
            self.fail(0, e);
        }
        self.taps.iter_mut().for_each(|t| t.flush());
        if sync {
            self.dirty = false;
            self.last_sync = Instant::now();
            self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// fsyncs when lines were written and the interval has passed since the last fsync.
    fn sync_due(&mut self) {
        if self.dirty && self.last_sync.elapsed() >= self.sync_interval {
            self.flush_all(true);
        }
    }

    fn handle(&mut self, item: Item, rx: &mut mpsc::Receiver<Item>) {
        match item {
            Item::Line { version, text } => self.write(version, &text),
            Item::Flush(done) => {
                self.flush_all(true);
                let _ = done.send(());
            }
            Item::Tap(tap) => self.taps.push(tap),
            Item::Sync => self.sync_due(),
            // Refuse new records; the loop still drains every one already accepted.
            Item::Close => rx.close(),
        }
    }

    fn run(mut self, mut rx: mpsc::Receiver<Item>) {
        self.recover();
        while let Some(item) = rx.blocking_recv() {
            self.handle(item, &mut rx);
            // Write whatever is already queued, then flush once the queue is idle.
            while let Ok(item) = rx.try_recv() {
                self.handle(item, &mut rx);
                // A queue that never empties still gets its fsync on time.
                self.sync_due();
            }
            self.flush_all(false);
            self.sync_due();
        }
        self.flush_all(true);
        self.open.clear();
    }
}

/// Messages of the [`Recorder`].
pub enum RecorderMsg {
    /// A handle to send records with.
    Handle(RpcReplyPort<RecorderHandle>),
    /// The counters.
    Stats(RpcReplyPort<RecorderStats>),
    /// Internal: the sync interval passed.
    #[doc(hidden)]
    SyncTick,
}

impl ractor::Message for RecorderMsg {}

/// The recorder actor (one per node). Stopping it drains and flushes every accepted record
/// before `post_stop` returns.
pub struct Recorder;

/// The recorder's state.
pub struct RecorderState {
    handle: RecorderHandle,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Actor for Recorder {
    type Msg = RecorderMsg;
    type State = RecorderState;
    type Arguments = RecorderConfig;

    async fn pre_start(
        &self,
        myself: ActorRef<RecorderMsg>,
        config: RecorderConfig,
    ) -> Result<RecorderState, ActorProcessingErr> {
        if config.capacity == 0 || config.max_open == 0 {
            return Err(RecorderStartError::Config(
                "capacity and max_open must be at least 1".into(),
            )
            .into());
        }
        if config.sync_interval.is_zero() {
            return Err(RecorderStartError::Config("sync_interval must be positive".into()).into());
        }
        let prefix_ok = !config.prefix.is_empty()
            && config
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !prefix_ok {
            return Err(RecorderStartError::Config(format!(
                "prefix {:?} must be non-empty letters, digits, '-', '_' or '.'",
                config.prefix
            ))
            .into());
        }
        std::fs::create_dir_all(&config.dir).map_err(|source| RecorderStartError::Dir {
            dir: config.dir.clone(),
            source,
        })?;
        let (tx, rx) = mpsc::channel(config.capacity);
        let counters = Arc::new(Counters::default());
        let writer = Writer {
            dir: config.dir.clone(),
            prefix: config.prefix.clone(),
            max_open: config.max_open,
            open: BTreeMap::new(),
            counters: counters.clone(),
            sync_interval: config.sync_interval,
            dirty: false,
            last_sync: Instant::now(),
            taps: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("clawrl-recorder".into())
            .spawn(move || writer.run(rx))?;
        myself.send_interval(config.sync_interval, || RecorderMsg::SyncTick);
        Ok(RecorderState {
            handle: RecorderHandle {
                tx,
                capacity: config.capacity,
                counters,
            },
            writer: Some(thread),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RecorderMsg>,
        msg: RecorderMsg,
        state: &mut RecorderState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RecorderMsg::Handle(port) => {
                let _ = port.send(state.handle.clone());
            }
            RecorderMsg::Stats(port) => {
                let _ = port.send(state.handle.stats());
            }
            // A full queue means the writer is busy and syncs on time by itself.
            RecorderMsg::SyncTick => {
                let _ = state.handle.tx.try_send(Item::Sync);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RecorderMsg>,
        state: &mut RecorderState,
    ) -> Result<(), ActorProcessingErr> {
        // Queue the close behind every accepted record; the writer then drains the rest.
        let _ = state.handle.tx.send(Item::Close).await;
        if let Some(thread) = state.writer.take() {
            tokio::task::spawn_blocking(move || thread.join())
                .await?
                .map_err(|_| "the recorder's writer thread panicked")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_lines_parse_and_a_torn_tail_is_skipped() {
        let p = Path::new("job.v00000001.jsonl");
        let text = "{\"version\":1,\"kind\":\"judge\",\"record\":{\"reward\":1}}\n\
                    {\"version\":1,\"kind\":\"trainer_step\",\"record\":{}}\n\
                    {\"version\":1,\"kind\":\"ju";
        let f = parse_records(p, text).unwrap();
        assert!(f.torn_tail);
        assert_eq!(f.lines.len(), 2);
        assert_eq!(f.lines[0].kind, "judge");
        assert_eq!(f.lines[0].record["reward"], 1);
        assert_eq!(f.lines[1].version, 1);

        let whole = parse_records(p, &text[..text.rfind('\n').unwrap() + 1]).unwrap();
        assert!(!whole.torn_tail);
        assert_eq!(whole.lines, f.lines);
        assert_eq!(parse_records(p, "").unwrap(), RecordFile::default());
        assert!(parse_records(p, "{\"vers").unwrap().torn_tail);
    }

    #[test]
    fn a_complete_line_that_is_not_a_record_is_an_error_naming_it() {
        let p = Path::new("job.v00000002.jsonl");
        let e = parse_records(p, "{\"version\":2,\"kind\":\"x\",\"record\":1}\nnot json\n")
            .unwrap_err();
        assert!(e.to_string().starts_with("job.v00000002.jsonl:2:"), "{e}");
    }
}
