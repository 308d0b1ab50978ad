use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use oncely_broker::{
    BoxFuture, DependencyHealth, Incoming, ReceivedMessage, SqlSubscriber, SubscribeError,
    Subscriber,
};
use oncely_core::{Failure, MessageId, OutcomeClass, RetryBudget, RetryDecision, RetryPolicy};
use oncely_sql::{Database, InboxOutcome, InboxStore, Retention, RetentionSweep, Tx};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics as m;

/// What a handler returns when it fails; the transaction is rolled back and the message
/// retried (its `Display` is stored as the delivery's last error) — unless the error is a
/// [`Rejected`], which dead-letters the message at once, or says that the database is
/// unreachable ([`oncely_sql::is_outage`] over its source chain: return the `sqlx::Error`
/// or `StoreError` with `?`, do not turn it into text), which is no attempt of the message:
/// the consumer holds it and runs the transaction again once the database answers.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// A handler error that no retry can fix (the message cannot be decoded, it names
/// something that cannot exist): the message goes to the dead state at once, with this
/// error, instead of being retried.
#[derive(Debug, thiserror::Error)]
#[error("rejected: {0}")]
pub struct Rejected(pub String);

/// A message handler: applies the message's effect inside `tx`, the transaction that also
/// holds the message's inbox row. It must do all its writes through `tx` (so effect and
/// inbox row commit together) and must not commit it.
pub trait Handler: Send + Sync + 'static {
    /// Applies `message` within `tx`.
    ///
    /// # Errors
    /// Any [`HandlerError`]: the transaction is rolled back and the message retried after a
    /// backoff, or dead after the attempt limit.
    fn handle<'a>(
        &'a self,
        tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// Messages handled at once (each holds one transaction). Default 8; at least 1.
    pub concurrency: usize,
    /// Largest number of deliveries received at once. Default 32.
    pub batch: u32,
    /// How long one receive waits for a message (the idle polling interval on the SQL
    /// transport). Default 100 ms.
    pub poll: Duration,
    /// Backoff (full jitter), attempt limit and deadline (from the broker's `enqueued_at`,
    /// when it says) for handler failures, decided by [`RetryPolicy::decide`]: a delivery it
    /// gives up on is dead-lettered. Default: 500 ms base, 5 min cap, 10 attempts.
    pub retry: RetryPolicy,
    /// Backoff while the database is unreachable ([`oncely_sql::is_outage`]): the message in
    /// hand is held — not acknowledged, not retried through the broker, no attempt counted —
    /// and its transaction runs again after [`RetryPolicy::outage_wait`] of the `n`-th
    /// failure in a row, for as long as the outage lasts (`max_attempts` and `deadline` are
    /// ignored); receiving pauses meanwhile, and the broker's broken-connection backoff uses
    /// the same policy. Must stay below JetStream's `ack_wait` (the hold is refreshed once
    /// per wait). Default: 100 ms base, 5 s cap.
    pub outage: RetryPolicy,
    /// The retry budget of the outage waits ([`RetryBudget`], the AWS SDKs' token bucket),
    /// shared by every message this consumer holds through a database outage and by its
    /// receive loop (clone the `Arc`, or the config, to share it with other consumers of
    /// the same database): each retry withdraws [`RetryBudget::RETRY_COST`], each success
    /// deposits; once it is spent the waits are `outage.cap` (counted in
    /// [`m::RETRY_BUDGET_EXHAUSTED_TOTAL`]), so many held messages do not probe the
    /// database in a storm. Default: a bucket of [`RetryBudget::DEFAULT_CAPACITY`] (500)
    /// tokens of its own.
    pub budget: Arc<RetryBudget>,
    /// How long inbox rows are kept; must be longer than the broker's redelivery window
    /// (a copy redelivered after it would run the effect again). Default 7 days.
    pub inbox_retention: Duration,
    /// How often [`Consumer::run`] deletes inbox rows past the retention and fanned-out
    /// queue rows past [`ConsumerConfig::queue_retention`] (500 per statement). Default 60 s.
    pub collect_interval: Duration,
    /// How long the SQL transport keeps a queue row after it was fanned out to the
    /// subscribed groups (it stops a republished copy from being delivered again while it
    /// exists); must be shorter than `inbox_retention`. Default 1 h.
    pub queue_retention: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            concurrency: 8,
            batch: 32,
            poll: Duration::from_millis(100),
            retry: RetryPolicy::default(),
            outage: RetryPolicy::outage(Duration::from_millis(100), Duration::from_secs(5)),
            budget: Arc::new(RetryBudget::default()),
            inbox_retention: Duration::from_secs(7 * 24 * 3600),
            collect_interval: Duration::from_secs(60),
            queue_retention: Duration::from_secs(3600),
        }
    }
}

/// Counters of one consumer instance (the same events also go to the `metrics` facade,
/// see [`crate::metrics`]).
#[derive(Debug, Default)]
pub struct ConsumerStats {
    consumed: AtomicU64,
    duplicates: AtomicU64,
    retries: AtomicU64,
    dead_lettered: AtomicU64,
}

impl ConsumerStats {
    /// Messages whose effect committed and that were acknowledged.
    pub fn consumed(&self) -> u64 {
        self.consumed.load(Ordering::Relaxed)
    }

    /// Redelivered messages the inbox recognised (handler not run).
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Handler failures rescheduled with backoff.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Deliveries parked as dead.
    pub fn dead_lettered(&self) -> u64 {
        self.dead_lettered.load(Ordering::Relaxed)
    }
}

/// What [`Consumer::process`] did with one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Processed {
    /// The effect committed and the delivery was acknowledged.
    Consumed,
    /// The effect committed but the acknowledgement did not happen (fault hook, or the
    /// acknowledgement failed): the delivery comes back and the inbox recognises it.
    CommittedNotAcknowledged,
    /// The inbox already held the message: acknowledged, handler not run.
    Duplicate,
    /// The handler failed: rolled back, retried after a backoff for this group only.
    Retried,
    /// The handler failed for the last allowed time (or the message is undecodable or
    /// [`Rejected`]): rolled back, moved to the dead-letter destination.
    DeadLettered,
    /// The store or the broker failed before the outcome was settled (or the consumer
    /// was shut down while it held the delivery through a database outage): nothing
    /// acknowledged, the delivery comes back.
    StoreFailed,
}

type FaultHook = Arc<dyn Fn(&MessageId) -> bool + Send + Sync>;

/// An inbox consumer: receives deliveries of one consumer group from a [`Subscriber`]
/// (SQL transport, RabbitMQ, NATS JetStream), runs each through the inbox and its
/// [`Handler`], acknowledges, retries, dead-letters — the same semantic on every broker.
///
/// Any number of instances of one group may run (in one or many processes): the broker
/// hands each delivery to one of them at a time, and the inbox row (primary key
/// `(consumer, message_id)`) makes a delivery that comes again (crash after commit, two
/// instances holding copies at once, a republished copy) a no-op.
pub struct Consumer<S: Subscriber> {
    subscriber: Arc<S>,
    db: Database,
    handler: Arc<dyn Handler>,
    config: ConsumerConfig,
    stats: Arc<ConsumerStats>,
    skip_ack_after_commit: Option<FaultHook>,
    database: DependencyHealth,
    broker: DependencyHealth,
    /// Ends the hold of messages during a database outage ([`Consumer::run`]'s shutdown).
    stop: CancellationToken,
}

/// An inbox consumer on the SQL transport.
pub type SqlConsumer = Consumer<SqlSubscriber>;

impl<S: Subscriber> fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("subscriber", &self.subscriber)
            .field("config", &self.config)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<S: Subscriber> Consumer<S> {
    /// A consumer of `subscriber`'s group (its name is the inbox's `consumer` column), with
    /// inbox and effects in `db` (migrated). Call [`Consumer::subscribe`] before the first
    /// message it must see is published.
    pub fn new(
        db: Database,
        subscriber: S,
        handler: Arc<dyn Handler>,
        config: ConsumerConfig,
    ) -> Self {
        let component = format!("consumer:{}", subscriber.consumer());
        Self {
            database: DependencyHealth::database(&db, &component),
            broker: DependencyHealth::broker(subscriber.broker(), &component),
            subscriber: Arc::new(subscriber),
            db,
            handler,
            config,
            stats: Arc::new(ConsumerStats::default()),
            skip_ack_after_commit: None,
            stop: CancellationToken::new(),
        }
    }

    /// Fault injection (tests, chaos drills): when `hook` returns `true` for a message, the
    /// consumer behaves as if it died right after committing the effect and before
    /// acknowledging — it does not acknowledge, so the broker delivers it again (SQL: after
    /// the lease; JetStream: after `ack_wait`; RabbitMQ: when the channel closes, e.g. on
    /// [`Consumer::close`]).
    #[must_use]
    pub fn with_fault_after_commit(
        mut self,
        hook: impl Fn(&MessageId) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.skip_ack_after_commit = Some(Arc::new(hook));
        self
    }

    /// Creates the group on the broker (idempotent): messages published from now on are
    /// delivered to it.
    ///
    /// # Errors
    /// [`SubscribeError`] when the broker is unreachable or refuses.
    pub async fn subscribe(&self) -> Result<(), SubscribeError> {
        self.subscriber.subscribe().await
    }

    /// Releases the broker connection; deliveries not acknowledged go back to the broker.
    pub async fn close(&self) {
        self.subscriber.close().await;
    }

    /// This instance's counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// The consumer (group) name.
    pub fn name(&self) -> &str {
        self.subscriber.consumer()
    }

    /// The subscriber.
    pub fn subscriber(&self) -> &S {
        &self.subscriber
    }

    /// Receives one batch (up to [`ConsumerConfig::batch`], waiting up to
    /// [`ConsumerConfig::poll`] for the first) and processes it, up to
    /// [`ConsumerConfig::concurrency`] at once; returns how many deliveries it received.
    ///
    /// # Errors
    /// [`SubscribeError`] when receiving fails (nothing was received).
    pub async fn run_once(&self) -> Result<usize, SubscribeError> {
        let deliveries = self
            .subscriber
            .receive(self.config.batch, self.config.poll)
            .await?;
        let n = deliveries.len();
        let limit = Arc::new(Semaphore::new(self.config.concurrency.max(1)));
        let mut tasks = Vec::with_capacity(n);
        for d in deliveries {
            let limit = limit.clone();
            tasks.push(async move {
                let _permit = limit.acquire_owned().await;
                self.process(d).await
            });
        }
        futures_util::future::join_all(tasks).await;
        Ok(n)
    }

    fn count(&self, counter: &AtomicU64, metric: &'static str) {
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(metric, "consumer" => self.name().to_owned(), "broker" => self.subscriber.broker())
            .increment(1);
    }

    async fn dead_letter(&self, delivery: &Incoming<S::Handle>, error: &str) -> Processed {
        let consumer = self.name();
        if let Err(e) = self.subscriber.dead(delivery, error).await {
            tracing::warn!(consumer, error = %e, "dead-letter failed");
            return Processed::StoreFailed;
        }
        self.count(&self.stats.dead_lettered, m::DEAD_LETTERED_TOTAL);
        Processed::DeadLettered
    }

    /// Runs one delivery: begin → inbox row → handler → commit → acknowledge; a duplicate
    /// is acknowledged without the handler; a handler error rolls back and retries the
    /// delivery after a backoff for this consumer group only (or dead-letters it after the
    /// attempt limit); an undecodable delivery is dead-lettered at once.
    ///
    /// While the database is unreachable ([`oncely_sql::is_outage`] on the begin, the inbox
    /// insert, the handler's error or the commit) the delivery is held: no attempt counted,
    /// nothing settled, [`Subscriber::hold`] sent, and the transaction runs again after
    /// [`ConsumerConfig::outage`]'s backoff until the database answers (a commit whose
    /// outcome was lost is found by the inbox then). The outage is logged once, when it
    /// starts and when it ends. When [`Consumer::run`]'s shutdown comes first it returns
    /// [`Processed::StoreFailed`], the delivery unsettled, so the broker delivers it again.
    pub async fn process(&self, delivery: Incoming<S::Handle>) -> Processed {
        let message = match &delivery.message {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(consumer = self.name(), error = %e, "undecodable delivery; dead-lettered");
                let e = e.to_string();
                return self.dead_letter(&delivery, &e).await;
            }
        };
        let mut outage_rounds = 0u32;
        loop {
            let error = match self.transact(&delivery, message).await {
                Ok(processed) => {
                    self.database.up();
                    // A retry that went through gets its cost back.
                    self.config
                        .budget
                        .on_success((outage_rounds > 0).then_some(false));
                    return processed;
                }
                Err(error) => error,
            };
            self.database.down(&*error);
            tracing::debug!(consumer = self.name(), message_id = %message.id, error = %error,
                "database unreachable; holding the message");
            if let Err(e) = self.subscriber.hold(&delivery).await {
                tracing::debug!(consumer = self.name(), error = %e, "hold failed");
            }
            outage_rounds = outage_rounds.saturating_add(1);
            let wait = self.outage_wait(outage_rounds);
            tokio::select! {
                () = self.stop.cancelled() => return Processed::StoreFailed,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The wait after the `failures`-th failure in a row to reach the database or the
    /// broker: [`ConsumerConfig::outage`]'s backoff while [`ConsumerConfig::budget`] pays
    /// for the retry, its cap once the budget is spent.
    fn outage_wait(&self, failures: u32) -> Duration {
        let decided = self.config.outage.outage_wait(
            failures,
            None,
            Some(&self.config.budget),
            rand::random::<f64>(),
        );
        if decided.budget_exhausted {
            metrics::counter!(m::RETRY_BUDGET_EXHAUSTED_TOTAL, "consumer" => self.name().to_owned(), "broker" => self.subscriber.broker())
                .increment(1);
        }
        decided.wait
    }

    /// Whether a handler failure of `delivery` (the `delivery.attempts + 1`-th) is retried,
    /// and after which wait, or dead-lettered: [`RetryPolicy::decide`] over
    /// [`ConsumerConfig::retry`] — a [`Rejected`] message is final, any other failure is
    /// the message's own and counts toward the attempt limit.
    fn decide(
        &self,
        delivery: &Incoming<S::Handle>,
        message: &ReceivedMessage,
        rejected: bool,
    ) -> RetryDecision {
        let elapsed = if message.enqueued_at > 0 {
            u64::try_from(oncely_core::now_ms().saturating_sub(message.enqueued_at)).unwrap_or(0)
        } else {
            0
        };
        let failure = Failure {
            failures: delivery.attempts.saturating_add(1),
            class: if rejected {
                OutcomeClass::Final
            } else {
                OutcomeClass::Retryable
            },
            retry_after: None,
            elapsed: Duration::from_millis(elapsed),
            timed_out: false,
        };
        self.config
            .retry
            .decide(&failure, None, rand::random::<f64>())
    }

    /// One run of `message`'s transaction and the settling of `delivery`. `Err`: the
    /// database was unreachable ([`oncely_sql::is_outage`]) before the outcome was settled;
    /// nothing was settled or counted.
    async fn transact(
        &self,
        delivery: &Incoming<S::Handle>,
        message: &ReceivedMessage,
    ) -> Result<Processed, HandlerError> {
        let consumer = self.name();
        let id = message.id;
        // Received, nothing recorded: the broker delivers it again after a crash here.
        oncely_core::failpoint::fail_point!("consumer.after_receive");
        let mut tx = match self.db.begin().await {
            Ok(tx) => tx,
            Err(e) if oncely_sql::is_outage(&e) => return Err(e.into()),
            Err(e) => {
                tracing::warn!(consumer, message_id = %id, error = %e, "cannot begin");
                return Ok(Processed::StoreFailed);
            }
        };
        match InboxStore::record(&mut tx, consumer, &id, oncely_core::now_ms()).await {
            Ok(InboxOutcome::Duplicate) => {
                drop(tx.rollback().await);
                self.count(&self.stats.duplicates, m::DUPLICATES_TOTAL);
                tracing::debug!(consumer, message_id = %id, "duplicate skipped");
                return Ok(match self.subscriber.ack(delivery).await {
                    Ok(()) => Processed::Duplicate,
                    Err(e) => {
                        tracing::warn!(consumer, message_id = %id, error = %e, "ack failed");
                        Processed::StoreFailed
                    }
                });
            }
            Ok(_) => {}
            Err(e) => {
                drop(tx.rollback().await);
                if oncely_sql::is_outage(&e) {
                    return Err(e.into());
                }
                tracing::warn!(consumer, message_id = %id, error = %e, "inbox insert failed");
                return Ok(Processed::StoreFailed);
            }
        }
        let started = Instant::now();
        // A panicking handler counts as a failed attempt (else its message would come back
        // after every lease, for ever).
        let outcome = AssertUnwindSafe(self.handler.handle(&mut tx, message))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(format!("handler panicked: {what}").into())
            });
        metrics::histogram!(m::HANDLER_SECONDS, "consumer" => consumer.to_owned(), "broker" => self.subscriber.broker())
            .record(started.elapsed().as_secs_f64());
        match outcome {
            Ok(()) => {
                if let Err(e) = tx.commit().await {
                    // Outcome unknown: the next run (held through an outage) or the next
                    // delivery finds out from the inbox whether the commit happened.
                    if oncely_sql::is_outage(&e) {
                        return Err(e.into());
                    }
                    tracing::warn!(consumer, message_id = %id, error = %e, "commit failed");
                    return Ok(Processed::StoreFailed);
                }
                self.count(&self.stats.consumed, m::CONSUMED_TOTAL);
                // The effect and the inbox row are committed, the delivery not acknowledged:
                // it comes again and the inbox recognises it.
                oncely_core::failpoint::fail_point!("consumer.after_inbox_commit");
                if self.skip_ack_after_commit.as_ref().is_some_and(|f| f(&id)) {
                    return Ok(Processed::CommittedNotAcknowledged);
                }
                Ok(match self.subscriber.ack(delivery).await {
                    Ok(()) => Processed::Consumed,
                    Err(e) => {
                        tracing::warn!(consumer, message_id = %id, error = %e, "ack failed");
                        Processed::CommittedNotAcknowledged
                    }
                })
            }
            Err(error) if oncely_sql::is_outage(&*error) => {
                drop(tx.rollback().await);
                Err(error)
            }
            Err(error) => {
                drop(tx.rollback().await);
                let rejected = error.downcast_ref::<Rejected>().is_some();
                let error = error.to_string();
                let failures = delivery.attempts.saturating_add(1);
                if let RetryDecision::RetryAfter(delay) = self.decide(delivery, message, rejected) {
                    tracing::warn!(consumer, message_id = %id, attempts = failures, delay_ms = oncely_core::millis(delay), %error, "handler failed; retrying");
                    if let Err(e) = self.subscriber.retry(delivery, delay, &error).await {
                        tracing::warn!(consumer, message_id = %id, error = %e, "retry failed");
                        return Ok(Processed::StoreFailed);
                    }
                    self.count(&self.stats.retries, m::RETRIES_TOTAL);
                    Ok(Processed::Retried)
                } else {
                    tracing::error!(consumer, message_id = %id, attempts = failures, %error, "dead-lettered");
                    Ok(self.dead_letter(delivery, &error).await)
                }
            }
        }
    }

    /// Runs until `shutdown`: receives as many deliveries as there are free handler slots
    /// ([`ConsumerConfig::concurrency`]), processes each in its own task, waits up to
    /// [`ConsumerConfig::poll`] for messages when idle, and deletes inbox rows past
    /// [`ConsumerConfig::inbox_retention`] (and, on the SQL transport, fanned-out queue rows
    /// past [`ConsumerConfig::queue_retention`]). On shutdown it stops receiving, waits for
    /// the messages in hand, and closes the subscriber.
    pub async fn run(self, shutdown: CancellationToken) {
        // Counters show 0 from the start, so `rate()` and alerts see them before the first
        // message.
        for name in [
            m::CONSUMED_TOTAL,
            m::DUPLICATES_TOTAL,
            m::RETRIES_TOTAL,
            m::DEAD_LETTERED_TOTAL,
            m::RETRY_BUDGET_EXHAUSTED_TOTAL,
        ] {
            metrics::counter!(name, "consumer" => self.name().to_owned(), "broker" => self.subscriber.broker())
                .increment(0);
        }
        metrics::counter!(m::COLLECTED_TOTAL, "consumer" => self.name().to_owned()).increment(0);
        let mut this = self;
        this.stop = shutdown.clone();
        let this = Arc::new(this);
        let slots = Arc::new(Semaphore::new(this.config.concurrency.max(1)));
        let tracker = TaskTracker::new();
        tracker.spawn(
            retention(
                InboxStore::new(this.db.clone()),
                this.subscriber.clone(),
                &this.config,
            )
            .run(shutdown.clone()),
        );
        // Consecutive receive failures (broker down).
        let mut failures = 0u32;
        while !shutdown.is_cancelled() {
            // The database is unreachable: the messages in hand are held and probe it;
            // taking more would only add to what waits.
            if this.database.is_down() {
                idle(&shutdown, this.config.poll.max(Duration::from_millis(100))).await;
                continue;
            }
            let free = slots.available_permits();
            if free == 0 {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    p = slots.clone().acquire_owned() => drop(p),
                }
                continue;
            }
            let max = u32::try_from(free)
                .unwrap_or(u32::MAX)
                .min(this.config.batch.max(1));
            let received = tokio::select! {
                () = shutdown.cancelled() => break,
                r = this.subscriber.receive(max, this.config.poll) => r,
            };
            match received {
                Ok(deliveries) => {
                    if failures > 0 {
                        this.config.budget.on_success(Some(false));
                    }
                    failures = 0;
                    this.broker.up();
                    for d in deliveries {
                        let Ok(permit) = slots.clone().acquire_owned().await else {
                            break;
                        };
                        let this = this.clone();
                        tracker.spawn(async move {
                            this.process(d).await;
                            drop(permit);
                        });
                    }
                }
                Err(e) => {
                    this.broker.down(&e);
                    failures = failures.saturating_add(1);
                    let wait = this.outage_wait(failures);
                    idle(&shutdown, wait).await;
                }
            }
        }
        tracker.close();
        tracker.wait().await;
        this.subscriber.close().await;
    }
}

async fn idle(shutdown: &CancellationToken, poll: Duration) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(poll) => {}
    }
}

/// The deletion of `consumer`'s inbox rows past [`ConsumerConfig::inbox_retention`] as a
/// [`RetentionSweep`] named `inbox:<consumer>` ([`InboxStore::collect`]): every
/// `collect_interval`, 500 rows per statement, counted in
/// `oncely_inbox_collected_total{consumer}`. [`Consumer::run`] runs it from start-up;
/// public so that a benchmark can time one round of the consumer's own sweep.
pub fn inbox_sweep(inbox: InboxStore, consumer: &str, config: &ConsumerConfig) -> RetentionSweep {
    let inbox_retention = oncely_core::millis(config.inbox_retention);
    let name = consumer.to_owned();
    RetentionSweep::new(
        format!("inbox:{consumer}"),
        config.collect_interval,
        COLLECT_BATCH,
        move |now_ms, batch| {
            let (inbox, consumer) = (inbox.clone(), name.clone());
            async move {
                let n = inbox
                    .collect(now_ms.saturating_sub(inbox_retention), batch)
                    .await?;
                metrics::counter!(m::COLLECTED_TOTAL, "consumer" => consumer).increment(n);
                Ok::<_, oncely_sql::StoreError>(n)
            }
        },
    )
}

/// Rows per statement of the consumer's retention sweeps.
const COLLECT_BATCH: u32 = 500;

/// The consumer's retention, two [`RetentionSweep`]s from start-up and every
/// `collect_interval`, [`COLLECT_BATCH`] rows per statement: [`inbox_sweep`], and
/// `queue:<consumer>` deleting the SQL transport's fanned-out queue rows past
/// `queue_retention`.
fn retention<S: Subscriber>(
    inbox: InboxStore,
    subscriber: Arc<S>,
    config: &ConsumerConfig,
) -> Retention {
    let collect = inbox_sweep(inbox, subscriber.consumer(), config);
    let name = subscriber.consumer().to_owned();
    let keep = oncely_core::millis(config.queue_retention);
    let queue_sweep = RetentionSweep::new(
        format!("queue:{name}"),
        config.collect_interval,
        COLLECT_BATCH,
        move |now_ms, batch| {
            let subscriber = subscriber.clone();
            async move { subscriber.collect(now_ms.saturating_sub(keep), batch).await }
        },
    );
    Retention::new()
        .sweep(collect.at_once())
        .sweep(queue_sweep.at_once())
}
