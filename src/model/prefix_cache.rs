//! The prefix cache's bookkeeping, pure and clock-free: which blocks of prompt tokens have
//! cached keys and values, how a prompt finds its longest cached prefix, and which blocks make
//! room when the memory budget is full. The engine stores the tensors as the blocks' values.
//!
//! A prompt is cut into blocks of `block_tokens` tokens, and only whole blocks are cached. A
//! block stands for its tokens *and* everything before them: its key chains the parent block's
//! key with its own tokens (as vLLM's automatic prefix caching does), and an entry keeps its
//! parent and tokens, so a hash collision can never hand out another prefix's values.
//!
//! Rules:
//! - A lookup covers at most `prompt.len() − 1` tokens: the last prompt token is always run, as
//!   its logits give the first sampled token.
//! - Recency is a logical counter bumped on every lookup and insert. Eviction takes the least
//!   recently used *leaf* (a block no cached block extends) that is not pinned, so a cached
//!   chain never has a hole and blocks a prefill is reading stay.
//! - The budget bounds the bytes of cached values; a block that cannot fit (everything else is
//!   pinned, or it alone exceeds the budget) is not cached, nor anything after it.
//!
//! Namespaces: keys and values depend on the weights that computed them, so every block belongs
//! to a namespace (an engine gives each set of weights it serves, base or adapter, its own), a
//! lookup finds only blocks of its own namespace, and [`PrefixIndex::forget`] drops a whole
//! namespace when its weights are no longer served.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// A block's key: the hash of its parent's key and its tokens.
pub type BlockKey = u64;

struct Entry<T> {
    ns: u64,
    parent: Option<BlockKey>,
    tokens: Vec<u32>,
    value: T,
    bytes: usize,
    last_use: u64,
    pins: usize,
    children: usize,
}

/// Counters since the index was made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefixStats {
    /// Lookups made.
    pub lookups: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens: u64,
    /// Blocks cached.
    pub inserted: u64,
    /// Blocks evicted to make room.
    pub evicted: u64,
    /// Blocks not cached because nothing evictable made room.
    pub refused: u64,
}

/// A lookup's result: the cached chain, pinned until [`PrefixIndex::unpin`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    /// The chain's keys, first block first.
    pub keys: Vec<BlockKey>,
    /// Prompt tokens the chain covers (`keys.len() · block_tokens`).
    pub tokens: usize,
}

/// Cached blocks of token prefixes with values `T`, bounded by a byte budget.
pub struct PrefixIndex<T> {
    block_tokens: usize,
    budget_bytes: usize,
    used_bytes: usize,
    clock: u64,
    entries: HashMap<BlockKey, Entry<T>>,
    stats: PrefixStats,
}

fn key_of(ns: u64, parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    let mut h = DefaultHasher::new();
    ns.hash(&mut h);
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl<T> PrefixIndex<T> {
    /// An empty index of blocks of `block_tokens` (at least 1) tokens holding at most
    /// `budget_bytes` of values.
    pub fn new(block_tokens: usize, budget_bytes: usize) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            budget_bytes,
            used_bytes: 0,
            clock: 0,
            entries: HashMap::new(),
            stats: PrefixStats::default(),
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Bytes of values cached now.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// Blocks cached now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Counters since the index was made.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// The entry for block `tokens` after `parent` in namespace `ns`, if cached (namespace,
    /// tokens and parent compared, not only the hash).
    fn find(&self, ns: u64, parent: Option<BlockKey>, tokens: &[u32]) -> Option<BlockKey> {
        let key = key_of(ns, parent, tokens);
        let e = self.entries.get(&key)?;
        (e.ns == ns && e.parent == parent && e.tokens == tokens).then_some(key)
    }

    /// The longest cached chain of whole blocks of namespace `ns` that starts `prompt` and
    /// leaves at least its last token uncovered. Its blocks are pinned (never evicted) until
    /// [`Self::unpin`].
    pub fn lookup(&mut self, ns: u64, prompt: &[u32]) -> Hit {
        self.stats.lookups += 1;
        self.clock += 1;
        let usable = prompt.len().saturating_sub(1) / self.block_tokens;
        let mut keys = Vec::new();
        let mut parent = None;
        for block in prompt.chunks_exact(self.block_tokens).take(usable) {
            let Some(key) = self.find(ns, parent, block) else {
                break;
            };
            let e = self.entries.get_mut(&key).expect("found");
            e.pins += 1;
            e.last_use = self.clock;
            keys.push(key);
            parent = Some(key);
        }
        let tokens = keys.len() * self.block_tokens;
        self.stats.hit_tokens += tokens as u64;
        Hit { keys, tokens }
    }

    /// The value of a cached block (one a pinned [`Hit`] names).
    pub fn value(&self, key: BlockKey) -> Option<&T> {
        self.entries.get(&key).map(|e| &e.value)
    }

    /// Releases the pins of a [`Hit`].
    pub fn unpin(&mut self, hit: &Hit) {
        for key in &hit.keys {
            if let Some(e) = self.entries.get_mut(key) {
                e.pins = e.pins.saturating_sub(1);
            }
        }
    }

    /// Caches the whole blocks of `prompt` in namespace `ns` from block `first` on (those before
    /// it must be cached: they are the hit the prompt was prefilled after). `make(i)` gives
    /// block `i`'s value and its size in bytes. Blocks already cached are kept (and refreshed).
    /// Returns the number of blocks added; stops at the first block that cannot be made room
    /// for.
    pub fn insert(
        &mut self,
        ns: u64,
        prompt: &[u32],
        first: usize,
        mut make: impl FnMut(usize) -> (T, usize),
    ) -> usize {
        self.clock += 1;
        let mut parent = None;
        let mut added = 0;
        for (i, block) in prompt.chunks_exact(self.block_tokens).enumerate() {
            if let Some(key) = self.find(ns, parent, block) {
                self.entries.get_mut(&key).expect("found").last_use = self.clock;
                parent = Some(key);
                continue;
            }
            if i < first {
                // The chain before `first` was evicted meanwhile: nothing after it can hang.
                break;
            }
            let key = key_of(ns, parent, block);
            if self.entries.contains_key(&key) {
                // A hash collision with another prefix's block: keep that one.
                break;
            }
            let (value, bytes) = make(i);
            // The parent is pinned while room is made, so the new block's chain stays whole.
            if let Some(p) = parent {
                self.entries.get_mut(&p).expect("parent").pins += 1;
            }
            let fits = self.make_room(bytes);
            if let Some(p) = parent {
                self.entries.get_mut(&p).expect("parent").pins -= 1;
            }
            if !fits {
                self.stats.refused += 1;
                break;
            }
            if let Some(p) = parent {
                self.entries.get_mut(&p).expect("parent").children += 1;
            }
            self.entries.insert(
                key,
                Entry {
                    ns,
                    parent,
                    tokens: block.to_vec(),
                    value,
                    bytes,
                    last_use: self.clock,
                    pins: 0,
                    children: 0,
                },
            );
            self.used_bytes += bytes;
            self.stats.inserted += 1;
            added += 1;
            parent = Some(key);
        }
        added
    }

    /// Drops every block of namespace `ns` (pinned ones too: a namespace is forgotten only when
    /// nothing reads it). Returns the number of blocks dropped.
    pub fn forget(&mut self, ns: u64) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, e| e.ns != ns);
        // A block's parent is always of its own namespace, so no surviving block lost a child.
        self.used_bytes = self.entries.values().map(|e| e.bytes).sum();
        before - self.entries.len()
    }

    /// Evicts least recently used unpinned leaves until `bytes` more fit; false if they cannot.
    fn make_room(&mut self, bytes: usize) -> bool {
        if bytes > self.budget_bytes {
            return false;
        }
        while self.used_bytes + bytes > self.budget_bytes {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.children == 0 && e.pins == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k);
            let Some(key) = victim else {
                return false;
            };
            let e = self.entries.remove(&key).expect("victim");
            self.used_bytes -= e.bytes;
            self.stats.evicted += 1;
            if let Some(p) = e.parent {
                if let Some(pe) = self.entries.get_mut(&p) {
                    pe.children -= 1;
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values are the block index; each block costs 10 bytes.
    fn fill(ix: &mut PrefixIndex<usize>, prompt: &[u32], first: usize) -> usize {
        ix.insert(0, prompt, first, |i| (i, 10))
    }

    fn prompt(start: u32, len: usize) -> Vec<u32> {
        (start..start + len as u32).collect()
    }

    #[test]
    fn a_prompt_finds_its_longest_cached_prefix_of_whole_blocks() {
        let mut ix = PrefixIndex::new(4, 1000);
        let p = prompt(0, 10); // blocks [0..4), [4..8); 2 tokens left over
        assert_eq!(fill(&mut ix, &p, 0), 2);
        // The same prompt reuses both blocks; the last token is never covered.
        let hit = ix.lookup(0, &p);
        assert_eq!(hit.tokens, 8);
        assert_eq!(
            hit.keys
                .iter()
                .map(|k| ix.value(*k).copied())
                .collect::<Vec<_>>(),
            [Some(0), Some(1)]
        );
        ix.unpin(&hit);
        // An 8-token prompt may reuse one block only (its last token must run).
        assert_eq!(ix.lookup(0, &p[..8]).tokens, 4);
        // A prompt that differs in the second block reuses the first.
        let mut q = p.clone();
        q[5] = 99;
        assert_eq!(ix.lookup(0, &q).tokens, 4);
        // A different first token reuses nothing: a block stands for everything before it.
        let mut r = p.clone();
        r[0] = 99;
        assert_eq!(ix.lookup(0, &r).tokens, 0);
        // Extending the prompt adds only the new blocks.
        let longer = prompt(0, 13);
        assert_eq!(fill(&mut ix, &longer, 2), 1);
        assert_eq!(ix.lookup(0, &longer).tokens, 12);
        assert_eq!(ix.stats().inserted, 3);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_leaf_and_keeps_chains_whole() {
        let mut ix = PrefixIndex::new(2, 40); // four blocks of 10 bytes
        let a = prompt(0, 7); // 3 blocks and a last token
        let b = prompt(100, 3); // 1 block
        fill(&mut ix, &a, 0);
        fill(&mut ix, &b, 0);
        assert_eq!(ix.used_bytes(), 40);
        // `a` is used again: `b` is now the least recently used leaf.
        let hit = ix.lookup(0, &a);
        ix.unpin(&hit);
        let c = prompt(200, 3);
        assert_eq!(fill(&mut ix, &c, 0), 1);
        assert_eq!(ix.lookup(0, &b).tokens, 0, "b was evicted");
        // Next the leaf of `a`'s chain goes, never a block with a cached child.
        let d = prompt(300, 3);
        fill(&mut ix, &d, 0);
        assert_eq!(ix.lookup(0, &a).tokens, 4, "a lost only its last block");
        assert_eq!(ix.stats().evicted, 2);
        assert!(ix.used_bytes() <= 40);
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let mut ix = PrefixIndex::new(2, 20);
        let a = prompt(0, 5); // 2 blocks: fills the budget
        fill(&mut ix, &a, 0);
        let hit = ix.lookup(0, &a);
        assert_eq!(hit.tokens, 4);
        // Everything is pinned: a new block is refused, and `a` stays whole.
        assert_eq!(fill(&mut ix, &prompt(50, 3), 0), 0);
        assert_eq!(ix.stats().refused, 1);
        ix.unpin(&hit);
        assert_eq!(ix.lookup(0, &a).tokens, 4);
        // A block larger than the whole budget is never cached.
        let mut big = PrefixIndex::new(2, 5);
        assert_eq!(fill(&mut big, &a, 0), 0);
        assert!(big.is_empty());
    }

    #[test]
    fn a_new_block_keeps_its_own_parent_while_room_is_made() {
        // Budget for two blocks: extending `a` must evict `b`, never `a`'s own first block,
        // though that is older.
        let mut ix = PrefixIndex::new(2, 20);
        fill(&mut ix, &prompt(0, 2), 0);
        fill(&mut ix, &prompt(100, 2), 0);
        assert_eq!(fill(&mut ix, &prompt(0, 5), 1), 1);
        assert_eq!(ix.lookup(0, &prompt(0, 5)).tokens, 4);
        assert_eq!(ix.lookup(0, &prompt(100, 3)).tokens, 0);
    }

    #[test]
    fn namespaces_never_share_blocks_and_are_forgotten_whole() {
        let mut ix = PrefixIndex::new(2, 1000);
        let a = prompt(0, 5);
        assert_eq!(ix.insert(1, &a, 0, |i| (i, 10)), 2);
        // The same tokens under other weights are another prefix.
        assert_eq!(ix.lookup(2, &a).tokens, 0);
        assert_eq!(ix.insert(2, &a, 0, |i| (i + 10, 10)), 2);
        let hit = ix.lookup(1, &a);
        assert_eq!(hit.tokens, 4);
        assert_eq!(ix.value(hit.keys[0]), Some(&0));
        ix.unpin(&hit);
        assert_eq!(ix.forget(1), 2);
        assert_eq!(ix.lookup(1, &a).tokens, 0);
        assert_eq!(ix.lookup(2, &a).tokens, 4, "the other namespace stays");
        assert_eq!(ix.used_bytes(), 20);
    }

    #[test]
    fn an_insert_after_its_prefix_was_evicted_adds_nothing_detached() {
        let mut ix = PrefixIndex::new(2, 100);
        let a = prompt(0, 7);
        // Claims block 0 was a hit, but nothing is cached: no block may hang without it.
        assert_eq!(fill(&mut ix, &a, 1), 0);
        assert!(ix.is_empty());
    }
}
