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
/// attempt limit. Binds `$1` error, `$2` available_at, `$3` attempt limit.
pub(crate) const RESCHEDULE_SET: &str =
    "attempts = attempts + 1, last_error = $1, available_at = $2, \
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

/// Rows marked `published` before the bound (`$1`), where published rows stay in
/// `oncely_outbox` (SQLite, MySQL).
pub(crate) const PUBLISHED_BEFORE: Sweep = Sweep {
    table: "oncely_outbox",
    filter: "state = 'published' AND published_at < $1",
    order_by: "published_at",
};
