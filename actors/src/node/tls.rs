//! The node's use of the cluster PKI: loading its identity (the configured certificates, or an
//! ephemeral CA for single-machine use), checking that its certificate carries its own name,
//! sealing the `NodeServer`'s TCP listener, and the revocation list (`[tls] deny`), which is
//! reloaded on SIGHUP and applied to the connections already open.

use std::sync::Arc;

use super::{lock, Node, NodeError};
use crate::config::NodeConfig;
use crate::pki::{self, Identity};
use crate::transport;

/// The node's identity: the configured `[tls]` files, or without them an ephemeral cluster CA
/// under the data directory (created on first use; single-machine use only).
pub(super) fn load_identity(config: &NodeConfig) -> Result<Identity, NodeError> {
    Ok(match &config.tls {
        Some(t) => Identity::load(&t.ca, &t.cert, &t.key)?,
        None => {
            let (id, created) = pki::ephemeral_identity(&config.data_dir, &config.name)?;
            let dir = pki::ephemeral_dir(&config.data_dir);
            if created {
                tracing::warn!(
                    "no [tls] in {}: created an EPHEMERAL cluster CA in {} (single-machine use only)",
                    config.file.display(),
                    dir.display()
                );
            } else {
                tracing::warn!(
                    "no [tls] in {}: using the EPHEMERAL cluster CA in {} (single-machine use only)",
                    config.file.display(),
                    dir.display()
                );
            }
            id
        }
    })
}

/// Warns when the node's certificate does not carry its configured name: peers admit a node
/// only under the name its certificate carries, so they will refuse it.
pub(super) fn warn_if_misnamed(config: &NodeConfig, identity: &Identity) {
    match pki::certificate_name(&identity.cert) {
        Ok(n) if n == config.name => {}
        Ok(n) => tracing::warn!(
            "node `{}`: its certificate names `{n}`; peers will refuse it under the name `{}`",
            config.name,
            config.name
        ),
        Err(e) => tracing::warn!(
            "node `{}`: its certificate names no node ({e}); peers will refuse it",
            config.name
        ),
    }
}

/// A TLS acceptor for the `NodeServer`'s TCP listener that no client can pass: it requires a
/// client certificate from a CA whose key is thrown away at once.
pub(super) fn sealed_acceptor() -> Result<tokio_rustls::TlsAcceptor, pki::PkiError> {
    let ca = pki::Ca::generate()?;
    let (cert, key) = ca.issue("sealed")?;
    use rustls::pki_types::pem::PemObject;
    let pem = |s: &str| {
        rustls::pki_types::CertificateDer::from_pem_slice(s.as_bytes()).map_err(|e| {
            pki::PkiError::Pem {
                path: "<memory>".into(),
                message: e.to_string(),
            }
        })
    };
    let id = Identity {
        ca: pem(&ca.cert_pem())?,
        cert: pem(&cert)?,
        key: rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| {
            pki::PkiError::Pem {
                path: "<memory>".into(),
                message: e.to_string(),
            }
        })?,
    };
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(
        id.server_config(&[])?,
    )))
}

impl Node {
    /// Re-reads the config file and applies its `[tls] deny` list; a file that no longer
    /// parses leaves the current list in force.
    pub(super) fn reload_denied(&self) {
        let file = &self.inner.config_file;
        match NodeConfig::load(file) {
            Ok(c) => {
                let deny = c.tls.map(|t| t.deny).unwrap_or_default();
                tracing::info!("SIGHUP: reloaded {}: deny {:?}", file.display(), deny);
                self.set_denied(deny);
            }
            Err(e) => tracing::error!(
                "SIGHUP: {} does not load ({e}); the deny list in force is kept",
                file.display()
            ),
        }
    }

    /// Replaces the revoked names and closes the connections of the peers now revoked (their
    /// node sessions end and their members leave their groups).
    pub fn set_denied(&self, names: impl IntoIterator<Item = String>) {
        lock(&self.inner.admission).set_denied(names);
        let peers: Vec<(String, quinn::Connection)> = lock(&self.inner.peers)
            .iter()
            .map(|(n, p)| (n.clone(), p.conn.clone()))
            .collect();
        let admission = lock(&self.inner.admission).clone();
        let revoked = peers.into_iter().filter(|(n, _)| admission.is_denied(n));
        for (name, conn) in revoked {
            tracing::warn!("peer `{name}` is revoked ([tls] deny): closing its connection");
            conn.close(5u32.into(), b"revoked");
        }
    }

    /// The revoked name the certificate of `conn`'s peer carries, if it is revoked.
    pub(super) fn revoked_peer(&self, conn: &quinn::Connection) -> Option<String> {
        lock(&self.inner.admission).revoked(transport::peer_name(conn))
    }
}
