//! A node faced with hostile or broken peers on its UDP port: a TLS client with no certificate,
//! a client speaking another ALPN, a client with no ALPN, and garbage datagrams. None of them
//! gets in, and the node neither crashes nor stalls: a proper CLI request still succeeds. A
//! connection with a valid cluster certificate that never said hello gets no blob from the bulk
//! plane, a CLI blob body that lies about its length is refused, and so is a job's progress
//! reported by the CLI.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clawrl_actors::bulk::{BulkConfig, BulkPlane, ConnectError, PeerConnector};
use clawrl_actors::cli::{self, BlobReply, BlobRequest, CliReply, CliRequest};
use clawrl_actors::config::NodeConfig;
use clawrl_actors::node::{Node, NodeOptions};
use clawrl_actors::pki::{self, Identity, NODE_SERVER_NAME};
use clawrl_actors::transport::{self, StreamTag};

fn config(dir: &Path, name: &str) -> NodeConfig {
    let text = format!(
        "[node]\nname = \"{name}\"\nlisten = \"127.0.0.1:0\"\nroles = [\"env\"]\ndata_dir = \"data\"\n"
    );
    NodeConfig::parse(&text, &dir.join("cluster.toml")).unwrap()
}

/// The node's config with its actual (OS-picked) port, for the CLI client.
fn client_config(cfg: &NodeConfig, node: &Node) -> NodeConfig {
    let mut c = cfg.clone();
    c.listen = node.addr();
    c
}

async fn cli_works(cfg: &NodeConfig) {
    match cli::request(cfg, &CliRequest::Nodes, Duration::from_secs(10)).await {
        Ok(CliReply::Nodes(v)) => assert_eq!(v.nodes.len(), 1),
        other => panic!("node did not answer a proper request: {other:?}"),
    }
}

fn client_endpoint(tls: rustls::ClientConfig) -> quinn::Endpoint {
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    ep
}

/// Tries a CLI exchange over a connection made with `ep`; Ok means the node answered.
async fn try_exchange(ep: &quinn::Endpoint, addr: SocketAddr) -> Result<(), String> {
    let conn = ep
        .connect(addr, NODE_SERVER_NAME)
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, mut recv) = transport::open_tagged(&conn, StreamTag::Cli)
        .await
        .map_err(|e| e.to_string())?;
    transport::write_frame(&mut send, &CliRequest::Nodes)
        .await
        .map_err(|e| e.to_string())?;
    let _ = send.finish();
    transport::read_frame::<CliReply>(&mut recv)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_certificate_or_with_wrong_alpn_are_refused_and_garbage_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "hostile-target");
    let node = Node::start(&cfg, NodeOptions::default()).await.unwrap();
    let ccfg = client_config(&cfg, &node);
    let addr = node.addr();
    cli_works(&ccfg).await;

    let eph = pki::ephemeral_dir(&cfg.data_dir);
    let ca = Identity::load(
        &eph.join("ca.pem"),
        &eph.join("client.pem"),
        &eph.join("client.key"),
    )
    .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.ca.clone()).unwrap();

    // 1. No client certificate.
    let mut tls = rustls::ClientConfig::builder_with_provider(ring())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
    tls.alpn_protocols = vec![pki::ALPN.to_vec()];
    let ep = client_endpoint(tls);
    let r = tokio::time::timeout(Duration::from_secs(10), try_exchange(&ep, addr)).await;
    assert!(
        matches!(r, Ok(Err(_))),
        "a peer without certificate was served: {r:?}"
    );

    // 2. A valid certificate but another ALPN, and no ALPN at all.
    for alpn in [vec![b"h3".to_vec()], vec![]] {
        let mut tls = ca.client_config(&[]).unwrap();
        tls.alpn_protocols = alpn.clone();
        let ep = client_endpoint(tls);
        let r = tokio::time::timeout(Duration::from_secs(10), try_exchange(&ep, addr)).await;
        assert!(matches!(r, Ok(Err(_))), "ALPN {alpn:?} was served: {r:?}");
    }

    // 3. Garbage datagrams of every size, including ones that look like QUIC long headers.
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..2000usize {
        let len = 1 + (i * 37) % 1400;
        let mut buf = vec![0u8; len];
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        if i % 3 == 0 {
            buf[0] = 0xc0 | (buf[0] & 0x0f); // long header, random version
        }
        let _ = sock.send_to(&buf, addr);
    }

    // 4. The node still serves its cluster's client, promptly.
    cli_works(&ccfg).await;
    let ok_tls = ca.client_config(&[pki::ALPN]).unwrap();
    let ep = client_endpoint(ok_tls);
    tokio::time::timeout(Duration::from_secs(10), try_exchange(&ep, addr))
        .await
        .expect("node stalled")
        .expect("node refused a proper client");

    // 5. A stream with an unknown tag and one that never sends a tag do not disturb it.
    let conn = ep.connect(addr, NODE_SERVER_NAME).unwrap().await.unwrap();
    let (mut s1, _r1) = conn.open_bi().await.unwrap();
    s1.write_all(&[0x7f, 1, 2, 3]).await.unwrap();
    let (_s2, _r2) = conn.open_bi().await.unwrap();
    cli_works(&ccfg).await;
    node.shutdown().await;
}

/// Lends the bulk plane one fixed connection, whoever the peer is.
struct Fixed(quinn::Connection);

impl PeerConnector for Fixed {
    fn connection(
        &self,
        _peer: &str,
    ) -> impl std::future::Future<Output = Result<quinn::Connection, ConnectError>> + Send {
        let c = self.0.clone();
        async move { Ok(c) }
    }
}

fn ephemeral_client(cfg: &NodeConfig) -> Identity {
    let eph = pki::ephemeral_dir(&cfg.data_dir);
    Identity::load(
        &eph.join("ca.pem"),
        &eph.join("client.pem"),
        &eph.join("client.key"),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_stream_from_a_peer_that_never_said_hello_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "bulk-target");
    let node = Node::start(&cfg, NodeOptions::default()).await.unwrap();
    let secret = Bytes::from(vec![0x5a; 3 << 20]);
    let id = node.bulk().publish(secret.clone()).unwrap();

    // A certificate of this cluster (the CLI's) and the right ALPN, but no hello: the node has
    // admitted no peer on this connection.
    let ep = client_endpoint(ephemeral_client(&cfg).client_config(&[pki::ALPN]).unwrap());
    let conn = ep
        .connect(node.addr(), NODE_SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let thief = BulkPlane::new(Fixed(conn.clone()), BulkConfig::new("thief"));
    let r = tokio::time::timeout(Duration::from_secs(20), thief.fetch(id, "bulk-target"))
        .await
        .expect("the node neither served nor refused the bulk stream");
    assert!(
        r.is_err(),
        "a peer without hello fetched a blob over the bulk plane"
    );
    assert!(thief.get(&id).is_none());

    // The connection was only refused a stream: the node still answers it on the CLI stream.
    let (mut send, mut recv) = transport::open_tagged(&conn, StreamTag::Cli).await.unwrap();
    transport::write_frame(&mut send, &CliRequest::Nodes)
        .await
        .unwrap();
    let _ = send.finish();
    assert!(matches!(
        transport::read_frame::<CliReply>(&mut recv).await,
        Ok(CliReply::Nodes(_))
    ));
    node.shutdown().await;
}

/// Sends a `blob publish` request declaring `declared` bytes followed by `body`, and returns the
/// node's answer.
async fn publish_raw(conn: &quinn::Connection, declared: u64, body: &[u8]) -> CliReply {
    let (mut send, mut recv) = transport::open_tagged(conn, StreamTag::Cli).await.unwrap();
    let req = CliRequest::Blob(BlobRequest::Publish { len: declared });
    transport::write_frame(&mut send, &req).await.unwrap();
    // The node may stop reading as soon as it knows the body is refused.
    let _ = send.write_all(body).await;
    let _ = send.finish();
    tokio::time::timeout(Duration::from_secs(20), transport::read_frame(&mut recv))
        .await
        .expect("no answer to blob publish")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_blob_bodies_are_bounded_by_their_declared_length_and_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "blob-target");
    let node = Node::start(&cfg, NodeOptions::default()).await.unwrap();
    let ep = client_endpoint(ephemeral_client(&cfg).client_config(&[pki::ALPN]).unwrap());
    let conn = ep
        .connect(node.addr(), NODE_SERVER_NAME)
        .unwrap()
        .await
        .unwrap();

    // More bytes than declared, fewer, and a declared length over the cap: all refused, and
    // nothing is published.
    for (declared, body) in [(10u64, vec![1u8; 11]), (10, vec![1; 9])] {
        match publish_raw(&conn, declared, &body).await {
            CliReply::Error(e) => assert!(e.contains("declared"), "{e}"),
            other => panic!(
                "a {}-byte body declared as {declared} was taken: {other:?}",
                body.len()
            ),
        }
    }
    match publish_raw(&conn, u64::MAX, &[1; 1000]).await {
        CliReply::Error(e) => assert!(e.contains("cap"), "{e}"),
        other => panic!("a body over the cap was taken: {other:?}"),
    }
    assert_eq!(node.bulk().stats().blobs, 0);

    // An honest body, larger than a frame may be, is published, and saved back bit-exact.
    let data: Vec<u8> = (0..(5u32 << 20))
        .map(|i| (i * 7 + i / 4099) as u8)
        .collect();
    let id = match publish_raw(&conn, data.len() as u64, &data).await {
        CliReply::Blob(BlobReply::Published { id, len }) => {
            assert_eq!(len, data.len() as u64);
            id
        }
        other => panic!("an honest body was refused: {other:?}"),
    };
    let ccfg = client_config(&cfg, &node);
    let out = dir.path().join("saved.bin");
    let saved = cli::save_blob(&ccfg, &id, &out, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(saved.len, data.len() as u64);
    assert_eq!(saved.blake3, blake3::hash(&data).to_hex().to_string());
    assert!(std::fs::read(&out).unwrap() == data);
    node.shutdown().await;
}

/// A job's progress is reported to Control by its trainer node alone: the CLI's certificate may
/// ask Control anything else, but a `Progress` (which could mark a job finished) is refused by
/// the node before it reaches Control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_cannot_report_a_jobs_progress() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "progress-target");
    let node = Node::start(&cfg, NodeOptions::default()).await.unwrap();
    let ccfg = client_config(&cfg, &node);
    let fake = CliRequest::Control(clawrl_actors::control::ControlRequest::Progress {
        id: "job-1".into(),
        counts: Box::new(clawrl_actors::loops::job::JobCounts {
            phase: clawrl_actors::loops::job::JobPhase::Finished,
            ..Default::default()
        }),
    });
    match cli::request(&ccfg, &fake, Duration::from_secs(10)).await {
        Ok(CliReply::Error(e)) => assert!(e.contains("reported by its trainer node"), "{e}"),
        other => panic!("the CLI's progress report was not refused: {other:?}"),
    }
    // The node still answers the CLI.
    cli_works(&ccfg).await;
    node.shutdown().await;
}
