//! Loopback bulk-plane nodes for the bulk tests and benchmark: real `quinn` endpoints on
//! 127.0.0.1 with mutual TLS from a throwaway CA made with rcgen, an address book mapping node
//! names to addresses, and an accept loop that routes `0x02`-tagged streams to the plane.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use clawrl_actors::bulk::wire::BULK_TAG;
use clawrl_actors::bulk::{BulkConfig, BulkPlane, ConnectError, PeerConnector};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// ALPN of clawrl node connections.
pub const ALPN: &[u8] = b"clawrl/1";

/// A test certificate authority.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "clawrl bulk test CA");
        let cert = params.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    pub fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// A certificate (valid for DNS name `name`, and naming `name` as its subject, which is the
    /// peer name the bulk plane's quota counts against) and key signed by this CA.
    pub fn issue(&self, name: &str) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (
            vec![cert.der().clone()],
            PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        )
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    clawrl_actors::bulk::tune_transport(&mut t);
    Arc::new(t)
}

/// A quinn endpoint on 127.0.0.1 that requires and presents certificates from `ca`.
pub fn endpoint(ca: &TestCa, name: &str) -> quinn::Endpoint {
    endpoint_capped(ca, name, None)
}

/// The rustls server and client configs of node `name` (TLS 1.3 only, mutual authentication
/// against `ca`, ALPN `clawrl/1`): what its QUIC endpoint uses, and what a TLS-over-TCP
/// reference stream uses in the bulk benchmark.
pub fn tls_configs(ca: &TestCa, name: &str) -> (rustls::ServerConfig, rustls::ClientConfig) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).unwrap();
    let roots = Arc::new(roots);
    let (chain, key) = ca.issue(name);

    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .unwrap();
    let mut server = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .unwrap();
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    client.alpn_protocols = vec![ALPN.to_vec()];
    (server, client)
}

/// Like [`endpoint`], with the node's outgoing bytes capped at `uplink` bytes/s when given
/// (emulates each node having its own network link instead of one shared loopback).
pub fn endpoint_capped(ca: &TestCa, name: &str, uplink: Option<f64>) -> quinn::Endpoint {
    let (server, client) = tls_configs(ca, name);
    let server = quinn::crypto::rustls::QuicServerConfig::try_from(server).unwrap();
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server));
    server.transport_config(transport());
    let client = quinn::crypto::rustls::QuicClientConfig::try_from(client).unwrap();
    let mut client = quinn::ClientConfig::new(Arc::new(client));
    client.transport_config(transport());

    let mut endpoint_config = quinn::EndpointConfig::default();
    clawrl_actors::bulk::tune_endpoint(&mut endpoint_config);
    let socket = clawrl_actors::bulk::bind_udp("127.0.0.1:0".parse().unwrap()).unwrap();
    let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
    let socket = runtime.wrap_udp_socket(socket).unwrap();
    let socket: Arc<dyn quinn::AsyncUdpSocket> = match uplink {
        Some(rate) => Arc::new(capped::Capped::new(socket, rate)),
        None => socket,
    };
    let mut ep =
        quinn::Endpoint::new_with_abstract_socket(endpoint_config, Some(server), socket, runtime)
            .unwrap();
    ep.set_default_client_config(client);
    ep
}

/// Name → address of every test node.
pub type Book = Arc<Mutex<HashMap<String, SocketAddr>>>;

/// Reaches peers by name through the address book, one cached connection per peer.
pub struct Peers {
    endpoint: quinn::Endpoint,
    book: Book,
    cache: Arc<Mutex<HashMap<String, quinn::Connection>>>,
}

impl PeerConnector for Peers {
    async fn connection(&self, peer: &str) -> Result<quinn::Connection, ConnectError> {
        if let Some(c) = self.cache.lock().unwrap().get(peer) {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        let addr = *self
            .book
            .lock()
            .unwrap()
            .get(peer)
            .ok_or_else(|| format!("no address for peer {peer}"))?;
        let conn = self.endpoint.connect(addr, peer)?.await?;
        self.cache
            .lock()
            .unwrap()
            .insert(peer.to_string(), conn.clone());
        Ok(conn)
    }
}

/// One loopback node: its endpoint, address and bulk plane.
pub struct Node {
    pub name: String,
    pub endpoint: quinn::Endpoint,
    pub addr: SocketAddr,
    pub plane: BulkPlane<Peers>,
    /// Connections this node opened, by peer name.
    pub connections: Arc<Mutex<HashMap<String, quinn::Connection>>>,
    /// Errors returned by `serve_stream` on this node, for assertions.
    pub serve_errors: Arc<Mutex<Vec<String>>>,
}

/// Starts a node named `name` with `config` (its `local_name` is overwritten) and registers
/// it in `book`.
pub fn node(ca: &TestCa, book: &Book, name: &str, config: BulkConfig) -> Node {
    node_capped(ca, book, name, config, None)
}

/// Like [`node`], with the node's uplink capped at `uplink` bytes/s when given.
pub fn node_capped(
    ca: &TestCa,
    book: &Book,
    name: &str,
    mut config: BulkConfig,
    uplink: Option<f64>,
) -> Node {
    config.local_name = name.to_string();
    let endpoint = endpoint_capped(ca, name, uplink);
    let addr = endpoint.local_addr().unwrap();
    book.lock().unwrap().insert(name.to_string(), addr);
    let connections = Arc::new(Mutex::new(HashMap::new()));
    let plane = BulkPlane::new(
        Peers {
            endpoint: endpoint.clone(),
            book: book.clone(),
            cache: connections.clone(),
        },
        config,
    );
    let serve_errors = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(accept_loop(
        endpoint.clone(),
        plane.clone(),
        serve_errors.clone(),
    ));
    Node {
        name: name.to_string(),
        endpoint,
        addr,
        plane,
        connections,
        serve_errors,
    }
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    plane: BulkPlane<Peers>,
    errors: Arc<Mutex<Vec<String>>>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let (plane, errors) = (plane.clone(), errors.clone());
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((send, mut recv)) = conn.accept_bi().await {
                let (plane, errors, conn) = (plane.clone(), errors.clone(), conn.clone());
                tokio::spawn(async move {
                    let mut tag = [0u8; 1];
                    if recv.read_exact(&mut tag).await.is_err() || tag[0] != BULK_TAG {
                        return;
                    }
                    let peer = clawrl_actors::transport::peer_name(&conn)
                        .unwrap_or_else(|_| "unnamed".into());
                    if let Err(e) = plane.serve_stream(&peer, send, recv).await {
                        errors.lock().unwrap().push(e.to_string());
                    }
                });
            }
        });
    }
}

/// `len` pseudo-random bytes (xorshift), different per `seed`.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A UDP socket whose sends are paced by a token bucket: a stand-in for a node's own network
/// link, so that a benchmark on one machine can show what relaying saves at the source.
mod capped {
    use std::fmt;
    use std::io::{self, IoSliceMut};
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};
    use std::time::{Duration, Instant};

    use quinn::udp::{RecvMeta, Transmit};
    use quinn::{AsyncUdpSocket, UdpPoller};

    /// Most bytes the bucket holds (the largest burst).
    const BURST: f64 = 256.0 * 1024.0;

    struct Bucket {
        tokens: f64,
        last: Instant,
    }

    pub struct Capped {
        inner: Arc<dyn AsyncUdpSocket>,
        rate: f64,
        bucket: Mutex<Bucket>,
    }

    impl fmt::Debug for Capped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "Capped({} B/s)", self.rate)
        }
    }

    impl Capped {
        pub fn new(inner: Arc<dyn AsyncUdpSocket>, rate: f64) -> Capped {
            Capped {
                inner,
                rate,
                bucket: Mutex::new(Bucket {
                    tokens: BURST,
                    last: Instant::now(),
                }),
            }
        }

        /// Refills the bucket; returns how long until it holds a positive amount.
        fn wait(&self) -> Duration {
            let mut b = self.bucket.lock().unwrap();
            let now = Instant::now();
            b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * self.rate).min(BURST);
            b.last = now;
            if b.tokens > 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(-b.tokens / self.rate) + Duration::from_micros(50)
            }
        }
    }

    impl AsyncUdpSocket for Capped {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            let inner = self.inner.clone().create_io_poller();
            Box::pin(CappedPoller {
                socket: self,
                inner,
                sleep: None,
            })
        }

        fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
            if !self.wait().is_zero() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.inner.try_send(transmit)?;
            self.bucket.lock().unwrap().tokens -= transmit.contents.len() as f64;
            Ok(())
        }

        fn poll_recv(
            &self,
            cx: &mut Context,
            bufs: &mut [IoSliceMut<'_>],
            meta: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            self.inner.poll_recv(cx, bufs, meta)
        }

        fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
            self.inner.local_addr()
        }

        fn max_transmit_segments(&self) -> usize {
            self.inner.max_transmit_segments()
        }

        fn max_receive_segments(&self) -> usize {
            self.inner.max_receive_segments()
        }

        fn may_fragment(&self) -> bool {
            self.inner.may_fragment()
        }
    }

    struct CappedPoller {
        socket: Arc<Capped>,
        inner: Pin<Box<dyn UdpPoller>>,
        sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    }

    impl fmt::Debug for CappedPoller {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("CappedPoller")
        }
    }

    impl UdpPoller for CappedPoller {
        fn poll_writable(mut self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
            loop {
                let wait = self.socket.wait();
                if wait.is_zero() {
                    self.sleep = None;
                    return self.inner.as_mut().poll_writable(cx);
                }
                let deadline = tokio::time::Instant::now() + wait;
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                sleep.as_mut().reset(deadline);
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
        }
    }

    use std::future::Future;
}
