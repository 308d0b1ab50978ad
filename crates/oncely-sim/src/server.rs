use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

/// Closes the connection a request came on (a request extension set by [`serve`]).
#[derive(Debug, Clone)]
struct ConnectionKill(CancellationToken);

/// Serves a simulator's router on `listener` until `shutdown` completes, then lets the
/// requests in flight finish and returns.
///
/// Use this rather than `axum::serve`: each connection is run here with a handle that the
/// `drop_after` fault uses to close the TCP connection with no answer at all. Under another
/// server `drop_after` falls back to sending the head and then failing the body (the client
/// then sees a status, then a broken body).
///
/// HTTP/1.1 only, no connection limit, no header timeout: a test double, not a server for
/// untrusted clients.
///
/// # Errors
/// The listener's accept error only if it repeats; a single failed accept is logged and
/// retried after 50 ms.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let connections = tokio_util::task::TaskTracker::new();
    let closing = CancellationToken::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        connections.spawn(connection(stream, router.clone(), closing.clone()));
    }
    closing.cancel();
    connections.close();
    connections.wait().await;
    Ok(())
}

async fn connection(stream: tokio::net::TcpStream, router: Router, closing: CancellationToken) {
    let kill = CancellationToken::new();
    let handle = kill.clone();
    let service =
        hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ConnectionKill(handle.clone()));
            router.clone().oneshot(req.map(Body::new))
        });
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        // Dropping the connection drops the socket: the client gets EOF/RST, no answer.
        () = kill.cancelled() => {}
        () = closing.cancelled() => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = conn.as_mut() => {}
                () = kill.cancelled() => {}
            }
        }
    }
}

/// Closes the connection of the request with these extensions, without an answer. Under
/// [`serve`] the returned future never completes (the connection task drops it); under
/// another server it yields a response whose body fails, which makes hyper abort the
/// connection after the head.
pub(crate) async fn drop_connection(extensions: &http::Extensions) -> Response {
    if let Some(kill) = extensions.get::<ConnectionKill>() {
        kill.0.cancel();
        std::future::pending::<()>().await;
    }
    let failing = futures_util::stream::once(async {
        Err::<bytes::Bytes, _>(std::io::Error::other("drop_after: connection dropped"))
    });
    Response::new(Body::from_stream(failing))
}
