use std::time::Duration;

use oncely_core::{Fingerprint, IdempotencyKey, RecordState, Scope, StoredResponse};
use sha2::{Digest, Sha256};

use crate::backend::{with_store, with_tx};
use crate::driver::{Store, Sweep};
use crate::{on_pool, sql_text, Database, StoreError, Tx};

/// The idempotency store over table `oncely_idempotency`, primary key
/// `(tenant, operation, key)` (docs/DESIGN.md "Idempotency record").
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
    pub(crate) tenant: String,
    pub(crate) operation: String,
    pub(crate) key: String,
    pub(crate) owner: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) created_at: i64,
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
    /// Multi-phase records: the end of the holder's lease, Unix ms (`None` in atomic mode
    /// and once completed).
    pub lease_until: Option<i64>,
    /// Multi-phase records: the fencing token, raised on every take-over (0 in atomic
    /// mode, 1 for the first holder).
    pub fence: i64,
}

#[derive(sqlx::FromRow)]
pub(crate) struct RecordRow {
    state: String,
    fingerprint: Vec<u8>,
    route_digest: Vec<u8>,
    headers_digest: Option<Vec<u8>>,
    response_status: Option<i32>,
    response_headers: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: i64,
    completed_at: Option<i64>,
    expires_at: Option<i64>,
    lease_until: Option<i64>,
    fence: i64,
}

/// The claim's row: every record column is NULL when no record exists.
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimRow {
    claimed: bool,
    state: Option<String>,
    fingerprint: Option<Vec<u8>>,
    route_digest: Option<Vec<u8>>,
    headers_digest: Option<Vec<u8>>,
    response_status: Option<i32>,
    response_headers: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: Option<i64>,
    completed_at: Option<i64>,
    expires_at: Option<i64>,
    lease_until: Option<i64>,
    fence: Option<i64>,
}

/// The record [`IdempotencyStore::complete`] writes.
pub(crate) struct NewRecord<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) key: &'a str,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) route_digest: &'a [u8],
    pub(crate) headers_digest: Option<&'a [u8]>,
    pub(crate) state: &'static str,
    pub(crate) owner: &'a str,
    pub(crate) status: i32,
    pub(crate) headers: &'a str,
    pub(crate) body: &'a [u8],
    pub(crate) created_at: i64,
    pub(crate) completed_at: i64,
    pub(crate) expires_at: i64,
}

/// Binds a [`NewRecord`] to an insert whose placeholders follow the column order of
/// `INSERT_RECORD` (each backend spells the text; the binds are the same).
macro_rules! bind_record {
    ($query:expr, $r:expr) => {
        $query
            .bind($r.tenant)
            .bind($r.operation)
            .bind($r.key)
            .bind($r.fingerprint)
            .bind($r.route_digest)
            .bind($r.headers_digest)
            .bind($r.state)
            .bind($r.owner)
            .bind($r.status)
            .bind($r.headers)
            .bind($r.body)
            .bind($r.created_at)
            .bind($r.completed_at)
            .bind($r.expires_at)
    };
}

/// The record insert's columns, in bind order (`key` as SQLite and PostgreSQL spell it;
/// [`insert_record_sql`] spells it for the backend).
const INSERT_RECORD: &str = "INSERT INTO oncely_idempotency (tenant, operation, \
     key, fingerprint, route_digest, headers_digest, state, owner, response_status, \
     response_headers, response_body, created_at, completed_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

/// The record columns a lookup reads (every backend).
const RECORD_COLUMNS: &str = "state, fingerprint, route_digest, headers_digest, response_status, \
     response_headers, response_body, created_at, completed_at, expires_at, lease_until, fence";

/// Finished records past their expiry (`$1` now); records in `processing` or `unknown`
/// are never collected.
pub(crate) const EXPIRED_RECORDS: Sweep = Sweep {
    table: "oncely_idempotency",
    filter: "expires_at < $1 AND state IN ('succeeded', 'failed')",
    order_by: "expires_at",
    index: "oncely_idempotency_expires",
};

/// The primary key of a record: tenant, operation and the client's key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordKey<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) key: &'a str,
}

/// What each backend implements for [`IdempotencyStore`] (in `sqlite/`, `postgres/`,
/// `mysql/` `idempotency.rs`): the claim and the spelling of the key. The record's insert
/// and lookup are the same text everywhere and stay in [`IdempotencyStore`].
pub(crate) trait IdempotencyBackend: Store {
    /// The `key` column as this backend's SQL spells it (a reserved word on MySQL).
    const KEY_COLUMN: &'static str;
    /// `tenant`, `operation` and the key (as `record_key`) in a select list, read as text
    /// (MySQL's `_bin` columns through `CAST(… AS CHAR)`, as sqlx reads them as bytes).
    const SELECT_IDS: &'static str;
    /// `true` when a lock conflict ([`crate::is_lock_conflict`]) on the record's insert
    /// means another transaction is writing the same key (MySQL: a deadlock, 1213, or a
    /// lock-wait timeout, 1205): this one has lost either way, so it rolls back and answers
    /// with the winner's record (replay) or, while that is uncommitted, 409.
    const LOCK_CONFLICT_IS_DUPLICATE: bool = false;
    /// A `FROM` clause that makes the `UPDATE` it ends commit without waiting for its WAL
    /// flush, or `""` where a statement cannot ask for that. PostgreSQL:
    /// `set_config('synchronous_commit', 'off', true)`, local to the statement's own
    /// transaction. Used only by a multi-phase holder's completion, whose loss in a
    /// database crash turns the record back to `processing` → `unknown` → status check,
    /// never a second run (see [`IdempotencyStore::complete_leased`]).
    const ASYNC_COMMIT_FROM: &'static str = "";

    /// One statement: takes the key's claim for `tx` (without waiting) and reads the
    /// committed record, if any (see [`IdempotencyStore::reserve`]). `lock_id` is
    /// [`advisory_lock_id`] of the key.
    async fn claim(
        tx: &mut Self::Tx,
        at: RecordKey<'_>,
        lock_id: i64,
    ) -> Result<ClaimRow, sqlx::Error>;
}

/// The record insert with `key` spelled `key_column`.
fn insert_record_sql(key_column: &str) -> String {
    INSERT_RECORD.replacen("key,", &format!("{key_column},"), 1)
}

/// The outcome of the record's insert on backend `S` (its rows affected): `true` when it
/// inserted, `false` when the key exists (see [`IdempotencyBackend::LOCK_CONFLICT_IS_DUPLICATE`]).
fn record_inserted<S: IdempotencyBackend>(
    rows_affected: Result<u64, sqlx::Error>,
) -> Result<bool, sqlx::Error> {
    match S::BACKEND.duplicate_ignored(rows_affected) {
        Err(e) if S::LOCK_CONFLICT_IS_DUPLICATE && crate::error::is_lock_conflict(&e) => Ok(false),
        other => other,
    }
}

fn key_column_of<S: IdempotencyBackend>(_: &S) -> &'static str {
    S::KEY_COLUMN
}

fn async_commit_from_of<S: IdempotencyBackend>(_: &S) -> &'static str {
    S::ASYNC_COMMIT_FROM
}

/// [`IdempotencyBackend::ASYNC_COMMIT_FROM`] of `db`'s backend.
pub(crate) fn async_commit_from(db: &Database) -> &'static str {
    with_store!(db, |s| async_commit_from_of(s))
}

/// The `key` column as `db`'s backend spells it.
pub(crate) fn key_column(db: &Database) -> &'static str {
    with_store!(db, |s| key_column_of(s))
}

impl ClaimRow {
    pub(crate) fn into_record_row(self) -> Option<RecordRow> {
        Some(RecordRow {
            state: self.state?,
            fingerprint: self.fingerprint?,
            route_digest: self.route_digest?,
            headers_digest: self.headers_digest,
            response_status: self.response_status,
            response_headers: self.response_headers,
            response_body: self.response_body,
            created_at: self.created_at?,
            completed_at: self.completed_at,
            expires_at: self.expires_at,
            lease_until: self.lease_until,
            fence: self.fence?,
        })
    }
}

impl RecordRow {
    pub(crate) fn into_record(self) -> Result<Record, StoreError> {
        let state = RecordState::parse(&self.state)?;
        let digest = |v: Vec<u8>| -> Result<[u8; 32], StoreError> {
            v.try_into()
                .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".into()))
        };
        let headers = self.headers_digest.map(digest).transpose()?;
        let fingerprint =
            Fingerprint::from_digests(digest(self.fingerprint)?, digest(self.route_digest)?)
                .with_headers_digest(headers);
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
            lease_until: self.lease_until,
            fence: self.fence,
        })
    }
}

/// 64-bit PostgreSQL advisory lock id for a key: the first 8 bytes of SHA-256 over the
/// length-prefixed scope and key. The claim XORs it with a hash of the current schema, so
/// deployments sharing one database in separate schemas never contend.
pub(crate) fn advisory_lock_id(tenant: &str, operation: &str, key: &str) -> i64 {
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
    /// the callers' retry window; docs/DESIGN.md default 24 h).
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
        let at = RecordKey {
            tenant,
            operation,
            key: key.as_str(),
        };
        let row = with_tx!(tx, |t: S| S::claim(t, at, lock_id).await)?;
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
        let expires_at = oncely_core::ms_after(now_ms, self.retention);
        let headers = response.headers_json();
        let record = NewRecord {
            tenant: &token.tenant,
            operation: &token.operation,
            key: &token.key,
            fingerprint: &token.fingerprint.full()[..],
            route_digest: &token.fingerprint.route()[..],
            headers_digest: token.fingerprint.headers().map(|d| &d[..]),
            state: state.as_str(),
            owner: &token.owner,
            status: i32::from(response.status),
            headers: &headers,
            body: &response.body[..],
            created_at: token.created_at,
            completed_at: now_ms,
            expires_at,
        };
        let inserted = with_tx!(tx, |t: S| {
            let insert = insert_record_sql(S::KEY_COLUMN);
            let sql = S::BACKEND.insert_ignoring_duplicate_sql(&insert, "");
            let n = bind_record!(sqlx::query(&sql), record)
                .execute(&mut **t)
                .await
                .map(|r| r.rows_affected());
            record_inserted::<S>(n)
        })?;
        if inserted {
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
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM oncely_idempotency \
             WHERE tenant = $1 AND operation = $2 AND {} = $3",
            key_column(&self.db)
        );
        let row: Option<RecordRow> = on_pool!(&self.db, |p| sqlx::query_as(&sql_text(p, &sql))
            .bind(scope.tenant.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .fetch_optional(p)
            .await)?;
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
        let n = with_store!(&self.db, |s| s.sweep(&EXPIRED_RECORDS, now_ms, batch).await)?;
        Ok(n)
    }
}
