use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{DependencyHealth, Message, PublishError, Publisher};
use oncely_core::{Failure, MessageId, OutcomeClass, RetryBudget, RetryDecision, RetryPolicy};
use oncely_sql::{
    ClaimedBatch, Database, OutboxEvent, OutboxRow, OutboxStore, PublishFailure, Rescheduled,
    Settled, StoreError,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics as m;

/// Settings of a [`Relay`].
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// This relay's identity in leases (`locked_by`); unique per running relay. Default: a
    /// random UUID.
    pub relay_id: String,
    /// Most rows claimed (and published as one pipelined window) per round. Default 256.
    pub batch_size: u32,
    /// Batches published at once: while one waits for its confirmations the next goes out,
    /// so commit-to-publish latency is not the sum of two confirmation waits. At most
    /// `batch_size × max_in_flight_batches` messages await confirmation; on PostgreSQL each
    /// batch in flight holds one pooled connection. Default 4.
    pub max_in_flight_batches: usize,
    /// How long a claim stays valid; must exceed the publisher's confirm timeout. A row of a
    /// relay that died is republished (same message id) once its lease runs out.
    /// Default 30 s.
    pub lease: Duration,
    /// Polling interval when idle. With PostgreSQL LISTEN/NOTIFY this is only the fallback
    /// (missed notifications, rows coming out of backoff). Default 250 ms.
    pub poll_interval: Duration,
    /// Use PostgreSQL LISTEN/NOTIFY (channel `oncely_outbox`) to wake up at once when a
    /// transaction with outbox rows commits. Ignored on SQLite. Default `true`.
    pub listen: bool,
    /// Backoff, attempt limit and deadline (from the row's `created_at`) for publishes that
    /// failed through the message's own fault (refused, unroutable, too large), decided by
    /// [`RetryPolicy::decide`]: a row it gives up on goes `dead`. A broker that is
    /// unavailable or does not confirm in time ([`PublishError::is_transient`]) does not
    /// count: see [`RelayConfig::outage`].
    pub retry: RetryPolicy,
    /// Backoff of the relay as a whole while the broker or the database is unavailable: the
    /// rows of the failed batch go back unchanged (pending, no attempt counted, no
    /// `last_error`), and the relay waits [`RetryPolicy::outage_wait`] after the `n`-th
    /// round in a row that found a dependency down before it tries again (one batch is the
    /// probe). `max_attempts` and `deadline` are ignored: an outage, however long, never
    /// makes an event dead. Default: 100 ms base, 5 s cap, so events flow again within
    /// about 5 s of the dependency's return.
    pub outage: RetryPolicy,
    /// The retry budget of the relay's outage rounds ([`RetryBudget`], the AWS SDKs' token
    /// bucket): each round after a failed one withdraws [`RetryBudget::RETRY_COST`], each
    /// round that finds the dependencies up deposits; once it is spent the relay waits
    /// `outage.cap` between rounds (counted in [`m::RETRY_BUDGET_EXHAUSTED_TOTAL`]). Relays
    /// that share a broker share one budget by cloning this `Arc` (a cloned config shares
    /// it), so many of them failing at once do not become a retry storm. Default: a bucket
    /// of [`RetryBudget::DEFAULT_CAPACITY`] (500) tokens of its own.
    pub budget: Arc<RetryBudget>,
    /// How long published rows are kept (for audit, and as a guard against enqueueing a
    /// published message id again) before deletion. Default zero, which keeps none: on
    /// PostgreSQL a published row is forgotten when its batch is settled — no published
    /// record to write, a fifth or more of the relay's throughput in `oncely-bench relay`
    /// — elsewhere the next cleanup deletes it. The broker (a JetStream stream, the
    /// consumers' inboxes) keeps its own record of what was delivered.
    pub retention: Duration,
    /// Interval of the deletion of published rows past retention. Default 60 s.
    pub cleanup_interval: Duration,
    /// Rows deleted per statement. Default 500.
    pub cleanup_batch: u32,
    /// Interval of the depth / oldest-pending-age / dead gauges update. Default 5 s.
    pub stats_interval: Duration,
    /// PostgreSQL: rows this relay claims between two vacuums of `oncely_outbox`
    /// ([`OutboxStore::vacuum`], run in the background, one at a time). Every claimed row
    /// is deleted and leaves a dead index entry that each later claim steps over until a
    /// vacuum removes it, and autovacuum comes at most once a minute. 0 leaves it to
    /// autovacuum. Ignored on SQLite and MySQL. Default 20,000.
    pub vacuum_after_rows: u64,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            relay_id: uuid::Uuid::new_v4().to_string(),
            batch_size: 256,
            max_in_flight_batches: 4,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(250),
            listen: true,
            retry: RetryPolicy::default(),
            outage: RetryPolicy {
                base: Duration::from_millis(100),
                cap: Duration::from_secs(5),
                max_attempts: u32::MAX,
                ..RetryPolicy::default()
            },
            budget: Arc::new(RetryBudget::default()),
            retention: Duration::ZERO,
            cleanup_interval: Duration::from_secs(60),
            cleanup_batch: 500,
            stats_interval: Duration::from_secs(5),
            vacuum_after_rows: 20_000,
        }
    }
}

/// A relay round failed before publishing (the outbox could not be read).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The database failed; [`Relay::run`] retries after [`RelayConfig::outage`]'s backoff.
    #[error("outbox store failed: {0}")]
    Store(#[from] StoreError),
}

/// What one [`Relay::run_once`] round (or a [`Relay::drain`]) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoundReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows confirmed by the broker and marked published.
    pub published: usize,
    /// Rows whose publish failed and that were rescheduled.
    pub retried: usize,
    /// Rows that reached the attempt limit and went dead.
    pub dead: usize,
    /// Rows given back untouched because the broker was unavailable (or its confirmation
    /// timed out), or because the database failed while settling: no attempt counted, the
    /// relay backs off as a whole ([`RelayConfig::outage`]).
    pub deferred: usize,
}

impl RoundReport {
    fn add(&mut self, other: Self) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.retried += other.retried;
        self.dead += other.dead;
        self.deferred += other.deferred;
    }
}

/// The outbox relay: claims the heads of the outbox's partitions (see
/// [`OutboxStore::claim_batch`]), publishes them as one confirmed window, marks the
/// confirmed rows published and reschedules the others with exponential backoff and full
/// jitter, until the attempt limit makes them `dead` (a message over the broker's size limit,
/// [`oncely_broker::PermanentError::TooLarge`], at once: it can never fit). Any number of relays may run against
/// one database; each partition key has at most one event in flight, so its events reach
/// the broker in order.
///
/// Only a fault of the message itself counts as an attempt. While the broker is unavailable
/// or does not confirm in time ([`PublishError::is_transient`]), or the database fails, the
/// rows stay pending with their attempts as they were, and the relay backs off as a whole
/// ([`RelayConfig::outage`]); each dependency's state change is logged once (down with its
/// root cause, up with the outage's length) and shown in the gauge
/// [`oncely_broker::DEPENDENCY_UP`] (`component="relay"`).
///
/// Delivery is at least once: a relay that dies after the broker confirmed but before it
/// settled the rows leaves them unmarked — on PostgreSQL its row locks go with its
/// connection and another relay republishes them at once, on SQLite after their lease —
/// with the same message ids (JetStream drops the copy within its duplicate window; the
/// SQL transport while the first copy is queued; consumers' inboxes otherwise).
#[derive(Debug, Clone)]
pub struct Relay {
    store: OutboxStore,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
    fault_after_confirm: Option<FaultHook>,
    vacuum: Arc<VacuumState>,
    health: Arc<RelayHealth>,
}

/// The relay's view of its two dependencies, shared by its clones.
#[derive(Debug)]
struct RelayHealth {
    broker: DependencyHealth,
    database: DependencyHealth,
}

impl RelayHealth {
    fn any_down(&self) -> bool {
        self.broker.is_down() || self.database.is_down()
    }
}

/// Rows claimed since the last vacuum, shared by a relay's clones (its batch tasks).
#[derive(Debug, Default)]
struct VacuumState {
    rows: std::sync::atomic::AtomicU64,
    running: std::sync::atomic::AtomicBool,
}

/// A fault-injection hook: called with the rows of a batch the broker confirmed, before
/// the batch is settled (see [`Relay::with_fault_after_confirm`]).
pub type FaultAfterConfirm = Arc<dyn Fn(&[OutboxRow]) + Send + Sync>;

#[derive(Clone)]
struct FaultHook(FaultAfterConfirm);

impl std::fmt::Debug for FaultHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FaultHook")
    }
}

impl Relay {
    /// A relay over `db`'s outbox publishing through `publisher`.
    pub fn new(db: Database, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Self {
        let health = Arc::new(RelayHealth {
            broker: DependencyHealth::broker(publisher.name(), "relay"),
            database: DependencyHealth::database(&db, "relay"),
        });
        Self {
            store: OutboxStore::new(db).keep_published(!config.retention.is_zero()),
            publisher,
            config,
            fault_after_confirm: None,
            vacuum: Arc::default(),
            health,
        }
    }

    /// The store this relay claims from.
    pub fn store(&self) -> &OutboxStore {
        &self.store
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Fault injection (tests, chaos drills): `hook` runs after the broker confirmed a
    /// batch and before the batch is settled in the outbox — the crash window of
    /// at-least-once publishing. A hook that aborts the process (`std::process::abort`)
    /// reproduces a relay killed at exactly that point.
    #[must_use]
    pub fn with_fault_after_confirm(mut self, hook: FaultAfterConfirm) -> Self {
        self.fault_after_confirm = Some(FaultHook(hook));
        self
    }

    /// One round: claim a batch, publish it, settle every row. Returns what happened; a
    /// round that claimed `batch_size` rows suggests another round at once.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the claim fails. Failures while settling are logged; the
    /// affected rows are claimable again (PostgreSQL) or after their lease (SQLite) and are
    /// republished with the same message ids.
    pub async fn run_once(&self) -> Result<RoundReport, RelayError> {
        let batch = self.claim().await?;
        if batch.is_empty() {
            return Ok(RoundReport::default());
        }
        let results = self.publish(batch.rows()).await;
        Ok(self.settle(batch, results).await)
    }

    /// Publishes until nothing is claimable, pipelined: up to
    /// [`RelayConfig::max_in_flight_batches`] batches are being published and settled at
    /// once, and the next batch is claimed while they wait for the broker's confirmations.
    /// Batches in flight never share a partition key (a partition whose head is held is
    /// not claimable), so per-partition order holds. Returns the totals. Stops early when
    /// `shutdown` is cancelled.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the first claim fails (later claim failures end the
    /// drain early and are logged).
    pub async fn drain(&self, shutdown: &CancellationToken) -> Result<RoundReport, RelayError> {
        self.drain_woken(shutdown, None).await
    }

    /// [`Relay::drain`], also claiming again on `wake` (new rows committed) while batches
    /// wait for their confirmations: events committed during a slow confirmation go out
    /// in the next window instead of queueing behind it.
    ///
    /// Each batch is one task: claim, publish, settle. While claims come back full (a
    /// backlog), every free slot gets a task at once, so claims run concurrently with
    /// each other as well as with publishes (`FOR UPDATE SKIP LOCKED` keeps them apart);
    /// otherwise one claim runs at a time, so an idle outbox is not polled by several
    /// claims per wake-up.
    async fn drain_woken(
        &self,
        shutdown: &CancellationToken,
        wake: Option<&Notify>,
    ) -> Result<RoundReport, RelayError> {
        let (mut drain, mut rx) = Drain::new(&self.config);
        let tasks = TaskTracker::new();
        loop {
            while drain.may_claim(shutdown) {
                tasks.spawn(self.clone().run_batch(drain.start_batch()));
            }
            if drain.in_flight == 0 {
                break;
            }
            let event = tokio::select! {
                e = rx.recv() => e,
                () = woken(wake), if drain.dry => {
                    drain.dry = false;
                    continue;
                }
                () = tokio::time::sleep(self.config.poll_interval), if drain.dry => {
                    drain.dry = false;
                    continue;
                }
            };
            // `None` is unreachable while `drain` holds a sender.
            let Some(event) = event else { break };
            drain.record(event);
        }
        tasks.close();
        tasks.wait().await;
        drain.finish()
    }

    /// One batch task of [`Relay::drain_woken`]: claim, publish, settle, reporting to the
    /// drain through `slot`'s reporter.
    async fn run_batch(self, slot: BatchSlot) {
        let BatchSlot {
            held,
            no,
            settles_before,
            mut reporter,
        } = slot;
        let skip: Vec<_> = lock(&held).iter().map(|(_, r)| r.clone()).collect();
        let batch = match self.claim_skipping(&skip).await {
            Ok(batch) => batch,
            Err(e) => {
                reporter.send(BatchEvent::ClaimFailed(e));
                return;
            }
        };
        reporter.send(BatchEvent::Claimed {
            rows: batch.rows().len(),
            settles_before,
        });
        let (Some(first), Some(last)) = (batch.rows().first(), batch.rows().last()) else {
            return;
        };
        // Removed however the task ends (a panic while publishing included):
        // a range left behind would hide its rows from this drain's claims.
        let held_range = HeldRange::new(held, no, first.id..=last.id);
        let results = self.publish(batch.rows()).await;
        let report = self.settle(batch, results).await;
        drop(held_range);
        reporter.send(BatchEvent::Settled(report));
    }

    async fn claim(&self) -> Result<ClaimedBatch, StoreError> {
        self.claim_skipping(&[]).await
    }

    /// Claims a batch; `held` are the id ranges of this relay's batches in flight (their
    /// rows are locked by this relay, so the claim need not look at them).
    async fn claim_skipping(
        &self,
        held: &[std::ops::RangeInclusive<i64>],
    ) -> Result<ClaimedBatch, StoreError> {
        let started = std::time::Instant::now();
        let batch = self
            .store
            .claim_batch(
                &self.config.relay_id,
                self.config.batch_size,
                self.config.lease,
                oncely_core::now_ms(),
                held,
            )
            .await;
        match &batch {
            Ok(_) => self.health.database.up(),
            Err(e) => self.health.database.down(e),
        }
        tracing::trace!(
            rows = batch.as_ref().map_or(0, |b| b.rows().len()),
            micros = started.elapsed().as_micros() as u64,
            oldest_age_ms = batch
                .as_ref()
                .ok()
                .and_then(|b| b.rows().iter().map(|r| r.created_at).min())
                .map_or(0, |c| oncely_core::now_ms() - c),
            "claim"
        );
        batch
    }

    async fn publish(&self, rows: &[OutboxRow]) -> Vec<Result<(), PublishError>> {
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
    async fn settle(
        &self,
        batch: ClaimedBatch,
        results: Vec<Result<(), PublishError>>,
    ) -> RoundReport {
        if let Some(FaultHook(hook)) = &self.fault_after_confirm {
            hook(batch.rows());
        }
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
    fn sort_results(
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
    fn fail(&self, out: &mut Outcomes, row: &OutboxRow, error: String, permanent: bool) {
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
        let retry_at = now.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
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
    fn report_settled(&self, report: &mut RoundReport, outcomes: &Outcomes, settled: Settled) {
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
                        retry_in_ms = delay.as_millis() as u64, error,
                        "publish failed; rescheduled");
                }
                _ => {}
            }
        }
    }

    /// Counts rows claimed (PostgreSQL: deleted) and, every
    /// [`RelayConfig::vacuum_after_rows`], starts a background vacuum of the outbox unless
    /// one of this relay's is still running.
    fn count_claimed(&self, rows: usize) {
        use std::sync::atomic::Ordering;
        let every = self.config.vacuum_after_rows;
        if every == 0 || rows == 0 || !self.store.database().backend().needs_vacuum() {
            return;
        }
        let v = &self.vacuum;
        let since = v.rows.fetch_add(rows as u64, Ordering::Relaxed) + rows as u64;
        if since < every || v.running.swap(true, Ordering::AcqRel) {
            return;
        }
        v.rows.fetch_sub(since, Ordering::Relaxed);
        let (store, v) = (self.store.clone(), self.vacuum.clone());
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            match store.vacuum().await {
                Ok(()) => {
                    metrics::counter!(m::VACUUMS_TOTAL).increment(1);
                    tracing::debug!(
                        rows = since,
                        ms = started.elapsed().as_millis() as u64,
                        "outbox vacuumed"
                    );
                }
                Err(e) => tracing::warn!(error = %e, "outbox vacuum failed"),
            }
            v.running.store(false, Ordering::Release);
        });
    }

    /// The wait after the `rounds`-th round in a row that found a dependency down:
    /// [`RelayConfig::outage`]'s backoff while [`RelayConfig::budget`] pays for the retry,
    /// its cap once the budget is spent.
    fn outage_wait(&self, rounds: u32) -> Duration {
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
        tracker.spawn(cleanup_loop(
            self.store.clone(),
            self.config.clone(),
            shutdown.clone(),
        ));
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

/// What a batch task of [`Relay::drain_woken`] reports to its drain.
enum BatchEvent {
    /// `settles_before`: batches settled when the task started; a settle since then may have
    /// made rows claimable that this claim did not see.
    Claimed {
        rows: usize,
        settles_before: u64,
    },
    ClaimFailed(StoreError),
    Settled(RoundReport),
    /// The task ended without reporting (it panicked); `claimed`: after its claim.
    Lost {
        claimed: bool,
    },
}

/// A batch task's line to its drain; reports [`BatchEvent::Lost`] if the task ends before
/// its last report.
struct Reporter {
    events: tokio::sync::mpsc::UnboundedSender<BatchEvent>,
    claimed: bool,
    done: bool,
}

impl Reporter {
    fn send(&mut self, event: BatchEvent) {
        match event {
            BatchEvent::Claimed { rows, .. } => {
                self.claimed = true;
                self.done = rows == 0;
            }
            _ => self.done = true,
        }
        drop(self.events.send(event));
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if !self.done {
            drop(self.events.send(BatchEvent::Lost {
                claimed: self.claimed,
            }));
        }
    }
}

/// What a batch task of [`Relay::drain_woken`] starts with.
struct BatchSlot {
    held: Arc<std::sync::Mutex<HeldRanges>>,
    /// The task's number, its key in `held`.
    no: u64,
    /// See [`BatchEvent::Claimed`].
    settles_before: u64,
    reporter: Reporter,
}

/// The state of one [`Relay::drain_woken`]: its batch tasks and what they reported.
#[allow(clippy::struct_excessive_bools)] // four independent conditions of the claim loop, not a mode
struct Drain {
    events: tokio::sync::mpsc::UnboundedSender<BatchEvent>,
    /// [`RelayConfig::max_in_flight_batches`], at least 1.
    windows: usize,
    /// Rows in a full claim.
    full: usize,
    /// Tasks started and not finished; of them, those still claiming.
    in_flight: usize,
    claiming: usize,
    /// The last claim came back full: more is likely waiting.
    backlog: bool,
    /// The last claim found nothing: wait for a settle, a wake-up or the poll interval.
    dry: bool,
    claimed_any: bool,
    failed: Option<StoreError>,
    /// A batch found the broker or the database unavailable: claim no more, so the relay
    /// backs off as a whole instead of re-claiming the rows it just gave back.
    halted: bool,
    /// Id ranges of the batches in flight, by task number.
    held: Arc<std::sync::Mutex<HeldRanges>>,
    task_no: u64,
    /// Batches settled so far.
    settles: u64,
    total: RoundReport,
}

impl Drain {
    fn new(config: &RelayConfig) -> (Self, tokio::sync::mpsc::UnboundedReceiver<BatchEvent>) {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let drain = Self {
            events,
            windows: config.max_in_flight_batches.max(1),
            full: usize::try_from(config.batch_size.max(1)).unwrap_or(usize::MAX),
            in_flight: 0,
            claiming: 0,
            backlog: false,
            dry: false,
            claimed_any: false,
            failed: None,
            halted: false,
            held: Arc::default(),
            task_no: 0,
            settles: 0,
            total: RoundReport::default(),
        };
        (drain, rx)
    }

    /// Whether to start another batch task now: while claims come back full, in every free
    /// slot; otherwise only when no claim is running.
    fn may_claim(&self, shutdown: &CancellationToken) -> bool {
        self.failed.is_none()
            && !self.halted
            && !self.dry
            && !shutdown.is_cancelled()
            && self.in_flight < self.windows
            && (self.claiming == 0 || self.backlog)
    }

    /// Counts a new batch task in; it starts with what this returns.
    fn start_batch(&mut self) -> BatchSlot {
        self.in_flight += 1;
        self.claiming += 1;
        self.task_no += 1;
        BatchSlot {
            held: self.held.clone(),
            no: self.task_no,
            settles_before: self.settles,
            reporter: Reporter {
                events: self.events.clone(),
                claimed: false,
                done: false,
            },
        }
    }

    fn record(&mut self, event: BatchEvent) {
        match event {
            BatchEvent::Claimed {
                rows,
                settles_before,
            } => self.claimed(rows, settles_before),
            BatchEvent::Settled(report) => self.settled(report),
            BatchEvent::ClaimFailed(e) => self.claim_failed(e),
            BatchEvent::Lost { claimed } => self.lost(claimed),
        }
    }

    fn claimed(&mut self, rows: usize, settles_before: u64) {
        self.claiming -= 1;
        self.backlog = rows >= self.full;
        if rows == 0 {
            // Settling what is in flight may make further partition heads claimable; so may
            // new commits. A batch settled while this claim ran may have done so already:
            // then claim again at once.
            self.in_flight -= 1;
            self.dry = self.settles == settles_before;
        } else {
            self.claimed_any = true;
        }
    }

    fn settled(&mut self, report: RoundReport) {
        self.in_flight -= 1;
        self.settles += 1;
        self.halted |= report.deferred > 0;
        self.total.add(report);
        self.dry = false;
    }

    fn claim_failed(&mut self, e: StoreError) {
        self.claiming -= 1;
        self.in_flight -= 1;
        tracing::debug!(error = %e, "relay claim failed");
        self.failed.get_or_insert(e);
    }

    fn lost(&mut self, claimed: bool) {
        if !claimed {
            self.claiming -= 1;
        }
        self.in_flight -= 1;
    }

    /// The drain's totals, or the claim failure if no claim succeeded.
    fn finish(self) -> Result<RoundReport, RelayError> {
        match self.failed {
            Some(e) if !self.claimed_any => Err(e.into()),
            _ => Ok(self.total),
        }
    }
}

/// Resolves on `wake`'s next notification; without one, never.
async fn woken(wake: Option<&Notify>) {
    match wake {
        Some(w) => w.notified().await,
        None => std::future::pending().await,
    }
}

/// A batch's publish results, sorted for [`ClaimedBatch::settle`].
struct Outcomes {
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
struct FailedAttempt {
    message_id: MessageId,
    /// Counting this one.
    attempts: u32,
    /// Until the next attempt.
    delay: Duration,
    error: String,
}

/// Id ranges (first..=last claimed id) of a relay's batches in flight, by task number.
type HeldRanges = Vec<(u64, std::ops::RangeInclusive<i64>)>;

/// One batch's entry in [`HeldRanges`], removed when dropped.
struct HeldRange {
    held: Arc<std::sync::Mutex<HeldRanges>>,
    no: u64,
}

impl HeldRange {
    fn new(
        held: Arc<std::sync::Mutex<HeldRanges>>,
        no: u64,
        range: std::ops::RangeInclusive<i64>,
    ) -> Self {
        lock(&held).push((no, range));
        Self { held, no }
    }
}

impl Drop for HeldRange {
    fn drop(&mut self) {
        lock(&self.held).retain(|(n, _)| *n != self.no);
    }
}

/// The mutex's data, also after a panic elsewhere poisoned it (a range list stays valid).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The message the relay publishes for `event`: same id (the broker's and the consumers'
/// de-duplication key), topic, partition key, event type, payload and headers.
pub fn to_message(event: OutboxEvent) -> Message {
    Message {
        id: event.message_id,
        topic: event.topic,
        partition_key: event.partition_key,
        event_type: event.event_type,
        payload: event.payload,
        headers: event.headers,
    }
}

/// Wakes the relay on every `NOTIFY oncely_outbox`. A lost connection is re-established
/// (notifications in between are lost; polling covers them).
async fn listen(pool: sqlx::PgPool, wake: Arc<Notify>, shutdown: CancellationToken) {
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

async fn stats_loop(store: OutboxStore, interval: Duration, shutdown: CancellationToken) {
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

async fn cleanup_loop(store: OutboxStore, config: RelayConfig, shutdown: CancellationToken) {
    let retention = i64::try_from(config.retention.as_millis()).unwrap_or(i64::MAX);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(config.cleanup_interval) => {}
        }
        loop {
            let before = oncely_core::now_ms().saturating_sub(retention);
            match store.delete_published(before, config.cleanup_batch).await {
                Ok(n) => {
                    metrics::counter!(m::DELETED_TOTAL).increment(n);
                    if n < u64::from(config.cleanup_batch) {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "deleting published outbox rows failed");
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
