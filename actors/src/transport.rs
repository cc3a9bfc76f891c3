//! The QUIC transport: one `quinn` endpoint per process, its wire conventions, and the adapter
//! that lets `ractor_cluster` node sessions run over QUIC bidirectional streams.
//!
//! Wire convention (shared with the bulk plane): ALPN [`crate::pki::ALPN`]; every bidirectional
//! stream starts with one tag byte ([`StreamTag`]) saying what the rest of the stream carries.
//! Small control messages ([`read_frame`], [`write_frame`]) are a `u32` big-endian length and a
//! `bincode` payload, capped at [`MAX_FRAME`].

use std::sync::Arc;
use std::time::Duration;

use quinn::{RecvStream, SendStream};
use ractor_cluster::{BoxRead, BoxWrite, ClusterBidiStream};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::pki::{Identity, PkiError, ALPN};

/// What a bidirectional stream carries, announced by its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamTag {
    /// A `ractor_cluster` node session (length-prefixed protobuf frames, as over TCP).
    ActorSession = 0x01,
    /// The bulk data plane (`crate::bulk`).
    Bulk = 0x02,
    /// Node hello: membership handshake (name, address, roles, known peers).
    Hello = 0x03,
    /// Gossip: a node's current peer list.
    Gossip = 0x04,
    /// A CLI request and its response.
    Cli = 0x05,
}

impl StreamTag {
    /// Decodes a tag byte.
    pub fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            0x01 => StreamTag::ActorSession,
            0x02 => StreamTag::Bulk,
            0x03 => StreamTag::Hello,
            0x04 => StreamTag::Gossip,
            0x05 => StreamTag::Cli,
            _ => return None,
        })
    }
}

/// Largest control frame accepted (hello, gossip, CLI messages).
pub const MAX_FRAME: u32 = 4 * 1024 * 1024;
/// A connection with no traffic for this long is dead (keep-alives are sent far more often).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3);
/// Keep-alive interval on every connection.
pub const KEEP_ALIVE: Duration = Duration::from_millis(500);

/// Errors of the framing helpers.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed.
    #[error("stream: {0}")]
    Io(#[from] std::io::Error),
    /// The peer announced a frame over the cap.
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte cap")]
    TooLarge(u32),
    /// The payload did not decode.
    #[error("malformed frame: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    /// The payload did not encode.
    #[error("encode: {0}")]
    Encode(#[from] bincode::error::EncodeError),
}

/// Writes one length-prefixed `bincode` frame.
pub async fn write_frame<T: Serialize>(send: &mut SendStream, value: &T) -> Result<(), FrameError> {
    let bytes = bincode::serde::encode_to_vec(value, bincode::config::standard())?;
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME)
        .ok_or(FrameError::TooLarge(u32::MAX))?;
    AsyncWriteExt::write_all(send, &len.to_be_bytes()).await?;
    AsyncWriteExt::write_all(send, &bytes).await?;
    Ok(())
}

/// Reads one length-prefixed `bincode` frame.
pub async fn read_frame<T: DeserializeOwned>(recv: &mut RecvStream) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    AsyncReadExt::read_exact(recv, &mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut buf = vec![0u8; len as usize];
    AsyncReadExt::read_exact(recv, &mut buf).await?;
    let (v, _) = bincode::serde::decode_from_slice(&buf, bincode::config::standard())?;
    Ok(v)
}

/// Opens a bidirectional stream and writes its tag byte.
pub async fn open_tagged(
    conn: &quinn::Connection,
    tag: StreamTag,
) -> Result<(SendStream, RecvStream), FrameError> {
    let (mut send, recv) = conn.open_bi().await.map_err(std::io::Error::from)?;
    AsyncWriteExt::write_all(&mut send, &[tag as u8]).await?;
    Ok((send, recv))
}

/// A QUIC bidirectional stream carrying one `ractor_cluster` node session with an
/// authenticated peer: what the peer sends is stamped with its node name ([`crate::stamp`]).
pub struct QuicBidi {
    send: SendStream,
    recv: RecvStream,
    caller: String,
    peer: String,
    local: String,
}

impl QuicBidi {
    /// Wraps a stream pair (its tag byte already consumed or written) with node `caller`, the
    /// name its certificate proves; `peer` and `local` are labels for logs.
    pub fn new(
        send: SendStream,
        recv: RecvStream,
        caller: String,
        peer: String,
        local: String,
    ) -> Self {
        QuicBidi {
            send,
            recv,
            caller,
            peer,
            local,
        }
    }
}

impl ClusterBidiStream for QuicBidi {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        (
            crate::stamp::stamped_reader(self.recv, self.caller),
            Box::new(self.send),
        )
    }
    fn peer_label(&self) -> Option<String> {
        Some(self.peer.clone())
    }
    fn local_label(&self) -> Option<String> {
        Some(self.local.clone())
    }
}

fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        IDLE_TIMEOUT
            .try_into()
            .expect("3 s is a valid idle timeout"),
    ));
    t.keep_alive_interval(Some(KEEP_ALIVE));
    t.max_concurrent_bidi_streams(1024u32.into());
    // Windows sized for bulk transfers (weights) sharing the connection.
    crate::bulk::tune_transport(&mut t);
    t
}

/// Errors building an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// Certificates or TLS setup failed.
    #[error(transparent)]
    Pki(#[from] PkiError),
    /// rustls config unusable for QUIC.
    #[error("QUIC TLS config: {0}")]
    Quic(String),
    /// The UDP socket could not be bound.
    #[error("bind {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The client-side QUIC config for `identity` (mutual TLS, ALPN `clawrl/1`).
pub fn client_config(identity: &Identity) -> Result<quinn::ClientConfig, EndpointError> {
    let tls = identity.client_config(&[ALPN])?;
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| EndpointError::Quic(e.to_string()))?;
    let mut c = quinn::ClientConfig::new(Arc::new(quic));
    c.transport_config(Arc::new(transport_config()));
    Ok(c)
}

/// Binds a QUIC endpoint at `addr`: a server requiring cluster client certificates when
/// `serve` is set, and a client presenting `identity` in every case.
pub fn endpoint(
    identity: &Identity,
    addr: std::net::SocketAddr,
    serve: bool,
) -> Result<quinn::Endpoint, EndpointError> {
    let server = if serve {
        let tls = identity.server_config(&[ALPN])?;
        let quic = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
            .map_err(|e| EndpointError::Quic(e.to_string()))?;
        let mut s = quinn::ServerConfig::with_crypto(Arc::new(quic));
        s.transport_config(Arc::new(transport_config()));
        Some(s)
    } else {
        None
    };
    // Large kernel buffers and datagrams: bulk transfers share this endpoint.
    let socket =
        crate::bulk::bind_udp(addr).map_err(|source| EndpointError::Bind { addr, source })?;
    let mut endpoint_config = quinn::EndpointConfig::default();
    crate::bulk::tune_endpoint(&mut endpoint_config);
    let runtime = quinn::default_runtime().ok_or_else(|| EndpointError::Bind {
        addr,
        source: std::io::Error::other("no async runtime"),
    })?;
    let mut ep = quinn::Endpoint::new(endpoint_config, server, socket, runtime)
        .map_err(|source| EndpointError::Bind { addr, source })?;
    ep.set_default_client_config(client_config(identity)?);
    Ok(ep)
}

/// The node name in the certificate the peer of `conn` presented ([`crate::pki::certificate_name`]
/// of the leaf; the handshake already verified the chain against the cluster CA).
pub fn peer_name(conn: &quinn::Connection) -> Result<String, crate::pki::CertNameError> {
    let chain = conn
        .peer_identity()
        .and_then(|id| {
            id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or(crate::pki::CertNameError::Missing)?;
    let leaf = chain.first().ok_or(crate::pki::CertNameError::Missing)?;
    crate::pki::certificate_name(leaf)
}

/// The ALPN a connection negotiated, if any.
pub fn negotiated_alpn(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.protocol)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_unknown_tags_are_rejected() {
        for t in [
            StreamTag::ActorSession,
            StreamTag::Bulk,
            StreamTag::Hello,
            StreamTag::Gossip,
            StreamTag::Cli,
        ] {
            assert_eq!(StreamTag::from_byte(t as u8), Some(t));
        }
        assert_eq!(StreamTag::from_byte(0), None);
        assert_eq!(StreamTag::from_byte(0xff), None);
    }
}
