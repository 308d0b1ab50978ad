//! [`IdempotencyBackend`] on PostgreSQL.

use super::PgStore;
use crate::driver::Store;
use crate::idempotency::{
    bind_record, ClaimRow, IdempotencyBackend, NewRecord, RecordRow, INSERT_RECORD, RECORD_COLUMNS,
};

/// The claim: whether this transaction holds the key (a transaction-scoped advisory
/// *try*-lock, XORed with a hash of the current schema so deployments in separate schemas
/// never contend), and the committed record if there is one. One row always (the
/// `LEFT JOIN` against a one-row relation).
const CLAIM: &str = "SELECT pg_try_advisory_xact_lock($4 # hashtextextended(current_schema(), 0)) \
     AS claimed, r.state, \
     r.fingerprint, r.route_digest, r.response_status, r.response_headers, r.response_body, \
     r.created_at, r.completed_at, r.expires_at, r.lease_until, r.fence \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = $1 AND r.operation = $2 AND r.key = $3";

impl IdempotencyBackend for PgStore {
    const KEY_COLUMN: &'static str = "key";
    const SELECT_IDS: &'static str = "tenant, operation, key AS record_key";

    async fn claim(
        tx: &mut Self::Tx,
        tenant: &str,
        operation: &str,
        key: &str,
        lock_id: i64,
    ) -> Result<ClaimRow, sqlx::Error> {
        sqlx::query_as(CLAIM)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(lock_id)
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
        .fetch_optional(self.pool())
        .await
    }
}
