//! The metrics endpoint.

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::RuntimeError;

/// Where to serve `GET /metrics`, and the installed recorder whose metrics it renders.
#[derive(Debug, Clone)]
pub struct MetricsEndpoint {
    /// Listen address, e.g. `127.0.0.1:9464` (port 0: any free port).
    pub listen: SocketAddr,
    /// The process's Prometheus recorder (install it once, before anything records).
    pub handle: PrometheusHandle,
}

/// Serves `GET /metrics` (`handle`'s metrics in the Prometheus text format) on `listen`
/// until `shutdown` is cancelled. Returns the bound address (port 0 resolved) and the
/// server's task: await it to see the listener closed. Logs the bound address
/// (`metrics on /metrics`, field `listen`).
///
/// # Errors
/// [`RuntimeError::Bind`] when `listen` cannot be bound. A listener failing later is
/// logged, not returned.
pub async fn serve_metrics(
    endpoint: MetricsEndpoint,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>), RuntimeError> {
    let MetricsEndpoint { listen, handle } = endpoint;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    );
    let bind = |source| RuntimeError::Bind {
        addr: listen,
        source,
    };
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(bind)?;
    let addr = listener.local_addr().map_err(bind)?;
    tracing::info!(listen = %addr, "metrics on /metrics");
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "metrics listener failed");
        }
    });
    Ok((addr, task))
}
