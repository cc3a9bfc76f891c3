//! Capped capture of a sandbox's stdout or stderr: keeps the first `cap` bytes, keeps draining
//! (and counting) the rest so the writer never blocks, and marks the cut.

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe::Receiver;

/// What one stream produced.
#[derive(Debug, Default)]
pub(super) struct Captured {
    pub kept: Vec<u8>,
    pub total: u64,
}

impl Captured {
    pub(super) fn truncated(&self) -> bool {
        self.total > self.kept.len() as u64
    }

    /// The kept bytes as (lossy) UTF-8, with a marker line when bytes were dropped.
    pub(super) fn into_text(self) -> String {
        let truncated = self.truncated();
        let mut s = String::from_utf8_lossy(&self.kept).into_owned();
        if truncated {
            if !s.ends_with('\n') {
                s.push('\n');
            }
            s.push_str(&format!(
                "[clawrl sandbox: output truncated: {} of {} bytes shown]\n",
                self.kept.len(),
                self.total
            ));
        }
        s
    }
}

/// Reads `rx` to EOF, keeping at most `cap` bytes.
pub(super) async fn capture(mut rx: Receiver, cap: usize) -> std::io::Result<Captured> {
    let mut out = Captured {
        kept: Vec::with_capacity(cap.min(64 * 1024)),
        total: 0,
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = rx.read(&mut buf).await?;
        if n == 0 {
            return Ok(out);
        }
        out.total += n as u64;
        let room = cap.saturating_sub(out.kept.len());
        if room > 0 {
            out.kept.extend_from_slice(&buf[..n.min(room)]);
        }
    }
}
