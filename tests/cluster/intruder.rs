//! A node with a valid cluster certificate that is not placed on a job tries to take the job
//! over: it announces a weight version no real one can follow to the rollout host (every later
//! version would be dropped as stale), the same with the job home's name written into the
//! request as its caller, reports the job finished to Control, starts an episode on the
//! environment host, steps and closes an episode the job's home started there, and has the
//! judge host build the job's judge and judge a turn. Each request
//! is refused and the refusal is logged with the intruder's
//! name; the job trains on and completes with versions past the attack.
//!
//! The intruder is a node in the test process (so it can send what no `clawrl node` would);
//! the job is held open ([`HELD_OPEN`](super::faults)) until the attack is over.

use std::path::Path;
use std::time::Duration;

use clawrl::pipeline::distributed::{
    EnvReply, EnvRequest, JudgeReply, JudgeRequest, RolloutReply, RolloutRequest,
};
use clawrl_actors::bulk::BlobId;
use clawrl_actors::config::NodeConfig;
use clawrl_actors::control::{ControlReply, ControlRequest};
use clawrl_actors::loops::job::{JobCounts, JobPhase};
use clawrl_actors::loops::WeightAnnounce;
use clawrl_actors::node::{Node, NodeOptions};
use clawrl_actors::rpc;
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{ActorCell, ActorRef, Message, RpcReplyPort};

use super::faults::{
    assert_completed, n, served_versions, without_ansi, Cluster, FIXTURE, LONG, ONE_AT_A_TIME,
};
use super::util::*;

const CALL: Duration = Duration::from_secs(20);

/// A request that claims its caller: the stamp the home's own session would carry.
struct Forged {
    request: Vec<u8>,
    reply: RpcReplyPort<Vec<u8>>,
    claimed: String,
}

impl Message for Forged {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        Ok(SerializedMessage::Call {
            variant: "clawrl.rpc".into(),
            args: self.request,
            reply: self.reply,
            metadata: Some(clawrl_actors::stamp::caller_stamp(&self.claimed)),
        })
    }
}

/// The one member of `group` the intruder sees whose label starts with `prefix`.
fn member(group: &str, prefix: &str) -> Option<ActorCell> {
    ractor::pg::get_members(&group.to_string())
        .into_iter()
        .find(|c| rpc::actor_label(c).starts_with(prefix))
}

/// The lines of `log` that contain all of `words`.
fn lines_with(log: &str, words: &[&str]) -> Vec<String> {
    log.lines()
        .map(without_ansi)
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .collect()
}

/// The ids of the episodes an environment host's `log` says it started.
fn started_episodes(log: &str) -> Vec<u64> {
    lines_with(log, &["episode started"])
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("episode=")? + "episode=".len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// Starts the intruder `mal` in this process, seeded with the control node.
fn start_intruder(rt: &tokio::runtime::Runtime, c: &Cluster) -> Node {
    let cfg = write_config(
        c.dir.path(),
        "mal",
        c.ports["mal"],
        &[c.ports["ctl"]],
        &[],
        Some(&c.certs),
    );
    let config = NodeConfig::load(Path::new(&cfg)).unwrap();
    rt.block_on(Node::start(&config, NodeOptions::default()))
        .unwrap()
}

#[test]
fn a_node_not_placed_on_a_job_cannot_poison_or_finish_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let c = Cluster::one_of_each(&["mal"]);

    let job = c.submit(2, 0);
    let before = c.wait_counts(&job, "two trainer versions", |p| {
        p["trainer"]["version"].as_u64().unwrap_or(0) >= 2
    });

    let rt = tokio::runtime::Runtime::new().unwrap();
    let _mal = start_intruder(&rt, &c);
    let (rollout, control, envhost, judgehost) = wait_for(LONG, || {
        Some((
            member("clawrl.rollout", "r1/")?,
            member("clawrl.control", "ctl/")?,
            member("clawrl.envhost.scripted", "e1/")?,
            member("clawrl.judge", "tr/")?,
        ))
    })
    .unwrap_or_else(|| panic!("the intruder never saw the hosts:\n{}", c.logs()));

    // A version no real one can follow.
    let poison = RolloutRequest::Serve {
        job: job.clone(),
        model_config: std::fs::read_to_string(format!("{FIXTURE}/config.json")).unwrap(),
        max_batch: 4,
        max_context: 512,
        prefix_cache_bytes: 0,
        announce: WeightAnnounce {
            version: u64::MAX,
            blob: BlobId([7; 32]),
            size: 1,
            source: "mal".into(),
        },
        adapter: None,
    };
    let reply: RolloutReply = rt.block_on(rpc::call(&rollout, &poison, CALL)).unwrap();
    match reply {
        RolloutReply::Refused(e) => assert!(e.contains("`mal` is not the home"), "{e}"),
        other => panic!("the poisoning Serve was taken: {other:?}"),
    }
    // The same, claiming to come from the job's home: the stamp the intruder wrote is
    // replaced by the name its certificate proves.
    let forged: ActorRef<Forged> = rollout.clone().into();
    let out = rt
        .block_on(forged.call(
            |reply| Forged {
                request: rpc::encode(&poison),
                reply,
                claimed: "tr".into(),
            },
            Some(CALL),
        ))
        .unwrap();
    let ractor::rpc::CallResult::Success(bytes) = out else {
        panic!("no answer to the forged Serve: {out:?}")
    };
    match rpc::decode::<RolloutReply>(&bytes).unwrap() {
        RolloutReply::Refused(e) => assert!(e.contains("`mal` is not the home"), "{e}"),
        other => panic!("the forged Serve was taken: {other:?}"),
    }
    // What r1 served up to now: a poisoned host would serve nothing newer.
    let served_before = served_versions(&c.procs["r1"].log_text())
        .into_iter()
        .max()
        .unwrap_or(0);
    // A fake end of the job.
    let finished = ControlRequest::Progress {
        id: job.clone(),
        counts: Box::new(JobCounts {
            phase: JobPhase::Finished,
            ..Default::default()
        }),
    };
    match rt.block_on(rpc::call::<_, ControlReply>(&control, &finished, CALL)) {
        Ok(ControlReply::Error(e)) => assert!(e.contains("`mal` is not the home"), "{e}"),
        other => panic!("the fake progress was taken: {other:?}"),
    }
    // An episode of the job, started by a node that is not its home.
    let start = EnvRequest::Start {
        job: job.clone(),
        file: "job.toml".into(),
        spec: String::new(),
        task_index: 0,
        seed: 1,
    };
    match rt.block_on(rpc::call::<_, EnvReply>(&envhost, &start, CALL)) {
        Ok(EnvReply::Failed(e)) => assert!(e.contains("`mal` is not the home"), "{e}"),
        other => panic!("the intruder's episode started: {other:?}"),
    }
    // The job's judge, built and asked to judge by a node that is not its home: a judge
    // node's grants (its endpoints, its key variables) serve only the homes of jobs.
    let judge_requests = [
        JudgeRequest::Prepare {
            job: job.clone(),
            file: "job.toml".into(),
            spec: String::new(),
        },
        JudgeRequest::Judge {
            job: job.clone(),
            file: "job.toml".into(),
            spec: String::new(),
            turn: "{}".into(),
        },
    ];
    for req in &judge_requests {
        match rt.block_on(rpc::call::<_, JudgeReply>(&judgehost, req, CALL)) {
            Ok(JudgeReply::Failed(e)) => assert!(e.contains("`mal` is not the home"), "{e}"),
            other => panic!("the intruder's {req:?} was taken: {other:?}"),
        }
    }
    // The home's own episodes: e1 logs each episode it starts, and the home's sessions keep
    // their latest ones open while the job runs. Stepping an open one is refused as not the
    // intruder's (an id that is no longer open is simply not there); closing the same one is
    // then refused too, unless the home closed it in between (`Closed` also answers an id that
    // is not open), and the intruder tries the next ones the log shows.
    let not_mine = |e: &str, id: u64| e.contains(&format!("`mal` did not start episode {id}"));
    let step = |id: u64| EnvRequest::Step {
        episode: id,
        action: "{\"content\": \"rm -rf /\", \"tool_calls\": [], \"raw\": \"\"}".into(),
    };
    let (mut steps_refused, mut closes_refused) = (0usize, 0usize);
    let stolen = wait_for(LONG, || {
        let mut started = started_episodes(&c.procs["e1"].log_text());
        started.sort_unstable_by(|a, b| b.cmp(a));
        for id in started.into_iter().take(16) {
            match rt.block_on(rpc::call::<_, EnvReply>(&envhost, &step(id), CALL)) {
                Ok(EnvReply::Failed(e)) if not_mine(&e, id) => steps_refused += 1,
                Ok(EnvReply::Failed(e)) if e.contains("no open episode") => continue,
                other => panic!("the intruder stepped episode {id}: {other:?}"),
            }
            let close = EnvRequest::Close { episode: id };
            match rt.block_on(rpc::call::<_, EnvReply>(&envhost, &close, CALL)) {
                Ok(EnvReply::Failed(e)) if not_mine(&e, id) => {
                    closes_refused += 1;
                    return Some(id);
                }
                Ok(EnvReply::Closed) => continue,
                other => panic!("the intruder's close of episode {id}: {other:?}"),
            }
        }
        None
    });
    assert!(
        stolen.is_some(),
        "the intruder never met an open episode:\n{}",
        c.logs()
    );

    // Each refusal is logged with the intruder's name.
    let r1 = c.procs["r1"].log_text();
    assert_eq!(
        lines_with(&r1, &["Serve refused", "mal"]).len(),
        2,
        "{}",
        c.logs()
    );
    let ctl = c.procs["ctl"].log_text();
    assert_eq!(
        lines_with(&ctl, &["progress refused", "mal"]).len(),
        1,
        "{}",
        c.logs()
    );
    let tr = c.procs["tr"].log_text();
    assert_eq!(
        lines_with(&tr, &["judge host: request refused", "mal"]).len(),
        judge_requests.len(),
        "{}",
        c.logs()
    );
    let e1 = c.procs["e1"].log_text();
    assert_eq!(
        lines_with(&e1, &["request refused", "mal"]).len(),
        1 + steps_refused + closes_refused,
        "{}",
        c.logs()
    );

    // The job runs on (it is held open): still running, and r1 serves versions trained after
    // the attack.
    let after = c.wait_counts(&job, "counts after the attack", |_| true);
    assert_eq!(after["phase"], "running", "{after}");
    wait_for(LONG, || {
        let served = served_versions(&c.procs["r1"].log_text());
        served.iter().any(|&v| v > served_before).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "r1 served no version after {served_before}, the newest before the attack:\n{}",
            c.logs()
        )
    });
    // And it completes.
    let max_steps = c.finish_after_progress(&job, &after);
    let end = c.wait_finished(&job);
    assert_completed(&end, max_steps);
    assert!(n(&end["trainer"], "version") > n(&before["trainer"], "version"));
}
