use std::time::Duration;

use oncely_sql::IdempotencyStore;
use tokio_util::sync::CancellationToken;

/// Spawns the retention collector: every `interval` it deletes finished idempotency records
/// past `expires_at`, `batch` rows per statement with a short pause between statements, so
/// it never holds locks long. Records in `processing`/`unknown` are never collected. Stops
/// when `shutdown` is cancelled.
pub fn spawn_collector(
    store: IdempotencyStore,
    interval: Duration,
    batch: u32,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            loop {
                match store.collect_expired(oncely_core::now_ms(), batch).await {
                    Ok(n) => {
                        metrics::counter!(crate::metrics::IDEMPOTENCY_COLLECTED_TOTAL).increment(n);
                        if n < u64::from(batch) {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention collector failed; will retry");
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
}
