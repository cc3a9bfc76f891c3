//! API keys: the bearer keys a server accepts, kept as blake3 digests and checked in constant
//! time, and the model ids each may use. Shared by the gateway and the dashboard, so both
//! accept exactly the same keys.

use axum::http::HeaderMap;

use super::session::Scope;

/// The accepted keys (none = every request is admitted, as key 0).
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    /// blake3 digests of the keys, in config order (a key's index is its [`Scope`]'s key).
    digests: Vec<[u8; 32]>,
    /// Per key, the model ids it may use (`None`: every one).
    models: Vec<Option<Vec<String>>>,
}

impl ApiKeys {
    /// Accepts `keys`, for every model id.
    pub fn new(keys: &[String]) -> Self {
        ApiKeys {
            digests: keys
                .iter()
                .map(|k| *blake3::hash(k.as_bytes()).as_bytes())
                .collect(),
            models: vec![None; keys.len()],
        }
    }

    /// Accepts each key of `keys`, for the model ids it lists (`None`: every one).
    pub fn scoped(keys: &[(String, Option<Vec<String>>)]) -> Self {
        ApiKeys {
            digests: keys
                .iter()
                .map(|(k, _)| *blake3::hash(k.as_bytes()).as_bytes())
                .collect(),
            models: keys.iter().map(|(_, m)| m.clone()).collect(),
        }
    }

    /// Whether the key of `scope` may use model id `model` (with no key configured, every
    /// request may use every model).
    pub fn allows(&self, scope: Scope, model: &str) -> bool {
        match self.models.get(scope.key as usize) {
            None => self.digests.is_empty(),
            Some(None) => true,
            Some(Some(ids)) => ids.iter().any(|m| m == model),
        }
    }

    /// No key is configured: every request is admitted.
    pub fn is_open(&self) -> bool {
        self.digests.is_empty()
    }

    /// The scope of the bearer key in `headers`: key 0 when no key is configured, else the
    /// index of the first configured key it matches; `None` when it matches none or is
    /// missing. The given key's blake3 digest is compared with every configured key's digest
    /// in constant time, with no early exit, so the time taken tells neither which bytes of a
    /// guess were right nor how long a key is.
    pub fn check(&self, headers: &HeaderMap) -> Option<Scope> {
        use subtle::{ConditionallySelectable, ConstantTimeEq};
        if self.digests.is_empty() {
            return Some(Scope::key(0));
        }
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)?;
        let digest = blake3::hash(given.as_bytes());
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (i, d) in self.digests.iter().enumerate() {
            let hit = digest.as_bytes()[..].ct_eq(&d[..]);
            index.conditional_assign(&(i as u32), hit & !found);
            found |= hit;
        }
        bool::from(found).then_some(Scope::key(index))
    }
}
