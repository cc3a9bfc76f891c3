//! The bounded blob store of one node. It holds complete, verified blobs up to a byte capacity,
//! counting also the bytes reserved by transfers in flight (whose size the manifest gives up
//! front). Making room evicts the least recently used complete blobs; when eviction cannot make
//! room the reservation is refused. Blobs can also be removed explicitly. Evicting a blob only
//! drops the store's reference: a holder of its `Bytes` keeps it alive. A pinned blob is never
//! evicted, only removed ([`Store::pin`]): what a job must keep serving until it ends. A blob a
//! peer pushes counts against that peer's quota, in flight and once stored: a push that would
//! take the peer past it first evicts that peer's own least recently used pushes, and is refused
//! when what the peer holds in flight or pinned leaves no room. So one peer can neither take the
//! whole store nor evict other peers' blobs by pushing more ([`Store::reserve_pushed`]).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::manifest::{BlobId, Manifest};

/// Why the store cannot take a blob.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// The blob alone is larger than the whole store.
    #[error("blob of {size} bytes is larger than the store's capacity of {capacity} bytes")]
    TooLarge {
        /// Blob size.
        size: u64,
        /// Store capacity.
        capacity: u64,
    },
    /// Transfers in flight hold too much of the store to make room.
    #[error("store full: {size} bytes needed, {free} free after evicting every stored blob ({in_flight} bytes reserved by transfers in flight)")]
    Full {
        /// Blob size.
        size: u64,
        /// Bytes free after evicting everything evictable (every blob not pinned).
        free: u64,
        /// Bytes reserved by transfers in flight.
        in_flight: u64,
    },
    /// The pushing peer's transfers in flight and pinned pushes already hold its quota.
    #[error("peer `{peer}` holds {held} bytes of pushes in flight or pinned; {size} more would pass its quota of {quota} bytes")]
    PeerQuota {
        /// The pushing peer.
        peer: String,
        /// Bytes its pushes in flight and its pinned pushes hold.
        held: u64,
        /// Blob size.
        size: u64,
        /// Its quota.
        quota: u64,
    },
}

struct Entry {
    manifest: Arc<Manifest>,
    bytes: Bytes,
    last_use: u64,
    /// Never evicted (removed only explicitly).
    pinned: bool,
    /// The peer whose push stored it (`None`: published here, or fetched by this node).
    pushed_by: Option<String>,
}

/// A byte-bounded LRU store of complete blobs plus reservations for blobs in flight.
pub(crate) struct Store {
    capacity: u64,
    stored: u64,
    reserved: u64,
    clock: u64,
    blobs: HashMap<BlobId, Entry>,
    /// Bytes reserved by each peer's pushes in flight (peers holding none are left out).
    pushed: HashMap<String, u64>,
}

impl Store {
    /// An empty store holding at most `capacity` bytes.
    pub(crate) fn new(capacity: u64) -> Store {
        Store {
            capacity,
            stored: 0,
            reserved: 0,
            clock: 0,
            blobs: HashMap::new(),
            pushed: HashMap::new(),
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Whether `size` more bytes fit once every unpinned blob is evicted (reservations in
    /// flight and pinned blobs stay).
    fn check_room(&self, size: u64) -> Result<(), StoreError> {
        if size > self.capacity {
            return Err(StoreError::TooLarge {
                size,
                capacity: self.capacity,
            });
        }
        let pinned: u64 = self
            .blobs
            .values()
            .filter(|e| e.pinned)
            .map(|e| e.bytes.len() as u64)
            .sum();
        let free = self.capacity - self.reserved.min(self.capacity);
        let free = free - pinned.min(free);
        if free < size {
            return Err(StoreError::Full {
                size,
                free,
                in_flight: self.reserved,
            });
        }
        Ok(())
    }

    /// Reserves `size` bytes for a blob in flight, evicting least recently used blobs as
    /// needed. Returns the evicted ids.
    pub(crate) fn reserve(&mut self, size: u64) -> Result<Vec<BlobId>, StoreError> {
        self.check_room(size)?;
        let mut evicted = Vec::new();
        while self.stored + self.reserved + size > self.capacity {
            let oldest = self
                .blobs
                .iter()
                .filter(|(_, e)| !e.pinned)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(id, _)| *id)
                .expect("unpinned stored bytes make the room, as checked");
            self.remove(&oldest);
            evicted.push(oldest);
        }
        self.reserved += size;
        Ok(evicted)
    }

    /// [`reserve`](Self::reserve) for a blob `peer` pushes, held to `quota` bytes of the
    /// peer's pushes in flight and stored: the peer's own least recently used unpinned pushes
    /// are evicted first to keep it there; refused when its pushes in flight and pinned leave no
    /// room, or the store cannot take the blob (nothing is evicted then). The caller gives the
    /// peer's in-flight share back with [`release_pushed`](Self::release_pushed) when the
    /// transfer ends, however it ends, and stores the blob under the peer with
    /// [`commit_pushed`](Self::commit_pushed).
    pub(crate) fn reserve_pushed(
        &mut self,
        peer: &str,
        quota: u64,
        size: u64,
    ) -> Result<Vec<BlobId>, StoreError> {
        let in_flight = self.pushed.get(peer).copied().unwrap_or(0);
        let own = |pinned: bool| -> u64 {
            self.blobs
                .values()
                .filter(|e| e.pushed_by.as_deref() == Some(peer) && e.pinned == pinned)
                .map(|e| e.bytes.len() as u64)
                .sum()
        };
        let (own_pinned, mut own_stored) = (own(true), own(false));
        let held = in_flight.saturating_add(own_pinned);
        if held.saturating_add(size) > quota {
            return Err(StoreError::PeerQuota {
                peer: peer.to_string(),
                held,
                size,
                quota,
            });
        }
        self.check_room(size)?;
        let mut evicted = Vec::new();
        while held + own_stored + size > quota {
            let oldest = self
                .blobs
                .iter()
                .filter(|(_, e)| !e.pinned && e.pushed_by.as_deref() == Some(peer))
                .min_by_key(|(_, e)| e.last_use)
                .map(|(id, e)| (*id, e.bytes.len() as u64))
                .expect("the peer's unpinned pushes make its room, as checked");
            self.remove(&oldest.0);
            own_stored -= oldest.1;
            evicted.push(oldest.0);
        }
        evicted.extend(self.reserve(size)?);
        *self.pushed.entry(peer.to_string()).or_insert(0) += size;
        Ok(evicted)
    }

    /// Gives back `size` bytes of `peer`'s quota (its push ended).
    pub(crate) fn release_pushed(&mut self, peer: &str, size: u64) {
        if let Some(held) = self.pushed.get_mut(peer) {
            *held = held.saturating_sub(size);
            if *held == 0 {
                self.pushed.remove(peer);
            }
        }
    }

    /// Gives back a reservation of `size` bytes (transfer failed or blob already stored).
    pub(crate) fn release(&mut self, size: u64) {
        debug_assert!(self.reserved >= size);
        self.reserved = self.reserved.saturating_sub(size);
    }

    /// Turns a reservation of `bytes.len()` bytes into a stored blob. If the blob is already
    /// stored, the reservation is just released.
    pub(crate) fn commit(&mut self, manifest: Arc<Manifest>, bytes: Bytes) {
        self.store(manifest, bytes, None);
    }

    /// [`commit`](Self::commit) for a blob `peer` pushed: stored, it counts against the peer's
    /// quota (a blob already stored keeps whoever stored it first).
    pub(crate) fn commit_pushed(&mut self, peer: &str, manifest: Arc<Manifest>, bytes: Bytes) {
        self.store(manifest, bytes, Some(peer.to_string()));
    }

    fn store(&mut self, manifest: Arc<Manifest>, bytes: Bytes, pushed_by: Option<String>) {
        let size = bytes.len() as u64;
        self.release(size);
        let id = manifest.id();
        let now = self.tick();
        if let Some(e) = self.blobs.get_mut(&id) {
            e.last_use = now;
            return;
        }
        self.stored += size;
        self.blobs.insert(
            id,
            Entry {
                manifest,
                bytes,
                last_use: now,
                pinned: false,
                pushed_by,
            },
        );
    }

    /// Keeps the stored blob `id` from eviction until it is removed; false if it is not stored.
    pub(crate) fn pin(&mut self, id: &BlobId) -> bool {
        self.blobs.get_mut(id).map(|e| e.pinned = true).is_some()
    }

    /// The blob's manifest and bytes, marking it recently used.
    pub(crate) fn get(&mut self, id: &BlobId) -> Option<(Arc<Manifest>, Bytes)> {
        let now = self.tick();
        let e = self.blobs.get_mut(id)?;
        e.last_use = now;
        Some((e.manifest.clone(), e.bytes.clone()))
    }

    /// True when the blob is stored.
    pub(crate) fn contains(&self, id: &BlobId) -> bool {
        self.blobs.contains_key(id)
    }

    /// Drops the blob from the store; false if it was not there.
    pub(crate) fn remove(&mut self, id: &BlobId) -> bool {
        match self.blobs.remove(id) {
            Some(e) => {
                self.stored -= e.bytes.len() as u64;
                true
            }
            None => false,
        }
    }

    /// Bytes held by stored blobs.
    pub(crate) fn stored_bytes(&self) -> u64 {
        self.stored
    }

    /// Bytes reserved by transfers in flight.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    /// Number of stored blobs.
    pub(crate) fn len(&self) -> usize {
        self.blobs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(n: usize, seed: u8) -> (Arc<Manifest>, Bytes) {
        let data: Vec<u8> = (0..n).map(|i| seed.wrapping_add(i as u8)).collect();
        (
            Arc::new(Manifest::build(&data, 4096).unwrap()),
            Bytes::from(data),
        )
    }

    fn put(s: &mut Store, b: &(Arc<Manifest>, Bytes)) -> Vec<BlobId> {
        let ev = s.reserve(b.1.len() as u64).unwrap();
        s.commit(b.0.clone(), b.1.clone());
        ev
    }

    #[test]
    fn evicts_least_recently_used_to_make_room() {
        let mut s = Store::new(3000);
        let (a, b, c) = (blob(1000, 1), blob(1000, 2), blob(1000, 3));
        put(&mut s, &a);
        put(&mut s, &b);
        put(&mut s, &c);
        assert_eq!(s.stored_bytes(), 3000);
        assert!(s.get(&a.0.id()).is_some()); // a is now more recent than b
        let d = blob(1500, 4);
        let evicted = put(&mut s, &d);
        assert_eq!(evicted, vec![b.0.id(), c.0.id()]);
        assert!(s.contains(&a.0.id()) && s.contains(&d.0.id()));
        assert_eq!(s.stored_bytes(), 2500);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn pinned_blobs_are_never_evicted_only_removed() {
        let mut s = Store::new(3000);
        let (a, b) = (blob(1000, 1), blob(1000, 2));
        put(&mut s, &a);
        put(&mut s, &b);
        assert!(s.pin(&a.0.id()));
        assert!(
            !s.pin(&blob(10, 9).0.id()),
            "only a stored blob can be pinned"
        );
        // `a` is the least recently used, but pinned: `b` goes instead.
        assert_eq!(put(&mut s, &blob(2000, 3)), vec![b.0.id()]);
        assert!(s.contains(&a.0.id()));
        // No room without evicting `a`: refused, and nothing was evicted for it.
        let before = s.len();
        let e = s.reserve(2500).unwrap_err();
        assert!(matches!(e, StoreError::Full { free: 2000, .. }), "{e}");
        assert_eq!(s.len(), before);
        // Removing is still possible.
        assert!(s.remove(&a.0.id()));
        assert_eq!(s.reserve(2500).unwrap().len(), 1);
    }

    #[test]
    fn reservations_in_flight_are_never_evicted() {
        let mut s = Store::new(3000);
        s.reserve(2000).unwrap();
        assert_eq!(
            s.reserve(1500),
            Err(StoreError::Full {
                size: 1500,
                free: 1000,
                in_flight: 2000
            })
        );
        s.release(2000);
        assert_eq!(s.reserved_bytes(), 0);
        s.reserve(1500).unwrap();
    }

    #[test]
    fn a_peer_holds_at_most_its_quota_in_flight() {
        let mut s = Store::new(10_000);
        s.reserve_pushed("p", 3000, 2000).unwrap();
        assert_eq!(
            s.reserve_pushed("p", 3000, 1500),
            Err(StoreError::PeerQuota {
                peer: "p".into(),
                held: 2000,
                size: 1500,
                quota: 3000
            })
        );
        // Another peer has its own quota.
        s.reserve_pushed("q", 3000, 3000).unwrap();
        // A push that ends gives its share back.
        s.release_pushed("p", 2000);
        s.release(2000);
        s.reserve_pushed("p", 3000, 3000).unwrap();
        assert_eq!(s.reserved_bytes(), 6000);
        // A refused reservation takes nothing.
        assert!(s.reserve_pushed("p", 3000, 1).is_err());
        assert_eq!(s.reserved_bytes(), 6000);
    }

    #[test]
    fn a_peers_stored_pushes_count_against_its_quota_and_evict_its_own_first() {
        let mut s = Store::new(10_000);
        let push = |s: &mut Store, peer: &str, b: &(Arc<Manifest>, Bytes)| {
            let size = b.1.len() as u64;
            let evicted = s.reserve_pushed(peer, 3000, size)?;
            s.commit_pushed(peer, b.0.clone(), b.1.clone());
            s.release_pushed(peer, size);
            Ok::<_, StoreError>(evicted)
        };
        // Another peer's blob and a local one, older than anything p pushes.
        let (q1, local) = (blob(2000, 1), blob(2000, 2));
        push(&mut s, "q", &q1).unwrap();
        put(&mut s, &local);
        let (p1, p2, p3) = (blob(2000, 3), blob(1000, 4), blob(1500, 5));
        assert!(push(&mut s, "p", &p1).unwrap().is_empty());
        assert!(push(&mut s, "p", &p2).unwrap().is_empty());
        // p holds 3000 stored: its next push evicts its own oldest (p1), though q1 and the
        // local blob are older and the store has room.
        assert_eq!(push(&mut s, "p", &p3).unwrap(), vec![p1.0.id()]);
        assert!(s.contains(&q1.0.id()) && s.contains(&local.0.id()));
        assert!(s.contains(&p2.0.id()) && s.contains(&p3.0.id()));
        // A pinned push stays and counts: with p2 pinned, p3 goes for the next one, and a push
        // that only evicting p2 could fit is refused, evicting nothing.
        assert!(s.pin(&p2.0.id()));
        let p4 = blob(2000, 6);
        assert_eq!(push(&mut s, "p", &p4).unwrap(), vec![p3.0.id()]);
        let before = s.len();
        assert!(matches!(
            push(&mut s, "p", &blob(2500, 7)),
            Err(StoreError::PeerQuota { held: 1000, .. })
        ));
        assert_eq!(s.len(), before);
    }

    #[test]
    fn too_large_and_remove() {
        let mut s = Store::new(100);
        assert!(matches!(s.reserve(101), Err(StoreError::TooLarge { .. })));
        let mut s = Store::new(10_000);
        let a = blob(1000, 1);
        put(&mut s, &a);
        assert!(s.remove(&a.0.id()));
        assert!(!s.remove(&a.0.id()));
        assert_eq!(s.stored_bytes(), 0);
    }

    #[test]
    fn committing_a_stored_blob_twice_counts_it_once() {
        let mut s = Store::new(10_000);
        let a = blob(1000, 1);
        put(&mut s, &a);
        put(&mut s, &a);
        assert_eq!(s.stored_bytes(), 1000);
        assert_eq!(s.reserved_bytes(), 0);
    }
}
