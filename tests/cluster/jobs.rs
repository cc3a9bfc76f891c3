//! The root `cluster.toml` is a working single-node cluster, and job specs are validated with
//! errors that name the offending key and the file.

use std::time::Duration;

use super::util::*;

#[test]
fn root_cluster_toml_runs_a_single_node_that_takes_jobs_and_names_bad_keys() {
    let dir = tempfile::tempdir().unwrap();
    let root =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cluster.toml")).unwrap();
    let port = free_port();
    assert!(
        root.contains("127.0.0.1:7420"),
        "cluster.toml listen address changed"
    );
    let cfg = dir.path().join("cluster.toml");
    std::fs::write(
        &cfg,
        root.replace("127.0.0.1:7420", &format!("127.0.0.1:{port}")),
    )
    .unwrap();
    let node = NodeProc::start("node", &cfg, &["--env", "terminal:2"]);
    let v = wait_for(Duration::from_secs(20), || {
        view(&cfg).filter(|v| members(v, "clawrl.envhost.terminal") == ["local/envhost.terminal"])
    })
    .unwrap_or_else(|| panic!("single node never came up:\n{}", node.log_text()));
    assert_eq!(node_names(&v), ["local"]);
    assert_eq!(members(&v, "clawrl.control"), ["local/control"]);
    assert!(
        node.log_text().contains("EPHEMERAL cluster CA"),
        "{}",
        node.log_text()
    );

    let job = dir.path().join("job.toml");
    std::fs::write(&job, job_spec(2)).unwrap();
    let out = clawrl_ok(&[
        "submit",
        job.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ]);
    assert!(
        out.starts_with("job-1\tterminal-demo\tPlaced\ttrainer=local"),
        "{out}"
    );
    let all = clawrl_ok(&["status", "--config", cfg.to_str().unwrap()]);
    assert!(all.contains("job-1"), "{all}");

    // Bad specs: the error names the key and the file, and nothing is stored.
    let cases = [
        ("lr = 1e-6", "lr = 1e-6\nlearning_rate = 1", "learning_rate"),
        (
            "batch_size = 16",
            "batch_size = \"many\"",
            "optim.batch_size",
        ),
        ("votes = 3", "", "votes"),
        ("parallelism = 2", "parallelism = -1", "env.parallelism"),
    ];
    for (from, to, key) in cases {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, job_spec(2).replace(from, to)).unwrap();
        let out = clawrl(&[
            "submit",
            bad.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
        ]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(key) && err.contains("bad.toml"),
            "{key}: {err}"
        );
    }
    let unknown = clawrl(&["status", "job-99", "--config", cfg.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no job `job-99`"));
    let all = clawrl_ok(&["status", "--config", cfg.to_str().unwrap()]);
    // One job (the node may already be running it: its counts line follows).
    assert_eq!(
        all.lines().filter(|l| l.starts_with("job-")).count(),
        1,
        "{all}"
    );

    // A bad node config names the key and the file.
    let badcfg = dir.path().join("badnode.toml");
    std::fs::write(&badcfg, root.replace("data_dir", "datadir")).unwrap();
    let out = clawrl(&["nodes", "--config", badcfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("badnode.toml") && err.contains("datadir"),
        "{err}"
    );
}
