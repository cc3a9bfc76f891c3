//! What a job's judge may reach: a job spec asks for an endpoint (`judge.endpoint`) and an
//! API-key variable (`judge.api_key_env`), and the node that builds the judge grants them or
//! not, by its `[judge]` section ([`JudgeAccess`]: `allowed_endpoints`, `allowed_key_envs`;
//! by default loopback endpoints and no key). [`check`] is the pure rule; it runs before the
//! judge is built, so a refused spec sends nothing and reads no variable.
//!
//! An endpoint is judged by the URL requests actually go to
//! ([`super::openai::chat_completions_url`]), parsed as the HTTP client parses it, so that a
//! string that looks allowed but names another host (`http://127.0.0.1@evil/`,
//! `http://evil\@127.0.0.1`) is judged by its real host. URLs with credentials in them are
//! never allowed.

use std::net::IpAddr;

use reqwest::Url;

use crate::job::JudgeSpec;

pub use clawrl_actors::config::{JudgeAccess, LOOPBACK};

/// Why a spec's judge is refused on this node. The message names the spec key and its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JudgeAccessError {
    /// `judge.endpoint` is not one of the node's `[judge] allowed_endpoints`.
    #[error(
        "judge.endpoint `{endpoint}` is not allowed on this node (not in its [judge] \
         allowed_endpoints)"
    )]
    Endpoint {
        /// The endpoint the spec asked for.
        endpoint: String,
    },
    /// `judge.api_key_env` is not one of the node's `[judge] allowed_key_envs`.
    #[error(
        "judge.api_key_env `{name}` is not allowed on this node (not in its [judge] \
         allowed_key_envs)"
    )]
    KeyEnv {
        /// The variable the spec asked for.
        name: String,
    },
}

/// Checks a spec's judge against the node's access: the endpoint, when the spec names one, must
/// be allowed ([`endpoint_allowed`]) and the key variable, when it names one, must be listed
/// exactly. Both are checked whatever the backend, since a spec only names them to use them.
pub fn check(judge: &JudgeSpec, access: &JudgeAccess) -> Result<(), JudgeAccessError> {
    check_values(
        judge.endpoint.as_deref(),
        judge.api_key_env.as_deref(),
        access,
    )
}

/// [`check`] over the two values themselves.
pub fn check_values(
    endpoint: Option<&str>,
    api_key_env: Option<&str>,
    access: &JudgeAccess,
) -> Result<(), JudgeAccessError> {
    if let Some(e) = endpoint {
        if !endpoint_allowed(e, &access.allowed_endpoints) {
            return Err(JudgeAccessError::Endpoint {
                endpoint: e.to_string(),
            });
        }
    }
    if let Some(k) = api_key_env {
        if !access.allowed_key_envs.iter().any(|a| a == k) {
            return Err(JudgeAccessError::KeyEnv {
                name: k.to_string(),
            });
        }
    }
    Ok(())
}

/// Whether requests of a judge configured with `endpoint` go somewhere `allowed` lists: the
/// request URL is `http`/`https` without credentials, and some entry is [`LOOPBACK`] with a
/// loopback host (`localhost`, `127.0.0.0/8`, `::1`, any port), or a URL with the same scheme,
/// host and port whose path the request path equals or extends at a `/` (entry
/// `https://api.example.com/v1` allows `https://api.example.com/v1/chat/completions`, not
/// `https://api.example.com/v10/...`). An entry that does not parse allows nothing.
pub fn endpoint_allowed(endpoint: &str, allowed: &[String]) -> bool {
    let Ok(url) = super::openai::chat_completions_url(endpoint) else {
        return false;
    };
    if !plain_http(&url) {
        return false;
    }
    allowed.iter().any(|entry| {
        if entry == LOOPBACK {
            return is_loopback(&url);
        }
        let Ok(base) = Url::parse(entry) else {
            return false;
        };
        plain_http(&base)
            && base.scheme() == url.scheme()
            && base.host_str() == url.host_str()
            && base.port_or_known_default() == url.port_or_known_default()
            && path_extends(url.path(), base.path())
    })
}

/// `http` or `https`, with a host and no user name or password.
fn plain_http(url: &Url) -> bool {
    matches!(url.scheme(), "http" | "https")
        && url.host().is_some()
        && url.username().is_empty()
        && url.password().is_none()
}

/// Whether the URL's host is `localhost` or a loopback address (the parser has already put
/// IPv4 hosts in dotted form and IPv6 hosts in brackets).
fn is_loopback(url: &Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => a.is_loopback(),
        Ok(IpAddr::V6(a)) => {
            a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

/// Whether `path` is `base` or below it (segment-wise; a trailing `/` of `base` is ignored).
fn path_extends(path: &str, base: &str) -> bool {
    let base = base.trim_end_matches('/');
    base.is_empty()
        || path == base
        || path
            .strip_prefix(base)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(endpoints: &[&str], keys: &[&str]) -> JudgeAccess {
        JudgeAccess {
            allowed_endpoints: endpoints.iter().map(|s| s.to_string()).collect(),
            allowed_key_envs: keys.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn the_default_allows_loopback_endpoints_and_no_key() {
        let d = JudgeAccess::default();
        for ok in [
            "http://127.0.0.1:8000/v1",
            "http://localhost:9/v1/chat/completions",
            "https://LOCALHOST/",
            "http://[::1]:8000",
            "http://127.1.2.3:1",
            "http://[::ffff:127.0.0.1]:80/v1",
        ] {
            assert_eq!(check_values(Some(ok), None, &d), Ok(()), "{ok}");
        }
        for bad in [
            "https://anywhere.example/v1",
            "http://169.254.169.254/latest",
            "http://10.0.0.1:8000/v1",
            "http://localhost.evil.example/v1",
            // Looks like loopback, is not: the host after the credentials is the real one.
            "http://127.0.0.1@evil.example/v1",
            "http://127.0.0.1:80@evil.example/v1",
            // Credentials are never allowed, even to loopback.
            "http://user:pw@127.0.0.1/v1",
            "ftp://127.0.0.1/v1",
            "file:///etc/passwd",
            "not a url",
        ] {
            assert!(
                matches!(
                    check_values(Some(bad), None, &d),
                    Err(JudgeAccessError::Endpoint { .. })
                ),
                "{bad}"
            );
        }
        // No key variable is allowed by default.
        assert_eq!(
            check_values(
                Some("http://127.0.0.1:8000/v1"),
                Some("AWS_SECRET_ACCESS_KEY"),
                &d
            ),
            Err(JudgeAccessError::KeyEnv {
                name: "AWS_SECRET_ACCESS_KEY".into()
            })
        );
        // Nothing asked, nothing refused (scripted and model judges).
        assert_eq!(check_values(None, None, &d), Ok(()));
    }

    #[test]
    fn url_entries_match_scheme_host_port_and_path_prefix() {
        let a = access(&["https://api.example.com/v1"], &["JUDGE_KEY"]);
        for ok in [
            "https://api.example.com/v1",
            "https://api.example.com/v1/",
            "https://api.example.com:443/v1/chat/completions",
            "https://API.example.com/v1",
        ] {
            assert!(endpoint_allowed(ok, &a.allowed_endpoints), "{ok}");
        }
        for bad in [
            "http://api.example.com/v1",       // scheme
            "https://api.example.com:8443/v1", // port
            "https://api.example.com/v10",     // not below /v1
            "https://api.example.com/",        // above it
            "https://api.example.com.evil/v1", // another host
            "https://evil/v1#https://api.example.com/v1",
            "https://api.example.com/v1/../../admin", // normalised to /admin
            "http://127.0.0.1:8000/v1",               // loopback is not listed here
        ] {
            assert!(!endpoint_allowed(bad, &a.allowed_endpoints), "{bad}");
        }
        // An empty list allows no endpoint at all.
        assert!(!endpoint_allowed("http://127.0.0.1/v1", &[]));
        // A whole host.
        assert!(endpoint_allowed(
            "https://judge.internal:8443/any/path",
            &["https://judge.internal:8443".to_string()]
        ));
    }

    #[test]
    fn a_refused_spec_names_the_key_and_the_value() {
        let a = access(&["https://api.example.com/v1"], &["JUDGE_KEY"]);
        let e = check_values(
            Some("https://anywhere.example"),
            Some("AWS_SECRET_ACCESS_KEY"),
            &a,
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("judge.endpoint") && m.contains("https://anywhere.example"),
            "{m}"
        );
        let e = check_values(
            Some("https://api.example.com/v1"),
            Some("AWS_SECRET_ACCESS_KEY"),
            &a,
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("judge.api_key_env") && m.contains("AWS_SECRET_ACCESS_KEY"),
            "{m}"
        );
        assert_eq!(
            check_values(Some("https://api.example.com/v1"), Some("JUDGE_KEY"), &a),
            Ok(())
        );
    }

    #[test]
    fn a_spec_is_checked_through_its_judge_section() {
        let text = r#"
kind = "rl"
name = "x"
[policy]
checkpoint = "ck"
[judge]
backend = "openai"
endpoint = "https://anywhere"
model = "m"
api_key_env = "AWS_SECRET_ACCESS_KEY"
votes = 1
[method]
kind = "binary"
[optim]
batch_size = 4
lr = 1e-6
clip = 0.2
clip_high = 0.28
kl = 0.0
staleness = 1
[env]
kind = "terminal"
parallelism = 1
tasks = "t.jsonl"
[stop]
max_steps = 1
"#;
        let spec = crate::job::JobSpec::parse(text, "job.toml").unwrap();
        let e = check(&spec.judge, &JudgeAccess::default()).unwrap_err();
        assert_eq!(
            e,
            JudgeAccessError::Endpoint {
                endpoint: "https://anywhere".into()
            }
        );
        let allowed = access(&["https://anywhere"], &[]);
        let e = check(&spec.judge, &allowed).unwrap_err();
        assert!(
            e.to_string()
                .contains("judge.api_key_env `AWS_SECRET_ACCESS_KEY`"),
            "{e}"
        );
    }
}
