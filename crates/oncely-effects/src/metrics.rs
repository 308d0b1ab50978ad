//! Metric names the effect runner and the reconciler record (through the `metrics`
//! facade). Labels: `provider` always; `outcome`, `result`, `state` and `kind` as named.

/// Counter: calls made, label `outcome` = `succeeded` | `failed` | `retryable` | `unknown` |
/// `not_sent`. A rising `unknown` rate means the provider times out or drops answers.
pub const ATTEMPTS_TOTAL: &str = "oncely_effect_attempts_total";
/// Counter: status checks of unknown outcomes, label `result` = `found` | `absent` |
/// `not_yet_visible` | `unavailable` | `invalid`.
pub const RESOLUTIONS_TOTAL: &str = "oncely_effect_resolutions_total";
/// Counter: waits lengthened because the provider's retry budget was spent (it failed
/// broadly; callers back off instead of storming it).
pub const BUDGET_EXHAUSTED_TOTAL: &str = "oncely_effect_budget_exhausted_total";
/// Gauge: effects per `state` (`pending`, `in_flight`, `succeeded`, `failed`, `unknown`,
/// `absent`, `needs_review`).
pub const EFFECTS: &str = "oncely_effects";
/// Gauge: effects waiting for a person (`needs_review`). Alert on any.
pub const NEEDS_REVIEW: &str = "oncely_effects_needs_review";
/// Gauge: seconds since the longest-waiting `unknown` effect last changed (0 when none).
/// Alert when it exceeds the provider's settle time plus a few status checks.
pub const OLDEST_UNKNOWN_AGE_SECONDS: &str = "oncely_effect_oldest_unknown_age_seconds";
/// Gauge: open reconciliation discrepancies, label `kind` = `missing_remote` |
/// `missing_local` | `amount_mismatch` | `status_mismatch` | `duplicate_remote`. Alert on
/// any; each is resolved by a person (`oncely reconcile resolve`).
pub const RECONCILE_DISCREPANCIES: &str = "oncely_reconcile_discrepancies";
/// Gauge: when the provider's latest reconciliation run finished, Unix seconds. Alert when
/// it is older than a few reconciliation intervals.
pub const RECONCILE_LAST_RUN_TIMESTAMP_SECONDS: &str =
    "oncely_reconcile_last_run_timestamp_seconds";

/// Registers the `# HELP` text (and unit) of every metric above with the installed
/// recorder; call it once after installing one (the order service does, in
/// `orders::metrics_handle`).
pub fn describe() {
    metrics::describe_counter!(
        ATTEMPTS_TOTAL,
        "Calls made, label outcome = succeeded | failed | retryable | unknown | not_sent. A rising unknown rate means the provider times out or drops answers."
    );
    metrics::describe_counter!(
        RESOLUTIONS_TOTAL,
        "Status checks of unknown outcomes, label result = found | absent | not_yet_visible | unavailable | invalid."
    );
    metrics::describe_counter!(
        BUDGET_EXHAUSTED_TOTAL,
        "Waits lengthened because the provider's retry budget was spent (it failed broadly; callers back off instead of storming it)."
    );
    metrics::describe_gauge!(
        EFFECTS,
        "Effects per state (pending, in_flight, succeeded, failed, unknown, absent, needs_review)."
    );
    metrics::describe_gauge!(
        NEEDS_REVIEW,
        "Effects waiting for a person (needs_review). Alert on any."
    );
    metrics::describe_gauge!(
        OLDEST_UNKNOWN_AGE_SECONDS,
        metrics::Unit::Seconds, "Seconds since the longest-waiting unknown effect last changed (0 when none). Alert when it exceeds the provider's settle time plus a few status checks."
    );
    metrics::describe_gauge!(
        RECONCILE_DISCREPANCIES,
        "Open reconciliation discrepancies, label kind = missing_remote | missing_local | amount_mismatch | status_mismatch | duplicate_remote. Alert on any; each is resolved by a person (oncely reconcile resolve)."
    );
    metrics::describe_gauge!(
        RECONCILE_LAST_RUN_TIMESTAMP_SECONDS,
        metrics::Unit::Seconds, "When the provider's latest reconciliation run finished, Unix seconds. Alert when it is older than a few reconciliation intervals."
    );
}
