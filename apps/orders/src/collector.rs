use std::time::Duration;

use oncely_sql::{IdempotencyStore, Retention, RetentionSweep};

use crate::AppConfig;

/// The retention collector as a [`RetentionSweep`] named `idempotency`: every `interval` it
/// deletes finished idempotency records past `expires_at`, `batch` rows per statement with a
/// short pause between statements, so it never holds locks long, and counts them in
/// `oncely_idempotency_collected_total`. Records in `processing`/`unknown` are never
/// collected.
pub fn collector_sweep(store: IdempotencyStore, interval: Duration, batch: u32) -> RetentionSweep {
    RetentionSweep::new("idempotency", interval, batch, move |now_ms, batch| {
        let store = store.clone();
        async move {
            let n = store.collect_expired(now_ms, batch).await?;
            metrics::counter!(crate::metrics::IDEMPOTENCY_COLLECTED_TOTAL).increment(n);
            Ok::<_, oncely_sql::StoreError>(n)
        }
    })
    .pausing(Duration::from_millis(20))
}

/// The service's one background retention runner: the collector ([`collector_sweep`],
/// every `collector_interval`) and the lease sweep of multi-phase records
/// ([`oncely_http::lease_sweep`], every `lease_sweep_interval`: records whose holder died
/// turn `unknown` without waiting for a retry). Run it with [`Retention::spawn`].
pub fn retention(store: &IdempotencyStore, config: &AppConfig) -> Retention {
    Retention::new()
        .sweep(collector_sweep(
            store.clone(),
            config.collector_interval,
            config.collector_batch,
        ))
        .sweep(oncely_http::lease_sweep(
            store.clone(),
            config.lease_sweep_interval,
        ))
}
