//! Multi-process cluster tests on loopback: nodes started from the built binary form a full mesh
//! over QUIC, process groups span them, remote calls round-trip, jobs are placed on environment
//! slots of several nodes (including ones attached later), and a SIGKILLed node leaves and
//! rejoins.

use std::time::{Duration, Instant};

use super::util::*;

const JOIN_LIMIT: Duration = Duration::from_secs(20);

#[test]
fn three_nodes_mesh_groups_span_them_calls_round_trip_and_jobs_use_attached_slots() {
    let dir = tempfile::tempdir().unwrap();
    let certs = init_certs(dir.path(), &["a", "b", "c", "d"]);
    let (pa, pb, pc, pd) = (free_port(), free_port(), free_port(), free_port());
    let a = write_config(
        dir.path(),
        "a",
        pa,
        &[],
        &["control", "trainer"],
        Some(&certs),
    );
    // b knows only a; c knows only b: the mesh must close through gossip.
    let b = write_config(dir.path(), "b", pb, &[pa], &["env"], Some(&certs));
    let c = write_config(dir.path(), "c", pc, &[pb], &["env", "judge"], Some(&certs));
    let d = write_config(dir.path(), "d", pd, &[pc], &["env"], Some(&certs));
    let _na = NodeProc::start("node", &a, &[]);
    let _nb = NodeProc::start("node", &b, &["--env", "terminal:2"]);
    let _nc = NodeProc::start("node", &c, &["--env", "terminal:2"]);

    // Every node sees all three nodes and the groups spanning them.
    for cfg in [&a, &b, &c] {
        let v = wait_for(JOIN_LIMIT, || {
            view(cfg).filter(|v| {
                node_names(v) == ["a", "b", "c"]
                    && members(v, "clawrl.nodes") == ["a/node", "b/node", "c/node"]
                    && members(v, "clawrl.envhost.terminal")
                        == ["b/envhost.terminal", "c/envhost.terminal"]
            })
        })
        .unwrap_or_else(|| panic!("{} never saw the full mesh: {:?}", cfg.display(), view(cfg)));
        assert_eq!(members(&v, "clawrl.control"), ["a/control"]);
        let c_node = v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == "c")
            .unwrap();
        assert_eq!(c_node["roles"], serde_json::json!(["judge", "env"]));
        assert_eq!(c_node["envs"], serde_json::json!(["terminal:2"]));
        assert!(c_node["addr"]
            .as_str()
            .unwrap()
            .ends_with(&format!(":{pc}")));
    }

    // A remote call round-trips: a pings every member, those on b and c are remote.
    let pings: serde_json::Value = serde_json::from_str(&clawrl_ok(&[
        "ping",
        "--config",
        a.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    let pinged: Vec<&str> = pings
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["ok"].as_bool() == Some(true))
        .map(|p| p["member"].as_str().unwrap())
        .collect();
    for m in ["a/node", "b/node", "c/node"] {
        assert!(pinged.contains(&m), "{m} did not answer: {pings}");
    }

    // A job submitted through c is placed by Control on a, with the slots b and c offer.
    let job = dir.path().join("job.toml");
    std::fs::write(&job, job_spec(6)).unwrap();
    let out = clawrl_ok(&[
        "submit",
        job.to_str().unwrap(),
        "--config",
        c.to_str().unwrap(),
    ]);
    let id = out.split_whitespace().next().unwrap().to_string();
    assert_eq!(id, "job-1");
    let s = job_status(&b, &id);
    assert_eq!(s["state"], "Partial", "{s}");
    assert_eq!(s["placement"]["trainer"], "a");
    assert_eq!(s["placement"]["env_slots"].as_array().unwrap().len(), 4);

    // A process attached at runtime offers its slots, and the running job uses them.
    let _nd = NodeProc::start("attach", &d, &["--env", "terminal:2"]);
    let s = wait_for(JOIN_LIMIT, || {
        let s = job_status(&a, &id);
        (s["state"] == "Placed").then_some(s)
    })
    .unwrap_or_else(|| panic!("job never used the attached slots: {}", job_status(&a, &id)));
    let workers: Vec<&str> = s["placement"]["env_slots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert!(
        workers.contains(&"d/env.terminal.0") && workers.contains(&"d/env.terminal.1"),
        "{s}"
    );
    let v = view(&b).unwrap();
    assert_eq!(node_names(&v), ["a", "b", "c", "d"]);

    // Cancelling frees the slots.
    clawrl_ok(&["cancel", &id, "--config", b.to_str().unwrap()]);
    let s = job_status(&c, &id);
    assert_eq!(s["state"], "Cancelled");
    assert!(s["placement"]["env_slots"].as_array().unwrap().is_empty());
}

#[test]
fn a_killed_node_leaves_within_5s_others_keep_working_and_it_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let certs = init_certs(dir.path(), &["k1", "k2", "k3"]);
    let (p1, p2, p3) = (free_port(), free_port(), free_port());
    let c1 = write_config(
        dir.path(),
        "k1",
        p1,
        &[p2, p3],
        &["control", "trainer", "env"],
        Some(&certs),
    );
    let c2 = write_config(dir.path(), "k2", p2, &[p1], &["env"], Some(&certs));
    let c3 = write_config(dir.path(), "k3", p3, &[p1], &["env"], Some(&certs));
    let _n1 = NodeProc::start("node", &c1, &["--env", "terminal:1"]);
    let _n2 = NodeProc::start("node", &c2, &["--env", "terminal:1"]);
    let mut n3 = NodeProc::start("node", &c3, &["--env", "terminal:1"]);
    for cfg in [&c1, &c2] {
        wait_for(JOIN_LIMIT, || {
            view(cfg).filter(|v| members(v, "clawrl.envhost.terminal").len() == 3)
        })
        .unwrap_or_else(|| panic!("no full mesh at {}", cfg.display()));
    }

    n3.kill();
    let killed = Instant::now();
    for cfg in [&c1, &c2] {
        wait_for(Duration::from_secs(10), || {
            view(cfg).filter(|v| {
                node_names(v) == ["k1", "k2"]
                    && !members(v, "clawrl.envhost.terminal")
                        .iter()
                        .any(|m| m.starts_with("k3/"))
                    && !members(v, "clawrl.nodes")
                        .iter()
                        .any(|m| m.starts_with("k3/"))
            })
        })
        .unwrap_or_else(|| panic!("k3 never left the view of {}", cfg.display()));
    }
    let gone = killed.elapsed();
    assert!(
        gone <= Duration::from_secs(5),
        "k3 left only after {gone:?}"
    );

    // The survivors keep working: remote calls between them still round-trip.
    let pings = clawrl_ok(&["ping", "--config", c2.to_str().unwrap(), "--json"]);
    assert!(
        pings.contains("k1/node") && !pings.contains("k3/"),
        "{pings}"
    );

    // Restarted, it rejoins (its seeds are k1 only; k2 learns of it by gossip or redial).
    let _n3 = NodeProc::start("node", &c3, &["--env", "terminal:1"]);
    for cfg in [&c1, &c2, &c3] {
        wait_for(JOIN_LIMIT, || {
            view(cfg).filter(|v| {
                node_names(v) == ["k1", "k2", "k3"]
                    && members(v, "clawrl.envhost.terminal").len() == 3
            })
        })
        .unwrap_or_else(|| panic!("k3 did not rejoin in the view of {}", cfg.display()));
    }
    let pings = clawrl_ok(&["ping", "--config", c2.to_str().unwrap()]);
    assert!(pings.contains("k3/node"), "{pings}");
}

#[test]
fn a_64_mib_blob_broadcast_from_one_node_arrives_bit_exact_at_three_others() {
    let dir = tempfile::tempdir().unwrap();
    let certs = init_certs(dir.path(), &["s", "r1", "r2", "r3"]);
    let ps = free_port();
    let src = write_config(dir.path(), "s", ps, &[], &["control"], Some(&certs));
    let _ns = NodeProc::start("node", &src, &[]);
    let mut receivers = Vec::new();
    for name in ["r1", "r2", "r3"] {
        let cfg = write_config(dir.path(), name, free_port(), &[ps], &["env"], Some(&certs));
        receivers.push((name, cfg.clone(), NodeProc::start("node", &cfg, &[])));
    }
    wait_for(JOIN_LIMIT, || {
        view(&src).filter(|v| node_names(v) == ["r1", "r2", "r3", "s"])
    })
    .expect("mesh never formed");

    // 64 MiB of deterministic pseudo-random bytes.
    let mut data = vec![0u8; 64 << 20];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let file = dir.path().join("blob.bin");
    std::fs::write(&file, &data).unwrap();
    let out = clawrl_ok(&[
        "blob",
        "publish",
        file.to_str().unwrap(),
        "--config",
        src.to_str().unwrap(),
    ]);
    let id = out.split_whitespace().next().unwrap().to_string();
    assert_eq!(out.split_whitespace().nth(1), Some("67108864"));

    let out = clawrl_ok(&[
        "blob",
        "broadcast",
        &id,
        "--to",
        "r1,r2,r3",
        "--config",
        src.to_str().unwrap(),
    ]);
    assert!(out.starts_with("delivered\t"), "{out}");
    for (name, cfg, _) in &receivers {
        let saved = dir.path().join(format!("{name}.bin"));
        clawrl_ok(&[
            "blob",
            "save",
            &id,
            saved.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
        ]);
        let got = std::fs::read(&saved).unwrap();
        assert!(got == data, "{name} holds different bytes");
    }
}
