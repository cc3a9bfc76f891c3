//! The `openai` backend: any OpenAI-compatible chat-completions endpoint.
//!
//! One `POST {url}/chat/completions` per vote (the path is appended unless `url` already ends
//! with it), with the API key read once from a named environment variable, a connect timeout and
//! a whole-request timeout, retries with exponential backoff on connection errors, timeouts,
//! HTTP 429 and 5xx (never on other 4xx or on an unreadable 2xx body), and a semaphore bounding
//! the requests in flight. TLS is rustls with the `ring` provider chosen explicitly, so the
//! client builds whatever other rustls providers the binary links.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::Semaphore;

use super::backend::{BackendError, JudgeBackend, JudgeRequest};

/// The `[judge.backend]` table of an `openai` judge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiConfig {
    /// Base URL (`https://host/v1`) or the full chat-completions URL.
    pub url: String,
    /// The model name sent in each request.
    pub model: String,
    /// Name of the environment variable holding the API key; none sends no `Authorization`.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Connect timeout in milliseconds.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Whole-request timeout in milliseconds (per attempt).
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Retries after the first attempt.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// First backoff in milliseconds; doubles on each retry.
    #[serde(default = "default_backoff_initial_ms")]
    pub backoff_initial_ms: u64,
    /// Cap of the backoff in milliseconds.
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: u64,
    /// Most requests in flight at once.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: usize,
}

fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_request_timeout_ms() -> u64 {
    60_000
}
fn default_max_retries() -> u32 {
    2
}
fn default_backoff_initial_ms() -> u64 {
    250
}
fn default_backoff_max_ms() -> u64 {
    8_000
}
fn default_max_concurrency() -> usize {
    32
}

impl OpenAiConfig {
    /// A config with the defaults for everything but the URL and model.
    pub fn new(url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            model: model.into(),
            api_key_env: None,
            connect_timeout_ms: default_connect_timeout_ms(),
            request_timeout_ms: default_request_timeout_ms(),
            max_retries: default_max_retries(),
            backoff_initial_ms: default_backoff_initial_ms(),
            backoff_max_ms: default_backoff_max_ms(),
            max_concurrency: default_max_concurrency(),
        }
    }
}

/// Errors building an `openai` backend.
#[derive(Debug, Error)]
pub enum OpenAiConfigError {
    /// The URL does not parse or is not http(s).
    #[error("judge.backend.url `{url}` is not an http(s) URL: {reason}")]
    BadUrl {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The named API-key variable is unset or not UTF-8.
    #[error("judge.backend.api_key_env: environment variable `{0}` is not set")]
    MissingKey(String),
    /// A numeric setting out of range.
    #[error("judge.backend.{0} must be > 0")]
    Zero(&'static str),
    /// The HTTP client could not be built.
    #[error("cannot build the judge HTTP client: {0}")]
    Client(String),
}

/// The `openai` backend (see the module doc).
pub struct OpenAiBackend {
    client: reqwest::Client,
    endpoint: reqwest::Url,
    config: OpenAiConfig,
    api_key: Option<String>,
    permits: Arc<Semaphore>,
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: &'a [super::backend::ChatMessage],
    temperature: f32,
    top_p: f32,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    n: u32,
    stream: bool,
}

#[derive(Deserialize)]
struct ChatResponse {
    choices: Vec<Choice>,
}

#[derive(Deserialize)]
struct Choice {
    message: ChoiceMessage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ChoiceMessage {
    content: Option<String>,
}

enum Attempt {
    Done(Result<String, BackendError>),
    Retry(BackendError),
}

impl OpenAiBackend {
    /// Validates the config, reads the API key from its variable and builds the client.
    pub fn new(config: OpenAiConfig) -> Result<Self, OpenAiConfigError> {
        let bad = |reason: String| OpenAiConfigError::BadUrl {
            url: config.url.clone(),
            reason,
        };
        let endpoint = chat_completions_url(&config.url).map_err(bad)?;
        if !matches!(endpoint.scheme(), "http" | "https") {
            return Err(bad(format!("scheme `{}`", endpoint.scheme())));
        }
        for (name, v) in [
            ("connect_timeout_ms", config.connect_timeout_ms),
            ("request_timeout_ms", config.request_timeout_ms),
            ("max_concurrency", config.max_concurrency as u64),
        ] {
            if v == 0 {
                return Err(OpenAiConfigError::Zero(name));
            }
        }
        let api_key = match &config.api_key_env {
            None => None,
            Some(var) => Some(
                std::env::var(var)
                    .ok()
                    .filter(|k| !k.is_empty())
                    .ok_or_else(|| OpenAiConfigError::MissingKey(var.clone()))?,
            ),
        };
        let client = build_client(&config)?;
        Ok(Self {
            client,
            endpoint,
            permits: Arc::new(Semaphore::new(config.max_concurrency)),
            config,
            api_key,
            in_flight: AtomicUsize::new(0),
            peak_in_flight: AtomicUsize::new(0),
        })
    }

    /// The endpoint requests go to.
    pub fn endpoint(&self) -> &reqwest::Url {
        &self.endpoint
    }

    /// The most requests that were in flight at once so far.
    pub fn peak_in_flight(&self) -> usize {
        self.peak_in_flight.load(Ordering::Relaxed)
    }

    fn backoff(&self, retry: u32) -> Duration {
        let ms = self
            .config
            .backoff_initial_ms
            .saturating_mul(1u64.checked_shl(retry).unwrap_or(u64::MAX))
            .min(self.config.backoff_max_ms);
        Duration::from_millis(ms)
    }

    async fn attempt(&self, request: &JudgeRequest) -> Attempt {
        let _permit = self
            .permits
            .acquire()
            .await
            .expect("semaphore never closed");
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_in_flight.fetch_max(now, Ordering::Relaxed);
        let out = self.send(request).await;
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        out
    }

    async fn send(&self, request: &JudgeRequest) -> Attempt {
        let body = ChatRequest {
            model: &self.config.model,
            messages: &request.messages,
            temperature: request.params.temperature,
            top_p: request.params.top_p,
            max_tokens: request.params.max_tokens,
            seed: request.params.seed,
            n: 1,
            stream: false,
        };
        let mut http = self.client.post(self.endpoint.clone()).json(&body);
        if let Some(key) = &self.api_key {
            http = http.bearer_auth(key);
        }
        let response = match http.send().await {
            Ok(r) => r,
            Err(e) => return Attempt::Retry(self.transport_error(e)),
        };
        let status = response.status();
        let bytes = match response.bytes().await {
            Ok(b) => b,
            Err(e) => return Attempt::Retry(self.transport_error(e)),
        };
        if !status.is_success() {
            let body: String = String::from_utf8_lossy(&bytes).chars().take(300).collect();
            let err = BackendError::Http {
                status: status.as_u16(),
                body,
            };
            return if status.as_u16() == 429 || status.is_server_error() {
                Attempt::Retry(err)
            } else {
                Attempt::Done(Err(err))
            };
        }
        let parsed: ChatResponse = match serde_json::from_slice(&bytes) {
            Ok(p) => p,
            Err(e) => {
                return Attempt::Done(Err(BackendError::BadResponse(format!(
                    "not a chat completion: {e}"
                ))))
            }
        };
        Attempt::Done(match parsed.choices.into_iter().next() {
            None => Err(BackendError::BadResponse("no choices".into())),
            Some(Choice {
                message: ChoiceMessage { content: None },
                ..
            }) => Err(BackendError::BadResponse(
                "choices[0].message.content is null".into(),
            )),
            Some(Choice {
                message: ChoiceMessage {
                    content: Some(text),
                },
                finish_reason,
            }) if finish_reason.as_deref() == Some("length") => Err(BackendError::Truncated {
                max_tokens: request.params.max_tokens,
                text,
            }),
            Some(Choice {
                message: ChoiceMessage {
                    content: Some(text),
                },
                ..
            }) => Ok(text),
        })
    }

    fn transport_error(&self, e: reqwest::Error) -> BackendError {
        if e.is_timeout() {
            BackendError::Timeout(self.config.request_timeout_ms)
        } else {
            // Walk the source chain: reqwest's own message ("error sending request") hides the
            // cause (connection refused, TLS).
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                src = s.source();
            }
            BackendError::Unreachable(msg)
        }
    }
}

/// The URL an `openai` judge configured with `url` sends its requests to: `url` with
/// `/chat/completions` appended unless it already ends with it (a trailing `/` dropped first).
/// The node's judge access rule ([`super::access`]) checks this URL, the one requests go to.
pub fn chat_completions_url(url: &str) -> Result<reqwest::Url, String> {
    let mut full = url.trim_end_matches('/').to_string();
    if !full.ends_with("/chat/completions") {
        full.push_str("/chat/completions");
    }
    reqwest::Url::parse(&full).map_err(|e| e.to_string())
}

fn build_client(config: &OpenAiConfig) -> Result<reqwest::Client, OpenAiConfigError> {
    let client_err = |e: &dyn std::fmt::Display| OpenAiConfigError::Client(e.to_string());
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| client_err(&e))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
        .timeout(Duration::from_millis(config.request_timeout_ms))
        // Requests go to the configured endpoint only (which a node may have checked against
        // its allowed endpoints); a redirect is an error, not a request somewhere else.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| client_err(&e))
}

impl JudgeBackend for OpenAiBackend {
    fn name(&self) -> &str {
        "openai"
    }

    fn complete<'a>(
        &'a self,
        request: &'a JudgeRequest,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        Box::pin(async move {
            let mut retry = 0;
            loop {
                match self.attempt(request).await {
                    Attempt::Done(out) => return out,
                    Attempt::Retry(err) if retry >= self.config.max_retries => return Err(err),
                    Attempt::Retry(err) => {
                        tracing::debug!(retry, error = %err, "judge request failed, retrying");
                        tokio::time::sleep(self.backoff(retry)).await;
                        retry += 1;
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_client_builds_without_a_default_crypto_provider() {
        let b =
            OpenAiBackend::new(OpenAiConfig::new("https://api.example.com/v1/", "judge")).unwrap();
        assert_eq!(
            b.endpoint().as_str(),
            "https://api.example.com/v1/chat/completions"
        );
        let b = OpenAiBackend::new(OpenAiConfig::new(
            "http://127.0.0.1:9/v1/chat/completions",
            "j",
        ))
        .unwrap();
        assert_eq!(
            b.endpoint().as_str(),
            "http://127.0.0.1:9/v1/chat/completions"
        );
    }

    #[test]
    fn bad_configs_are_refused() {
        assert!(matches!(
            OpenAiBackend::new(OpenAiConfig::new("ftp://x/v1", "m")),
            Err(OpenAiConfigError::BadUrl { .. })
        ));
        assert!(matches!(
            OpenAiBackend::new(OpenAiConfig::new("not a url", "m")),
            Err(OpenAiConfigError::BadUrl { .. })
        ));
        let mut c = OpenAiConfig::new("http://x/v1", "m");
        c.api_key_env = Some("CLAWRL_TEST_SURELY_UNSET_KEY_VAR".into());
        let e = OpenAiBackend::new(c).err().unwrap();
        assert!(
            e.to_string().contains("CLAWRL_TEST_SURELY_UNSET_KEY_VAR"),
            "{e}"
        );
        let mut c = OpenAiConfig::new("http://x/v1", "m");
        c.max_concurrency = 0;
        assert!(matches!(
            OpenAiBackend::new(c),
            Err(OpenAiConfigError::Zero("max_concurrency"))
        ));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut c = OpenAiConfig::new("http://x/v1", "m");
        c.backoff_initial_ms = 100;
        c.backoff_max_ms = 350;
        let b = OpenAiBackend::new(c).unwrap();
        let ms: Vec<u128> = (0..4).map(|r| b.backoff(r).as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 350, 350]);
        assert_eq!(b.backoff(200).as_millis(), 350);
    }
}
