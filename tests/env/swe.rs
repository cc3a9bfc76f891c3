//! The SWE environment over the fixture repositories (Python and Rust), in the real sandbox:
//! applying each task's known fix through the `bash` tool gives outcome +1, the unfixed
//! repository gives -1, and editing the protected tests instead of the code does not help, not
//! even with modules planted in `/work` for the restore of the tests to import.

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

/// A module planted in `/work` under a name the restore imports: run as the restore (`python3
/// -c ...`), it ends the process with exit 0 before anything is restored; imported by anything
/// else (the test command), it hands over the real module if there is one, so that the tests
/// still run.
const PLANTED_MODULE: &str = r#"import os, sys
if sys.argv[0] == "-c":
    os._exit(0)
import importlib
_name = __name__
_here = os.path.dirname(os.path.abspath(__file__))
del sys.modules[_name]
_saved = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    _real = importlib.import_module(_name)
finally:
    sys.path[:] = _saved
sys.modules[_name] = _real
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_planted_for_the_restore_do_not_stop_it() {
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
    // Every module the restore imports that is not built in or loaded at startup, plus the
    // hooks `site` would run (from /work or from the user site under HOME=/work).
    let plant = format!(
        "for m in json shutil sitecustomize usercustomize; do cat > $m.py <<'PY'\n{PLANTED_MODULE}PY\n\
         done\n\
         u=$(python3 -I -c 'import site; print(site.getusersitepackages())') && mkdir -p \"$u\" \
         && cp usercustomize.py \"$u/\"\n\
         printf 'import unittest\\nclass T(unittest.TestCase):\\n    def test(self): pass\\n' \
         > test_slug.py"
    );
    let outs = run(
        &env,
        i,
        &[bash(&plant), bash("python3 -m unittest"), submit()],
    )
    .await;
    let planted = outs[0].next_state[0]["content"].as_str().unwrap();
    assert!(planted.starts_with("exit code: 0"), "{planted}");
    // The edited tests pass inside the episode, planted modules and all...
    let ran = outs[1].next_state[0]["content"].as_str().unwrap();
    assert!(ran.starts_with("exit code: 0"), "{ran}");
    // ...but the restore still runs: the original tests fail on the unfixed code.
    let verdict = &outs[2];
    assert_eq!(verdict.outcome, Some(-1.0), "{}", verdict.info);
    let stderr = verdict.info["check"]["stderr"].as_str().unwrap_or_default();
    assert!(
        stderr.contains("FAILED ("),
        "the original tests did not run: {stderr}"
    );

    // With the fix applied, the same plants leave a restore that works and tests that pass.
    let outs = run(
        &env,
        i,
        &[bash(&plant), bash(&fix_script("py-slugify")), submit()],
    )
    .await;
    assert_eq!(outs[2].outcome, Some(1.0), "{}", outs[2].info);
}

/// Uid and gid of a path itself (a link is not followed).
fn owner(p: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.uid(), m.gid())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_dirs_are_fresh_and_links_in_them_are_never_followed() {
    // A directory planted where work dirs used to go (`<temp dir>/clawrl-env-<pid>`, a
    // predictable name) is a link to a victim dir: nothing may be created through it.
    let victim = tempfile::tempdir().unwrap();
    let planted = std::env::temp_dir().join(format!("clawrl-env-{}", std::process::id()));
    let _ = std::fs::remove_file(&planted);
    std::os::unix::fs::symlink(victim.path(), &planted).unwrap();
    let env = SweEnv::load(
        &fixtures(),
        EnvOptions {
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

    // A host file the policy learns the path of, linked from inside its work dir; the next
    // command hands the work dir to the sandbox user (chown), which must change the link and
    // leave its target, and the tests still run (the link is in the policy's own tree).
    let host = tempfile::tempdir().unwrap();
    let secret = host.path().join("host-secret");
    std::fs::write(&secret, "root's").unwrap();
    let before = owner(&secret);
    let outs = run(
        &env,
        i,
        &[
            bash(&format!(
                "ln -s {} link && ln -s {} dirlink && mkdir -p d && ln -s {} d/deeper",
                secret.display(),
                host.path().display(),
                host.path().display()
            )),
            bash("ls -l link dirlink d/deeper && readlink link"),
            submit(),
        ],
    )
    .await;
    let listed = outs[1].next_state[0]["content"].as_str().unwrap();
    assert!(listed.starts_with("exit code: 0"), "{listed}");
    assert!(listed.contains(&secret.display().to_string()), "{listed}");
    assert_eq!(outs[2].outcome, Some(-1.0), "{}", outs[2].info);
    assert_eq!(owner(&secret), before, "the link's target was handed over");
    assert_eq!(
        owner(host.path()),
        before,
        "the dir link's target was handed over"
    );
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root's");

    drop(env);
    assert_eq!(
        std::fs::read_dir(victim.path()).unwrap().count(),
        0,
        "work dirs were created through the planted link"
    );
    std::fs::remove_file(&planted).unwrap();
}
