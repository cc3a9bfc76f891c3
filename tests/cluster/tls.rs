//! Mutual TLS between node processes: a node whose certificate comes from another cluster CA is
//! refused (and the refusal is logged), and neither side lists the other. A node's name is the
//! identity in its certificate: a node presenting another node's certificate, or the CLI's
//! client certificate, is refused whichever side dials, with a log line naming both names.

use std::time::Duration;

use super::util::*;

#[test]
fn a_node_with_a_certificate_from_another_ca_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = init_certs(&dir.path().join("good"), &["g1", "g2"]);
    let evil = init_certs(&dir.path().join("evil"), &["x"]);
    let (p1, p2, px) = (free_port(), free_port(), free_port());
    let g1 = write_config(dir.path(), "g1", p1, &[], &["control"], Some(&good));
    let g2 = write_config(dir.path(), "g2", p2, &[p1], &["env"], Some(&good));
    let x = write_config(dir.path(), "x", px, &[p1], &["env"], Some(&evil));
    let n1 = NodeProc::start("node", &g1, &[]);
    let _n2 = NodeProc::start("node", &g2, &[]);
    let nx = NodeProc::start("node", &x, &[]);

    wait_for(Duration::from_secs(20), || {
        view(&g1).filter(|v| node_names(v) == ["g1", "g2"])
    })
    .expect("g2 (same CA) should join g1");
    wait_for(Duration::from_secs(20), || {
        n1.log_text()
            .contains("refused connection from")
            .then_some(())
    })
    .unwrap_or_else(|| panic!("g1 never logged the refusal:\n{}", n1.log_text()));
    // x keeps redialing; it is still out.
    assert_eq!(node_names(&view(&g1).unwrap()), ["g1", "g2"]);
    assert_eq!(node_names(&view(&x).unwrap()), ["x"]);
    assert!(
        !nx.log_text().contains("peer `g1` joined"),
        "{}",
        nx.log_text()
    );

    // A client that trusts this cluster's CA but presents another CA's certificate is refused.
    let wrong_client = dir.path().join("wrong-client.toml");
    let text = std::fs::read_to_string(&g1).unwrap()
        + &format!(
            "client_cert = \"{0}/client.pem\"\nclient_key = \"{0}/client.key\"\n",
            evil.display()
        );
    std::fs::write(&wrong_client, text).unwrap();
    let out = clawrl(&["nodes", "--config", wrong_client.to_str().unwrap()]);
    assert!(
        !out.status.success(),
        "a client of another CA got an answer"
    );
    // ... while this cluster's own client certificate works.
    clawrl_ok(&["nodes", "--config", g1.to_str().unwrap()]);
}

/// Makes the config of node `own` use the certificate and key issued to `cert` instead.
fn use_certificate(config: &std::path::Path, own: &str, cert: &str) {
    let text = std::fs::read_to_string(config)
        .unwrap()
        .replace(&format!("/{own}.pem\""), &format!("/{cert}.pem\""))
        .replace(&format!("/{own}.key\""), &format!("/{cert}.key\""));
    assert!(text.contains(&format!("/{cert}.key\"")), "{text}");
    std::fs::write(config, text).unwrap();
}

#[test]
fn a_node_is_admitted_only_under_the_name_in_its_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let certs = init_certs(dir.path(), &["a", "b", "c"]);
    // `cluster init` makes the directory and every private key owner-only.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&certs), 0o700);
        for k in ["ca.key", "a.key", "b.key", "c.key", "client.key"] {
            assert_eq!(mode(&certs.join(k)), 0o600, "{k}");
        }
    }
    let (pa, pb, pc, pd) = (free_port(), free_port(), free_port(), free_port());
    // `a` dials `c` (the dialing side checks), `d` dials `a` (the accepting side checks).
    let a = write_config(dir.path(), "a", pa, &[pc], &["control"], Some(&certs));
    let b = write_config(dir.path(), "b", pb, &[pa], &["env"], Some(&certs));
    // `c` runs with `b`'s certificate, `d` with the CLI's client certificate.
    let c = write_config(dir.path(), "c", pc, &[], &["env"], Some(&certs));
    use_certificate(&c, "c", "b");
    let d = write_config(dir.path(), "d", pd, &[pa], &["env"], Some(&certs));
    use_certificate(&d, "d", "client");
    let na = NodeProc::start("node", &a, &[]);
    let _nb = NodeProc::start("node", &b, &[]);
    let _nc = NodeProc::start("node", &c, &[]);
    let _nd = NodeProc::start("node", &d, &[]);

    wait_for(Duration::from_secs(20), || {
        view(&a).filter(|v| node_names(v).contains(&"b".to_string()))
    })
    .expect("b (its own certificate) should join a");
    for (who, line) in [
        ("c", "refused `c` at 127.0.0.1:"),
        ("d", "refused `d` from 127.0.0.1:"),
    ] {
        wait_for(Duration::from_secs(20), || {
            na.log_text().contains(line).then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "a never logged refusing {who} (a sees {:?}):\n{}",
                view(&a).map(|v| node_names(&v)),
                na.log_text()
            )
        });
    }
    let log = na.log_text();
    assert!(
        log.contains("it claims to be `c` but its certificate names `b`"),
        "{log}"
    );
    assert!(
        log.contains("it claims to be `d` but its certificate names `client`"),
        "{log}"
    );
    // They keep trying; they stay out.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(node_names(&view(&a).unwrap()), ["a", "b"]);
    assert_eq!(node_names(&view(&b).unwrap()), ["a", "b"]);
    assert_eq!(node_names(&view(&d).unwrap()), ["d"]);

    // A node cannot take the client certificate's name either: its config is refused.
    let e = write_config(
        dir.path(),
        "client",
        free_port(),
        &[pa],
        &["env"],
        Some(&certs),
    );
    let mut ne = NodeProc::start("node", &e, &[]);
    wait_for(Duration::from_secs(20), || (!ne.alive()).then_some(()))
        .expect("a node named `client` started");
    assert!(ne.log_text().contains("reserved"), "{}", ne.log_text());

    // The client certificate still does what it is for: CLI requests.
    clawrl_ok(&["nodes", "--config", a.to_str().unwrap()]);
}

/// Revocation: `[tls] deny` in a node's config, re-read on SIGHUP, closes a revoked node's
/// existing connection at once and refuses its certificate afterwards (it keeps redialing and
/// is refused); a config that no longer loads keeps the list in force.
#[test]
fn a_denied_node_is_cut_off_on_sighup_and_refused_after() {
    let dir = tempfile::tempdir().unwrap();
    let certs = init_certs(dir.path(), &["a", "b"]);
    let (pa, pb) = (free_port(), free_port());
    let a = write_config(dir.path(), "a", pa, &[], &["control"], Some(&certs));
    let b = write_config(dir.path(), "b", pb, &[pa], &["env"], Some(&certs));
    let na = NodeProc::start("node", &a, &[]);
    let nb = NodeProc::start("node", &b, &[]);
    wait_for(Duration::from_secs(30), || {
        view(&a).filter(|v| node_names(v) == ["a", "b"])
    })
    .unwrap_or_else(|| panic!("b never joined:\n{}\n{}", na.log_text(), nb.log_text()));

    // A bad name in the list is refused when the file is read, naming the key.
    let good = std::fs::read_to_string(&a).unwrap();
    std::fs::write(&a, good.clone() + "deny = [\"b c\"]\n").unwrap();
    na.hangup();
    wait_for(Duration::from_secs(30), || {
        na.log_text().contains("tls.deny[0]").then_some(())
    })
    .unwrap_or_else(|| panic!("a bad deny list was not named:\n{}", na.log_text()));
    // The CLI reads the same file, so the good one goes back before asking a for its view.
    std::fs::write(&a, &good).unwrap();
    assert_eq!(node_names(&view(&a).unwrap()), ["a", "b"]);

    std::fs::write(&a, good + "deny = [\"b\"]\n").unwrap();
    let revoked_at = std::time::Instant::now();
    na.hangup();
    wait_for(Duration::from_secs(30), || {
        view(&a).filter(|v| node_names(v) == ["a"])
    })
    .unwrap_or_else(|| panic!("b was not cut off:\n{}", na.log_text()));
    eprintln!(
        "b left a's view {:?} after the SIGHUP",
        revoked_at.elapsed()
    );
    // b redials and is refused at the handshake's end.
    wait_for(Duration::from_secs(30), || {
        na.log_text().contains("refused `b` from").then_some(())
    })
    .unwrap_or_else(|| panic!("b's redial was not refused:\n{}", na.log_text()));
    assert_eq!(node_names(&view(&a).unwrap()), ["a"]);
}
