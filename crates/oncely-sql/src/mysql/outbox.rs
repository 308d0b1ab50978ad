//! [`OutboxBackend`] on MySQL / MariaDB: no `UPDATE … RETURNING`, no `= ANY($1)`, `?`
//! placeholders bound by position, `_bin` columns selected through `CAST(… AS CHAR)` (sqlx
//! decodes a binary-collated column as bytes, not text).

use sqlx::mysql::MySqlPool;

use super::MySqlStore;
use crate::dialect::in_list;
use crate::outbox::driver::{OutboxBackend, Row};
use crate::outbox::types::OutboxEvent;
use crate::StoreError;

impl OutboxBackend for MySqlStore {
    /// No `INSERT … RETURNING` on MySQL: the id is the connection's last insert id.
    async fn enqueue(
        tx: &mut Self::Tx,
        event: &OutboxEvent,
        headers: &str,
        now: i64,
    ) -> Result<i64, StoreError> {
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
        .bind(headers)
        .bind(now)
        .bind(now)
        .execute(&mut **tx)
        .await?
        .last_insert_id();
        i64::try_from(id).map_err(|_| StoreError::Corrupt(format!("outbox id {id}")))
    }

    async fn claim(
        &self,
        owner: &str,
        until: i64,
        now_ms: i64,
        batch: i64,
    ) -> Result<Vec<Row>, StoreError> {
        claim(self.pool(), owner, until, now_ms, batch).await
    }

    async fn mark_published(
        &self,
        owner: &str,
        ids: &[i64],
        now_ms: i64,
        _keep: bool,
    ) -> Result<u64, StoreError> {
        mark_published(self.pool(), owner, ids, now_ms).await
    }

    async fn reschedule(
        &self,
        owner: &str,
        id: i64,
        error: &str,
        retry_at_ms: i64,
        max: i64,
    ) -> Result<Option<String>, StoreError> {
        reschedule(self.pool(), owner, id, error, retry_at_ms, max).await
    }

    async fn stats(&self) -> Result<(i64, Option<i64>, i64), StoreError> {
        Ok(sqlx::query_as(STATS).fetch_one(self.pool()).await?)
    }

    async fn get(&self, id: i64) -> Result<Option<Row>, StoreError> {
        Ok(
            sqlx::query_as(&format!("SELECT {COLUMNS} FROM oncely_outbox WHERE id = ?"))
                .bind(id)
                .fetch_optional(self.pool())
                .await?,
        )
    }

    async fn dead(&self, after_id: i64, limit: i64) -> Result<Vec<Row>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM oncely_outbox WHERE state = 'dead' AND id > ? \
             ORDER BY id LIMIT ?"
        ))
        .bind(after_id)
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
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
async fn claim(
    pool: &MySqlPool,
    owner: &str,
    until: i64,
    now_ms: i64,
    batch: i64,
) -> Result<Vec<Row>, StoreError> {
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
    if ids.is_empty() {
        tx.commit().await?;
        return Ok(Vec::new());
    }
    let set = in_list(ids.len());
    let update_sql = format!(
        "UPDATE oncely_outbox SET locked_by = ?, locked_until = ? \
         WHERE state = 'pending' AND (locked_until IS NULL OR locked_until < ?) AND id IN ({set})"
    );
    let mut update = sqlx::query(&update_sql)
        .bind(owner)
        .bind(until)
        .bind(now_ms);
    for id in &ids {
        update = update.bind(id);
    }
    update.execute(&mut *tx).await?;
    let select = format!(
        "SELECT {COLUMNS} FROM oncely_outbox WHERE locked_by = ? AND locked_until = ? \
         AND id IN ({set}) ORDER BY id"
    );
    let mut q = sqlx::query_as(&select).bind(owner).bind(until);
    for id in &ids {
        q = q.bind(id);
    }
    let rows: Vec<Row> = q.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(rows)
}

/// `UPDATE … WHERE id IN (…)` in chunks of 1,000 ids.
async fn mark_published(
    pool: &MySqlPool,
    owner: &str,
    ids: &[i64],
    now_ms: i64,
) -> Result<u64, StoreError> {
    let mut n = 0;
    for chunk in ids.chunks(1000) {
        let sql = format!(
            "UPDATE oncely_outbox SET state = 'published', published_at = ?, \
             locked_by = NULL, locked_until = NULL \
             WHERE locked_by = ? AND state = 'pending' AND id IN ({})",
            in_list(chunk.len())
        );
        let mut q = sqlx::query(&sql).bind(now_ms).bind(owner);
        for id in chunk {
            q = q.bind(id);
        }
        n += q.execute(pool).await?.rows_affected();
    }
    Ok(n)
}

/// The reschedule as an `UPDATE` and a read of the new state in one transaction. MySQL
/// evaluates single-table `SET` assignments left to right, each seeing the columns
/// assigned before it, so `state` is computed *before* `attempts` is incremented.
async fn reschedule(
    pool: &MySqlPool,
    owner: &str,
    id: i64,
    error: &str,
    retry_at_ms: i64,
    max: i64,
) -> Result<Option<String>, StoreError> {
    let mut tx = pool.begin().await?;
    let n = sqlx::query(
        "UPDATE oncely_outbox SET \
         state = CASE WHEN attempts + 1 >= ? THEN 'dead' ELSE 'pending' END, \
         attempts = attempts + 1, last_error = ?, \
         locked_by = NULL, locked_until = NULL, available_at = ? \
         WHERE id = ? AND locked_by = ? AND state = 'pending'",
    )
    .bind(max)
    .bind(error)
    .bind(retry_at_ms)
    .bind(id)
    .bind(owner)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let state = if n == 1 {
        sqlx::query_scalar("SELECT state FROM oncely_outbox WHERE id = ?")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
    } else {
        None
    };
    tx.commit().await?;
    Ok(state)
}

/// Pending and dead counts: `SUM` is `DECIMAL` on MySQL, so it is cast back to an integer.
const STATS: &str = "SELECT \
     CAST(COALESCE(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END), 0) AS SIGNED), \
     MIN(CASE WHEN state = 'pending' THEN created_at END), \
     CAST(COALESCE(SUM(CASE WHEN state = 'dead' THEN 1 ELSE 0 END), 0) AS SIGNED) \
     FROM oncely_outbox WHERE state <> 'published'";
