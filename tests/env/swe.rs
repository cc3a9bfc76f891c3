//! The SWE environment over the fixture repositories (Python and Rust), in the real sandbox:
//! applying each task's known fix through the `bash` tool gives outcome +1, the unfixed
//! repository gives -1, and editing the protected tests instead of the code does not help.

use std::path::{Path, PathBuf};

use clawrl::env::swe::SweEnv;
use clawrl::env::EnvOptions;
use clawrl_actors::loops::{Action, Environment, StepOutcome, ToolCallAction};
use serde_json::json;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/env/swe")
}

fn bash(command: &str) -> Action {
    Action {
        content: String::new(),
        tool_calls: vec![ToolCallAction {
            id: "b".into(),
            name: "bash".into(),
            arguments: json!({ "command": command }),
        }],
        raw: String::new(),
    }
}

fn submit() -> Action {
    Action {
        content: String::new(),
        tool_calls: vec![ToolCallAction {
            id: "s".into(),
            name: "submit".into(),
            arguments: json!({}),
        }],
        raw: String::new(),
    }
}

/// The fixture directory of the task with this id.
fn fix_script(id: &str) -> String {
    for e in std::fs::read_dir(fixtures()).unwrap() {
        let d = e.unwrap().path();
        let t: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("task.json")).unwrap()).unwrap();
        if t["id"] == id {
            return std::fs::read_to_string(d.join("fix.sh")).unwrap();
        }
    }
    panic!("no fixture {id}")
}

async fn run(env: &SweEnv, index: usize, actions: &[Action]) -> Vec<StepOutcome> {
    let mut ep = env.start(index, 0).await.expect("start");
    let mut outs = Vec::new();
    for a in actions {
        let o = ep.step(a).await.expect("step");
        let done = o.done;
        outs.push(o);
        if done {
            break;
        }
    }
    ep.close().await;
    outs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn known_fixes_pass_and_unfixed_repositories_fail() {
    let root = tempfile::tempdir().unwrap();
    let env = SweEnv::load(
        &fixtures(),
        EnvOptions {
            work_root: Some(root.path().to_path_buf()),
            warm_workdirs: 1,
            ..EnvOptions::default()
        },
    )
    .unwrap();
    assert_eq!(env.kind(), "swe");
    assert_eq!(env.max_steps(), 20);
    let ids: Vec<&str> = env.tasks().iter().map(|t| t.id.as_str()).collect();
    assert!(ids.len() >= 5, "{ids:?}");
    assert!(ids.iter().filter(|i| i.starts_with("py-")).count() >= 3);
    assert!(ids.iter().filter(|i| i.starts_with("rs-")).count() >= 2);
    for (i, task) in env.tasks().iter().enumerate() {
        // Unfixed: the tests fail.
        let outs = run(&env, i, &[submit()]).await;
        let last = outs.last().unwrap();
        assert!(last.done);
        assert_eq!(
            last.outcome,
            Some(-1.0),
            "{} unfixed: {}",
            task.id,
            last.info
        );

        // The policy sees the failure when it runs the tests, applies the fix, submits.
        let outs = run(
            &env,
            i,
            &[
                bash(&task.test_command),
                bash(&fix_script(&task.id)),
                submit(),
            ],
        )
        .await;
        assert_eq!(outs.len(), 3);
        let first = outs[0].next_state[0]["content"].as_str().unwrap();
        assert!(!first.starts_with("exit code: 0"), "{}: {first}", task.id);
        let applied = outs[1].next_state[0]["content"].as_str().unwrap();
        assert!(
            applied.starts_with("exit code: 0"),
            "{}: {applied}",
            task.id
        );
        let last = &outs[2];
        assert_eq!(last.outcome, Some(1.0), "{} fixed: {}", task.id, last.info);
        assert_eq!(last.info["finish"], "submit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_the_protected_tests_does_not_pass() {
    let root = tempfile::tempdir().unwrap();
    let env = SweEnv::load(
        &fixtures(),
        EnvOptions {
            work_root: Some(root.path().to_path_buf()),
            warm_workdirs: 1,
            ..EnvOptions::default()
        },
    )
    .unwrap();
    let i = env
        .tasks()
        .iter()
        .position(|t| t.id == "py-slugify")
        .unwrap();
    // Replacing the test file with a trivially passing one passes inside the episode...
    let cheat = "printf 'import unittest\\nclass T(unittest.TestCase):\\n    def test(self): pass\\n' > test_slug.py";
    let outs = run(
        &env,
        i,
        &[bash(cheat), bash("python3 -m unittest"), submit()],
    )
    .await;
    let ran = outs[1].next_state[0]["content"].as_str().unwrap();
    assert!(ran.starts_with("exit code: 0"), "{ran}");
    // ...but the original tests are restored before the verdict.
    assert_eq!(outs[2].outcome, Some(-1.0), "{}", outs[2].info);
    // Replacing it by a link somewhere else does not help either.
    let outs = run(
        &env,
        i,
        &[
            bash("rm test_slug.py && ln -s /etc/hostname test_slug.py"),
            submit(),
        ],
    )
    .await;
    assert_eq!(outs[1].outcome, Some(-1.0), "{}", outs[1].info);
}
