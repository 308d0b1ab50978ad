//! Publishing a claimed batch and settling it: each row's outcome sorted into published, retried or dead, and reported.

use std::collections::HashMap;
use std::time::Duration;

use oncely_broker::{Message, PublishError};
use oncely_core::{Failure, MessageId, OutcomeClass, RetryDecision};
use oncely_sql::{ClaimedBatch, OutboxRow, PublishFailure, Rescheduled, Settled};

use super::{to_message, Relay, RoundReport};
use crate::metrics as m;

impl Relay {
    pub(super) async fn publish(&self, rows: &[OutboxRow]) -> Vec<Result<(), PublishError>> {
        let messages: Vec<Message> = rows.iter().map(|r| to_message(r.event.clone())).collect();
        let started = std::time::Instant::now();
        let results = self.publisher.publish(&messages).await;
        tracing::trace!(
            rows = rows.len(),
            micros = started.elapsed().as_micros() as u64,
            "publish"
        );
        metrics::histogram!(m::PUBLISH_BATCH_SECONDS, "broker" => self.publisher.name())
            .record(started.elapsed().as_secs_f64());
        results
    }

    /// Marks the confirmed rows published and reschedules the others, in one transaction
    /// on PostgreSQL.
    pub(super) async fn settle(
        &self,
        batch: ClaimedBatch,
        results: Vec<Result<(), PublishError>>,
    ) -> RoundReport {
        // The broker confirmed (or refused) every row; the outbox does not know yet. A crash
        // here publishes the confirmed rows again, under the same message ids.
        oncely_core::failpoint::fail_point!(
            "relay.after_confirm",
            !batch.rows().is_empty(),
            |_| { RoundReport::default() }
        );
        let started = std::time::Instant::now();
        let confirmed_at = oncely_core::now_ms();
        let outcomes = self.sort_results(batch.rows(), results, confirmed_at);
        match &outcomes.unavailable {
            Some(e) => self.health.broker.down(e),
            None if outcomes.answered => self.health.broker.up(),
            None => {}
        }
        let mut report = RoundReport {
            claimed: batch.rows().len(),
            deferred: outcomes.deferred,
            ..RoundReport::default()
        };
        match batch
            .settle(
                &outcomes.ok_ids,
                confirmed_at,
                &outcomes.failures,
                self.config.retry.max_attempts,
            )
            .await
        {
            Ok(settled) => {
                self.health.database.up();
                self.report_settled(&mut report, &outcomes, settled);
            }
            Err(e) => {
                // Nothing recorded: every row comes back (PostgreSQL at once, else after its
                // lease) with its attempts as they were.
                report.deferred = report.claimed;
                tracing::debug!(error = %e, rows = report.claimed,
                    "could not settle the batch; its rows will be republished with the same \
                     message ids");
                self.health.database.down(&e);
            }
        }
        tracing::trace!(
            rows = report.claimed,
            micros = started.elapsed().as_micros() as u64,
            "settle"
        );
        self.count_claimed(report.claimed);
        report
    }

    /// Sorts the rows of a batch by their publish results, in order: confirmed (latency
    /// recorded), deferred (the broker was unavailable) or failed.
    pub(super) fn sort_results(
        &self,
        rows: &[OutboxRow],
        results: Vec<Result<(), PublishError>>,
        confirmed_at: i64,
    ) -> Outcomes {
        let broker = self.publisher.name();
        let mut results = results.into_iter();
        let mut out = Outcomes {
            ok_ids: Vec::with_capacity(rows.len()),
            failures: Vec::new(),
            attempts: HashMap::new(),
            deferred: 0,
            unavailable: None,
            answered: false,
        };
        // One registry lookup per batch, not per row.
        let latency = metrics::histogram!(m::PUBLISH_LATENCY_SECONDS, "broker" => broker);
        for row in rows {
            // A message over the broker's size limit never fits: dead at once.
            let (error, permanent) = match results.next() {
                Some(Ok(())) => {
                    out.answered = true;
                    out.ok_ids.push(row.id);
                    let latency_ms = confirmed_at.saturating_sub(row.created_at).max(0);
                    latency.record(latency_ms as f64 / 1000.0);
                    continue;
                }
                Some(Err(e)) if e.is_transient() => {
                    // Not an attempt of this message: the row goes back as it was (neither
                    // published nor failed in `settle`), the relay backs off as a whole.
                    metrics::counter!(m::PUBLISH_FAILURES_TOTAL, "broker" => broker).increment(1);
                    tracing::debug!(id = row.id, message_id = %row.event.message_id, error = %e,
                        "publish deferred: broker unavailable");
                    out.deferred += 1;
                    out.unavailable.get_or_insert(e);
                    continue;
                }
                Some(Err(e)) => {
                    out.answered = true;
                    (e.to_string(), e.is_too_large())
                }
                None => ("publisher returned no result".to_owned(), false),
            };
            self.fail(&mut out, row, error, permanent);
        }
        out
    }

    /// Adds a failure of `row` itself to `out`; `permanent`: it can never succeed. Whether
    /// it is retried (after the backoff) or goes dead is [`RetryPolicy::decide`]'s answer
    /// for this attempt: a final failure, the attempt limit or the deadline make it dead.
    pub(super) fn fail(&self, out: &mut Outcomes, row: &OutboxRow, error: String, permanent: bool) {
        let failures_so_far = row.attempts.saturating_add(1);
        let now = oncely_core::now_ms();
        let failure = Failure {
            failures: failures_so_far,
            // The broker answered that it did not take the message (refused, unroutable);
            // a message over its size limit can never be taken.
            class: if permanent {
                OutcomeClass::Final
            } else {
                OutcomeClass::Retryable
            },
            retry_after: None,
            elapsed: Duration::from_millis(
                u64::try_from(now.saturating_sub(row.created_at)).unwrap_or(0),
            ),
            timed_out: false,
        };
        let (delay, dead) = match self
            .config
            .retry
            .decide(&failure, None, rand::random::<f64>())
        {
            RetryDecision::RetryAfter(delay) => (delay, false),
            _ => (Duration::ZERO, true),
        };
        let retry_at = oncely_core::ms_after(now, delay);
        metrics::counter!(m::PUBLISH_FAILURES_TOTAL, "broker" => self.publisher.name())
            .increment(1);
        out.attempts.insert(
            row.id,
            FailedAttempt {
                message_id: row.event.message_id,
                attempts: failures_so_far,
                delay,
                error: error.clone(),
            },
        );
        let mut failure = PublishFailure::new(row.id, error, retry_at);
        // The store makes a permanent failure dead at once, this attempt counted.
        failure.permanent = dead;
        out.failures.push(failure);
    }

    /// Counts and logs what the store recorded for a batch.
    pub(super) fn report_settled(
        &self,
        report: &mut RoundReport,
        outcomes: &Outcomes,
        settled: Settled,
    ) {
        report.published = usize::try_from(settled.published).unwrap_or(usize::MAX);
        metrics::counter!(m::PUBLISHED_TOTAL, "broker" => self.publisher.name())
            .increment(settled.published);
        if settled.published < outcomes.ok_ids.len() as u64 {
            tracing::warn!(
                confirmed = outcomes.ok_ids.len(),
                marked = settled.published,
                "some leases ran out before marking; those rows will be \
                 republished with the same message ids"
            );
        }
        for (id, outcome) in settled.failures {
            let Some(FailedAttempt {
                message_id,
                attempts,
                delay,
                error,
            }) = outcomes.attempts.get(&id)
            else {
                continue;
            };
            match outcome {
                Rescheduled::Dead => {
                    report.dead += 1;
                    metrics::counter!(m::DEAD_TOTAL).increment(1);
                    tracing::error!(id, %message_id, attempts, error,
                        "outbox event is dead (attempt limit reached, or a \
                         message the broker can never take)");
                }
                Rescheduled::Retry => {
                    report.retried += 1;
                    tracing::warn!(id, %message_id, attempts,
                        retry_in_ms = oncely_core::millis(*delay), error,
                        "publish failed; rescheduled");
                }
                _ => {}
            }
        }
    }
}

/// A batch's publish results, sorted for [`ClaimedBatch::settle`].
pub(super) struct Outcomes {
    /// Confirmed rows.
    ok_ids: Vec<i64>,
    failures: Vec<PublishFailure>,
    /// By row id: what to log once the store has recorded the failure.
    attempts: HashMap<i64, FailedAttempt>,
    /// Rows given back untouched: the broker was unavailable.
    deferred: usize,
    /// The first failure that is not the message's fault.
    unavailable: Option<PublishError>,
    /// The broker gave an answer about some message, so it is reachable.
    answered: bool,
}

/// A publish that failed through the message's own fault.
pub(super) struct FailedAttempt {
    message_id: MessageId,
    /// Counting this one.
    attempts: u32,
    /// Until the next attempt.
    delay: Duration,
    error: String,
}
