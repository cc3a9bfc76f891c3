//! A job across several `clawrl node` processes on loopback (mutual TLS), and its faults: a
//! rollout node SIGKILLed mid-job (its sessions re-route, the job completes), an environment
//! node SIGKILLed (its sessions restart on the other node or count as lost), and the trainer
//! node SIGKILLed (restarted, it resumes from the last checkpoint and versions keep counting
//! up). Every job uses the fixture policy, a scripted environment and a scripted judge; counts
//! must balance (`produced = trained + dropped_stale + failed + pending`). One more job trains
//! a LoRA adapter across nodes: the rollout node serves adapter versions over a base it fetched.
//! And a job whose home lacks the `judge` role has its turns judged on two judge nodes, one of
//! which is SIGKILLed mid-job.
//!
//! No test races its job: each job is submitted with a step limit it cannot reach
//! ([`HELD_OPEN`]), so it is still running when the fault is in place whatever the machine's
//! speed; only then does the test set the real limit through Control (`clawrl limit`), above
//! the steps already made, and the job runs on to it.
//!
//! The tests share the machine's cores, so they run one at a time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::util::*;
use serde_json::Value;

pub(crate) const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");
/// Generous: waits end as soon as their condition holds.
pub(crate) const LONG: Duration = Duration::from_secs(240);
/// The step limit jobs are submitted with: far more steps than a test ever waits for, so a
/// job ends only after the test has set its real limit.
const HELD_OPEN: u64 = 1_000_000;

pub(crate) static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The jobs' judge: the scripted environment's replies say "wrong" or "thanks".
const SCRIPTED_JUDGE: &str = r#"backend = "scripted"
votes = 1
rules = [{ pattern = "(?i)wrong", score = -1 }, { pattern = "(?i)thanks", score = 1 }]"#;

pub(crate) struct Cluster {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) certs: PathBuf,
    pub(crate) ports: BTreeMap<String, u16>,
    configs: BTreeMap<String, PathBuf>,
    pub(crate) procs: BTreeMap<String, NodeProc>,
    extra: BTreeMap<String, Vec<String>>,
}

impl Cluster {
    /// Certificates for `names`; the first is the seed of the others.
    pub(crate) fn new(names: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let certs = init_certs(dir.path(), names);
        let ports = names.iter().map(|n| (n.to_string(), free_port())).collect();
        Cluster {
            dir,
            certs,
            ports,
            configs: BTreeMap::new(),
            procs: BTreeMap::new(),
            extra: BTreeMap::new(),
        }
    }

    pub(crate) fn seed_port(&self) -> u16 {
        *self.ports.values().next().unwrap()
    }

    /// The usual four nodes, started and up: `ctl` (control), `tr` (trainer, judge), `r1`
    /// (rollout) and `e1` (env, 4 scripted workers); certificates are made for `more` too.
    pub(crate) fn one_of_each(more: &[&str]) -> Cluster {
        let names: Vec<&str> = ["ctl", "tr", "r1", "e1"]
            .iter()
            .chain(more)
            .copied()
            .collect();
        let mut c = Cluster::new(&names);
        c.start("ctl", &["control"], None);
        c.start("tr", &["trainer", "judge"], None);
        c.start("r1", &["rollout"], None);
        c.start("e1", &["env"], Some("scripted:4"));
        c.wait_up(&[("clawrl.rollout", 1), ("clawrl.envhost.scripted", 1)]);
        c
    }

    /// Starts node `name` with `roles`, hosting environment workers `env` (`KIND:N`) if any.
    pub(crate) fn start(&mut self, name: &str, roles: &[&str], env: Option<&str>) {
        let port = self.ports[name];
        let seeds: Vec<u16> = if port == self.seed_port() {
            vec![]
        } else {
            vec![self.seed_port()]
        };
        let cfg = write_config(
            self.dir.path(),
            name,
            port,
            &seeds,
            roles,
            Some(&self.certs),
        );
        let extra: Vec<String> = env
            .map(|e| vec!["--env".into(), e.into()])
            .unwrap_or_default();
        self.extra.insert(name.into(), extra);
        self.configs.insert(name.into(), cfg);
        self.restart(name);
    }

    /// (Re)starts node `name` with the config and options it was started with.
    pub(crate) fn restart(&mut self, name: &str) {
        let extra: Vec<&str> = self.extra[name].iter().map(|s| s.as_str()).collect();
        let p = NodeProc::start("node", &self.configs[name], &extra);
        self.procs.insert(name.into(), p);
    }

    pub(crate) fn kill(&mut self, name: &str) {
        self.procs.get_mut(name).unwrap().kill();
    }

    pub(crate) fn control(&self) -> &Path {
        &self.configs[self.ports.keys().next().unwrap()]
    }

    pub(crate) fn logs(&self) -> String {
        let mut s = String::new();
        for (n, p) in &self.procs {
            s += &format!("---- {n}\n{}\n", p.log_text());
        }
        s
    }

    /// Waits until the control node sees every started node and the groups have `want` members.
    pub(crate) fn wait_up(&self, want: &[(&str, usize)]) {
        let n = self.configs.len();
        wait_for(LONG, || {
            view(self.control()).filter(|v| {
                node_names(v).len() == n && want.iter().all(|(g, k)| members(v, g).len() == *k)
            })
        })
        .unwrap_or_else(|| panic!("the cluster never came up:\n{}", self.logs()));
    }

    /// Waits until the control node sees the groups with `want` members after a node died.
    pub(crate) fn wait_up_after_loss(&self, want: &[(&str, usize)]) {
        wait_for(LONG, || {
            view(self.control()).filter(|v| want.iter().all(|(g, k)| members(v, g).len() == *k))
        })
        .unwrap_or_else(|| panic!("the cluster never noticed the loss:\n{}", self.logs()));
    }

    /// Writes the job spec and submits it, held open ([`HELD_OPEN`]); returns the job id.
    pub(crate) fn submit(&self, parallelism: u32, checkpoint_every: u64) -> String {
        self.submit_with(parallelism, checkpoint_every, "")
    }

    /// [`submit`](Self::submit) with more `[policy]` keys.
    pub(crate) fn submit_with(
        &self,
        parallelism: u32,
        checkpoint_every: u64,
        policy_keys: &str,
    ) -> String {
        self.submit_judged(parallelism, checkpoint_every, policy_keys, SCRIPTED_JUDGE)
    }

    /// [`submit_with`](Self::submit_with) with `judge` as the spec's `[judge]` keys.
    pub(crate) fn submit_judged(
        &self,
        parallelism: u32,
        checkpoint_every: u64,
        policy_keys: &str,
        judge: &str,
    ) -> String {
        let tasks = self.dir.path().join("tasks.jsonl");
        std::fs::write(
            &tasks,
            concat!(
                "{\"id\":\"a\",\"instruction\":\"Say hello.\",\"replies\":[\"No, wrong. Hint: greet me by name, Ada.\",\"Thanks, great.\"]}\n",
                "{\"id\":\"b\",\"instruction\":\"Count to three.\",\"replies\":[\"Wrong. Hint: write the digits 1 2 3 only.\",\"Good, thanks.\"]}\n",
                "{\"id\":\"c\",\"instruction\":\"Name a color.\",\"replies\":[\"Great, thanks!\",\"Now another one, thanks.\"]}\n",
            ),
        )
        .unwrap();
        let spec = format!(
            r#"kind = "rl"
name = "faults"
seed = 3
[policy]
checkpoint = "{FIXTURE}"
max_new_tokens = 8
max_context = 512
{policy_keys}
[judge]
{judge}
[method]
kind = "binary"
[optim]
batch_size = 4
lr = 1e-3
clip = 0.2
kl = 0.0
staleness = 1000
checkpoint_every = {checkpoint_every}
[env]
kind = "scripted"
parallelism = {parallelism}
tasks = "tasks.jsonl"
[stop]
max_steps = {HELD_OPEN}
"#
        );
        let job = self.dir.path().join("job.toml");
        std::fs::write(&job, spec).unwrap();
        let out = clawrl_ok(&[
            "submit",
            job.to_str().unwrap(),
            "--config",
            self.control().to_str().unwrap(),
        ]);
        out.split('\t').next().unwrap().to_string()
    }

    /// The job's reported counts, once `ok` holds for them.
    pub(crate) fn wait_counts(&self, job: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        wait_for(LONG, || {
            let out = clawrl(&[
                "status",
                job,
                "--config",
                self.control().to_str().unwrap(),
                "--json",
            ]);
            if !out.status.success() {
                return None;
            }
            let v: Value = serde_json::from_slice(&out.stdout).ok()?;
            let p = v[0]["progress"].clone();
            (!p.is_null() && ok(&p)).then_some(p)
        })
        .unwrap_or_else(|| panic!("{what} never happened:\n{}", self.logs()))
    }

    /// Sets the job's step limit through Control.
    pub(crate) fn limit(&self, job: &str, max_steps: u64) {
        clawrl_ok(&[
            "limit",
            job,
            "--max-steps",
            &max_steps.to_string(),
            "--config",
            self.control().to_str().unwrap(),
        ]);
    }

    /// Once the job has made progress past `after` (more turns and more trainer steps), sets
    /// its step limit a few steps above where it stands; returns the limit.
    pub(crate) fn finish_after_progress(&self, job: &str, after: &Value) -> u64 {
        let (turns, steps) = (n(after, "turns"), n(&after["trainer"], "steps"));
        let now = self.wait_counts(job, "progress after the fault", |p| {
            p["turns"].as_u64().unwrap_or(0) > turns
                && p["trainer"]["steps"].as_u64().unwrap_or(0) > steps
        });
        let max_steps = n(&now["trainer"], "steps") + 2;
        self.limit(job, max_steps);
        max_steps
    }

    pub(crate) fn wait_finished(&self, job: &str) -> Value {
        self.wait_counts(job, "the job's end", |p| p["phase"] == "finished")
    }
}

pub(crate) fn n(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no `{key}` in {v}"))
}

/// Checks a finished job: it reached its stop condition without giving up, and its counts
/// balance.
pub(crate) fn assert_completed(c: &Value, max_steps: u64) {
    assert!(c["gave_up"].is_null(), "{c}");
    let t = &c["trainer"];
    assert!(n(t, "steps") >= max_steps, "{c}");
    assert_eq!(
        n(t, "produced"),
        n(t, "trained") + n(t, "dropped_stale") + n(t, "failed") + n(t, "pending"),
        "the counts do not balance: {c}"
    );
    assert!(n(t, "trained") > 0, "{c}");
    assert_eq!(n(c, "samples_refused"), 0, "{c}");
}

#[test]
fn a_job_survives_a_rollout_node_killed_mid_job() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(&["ctl", "tr", "r1", "r2", "e1"]);
    c.start("ctl", &["control"], None);
    c.start("tr", &["trainer", "judge"], None);
    c.start("r1", &["rollout"], None);
    c.start("r2", &["rollout"], None);
    c.start("e1", &["env"], Some("scripted:4"));
    c.wait_up(&[("clawrl.rollout", 2), ("clawrl.envhost.scripted", 1)]);

    let job = c.submit(4, 0);
    // Both rollout nodes serve the job, and turns flow.
    let before = c.wait_counts(&job, "turns through both rollout nodes", |p| {
        p["turns"].as_u64().unwrap_or(0) >= 12
    });
    for r in ["r1", "r2"] {
        assert!(
            c.procs[r].log_text().contains("serving the job's policy"),
            "{r} never served:\n{}",
            c.logs()
        );
    }
    c.kill("r1");
    // Once the cluster has noticed (r1 left the group), the job is still running...
    c.wait_up_after_loss(&[("clawrl.rollout", 1)]);
    let after = c.wait_counts(&job, "counts after the kill", |_| true);
    assert_eq!(after["phase"], "running", "{after}");
    assert!(n(&after, "turns") >= n(&before, "turns"));
    // ... goes on with turns generated by r2 alone, and completes.
    let max_steps = c.finish_after_progress(&job, &after);
    let end = c.wait_finished(&job);
    assert_completed(&end, max_steps);
    assert!(
        n(&end, "turns") > n(&after, "turns"),
        "no turn after the kill: {end}"
    );
    // Sessions re-routed to r2: none was lost.
    assert_eq!(n(&end, "sessions_lost"), 0, "{end}");
}

#[test]
fn a_home_without_the_judge_role_has_its_turns_judged_on_judge_nodes_and_survives_one_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(&["ctl", "tr", "j1", "j2", "e1"]);
    c.start("ctl", &["control"], None);
    c.start("tr", &["trainer", "rollout"], None);
    c.start("j1", &["judge"], None);
    c.start("j2", &["judge"], None);
    c.start("e1", &["env"], Some("scripted:4"));
    c.wait_up(&[
        ("clawrl.rollout", 1),
        ("clawrl.envhost.scripted", 1),
        ("clawrl.judge", 2),
    ]);

    let job = c.submit(4, 0);
    // Turns are judged, and both judge nodes built the job's judge and judged some of them.
    let before = c.wait_counts(&job, "turns judged on both judge nodes", |p| {
        p["judged"].as_u64().unwrap_or(0) >= 12
    });
    for j in ["j1", "j2"] {
        assert!(
            c.procs[j].log_text().contains("built the job's judge"),
            "{j} never judged:\n{}",
            c.logs()
        );
    }
    c.kill("j1");
    // Once the cluster has noticed, the job is still running, its turns judged on j2 alone.
    c.wait_up_after_loss(&[("clawrl.judge", 1)]);
    let after = c.wait_counts(&job, "counts after the kill", |_| true);
    assert_eq!(after["phase"], "running", "{after}");
    let judged = n(&after, "judged");
    let max_steps = c.finish_after_progress(&job, &after);
    let end = c.wait_finished(&job);
    assert_completed(&end, max_steps);
    assert!(
        n(&end, "judged") > judged.max(n(&before, "judged")),
        "no turn judged after the kill: {end}"
    );
}

#[test]
fn a_judge_node_whose_grants_refuse_the_judge_fails_the_job_naming_the_key() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(&["ctl", "tr", "j1", "e1"]);
    c.start("ctl", &["control"], None);
    c.start("tr", &["trainer", "rollout"], None);
    c.start("j1", &["judge"], None);
    c.start("e1", &["env"], Some("scripted:2"));
    c.wait_up(&[
        ("clawrl.rollout", 1),
        ("clawrl.envhost.scripted", 1),
        ("clawrl.judge", 1),
    ]);
    // j1 grants loopback endpoints only (the default): this one is refused there, before the
    // judge sends anything.
    let job = c.submit_judged(
        2,
        0,
        "",
        "backend = \"openai\"\nvotes = 1\nendpoint = \"http://192.0.2.1:9/v1\"\nmodel = \"judge\"",
    );
    let end = c.wait_finished(&job);
    let why = end["gave_up"].as_str().unwrap_or_default();
    assert!(
        why.contains("judge host j1/judge")
            && why.contains("judge.endpoint `http://192.0.2.1:9/v1` is not allowed on this node"),
        "{end}"
    );
    assert_eq!(n(&end, "turns"), 0, "{end}");
}

#[test]
fn a_job_survives_an_environment_node_killed_mid_job() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(&["ctl", "tr", "e1", "e2"]);
    c.start("ctl", &["control"], None);
    c.start("tr", &["trainer", "judge", "rollout"], None);
    c.start("e1", &["env"], Some("scripted:2"));
    c.start("e2", &["env"], Some("scripted:2"));
    c.wait_up(&[("clawrl.rollout", 1), ("clawrl.envhost.scripted", 2)]);

    let job = c.submit(4, 0);
    c.wait_counts(&job, "turns on both environment nodes", |p| {
        p["turns"].as_u64().unwrap_or(0) >= 12
    });
    for e in ["e1", "e2"] {
        assert!(
            c.procs[e]
                .log_text()
                .contains("built the job's `scripted` environment"),
            "{e} never hosted the job:\n{}",
            c.logs()
        );
    }
    c.kill("e1");
    c.wait_up_after_loss(&[("clawrl.envhost.scripted", 1)]);
    let after = c.wait_counts(&job, "counts after the kill", |_| true);
    assert_eq!(after["phase"], "running", "{after}");
    let max_steps = c.finish_after_progress(&job, &after);
    let end = c.wait_finished(&job);
    assert!(
        n(&end, "turns") > n(&after, "turns"),
        "no turn after the kill: {end}"
    );
    assert_completed(&end, max_steps);
    // The sessions whose episodes lived on e1 failed and were restarted (on e2) or lost; the
    // job went on to its stop condition.
    let failed = n(&end, "sessions_failed");
    assert!(failed >= 1, "no session noticed e1's death: {end}");
    assert_eq!(
        failed,
        n(&end, "sessions_restarted") + n(&end, "sessions_lost"),
        "{end}"
    );
    // Control now places the job only on e2's workers.
    let status = job_status(c.control(), &job);
    let workers = status["placement"]["env_slots"].as_array().unwrap();
    assert!(
        workers
            .iter()
            .all(|w| w.as_str().unwrap().starts_with("e2/")),
        "{status}"
    );
}

#[test]
fn a_restarted_trainer_node_resumes_the_job_from_its_checkpoint() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(&["ctl", "tr", "e1"]);
    c.start("ctl", &["control"], None);
    c.start("tr", &["trainer", "judge", "rollout"], None);
    c.start("e1", &["env", "rollout"], Some("scripted:2"));
    c.wait_up(&[("clawrl.rollout", 2), ("clawrl.envhost.scripted", 1)]);

    let job = c.submit(2, 1);
    let before = c.wait_counts(&job, "three trainer versions", |p| {
        p["trainer"]["version"].as_u64().unwrap_or(0) >= 3
    });
    c.kill("tr");
    // The dead incarnation checkpointed after every step, so it made at most one step past
    // its newest checkpoint.
    let checkpoints = c.dir.path().join(format!("data/tr/jobs/{job}/checkpoints"));
    let latest = std::fs::read_to_string(checkpoints.join("latest"))
        .unwrap_or_else(|e| panic!("no checkpoint in {}: {e}", checkpoints.display()));
    let saved_steps: u64 = latest
        .trim()
        .strip_prefix("step-")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("`latest` names {latest:?}"));
    assert!(saved_steps >= 1, "{latest}");
    // The limit is set while the trainer node is down: the restarted job runs with it, and it
    // lies beyond any step the dead incarnation made.
    let max_steps = saved_steps + 3;
    c.limit(&job, max_steps);
    c.restart("tr");
    let end = c.wait_finished(&job);
    assert_completed(&end, max_steps);
    // The new incarnation resumed (its versions continue above those reported before the kill).
    assert!(
        n(&end["trainer"], "version") > n(&before["trainer"], "version"),
        "before {before}\nafter {end}"
    );
    let log = c.procs["tr"].log_text();
    assert!(
        log.contains("trainer resumed"),
        "the trainer did not resume:\n{log}"
    );
}

/// A job that trains a LoRA adapter runs across nodes: the rollout node fetches the job's base
/// from the trainer node once, then installs every version (an adapter alone) over it; turns
/// flow on trained versions and the job completes.
#[test]
fn a_lora_job_across_nodes_serves_adapter_versions_over_a_base_fetched_once() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let c = Cluster::one_of_each(&[]);

    let job = c.submit_with(
        4,
        0,
        r#"lora = { r = 4, alpha = 8, targets = ["q_proj", "v_proj", "up_proj"] }"#,
    );
    let now = c.wait_counts(&job, "two trainer steps", |p| {
        p["trainer"]["steps"].as_u64().unwrap_or(0) >= 2
    });
    let max_steps = n(&now["trainer"], "steps") + 2;
    c.limit(&job, max_steps);
    let end = c.wait_finished(&job);
    assert_completed(&end, max_steps);
    let log = c.procs["r1"].log_text();
    assert!(log.contains("serving the job's policy"), "{}", c.logs());
    // Versions above 0 exist only as adapters: r1 serving one means it attached it to the base.
    let served = served_versions(&log);
    assert!(
        served.iter().any(|&v| v >= 2),
        "r1 never served a trained adapter version ({served:?}):\n{}",
        c.logs()
    );
    assert!(!log.contains("loading the weights failed"), "{}", c.logs());
}

/// The weight versions a rollout node's `log` says it served.
pub(crate) fn served_versions(log: &str) -> Vec<u64> {
    log.lines()
        .map(without_ansi)
        .filter(|l| l.contains("serving a new weight version"))
        .filter_map(|l| {
            let v = l.split(" version=").nth(1)?;
            v.split(|ch: char| !ch.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// `line` without its terminal colour codes (`ESC [ ... m`).
pub(crate) fn without_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}
