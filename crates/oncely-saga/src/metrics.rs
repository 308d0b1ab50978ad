//! Metric names the orchestrator records (through the `metrics` facade). Label `kind`
//! (the saga's kind) always; `state`, `step` and `phase` as named.
//!
//! The counters and the histogram are recorded inside the transaction of the transition
//! they count: a transaction that then rolls back (the store failed, the settle lost its
//! lease) has counted a transition that is tried again, so they may over-count by the
//! retries; the gauges are read from the store ([`crate::Orchestrator::record_gauges`]).

/// Gauge: sagas per `state` (`running`, `compensating`, `completed`, `compensated`,
/// `needs_review`).
pub const SAGAS: &str = "oncely_sagas";
/// Counter: compensations started (a saga turned `compensating`).
pub const COMPENSATIONS_STARTED_TOTAL: &str = "oncely_saga_compensations_started_total";
/// Counter: compensations completed (a saga turned `compensated`).
pub const COMPENSATIONS_COMPLETED_TOTAL: &str = "oncely_saga_compensations_completed_total";
/// Gauge: step-log rows in `needs_review`. Alert on any.
pub const STEPS_NEEDS_REVIEW: &str = "oncely_saga_steps_needs_review";
/// Histogram: seconds from a step's start (its intent recorded) to its end, labels `step`
/// and `phase` (`forward`, `compensate`).
pub const STEP_DURATION_SECONDS: &str = "oncely_saga_step_duration_seconds";
/// Counter: steps that timed out (compensation started while their effect was open).
pub const STEP_TIMEOUTS_TOTAL: &str = "oncely_saga_step_timeouts_total";
/// Counter: timed-out steps whose effect committed afterwards (their success is
/// compensated).
pub const LATE_COMMITS_TOTAL: &str = "oncely_saga_late_commits_total";
