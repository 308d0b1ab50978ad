//! Metric names the consumer records (through the `metrics` facade; label `consumer`).

/// Counter: messages whose effect committed and that were acknowledged.
pub const CONSUMED_TOTAL: &str = "oncely_inbox_consumed_total";
/// Counter: redelivered messages the inbox recognised; acknowledged without running the
/// handler.
pub const DUPLICATES_TOTAL: &str = "oncely_inbox_duplicates_skipped_total";
/// Counter: handler failures rescheduled with backoff.
pub const RETRIES_TOTAL: &str = "oncely_inbox_retries_total";
/// Counter: deliveries parked as dead after the attempt limit.
pub const DEAD_LETTERED_TOTAL: &str = "oncely_inbox_dead_lettered_total";
/// Counter: outage waits (database or broker unreachable) whose retry the consumer's budget
/// could not pay for, so it waited its outage cap (`ConsumerConfig::budget`).
pub const RETRY_BUDGET_EXHAUSTED_TOTAL: &str = "oncely_inbox_retry_budget_exhausted_total";
/// Histogram: handler run time (inbox insert to handler return), seconds.
pub const HANDLER_SECONDS: &str = "oncely_inbox_handler_seconds";
/// Histogram bucket bounds (seconds) suited to [`HANDLER_SECONDS`]: 0.5 ms … 30 s.
pub const HANDLER_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Counter: inbox rows deleted after the retention.
pub const COLLECTED_TOTAL: &str = "oncely_inbox_collected_total";

/// Registers the `# HELP` text (and unit) of every metric above with the installed
/// recorder; call it once after installing one (the order service does, in
/// `orders::metrics_handle`).
pub fn describe() {
    metrics::describe_counter!(
        CONSUMED_TOTAL,
        "Messages whose effect committed and that were acknowledged."
    );
    metrics::describe_counter!(
        DUPLICATES_TOTAL,
        "Redelivered messages the inbox recognised; acknowledged without running the handler."
    );
    metrics::describe_counter!(RETRIES_TOTAL, "Handler failures rescheduled with backoff.");
    metrics::describe_counter!(
        DEAD_LETTERED_TOTAL,
        "Deliveries parked as dead after the attempt limit."
    );
    metrics::describe_counter!(
        RETRY_BUDGET_EXHAUSTED_TOTAL,
        "Outage waits (database or broker unreachable) whose retry the consumer's budget could not pay for, so it waited its outage cap (ConsumerConfig::budget)."
    );
    metrics::describe_histogram!(
        HANDLER_SECONDS,
        metrics::Unit::Seconds,
        "Handler run time (inbox insert to handler return), seconds."
    );
    metrics::describe_counter!(COLLECTED_TOTAL, "Inbox rows deleted after the retention.");
}
