//! Shutdown signals.

use std::future::Future;

/// Resolves at SIGTERM or SIGINT (Ctrl-C); elsewhere than Unix, at Ctrl-C.
///
/// The handlers are installed when this is called, not when the future is first polled:
/// a server that announced it is ready and then met a SIGTERM before its accept loop first
/// polled the future would otherwise die of the signal's default action instead of
/// draining. So call it before announcing readiness, and hand the future to the `run_*`
/// function or server that stops on it.
///
/// Must be called within a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        )
    };
    async move {
        #[cfg(unix)]
        match signals {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => drop(tokio::signal::ctrl_c().await),
        }
        #[cfg(not(unix))]
        drop(tokio::signal::ctrl_c().await);
        tracing::info!("shutting down: draining in-flight requests");
    }
}
