//! Metric names the relay records (through the `metrics` facade; the order service renders
//! them in the Prometheus text format on `/metrics`).

/// Gauge: rows in state `pending`.
pub const DEPTH: &str = "oncely_outbox_depth";
/// Gauge: age of the oldest pending row, seconds.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "oncely_outbox_oldest_pending_age_seconds";
/// Gauge: rows in state `dead`.
pub const DEAD: &str = "oncely_outbox_dead";
/// Counter: rows confirmed by the broker and marked published (label `broker`).
pub const PUBLISHED_TOTAL: &str = "oncely_outbox_published_total";
/// Histogram: from the row's commit (its `created_at`) to the broker's confirmation,
/// seconds (label `broker`).
pub const PUBLISH_LATENCY_SECONDS: &str = "oncely_outbox_publish_latency_seconds";
/// Histogram: duration of one batch's publish and confirmation, seconds (label `broker`).
pub const PUBLISH_BATCH_SECONDS: &str = "oncely_outbox_publish_batch_seconds";
/// Counter: failed publish attempts (label `broker`).
pub const PUBLISH_FAILURES_TOTAL: &str = "oncely_outbox_publish_failures_total";
/// Counter: outage rounds whose retry the relay's budget could not pay for, so the relay
/// waited its outage cap (label `broker`; `RelayConfig::budget`).
pub const RETRY_BUDGET_EXHAUSTED_TOTAL: &str = "oncely_outbox_retry_budget_exhausted_total";
/// Counter: rows that went dead after the attempt limit.
pub const DEAD_TOTAL: &str = "oncely_outbox_dead_total";
/// Counter: published rows deleted after retention.
pub const DELETED_TOTAL: &str = "oncely_outbox_deleted_total";
/// Counter: vacuums of `oncely_outbox` a relay ran (PostgreSQL, see
/// `RelayConfig::vacuum_after_rows`).
pub const VACUUMS_TOTAL: &str = "oncely_outbox_vacuums_total";

/// Histogram bucket bounds (seconds) suited to publish latency: 1 ms … 30 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Registers the `# HELP` text (and unit) of every metric above with the installed
/// recorder; call it once after installing one (the order service does, in
/// `orders::metrics_handle`).
pub fn describe() {
    metrics::describe_gauge!(DEPTH, "Rows in state pending.");
    metrics::describe_gauge!(
        OLDEST_PENDING_AGE_SECONDS,
        metrics::Unit::Seconds,
        "Age of the oldest pending row, seconds."
    );
    metrics::describe_gauge!(DEAD, "Rows in state dead.");
    metrics::describe_counter!(
        PUBLISHED_TOTAL,
        "Rows confirmed by the broker and marked published (label broker)."
    );
    metrics::describe_histogram!(
        PUBLISH_LATENCY_SECONDS,
        metrics::Unit::Seconds, "From the row's commit (its created_at) to the broker's confirmation, seconds (label broker)."
    );
    metrics::describe_histogram!(
        PUBLISH_BATCH_SECONDS,
        metrics::Unit::Seconds,
        "Duration of one batch's publish and confirmation, seconds (label broker)."
    );
    metrics::describe_counter!(
        PUBLISH_FAILURES_TOTAL,
        "Failed publish attempts (label broker)."
    );
    metrics::describe_counter!(
        RETRY_BUDGET_EXHAUSTED_TOTAL,
        "Outage rounds whose retry the relay's budget could not pay for, so the relay waited its outage cap (label broker; RelayConfig::budget)."
    );
    metrics::describe_counter!(DEAD_TOTAL, "Rows that went dead after the attempt limit.");
    metrics::describe_counter!(DELETED_TOTAL, "Published rows deleted after retention.");
    metrics::describe_counter!(
        VACUUMS_TOTAL,
        "Vacuums of oncely_outbox a relay ran (PostgreSQL, see RelayConfig::vacuum_after_rows)."
    );
}
