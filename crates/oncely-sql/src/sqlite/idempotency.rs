//! [`IdempotencyBackend`] on SQLite.

use super::SqliteStore;
use crate::driver::Store;
use crate::idempotency::{
    bind_record, ClaimRow, IdempotencyBackend, NewRecord, RecordRow, INSERT_RECORD, RECORD_COLUMNS,
};

/// The write lock is already held (`BEGIN IMMEDIATE`), so the claim always holds.
const CLAIM: &str = "SELECT 1 AS claimed, r.state, \
     r.fingerprint, r.route_digest, r.response_status, r.response_headers, r.response_body, \
     r.created_at, r.completed_at, r.expires_at, r.lease_until, r.fence \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = $1 AND r.operation = $2 AND r.key = $3";

impl IdempotencyBackend for SqliteStore {
    const KEY_COLUMN: &'static str = "key";
    const SELECT_IDS: &'static str = "tenant, operation, key AS record_key";

    async fn claim(
        tx: &mut Self::Tx,
        tenant: &str,
        operation: &str,
        key: &str,
        _lock_id: i64,
    ) -> Result<ClaimRow, sqlx::Error> {
        sqlx::query_as(CLAIM)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .fetch_one(&mut **tx)
            .await
    }

    async fn insert_record(tx: &mut Self::Tx, record: &NewRecord<'_>) -> Result<bool, sqlx::Error> {
        let sql = Self::BACKEND.insert_ignoring_duplicate_sql(INSERT_RECORD, "");
        let n = bind_record!(sqlx::query(&sql), record)
            .execute(&mut **tx)
            .await
            .map(|r| r.rows_affected());
        Self::BACKEND.duplicate_ignored(n)
    }

    async fn lookup(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<RecordRow>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT {RECORD_COLUMNS} FROM oncely_idempotency \
             WHERE tenant = $1 AND operation = $2 AND key = $3"
        ))
        .bind(tenant)
        .bind(operation)
        .bind(key)
        .fetch_optional(self.reader())
        .await
    }
}
