//! The trainer's pending-sample journal, `<dir>/pending.jsonl`: every accepted sample is
//! appended (and flushed to the OS) before it is counted; a checkpoint rewrites the file
//! (temporary file, synced, renamed) to the samples that checkpoint does not cover; a restarted
//! trainer replays it into its queue. A line cut short by a crash can only be the last one, and
//! is skipped.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use super::{TrainSample, TrainerState};

/// The pending-sample journal under the checkpoint directory (see the module docs).
pub(super) struct Journal {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl Journal {
    pub(super) fn path(root: &Path) -> PathBuf {
        root.join("pending.jsonl")
    }

    /// The samples a previous incarnation left, in order.
    pub(super) fn replay(root: &Path) -> Result<Vec<TrainSample>, String> {
        let path = Self::path(root);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let mut out = Vec::new();
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<TrainSample>(&line) {
                Ok(s) => out.push(s),
                // A line cut short by a crash mid-append can only be the last one.
                Err(e) => tracing::warn!(
                    "{}: line {} is not a sample ({e}); skipped",
                    path.display(),
                    i + 1
                ),
            }
        }
        Ok(out)
    }

    /// Rewrites the journal to hold exactly `samples` and opens it for appending.
    pub(super) fn rewrite<'a>(
        root: &Path,
        samples: impl Iterator<Item = &'a TrainSample>,
    ) -> Result<Journal, String> {
        let path = Self::path(root);
        let tmp = root.join(".pending.jsonl.tmp");
        let io = |e: std::io::Error| format!("{}: {e}", tmp.display());
        std::fs::create_dir_all(root).map_err(|e| format!("{}: {e}", root.display()))?;
        {
            let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
            for s in samples {
                serde_json::to_writer(&mut w, s).map_err(|e| e.to_string())?;
                w.write_all(b"\n").map_err(io)?;
            }
            w.into_inner()
                .map_err(|e| io(e.into_error()))?
                .sync_all()
                .map_err(io)?;
        }
        std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Journal {
            path,
            file: std::io::BufWriter::new(file),
        })
    }

    pub(super) fn append(&mut self, samples: &[TrainSample]) -> Result<(), String> {
        let io = |e: std::io::Error| format!("{}: {e}", self.path.display());
        for s in samples {
            serde_json::to_writer(&mut self.file, s).map_err(|e| e.to_string())?;
            self.file.write_all(b"\n").map_err(io)?;
        }
        self.file.flush().map_err(io)
    }
}

impl TrainerState {
    /// Rewrites the journal to the samples the newest checkpoint does not cover.
    pub(super) fn compact_journal(&mut self) {
        let Some(root) = self.config.checkpoint_dir.clone() else {
            return;
        };
        let in_step = self.in_step.as_ref().map(|s| s.batch.clone());
        let samples = in_step
            .iter()
            .flat_map(|b| b.iter())
            .chain(self.queue.iter());
        match Journal::rewrite(&root, samples) {
            Ok(j) => self.journal = Some(j),
            Err(e) => {
                tracing::error!("rewriting the pending-sample journal: {e}");
                self.stats.last_error = Some(format!("pending-sample journal: {e}"));
            }
        }
    }
}
