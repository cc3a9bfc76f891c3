//! The GUI environment (docs/design.md §4): a local HTML page in headless Chromium, driven over the
//! Chrome DevTools Protocol ([`cdp`], [`page`]); the policy sees the page's accessibility tree as
//! text with element ids ([`axtree`]) and the path of a screenshot, acts with `click`, `type`,
//! `key` and `scroll` by element id, finishes with `submit` (or a plain answer), and a JavaScript
//! check evaluated in the page decides the outcome. 30 steps by default.
//!
//! A task line is `{"id", "instruction", "page", "check"}`: `page` is an HTML file relative to the
//! task file's directory (read at load, at most 1 MiB of UTF-8), `check` a JavaScript expression
//! that evaluates (awaiting a promise) to `true` when the task is done; anything else (false, a
//! non-boolean, an exception) is a failure. Unknown keys, missing fields, blank texts and pages
//! that cannot be read are errors naming the line and the key.
//!
//! Each episode has a browser of its own (profile, `HOME` and screenshots in the episode's work
//! dir); the page is served from memory at [`page::PAGE_ORIGIN`] and every other request is
//! refused. The browser is confined ([`confine`]): it runs as [`confine::BROWSER_UID`], not as
//! the node's user, with Chromium's own sandbox on, in network and mount namespaces of its own
//! where the only place it can write is the episode's browser directory and no other episode's
//! directory is visible. That needs root: without it the environment refuses to start rather
//! than run a browser that could read whatever the node's user can and reach the network.
//! Closing the episode kills every process of its browser. Browsers are launched ahead of
//! the episodes that will use them ([`pool`], `EnvOptions::warm_browsers` kept ready). At most
//! `EnvOptions::max_concurrent_commands` browsers of one environment are alive at once, ready
//! ones included.

pub mod axtree;
pub mod cdp;
pub mod confine;
pub mod page;
pub mod pool;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clawrl_actors::loops::{Action, BoxFuture, EnvError, Episode, ToolCallAction};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use self::axtree::RenderedTree;
use self::cdp::CdpError;
use self::page::{known_key, TaskPage, KEY_NAMES};
use self::pool::{BrowserPool, BrowserSpec, Leased, PoolStats};
use super::episode::{verdict, Finish, StepResult, ToolEpisode, ToolSteps};
use super::exec::{no_arg_tool, tool_message};
use super::shell::SUBMIT_TOOL;
use super::task_env::{setup_error, TaskEnv, TaskKind};
use super::tasks::{check_nonblank, check_relative_path, read_tasks, TaskError};
use super::workdir::{WorkDir, WorkDirPool};
use super::{EnvBuildError, EnvKind, EnvOptions};

/// The default step limit.
pub const DEFAULT_MAX_STEPS: u32 = 30;

/// The largest page a task may ship.
pub const MAX_PAGE_BYTES: u64 = 1 << 20;

/// The viewport, in CSS pixels.
pub const VIEWPORT: (u32, u32) = (1024, 768);

/// Pixels one `scroll` by direction moves.
pub const SCROLL_STEP: i64 = 400;

/// How long one protocol command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

const SYSTEM_PROMPT: &str = "You operate a web page in a browser. After every action you see \
the page's accessibility tree, one element a line as `[n] role \"name\" states`, and the path of \
a screenshot. Act on elements by their number n with the tools `click`, `type` (replaces the \
field's text), `key` and `scroll`; numbers refer to the latest tree. There is no network. When \
the task is done, call `submit`.";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    id: String,
    instruction: String,
    page: String,
    check: String,
}

/// One GUI task.
#[derive(Clone, Debug, PartialEq)]
pub struct GuiTask {
    /// Its id.
    pub id: String,
    /// What the agent must do.
    pub instruction: String,
    /// The page's file name (the last component of `page`; it is served under that name).
    pub page_name: String,
    /// The page's HTML.
    pub html: String,
    /// The JavaScript check: `true` is success.
    pub check: String,
}

/// Reads and validates a GUI task file (pages are read relative to its directory).
pub fn load_tasks(path: &Path) -> Result<Vec<GuiTask>, TaskError> {
    let base = path.parent().unwrap_or(Path::new("."));
    read_tasks(
        path,
        |raw: &RawTask| &raw.id,
        |line, raw| {
            check_nonblank(path, line, "instruction", &raw.instruction)?;
            check_nonblank(path, line, "check", &raw.check)?;
            let rel = check_relative_path(&raw.page)
                .map_err(|r| TaskError::invalid(path, line, "page", r))?;
            let bad = |r: String| TaskError::invalid(path, line, "page", r);
            let ext = rel.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !ext.eq_ignore_ascii_case("html") && !ext.eq_ignore_ascii_case("htm") {
                return Err(bad(format!("{:?} is not an .html file", raw.page)));
            }
            let file = base.join(&rel);
            let meta = std::fs::metadata(&file)
                .map_err(|e| bad(format!("reading {}: {e}", file.display())))?;
            if !meta.is_file() || meta.len() > MAX_PAGE_BYTES || meta.len() == 0 {
                return Err(bad(format!(
                    "{} must be a non-empty file of at most {MAX_PAGE_BYTES} bytes",
                    file.display()
                )));
            }
            let html = std::fs::read_to_string(&file)
                .map_err(|e| bad(format!("reading {}: {e}", file.display())))?;
            let page_name = rel
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("index.html")
                .to_string();
            Ok(GuiTask {
                id: raw.id,
                instruction: raw.instruction,
                page_name,
                html,
                check: raw.check,
            })
        },
    )
}

/// An action parsed from a tool call.
#[derive(Clone, Debug, PartialEq)]
pub enum GuiAction {
    /// Click element `[id]`.
    Click(u64),
    /// Replace the text of element `[id]`.
    Type(u64, String),
    /// Press a key, first focusing element `[id]` when given.
    Key(Option<u64>, String),
    /// Scroll element `[id]` into view.
    ScrollTo(u64),
    /// Scroll the page by [`SCROLL_STEP`] pixels, down when `true`.
    Scroll(bool),
    /// Finish the episode.
    Submit,
}

/// The tool schemas the environment offers.
pub fn tool_schemas() -> Vec<Value> {
    let id = json!({"type": "integer", "description": "The element's number n from the tree."});
    let tool = |name: &str, description: &str, properties: Value, required: Value| {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": false}}})
    };
    let mut keys: Vec<&str> = KEY_NAMES.to_vec();
    keys.push("a single letter or digit");
    vec![
        tool(
            "click",
            "Click an element with the left mouse button.",
            json!({"id": id}),
            json!(["id"]),
        ),
        tool(
            "type",
            "Focus a text field and replace its text with `text`.",
            json!({"id": id, "text": {"type": "string", "description": "The new text."}}),
            json!(["id", "text"]),
        ),
        tool(
            "key",
            "Press a key, on element `id` (focused first) or on the focused element.",
            json!({"key": {"type": "string", "description": format!("One of: {}.", keys.join(", "))},
                   "id": id}),
            json!(["key"]),
        ),
        tool(
            "scroll",
            "Scroll element `id` into view, or scroll the page `up` or `down`.",
            json!({"id": id, "direction": {"type": "string", "enum": ["up", "down"]}}),
            json!([]),
        ),
        no_arg_tool(SUBMIT_TOOL, "Finish the task; the page is then checked."),
    ]
}

fn element_id(args: &Map<String, Value>, tool: &str) -> Result<Option<u64>, String> {
    match args.get("id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().filter(|&n| n > 0).map(Some).ok_or_else(|| {
            format!("error: \"id\" of `{tool}` must be an element number n ≥ 1, got {n}")
        }),
        Some(Value::String(s)) => {
            let t = s.trim().trim_start_matches('[').trim_end_matches(']');
            t.parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .map(Some)
                .ok_or_else(|| {
                    format!("error: \"id\" of `{tool}` must be an element number, got {s:?}")
                })
        }
        Some(other) => Err(format!(
            "error: \"id\" of `{tool}` must be an element number, got {other}"
        )),
    }
}

/// Parses a tool call; the error is the text the tool message shows the policy.
pub fn parse_action(call: &ToolCallAction) -> Result<GuiAction, String> {
    let tool = call.name.as_str();
    let allowed: &[&str] = match tool {
        "click" => &["id"],
        "type" => &["id", "text"],
        "key" => &["key", "id"],
        "scroll" => &["id", "direction"],
        SUBMIT_TOOL => &[],
        other => {
            return Err(format!(
                "error: unknown tool `{other}`; the tools are click, type, key, scroll and submit"
            ))
        }
    };
    let empty = Map::new();
    let args = match &call.arguments {
        Value::Object(m) => m,
        Value::Null => &empty,
        _ => {
            return Err(format!(
                "error: the arguments of `{tool}` must be a JSON object"
            ))
        }
    };
    if let Some(k) = args.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(format!("error: `{tool}` takes no argument \"{k}\""));
    }
    let id = element_id(args, tool)?;
    let need_id = || id.ok_or_else(|| format!("error: `{tool}` needs \"id\", an element number"));
    let string = |key: &str| match args.get(key) {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        None | Some(Value::Null) => Ok(None),
        Some(other) => Err(format!(
            "error: \"{key}\" of `{tool}` must be a string, got {other}"
        )),
    };
    Ok(match tool {
        "click" => GuiAction::Click(need_id()?),
        "type" => {
            let id = need_id()?;
            let text = string("text")?
                .ok_or_else(|| "error: `type` needs \"text\" (a string)".to_string())?;
            GuiAction::Type(id, text)
        }
        "key" => {
            let key = string("key")?
                .ok_or_else(|| "error: `key` needs \"key\" (a string)".to_string())?;
            if !known_key(&key) {
                return Err(format!(
                    "error: unknown key {key:?}; keys are {} or a single letter or digit",
                    KEY_NAMES.join(", ")
                ));
            }
            GuiAction::Key(id, key)
        }
        "scroll" => match (id, string("direction")?.as_deref()) {
            (Some(id), None) => GuiAction::ScrollTo(id),
            (None, Some("down")) => GuiAction::Scroll(true),
            (None, Some("up")) => GuiAction::Scroll(false),
            (None, Some(d)) => {
                return Err(format!(
                    "error: \"direction\" of `scroll` must be \"up\" or \"down\", got {d:?}"
                ))
            }
            _ => {
                return Err(
                    "error: `scroll` takes either \"id\" or \"direction\" (exactly one)".into(),
                )
            }
        },
        _ => GuiAction::Submit,
    })
}

/// Checks once per process that Chromium is installed and that this process can confine it
/// ([`confine`]: namespaces and a uid change, which need root); returns its path.
fn probe_browser() -> Result<PathBuf, EnvBuildError> {
    static PROBE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let binary = cdp::find_chromium()?;
            let out = std::process::Command::new(&binary)
                .arg("--version")
                .output()
                .map_err(|e| format!("running {} --version: {e}", binary.display()))?;
            if !out.status.success() {
                return Err(format!(
                    "{} --version failed ({}): {}",
                    binary.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let confined = confine::Prepared::without_dir().map_err(|e| e.to_string())?;
            let mut cmd = std::process::Command::new("/bin/true");
            // SAFETY: `enter` makes only async-signal-safe system calls.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || confined.enter());
            }
            match cmd.status() {
                Ok(s) if s.success() => Ok(binary),
                Ok(s) => Err(format!("/bin/true confined as the browser is: {s}")),
                Err(e) => Err(format!(
                    "the browser runs as uid {} in network and mount namespaces of its own, \
                     which needs root (CAP_SYS_ADMIN, CAP_SETUID and CAP_SETGID): {e}",
                    confine::BROWSER_UID
                )),
            }
        })
        .clone()
        .map_err(EnvBuildError::Browser)
}

#[derive(Debug)]
struct Config {
    tools: Arc<Vec<Value>>,
    max_steps: u32,
    observation_bytes: usize,
    deadline: Duration,
}

/// The GUI environment over a task set.
pub type GuiEnv = TaskEnv<Gui>;

/// What the GUI kind adds to its task set: the episodes' settings and the browsers.
pub struct Gui {
    cfg: Arc<Config>,
    browsers: Arc<BrowserPool>,
}

impl TaskKind for Gui {
    type Task = GuiTask;

    const KIND: EnvKind = EnvKind::Gui;

    fn load_tasks(path: &Path) -> Result<Vec<GuiTask>, TaskError> {
        load_tasks(path)
    }

    /// Checks that Chromium can start and starts warming the browsers.
    fn build(options: &EnvOptions, workdirs: Arc<WorkDirPool>) -> Result<Self, EnvBuildError> {
        if options.warm_browsers > options.max_concurrent_commands {
            return Err(EnvBuildError::Options {
                option: "warm_browsers".into(),
                reason: format!(
                    "{} ready browsers exceed the limit of {} browsers alive \
                     (max_concurrent_commands)",
                    options.warm_browsers, options.max_concurrent_commands
                ),
            });
        }
        let spec = BrowserSpec {
            binary: probe_browser()?,
            viewport: VIEWPORT,
            timeout: COMMAND_TIMEOUT,
        };
        let browsers = BrowserPool::new(
            spec,
            workdirs,
            Arc::new(Semaphore::new(options.max_concurrent_commands)),
            options.warm_browsers,
        );
        Ok(Self {
            cfg: Arc::new(Config {
                tools: Arc::new(tool_schemas()),
                max_steps: options.max_steps.unwrap_or(DEFAULT_MAX_STEPS),
                observation_bytes: options.observation_bytes,
                deadline: options.episode_deadline,
            }),
            browsers,
        })
    }

    fn max_steps(&self) -> u32 {
        self.cfg.max_steps
    }

    async fn start(
        &self,
        task: Arc<GuiTask>,
        started: Instant,
    ) -> Result<Box<dyn Episode>, EnvError> {
        let setup_err = |reason| setup_error(&task.id, reason);
        let (page, wd, permit, warm_browser) = self.open_page(&task).await.map_err(setup_err)?;
        let start_ms = started.elapsed().as_millis() as u64;
        let mut steps = GuiSteps {
            task: Arc::clone(&task),
            cfg: Arc::clone(&self.cfg),
            page: Some(page),
            workdir: Some(wd),
            tree: RenderedTree::default(),
            start_ms,
            warm_browser,
            _permit: permit,
            browsers: Arc::clone(&self.browsers),
        };
        let state = match steps.snapshot(0).await {
            Ok(s) => s,
            Err(e) => {
                let reason = e.to_string();
                steps.close().await;
                return Err(setup_err(reason));
            }
        };
        let messages = vec![
            json!({"role": "system", "content": SYSTEM_PROMPT}),
            json!({"role": "user", "content": format!("{}\n\n{state}", task.instruction)}),
        ];
        Ok(Box::new(ToolEpisode::new(
            task.id.clone(),
            task.instruction.clone(),
            messages,
            Arc::clone(&self.cfg.tools),
            started + self.cfg.deadline,
            steps,
        )))
    }
}

impl GuiEnv {
    /// The warm browser pool's counters.
    pub fn browser_stats(&self) -> PoolStats {
        self.kind.browsers.stats()
    }

    /// Waits until the pool has `EnvOptions::warm_browsers` browsers ready (or `timeout` has
    /// passed); returns how many are ready. For callers that want the first episodes to start
    /// warm, such as a benchmark.
    pub async fn wait_warm(&self, timeout: Duration) -> usize {
        let browsers = &self.kind.browsers;
        let until = Instant::now() + timeout;
        browsers.refill();
        loop {
            let ready = browsers.stats().ready;
            if ready >= browsers.target() || Instant::now() >= until {
                return ready;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Gui {
    /// A browser showing `task`'s page: a ready one from the pool, or a fresh one when the
    /// ready one turns out dead.
    async fn open_page(
        &self,
        task: &GuiTask,
    ) -> Result<(TaskPage, WorkDir, OwnedSemaphorePermit, bool), String> {
        let mut leased = self.browsers.take().await.map_err(|e| e.to_string())?;
        loop {
            let Leased {
                launched,
                workdir,
                permit,
                warm,
            } = leased;
            match TaskPage::open_in(
                launched,
                self.browsers.viewport(),
                &task.page_name,
                &task.html,
            )
            .await
            {
                Ok(page) => return Ok((page, workdir, permit, warm)),
                Err(e) if warm => {
                    tracing::warn!(task = %task.id, "a ready browser failed to open the page, taking another: {e}");
                    self.browsers.discarded();
                    drop(permit);
                    if let Err(e) = workdir.remove().await {
                        tracing::warn!("removing a GUI work dir: {e}");
                    }
                    leased = self.browsers.take().await.map_err(|e| e.to_string())?;
                }
                Err(e) => {
                    if let Err(e) = workdir.remove().await {
                        tracing::warn!("removing a GUI work dir: {e}");
                    }
                    return Err(e.to_string());
                }
            }
        }
    }
}

/// What a GUI episode does with its steps: acts on the page in its browser, by the latest
/// tree's element ids, and evaluates the task's check.
pub struct GuiSteps {
    task: Arc<GuiTask>,
    cfg: Arc<Config>,
    page: Option<TaskPage>,
    workdir: Option<WorkDir>,
    tree: RenderedTree,
    /// Milliseconds from the start until the page was shown, and whether its browser was
    /// ready in the pool (reported in the first step's info).
    start_ms: u64,
    warm_browser: bool,
    _permit: OwnedSemaphorePermit,
    browsers: Arc<BrowserPool>,
}

impl GuiSteps {
    fn step_error(&self, e: impl std::fmt::Display) -> EnvError {
        EnvError::Step {
            task: self.task.id.clone(),
            reason: e.to_string(),
        }
    }

    fn page(&self) -> &TaskPage {
        self.page.as_ref().expect("open episode has a page")
    }

    /// The screenshot path of step `step`.
    fn screenshot_path(&self, step: u32) -> PathBuf {
        self.workdir
            .as_ref()
            .expect("open episode has a work dir")
            .path()
            .join("screenshots")
            .join(format!("step-{step:02}.png"))
    }

    /// Reads the page (tree, screenshot) after step `step`, remembers the element ids and
    /// renders the state text.
    async fn snapshot(&mut self, step: u32) -> Result<String, CdpError> {
        let shot = self.screenshot_path(step);
        let page = self.page();
        let info = page.info().await?;
        let nodes = page.ax_nodes().await?;
        page.screenshot(&shot).await?;
        let budget = self.cfg.observation_bytes;
        self.tree = axtree::render(&nodes, budget).map_err(|e| CdpError::Closed(e.to_string()))?;
        let (y, height, view) = info.scroll;
        let mut text = format!(
            "page: {} ({})\nscroll: {y} of {height} px (viewport {view})\nscreenshot: {}\n\
             elements:\n{}",
            serde_json::to_string(&info.title).expect("strings serialise"),
            info.url,
            shot.display(),
            self.tree.text
        );
        if self.tree.truncated {
            text.push_str(&format!(
                "[... the tree is cut at {budget} bytes; scroll or act on what is shown ...]\n"
            ));
        }
        Ok(text)
    }

    /// Runs one parsed action; `Ok(text)` is what the tool message says.
    async fn act(&self, action: &GuiAction) -> Result<String, EnvError> {
        let resolve = |id: u64| {
            self.tree.backend_node(id).ok_or_else(|| {
                format!(
                    "error: there is no element [{id}] in the latest page state (elements are \
                     [1] to [{}])",
                    self.tree.backend.len()
                )
            })
        };
        let page = self.page();
        let (label, result) = match action {
            GuiAction::Click(id) => match resolve(*id) {
                Err(m) => return Ok(m),
                Ok(b) => (format!("click [{id}]"), page.click(b).await),
            },
            GuiAction::Type(id, text) => match resolve(*id) {
                Err(m) => return Ok(m),
                Ok(b) => (format!("type into [{id}]"), page.type_text(b, text).await),
            },
            GuiAction::Key(id, key) => {
                let b = match id.map(resolve).transpose() {
                    Err(m) => return Ok(m),
                    Ok(b) => b,
                };
                let on = id.map(|i| format!(" on [{i}]")).unwrap_or_default();
                (format!("press {key}{on}"), page.key(b, key).await)
            }
            GuiAction::ScrollTo(id) => match resolve(*id) {
                Err(m) => return Ok(m),
                Ok(b) => (format!("scroll to [{id}]"), page.scroll_to(b).await),
            },
            GuiAction::Scroll(down) => {
                let dy = if *down { SCROLL_STEP } else { -SCROLL_STEP };
                (
                    format!("scroll {}", if *down { "down" } else { "up" }),
                    page.wheel(dy, VIEWPORT.0, VIEWPORT.1).await,
                )
            }
            GuiAction::Submit => return Ok("submitted".into()),
        };
        match result.map_err(|e| self.step_error(e))? {
            Ok(done) => {
                page.settle().await.map_err(|e| self.step_error(e))?;
                Ok(format!("{label}: {done}"))
            }
            Err(why) => Ok(format!("error: could not {label}: {why}")),
        }
    }

    /// Evaluates the task's check.
    async fn judge(&self) -> Result<(f64, Value), EnvError> {
        let page = self.page();
        page.settle().await.map_err(|e| self.step_error(e))?;
        let r = page
            .evaluate(&self.task.check)
            .await
            .map_err(|e| self.step_error(e))?;
        Ok(match r {
            Ok(Value::Bool(true)) => (1.0, json!({"passed": true})),
            Ok(Value::Bool(false)) => (-1.0, json!({"passed": false})),
            Ok(other) => (
                -1.0,
                json!({"passed": false, "error": format!("the check gave {other}, not a boolean")}),
            ),
            Err(e) => (-1.0, json!({"passed": false, "error": e})),
        })
    }
}

impl ToolSteps for GuiSteps {
    async fn run(
        &mut self,
        action: &Action,
        step: u32,
        _deadline: Instant,
    ) -> Result<StepResult, EnvError> {
        let t0 = Instant::now();
        let mut next_state = Vec::new();
        let mut actions = Vec::new();
        let mut finish = Finish::of(action);
        for call in &action.tool_calls {
            if let Some(refusal) = finish.refusal(call) {
                next_state.push(refusal);
                continue;
            }
            let text = match parse_action(call) {
                Err(msg) => msg,
                Ok(GuiAction::Submit) => {
                    finish.submit();
                    "submitted".into()
                }
                Ok(a) => self.act(&a).await?,
            };
            actions.push(json!({"tool": call.name, "ok": !text.starts_with("error:")}));
            next_state.push(tool_message(call, text));
        }
        let mut info = json!({"step": step, "actions": actions});
        let mut outcome = None;
        if let Some(how) = finish.how(step, self.cfg.max_steps) {
            outcome = Some(verdict(&mut info, how, self.judge().await?));
        } else {
            let state = self.snapshot(step).await.map_err(|e| self.step_error(e))?;
            info["screenshot"] = Value::String(self.screenshot_path(step).display().to_string());
            info["elements"] = json!(self.tree.backend.len());
            if let Some(last) = next_state.last_mut() {
                let text = last["content"].as_str().unwrap_or("").to_string();
                last["content"] = Value::String(format!("{text}\n\n{state}"));
            }
        }
        info["blocked_requests"] = json!(self.page().blocked_requests());
        info["step_ms"] = json!(t0.elapsed().as_millis() as u64);
        if step == 1 {
            info["start_ms"] = json!(self.start_ms);
            info["warm_browser"] = json!(self.warm_browser);
        }
        Ok(StepResult {
            next_state,
            outcome,
            info,
        })
    }

    fn close(mut self) -> BoxFuture<'static, ()> {
        let page = self.page.take();
        let wd = self.workdir.take();
        Box::pin(async move {
            if let Some(page) = page {
                page.close().await;
            }
            super::workdir::release(wd).await;
            let browsers = Arc::clone(&self.browsers);
            // Frees the episode's place under the browser limit, which a refill may now take.
            drop(self);
            browsers.refill();
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: Value) -> ToolCallAction {
        ToolCallAction {
            id: "c".into(),
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn actions_parse_and_bad_ones_say_why() {
        let ok = [
            (call("click", json!({"id": 3})), GuiAction::Click(3)),
            (call("click", json!({"id": "[4]"})), GuiAction::Click(4)),
            (
                call("type", json!({"id": 2, "text": "hi"})),
                GuiAction::Type(2, "hi".into()),
            ),
            (
                call("key", json!({"key": "Enter"})),
                GuiAction::Key(None, "Enter".into()),
            ),
            (
                call("key", json!({"key": "a", "id": 1})),
                GuiAction::Key(Some(1), "a".into()),
            ),
            (call("scroll", json!({"id": 9})), GuiAction::ScrollTo(9)),
            (
                call("scroll", json!({"direction": "down"})),
                GuiAction::Scroll(true),
            ),
            (call("submit", json!({})), GuiAction::Submit),
            (call("submit", Value::Null), GuiAction::Submit),
        ];
        for (c, want) in ok {
            assert_eq!(parse_action(&c), Ok(want), "{c:?}");
        }
        let bad = [
            (call("navigate", json!({})), "unknown tool"),
            (call("click", json!({})), "needs \"id\""),
            (call("click", json!({"id": 0})), "n ≥ 1"),
            (call("click", json!({"id": -2})), "n ≥ 1"),
            (call("click", json!({"id": "x"})), "element number"),
            (call("click", json!({"id": 1, "x": 5})), "no argument \"x\""),
            (call("click", json!([1])), "JSON object"),
            (call("type", json!({"id": 1})), "needs \"text\""),
            (
                call("type", json!({"id": 1, "text": 5})),
                "must be a string",
            ),
            (call("key", json!({"key": "F13"})), "unknown key"),
            (call("key", json!({})), "needs \"key\""),
            (call("scroll", json!({})), "exactly one"),
            (
                call("scroll", json!({"id": 1, "direction": "up"})),
                "exactly one",
            ),
            (
                call("scroll", json!({"direction": "left"})),
                "\"up\" or \"down\"",
            ),
        ];
        for (c, want) in bad {
            let e = parse_action(&c).unwrap_err();
            assert!(e.starts_with("error:") && e.contains(want), "{c:?}: {e}");
        }
    }

    #[test]
    fn every_tool_schema_parses_as_an_action_name() {
        for t in tool_schemas() {
            let name = t["function"]["name"].as_str().unwrap();
            let e = parse_action(&call(name, json!({"bogus": 1}))).unwrap_err();
            assert!(!e.contains("unknown tool"), "{name}: {e}");
        }
    }

    fn load(dir: &Path, text: &str) -> Result<Vec<GuiTask>, TaskError> {
        let f = dir.join("t.jsonl");
        std::fs::write(&f, text).unwrap();
        load_tasks(&f)
    }

    #[test]
    fn tasks_load_pages_and_invalid_ones_name_line_and_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("p")).unwrap();
        std::fs::write(dir.path().join("p/a.html"), "<title>A</title>").unwrap();
        std::fs::write(dir.path().join("empty.html"), "").unwrap();
        std::fs::write(dir.path().join("x.txt"), "x").unwrap();
        let ok = r#"{"id":"a","instruction":"do","page":"p/a.html","check":"true"}"#;
        let t = load(dir.path(), ok).unwrap();
        assert_eq!(t[0].page_name, "a.html");
        assert_eq!(t[0].html, "<title>A</title>");
        let cases = [
            (
                r#"{"id":"b","instruction":"do","page":"p/a.html"}"#,
                "check",
            ),
            (
                r#"{"id":"b","instruction":"do","page":"p/a.html","check":"true","x":1}"#,
                "x",
            ),
            (
                r#"{"id":"b","instruction":"do","page":"nope.html","check":"true"}"#,
                "page",
            ),
            (
                r#"{"id":"b","instruction":"do","page":"../a.html","check":"true"}"#,
                "page",
            ),
            (
                r#"{"id":"b","instruction":"do","page":"x.txt","check":"true"}"#,
                "page",
            ),
            (
                r#"{"id":"b","instruction":"do","page":"empty.html","check":"true"}"#,
                "page",
            ),
            (
                r#"{"id":"b","instruction":"do","page":"p/a.html","check":" "}"#,
                "check",
            ),
            (
                r#"{"id":"a","instruction":"do","page":"p/a.html","check":"true"}"#,
                "id",
            ),
        ];
        for (bad, key) in cases {
            match load(dir.path(), &format!("{ok}\n{bad}\n")).unwrap_err() {
                TaskError::Invalid { line, key: k, .. } => {
                    assert_eq!((line, k.as_str()), (2, key), "{bad}")
                }
                e => panic!("{bad}: {e}"),
            }
        }
    }
}
