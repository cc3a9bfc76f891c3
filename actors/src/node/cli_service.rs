//! The CLI service: the one request a CLI stream carries (`nodes`, `ping`, a blob request, or
//! a Control request forwarded to the cluster's Control actor) and its answer. Any connection
//! the handshake let in may make CLI requests (the CLI's own client certificate included); the
//! blob requests are answered in `blobs`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quinn::{RecvStream, SendStream};

use super::{Node, STREAM_HEAD_TIMEOUT};
use crate::cli::{BlobRequest, CliReply, CliRequest, ClusterView, NodeView, PingResult};
use crate::control::ControlRequest;
use crate::member::{MemberReply, MemberRequest};
use crate::rpc;
use crate::transport;

impl Node {
    /// The cluster as this node sees it.
    pub fn view(&self) -> ClusterView {
        let slots = |envs: &[crate::member::EnvSpec]| {
            envs.iter()
                .map(|e| format!("{}:{}", e.kind, e.count))
                .collect()
        };
        let mut nodes = vec![NodeView {
            name: self.inner.name.clone(),
            addr: self.inner.advertised.to_string(),
            roles: self.inner.roles.iter().map(|r| r.as_str().into()).collect(),
            envs: slots(&self.inner.envs),
        }];
        for p in self.peers().into_values() {
            nodes.push(NodeView {
                name: p.name,
                addr: p.addr.to_string(),
                roles: p.roles.iter().map(|r| r.as_str().into()).collect(),
                envs: slots(&p.envs),
            });
        }
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        let mut groups = BTreeMap::new();
        for g in ractor::pg::which_groups() {
            if !g.starts_with(crate::groups::PREFIX) {
                continue;
            }
            let mut members: Vec<String> = ractor::pg::get_members(&g)
                .iter()
                .map(rpc::actor_label)
                .collect();
            if members.is_empty() {
                continue;
            }
            members.sort();
            groups.insert(g, members);
        }
        ClusterView { nodes, groups }
    }

    pub(super) async fn serve_cli(
        &self,
        from: SocketAddr,
        mut send: SendStream,
        mut recv: RecvStream,
    ) {
        let req: CliRequest =
            match tokio::time::timeout(STREAM_HEAD_TIMEOUT, transport::read_frame(&mut recv)).await
            {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    tracing::warn!("{from}: bad CLI request: {e}");
                    return;
                }
                Err(_) => return,
            };
        let reply = match req {
            CliRequest::Nodes => CliReply::Nodes(self.view()),
            CliRequest::Ping => CliReply::Ping(self.ping_all().await),
            CliRequest::Blob(BlobRequest::Publish { len }) => {
                self.receive_blob(from, len, &mut recv).await
            }
            CliRequest::Blob(BlobRequest::Save { id }) => match self.held_blob(&id) {
                Ok(data) => return self.send_blob(from, send, data).await,
                Err(e) => CliReply::Error(e),
            },
            CliRequest::Blob(BlobRequest::Broadcast { id, targets }) => {
                match self.broadcast_blob(&id, &targets).await {
                    Ok(r) => CliReply::Blob(r),
                    Err(e) => CliReply::Error(e),
                }
            }
            CliRequest::Control(ControlRequest::Progress { id, .. }) => {
                tracing::warn!("{from}: the CLI reported progress of {id}; refused");
                CliReply::Error(format!(
                    "a job's progress is reported by its trainer node, not the CLI ({id})"
                ))
            }
            CliRequest::Control(c) => {
                let mut members = ractor::pg::get_members(&crate::groups::CONTROL.to_string());
                members.sort_by_key(rpc::actor_label);
                if members.len() > 1 {
                    tracing::warn!(
                        "{} Control actors in the cluster; using {}",
                        members.len(),
                        rpc::actor_label(&members[0])
                    );
                }
                match members.first() {
                    None => CliReply::Error(
                        "no Control actor in the cluster (no node with the `control` role is connected)".into(),
                    ),
                    Some(ctl) => match rpc::call(ctl, &c, Duration::from_secs(20)).await {
                        Ok(r) => CliReply::Control(r),
                        Err(e) => CliReply::Error(e.to_string()),
                    },
                }
            }
        };
        if let Err(e) = transport::write_frame(&mut send, &reply).await {
            tracing::warn!("{from}: cannot answer CLI request: {e}");
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    }

    /// Pings every node member, concurrently.
    async fn ping_all(&self) -> Vec<PingResult> {
        let mut set = tokio::task::JoinSet::new();
        let mut n = 0u64;
        // Only node members answer `MemberRequest`; Control, the rollout hosts and the
        // environment hosts speak their own protocols.
        for g in ractor::pg::which_groups() {
            if g != crate::groups::NODES {
                continue;
            }
            for m in ractor::pg::get_members(&g) {
                n += 1;
                let g = g.clone();
                let nonce = n ^ 0x5eed_0000_0000;
                set.spawn(async move {
                    let t = Instant::now();
                    let r: Result<MemberReply, _> =
                        rpc::call(&m, &MemberRequest::Ping(nonce), Duration::from_secs(3)).await;
                    let member = rpc::actor_label(&m);
                    let (ok, detail) = match r {
                        Ok(MemberReply::Pong(x)) if x == nonce => {
                            (true, format!("{}", t.elapsed().as_micros()))
                        }
                        Ok(other) => (false, format!("unexpected reply {other:?}")),
                        Err(e) => (false, e.to_string()),
                    };
                    PingResult {
                        group: g,
                        member,
                        ok,
                        detail,
                    }
                });
            }
        }
        let mut out = Vec::new();
        while let Some(r) = set.join_next().await {
            if let Ok(r) = r {
                out.push(r);
            }
        }
        out.sort_by(|a, b| (&a.group, &a.member).cmp(&(&b.group, &b.member)));
        out
    }
}
