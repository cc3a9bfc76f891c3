//! Appending judged-turn records to the job's JSONL file off the hot path.
//!
//! [`RecordWriter::append`] only serializes and queues the line (it never waits on the disk); a
//! background task appends queued lines in order through a buffered writer and flushes whenever
//! the queue runs dry, so a judge never stalls on IO. [`RecordWriter::close`] drains the queue,
//! flushes, and reports how many lines were written or the first IO error.

use std::path::{Path, PathBuf};

use thiserror::Error;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::votes::JudgedTurnRecord;

/// Errors of the record writer.
#[derive(Debug, Error)]
pub enum RecordError {
    /// The file could not be opened or written.
    #[error("judge records {path}: {source}")]
    Io {
        /// The JSONL file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// The writer task has stopped (after an IO error, reported by `close`).
    #[error("judge records {0}: the writer has stopped")]
    Closed(PathBuf),
}

/// A background JSONL appender for [`JudgedTurnRecord`]s.
pub struct RecordWriter {
    path: PathBuf,
    tx: mpsc::UnboundedSender<String>,
    task: JoinHandle<Result<u64, RecordError>>,
}

impl RecordWriter {
    /// Opens `path` for appending (creating it) and starts the writer task.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, RecordError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| RecordError::Io {
            path: path.clone(),
            source,
        };
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await
            .map_err(io)?;
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let task_path = path.clone();
        let task = tokio::spawn(async move {
            let io = |source| RecordError::Io {
                path: task_path.clone(),
                source,
            };
            let mut out = tokio::io::BufWriter::new(file);
            let mut written = 0u64;
            while let Some(line) = rx.recv().await {
                out.write_all(line.as_bytes()).await.map_err(io)?;
                written += 1;
                while let Ok(line) = rx.try_recv() {
                    out.write_all(line.as_bytes()).await.map_err(io)?;
                    written += 1;
                }
                out.flush().await.map_err(io)?;
            }
            out.flush().await.map_err(io)?;
            Ok(written)
        });
        Ok(Self { path, tx, task })
    }

    /// Queues one record as a JSON line; never waits on IO.
    pub fn append(&self, record: &JudgedTurnRecord) -> Result<(), RecordError> {
        let mut line = record.to_json_line();
        line.push('\n');
        self.tx
            .send(line)
            .map_err(|_| RecordError::Closed(self.path.clone()))
    }

    /// Writes everything queued, flushes, and returns the number of lines written.
    pub async fn close(self) -> Result<u64, RecordError> {
        drop(self.tx);
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(RecordError::Io {
                path: self.path,
                source: std::io::Error::other(e.to_string()),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::votes::{VoteKind, VoteRecord};

    fn record(turn: u64) -> JudgedTurnRecord {
        JudgedTurnRecord {
            session_id: format!("s{}", turn % 3),
            turn,
            votes: vec![VoteRecord {
                kind: VoteKind::Eval,
                score: Some(1),
                hint: None,
                raw: "\\boxed{1}\n\"quoted\"".into(),
                error: None,
                truncated: false,
            }],
            reward: 1,
            hint_accepted: false,
            hint: None,
            teacher_version: None,
            unjudged: None,
        }
    }

    #[tokio::test]
    async fn records_append_in_order_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("judge.jsonl");
        let w = RecordWriter::open(&path).await.unwrap();
        for t in 0..200 {
            w.append(&record(t)).unwrap();
        }
        assert_eq!(w.close().await.unwrap(), 200);
        let w = RecordWriter::open(&path).await.unwrap();
        w.append(&record(200)).unwrap();
        assert_eq!(w.close().await.unwrap(), 1);
        let text = std::fs::read_to_string(&path).unwrap();
        let back: Vec<JudgedTurnRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(back, (0..201).map(record).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn an_unwritable_path_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = RecordWriter::open(dir.path().join("missing/dir/judge.jsonl"))
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("missing/dir/judge.jsonl"), "{e}");
    }
}
