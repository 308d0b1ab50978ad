use crate::PINNED_PLAN;
use std::collections::BTreeMap;
use std::time::Duration;

use oncely_core::MessageId;

use crate::{on_tx, outbox_mysql, sql_text, Database, StoreError, Tx};

/// An event to publish, written with [`OutboxStore::enqueue`] in the transaction of the
/// business change it announces.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxEvent {
    /// The message's identity; derive it with [`MessageId::derive`] when the event comes
    /// from an idempotent operation.
    pub message_id: MessageId,
    /// Destination: AMQP routing key, NATS subject, SQL-transport topic (e.g. `orders`).
    pub topic: String,
    /// The ordering unit, usually the aggregate id: events with one partition key are
    /// published in order.
    pub partition_key: String,
    /// Event type, e.g. `order.created`.
    pub event_type: String,
    /// Body bytes (the order service sends JSON).
    pub payload: Vec<u8>,
    /// Extra headers: `correlation-id`, `idempotency-key`, `traceparent` (W3C Trace
    /// Context), …
    pub headers: BTreeMap<String, String>,
}

impl OutboxEvent {
    /// An event without extra headers.
    pub fn new(
        message_id: MessageId,
        topic: impl Into<String>,
        partition_key: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            message_id,
            topic: topic.into(),
            partition_key: partition_key.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            headers: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) a header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }
}

/// State of an outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutboxState {
    /// Waiting to be published (possibly leased by a relay, possibly in backoff).
    Pending,
    /// Confirmed by the broker.
    Published,
    /// Gave up after the attempt limit; `oncely outbox dead requeue` puts it back.
    Dead,
}

impl OutboxState {
    fn parse(s: &str) -> Result<Self, StoreError> {
        match s {
            "pending" => Ok(Self::Pending),
            "published" => Ok(Self::Published),
            "dead" => Ok(Self::Dead),
            other => Err(StoreError::Corrupt(format!(
                "unknown outbox state {other:?}"
            ))),
        }
    }

    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Published => "published",
            Self::Dead => "dead",
        }
    }
}

/// A stored outbox row.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutboxRow {
    /// Row id (monotonic at insert; *not* commit order, so never used as a cursor).
    pub id: i64,
    /// The event.
    pub event: OutboxEvent,
    /// Insert time (the business transaction's time), Unix ms.
    pub created_at: i64,
    /// Earliest next publish attempt, Unix ms.
    pub available_at: i64,
    /// Failed publish attempts so far.
    pub attempts: u32,
    /// The last publish error, if any.
    pub last_error: Option<String>,
    /// State.
    pub state: OutboxState,
    /// When the broker confirmed it, Unix ms.
    pub published_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
pub(crate) struct Row {
    id: i64,
    message_id: String,
    topic: String,
    partition_key: String,
    event_type: String,
    payload: Vec<u8>,
    headers: String,
    created_at: i64,
    available_at: i64,
    attempts: i32,
    last_error: Option<String>,
    state: String,
    published_at: Option<i64>,
}

const COLUMNS: &str = "id, message_id, topic, partition_key, event_type, payload, headers, \
     created_at, available_at, attempts, last_error, state, published_at";

/// The columns a row keeps when it moves between `oncely_outbox` and
/// `oncely_outbox_published` (PostgreSQL): all but `state`, `published_at` and the lease.
macro_rules! moved_columns {
    () => {
        "id, message_id, topic, partition_key, event_type, payload, headers, created_at, \
         available_at, attempts, last_error"
    };
}

/// [`COLUMNS`] read from `oncely_outbox_published` (PostgreSQL).
const PUBLISHED_COLUMNS: &str = concat!(moved_columns!(), ", 'published' AS state, published_at");

/// PostgreSQL: takes the transaction-scoped advisory lock of the partition of the row
/// aliased `alias`, false when another transaction holds it. The key is a 64-bit hash of
/// the partition key seeded with the outbox table's OID and 1869505381 (`"once"` in ASCII):
/// advisory locks are one namespace per database, and with a key of the partition alone
/// the relays of an outbox in another schema (another service, another test) held up this
/// one's partitions of the same name — a claim skipped them while the other relay
/// published. A `claim_batch` relay holds the partitions of
/// its batch until the batch is settled, so no other relay takes a row of theirs — in
/// particular not a row that committed late, after a newer row of its partition was
/// claimed: the anti-join on lower ids cannot see that newer row (it looks pending), only
/// its partition lock can. Two partition keys with the same hash only wait for each other.
/// Each row a relay holds takes one entry of PostgreSQL's lock table: size
/// `max_locks_per_transaction` for the batch size (`max_locks_per_transaction ×
/// max_connections` slots in all; the defaults, 64 × 100, hold 25 batches of 256).
///
/// `alias` names the claim's materialised candidate CTE (columns `id`, `partition_key`,
/// `table_oid`), never the outbox table itself: a lock-taking function in a `WHERE` clause
/// over the table is evaluated on whatever rows the planner's scan visits, and a plan made
/// while the table was believed empty (a seq scan of the outbox as the join's outer side)
/// took a lock for every pending row's partition — 20,000 partitions exhausted the
/// server-wide lock table (`out of shared memory`). A CTE with a volatile function is never
/// inlined (PostgreSQL 12+ inlines only side-effect-free CTEs), so the lock is tried on the
/// candidate rows alone, at most `LIMIT` of them, and no statement takes a lock for a row it
/// does not return (a candidate whose partition lock fails is returned by neither).
fn partition_lock(alias: &str) -> String {
    format!(
        "pg_try_advisory_xact_lock(hashtextextended({alias}.partition_key, \
         {alias}.table_oid::bigint # 1869505381))"
    )
}

/// The candidate partition heads of a PostgreSQL claim, as the body of a CTE with columns
/// `id`, `partition_key`, `table_oid`: pending, available, not leased by a live lease, the
/// oldest pending row of its partition, outside the `$skip` id multirange (`'{}'`: none),
/// and of no partition with a live lease; `LIMIT $limit` of them in id order, locked
/// `FOR UPDATE OF o SKIP LOCKED` (`LIMIT` applies after locking, so skipped rows do not
/// count against it). `$now`, `$limit`, `$skip` are placeholders to substitute.
const CLAIM_CANDIDATES: &str = "SELECT o.id, o.partition_key, o.tableoid AS table_oid \
     FROM oncely_outbox o \
     WHERE o.state = 'pending' AND o.available_at <= $now \
     AND (o.locked_until IS NULL OR o.locked_until < $now) \
     AND NOT (CAST($skip::text AS int8multirange) @> o.id) \
     AND NOT EXISTS (SELECT 1 FROM oncely_outbox p \
       WHERE p.partition_key = o.partition_key AND p.state = 'pending' \
       AND (p.partition_key, p.id) < (o.partition_key, o.id) OFFSET 0) \
     AND o.partition_key NOT IN (SELECT l.partition_key FROM oncely_outbox l \
       WHERE l.state = 'pending' AND l.locked_until >= $now) \
     ORDER BY o.id LIMIT $limit FOR UPDATE OF o SKIP LOCKED";

/// [`CLAIM_CANDIDATES`] with its placeholders bound to `now`, `limit` and `skip` (each a
/// `$n` parameter of the statement).
fn claim_candidates(now: &str, limit: &str, skip: &str) -> String {
    CLAIM_CANDIDATES
        .replace("$now", now)
        .replace("$limit", limit)
        .replace("$skip", skip)
}

/// `headers` as stored in the `headers` column (a JSON object).
fn headers_json(headers: &BTreeMap<String, String>) -> Result<String, StoreError> {
    serde_json::to_string(headers).map_err(|e| StoreError::Corrupt(format!("outbox headers: {e}")))
}

/// [`COLUMNS`] prefixed with a table alias.
fn qualified(alias: &str) -> String {
    COLUMNS
        .split(", ")
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Row {
    fn into_row(self) -> Result<OutboxRow, StoreError> {
        let headers: BTreeMap<String, String> = serde_json::from_str(&self.headers)
            .map_err(|e| StoreError::Corrupt(format!("outbox headers: {e}")))?;
        Ok(OutboxRow {
            id: self.id,
            event: OutboxEvent {
                message_id: MessageId::parse(&self.message_id)
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                topic: self.topic,
                partition_key: self.partition_key,
                event_type: self.event_type,
                payload: self.payload,
                headers,
            },
            created_at: self.created_at,
            available_at: self.available_at,
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            last_error: self.last_error,
            state: OutboxState::parse(&self.state)?,
            published_at: self.published_at,
        })
    }
}

/// Depth and health of the outbox, for `oncely outbox stats` and the relay's gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows in state `pending`.
    pub pending: u64,
    /// `created_at` of the oldest pending row, Unix ms.
    pub oldest_pending_created_at: Option<i64>,
    /// Rows in state `dead`.
    pub dead: u64,
}

impl OutboxStats {
    /// Age of the oldest pending row at `now_ms`, in milliseconds (0 when none is pending).
    pub fn oldest_pending_age_ms(&self, now_ms: i64) -> i64 {
        self.oldest_pending_created_at
            .map_or(0, |t| now_ms.saturating_sub(t).max(0))
    }
}

/// What [`OutboxStore::reschedule`] did with a failed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rescheduled {
    /// Back to `pending`, available again from the `retry_at_ms` given.
    Retry,
    /// The attempt limit is reached: the row is `dead`.
    Dead,
    /// This relay no longer holds the row (its lease ran out and another relay took it);
    /// nothing was changed.
    NotHeld,
}

impl Rescheduled {
    /// From the `state` a reschedule statement returned (`None`: no row matched).
    fn from_state(state: Option<&str>) -> Self {
        match state {
            None => Self::NotHeld,
            Some("dead") => Self::Dead,
            Some(_) => Self::Retry,
        }
    }
}

/// A failed publish: one more attempt, its error, the next attempt's time, and `dead` at the
/// attempt limit. Binds `$1` error, `$2` available_at, `$3` attempt limit.
const RESCHEDULE_SET: &str = "attempts = attempts + 1, last_error = $1, available_at = $2, \
     state = CASE WHEN attempts + 1 >= $3 THEN 'dead' ELSE 'pending' END";

/// Which dead rows [`OutboxStore::requeue_dead`] puts back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequeueTarget {
    /// One row by id.
    Id(i64),
    /// Every dead row.
    All,
}

/// Rows held by [`OutboxStore::claim_batch`] until they are settled.
#[derive(Debug)]
pub struct ClaimedBatch {
    rows: Vec<OutboxRow>,
    hold: Hold,
}

enum Hold {
    /// Nothing was claimed.
    Nothing,
    /// PostgreSQL: deleted, and so locked, by this open transaction; `keep`: record the
    /// published rows in `oncely_outbox_published`.
    Locked {
        tx: Box<sqlx::Transaction<'static, sqlx::Postgres>>,
        keep: bool,
    },
    /// SQLite, MySQL: leased to `owner`.
    Leased { store: OutboxStore, owner: String },
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nothing => f.write_str("Nothing"),
            Self::Locked { keep, .. } => f.debug_struct("Locked").field("keep", keep).finish(),
            Self::Leased { owner, .. } => f.debug_struct("Leased").field("owner", owner).finish(),
        }
    }
}

/// A failed publish to record with [`ClaimedBatch::settle`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublishFailure {
    /// The row.
    pub id: i64,
    /// The error, stored as `last_error` (cut to 2,000 characters).
    pub error: String,
    /// Earliest next attempt, Unix ms (the caller applies backoff with jitter).
    pub retry_at_ms: i64,
    /// The publish cannot succeed as the message is (it exceeds the broker's size limit):
    /// the row goes `dead` at once, this attempt counted, instead of holding its
    /// partition back through every backoff up to the attempt limit.
    pub permanent: bool,
}

impl PublishFailure {
    /// A failure of row `id` with `error`, to be retried from `retry_at_ms` (Unix ms).
    pub fn new(id: i64, error: impl Into<String>, retry_at_ms: i64) -> Self {
        Self {
            id,
            error: error.into(),
            retry_at_ms,
            permanent: false,
        }
    }

    /// Marks the failure permanent ([`PublishFailure::permanent`]).
    #[must_use]
    pub fn permanent(mut self) -> Self {
        self.permanent = true;
        self
    }
}

/// What [`ClaimedBatch::settle`] recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settled {
    /// Rows marked published (fewer than asked when a SQLite lease ran out and another
    /// relay took the row over).
    pub published: u64,
    /// Each failure's outcome, in the order given.
    pub failures: Vec<(i64, Rescheduled)>,
}

impl ClaimedBatch {
    /// The claimed rows, in id order.
    pub fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    /// True when nothing was claimed.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Records the outcome of the batch: `published` rows become `published` at
    /// `published_at_ms` (Unix ms) — kept as such, or not kept at all when the store does
    /// not keep published rows ([`OutboxStore::keep_published`]; SQLite and MySQL mark them
    /// either way) — each failure is rescheduled or goes `dead` at `max_attempts` (at once when
    /// [`PublishFailure::permanent`]; as
    /// [`OutboxStore::reschedule`]); rows in neither list are released without counting an
    /// attempt. On PostgreSQL all of it commits as one transaction (the claim's, which
    /// deleted the rows: failed and released rows are re-inserted with their ids).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails. Nothing is recorded then: PostgreSQL rolls
    /// back (the rows are claimable again at once), on SQLite the leases run out; either
    /// way the rows are republished with the same message ids.
    pub async fn settle(
        self,
        published: &[i64],
        published_at_ms: i64,
        failures: &[PublishFailure],
        max_attempts: u32,
    ) -> Result<Settled, StoreError> {
        let mut settled = Settled::default();
        match self.hold {
            Hold::Nothing => {}
            Hold::Leased { store, owner } => {
                settled.published = store
                    .mark_published(&owner, published, published_at_ms)
                    .await?;
                for f in failures {
                    // A permanent failure reaches any limit with this attempt.
                    let max = if f.permanent { 1 } else { max_attempts };
                    let r = store
                        .reschedule(&owner, f.id, &f.error, f.retry_at_ms, max)
                        .await?;
                    settled.failures.push((f.id, r));
                }
                let done: std::collections::HashSet<i64> = published
                    .iter()
                    .copied()
                    .chain(failures.iter().map(|f| f.id))
                    .collect();
                let rest: Vec<i64> = self
                    .rows
                    .iter()
                    .map(|r| r.id)
                    .filter(|id| !done.contains(id))
                    .collect();
                if !rest.is_empty() {
                    store.release(&owner, &rest).await?;
                }
            }
            Hold::Locked { mut tx, keep } => {
                // The claim deleted the rows in this still-open transaction: a published row
                // is recorded in the published table (or, without retention, nothing more);
                // a failed one goes back with its attempt recorded, the rest go back as they
                // were (same ids, so the partitions' order holds).
                let published: std::collections::HashSet<i64> = published.iter().copied().collect();
                let (done, rest): (Vec<&OutboxRow>, Vec<&OutboxRow>) =
                    self.rows.iter().partition(|r| published.contains(&r.id));
                let mut back: BTreeMap<i64, OutboxRow> =
                    rest.into_iter().map(|r| (r.id, r.clone())).collect();
                let max = max_attempts.max(1);
                for f in failures {
                    let Some(row) = back.get_mut(&f.id) else {
                        settled.failures.push((f.id, Rescheduled::NotHeld));
                        continue;
                    };
                    row.attempts = row.attempts.saturating_add(1);
                    row.last_error = Some(f.error.chars().take(2000).collect());
                    row.available_at = f.retry_at_ms;
                    let outcome = if row.attempts >= max || f.permanent {
                        row.state = OutboxState::Dead;
                        Rescheduled::Dead
                    } else {
                        Rescheduled::Retry
                    };
                    settled.failures.push((f.id, outcome));
                }
                settled.published = done.len() as u64;
                insert_rows(&mut tx, back.values(), Destination::Outbox).await?;
                if keep {
                    let to = Destination::Published {
                        at_ms: published_at_ms,
                    };
                    insert_rows(&mut tx, done, to).await?;
                }
                tx.commit().await?;
            }
        }
        Ok(settled)
    }
}

/// One column of `rows`, as an array parameter for `UNNEST`.
fn column<'a, T>(rows: &[&'a OutboxRow], f: impl Fn(&'a OutboxRow) -> T) -> Vec<T> {
    rows.iter().map(|r| f(r)).collect()
}

/// The `UNNEST` arguments of [`insert_rows`]: `moved_columns!`' arrays, `$1`–`$11`.
const MOVED_ARRAYS: &str = "$1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], \
     $6::bytea[], $7::text[], $8::bigint[], $9::bigint[], $10::int[], $11::text[]";

/// Where [`insert_rows`] writes.
enum Destination {
    /// Back into `oncely_outbox`, each row with its state.
    Outbox,
    /// Into `oncely_outbox_published`, published at `at_ms` (Unix ms). A message id recorded
    /// already (a copy enqueued while its original was being published, published again
    /// with the same id) keeps its first record.
    Published { at_ms: i64 },
}

/// Inserts rows (PostgreSQL) with their ids and message ids, in one statement; nothing
/// when there are none.
async fn insert_rows<'a>(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    rows: impl IntoIterator<Item = &'a OutboxRow>,
    to: Destination,
) -> Result<(), StoreError> {
    let rows: Vec<&OutboxRow> = rows.into_iter().collect();
    if rows.is_empty() {
        return Ok(());
    }
    let headers = rows
        .iter()
        .map(|r| headers_json(&r.event.headers))
        .collect::<Result<Vec<_>, _>>()?;
    let sql = match to {
        Destination::Outbox => format!(
            "INSERT INTO oncely_outbox ({}, state) SELECT * FROM UNNEST({MOVED_ARRAYS}, $12::text[])",
            moved_columns!()
        ),
        Destination::Published { .. } => format!(
            "INSERT INTO oncely_outbox_published ({}, published_at) \
             SELECT u.*, $12 FROM UNNEST({MOVED_ARRAYS}) AS u ON CONFLICT DO NOTHING",
            moved_columns!()
        ),
    };
    let query = sqlx::query(&sql)
        .bind(column(&rows, |r| r.id))
        .bind(column(&rows, |r| r.event.message_id.to_string()))
        .bind(column(&rows, |r| r.event.topic.as_str()))
        .bind(column(&rows, |r| r.event.partition_key.as_str()))
        .bind(column(&rows, |r| r.event.event_type.as_str()))
        .bind(column(&rows, |r| r.event.payload.as_slice()))
        .bind(headers)
        .bind(column(&rows, |r| r.created_at))
        .bind(column(&rows, |r| r.available_at))
        .bind(column(&rows, |r| {
            i32::try_from(r.attempts).unwrap_or(i32::MAX)
        }))
        .bind(column(&rows, |r| r.last_error.as_deref()));
    let query = match to {
        Destination::Outbox => query.bind(column(&rows, |r| r.state.as_str())),
        Destination::Published { at_ms } => query.bind(at_ms),
    };
    query.execute(&mut **tx).await?;
    Ok(())
}

/// `ranges` as a PostgreSQL `int8multirange` literal, e.g. `{[1,128],[200,311]}`.
fn multirange(ranges: &[std::ops::RangeInclusive<i64>]) -> String {
    let parts: Vec<String> = ranges
        .iter()
        .filter(|r| r.start() <= r.end())
        .map(|r| format!("[{},{}]", r.start(), r.end()))
        .collect();
    format!("{{{}}}", parts.join(","))
}

/// The transactional outbox over table `oncely_outbox` (DESIGN.md "Outbox, relay, inbox").
///
/// - **Enqueue** in the caller's transaction ([`OutboxStore::enqueue`]): no event without
///   its business change, no business change without its event.
/// - **Claim by state, never by cursor** ([`OutboxStore::claim`]): a relay leases the
///   *head* of each partition — its oldest pending row — so a row whose transaction commits
///   after a higher-numbered row is still found, and at most one event per partition key is
///   in flight across all relays, which keeps each partition's events in order however
///   many relays run. PostgreSQL and MySQL 8.0+ / MariaDB 10.6+ lock candidates with
///   `FOR UPDATE SKIP LOCKED`, so relays never wait on each other; SQLite serialises claims
///   on its single writer.
/// - **Settle**: [`ClaimedBatch::settle`] for a batch of [`OutboxStore::claim_batch`];
///   for leases of [`OutboxStore::claim`], [`OutboxStore::mark_published`] after the broker
///   confirmed and [`OutboxStore::reschedule`] after a failure (backoff computed by the
///   caller; `dead` after the attempt limit), both acting only on rows the caller still
///   leases.
/// - **Published rows**: on PostgreSQL they leave `oncely_outbox` for
///   `oncely_outbox_published` (or are forgotten, see [`OutboxStore::keep_published`]);
///   elsewhere they stay, state `published`. [`OutboxStore::get`] finds them either way
///   until [`OutboxStore::delete_published`] removes them.
///
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct OutboxStore {
    db: Database,
    keep_published: bool,
}

impl OutboxStore {
    /// A store on `db` (migrated with [`Database::migrate`]) that keeps published rows
    /// until [`OutboxStore::delete_published`] removes them.
    pub fn new(db: Database) -> Self {
        Self {
            db,
            keep_published: true,
        }
    }

    /// Whether rows are kept once published (default `true`). With `false` (a relay with
    /// zero retention), PostgreSQL forgets a row when its publish is settled, which spares
    /// the write of the published record; SQLite and MySQL mark it and leave it to
    /// [`OutboxStore::delete_published`].
    #[must_use]
    pub fn keep_published(mut self, keep: bool) -> Self {
        self.keep_published = keep;
        self
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Adds `event` to the outbox inside `tx`, state `pending`, available at once. It
    /// becomes visible to relays when `tx` commits (PostgreSQL then notifies channel
    /// `oncely_outbox`) and vanishes if `tx` rolls back. Returns the row id.
    ///
    /// # Errors
    /// [`StoreError::Database`] when the insert fails — including a unique violation on
    /// `message_id`, which means the same event was enqueued twice; the caller must then
    /// roll back. [`StoreError::AlreadyPublished`] (PostgreSQL) when an event with this
    /// message id was published within the retention. Either guard is best effort across
    /// the retention boundary and against a copy enqueued while the first is being
    /// published; such a copy goes out with the same message id, which JetStream and the
    /// consumers' inboxes drop.
    pub async fn enqueue(tx: &mut Tx, event: &OutboxEvent) -> Result<i64, StoreError> {
        let now = oncely_core::now_ms();
        let headers = headers_json(&event.headers)?;
        if let Tx::MySql(t) = tx {
            // No `INSERT … RETURNING` on MySQL: the id is the connection's last insert id.
            let id = sqlx::query(
                "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
                 payload, headers, created_at, available_at, attempts, state) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, 'pending')",
            )
            .bind(event.message_id.to_string())
            .bind(&event.topic)
            .bind(&event.partition_key)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(&headers)
            .bind(now)
            .bind(now)
            .execute(&mut **t)
            .await?
            .last_insert_id();
            return i64::try_from(id).map_err(|_| StoreError::Corrupt(format!("outbox id {id}")));
        }
        if let Tx::Postgres(t) = tx {
            // Published events live in `oncely_outbox_published`; the UNIQUE(message_id)
            // there and the check here keep an id from being enqueued again while its
            // published record is kept.
            let id: Option<i64> = sqlx::query_scalar(
                "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
                 payload, headers, created_at, available_at, attempts, state) \
                 SELECT $1, $2, $3, $4, $5, $6, $7, $7, 0, 'pending' \
                 WHERE NOT EXISTS (SELECT 1 FROM oncely_outbox_published WHERE message_id = $1) \
                 RETURNING id",
            )
            .bind(event.message_id.to_string())
            .bind(&event.topic)
            .bind(&event.partition_key)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(&headers)
            .bind(now)
            .fetch_optional(&mut **t)
            .await?;
            return id.ok_or_else(|| StoreError::AlreadyPublished(event.message_id.to_string()));
        }
        let id: i64 = on_tx!(tx, |c| {
            sqlx::query_scalar(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, payload, \
             headers, created_at, available_at, attempts, state) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7, 0, 'pending') RETURNING id",
        )
        .bind(event.message_id.to_string())
        .bind(&event.topic)
        .bind(&event.partition_key)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(&headers)
        .bind(now)
        .fetch_one(c)
        .await
        })?;
        Ok(id)
    }

    /// Leases up to `batch` rows for `owner` until `now_ms + lease` and returns them in id
    /// order. A row is claimable when it is `pending`, available (`available_at ≤ now`), not
    /// leased by a live lease, the oldest pending row of its partition key, and no other row
    /// of its partition is leased — so each partition contributes at most one row, and none
    /// while another row of it is in flight (even one with a higher id whose transaction
    /// committed first) or an earlier one is in backoff.
    ///
    /// `lease` must exceed the publish timeout: a relay that outlives its lease may see its
    /// rows republished by another (same message ids, so consumers' inboxes and JetStream's
    /// de-duplication recognise them).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing is leased then.
    pub async fn claim(
        &self,
        owner: &str,
        batch: u32,
        lease: Duration,
        now_ms: i64,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let until = now_ms.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        let batch = i64::from(batch.max(1));
        // Candidates: pending, available, unleased heads of partitions with nothing leased.
        let candidates = "SELECT o.id FROM oncely_outbox o \
             WHERE o.state = 'pending' AND o.available_at <= $3 \
             AND (o.locked_until IS NULL OR o.locked_until < $3) \
             AND NOT EXISTS (SELECT 1 FROM oncely_outbox p \
               WHERE p.partition_key = o.partition_key AND p.state = 'pending' \
               AND (p.id < o.id OR p.locked_until >= $3)) \
             ORDER BY o.id LIMIT $4";
        let rows: Vec<Row> = match &self.db {
            // One writer: the statement runs alone, the subquery once.
            Database::Sqlite(s) => {
                sqlx::query_as(&format!(
                    "UPDATE oncely_outbox SET locked_by = $1, locked_until = $2 \
                     WHERE id IN ({candidates}) RETURNING {COLUMNS}"
                ))
                .bind(owner)
                .bind(until)
                .bind(now_ms)
                .bind(batch)
                .fetch_all(s.writer())
                .await?
            }
            // The locking subquery sits in a CTE so it runs exactly once: as an `IN (…)`
            // subquery the planner may rescan it, and with SKIP LOCKED a rescan returns
            // other rows (more than LIMIT in all). The partition locks are tried on its rows
            // only ([`partition_lock`]), leaving out partitions a `claim_batch` relay
            // holds; the UPDATE re-checks the lease on the row version the lock returned.
            Database::Postgres(p) => {
                let mut tx = p.pool().begin_with(format!("BEGIN; {PINNED_PLAN}")).await?;
                let rows = sqlx::query_as(&format!(
                    "WITH c AS ({}), h AS (SELECT c.id FROM c WHERE {}) \
                     UPDATE oncely_outbox t SET locked_by = $1, locked_until = $2 \
                     WHERE t.id = ANY (ARRAY(SELECT h.id FROM h)) AND t.state = 'pending' \
                     AND (t.locked_until IS NULL OR t.locked_until < $3) \
                     RETURNING {}",
                    claim_candidates("$3", "$4", "'{}'"),
                    partition_lock("c"),
                    qualified("t")
                ))
                .bind(owner)
                .bind(until)
                .bind(now_ms)
                .bind(batch)
                .fetch_all(&mut *tx)
                .await?;
                tx.commit().await?;
                rows
            }
            Database::MySql(p) => {
                outbox_mysql::claim(p.pool(), owner, until, now_ms, batch).await?
            }
        };
        let mut rows = rows
            .into_iter()
            .map(Row::into_row)
            .collect::<Result<Vec<_>, _>>()?;
        rows.sort_by_key(|r| r.id);
        Ok(rows)
    }

    /// Claims up to `batch` partition heads (the rows [`OutboxStore::claim`] would take) and
    /// holds them until [`ClaimedBatch::settle`]:
    ///
    /// - **PostgreSQL**: one statement locks the rows `FOR UPDATE SKIP LOCKED` and deletes
    ///   them, in a transaction that stays open while they are published; `settle` commits
    ///   it together with the outcome (published rows recorded in
    ///   `oncely_outbox_published` when the store keeps them, failed and unsettled rows
    ///   re-inserted with their ids). Until then other relays still see the rows — so the
    ///   rest of each partition stays unclaimable — and skip them, as they are locked. A
    ///   relay that dies mid-batch loses its connection, PostgreSQL rolls the transaction
    ///   back and the rows are claimable again at once, untouched (republished with the same
    ///   message ids) — no lease to wait out. The hot table thus only ever holds pending and
    ///   dead rows, and a published row costs no second version of itself. Measured with
    ///   `oncely bench relay`: see the README.
    /// - **SQLite**: a lease for `owner` until `now_ms + lease`, as [`OutboxStore::claim`]
    ///   (one writer: there is no row lock to hold).
    /// - **MySQL / MariaDB**: a lease as well, written by [`OutboxStore::claim`]'s
    ///   `FOR UPDATE SKIP LOCKED` transaction (holding the locks across the publish, as on
    ///   PostgreSQL, is not built for MySQL yet).
    ///
    /// `skip`: id ranges the claim need not look at (PostgreSQL), because their rows are
    /// held by the caller's own batches in flight — rows there that the caller does not
    /// hold are only left for a later claim. Pass `&[]` when there are none.
    ///
    /// Each held batch keeps one pooled connection (PostgreSQL) until it is settled or
    /// dropped; dropping it unsettled rolls back (PostgreSQL, when the pool takes the
    /// connection back) or leaves the lease to run out (SQLite, MySQL).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing is held then.
    pub async fn claim_batch(
        &self,
        owner: &str,
        batch: u32,
        lease: Duration,
        now_ms: i64,
        skip: &[std::ops::RangeInclusive<i64>],
    ) -> Result<ClaimedBatch, StoreError> {
        let Database::Postgres(p) = &self.db else {
            let rows = self.claim(owner, batch, lease, now_ms).await?;
            return Ok(ClaimedBatch {
                rows,
                hold: Hold::Leased {
                    store: self.clone(),
                    owner: owner.to_owned(),
                },
            });
        };
        let batch = i64::from(batch.max(1));
        // The claim's plan is pinned ([`PINNED_PLAN`]: the statistics say the table is empty
        // right when a backlog arrives; with the seq scans it took 7 s instead of 6 ms to
        // claim 256 of 30,000 rows), set in the same round trip as `BEGIN`; the head check is
        // an `OFFSET 0` subquery on a row comparison only `oncely_outbox_pending` can serve,
        // and the ids are taken as `= ANY (ARRAY(…))`, so no join is left to plan.
        //
        // `plan_cache_mode = force_generic_plan`: the claim's plan does not depend on its
        // parameters, but PostgreSQL 15 kept choosing a custom plan for it on every
        // execution (`pg_prepared_statements`: 0 generic, 8 custom), planning it each time
        // for about 1 ms — as long as the claim itself.
        //
        // `synchronous_commit = off` for this transaction only: its commit (the settle)
        // returns before the WAL is flushed. A server crash in that window can only undo
        // the settle — the rows come back `pending` and are republished with the same
        // message ids, which at-least-once delivery already allows; no event is lost and no
        // business data is in this transaction. It saves one WAL flush per batch on the
        // relay's critical path.
        let mut tx = p
            .pool()
            .begin_with(format!(
                "BEGIN; {PINNED_PLAN}; \
                 SET LOCAL plan_cache_mode = force_generic_plan; \
                 SET LOCAL synchronous_commit = off"
            ))
            .await?;
        // The claim *is* the delete: the candidates are locked `FOR UPDATE OF o SKIP
        // LOCKED` and deleted in the same statement — those whose partition this
        // transaction can lock ([`partition_lock`]); a candidate whose partition another
        // relay holds stays locked by this transaction, untouched, until it ends. Until
        // this transaction commits, other relays still see the rows (so a partition whose
        // head is in flight stays blocked) and skip them (they are locked); a rollback —
        // relay crash, lost connection, failed settle — puts them back untouched. A live
        // lease (a relay using `claim`) is honoured as in `claim`.
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "WITH c AS ({}), h AS (SELECT c.id FROM c WHERE {}) \
             DELETE FROM oncely_outbox x WHERE x.id = ANY (ARRAY(SELECT h.id FROM h)) \
             RETURNING {}",
            claim_candidates("$1", "$2", "$3"),
            partition_lock("c"),
            qualified("x")
        ))
        .bind(now_ms)
        .bind(batch)
        .bind(multirange(skip))
        .fetch_all(&mut *tx)
        .await?;
        let mut rows = rows
            .into_iter()
            .map(Row::into_row)
            .collect::<Result<Vec<_>, _>>()?;
        rows.sort_by_key(|r| r.id);
        if rows.is_empty() {
            // Nothing to hold: give the connection back now.
            tx.rollback().await?;
            return Ok(ClaimedBatch {
                rows,
                hold: Hold::Nothing,
            });
        }
        Ok(ClaimedBatch {
            rows,
            hold: Hold::Locked {
                tx: Box::new(tx),
                keep: self.keep_published,
            },
        })
    }

    /// Marks `ids` published at `now_ms`, for those rows `owner` still leases. Returns how
    /// many rows were marked (fewer than `ids.len()` when a lease ran out and another relay
    /// took the row over).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the rows stay leased and are republished
    /// after the lease runs out (same message ids).
    pub async fn mark_published(
        &self,
        owner: &str,
        ids: &[i64],
        now_ms: i64,
    ) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let n = match &self.db {
            Database::Sqlite(s) => {
                let list = serde_json::to_string(ids)
                    .map_err(|e| StoreError::Corrupt(format!("id list: {e}")))?;
                sqlx::query(
                    "UPDATE oncely_outbox SET state = 'published', published_at = $1, \
                     locked_by = NULL, locked_until = NULL \
                     WHERE id IN (SELECT value FROM json_each($2)) AND locked_by = $3 \
                     AND state = 'pending'",
                )
                .bind(now_ms)
                .bind(list)
                .bind(owner)
                .execute(s.writer())
                .await?
                .rows_affected()
            }
            // The row moves to `oncely_outbox_published` (or goes, without retention).
            // A message id recorded already keeps its first record (see `Destination`).
            Database::Postgres(p) if self.keep_published => {
                let n: i64 = sqlx::query_scalar(concat!(
                    "WITH d AS (DELETE FROM oncely_outbox \
                         WHERE id = ANY($2) AND locked_by = $3 AND state = 'pending' \
                         RETURNING *), \
                         i AS (INSERT INTO oncely_outbox_published (",
                    moved_columns!(),
                    ", published_at) SELECT ",
                    moved_columns!(),
                    ", $1 FROM d ON CONFLICT DO NOTHING) SELECT count(*) FROM d"
                ))
                .bind(now_ms)
                .bind(ids)
                .bind(owner)
                .fetch_one(p.pool())
                .await?;
                u64::try_from(n).unwrap_or(0)
            }
            Database::Postgres(p) => sqlx::query(
                "DELETE FROM oncely_outbox \
                 WHERE id = ANY($1) AND locked_by = $2 AND state = 'pending'",
            )
            .bind(ids)
            .bind(owner)
            .execute(p.pool())
            .await?
            .rows_affected(),
            Database::MySql(p) => {
                outbox_mysql::mark_published(p.pool(), owner, ids, now_ms).await?
            }
        };
        Ok(n)
    }

    /// Records a failed publish of row `id` held by `owner`: `attempts + 1`, `last_error`,
    /// lease released; the row becomes `dead` when the new attempt count reaches
    /// `max_attempts`, else `pending` again from `retry_at_ms` (Unix ms; the caller applies
    /// backoff with jitter). `error` is cut to 2,000 characters.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the row stays leased and is retried after
    /// the lease runs out.
    pub async fn reschedule(
        &self,
        owner: &str,
        id: i64,
        error: &str,
        retry_at_ms: i64,
        max_attempts: u32,
    ) -> Result<Rescheduled, StoreError> {
        let error: String = error.chars().take(2000).collect();
        let max = i64::from(max_attempts.max(1));
        let sql = format!(
            "UPDATE oncely_outbox SET {RESCHEDULE_SET}, locked_by = NULL, locked_until = NULL \
             WHERE id = $4 AND locked_by = $5 AND state = 'pending' RETURNING state"
        );
        if let Database::MySql(p) = &self.db {
            let state =
                outbox_mysql::reschedule(p.pool(), owner, id, &error, retry_at_ms, max).await?;
            return Ok(Rescheduled::from_state(state.as_deref()));
        }
        let state: Option<String> = crate::on_writer!(&self.db, |p| sqlx::query_scalar(&sql)
            .bind(&error)
            .bind(retry_at_ms)
            .bind(max)
            .bind(id)
            .bind(owner)
            .fetch_optional(p)
            .await)?;
        Ok(Rescheduled::from_state(state.as_deref()))
    }

    /// Gives back the leases `owner` holds on `ids` without counting an attempt (a relay
    /// shutting down with claimed rows it did not publish).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the leases then simply run out.
    pub async fn release(&self, owner: &str, ids: &[i64]) -> Result<u64, StoreError> {
        let mut n = 0;
        for id in ids {
            let sql = "UPDATE oncely_outbox SET locked_by = NULL, locked_until = NULL \
                       WHERE id = $1 AND locked_by = $2 AND state = 'pending'";
            n += crate::on_writer!(&self.db, |p| sqlx::query(&sql_text(p, sql))
                .bind(id)
                .bind(owner)
                .execute(p)
                .await
                .map(|r| r.rows_affected()))?;
        }
        Ok(n)
    }

    /// Pending and dead counts and the oldest pending row's time.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let sql = "SELECT \
                   COALESCE(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END), 0), \
                   MIN(CASE WHEN state = 'pending' THEN created_at END), \
                   COALESCE(SUM(CASE WHEN state = 'dead' THEN 1 ELSE 0 END), 0) \
                   FROM oncely_outbox WHERE state <> 'published'";
        let (pending, oldest, dead): (i64, Option<i64>, i64) = match &self.db {
            Database::Sqlite(s) => sqlx::query_as(sql).fetch_one(s.reader()).await?,
            Database::Postgres(p) => sqlx::query_as(sql).fetch_one(p.pool()).await?,
            Database::MySql(p) => {
                sqlx::query_as(outbox_mysql::STATS)
                    .fetch_one(p.pool())
                    .await?
            }
        };
        Ok(OutboxStats {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest_pending_created_at: oldest,
            dead: u64::try_from(dead).unwrap_or(0),
        })
    }

    /// Reads one row by id.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is corrupt.
    pub async fn get(&self, id: i64) -> Result<Option<OutboxRow>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM oncely_outbox WHERE id = $1");
        let row: Option<Row> = match &self.db {
            Database::Sqlite(s) => {
                sqlx::query_as(&sql)
                    .bind(id)
                    .fetch_optional(s.reader())
                    .await?
            }
            Database::Postgres(p) => {
                // A published row lives in `oncely_outbox_published` (migration 0005).
                sqlx::query_as(&format!(
                    "SELECT {COLUMNS} FROM oncely_outbox WHERE id = $1 \
                     UNION ALL SELECT {PUBLISHED_COLUMNS} FROM oncely_outbox_published \
                     WHERE id = $1"
                ))
                .bind(id)
                .fetch_optional(p.pool())
                .await?
            }
            Database::MySql(p) => {
                sqlx::query_as(&format!(
                    "SELECT {} FROM oncely_outbox WHERE id = ?",
                    outbox_mysql::COLUMNS
                ))
                .bind(id)
                .fetch_optional(p.pool())
                .await?
            }
        };
        row.map(Row::into_row).transpose()
    }

    /// Up to `limit` dead rows with ids above `after_id` (0 to start), in id order.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn dead(&self, after_id: i64, limit: u32) -> Result<Vec<OutboxRow>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM oncely_outbox WHERE state = 'dead' AND id > $1 \
             ORDER BY id LIMIT $2"
        );
        let limit = i64::from(limit.max(1));
        let rows: Vec<Row> = match &self.db {
            Database::Sqlite(s) => {
                sqlx::query_as(&sql)
                    .bind(after_id)
                    .bind(limit)
                    .fetch_all(s.reader())
                    .await?
            }
            Database::Postgres(p) => {
                sqlx::query_as(&sql)
                    .bind(after_id)
                    .bind(limit)
                    .fetch_all(p.pool())
                    .await?
            }
            Database::MySql(p) => {
                sqlx::query_as(&format!(
                    "SELECT {} FROM oncely_outbox WHERE state = 'dead' AND id > ? \
                     ORDER BY id LIMIT ?",
                    outbox_mysql::COLUMNS
                ))
                .bind(after_id)
                .bind(limit)
                .fetch_all(p.pool())
                .await?
            }
        };
        rows.into_iter().map(Row::into_row).collect()
    }

    /// Puts dead rows back to `pending` with `attempts = 0`, available at `now_ms`
    /// (`last_error` is kept for the record). Returns how many rows were requeued. A
    /// requeued row is published after the rows of its partition that overtook it while it
    /// was dead.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn requeue_dead(
        &self,
        target: RequeueTarget,
        now_ms: i64,
    ) -> Result<u64, StoreError> {
        let (sql, id) = match target {
            RequeueTarget::Id(id) => (
                "UPDATE oncely_outbox SET state = 'pending', attempts = 0, available_at = $1, \
                 locked_by = NULL, locked_until = NULL WHERE state = 'dead' AND id = $2",
                Some(id),
            ),
            RequeueTarget::All => (
                "UPDATE oncely_outbox SET state = 'pending', attempts = 0, available_at = $1, \
                 locked_by = NULL, locked_until = NULL WHERE state = 'dead'",
                None,
            ),
        };
        let n = crate::on_writer!(&self.db, |p| {
            let sql = sql_text(p, sql);
            let mut q = sqlx::query(&sql).bind(now_ms);
            if let Some(id) = id {
                q = q.bind(id);
            }
            q.execute(p).await.map(|r| r.rows_affected())
        })?;
        Ok(n)
    }

    /// Deletes up to `batch` rows published before `before_ms` (Unix ms). Returns how many
    /// were deleted; call again while it returns `batch`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn delete_published(&self, before_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        let n = match &self.db {
            Database::Sqlite(s) => sqlx::query(
                "DELETE FROM oncely_outbox WHERE id IN (SELECT id FROM oncely_outbox \
                 WHERE state = 'published' AND published_at < $1 LIMIT $2)",
            )
            .bind(before_ms)
            .bind(batch)
            .execute(s.writer())
            .await?
            .rows_affected(),
            // Plan pinned, rows taken by TID (`crate::plan`).
            Database::Postgres(p) => {
                crate::plan::execute_planned(
                    p.pool(),
                    crate::plan::PINNED_PLAN_BRIN,
                    sqlx::query(
                        "WITH c AS (SELECT ctid FROM oncely_outbox_published \
                         WHERE published_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED) \
                         DELETE FROM oncely_outbox_published \
                         WHERE ctid = ANY (ARRAY(SELECT c.ctid FROM c))",
                    )
                    .bind(before_ms)
                    .bind(batch),
                )
                .await?
            }
            Database::MySql(p) => sqlx::query(outbox_mysql::DELETE_PUBLISHED)
                .bind(before_ms)
                .bind(batch)
                .execute(p.pool())
                .await?
                .rows_affected(),
        };
        Ok(n)
    }

    /// PostgreSQL: `VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON, TRUNCATE false) oncely_outbox` —
    /// removes the index entries and row versions left by claimed (deleted) rows; skipped
    /// when another session holds the table's vacuum lock (another relay vacuuming it,
    /// autovacuum). `TRUNCATE false`: giving empty trailing pages back to the file system
    /// takes an `ACCESS EXCLUSIVE` lock that would stall the business transactions
    /// enqueueing events (and, replayed on a standby, cancel its queries); the pages are
    /// reused by the next inserts anyway, and autovacuum still truncates. Does nothing on
    /// SQLite (freed pages are reused) and MySQL (InnoDB's purge runs by itself).
    ///
    /// Why a relay calls it (see `RelayConfig::vacuum_after_rows` in `oncely-outbox`): the
    /// claim walks the pending rows in id order, and every row claimed since the last
    /// vacuum leaves a dead entry at the low end of that walk. Autovacuum visits a database
    /// at most once per `autovacuum_naptime` (60 s by default); at tens of thousands of
    /// events per second each claim then steps over hundreds of thousands of dead entries
    /// (`oncely bench relay` to NATS lost 15–20 % of its throughput within five
    /// 50,000-event runs).
    ///
    /// Needs the table's owner (or, PostgreSQL 17+, `MAINTAIN`); without it PostgreSQL only
    /// warns and skips the table.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn vacuum(&self) -> Result<(), StoreError> {
        if let Database::Postgres(p) = &self.db {
            // Simple query protocol: VACUUM cannot run inside a transaction block.
            sqlx::raw_sql("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON, TRUNCATE false) oncely_outbox")
                .execute(p.pool())
                .await?;
        }
        Ok(())
    }
}
