//! The personal-agent gateway (docs/design.md §4): an OpenAI-compatible HTTP endpoint that
//! serves the policy and records every main-line turn, with its exact token ids, log-probs and
//! next state, for training.
//!
//! Layout: [`server`] (axum routes, auth, limits, OpenAI wire format, SSE streaming),
//! [`policy`] (the served weight versions over the generation engine, token-by-token streaming,
//! hot swap without pausing), [`text`] (ids → served text, tool-call splitting; pure),
//! [`session`] (the clock-free session table), [`infer`] (which served turn a request without a
//! session id extends; pure), [`sink`] (the JSONL turn writer), [`metrics`] (Prometheus text)
//! and [`GatewayConfig`] here.

pub mod auth;
pub mod infer;
pub mod listen;
pub mod logprobs;
pub mod metrics;
pub mod policy;
pub mod reasoning;
pub mod server;
pub mod session;
pub mod sink;
pub mod text;

use crate::model::engine::DEFAULT_PREFIX_CACHE_BYTES;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use policy::{GatewayPolicy, InstallError, PolicyStats};
pub use server::{Gateway, GatewayCounter, GatewayCounts, GatewayError};
pub use session::{
    Admission, EndPolicy, Scope, SessionConfig, SessionStats, SessionTable, SessionsFull, TurnEnd,
    TurnType,
};
pub use sink::{TurnRecord, TurnSink};

/// Gateway settings (`clawrl serve --config FILE`, TOML; every key optional).
///
/// ```toml
/// listen = "127.0.0.1:8000"
/// model_name = "my-agent"          # default: the checkpoint directory's name
/// api_keys = ["sk-local-1"]        # bearer keys; none configured = open
/// api_keys_env = "CLAWRL_API_KEYS" # also read comma-separated keys from this variable
/// metrics_public = false           # true: GET /metrics needs no key (it does when keys are set)
/// max_body_bytes = 4194304         # larger request bodies get 413
/// max_header_bytes = 65536         # larger request heads get 431
/// header_read_timeout_secs = 10.0  # a request head must arrive whole within this (also ends
///                                  # connections idle that long between requests)
/// body_read_timeout_secs = 30.0    # a request body must arrive whole within this (else 408)
/// max_connections = 4096           # open connections (more wait in the listen backlog)
/// max_in_flight_per_key = 64       # requests being answered per API key (one more: 429)
/// default_turn_type = "main"       # for requests naming neither a session nor a turn type
/// idle_timeout_secs = 300.0        # a session idle this long ends
/// on_session_end = "keep"          # last turn: "keep" (no next state) or "drop"
/// max_sessions_per_key = 1024      # open sessions per API key (one more: 429)
/// data_dir = "data/gateway"        # turns-v<version>.jsonl go here
/// record_queue = 1024              # records waiting for the writer
/// max_batch = 16                   # sequences decoded together
/// max_context = 4096               # prompt + response positions per sequence
///                                  # (default: the model's max_position_embeddings)
/// prefix_cache_mib = 1024          # prompt keys/values kept for reuse (0: off)
/// default_max_tokens = 256         # when a request gives none
/// max_tokens_limit = 4096          # the most a request may ask for
/// version = 0                      # weight version the loaded checkpoint is served as
///
/// [adapters]                       # more model ids: PEFT LoRA adapter directories over the
/// alice = "adapters/alice"         # checkpoint, each served as its own model id; requests
/// bob = "adapters/bob"             # for any of them share decode batches over the one base
///
/// [[scoped_keys]]                  # a key that sees only these model ids (others: 404)
/// key = "sk-alice"
/// models = ["alice"]
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// The model id clients must name; `None` = the checkpoint directory's name.
    pub model_name: Option<String>,
    /// Accepted bearer API keys.
    pub api_keys: Vec<String>,
    /// Environment variable with more comma-separated keys (empty string = none).
    pub api_keys_env: String,
    /// `GET /metrics` without an API key. When keys are configured it needs one by default:
    /// the counters tell how the gateway is used.
    pub metrics_public: bool,
    /// Request body limit in bytes.
    pub max_body_bytes: usize,
    /// Request head (request line and headers) limit in bytes; more gets 431.
    pub max_header_bytes: usize,
    /// Seconds a request head may take to arrive whole, counted from when the server waits for
    /// it (a new connection, or the end of the previous response).
    pub header_read_timeout_secs: f64,
    /// Seconds a request body may take to arrive whole.
    pub body_read_timeout_secs: f64,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Most requests being answered at once per API key (with no key configured, all clients
    /// together); one more gets 429 with `Retry-After`.
    pub max_in_flight_per_key: usize,
    /// Turn type of requests that name neither a session nor a turn type.
    pub default_turn_type: TurnType,
    /// Seconds without a request after which a session ends.
    pub idle_timeout_secs: f64,
    /// What happens to a session's last turn when it ends.
    pub on_session_end: EndPolicy,
    /// Most sessions one API key may have open (with no key configured, all clients together).
    /// A main request that would open one more is refused with 429 and `Retry-After`; so the
    /// session table holds at most this many sessions per configured key.
    pub max_sessions_per_key: usize,
    /// Directory of the recorded turns.
    pub data_dir: PathBuf,
    /// Capacity of the record queue.
    pub record_queue: usize,
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// Most positions (prompt + response) per sequence; absent: the model's
    /// `max_position_embeddings`. More than that is refused when the gateway starts.
    pub max_context: Option<usize>,
    /// MiB of prompt keys and values the engine keeps for later prompts with the same prefix
    /// (an agent's long system prompt and tools, a session's history); 0 turns it off.
    pub prefix_cache_mib: usize,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// The largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    /// The weight version the loaded checkpoint is served as (later ones come through
    /// [`GatewayPolicy::install`]); every turn records the version that generated it.
    pub version: u64,
    /// Set by a job that trains a LoRA adapter, never read from a file: installed versions are
    /// adapters of this shape over the served checkpoint, not whole weights.
    #[serde(skip)]
    pub adapter_versions: Option<crate::model::LoraConfig>,
    /// More model ids: name → PEFT adapter directory, each adapter attached to the served
    /// checkpoint's own weights (without any adapter the checkpoint model carries) and served
    /// under its name (as vLLM's `--lora-modules name=path`).
    pub adapters: std::collections::BTreeMap<String, PathBuf>,
    /// Keys that may use only the model ids they list; to them every other id does not exist.
    pub scoped_keys: Vec<ScopedKey>,
}

/// An API key limited to some model ids (`[[scoped_keys]]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopedKey {
    /// The bearer key.
    pub key: String,
    /// The model ids it may use (the checkpoint's name or an `adapters` name).
    pub models: Vec<String>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            model_name: None,
            api_keys: Vec::new(),
            api_keys_env: "CLAWRL_API_KEYS".into(),
            metrics_public: false,
            max_body_bytes: 4 << 20,
            max_header_bytes: 64 << 10,
            header_read_timeout_secs: 10.0,
            body_read_timeout_secs: 30.0,
            max_connections: 4096,
            max_in_flight_per_key: 64,
            default_turn_type: TurnType::Main,
            idle_timeout_secs: 300.0,
            on_session_end: EndPolicy::Keep,
            max_sessions_per_key: 1024,
            data_dir: PathBuf::from("data/gateway"),
            record_queue: 1024,
            max_batch: 16,
            max_context: None,
            prefix_cache_mib: DEFAULT_PREFIX_CACHE_BYTES >> 20,
            default_max_tokens: 256,
            max_tokens_limit: 4096,
            version: 0,
            adapter_versions: None,
            adapters: Default::default(),
            scoped_keys: Vec::new(),
        }
    }
}

/// A bad gateway config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read gateway config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file does not parse (the message names the key).
    #[error("gateway config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value is out of range.
    #[error("gateway config: {key} {reason}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl GatewayConfig {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        let cfg: Self = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, reason: &str| {
            Err(ConfigError::Invalid {
                key,
                reason: reason.to_string(),
            })
        };
        if !(self.idle_timeout_secs.is_finite() && self.idle_timeout_secs > 0.0) {
            return bad("idle_timeout_secs", "must be a positive number of seconds");
        }
        if self.max_body_bytes == 0 {
            return bad("max_body_bytes", "must be at least 1");
        }
        for (key, secs) in [
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("body_read_timeout_secs", self.body_read_timeout_secs),
        ] {
            if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0) {
                return bad(key, "must be a positive number of seconds, at most a day");
            }
        }
        for (key, n) in [
            ("max_header_bytes", self.max_header_bytes),
            ("max_connections", self.max_connections),
            ("max_in_flight_per_key", self.max_in_flight_per_key),
        ] {
            if n == 0 {
                return bad(key, "must be at least 1");
            }
        }
        if self.max_sessions_per_key == 0 {
            return bad("max_sessions_per_key", "must be at least 1");
        }
        if self.record_queue == 0 {
            return bad("record_queue", "must be at least 1");
        }
        if self.max_batch == 0 {
            return bad("max_batch", "must be at least 1");
        }
        if self.max_context.is_some_and(|c| c < 2) {
            return bad("max_context", "must be at least 2");
        }
        if self.default_max_tokens == 0 || self.default_max_tokens > self.max_tokens_limit {
            return bad(
                "default_max_tokens",
                "must be at least 1 and at most max_tokens_limit",
            );
        }
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return bad("api_keys", "must not contain empty keys");
        }
        if matches!(&self.model_name, Some(n) if n.trim().is_empty()) {
            return bad("model_name", "must not be empty");
        }
        for name in self.adapters.keys() {
            if !valid_model_id(name) {
                return Err(ConfigError::Invalid {
                    key: "adapters",
                    reason: format!(
                        "{name:?} is not a model id: 1 to 128 characters, none of them \
                         whitespace, a control character, `/` first or `?#%`"
                    ),
                });
            }
            if self.model_name.as_deref() == Some(name) {
                return Err(ConfigError::Invalid {
                    key: "adapters",
                    reason: format!("{name:?} is also the checkpoint's model_name"),
                });
            }
        }
        for (i, k) in self.scoped_keys.iter().enumerate() {
            if k.key.trim().is_empty() {
                return Err(ConfigError::Invalid {
                    key: "scoped_keys",
                    reason: format!("entry {i}: the key must not be empty"),
                });
            }
            if k.models.is_empty() {
                return Err(ConfigError::Invalid {
                    key: "scoped_keys",
                    reason: format!("entry {i}: `models` must name at least one model id"),
                });
            }
            if self.api_keys.contains(&k.key) {
                return Err(ConfigError::Invalid {
                    key: "scoped_keys",
                    reason: format!("entry {i}: the key is also in api_keys, unscoped"),
                });
            }
        }
        Ok(())
    }

    /// The accepted keys: [`resolved_api_keys`](Self::resolved_api_keys), for every model id,
    /// then `scoped_keys`, each for the ids it lists.
    pub fn accepted_keys(&self) -> auth::ApiKeys {
        let mut keys: Vec<(String, Option<Vec<String>>)> = self
            .resolved_api_keys()
            .into_iter()
            .map(|k| (k, None))
            .collect();
        keys.extend(
            self.scoped_keys
                .iter()
                .map(|k| (k.key.clone(), Some(k.models.clone()))),
        );
        auth::ApiKeys::scoped(&keys)
    }

    /// The session rules of this config.
    pub fn session_config(&self) -> SessionConfig {
        SessionConfig {
            default_turn_type: self.default_turn_type,
            idle_timeout: Duration::from_secs_f64(self.idle_timeout_secs),
            on_end: self.on_session_end,
            max_sessions_per_key: self.max_sessions_per_key,
        }
    }

    /// Configured keys plus those of `api_keys_env` (read now).
    pub fn resolved_api_keys(&self) -> Vec<String> {
        let mut keys = self.api_keys.clone();
        if !self.api_keys_env.is_empty() {
            if let Ok(v) = std::env::var(&self.api_keys_env) {
                keys.extend(
                    v.split(',')
                        .map(|k| k.trim().to_string())
                        .filter(|k| !k.is_empty()),
                );
            }
        }
        keys
    }
}

/// Whether `name` can be a model id in a URL path (`/v1/models/{id}`) and a JSON field as
/// given: 1 to 128 characters, no whitespace or control character, no `/` first, none of `?#%`.
fn valid_model_id(name: &str) -> bool {
    (1..=128).contains(&name.chars().count())
        && !name.starts_with('/')
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || "?#%".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_keys_are_checked() {
        let c: GatewayConfig =
            toml::from_str("on_session_end = \"drop\"\ndefault_turn_type = \"side\"").unwrap();
        assert_eq!(c.on_session_end, EndPolicy::Drop);
        assert_eq!(c.default_turn_type, TurnType::Side);
        let e = toml::from_str::<GatewayConfig>("idle_timeout = 3").unwrap_err();
        assert!(e.to_string().contains("idle_timeout"), "{e}");
        let c = GatewayConfig {
            idle_timeout_secs: 0.0,
            ..Default::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("idle_timeout_secs"));
        let c: GatewayConfig =
            toml::from_str("metrics_public = true\nmax_sessions_per_key = 8").unwrap();
        assert!(c.metrics_public);
        assert_eq!(c.session_config().max_sessions_per_key, 8);
        let c = GatewayConfig {
            max_sessions_per_key: 0,
            ..Default::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_sessions_per_key"));
    }

    #[test]
    fn adapters_and_scoped_keys_are_checked() {
        let parse = |t: &str| toml::from_str::<GatewayConfig>(t).unwrap();
        let ok = parse(
            "api_keys = [\"all\"]\n[adapters]\nalice = \"a\"\n\
             [[scoped_keys]]\nkey = \"k\"\nmodels = [\"alice\"]\n",
        );
        ok.validate().unwrap();
        let keys = ok.accepted_keys();
        let (all, scoped) = (Scope::key(0), Scope::key(1));
        assert!(keys.allows(all, "alice") && keys.allows(all, "base"));
        assert!(keys.allows(scoped, "alice") && !keys.allows(scoped, "base"));
        let refused = |t: &str| parse(t).validate().unwrap_err().to_string();
        for bad in ["\"\"", "\"a b\"", "\"/x\"", "\"a?b\""] {
            assert!(refused(&format!("[adapters]\n{bad} = \"d\"\n")).contains("adapters"));
        }
        assert!(refused("model_name = \"m\"\n[adapters]\nm = \"d\"\n").contains("model_name"));
        assert!(refused("[[scoped_keys]]\nkey = \"k\"\nmodels = []\n").contains("models"));
        assert!(refused("[[scoped_keys]]\nkey = \" \"\nmodels = [\"m\"]\n").contains("empty"));
        assert!(
            refused("api_keys = [\"k\"]\n[[scoped_keys]]\nkey = \"k\"\nmodels = [\"m\"]\n")
                .contains("unscoped")
        );
        let e = toml::from_str::<GatewayConfig>("[[scoped_keys]]\nkey = \"k\"\nmodel = [\"m\"]\n")
            .unwrap_err();
        assert!(e.to_string().contains("model"), "{e}");
    }
}
