//! Mutual TLS between node processes: a node whose certificate comes from another cluster CA is
//! refused (and the refusal is logged), and neither side lists the other.

use std::time::Duration;

use crate::util::*;

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
