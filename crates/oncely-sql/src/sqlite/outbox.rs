//! [`OutboxBackend`] on SQLite: one writer, so each claim runs alone and leases its rows.

use super::SqliteStore;
use crate::outbox::driver::{bind_new_row, Claim, NewRow, OutboxBackend, Published, Row, COLUMNS};
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
    async fn enqueue(tx: &mut Self::Tx, row: NewRow<'_>) -> Result<i64, StoreError> {
        let insert = sqlx::query_scalar(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, payload, \
             headers, created_at, available_at, attempts, state) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7, 0, 'pending') RETURNING id",
        );
        Ok(bind_new_row!(insert, row).fetch_one(&mut **tx).await?)
    }

    /// One writer: the statement runs alone, the subquery once.
    async fn claim(&self, claim: Claim<'_>) -> Result<Vec<Row>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "UPDATE oncely_outbox SET locked_by = $1, locked_until = $2 \
             WHERE id IN ({CANDIDATES}) RETURNING {COLUMNS}"
        ))
        .bind(claim.owner)
        .bind(claim.until)
        .bind(claim.now_ms)
        .bind(claim.batch)
        .fetch_all(self.writer())
        .await?)
    }

    async fn mark_published(&self, published: Published<'_>) -> Result<u64, StoreError> {
        let list = serde_json::to_string(published.ids)
            .map_err(|e| StoreError::Corrupt(format!("id list: {e}")))?;
        Ok(sqlx::query(
            "UPDATE oncely_outbox SET state = 'published', published_at = $1, \
             locked_by = NULL, locked_until = NULL \
             WHERE id IN (SELECT value FROM json_each($2)) AND locked_by = $3 \
             AND state = 'pending'",
        )
        .bind(published.now_ms)
        .bind(list)
        .bind(published.owner)
        .execute(self.writer())
        .await?
        .rows_affected())
    }
}
