//! Bulk plane over real QUIC endpoints on loopback with mutual TLS: relayed broadcast arrives
//! bit-exact and the source sends about one copy; corrupt chunks, unknown blobs, garbage and
//! truncated streams are errors that name what is wrong, and the node keeps serving; one peer's
//! pushes in flight hold at most its quota of the store; a blob nothing holds any more is
//! received into again.

use crate::loopback::{node, random_bytes, Book, Node, TestCa};
use bytes::Bytes;
use clawrl_actors::bulk::wire::{self, FetchReply, PushAck, PushDone, Request, BULK_TAG};
use clawrl_actors::bulk::{BlobId, BroadcastError, BulkConfig, Manifest, TransferError};

const MIB: usize = 1 << 20;

fn config() -> BulkConfig {
    let mut c = BulkConfig::new("unset");
    c.capacity = 512 << 20;
    c
}

fn cluster(names: &[&str]) -> (TestCa, Book, Vec<Node>) {
    let ca = TestCa::new();
    let book = Book::default();
    let nodes = names
        .iter()
        .map(|n| node(&ca, &book, n, config()))
        .collect();
    (ca, book, nodes)
}

/// Opens a raw bulk stream from a fresh endpoint (certified by `ca`) to `to`.
async fn raw_stream(ca: &TestCa, to: &Node) -> (quinn::SendStream, quinn::RecvStream) {
    let ep = crate::loopback::endpoint(ca, "raw");
    let conn = ep.connect(to.addr, &to.name).unwrap().await.unwrap();
    let (mut send, recv) = conn.open_bi().await.unwrap();
    send.write_all(&[BULK_TAG]).await.unwrap();
    (send, recv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_of_64_mib_to_three_is_bit_exact_and_relayed() {
    let (_ca, _book, nodes) = cluster(&["a", "b", "c", "d"]);
    let data = Bytes::from(random_bytes(64 * MIB, 1));
    let id = nodes[0].plane.publish(data.clone()).unwrap();
    let targets: Vec<String> = ["b", "c", "d"].map(String::from).to_vec();

    let report = nodes[0].plane.broadcast(id, &targets).await.unwrap();
    let mut delivered = report.delivered.clone();
    delivered.sort();
    assert_eq!(delivered, targets);
    assert!(report.retried.is_empty());

    for n in &nodes[1..] {
        let got = n
            .plane
            .get(&id)
            .unwrap_or_else(|| panic!("{} lacks the blob", n.name));
        assert!(got == data, "{} holds different bytes", n.name);
        let s = n.plane.stats();
        assert_eq!(s.bytes_received, data.len() as u64, "{}", n.name);
        assert_eq!(s.chunks_verified, 64, "{}", n.name);
        assert_eq!(s.reserved_bytes, 0, "{}", n.name);
    }
    // The source sent one copy, not three: the chain a → b → c → d relayed the rest.
    let sent: Vec<u64> = nodes.iter().map(|n| n.plane.stats().bytes_sent).collect();
    assert_eq!(
        sent,
        vec![data.len() as u64, data.len() as u64, data.len() as u64, 0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tree_fanout_delivers_and_bounds_each_senders_copies() {
    let ca = TestCa::new();
    let book = Book::default();
    let mut cfg = config();
    cfg.fanout = 2;
    let nodes: Vec<Node> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|n| node(&ca, &book, n, cfg.clone()))
        .collect();
    let data = Bytes::from(random_bytes(3 * MIB + 123, 2));
    let id = nodes[0].plane.publish(data.clone()).unwrap();
    let targets: Vec<String> = ["b", "c", "d", "e"].map(String::from).to_vec();
    nodes[0].plane.broadcast(id, &targets).await.unwrap();
    for n in &nodes[1..] {
        assert!(n.plane.get(&id).unwrap() == data, "{}", n.name);
    }
    // a → {b → c, d → e}: a sends two copies, b and d one each.
    let sent: Vec<u64> = nodes.iter().map(|n| n.plane.stats().bytes_sent).collect();
    let len = data.len() as u64;
    assert_eq!(sent, vec![2 * len, len, 0, len, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_pushed_chunk_is_detected_and_named() {
    let (ca, _book, nodes) = cluster(&["b"]);
    let b = &nodes[0];
    let data = random_bytes(5 * MIB, 3);
    let manifest = Manifest::build(&data, MIB as u32).unwrap();
    let id = manifest.id();

    let (mut send, mut recv) = raw_stream(&ca, b).await;
    let push = Request::Push {
        manifest,
        forward: vec![],
    };
    wire::write_frame(&mut send, &push).await.unwrap();
    let ack: PushAck = wire::read_frame(&mut recv, "ack").await.unwrap();
    assert_eq!(ack, PushAck::Send);
    let mut bad = data.clone();
    bad[2 * MIB + 77] ^= 0x40;
    // The receiver stops reading at the bad chunk, so the rest of the write may fail.
    let _ = send.write_all(&bad).await;
    let _ = send.finish();
    let done: PushDone = wire::read_frame(&mut recv, "done").await.unwrap();

    assert!(done.delivered.is_empty());
    assert_eq!(done.failed.len(), 1);
    let (who, reason) = &done.failed[0];
    assert_eq!(who, "b");
    assert!(reason.contains(&id.to_string()), "{reason}");
    assert!(reason.contains("chunk 2 "), "{reason}");
    assert!(b.plane.get(&id).is_none());
    let s = b.plane.stats();
    assert_eq!(
        (s.corrupt_chunks, s.chunks_verified, s.reserved_bytes),
        (1, 2, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_fetched_chunk_is_detected_and_named() {
    let (ca, book, nodes) = cluster(&["b"]);
    let data = random_bytes(3 * MIB, 4);
    let manifest = Manifest::build(&data, MIB as u32).unwrap();
    let id = manifest.id();

    // A peer that answers fetches with the right manifest but a flipped byte in chunk 1.
    let liar = crate::loopback::endpoint(&ca, "liar");
    book.lock()
        .unwrap()
        .insert("liar".into(), liar.local_addr().unwrap());
    let served = tokio::spawn(async move {
        let conn = liar.accept().await.unwrap().await.unwrap();
        let (mut send, mut recv) = conn.accept_bi().await.unwrap();
        let mut tag = [0u8; 1];
        recv.read_exact(&mut tag).await.unwrap();
        let req: Request = wire::read_frame(&mut recv, "request").await.unwrap();
        assert_eq!(req, Request::Fetch { id });
        wire::write_frame(&mut send, &FetchReply::Found(manifest))
            .await
            .unwrap();
        let mut bad = data;
        bad[MIB + 5] ^= 1;
        let _ = send.write_all(&bad).await;
        let _ = send.finish();
        conn.closed().await;
    });

    let err = nodes[0].plane.fetch(id, "liar").await.unwrap_err();
    assert!(
        matches!(&err, TransferError::CorruptChunk { blob, chunk: 1, peer } if *blob == id && peer == "liar"),
        "{err}"
    );
    assert!(nodes[0].plane.get(&id).is_none());
    assert_eq!(nodes[0].plane.stats().reserved_bytes, 0);
    drop(nodes);
    served.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_of_an_unknown_blob_errors_clearly_and_a_known_one_verifies() {
    let (_ca, _book, nodes) = cluster(&["a", "b"]);
    let unknown = BlobId([7; 32]);
    let err = nodes[1].plane.fetch(unknown, "a").await.unwrap_err();
    assert!(
        matches!(&err, TransferError::NotFound { blob, peer } if *blob == unknown && peer == "a")
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&unknown.to_string()) && msg.contains("does not hold"),
        "{msg}"
    );

    let data = Bytes::from(random_bytes(2 * MIB + 9, 5));
    let id = nodes[0].plane.publish(data.clone()).unwrap();
    let got = nodes[1].plane.fetch(id, "a").await.unwrap();
    assert!(got == data);
    assert!(nodes[1].plane.get(&id).unwrap() == data);

    let err = nodes[1].plane.fetch(unknown, "nobody").await.unwrap_err();
    assert!(matches!(err, TransferError::Connect { .. }), "{err}");
}

/// A replica receives each weight version into the memory of one it no longer holds: the same
/// allocation, written over whole, only once nothing reads the old blob, and only for a blob of
/// the same length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_nothing_holds_is_received_into_again() {
    let (_ca, _book, nodes) = cluster(&["a", "b"]);
    let (a, b) = (&nodes[0].plane, &nodes[1].plane);
    let len = 3 * MIB + 5;
    let versions: Vec<Bytes> = (1..=3)
        .map(|seed| Bytes::from(random_bytes(len, seed)))
        .collect();
    let ids: Vec<BlobId> = versions
        .iter()
        .map(|v| a.publish(v.clone()).unwrap())
        .collect();

    let v1 = b.fetch(ids[0], "a").await.unwrap();
    let v1_memory = v1.as_ptr();
    assert_eq!(b.stats().buffers_reused, 0);
    // Out of the store but still read: nothing to reuse, so version 2 gets fresh memory.
    assert!(b.remove(&ids[0]));
    let v2 = b.fetch(ids[1], "a").await.unwrap();
    assert!(v2 == versions[1]);
    assert_ne!(v2.as_ptr(), v1_memory);
    assert_eq!(b.stats().buffers_reused, 0);
    assert_eq!(b.stats().retired_bytes, 0);
    // Version 1's last reader lets go: version 3 is received into its memory, bit-exact.
    drop(v1);
    assert_eq!(b.stats().retired_bytes, len as u64);
    let v3 = b.fetch(ids[2], "a").await.unwrap();
    assert_eq!(v3.as_ptr(), v1_memory, "received into version 1's memory");
    assert!(v3 == versions[2], "version 1's bytes showed through");
    assert!(b.get(&ids[2]).unwrap() == versions[2]);
    let s = b.stats();
    assert_eq!((s.buffers_reused, s.retired_bytes), (1, 0));

    // A blob of another length is not received into a retired one.
    assert!(b.remove(&ids[1]));
    drop(v2);
    assert_eq!(b.stats().retired_bytes, len as u64);
    let other = Bytes::from(random_bytes(len + 1, 9));
    let other_id = a.publish(other.clone()).unwrap();
    assert!(b.fetch(other_id, "a").await.unwrap() == other);
    let s = b.stats();
    assert_eq!((s.buffers_reused, s.retired_bytes), (1, len as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_truncated_streams_fail_without_hurting_the_node() {
    let (ca, _book, nodes) = cluster(&["a", "b"]);
    let a = &nodes[0];
    let data = Bytes::from(random_bytes(4 * MIB, 6));
    let id = a.plane.publish(data.clone()).unwrap();

    // An unknown request variant.
    let (mut send, _recv) = raw_stream(&ca, a).await;
    send.write_all(&[3, 0, 0, 0, 42, 1, 2]).await.unwrap();
    send.finish().unwrap();
    // An absurd frame length.
    let (mut send, _recv2) = raw_stream(&ca, a).await;
    send.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    send.finish().unwrap();
    // A push whose data stops halfway.
    let other = random_bytes(3 * MIB, 7);
    let manifest = Manifest::build(&other, MIB as u32).unwrap();
    let other_id = manifest.id();
    let (mut send, mut recv) = raw_stream(&ca, a).await;
    wire::write_frame(
        &mut send,
        &Request::Push {
            manifest,
            forward: vec![],
        },
    )
    .await
    .unwrap();
    let _: PushAck = wire::read_frame(&mut recv, "ack").await.unwrap();
    send.write_all(&other[..MIB + MIB / 2]).await.unwrap();
    send.finish().unwrap();
    let done: PushDone = wire::read_frame(&mut recv, "done").await.unwrap();
    assert_eq!(done.failed.len(), 1, "{done:?}");
    // A push announcing a blob larger than the node accepts is refused up front.
    let huge = Manifest {
        total_len: 1 << 40,
        chunk_size: 1 << 20,
        chunks: vec![[0; 32]; 1 << 18],
    };
    let (mut send, mut recv) = raw_stream(&ca, a).await;
    wire::write_frame(
        &mut send,
        &Request::Push {
            manifest: huge,
            forward: vec![],
        },
    )
    .await
    .unwrap();
    let ack: PushAck = wire::read_frame(&mut recv, "ack").await.unwrap();
    assert!(
        matches!(&ack, PushAck::Refused(r) if r.contains("exceeds")),
        "{ack:?}"
    );

    // The node still serves, and every bad stream left an error naming its fault.
    let got = nodes[1].plane.fetch(id, "a").await.unwrap();
    assert!(got == data);
    assert!(a.plane.get(&other_id).is_none());
    assert_eq!(a.plane.stats().reserved_bytes, 0);
    // Streams are served concurrently: wait (bounded) until all three errors are recorded.
    let wanted = [
        "does not decode as bulk request",
        "exceeds the limit",
        "finished early",
    ];
    let mut errors = Vec::new();
    for _ in 0..200 {
        errors = a.serve_errors.lock().unwrap().clone();
        if wanted.iter().all(|w| errors.iter().any(|e| e.contains(w))) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let has = |s: &str| errors.iter().any(|e| e.contains(s));
    assert!(has("does not decode as bulk request"), "{errors:?}");
    assert!(has("exceeds the limit"), "{errors:?}");
    assert!(has("finished early"), "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_relay_paths_are_retried_directly_and_dead_targets_reported() {
    let (_ca, _book, nodes) = cluster(&["a", "b", "c"]);
    let data = Bytes::from(random_bytes(2 * MIB, 8));
    let id = nodes[0].plane.publish(data.clone()).unwrap();
    // "ghost" has no address: the chain a → ghost → b → c breaks at its first hop.
    let targets: Vec<String> = ["ghost", "b", "c"].map(String::from).to_vec();
    let err = nodes[0].plane.broadcast(id, &targets).await.unwrap_err();
    let BroadcastError::Incomplete {
        blob,
        mut delivered,
        failed,
    } = err
    else {
        panic!("expected Incomplete");
    };
    assert_eq!(blob, id);
    delivered.sort();
    assert_eq!(delivered, vec!["b".to_string(), "c".to_string()]);
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, "ghost");
    assert!(nodes[1].plane.get(&id).unwrap() == data);
    assert!(nodes[2].plane.get(&id).unwrap() == data);

    // A blob this node does not hold cannot be broadcast.
    let err = nodes[1]
        .plane
        .broadcast(BlobId([1; 32]), &targets)
        .await
        .unwrap_err();
    assert!(matches!(err, BroadcastError::NotLocal(_)));
    // Removing a blob frees its bytes.
    assert!(nodes[0].plane.remove(&id));
    assert_eq!(nodes[0].plane.stats().stored_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_store_is_bounded_evicting_old_blobs_and_refusing_oversized_ones() {
    let ca = TestCa::new();
    let book = Book::default();
    let a = node(&ca, &book, "a", config());
    let mut small = config();
    small.capacity = 10 * MIB as u64;
    let b = node(&ca, &book, "b", small);
    let targets = vec!["b".to_string()];

    let first = Bytes::from(random_bytes(6 * MIB, 9));
    let second = Bytes::from(random_bytes(6 * MIB, 10));
    let id1 = a.plane.publish(first).unwrap();
    let id2 = a.plane.publish(second.clone()).unwrap();
    a.plane.broadcast(id1, &targets).await.unwrap();
    a.plane.broadcast(id2, &targets).await.unwrap();
    // Both do not fit: the older one was evicted to make room for the newer.
    assert!(b.plane.get(&id1).is_none());
    assert!(b.plane.get(&id2).unwrap() == second);
    assert_eq!(b.plane.stats().stored_bytes, 6 * MIB as u64);

    let big = a
        .plane
        .publish(Bytes::from(random_bytes(11 * MIB, 11)))
        .unwrap();
    let err = a.plane.broadcast(big, &targets).await.unwrap_err();
    let BroadcastError::Incomplete { failed, .. } = &err else {
        panic!("expected Incomplete, got {err}");
    };
    assert_eq!(failed[0].0, "b");
    assert!(
        failed[0].1.contains("refused") && failed[0].1.contains("capacity"),
        "{err}"
    );
    // The refusal left b's store as it was.
    assert!(b.plane.get(&id2).is_some());
    assert_eq!(b.plane.stats().reserved_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_pushes_in_flight_are_held_to_its_quota() {
    let ca = TestCa::new();
    let book = Book::default();
    let a = node(&ca, &book, "a", config());
    let mut capped = config();
    capped.peer_quota = 4 * MIB as u64;
    let b = node(&ca, &book, "b", capped);
    let push = |data: &[u8]| Request::Push {
        manifest: Manifest::build(data, MIB as u32).unwrap(),
        forward: vec![],
    };

    // Peer `raw` announces 3 MiB and holds the reservation, sending nothing yet.
    let first = random_bytes(3 * MIB, 12);
    let (mut send1, mut recv1) = raw_stream(&ca, &b).await;
    wire::write_frame(&mut send1, &push(&first)).await.unwrap();
    let ack: PushAck = wire::read_frame(&mut recv1, "ack").await.unwrap();
    assert_eq!(ack, PushAck::Send);
    // Its second push would pass its quota: refused up front, naming the quota.
    let (mut send2, mut recv2) = raw_stream(&ca, &b).await;
    wire::write_frame(&mut send2, &push(&random_bytes(3 * MIB, 13)))
        .await
        .unwrap();
    let ack: PushAck = wire::read_frame(&mut recv2, "ack").await.unwrap();
    let PushAck::Refused(reason) = ack else {
        panic!("the push past the quota was taken: {ack:?}")
    };
    assert!(
        reason.contains("`raw`") && reason.contains("quota"),
        "{reason}"
    );
    // Another peer has a quota of its own.
    let other = Bytes::from(random_bytes(3 * MIB, 14));
    let id = a.plane.publish(other.clone()).unwrap();
    a.plane.broadcast(id, &["b".to_string()]).await.unwrap();
    assert!(b.plane.get(&id).unwrap() == other);
    // The held push completes, and gives its share back.
    send1.write_all(&first).await.unwrap();
    send1.finish().unwrap();
    let done: PushDone = wire::read_frame(&mut recv1, "done").await.unwrap();
    assert_eq!(done.delivered, vec!["b".to_string()], "{done:?}");
    assert_eq!(b.plane.stats().reserved_bytes, 0);
    let (mut send3, mut recv3) = raw_stream(&ca, &b).await;
    wire::write_frame(&mut send3, &push(&random_bytes(4 * MIB, 15)))
        .await
        .unwrap();
    let ack: PushAck = wire::read_frame(&mut recv3, "ack").await.unwrap();
    assert_eq!(ack, PushAck::Send);
}
