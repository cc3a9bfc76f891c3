//! Model-driven terminal, SWE, tool-call and GUI jobs end to end, in-process through `run_job`
//! from a JOB.toml: the policy generates on the rendered prompt with its tools, tool calls are
//! parsed from the sampled tokens, executed in the sandbox (the GUI: in a headless browser),
//! judged, built into samples, trained on, and every replica switches to the published versions.
//! The random-policy jobs train step-wise: their episodes mostly end at once with a plain
//! answer, a step without a next state that only the outcome rewards.
//!
//! The fixture policy holds 512 positions and these prompts do not fit it (a job on it is refused
//! before any session starts, naming the numbers), so each test makes its own checkpoint: the
//! fixture's tokenizer, a seeded random Qwen3 of the fixture's shape with 2048 positions (8192 for
//! the GUI, whose first prompt is about 2600 tokens), written
//! with the project's checkpoint writer. Random weights almost never write a valid tool call, so
//! one test first fine-tunes its checkpoint through the project's learner on a single canned
//! first turn of a terminal task (the shell call that solves it), then checks that the job's own
//! sampling produced that call, that the sandbox ran it and that the task's check passed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::AutodiffModule;
use clawrl::job::JobSpec;
use clawrl::model::checkpoint::{load_tokenizer_files, TokenizerFiles};
use clawrl::model::{save_checkpoint_dir, ChatTemplate, Qwen3Config};
use clawrl::pipeline::fit::FitError;
use clawrl::pipeline::{run_job, RunError, RunOptions, RunReport};
use clawrl::train::learner::BurnLearner;
use clawrl::train::{Sample, TrainConfig};
use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3-tiny");

/// The fixture's config with `positions` positions, stored in float32.
fn config(positions: usize) -> Qwen3Config {
    let text = std::fs::read_to_string(Path::new(FIXTURE).join("config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    cfg["max_position_embeddings"] = positions.into();
    cfg["dtype"] = "float32".into();
    cfg["torch_dtype"] = "float32".into();
    Qwen3Config::from_json(&cfg.to_string()).unwrap()
}

/// The fixture's tokenizer files, with `template` as the chat template when given.
fn tokenizer_files(template: Option<&str>) -> TokenizerFiles {
    let (_, _, mut files) = load_tokenizer_files(Path::new(FIXTURE)).unwrap();
    if let Some(t) = template {
        let mut cfg: Value =
            serde_json::from_str(files.tokenizer_config_json.as_deref().unwrap()).unwrap();
        cfg["chat_template"] = t.into();
        files.tokenizer_config_json = Some(cfg.to_string());
    }
    files
}

fn learner(positions: usize, lr: f64) -> BurnLearner {
    let cfg = config(positions);
    let model = clawrl::model::Qwen3::<clawrl::CpuAutodiff>::init(&cfg, &Default::default(), 11);
    let train = TrainConfig {
        lr,
        weight_decay: 0.0,
        kl_coef: 0.0,
        batch_size: 1,
        ..TrainConfig::default()
    };
    BurnLearner::new(cfg, model, train, Default::default(), 11)
}

fn save(learner: &BurnLearner, dir: &Path, files: &TokenizerFiles) {
    save_checkpoint_dir(
        dir,
        learner.model_config(),
        &learner.policy().valid(),
        files,
    )
    .unwrap();
}

fn first_line(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

struct Job<'a> {
    checkpoint: &'a Path,
    kind: &'a str,
    tasks: &'a str,
    temperature: f32,
    max_new_tokens: u32,
    max_steps: u32,
    /// `binary` needs a next state, which a one-turn episode's only turn lacks; `stepwise`
    /// rewards every step with the episode's outcome (plus its process score).
    method: &'a str,
    /// `policy.max_context` (the checkpoint's positions).
    max_context: usize,
}

fn spec_text(j: &Job) -> String {
    format!(
        r#"
kind = "rl"
name = "agent-{kind}"
seed = 5
[policy]
checkpoint = "{ckpt}"
replicas = 2
temperature = {temperature}
max_new_tokens = {max_new_tokens}
max_context = {max_context}
[judge]
backend = "scripted"
votes = 1
timeout_s = 60
rules = [
  {{ pattern = "exit code: 0", score = 1 }},
  {{ pattern = "(?i)error|exit code: [1-9]", score = -1 }},
]
default_score = 0
[method]
kind = "{method}"
[optim]
batch_size = 2
lr = 1e-4
clip = 0.2
kl = 0.0
staleness = 4
[env]
kind = "{kind}"
parallelism = 2
tasks = "{tasks}"
max_steps = {max_steps}
episode_timeout_s = 120
{group}
[stop]
max_steps = 2
"#,
        kind = j.kind,
        ckpt = j.checkpoint.display(),
        temperature = j.temperature,
        max_new_tokens = j.max_new_tokens,
        tasks = j.tasks,
        max_steps = j.max_steps,
        method = j.method,
        max_context = j.max_context,
        // Step-wise: GRPO groups of two episodes, so that two steps' samples come soon.
        group = if j.method == "stepwise" {
            "group_size = 2"
        } else {
            ""
        },
    )
}

async fn run(dir: &Path, job: &Job<'_>) -> Result<(RunReport, Vec<(String, Value)>), RunError> {
    let file = dir.join(format!("{}.toml", job.kind));
    std::fs::write(&file, spec_text(job)).unwrap();
    let spec = JobSpec::load(&file).unwrap();
    let report = tokio::time::timeout(
        Duration::from_secs(600),
        run_job(
            &spec,
            &file.display().to_string(),
            RunOptions {
                out: dir.join(format!("run-{}", job.kind)),
                job_id: format!("agent-{}", job.kind),
                progress: None,
                poll: Duration::from_millis(50),
            },
        ),
    )
    .await
    .expect("the job finishes")?;
    let mut records = Vec::new();
    for f in std::fs::read_dir(&report.records_dir).unwrap() {
        for line in std::fs::read_to_string(f.unwrap().path()).unwrap().lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            records.push((v["kind"].as_str().unwrap().to_string(), v["record"].clone()));
        }
    }
    Ok((report, records))
}

/// What every model-driven job must show: trained versions served by every replica, balanced
/// counts, no failed session, and turns whose prompts exceed the fixture's 512 positions.
fn check_job(kind: &str, r: &RunReport, records: &[(String, Value)]) {
    let t = &r.trainer;
    assert!(r.counts.gave_up.is_none(), "{kind}: {:?}", r.counts.gave_up);
    assert_eq!(r.counts.sessions_failed, 0, "{kind}: {:?}", r.counts);
    assert!(t.steps >= 2 && t.version >= 2, "{kind}: {t:?}");
    assert!(t.balanced(), "{kind}: {t:?}");
    assert!(t.produced > 0 && t.trained > 0, "{kind}: {t:?}");
    for s in &r.replicas {
        assert!(s.switches >= 1 && s.version.unwrap() >= 1, "{kind}: {s:?}");
        assert_eq!(s.failed, 0, "{kind}: {s:?}");
    }
    let turns: Vec<&Value> = records
        .iter()
        .filter(|(k, _)| k == "turn")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(turns.len() as u64, r.counts.turns, "{kind}");
    assert!(!turns.is_empty(), "{kind}");
    for v in &turns {
        assert!(
            v["prompt_tokens"].as_u64().unwrap() > 512,
            "{kind}: a prompt the fixture could hold: {v}"
        );
        assert!(v["response_tokens"].as_u64().unwrap() > 0, "{kind}");
        assert!(
            !v["tools"].as_array().unwrap().is_empty(),
            "{kind}: no tools"
        );
    }
    let samples = records.iter().filter(|(k, _)| k == "sample").count() as u64;
    assert_eq!(samples, t.produced, "{kind}");
    assert!(records.iter().any(|(k, _)| k == "trainer_step"), "{kind}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_longer_than_the_context_is_refused_before_any_session() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("t.jsonl"),
        first_line("tests/fixtures/env/terminal.jsonl"),
    )
    .unwrap();
    let job = Job {
        checkpoint: Path::new(FIXTURE),
        kind: "terminal",
        tasks: "t.jsonl",
        temperature: 1.0,
        max_new_tokens: 8,
        max_steps: 2,
        method: "binary",
        max_context: 2048,
    };
    let e = run(dir.path(), &job).await.expect_err("refused");
    match &e {
        RunError::PromptFit(FitError::TooLong {
            task,
            tokens,
            context,
            max_context,
            max_positions,
            tools,
        }) => {
            assert_eq!(task, "hello-file");
            assert_eq!((*context, *max_context, *max_positions), (512, 2048, 512));
            assert!(*tokens >= 512, "{tokens}");
            assert_eq!(*tools, 2);
        }
        other => panic!("not a prompt-fit error: {other}"),
    }
    let text = e.to_string();
    for part in ["hello-file", "512", "2048", "max_position_embeddings"] {
        assert!(text.contains(part), "the error lacks {part}: {text}");
    }
    // Refused before anything ran: no records, no checkpoints.
    assert!(!dir.path().join("run-terminal").join("records").exists());
}

/// A step-wise job of `kind` on a random policy at `ckpt` with `max_context` positions.
fn random_policy_job<'a>(
    ckpt: &'a Path,
    kind: &'a str,
    tasks: &'a str,
    max_context: usize,
) -> Job<'a> {
    Job {
        checkpoint: ckpt,
        kind,
        tasks,
        temperature: 1.0,
        max_new_tokens: 16,
        max_steps: 2,
        method: "stepwise",
        max_context,
    }
}

/// The final turns of the job's episodes: at least one, each with outcome -1.
fn failed_episode_ends(records: &[(String, Value)]) -> Vec<&Value> {
    let ended: Vec<&Value> = records
        .iter()
        .filter(|(k, v)| k == "turn" && v["done"] == true)
        .map(|(_, v)| v)
        .collect();
    assert!(!ended.is_empty(), "no episode ended");
    for v in &ended {
        assert_eq!(v["outcome"].as_f64(), Some(-1.0), "{v}");
    }
    ended
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_policy_runs_a_tool_call_job() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("policy");
    save(&learner(2048, 1e-3), &ckpt, &tokenizer_files(None));
    std::fs::write(
        dir.path().join("t.jsonl"),
        first_line("tests/fixtures/env/tool_call.jsonl"),
    )
    .unwrap();
    let job = random_policy_job(&ckpt, "tool_call", "t.jsonl", 2048);
    let (r, records) = run(dir.path(), &job).await.unwrap();
    check_job("tool_call", &r, &records);
    // Random text is an answer; it is matched against the reference and fails.
    failed_episode_ends(&records);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_policy_runs_a_swe_job() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("policy");
    save(&learner(2048, 1e-3), &ckpt, &tokenizer_files(None));
    copy_dir(
        &Path::new(ROOT).join("tests/fixtures/env/swe/py_median"),
        &dir.path().join("swe/py_median"),
    );
    let job = random_policy_job(&ckpt, "swe", "swe", 2048);
    let (r, records) = run(dir.path(), &job).await.unwrap();
    check_job("swe", &r, &records);
    // The repository's tests decided: the bug is still there.
    for v in failed_episode_ends(&records) {
        assert!(v["info"]["check"].is_object(), "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_policy_runs_a_gui_job() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("policy");
    save(&learner(8192, 1e-3), &ckpt, &tokenizer_files(None));
    let gui = Path::new(ROOT).join("tests/fixtures/env/gui");
    std::fs::write(
        dir.path().join("t.jsonl"),
        first_line("tests/fixtures/env/gui/tasks.jsonl"),
    )
    .unwrap();
    std::fs::copy(gui.join("signup.html"), dir.path().join("signup.html")).unwrap();
    let job = random_policy_job(&ckpt, "gui", "t.jsonl", 8192);
    let (r, records) = run(dir.path(), &job).await.unwrap();
    check_job("gui", &r, &records);
    // The page's check decided every episode (a random policy does not sign up), and each
    // first observation was the page's tree with a screenshot taken in a browser.
    failed_episode_ends(&records);
    let first = records
        .iter()
        .find(|(k, v)| k == "turn" && v["turn"] == 0)
        .map(|(_, v)| v)
        .unwrap();
    let prompt = first["prompt_text"].as_str().unwrap();
    assert!(
        prompt.contains("elements:") && prompt.contains("screenshot:"),
        "{prompt}"
    );
}

/// The fixture's chat template with each tool listed as `- name: description` instead of its
/// JSON schema: the fine-tuning below trains on the whole prompt, and a shorter one keeps it
/// within the test's budget on two cores.
fn compact_template(full: &str) -> String {
    let t = full.replace(
        "{{- tool | tojson }}",
        "{{- '- ' + tool.function.name + ': ' + tool.function.description }}",
    );
    assert_ne!(t, full, "the fixture's template changed");
    t
}

const SOLUTION: &str = "<tool_call>\n{\"name\": \"shell_exec\", \"arguments\": {\"command\": \
                        \"echo hello world > hello.txt\"}}\n</tool_call><|im_end|>";

/// A 2048-position policy fine-tuned (through the project's learner, mean token NLL) to answer
/// the first observation of `tasks`' first task with [`SOLUTION`]; trains until every response
/// token has probability above 0.9 (at most 150 steps).
async fn tuned_policy(dir: &Path, tasks: &Path) -> PathBuf {
    let (_, fixture_template, _) = load_tokenizer_files(Path::new(FIXTURE)).unwrap();
    let files = tokenizer_files(Some(&compact_template(fixture_template.source())));
    let template = ChatTemplate::new(
        &compact_template(fixture_template.source()),
        "compact",
        fixture_template.special_tokens().to_vec(),
    )
    .unwrap();
    let (tokenizer, _, _) = load_tokenizer_files(Path::new(FIXTURE)).unwrap();
    // The first observation exactly as the job's sessions will see it.
    let env =
        clawrl::env::build_environment(clawrl::env::EnvKind::Terminal, tasks, Default::default())
            .unwrap();
    let episode = env.start(0, 0).await.unwrap();
    let obs = episode.observation();
    episode.close().await;
    let prompt = template
        .encode(
            &tokenizer,
            &minijinja::Value::from_serialize(&obs.messages),
            Some(&minijinja::Value::from_serialize(&obs.tools)),
        )
        .unwrap();
    let response = tokenizer
        .encode(SOLUTION, false)
        .unwrap()
        .get_ids()
        .to_vec();
    let sample = Sample::new(prompt.ids, response, 1.0);
    let mut l = learner(2048, 1e-2);
    let sample = std::slice::from_ref(&sample);
    let mut worst = f32::NEG_INFINITY;
    for _ in 0..150 {
        l.step(sample).unwrap();
        worst = l.logprobs(sample).unwrap()[0]
            .iter()
            .copied()
            .fold(0.0, f32::min);
        if worst > 0.9f32.ln() {
            break;
        }
    }
    assert!(worst > 0.9f32.ln(), "fine-tuning did not converge: {worst}");
    let ckpt = dir.join("tuned");
    save(&l, &ckpt, &files);
    ckpt
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tuned_policy_calls_the_shell_tool_and_solves_a_terminal_task() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = dir.path().join("t.jsonl");
    std::fs::write(&tasks, first_line("tests/fixtures/env/terminal.jsonl")).unwrap();
    let ckpt = tuned_policy(dir.path(), &tasks).await;
    let job = Job {
        checkpoint: &ckpt,
        kind: "terminal",
        tasks: "t.jsonl",
        temperature: 0.3,
        max_new_tokens: 96,
        max_steps: 2,
        method: "binary",
        max_context: 2048,
    };
    let (r, records) = run(dir.path(), &job).await.unwrap();
    // The compact template's prompts are shorter than the fixture's context; everything else is
    // checked as for the other kinds.
    let t = &r.trainer;
    assert!(r.counts.gave_up.is_none() && r.counts.sessions_failed == 0);
    assert!(t.steps >= 2 && t.version >= 2 && t.balanced(), "{t:?}");
    for s in &r.replicas {
        assert!(s.switches >= 1 && s.version.unwrap() >= 1, "{s:?}");
    }
    let turns: Vec<&Value> = records
        .iter()
        .filter(|(k, _)| k == "turn")
        .map(|(_, v)| v)
        .collect();
    // The sampled text held a shell call, parsed into the action and run in the sandbox.
    let calls: Vec<&Value> = turns
        .iter()
        .filter(|v| {
            v["tool_calls"].as_array().is_some_and(|c| {
                c.iter().any(|c| {
                    c["name"] == "shell_exec"
                        && c["arguments"]["command"] == "echo hello world > hello.txt"
                })
            })
        })
        .copied()
        .collect();
    assert!(!calls.is_empty(), "no shell call was parsed: {turns:?}");
    for v in &calls {
        let out = v["next_state"][0]["content"].as_str().unwrap();
        assert!(out.starts_with("exit code: 0"), "{out}");
        assert_eq!(v["info"]["commands"][0]["exit_code"], 0, "{v}");
    }
    // The task's check ran on the sandbox's work dir and passed.
    assert!(
        turns
            .iter()
            .any(|v| v["done"] == true && v["outcome"].as_f64() == Some(1.0)),
        "no episode solved the task: {turns:?}"
    );
    // Those turns were judged by the next state and trained on.
    let judged_plus = records
        .iter()
        .filter(|(k, v)| k == "judge" && v["reward"].as_f64() == Some(1.0))
        .count();
    assert!(judged_plus > 0);
    assert!(records.iter().any(|(k, _)| k == "sample"));
}
