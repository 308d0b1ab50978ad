use std::collections::BTreeMap;
use std::time::Duration;

use oncely_core::MessageId;

use crate::backend::{with_store, with_tx, Store, Sweep};
use crate::{sql_text, Database, StoreError, Tx};

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
    pub(crate) id: i64,
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

pub(crate) const COLUMNS: &str =
    "id, message_id, topic, partition_key, event_type, payload, headers, \
     created_at, available_at, attempts, last_error, state, published_at";

/// `headers` as stored in the `headers` column (a JSON object).
pub(crate) fn headers_json(headers: &BTreeMap<String, String>) -> Result<String, StoreError> {
    serde_json::to_string(headers).map_err(|e| StoreError::Corrupt(format!("outbox headers: {e}")))
}

impl Row {
    pub(crate) fn into_row(self) -> Result<OutboxRow, StoreError> {
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

/// The reschedule of a row (SQLite, PostgreSQL): binds `$1`–`$3` as [`RESCHEDULE_SET`],
/// `$4` id, `$5` owner; returns the new state, no row when `owner` does not hold it.
pub(crate) fn reschedule_sql() -> String {
    format!(
        "UPDATE oncely_outbox SET {RESCHEDULE_SET}, locked_by = NULL, locked_until = NULL \
         WHERE id = $4 AND locked_by = $5 AND state = 'pending' RETURNING state"
    )
}

/// Pending and dead counts and the oldest pending row's time (SQLite, PostgreSQL).
pub(crate) const STATS: &str = "SELECT \
     COALESCE(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END), 0), \
     MIN(CASE WHEN state = 'pending' THEN created_at END), \
     COALESCE(SUM(CASE WHEN state = 'dead' THEN 1 ELSE 0 END), 0) \
     FROM oncely_outbox WHERE state <> 'published'";

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
    pub(crate) rows: Vec<OutboxRow>,
    pub(crate) hold: Hold,
}

pub(crate) enum Hold {
    /// Nothing was claimed (PostgreSQL's held claim found no row).
    Nothing,
    /// PostgreSQL: deleted, and so locked, by this open transaction; `keep`: record the
    /// published rows in `oncely_outbox_published`.
    #[cfg(feature = "postgres")]
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
            #[cfg(feature = "postgres")]
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
            #[cfg(feature = "postgres")]
            Hold::Locked { tx, keep } => {
                settled = crate::postgres::settle_locked(
                    tx,
                    keep,
                    &self.rows,
                    published,
                    published_at_ms,
                    failures,
                    max_attempts,
                )
                .await?;
            }
        }
        Ok(settled)
    }
}

/// The transactional outbox over table `oncely_outbox` (docs/DESIGN.md "Outbox, relay, inbox").
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
        with_tx!(tx, |t: S| S::enqueue(t, event, &headers, now).await)
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
        let rows = with_store!(&self.db, |s| s.claim(owner, until, now_ms, batch).await)?;
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
    ///   `oncely-bench relay`: see the README.
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
        let held = with_store!(&self.db, |s| s
            .claim_held(batch, now_ms, skip, self.keep_published)
            .await)?;
        if let Some(held) = held {
            return Ok(held);
        }
        let rows = self.claim(owner, batch, lease, now_ms).await?;
        Ok(ClaimedBatch {
            rows,
            hold: Hold::Leased {
                store: self.clone(),
                owner: owner.to_owned(),
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
        let keep = self.keep_published;
        let n = with_store!(&self.db, |s| s
            .mark_published(owner, ids, now_ms, keep)
            .await)?;
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
        let state = with_store!(&self.db, |s| s
            .reschedule(owner, id, &error, retry_at_ms, max)
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
        let (pending, oldest, dead) = with_store!(&self.db, |s| s.stats().await)?;
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
        let row = with_store!(&self.db, |s| s.get(id).await)?;
        row.map(Row::into_row).transpose()
    }

    /// Up to `limit` dead rows with ids above `after_id` (0 to start), in id order.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn dead(&self, after_id: i64, limit: u32) -> Result<Vec<OutboxRow>, StoreError> {
        let limit = i64::from(limit.max(1));
        let rows = with_store!(&self.db, |s| s.dead(after_id, limit).await)?;
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
        let n = with_store!(&self.db, |s| s.delete_published(before_ms, batch).await)?;
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
    /// (`oncely-bench relay` to NATS lost 15–20 % of its throughput within five
    /// 50,000-event runs).
    ///
    /// Needs the table's owner (or, PostgreSQL 17+, `MAINTAIN`); without it PostgreSQL only
    /// warns and skips the table.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn vacuum(&self) -> Result<(), StoreError> {
        with_store!(&self.db, |s| s.vacuum().await)
    }
}

/// Rows marked `published` before the bound (`$1`), where published rows stay in
/// `oncely_outbox` (SQLite, MySQL).
const PUBLISHED_BEFORE: Sweep = Sweep {
    table: "oncely_outbox",
    filter: "state = 'published' AND published_at < $1",
    order_by: "published_at",
};

/// What each backend implements for [`OutboxStore`] (in `sqlite/`, `postgres/`, `mysql/`
/// `outbox.rs`). Statements whose text is the same everywhere (release, requeue) stay in
/// [`OutboxStore`], through [`crate::on_writer!`] and [`sql_text`].
pub(crate) trait OutboxBackend: Store {
    /// Inserts `event` (headers already as JSON) in `tx` at `now` (Unix ms); the row id.
    async fn enqueue(
        tx: &mut Self::Tx,
        event: &OutboxEvent,
        headers: &str,
        now: i64,
    ) -> Result<i64, StoreError>;

    /// Leases up to `batch` claimable rows to `owner` until `until` (see
    /// [`OutboxStore::claim`]).
    async fn claim(
        &self,
        owner: &str,
        until: i64,
        now_ms: i64,
        batch: i64,
    ) -> Result<Vec<Row>, StoreError>;

    /// A claim held by an open transaction instead of a lease (see
    /// [`OutboxStore::claim_batch`]); `None` where the backend leases (the default).
    async fn claim_held(
        &self,
        batch: u32,
        now_ms: i64,
        skip: &[std::ops::RangeInclusive<i64>],
        keep: bool,
    ) -> Result<Option<ClaimedBatch>, StoreError> {
        let _ = (batch, now_ms, skip, keep);
        Ok(None)
    }

    /// Marks `ids` leased by `owner` published (`keep`: record them; see
    /// [`OutboxStore::keep_published`]).
    async fn mark_published(
        &self,
        owner: &str,
        ids: &[i64],
        now_ms: i64,
        keep: bool,
    ) -> Result<u64, StoreError>;

    /// One failed attempt of row `id` held by `owner` (`error` already cut); the new state,
    /// `None` when `owner` does not hold the row.
    async fn reschedule(
        &self,
        owner: &str,
        id: i64,
        error: &str,
        retry_at_ms: i64,
        max: i64,
    ) -> Result<Option<String>, StoreError>;

    /// Pending count, oldest pending `created_at`, dead count.
    async fn stats(&self) -> Result<(i64, Option<i64>, i64), StoreError>;

    /// One row by id, published ones included.
    async fn get(&self, id: i64) -> Result<Option<Row>, StoreError>;

    /// Up to `limit` dead rows above `after_id`, in id order.
    async fn dead(&self, after_id: i64, limit: i64) -> Result<Vec<Row>, StoreError>;

    /// Deletes up to `batch` rows published before `before_ms`: by default the rows marked
    /// `published` in `oncely_outbox` ([`PUBLISHED_BEFORE`]).
    async fn delete_published(&self, before_ms: i64, batch: i64) -> Result<u64, StoreError> {
        Ok(self.sweep(&PUBLISHED_BEFORE, before_ms, batch).await?)
    }

    /// Vacuums the outbox where that helps ([`crate::Backend::needs_vacuum`]); nothing by
    /// default.
    async fn vacuum(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
