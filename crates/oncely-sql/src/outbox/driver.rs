//! What each backend implements for [`OutboxStore`](crate::OutboxStore) (in `sqlite/`, `postgres/`, `mysql/`), and the row and SQL texts they share.

use std::collections::BTreeMap;

use oncely_core::MessageId;

use super::types::{ClaimedBatch, OutboxEvent, OutboxRow, OutboxState};
use crate::driver::{Store, Sweep};
use crate::StoreError;

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

/// A failed publish: one more attempt, its error, the next attempt's time, and `dead` at the
/// attempt limit. `state` comes first: MySQL evaluates single-table `SET` assignments left
/// to right, each seeing the columns assigned before it (SQLite and PostgreSQL read the old
/// row whatever the order). Binds `$1` attempt limit, `$2` error, `$3` available_at.
const RESCHEDULE_SET: &str =
    "state = CASE WHEN attempts + 1 >= $1 THEN 'dead' ELSE 'pending' END, \
     attempts = attempts + 1, last_error = $2, available_at = $3, \
     locked_by = NULL, locked_until = NULL";

/// The reschedule of a row (every backend; MySQL rewrites the placeholders): binds
/// `$1`–`$3` as [`RESCHEDULE_SET`], `$4` id, `$5` owner; touches no row when `owner` does
/// not hold it.
pub(crate) fn reschedule_update() -> String {
    format!(
        "UPDATE oncely_outbox SET {RESCHEDULE_SET} \
         WHERE id = $4 AND locked_by = $5 AND state = 'pending'"
    )
}

/// [`reschedule_update`] returning the new state, where `UPDATE … RETURNING` exists (SQLite,
/// PostgreSQL): no row when `owner` does not hold it.
pub(crate) fn reschedule_sql() -> String {
    format!("{} RETURNING state", reschedule_update())
}

/// Pending and dead counts and the oldest pending row's time (every backend: `COUNT` is a
/// 64-bit integer on each, where MySQL's `SUM` would be `DECIMAL`).
pub(crate) const STATS: &str = "SELECT \
     COUNT(CASE WHEN state = 'pending' THEN 1 END), \
     MIN(CASE WHEN state = 'pending' THEN created_at END), \
     COUNT(CASE WHEN state = 'dead' THEN 1 END) \
     FROM oncely_outbox WHERE state <> 'published'";

/// [`STATS`] on SQLite, where published rows stay until the retention sweep: each figure a
/// subquery on the state's partial index (`oncely_outbox_pending_id`, `oncely_outbox_dead`),
/// so the read is of the pending and dead rows only. `WHERE state <> 'published'` can use
/// no partial index: SQLite scanned the whole table, every retained published row.
pub(crate) const STATS_BY_STATE: &str = "SELECT \
     (SELECT COUNT(*) FROM oncely_outbox WHERE state = 'pending'), \
     (SELECT MIN(created_at) FROM oncely_outbox WHERE state = 'pending'), \
     (SELECT COUNT(*) FROM oncely_outbox WHERE state = 'dead')";

/// A new row for [`OutboxBackend::enqueue`]: `event`, its headers already as JSON, enqueued
/// (and available) at `now` (Unix ms).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewRow<'a> {
    pub(crate) event: &'a OutboxEvent,
    pub(crate) headers: &'a str,
    pub(crate) now: i64,
}

/// Binds a [`NewRow`] to an insert whose placeholders are, in order, `message_id`, `topic`,
/// `partition_key`, `event_type`, `payload`, `headers` and the enqueue time.
macro_rules! bind_new_row {
    ($query:expr, $r:expr) => {
        $query
            .bind($r.event.message_id.to_string())
            .bind(&$r.event.topic)
            .bind(&$r.event.partition_key)
            .bind(&$r.event.event_type)
            .bind(&$r.event.payload)
            .bind($r.headers)
            .bind($r.now)
    };
}
pub(crate) use bind_new_row;

/// A claim of [`OutboxBackend::claim`]: up to `batch` claimable rows leased to `owner`
/// until `until`, at `now_ms` (Unix ms).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim<'a> {
    pub(crate) owner: &'a str,
    pub(crate) until: i64,
    pub(crate) now_ms: i64,
    pub(crate) batch: i64,
}

/// A claim of [`OutboxBackend::claim_held`]: up to `batch` partition heads at `now_ms`
/// (Unix ms) outside the id ranges `skip`; `keep`: the store keeps published rows.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) struct HeldClaim<'a> {
    pub(crate) batch: u32,
    pub(crate) now_ms: i64,
    pub(crate) skip: &'a [std::ops::RangeInclusive<i64>],
    pub(crate) keep: bool,
}

/// Rows `ids` leased by `owner`, published at `now_ms` (Unix ms); `keep`: record them (see
/// [`OutboxStore::keep_published`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Published<'a> {
    pub(crate) owner: &'a str,
    pub(crate) ids: &'a [i64],
    pub(crate) now_ms: i64,
    pub(crate) keep: bool,
}

/// One failed attempt of row `id` held by `owner`: `error` (already cut), the next attempt
/// at `retry_at_ms`, `dead` at `max` attempts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Failure<'a> {
    pub(crate) owner: &'a str,
    pub(crate) id: i64,
    pub(crate) error: &'a str,
    pub(crate) retry_at_ms: i64,
    pub(crate) max: i64,
}

/// What each backend implements for [`OutboxStore`] (in `sqlite/`, `postgres/`, `mysql/`
/// `outbox.rs`): the statements that really differ — the insert (`RETURNING`), the claims,
/// the publish. Statements whose text is the same everywhere (release, requeue, stats,
/// dead rows, a row by id, the reschedule where `UPDATE … RETURNING` exists) stay in
/// [`OutboxStore`], through [`crate::on_pool!`], [`crate::on_writer!`] and [`crate::sql_text`].
pub(crate) trait OutboxBackend: Store {
    /// The select list [`Row`] decodes ([`COLUMNS`]; MySQL reads its `_bin` columns
    /// through `CAST(… AS CHAR)`).
    const COLUMNS: &'static str = COLUMNS;

    /// Inserts `row` in `tx`; the row id.
    async fn enqueue(tx: &mut Self::Tx, row: NewRow<'_>) -> Result<i64, StoreError>;

    /// Leases up to `claim.batch` claimable rows (see [`OutboxStore::claim`]).
    async fn claim(&self, claim: Claim<'_>) -> Result<Vec<Row>, StoreError>;

    /// A claim held by an open transaction instead of a lease (see
    /// [`OutboxStore::claim_batch`]); `None` where the backend leases (the default).
    async fn claim_held(&self, held: HeldClaim<'_>) -> Result<Option<ClaimedBatch>, StoreError> {
        let _ = held;
        Ok(None)
    }

    /// Marks the rows of `published` that its owner still leases published; how many.
    async fn mark_published(&self, published: Published<'_>) -> Result<u64, StoreError>;

    /// The reschedule where [`reschedule_sql`] cannot serve (no `UPDATE … RETURNING`:
    /// MySQL): `Some` new state, `Some(None)` when the owner does not hold the row. `None`
    /// (the default): the backend returns rows from an `UPDATE`, [`reschedule_sql`] serves.
    async fn reschedule(&self, failure: Failure<'_>) -> Result<Option<Option<String>>, StoreError> {
        let _ = failure;
        Ok(None)
    }

    /// The published row `id` where published rows leave `oncely_outbox` (PostgreSQL:
    /// `oncely_outbox_published`); `None` by default (they stay in `oncely_outbox`).
    async fn get_published(&self, id: i64) -> Result<Option<Row>, StoreError> {
        let _ = id;
        Ok(None)
    }

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

/// [`OutboxBackend::COLUMNS`] of `store`'s backend.
pub(crate) fn columns_of<S: OutboxBackend>(_: &S) -> &'static str {
    S::COLUMNS
}

/// Rows marked `published` before the bound (`$1`), where published rows stay in
/// `oncely_outbox` (SQLite, MySQL).
pub(crate) const PUBLISHED_BEFORE: Sweep = Sweep {
    table: "oncely_outbox",
    filter: "state = 'published' AND published_at < $1",
    order_by: "published_at",
    index: "oncely_outbox_published",
};
