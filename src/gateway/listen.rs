//! The gateway's HTTP/1.1 accept loop: at most `max_connections` open connections (more wait in
//! the listen backlog until one closes), a header-read timeout that also ends a connection left
//! idle or half-open (slowloris), a bound on the header bytes, and a graceful shutdown that
//! stops accepting, closes idle connections and waits for the requests in flight.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// What one connection may hold and for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnectionLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// A request's headers must arrive whole within this time from the moment the server waits
    /// for them: on a new connection, and again after each response, so a connection idle that
    /// long is closed too.
    pub header_read_timeout: Duration,
    /// The most bytes of a request head (request line and headers); more gets 431.
    pub max_header_bytes: usize,
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits for the connections that
/// are serving a request to finish theirs.
pub async fn serve_http1(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // A head (request line and headers) past this gets 431 and the connection is closed,
        // whether it arrived in one read or several.
        .max_header_size(limits.max_header_bytes);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A slot first: past the cap, new connections wait in the kernel's backlog.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) if transient(&e) => {
                    // Out of file descriptors or a connection reset before it was accepted:
                    // the listener is fine, try again shortly.
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => return Err(e),
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = builder.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(router.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A connection error (a timeout, a reset, a malformed request) ends that connection
            // only; hyper has answered what it could.
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Accept errors after which the listener still works.
fn transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}
