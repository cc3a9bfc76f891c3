//! The cluster's certificates: creating a CA, issuing node and client certificates (`rcgen`),
//! and building the mutual-TLS `rustls` configurations every QUIC endpoint uses.
//!
//! Every certificate carries the DNS name [`NODE_SERVER_NAME`], so a node can dial a seed by
//! address alone; trust comes from the cluster CA, which both sides require. All configs are built
//! with the `ring` provider explicitly (two providers are compiled into `rustls` here).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The TLS server name every cluster certificate carries and every dial uses.
pub const NODE_SERVER_NAME: &str = "clawrl-node";
/// The ALPN protocol of the cluster endpoint.
pub const ALPN: &[u8] = b"clawrl/1";
/// Common name of every cluster CA (kept fixed so a CA can be rebuilt from its key).
const CA_COMMON_NAME: &str = "clawrl cluster CA";

/// Why certificates could not be made, read or used.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// File I/O failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A PEM file did not hold what it should.
    #[error("{path}: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// A client-certificate verifier could not be built.
    #[error("TLS verifier: {0}")]
    Verifier(String),
}

/// A cluster CA able to issue certificates.
pub struct Ca {
    key: KeyPair,
    cert: rcgen::Certificate,
}

fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

fn write(path: &Path, text: &str) -> Result<(), PkiError> {
    std::fs::write(path, text).map_err(|source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl Ca {
    /// Creates a new CA with a fresh key.
    pub fn generate() -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        Ok(Ca { key, cert })
    }

    /// Rebuilds a CA from its private key. Certificates it issues chain to any CA certificate
    /// made from the same key (same subject, same key identifier).
    pub fn from_key_file(path: &Path) -> Result<Self, PkiError> {
        let key = KeyPair::from_pem(&read(path)?).map_err(|e| PkiError::Pem {
            path: path.to_path_buf(),
            message: format!("not a private key: {e}"),
        })?;
        let cert = ca_params()?.self_signed(&key)?;
        Ok(Ca { key, cert })
    }

    /// The CA certificate (PEM).
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA private key (PEM).
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// Issues a certificate for `name` (a node, or `client`); returns `(cert_pem, key_pem)`.
    pub fn issue(&self, name: &str) -> Result<(String, String), PkiError> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(vec![NODE_SERVER_NAME.to_string(), format!("{name}.clawrl")])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// Writes a CA, one certificate per node and a client certificate into `dir`
/// (`ca.pem`, `ca.key`, `<node>.pem`, `<node>.key`, `client.pem`, `client.key`).
pub fn init_cluster(dir: &Path, nodes: &[String]) -> Result<Vec<PathBuf>, PkiError> {
    std::fs::create_dir_all(dir).map_err(|source| PkiError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let ca = Ca::generate()?;
    let mut written = Vec::new();
    let mut put = |name: &str, text: &str| -> Result<(), PkiError> {
        let p = dir.join(name);
        write(&p, text)?;
        written.push(p);
        Ok(())
    };
    put("ca.pem", &ca.cert_pem())?;
    put("ca.key", &ca.key_pem())?;
    for n in nodes.iter().map(String::as_str).chain(["client"]) {
        let (cert, key) = ca.issue(n)?;
        put(&format!("{n}.pem"), &cert)?;
        put(&format!("{n}.key"), &key)?;
    }
    Ok(written)
}

/// PEM material of one endpoint: the CA to trust and its own chain and key.
pub struct Identity {
    /// The trusted cluster CA.
    pub ca: CertificateDer<'static>,
    /// This endpoint's certificate.
    pub cert: CertificateDer<'static>,
    /// This endpoint's private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
        }
    }
}

fn load_cert(path: &Path) -> Result<CertificateDer<'static>, PkiError> {
    CertificateDer::from_pem_slice(read(path)?.as_bytes()).map_err(|e| PkiError::Pem {
        path: path.to_path_buf(),
        message: format!("no PEM certificate: {e}"),
    })
}

impl Identity {
    /// Loads the CA certificate, a certificate and its key from PEM files.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Self, PkiError> {
        let key_der =
            PrivateKeyDer::from_pem_slice(read(key)?.as_bytes()).map_err(|e| PkiError::Pem {
                path: key.to_path_buf(),
                message: format!("no PEM private key: {e}"),
            })?;
        Ok(Identity {
            ca: load_cert(ca)?,
            cert: load_cert(cert)?,
            key: key_der,
        })
    }

    /// A digest of the CA certificate: nodes of one cluster share it (used as the
    /// `ractor_cluster` cookie, on top of the mutual TLS that actually authenticates).
    pub fn cluster_digest(&self) -> String {
        blake3::hash(self.ca.as_ref()).to_hex().to_string()
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, PkiError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone())?;
        Ok(Arc::new(roots))
    }

    /// Server side: requires a client certificate signed by the cluster CA.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, PkiError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| PkiError::Verifier(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())?;
        cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        Ok(cfg)
    }

    /// Client side: trusts only the cluster CA and presents this identity.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<rustls::ClientConfig, PkiError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())?;
        cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        Ok(cfg)
    }
}

/// Where the ephemeral CA of a node without `[tls]` lives.
pub fn ephemeral_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("ephemeral-ca")
}

/// Loads (or creates on first use) the ephemeral CA under `data_dir` and a certificate for
/// `name` issued by it. Returns the identity and whether the CA was just created.
pub fn ephemeral_identity(data_dir: &Path, name: &str) -> Result<(Identity, bool), PkiError> {
    let dir = ephemeral_dir(data_dir);
    std::fs::create_dir_all(&dir).map_err(|source| PkiError::Io {
        path: dir.clone(),
        source,
    })?;
    let ca_key = dir.join("ca.key");
    let ca_pem = dir.join("ca.pem");
    let created = !ca_key.exists();
    let ca = if created {
        let ca = Ca::generate()?;
        write(&ca_key, &ca.key_pem())?;
        write(&ca_pem, &ca.cert_pem())?;
        ca
    } else {
        Ca::from_key_file(&ca_key)?
    };
    if !ca_pem.exists() {
        write(&ca_pem, &ca.cert_pem())?;
    }
    for n in [name, "client"] {
        let (cp, kp) = (dir.join(format!("{n}.pem")), dir.join(format!("{n}.key")));
        if created || !cp.exists() || !kp.exists() {
            let (c, k) = ca.issue(n)?;
            write(&cp, &c)?;
            write(&kp, &k)?;
        }
    }
    let id = Identity::load(
        &ca_pem,
        &dir.join(format!("{name}.pem")),
        &dir.join(format!("{name}.key")),
    )?;
    Ok((id, created))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_writes_every_file_and_identities_load() {
        let dir = tempfile::tempdir().unwrap();
        let files = init_cluster(dir.path(), &["a".into(), "b".into()]).unwrap();
        assert_eq!(files.len(), 8);
        let d = dir.path();
        let id = Identity::load(&d.join("ca.pem"), &d.join("a.pem"), &d.join("a.key")).unwrap();
        id.server_config(&[ALPN]).unwrap();
        id.client_config(&[ALPN]).unwrap();
        let client = Identity::load(
            &d.join("ca.pem"),
            &d.join("client.pem"),
            &d.join("client.key"),
        )
        .unwrap();
        assert_eq!(client.cluster_digest(), id.cluster_digest());
    }

    #[test]
    fn ephemeral_ca_is_created_once_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let (a, created) = ephemeral_identity(dir.path(), "a").unwrap();
        assert!(created);
        let (b, created) = ephemeral_identity(dir.path(), "b").unwrap();
        assert!(!created);
        assert_eq!(a.cluster_digest(), b.cluster_digest());
    }

    #[test]
    fn bad_pem_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("junk.pem");
        std::fs::write(&p, "hello").unwrap();
        let e = Identity::load(&p, &p, &p).err().unwrap().to_string();
        assert!(e.contains("junk.pem"), "{e}");
    }
}
