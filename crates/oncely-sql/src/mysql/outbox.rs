//! [`OutboxBackend`] on MySQL / MariaDB: no `UPDATE … RETURNING`, no `= ANY($1)`, `?`
//! placeholders bound by position, `_bin` columns selected through `CAST(… AS CHAR)` (sqlx
//! decodes a binary-collated column as bytes, not text).

use sqlx::mysql::MySqlPool;

use super::{bind_ids, bind_ids_as, id_list, MySqlStore};
use crate::dialect::{in_list, question_marks};
use crate::outbox::driver::{
    bind_new_row, reschedule_update, Claim, Failure, NewRow, OutboxBackend, Published, Row,
};
use crate::StoreError;

impl OutboxBackend for MySqlStore {
    const COLUMNS: &'static str = COLUMNS;

    /// No `INSERT … RETURNING` on MySQL: the id is the connection's last insert id.
    async fn enqueue(tx: &mut Self::Tx, row: NewRow<'_>) -> Result<i64, StoreError> {
        let insert = sqlx::query(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
             payload, headers, created_at, available_at, attempts, state) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, 'pending')",
        );
        let id = bind_new_row!(insert, row)
            .bind(row.now)
            .execute(&mut **tx)
            .await?
            .last_insert_id();
        i64::try_from(id).map_err(|_| StoreError::Corrupt(format!("outbox id {id}")))
    }

    async fn claim(&self, claim: Claim<'_>) -> Result<Vec<Row>, StoreError> {
        claim_rows(self.pool(), claim).await
    }

    async fn mark_published(&self, published: Published<'_>) -> Result<u64, StoreError> {
        mark_published(self.pool(), published).await
    }

    async fn reschedule(&self, failure: Failure<'_>) -> Result<Option<Option<String>>, StoreError> {
        reschedule(self.pool(), failure).await.map(Some)
    }
}

/// The outbox columns as [`Row`] decodes them; `topic` and `partition_key` are
/// `utf8mb4_bin` (compared byte for byte like on the other backends).
const COLUMNS: &str = "id, message_id, CAST(topic AS CHAR) AS topic, \
     CAST(partition_key AS CHAR) AS partition_key, event_type, payload, headers, \
     created_at, available_at, attempts, last_error, state, published_at";

/// Claims like the PostgreSQL statement, in one transaction of three statements: lock the
/// candidates with `FOR UPDATE SKIP LOCKED` (MySQL 8.0+, MariaDB 10.6+), lease them, read
/// them back (no `UPDATE … RETURNING` on MySQL). The lease re-checks the row the lock
/// returned, as on PostgreSQL.
async fn claim_rows(pool: &MySqlPool, claim: Claim<'_>) -> Result<Vec<Row>, StoreError> {
    let Claim {
        owner,
        until,
        now_ms,
        batch,
    } = claim;
    let mut tx = pool.begin().await?;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT o.id FROM oncely_outbox o \
         WHERE o.state = 'pending' AND o.available_at <= ? \
         AND (o.locked_until IS NULL OR o.locked_until < ?) \
         AND NOT EXISTS (SELECT 1 FROM oncely_outbox p \
           WHERE p.partition_key = o.partition_key AND p.state = 'pending' \
           AND (p.id < o.id OR p.locked_until >= ?)) \
         ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED",
    )
    .bind(now_ms)
    .bind(now_ms)
    .bind(now_ms)
    .bind(batch)
    .fetch_all(&mut *tx)
    .await?;
    let Some(set) = id_list(&ids) else {
        tx.commit().await?;
        return Ok(Vec::new());
    };
    let update_sql = format!(
        "UPDATE oncely_outbox SET locked_by = ?, locked_until = ? \
         WHERE state = 'pending' AND (locked_until IS NULL OR locked_until < ?) AND id IN ({set})"
    );
    let update = sqlx::query(&update_sql)
        .bind(owner)
        .bind(until)
        .bind(now_ms);
    bind_ids(update, &ids).execute(&mut *tx).await?;
    let select = format!(
        "SELECT {COLUMNS} FROM oncely_outbox WHERE locked_by = ? AND locked_until = ? \
         AND id IN ({set}) ORDER BY id"
    );
    let select = sqlx::query_as(&select).bind(owner).bind(until);
    let rows: Vec<Row> = bind_ids_as(select, &ids).fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(rows)
}

/// `UPDATE … WHERE id IN (…)` in chunks of 1,000 ids.
async fn mark_published(pool: &MySqlPool, published: Published<'_>) -> Result<u64, StoreError> {
    let mut n = 0;
    for chunk in published.ids.chunks(1000) {
        let sql = format!(
            "UPDATE oncely_outbox SET state = 'published', published_at = ?, \
             locked_by = NULL, locked_until = NULL \
             WHERE locked_by = ? AND state = 'pending' AND id IN ({})",
            in_list(chunk.len())
        );
        let update = sqlx::query(&sql)
            .bind(published.now_ms)
            .bind(published.owner);
        n += bind_ids(update, chunk).execute(pool).await?.rows_affected();
    }
    Ok(n)
}

/// The reschedule as [`reschedule_update`] and a read of the new state in one transaction
/// (no `UPDATE … RETURNING` on MySQL).
async fn reschedule(pool: &MySqlPool, failure: Failure<'_>) -> Result<Option<String>, StoreError> {
    let mut tx = pool.begin().await?;
    let n = sqlx::query(&question_marks(&reschedule_update()))
        .bind(failure.max)
        .bind(failure.error)
        .bind(failure.retry_at_ms)
        .bind(failure.id)
        .bind(failure.owner)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    let state = if n == 1 {
        sqlx::query_scalar("SELECT state FROM oncely_outbox WHERE id = ?")
            .bind(failure.id)
            .fetch_optional(&mut *tx)
            .await?
    } else {
        None
    };
    tx.commit().await?;
    Ok(state)
}
