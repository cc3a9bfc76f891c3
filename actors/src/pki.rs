//! The cluster's certificates: creating a CA, issuing node and client certificates (`rcgen`),
//! and building the mutual-TLS `rustls` configurations every QUIC endpoint uses.
//!
//! Every certificate carries the DNS name [`NODE_SERVER_NAME`], so a node can dial a seed by
//! address alone; trust comes from the cluster CA, which both sides require. A certificate's
//! identity is the second DNS name, `<name>.clawrl` ([`certificate_name`]): a node is admitted
//! under that name only, and the CLI's certificate ([`CLIENT_NAME`]) never as a node. Private
//! keys are created owner-only (0600) in owner-only directories (0700). All configs are built
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
/// The name the CLI's client certificate is issued to.
pub const CLIENT_NAME: &str = "client";
/// Names no node may take: the CA's files and the CLI's certificate use them.
pub const RESERVED_NAMES: [&str; 2] = ["ca", CLIENT_NAME];
/// Suffix of the DNS name that carries a certificate's identity (`<name>.clawrl`).
const IDENTITY_SUFFIX: &str = ".clawrl";
/// Mode of private key files: read and write by the owner only.
#[cfg(unix)]
const KEY_MODE: u32 = 0o600;
/// Mode of directories holding private keys: the owner only.
#[cfg(unix)]
const KEY_DIR_MODE: u32 = 0o700;

/// Whether `name` is reserved ([`RESERVED_NAMES`]) and so cannot be a node's.
pub fn is_reserved_name(name: &str) -> bool {
    RESERVED_NAMES.contains(&name)
}

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

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, text: &str) -> Result<(), PkiError> {
    std::fs::write(path, text).map_err(io_err(path))
}

/// Writes a private key so that only the owner can ever read it: the file is created anew with
/// mode 0600 at open time (a file already there is removed first, since opening an existing
/// file keeps its old mode), so no other user can open it between creation and a later chmod.
/// `create_new` also refuses to follow a symlink planted at `path`.
fn write_private(path: &Path, text: &str) -> Result<(), PkiError> {
    use std::io::Write;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(path)(e)),
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, KEY_MODE);
    let mut f = options.open(path).map_err(io_err(path))?;
    f.write_all(text.as_bytes()).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Creates `dir` (and missing parents) for private keys: `dir` itself is created with mode
/// 0700; a directory already there keeps its mode (the keys in it are 0600 whatever it is).
fn create_key_dir(dir: &Path) -> Result<(), PkiError> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, KEY_DIR_MODE);
    match builder.create(dir) {
        Ok(()) => Ok(()),
        // Created meanwhile by another process: same outcome.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(io_err(dir)(e)),
    }
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
        let mut params = CertificateParams::new(vec![
            NODE_SERVER_NAME.to_string(),
            format!("{name}{IDENTITY_SUFFIX}"),
        ])?;
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
/// (`ca.pem`, `ca.key`, `<node>.pem`, `<node>.key`, `client.pem`, `client.key`). Keys are
/// written 0600; `dir`, when created here, is 0700.
pub fn init_cluster(dir: &Path, nodes: &[String]) -> Result<Vec<PathBuf>, PkiError> {
    create_key_dir(dir)?;
    let ca = Ca::generate()?;
    let mut written = Vec::new();
    let mut put = |name: &str, text: &str, private: bool| -> Result<(), PkiError> {
        let p = dir.join(name);
        if private {
            write_private(&p, text)?;
        } else {
            write(&p, text)?;
        }
        written.push(p);
        Ok(())
    };
    put("ca.pem", &ca.cert_pem(), false)?;
    put("ca.key", &ca.key_pem(), true)?;
    for n in nodes.iter().map(String::as_str).chain([CLIENT_NAME]) {
        let (cert, key) = ca.issue(n)?;
        put(&format!("{n}.pem"), &cert, false)?;
        put(&format!("{n}.key"), &key, true)?;
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

/// Why a certificate's node name could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CertNameError {
    /// The peer presented no certificate.
    #[error("no certificate")]
    Missing,
    /// The certificate did not parse.
    #[error("unreadable certificate: {0}")]
    Malformed(String),
    /// Neither a `<name>.clawrl` DNS name nor a common name.
    #[error("the certificate names no node (no `<name>.clawrl` DNS name, no common name)")]
    Unnamed,
    /// Several `<name>.clawrl` DNS names.
    #[error("the certificate names several nodes: {}", .0.join(", "))]
    Ambiguous(Vec<String>),
}

/// The node name a certificate was issued to: its one subject-alternative DNS name
/// `<name>.clawrl` ([`Ca::issue`] writes it beside [`NODE_SERVER_NAME`]), or, when it has none,
/// its subject common name. The certificate is not verified here: callers pass one the TLS
/// handshake already verified against the cluster CA.
pub fn certificate_name(cert: &CertificateDer<'_>) -> Result<String, CertNameError> {
    let names = der::names(cert.as_ref()).map_err(|e| CertNameError::Malformed(e.to_string()))?;
    let mut nodes: Vec<String> = names
        .dns
        .iter()
        .filter_map(|d| d.strip_suffix(IDENTITY_SUFFIX))
        .filter(|n| !n.is_empty())
        .map(String::from)
        .collect();
    nodes.sort();
    nodes.dedup();
    match nodes.len() {
        0 => names.common_name.ok_or(CertNameError::Unnamed),
        1 => Ok(nodes.remove(0)),
        _ => Err(CertNameError::Ambiguous(nodes)),
    }
}

/// Just enough X.509 (RFC 5280 §4.1) to read a certificate's names, with `yasna` (the DER
/// codec `rcgen` writes certificates with).
mod der {
    use yasna::models::ObjectIdentifier;
    use yasna::{ASN1Result, BERReader, Tag};

    /// `id-at-commonName`.
    const COMMON_NAME: [u64; 4] = [2, 5, 4, 3];
    /// `id-ce-subjectAltName`.
    const SUBJECT_ALT_NAME: [u64; 4] = [2, 5, 29, 17];

    /// The names a certificate carries.
    pub(super) struct Names {
        /// The subject's common name.
        pub common_name: Option<String>,
        /// Subject-alternative `dNSName`s.
        pub dns: Vec<String>,
    }

    fn is(oid: &ObjectIdentifier, want: &[u64]) -> bool {
        oid.components().as_slice() == want
    }

    /// Reads `Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signature }`.
    pub(super) fn names(cert: &[u8]) -> ASN1Result<Names> {
        yasna::parse_ber(cert, |r| {
            r.read_sequence(|r| {
                let names = r.next().read_sequence(|tbs| {
                    // version [0] EXPLICIT (absent in v1), serialNumber, signature, issuer,
                    // validity, then the subject.
                    tbs.read_optional(|r| r.read_tagged(Tag::context(0), |r| r.read_der()))?;
                    for _ in 0..4 {
                        tbs.next().read_der()?;
                    }
                    let common_name = common_name(tbs.next())?;
                    tbs.next().read_der()?; // subjectPublicKeyInfo
                                            // issuerUniqueID [1], subjectUniqueID [2], extensions [3] EXPLICIT.
                    let mut dns = Vec::new();
                    while let Some(field) = tbs.read_optional(|r| r.read_tagged_der())? {
                        if field.tag() == Tag::context(3) {
                            dns.extend(dns_names(field.value())?);
                        }
                    }
                    Ok(Names { common_name, dns })
                })?;
                r.next().read_der()?;
                r.next().read_der()?;
                Ok(names)
            })
        })
    }

    /// `Name ::= SEQUENCE OF SET OF SEQUENCE { type OID, value ANY }`: the common name, if any.
    fn common_name(r: BERReader<'_, '_>) -> ASN1Result<Option<String>> {
        let mut found = None;
        r.read_sequence_of(|r| {
            r.read_set_of(|r| {
                r.read_sequence(|r| {
                    let oid = r.next().read_oid()?;
                    let value = r.next().read_tagged_der()?;
                    if is(&oid, &COMMON_NAME) {
                        found = String::from_utf8(value.value().to_vec()).ok();
                    }
                    Ok(())
                })
            })
        })?;
        Ok(found)
    }

    /// `Extensions ::= SEQUENCE OF SEQUENCE { extnID, critical BOOLEAN DEFAULT FALSE,
    /// extnValue OCTET STRING }`: the `dNSName`s (`[2] IMPLICIT IA5String`) of the subject
    /// alternative name.
    fn dns_names(extensions: &[u8]) -> ASN1Result<Vec<String>> {
        let mut dns = Vec::new();
        yasna::parse_ber(extensions, |r| {
            r.read_sequence_of(|r| {
                r.read_sequence(|r| {
                    let oid = r.next().read_oid()?;
                    r.read_optional(|r| r.read_bool())?;
                    let value = r.next().read_bytes()?;
                    if is(&oid, &SUBJECT_ALT_NAME) {
                        yasna::parse_ber(&value, |r| {
                            r.read_sequence_of(|r| {
                                let name = r.read_tagged_der()?;
                                if name.tag() == Tag::context(2) {
                                    if let Ok(s) = String::from_utf8(name.value().to_vec()) {
                                        dns.push(s);
                                    }
                                }
                                Ok(())
                            })
                        })?;
                    }
                    Ok(())
                })
            })
        })?;
        Ok(dns)
    }
}

/// Where the ephemeral CA of a node without `[tls]` lives.
pub fn ephemeral_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("ephemeral-ca")
}

/// Loads (or creates on first use) the ephemeral CA under `data_dir` and a certificate for
/// `name` issued by it. Returns the identity and whether the CA was just created. The directory
/// is the node's own: it is made (or, made by an older version, tightened to) 0700, and the keys
/// written into it are 0600.
pub fn ephemeral_identity(data_dir: &Path, name: &str) -> Result<(Identity, bool), PkiError> {
    let dir = ephemeral_dir(data_dir);
    create_key_dir(&dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir)
            .map_err(io_err(&dir))?
            .permissions()
            .mode();
        if mode & 0o777 != KEY_DIR_MODE {
            if let Err(e) =
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(KEY_DIR_MODE))
            {
                tracing::warn!(
                    "{}: mode {:o}, and it cannot be made 0700 ({e}): other users may reach its keys",
                    dir.display(),
                    mode & 0o777
                );
            }
        }
    }
    let ca_key = dir.join("ca.key");
    let ca_pem = dir.join("ca.pem");
    let created = !ca_key.exists();
    let ca = if created {
        let ca = Ca::generate()?;
        write_private(&ca_key, &ca.key_pem())?;
        write(&ca_pem, &ca.cert_pem())?;
        ca
    } else {
        Ca::from_key_file(&ca_key)?
    };
    if !ca_pem.exists() {
        write(&ca_pem, &ca.cert_pem())?;
    }
    for n in [name, CLIENT_NAME] {
        let (cp, kp) = (dir.join(format!("{n}.pem")), dir.join(format!("{n}.key")));
        if created || !cp.exists() || !kp.exists() {
            let (c, k) = ca.issue(n)?;
            write(&cp, &c)?;
            write_private(&kp, &k)?;
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

    #[cfg(unix)]
    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[cfg(unix)]
    #[test]
    fn init_writes_keys_0600_in_a_0700_directory() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("certs");
        // A key left by an earlier run with a loose mode is replaced, not reused with its mode.
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("a.key"), "old").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(out.join("a.key"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        init_cluster(&out, &["a".into()]).unwrap();
        for k in ["ca.key", "a.key", "client.key"] {
            assert_eq!(mode(&out.join(k)), 0o600, "{k}");
        }
        assert_eq!(mode(&out.join("ca.pem")) & 0o600, 0o600);
        let fresh = dir.path().join("new/certs");
        init_cluster(&fresh, &["a".into()]).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        for k in ["ca.key", "a.key", "client.key"] {
            assert_eq!(mode(&fresh.join(k)), 0o600, "{k}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn ephemeral_keys_are_0600_in_a_0700_directory() {
        let dir = tempfile::tempdir().unwrap();
        ephemeral_identity(dir.path(), "a").unwrap();
        let eph = ephemeral_dir(dir.path());
        assert_eq!(mode(&eph), 0o700);
        for k in ["ca.key", "a.key", "client.key"] {
            assert_eq!(mode(&eph.join(k)), 0o600, "{k}");
        }
        // A directory an older version made 0755 is tightened on the next start.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&eph, std::fs::Permissions::from_mode(0o755)).unwrap();
        ephemeral_identity(dir.path(), "b").unwrap();
        assert_eq!(mode(&eph), 0o700);
        assert_eq!(mode(&eph.join("b.key")), 0o600);
    }

    #[test]
    fn a_certificate_names_the_node_it_was_issued_to() {
        let ca = Ca::generate().unwrap();
        for name in ["a", "node-7", CLIENT_NAME] {
            let (cert, _) = ca.issue(name).unwrap();
            let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
            assert_eq!(certificate_name(&der).unwrap(), name);
        }
        // The CA's own certificate has no `.clawrl` DNS name: its common name is its name.
        let der = CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap();
        assert_eq!(certificate_name(&der).unwrap(), CA_COMMON_NAME);
        let e = certificate_name(&CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x01]));
        assert!(matches!(e, Err(CertNameError::Malformed(_))), "{e:?}");
    }

    #[test]
    fn two_identity_names_are_ambiguous() {
        let ca = Ca::generate().unwrap();
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec![
            NODE_SERVER_NAME.to_string(),
            "a.clawrl".to_string(),
            "b.clawrl".to_string(),
        ])
        .unwrap();
        let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
        let e = certificate_name(cert.der());
        assert!(
            matches!(&e, Err(CertNameError::Ambiguous(n)) if n == &["a", "b"]),
            "{e:?}"
        );
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
