//! Shared-prefix packing of a trainer batch: which samples share a token prefix, and the
//! sequences the forward pass runs instead of one padded row per sample. Pure data, no Burn.
//!
//! Real agent traffic repeats long prefixes (a 12k-token system prompt and tool list, or the
//! earlier turns of a session) before short answers. A *group* runs its shared prefix through the
//! model once, as one sequence, and each member's remainder as a row that continues it: the
//! remainder's positions start at the prefix's length, and it attends to the whole prefix and
//! causally to itself, never to another row. Attention is causal, so the prefix's hidden states
//! do not depend on what follows it, and every hidden state of a member equals the one its
//! unpacked sequence gives at the same position: packing changes the arithmetic's order, never
//! the result.
//!
//! Samples that share no prefix worth a pass of its own go in one *plain* group (prefix length 0)
//! of whole sequences, right-padded together, which is the unpacked layout.

use super::batch::{BatchLayout, Sample};

/// The shortest shared prefix worth its own group: each group is one more pass through the
/// layers, so a prefix of a few tokens saves less than that pass costs.
pub const MIN_PREFIX: usize = 16;

/// One sequence group of a packed batch.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedGroup {
    /// The shared prefix's token ids, `[prefix_len]` (empty for the plain group).
    pub prefix: Vec<i64>,
    /// Each member's tokens after the prefix, right-padded: `[rows, len]`.
    pub rest: Vec<i64>,
    /// Members, in row order (indices into the batch).
    pub members: Vec<usize>,
    /// Padded length of a row of `rest`.
    pub len: usize,
}

impl PackedGroup {
    /// Rows of `rest`.
    pub fn rows(&self) -> usize {
        self.members.len()
    }

    /// Tokens the forward pass runs for this group, padding included.
    pub fn computed(&self) -> usize {
        self.prefix.len() + self.rows() * self.len
    }
}

/// A batch laid out for the forward pass: its groups, and where each window position's hidden
/// state lies among the groups' outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Packing {
    /// The groups, in the order their hidden states are concatenated: each group contributes
    /// its prefix's `prefix.len()` states, then its `rows × len` row states.
    pub groups: Vec<PackedGroup>,
    /// `[batch, window]`: for each sample and window position (see [`BatchLayout`]), the index
    /// of its hidden state in that concatenation. A position past a sample's end points at its
    /// row's last state (such positions carry no weight).
    pub window_rows: Vec<i64>,
    /// Tokens the forward pass runs, padding included.
    pub computed: usize,
    /// Tokens the samples hold.
    pub represented: usize,
}

impl Packing {
    /// The unpacked layout: one plain group of `layout`'s padded rows.
    pub fn plain(samples: &[Sample], layout: &BatchLayout) -> Self {
        let group = PackedGroup {
            prefix: Vec::new(),
            rest: layout.input_ids.clone(),
            members: (0..layout.batch).collect(),
            len: layout.seq_len,
        };
        Self::from_groups(vec![group], samples, layout)
    }

    /// Packs `samples` (laid out as `layout`) into shared-prefix groups ([`group_samples`]);
    /// samples left alone go into one plain group padded with `pad_id`.
    pub fn packed(samples: &[Sample], layout: &BatchLayout, pad_id: u32) -> Self {
        let seqs: Vec<Vec<u32>> = samples
            .iter()
            .map(|s| {
                s.prompt_ids
                    .iter()
                    .chain(&s.response_ids)
                    .copied()
                    .collect()
            })
            .collect();
        let groups = group_samples(&seqs)
            .into_iter()
            .map(|(prefix_len, members)| {
                let len = members
                    .iter()
                    .map(|&i| seqs[i].len() - prefix_len)
                    .max()
                    .unwrap_or(0);
                let mut rest = vec![pad_id as i64; members.len() * len];
                for (row, &i) in members.iter().enumerate() {
                    for (dst, &id) in rest[row * len..].iter_mut().zip(&seqs[i][prefix_len..]) {
                        *dst = id as i64;
                    }
                }
                let prefix = members.first().map_or(Vec::new(), |&i| {
                    seqs[i][..prefix_len].iter().map(|&t| t as i64).collect()
                });
                PackedGroup {
                    prefix,
                    rest,
                    members,
                    len,
                }
            })
            .collect();
        Self::from_groups(groups, samples, layout)
    }

    fn from_groups(groups: Vec<PackedGroup>, samples: &[Sample], layout: &BatchLayout) -> Self {
        let (w, start) = (layout.window, layout.window_start);
        let mut window_rows = vec![0i64; layout.batch * w];
        let mut base = 0usize;
        for g in &groups {
            let p = g.prefix.len();
            for (row, &i) in g.members.iter().enumerate() {
                let row_base = base + p + row * g.len;
                let last = row_base + g.len.saturating_sub(1);
                for (k, dst) in window_rows[i * w..(i + 1) * w].iter_mut().enumerate() {
                    let pos = start + k;
                    *dst = if pos < p {
                        (base + pos) as i64
                    } else {
                        (row_base + (pos - p)).min(last) as i64
                    };
                }
            }
            base += g.computed();
        }
        Self {
            computed: base,
            represented: samples.iter().map(Sample::len).sum(),
            groups,
            window_rows,
        }
    }

    /// Tokens computed over tokens represented: below 1 when prefixes were shared, above 1 by
    /// the padding otherwise.
    pub fn ratio(&self) -> f64 {
        self.computed as f64 / self.represented.max(1) as f64
    }
}

/// Groups sequences by shared prefix: `(prefix_len, members)` per group, the plain group (prefix
/// length 0, every sequence not worth packing) last when there is one.
///
/// Sorted lexicographically, sequences with long common prefixes are neighbours, and a run of
/// neighbours shares the smallest common prefix between adjacent ones. The grouping cuts that
/// order into runs that minimise the tokens computed: a run of two or more whose shared prefix
/// is at least [`MIN_PREFIX`] costs the prefix once plus every member's remainder, any other run
/// costs its members whole. A prefix stops one token short of its shortest member, so that
/// every row has a token of its own. Batches are tens of samples: the quadratic search is cheap.
pub fn group_samples(seqs: &[Vec<u32>]) -> Vec<(usize, Vec<usize>)> {
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by(|&a, &b| seqs[a].cmp(&seqs[b]).then(a.cmp(&b)));
    let n = order.len();
    let lens: Vec<usize> = order.iter().map(|&i| seqs[i].len()).collect();
    // adjacent[k]: the common prefix of order[k - 1] and order[k] (k ≥ 1).
    let adjacent: Vec<usize> = (0..n)
        .map(|k| match k {
            0 => 0,
            _ => common_prefix(&seqs[order[k - 1]], &seqs[order[k]]),
        })
        .collect();
    // The shared prefix and cost of the run `order[i..j]`.
    let run = |i: usize, j: usize| -> (usize, usize) {
        let size = j - i;
        let total: usize = lens[i..j].iter().sum();
        let shortest = lens[i..j].iter().copied().min().unwrap_or(0);
        let common = adjacent[i + 1..j].iter().copied().min().unwrap_or(0);
        let shared = common.min(shortest.saturating_sub(1));
        if size >= 2 && shared >= MIN_PREFIX {
            (shared, shared + total - size * shared)
        } else {
            (0, total)
        }
    };
    // best[j]: the least cost of order[..j]; start[j]: where its last run begins.
    let mut best = vec![usize::MAX; n + 1];
    let mut start = vec![0usize; n + 1];
    best[0] = 0;
    for j in 1..=n {
        for i in (0..j).rev() {
            let cost = best[i] + run(i, j).1;
            if cost < best[j] {
                best[j] = cost;
                start[j] = i;
            }
        }
    }
    let (mut groups, mut plain) = (Vec::new(), Vec::new());
    let mut j = n;
    while j > 0 {
        let i = start[j];
        let mut members: Vec<usize> = order[i..j].to_vec();
        match run(i, j).0 {
            0 => plain.append(&mut members),
            shared => {
                members.sort_unstable();
                groups.push((shared, members));
            }
        }
        j = i;
    }
    groups.reverse();
    if !plain.is_empty() {
        plain.sort_unstable();
        groups.push((0, plain));
    }
    groups
}

/// The length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(p: &[u32], r: &[u32]) -> Sample {
        Sample::new(p.to_vec(), r.to_vec(), 1.0)
    }

    fn shared(n: usize) -> Vec<u32> {
        (100..100 + n as u32).collect()
    }

    #[test]
    fn samples_sharing_a_long_prefix_form_a_group_and_the_rest_stay_plain() {
        let sys = shared(40);
        let with = |tail: &[u32]| [sys.as_slice(), tail].concat();
        let seqs = vec![
            with(&[1, 2, 3]),
            vec![7, 8, 9],
            with(&[5]),
            with(&[1, 2, 4, 4]),
            (0..30).collect(),
        ];
        let groups = group_samples(&seqs);
        // Samples 0, 2 and 3 share the 40 system tokens; 1 and 4 share nothing.
        assert_eq!(groups, vec![(40, vec![0, 2, 3]), (0, vec![1, 4])]);
    }

    #[test]
    fn a_prefix_stops_one_token_short_of_its_shortest_member() {
        let a = shared(30);
        let b = [a.as_slice(), &[1, 2]].concat();
        // `a` is entirely a prefix of `b`: the group's prefix keeps `a`'s last token in its row.
        assert_eq!(group_samples(&[b, a]), vec![(29, vec![0, 1])]);
    }

    #[test]
    fn short_or_costly_prefixes_are_not_packed() {
        // Ten shared tokens are below the minimum.
        let s = shared(10);
        let seqs = vec![[s.as_slice(), &[1]].concat(), [s.as_slice(), &[2]].concat()];
        assert_eq!(group_samples(&seqs), vec![(0, vec![0, 1])]);
        // Two sequences sharing 100 tokens and a third sharing 20 with them: taking the third in
        // would cut the prefix from 100 to 20, computing more than it saves.
        let long = shared(100);
        let mut third = shared(20);
        third.extend([9; 200]);
        let seqs = vec![
            [long.as_slice(), &[1]].concat(),
            [long.as_slice(), &[2]].concat(),
            third,
        ];
        assert_eq!(group_samples(&seqs), vec![(100, vec![0, 1]), (0, vec![2])]);
    }

    #[test]
    fn window_rows_point_at_the_prefix_then_each_members_row() {
        let sys = shared(20);
        let samples = vec![
            sample(&[sys.as_slice(), &[1]].concat(), &[2, 3]),
            sample(&[5, 6], &[7]),
            sample(&[sys.as_slice(), &[4, 4]].concat(), &[8]),
        ];
        let layout = BatchLayout::new(&samples, None, 0, None).unwrap();
        let p = Packing::packed(&samples, &layout, 0);
        assert_eq!(p.groups.len(), 2);
        let (g, plain) = (&p.groups[0], &p.groups[1]);
        assert_eq!(
            (g.prefix.len(), g.members.clone(), g.len),
            (20, vec![0, 2], 3)
        );
        assert_eq!(g.rest, vec![1, 2, 3, 4, 4, 8]);
        assert_eq!((plain.members.clone(), plain.len), (vec![1], 3));
        assert_eq!(p.computed, 20 + 2 * 3 + 3);
        assert_eq!(p.represented, 23 + 3 + 23);
        // Window positions 1..=22 (the shortest prompt is 2 tokens).
        assert_eq!(layout.window_start, 1);
        let w = layout.window;
        let rows = |i: usize| &p.window_rows[i * w..(i + 1) * w];
        // Sample 0: positions below 20 are the prefix's states, then its row (26.. is row 0).
        assert_eq!(rows(0)[0], 1);
        assert_eq!(rows(0)[18], 19);
        assert_eq!(&rows(0)[19..], &[20, 21]);
        // Sample 2's row starts at 23.
        assert_eq!(&rows(2)[19..], &[23, 24]);
        // Sample 1 is the plain group's only row, after the first group's 26 states; past its
        // end every position points at its last state.
        assert_eq!(&rows(1)[..3], &[27, 28, 28]);
        // Its response token 7 (position 2) is predicted from position 1: window index 0.
        assert_eq!(rows(1)[0], 27);
        assert!(p.ratio() < 1.0);
    }

    #[test]
    fn the_plain_packing_is_the_padded_layout() {
        let samples = vec![sample(&[1, 2, 3], &[4, 5]), sample(&[7], &[8, 9, 10])];
        let layout = BatchLayout::new(&samples, Some(6), 0, None).unwrap();
        let p = Packing::plain(&samples, &layout);
        assert_eq!(p.groups.len(), 1);
        assert_eq!(p.groups[0].rest, layout.input_ids);
        assert_eq!(p.computed, 12);
        // Window positions 0..=3 of row 1 start at its row's first state, index 6.
        assert_eq!(&p.window_rows[4..], &[6, 7, 8, 9]);
        assert_eq!(p.represented, 9);
        assert_eq!(p.ratio(), 12.0 / 9.0);
    }
}
