//! Sandbox benchmark: start latency p50/p99 (`true`, sequentially), the overhead of
//! the sandbox as a ratio against the same commands in an unsandboxed subprocess measured in
//! the same run, and execs/s with 1, 64 and 256 sandboxes in flight.
//!
//! Commands are given by absolute path so both sides run the same binaries.
//! `cargo bench --bench sandbox` (env `SANDBOX_BENCH_N` overrides the 200 sequential runs).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use clawrl::sandbox::{self, SandboxSpec};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn sandboxed(dir: &Path, argv: &[&str]) -> Duration {
    let spec = SandboxSpec::new(dir, argv.iter().map(|s| s.to_string()).collect());
    let t = Instant::now();
    let out = sandbox::exec(&spec).await.expect("sandbox exec");
    let d = t.elapsed();
    assert_eq!(out.exit_code, Some(0), "{argv:?}: {out:?}");
    d
}

async fn plain(dir: &Path, argv: &[&str]) -> Duration {
    let t = Instant::now();
    let out = tokio::process::Command::new(argv[0])
        .args(&argv[1..])
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("spawn");
    let d = t.elapsed();
    assert!(out.status.success(), "{argv:?}");
    d
}

struct Stats {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let mean = v.iter().sum::<Duration>() / v.len() as u32;
    Stats {
        p50: percentile(&v, 0.5),
        p99: percentile(&v, 0.99),
        mean,
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    if let Err(e) = sandbox::probe() {
        eprintln!("sandbox bench: sandboxes cannot start here: {e}");
        std::process::exit(1);
    }
    let n: usize = std::env::var("SANDBOX_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();

    // Warm up (page cache, the rustc sysroot lookup).
    for _ in 0..5 {
        sandboxed(dir, &["/usr/bin/true"]).await;
        plain(dir, &["/usr/bin/true"]).await;
    }

    println!("sandbox start latency (`true`, {n} sequential runs, interleaved with plain runs)");
    let mut sb = Vec::with_capacity(n);
    let mut pl = Vec::with_capacity(n);
    for _ in 0..n {
        sb.push(sandboxed(dir, &["/usr/bin/true"]).await);
        pl.push(plain(dir, &["/usr/bin/true"]).await);
    }
    let (s, p) = (stats(sb), stats(pl));
    println!(
        "  sandboxed: p50 {:.2} ms  p99 {:.2} ms  mean {:.2} ms",
        ms(s.p50),
        ms(s.p99),
        ms(s.mean)
    );
    println!(
        "  plain:     p50 {:.2} ms  p99 {:.2} ms  mean {:.2} ms",
        ms(p.p50),
        ms(p.p99),
        ms(p.mean)
    );
    println!(
        "  ratio (p50): {:.1}x, added latency (p50): {:.2} ms",
        s.p50.as_secs_f64() / p.p50.as_secs_f64(),
        ms(s.p50.saturating_sub(p.p50))
    );

    println!("\noverhead per command (mean of 20 runs each, sandboxed / plain)");
    let commands: &[(&str, &[&str])] = &[
        ("true", &["/usr/bin/true"]),
        (
            "sh loop 1000 echo",
            &[
                "/bin/sh",
                "-c",
                "i=0; while [ $i -lt 1000 ]; do echo $i; i=$((i+1)); done",
            ],
        ),
        ("python3 -c pass", &["/usr/bin/python3", "-c", "pass"]),
        (
            "python3 sum 10^7",
            &["/usr/bin/python3", "-c", "print(sum(range(10**7)))"],
        ),
        (
            "10 MB stdout",
            &["/bin/sh", "-c", "head -c 10000000 /dev/zero"],
        ),
    ];
    for (name, argv) in commands {
        let mut sb = Vec::new();
        let mut pl = Vec::new();
        for _ in 0..20 {
            sb.push(sandboxed(dir, argv).await);
            pl.push(plain(dir, argv).await);
        }
        let (s, p) = (stats(sb), stats(pl));
        println!(
            "  {name:<20} sandboxed {:>8.2} ms  plain {:>8.2} ms  ratio {:.2}",
            ms(s.mean),
            ms(p.mean),
            s.mean.as_secs_f64() / p.mean.as_secs_f64()
        );
    }

    println!("\nthroughput with sandboxes in flight (`true`)");
    for conc in [1usize, 64, 256] {
        let total = conc.max(64) * 2;
        let started = Instant::now();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(conc));
        let mut tasks = Vec::with_capacity(total);
        for _ in 0..total {
            let sem = sem.clone();
            let dir = dir.to_path_buf();
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.unwrap();
                sandboxed(&dir, &["/usr/bin/true"]).await
            }));
        }
        let mut lat = Vec::with_capacity(total);
        for t in tasks {
            lat.push(t.await.unwrap());
        }
        let wall = started.elapsed();
        let s = stats(lat);
        println!(
            "  {conc:>3} in flight: {:>7.1} execs/s  (latency p50 {:.1} ms, p99 {:.1} ms, {total} execs)",
            total as f64 / wall.as_secs_f64(),
            ms(s.p50),
            ms(s.p99)
        );
    }
}
