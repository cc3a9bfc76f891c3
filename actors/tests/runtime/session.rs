//! EnvSession, PrmVoter and the job supervisor with small deterministic environments, policies,
//! judges, builders and trainers: episodes are closed exactly once (done, deadline, failure,
//! stop), failed judging leaves turns unjudged with the reason, failed sessions are restarted
//! then counted as lost, and a job's counts balance at its stop condition.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clawrl_actors::loops::{
    job, spawn_job, Action, BoxFuture, Built, EndReason, EnvError, EnvSession, Environment,
    Episode, EpisodeTurns, JobArgs, JobCounts, JobMsg, JobPhase, JobSample, JobSettings,
    JudgedTurn, Judgement, Observation, PolicyError, PolicyTurn, PrmVoter, SampleBuilder,
    SessionArgs, SessionEvent, StepOutcome, StopCause, StopCondition, TrainerCounts, TrainerLink,
    Turn, TurnJudge, TurnPolicy, TurnSource, VoterArgs, VoterMsg,
};
use ractor::Actor;
use serde_json::json;
use tokio::sync::mpsc;

/// Tasks: index `i` has `steps[i]` steps; a task in `fail_start` cannot start; a task in
/// `fail_step` errors on its second step.
struct Env {
    steps: Vec<u32>,
    fail_start: Vec<usize>,
    fail_step: Vec<usize>,
    started: AtomicUsize,
    closed: Arc<AtomicUsize>,
}

impl Env {
    fn new(steps: Vec<u32>) -> Self {
        Env {
            steps,
            fail_start: vec![],
            fail_step: vec![],
            started: AtomicUsize::new(0),
            closed: Arc::new(AtomicUsize::new(0)),
        }
    }
}

struct Ep {
    id: String,
    steps: u32,
    taken: u32,
    fail_step: bool,
    messages: Vec<serde_json::Value>,
    closed: Arc<AtomicUsize>,
}

impl Environment for Env {
    fn kind(&self) -> &str {
        "test"
    }
    fn task_count(&self) -> usize {
        self.steps.len()
    }
    fn max_steps(&self) -> u32 {
        100
    }
    fn start(&self, index: usize, _seed: u64) -> BoxFuture<'_, Result<Box<dyn Episode>, EnvError>> {
        Box::pin(async move {
            if self.fail_start.contains(&index) {
                return Err(EnvError::Setup {
                    task: format!("t{index}"),
                    reason: "cannot start".into(),
                });
            }
            self.started.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(Ep {
                id: format!("t{index}"),
                steps: self.steps[index],
                taken: 0,
                fail_step: self.fail_step.contains(&index),
                messages: vec![json!({"role": "user", "content": "go"})],
                closed: self.closed.clone(),
            }) as Box<dyn Episode>)
        })
    }
}

impl Episode for Ep {
    fn task_id(&self) -> &str {
        &self.id
    }
    fn instruction(&self) -> &str {
        "go"
    }
    fn observation(&self) -> Observation {
        Observation {
            messages: self.messages.clone(),
            tools: vec![],
            template_kwargs: Default::default(),
        }
    }
    fn step<'a>(&'a mut self, action: &'a Action) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        Box::pin(async move {
            if self.fail_step && self.taken == 1 {
                return Err(EnvError::Step {
                    task: self.id.clone(),
                    reason: "sandbox died".into(),
                });
            }
            self.taken += 1;
            let reply = json!({"role": "user", "content": format!("reply {}", self.taken)});
            self.messages
                .push(json!({"role": "assistant", "content": action.content}));
            self.messages.push(reply.clone());
            let done = self.taken >= self.steps;
            Ok(StepOutcome {
                next_state: vec![reply],
                done,
                outcome: done.then_some(1.0),
                info: json!({}),
            })
        })
    }
    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        let closed = self.closed.clone();
        Box::pin(async move {
            closed.fetch_add(1, Ordering::SeqCst);
        })
    }
}

/// Answers with the number of messages seen; version = a settable counter. Its prompt ids
/// grow by the previous exchange each step (`[1, 2, 3]`, then `[4, 5, 9]` per earlier step: its
/// response `[4, 5]` and a next-state token), so each step keeps the history; with `rewrite`,
/// the earlier responses come back as `[4, 6]`, as a template that re-renders them would.
struct Policy {
    delay: Duration,
    version: AtomicU64,
    rewrite: bool,
}

impl TurnPolicy for Policy {
    fn act<'a>(&'a self, o: &'a Observation) -> BoxFuture<'a, Result<PolicyTurn, PolicyError>> {
        Box::pin(async move {
            tokio::time::sleep(self.delay).await;
            let text = format!("seen {}", o.messages.len());
            let earlier = if self.rewrite { [4, 6, 9] } else { [4, 5, 9] };
            let mut prompt_ids = vec![1, 2, 3];
            for _ in 0..o.messages.len() / 2 {
                prompt_ids.extend(earlier);
            }
            Ok(PolicyTurn {
                action: Action {
                    content: text.clone(),
                    tool_calls: vec![],
                    raw: text.clone(),
                },
                prompt_ids,
                response_ids: vec![4, 5],
                logprobs: vec![-0.5, -0.25],
                version: self.version.load(Ordering::SeqCst),
                prompt_text: "p".into(),
                response_text: text,
            })
        })
    }
}

fn policy(delay_ms: u64) -> Arc<Policy> {
    Arc::new(Policy {
        delay: Duration::from_millis(delay_ms),
        version: AtomicU64::new(0),
        rewrite: false,
    })
}

async fn run_session(
    env: Arc<Env>,
    task: usize,
    policy: Arc<Policy>,
    deadline: Duration,
    stop_after: Option<Duration>,
) -> Vec<SessionEvent> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (actor, handle) = Actor::spawn(
        None,
        EnvSession,
        SessionArgs {
            session_id: "s1".into(),
            env,
            task_index: task,
            seed: 0,
            policy,
            deadline,
            max_steps: None,
            report: Arc::new(move |ev| {
                let _ = tx.send(ev);
            }),
        },
    )
    .await
    .unwrap();
    if let Some(d) = stop_after {
        tokio::time::sleep(d).await;
        actor.stop(None);
    }
    handle.await.unwrap();
    let mut events = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        events.push(ev);
    }
    events
}

fn ended(events: &[SessionEvent]) -> (u32, EndReason) {
    let ends: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            SessionEvent::Ended { turns, reason, .. } => Some((*turns, reason.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(ends.len(), 1, "exactly one Ended: {events:?}");
    assert!(
        matches!(events.last(), Some(SessionEvent::Ended { .. })),
        "Ended comes last"
    );
    ends[0].clone()
}

fn turns(events: &[SessionEvent]) -> Vec<&Turn> {
    events
        .iter()
        .filter_map(|e| match e {
            SessionEvent::Turn(t) => Some(t.as_ref()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_session_runs_its_episode_to_done_and_closes_it_once() {
    let env = Arc::new(Env::new(vec![3]));
    let ev = run_session(env.clone(), 0, policy(0), Duration::from_secs(10), None).await;
    let t = turns(&ev);
    assert_eq!(t.len(), 3);
    for (i, turn) in t.iter().enumerate() {
        assert_eq!(turn.turn, i as u32);
        assert_eq!(turn.task_id, "t0");
        // The observation is what the policy saw: 1 message, then 3, then 5.
        assert_eq!(turn.observation.messages.len(), 1 + 2 * i);
        assert_eq!(turn.policy.action.content, format!("seen {}", 1 + 2 * i));
        assert_eq!(
            turn.outcome.next_state[0]["content"],
            format!("reply {}", i + 1)
        );
        // Each step's prompt starts with the previous prompt and response.
        assert_eq!(turn.history_kept, (i > 0).then_some(true), "step {i}");
    }
    assert_eq!(ended(&ev), (3, EndReason::Done { outcome: Some(1.0) }));
    assert_eq!(env.closed.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_step_whose_prompt_rewrites_the_history_is_marked() {
    let env = Arc::new(Env::new(vec![3]));
    let rewriting = Arc::new(Policy {
        delay: Duration::ZERO,
        version: AtomicU64::new(0),
        rewrite: true,
    });
    let ev = run_session(env, 0, rewriting, Duration::from_secs(10), None).await;
    let kept: Vec<_> = turns(&ev).iter().map(|t| t.history_kept).collect();
    assert_eq!(kept, vec![None, Some(false), Some(false)]);
}

#[tokio::test]
async fn deadline_failure_and_stop_each_close_the_episode_once() {
    // Deadline: each policy call takes 80 ms, the episode may take 200 ms.
    let env = Arc::new(Env::new(vec![50]));
    let ev = run_session(env.clone(), 0, policy(80), Duration::from_millis(200), None).await;
    let (n, reason) = ended(&ev);
    assert_eq!(reason, EndReason::Deadline);
    assert!((1..=3).contains(&n), "{n}");
    assert_eq!(turns(&ev).len() as u32, n);
    assert_eq!(env.closed.load(Ordering::SeqCst), 1);

    // A step error fails the session after its first turn.
    let mut e = Env::new(vec![5]);
    e.fail_step = vec![0];
    let env = Arc::new(e);
    let ev = run_session(env.clone(), 0, policy(0), Duration::from_secs(10), None).await;
    let (n, reason) = ended(&ev);
    assert_eq!(n, 1);
    assert!(
        matches!(&reason, EndReason::Failed { error } if error.contains("sandbox died")),
        "{reason:?}"
    );
    assert_eq!(env.closed.load(Ordering::SeqCst), 1);

    // A start error: no episode, nothing to close.
    let mut e = Env::new(vec![5]);
    e.fail_start = vec![0];
    let env = Arc::new(e);
    let ev = run_session(env.clone(), 0, policy(0), Duration::from_secs(10), None).await;
    assert!(matches!(ended(&ev), (0, EndReason::Failed { .. })));
    assert_eq!(env.closed.load(Ordering::SeqCst), 0);

    // Stopped from outside mid-episode.
    let env = Arc::new(Env::new(vec![1000]));
    let ev = run_session(
        env.clone(),
        0,
        policy(20),
        Duration::from_secs(10),
        Some(Duration::from_millis(150)),
    )
    .await;
    assert_eq!(ended(&ev).1, EndReason::Stopped);
    assert_eq!(env.closed.load(Ordering::SeqCst), 1);
}

/// Judges by the turn index: 0 → +1, 1 → error, 2 → hangs, 3 → panics, else -1.
struct Judge;

impl TurnJudge for Judge {
    fn judge<'a>(&'a self, turn: &'a Turn) -> BoxFuture<'a, Result<Judgement, String>> {
        Box::pin(async move {
            match turn.turn {
                0 => Ok(Judgement {
                    reward: 1.0,
                    hint: None,
                    unjudged: None,
                    failed_votes: 0,
                    truncated_votes: 0,
                    record: json!({"turn": 0}),
                }),
                1 => Err("endpoint unreachable".into()),
                2 => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    unreachable!()
                }
                3 => panic!("judge bug"),
                _ => Ok(Judgement {
                    reward: -1.0,
                    hint: None,
                    unjudged: None,
                    failed_votes: 0,
                    truncated_votes: 0,
                    record: json!({}),
                }),
            }
        })
    }
}

#[tokio::test]
async fn failed_judging_leaves_turns_unjudged_with_the_reason() {
    let env = Arc::new(Env::new(vec![5]));
    let ev = run_session(env, 0, policy(0), Duration::from_secs(10), None).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (voter, _) = Actor::spawn(
        None,
        PrmVoter,
        VoterArgs {
            judge: Arc::new(Judge),
            timeout: Duration::from_millis(200),
            max_concurrent: 2,
            report: Arc::new(move |jt| {
                let _ = tx.send(jt);
            }),
        },
    )
    .await
    .unwrap();
    for t in turns(&ev) {
        voter.cast(VoterMsg::Judge(Box::new(t.clone()))).unwrap();
    }
    let mut got: HashMap<u32, JudgedTurn> = HashMap::new();
    while got.len() < 5 {
        let jt = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("every turn comes back")
            .unwrap();
        got.insert(jt.turn.turn, jt);
    }
    assert_eq!(got[&0].judgement.reward, 1.0);
    assert!(got[&0].judgement.unjudged.is_none());
    let reason = |i: u32| got[&i].judgement.unjudged.clone().unwrap();
    assert!(reason(1).contains("unreachable"));
    assert!(reason(2).contains("timed out"));
    assert!(reason(3).contains("judge task failed"), "{}", reason(3));
    for i in 1..=3 {
        let j = &got[&i].judgement;
        assert_eq!((j.reward, j.hint.as_deref()), (0.0, None));
        assert_eq!(j.record["unjudged"], reason(i));
        assert_eq!(j.record["turn"], i);
    }
    assert_eq!(got[&4].judgement.reward, -1.0);
    let stats = ractor::call_t!(voter, VoterMsg::Stats, 1000).unwrap();
    assert_eq!(
        (
            stats.received,
            stats.judged,
            stats.unjudged,
            stats.in_flight
        ),
        (5, 2, 3, 0)
    );
}

/// A sample: (session, turn, version).
struct Sample(String, u32, u64);

impl JobSample for Sample {
    fn version(&self) -> u64 {
        self.2
    }
    fn record(&self) -> serde_json::Value {
        json!({"session_id": self.0, "turn": self.1})
    }
}

/// One sample per judged turn with a non-zero reward.
struct Builder;

impl SampleBuilder<Sample> for Builder {
    fn build(
        &self,
        eps: Arc<Vec<EpisodeTurns>>,
    ) -> BoxFuture<'static, Result<Built<Sample>, String>> {
        Box::pin(async move {
            let samples = eps
                .iter()
                .flat_map(|e| e.turns.iter())
                .filter(|jt| jt.judgement.reward != 0.0)
                .map(|jt| {
                    Sample(
                        jt.turn.session_id.clone(),
                        jt.turn.turn,
                        jt.turn.policy.version,
                    )
                })
                .collect();
            Ok(Built {
                samples,
                teacher_versions: HashMap::new(),
            })
        })
    }
}

/// Steps every 4 samples; each step raises the policy's version.
struct Trainer {
    counts: Mutex<TrainerCounts>,
    policy: Arc<Policy>,
    seen: Mutex<Vec<(String, u32)>>,
}

impl TrainerLink<Sample> for Trainer {
    fn submit(&self, samples: Vec<Sample>) -> Result<(), String> {
        let mut c = self.counts.lock().unwrap();
        for s in samples {
            self.seen.lock().unwrap().push((s.0, s.1));
            c.produced += 1;
            c.pending += 1;
            if c.pending == 4 {
                c.pending = 0;
                c.trained += 4;
                c.steps += 1;
                c.version += 1;
                self.policy.version.store(c.version, Ordering::SeqCst);
            }
        }
        Ok(())
    }
    fn counts(&self) -> BoxFuture<'_, Result<TrainerCounts, String>> {
        let c = self.counts.lock().unwrap().clone();
        Box::pin(async move { Ok(c) })
    }
    /// This test trainer keeps no step limit of its own.
    fn set_max_steps(&self, _: Option<u64>) -> Result<(), String> {
        Ok(())
    }
}

/// Runs a job of `env`'s sessions acted on by `policy`, with the test judge and builder and a
/// trainer that counts: `parallelism` sessions at once, a failed session restarted up to
/// `max_restarts` times, until `steps` trainer steps (or until it stops on its own). The
/// trainer and the job's final counts; the job must stop within a minute.
async fn run_job(
    env: Arc<Env>,
    policy: Arc<Policy>,
    parallelism: usize,
    max_restarts: u32,
    steps: u64,
) -> (Arc<Trainer>, JobCounts) {
    run_judged_job(
        env,
        policy,
        parallelism,
        max_restarts,
        steps,
        Arc::new(Judge),
    )
    .await
}

/// [`run_job`] with `judge`.
async fn run_judged_job(
    env: Arc<Env>,
    policy: Arc<Policy>,
    parallelism: usize,
    max_restarts: u32,
    steps: u64,
    judge: Arc<dyn TurnJudge>,
) -> (Arc<Trainer>, JobCounts) {
    let trainer = Arc::new(Trainer {
        counts: Mutex::new(TrainerCounts::default()),
        policy: policy.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let (_job, done) = spawn_job(JobArgs {
        job: "j".into(),
        source: TurnSource::Sessions { env, policy },
        judge,
        builder: Arc::new(Builder),
        trainer: trainer.clone(),
        recorder: None,
        settings: JobSettings {
            parallelism,
            episode_deadline: Duration::from_secs(10),
            judge_timeout: Duration::from_millis(100),
            max_restarts,
            stop: StopCondition {
                max_trainer_steps: Some(steps),
                ..StopCondition::default()
            },
            poll: Duration::from_millis(20),
            ..JobSettings::default()
        },
        progress: None,
        done: None,
    })
    .await
    .unwrap();
    let c = tokio::time::timeout(Duration::from_secs(60), done)
        .await
        .expect("the job stops")
        .unwrap();
    (trainer, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_restarts_failed_sessions_counts_lost_ones_and_balances() {
    // Task 1 never starts; task 2 fails at its second step; 0 and 3 run 3 steps.
    let mut e = Env::new(vec![3, 3, 3, 3]);
    e.fail_start = vec![1];
    e.fail_step = vec![2];
    let env = Arc::new(e);
    let (trainer, c) = run_job(env.clone(), policy(2), 3, 2, 3).await;
    assert!(c.trainer.steps >= 3, "{c:?}");
    assert!(c.balanced());
    assert_eq!(c.turns, c.judged + c.unjudged, "{c:?}");
    assert_eq!(c.history_rewritten, 0, "{c:?}");
    assert_eq!(c.sessions_running, 0);
    // Every started session ended one way or the other.
    assert_eq!(
        c.sessions_started,
        c.sessions_finished + c.sessions_failed,
        "{c:?}"
    );
    // Task 1's slot: the first try and max_restarts restarts fail, then it is lost.
    assert!(c.sessions_lost >= 1, "{c:?}");
    assert!(c.sessions_restarted >= 2, "{c:?}");
    assert!(c.sessions_failed >= c.sessions_lost, "{c:?}");
    // Samples handed over are exactly those the trainer saw; unjudged turns (1, 2, 3 of each
    // episode) give none.
    assert_eq!(c.samples_submitted, c.trainer.produced);
    let seen = trainer.seen.lock().unwrap();
    assert_eq!(seen.len() as u64, c.samples_submitted);
    assert!(seen.iter().all(|(_, turn)| *turn == 0 || *turn >= 4));
    // Every episode that started was closed.
    assert_eq!(
        env.closed.load(Ordering::SeqCst),
        env.started.load(Ordering::SeqCst)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_counts_the_turns_whose_prompt_rewrote_the_history() {
    let env = Arc::new(Env::new(vec![3, 3]));
    let rewriting = Arc::new(Policy {
        delay: Duration::from_millis(1),
        version: AtomicU64::new(0),
        rewrite: true,
    });
    let (_, c) = run_job(env, rewriting, 2, 0, 2).await;
    // Every turn but a session's first rewrote the history; a session stopped before its first
    // turn has none.
    assert!(c.turns > c.sessions_started, "{c:?}");
    assert!(
        c.history_rewritten >= c.turns - c.sessions_started && c.history_rewritten < c.turns,
        "{c:?}"
    );
}

/// A judge that never gives a verdict: its endpoint refuses every request.
struct Refusing;

impl TurnJudge for Refusing {
    fn judge<'a>(&'a self, _: &'a Turn) -> BoxFuture<'a, Result<Judgement, String>> {
        Box::pin(async { Err("connection refused".into()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_judge_never_gives_a_verdict_stops_with_its_error() {
    // Tasks of many steps, so the sessions keep producing turns the judge is asked about.
    let env = Arc::new(Env::new(vec![40; 8]));
    let (_, c) = run_judged_job(env, policy(1), 2, 0, 1, Arc::new(Refusing)).await;
    let why = c.gave_up.as_deref().expect("the job says it gave up");
    assert!(
        why.contains("the judge gave no verdict on any turn"),
        "{why}"
    );
    assert!(
        why.contains("connection refused"),
        "the judge's error is named: {why}"
    );
    assert_eq!(c.stopped_by, Some(StopCause::GaveUp), "{c:?}");
    assert_eq!(c.judged, 0, "{c:?}");
    assert!(c.unjudged >= job::judge_failure_limit(2), "{c:?}");
    assert_eq!(c.trainer.steps, 0);
    assert!(c.balanced());
}

#[tokio::test]
async fn a_job_whose_sessions_all_fail_stops_with_the_error() {
    // No task can start: the job must stop on its own (not spin through the task set) and say
    // why, although its stop condition (trainer steps) can never be reached.
    let mut e = Env::new(vec![3, 3]);
    e.fail_start = vec![0, 1];
    let env = Arc::new(e);
    let (_, c) = run_job(env.clone(), policy(1), 2, 1, 1).await;
    let why = c.gave_up.as_deref().expect("the job says it gave up");
    assert!(why.contains("every session failed"), "{why}");
    assert!(
        why.contains("cannot start"),
        "the sessions' error is named: {why}"
    );
    assert!(c.sessions_lost >= 2, "{c:?}");
    assert_eq!(c.trainer.steps, 0);
    assert!(c.balanced());
}

/// Records the task and group of every episode of every build, and makes one sample per judged
/// turn with a non-zero reward (as [`Builder`]).
#[derive(Default)]
struct GroupRecorder {
    builds: Mutex<Vec<Vec<EpisodeTag>>>,
}

/// An episode's task id, group, and whether it ended in a failure.
type EpisodeTag = (String, Option<u64>, bool);

impl SampleBuilder<Sample> for Arc<GroupRecorder> {
    fn build(
        &self,
        eps: Arc<Vec<EpisodeTurns>>,
    ) -> BoxFuture<'static, Result<Built<Sample>, String>> {
        self.builds.lock().unwrap().push(
            eps.iter()
                .map(|e| (e.task_id.clone(), e.group, e.reason.is_failure()))
                .collect(),
        );
        Builder.build(eps)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_groups_builds_whole_groups_of_one_task_and_drops_failed_ones() {
    // Groups of 2 episodes. Task 1 never starts and task 2 fails at its second step, so their
    // groups are retried and then dropped whole; groups of tasks 0 and 3 are built.
    let mut e = Env::new(vec![3, 3, 3, 3]);
    e.fail_start = vec![1];
    e.fail_step = vec![2];
    let env = Arc::new(e);
    let p = policy(2);
    let trainer = Arc::new(Trainer {
        counts: Mutex::new(TrainerCounts::default()),
        policy: p.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let builds = Arc::new(GroupRecorder::default());
    let (_job, done) = spawn_job(JobArgs {
        job: "j".into(),
        source: TurnSource::Sessions {
            env: env.clone(),
            policy: p.clone(),
        },
        judge: Arc::new(Judge),
        builder: Arc::new(builds.clone()),
        trainer: trainer.clone(),
        recorder: None,
        settings: JobSettings {
            parallelism: 3,
            episode_deadline: Duration::from_secs(10),
            judge_timeout: Duration::from_millis(100),
            max_restarts: 1,
            stop: StopCondition {
                max_trainer_steps: Some(3),
                ..StopCondition::default()
            },
            poll: Duration::from_millis(20),
            group_size: Some(2),
            ..JobSettings::default()
        },
        progress: None,
        done: None,
    })
    .await
    .unwrap();
    let c = tokio::time::timeout(Duration::from_secs(60), done)
        .await
        .expect("the job stops")
        .unwrap();
    assert!(c.trainer.steps >= 3, "{c:?}");
    assert!(c.balanced());
    assert_eq!(c.turns, c.judged + c.unjudged, "{c:?}");
    let g = c.groups.clone().expect("group counts");
    assert_eq!(g.size, 2);
    assert!(
        g.dropped >= 2,
        "the groups of tasks 1 and 2 are dropped: {g:?}"
    );
    assert!(g.built >= 2, "{g:?}");
    assert!(g.episodes_discarded >= 1, "task 2's failed attempts: {g:?}");
    assert!(g.started >= g.built + g.short + g.dropped, "{g:?}");
    let builds = builds.builds.lock().unwrap();
    assert_eq!(
        builds.len() as u64,
        g.built + g.short,
        "one build per group"
    );
    for b in builds.iter() {
        // One group, one task.
        assert!(!b.is_empty() && b.len() <= 2, "{b:?}");
        assert!(
            b.iter().all(|e| (&e.0, e.1) == (&b[0].0, b[0].1)),
            "a build mixes groups: {b:?}"
        );
        assert!(b[0].1.is_some(), "{b:?}");
        // No failed attempt is ever built. Task 1 never starts; task 2's episodes fail at their
        // second step, so one of its groups is built only when the stop ended its members
        // before that (a drain stops episodes; stopped ones are members).
        assert!(b.iter().all(|e| !e.2), "a failed episode was built: {b:?}");
        assert_ne!(b[0].0, "t1", "{b:?}");
    }
    assert_eq!(
        builds.iter().filter(|b| b.len() == 2).count() as u64,
        g.built,
        "{builds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offered_turns_are_one_turn_episodes_and_the_job_drains_only_once_the_source_closes() {
    // A turn to offer, made by a real session; copies of it stand for a gateway's turns.
    let env = Arc::new(Env::new(vec![1]));
    let ev = run_session(env, 0, policy(0), Duration::from_secs(10), None).await;
    let template = turns(&ev)[0].clone();
    let offered = |session: &str, turn: u32| {
        let mut t = template.clone();
        t.session_id = session.into();
        t.turn = turn;
        JobMsg::Offer(Box::new(t))
    };
    let p = policy(0);
    let trainer = Arc::new(Trainer {
        counts: Mutex::new(TrainerCounts::default()),
        policy: p.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let (job, done) = spawn_job(JobArgs {
        job: "offered".into(),
        source: TurnSource::Offered,
        judge: Arc::new(Judge),
        builder: Arc::new(Builder),
        trainer: trainer.clone(),
        recorder: None,
        settings: JobSettings {
            // Unused: no session is ever started for an offering source.
            parallelism: 0,
            judge_timeout: Duration::from_millis(200),
            stop: StopCondition {
                max_samples: Some(100),
                ..StopCondition::default()
            },
            poll: Duration::from_millis(10),
            ..JobSettings::default()
        },
        progress: None,
        done: None,
    })
    .await
    .unwrap();
    // Judge: turn 0 → +1, turn 1 → an error (unjudged), turns 4 and 5 → −1.
    job.cast(offered("a", 0)).unwrap();
    job.cast(offered("b", 0)).unwrap();
    job.cast(offered("a", 1)).unwrap();
    job.cast(offered("a", 4)).unwrap();
    job.cast(JobMsg::Stop).unwrap();
    // Still taken while draining: the source's last turns come after the stop.
    job.cast(offered("b", 5)).unwrap();
    let c = ractor::call_t!(job, JobMsg::Counts, 1000).unwrap();
    assert_eq!(c.phase, JobPhase::Draining, "{c:?}");
    job.cast(JobMsg::SourceClosed).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(30), done)
        .await
        .expect("the job finishes once its source is closed")
        .unwrap();
    assert_eq!(c.phase, JobPhase::Finished);
    assert_eq!(c.stopped_by, Some(StopCause::Requested));
    assert_eq!((c.turns, c.sessions_started), (5, 2), "{c:?}");
    assert_eq!((c.judged, c.unjudged), (4, 1), "{c:?}");
    // Each turn is an episode of its own; the unjudged one gives no sample.
    assert_eq!(c.episodes_built, 5, "{c:?}");
    assert_eq!(c.samples_submitted, 4, "{c:?}");
    let mut seen = trainer.seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("a".to_string(), 0),
            ("a".to_string(), 4),
            ("b".to_string(), 0),
            ("b".to_string(), 5)
        ]
    );
}
