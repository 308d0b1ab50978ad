//! The relay as a service: the drain loop woken by PostgreSQL notifications or a poll, with its stats and retention loops.

use std::sync::Arc;
use std::time::Duration;

use oncely_sql::{OutboxStore, Retention, RetentionSweep};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Relay, RelayConfig};
use crate::metrics as m;

impl Relay {
    /// The wait after the `rounds`-th round in a row that found a dependency down:
    /// [`RelayConfig::outage`]'s backoff while [`RelayConfig::budget`] pays for the retry,
    /// its cap once the budget is spent.
    pub(super) fn outage_wait(&self, rounds: u32) -> Duration {
        let decided = self.config.outage.outage_wait(
            rounds,
            None,
            Some(&self.config.budget),
            rand::random::<f64>(),
        );
        if decided.budget_exhausted {
            metrics::counter!(m::RETRY_BUDGET_EXHAUSTED_TOTAL, "broker" => self.publisher.name())
                .increment(1);
        }
        decided.wait
    }

    /// Runs until `shutdown` is cancelled: rounds back to back while there is work, else
    /// waits for a PostgreSQL notification or the poll interval. Alongside, updates the
    /// outbox gauges every `stats_interval` and deletes published rows past `retention`.
    /// Returns after the current round finishes.
    pub async fn run(self, shutdown: CancellationToken) {
        // Counters show 0 from the start, so `rate()` and alerts see them before the first
        // event (Prometheus' advice for counters).
        let broker = self.publisher.name();
        for name in [
            m::PUBLISHED_TOTAL,
            m::PUBLISH_FAILURES_TOTAL,
            m::RETRY_BUDGET_EXHAUSTED_TOTAL,
        ] {
            metrics::counter!(name, "broker" => broker).increment(0);
        }
        for name in [m::DEAD_TOTAL, m::DELETED_TOTAL, m::VACUUMS_TOTAL] {
            metrics::counter!(name).increment(0);
        }
        let tracker = TaskTracker::new();
        let wake = Arc::new(Notify::new());
        if self.config.listen {
            if let Some(pool) = self.store.database().as_postgres() {
                tracker.spawn(listen(pool.clone(), wake.clone(), shutdown.clone()));
            }
        }
        tracker.spawn(stats_loop(
            self.store.clone(),
            self.config.stats_interval,
            shutdown.clone(),
        ));
        tracker.spawn(
            Retention::new()
                .sweep(published_sweep(self.store.clone(), &self.config))
                .run(shutdown.clone()),
        );
        tracker.close();
        tracing::info!(relay = %self.config.relay_id, broker = self.publisher.name(), "relay running");
        // Rounds in a row that found the broker or the database unavailable.
        let mut outage_rounds = 0u32;
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let busy = match self.drain_woken(&shutdown, Some(&wake)).await {
                Ok(r) => r.claimed > 0,
                // Logged once per state change by the database's health.
                Err(e) => {
                    tracing::debug!(error = %e, "relay round failed");
                    false
                }
            };
            if self.health.any_down() {
                outage_rounds = outage_rounds.saturating_add(1);
                let wait = self.outage_wait(outage_rounds);
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            // A round that found everything up: a retry that succeeded gets its cost back,
            // any other success deposits the bucket's increment.
            self.config
                .budget
                .on_success((outage_rounds > 0).then_some(false));
            outage_rounds = 0;
            if busy {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = wake.notified() => {}
                () = tokio::time::sleep(self.config.poll_interval) => {}
            }
        }
        tracker.wait().await;
        tracing::info!(relay = %self.config.relay_id, "relay stopped");
    }
}

/// Wakes the relay on every `NOTIFY oncely_outbox`. A lost connection is re-established
/// (notifications in between are lost; polling covers them).
pub(super) async fn listen(pool: sqlx::PgPool, wake: Arc<Notify>, shutdown: CancellationToken) {
    loop {
        let listener = async {
            let mut l = sqlx::postgres::PgListener::connect_with(&pool).await?;
            l.listen("oncely_outbox").await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            () = shutdown.cancelled() => return,
            l = listener => match l {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(error = %e, "LISTEN failed; polling until it works");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            }
        };
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                n = listener.recv() => match n {
                    Ok(_) => wake.notify_one(),
                    Err(e) => {
                        tracing::debug!(error = %e, "LISTEN connection lost");
                        break;
                    }
                }
            }
        }
    }
}

pub(super) async fn stats_loop(
    store: OutboxStore,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        match store.stats().await {
            Ok(s) => {
                metrics::gauge!(m::DEPTH).set(s.pending as f64);
                metrics::gauge!(m::DEAD).set(s.dead as f64);
                metrics::gauge!(m::OLDEST_PENDING_AGE_SECONDS)
                    .set(s.oldest_pending_age_ms(oncely_core::now_ms()) as f64 / 1000.0);
            }
            Err(e) => tracing::debug!(error = %e, "outbox stats failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// The deletion of published rows past [`RelayConfig::retention`] as a [`RetentionSweep`]
/// named `outbox` ([`OutboxStore::delete_published`]): every `cleanup_interval`,
/// `cleanup_batch` rows per statement with a 20 ms pause between statements, counted in
/// `oncely_outbox_deleted_total`. [`Relay::run`] runs it when the retention is not zero;
/// public so that a benchmark can time one round of the relay's own sweep.
pub fn published_sweep(store: OutboxStore, config: &RelayConfig) -> RetentionSweep {
    let retention = oncely_core::millis(config.retention);
    RetentionSweep::new(
        "outbox",
        config.cleanup_interval,
        config.cleanup_batch,
        move |now_ms, batch| {
            let store = store.clone();
            async move {
                let before = now_ms.saturating_sub(retention);
                let n = store.delete_published(before, batch).await?;
                metrics::counter!(m::DELETED_TOTAL).increment(n);
                Ok::<_, oncely_sql::StoreError>(n)
            }
        },
    )
    .pausing(Duration::from_millis(20))
}
