//! [`IdempotencyBackend`] on SQLite.

use super::SqliteStore;
use crate::idempotency::{ClaimRow, IdempotencyBackend, RecordKey};

/// The write lock is already held (`BEGIN IMMEDIATE`), so the claim always holds.
const CLAIM: &str = "SELECT 1 AS claimed, r.state, \
     r.fingerprint, r.route_digest, r.headers_digest, r.response_status, r.response_headers, r.response_body, \
     r.created_at, r.completed_at, r.expires_at, r.lease_until, r.fence \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = $1 AND r.operation = $2 AND r.key = $3";

impl IdempotencyBackend for SqliteStore {
    const KEY_COLUMN: &'static str = "key";
    const SELECT_IDS: &'static str = "tenant, operation, key AS record_key";

    async fn claim(
        tx: &mut Self::Tx,
        at: RecordKey<'_>,
        _lock_id: i64,
    ) -> Result<ClaimRow, sqlx::Error> {
        sqlx::query_as(CLAIM)
            .bind(at.tenant)
            .bind(at.operation)
            .bind(at.key)
            .fetch_one(&mut **tx)
            .await
    }
}
