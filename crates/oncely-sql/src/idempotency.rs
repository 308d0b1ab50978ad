use std::time::Duration;

use oncely_core::{Fingerprint, IdempotencyKey, RecordState, Scope, StoredResponse};
use sha2::{Digest, Sha256};

use crate::{on_tx, Database, StoreError, Tx};

/// The idempotency store over table `oncely_idempotency`, primary key
/// `(tenant, operation, key)` (DESIGN.md "Idempotency record").
///
/// Reservation is an `INSERT … ON CONFLICT DO NOTHING` under that primary key, inside the
/// caller's transaction — never SELECT-then-INSERT. Cheap to clone.
#[derive(Debug, Clone)]
pub struct IdempotencyStore {
    db: Database,
    retention: Duration,
}

/// What [`IdempotencyStore::reserve`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Reservation {
    /// This transaction holds the key; it alone may complete it. No other transaction can
    /// see a record until this one commits.
    Reserved(ReservationToken),
    /// A committed record with this key exists; compare its fingerprint before using it.
    Existing(Record),
    /// Another transaction holds this key and has not committed: the operation is in
    /// flight. Nothing was written or waited for.
    InFlight,
}

/// Proof that the holder reserved a record: required to complete it, not `Clone`, so a
/// request that did not reserve a record cannot alter it.
#[derive(Debug)]
pub struct ReservationToken {
    tenant: String,
    operation: String,
    key: String,
    owner: String,
    fingerprint: Fingerprint,
    created_at: i64,
}

impl ReservationToken {
    /// A value unique to this reservation (`owner` column; also usable as a fence).
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

/// A stored idempotency record.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Record {
    /// Current state.
    pub state: RecordState,
    /// The reserving request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The stored answer, once the state is final.
    pub response: Option<StoredResponse>,
    /// Reservation time, Unix ms.
    pub created_at: i64,
    /// Completion time, Unix ms.
    pub completed_at: Option<i64>,
    /// Time after which the collector may delete the record, Unix ms.
    pub expires_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct RecordRow {
    state: String,
    fingerprint: Vec<u8>,
    route_digest: Vec<u8>,
    response_status: Option<i32>,
    response_headers: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: i64,
    completed_at: Option<i64>,
    expires_at: Option<i64>,
}

const SELECT_RECORD: &str = "SELECT state, fingerprint, route_digest, response_status, \
     response_headers, response_body, created_at, completed_at, expires_at \
     FROM oncely_idempotency WHERE tenant = $1 AND operation = $2 AND key = $3";

/// `SELECT` of the claim: whether this transaction holds the key, and the committed record
/// if there is one. One row always (the `LEFT JOIN` against a one-row relation).
const CLAIM_POSTGRES: &str =
    "SELECT pg_try_advisory_xact_lock($4 # hashtextextended(current_schema(), 0)) \
     AS claimed, r.state, \
     r.fingerprint, r.route_digest, r.response_status, r.response_headers, r.response_body, \
     r.created_at, r.completed_at, r.expires_at \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = $1 AND r.operation = $2 AND r.key = $3";

/// SQLite: the write lock is already held (`BEGIN IMMEDIATE`), so the claim always holds.
const CLAIM_SQLITE: &str = "SELECT 1 AS claimed, r.state, \
     r.fingerprint, r.route_digest, r.response_status, r.response_headers, r.response_body, \
     r.created_at, r.completed_at, r.expires_at \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = $1 AND r.operation = $2 AND r.key = $3";

/// The record, written once at completion; a conflict on the primary key inserts nothing.
const INSERT_RECORD: &str = "INSERT INTO oncely_idempotency (tenant, operation, key, \
     fingerprint, route_digest, state, owner, response_status, response_headers, \
     response_body, created_at, completed_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT DO NOTHING";

/// MySQL / MariaDB: a plain insert; `ER_DUP_ENTRY` (1062) tells the conflict.
const INSERT_RECORD_MYSQL: &str = "INSERT INTO oncely_idempotency (tenant, operation, `key`, \
     fingerprint, route_digest, state, owner, response_status, response_headers, \
     response_body, created_at, completed_at, expires_at) \
     VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

/// MySQL / MariaDB spelling of [`SELECT_RECORD`] (`key` is a reserved word there).
const SELECT_RECORD_MYSQL: &str = "SELECT state, fingerprint, route_digest, response_status, \
     response_headers, response_body, created_at, completed_at, expires_at \
     FROM oncely_idempotency WHERE tenant = ? AND operation = ? AND `key` = ?";

/// MySQL / MariaDB claim, the counterpart of [`CLAIM_POSTGRES`]: a *session*-scoped named
/// lock taken without waiting (`GET_LOCK(name, 0)`: 1 when this session holds it, 0 when
/// another does, NULL on an error — counted as not held: 409, never an unprotected run), named after the database and the key's hash (64 characters at most, as
/// MySQL requires) so deployments in separate databases of one server never contend, plus
/// the committed record if there is one. [`crate::MySqlTx`] releases the lock
/// (`RELEASE_ALL_LOCKS()`) with the transaction's end, before the connection goes back to
/// the pool, or closes the session if the transaction is dropped unfinished.
///
/// As on PostgreSQL the read may precede the lock within the statement, so a record
/// committed by the previous holder in that instant can be missed: this request then runs,
/// its record insert meets the primary key (`ER_DUP_ENTRY`), it rolls back and replays the
/// winner — wasted work, never a second effect.
const CLAIM_MYSQL: &str = "SELECT COALESCE(GET_LOCK(CONCAT('oncely:', \
     LEFT(SHA2(CONCAT(COALESCE(DATABASE(), ''), ':', ?), 256), 56)), 0), 0) = 1 AS claimed, \
     r.state, r.fingerprint, r.route_digest, r.response_status, r.response_headers, \
     r.response_body, r.created_at, r.completed_at, r.expires_at \
     FROM (SELECT 1) AS one LEFT JOIN oncely_idempotency r \
     ON r.tenant = ? AND r.operation = ? AND r.`key` = ?";

/// The claim's row: every record column is NULL when no record exists.
#[derive(sqlx::FromRow)]
struct ClaimRow {
    claimed: bool,
    state: Option<String>,
    fingerprint: Option<Vec<u8>>,
    route_digest: Option<Vec<u8>>,
    response_status: Option<i32>,
    response_headers: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: Option<i64>,
    completed_at: Option<i64>,
    expires_at: Option<i64>,
}

impl ClaimRow {
    fn into_record_row(self) -> Option<RecordRow> {
        Some(RecordRow {
            state: self.state?,
            fingerprint: self.fingerprint?,
            route_digest: self.route_digest?,
            response_status: self.response_status,
            response_headers: self.response_headers,
            response_body: self.response_body,
            created_at: self.created_at?,
            completed_at: self.completed_at,
            expires_at: self.expires_at,
        })
    }
}

impl RecordRow {
    fn into_record(self) -> Result<Record, StoreError> {
        let state = RecordState::parse(&self.state)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown state {:?}", self.state)))?;
        let digest = |v: Vec<u8>| -> Result<[u8; 32], StoreError> {
            v.try_into()
                .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".into()))
        };
        let fingerprint =
            Fingerprint::from_digests(digest(self.fingerprint)?, digest(self.route_digest)?);
        let response = match (self.response_status, self.response_headers) {
            (Some(status), Some(headers)) => Some(
                StoredResponse::from_columns(
                    u16::try_from(status)
                        .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
                    &headers,
                    self.response_body.unwrap_or_default(),
                )
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            ),
            _ => None,
        };
        Ok(Record {
            state,
            fingerprint,
            response,
            created_at: self.created_at,
            completed_at: self.completed_at,
            expires_at: self.expires_at,
        })
    }
}

/// 64-bit PostgreSQL advisory lock id for a key: the first 8 bytes of SHA-256 over the
/// length-prefixed scope and key. The claim XORs it with a hash of the current schema, so
/// deployments sharing one database in separate schemas never contend.
fn advisory_lock_id(tenant: &str, operation: &str, key: &str) -> i64 {
    let mut h = Sha256::new();
    for part in [tenant, operation, key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let d = h.finalize();
    i64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

impl IdempotencyStore {
    /// A store on `db`; finished records expire `retention` after completion (must exceed
    /// the callers' retry window; DESIGN.md default 24 h).
    pub fn new(db: Database, retention: Duration) -> Self {
        Self { db, retention }
    }

    /// The database this store writes to.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Retention of finished records.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Reserves `key` in `scope` inside `tx` (atomic mode: the record is written by
    /// [`IdempotencyStore::complete`] in the same transaction, so it commits together with
    /// the business writes and the response, or not at all).
    ///
    /// One statement reads any committed record for the key and takes the key's exclusive
    /// claim for this transaction:
    /// - PostgreSQL: a transaction-scoped advisory *try*-lock on the key, so a request never
    ///   blocks on another in-flight request with the same key (64 requests on one hot key
    ///   do not pin 64 connections): it gets [`Reservation::InFlight`] at once;
    /// - SQLite: the transaction already holds the database's write lock (`BEGIN IMMEDIATE`);
    /// - MySQL / MariaDB: a named lock, `GET_LOCK(name, 0)` (no wait), in the same statement
    ///   as the read — the same "try, never queue" behaviour as PostgreSQL's try-lock. A named
    ///   lock belongs to the *session*, not the transaction, so [`crate::MySqlTx`] releases
    ///   it when the transaction ends (or closes the connection when dropped unfinished).
    ///
    /// The claim only avoids wasted work. The guarantee is the UNIQUE primary key checked by
    /// the insert in [`IdempotencyStore::complete`] (`ON CONFLICT DO NOTHING`; on MySQL the
    /// duplicate-key error `ER_DUP_ENTRY`, SQLSTATE 23000): two
    /// transactions can never both commit a record for one key, and the loser's business
    /// writes roll back with it. Nothing here is SELECT-then-INSERT: the SELECT decides
    /// only what to *answer*, never whether a second execution may commit.
    ///
    /// `now_ms` is the reservation time (Unix ms), stored as `created_at`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the caller must then not run the operation.
    pub async fn reserve(
        &self,
        tx: &mut Tx,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        now_ms: i64,
    ) -> Result<Reservation, StoreError> {
        let tenant = scope.tenant.as_str();
        let operation = scope.operation.as_str();
        let lock_id = advisory_lock_id(tenant, operation, key.as_str());
        let row: ClaimRow = match tx {
            Tx::MySql(t) => {
                t.took_named_lock();
                sqlx::query_as(CLAIM_MYSQL)
                    .bind(format!("{lock_id:016x}"))
                    .bind(tenant)
                    .bind(operation)
                    .bind(key.as_str())
                    .fetch_one(&mut **t)
                    .await?
            }
            Tx::Sqlite(t) => {
                sqlx::query_as(CLAIM_SQLITE)
                    .bind(tenant)
                    .bind(operation)
                    .bind(key.as_str())
                    .fetch_one(&mut **t)
                    .await?
            }
            Tx::Postgres(t) => {
                sqlx::query_as(CLAIM_POSTGRES)
                    .bind(tenant)
                    .bind(operation)
                    .bind(key.as_str())
                    .bind(lock_id)
                    .fetch_one(&mut **t)
                    .await?
            }
        };
        let claimed = row.claimed;
        if let Some(record) = row.into_record_row() {
            return Ok(Reservation::Existing(record.into_record()?));
        }
        if !claimed {
            return Ok(Reservation::InFlight);
        }
        Ok(Reservation::Reserved(ReservationToken {
            tenant: tenant.to_owned(),
            operation: operation.to_owned(),
            key: key.as_str().to_owned(),
            owner: uuid::Uuid::new_v4().to_string(),
            fingerprint: *fingerprint,
            created_at: now_ms,
        }))
    }

    /// Writes the final record of the reservation `token` in `tx`: state
    /// ([`RecordState::for_status`]), response, `completed_at = now_ms` and
    /// `expires_at = now_ms + retention`, with `INSERT … ON CONFLICT DO NOTHING` under the
    /// primary key (MySQL: a plain `INSERT` whose `ER_DUP_ENTRY`, deadlock or lock-wait
    /// timeout means the same as a conflict). The caller commits `tx`.
    ///
    /// # Errors
    /// [`StoreError::NotHeld`] when another transaction committed a record for this key
    /// first (the caller must roll back `tx`, undoing its business writes, and answer with
    /// that record); [`StoreError`] when the database fails.
    pub async fn complete(
        &self,
        tx: &mut Tx,
        token: ReservationToken,
        response: &StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let state = RecordState::for_status(response.status);
        let expires_at =
            now_ms.saturating_add(i64::try_from(self.retention.as_millis()).unwrap_or(i64::MAX));
        let headers = response.headers_json();
        let (sql, ignores_conflict) = match tx {
            Tx::MySql(_) => (INSERT_RECORD_MYSQL, false),
            _ => (INSERT_RECORD, true),
        };
        let inserted = on_tx!(tx, |c| sqlx::query(sql)
            .bind(&token.tenant)
            .bind(&token.operation)
            .bind(&token.key)
            .bind(&token.fingerprint.full()[..])
            .bind(&token.fingerprint.route()[..])
            .bind(state.as_str())
            .bind(&token.owner)
            .bind(i32::from(response.status))
            .bind(&headers)
            .bind(&response.body)
            .bind(token.created_at)
            .bind(now_ms)
            .bind(expires_at)
            .execute(c)
            .await
            .map(|r| r.rows_affected()));
        let n = match inserted {
            Ok(n) => n,
            // MySQL has no `ON CONFLICT DO NOTHING` that ignores only the key conflict
            // (`INSERT IGNORE` also turns truncation and other errors into warnings), so
            // the duplicate-key error itself is the "already recorded" signal. A deadlock
            // (1213) or lock-wait timeout (1205) here means another transaction is writing
            // the same key: this one has lost either way, so it rolls back and answers
            // with the winner's record (replay) or, while that is uncommitted, 409.
            Err(e)
                if !ignores_conflict
                    && (is_unique_violation(&e) || crate::error::is_mysql_lock_conflict(&e)) =>
            {
                0
            }
            Err(e) => return Err(e.into()),
        };
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::NotHeld)
        }
    }

    /// Reads the committed record for `key` in `scope`, outside any transaction.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is corrupt.
    pub async fn lookup(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, StoreError> {
        let row: Option<RecordRow> = match &self.db {
            Database::Sqlite(s) => {
                sqlx::query_as(SELECT_RECORD)
                    .bind(scope.tenant.as_str())
                    .bind(scope.operation.as_str())
                    .bind(key.as_str())
                    .fetch_optional(s.reader())
                    .await?
            }
            Database::Postgres(p) => {
                sqlx::query_as(SELECT_RECORD)
                    .bind(scope.tenant.as_str())
                    .bind(scope.operation.as_str())
                    .bind(key.as_str())
                    .fetch_optional(p.pool())
                    .await?
            }
            Database::MySql(p) => {
                sqlx::query_as(SELECT_RECORD_MYSQL)
                    .bind(scope.tenant.as_str())
                    .bind(scope.operation.as_str())
                    .bind(key.as_str())
                    .fetch_optional(p.pool())
                    .await?
            }
        };
        row.map(RecordRow::into_record).transpose()
    }

    /// Deletes up to `batch` finished records whose `expires_at` is before `now_ms`
    /// (PostgreSQL: the locked batch is a materialised CTE, so the `LIMIT` holds — an
    /// `IN (SELECT … LIMIT … SKIP LOCKED)` subquery may be re-run and delete more; MySQL:
    /// `DELETE … ORDER BY expires_at LIMIT n`).
    /// Records in `processing` or `unknown` are never collected. Returns how many rows were
    /// deleted; call again while it returns `batch`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn collect_expired(&self, now_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        let n = match &self.db {
            Database::Sqlite(s) => sqlx::query(
                "DELETE FROM oncely_idempotency WHERE rowid IN (SELECT rowid FROM \
                 oncely_idempotency WHERE expires_at < $1 AND state IN ('succeeded', 'failed') \
                 LIMIT $2)",
            )
            .bind(now_ms)
            .bind(batch)
            .execute(s.writer())
            .await?
            .rows_affected(),
            // Plan pinned and rows taken by TID (`crate::plan`).
            Database::Postgres(p) => {
                crate::execute_pinned(
                    p.pool(),
                    sqlx::query(
                        "WITH doomed AS MATERIALIZED (SELECT ctid FROM oncely_idempotency \
                         WHERE expires_at < $1 AND state IN ('succeeded', 'failed') LIMIT $2 \
                         FOR UPDATE SKIP LOCKED) \
                         DELETE FROM oncely_idempotency \
                         WHERE ctid = ANY (ARRAY(SELECT d.ctid FROM doomed d))",
                    )
                    .bind(now_ms)
                    .bind(batch),
                )
                .await?
            }
            // A single-table DELETE takes its own LIMIT.
            Database::MySql(p) => sqlx::query(
                "DELETE FROM oncely_idempotency WHERE expires_at < ? \
                 AND state IN ('succeeded', 'failed') ORDER BY expires_at LIMIT ?",
            )
            .bind(now_ms)
            .bind(batch)
            .execute(p.pool())
            .await?
            .rows_affected(),
        };
        Ok(n)
    }
}
