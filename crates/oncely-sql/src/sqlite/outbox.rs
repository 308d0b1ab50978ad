//! [`OutboxBackend`] on SQLite: one writer, so each claim runs alone and leases its rows.

use super::SqliteStore;
use crate::outbox::driver::{reschedule_sql, OutboxBackend, Row, COLUMNS, STATS};
use crate::outbox::types::OutboxEvent;
use crate::StoreError;

/// Claim candidates: pending, available, unleased heads of partitions with nothing leased
/// (`$3` now, `$4` the batch size).
const CANDIDATES: &str = "SELECT o.id FROM oncely_outbox o \
     WHERE o.state = 'pending' AND o.available_at <= $3 \
     AND (o.locked_until IS NULL OR o.locked_until < $3) \
     AND NOT EXISTS (SELECT 1 FROM oncely_outbox p \
       WHERE p.partition_key = o.partition_key AND p.state = 'pending' \
       AND (p.id < o.id OR p.locked_until >= $3)) \
     ORDER BY o.id LIMIT $4";

impl OutboxBackend for SqliteStore {
    async fn enqueue(
        tx: &mut Self::Tx,
        event: &OutboxEvent,
        headers: &str,
        now: i64,
    ) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, payload, \
             headers, created_at, available_at, attempts, state) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7, 0, 'pending') RETURNING id",
        )
        .bind(event.message_id.to_string())
        .bind(&event.topic)
        .bind(&event.partition_key)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(headers)
        .bind(now)
        .fetch_one(&mut **tx)
        .await?)
    }

    /// One writer: the statement runs alone, the subquery once.
    async fn claim(
        &self,
        owner: &str,
        until: i64,
        now_ms: i64,
        batch: i64,
    ) -> Result<Vec<Row>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "UPDATE oncely_outbox SET locked_by = $1, locked_until = $2 \
             WHERE id IN ({CANDIDATES}) RETURNING {COLUMNS}"
        ))
        .bind(owner)
        .bind(until)
        .bind(now_ms)
        .bind(batch)
        .fetch_all(self.writer())
        .await?)
    }

    async fn mark_published(
        &self,
        owner: &str,
        ids: &[i64],
        now_ms: i64,
        _keep: bool,
    ) -> Result<u64, StoreError> {
        let list =
            serde_json::to_string(ids).map_err(|e| StoreError::Corrupt(format!("id list: {e}")))?;
        Ok(sqlx::query(
            "UPDATE oncely_outbox SET state = 'published', published_at = $1, \
             locked_by = NULL, locked_until = NULL \
             WHERE id IN (SELECT value FROM json_each($2)) AND locked_by = $3 \
             AND state = 'pending'",
        )
        .bind(now_ms)
        .bind(list)
        .bind(owner)
        .execute(self.writer())
        .await?
        .rows_affected())
    }

    async fn reschedule(
        &self,
        owner: &str,
        id: i64,
        error: &str,
        retry_at_ms: i64,
        max: i64,
    ) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar(&reschedule_sql())
            .bind(error)
            .bind(retry_at_ms)
            .bind(max)
            .bind(id)
            .bind(owner)
            .fetch_optional(self.writer())
            .await?)
    }

    async fn stats(&self) -> Result<(i64, Option<i64>, i64), StoreError> {
        Ok(sqlx::query_as(STATS).fetch_one(self.reader()).await?)
    }

    async fn get(&self, id: i64) -> Result<Option<Row>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM oncely_outbox WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(self.reader())
        .await?)
    }

    async fn dead(&self, after_id: i64, limit: i64) -> Result<Vec<Row>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM oncely_outbox WHERE state = 'dead' AND id > $1 \
             ORDER BY id LIMIT $2"
        ))
        .bind(after_id)
        .bind(limit)
        .fetch_all(self.reader())
        .await?)
    }
}
