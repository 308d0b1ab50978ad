//! [`IdempotencyBackend`] on PostgreSQL.

use super::PgStore;
use crate::idempotency::{ClaimRow, IdempotencyBackend, RecordKey};

/// The claim: whether this transaction holds the key (a transaction-scoped advisory
/// *try*-lock, XORed with a hash of the current schema so deployments in separate schemas
/// never contend), and the committed record if there is one. One row always (the
/// `LEFT JOIN` against a one-row relation).
const CLAIM: &str = "SELECT pg_try_advisory_xact_lock($4 # hashtextextended(current_schema(), 0)) \
     AS claimed, r.state, \
     r.fingerprint, r.route_digest, r.headers_digest, r.response_status, r.response_headers, r.response_body, \
     r.created_at, r.completed_at, r.expires_at, r.lease_until, r.fence \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = $1 AND r.operation = $2 AND r.key = $3";

impl IdempotencyBackend for PgStore {
    const KEY_COLUMN: &'static str = "key";
    const SELECT_IDS: &'static str = "tenant, operation, key AS record_key";
    const ASYNC_COMMIT_FROM: &'static str =
        " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit";

    async fn claim(
        tx: &mut Self::Tx,
        at: RecordKey<'_>,
        lock_id: i64,
    ) -> Result<ClaimRow, sqlx::Error> {
        sqlx::query_as(CLAIM)
            .bind(at.tenant)
            .bind(at.operation)
            .bind(at.key)
            .bind(lock_id)
            .fetch_one(&mut **tx)
            .await
    }
}
