//! The bulk plane: large byte buffers (weight versions) move between nodes on their own QUIC
//! bidirectional streams, never inside actor frames.
//!
//! - **Content-addressed and verified.** A blob is described by a [`Manifest`] (total size,
//!   chunk size, one blake3 hash per chunk); its [`BlobId`] is the hash of the manifest. Every
//!   chunk is verified as it arrives, at relays too, and a bad chunk fails the transfer with an
//!   error naming the blob and the chunk.
//! - **Relayed.** [`BulkPlane::broadcast`] sends the blob to the head of each of at most
//!   `fanout` groups of targets; each receiver forwards every verified chunk to its own group
//!   while later chunks are still arriving (a chain for `fanout = 1`). The source sends about
//!   one copy whatever the number of receivers. Forwarders read from the receiver's own copy,
//!   so a slow child costs no extra memory, and QUIC flow control paces each hop.
//! - **Bounded.** Each node keeps blobs in a byte-bounded store (LRU eviction, explicit
//!   [`BulkPlane::remove`]); a transfer reserves its size up front and is refused if it cannot.
//!   The pushes of one peer hold at most [`BulkConfig::peer_quota`] bytes of the store, in
//!   flight and stored; a push past it evicts that peer's own oldest pushes first.
//! - **Recycled.** A received blob's memory, once nothing reads it, is kept for a while for the
//!   next transfer of its length (`buffer::Recycler`, rules in `retired`): successive weight
//!   versions are received into mapped pages instead of fresh ones.
//! - **Defensive.** All wire input is validated (see [`wire`]); a misbehaving peer gets an
//!   error on its stream, never a crash, and stalled streams time out.
//!
//! - **Polite.** Bulk streams send at a lower priority than actor traffic on the same
//!   connection, and never consume connection-wide flow-control credit.
//!
//! The node owns the QUIC endpoint: it calls [`BulkPlane::serve_stream`] for every incoming
//! bidirectional stream whose first byte is [`wire::BULK_TAG`], and it lends its connections
//! to the plane through [`PeerConnector`]. For bulk throughput the node should build its
//! endpoint on [`bind_udp`] (large socket buffers) and apply [`tune_transport`] and
//! [`tune_endpoint`] to its configs.

pub mod manifest;
pub mod wire;

mod buffer;
mod plan;
mod retired;
mod store;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::{RecvStream, SendStream, VarInt};
use tokio::task::JoinSet;

pub use manifest::{BlobId, Manifest, ManifestError};
pub use store::StoreError;
pub use wire::WireError;

use buffer::{BlobReader, BlobWriter, Recycler, SourceFailed};
use store::Store;
use wire::{FetchReply, PushAck, PushDone, Request, BULK_TAG};

/// Error a [`PeerConnector`] returns when it cannot reach a peer.
pub type ConnectError = Box<dyn std::error::Error + Send + Sync>;

/// Gives the bulk plane a QUIC connection to a named peer (the node implements it over its
/// peer table; the connection must speak ALPN `clawrl/1` and route `0x02` streams here).
pub trait PeerConnector: Send + Sync + 'static {
    /// An open connection to `peer`.
    fn connection(
        &self,
        peer: &str,
    ) -> impl Future<Output = Result<quinn::Connection, ConnectError>> + Send;
}

/// Send priority of bulk streams: below quinn's default 0, so pending actor frames on the same
/// connection go out before queued blob data.
pub const BULK_PRIORITY: i32 = -1;

/// Slowest relay rate (bytes/s) a pusher allows for when it bounds its wait for a report.
pub const MIN_RELAY_RATE: u64 = 4 << 20;

/// QUIC error code used when the bulk plane aborts a stream.
const ABORT: VarInt = VarInt::from_u32(0x0b);

/// Settings of one node's bulk plane.
#[derive(Clone, Debug)]
pub struct BulkConfig {
    /// This node's name as peers know it (dropped from broadcast target lists).
    pub local_name: String,
    /// Chunk size for blobs published here.
    pub chunk_size: u32,
    /// Byte capacity of the blob store (complete blobs plus transfers in flight).
    pub capacity: u64,
    /// Largest blob accepted from a peer.
    pub max_blob: u64,
    /// Most bytes the pushes of one peer may hold in the store at once, in flight and stored
    /// (its own least recently used pushes are evicted first to stay within it).
    pub peer_quota: u64,
    /// Children per relay node: 1 makes a chain, larger values a shallower tree.
    pub fanout: usize,
    /// A stream that makes no progress for this long is aborted.
    pub stall_timeout: Duration,
}

impl BulkConfig {
    /// Defaults for node `local_name`: 1 MiB chunks, an 8 GiB store, chain relaying, and one
    /// largest blob in flight per pushing peer.
    pub fn new(local_name: impl Into<String>) -> BulkConfig {
        BulkConfig {
            local_name: local_name.into(),
            chunk_size: 1 << 20,
            capacity: 8 << 30,
            max_blob: 8 << 30,
            peer_quota: 8 << 30,
            fanout: 1,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Largest UDP payload the bulk plane lets QUIC MTU discovery probe for, and asks peers to
/// send at most. Discovery only settles on what the path carries (1500-byte Ethernet stays at
/// quinn's 1452), so this is safe everywhere; on loopback and jumbo-frame links it cuts the
/// per-packet cost, about doubling throughput on loopback. It stays under 6 553 bytes because
/// quinn batches up to 10 datagrams into one GSO send, which must fit a 64 KiB UDP datagram
/// (larger MTUs make those sends fail and show up as heavy loss). The initial MTU stays at
/// quinn's safe 1200: node connections are long-lived (the mesh), discovery reaches the path's
/// MTU within a few round trips of the handshake, and a higher starting value on a 1500-byte
/// LAN would lose every full packet until black-hole detection backs it off.
pub const MAX_UDP_PAYLOAD: u16 = 6000;

/// Transport settings for bulk traffic; the node should apply this to its endpoint's
/// `TransportConfig` (client and server side). The per-stream receive window is sized to the
/// bandwidth-delay product of the links a cluster runs on: 16 MiB keeps a 10 Gbit/s link full
/// at round trips up to about 13 ms (a LAN, or one region), so a fast hop never waits on
/// acknowledgements, while QUIC flow control still paces every hop (a slow receiver holds its
/// sender back instead of growing buffers); the send window lets four such streams (a relay's
/// children) be in flight at once. The connection-wide receive window stays
/// unlimited (quinn's default) so bulk streams can never use up credit that actor traffic on
/// the same connection needs. MTU discovery may probe up to [`MAX_UDP_PAYLOAD`].
pub fn tune_transport(cfg: &mut quinn::TransportConfig) {
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_UDP_PAYLOAD);
    cfg.stream_receive_window(VarInt::from_u32(16 << 20))
        .send_window(64 << 20)
        .mtu_discovery_config(Some(mtu));
}

/// Endpoint settings for bulk traffic: accept UDP payloads up to [`MAX_UDP_PAYLOAD`] bytes
/// (peers never send datagrams larger than this transport parameter allows). The node should
/// apply this to the `EndpointConfig` it builds its endpoint with.
pub fn tune_endpoint(cfg: &mut quinn::EndpointConfig) {
    cfg.max_udp_payload_size(MAX_UDP_PAYLOAD)
        .expect("MAX_UDP_PAYLOAD is within quinn's 1200..=65527");
}

/// Socket buffer size the bulk plane asks for (the kernel may cap it, e.g. `net.core.rmem_max`).
pub const SOCKET_BUFFER: usize = 4 << 20;

/// A UDP socket bound to `addr` with large kernel buffers, for the node's QUIC endpoint: with
/// the default ~200 KiB receive buffer a burst of bulk datagrams overflows it, and the losses
/// throttle QUIC congestion control far below what the link carries.
pub fn bind_udp(addr: std::net::SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    // Best effort: a smaller buffer only costs throughput.
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// A snapshot of one node's bulk counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BulkStats {
    /// Chunk payload bytes this node wrote to peers (fetch replies and pushes).
    pub bytes_sent: u64,
    /// Chunk payload bytes this node read from peers.
    pub bytes_received: u64,
    /// Chunks received that matched their hash.
    pub chunks_verified: u64,
    /// Chunks received that did not.
    pub corrupt_chunks: u64,
    /// Blobs in the store.
    pub blobs: u64,
    /// Bytes held by stored blobs.
    pub stored_bytes: u64,
    /// Bytes reserved by transfers in flight.
    pub reserved_bytes: u64,
    /// Transfers received into the memory of a blob nothing read any more.
    pub buffers_reused: u64,
    /// Bytes of such memory kept for the next transfer of the same length (outside the store's
    /// capacity: it was a stored blob's, and is let go of within two minutes unused).
    pub retired_bytes: u64,
}

#[derive(Default)]
struct Counters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    chunks_verified: AtomicU64,
    corrupt_chunks: AtomicU64,
}

/// Failure of one bulk stream (fetching, pushing or serving).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The peer could not be reached.
    #[error("cannot reach peer {peer}: {source}")]
    Connect {
        /// The peer.
        peer: String,
        /// Why.
        source: ConnectError,
    },
    /// A stream could not be opened on the connection.
    #[error("cannot open a bulk stream to {peer}: {source}")]
    Open {
        /// The peer.
        peer: String,
        /// Why.
        source: quinn::ConnectionError,
    },
    /// The stream broke a wire rule, failed or ended early.
    #[error("bulk stream with {peer}: {source}")]
    Wire {
        /// The peer.
        peer: String,
        /// What went wrong.
        source: WireError,
    },
    /// Writing chunk data failed.
    #[error("sending blob {blob} to {peer} failed: {source}")]
    Write {
        /// The blob.
        blob: BlobId,
        /// The peer.
        peer: String,
        /// Why.
        source: quinn::WriteError,
    },
    /// A chunk did not match its manifest hash.
    #[error("blob {blob}: chunk {chunk} from {peer} does not match its hash")]
    CorruptChunk {
        /// The blob.
        blob: BlobId,
        /// Index of the bad chunk.
        chunk: usize,
        /// The peer that sent it.
        peer: String,
    },
    /// The manifest is inconsistent or too large.
    #[error("blob {blob} from {peer}: bad manifest: {source}")]
    Manifest {
        /// The blob (hash of the manifest received).
        blob: BlobId,
        /// The peer.
        peer: String,
        /// What is wrong.
        source: ManifestError,
    },
    /// The peer sent the manifest of another blob than the one asked for.
    #[error("asked {peer} for blob {wanted} but its manifest hashes to {got}")]
    WrongManifest {
        /// The blob asked for.
        wanted: BlobId,
        /// The manifest's hash.
        got: BlobId,
        /// The peer.
        peer: String,
    },
    /// The local store cannot take the blob.
    #[error("blob {blob}: {source}")]
    Store {
        /// The blob.
        blob: BlobId,
        /// Why.
        source: StoreError,
    },
    /// The peer refused the blob.
    #[error("{peer} refused blob {blob}: {reason}")]
    Refused {
        /// The blob.
        blob: BlobId,
        /// The peer.
        peer: String,
        /// Its reason.
        reason: String,
    },
    /// This relay's own incoming copy failed, so it cannot forward further.
    #[error("relay lost its incoming copy of blob {blob} before chunk {chunk}")]
    SourceFailed {
        /// The blob.
        blob: BlobId,
        /// First chunk it could not forward.
        chunk: usize,
    },
    /// The stream made no progress within the stall timeout.
    #[error("bulk stream with {peer} stalled for {timeout:?} ({during})")]
    Stalled {
        /// The peer.
        peer: String,
        /// The configured timeout.
        timeout: Duration,
        /// What was awaited.
        during: &'static str,
    },
    /// The peer does not hold the blob.
    #[error("peer {peer} does not hold blob {blob}")]
    NotFound {
        /// The blob.
        blob: BlobId,
        /// The peer.
        peer: String,
    },
}

/// [`BulkPlane::publish`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The configured chunk size is invalid or the blob has too many chunks.
    #[error("cannot chunk blob: {0}")]
    Manifest(#[from] ManifestError),
    /// The store cannot take the blob.
    #[error("cannot store blob: {0}")]
    Store(#[from] StoreError),
}

/// [`BulkPlane::broadcast`] failed.
#[derive(Debug, thiserror::Error)]
pub enum BroadcastError {
    /// Only a node that holds a blob can broadcast it.
    #[error("blob {0} is not in this node's store")]
    NotLocal(BlobId),
    /// Some targets did not receive the blob, even after a direct retry.
    #[error("blob {blob} reached {} of {} targets; failed: {}", delivered.len(), delivered.len() + failed.len(), failed.iter().map(|(p, r)| format!("{p} ({r})")).collect::<Vec<_>>().join(", "))]
    Incomplete {
        /// The blob.
        blob: BlobId,
        /// Targets that hold it now.
        delivered: Vec<String>,
        /// Targets that do not, with reasons.
        failed: Vec<(String, String)>,
    },
}

/// Outcome of a successful broadcast.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BroadcastReport {
    /// The blob.
    pub blob: BlobId,
    /// Every target (duplicates and this node removed), all holding the blob now.
    pub delivered: Vec<String>,
    /// Targets that needed a direct retry after their relay path failed.
    pub retried: Vec<String>,
}

/// Where a sender takes chunks from: a stored blob, or a copy still arriving.
#[derive(Clone)]
enum Source {
    Complete(Bytes),
    Incoming(BlobReader),
}

impl Source {
    async fn chunk(&mut self, manifest: &Manifest, index: usize) -> Result<Bytes, SourceFailed> {
        match self {
            Source::Complete(b) => Ok(b.slice(manifest.chunk_range(index))),
            Source::Incoming(r) => r.chunk(index).await,
        }
    }
}

/// A store reservation for a transfer in flight; released on drop unless committed.
struct Reservation {
    store: Arc<Mutex<Store>>,
    size: u64,
    committed: bool,
    /// The peer whose push holds it, against its quota.
    pusher: Option<String>,
}

impl Reservation {
    /// Turns the reservation into the stored blob (a push's, counted against its peer).
    fn commit(mut self, manifest: Arc<Manifest>, bytes: Bytes) {
        self.committed = true;
        let mut store = lock(&self.store);
        match &self.pusher {
            Some(peer) => store.commit_pushed(peer, manifest, bytes),
            None => store.commit(manifest, bytes),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut store = lock(&self.store);
        if !self.committed {
            store.release(self.size);
        }
        if let Some(peer) = &self.pusher {
            store.release_pushed(peer, self.size);
        }
    }
}

fn lock(store: &Mutex<Store>) -> std::sync::MutexGuard<'_, Store> {
    // The store's invariants hold between calls; a panic elsewhere does not break them.
    store.lock().unwrap_or_else(|e| e.into_inner())
}

use plan::Outcome as GroupOutcome;

struct Inner<C> {
    connector: C,
    config: BulkConfig,
    store: Arc<Mutex<Store>>,
    counters: Counters,
    /// `None` when the plane was built outside a tokio runtime (nothing to time expiry on):
    /// then every transfer gets fresh memory.
    recycler: Option<Arc<Recycler>>,
}

/// One node's bulk plane (cheap to clone; clones share the store and counters).
pub struct BulkPlane<C> {
    inner: Arc<Inner<C>>,
}

impl<C> Clone for BulkPlane<C> {
    fn clone(&self) -> Self {
        BulkPlane {
            inner: self.inner.clone(),
        }
    }
}

impl<C: PeerConnector> BulkPlane<C> {
    /// A bulk plane that reaches peers through `connector`. Built inside a tokio runtime, it
    /// receives blobs into the memory of retired ones of the same length ([`BulkStats`]).
    pub fn new(connector: C, config: BulkConfig) -> BulkPlane<C> {
        let store = Arc::new(Mutex::new(Store::new(config.capacity)));
        let recycler = tokio::runtime::Handle::try_current()
            .ok()
            .map(Recycler::new);
        BulkPlane {
            inner: Arc::new(Inner {
                connector,
                config,
                store,
                counters: Counters::default(),
                recycler,
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BulkConfig {
        &self.inner.config
    }

    /// Chunks and hashes `bytes`, stores it, and returns its id.
    pub fn publish(&self, bytes: Bytes) -> Result<BlobId, PublishError> {
        self.store_blob(bytes, false)
    }

    /// As [`publish`](Self::publish), and the blob is never evicted to make room for others:
    /// it stays until [`remove`](Self::remove)d (what peers must be able to fetch for as long
    /// as a job runs, however many other blobs pass through the store meanwhile).
    pub fn publish_pinned(&self, bytes: Bytes) -> Result<BlobId, PublishError> {
        self.store_blob(bytes, true)
    }

    fn store_blob(&self, bytes: Bytes, pin: bool) -> Result<BlobId, PublishError> {
        let manifest = Arc::new(Manifest::build(&bytes, self.inner.config.chunk_size)?);
        let id = manifest.id();
        let mut store = lock(&self.inner.store);
        if store.contains(&id) {
            store.get(&id);
        } else {
            store.reserve(bytes.len() as u64)?;
            store.commit(manifest, bytes);
        }
        if pin {
            store.pin(&id);
        }
        Ok(id)
    }

    /// The blob if this node holds it.
    pub fn get(&self, id: &BlobId) -> Option<Bytes> {
        lock(&self.inner.store).get(id).map(|(_, b)| b)
    }

    /// The blob's manifest if this node holds it.
    pub fn manifest(&self, id: &BlobId) -> Option<Manifest> {
        lock(&self.inner.store)
            .get(id)
            .map(|(m, _)| Manifest::clone(&m))
    }

    /// Drops the blob from this node's store; false if it was not there.
    pub fn remove(&self, id: &BlobId) -> bool {
        lock(&self.inner.store).remove(id)
    }

    /// Current counters.
    pub fn stats(&self) -> BulkStats {
        let c = &self.inner.counters;
        let store = lock(&self.inner.store);
        BulkStats {
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            chunks_verified: c.chunks_verified.load(Ordering::Relaxed),
            corrupt_chunks: c.corrupt_chunks.load(Ordering::Relaxed),
            blobs: store.len() as u64,
            stored_bytes: store.stored_bytes(),
            reserved_bytes: store.reserved_bytes(),
            buffers_reused: self.inner.recycler.as_ref().map_or(0, |r| r.reused()),
            retired_bytes: self.inner.recycler.as_ref().map_or(0, |r| r.held() as u64),
        }
    }

    /// The blob, from the local store or else fetched (and verified, and stored) from `peer`.
    pub async fn fetch(&self, id: BlobId, peer: &str) -> Result<Bytes, TransferError> {
        if let Some(b) = self.get(&id) {
            return Ok(b);
        }
        let (mut send, mut recv) = self.open(peer).await?;
        let wire_err = |source| TransferError::Wire {
            peer: peer.to_owned(),
            source,
        };
        self.stall(
            peer,
            "sending request",
            wire::write_frame(&mut send, &Request::Fetch { id }),
        )
        .await?
        .map_err(wire_err)?;
        let _ = send.finish();
        let reply: FetchReply = self
            .stall(
                peer,
                "fetch reply",
                wire::read_frame(&mut recv, "fetch reply"),
            )
            .await?
            .map_err(wire_err)?;
        let manifest = match reply {
            FetchReply::NotFound => {
                return Err(TransferError::NotFound {
                    blob: id,
                    peer: peer.to_owned(),
                })
            }
            FetchReply::Found(m) => m,
        };
        let got = manifest.id();
        if got != id {
            return Err(TransferError::WrongManifest {
                wanted: id,
                got,
                peer: peer.to_owned(),
            });
        }
        manifest
            .validate(self.inner.config.max_blob)
            .map_err(|source| TransferError::Manifest {
                blob: id,
                peer: peer.to_owned(),
                source,
            })?;
        let manifest = Arc::new(manifest);
        let reservation = self.reserve(id, manifest.total_len, None)?;
        let (writer, _reader) = buffer::incoming(manifest.clone(), self.inner.recycler.as_ref());
        let bytes = self.receive(id, peer, &mut recv, writer).await?;
        reservation.commit(manifest, bytes.clone());
        Ok(bytes)
    }

    /// Delivers a locally held blob to every peer in `targets` through relay groups (see the
    /// module docs). Targets whose relay path failed are retried once directly.
    pub async fn broadcast(
        &self,
        id: BlobId,
        targets: &[String],
    ) -> Result<BroadcastReport, BroadcastError> {
        let (manifest, bytes) = lock(&self.inner.store)
            .get(&id)
            .ok_or(BroadcastError::NotLocal(id))?;
        let targets = plan::normalize(targets, &self.inner.config.local_name);
        let source = Source::Complete(bytes);
        let (mut delivered, failed) = self.fan_out(&manifest, &source, &targets).await;
        let mut retried = Vec::new();
        let mut still_failed = Vec::new();
        if !failed.is_empty() {
            tracing::warn!(blob = %id.short(), failed = ?failed, "bulk relay path failed; retrying directly");
            let groups = failed.into_iter().map(|(peer, _)| (peer, Vec::new()));
            let (ok, bad) = self.run_groups(&manifest, &source, groups.collect()).await;
            retried.extend(ok.iter().cloned());
            delivered.extend(ok);
            still_failed.extend(bad);
        }
        if !still_failed.is_empty() {
            return Err(BroadcastError::Incomplete {
                blob: id,
                delivered,
                failed: still_failed,
            });
        }
        Ok(BroadcastReport {
            blob: id,
            delivered,
            retried,
        })
    }

    /// Serves one incoming bulk stream (the node has already consumed the `0x02` tag byte).
    /// Errors are the peer's fault or the network's; the node should log them and go on.
    pub async fn serve_stream(
        &self,
        peer: &str,
        mut send: SendStream,
        mut recv: RecvStream,
    ) -> Result<(), TransferError> {
        let _ = send.set_priority(BULK_PRIORITY);
        let request: Request = self
            .stall(peer, "request", wire::read_frame(&mut recv, "bulk request"))
            .await?
            .map_err(|source| TransferError::Wire {
                peer: peer.to_owned(),
                source,
            })?;
        match request {
            Request::Fetch { id } => self.serve_fetch(id, send).await,
            Request::Push { manifest, forward } => {
                let result = self
                    .serve_push(peer, manifest, forward, &mut send, &mut recv)
                    .await;
                if result.is_err() {
                    let _ = recv.stop(ABORT);
                }
                result
            }
        }
    }

    async fn serve_fetch(&self, id: BlobId, mut send: SendStream) -> Result<(), TransferError> {
        let peer = "fetching peer";
        let found = lock(&self.inner.store).get(&id);
        let wire_err = |source| TransferError::Wire {
            peer: peer.to_owned(),
            source,
        };
        let Some((manifest, bytes)) = found else {
            self.stall(
                peer,
                "sending reply",
                wire::write_frame(&mut send, &FetchReply::NotFound),
            )
            .await?
            .map_err(wire_err)?;
            let _ = send.finish();
            return Ok(());
        };
        let reply = FetchReply::Found(Manifest::clone(&manifest));
        self.stall(peer, "sending reply", wire::write_frame(&mut send, &reply))
            .await?
            .map_err(wire_err)?;
        self.send_chunks(&manifest, Source::Complete(bytes), &mut send, peer)
            .await?;
        let _ = send.finish();
        Ok(())
    }

    /// Tells `peer` its push is refused for `why` (best effort: the refusal stands whether or
    /// not the ack arrives), closes the stream, and gives `why` back.
    async fn refuse_push(
        &self,
        peer: &str,
        send: &mut SendStream,
        why: TransferError,
    ) -> TransferError {
        let ack = PushAck::Refused(wire::clip_reason(why.to_string()));
        let _ = self
            .stall(peer, "sending ack", wire::write_frame(send, &ack))
            .await;
        let _ = send.finish();
        why
    }

    async fn serve_push(
        &self,
        peer: &str,
        manifest: Manifest,
        forward: Vec<String>,
        send: &mut SendStream,
        recv: &mut RecvStream,
    ) -> Result<(), TransferError> {
        let id = manifest.id();
        let wire_err = |source| TransferError::Wire {
            peer: peer.to_owned(),
            source,
        };
        let checked = manifest
            .validate(self.inner.config.max_blob)
            .map_err(|source| TransferError::Manifest {
                blob: id,
                peer: peer.to_owned(),
                source,
            })
            .and_then(|()| wire::validate_names(forward.iter()).map_err(wire_err));
        if let Err(e) = checked {
            return Err(self.refuse_push(peer, send, e).await);
        }
        let manifest = Arc::new(manifest);
        let forward = plan::normalize(&forward, &self.inner.config.local_name);
        let stored = lock(&self.inner.store).get(&id);

        // Either relay from the stored copy, or receive a new copy and relay while it arrives.
        let (source, incoming) = match stored {
            Some((_, bytes)) => {
                self.stall(peer, "sending ack", wire::write_frame(send, &PushAck::Have))
                    .await?
                    .map_err(wire_err)?;
                (Source::Complete(bytes), None)
            }
            None => {
                let reservation = match self.reserve(id, manifest.total_len, Some(peer)) {
                    Ok(r) => r,
                    Err(e) => return Err(self.refuse_push(peer, send, e).await),
                };
                self.stall(peer, "sending ack", wire::write_frame(send, &PushAck::Send))
                    .await?
                    .map_err(wire_err)?;
                let (writer, reader) =
                    buffer::incoming(manifest.clone(), self.inner.recycler.as_ref());
                (Source::Incoming(reader), Some((writer, reservation)))
            }
        };

        let relay = {
            let this = self.clone();
            let m = manifest.clone();
            let targets = forward.clone();
            tokio::spawn(async move { this.fan_out(&m, &source, &targets).await })
        };

        let mut own: Result<(), TransferError> = Ok(());
        if let Some((writer, reservation)) = incoming {
            match self.receive(id, peer, recv, writer).await {
                Ok(bytes) => reservation.commit(manifest.clone(), bytes),
                Err(e) => own = Err(e),
            }
        }
        let (mut delivered, mut failed) = match relay.await {
            Ok(outcome) => outcome,
            Err(e) => {
                let reason = format!("relay task died: {e}");
                (
                    Vec::new(),
                    forward
                        .iter()
                        .map(|p| (p.clone(), reason.clone()))
                        .collect(),
                )
            }
        };
        let me = self.inner.config.local_name.clone();
        match &own {
            Ok(()) => delivered.insert(0, me),
            Err(e) => failed.insert(0, (me, wire::clip_reason(e.to_string()))),
        }
        for (_, reason) in failed.iter_mut() {
            *reason = wire::clip_reason(std::mem::take(reason));
        }
        let done = PushDone { delivered, failed };
        let sent = self
            .stall(peer, "sending report", wire::write_frame(send, &done))
            .await
            .and_then(|r| r.map_err(wire_err));
        let _ = send.finish();
        own?;
        sent
    }

    /// Sends `manifest`'s blob from `source` to every target via relay groups.
    async fn fan_out(
        &self,
        manifest: &Arc<Manifest>,
        source: &Source,
        targets: &[String],
    ) -> GroupOutcome {
        let groups = plan::split(targets, self.inner.config.fanout);
        self.run_groups(manifest, source, groups).await
    }

    /// Pushes to every (head, rest) group concurrently and merges the outcomes; a push task
    /// that dies is reported as a failure of its whole group.
    async fn run_groups(
        &self,
        manifest: &Arc<Manifest>,
        source: &Source,
        groups: Vec<(String, Vec<String>)>,
    ) -> GroupOutcome {
        let mut tasks = JoinSet::new();
        let mut by_task = HashMap::new();
        for (head, rest) in groups {
            let this = self.clone();
            let (m, s) = (manifest.clone(), source.clone());
            let (h, r) = (head.clone(), rest.clone());
            let task = tasks.spawn(async move { this.push_group(&m, s, &h, r).await });
            by_task.insert(task.id(), (head, rest));
        }
        let (mut delivered, mut failed) = (Vec::new(), Vec::new());
        while let Some(joined) = tasks.join_next_with_id().await {
            let (ok, bad) = match joined {
                Ok((_, outcome)) => outcome,
                Err(e) => match by_task.get(&e.id()) {
                    Some((head, rest)) => group_failed(head, rest, &format!("push task died: {e}")),
                    None => continue,
                },
            };
            delivered.extend(ok);
            failed.extend(bad);
        }
        (delivered, failed)
    }

    /// Pushes the blob to `head`, asking it to relay to `rest`; every failure is reported per
    /// peer of the group.
    async fn push_group(
        &self,
        manifest: &Arc<Manifest>,
        source: Source,
        head: &str,
        rest: Vec<String>,
    ) -> GroupOutcome {
        match self.push(manifest, source, head, &rest).await {
            Ok(done) => match plan::reconcile(head, &rest, done.delivered, done.failed) {
                Ok(outcome) => outcome,
                Err(reason) => {
                    let reason = format!("bad relay report from {head}: {reason}");
                    group_failed(head, &rest, &reason)
                }
            },
            Err(e) => {
                let reason = e.to_string();
                tracing::warn!(blob = %manifest.id().short(), peer = head, error = %reason, "bulk push failed");
                group_failed(head, &rest, &reason)
            }
        }
    }

    async fn push(
        &self,
        manifest: &Arc<Manifest>,
        source: Source,
        peer: &str,
        forward: &[String],
    ) -> Result<PushDone, TransferError> {
        let id = manifest.id();
        let (mut send, mut recv) = self.open(peer).await?;
        let wire_err = |source| TransferError::Wire {
            peer: peer.to_owned(),
            source,
        };
        let request = Request::Push {
            manifest: Manifest::clone(manifest),
            forward: forward.to_vec(),
        };
        self.stall(
            peer,
            "sending request",
            wire::write_frame(&mut send, &request),
        )
        .await?
        .map_err(wire_err)?;
        let ack: PushAck = self
            .stall(peer, "push ack", wire::read_frame(&mut recv, "push ack"))
            .await?
            .map_err(wire_err)?;
        match ack {
            PushAck::Refused(reason) => {
                return Err(TransferError::Refused {
                    blob: id,
                    peer: peer.to_owned(),
                    reason,
                })
            }
            PushAck::Have => {}
            PushAck::Send => {
                if let Err(e) = self.send_chunks(manifest, source, &mut send, peer).await {
                    let _ = send.reset(ABORT);
                    return Err(e);
                }
            }
        }
        let _ = send.finish();
        // The report comes once the peer's whole subtree is done; each hop below has its own
        // stall timeout, so this wait is bounded by the subtree's progress.
        let wait = self.report_timeout(manifest.total_len, forward.len());
        let done: PushDone = tokio::time::timeout(wait, wire::read_frame(&mut recv, "push result"))
            .await
            .map_err(|_| TransferError::Stalled {
                peer: peer.to_owned(),
                timeout: wait,
                during: "waiting for the relay report",
            })?
            .map_err(wire_err)?;
        done.validate().map_err(wire_err)?;
        Ok(done)
    }

    /// Opens a bulk stream to `peer` and writes the tag byte.
    async fn open(&self, peer: &str) -> Result<(SendStream, RecvStream), TransferError> {
        let conn = self
            .stall(peer, "connecting", self.inner.connector.connection(peer))
            .await?
            .map_err(|source| TransferError::Connect {
                peer: peer.to_owned(),
                source,
            })?;
        let (mut send, recv) = self
            .stall(peer, "opening a stream", conn.open_bi())
            .await?
            .map_err(|source| TransferError::Open {
                peer: peer.to_owned(),
                source,
            })?;
        let _ = send.set_priority(BULK_PRIORITY);
        self.stall(peer, "sending the tag", send.write_all(&[BULK_TAG]))
            .await?
            .map_err(|e| TransferError::Wire {
                peer: peer.to_owned(),
                source: WireError::Io(std::io::Error::other(e)),
            })?;
        Ok((send, recv))
    }

    /// Reserves `size` bytes of the store for blob `id`; a blob a peer pushes names it as
    /// `pusher`, and is held to its quota ([`BulkConfig::peer_quota`]).
    fn reserve(
        &self,
        id: BlobId,
        size: u64,
        pusher: Option<&str>,
    ) -> Result<Reservation, TransferError> {
        let mut store = lock(&self.inner.store);
        let evicted = match pusher {
            None => store.reserve(size),
            Some(peer) => store.reserve_pushed(peer, self.inner.config.peer_quota, size),
        }
        .map_err(|source| TransferError::Store { blob: id, source })?;
        drop(store);
        for old in evicted {
            tracing::info!(blob = %old.short(), "bulk store evicted blob to make room");
        }
        Ok(Reservation {
            store: self.inner.store.clone(),
            size,
            committed: false,
            pusher: pusher.map(str::to_string),
        })
    }

    /// Reads every chunk into `writer`, verifying each; then checks the stream ends. A chunk's
    /// hash is checked on a blocking thread while the next chunk is read off the stream, and
    /// chunks commit in order as their checks pass.
    async fn receive(
        &self,
        id: BlobId,
        peer: &str,
        recv: &mut RecvStream,
        mut writer: BlobWriter,
    ) -> Result<Bytes, TransferError> {
        let c = &self.inner.counters;
        let wire_err = |e: std::io::Error| TransferError::Wire {
            peer: peer.to_owned(),
            source: WireError::Io(e),
        };
        fn io<E: std::error::Error + Send + Sync + 'static>(e: E) -> std::io::Error {
            std::io::Error::other(e)
        }
        let mut checking: Option<tokio::task::JoinHandle<bool>> = None;
        loop {
            let filled = match writer.next_region() {
                Some(region) => {
                    let n = region.len();
                    self.stall(peer, "chunk data", recv.read_exact(region))
                        .await?
                        .map_err(|e| wire_err(io(e)))?;
                    c.bytes_received.fetch_add(n as u64, Ordering::Relaxed);
                    let chunk = writer.fill();
                    Some(tokio::task::spawn_blocking(move || chunk.verify()))
                }
                None => None,
            };
            let done = filled.is_none();
            if let Some(check) = std::mem::replace(&mut checking, filled) {
                // A check that panicked counts as a failed one.
                let verified = check.await.unwrap_or(false);
                if !writer.commit(verified) {
                    c.corrupt_chunks.fetch_add(1, Ordering::Relaxed);
                    let chunk = writer.next_index();
                    tracing::warn!(blob = %id.short(), chunk, peer, "bulk chunk failed verification");
                    return Err(TransferError::CorruptChunk {
                        blob: id,
                        chunk,
                        peer: peer.to_owned(),
                    });
                }
                c.chunks_verified.fetch_add(1, Ordering::Relaxed);
            }
            if done {
                break;
            }
        }
        let mut probe = [0u8; 1];
        let extra = self
            .stall(peer, "end of stream", recv.read(&mut probe))
            .await?
            .map_err(|e| wire_err(io(e)))?;
        if extra.is_some_and(|n| n > 0) {
            return Err(TransferError::Wire {
                peer: peer.to_owned(),
                source: WireError::Invalid(format!("data after the last chunk of blob {id}")),
            });
        }
        Ok(writer
            .finish()
            .ok()
            .expect("every chunk was committed above"))
    }

    /// Writes every chunk of the blob from `source` (waiting for chunks still arriving).
    async fn send_chunks(
        &self,
        manifest: &Manifest,
        mut source: Source,
        send: &mut SendStream,
        peer: &str,
    ) -> Result<(), TransferError> {
        let id = manifest.id();
        for index in 0..manifest.chunk_count() {
            let chunk = source
                .chunk(manifest, index)
                .await
                .map_err(|SourceFailed(chunk)| TransferError::SourceFailed { blob: id, chunk })?;
            let n = chunk.len() as u64;
            self.stall(peer, "sending chunk data", send.write_chunk(chunk))
                .await?
                .map_err(|source| TransferError::Write {
                    blob: id,
                    peer: peer.to_owned(),
                    source,
                })?;
            self.inner
                .counters
                .bytes_sent
                .fetch_add(n, Ordering::Relaxed);
        }
        Ok(())
    }

    /// How long a pusher waits, after its last chunk, for the receiver's report: the subtree
    /// below may still be forwarding. The stall timeout plus the blob's time at
    /// [`MIN_RELAY_RATE`] for each level the subtree may have.
    fn report_timeout(&self, total_len: u64, subtree: usize) -> Duration {
        let per_level = Duration::from_secs_f64(total_len as f64 / MIN_RELAY_RATE as f64);
        self.inner.config.stall_timeout + per_level * (subtree as u32 + 1)
    }

    /// Runs `fut` under the stall timeout.
    async fn stall<T>(
        &self,
        peer: &str,
        during: &'static str,
        fut: impl Future<Output = T>,
    ) -> Result<T, TransferError> {
        let timeout = self.inner.config.stall_timeout;
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TransferError::Stalled {
                peer: peer.to_owned(),
                timeout,
                during,
            })
    }
}

fn group_failed(head: &str, rest: &[String], reason: &str) -> GroupOutcome {
    let mut failed = vec![(head.to_owned(), reason.to_owned())];
    failed.extend(rest.iter().map(|p| {
        (
            p.clone(),
            format!("not reached: relay {head} failed: {reason}"),
        )
    }));
    (Vec::new(), failed)
}
