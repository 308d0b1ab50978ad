//! The supervised outbox relay.

use std::future::Future;
use std::time::Duration;

use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::Database;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::broker::not_built;
use crate::metrics::run_until_shutdown;
use crate::{BrokerConfig, MetricsEndpoint, RuntimeError};

/// First wait before retrying a broker that cannot be reached at start-up; it doubles.
const FIRST_RETRY: Duration = Duration::from_secs(1);
/// Longest wait between two connection attempts.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// An outbox relay on a configured broker, supervised: a broker that cannot be reached at
/// start-up does not stop it.
#[derive(Debug, Clone, Default)]
pub struct RelaySupervisor {
    /// The broker the relay publishes to.
    pub broker: BrokerConfig,
    /// The relay's settings (batch, polling, lease, retries, retention).
    pub relay: RelayConfig,
}

impl RelaySupervisor {
    /// Starts the relay task on `db` (migrated); cancel `shutdown` and await the handle to
    /// stop it (in-flight batches settle first, then the publisher is closed).
    ///
    /// A broker that cannot be reached at start-up does not end the task: the outbox keeps every event while the task retries the connection
    /// (1 s doubling to 30 s, each failure logged at `WARN` with its cause), then relays.
    ///
    /// Must be called within a Tokio runtime.
    ///
    /// # Errors
    /// [`RuntimeError::BrokerNotBuilt`] at once, for a broker whose feature is off (a
    /// configuration error no retry can mend).
    pub fn spawn(
        &self,
        db: &Database,
        shutdown: CancellationToken,
    ) -> Result<JoinHandle<()>, RuntimeError> {
        if !self.broker.kind.is_built() {
            return Err(not_built(self.broker.kind));
        }
        let (this, db) = (self.clone(), db.clone());
        Ok(tokio::spawn(async move {
            let mut backoff = FIRST_RETRY;
            let publisher = loop {
                match this.broker.publisher(&db).await {
                    Ok(p) => break p,
                    Err(e) => {
                        tracing::warn!(
                            error = oncely_broker::error_chain(&e),
                            retry_in_s = backoff.as_secs(),
                            "broker unreachable; events wait in the outbox"
                        );
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(MAX_RETRY);
                    }
                }
            };
            tracing::info!(broker = publisher.name(), "outbox relay starting");
            let relay = Relay::new(db, publisher.clone(), this.relay.clone());
            relay.run(shutdown).await;
            publisher.close().await;
        }))
    }
}

/// Runs `relay` on `db` (migrated) until `shutdown` resolves, with `GET /metrics` on
/// `metrics` when given; then stops the relay (in-flight batches settle) and the metrics
/// listener, and returns.
///
/// # Errors
/// [`RuntimeError::Bind`] when the metrics address cannot be bound (before the relay
/// starts); [`RuntimeError::BrokerNotBuilt`] as [`RelaySupervisor::spawn`];
/// [`RuntimeError::Task`] when the relay or the listener task panicked.
pub async fn run_relay(
    db: &Database,
    relay: &RelaySupervisor,
    metrics: Option<MetricsEndpoint>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RuntimeError> {
    run_until_shutdown(
        metrics,
        shutdown,
        |stop| async move { relay.spawn(db, stop) },
    )
    .await
}
