//! Bulk plane benchmark on loopback (one run, figures printed as ratios):
//! - blob throughput to one receiver vs a plain TCP stream copying the same bytes (target ≥ 0.7);
//! - broadcast of the blob to 4 receivers vs to 1 receiver (target ≤ 1.3; a naive star is ~4).
//!
//! All nodes share one machine here, so the raw loopback figures are bound by its CPU (every
//! receiver decrypts, every relay re-encrypts). A second part therefore caps each node's
//! uplink (a token bucket on its UDP sends, `BULK_BENCH_UPLINK_MIB` MiB/s, default 40) to
//! emulate separate machines, and compares the relay chain with a star (fan-out 4).
//!
//! `BULK_BENCH_MIB` (default 256) sets the blob size, `BULK_BENCH_CHUNK_KIB` (default 1024) the
//! chunk size, `BULK_BENCH_FANOUT` (default 1, a chain) the relay fan-out.

#[path = "../tests/runtime/loopback.rs"]
mod loopback;

use std::time::{Duration, Instant};

use bytes::Bytes;
use clawrl_actors::bulk::BulkConfig;
use loopback::{node_capped, random_bytes, Book, Node, TestCa};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Copies `data` over a loopback TCP connection into a receiver-side buffer.
async fn tcp_copy(data: Bytes) -> Duration {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let len = data.len();
    let receiver = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await.unwrap();
        buf
    });
    let start = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    for chunk in data.chunks(1 << 20) {
        s.write_all(chunk).await.unwrap();
    }
    s.shutdown().await.unwrap();
    let got = receiver.await.unwrap();
    let took = start.elapsed();
    assert!(got[..] == data[..]);
    took
}

/// Broadcasts a fresh blob of `len` bytes from a new source to `receivers` new nodes and
/// returns the wall time of the broadcast (connections warmed up first).
async fn broadcast(
    len: usize,
    receivers: usize,
    seed: u64,
    config: &BulkConfig,
    uplink: Option<f64>,
) -> (Duration, u64) {
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
    let took = start.elapsed();
    println!(
        "  broadcast to {receivers} (fan-out {}): {:.3} s wall, {:.2} CPU-s used by this process",
        config.fanout,
        took.as_secs_f64(),
        cpu_seconds() - cpu
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
    (took, source.plane.stats().bytes_sent - sent_before)
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

fn main() {
    let mib = env("BULK_BENCH_MIB", 256);
    let len = mib << 20;
    let mut config = BulkConfig::new("unset");
    config.chunk_size = (env("BULK_BENCH_CHUNK_KIB", 1024) << 10) as u32;
    config.fanout = env("BULK_BENCH_FANOUT", 1);
    config.capacity = 2 * len as u64 + (64 << 20);
    config.max_blob = config.capacity;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!(
            "bulk bench: {mib} MiB blob, {} KiB chunks, fan-out {}, {} cores",
            config.chunk_size >> 10,
            config.fanout,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        let tcp = tcp_copy(Bytes::from(random_bytes(len, 1))).await;
        let (one, _) = broadcast(len, 1, 2, &config, None).await;
        let (four, source_sent) = broadcast(len, 4, 3, &config, None).await;
        println!(
            "plain TCP copy            : {:>8.3} s  {}",
            tcp.as_secs_f64(),
            rate(len, tcp)
        );
        println!(
            "blob to 1 receiver        : {:>8.3} s  {}",
            one.as_secs_f64(),
            rate(len, one)
        );
        println!(
            "blob to 4 receivers       : {:>8.3} s  {}  (source sent {:.2} copies)",
            four.as_secs_f64(),
            rate(len, four),
            source_sent as f64 / len as f64
        );
        println!(
            "ratio throughput 1 receiver / TCP : {:.2}  (target >= 0.7)",
            tcp.as_secs_f64() / one.as_secs_f64()
        );
        println!(
            "ratio time 4 receivers / 1        : {:.2}  (target <= 1.3)",
            four.as_secs_f64() / one.as_secs_f64()
        );

        let uplink = env("BULK_BENCH_UPLINK_MIB", 40);
        let cap = Some((uplink << 20) as f64);
        println!("with every node's uplink capped at {uplink} MiB/s:");
        let (c1, _) = broadcast(len, 1, 4, &config, cap).await;
        let (c4, c4_sent) = broadcast(len, 4, 5, &config, cap).await;
        let mut star = config.clone();
        star.fanout = 4;
        let (s4, s4_sent) = broadcast(len, 4, 6, &star, cap).await;
        println!("capped, blob to 1 receiver             : {:>8.3} s  {}", c1.as_secs_f64(), rate(len, c1));
        println!(
            "capped, blob to 4 (fan-out {})          : {:>8.3} s  {}  (source sent {:.2} copies)",
            config.fanout,
            c4.as_secs_f64(),
            rate(len, c4),
            c4_sent as f64 / len as f64
        );
        println!(
            "capped, blob to 4 (star, fan-out 4)    : {:>8.3} s  {}  (source sent {:.2} copies)",
            s4.as_secs_f64(),
            rate(len, s4),
            s4_sent as f64 / len as f64
        );
        println!(
            "ratio time 4 receivers / 1, capped uplinks: {:.2} relayed, {:.2} star  (target <= 1.3)",
            c4.as_secs_f64() / c1.as_secs_f64(),
            s4.as_secs_f64() / c1.as_secs_f64()
        );
    });
}
