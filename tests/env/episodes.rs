//! The terminal and tool-call environments end to end, in the real sandbox, driven by scripted
//! actions: every fixture task solved (+1) and not solved (-1), observations (exit code, streams,
//! truncation), the step limit, the deadline, malformed calls, the tool budget and work dir
//! cleanup.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clawrl::env::terminal::{TerminalEnv, TerminalTask};
use clawrl::env::tool_call::ToolCallEnv;
use clawrl::env::{build_environment, EnvKind, EnvOptions};
use clawrl_actors::loops::{Action, EnvError, Environment, StepOutcome, ToolCallAction};
use serde_json::{json, Value};

/// The work-dir roots environments of `kind` made under `work_root` (each a fresh
/// `clawrl-env-<kind>-<random>`).
fn pool_roots(work_root: &Path, kind: &str) -> Vec<PathBuf> {
    let prefix = format!("clawrl-env-{kind}-");
    std::fs::read_dir(work_root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&prefix)
        })
        .collect()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/env")
        .join(name)
}

fn options(root: &Path) -> EnvOptions {
    EnvOptions {
        work_root: Some(root.to_path_buf()),
        warm_workdirs: 2,
        ..EnvOptions::default()
    }
}

fn call(name: &str, arguments: Value) -> Action {
    Action {
        content: String::new(),
        tool_calls: vec![ToolCallAction {
            id: "call-1".into(),
            name: name.into(),
            arguments,
        }],
        raw: String::new(),
    }
}

fn shell(command: &str) -> Action {
    call("shell_exec", json!({ "command": command }))
}

fn submit() -> Action {
    call("submit", json!({}))
}

fn answer(text: &str) -> Action {
    Action {
        content: text.into(),
        tool_calls: vec![],
        raw: text.into(),
    }
}

fn tool_text(out: &StepOutcome, i: usize) -> &str {
    assert_eq!(out.next_state[i]["role"], "tool");
    out.next_state[i]["content"].as_str().expect("tool content")
}

/// Commands that solve each terminal fixture task.
fn terminal_solution(id: &str) -> Vec<&'static str> {
    match id {
        "hello-file" => vec!["echo 'hello world' > hello.txt"],
        "count-lines" => vec!["wc -l < data.txt > count.txt", "cat count.txt"],
        "rename-logs" => vec![
            "ls logs",
            "for f in logs/*.log; do mv \"$f\" \"${f%.log}.txt\"; done",
        ],
        "fix-script" => vec!["printf '#!/bin/sh\\necho OK\\n' > run.sh && chmod +x run.sh"],
        "unique-names" => vec!["sort -u in/names.txt > unique.txt"],
        other => panic!("no scripted solution for terminal task {other}"),
    }
}

async fn run_terminal(env: &TerminalEnv, index: usize, actions: &[Action]) -> (StepOutcome, u32) {
    let mut ep = env.start(index, 0).await.expect("start");
    let mut last = None;
    let mut steps = 0;
    for a in actions {
        let out = ep.step(a).await.expect("step");
        steps += 1;
        let done = out.done;
        last = Some(out);
        if done {
            break;
        }
    }
    ep.close().await;
    (last.expect("at least one step"), steps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_fixture_tasks_pass_when_solved_and_fail_when_not() {
    let root = tempfile::tempdir().unwrap();
    let env = TerminalEnv::load(&fixture("terminal.jsonl"), options(root.path())).unwrap();
    assert_eq!(env.kind(), "terminal");
    assert_eq!(env.max_steps(), 10);
    assert!(env.task_count() >= 5);
    for (i, task) in env.tasks().iter().enumerate() {
        let mut actions: Vec<Action> = terminal_solution(&task.id).into_iter().map(shell).collect();
        actions.push(submit());
        let (out, steps) = run_terminal(&env, i, &actions).await;
        assert!(out.done, "{}", task.id);
        assert_eq!(out.outcome, Some(1.0), "{}: {}", task.id, out.info);
        assert_eq!(out.info["finish"], "submit");
        assert_eq!(steps as usize, actions.len());
        // Doing nothing fails the check.
        let (out, _) = run_terminal(&env, i, &[submit()]).await;
        assert_eq!(
            out.outcome,
            Some(-1.0),
            "{} unsolved: {}",
            task.id,
            out.info
        );
    }
    // Every work dir is gone after close (only the pool's empty warm dirs remain).
    let pools = pool_roots(root.path(), "terminal");
    assert_eq!(pools.len(), 1, "{pools:?}");
    for e in std::fs::read_dir(&pools[0]).unwrap() {
        let p = e.unwrap().path();
        assert_eq!(std::fs::read_dir(&p).unwrap().count(), 0, "{p:?} not empty");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_observation_and_conversation() {
    let root = tempfile::tempdir().unwrap();
    let env = build_environment(
        EnvKind::Terminal,
        &fixture("terminal.jsonl"),
        EnvOptions {
            observation_bytes: 256,
            ..options(root.path())
        },
    )
    .unwrap();
    let mut ep = env.start(0, 7).await.unwrap();
    assert_eq!(ep.task_id(), "hello-file");
    assert!(ep.instruction().contains("hello.txt"));
    let obs = ep.observation();
    assert_eq!(obs.messages.len(), 2);
    assert_eq!(obs.messages[0]["role"], "system");
    assert_eq!(obs.messages[1]["role"], "user");
    let names: Vec<&str> = obs
        .tools
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["shell_exec", "submit"]);

    let out = ep
        .step(&shell("echo to-out; echo to-err >&2; pwd; exit 3"))
        .await
        .unwrap();
    assert!(!out.done);
    assert_eq!(out.outcome, None);
    let text = tool_text(&out, 0);
    assert!(text.contains("exit code: 3"), "{text}");
    assert!(text.contains("to-out") && text.contains("/work"), "{text}");
    assert!(text.contains("stderr:\nto-err"), "{text}");
    assert_eq!(out.next_state[0]["tool_call_id"], "call-1");
    assert_eq!(out.info["commands"][0]["exit_code"], 3);

    let out = ep
        .step(&shell("head -c 100000 /dev/zero | tr '\\0' a"))
        .await
        .unwrap();
    let text = tool_text(&out, 0);
    assert!(text.contains("bytes truncated"), "{}", &text[..200]);
    assert!(text.len() < 1000, "{} bytes", text.len());
    assert_eq!(out.info["commands"][0]["observation_truncated"], true);

    // Malformed calls are answered, not errors.
    let out = ep.step(&call("rm_rf", json!({}))).await.unwrap();
    assert!(tool_text(&out, 0).contains("unknown tool"));
    let out = ep
        .step(&call("shell_exec", json!({"cmd": "ls"})))
        .await
        .unwrap();
    assert!(tool_text(&out, 0).contains("\"cmd\""));
    let out = ep
        .step(&call("shell_exec", json!({"command": 5})))
        .await
        .unwrap();
    assert!(tool_text(&out, 0).contains("must be a string"));
    assert!(!out.done);

    // The conversation: system, user, then (assistant, tool) per step.
    let obs = ep.observation();
    assert_eq!(obs.messages.len(), 2 + 5 * 2);
    assert_eq!(obs.messages[2]["role"], "assistant");
    assert_eq!(
        obs.messages[2]["tool_calls"][0]["function"]["name"],
        "shell_exec"
    );
    assert_eq!(obs.messages[3]["role"], "tool");

    // A plain answer ends the episode and runs the check.
    let out = ep.step(&answer("I am done.")).await.unwrap();
    assert!(out.done);
    assert_eq!(out.outcome, Some(-1.0));
    assert_eq!(out.info["finish"], "answer");
    assert!(out.next_state.is_empty());
    match ep.step(&submit()).await {
        Err(EnvError::Finished { task }) => assert_eq!(task, "hello-file"),
        other => panic!("{other:?}"),
    }
    ep.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_step_limit_runs_the_check() {
    let root = tempfile::tempdir().unwrap();
    let env = TerminalEnv::load(&fixture("terminal.jsonl"), options(root.path())).unwrap();
    // Nine idle steps, the work at the tenth: the check runs at the limit and passes.
    let mut actions: Vec<Action> = (0..9).map(|_| shell("true")).collect();
    actions.push(shell("echo 'hello world' > hello.txt"));
    actions.push(shell("true"));
    let (out, steps) = run_terminal(&env, 0, &actions).await;
    assert_eq!(steps, 10);
    assert!(out.done);
    assert_eq!(out.info["finish"], "step_limit");
    assert_eq!(out.outcome, Some(1.0));
    // Ten idle steps fail.
    let actions: Vec<Action> = (0..10).map(|_| shell("true")).collect();
    let (out, steps) = run_terminal(&env, 0, &actions).await;
    assert_eq!((steps, out.outcome), (10, Some(-1.0)));

    // A configured limit.
    let env = TerminalEnv::load(
        &fixture("terminal.jsonl"),
        EnvOptions {
            max_steps: Some(2),
            ..options(root.path())
        },
    )
    .unwrap();
    let (out, steps) = run_terminal(&env, 0, &[shell("true"), shell("true"), submit()]).await;
    assert_eq!((steps, out.done), (2, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_deadline_clips_commands_and_fails_the_episode() {
    let root = tempfile::tempdir().unwrap();
    let env = TerminalEnv::load(
        &fixture("terminal.jsonl"),
        EnvOptions {
            episode_deadline: Duration::from_millis(1500),
            ..options(root.path())
        },
    )
    .unwrap();
    let mut ep = env.start(0, 0).await.unwrap();
    let t = std::time::Instant::now();
    let out = ep.step(&shell("sleep 30")).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(out.info["commands"][0]["timed_out"], true);
    assert!(tool_text(&out, 0).contains("timed out"));
    let out = ep
        .step(&shell("echo 'hello world' > hello.txt"))
        .await
        .unwrap();
    assert!(out.done);
    assert_eq!(out.outcome, Some(-1.0));
    assert_eq!(out.info["deadline_exceeded"], true);
    ep.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_setup_failures_and_bad_indices_are_errors() {
    let root = tempfile::tempdir().unwrap();
    let task = TerminalTask {
        id: "broken".into(),
        instruction: "x".into(),
        files: vec![(PathBuf::from("a/b.txt"), "B".into())],
        setup_script: Some("test -f a/b.txt && echo bad setup >&2 && exit 4".into()),
        check: "true".into(),
    };
    let env = TerminalEnv::new(vec![task], options(root.path())).unwrap();
    match env.start(0, 0).await {
        Err(EnvError::Setup { task, reason }) => {
            assert_eq!(task, "broken");
            assert!(reason.contains("bad setup"), "{reason}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("setup should fail"),
    }
    match env.start(5, 0).await {
        Err(EnvError::NoSuchTask { index: 5, count: 1 }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("no task 5"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_of_one_task_have_separate_work_dirs() {
    let root = tempfile::tempdir().unwrap();
    let env = TerminalEnv::load(&fixture("terminal.jsonl"), options(root.path())).unwrap();
    let mut a = env.start(0, 0).await.unwrap();
    let mut b = env.start(0, 1).await.unwrap();
    a.step(&shell("echo 'hello world' > hello.txt"))
        .await
        .unwrap();
    let out = b.step(&shell("ls")).await.unwrap();
    assert!(!tool_text(&out, 0).contains("hello.txt"));
    assert_eq!(a.step(&submit()).await.unwrap().outcome, Some(1.0));
    assert_eq!(b.step(&submit()).await.unwrap().outcome, Some(-1.0));
    a.close().await;
    b.close().await;
}

/// Python that prints each tool-call fixture task's answer.
fn interpreter_solution(id: &str) -> &'static str {
    match id {
        "sum-of-squares" => "print(sum(i * i for i in range(1, 101)))",
        "primes-below-1000" => {
            "print(sum(all(n % d for d in range(2, int(n ** 0.5) + 1)) for n in range(2, 1000)))"
        }
        "fraction-sum" => "from fractions import Fraction as F\nprint(F(1, 3) + F(1, 6))",
        "compound-interest" => {
            "from fractions import Fraction as F\nprint(float(1000 * F(105, 100) ** 3))"
        }
        "digit-sum" => "print(sum(map(int, str(2 ** 100))))",
        "linear-equation" => "print((5 - 17) // 3)",
        other => panic!("no scripted solution for tool-call task {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_fixture_tasks_are_solved_through_the_interpreter() {
    let root = tempfile::tempdir().unwrap();
    let env = ToolCallEnv::load(&fixture("tool_call.jsonl"), options(root.path())).unwrap();
    assert_eq!(env.kind(), "tool_call");
    assert_eq!(env.max_steps(), 17);
    for (i, task) in env.tasks().iter().enumerate() {
        let mut ep = env.start(i, 0).await.unwrap();
        let obs = ep.observation();
        let names: Vec<&str> = obs
            .tools
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["code_interpreter"]);
        let out = ep
            .step(&call(
                "code_interpreter",
                json!({"code": interpreter_solution(&task.id)}),
            ))
            .await
            .unwrap();
        assert!(!out.done);
        let text = tool_text(&out, 0).to_string();
        assert!(text.starts_with("exit code: 0"), "{}: {text}", task.id);
        let printed = text
            .split("stdout:\n")
            .nth(1)
            .unwrap()
            .split("stderr:")
            .next()
            .unwrap()
            .trim();
        let out = ep
            .step(&answer(&format!("The answer is \\boxed{{{printed}}}.")))
            .await
            .unwrap();
        assert!(out.done);
        assert_eq!(out.outcome, Some(1.0), "{}: {}", task.id, out.info);
        ep.close().await;

        // A wrong final answer fails.
        let mut ep = env.start(i, 0).await.unwrap();
        let out = ep
            .step(&answer("I think it is \\boxed{999999}"))
            .await
            .unwrap();
        assert_eq!(out.outcome, Some(-1.0), "{}", task.id);
        assert_eq!(out.info["answer"]["given"], "999999");
        ep.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_budget_errors_and_step_limit() {
    let root = tempfile::tempdir().unwrap();
    let env = ToolCallEnv::load(
        &fixture("tool_call.jsonl"),
        EnvOptions {
            max_tool_calls: 2,
            ..options(root.path())
        },
    )
    .unwrap();
    assert_eq!(env.max_steps(), 3);
    let mut ep = env.start(0, 0).await.unwrap();
    let code = |c: &str| ToolCallAction {
        id: c.into(),
        name: "code_interpreter".into(),
        arguments: json!({"code": "print(6 * 7)\nopen('f', 'a').write('x')"}),
    };
    let three = Action {
        content: String::new(),
        tool_calls: vec![code("a"), code("b"), code("c")],
        raw: String::new(),
    };
    let out = ep.step(&three).await.unwrap();
    assert_eq!(out.next_state.len(), 3);
    assert!(tool_text(&out, 0).contains("42"));
    assert!(tool_text(&out, 1).contains("42"));
    assert!(tool_text(&out, 2).contains("budget of 2 tool calls"));
    assert_eq!(out.info["calls_used"], 2);
    // A Python error is an observation; files persist between calls.
    let out = ep
        .step(&call(
            "code_interpreter",
            json!({"code": "print(open('f').read()); 1/0"}),
        ))
        .await
        .unwrap();
    assert!(tool_text(&out, 0).contains("budget"));
    let out = ep
        .step(&call("code_interpreter", json!({"code": "print(1)"})))
        .await
        .unwrap();
    // The third step is the limit: the episode ends and its text is judged (no answer: -1).
    assert!(out.done);
    assert_eq!(out.outcome, Some(-1.0));
    assert_eq!(out.info["finish"], "step_limit");
    ep.close().await;

    let env = ToolCallEnv::load(&fixture("tool_call.jsonl"), options(root.path())).unwrap();
    let mut ep = env.start(0, 0).await.unwrap();
    let out = ep
        .step(&call(
            "code_interpreter",
            json!({"code": "open('f', 'w').write('hi')"}),
        ))
        .await
        .unwrap();
    assert!(tool_text(&out, 0).starts_with("exit code: 0"));
    let out = ep
        .step(&call(
            "code_interpreter",
            json!({"code": "print(open('f').read()); 1/0"}),
        ))
        .await
        .unwrap();
    let text = tool_text(&out, 0);
    assert!(text.starts_with("exit code: 1"), "{text}");
    assert!(
        text.contains("hi") && text.contains("ZeroDivisionError"),
        "{text}"
    );
    let out = ep
        .step(&call("python", json!({"code": "1"})))
        .await
        .unwrap();
    assert!(tool_text(&out, 0).contains("unknown tool"));
    ep.close().await;
}

#[test]
fn build_environment_knows_every_kind_and_names_bad_input() {
    let root = tempfile::tempdir().unwrap();
    for (kind, path, count, steps) in [
        ("terminal", fixture("terminal.jsonl"), 5, 10),
        ("tool_call", fixture("tool_call.jsonl"), 6, 17),
        ("swe", fixture("swe"), 5, 20),
    ] {
        let env = build_environment(kind.parse().unwrap(), &path, options(root.path())).unwrap();
        assert_eq!(env.kind(), kind);
        assert_eq!(env.task_count(), count, "{kind}");
        assert_eq!(env.max_steps(), steps, "{kind}");
    }
    let e = build_environment(
        EnvKind::Terminal,
        &fixture("missing.jsonl"),
        options(root.path()),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("missing.jsonl"), "{e}");
    // A tool-call file given to the terminal kind: the first line names the missing key.
    let e = build_environment(
        EnvKind::Terminal,
        &fixture("tool_call.jsonl"),
        options(root.path()),
    )
    .err()
    .unwrap();
    let text = e.to_string();
    assert!(text.contains("tool_call.jsonl:1:"), "{text}");
    let e = "browser".parse::<EnvKind>().unwrap_err();
    assert!(e.to_string().contains("`browser`"), "{e}");
}
