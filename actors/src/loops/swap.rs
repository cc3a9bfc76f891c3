//! The weight-version swap rule, shared by the [`RolloutWorker`](super::rollout::RolloutWorker)
//! and the root crate's gateway policy: which offered version to load, which to ignore, and
//! what a finished load changes. It knows no clock, no weights and no IO; the caller holds the
//! payloads and does the loading, and tells the rule what happened.
//!
//! The rule, as [`VersionSwap`] applies it:
//!
//! - **Versions never go backwards.** An offered version not newer than every version serving,
//!   loading or waiting is stale and ignored ([`Offer::Stale`]).
//! - **Load beside, then swap.** A newer version is loaded while the old one keeps serving
//!   ([`Offer::Load`]); only a load that succeeded makes it the serving version
//!   ([`LoadOutcome::Switched`]). A failed load leaves the serving version in place
//!   ([`LoadOutcome::Failed`]).
//! - **One load at a time.** A newer version offered while a load runs waits; a still newer one
//!   replaces it ([`Offer::Queue`] names the one superseded). When the load finishes, the
//!   waiting version starts loading ([`LoadFinished::next`]): it is newer than whatever now
//!   serves, since it was newer than the version that was loading.
//!
//! A caller that serializes its loads itself (the gateway runs installs one at a time, in
//! arrival order) never offers while a load runs, so it only ever sees `Load` or `Stale`.

/// What to do with an offered version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Start loading it now, beside the serving version.
    Load,
    /// A load is running: the version waits for it. `superseded` is the version that was
    /// waiting and is now dropped unloaded.
    Queue {
        /// The waiting version this one replaced, if any.
        superseded: Option<u64>,
    },
    /// Not newer than `newest`, the newest version serving, loading or waiting: ignore it.
    Stale {
        /// The newest version known.
        newest: u64,
    },
}

/// What a finished load changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadFinished {
    /// Whether the loaded version now serves.
    pub outcome: LoadOutcome,
    /// The waiting version that starts loading now, if any.
    pub next: Option<u64>,
}

/// How a load ended, as the rule records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    /// The version now serves; `previous` served before it.
    Switched {
        /// The version served until now.
        previous: Option<u64>,
    },
    /// The load failed; the serving version is unchanged.
    Failed,
}

impl LoadFinished {
    /// Whether the finished load switched versions.
    pub fn switched(&self) -> bool {
        matches!(self.outcome, LoadOutcome::Switched { .. })
    }
}

/// Why a report to the rule does not fit its state (a caller bug, not a runtime condition).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SwapError {
    /// A load finished that the rule never started.
    #[error("a load of version {version} finished, but {loading:?} was the one loading")]
    NotLoading {
        /// The version reported.
        version: u64,
        /// The version the rule had loading.
        loading: Option<u64>,
    },
}

/// The serving, loading and waiting versions of one replica (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionSwap {
    serving: Option<u64>,
    loading: Option<u64>,
    queued: Option<u64>,
}

impl VersionSwap {
    /// A replica serving `serving` (`None`: nothing loaded yet), with no load running.
    pub fn new(serving: Option<u64>) -> Self {
        VersionSwap {
            serving,
            loading: None,
            queued: None,
        }
    }

    /// The version new requests run on.
    pub fn serving(&self) -> Option<u64> {
        self.serving
    }

    /// The version being loaded.
    pub fn loading(&self) -> Option<u64> {
        self.loading
    }

    /// The version waiting for the running load.
    pub fn queued(&self) -> Option<u64> {
        self.queued
    }

    /// The newest version serving, loading or waiting.
    pub fn newest(&self) -> Option<u64> {
        [self.serving, self.loading, self.queued]
            .into_iter()
            .flatten()
            .max()
    }

    /// Decides what to do with `version` and records it as loading or waiting accordingly.
    pub fn offer(&mut self, version: u64) -> Offer {
        if let Some(newest) = self.newest().filter(|&n| version <= n) {
            return Offer::Stale { newest };
        }
        if self.loading.is_some() {
            let superseded = self.queued.replace(version);
            return Offer::Queue { superseded };
        }
        self.loading = Some(version);
        Offer::Load
    }

    /// Records that the load of `version` ended (`ok`: it succeeded) and starts the waiting
    /// version's load, if one waits.
    pub fn finish(&mut self, version: u64, ok: bool) -> Result<LoadFinished, SwapError> {
        if self.loading != Some(version) {
            return Err(SwapError::NotLoading {
                version,
                loading: self.loading,
            });
        }
        let outcome = if ok {
            // `offer` only starts loads newer than everything known, so this is a switch.
            let previous = self.serving.replace(version);
            LoadOutcome::Switched { previous }
        } else {
            LoadOutcome::Failed
        };
        self.loading = self.queued.take();
        Ok(LoadFinished {
            outcome,
            next: self.loading,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_newer_versions_load_and_a_success_swaps() {
        let mut s = VersionSwap::new(Some(3));
        assert_eq!(s.offer(3), Offer::Stale { newest: 3 });
        assert_eq!(s.offer(2), Offer::Stale { newest: 3 });
        assert_eq!(s.offer(5), Offer::Load);
        assert_eq!((s.serving(), s.loading()), (Some(3), Some(5)));
        let f = s.finish(5, true).unwrap();
        assert_eq!(
            f,
            LoadFinished {
                outcome: LoadOutcome::Switched { previous: Some(3) },
                next: None
            }
        );
        assert!(f.switched());
        assert_eq!((s.serving(), s.loading()), (Some(5), None));
    }

    #[test]
    fn a_replica_with_nothing_loaded_takes_any_version() {
        let mut s = VersionSwap::new(None);
        assert_eq!(s.newest(), None);
        assert_eq!(s.offer(0), Offer::Load);
        let f = s.finish(0, true).unwrap();
        assert_eq!(f.outcome, LoadOutcome::Switched { previous: None });
        assert_eq!(s.serving(), Some(0));
    }

    #[test]
    fn a_failed_load_keeps_the_serving_version() {
        let mut s = VersionSwap::new(Some(1));
        assert_eq!(s.offer(2), Offer::Load);
        let f = s.finish(2, false).unwrap();
        assert_eq!(f.outcome, LoadOutcome::Failed);
        assert!(!f.switched());
        assert_eq!((s.serving(), s.loading()), (Some(1), None));
        // The failed version was never served, so it may be offered again.
        assert_eq!(s.offer(2), Offer::Load);
    }

    #[test]
    fn versions_wait_for_the_running_load_and_the_newest_waiting_wins() {
        let mut s = VersionSwap::new(Some(1));
        assert_eq!(s.offer(2), Offer::Load);
        // Not newer than the one loading: stale, even though newer than the serving one.
        assert_eq!(s.offer(2), Offer::Stale { newest: 2 });
        assert_eq!(s.offer(3), Offer::Queue { superseded: None });
        assert_eq!(s.offer(3), Offer::Stale { newest: 3 });
        assert_eq!(
            s.offer(5),
            Offer::Queue {
                superseded: Some(3)
            }
        );
        assert_eq!(s.offer(4), Offer::Stale { newest: 5 });
        assert_eq!(s.queued(), Some(5));
        // The load ends (either way) and the waiting version starts loading.
        let f = s.finish(2, false).unwrap();
        assert_eq!((f.outcome, f.next), (LoadOutcome::Failed, Some(5)));
        assert_eq!(
            (s.serving(), s.loading(), s.queued()),
            (Some(1), Some(5), None)
        );
        let f = s.finish(5, true).unwrap();
        assert_eq!(
            (f.outcome, f.next),
            (LoadOutcome::Switched { previous: Some(1) }, None)
        );
    }

    #[test]
    fn a_finish_the_rule_did_not_start_is_refused() {
        let mut s = VersionSwap::new(Some(1));
        assert_eq!(
            s.finish(2, true),
            Err(SwapError::NotLoading {
                version: 2,
                loading: None
            })
        );
        assert_eq!(s.offer(3), Offer::Load);
        assert_eq!(
            s.finish(2, true),
            Err(SwapError::NotLoading {
                version: 2,
                loading: Some(3)
            })
        );
        assert_eq!((s.serving(), s.loading()), (Some(1), Some(3)));
    }
}
