//! GRPO groups of a job: which task a new session runs, which group it belongs to, and when a
//! group's episodes go to a build together. Pure and clock-free; the job supervisor drives it.
//!
//! Step-wise advantages are z-scored among the episodes of one task (per step index), so those
//! episodes must be built together and must all be episodes of that task. The rules:
//!
//! - **Assignment.** Sessions join groups in the order they start: the first `size` sessions form
//!   group 0 on one task, the next `size` group 1 on the next task, and so on. A group's episodes
//!   therefore run at the same time as far as the job's parallelism allows.
//! - **Members.** A session that ends normally (done, step limit, deadline, stopped while the job
//!   drains) is a member: its episode joins the group once all its turns are judged.
//! - **Retries.** A session that fails is restarted in the same group (the supervisor decides);
//!   the failed attempt's episode is discarded, never built.
//! - **Dropped whole.** A session given up on (its restarts spent, or failed while the job
//!   drains) drops its group: the episodes already in it and those that end later are
//!   discarded.
//! - **Ready.** A group goes to one build when `size` members are in. When the job drains no
//!   group takes new sessions; a group with nothing left running is then built with the members
//!   it has (counted as short), or closed when it has none.
//!
//! Every episode handed in comes back exactly once, in a build or as discarded, so the
//! supervisor's turn accounting balances.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A group's number (in the order groups open).
pub type GroupId = u64;

/// What became of groups, for the job's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCounts {
    /// Episodes per group.
    pub size: u64,
    /// Groups opened.
    pub started: u64,
    /// Groups built with all their members.
    pub built: u64,
    /// Groups built with fewer members when the job drained.
    pub short: u64,
    /// Groups dropped whole because a member was given up on.
    pub dropped: u64,
    /// Episodes never built: failed attempts that were retried, and the episodes of dropped
    /// groups.
    pub episodes_discarded: u64,
}

/// What the supervisor does with episodes the book hands back.
#[derive(Debug, PartialEq)]
pub enum Settled<E> {
    /// Build these episodes together (one group, in the order they came in).
    Build {
        /// The group.
        group: GroupId,
        /// Its members' episodes.
        episodes: Vec<E>,
    },
    /// These episodes give no samples (their turns are settled all the same).
    Discard(Vec<E>),
}

struct Group<E> {
    task_index: usize,
    /// Sessions still to start in this group (zero once it is full or the job drains).
    to_start: usize,
    /// Sessions started whose episode has not come back yet.
    running: usize,
    episodes: Vec<E>,
    dropped: bool,
}

/// The groups of one job.
pub struct Groups<E> {
    size: usize,
    next: GroupId,
    /// The group new sessions join, while it has places.
    filling: Option<GroupId>,
    open: BTreeMap<GroupId, Group<E>>,
    draining: bool,
    counts: GroupCounts,
}

impl<E> Groups<E> {
    /// Groups of `size` episodes (at least 1).
    pub fn new(size: usize) -> Self {
        let size = size.max(1);
        Groups {
            size,
            next: 0,
            filling: None,
            open: BTreeMap::new(),
            draining: false,
            counts: GroupCounts {
                size: size as u64,
                ..GroupCounts::default()
            },
        }
    }

    /// The counters.
    pub fn counts(&self) -> &GroupCounts {
        &self.counts
    }

    /// Whether no group is open (every episode handed in was handed back).
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// The group and task of a new session; `next_task` gives the task when a group opens.
    /// `None` once the job drains.
    pub fn assign(&mut self, next_task: impl FnOnce() -> usize) -> Option<(GroupId, usize)> {
        if self.draining {
            return None;
        }
        let id = match self.filling {
            Some(id) => id,
            None => {
                let id = self.next;
                self.next += 1;
                self.counts.started += 1;
                self.open.insert(
                    id,
                    Group {
                        task_index: next_task(),
                        to_start: self.size,
                        running: 0,
                        episodes: Vec::new(),
                        dropped: false,
                    },
                );
                self.filling = Some(id);
                id
            }
        };
        let g = self.open.get_mut(&id).expect("the filling group is open");
        g.to_start -= 1;
        g.running += 1;
        if g.to_start == 0 {
            self.filling = None;
        }
        Some((id, g.task_index))
    }

    /// Whether `group` was dropped (it takes no retries; its episodes are discarded).
    pub fn is_dropped(&self, group: GroupId) -> bool {
        self.open.get(&group).is_some_and(|g| g.dropped)
    }

    /// A failed session of `group` is restarted in it: one more attempt runs.
    pub fn retry(&mut self, group: GroupId) {
        if let Some(g) = self.open.get_mut(&group) {
            g.running += 1;
        }
    }

    /// A session of `group` was given up on: the group is dropped; the episodes already in it
    /// are handed back to discard.
    pub fn give_up(&mut self, group: GroupId) -> Option<Settled<E>> {
        let g = self.open.get_mut(&group)?;
        if g.dropped {
            return None;
        }
        g.dropped = true;
        g.to_start = 0;
        if self.filling == Some(group) {
            self.filling = None;
        }
        self.counts.dropped += 1;
        let episodes = std::mem::take(&mut g.episodes);
        self.counts.episodes_discarded += episodes.len() as u64;
        self.close_if_done(group);
        (!episodes.is_empty()).then_some(Settled::Discard(episodes))
    }

    /// The episode of a session of `group` is complete (every turn judged): `member` when the
    /// session ended normally, else a failed attempt. `None` for an episode without turns.
    pub fn episode(
        &mut self,
        group: GroupId,
        episode: Option<E>,
        member: bool,
    ) -> Option<Settled<E>> {
        let Some(g) = self.open.get_mut(&group) else {
            // Not a group of this book: nothing can be built of it.
            return episode.map(|e| {
                self.counts.episodes_discarded += 1;
                Settled::Discard(vec![e])
            });
        };
        g.running = g.running.saturating_sub(1);
        let mut out = None;
        match episode {
            Some(e) if member && !g.dropped => g.episodes.push(e),
            Some(e) => {
                self.counts.episodes_discarded += 1;
                out = Some(Settled::Discard(vec![e]));
            }
            None => {}
        }
        let ready = self.ready(group);
        out.or(ready)
    }

    /// The job drains: no group takes new sessions; groups with nothing running are built now
    /// with what they have.
    pub fn drain(&mut self) -> Vec<Settled<E>> {
        self.draining = true;
        self.filling = None;
        let ids: Vec<GroupId> = self.open.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| {
                if let Some(g) = self.open.get_mut(&id) {
                    g.to_start = 0;
                }
                self.ready(id)
            })
            .collect()
    }

    /// The build of `group` if it is complete (closing it), else `None`.
    fn ready(&mut self, group: GroupId) -> Option<Settled<E>> {
        let g = self.open.get(&group)?;
        if g.dropped {
            self.close_if_done(group);
            return None;
        }
        let full = g.episodes.len() >= self.size;
        if !full && (g.running > 0 || g.to_start > 0) {
            return None;
        }
        let g = self.open.remove(&group).expect("checked");
        if g.episodes.is_empty() {
            return None;
        }
        if full {
            self.counts.built += 1;
        } else {
            self.counts.short += 1;
        }
        Some(Settled::Build {
            group,
            episodes: g.episodes,
        })
    }

    fn close_if_done(&mut self, group: GroupId) {
        if self
            .open
            .get(&group)
            .is_some_and(|g| g.dropped && g.running == 0)
        {
            self.open.remove(&group);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tasks() -> impl FnMut() -> usize {
        let mut n = 0;
        move || {
            n += 1;
            n - 1
        }
    }

    #[test]
    fn sessions_fill_groups_in_order_each_on_one_task() {
        let mut g: Groups<u32> = Groups::new(3);
        let mut next = tasks();
        let got: Vec<_> = (0..7).map(|_| g.assign(&mut next).unwrap()).collect();
        assert_eq!(
            got,
            vec![(0, 0), (0, 0), (0, 0), (1, 1), (1, 1), (1, 1), (2, 2)]
        );
        assert_eq!(g.counts().started, 3);
    }

    #[test]
    fn a_group_builds_once_all_members_are_in() {
        let mut g: Groups<u32> = Groups::new(2);
        let mut next = tasks();
        let (a, _) = g.assign(&mut next).unwrap();
        g.assign(&mut next).unwrap();
        assert_eq!(g.episode(a, Some(10), true), None);
        assert_eq!(
            g.episode(a, Some(11), true),
            Some(Settled::Build {
                group: a,
                episodes: vec![10, 11]
            })
        );
        assert!(g.is_empty());
        assert_eq!(g.counts().built, 1);
    }

    #[test]
    fn a_failed_attempt_is_discarded_and_its_retry_takes_its_place() {
        let mut g: Groups<u32> = Groups::new(2);
        let mut next = tasks();
        let (a, _) = g.assign(&mut next).unwrap();
        g.assign(&mut next).unwrap();
        g.retry(a);
        assert_eq!(
            g.episode(a, Some(1), false),
            Some(Settled::Discard(vec![1]))
        );
        assert_eq!(g.episode(a, Some(2), true), None);
        assert_eq!(
            g.episode(a, Some(3), true),
            Some(Settled::Build {
                group: a,
                episodes: vec![2, 3]
            })
        );
        assert_eq!(g.counts().episodes_discarded, 1);
    }

    #[test]
    fn a_member_given_up_on_drops_the_whole_group() {
        let mut g: Groups<u32> = Groups::new(3);
        let mut next = tasks();
        let (a, _) = g.assign(&mut next).unwrap();
        g.assign(&mut next).unwrap();
        assert_eq!(g.episode(a, Some(1), true), None);
        // The second session fails for good: its group is dropped, what it had is discarded.
        assert_eq!(g.give_up(a), Some(Settled::Discard(vec![1])));
        // New sessions open a new group; the dropped one takes no more.
        assert_eq!(g.assign(&mut next), Some((1, 1)));
        assert_eq!(
            g.episode(a, Some(2), false),
            Some(Settled::Discard(vec![2]))
        );
        assert_eq!(g.counts().dropped, 1);
        assert_eq!(g.counts().episodes_discarded, 2);
        assert_eq!(g.counts().built, 0);
    }

    #[test]
    fn draining_builds_groups_short_once_nothing_runs() {
        let mut g: Groups<u32> = Groups::new(4);
        let mut next = tasks();
        let (a, _) = g.assign(&mut next).unwrap();
        g.assign(&mut next).unwrap();
        assert_eq!(g.episode(a, Some(1), true), None);
        // Nothing new starts while draining; the running member still counts.
        assert!(g.drain().is_empty());
        assert_eq!(g.assign(&mut next), None);
        assert_eq!(
            g.episode(a, Some(2), true),
            Some(Settled::Build {
                group: a,
                episodes: vec![1, 2]
            })
        );
        assert_eq!(g.counts().short, 1);
        assert!(g.is_empty());
    }

    #[test]
    fn draining_builds_a_group_held_back_with_nothing_running() {
        let mut g: Groups<u32> = Groups::new(4);
        let mut next = tasks();
        let (a, _) = g.assign(&mut next).unwrap();
        assert_eq!(g.episode(a, Some(7), true), None);
        assert_eq!(
            g.drain(),
            vec![Settled::Build {
                group: a,
                episodes: vec![7]
            }]
        );
        assert!(g.is_empty());
    }

    #[test]
    fn groups_of_empty_episodes_close_without_a_build() {
        let mut g: Groups<u32> = Groups::new(2);
        let mut next = tasks();
        let (a, _) = g.assign(&mut next).unwrap();
        g.assign(&mut next).unwrap();
        assert_eq!(g.episode(a, None, true), None);
        assert!(g.drain().is_empty());
        assert_eq!(g.episode(a, None, true), None);
        assert!(g.is_empty());
        assert_eq!(g.counts().built + g.counts().short, 0);
    }

    #[test]
    fn every_episode_comes_back_exactly_once() {
        // A deterministic walk through mixed outcomes: members, failures with retries, a give
        // up, then a drain; every episode handed in is handed back once.
        let mut g: Groups<u32> = Groups::new(3);
        let mut next = tasks();
        let mut running: Vec<GroupId> = Vec::new();
        let mut handed = 0u32;
        let mut back: Vec<u32> = Vec::new();
        fn take(s: Option<Settled<u32>>, back: &mut Vec<u32>) {
            if let Some(Settled::Build { episodes, .. } | Settled::Discard(episodes)) = s {
                back.extend(episodes)
            }
        }
        for step in 0..40u32 {
            while running.len() < 4 {
                match g.assign(&mut next) {
                    Some((id, _)) => running.push(id),
                    None => break,
                }
            }
            let id = running.remove((step as usize * 7) % running.len());
            handed += 1;
            match step % 5 {
                3 => {
                    g.retry(id);
                    running.push(id);
                    take(g.episode(id, Some(handed), false), &mut back);
                }
                4 if step % 3 == 0 => {
                    take(g.give_up(id), &mut back);
                    take(g.episode(id, Some(handed), false), &mut back);
                }
                _ => take(g.episode(id, Some(handed), true), &mut back),
            }
        }
        for s in g.drain() {
            take(Some(s), &mut back);
        }
        for id in std::mem::take(&mut running) {
            handed += 1;
            take(g.episode(id, Some(handed), true), &mut back);
        }
        back.sort_unstable();
        assert_eq!(back, (1..=handed).collect::<Vec<_>>());
        assert!(g.is_empty());
    }
}
