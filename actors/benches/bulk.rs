//! Bulk plane benchmark on loopback, figures printed as ratios of sides run in the same
//! invocation:
//! - blob throughput to one receiver against a TLS 1.3 stream over TCP (rustls, the same
//!   cluster certificates, mutual authentication) and against plain TCP carrying the same
//!   bytes (targets ≥ 0.8 and ≥ 0.5). The three sides run interleaved (TCP, TLS, QUIC, then
//!   again) for `BULK_BENCH_ROUNDS` rounds (default 3); the medians and the median of the
//!   per-round ratios are reported, with the CPU-seconds each side's process spent per GiB
//!   moved (sender and receiver together: both ends live in this process), to tell a CPU
//!   limit from a wire limit;
//! - broadcast of the blob to 4 receivers vs to 1 receiver (target ≤ 1.3; a naive star is ~4).
//!
//! All nodes share one machine here, so the raw loopback figures are bound by its CPU (every
//! receiver decrypts, every relay re-encrypts). A second part therefore caps each node's
//! uplink (a token bucket on its UDP sends, `BULK_BENCH_UPLINK_MIB` MiB/s, default 40) to
//! emulate separate machines, and compares the relay chain with a star (fan-out 4).
//!
//! `BULK_BENCH_MIB` (default 256) sets the blob size, `BULK_BENCH_CHUNK_KIB` (default 1024) the
//! chunk size, `BULK_BENCH_FANOUT` (default 1, a chain) the relay fan-out, `BULK_BENCH_CAPPED=0`
//! skips the capped part. The load average is printed before and after; a ratio taken while
//! other work shares the machine is not a result.

#[path = "../tests/runtime/loopback.rs"]
mod loopback;
#[path = "support/measure.rs"]
mod measure;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clawrl_actors::bulk::BulkConfig;
use loopback::{node_capped, random_bytes, tls_configs, Book, Node, TestCa};
use measure::{env, median, print_load};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// One timed transfer: wall time and the CPU-seconds this process spent on it.
#[derive(Clone, Copy)]
struct Run {
    wall: Duration,
    cpu: f64,
}

/// Writes `data` to `w` in 1 MiB writes while `read` fills a receiver-side buffer; the clock
/// starts after the connection is set up (as the QUIC side's warm-up does for its handshake).
async fn copy_timed<R, W>(
    data: &Bytes,
    mut w: W,
    read: tokio::task::JoinHandle<(Vec<u8>, R)>,
) -> Run
where
    R: Send + 'static,
    W: AsyncWrite + Unpin,
{
    let (start, cpu) = (Instant::now(), cpu_seconds());
    for chunk in data.chunks(1 << 20) {
        w.write_all(chunk).await.unwrap();
    }
    w.shutdown().await.unwrap();
    let (got, _) = read.await.unwrap();
    let run = Run {
        wall: start.elapsed(),
        cpu: cpu_seconds() - cpu,
    };
    assert!(got[..] == data[..]);
    run
}

async fn read_into<S: AsyncRead + Unpin>(len: usize, mut s: S) -> (Vec<u8>, S) {
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).await.unwrap();
    (buf, s)
}

/// Copies `data` over a loopback TCP connection into a receiver-side buffer.
async fn tcp_copy(data: &Bytes) -> Run {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let len = data.len();
    let sender = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (receiver, _) = listener.accept().await.unwrap();
    let read = tokio::spawn(read_into(len, receiver));
    copy_timed(data, sender, read).await
}

/// Copies `data` over a loopback TLS 1.3 stream on TCP (rustls with the ring provider, mutual
/// authentication with certificates from `ca`: what the QUIC side's handshake also does).
async fn tls_copy(data: &Bytes, ca: &TestCa) -> Run {
    let (server, _) = tls_configs(ca, "receiver");
    let (_, client) = tls_configs(ca, "sender");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let len = data.len();
    let accept = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        acceptor.accept(tcp).await.unwrap()
    });
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("receiver").unwrap();
    let sender = connector.connect(name, tcp).await.unwrap();
    let receiver = accept.await.unwrap();
    let read = tokio::spawn(read_into(len, receiver));
    copy_timed(data, sender, read).await
}

/// Broadcasts a fresh blob of `len` bytes from a new source to `receivers` new nodes and
/// returns the wall time of the broadcast (connections warmed up first).
async fn broadcast(
    len: usize,
    receivers: usize,
    seed: u64,
    config: &BulkConfig,
    uplink: Option<f64>,
) -> (Run, u64) {
    let ca = TestCa::new();
    let book = Book::default();
    let source = node_capped(&ca, &book, "src", config.clone(), uplink);
    let nodes: Vec<Node> = (0..receivers)
        .map(|i| node_capped(&ca, &book, &format!("r{i}"), config.clone(), uplink))
        .collect();
    let targets: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    // Warm-up: handshakes along the relay path.
    let warm = source
        .plane
        .publish(Bytes::from(random_bytes(64 << 10, seed + 1000)))
        .unwrap();
    source.plane.broadcast(warm, &targets).await.unwrap();
    let sent_before = source.plane.stats().bytes_sent;

    let data = Bytes::from(random_bytes(len, seed));
    let id = source.plane.publish(data.clone()).unwrap();
    let (start, cpu) = (Instant::now(), cpu_seconds());
    source.plane.broadcast(id, &targets).await.unwrap();
    let run = Run {
        wall: start.elapsed(),
        cpu: cpu_seconds() - cpu,
    };
    println!(
        "  broadcast to {receivers} (fan-out {}): {:.3} s wall, {:.2} CPU-s used by this process",
        config.fanout,
        run.wall.as_secs_f64(),
        run.cpu
    );
    for c in source.connections.lock().unwrap().values() {
        let st = c.stats();
        println!(
            "  source connection: mtu {} sent {} datagrams, lost {} packets, rtt {:?}, cwnd {}",
            st.path.current_mtu,
            st.udp_tx.datagrams,
            st.path.lost_packets,
            st.path.rtt,
            st.path.cwnd
        );
    }
    for n in &nodes {
        assert!(n.plane.get(&id).unwrap() == data, "{} differs", n.name);
    }
    (run, source.plane.stats().bytes_sent - sent_before)
}

/// User + system CPU seconds this process has used (Linux `/proc/self/stat`; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn rate(len: usize, d: Duration) -> String {
    format!(
        "{:.0} MiB/s",
        len as f64 / (1 << 20) as f64 / d.as_secs_f64()
    )
}

/// One side's runs over the rounds: median throughput and CPU-seconds per GiB moved.
fn summary(name: &str, len: usize, runs: &[Run]) -> f64 {
    let secs = median(runs.iter().map(|r| r.wall.as_secs_f64()).collect());
    let gib = len as f64 / (1u64 << 30) as f64;
    let cpu = median(runs.iter().map(|r| r.cpu / gib).collect());
    let each: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{:.0}",
                len as f64 / (1 << 20) as f64 / r.wall.as_secs_f64()
            )
        })
        .collect();
    println!(
        "{name:<26}: median {:>8.3} s  {}  {cpu:.2} CPU-s/GiB  (rounds, MiB/s: {})",
        secs,
        rate(len, Duration::from_secs_f64(secs)),
        each.join(", ")
    );
    secs
}

/// The median over rounds of `reference`'s time over `ours` (a throughput ratio).
fn ratio(ours: &[Run], reference: &[Run]) -> f64 {
    median(
        ours.iter()
            .zip(reference)
            .map(|(o, r)| r.wall.as_secs_f64() / o.wall.as_secs_f64())
            .collect(),
    )
}

fn main() {
    let mib = env("BULK_BENCH_MIB", 256) as usize;
    let len = mib << 20;
    let rounds = env("BULK_BENCH_ROUNDS", 3).max(1);
    let mut config = BulkConfig::new("unset");
    config.chunk_size = (env("BULK_BENCH_CHUNK_KIB", 1024) << 10) as u32;
    config.fanout = env("BULK_BENCH_FANOUT", 1) as usize;
    config.capacity = 2 * len as u64 + (64 << 20);
    config.max_blob = config.capacity;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!(
            "bulk bench: {mib} MiB blob, {} KiB chunks, fan-out {}, {} cores, {rounds} rounds",
            config.chunk_size >> 10,
            config.fanout,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        print_load("before");
        let ca = TestCa::new();
        let (mut tcp, mut tls, mut one) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let data = Bytes::from(random_bytes(len, 10 + round));
            tcp.push(tcp_copy(&data).await);
            tls.push(tls_copy(&data, &ca).await);
            one.push(broadcast(len, 1, 20 + round, &config, None).await.0);
        }
        let (four, source_sent) = broadcast(len, 4, 3, &config, None).await;
        summary("plain TCP copy", len, &tcp);
        summary("TLS 1.3 over TCP copy", len, &tls);
        let one_secs = summary("blob to 1 receiver (QUIC)", len, &one);
        println!(
            "blob to 4 receivers       : {:>8.3} s  {}  {:.2} CPU-s/GiB received  (source sent {:.2} copies)",
            four.wall.as_secs_f64(),
            rate(len, four.wall),
            four.cpu / (4.0 * len as f64 / (1u64 << 30) as f64),
            source_sent as f64 / len as f64
        );
        println!(
            "ratio throughput 1 receiver / TLS over TCP : {:.2}  (median of rounds; target >= 0.8)",
            ratio(&one, &tls)
        );
        println!(
            "ratio throughput 1 receiver / plain TCP    : {:.2}  (median of rounds; target >= 0.5)",
            ratio(&one, &tcp)
        );
        println!(
            "ratio time 4 receivers / 1                 : {:.2}  (target <= 1.3)",
            four.wall.as_secs_f64() / one_secs
        );
        print_load("after the uncapped part");
        if env("BULK_BENCH_CAPPED", 1) == 0 {
            return;
        }

        let uplink = env("BULK_BENCH_UPLINK_MIB", 40);
        let cap = Some((uplink << 20) as f64);
        println!("with every node's uplink capped at {uplink} MiB/s:");
        let (c1, _) = broadcast(len, 1, 4, &config, cap).await;
        let (c4, c4_sent) = broadcast(len, 4, 5, &config, cap).await;
        let mut star = config.clone();
        star.fanout = 4;
        let (s4, s4_sent) = broadcast(len, 4, 6, &star, cap).await;
        println!(
            "capped, blob to 1 receiver             : {:>8.3} s  {}",
            c1.wall.as_secs_f64(),
            rate(len, c1.wall)
        );
        println!(
            "capped, blob to 4 (fan-out {})          : {:>8.3} s  {}  (source sent {:.2} copies)",
            config.fanout,
            c4.wall.as_secs_f64(),
            rate(len, c4.wall),
            c4_sent as f64 / len as f64
        );
        println!(
            "capped, blob to 4 (star, fan-out 4)    : {:>8.3} s  {}  (source sent {:.2} copies)",
            s4.wall.as_secs_f64(),
            rate(len, s4.wall),
            s4_sent as f64 / len as f64
        );
        println!(
            "ratio time 4 receivers / 1, capped uplinks: {:.2} relayed, {:.2} star  (target <= 1.3)",
            c4.wall.as_secs_f64() / c1.wall.as_secs_f64(),
            s4.wall.as_secs_f64() / c1.wall.as_secs_f64()
        );
        print_load("after");
    });
}
