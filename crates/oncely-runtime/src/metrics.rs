//! The metrics endpoint.

use std::future::Future;
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

/// Runs the task `start` spawns with a cancellation token until `shutdown` resolves, with
/// `GET /metrics` on `metrics` when given (bound before the task starts); then cancels the
/// token and waits for the task and the metrics listener. The relay, the consumer and the
/// effect runner each run so.
///
/// # Errors
/// [`RuntimeError::Bind`] when the metrics address cannot be bound; the errors of `start`;
/// [`RuntimeError::Task`] when the task or the listener panicked.
pub(crate) async fn run_until_shutdown<S, F>(
    metrics: Option<MetricsEndpoint>,
    shutdown: impl Future<Output = ()>,
    start: S,
) -> Result<(), RuntimeError>
where
    S: FnOnce(CancellationToken) -> F,
    F: Future<Output = Result<JoinHandle<()>, RuntimeError>>,
{
    let stop = CancellationToken::new();
    let metrics = match metrics {
        Some(endpoint) => Some(serve_metrics(endpoint, stop.clone()).await?),
        None => None,
    };
    let task = start(stop.clone()).await?;
    shutdown.await;
    stop.cancel();
    task.await?;
    if let Some((_, m)) = metrics {
        m.await?;
    }
    Ok(())
}
