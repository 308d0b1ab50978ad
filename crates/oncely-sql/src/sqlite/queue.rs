//! [`QueueBackend`] on SQLite: `RETURNING` on `UPDATE` / `DELETE`; every write on the
//! single writer connection, so concurrent claimers are serialised and never take the same
//! row.

use super::SqliteStore;
use crate::driver::Store;
use crate::queue::{subscribe_in, DeliveryClaim, DeliveryRow, QueueBackend, QueueRow};
use crate::StoreError;

impl QueueBackend for SqliteStore {
    async fn take(&self, topic: &str, max: i64) -> Result<Vec<QueueRow>, StoreError> {
        Ok(sqlx::query_as(
            "DELETE FROM oncely_queue WHERE id IN (SELECT id FROM oncely_queue \
             WHERE topic = $1 ORDER BY id LIMIT $2) RETURNING id, topic, message_id, \
             partition_key, event_type, headers, payload, enqueued_at",
        )
        .bind(topic)
        .bind(max)
        .fetch_all(self.writer())
        .await?)
    }

    async fn claim(&self, claim: DeliveryClaim<'_>) -> Result<Vec<DeliveryRow>, StoreError> {
        Ok(sqlx::query_as(
            "UPDATE oncely_deliveries SET lease_token = $3, locked_until = $4 \
             WHERE id IN (SELECT id FROM oncely_deliveries WHERE consumer = $1 \
             AND state = 'pending' AND available_at <= $5 \
             AND (locked_until IS NULL OR locked_until <= $5) ORDER BY id LIMIT $2) \
             RETURNING id, topic, message_id, partition_key, event_type, headers, \
             payload, enqueued_at, attempts",
        )
        .bind(claim.consumer)
        .bind(claim.max)
        .bind(claim.token)
        .bind(claim.until)
        .bind(claim.now)
        .fetch_all(self.writer())
        .await?)
    }

    async fn collect_fanned_out(&self, before_ms: i64, batch: i64) -> Result<u64, StoreError> {
        Ok(sqlx::query(
            "DELETE FROM oncely_queue WHERE id IN (SELECT q.id FROM oncely_queue q \
             WHERE q.enqueued_at < $1 AND EXISTS (SELECT 1 FROM oncely_subscriptions s \
             WHERE s.topic = q.topic) ORDER BY q.id LIMIT $2)",
        )
        .bind(before_ms)
        .bind(batch)
        .execute(self.writer())
        .await?
        .rows_affected())
    }

    async fn subscribe(&self, consumer: &str, topic: &str) -> Result<bool, StoreError> {
        // The single writer (`BEGIN IMMEDIATE`): no publish runs until this commits.
        subscribe_in(self.begin().await?, consumer, topic).await
    }
}
