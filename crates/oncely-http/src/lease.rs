//! The lease sweep of multi-phase records: the gauges of records in `processing` and
//! `unknown`, and the turning of records past their lease to `unknown` without waiting for
//! a retry.

use std::time::Duration;

use oncely_sql::{IdempotencyStore, LeaseReport, RetentionSweep, StoreError, UNKNOWN_AGE_BUCKETS};

use crate::metrics as metric;

/// Sets the multi-phase gauges from `report` (see [`crate::metrics`]).
#[allow(clippy::cast_precision_loss)] // counts and ages far below 2^52
pub fn record_lease_gauges(report: &LeaseReport) {
    metrics::gauge!(metric::PROCESSING).set(report.processing as f64);
    metrics::gauge!(metric::PROCESSING_PAST_LEASE).set(report.processing_past_lease as f64);
    for (bucket, n) in UNKNOWN_AGE_BUCKETS.iter().zip(report.unknown_by_age) {
        metrics::gauge!(metric::UNKNOWN_RECORDS, "age" => *bucket).set(n as f64);
    }
    let oldest = report.oldest_unknown_ms.unwrap_or(0) as f64 / 1000.0;
    metrics::gauge!(metric::OLDEST_UNKNOWN_SECONDS).set(oldest);
}

/// One round of the lease sweep at `now_ms`: reads the [`LeaseReport`] and sets the gauges
/// from it (so records stuck in `processing` past their lease show before they are
/// turned), then turns up to `batch` such records `unknown`
/// ([`IdempotencyStore::expire_leases`]). Returns the report and how many were turned.
///
/// # Errors
/// [`StoreError`] when the database fails.
pub async fn sweep_leases(
    store: &IdempotencyStore,
    now_ms: i64,
    batch: u32,
) -> Result<(LeaseReport, u64), StoreError> {
    let report = store.lease_report(now_ms).await?;
    record_lease_gauges(&report);
    let turned = store.expire_leases(now_ms, batch).await?;
    Ok((report, turned))
}

/// The lease sweep as a [`RetentionSweep`] named `lease` for a [`Retention`] runner: a
/// round at start-up, then every `every`, of [`sweep_leases`] in batches of 500 repeated
/// while full. A failed round is retried by the runner's policy: a database that is down is
/// not the records' fault.
///
/// [`Retention`]: oncely_sql::Retention
pub fn lease_sweep(store: IdempotencyStore, every: Duration) -> RetentionSweep {
    const BATCH: u32 = 500;
    RetentionSweep::new("lease", every, BATCH, move |now_ms, batch| {
        let store = store.clone();
        async move { Ok::<_, StoreError>(sweep_leases(&store, now_ms, batch).await?.1) }
    })
    .at_once()
}
