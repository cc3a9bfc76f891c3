//! The GUI browser's confinement, tested on the browser itself with no request interception:
//! whatever a page asks the browser to load, it runs as the browser uid with Chromium's
//! sandbox on (renderers under a seccomp filter, in user namespaces of their own), reads no
//! file outside its own directory that the node keeps private, sees neither the node's
//! world-writable directories nor another browser's directory, and reaches no network.
//!
//! Each file read is paired with a control that the same request does read a file the
//! browser may see, so that a refusal is the confinement's and not a broken probe's.
//!
//! Chromium and root are required, as for every GUI test.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clawrl::env::gui::cdp::{browser_processes, Browser, Cdp, LaunchOptions};
use clawrl::env::gui::confine::{self, BROWSER_GID, BROWSER_UID};
use clawrl::env::gui::page::TaskPage;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

fn launch_options(dir: PathBuf) -> LaunchOptions {
    LaunchOptions {
        binary: clawrl::env::gui::cdp::find_chromium().expect("Chromium (the Debian package)"),
        dir,
        width: 800,
        height: 600,
        timeout: Duration::from_secs(30),
    }
}

/// A browser and its event stream (kept open, unread: every command here waits for its reply).
async fn launch(dir: PathBuf) -> (Browser, UnboundedReceiver<Value>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let b = Browser::launch(&launch_options(dir), tx)
        .await
        .expect("the browser starts confined");
    (b, rx)
}

/// Opens `url` in a new tab, straight (no interception); returns the navigation's error, if
/// any, and the text the tab then shows once its document is complete.
async fn visit(cdp: &Cdp, url: &str) -> (Option<String>, String) {
    let s = cdp.open_tab().await.unwrap();
    let nav = cdp
        .call("Page.navigate", json!({"url": url}), Some(&s))
        .await
        .unwrap();
    let error = nav["errorText"].as_str().map(str::to_string);
    let r = cdp
        .call(
            "Runtime.evaluate",
            json!({
                "expression": "new Promise(r => document.readyState === 'complete' ? r() : \
                               addEventListener('load', () => r(), {once: true})) \
                               .then(() => document.body ? document.body.innerText : '')",
                "awaitPromise": true,
                "returnByValue": true,
            }),
            Some(&s),
        )
        .await
        .unwrap();
    let text = r["result"]["value"].as_str().unwrap_or("").to_string();
    (error, text)
}

/// A file of `mode` with `text`, owned by `uid:gid`.
fn plant(path: &Path, text: &str, mode: u32, owner: (u32, u32)) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    std::os::unix::fs::chown(path, Some(owner.0), Some(owner.1)).unwrap();
}

/// What the test reads of one process, all at once.
#[derive(Debug)]
struct Proc {
    pid: i32,
    cmdline: String,
    status: String,
    /// `net`, `mnt` and `user` namespaces.
    ns: std::collections::HashMap<&'static str, PathBuf>,
}

impl Proc {
    /// `None` when the process is gone.
    fn read(pid: i32) -> Option<Proc> {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let mut ns = std::collections::HashMap::new();
        for kind in ["net", "mnt", "user"] {
            ns.insert(
                kind,
                std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).ok()?,
            );
        }
        Some(Proc {
            pid,
            cmdline: String::from_utf8_lossy(&cmdline).replace('\0', " "),
            status,
            ns,
        })
    }

    /// A `/proc/PID/status` field, its values joined by single spaces.
    fn field(&self, name: &str) -> String {
        self.status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    }
}

fn ns(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_browser_runs_unprivileged_sandboxed_and_reads_only_what_it_may() {
    let root = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (root.path().join("a"), root.path().join("b"));
    let (mut a, _a_events) = launch(a_dir.clone()).await;
    let (mut b, _b_events) = launch(b_dir.clone()).await;

    // The controls: each browser reads a file in its own directory (its own, and one the node
    // put there readable by all).
    plant(
        &a_dir.join("tmp/own.txt"),
        "A-OWN-TEXT",
        0o600,
        (BROWSER_UID, BROWSER_GID),
    );
    plant(&b_dir.join("tmp/given.txt"), "B-GIVEN-TEXT", 0o644, (0, 0));
    let (err, text) = visit(a.cdp(), &format!("file://{}/tmp/own.txt", a_dir.display())).await;
    assert_eq!((err, text.trim()), (None, "A-OWN-TEXT"));
    let (err, text) = visit(
        b.cdp(),
        &format!("file://{}/tmp/given.txt", b_dir.display()),
    )
    .await;
    assert_eq!((err, text.trim()), (None, "B-GIVEN-TEXT"));

    // What B must not read:
    // - A's file, though the browsers share a uid: A's directory is not in B's view;
    // - a private file of the node beside B's directory;
    // - a file readable by all in /tmp, which B sees only as an empty cover;
    // - a private file of the node where B can see it (a directory outside every cover): the
    //   uid keeps it out;
    // - the host's password hashes.
    let beside = root.path().join("secret.txt");
    plant(&beside, "NODE-SECRET-BESIDE", 0o600, (0, 0));
    let world = tempfile::Builder::new()
        .prefix("clawrl-browser-test-")
        .tempfile_in("/tmp")
        .unwrap();
    plant(world.path(), "WORLD-READABLE-IN-TMP", 0o644, (0, 0));
    let scratch = tempfile::tempdir_in(uncovered_dir(root.path())).unwrap();
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let visible = scratch.path().join("secret.txt");
    plant(&visible, "NODE-SECRET-VISIBLE", 0o600, (0, 0));
    let refused = [
        (a_dir.join("tmp/own.txt"), "A-OWN-TEXT"),
        (beside, "NODE-SECRET-BESIDE"),
        (world.path().to_path_buf(), "WORLD-READABLE-IN-TMP"),
        (visible, "NODE-SECRET-VISIBLE"),
        (PathBuf::from("/etc/shadow"), "root:"),
    ];
    for (path, secret) in &refused {
        let (err, text) = visit(b.cdp(), &format!("file://{}", path.display())).await;
        assert!(
            !text.contains(secret),
            "{}: B read {text:?}",
            path.display()
        );
        let err = err.unwrap_or_default();
        assert!(
            err.contains("ERR_ACCESS_DENIED") || err.contains("ERR_FILE_NOT_FOUND"),
            "{}: {err}",
            path.display()
        );
    }

    // No network: a listener on the host's loopback hears nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (err, text) = visit(b.cdp(), &format!("http://127.0.0.1:{port}/")).await;
    assert!(err.is_some(), "the page loaded: {text}");
    // The navigation has failed by now, so a connection it made would be queued already.
    let accepted = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
    assert!(accepted.is_err(), "the browser reached the host's loopback");

    // Every process of B runs as the browser uid and group, in network and mount namespaces
    // that are not the node's; its renderers (where pages run) are under a seccomp filter in
    // user namespaces of their own: Chromium's namespace sandbox, not a setuid helper.
    // Read once each; one that exits meanwhile (a spare renderer let go) is left out.
    let procs: Vec<Proc> = browser_processes(0, &b_dir)
        .into_iter()
        .filter_map(Proc::read)
        .collect();
    let renderers: Vec<&Proc> = procs
        .iter()
        .filter(|p| p.cmdline.contains("--type=renderer"))
        .collect();
    let main: Vec<&Proc> = procs
        .iter()
        .filter(|p| !p.cmdline.contains("--type=") && !p.cmdline.contains("crashpad"))
        .collect();
    assert_eq!(main.len(), 1, "{procs:#?}");
    assert!(!renderers.is_empty(), "{procs:#?}");
    let uids = format!("{BROWSER_UID} {BROWSER_UID} {BROWSER_UID} {BROWSER_UID}");
    let gids = format!("{BROWSER_GID} {BROWSER_GID} {BROWSER_GID} {BROWSER_GID}");
    for p in &procs {
        assert_eq!(p.field("Uid"), uids, "{p:#?}");
        assert_eq!(p.field("Gid"), gids, "{p:#?}");
        assert_eq!(p.field("Groups"), "", "{p:#?}");
        assert_eq!(p.field("NoNewPrivs"), "1", "{p:#?}");
    }
    let main = main[0];
    for kind in ["net", "mnt"] {
        assert_ne!(main.ns[kind], ns("self", kind), "{kind}");
    }
    for r in &renderers {
        assert_eq!(r.field("Seccomp"), "2", "{r:#?}");
        assert_ne!(r.ns["user"], main.ns["user"], "{r:#?}");
    }
    let main = main.pid;
    // In B's view, the files refused above are out of sight (A's, beside B's directory, in
    // /tmp), not only unreadable.
    for gone in [&refused[0].0, &refused[1].0, &refused[2].0] {
        let seen = PathBuf::from(format!("/proc/{main}/root{}", gone.display()));
        assert!(!seen.exists(), "{}", seen.display());
    }
    assert!(PathBuf::from(format!("/proc/{main}/root{}", refused[3].0.display())).exists());
    // Its TMPDIR is its own directory's `tmp`.
    let scratch_seen = format!("/proc/{main}/root{}/given.txt", confine::SCRATCH);
    assert_eq!(
        std::fs::read_to_string(&scratch_seen).unwrap(),
        "B-GIVEN-TEXT"
    );
    // The node's world-writable directories and /run are root-owned covers.
    for d in ["tmp", "var/tmp", "dev/shm", "run"] {
        let seen = PathBuf::from(format!("/proc/{main}/root/{d}"));
        let m = std::fs::metadata(&seen).unwrap();
        assert_eq!(
            (m.mode() & 0o7777, m.uid()),
            (0o755, 0),
            "{}",
            seen.display()
        );
    }

    // Its /proc lists only its own uid's processes.
    let mounts = std::fs::read_to_string(format!("/proc/{main}/mountinfo")).unwrap();
    let proc_mount = mounts
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some("/proc") && l.contains(" - proc "))
        .unwrap_or_default();
    assert!(proc_mount.contains("hidepid=invisible"), "{mounts}");

    a.kill().await;
    b.kill().await;
    assert_eq!(browser_processes(0, root.path()), Vec::<i32>::new());
    // Nothing the browsers did is left mounted on the node.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(root.path().to_str().unwrap()), "{mounts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_page_reads_no_file_and_reaches_no_network() {
    let root = tempfile::tempdir().unwrap();
    let secret = root.path().join("secret.txt");
    plant(&secret, "NODE-SECRET", 0o600, (0, 0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let html = format!(
        r#"<!doctype html><title>files</title><p id="r">pending</p>
<iframe id="f1" src="file://{secret}"></iframe>
<iframe id="f2" src="file:///etc/shadow"></iframe>
<script>
  const urls = ["file://{secret}", "file:///etc/shadow", "http://127.0.0.1:{port}/"];
  const viaFetch = u => fetch(u).then(r => r.text()).then(t => "read " + t, () => "refused");
  const viaXhr = u => new Promise(done => {{
    const x = new XMLHttpRequest();
    x.onload = () => done("read " + x.responseText);
    x.onerror = () => done("refused");
    try {{ x.open("GET", u); x.send(); }} catch (e) {{ done("refused"); }}
  }});
  window.done = Promise.all(urls.flatMap(u => [viaFetch(u), viaXhr(u)])).then(r => {{
    document.getElementById("r").textContent = r.join(" | ");
    return r;
  }});
</script>"#,
        secret = secret.display()
    );
    let opts = launch_options(root.path().join("browser"));
    let page = TaskPage::open(&opts, "files.html", &html).await.unwrap();
    let results = page
        .evaluate("window.done")
        .await
        .unwrap()
        .expect("the page's requests all settle");
    assert_eq!(results, json!(vec!["refused"; 6]), "{results}");
    // What the page shows, frames included, never holds the files' text.
    let shown = page
        .evaluate(
            "[document.body.innerText].concat([...document.querySelectorAll('iframe')].map(f => \
             { try { return f.contentDocument ? f.contentDocument.body.innerText : 'opaque'; } \
             catch (e) { return 'opaque'; } })).join('\\n')",
        )
        .await
        .unwrap()
        .unwrap();
    let shown = shown.as_str().unwrap_or("");
    assert!(
        !shown.contains("NODE-SECRET") && !shown.contains("root:"),
        "{shown}"
    );
    let tree = page
        .ax_nodes()
        .await
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect::<String>();
    assert!(!tree.contains("NODE-SECRET") && !tree.contains("root:"));
    drop(page);
    let accepted = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
    assert!(accepted.is_err(), "the page reached the host's loopback");
    assert_eq!(browser_processes(0, root.path()), Vec::<i32>::new());
}

/// A directory of the host that the browser's mount namespace shows as it is: outside every
/// cover ([`confine::COVERED`]) and outside `root` (whose unreachable ancestors are covered too).
/// The build's scratch dir when it qualifies (a checkout under `/tmp` does not), else `/var/lib`.
fn uncovered_dir(root: &Path) -> PathBuf {
    let covered = |p: &Path| {
        confine::COVERED.iter().any(|c| p.starts_with(c))
            || root
                .ancestors()
                .any(|a| a != Path::new("/") && p.starts_with(a))
    };
    [
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
        PathBuf::from("/var/lib"),
    ]
    .into_iter()
    .find(|d| d.is_dir() && !covered(d))
    .expect("a directory outside the browser's covers")
}
