//! [`QueueBackend`] on MySQL / MariaDB: no `UPDATE/DELETE … RETURNING` there, so
//! a claim or a take is a locking select with `FOR UPDATE SKIP LOCKED` (MySQL 8.0+,
//! MariaDB 10.6+), the write, and a read of the rows, in one transaction; binary-collated
//! text columns (`topic`, `partition_key`) are read through `CAST(… AS CHAR)`, which sqlx
//! decodes as text.

use sqlx::pool::PoolConnection;
use sqlx::{Executor as _, MySql, MySqlConnection};

use super::{bind_ids, bind_ids_as, id_list, MySqlStore};
use crate::dialect::question_marks;
use crate::queue::{DeliveryClaim, DeliveryRow, QueueBackend, QueueRow, BACKLOG};
use crate::{Backend, StoreError};

const QUEUE_COLUMNS: &str = "id, CAST(topic AS CHAR) AS topic, message_id, \
     CAST(partition_key AS CHAR) AS partition_key, event_type, headers, payload, enqueued_at";

const DELIVERY_COLUMNS: &str = "id, CAST(topic AS CHAR) AS topic, message_id, \
     CAST(partition_key AS CHAR) AS partition_key, event_type, headers, payload, enqueued_at, \
     attempts";

impl QueueBackend for MySqlStore {
    async fn take(&self, topic: &str, max: i64) -> Result<Vec<QueueRow>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM oncely_queue WHERE topic = ? ORDER BY id LIMIT ? \
             FOR UPDATE SKIP LOCKED",
        )
        .bind(topic)
        .bind(max)
        .fetch_all(&mut *tx)
        .await?;
        let Some(set) = id_list(&ids) else {
            tx.commit().await?;
            return Ok(Vec::new());
        };
        let select = format!("SELECT {QUEUE_COLUMNS} FROM oncely_queue WHERE id IN ({set})");
        let rows: Vec<QueueRow> = bind_ids_as(sqlx::query_as(&select), &ids)
            .fetch_all(&mut *tx)
            .await?;
        let delete = format!("DELETE FROM oncely_queue WHERE id IN ({set})");
        bind_ids(sqlx::query(&delete), &ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows)
    }

    async fn claim(&self, claim: DeliveryClaim<'_>) -> Result<Vec<DeliveryRow>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM oncely_deliveries WHERE consumer = ? AND state = 'pending' \
             AND available_at <= ? AND (locked_until IS NULL OR locked_until <= ?) \
             ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
        )
        .bind(claim.consumer)
        .bind(claim.now)
        .bind(claim.now)
        .bind(claim.max)
        .fetch_all(&mut *tx)
        .await?;
        let Some(set) = id_list(&ids) else {
            tx.commit().await?;
            return Ok(Vec::new());
        };
        let update = format!(
            "UPDATE oncely_deliveries SET lease_token = ?, locked_until = ? WHERE id IN ({set})"
        );
        let update = sqlx::query(&update).bind(claim.token).bind(claim.until);
        bind_ids(update, &ids).execute(&mut *tx).await?;
        let select = format!(
            "SELECT {DELIVERY_COLUMNS} FROM oncely_deliveries WHERE lease_token = ? \
             AND id IN ({set})"
        );
        let select = sqlx::query_as(&select).bind(claim.token);
        let rows: Vec<DeliveryRow> = bind_ids_as(select, &ids).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(rows)
    }

    async fn collect_fanned_out(&self, before_ms: i64, batch: i64) -> Result<u64, StoreError> {
        Ok(sqlx::query(
            "DELETE FROM oncely_queue WHERE enqueued_at < ? AND EXISTS (SELECT 1 FROM \
             oncely_subscriptions s WHERE s.topic = oncely_queue.topic) ORDER BY id LIMIT ?",
        )
        .bind(before_ms)
        .bind(batch)
        .execute(self.pool())
        .await?
        .rows_affected())
    }

    async fn subscribe(&self, consumer: &str, topic: &str) -> Result<bool, StoreError> {
        let mut conn = TableLocks(Some(self.pool().acquire().await?));
        let new = subscribe_locked(conn.connection(), consumer, topic).await?;
        conn.release().await?;
        Ok(new)
    }
}

/// A session under `LOCK TABLES` (autocommit off until [`TableLocks::release`]). Dropped
/// unreleased (an error, a cancelled future), it closes the session, which makes the
/// server roll back and free the locks, rather than hand it back to the pool locked.
struct TableLocks(Option<PoolConnection<MySql>>);

impl TableLocks {
    fn connection(&mut self) -> &mut MySqlConnection {
        self.0.as_mut().expect("TableLocks used after release")
    }

    async fn release(mut self) -> Result<(), sqlx::Error> {
        let mut conn = self.0.take().expect("released once");
        let done = (&mut *conn)
            .execute("COMMIT; UNLOCK TABLES; SET autocommit = 1")
            .await;
        if done.is_err() {
            conn.close_on_drop();
        }
        done.map(drop)
    }
}

impl Drop for TableLocks {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// Subscribes under table locks. A `READ` lock on the queue waits for the publishing
/// transactions in flight (they hold a shared-write metadata lock on it until they commit)
/// and holds new ones back until the locks go: a message is either in the queue when the
/// backlog is copied, or fanned out by a trigger that sees the subscription — never neither.
/// (InnoDB row locks cannot say this under `READ COMMITTED`: the trigger reads the
/// subscriptions without locking.) `LOCK TABLES` commits any open transaction, hence
/// autocommit off rather than `BEGIN`.
async fn subscribe_locked(
    conn: &mut MySqlConnection,
    consumer: &str,
    topic: &str,
) -> Result<bool, StoreError> {
    conn.execute(
        "SET autocommit = 0; LOCK TABLES oncely_queue READ, oncely_subscriptions WRITE, \
         oncely_deliveries WRITE",
    )
    .await?;
    let inserted = sqlx::query("INSERT INTO oncely_subscriptions (consumer, topic) VALUES (?, ?)")
        .bind(consumer)
        .bind(topic)
        .execute(&mut *conn)
        .await
        .map(|r| r.rows_affected());
    let new = Backend::MySql.duplicate_ignored(inserted)?;
    if new {
        sqlx::query(&question_marks(&BACKLOG.replacen(
            "INSERT INTO",
            "INSERT IGNORE INTO",
            1,
        )))
        .bind(consumer)
        .bind(topic)
        .execute(&mut *conn)
        .await?;
    }
    Ok(new)
}
