//! The GUI environment end to end in headless Chromium, driven by scripted actions: every fixture
//! task solved (+1) by clicking and typing on the ids its accessibility tree shows, and failed (-1)
//! when left undone or done wrong; the observation (tree, screenshot file), bad actions answered
//! in words, the step limit, the network refused, and no browser process left after close.
//!
//! Chromium is required (the Debian package `chromium`; `scripts/test` installs it): without it
//! every test here fails, saying so.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clawrl::env::gui::{GuiEnv, GuiTask};
use clawrl::env::{build_environment, EnvBuildError, EnvKind, EnvOptions};
use clawrl_actors::loops::{Action, EnvError, Environment, Episode, StepOutcome, ToolCallAction};
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
        .join("tests/fixtures/env/gui")
        .join(name)
}

/// Options with no ready browsers: every episode launches its own, so that the processes
/// under `root` are exactly those of the running episodes.
fn options(root: &Path) -> EnvOptions {
    EnvOptions {
        work_root: Some(root.to_path_buf()),
        warm_workdirs: 1,
        warm_browsers: 0,
        ..EnvOptions::default()
    }
}

/// Polls until no browser process is left under `root` (the pool's in-flight launches end
/// after the environment is dropped); returns what is left after 20 s.
async fn settle_no_processes(root: &Path) -> Vec<i32> {
    for _ in 0..200 {
        if processes_under(root).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    processes_under(root)
}

fn built<T>(r: Result<T, EnvBuildError>) -> T {
    match r {
        Ok(v) => v,
        Err(EnvBuildError::Browser(why)) => panic!(
            "the GUI tests need Chromium (the Debian package `chromium`, installed by \
             scripts/test): {why}"
        ),
        Err(e) => panic!("{e}"),
    }
}

fn fixture_env(options: EnvOptions) -> GuiEnv {
    built(GuiEnv::load(&fixture("tasks.jsonl"), options))
}

fn call(name: &str, arguments: Value) -> Action {
    Action {
        content: String::new(),
        tool_calls: vec![ToolCallAction {
            id: format!("call-{name}"),
            name: name.into(),
            arguments,
        }],
        raw: String::new(),
    }
}

/// The text of the latest page state the episode showed.
fn latest_state(ep: &dyn Episode) -> String {
    let obs = ep.observation();
    obs.messages
        .iter()
        .rev()
        .filter_map(|m| m["content"].as_str())
        .find(|c| c.contains("\nelements:\n"))
        .expect("a page state in the conversation")
        .to_string()
}

/// The id `n` of the first element line `[n] <what>` in the latest state.
fn id_of(ep: &dyn Episode, what: &str) -> u64 {
    let state = latest_state(ep);
    for line in state.lines() {
        let l = line.trim_start();
        if let Some(rest) = l.strip_prefix('[') {
            if let Some((n, tail)) = rest.split_once("] ") {
                if tail.starts_with(what) {
                    return n.parse().expect("an id");
                }
            }
        }
    }
    panic!("no element `{what}` in:\n{state}");
}

/// One scripted step: a tool and its arguments, with `{what}` standing for an element id looked
/// up in the latest state.
enum Do {
    Click(&'static str),
    Type(&'static str, &'static str),
    Key(Option<&'static str>, &'static str),
    ScrollTo(&'static str),
    Scroll(&'static str),
    Submit,
}

fn action(ep: &dyn Episode, d: &Do) -> Action {
    match d {
        Do::Click(w) => call("click", json!({"id": id_of(ep, w)})),
        Do::Type(w, t) => call("type", json!({"id": id_of(ep, w), "text": t})),
        Do::Key(Some(w), k) => call("key", json!({"id": id_of(ep, w), "key": k})),
        Do::Key(None, k) => call("key", json!({"key": k})),
        Do::ScrollTo(w) => call("scroll", json!({"id": id_of(ep, w)})),
        Do::Scroll(dir) => call("scroll", json!({"direction": dir})),
        Do::Submit => call("submit", json!({})),
    }
}

/// Actions that solve each fixture task, by what the elements are called.
fn solution(id: &str) -> Vec<Do> {
    use Do::*;
    match id {
        "signup-pro" => vec![
            Type("textbox \"Full name\"", "Ada Lovelace"),
            Type("textbox \"Email\"", "ada@example.org"),
            Click("radio \"Pro\""),
            Click("checkbox \"I accept the terms\""),
            Click("button \"Create account\""),
            Submit,
        ],
        "todo-add-complete" => vec![
            Type("textbox \"New item\"", "Pay rent"),
            Key(None, "Enter"),
            Click("checkbox \"Done: Buy milk\""),
            Submit,
        ],
        "todo-delete" => vec![Click("button \"Delete Call the bank\""), Submit],
        "settings-privacy" => vec![
            Click("switch \"Dark mode\""),
            Scroll("down"),
            Click("checkbox \"Share usage data\""),
            Click("button \"Save settings\""),
            Submit,
        ],
        "settings-name" => vec![
            ScrollTo("textbox \"Display name\""),
            Type("textbox \"Display name\"", "night owl"),
            Click("checkbox \"SMS notifications\""),
            Click("button \"Save settings\""),
            Submit,
        ],
        "search-open" => vec![
            Type("searchbox \"Search books\"", "dune"),
            Key(Some("searchbox \"Search books\""), "Enter"),
            Click("button \"Open Dune Messiah\""),
            Submit,
        ],
        "tickets" => vec![
            Click("button \"More adult tickets\""),
            Click("button \"More child tickets\""),
            Click("button \"More child tickets\""),
            Click("button \"More child tickets\""),
            Click("button \"Place order\""),
            Submit,
        ],
        other => panic!("no scripted solution for GUI task {other}"),
    }
}

/// A plausible but wrong attempt at each task.
fn wrong(id: &str) -> Vec<Do> {
    use Do::*;
    match id {
        // The Free plan stays selected.
        "signup-pro" => vec![
            Type("textbox \"Full name\"", "Ada Lovelace"),
            Type("textbox \"Email\"", "ada@example.org"),
            Click("checkbox \"I accept the terms\""),
            Click("button \"Create account\""),
            Submit,
        ],
        // The wrong item is completed.
        "todo-add-complete" => vec![
            Type("textbox \"New item\"", "Pay rent"),
            Key(None, "Enter"),
            Click("checkbox \"Done: Call the bank\""),
            Submit,
        ],
        "todo-delete" => vec![Click("button \"Delete Buy milk\""), Submit],
        // Not saved.
        "settings-privacy" => vec![
            Click("switch \"Dark mode\""),
            Click("checkbox \"Share usage data\""),
            Submit,
        ],
        "settings-name" => vec![
            Type("textbox \"Display name\"", "night owl"),
            Click("button \"Save settings\""),
            Submit,
        ],
        "search-open" => vec![
            Type("searchbox \"Search books\"", "dune"),
            Key(Some("searchbox \"Search books\""), "Enter"),
            Click("button \"Open Dune\""),
            Submit,
        ],
        "tickets" => vec![
            Click("button \"More adult tickets\""),
            Click("button \"More child tickets\""),
            Click("button \"Place order\""),
            Submit,
        ],
        other => panic!("no wrong attempt for GUI task {other}"),
    }
}

/// Runs the script; returns the last outcome and how many steps ran.
async fn run(ep: &mut Box<dyn Episode>, script: &[Do]) -> (StepOutcome, usize) {
    let mut last = None;
    let mut steps = 0;
    for d in script {
        let a = action(ep.as_ref(), d);
        let out = ep.step(&a).await.expect("step");
        steps += 1;
        for m in &out.next_state {
            let text = m["content"].as_str().unwrap_or("");
            assert!(!text.starts_with("error:"), "{text}");
        }
        let done = out.done;
        last = Some(out);
        if done {
            break;
        }
    }
    (last.expect("at least one step"), steps)
}

/// Live processes whose command line mentions `root` (every browser's profile lives under it).
fn processes_under(root: &Path) -> Vec<i32> {
    clawrl::env::gui::cdp::browser_processes(0, root)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_tasks_pass_when_solved_and_fail_when_not() {
    let root = tempfile::tempdir().unwrap();
    // The default way: browsers launched ahead and kept ready.
    let env = fixture_env(EnvOptions {
        warm_browsers: 2,
        ..options(root.path())
    });
    assert_eq!(env.kind(), "gui");
    assert_eq!(env.max_steps(), 30);
    assert!(env.task_count() >= 5);
    for (i, task) in env.tasks().iter().enumerate() {
        let script = solution(&task.id);
        let mut ep = env.start(i, 0).await.expect("start");
        let (out, steps) = run(&mut ep, &script).await;
        assert!(out.done, "{}", task.id);
        assert_eq!(out.outcome, Some(1.0), "{} solved: {}", task.id, out.info);
        assert_eq!(out.info["finish"], "submit");
        assert_eq!(steps, script.len(), "{}", task.id);
        ep.close().await;

        let mut ep = env.start(i, 0).await.expect("start");
        let (out, _) = run(&mut ep, &wrong(&task.id)).await;
        assert_eq!(out.outcome, Some(-1.0), "{} wrong: {}", task.id, out.info);
        ep.close().await;

        if i > 0 {
            continue;
        }
        // Answering in words at once ends the episode, and the check fails.
        let mut ep = env.start(i, 0).await.expect("start");
        let out = ep
            .step(&Action {
                content: "Done.".into(),
                tool_calls: vec![],
                raw: "Done.".into(),
            })
            .await
            .unwrap();
        assert_eq!((out.done, out.outcome), (true, Some(-1.0)), "{}", task.id);
        assert_eq!(out.info["finish"], "answer");
        ep.close().await;
    }
    let stats = env.browser_stats();
    assert!(stats.taken_warm >= 1, "{stats:?}");
    assert_eq!(stats.refill_failures, 0, "{stats:?}");
    drop(env);
    assert_eq!(settle_no_processes(root.path()).await, Vec::<i32>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_browsers_serve_episodes_and_a_dead_one_is_replaced() {
    let root = tempfile::tempdir().unwrap();
    let env = fixture_env(EnvOptions {
        warm_browsers: 2,
        ..options(root.path())
    });
    assert_eq!(env.wait_warm(Duration::from_secs(60)).await, 2);
    assert!(!processes_under(root.path()).is_empty());

    // An episode starts in a ready browser; the first step says so, and the task is solved.
    let mut ep = env.start(0, 0).await.expect("start");
    let stats = env.browser_stats();
    assert_eq!((stats.taken_warm, stats.launched_cold), (1, 0), "{stats:?}");
    let id = env.tasks()[0].id.clone();
    let script = solution(&id);
    let first = ep.step(&action(ep.as_ref(), &script[0])).await.unwrap();
    assert_eq!(first.info["warm_browser"], true, "{}", first.info);
    assert!(first.info["start_ms"].as_u64().is_some(), "{}", first.info);
    let (out, _) = run(&mut ep, &script[1..]).await;
    assert_eq!(out.outcome, Some(1.0), "{id}: {}", out.info);
    ep.close().await;
    assert_eq!(env.wait_warm(Duration::from_secs(60)).await, 2);

    // Every ready browser dies while idle (no episode runs, so every process under the root is
    // one of theirs): the next episode still starts, in a browser of its own.
    let idle = processes_under(root.path());
    assert!(!idle.is_empty());
    for pid in &idle {
        // SAFETY: plain system call on processes this test's environment started.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    let mut ep = env
        .start(1, 0)
        .await
        .expect("start after the ready browsers died");
    let stats = env.browser_stats();
    assert!(stats.discarded >= 1, "{stats:?}");
    let id = env.tasks()[1].id.clone();
    let (out, _) = run(&mut ep, &solution(&id)).await;
    assert_eq!(out.outcome, Some(1.0), "{id}: {}", out.info);
    ep.close().await;

    // Dropping the environment kills the ready browsers too and removes their work dirs (the
    // pool's root goes when it is empty).
    drop(env);
    assert_eq!(settle_no_processes(root.path()).await, Vec::<i32>::new());
    for pool in pool_roots(root.path(), "gui") {
        for e in std::fs::read_dir(&pool).unwrap() {
            let p = e.unwrap().path();
            assert_eq!(std::fs::read_dir(&p).unwrap().count(), 0, "{p:?} not empty");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observation_shows_tree_and_screenshot_and_bad_actions_are_answered() {
    let root = tempfile::tempdir().unwrap();
    let env = fixture_env(options(root.path()));
    let mut ep = env.start(0, 0).await.unwrap();
    assert_eq!(ep.task_id(), "signup-pro");
    assert!(ep.instruction().contains("Ada Lovelace"));
    let obs = ep.observation();
    assert_eq!(obs.messages.len(), 2);
    assert_eq!(obs.messages[0]["role"], "system");
    assert_eq!(obs.messages[1]["role"], "user");
    let names: Vec<&str> = obs
        .tools
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["click", "type", "key", "scroll", "submit"]);
    let first = obs.messages[1]["content"].as_str().unwrap();
    assert!(first.starts_with(ep.instruction()), "{first}");
    assert!(first.contains("page: \"Create an account\" (http://task.invalid/signup.html)"));
    assert!(
        first.contains("[1] RootWebArea \"Create an account\""),
        "{first}"
    );
    assert!(
        first.contains("heading \"Create an account\" level=1"),
        "{first}"
    );
    assert!(first.contains("radio \"Free\" checked=true"), "{first}");
    assert!(
        first.contains("checkbox \"I accept the terms\" checked=false"),
        "{first}"
    );
    // The screenshot is a PNG file under the episode's work dir.
    let shot = first
        .lines()
        .find_map(|l| l.strip_prefix("screenshot: "))
        .expect("a screenshot line");
    assert!(shot.starts_with(root.path().to_str().unwrap()), "{shot}");
    let png = std::fs::read(shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 1000);

    // Typing shows up in the next tree, with a new screenshot.
    let name = id_of(ep.as_ref(), "textbox \"Full name\"");
    let out = ep
        .step(&call("type", json!({"id": name, "text": "Grace"})))
        .await
        .unwrap();
    assert!(!out.done);
    assert_eq!(out.outcome, None);
    assert_eq!(out.next_state.len(), 1);
    assert_eq!(out.next_state[0]["role"], "tool");
    assert_eq!(out.next_state[0]["tool_call_id"], "call-type");
    let text = out.next_state[0]["content"].as_str().unwrap();
    assert!(
        text.starts_with(&format!("type into [{name}]: typed 5 characters")),
        "{text}"
    );
    assert!(
        text.contains("textbox \"Full name\" value=\"Grace\" focused"),
        "{text}"
    );
    let shot1 = out.info["screenshot"].as_str().unwrap();
    assert!(shot1.ends_with("step-01.png") && Path::new(shot1).is_file());
    // Typing again replaces the text.
    let out = ep
        .step(&call("type", json!({"id": name, "text": "Ada"})))
        .await
        .unwrap();
    assert!(out.next_state[0]["content"]
        .as_str()
        .unwrap()
        .contains("value=\"Ada\""));

    // Bad actions are answered in words and the episode goes on.
    let button = id_of(ep.as_ref(), "button \"Create account\"");
    let bad: Vec<(Action, &str)> = vec![
        (call("click", json!({"id": 999})), "no element [999]"),
        (call("click", json!({"id": "x"})), "element number"),
        (call("click", json!({})), "needs \"id\""),
        (
            call("navigate", json!({"url": "http://example.com"})),
            "unknown tool",
        ),
        (
            call("type", json!({"id": button, "text": "x"})),
            "not a text field",
        ),
        (call("key", json!({"key": "F13"})), "unknown key"),
        (
            call("scroll", json!({"direction": "sideways"})),
            "\"up\" or \"down\"",
        ),
    ];
    for (a, want) in &bad {
        let out = ep.step(a).await.unwrap();
        assert!(!out.done);
        let text = out.next_state[0]["content"].as_str().unwrap();
        assert!(
            text.starts_with("error:") && text.contains(want),
            "{want}: {text}"
        );
        assert_eq!(out.info["actions"][0]["ok"], false);
    }
    // Two calls in one message: both run, in order; the state follows the last.
    let terms = id_of(ep.as_ref(), "checkbox \"I accept the terms\"");
    let mut two = call("click", json!({"id": terms}));
    two.tool_calls.push(ToolCallAction {
        id: "call-2".into(),
        name: "click".into(),
        arguments: json!({"id": 999}),
    });
    let out = ep.step(&two).await.unwrap();
    assert_eq!(out.next_state.len(), 2);
    let last = out.next_state[1]["content"].as_str().unwrap();
    assert!(
        last.contains("checkbox \"I accept the terms\" checked=true"),
        "{last}"
    );

    // The conversation: system, user, then (assistant, tool...) per step.
    let obs = ep.observation();
    assert_eq!(obs.messages.len(), 2 + 2 * (3 + bad.len()) + 1);
    let out = ep.step(&call("submit", json!({}))).await.unwrap();
    assert!(out.done);
    assert_eq!(out.outcome, Some(-1.0));
    match ep.step(&call("submit", json!({}))).await {
        Err(EnvError::Finished { task }) => assert_eq!(task, "signup-pro"),
        other => panic!("{other:?}"),
    }
    ep.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_limit_ends_the_episode_and_runs_the_check() {
    let root = tempfile::tempdir().unwrap();
    let env = fixture_env(EnvOptions {
        max_steps: Some(4),
        ..options(root.path())
    });
    assert_eq!(env.max_steps(), 4);
    let todo = env
        .tasks()
        .iter()
        .position(|t| t.id == "todo-delete")
        .unwrap();
    // Three idle steps, the work at the fourth: the check runs at the limit and passes.
    let mut ep = env.start(todo, 0).await.unwrap();
    let script = [
        Do::Scroll("down"),
        Do::Scroll("up"),
        Do::Scroll("down"),
        Do::Click("button \"Delete Call the bank\""),
        Do::Submit,
    ];
    let (out, steps) = run(&mut ep, &script).await;
    assert_eq!(steps, 4);
    assert!(out.done);
    assert_eq!(out.info["finish"], "step_limit");
    assert_eq!(out.outcome, Some(1.0));
    ep.close().await;
    // Four idle steps fail.
    let mut ep = env.start(todo, 0).await.unwrap();
    let (out, steps) = run(
        &mut ep,
        &[
            Do::Scroll("down"),
            Do::Scroll("down"),
            Do::Scroll("up"),
            Do::Scroll("up"),
        ],
    )
    .await;
    assert_eq!((steps, out.done, out.outcome), (4, true, Some(-1.0)));
    ep.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_has_no_network() {
    let root = tempfile::tempdir().unwrap();
    // A listener on the host's loopback that the page tries to reach.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let html = format!(
        r#"<!doctype html><title>net</title>
<img src="http://127.0.0.1:{port}/pixel.png" alt="remote">
<img src="https://example.com/logo.png" alt="logo">
<p id="r">pending</p>
<script>
  window.results = [];
  for (const url of ["http://127.0.0.1:{port}/x", "https://example.com/", "file:///etc/hostname"]) {{
    window.results.push(fetch(url).then(() => "reached " + url, () => "blocked"));
  }}
  window.done = Promise.all(window.results).then(r => {{
    document.getElementById("r").textContent = r.join(", ");
    return r;
  }});
</script>"#
    );
    let task = GuiTask {
        id: "net".into(),
        instruction: "Nothing.".into(),
        page_name: "net.html".into(),
        html,
        check: "window.done.then(r => r.every(x => x === 'blocked'))".into(),
    };
    let env = built(GuiEnv::new(vec![task], options(root.path())));
    let mut ep = env.start(0, 0).await.unwrap();
    let out = ep.step(&call("submit", json!({}))).await.unwrap();
    assert_eq!(out.outcome, Some(1.0), "{}", out.info);
    // Two images and two http fetches were refused (the file:// fetch fails in the page).
    assert!(
        out.info["blocked_requests"].as_u64().unwrap() >= 4,
        "{}",
        out.info
    );
    ep.close().await;
    let accepted = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
    assert!(accepted.is_err(), "the page reached the host's loopback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_browser_process_is_left_after_close_or_drop() {
    let root = tempfile::tempdir().unwrap();
    let env = fixture_env(options(root.path()));
    let a = env.start(0, 0).await.unwrap();
    let b = env.start(1, 0).await.unwrap();
    let running = processes_under(root.path());
    // A browser is several processes (browser, zygotes, renderer, GPU, network service).
    assert!(running.len() >= 4, "{running:?}");
    a.close().await;
    let left = processes_under(root.path());
    assert!(!left.is_empty() && left.len() < running.len(), "{left:?}");
    b.close().await;
    assert_eq!(processes_under(root.path()), Vec::<i32>::new());
    // An episode dropped without close (a panicking session) also kills its browser.
    let c = env.start(2, 0).await.unwrap();
    assert!(!processes_under(root.path()).is_empty());
    drop(c);
    assert_eq!(processes_under(root.path()), Vec::<i32>::new());
    // And every work dir is gone (only the pool's empty warm dirs remain).
    let pools = pool_roots(root.path(), "gui");
    assert_eq!(pools.len(), 1, "{pools:?}");
    for e in std::fs::read_dir(&pools[0]).unwrap() {
        let p = e.unwrap().path();
        assert_eq!(std::fs::read_dir(&p).unwrap().count(), 0, "{p:?} not empty");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_fails_the_episode() {
    let root = tempfile::tempdir().unwrap();
    let env = fixture_env(EnvOptions {
        episode_deadline: Duration::from_millis(1),
        ..options(root.path())
    });
    let mut ep = env.start(0, 0).await.unwrap();
    let out = ep.step(&call("submit", json!({}))).await.unwrap();
    assert_eq!((out.done, out.outcome), (true, Some(-1.0)));
    assert_eq!(out.info["deadline_exceeded"], true);
    ep.close().await;
}

#[test]
fn build_environment_knows_gui_and_names_bad_input() {
    let root = tempfile::tempdir().unwrap();
    let env = built(build_environment(
        EnvKind::Gui,
        &fixture("tasks.jsonl"),
        options(root.path()),
    ));
    assert_eq!(env.kind(), "gui");
    assert_eq!(env.task_count(), 7);
    assert_eq!(env.max_steps(), 30);
    // A terminal task file given to the gui kind: the first line names the missing key.
    let e = build_environment(
        EnvKind::Gui,
        &fixture("../terminal.jsonl"),
        options(root.path()),
    )
    .err()
    .unwrap();
    let text = e.to_string();
    assert!(text.contains("terminal.jsonl:1:"), "{text}");
    assert!(
        text.contains("`page`") || text.contains("`setup`"),
        "{text}"
    );
    // More ready browsers than may be alive at once.
    let e = build_environment(
        EnvKind::Gui,
        &fixture("tasks.jsonl"),
        EnvOptions {
            warm_browsers: 5,
            max_concurrent_commands: 2,
            ..options(root.path())
        },
    )
    .err()
    .unwrap();
    let text = e.to_string();
    assert!(
        text.contains("warm_browsers") && text.contains("5") && text.contains("2"),
        "{text}"
    );
}
