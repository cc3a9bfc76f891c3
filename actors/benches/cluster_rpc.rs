//! Remote request/reply round trips per second: the same `ractor_cluster` call messages carried
//! over clawrl's QUIC transport (mutual TLS, one bidirectional stream per node session) versus
//! `ractor_cluster`'s own TCP transport, plain and with TLS. Loopback, one process, two node
//! servers per transport. The transports run interleaved (QUIC, TCP, TCP + TLS, then again) for
//! `CLUSTER_BENCH_ROUNDS` rounds (default 3) of `CLUSTER_BENCH_SECS` seconds a measure (default
//! 2); the medians of each and the medians of the per-round ratios are printed, with the load
//! average before and after (a ratio taken while other work shares the machine is not a
//! result). Run with `cargo bench -p clawrl-actors --bench cluster_rpc`.
//!
//! Both nodes run on one tokio runtime, multi-threaded as a node's is (two workers on two
//! cores); `CLUSTER_BENCH_RUNTIME=current_thread` runs them on one thread instead, which takes
//! the wake-ups between worker threads out of every round trip and leaves each transport's own
//! cost. `CLUSTER_BENCH_ONLY=<transport>` (`quic+tls`, `tcp` or `tcp+tls`) runs that transport
//! alone, with no ratios: for profiling one side, for example under `perf record`.
//! `CLUSTER_BENCH_PAYLOADS` (request sizes in bytes, comma-separated; default `64,16384`) and
//! `CLUSTER_BENCH_WIDTH` (concurrent callers, default 32; 0 measures one at a time only)
//! narrow a run the same way.

#[path = "support/measure.rs"]
mod measure;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl_actors::pki::{self, Identity, NODE_SERVER_NAME};
use clawrl_actors::rpc::Rpc;
use clawrl_actors::transport::{self, QuicBidi, StreamTag};
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::node::NodeConnectionMode;
use ractor_cluster::{IncomingEncryptionMode, NodeServer, NodeServerMessage};

use measure::{env, median, print_load};

/// A request whose reply is its own bytes.
trait Request: ractor::Message + Sync {
    fn new(body: Vec<u8>, reply: RpcReplyPort<Vec<u8>>) -> Self;
    fn parts(self) -> (Vec<u8>, RpcReplyPort<Vec<u8>>);
}

/// Over QUIC: clawrl's own request, which the receiving node stamps with its caller and the
/// receiver refuses unstamped (part of what our transport costs).
impl Request for Rpc {
    fn new(body: Vec<u8>, reply: RpcReplyPort<Vec<u8>>) -> Self {
        Rpc::local(body, reply)
    }
    fn parts(self) -> (Vec<u8>, RpcReplyPort<Vec<u8>>) {
        (self.request, self.reply)
    }
}

/// Over ractor's TCP transports, which carry no caller stamp: the same call frame as [`Rpc`]'s
/// (variant, body and reply port), with no stamp required.
struct Ping(Vec<u8>, RpcReplyPort<Vec<u8>>);

const PING: &str = "bench.ping";

impl ractor::Message for Ping {
    fn serializable() -> bool {
        true
    }
    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        Ok(SerializedMessage::Call {
            variant: PING.to_string(),
            args: self.0,
            reply: self.1,
            metadata: None,
        })
    }
    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match bytes {
            SerializedMessage::Call {
                variant,
                args,
                reply,
                ..
            } if variant == PING => Ok(Ping(args, reply)),
            _ => Err(BoxedDowncastErr),
        }
    }
}

impl Request for Ping {
    fn new(body: Vec<u8>, reply: RpcReplyPort<Vec<u8>>) -> Self {
        Ping(body, reply)
    }
    fn parts(self) -> (Vec<u8>, RpcReplyPort<Vec<u8>>) {
        (self.0, self.1)
    }
}

/// Replies with the request bytes.
struct Echo<M>(std::marker::PhantomData<M>);

fn echo_actor<M>() -> Echo<M> {
    Echo(std::marker::PhantomData)
}

impl<M: Request> Actor for Echo<M> {
    type Msg = M;
    type State = ();
    type Arguments = String;
    async fn pre_start(&self, me: ActorRef<M>, group: String) -> Result<(), ActorProcessingErr> {
        ractor::pg::join(group, vec![me.get_cell()]);
        Ok(())
    }
    async fn handle(&self, _: ActorRef<M>, msg: M, _: &mut ()) -> Result<(), ActorProcessingErr> {
        let (body, reply) = msg.parts();
        let _ = reply.send(body);
        Ok(())
    }
}

async fn node_server(
    name: &str,
    port: u16,
    enc: Option<IncomingEncryptionMode>,
) -> ActorRef<NodeServerMessage> {
    let server = NodeServer::new(
        port,
        "bench-cookie".into(),
        name.into(),
        "bench".into(),
        enc,
        Some(NodeConnectionMode::Isolated),
    )
    .with_listen_addr(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    Actor::spawn(None, server, ()).await.unwrap().0
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for the remote proxy of the echo actor in `group` (the member that is not local).
async fn remote_member(group: &str) -> ActorCell {
    let start = Instant::now();
    loop {
        if let Some(m) = ractor::pg::get_members(&group.to_string())
            .into_iter()
            .find(|m| !m.get_id().is_local())
        {
            return m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no remote member in {group}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// (sequential round trips/s, pipelined round trips/s with `width` callers).
async fn measure<M: Request>(
    target: &ActorCell,
    payload: usize,
    width: usize,
    dur: Duration,
) -> (f64, f64) {
    let actor: ActorRef<M> = target.clone().into();
    let body = vec![7u8; payload];
    // Warm-up.
    for _ in 0..200 {
        call(&actor, &body).await;
    }
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < dur {
        call(&actor, &body).await;
        n += 1;
    }
    let seq = n as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..width {
        let a = actor.clone();
        let b = body.clone();
        set.spawn(async move {
            let mut k = 0u64;
            while start.elapsed() < dur {
                call(&a, &b).await;
                k += 1;
            }
            k
        });
    }
    let mut total = 0u64;
    while let Some(k) = set.join_next().await {
        total += k.unwrap();
    }
    (seq, total as f64 / start.elapsed().as_secs_f64())
}

async fn call<M: Request>(actor: &ActorRef<M>, body: &[u8]) {
    let request = body.to_vec();
    match actor
        .call(|reply| M::new(request, reply), Some(Duration::from_secs(5)))
        .await
        .unwrap()
    {
        ractor::rpc::CallResult::Success(r) => assert_eq!(r.len(), body.len()),
        other => panic!("call failed: {other:?}"),
    }
}

/// One transport's node servers and echo actor; torn down before the next transport so that
/// remote proxies of one transport are never picked by another.
struct Setup {
    target: ActorCell,
    actors: Vec<ActorCell>,
    quic: Option<(quinn::Connection, quinn::Endpoint)>,
}

impl Setup {
    /// Stops this transport's actors and waits until its sessions are gone: every actor
    /// stopped and no remote proxy left in any group (a live session of this transport would
    /// otherwise also carry the next transport's groups, and a call could take it).
    async fn teardown(self) {
        for a in &self.actors {
            a.stop(None);
        }
        if let Some((conn, ep)) = self.quic {
            conn.close(0u32.into(), b"done");
            ep.close(0u32.into(), b"done");
        }
        let start = Instant::now();
        loop {
            let stopped = self
                .actors
                .iter()
                .all(|a| a.get_status() == ractor::ActorStatus::Stopped);
            let proxies = ractor::pg::which_groups().into_iter().any(|g| {
                ractor::pg::get_members(&g)
                    .iter()
                    .any(|m| !m.get_id().is_local())
            });
            if stopped && !proxies {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "sessions still up 30 s after teardown"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn identity(dir: &std::path::Path, name: &str) -> Identity {
    Identity::load(
        &dir.join("ca.pem"),
        &dir.join(format!("{name}.pem")),
        &dir.join(format!("{name}.key")),
    )
    .unwrap()
}

async fn setup_tcp(tls: Option<(Identity, Identity)>, tag: &str) -> Setup {
    let port = free_tcp_port();
    let enc = tls.as_ref().map(|(server, _)| {
        IncomingEncryptionMode::Tls(tokio_rustls::TlsAcceptor::from(Arc::new(
            server.server_config(&[]).unwrap(),
        )))
    });
    let a = node_server(&format!("{tag}-a"), port, enc).await;
    let b = node_server(&format!("{tag}-b"), 0, None).await;
    let group = format!("bench.{tag}");
    let (echo, _) = Actor::spawn(None, echo_actor::<Ping>(), group.clone())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let addr = format!("127.0.0.1:{port}");
    match tls {
        Some((_, client)) => {
            let cfg = client.client_config(&[]).unwrap();
            let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
            let name = rustls::pki_types::ServerName::try_from(NODE_SERVER_NAME).unwrap();
            ractor_cluster::client_connect_enc(&b, addr, connector, name)
                .await
                .unwrap();
        }
        None => ractor_cluster::client_connect(&b, addr).await.unwrap(),
    }
    Setup {
        target: remote_member(&group).await,
        actors: vec![a.get_cell(), b.get_cell(), echo.get_cell()],
        quic: None,
    }
}

async fn setup_quic(dir: &std::path::Path) -> Setup {
    let a = node_server("quic-a", 0, None).await;
    let b = node_server("quic-b", 0, None).await;
    let server_ep =
        transport::endpoint(&identity(dir, "a"), "127.0.0.1:0".parse().unwrap(), true).unwrap();
    let client_ep =
        transport::endpoint(&identity(dir, "b"), "127.0.0.1:0".parse().unwrap(), false).unwrap();
    let addr: SocketAddr = server_ep.local_addr().unwrap();
    let a2 = a.clone();
    tokio::spawn(async move {
        let conn = server_ep.accept().await.unwrap().await.unwrap();
        let (send, mut recv) = conn.accept_bi().await.unwrap();
        let mut tag = [0u8; 1];
        recv.read_exact(&mut tag).await.unwrap();
        assert_eq!(tag[0], StreamTag::ActorSession as u8);
        a2.cast(NodeServerMessage::ConnectionOpenedExternal {
            stream: Box::new(QuicBidi::new(
                send,
                recv,
                "b".into(),
                "b".into(),
                "a".into(),
            )),
            is_server: true,
        })
        .unwrap();
        conn.closed().await;
    });
    let group = "bench.quic".to_string();
    let (echo, _) = Actor::spawn(None, echo_actor::<Rpc>(), group.clone())
        .await
        .unwrap();
    let conn = client_ep
        .connect(addr, NODE_SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let (send, recv) = transport::open_tagged(&conn, StreamTag::ActorSession)
        .await
        .unwrap();
    b.cast(NodeServerMessage::ConnectionOpenedExternal {
        stream: Box::new(QuicBidi::new(
            send,
            recv,
            "a".into(),
            "a".into(),
            "b".into(),
        )),
        is_server: false,
    })
    .unwrap();
    let target = remote_member(&group).await;
    // Discovery latency: a member joining a group on one node, seen through the other node's
    // session (the session is up, so this is pure propagation).
    let late = "bench.quic.late".to_string();
    let t = Instant::now();
    let (late_echo, _) = Actor::spawn(None, echo_actor::<Rpc>(), late.clone())
        .await
        .unwrap();
    remote_member(&late).await;
    println!(
        "group join visible through the QUIC session after {:?}",
        t.elapsed()
    );
    late_echo.stop(None);
    Setup {
        target,
        actors: vec![a.get_cell(), b.get_cell(), echo.get_cell()],
        quic: Some((conn, client_ep)),
    }
}

const TRANSPORTS: [&str; 3] = ["quic+tls", "tcp", "tcp+tls"];
/// Request sizes measured unless `CLUSTER_BENCH_PAYLOADS` says otherwise.
const PAYLOADS: [usize; 2] = [64, 16 << 10];

/// `CLUSTER_BENCH_PAYLOADS` as sizes, or [`PAYLOADS`].
fn payloads() -> Vec<usize> {
    let Ok(list) = std::env::var("CLUSTER_BENCH_PAYLOADS") else {
        return PAYLOADS.to_vec();
    };
    list.split(',')
        .map(|p| match p.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => panic!("CLUSTER_BENCH_PAYLOADS={list}: expected sizes in bytes, like 64,16384"),
        })
        .collect()
}

fn main() {
    let runtime = std::env::var("CLUSTER_BENCH_RUNTIME").unwrap_or_else(|_| "multi_thread".into());
    let rt = match runtime.as_str() {
        "multi_thread" => tokio::runtime::Builder::new_multi_thread(),
        "current_thread" => tokio::runtime::Builder::new_current_thread(),
        other => panic!(
            "CLUSTER_BENCH_RUNTIME={other}: expected multi_thread (the default) or current_thread"
        ),
    }
    .enable_all()
    .build()
    .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        pki::init_cluster(dir.path(), &["a".into(), "b".into()]).unwrap();
        let dur = Duration::from_secs(env("CLUSTER_BENCH_SECS", 2));
        let rounds = env("CLUSTER_BENCH_ROUNDS", 3).max(1) as usize;
        let width = env("CLUSTER_BENCH_WIDTH", 32) as usize;
        let payloads = payloads();
        let only = std::env::var("CLUSTER_BENCH_ONLY").ok();
        if let Some(t) = &only {
            assert!(
                TRANSPORTS.contains(&t.as_str()),
                "CLUSTER_BENCH_ONLY={t}: expected one of {TRANSPORTS:?}"
            );
        }
        println!(
            "remote request/reply over ractor_cluster sessions, loopback, {dur:?} per measure, \
             {rounds} interleaved rounds, {runtime} runtime"
        );
        print_load("before");
        println!(
            "{:<6} {:<10} {:>8} {:>16} {:>22}",
            "round",
            "transport",
            "payload",
            "sequential rt/s",
            format!("{width} concurrent rt/s")
        );
        // rates[transport][payload] = one (sequential, concurrent) pair per round.
        let mut rates = vec![vec![Vec::new(); payloads.len()]; TRANSPORTS.len()];
        for round in 1..=rounds {
            for (t, name) in TRANSPORTS.iter().enumerate() {
                if only.as_ref().is_some_and(|o| o != name) {
                    continue;
                }
                let setup = match *name {
                    "quic+tls" => setup_quic(dir.path()).await,
                    "tcp" => setup_tcp(None, "tcp").await,
                    _ => {
                        setup_tcp(
                            Some((identity(dir.path(), "a"), identity(dir.path(), "b"))),
                            "tls",
                        )
                        .await
                    }
                };
                for (p, payload) in payloads.iter().enumerate() {
                    let m = if t == 0 {
                        measure::<Rpc>(&setup.target, *payload, width, dur).await
                    } else {
                        measure::<Ping>(&setup.target, *payload, width, dur).await
                    };
                    println!("{round:<6} {name:<10} {payload:>8} {:>16.0} {:>22.0}", m.0, m.1);
                    rates[t][p].push(m);
                }
                setup.teardown().await;
            }
        }
        println!("medians over {rounds} rounds:");
        for (t, name) in TRANSPORTS.iter().enumerate() {
            for (p, payload) in payloads.iter().enumerate() {
                let r = &rates[t][p];
                if r.is_empty() {
                    continue;
                }
                println!(
                    "{:<6} {name:<10} {payload:>8} {:>16.0} {:>22.0}",
                    "",
                    median(r.iter().map(|m| m.0).collect()),
                    median(r.iter().map(|m| m.1).collect())
                );
            }
        }
        // Ratios need every transport (none when one ran alone).
        for (t, name) in TRANSPORTS
            .iter()
            .enumerate()
            .skip(1)
            .filter(|_| only.is_none())
        {
            for (p, payload) in payloads.iter().enumerate() {
                let (q, r) = (&rates[0][p], &rates[t][p]);
                let ratio = |f: fn(&(f64, f64)) -> f64| {
                    median(q.iter().zip(r).map(|(a, b)| f(a) / f(b)).collect())
                };
                println!(
                    "ratio quic+tls / {name:<8} payload {payload:>6}: sequential {:.2}, concurrent {:.2} \
                     (medians of per-round ratios)",
                    ratio(|m| m.0),
                    ratio(|m| m.1)
                );
            }
        }
        print_load("after");
    });
}
