//! [`IdempotencyBackend`] on MySQL / MariaDB (`key` is a reserved word there).

use super::MySqlStore;
use crate::idempotency::{ClaimRow, IdempotencyBackend, RecordKey};

/// The counterpart of PostgreSQL's claim: a *session*-scoped named lock taken without
/// waiting (`GET_LOCK(name, 0)`: 1 when this session holds it, 0 when another does, NULL on
/// an error — counted as not held: 409, never an unprotected run), named after the database
/// and the key's hash (64 characters at most, as MySQL requires) so deployments in separate
/// databases of one server never contend, plus the committed record if there is one.
/// [`crate::MySqlTx`] releases the lock (`RELEASE_ALL_LOCKS()`) with the transaction's end,
/// before the connection goes back to the pool, or closes the session if the transaction
/// is dropped unfinished.
///
/// The lock is taken only when no record is found (`CASE` evaluates the branch it picks,
/// nothing else): a found record is the answer whatever the lock says
/// ([`crate::IdempotencyStore::reserve`]), so a replay from the store costs no named lock
/// and no contention with other replays of the same key.
///
/// As on PostgreSQL the read may precede the lock within the statement, so a record
/// committed by the previous holder in that instant can be missed: this request then runs,
/// its record insert meets the primary key (`ER_DUP_ENTRY`), it rolls back and replays the
/// winner — wasted work, never a second effect.
const CLAIM: &str = "SELECT CASE WHEN r.tenant IS NULL THEN COALESCE(GET_LOCK(CONCAT('oncely:', \
     LEFT(SHA2(CONCAT(COALESCE(DATABASE(), ''), ':', ?), 256), 56)), 0), 0) ELSE 0 END = 1 \
     AS claimed, \
     r.state, r.fingerprint, r.route_digest, r.headers_digest, r.response_status, \
     r.response_headers, r.response_body, r.created_at, r.completed_at, r.expires_at, r.lease_until, r.fence \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = ? AND r.operation = ? AND r.`key` = ?";

impl IdempotencyBackend for MySqlStore {
    const KEY_COLUMN: &'static str = "`key`";
    const SELECT_IDS: &'static str = "CAST(tenant AS CHAR) AS tenant, \
        CAST(operation AS CHAR) AS operation, CAST(`key` AS CHAR) AS record_key";
    const LOCK_CONFLICT_IS_DUPLICATE: bool = true;

    async fn claim(
        tx: &mut Self::Tx,
        at: RecordKey<'_>,
        lock_id: i64,
    ) -> Result<ClaimRow, sqlx::Error> {
        tx.took_named_lock();
        sqlx::query_as(CLAIM)
            .bind(format!("{lock_id:016x}"))
            .bind(at.tenant)
            .bind(at.operation)
            .bind(at.key)
            .fetch_one(&mut **tx)
            .await
    }
}
