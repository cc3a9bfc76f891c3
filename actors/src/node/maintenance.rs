//! The maintenance loop, every [`TICK`]: dial the addresses the pure policy of [`crate::dial`]
//! says are due (seeds and learnt peers, with capped backoff; a learnt address that never
//! answers is dropped), every fourth tick reopen the node sessions `ractor_cluster` dropped on
//! connections this node dialed ([`session_missing`]), and every eighth tick gossip the peer
//! list to every peer so that nodes form a full mesh.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ractor_cluster::NodeServerMessage;

use super::{lock, Node, RACTOR_HOST, SESSION_GRACE, TICK};
use crate::dial::AfterDial;
use crate::transport::{self, StreamTag};

/// Whether a node session that `ractor_cluster` does not list is missing, at `now`: never
/// opened, or opened more than [`SESSION_GRACE`] ago (a session just opened may not be listed
/// yet).
fn session_missing(opened: Option<Instant>, now: Instant) -> bool {
    opened.is_none_or(|t| now.saturating_duration_since(t) > SESSION_GRACE)
}

impl Node {
    /// Runs the maintenance ticks until the supervisor has stopped.
    pub(super) async fn maintenance_loop(self) {
        let mut tick: u64 = 0;
        let mut interval = tokio::time::interval(TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if self.supervisor.get_status() == ractor::ActorStatus::Stopped {
                return;
            }
            tick += 1;
            self.dial_targets();
            if tick.is_multiple_of(4) {
                self.check_sessions().await;
            }
            if tick.is_multiple_of(8) {
                self.gossip();
            }
        }
    }

    fn dial_targets(&self) {
        let peers = self.peers();
        let live_addrs: Vec<SocketAddr> = peers.values().map(|p| p.addr).collect();
        let me = &self.inner.name;
        let due = lock(&self.inner.dial).due(Instant::now(), |addr, name| {
            name.is_some_and(|n| n == me || peers.contains_key(n))
                || live_addrs.contains(addr)
                || *addr == self.inner.advertised
        });
        for addr in due {
            let node = self.clone();
            tokio::spawn(async move {
                let r = node.clone().dial(addr).await;
                let after = lock(&node.inner.dial).dialed(addr, r.is_ok(), Instant::now());
                match (r, after) {
                    (Err(e), AfterDial::Retry(b)) => {
                        tracing::debug!("dial {addr}: {e}; retry in {b:?}")
                    }
                    (Err(e), AfterDial::Pruned) => {
                        tracing::info!(
                            "dial {addr}: {e}; a learnt address that never answers, dropped"
                        )
                    }
                    _ => {}
                }
            });
        }
    }

    /// Reopens node sessions that `ractor_cluster` dropped on connections this node dialed.
    async fn check_sessions(&self) {
        let sessions = match self
            .inner
            .node_server
            .call(NodeServerMessage::GetSessions, Some(Duration::from_secs(2)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(s)) => s,
            _ => return,
        };
        let live: Vec<String> = sessions
            .values()
            .filter_map(|s| s.peer_name.as_ref())
            .filter_map(|n| {
                n.name
                    .strip_suffix(&format!("@{RACTOR_HOST}"))
                    .map(String::from)
            })
            .collect();
        let now = Instant::now();
        let stale: Vec<(String, quinn::Connection)> = lock(&self.inner.peers)
            .values()
            .filter(|p| {
                p.dialer == self.inner.name
                    && p.conn.close_reason().is_none()
                    && !live.contains(&p.name)
                    && session_missing(p.session_opened, now)
            })
            .map(|p| (p.name.clone(), p.conn.clone()))
            .collect();
        for (name, conn) in stale {
            tracing::info!("peer `{name}`: no node session; opening one");
            self.open_session(&name, &conn).await;
        }
    }

    fn gossip(&self) {
        let mut list: Vec<(String, SocketAddr)> = self
            .peers()
            .into_values()
            .map(|p| (p.name, p.addr))
            .collect();
        list.push((self.inner.name.clone(), self.inner.advertised));
        for p in self.peers().into_values() {
            let list = list.clone();
            tokio::spawn(async move {
                if let Ok((mut send, _recv)) =
                    transport::open_tagged(&p.conn, StreamTag::Gossip).await
                {
                    if transport::write_frame(&mut send, &list).await.is_ok() {
                        let _ = send.finish();
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_missing_once_its_grace_has_passed() {
        let t0 = Instant::now();
        assert!(session_missing(None, t0));
        assert!(!session_missing(Some(t0), t0));
        assert!(!session_missing(Some(t0), t0 + SESSION_GRACE));
        assert!(session_missing(
            Some(t0),
            t0 + SESSION_GRACE + Duration::from_millis(1)
        ));
        // A clock read before the opening (another thread's) is not past the grace.
        assert!(!session_missing(Some(t0 + SESSION_GRACE), t0));
    }
}
