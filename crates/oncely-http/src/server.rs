//! The HTTP/1.1 server of oncely's services (the order service, `oncely gateway`): an
//! accept loop that bounds slow and greedy clients ([`HttpLimits`], [`serve_http`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What a client may hold of a server: the slow-client timeouts and the connection and
/// body-byte caps. [`serve_http`] enforces the connection-level ones; [`read_body`]
/// (through [`BodyLimits`]) the body-level ones.
///
/// [`read_body`]: crate::read_body
/// [`BodyLimits`]: crate::BodyLimits
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// How long a client may take to send a request's head (request line and headers)
    /// before its connection is closed — the slowloris guard (hyper's HTTP/1 header read
    /// timeout). Default 30 s.
    pub header_read_timeout: Duration,
    /// How long a client may take to send a request's whole body, counted from the end of
    /// its head: a total deadline, not an idle timeout, so a body trickled a byte at a time
    /// is cut too. Past it the client gets 408 and the connection closes. Default 30 s.
    pub body_read_timeout: Duration,
    /// How long a write of a response may stall — the client not taking its bytes, its
    /// receive window full — before the connection is closed. Without it a client that
    /// sends requests and never reads the answers holds its connection, and at
    /// [`HttpLimits::max_connections`] of them nobody else is served. Default 30 s.
    pub write_timeout: Duration,
    /// Most connections served at once. At the cap the server stops accepting (new
    /// connections wait in the kernel's listen backlog) until one closes. Default 512,
    /// below the usual 1024 file-descriptor soft limit with room for the database pools and
    /// broker connections.
    pub max_connections: usize,
    /// Most request-body bytes buffered at once, over all requests in flight. A request
    /// reserves its `Content-Length` (or the request-body bound when the length is not
    /// known) before its body is read; when the budget is spent it gets 503 with
    /// `Retry-After` at once (see [`read_body`](crate::read_body) for why not a wait).
    /// Default 64 MiB.
    pub max_body_bytes_in_flight: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_body_bytes_in_flight: 64 * 1024 * 1024,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets every connection finish
/// its request in flight (hyper's graceful shutdown) and returns when all are closed.
///
/// `axum::serve` would do, but it gives hyper no timer, so a client that sends its headers
/// one byte at a time holds a connection forever (slowloris). This loop runs each
/// connection with hyper-util's builder, a Tokio timer and `header_read_timeout`, its
/// socket wrapped so that a write stalled for `write_timeout` fails and ends the
/// connection (`tokio-io-timeout`; hyper has no write timeout). It accepts only while it
/// holds one of `max_connections` slots (a semaphore permit, as mini-redis does), so at the
/// cap new connections wait in the listen backlog.
///
/// # Errors
/// None today: a failed accept (out of file descriptors) is logged and retried after
/// 50 ms; the `io::Result` keeps `axum::serve`'s shape.
pub async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    limits: &HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt as _;

    let header_read_timeout = limits.header_read_timeout;
    let write_timeout = limits.write_timeout;
    let slots = Arc::new(tokio::sync::Semaphore::new(
        limits
            .max_connections
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
    ));
    let connections = tokio_util::task::TaskTracker::new();
    let closing = CancellationToken::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            () = &mut shutdown => break,
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        drop(stream.set_nodelay(true));
        let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
        stream.set_write_timeout(Some(write_timeout));
        let stream = Box::pin(stream);
        let service =
            hyper_util::service::TowerToHyperService::new(app.clone().map_request(
                |r: http::Request<hyper::body::Incoming>| r.map(axum::body::Body::new),
            ));
        let closing = closing.clone();
        connections.spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::trace!(error = %e, "connection ended");
                    }
                }
                () = closing.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    drop(conn.await);
                }
            }
        });
    }
    closing.cancel();
    connections.close();
    connections.wait().await;
    Ok(())
}
