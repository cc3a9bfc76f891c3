//! Who may ask a host for what of a job: the rules are pure ([`check`]) and read the job's
//! placement as Control records it; [`JobPlaces`] keeps what Control said per job, asks again
//! when an entry is old or a caller does not fit it, and refuses with a typed [`Refusal`].
//!
//! The rules:
//!
//! - **The job home drives the job.** Requests that change what a host does for job J (serve
//!   it, install a weight version, release it, build its environment, start an episode, report
//!   its progress) are accepted only from J's trainer node ([`Need::Home`]).
//! - **Placed nodes may use it.** Requests that only use what a host serves for J (generate)
//!   are accepted from the nodes Control placed on J: its trainer node and the nodes of its
//!   environment slots ([`Need::Placed`]).
//! - **Hosts serve jobs placed on them.** An environment host builds a job's environment and
//!   starts its episodes only when Control placed the job's environment slots on its node
//!   (or it is the home's own node), so a home cannot take capacity Control did not give it
//!   ([`check_host`]).
//! - **The caller is the certified node.** A caller is named by [`Caller`], which the transport
//!   stamps from the peer's certificate; code in this process is this node.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::control::{ControlReply, ControlRequest, Placement};
use crate::rpc::{self, Caller};

/// What a request needs of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The caller is the job's home (its trainer node).
    Home,
    /// The caller is a node placed on the job (its home, or a node of one of its environment slots).
    Placed,
}

/// Where a job runs, by node: what the checks read of Control's placement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Places {
    /// The job's home (trainer node), if it has one.
    pub home: Option<String>,
    /// The nodes of its environment slots.
    pub env_nodes: BTreeSet<String>,
}

impl Places {
    /// The nodes of `placement` (slots are named `<node>/env.<kind>.<i>`).
    pub fn of(placement: &Placement) -> Places {
        Places {
            home: placement.trainer.clone(),
            env_nodes: placement
                .env_slots
                .iter()
                .map(|w| w.split('/').next().unwrap_or(w).to_string())
                .collect(),
        }
    }
}

/// Why a request was refused; the text names the caller and the job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The caller is not the job's home.
    #[error("node `{caller}` is not the home of job {job} (its home is {home})")]
    NotHome {
        /// The job.
        job: String,
        /// The caller's node.
        caller: String,
        /// The home Control records, or `none`.
        home: String,
    },
    /// The caller is not a node placed on the job.
    #[error("node `{caller}` is not placed on job {job}")]
    NotPlaced {
        /// The job.
        job: String,
        /// The caller's node.
        caller: String,
    },
    /// Control does not know the job.
    #[error("Control knows no job {0}")]
    UnknownJob(String),
    /// Control could not be asked.
    #[error("Control cannot say where job {job} runs: {reason}")]
    NoControl {
        /// The job.
        job: String,
        /// Why.
        reason: String,
    },
    /// This host's node is not placed on the job.
    #[error("job {job} is not placed on node `{node}`")]
    HostNotPlaced {
        /// The job.
        job: String,
        /// This host's node.
        node: String,
    },
    /// The caller did not open the episode it names.
    #[error("node `{caller}` did not start episode {episode}")]
    NotYourEpisode {
        /// The episode.
        episode: u64,
        /// The caller's node.
        caller: String,
    },
}

/// Whether node `caller` may make a request of job `job` that needs `need`, the job running at
/// `places`.
pub fn check(job: &str, caller: &str, need: Need, places: &Places) -> Result<(), Refusal> {
    let home = places.home.as_deref();
    if home == Some(caller) {
        return Ok(());
    }
    match need {
        Need::Placed if places.env_nodes.contains(caller) => Ok(()),
        Need::Placed => Err(Refusal::NotPlaced {
            job: job.to_string(),
            caller: caller.to_string(),
        }),
        Need::Home => Err(Refusal::NotHome {
            job: job.to_string(),
            caller: caller.to_string(),
            home: home.map_or_else(|| "none".into(), |h| format!("`{h}`")),
        }),
    }
}

/// Whether a host on node `here` may serve job `job`, the job running at `places`: its node
/// holds environment slots placed on the job, or is the job's home.
pub fn check_host(job: &str, here: &str, places: &Places) -> Result<(), Refusal> {
    if places.env_nodes.contains(here) || places.home.as_deref() == Some(here) {
        return Ok(());
    }
    Err(Refusal::HostNotPlaced {
        job: job.to_string(),
        node: here.to_string(),
    })
}

/// How long what Control said of a job is trusted before it is asked again.
pub const PLACES_TTL: Duration = Duration::from_secs(5);
/// How long a host waits for Control's answer.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// A host's view of where jobs run, from Control (see the module docs).
pub struct JobPlaces {
    here: String,
    known: HashMap<String, (Places, Instant)>,
}

impl JobPlaces {
    /// The view of a host on node `here`.
    pub fn new(here: impl Into<String>) -> Self {
        JobPlaces {
            here: here.into(),
            known: HashMap::new(),
        }
    }

    /// This node's name.
    pub fn here(&self) -> &str {
        &self.here
    }

    /// Whether what is known of `job` at `now` passes `rule`: false when nothing fresh is
    /// known or the request does not fit it (then Control is asked again).
    fn known_ok(
        &self,
        job: &str,
        now: Instant,
        rule: impl Fn(&Places) -> Result<(), Refusal>,
    ) -> bool {
        self.known
            .get(job)
            .is_some_and(|(p, at)| now.duration_since(*at) < PLACES_TTL && rule(p).is_ok())
    }

    /// Records what Control said of `job` at `now`.
    pub fn learn(&mut self, job: &str, places: Places, now: Instant) {
        self.known.insert(job.to_string(), (places, now));
    }

    /// Whether `caller` may make a request of `job` that needs `need`, asking Control where
    /// the job runs unless a fresh answer already admits the caller. While Control cannot be
    /// asked, its last answer still holds, however old.
    pub async fn check(&mut self, job: &str, caller: &Caller, need: Need) -> Result<(), Refusal> {
        let node = caller.node(&self.here).to_string();
        self.ask_unless_known(job, |p| check(job, &node, need, p))
            .await
    }

    /// As [`check`](Self::check), and this host's node must be placed on the job
    /// ([`check_host`]).
    pub async fn check_on_host(
        &mut self,
        job: &str,
        caller: &Caller,
        need: Need,
    ) -> Result<(), Refusal> {
        let node = caller.node(&self.here).to_string();
        let here = self.here.clone();
        self.ask_unless_known(job, |p| {
            check(job, &node, need, p).and_then(|()| check_host(job, &here, p))
        })
        .await
    }

    /// `rule` over what is known of `job`, asking Control first unless a fresh answer already
    /// passes it.
    async fn ask_unless_known(
        &mut self,
        job: &str,
        rule: impl Fn(&Places) -> Result<(), Refusal>,
    ) -> Result<(), Refusal> {
        if self.known_ok(job, Instant::now(), &rule) {
            return Ok(());
        }
        match ask_control(job).await {
            Ok(places) => {
                let verdict = rule(&places);
                self.learn(job, places, Instant::now());
                verdict
            }
            Err(e @ Refusal::NoControl { .. }) => match self.known.get(job) {
                Some((places, _)) => rule(places),
                None => Err(e),
            },
            Err(e) => {
                self.known.remove(job);
                Err(e)
            }
        }
    }
}

/// Where Control places `job`.
async fn ask_control(job: &str) -> Result<Places, Refusal> {
    let no_control = |reason: String| Refusal::NoControl {
        job: job.to_string(),
        reason,
    };
    let mut members = ractor::pg::get_members(&crate::groups::CONTROL.to_string());
    members.sort_by_key(rpc::actor_label);
    let control = members
        .first()
        .ok_or_else(|| no_control("no Control actor in the cluster".into()))?;
    let req = ControlRequest::Status(Some(job.to_string()));
    match rpc::call::<_, ControlReply>(control, &req, CONTROL_TIMEOUT).await {
        Ok(ControlReply::Jobs(jobs)) => jobs
            .iter()
            .find(|j| j.id == job)
            .map(|j| Places::of(&j.placement))
            .ok_or_else(|| Refusal::UnknownJob(job.to_string())),
        Ok(ControlReply::Error(_)) => Err(Refusal::UnknownJob(job.to_string())),
        Err(e) => Err(no_control(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(home: Option<&str>, env: &[&str]) -> Places {
        Places {
            home: home.map(String::from),
            env_nodes: env.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn only_the_home_drives_a_job() {
        let p = places(Some("t"), &["e"]);
        assert_eq!(check("job-1", "t", Need::Home, &p), Ok(()));
        assert_eq!(
            check("job-1", "e", Need::Home, &p),
            Err(Refusal::NotHome {
                job: "job-1".into(),
                caller: "e".into(),
                home: "`t`".into()
            })
        );
        let unplaced = places(None, &[]);
        let e = check("job-1", "t", Need::Home, &unplaced).unwrap_err();
        assert_eq!(
            e.to_string(),
            "node `t` is not the home of job job-1 (its home is none)"
        );
    }

    #[test]
    fn placed_nodes_may_use_a_job() {
        let p = places(Some("t"), &["e"]);
        assert_eq!(check("job-1", "t", Need::Placed, &p), Ok(()));
        assert_eq!(check("job-1", "e", Need::Placed, &p), Ok(()));
        assert!(matches!(
            check("job-1", "x", Need::Placed, &p),
            Err(Refusal::NotPlaced { .. })
        ));
    }

    #[test]
    fn a_host_serves_only_jobs_placed_on_its_node() {
        let p = places(Some("t"), &["e"]);
        assert_eq!(check_host("job-1", "e", &p), Ok(()));
        assert_eq!(check_host("job-1", "t", &p), Ok(()), "the home's own node");
        let e = check_host("job-1", "f", &p).unwrap_err();
        assert_eq!(e.to_string(), "job job-1 is not placed on node `f`");
    }

    #[test]
    fn placement_nodes_come_from_slot_names() {
        let p = Places::of(&Placement {
            trainer: Some("t".into()),
            env_slots: vec!["e/env.terminal.0".into(), "f/env.terminal.1".into()],
        });
        assert_eq!(p, places(Some("t"), &["e", "f"]));
    }

    #[test]
    fn what_is_known_admits_only_fitting_callers_while_fresh() {
        let mut v = JobPlaces::new("here");
        let t0 = Instant::now();
        v.learn("job-1", places(Some("t"), &[]), t0);
        let home = |caller: &'static str| move |p: &Places| check("job-1", caller, Need::Home, p);
        assert!(v.known_ok("job-1", t0, home("t")));
        assert!(!v.known_ok("job-1", t0, home("x")), "asks again");
        assert!(!v.known_ok("job-2", t0, home("t")), "unknown job");
        assert!(
            !v.known_ok("job-1", t0 + PLACES_TTL, home("t")),
            "stale: asks again"
        );
        // A host not placed on the job asks again too (it may just have been placed).
        assert!(!v.known_ok("job-1", t0, |p| check_host("job-1", "here", p)));
        assert_eq!(Caller::Local.node(v.here()), "here");
    }
}
