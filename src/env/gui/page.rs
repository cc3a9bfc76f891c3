//! One task page in a [`Browser`]: opened in a fresh tab whose every request is intercepted
//! (`Fetch`): the task's HTML is served at [`PAGE_ORIGIN`] from memory and every other request
//! fails (counted); JavaScript dialogs are dismissed. On it: the accessibility tree, screenshots,
//! the check expression, and the actions — real input events at an element's box for clicks,
//! focus + select + `Input.insertText` for typing, key events, wheel scrolling.
//!
//! Errors come in two layers: `Err(CdpError)` when the browser itself failed (gone, timed out);
//! `Ok(Err(text))` when the action could not be done on this page (a stale or invisible
//! element), which the episode shows the policy.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::cdp::{Browser, Cdp, CdpError, LaunchOptions};

/// The origin the task page is served from (`.invalid` never resolves).
pub const PAGE_ORIGIN: &str = "http://task.invalid";

/// The result of an action the policy can be told about.
pub type ActionResult = Result<Result<String, String>, CdpError>;

/// What the page shows besides the tree.
#[derive(Clone, Debug, PartialEq)]
pub struct PageInfo {
    /// `document.title`.
    pub title: String,
    /// `location.href`.
    pub url: String,
    /// Vertical scroll offset, page height and viewport height, in CSS pixels.
    pub scroll: (i64, i64, i64),
}

/// A browser with the task page open in it.
pub struct TaskPage {
    browser: Browser,
    cdp: Cdp,
    session: String,
    blocked: Arc<AtomicU64>,
    events: tokio::task::JoinHandle<()>,
}

/// A named key: `(key, code, windowsVirtualKeyCode, text)`.
fn named_key(name: &str) -> Option<(&'static str, &'static str, i64, &'static str)> {
    Some(match name {
        "Enter" => ("Enter", "Enter", 13, "\r"),
        "Tab" => ("Tab", "Tab", 9, ""),
        "Escape" => ("Escape", "Escape", 27, ""),
        "Backspace" => ("Backspace", "Backspace", 8, ""),
        "Delete" => ("Delete", "Delete", 46, ""),
        "Space" | " " => (" ", "Space", 32, " "),
        "ArrowUp" => ("ArrowUp", "ArrowUp", 38, ""),
        "ArrowDown" => ("ArrowDown", "ArrowDown", 40, ""),
        "ArrowLeft" => ("ArrowLeft", "ArrowLeft", 37, ""),
        "ArrowRight" => ("ArrowRight", "ArrowRight", 39, ""),
        "Home" => ("Home", "Home", 36, ""),
        "End" => ("End", "End", 35, ""),
        "PageUp" => ("PageUp", "PageUp", 33, ""),
        "PageDown" => ("PageDown", "PageDown", 34, ""),
        _ => return None,
    })
}

/// The keys [`TaskPage::key`] knows besides single letters and digits.
pub const KEY_NAMES: [&str; 14] = [
    "Enter",
    "Tab",
    "Escape",
    "Backspace",
    "Delete",
    "Space",
    "ArrowUp",
    "ArrowDown",
    "ArrowLeft",
    "ArrowRight",
    "Home",
    "End",
    "PageUp",
    "PageDown",
];

/// Whether `key` is one [`TaskPage::key`] can press.
pub fn known_key(key: &str) -> bool {
    named_key(key).is_some()
        || (key.chars().count() == 1 && key.chars().all(|c| c.is_ascii_alphanumeric()))
}

async fn handle_events(
    cdp: Cdp,
    mut rx: mpsc::UnboundedReceiver<Value>,
    page_url: String,
    body: Arc<String>,
    blocked: Arc<AtomicU64>,
) {
    while let Some(ev) = rx.recv().await {
        let session = ev["sessionId"].as_str().map(str::to_string);
        let p = &ev["params"];
        match ev["method"].as_str() {
            Some("Fetch.requestPaused") => {
                let id = p["requestId"].clone();
                let url = p["request"]["url"].as_str().unwrap_or("");
                let (method, params) = if url == page_url {
                    (
                        "Fetch.fulfillRequest",
                        json!({"requestId": id, "responseCode": 200, "body": body.as_str(),
                               "responseHeaders": [{"name": "Content-Type",
                                                    "value": "text/html; charset=utf-8"}]}),
                    )
                } else {
                    blocked.fetch_add(1, Ordering::Relaxed);
                    (
                        "Fetch.failRequest",
                        json!({"requestId": id, "errorReason": "BlockedByClient"}),
                    )
                };
                let cdp = cdp.clone();
                tokio::spawn(async move {
                    let _ = cdp.call(method, params, session.as_deref()).await;
                });
            }
            Some("Page.javascriptDialogOpening") => {
                let cdp = cdp.clone();
                tokio::spawn(async move {
                    let _ = cdp
                        .call(
                            "Page.handleJavaScriptDialog",
                            json!({"accept": false}),
                            session.as_deref(),
                        )
                        .await;
                });
            }
            _ => {}
        }
    }
}

fn protocol_text(e: &CdpError) -> Option<String> {
    match e {
        CdpError::Protocol { message, .. } => Some(message.clone()),
        _ => None,
    }
}

/// Splits a browser failure from a page-level refusal.
fn soft<T>(r: Result<T, CdpError>) -> Result<Result<T, String>, CdpError> {
    match r {
        Ok(v) => Ok(Ok(v)),
        Err(e) => match protocol_text(&e) {
            Some(m) => Ok(Err(m)),
            None => Err(e),
        },
    }
}

/// A browser started for one task page and not yet showing it: what a warm pool holds.
pub struct Launched {
    browser: Browser,
    events: mpsc::UnboundedReceiver<Value>,
}

impl Launched {
    /// Starts a browser (its profile and `HOME` in `opts.dir`) and waits for its first answer.
    pub async fn launch(opts: &LaunchOptions) -> Result<Launched, CdpError> {
        let (tx, events) = mpsc::unbounded_channel();
        let browser = Browser::launch(opts, tx).await?;
        Ok(Launched { browser, events })
    }
}

impl TaskPage {
    /// Starts a browser and opens `html` in it at `PAGE_ORIGIN/<file_name>`.
    pub async fn open(
        opts: &LaunchOptions,
        file_name: &str,
        html: &str,
    ) -> Result<TaskPage, CdpError> {
        let launched = Launched::launch(opts).await?;
        Self::open_in(launched, (opts.width, opts.height), file_name, html).await
    }

    /// Opens `html` at `PAGE_ORIGIN/<file_name>` in a new tab of `launched`, with a viewport of
    /// `(width, height)` CSS pixels. On failure the browser is killed.
    pub async fn open_in(
        launched: Launched,
        (width, height): (u32, u32),
        file_name: &str,
        html: &str,
    ) -> Result<TaskPage, CdpError> {
        let Launched {
            mut browser,
            events: rx,
        } = launched;
        let cdp = browser.cdp().clone();
        let page_url = format!("{PAGE_ORIGIN}/{file_name}");
        let blocked = Arc::new(AtomicU64::new(0));
        let body = Arc::new(base64::engine::general_purpose::STANDARD.encode(html));
        let events = tokio::spawn(handle_events(
            cdp.clone(),
            rx,
            page_url.clone(),
            body,
            Arc::clone(&blocked),
        ));
        let opened = async {
            let session = cdp.open_tab().await?;
            let s = Some(session.as_str());
            cdp.call(
                "Fetch.enable",
                json!({"patterns": [{"urlPattern": "*", "requestStage": "Request"}]}),
                s,
            )
            .await?;
            cdp.call("Page.enable", json!({}), s).await?;
            cdp.call(
                "Emulation.setDeviceMetricsOverride",
                json!({"width": width, "height": height, "deviceScaleFactor": 1,
                       "mobile": false}),
                s,
            )
            .await?;
            let nav = cdp
                .call("Page.navigate", json!({"url": page_url}), s)
                .await?;
            if let Some(err) = nav.get("errorText").and_then(Value::as_str) {
                return Err(CdpError::Closed(format!("loading {page_url}: {err}")));
            }
            Ok(session)
        }
        .await;
        let session = match opened {
            Ok(s) => s,
            Err(e) => {
                events.abort();
                browser.kill().await;
                return Err(e);
            }
        };
        let page = TaskPage {
            browser,
            cdp,
            session,
            blocked,
            events,
        };
        page.settle().await?;
        Ok(page)
    }

    async fn call(&self, method: &str, params: Value) -> Result<Value, CdpError> {
        self.cdp.call(method, params, Some(&self.session)).await
    }

    /// How many requests other than the task page were refused so far.
    pub fn blocked_requests(&self) -> u64 {
        self.blocked.load(Ordering::Relaxed)
    }

    /// Evaluates `expression` in the page, awaiting a promise; `Ok(Err)` on an exception.
    pub async fn evaluate(&self, expression: &str) -> Result<Result<Value, String>, CdpError> {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        let r = match soft(r)? {
            Ok(r) => r,
            Err(m) => return Ok(Err(m)),
        };
        if let Some(ex) = r.get("exceptionDetails") {
            let text = ex["exception"]["description"]
                .as_str()
                .or_else(|| ex["text"].as_str())
                .unwrap_or("exception")
                .to_string();
            return Ok(Err(text));
        }
        Ok(Ok(r["result"]["value"].clone()))
    }

    /// Waits until the document is loaded and two animation frames have passed (so that a
    /// click's effects are rendered), retrying while a navigation replaces the document; gives
    /// up quietly after 5 s (a page that never settles is still observed).
    pub async fn settle(&self) -> Result<(), CdpError> {
        let until = Instant::now() + Duration::from_secs(5);
        let probe = "document.readyState === 'complete' ? new Promise(r => \
                     requestAnimationFrame(() => requestAnimationFrame(() => r(true)))) : false";
        while Instant::now() < until {
            if let Ok(Value::Bool(true)) = self.evaluate(probe).await? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Ok(())
    }

    /// The full accessibility tree's nodes.
    pub async fn ax_nodes(&self) -> Result<Vec<Value>, CdpError> {
        let r = self.call("Accessibility.getFullAXTree", json!({})).await?;
        match r.get("nodes") {
            Some(Value::Array(a)) => Ok(a.clone()),
            _ => Err(CdpError::Closed(
                "Accessibility.getFullAXTree returned no node list".into(),
            )),
        }
    }

    /// Title, URL and scroll position.
    pub async fn info(&self) -> Result<PageInfo, CdpError> {
        let v = self
            .evaluate(
                "[document.title, location.href, Math.round(scrollY), \
                 document.documentElement.scrollHeight, innerHeight]",
            )
            .await?
            .unwrap_or(Value::Null);
        Ok(PageInfo {
            title: v[0].as_str().unwrap_or("").to_string(),
            url: v[1].as_str().unwrap_or("").to_string(),
            scroll: (
                v[2].as_i64().unwrap_or(0),
                v[3].as_i64().unwrap_or(0),
                v[4].as_i64().unwrap_or(0),
            ),
        })
    }

    /// Writes a PNG of the viewport to `path`.
    pub async fn screenshot(&self, path: &Path) -> Result<(), CdpError> {
        let r = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await?;
        let data = r["data"].as_str().unwrap_or("");
        let png = base64::engine::general_purpose::STANDARD
            .decode(data)
            .map_err(|e| CdpError::Closed(format!("screenshot is not base64: {e}")))?;
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| CdpError::Closed(format!("creating {}: {e}", parent.display())))?;
        }
        tokio::fs::write(path, png)
            .await
            .map_err(|e| CdpError::Closed(format!("writing {}: {e}", path.display())))
    }

    /// Clicks the middle of the element's first box with the left mouse button.
    pub async fn click(&self, backend: i64) -> ActionResult {
        let _ = self
            .call(
                "DOM.scrollIntoViewIfNeeded",
                json!({"backendNodeId": backend}),
            )
            .await;
        let quads = match soft(
            self.call("DOM.getContentQuads", json!({"backendNodeId": backend}))
                .await,
        )? {
            Ok(q) => q,
            Err(m) => return Ok(Err(m)),
        };
        let Some(q) = quads["quads"][0].as_array().filter(|q| q.len() == 8) else {
            return Ok(Err("it has no box on the page (hidden?)".into()));
        };
        let n: Vec<f64> = q.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect();
        let x = (n[0] + n[2] + n[4] + n[6]) / 4.0;
        let y = (n[1] + n[3] + n[5] + n[7]) / 4.0;
        for (kind, buttons) in [("mouseMoved", 0), ("mousePressed", 1), ("mouseReleased", 0)] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({"type": kind, "x": x, "y": y, "button": "left", "buttons": buttons,
                       "clickCount": 1}),
            )
            .await?;
        }
        Ok(Ok(format!("clicked at ({x:.0}, {y:.0})")))
    }

    async fn focus(&self, backend: i64) -> Result<Result<(), String>, CdpError> {
        soft(
            self.call("DOM.focus", json!({"backendNodeId": backend}))
                .await
                .map(|_| ()),
        )
    }

    /// Focuses the element, selects its content and types `text` in its place.
    pub async fn type_text(&self, backend: i64, text: &str) -> ActionResult {
        if let Err(m) = self.focus(backend).await? {
            return Ok(Err(format!("it cannot take the focus: {m}")));
        }
        let object = match soft(
            self.call("DOM.resolveNode", json!({"backendNodeId": backend}))
                .await,
        )? {
            Ok(o) => o["object"]["objectId"].as_str().unwrap_or("").to_string(),
            Err(m) => return Ok(Err(m)),
        };
        let editable = self
            .call(
                "Runtime.callFunctionOn",
                json!({"objectId": object, "returnByValue": true, "functionDeclaration":
                    "function() { \
                       if (typeof this.select === 'function' && 'value' in this) { \
                         this.select(); return true; } \
                       if (this.isContentEditable) { const r = document.createRange(); \
                         r.selectNodeContents(this); const s = getSelection(); \
                         s.removeAllRanges(); s.addRange(r); return true; } \
                       return false; }"}),
            )
            .await;
        match soft(editable)? {
            Ok(v) if v["result"]["value"] == Value::Bool(true) => {}
            Ok(_) => return Ok(Err("it is not a text field".into())),
            Err(m) => return Ok(Err(m)),
        }
        if text.is_empty() {
            self.press("Backspace").await?;
        } else {
            self.call("Input.insertText", json!({"text": text})).await?;
        }
        Ok(Ok(format!("typed {} characters", text.chars().count())))
    }

    async fn press(&self, key: &str) -> Result<(), CdpError> {
        let (key, code, vk, text) = match named_key(key) {
            Some(k) => (k.0.to_string(), k.1.to_string(), k.2, k.3.to_string()),
            None => {
                let c = key.chars().next().unwrap_or(' ');
                let upper = c.to_ascii_uppercase();
                let code = if c.is_ascii_digit() {
                    format!("Digit{c}")
                } else {
                    format!("Key{upper}")
                };
                (c.to_string(), code, upper as i64, c.to_string())
            }
        };
        let mut down = json!({"type": "keyDown", "key": key, "code": code,
                              "windowsVirtualKeyCode": vk, "nativeVirtualKeyCode": vk});
        if !text.is_empty() {
            down["text"] = Value::String(text.clone());
            down["unmodifiedText"] = Value::String(text);
        }
        self.call("Input.dispatchKeyEvent", down).await?;
        self.call(
            "Input.dispatchKeyEvent",
            json!({"type": "keyUp", "key": key, "code": code, "windowsVirtualKeyCode": vk,
                   "nativeVirtualKeyCode": vk}),
        )
        .await?;
        Ok(())
    }

    /// Presses `key` (see [`known_key`]), first focusing the element when one is given.
    pub async fn key(&self, backend: Option<i64>, key: &str) -> ActionResult {
        if let Some(b) = backend {
            if let Err(m) = self.focus(b).await? {
                return Ok(Err(format!("it cannot take the focus: {m}")));
            }
        }
        self.press(key).await?;
        Ok(Ok(format!("pressed {key}")))
    }

    /// Scrolls the element into view.
    pub async fn scroll_to(&self, backend: i64) -> ActionResult {
        Ok(soft(
            self.call(
                "DOM.scrollIntoViewIfNeeded",
                json!({"backendNodeId": backend}),
            )
            .await,
        )?
        .map(|_| "scrolled it into view".to_string()))
    }

    /// Turns the mouse wheel by `dy` CSS pixels in the middle of the viewport.
    pub async fn wheel(&self, dy: i64, width: u32, height: u32) -> ActionResult {
        let before = self.info().await?.scroll.0;
        self.call(
            "Input.dispatchMouseEvent",
            json!({"type": "mouseWheel", "x": width / 2, "y": height / 2, "deltaX": 0,
                   "deltaY": dy}),
        )
        .await?;
        // Wheel scrolling is asynchronous: wait (briefly) for the offset to move.
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until && self.info().await?.scroll.0 == before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Ok(format!("scrolled by {dy} px")))
    }

    /// Kills the browser; returns how many of its processes had to be swept after the group
    /// kill.
    pub async fn close(mut self) -> usize {
        self.events.abort();
        self.browser.kill().await
    }
}
