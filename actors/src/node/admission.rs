//! Mesh admission as pure decisions: who may connect, who may join the mesh under which name,
//! which connection to a peer is kept, and which streams a connection may open. No sockets, no
//! clock, no locks: the node reads the facts (the name its handshake verified, the hello, the
//! connection already held) and asks these functions; the IO stays in the sibling modules.
//!
//! The rules:
//!
//! - **Revocation first.** A connection whose certificate names a node in the `[tls] deny`
//!   list is refused at the handshake's end, whatever it is for (node or CLI):
//!   [`MeshAdmission::revoked`].
//! - **A node is the name its certificate carries.** A hello is welcome only from the same
//!   cluster (the digest of the CA), under a valid node name other than this node's, and only
//!   when the name the handshake verified is exactly the name claimed and is not a reserved
//!   one ([`MeshAdmission::hello`], [`check_identity`]). The CLI's client certificate carries a
//!   reserved name, so it can open CLI streams but never join as a node.
//! - **Node traffic needs admission.** Node sessions, gossip and the bulk plane are served only
//!   on a connection admitted by a hello; hello and CLI streams are served on any connection
//!   the handshake let in ([`needs_admission`]).
//! - **One connection per pair of nodes.** Both ends apply [`prefer_new`] to the connection
//!   they hold and the new one, so they keep the same one ([`join`]).

use std::collections::BTreeSet;

use crate::config::{valid_node_name, Role};
use crate::pki::{self, CertNameError};
use crate::transport::StreamTag;

/// Why a peer may not be admitted under the name its hello claims.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// Its certificate carries no usable name.
    #[error("it claims to be `{claimed}` but its certificate names no node: {source}")]
    Unnamed {
        /// The name in the hello.
        claimed: String,
        /// Why no name was read.
        source: CertNameError,
    },
    /// Its certificate names another node.
    #[error("it claims to be `{claimed}` but its certificate names `{certified}`")]
    Mismatch {
        /// The name in the hello.
        claimed: String,
        /// The name in its certificate.
        certified: String,
    },
    /// The name is reserved, as the CLI's client certificate's is.
    #[error("`{0}` is a reserved name (the CLI's client certificate may not join as a node)")]
    Reserved(String),
}

/// Checks that a peer whose verified certificate names `certified` may be node `claimed`: the
/// two names must be equal, and not a reserved name.
pub fn check_identity(
    claimed: &str,
    certified: Result<String, CertNameError>,
) -> Result<(), IdentityError> {
    let certified = certified.map_err(|source| IdentityError::Unnamed {
        claimed: claimed.to_string(),
        source,
    })?;
    if certified != claimed {
        return Err(IdentityError::Mismatch {
            claimed: claimed.to_string(),
            certified,
        });
    }
    if pki::is_reserved_name(claimed) {
        return Err(IdentityError::Reserved(certified));
    }
    Ok(())
}

/// Why a hello is refused; the text is the reason the refusal carries to the peer.
#[derive(Debug, thiserror::Error)]
pub enum HelloRefusal {
    /// Its cluster digest is not this node's: another CA.
    #[error("another cluster")]
    AnotherCluster,
    /// It claims this node's own name.
    #[error("same name as this node")]
    SameName,
    /// The name it claims is not a valid node name.
    #[error("invalid node name")]
    InvalidName,
    /// Its certificate does not carry the name it claims.
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// This node's admission settings: its name, its cluster's digest, and the revoked names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshAdmission {
    name: String,
    cluster: String,
    denied: BTreeSet<String>,
}

impl MeshAdmission {
    /// Node `name` of the cluster whose CA digest is `cluster`, refusing the names in `denied`.
    pub fn new(
        name: impl Into<String>,
        cluster: impl Into<String>,
        denied: impl IntoIterator<Item = String>,
    ) -> Self {
        MeshAdmission {
            name: name.into(),
            cluster: cluster.into(),
            denied: denied.into_iter().collect(),
        }
    }

    /// Replaces the revoked names.
    pub fn set_denied(&mut self, denied: impl IntoIterator<Item = String>) {
        self.denied = denied.into_iter().collect();
    }

    /// Whether `name` is revoked.
    pub fn is_denied(&self, name: &str) -> bool {
        self.denied.contains(name)
    }

    /// At a handshake's end: the revoked name the peer's certificate carries, if it is revoked
    /// (a certificate that names no node is left to the hello to refuse).
    pub fn revoked(&self, certified: Result<String, CertNameError>) -> Option<String> {
        certified.ok().filter(|n| self.is_denied(n))
    }

    /// Whether `cluster` is this node's cluster digest.
    pub fn same_cluster(&self, cluster: &str) -> bool {
        cluster == self.cluster
    }

    /// Whether a hello from `claimed` of `cluster`, over a connection whose verified certificate
    /// names `certified`, may join. The checks run in this order, and the first that fails is
    /// the answer: cluster, own name, valid name, identity.
    pub fn hello(
        &self,
        cluster: &str,
        claimed: &str,
        certified: Result<String, CertNameError>,
    ) -> Result<(), HelloRefusal> {
        if !self.same_cluster(cluster) {
            return Err(HelloRefusal::AnotherCluster);
        }
        if claimed == self.name {
            return Err(HelloRefusal::SameName);
        }
        if !valid_node_name(claimed) {
            return Err(HelloRefusal::InvalidName);
        }
        check_identity(claimed, certified)?;
        Ok(())
    }
}

/// Whether a stream of kind `tag` is served only on a connection a hello admitted (node
/// sessions, gossip, the bulk plane) rather than on any connection the handshake let in
/// (hello, CLI).
pub fn needs_admission(tag: StreamTag) -> bool {
    match tag {
        StreamTag::Hello | StreamTag::Cli => false,
        StreamTag::ActorSession | StreamTag::Gossip | StreamTag::Bulk => true,
    }
}

/// Whether a new connection to a peer replaces the one already held. Both ends compute the
/// same answer: the connection dialed by the node whose name sorts first wins; between two
/// dialed by the same node, the newer wins (the older is a leftover of a restart).
pub fn prefer_new(me: &str, peer: &str, new_dialer: &str, old_dialer: &str) -> bool {
    let canonical = if me <= peer { me } else { peer };
    let (new_c, old_c) = (new_dialer == canonical, old_dialer == canonical);
    if new_c != old_c {
        new_c
    } else {
        true
    }
}

/// The connection held to a peer when a new one is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held<'a> {
    /// It is the new connection itself (a second hello on it).
    pub same_connection: bool,
    /// It is still open.
    pub live: bool,
    /// The node that dialed it.
    pub dialer: &'a str,
}

/// What becomes of a new connection to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// It is already the connection held: nothing changes.
    AlreadyHeld,
    /// The live connection held wins: the new one is refused as a duplicate.
    KeepHeld,
    /// The new connection becomes the peer's; `close_held` says to close a live one it
    /// replaces.
    Insert {
        /// A live connection is replaced and must be closed.
        close_held: bool,
    },
}

/// Decides between the connection `held` to `peer` (if any) and a new one dialed by
/// `new_dialer`, as seen by node `me` ([`prefer_new`]; a closed connection always gives way).
pub fn join(me: &str, peer: &str, new_dialer: &str, held: Option<Held<'_>>) -> Join {
    let Some(held) = held else {
        return Join::Insert { close_held: false };
    };
    if held.same_connection {
        return Join::AlreadyHeld;
    }
    if held.live && !prefer_new(me, peer, new_dialer, held.dialer) {
        return Join::KeepHeld;
    }
    Join::Insert {
        close_held: held.live,
    }
}

/// Whether two nodes both have the control role (a cluster has one Control; this is reported,
/// not refused).
pub fn control_conflict(mine: &[Role], theirs: &[Role]) -> bool {
    mine.contains(&Role::Control) && theirs.contains(&Role::Control)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(n: &str) -> Result<String, CertNameError> {
        Ok(n.to_string())
    }

    #[test]
    fn both_ends_keep_the_same_connection() {
        // a < b: the connection dialed by a wins on both ends, whichever arrives first.
        assert!(prefer_new("a", "b", "a", "b"));
        assert!(!prefer_new("a", "b", "b", "a"));
        assert!(prefer_new("b", "a", "a", "b"));
        assert!(!prefer_new("b", "a", "b", "a"));
        // Same dialer (a restart): the newer wins.
        assert!(prefer_new("a", "b", "b", "b"));
        assert!(prefer_new("b", "a", "b", "b"));
    }

    #[test]
    fn a_name_is_admitted_only_as_its_certificate_carries_it() {
        assert!(check_identity("n1", named("n1")).is_ok());
        assert!(matches!(
            check_identity("n1", named("n2")),
            Err(IdentityError::Mismatch { claimed, certified })
                if claimed == "n1" && certified == "n2"
        ));
        assert!(matches!(
            check_identity("n1", Err(CertNameError::Missing)),
            Err(IdentityError::Unnamed {
                claimed,
                source: CertNameError::Missing,
            }) if claimed == "n1"
        ));
        // The CLI's client certificate carries a reserved name: it may not join as a node.
        let reserved = pki::CLIENT_NAME;
        assert!(pki::is_reserved_name(reserved));
        assert!(matches!(
            check_identity(reserved, named(reserved)),
            Err(IdentityError::Reserved(n)) if n == reserved
        ));
    }

    #[test]
    fn hellos_are_checked_cluster_first_then_name_then_identity() {
        let a = MeshAdmission::new("me", "digest", []);
        assert!(a.hello("digest", "peer", named("peer")).is_ok());
        // Another cluster is refused whatever else is wrong.
        assert!(matches!(
            a.hello("other", "me", named("x")),
            Err(HelloRefusal::AnotherCluster)
        ));
        assert!(matches!(
            a.hello("digest", "me", named("me")),
            Err(HelloRefusal::SameName)
        ));
        assert!(matches!(
            a.hello("digest", "bad name!", named("bad name!")),
            Err(HelloRefusal::InvalidName)
        ));
        let e = a.hello("digest", "peer", named("other")).unwrap_err();
        assert!(matches!(
            e,
            HelloRefusal::Identity(IdentityError::Mismatch { .. })
        ));
        // The refusal's text is the reason sent to the peer.
        assert_eq!(HelloRefusal::AnotherCluster.to_string(), "another cluster");
        assert!(e.to_string().contains("its certificate names `other`"));
    }

    #[test]
    fn revoked_certificates_are_refused_until_the_list_changes() {
        let mut a = MeshAdmission::new("me", "digest", ["bad".to_string()]);
        assert_eq!(a.revoked(named("bad")), Some("bad".into()));
        assert_eq!(a.revoked(named("good")), None);
        // A certificate with no name is not revoked here; the hello refuses it.
        assert_eq!(a.revoked(Err(CertNameError::Missing)), None);
        a.set_denied(["good".to_string()]);
        assert_eq!(a.revoked(named("bad")), None);
        assert!(a.is_denied("good"));
        assert!(a.same_cluster("digest") && !a.same_cluster("other"));
    }

    #[test]
    fn node_traffic_needs_a_hello_and_cli_requests_do_not() {
        assert!(!needs_admission(StreamTag::Hello));
        assert!(!needs_admission(StreamTag::Cli));
        assert!(needs_admission(StreamTag::ActorSession));
        assert!(needs_admission(StreamTag::Gossip));
        assert!(needs_admission(StreamTag::Bulk));
    }

    #[test]
    fn one_connection_is_kept_per_pair() {
        let held = |same_connection, live, dialer| {
            Some(Held {
                same_connection,
                live,
                dialer,
            })
        };
        assert_eq!(
            join("a", "b", "b", None),
            Join::Insert { close_held: false }
        );
        assert_eq!(
            join("a", "b", "b", held(true, true, "b")),
            Join::AlreadyHeld
        );
        // a < b: a's connection is kept against b's ...
        assert_eq!(join("a", "b", "b", held(false, true, "a")), Join::KeepHeld);
        // ... and replaces b's, which is closed.
        assert_eq!(
            join("a", "b", "a", held(false, true, "b")),
            Join::Insert { close_held: true }
        );
        // A closed connection always gives way, and needs no closing.
        assert_eq!(
            join("a", "b", "b", held(false, false, "a")),
            Join::Insert { close_held: false }
        );
    }

    #[test]
    fn two_controls_are_a_conflict() {
        let control = [Role::Control];
        assert!(control_conflict(&control, &control));
        assert!(!control_conflict(&control, &[]));
        assert!(!control_conflict(&[], &control));
    }
}
