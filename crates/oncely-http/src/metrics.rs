//! Metric names the idempotency layer records, through the `metrics` facade (the service
//! renders them, e.g. in the Prometheus text format on `/metrics`). One place for the
//! names, so dashboards, alerts and tests spell them as the code does.

/// Counter: answers replayed from a stored outcome (database or cache), i.e. retries that
/// did not run the handler again.
pub const REPLAYS_TOTAL: &str = "oncely_idempotency_replays_total";
/// Counter: replays served from the per-process cache of finished outcomes, without a
/// database round trip (a subset of [`REPLAYS_TOTAL`] when the cache answers).
pub const REPLAY_CACHE_HITS_TOTAL: &str = "oncely_idempotency_replay_cache_hits_total";
/// Counter: first executions of a key (the handler ran under a fresh reservation).
pub const EXECUTIONS_TOTAL: &str = "oncely_idempotency_executions_total";
/// Counter: a key reused with a different request (422 `idempotency-key-reused`): a client
/// bug, or two operations sharing one key.
pub const FINGERPRINT_MISMATCHES_TOTAL: &str = "oncely_idempotency_fingerprint_mismatches_total";
/// Counter: retries that found their record `unknown` (409 `outcome-unknown`).
pub const UNKNOWN_TOTAL: &str = "oncely_idempotency_unknown_total";
/// Counter: retries that found their key still being processed (409 `request-in-flight`).
pub const IN_FLIGHT_TOTAL: &str = "oncely_idempotency_in_flight_total";
/// Counter: executions whose commit could not be confirmed, or that ran past the execution
/// timeout (503 `execution-outcome-unknown`).
pub const OUTCOME_UNKNOWN_TOTAL: &str = "oncely_idempotency_outcome_unknown_total";
/// Counter: requests answered 503 `store-unavailable` (the store could not be reached:
/// failing closed).
pub const STORE_UNAVAILABLE_TOTAL: &str = "oncely_idempotency_store_unavailable_total";
/// Counter: requests refused before any lookup, label `reason` = `malformed_key` |
/// `missing_key`.
pub const REJECTED_TOTAL: &str = "oncely_idempotency_rejected_total";
/// Counter: executions rolled back with nothing stored, label `reason` = `5xx` |
/// `not_stored` | `response_too_large` | `response_body` | `lost_race` | `panic`.
pub const ROLLBACKS_TOTAL: &str = "oncely_idempotency_rollbacks_total";

/// Counter: multi-phase completions or releases refused because the holder's record was
/// taken over (a stale fencing token): the new holder's outcome stood.
pub const FENCED_TOTAL: &str = "oncely_idempotency_fenced_total";
/// Counter: multi-phase records turned `unknown` by their own holder, label `reason` =
/// `5xx` | `panic` | `timeout` | `response` (it may have called out before failing).
pub const ABANDONED_TOTAL: &str = "oncely_idempotency_abandoned_total";
/// Counter: status checks of `unknown` records, label `outcome` = `found` (completed from
/// the provider) | `absent` (run again with the same key) | `unknown` (still unknown).
pub const RESOLUTIONS_TOTAL: &str = "oncely_idempotency_resolutions_total";
/// Gauge: multi-phase records in `processing`, as of the last lease sweep.
pub const PROCESSING: &str = "oncely_idempotency_processing";
/// Gauge: `processing` records past their lease (a holder that died or hangs), as of the
/// last lease sweep, before it turned them `unknown`.
pub const PROCESSING_PAST_LEASE: &str = "oncely_idempotency_processing_past_lease";
/// Gauge: `unknown` records by how long they have been unknown, label `age` = `under_5m` |
/// `5m_to_1h` | `1h_to_24h` | `over_24h`, as of the last lease sweep.
pub const UNKNOWN_RECORDS: &str = "oncely_idempotency_unknown_records";
/// Gauge: how long the oldest `unknown` record has been unknown, in seconds (0 when there
/// is none), as of the last lease sweep.
pub const OLDEST_UNKNOWN_SECONDS: &str = "oncely_idempotency_oldest_unknown_seconds";
/// Counter: request bodies refused before they were read by
/// [`read_body`](crate::read_body), label `reason` = `busy` (the body budget is spent:
/// 503) | `timeout` (the body deadline passed: 408).
pub const HTTP_BODY_REJECTED_TOTAL: &str = "oncely_http_body_rejected_total";

/// Every counter above: registered at 0 when a layer is built, so `rate()` and alerts see
/// them before the first event.
pub(crate) const COUNTERS: &[&str] = &[
    REPLAYS_TOTAL,
    REPLAY_CACHE_HITS_TOTAL,
    EXECUTIONS_TOTAL,
    FINGERPRINT_MISMATCHES_TOTAL,
    UNKNOWN_TOTAL,
    IN_FLIGHT_TOTAL,
    OUTCOME_UNKNOWN_TOTAL,
    STORE_UNAVAILABLE_TOTAL,
];

/// Registers the `# HELP` text (and unit) of every metric above with the installed
/// recorder; call it once after installing one (the order service does, in
/// `orders::metrics_handle`).
pub fn describe() {
    metrics::describe_counter!(
        REPLAYS_TOTAL,
        "Answers replayed from a stored outcome (database or cache), i.e. retries that did not run the handler again."
    );
    metrics::describe_counter!(
        REPLAY_CACHE_HITS_TOTAL,
        "Replays served from the per-process cache of finished outcomes, without a database round trip (a subset of REPLAYS_TOTAL when the cache answers)."
    );
    metrics::describe_counter!(
        EXECUTIONS_TOTAL,
        "First executions of a key (the handler ran under a fresh reservation)."
    );
    metrics::describe_counter!(
        FINGERPRINT_MISMATCHES_TOTAL,
        "A key reused with a different request (422 idempotency-key-reused): a client bug, or two operations sharing one key."
    );
    metrics::describe_counter!(
        UNKNOWN_TOTAL,
        "Retries that found their record unknown (409 outcome-unknown)."
    );
    metrics::describe_counter!(
        IN_FLIGHT_TOTAL,
        "Retries that found their key still being processed (409 request-in-flight)."
    );
    metrics::describe_counter!(
        OUTCOME_UNKNOWN_TOTAL,
        "Executions whose commit could not be confirmed, or that ran past the execution timeout (503 execution-outcome-unknown)."
    );
    metrics::describe_counter!(
        STORE_UNAVAILABLE_TOTAL,
        "Requests answered 503 store-unavailable (the store could not be reached: failing closed)."
    );
    metrics::describe_counter!(
        REJECTED_TOTAL,
        "Requests refused before any lookup, label reason = malformed_key | missing_key."
    );
    metrics::describe_counter!(
        ROLLBACKS_TOTAL,
        "Executions rolled back with nothing stored, label reason = 5xx | not_stored | response_too_large | response_body | lost_race | panic."
    );
    metrics::describe_counter!(
        FENCED_TOTAL,
        "Multi-phase completions or releases refused because the holder's record was taken over (a stale fencing token): the new holder's outcome stood."
    );
    metrics::describe_counter!(
        ABANDONED_TOTAL,
        "Multi-phase records turned unknown by their own holder, label reason = 5xx | panic | timeout | response (it may have called out before failing)."
    );
    metrics::describe_counter!(
        RESOLUTIONS_TOTAL,
        "Status checks of unknown records, label outcome = found (completed from the provider) | absent (run again with the same key) | unknown (still unknown)."
    );
    metrics::describe_gauge!(
        PROCESSING,
        "Multi-phase records in processing, as of the last lease sweep."
    );
    metrics::describe_gauge!(
        PROCESSING_PAST_LEASE,
        "Processing records past their lease (a holder that died or hangs), as of the last lease sweep, before it turned them unknown."
    );
    metrics::describe_gauge!(
        UNKNOWN_RECORDS,
        "Unknown records by how long they have been unknown, label age = under_5m | 5m_to_1h | 1h_to_24h | over_24h, as of the last lease sweep."
    );
    metrics::describe_counter!(
        HTTP_BODY_REJECTED_TOTAL,
        "Request bodies refused before they were read, reason = busy (the body budget is \
         spent: 503) | timeout (the body deadline passed: 408)."
    );
    metrics::describe_gauge!(
        OLDEST_UNKNOWN_SECONDS,
        metrics::Unit::Seconds, "How long the oldest unknown record has been unknown, in seconds (0 when there is none), as of the last lease sweep."
    );
}
