//! The rollout worker's version rules with a scripted policy replica (weights are a UTF-8 tag;
//! requests wait on a gate the test opens): in-flight requests finish on their version, new ones
//! get the new version, stale updates are ignored and counted, a failed update keeps the old
//! version serving, loads run off the message loop, and announced versions arrive over the bulk
//! plane on real QUIC endpoints.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use clawrl_actors::bulk::{BlobId, BulkConfig};
use clawrl_actors::loops::{
    PolicyReplica, RolloutArgs, RolloutMsg, RolloutStats, RolloutWorker, UpdateOutcome,
    WeightAnnounce,
};
use ractor::{Actor, ActorRef};
use tokio::sync::oneshot;

/// Weights are a tag; a tag starting with "corrupt" fails to load. `load_gate`, when set, makes
/// the next load block its (blocking) thread until the test releases it.
#[derive(Default)]
struct Scripted {
    load_gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Bad(String);

impl PolicyReplica for Scripted {
    /// Generation returns once the gate opens (a dropped sender opens it too).
    type Request = oneshot::Receiver<()>;
    type Output = String;
    type GenerateError = Bad;
    type Loaded = String;
    type LoadError = Bad;

    fn load(&self, version: u64, weights: &Bytes) -> Result<String, Bad> {
        if let Some(gate) = self.load_gate.lock().unwrap().take() {
            let _ = gate.recv();
        }
        let tag = std::str::from_utf8(weights).map_err(|e| Bad(e.to_string()))?;
        if tag.starts_with("corrupt") {
            return Err(Bad(format!(
                "tensor model.norm.weight of version {version} is corrupt"
            )));
        }
        Ok(tag.to_string())
    }

    async fn generate(
        &self,
        loaded: Arc<String>,
        gate: oneshot::Receiver<()>,
    ) -> Result<String, Bad> {
        let _ = gate.await;
        Ok(loaded.to_string())
    }
}

type Msg = RolloutMsg<Scripted>;

fn announce(version: u64, bytes: &[u8]) -> WeightAnnounce {
    WeightAnnounce {
        version,
        blob: BlobId([version as u8; 32]),
        size: bytes.len() as u64,
        source: "trainer".into(),
    }
}

async fn worker(
    policy: Arc<Scripted>,
    source: Option<Arc<dyn clawrl_actors::loops::WeightSource>>,
) -> ActorRef<Msg> {
    let initial = Some((1, Arc::new("w1".to_string())));
    let (actor, _) = Actor::spawn(
        None,
        RolloutWorker::<Scripted>::new(),
        RolloutArgs {
            policy,
            source,
            initial,
        },
    )
    .await
    .unwrap();
    actor
}

async fn install(w: &ActorRef<Msg>, version: u64, tag: &str) -> UpdateOutcome {
    let a = announce(version, tag.as_bytes());
    let bytes = Bytes::from(tag.as_bytes().to_vec());
    ractor::call!(w, |port| RolloutMsg::Install(a, bytes, Some(port))).unwrap()
}

/// Sends a request; returns its reply receiver and the gate that releases it.
fn start(
    w: &ActorRef<Msg>,
) -> (
    oneshot::Sender<()>,
    impl std::future::Future<Output = clawrl_actors::loops::Generated<String>>,
) {
    let (open, gate) = oneshot::channel();
    let (tx, rx) = oneshot::channel();
    let w = w.clone();
    tokio::spawn(async move {
        let r = ractor::call!(w, |port| RolloutMsg::Generate(gate, port)).unwrap();
        let _ = tx.send(r);
    });
    (open, async move { rx.await.unwrap().unwrap() })
}

async fn stats(w: &ActorRef<Msg>) -> RolloutStats {
    ractor::call!(w, RolloutMsg::Stats).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_finish_on_their_version_and_new_ones_get_the_new_one() {
    let w = worker(Arc::default(), None).await;
    let (open1, old) = start(&w);
    // Wait until the request is in flight on version 1.
    while stats(&w).await.in_flight < 1 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        install(&w, 2, "w2").await,
        UpdateOutcome::Switched { version: 2 }
    );
    let (open2, new) = start(&w);
    drop(open2);
    let new = new.await;
    assert_eq!(
        (new.version, new.output.as_str(), new.serving_at_finish),
        (2, "w2", 2)
    );
    open1.send(()).unwrap();
    let old = old.await;
    assert_eq!(
        (old.version, old.output.as_str(), old.serving_at_finish),
        (1, "w1", 2)
    );
    let s = stats(&w).await;
    assert_eq!(
        (
            s.version,
            s.requests,
            s.completed,
            s.failed,
            s.in_flight,
            s.switches
        ),
        (Some(2), 2, 2, 0, 0, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_or_equal_versions_are_ignored_and_counted() {
    let w = worker(Arc::default(), None).await;
    assert_eq!(
        install(&w, 3, "w3").await,
        UpdateOutcome::Switched { version: 3 }
    );
    assert_eq!(
        install(&w, 2, "w2").await,
        UpdateOutcome::Stale {
            version: 2,
            newest: 3
        }
    );
    assert_eq!(
        install(&w, 3, "w3-again").await,
        UpdateOutcome::Stale {
            version: 3,
            newest: 3
        }
    );
    let (open, r) = start(&w);
    drop(open);
    assert_eq!(r.await.output, "w3");
    let s = stats(&w).await;
    assert_eq!((s.version, s.stale_updates, s.switches), (Some(3), 2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_update_keeps_the_old_version_serving_and_is_reported() {
    let w = worker(Arc::default(), None).await;
    // Bytes that do not have the announced size.
    let a = announce(2, b"w2");
    let out = ractor::call!(w, |port| RolloutMsg::Install(
        a,
        Bytes::from_static(b"w2-tampered"),
        Some(port)
    ))
    .unwrap();
    let UpdateOutcome::Failed { version: 2, error } = out else {
        panic!("{out:?}")
    };
    assert!(
        error.contains("11 bytes, the announcement says 2"),
        "{error}"
    );
    // Bytes of the announced size that do not load.
    let out = install(&w, 2, "corrupt-2").await;
    let UpdateOutcome::Failed { error, .. } = out else {
        panic!("{out:?}")
    };
    assert!(error.contains("model.norm.weight"), "{error}");
    // An announcement with no weight source configured.
    let out = ractor::call!(w, |port| RolloutMsg::Announce(
        announce(2, b"w2"),
        Some(port)
    ))
    .unwrap();
    let UpdateOutcome::Failed { error, .. } = out else {
        panic!("{out:?}")
    };
    assert!(error.contains("no weight source"), "{error}");

    let (open, r) = start(&w);
    drop(open);
    assert_eq!(r.await.version, 1);
    let s = stats(&w).await;
    assert_eq!((s.version, s.failed_updates, s.failed), (Some(1), 3, 0));
    assert!(s.last_update_error.unwrap().contains("no weight source"));
    // A later good version still applies.
    assert_eq!(
        install(&w, 2, "w2").await,
        UpdateOutcome::Switched { version: 2 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_run_off_the_message_loop_and_newer_updates_supersede_waiting_ones() {
    let policy = Arc::new(Scripted::default());
    let (release, gate) = std::sync::mpsc::channel();
    *policy.load_gate.lock().unwrap() = Some(gate);
    let w = worker(policy, None).await;

    let (tx2, rx2) = oneshot::channel();
    let a2 = announce(2, b"w2");
    w.cast(RolloutMsg::Install(
        a2,
        Bytes::from_static(b"w2"),
        Some(tx2.into()),
    ))
    .unwrap();
    // While version 2's load is blocked, requests are served on version 1.
    for _ in 0..3 {
        let (open, r) = start(&w);
        drop(open);
        assert_eq!(r.await.version, 1);
    }
    assert_eq!(stats(&w).await.loading, Some(2));
    // 3 then 4 arrive during the load: 3 waits, then 4 replaces it.
    let (tx3, rx3) = oneshot::channel();
    w.cast(RolloutMsg::Install(
        announce(3, b"w3"),
        Bytes::from_static(b"w3"),
        Some(tx3.into()),
    ))
    .unwrap();
    let (tx4, rx4) = oneshot::channel();
    w.cast(RolloutMsg::Install(
        announce(4, b"w4"),
        Bytes::from_static(b"w4"),
        Some(tx4.into()),
    ))
    .unwrap();
    assert_eq!(
        rx3.await.unwrap(),
        UpdateOutcome::Superseded { version: 3, by: 4 }
    );
    release.send(()).unwrap();
    assert_eq!(rx2.await.unwrap(), UpdateOutcome::Switched { version: 2 });
    assert_eq!(rx4.await.unwrap(), UpdateOutcome::Switched { version: 4 });
    let (open, r) = start(&w);
    drop(open);
    assert_eq!(r.await.output, "w4");
    let s = stats(&w).await;
    assert_eq!((s.switches, s.superseded_updates, s.loading), (2, 1, None));
}

/// Two nodes on loopback, `trainer` and `replica`, with 64 KiB chunks.
fn trainer_and_replica() -> (crate::loopback::Node, crate::loopback::Node) {
    let ca = crate::loopback::TestCa::new();
    let book = crate::loopback::Book::default();
    let mut cfg = BulkConfig::new("unset");
    cfg.chunk_size = 64 << 10;
    let trainer = crate::loopback::node(&ca, &book, "trainer", cfg.clone());
    let replica = crate::loopback::node(&ca, &book, "replica", cfg);
    (trainer, replica)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_versions_are_fetched_over_the_bulk_plane_and_verified() {
    let (trainer, replica) = trainer_and_replica();
    let weights = format!("w2{}", "x".repeat(300_000));
    let blob = trainer.plane.publish(Bytes::from(weights.clone())).unwrap();
    let mut a = announce(2, weights.as_bytes());
    a.blob = blob;
    let w = worker(Arc::default(), Some(Arc::new(replica.plane.clone()))).await;

    // A blob of another size than announced is refused after the (chunk-verified) transfer.
    let mut bad = a.clone();
    bad.size += 1;
    let out = ractor::call!(w, |port| RolloutMsg::Announce(bad, Some(port))).unwrap();
    let UpdateOutcome::Failed { version: 2, error } = out else {
        panic!("{out:?}")
    };
    assert!(error.contains("the announcement says"), "{error}");
    // An unknown blob is a fetch error naming it.
    let mut unknown = a.clone();
    unknown.blob = BlobId([9; 32]);
    let out = ractor::call!(w, |port| RolloutMsg::Announce(unknown, Some(port))).unwrap();
    let UpdateOutcome::Failed { error, .. } = out else {
        panic!("{out:?}")
    };
    assert!(error.contains(&BlobId([9; 32]).to_string()), "{error}");

    let out = ractor::call_t!(w, |port| RolloutMsg::Announce(a, Some(port)), 20_000).unwrap();
    assert_eq!(out, UpdateOutcome::Switched { version: 2 });
    let (open, r) = start(&w);
    drop(open);
    assert_eq!(r.await.output, weights);
    assert_eq!(replica.plane.get(&blob).unwrap(), weights.as_bytes());
}

/// A replica node keeps the versions it serves, not every version it fetched: once a newer
/// version serves, the older one's blob leaves its store (the trainer's copy stays), and so
/// does the blob of a version that failed to load. A worker on the trainer's own node leaves
/// the trainer's published blobs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_node_lets_go_of_versions_it_no_longer_serves() {
    let (trainer, replica) = trainer_and_replica();
    let version = |v: u64, prefix: &str| {
        let weights = format!("{prefix}w{v}{}", "x".repeat(200_000));
        let blob = trainer.plane.publish(Bytes::from(weights.clone())).unwrap();
        let mut a = announce(v, weights.as_bytes());
        a.blob = blob;
        a
    };
    let (v2, v3) = (version(2, ""), version(3, ""));
    let broken = version(4, "corrupt");
    let on = |w: &ActorRef<Msg>, a: &WeightAnnounce| {
        let (w, a) = (w.clone(), a.clone());
        async move { ractor::call_t!(w, |port| RolloutMsg::Announce(a, Some(port)), 20_000).unwrap() }
    };

    let w = worker(Arc::default(), Some(Arc::new(replica.plane.clone()))).await;
    assert_eq!(on(&w, &v2).await, UpdateOutcome::Switched { version: 2 });
    assert!(replica.plane.get(&v2.blob).is_some());
    assert_eq!(on(&w, &v3).await, UpdateOutcome::Switched { version: 3 });
    assert!(replica.plane.get(&v2.blob).is_none(), "v2 is still stored");
    assert!(
        replica.plane.get(&v3.blob).is_some(),
        "the serving v3 left the store"
    );
    assert!(matches!(
        on(&w, &broken).await,
        UpdateOutcome::Failed { version: 4, .. }
    ));
    assert!(replica.plane.get(&broken.blob).is_none());
    assert!(replica.plane.get(&v3.blob).is_some());
    for a in [&v2, &v3, &broken] {
        assert!(
            trainer.plane.get(&a.blob).is_some(),
            "the trainer's copy went"
        );
    }

    let beside = worker(Arc::default(), Some(Arc::new(trainer.plane.clone()))).await;
    assert_eq!(
        on(&beside, &v2).await,
        UpdateOutcome::Switched { version: 2 }
    );
    assert_eq!(
        on(&beside, &v3).await,
        UpdateOutcome::Switched { version: 3 }
    );
    assert!(trainer.plane.get(&v2.blob).is_some());
}
