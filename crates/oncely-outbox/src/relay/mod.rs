//! The relay: [`Relay`] with its [`RelayConfig`], [`RoundReport`] and [`RelayError`], and
//! [`to_message`]. A folder: `drain` (concurrent batches claimed around the id ranges
//! others hold), `settle` (publishing a batch and settling each row), `background` (the
//! service loop, woken by notifications or a poll, with its stats and retention loops).

mod background;
mod drain;
mod settle;

pub use background::published_sweep;

use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{DependencyHealth, Message, Publisher};
use oncely_core::{RetryBudget, RetryPolicy};
use oncely_sql::{Database, OutboxEvent, OutboxStore, StoreError};
use tokio_util::sync::CancellationToken;

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
    /// unavailable or does not confirm in time ([`PublishError::is_transient`](oncely_broker::PublishError::is_transient)) does not
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
    /// `outage.cap` between rounds (counted in [`m::RETRY_BUDGET_EXHAUSTED_TOTAL`](crate::metrics::RETRY_BUDGET_EXHAUSTED_TOTAL)). Relays
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
            outage: RetryPolicy::outage(Duration::from_millis(100), Duration::from_secs(5)),
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
/// or does not confirm in time ([`PublishError::is_transient`](oncely_broker::PublishError::is_transient)), or the database fails, the
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
