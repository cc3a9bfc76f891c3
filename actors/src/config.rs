//! The node configuration file (`cluster.toml`): its schema, parsing and validation.
//!
//! A file has a `[node]` section (name, UDP listen address, seeds, roles, data directory), an
//! optional `[tls]` section (cluster CA, this node's certificate and key) and an optional
//! `[judge]` section (which judge endpoints and API-key variables the jobs run here may use).
//! Unknown keys, wrong types and missing fields are errors that name the key and the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A role a node plays in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Hosts the cluster's one `Control` actor.
    Control,
    /// May host trainers.
    Trainer,
    /// May host rollout (policy serving) workers.
    Rollout,
    /// Hosts judge workers: the node judges the turns of jobs whose home (trainer node) lacks
    /// this role, under its own `[judge]` grants; a home with it judges its own.
    Judge,
    /// May host environments (`--env KIND:N` slots).
    Env,
}

impl Role {
    /// The role's name as written in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Control => "control",
            Role::Trainer => "trainer",
            Role::Rollout => "rollout",
            Role::Judge => "judge",
            Role::Env => "env",
        }
    }
}

/// The `[node]` section as written in the file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: String,
    listen: String,
    #[serde(default)]
    seeds: Vec<String>,
    roles: Vec<Role>,
    data_dir: PathBuf,
}

/// The `[tls]` section as written in the file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    #[serde(default)]
    deny: Vec<String>,
}

/// The `[judge]` section as written in the file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJudge {
    allowed_endpoints: Option<Vec<String>>,
    #[serde(default)]
    allowed_key_envs: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    node: RawNode,
    tls: Option<RawTls>,
    judge: Option<RawJudge>,
}

/// The `allowed_endpoints` entry that stands for every loopback URL.
pub const LOOPBACK: &str = "loopback";

/// What a job's judge may reach from this node (`[judge]`): a job spec's `judge.endpoint` and
/// `judge.api_key_env` are its requests, and the node grants them. Whatever a job's spec says,
/// its judge sends requests only to an allowed endpoint and reads only an allowed variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JudgeAccess {
    /// Endpoints a job's judge may call: [`LOOPBACK`] (any `http`/`https` URL whose host is
    /// `localhost`, `127.0.0.0/8` or `::1`, any port), or an `http`/`https` URL that the
    /// endpoint must equal or extend by path (same scheme, host and port). Default:
    /// `["loopback"]`; `[]` allows none.
    pub allowed_endpoints: Vec<String>,
    /// Environment variables a job's judge may read its API key from (sent as a Bearer token
    /// to the job's endpoint). Default: none.
    pub allowed_key_envs: Vec<String>,
}

impl Default for JudgeAccess {
    fn default() -> Self {
        Self {
            allowed_endpoints: vec![LOOPBACK.to_string()],
            allowed_key_envs: Vec::new(),
        }
    }
}

impl JudgeAccess {
    /// Checks the entries' shapes: an endpoint is [`LOOPBACK`] or starts `http://` / `https://`
    /// (without spaces); a key variable is letters, digits and `_`, not starting with a digit.
    /// Errors name the key (`judge.allowed_endpoints[i]`) and the value.
    fn validate(&self) -> Result<(), (String, String)> {
        for (i, e) in self.allowed_endpoints.iter().enumerate() {
            let url = e.starts_with("http://") || e.starts_with("https://");
            let ok = e == LOOPBACK || (url && !e.contains(char::is_whitespace));
            if !ok {
                return Err((
                    format!("judge.allowed_endpoints[{i}]"),
                    format!("`{e}` is neither \"{LOOPBACK}\" nor an http:// or https:// URL"),
                ));
            }
        }
        for (i, k) in self.allowed_key_envs.iter().enumerate() {
            let ok = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                return Err((
                    format!("judge.allowed_key_envs[{i}]"),
                    format!("`{k}` is not an environment variable name"),
                ));
            }
        }
        Ok(())
    }
}

/// Certificate files of a cluster member (paths resolved relative to the config file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The cluster CA certificate (PEM).
    pub ca: PathBuf,
    /// This node's certificate (PEM), signed by the CA.
    pub cert: PathBuf,
    /// This node's private key (PEM).
    pub key: PathBuf,
    /// The CLI's client certificate (default: `client.pem` beside the CA).
    pub client_cert: PathBuf,
    /// The CLI's client key (default: `client.key` beside the CA).
    pub client_key: PathBuf,
    /// Revoked node names (`deny`): certificates naming them are refused, and a running node
    /// re-reads the list on SIGHUP and closes their connections.
    pub deny: Vec<String>,
}

/// A validated node configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConfig {
    /// The file it was read from (for messages).
    pub file: PathBuf,
    /// Unique node name within the cluster.
    pub name: String,
    /// UDP address the QUIC endpoint binds.
    pub listen: SocketAddr,
    /// Addresses of nodes to dial at start (and redial after a loss).
    pub seeds: Vec<SocketAddr>,
    /// Roles of this node (deduplicated, sorted).
    pub roles: Vec<Role>,
    /// Directory for node state (ephemeral CA, records); relative to the config file.
    pub data_dir: PathBuf,
    /// Certificates; `None` means an ephemeral CA under `data_dir`.
    pub tls: Option<TlsFiles>,
    /// What jobs' judges may reach from this node (`[judge]`; default: loopback, no key).
    pub judge: JudgeAccess,
}

/// Why a config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {file}: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not match the schema.
    #[error("config {file}: key `{key}`: {message}")]
    Schema {
        /// The file.
        file: PathBuf,
        /// The dotted key path where the problem is (`.` for the top level).
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// Checks that a node name is usable in certificates, actor names and file names.
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn parse_addr(file: &Path, key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    use std::net::ToSocketAddrs;
    let schema = |message: String| ConfigError::Schema {
        file: file.to_path_buf(),
        key: key.to_string(),
        message,
    };
    if let Ok(a) = value.parse::<SocketAddr>() {
        return Ok(a);
    }
    let mut addrs = value
        .to_socket_addrs()
        .map_err(|e| schema(format!("`{value}` is not a host:port address: {e}")))?;
    addrs
        .next()
        .ok_or_else(|| schema(format!("`{value}` resolves to no address")))
}

impl NodeConfig {
    /// Reads and validates a config file.
    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
            file: file.to_path_buf(),
            source,
        })?;
        Self::parse(&text, file)
    }

    /// Parses and validates config text; `file` is used for messages and relative paths.
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let de = toml::Deserializer::new(text);
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let message = e.inner().message().to_string();
            ConfigError::Schema {
                file: file.to_path_buf(),
                key,
                message,
            }
        })?;
        let schema = |key: &str, message: String| ConfigError::Schema {
            file: file.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let base = file
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let resolve = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            }
        };
        let n = raw.node;
        if !valid_node_name(&n.name) {
            return Err(schema(
                "node.name",
                format!(
                    "`{}` must be 1-63 characters of ASCII letters, digits, '-' or '_'",
                    n.name
                ),
            ));
        }
        if crate::pki::is_reserved_name(&n.name) {
            return Err(schema(
                "node.name",
                format!(
                    "`{}` is reserved (names of the CA's and the CLI's certificates: {})",
                    n.name,
                    crate::pki::RESERVED_NAMES.join(", ")
                ),
            ));
        }
        let listen = parse_addr(file, "node.listen", &n.listen)?;
        let seeds = n
            .seeds
            .iter()
            .enumerate()
            .map(|(i, s)| parse_addr(file, &format!("node.seeds[{i}]"), s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut roles = n.roles;
        roles.sort();
        roles.dedup();
        if let Some(t) = &raw.tls {
            for (i, d) in t.deny.iter().enumerate() {
                if !valid_node_name(d) {
                    return Err(schema(
                        &format!("tls.deny[{i}]"),
                        format!("`{d}` is not a node name"),
                    ));
                }
            }
        }
        let tls = raw.tls.map(|t| {
            let ca = resolve(&t.ca);
            let dir = ca.parent().map(Path::to_path_buf).unwrap_or_default();
            TlsFiles {
                client_cert: t
                    .client_cert
                    .map(|p| resolve(&p))
                    .unwrap_or_else(|| dir.join("client.pem")),
                client_key: t
                    .client_key
                    .map(|p| resolve(&p))
                    .unwrap_or_else(|| dir.join("client.key")),
                ca,
                cert: resolve(&t.cert),
                key: resolve(&t.key),
                deny: t.deny,
            }
        });
        let judge = match raw.judge {
            None => JudgeAccess::default(),
            Some(j) => JudgeAccess {
                allowed_endpoints: j
                    .allowed_endpoints
                    .unwrap_or_else(|| JudgeAccess::default().allowed_endpoints),
                allowed_key_envs: j.allowed_key_envs,
            },
        };
        judge.validate().map_err(|(key, m)| schema(&key, m))?;
        Ok(NodeConfig {
            file: file.to_path_buf(),
            name: n.name,
            listen,
            seeds,
            roles,
            data_dir: resolve(&n.data_dir),
            tls,
            judge,
        })
    }

    /// Whether this node has `role`.
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[node]
name = "a"
listen = "127.0.0.1:7400"
seeds = ["127.0.0.1:7401"]
roles = ["control", "env", "control"]
data_dir = "data/a"

[tls]
ca = "certs/ca.pem"
cert = "certs/a.pem"
key = "certs/a.key"
"#;

    #[test]
    fn parses_a_full_config_and_resolves_paths() {
        let c = NodeConfig::parse(GOOD, Path::new("/etc/clawrl/cluster.toml")).unwrap();
        assert_eq!(c.name, "a");
        assert_eq!(c.listen, "127.0.0.1:7400".parse().unwrap());
        assert_eq!(c.seeds, vec!["127.0.0.1:7401".parse().unwrap()]);
        assert_eq!(c.roles, vec![Role::Control, Role::Env]);
        assert_eq!(c.data_dir, PathBuf::from("/etc/clawrl/data/a"));
        let tls = c.tls.unwrap();
        assert_eq!(tls.ca, PathBuf::from("/etc/clawrl/certs/ca.pem"));
        assert_eq!(
            tls.client_cert,
            PathBuf::from("/etc/clawrl/certs/client.pem")
        );
    }

    fn err(text: &str) -> String {
        NodeConfig::parse(text, Path::new("x/cluster.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn unknown_key_is_named_with_the_file() {
        let e = err(&GOOD.replace("data_dir", "datadir"));
        assert!(e.contains("x/cluster.toml"), "{e}");
        assert!(e.contains("datadir"), "{e}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let e = err(&GOOD.replace(r#"name = "a""#, "name = 3"));
        assert!(e.contains("node.name"), "{e}");
    }

    #[test]
    fn missing_field_is_named() {
        let e = err(&GOOD.replace(r#"listen = "127.0.0.1:7400""#, ""));
        assert!(e.contains("listen"), "{e}");
    }

    #[test]
    fn bad_role_and_bad_address_are_named() {
        let e = err(&GOOD.replace(r#""env""#, r#""chef""#));
        assert!(e.contains("node.roles"), "{e}");
        let e = err(&GOOD.replace("127.0.0.1:7401", "nowhere"));
        assert!(e.contains("node.seeds[0]"), "{e}");
    }

    #[test]
    fn reserved_names_are_refused() {
        for name in crate::pki::RESERVED_NAMES {
            let e = err(&GOOD.replace(r#"name = "a""#, &format!("name = \"{name}\"")));
            assert!(e.contains("node.name") && e.contains("reserved"), "{e}");
        }
    }

    #[test]
    fn tls_is_optional() {
        let text = GOOD.split("[tls]").next().unwrap();
        let c = NodeConfig::parse(text, Path::new("cluster.toml")).unwrap();
        assert!(c.tls.is_none());
    }

    #[test]
    fn judge_access_defaults_to_loopback_without_keys() {
        let c = NodeConfig::parse(GOOD, Path::new("cluster.toml")).unwrap();
        assert_eq!(c.judge, JudgeAccess::default());
        assert_eq!(c.judge.allowed_endpoints, vec![LOOPBACK.to_string()]);
        assert!(c.judge.allowed_key_envs.is_empty());
        // A section with only the keys keeps the loopback default.
        let text = format!("{GOOD}\n[judge]\nallowed_key_envs = [\"JUDGE_KEY\"]\n");
        let c = NodeConfig::parse(&text, Path::new("cluster.toml")).unwrap();
        assert_eq!(c.judge.allowed_endpoints, vec![LOOPBACK.to_string()]);
        assert_eq!(c.judge.allowed_key_envs, vec!["JUDGE_KEY".to_string()]);
    }

    #[test]
    fn judge_access_is_read_and_checked() {
        let text = format!(
            "{GOOD}\n[judge]\nallowed_endpoints = [\"https://api.example.com/v1\"]\n\
             allowed_key_envs = [\"JUDGE_KEY\"]\n"
        );
        let c = NodeConfig::parse(&text, Path::new("cluster.toml")).unwrap();
        assert_eq!(
            c.judge.allowed_endpoints,
            vec!["https://api.example.com/v1"]
        );
        let text = format!("{GOOD}\n[judge]\nallowed_endpoints = []\n");
        let c = NodeConfig::parse(&text, Path::new("cluster.toml")).unwrap();
        assert!(c.judge.allowed_endpoints.is_empty());
        let e = err(&format!(
            "{GOOD}\n[judge]\nallowed_endpoints = [\"ftp://x\"]\n"
        ));
        assert!(
            e.contains("judge.allowed_endpoints[0]") && e.contains("ftp://x"),
            "{e}"
        );
        let e = err(&format!("{GOOD}\n[judge]\nallowed_key_envs = [\"A-B\"]\n"));
        assert!(
            e.contains("judge.allowed_key_envs[0]") && e.contains("A-B"),
            "{e}"
        );
        let e = err(&format!("{GOOD}\n[judge]\nendpoints = []\n"));
        assert!(e.contains("endpoints"), "{e}");
    }
}
