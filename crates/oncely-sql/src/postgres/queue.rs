//! [`QueueBackend`] on PostgreSQL: takes, claims and sweeps that lock with `FOR UPDATE SKIP
//! LOCKED` in a CTE (which runs once: an `IN (…)` subquery may be rescanned, and with SKIP
//! LOCKED a rescan takes other rows) and address the chosen rows by TID, under a pinned
//! plan ([`crate::PINNED_PLAN`]).

use super::PgStore;
use crate::driver::Store;
use crate::queue::{subscribe_in, DeliveryClaim, DeliveryRow, QueueBackend, QueueRow};
use crate::{execute_pinned, fetch_all_pinned, query, StoreError};

impl QueueBackend for PgStore {
    async fn take(&self, topic: &str, max: i64) -> Result<Vec<QueueRow>, StoreError> {
        Ok(fetch_all_pinned(
            self.pool(),
            sqlx::query_as(
                "WITH c AS (SELECT ctid FROM oncely_queue WHERE topic = $1 ORDER BY id \
                 LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 DELETE FROM oncely_queue q \
                 WHERE q.ctid = ANY (ARRAY(SELECT c.ctid FROM c)) \
                 RETURNING q.id, q.topic, q.message_id, q.partition_key, q.event_type, \
                 q.headers, q.payload, q.enqueued_at",
            )
            .bind(topic)
            .bind(max),
        )
        .await?)
    }

    async fn claim(&self, claim: DeliveryClaim<'_>) -> Result<Vec<DeliveryRow>, StoreError> {
        Ok(fetch_all_pinned(
            self.pool(),
            sqlx::query_as(
                "WITH c AS MATERIALIZED (SELECT ctid FROM oncely_deliveries \
                 WHERE consumer = $1 AND state = 'pending' AND available_at <= $5 \
                 AND (locked_until IS NULL OR locked_until <= $5) ORDER BY id \
                 LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 UPDATE oncely_deliveries d SET lease_token = $3, locked_until = $4 \
                 WHERE d.ctid = ANY (ARRAY(SELECT c.ctid FROM c)) \
                 RETURNING d.id, d.topic, d.message_id, d.partition_key, d.event_type, \
                 d.headers, d.payload, d.enqueued_at, d.attempts",
            )
            .bind(claim.consumer)
            .bind(claim.max)
            .bind(claim.token)
            .bind(claim.until)
            .bind(claim.now),
        )
        .await?)
    }

    async fn collect_fanned_out(&self, before_ms: i64, batch: i64) -> Result<u64, StoreError> {
        // The locked batch is a materialised CTE, so the `LIMIT` holds.
        Ok(execute_pinned(
            self.pool(),
            sqlx::query(
                "WITH doomed AS MATERIALIZED (SELECT q.ctid FROM oncely_queue q \
                 WHERE q.enqueued_at < $1 AND EXISTS (SELECT 1 FROM \
                 oncely_subscriptions s WHERE s.topic = q.topic) ORDER BY q.id \
                 LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 DELETE FROM oncely_queue q \
                 WHERE q.ctid = ANY (ARRAY(SELECT d.ctid FROM doomed d))",
            )
            .bind(before_ms)
            .bind(batch),
        )
        .await?)
    }

    async fn subscribe(&self, consumer: &str, topic: &str) -> Result<bool, StoreError> {
        let mut tx = self.begin().await?;
        // Publishing transactions hold ROW EXCLUSIVE on the queue until they commit. SHARE
        // waits for those in flight and holds new ones back until this commits: a message
        // is either in the queue when the backlog is copied, or fanned out by a trigger
        // that sees the subscription — never neither.
        tx.execute(query("LOCK TABLE oncely_queue IN SHARE MODE"))
            .await?;
        subscribe_in(tx, consumer, topic).await
    }
}
