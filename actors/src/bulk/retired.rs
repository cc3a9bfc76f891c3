//! Which retired receive buffer a new transfer may write into, and how long one is kept: the
//! rules alone, over any buffer type, with the time passed in.
//!
//! - Only buffers of at least [`MIN_LEN`] bytes are kept: below that a fresh allocation's page
//!   faults cost little.
//! - One buffer is kept at a time (the latest retired), so a node holds at most one blob's
//!   memory more than it would without reuse.
//! - A transfer takes it only for a blob of exactly its length: successive versions of one
//!   model are, and nothing is wasted on a larger buffer.
//! - A buffer not taken within the keep time is let go of.

use std::time::{Duration, Instant};

/// Smallest buffer worth keeping.
pub(crate) const MIN_LEN: usize = 1 << 20;

/// How long a retired buffer waits for a transfer of its length before it is let go of. A
/// node whose job ended gives the memory back within this; a job whose versions come further
/// apart receives each into fresh memory, as without reuse.
pub(crate) const KEEP: Duration = Duration::from_secs(120);

/// The retired buffer kept for reuse, if any.
pub(crate) struct Retired<B> {
    keep: Duration,
    kept: Option<Kept<B>>,
}

struct Kept<B> {
    len: usize,
    since: Instant,
    buf: B,
}

impl<B> Retired<B> {
    /// Nothing kept; a buffer is kept at most `keep`.
    pub(crate) fn new(keep: Duration) -> Self {
        Retired { keep, kept: None }
    }

    /// Whether a buffer of `len` bytes is worth keeping at all.
    pub(crate) fn keeps(len: usize) -> bool {
        len >= MIN_LEN
    }

    /// Offers a buffer of `len` bytes that nothing reads any more. Returns what is let go of
    /// (the offered buffer if it is too small, else the one kept before), for the caller to
    /// drop outside any lock.
    pub(crate) fn put(&mut self, len: usize, buf: B, now: Instant) -> Option<B> {
        if !Self::keeps(len) {
            return Some(buf);
        }
        let kept = Kept {
            len,
            since: now,
            buf,
        };
        self.kept.replace(kept).map(|k| k.buf)
    }

    /// The kept buffer if it is exactly `len` bytes and still within its keep time.
    pub(crate) fn take(&mut self, len: usize, now: Instant) -> Option<B> {
        self.kept
            .take_if(|k| k.len == len && now.duration_since(k.since) <= self.keep)
            .map(|k| k.buf)
    }

    /// Lets go of the kept buffer if it waited longer than the keep time; returns it for the
    /// caller to drop outside any lock.
    pub(crate) fn expire(&mut self, now: Instant) -> Option<B> {
        self.kept
            .take_if(|k| now.duration_since(k.since) > self.keep)
            .map(|k| k.buf)
    }

    /// Bytes kept for reuse.
    pub(crate) fn held(&self) -> usize {
        self.kept.as_ref().map_or(0, |k| k.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_retired_buffer_goes_to_the_next_blob_of_its_length_only() {
        let t0 = Instant::now();
        let mut r = Retired::new(KEEP);
        assert_eq!(r.put(85 * MIB, "v1", t0), None);
        assert_eq!(r.held(), 85 * MIB);
        assert_eq!(r.take(85 * MIB - 1, t0), None, "a shorter blob");
        assert_eq!(r.take(85 * MIB + 1, t0), None, "a longer blob");
        assert_eq!(r.take(85 * MIB, t0 + KEEP), Some("v1"));
        assert_eq!(r.take(85 * MIB, t0 + KEEP), None, "taken once");
        assert_eq!(r.held(), 0);
    }

    #[test]
    fn one_buffer_is_kept_the_latest() {
        let t0 = Instant::now();
        let mut r = Retired::new(KEEP);
        assert_eq!(r.put(4 * MIB, "a", t0), None);
        assert_eq!(
            r.put(8 * MIB, "b", t0),
            Some("a"),
            "the older one is let go of"
        );
        assert_eq!(r.take(4 * MIB, t0), None);
        assert_eq!(r.take(8 * MIB, t0), Some("b"));
    }

    #[test]
    fn small_buffers_are_not_kept() {
        let t0 = Instant::now();
        let mut r = Retired::new(KEEP);
        assert_eq!(r.put(MIN_LEN - 1, "small", t0), Some("small"));
        assert_eq!(r.held(), 0);
        assert_eq!(r.put(MIN_LEN, "big", t0), None);
        assert_eq!(r.held(), MIN_LEN);
    }

    #[test]
    fn a_buffer_past_its_keep_time_is_let_go_of() {
        let t0 = Instant::now();
        let mut r = Retired::new(KEEP);
        r.put(2 * MIB, "old", t0);
        assert_eq!(r.expire(t0 + KEEP), None, "still within its time");
        assert_eq!(r.take(2 * MIB, t0 + KEEP + Duration::from_millis(1)), None);
        assert_eq!(r.held(), 2 * MIB, "a late take leaves it for expire");
        assert_eq!(r.expire(t0 + KEEP + Duration::from_millis(1)), Some("old"));
        assert_eq!(r.held(), 0);
        // A newer buffer restarts the clock.
        r.put(2 * MIB, "new", t0 + KEEP);
        assert_eq!(r.expire(t0 + KEEP + KEEP / 2), None);
        assert_eq!(r.take(2 * MIB, t0 + KEEP + KEEP / 2), Some("new"));
    }
}
