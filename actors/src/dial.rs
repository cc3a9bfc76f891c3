//! The dial policy of a node: which addresses it keeps connecting to, and when. Pure and
//! clock-free (`now` is an argument), so every rule is tested without sockets.
//!
//! - Seeds (from the node's config) are kept for ever.
//! - Addresses learnt from peers (their hello and their gossip) are bounded: at most
//!   [`MAX_LEARNT_PER_FRAME`] are taken from one frame and at most [`MAX_LEARNT`] are held, so a
//!   peer cannot grow the table without bound. A learnt address is dropped after
//!   [`PRUNE_AFTER_FAILURES`] failed dials in a row: a peer cannot keep a node dialing addresses
//!   that never answer. A node that comes back later is learnt again from the gossip of the
//!   peers it dials itself.
//! - An address is not dialed while a dial to it runs, while the peer found there is connected,
//!   or before its backoff (doubling from `MIN_BACKOFF` to `MAX_BACKOFF` after each failure)
//!   has passed; a success or a live peer resets the backoff.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The most learnt (non-seed) addresses held.
pub const MAX_LEARNT: usize = 256;
/// The most addresses taken from one hello or gossip frame.
pub const MAX_LEARNT_PER_FRAME: usize = 64;
/// Failed dials in a row after which a learnt address is dropped.
pub const PRUNE_AFTER_FAILURES: u32 = 20;
/// The first retry delay after a failure.
pub const MIN_BACKOFF: Duration = Duration::from_millis(200);
/// The longest retry delay.
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Exponential backoff: the next delay after `prev`.
pub fn next_backoff(prev: Duration) -> Duration {
    (prev * 2).clamp(MIN_BACKOFF, MAX_BACKOFF)
}

#[derive(Debug, Clone)]
struct Target {
    seed: bool,
    backoff: Duration,
    next: Instant,
    dialing: bool,
    failures: u32,
    /// The name found at this address (this node, or a peer reached under another address).
    name: Option<String>,
}

impl Target {
    fn new(seed: bool, now: Instant) -> Self {
        Target {
            seed,
            backoff: Duration::ZERO,
            next: now,
            dialing: false,
            failures: 0,
            name: None,
        }
    }
}

/// What [`DialTable::learn`] did with a frame of addresses.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Learnt {
    /// New addresses taken.
    pub added: usize,
    /// Addresses left out: past the per-frame cap, or the table was full.
    pub refused: usize,
}

/// What a dial's end did to its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDial {
    /// Connected; the backoff is reset.
    Connected,
    /// Failed; the next try comes after this delay.
    Retry(Duration),
    /// Failed too often: the learnt address was dropped.
    Pruned,
    /// The address is no longer in the table.
    Unknown,
}

/// The addresses a node dials.
#[derive(Debug, Clone, Default)]
pub struct DialTable {
    targets: HashMap<SocketAddr, Target>,
}

impl DialTable {
    /// A table holding the config's seeds, each due at once.
    pub fn new(seeds: impl IntoIterator<Item = SocketAddr>, now: Instant) -> Self {
        let targets = seeds
            .into_iter()
            .map(|a| (a, Target::new(true, now)))
            .collect();
        DialTable { targets }
    }

    /// Takes the new addresses of one frame, within [`MAX_LEARNT_PER_FRAME`] and
    /// [`MAX_LEARNT`]; addresses already held are left as they are.
    pub fn learn(&mut self, addrs: impl IntoIterator<Item = SocketAddr>, now: Instant) -> Learnt {
        let mut learnt = Learnt::default();
        let mut held = self.targets.values().filter(|t| !t.seed).count();
        for (i, addr) in addrs.into_iter().enumerate() {
            if self.targets.contains_key(&addr) {
                continue;
            }
            if i >= MAX_LEARNT_PER_FRAME || held >= MAX_LEARNT {
                learnt.refused += 1;
                continue;
            }
            self.targets.insert(addr, Target::new(false, now));
            held += 1;
            learnt.added += 1;
        }
        learnt
    }

    /// Records the name of the node found at `addr`.
    pub fn set_name(&mut self, addr: SocketAddr, name: &str) {
        if let Some(t) = self.targets.get_mut(&addr) {
            t.name = Some(name.to_string());
        }
    }

    /// The addresses to dial now, each marked as being dialed. `live(addr, name)` says whether
    /// the node at an address (or under the name found there) is connected or is this node:
    /// those are not dialed, and their backoff is reset.
    pub fn due(
        &mut self,
        now: Instant,
        live: impl Fn(&SocketAddr, Option<&str>) -> bool,
    ) -> Vec<SocketAddr> {
        let mut due = Vec::new();
        for (addr, t) in self.targets.iter_mut() {
            if t.dialing {
                continue;
            }
            if live(addr, t.name.as_deref()) {
                t.backoff = Duration::ZERO;
                t.failures = 0;
                continue;
            }
            if now >= t.next {
                t.dialing = true;
                due.push(*addr);
            }
        }
        due.sort();
        due
    }

    /// Records the end of a dial to `addr` started by [`due`](Self::due).
    pub fn dialed(&mut self, addr: SocketAddr, ok: bool, now: Instant) -> AfterDial {
        let Some(t) = self.targets.get_mut(&addr) else {
            return AfterDial::Unknown;
        };
        t.dialing = false;
        if ok {
            t.backoff = Duration::ZERO;
            t.failures = 0;
            return AfterDial::Connected;
        }
        t.failures += 1;
        if !t.seed && t.failures >= PRUNE_AFTER_FAILURES {
            self.targets.remove(&addr);
            return AfterDial::Pruned;
        }
        t.backoff = next_backoff(t.backoff);
        t.next = now + t.backoff;
        AfterDial::Retry(t.backoff)
    }

    /// Addresses held (seeds included).
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether no address is held.
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Whether `addr` is held.
    pub fn contains(&self, addr: &SocketAddr) -> bool {
        self.targets.contains_key(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(i: u32) -> SocketAddr {
        SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 7000))
    }

    fn none_live(_: &SocketAddr, _: Option<&str>) -> bool {
        false
    }

    #[test]
    fn seeds_are_due_at_once_and_not_twice_while_dialing() {
        let t0 = Instant::now();
        let mut d = DialTable::new([addr(1), addr(2)], t0);
        assert_eq!(d.due(t0, none_live), vec![addr(1), addr(2)]);
        assert!(d.due(t0 + Duration::from_secs(10), none_live).is_empty());
    }

    #[test]
    fn failures_back_off_doubling_to_the_cap_and_a_success_resets() {
        let t0 = Instant::now();
        let mut d = DialTable::new([addr(1)], t0);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..6 {
            assert_eq!(d.due(now, none_live), vec![addr(1)]);
            match d.dialed(addr(1), false, now) {
                AfterDial::Retry(b) => {
                    assert!(d
                        .due(now + b - Duration::from_millis(1), none_live)
                        .is_empty());
                    delays.push(b);
                    now += b;
                }
                other => panic!("{other:?}"),
            }
        }
        let ms: Vec<u128> = delays.iter().map(|b| b.as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(d.due(now, none_live), vec![addr(1)]);
        assert_eq!(d.dialed(addr(1), true, now), AfterDial::Connected);
        assert_eq!(d.due(now, none_live), vec![addr(1)]);
        assert_eq!(
            d.dialed(addr(1), false, now),
            AfterDial::Retry(MIN_BACKOFF),
            "the backoff starts over after a success"
        );
    }

    #[test]
    fn live_peers_and_this_node_are_not_dialed() {
        let t0 = Instant::now();
        let mut d = DialTable::new([addr(1), addr(2), addr(3)], t0);
        d.set_name(addr(2), "b");
        d.set_name(addr(3), "me");
        let live = |a: &SocketAddr, n: Option<&str>| *a == addr(1) || matches!(n, Some("b" | "me"));
        assert!(d.due(t0, live).is_empty());
        assert_eq!(d.due(t0, none_live), vec![addr(1), addr(2), addr(3)]);
    }

    #[test]
    fn one_frame_and_the_table_are_capped() {
        let t0 = Instant::now();
        let mut d = DialTable::new([addr(0)], t0);
        let l = d.learn((1..=100_000).map(addr), t0);
        assert_eq!(
            l,
            Learnt {
                added: MAX_LEARNT_PER_FRAME,
                refused: 100_000 - MAX_LEARNT_PER_FRAME
            }
        );
        let mut next = 100_001;
        while d.len() < MAX_LEARNT + 1 {
            d.learn((next..next + MAX_LEARNT_PER_FRAME as u32).map(addr), t0);
            next += MAX_LEARNT_PER_FRAME as u32;
        }
        assert_eq!(d.len(), MAX_LEARNT + 1, "the seed and MAX_LEARNT learnt");
        let l = d.learn([addr(next)], t0);
        assert_eq!(
            l,
            Learnt {
                added: 0,
                refused: 1
            }
        );
        // Known addresses are neither counted nor refused.
        assert_eq!(d.learn([addr(0), addr(1)], t0), Learnt::default());
    }

    #[test]
    fn learnt_addresses_that_never_answer_are_pruned_and_seeds_are_kept() {
        let t0 = Instant::now();
        let mut d = DialTable::new([addr(1)], t0);
        d.learn([addr(2)], t0);
        let mut now = t0;
        let mut pruned_after = None;
        for round in 1..=PRUNE_AFTER_FAILURES + 5 {
            for a in d.due(now, none_live) {
                if d.dialed(a, false, now) == AfterDial::Pruned {
                    assert_eq!(a, addr(2));
                    pruned_after = Some(round);
                }
            }
            now += MAX_BACKOFF;
        }
        assert_eq!(pruned_after, Some(PRUNE_AFTER_FAILURES));
        assert!(!d.contains(&addr(2)) && d.contains(&addr(1)));
        assert_eq!(d.dialed(addr(2), false, now), AfterDial::Unknown);
        // A pruned address can be learnt again, and room was made for it.
        assert_eq!(d.learn([addr(2)], now).added, 1);
    }

    #[test]
    fn a_success_clears_the_failures_that_would_prune() {
        let t0 = Instant::now();
        let mut d = DialTable::new([], t0);
        d.learn([addr(2)], t0);
        let mut now = t0;
        for i in 0..3 * PRUNE_AFTER_FAILURES {
            assert_eq!(d.due(now, none_live), vec![addr(2)]);
            let ok = i % (PRUNE_AFTER_FAILURES - 1) == 0;
            assert_ne!(d.dialed(addr(2), ok, now), AfterDial::Pruned);
            now += MAX_BACKOFF;
        }
    }
}
