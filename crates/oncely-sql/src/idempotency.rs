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
    /// This transaction inserted the record (state `processing`); it alone may complete it.
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
/// length-prefixed scope and key.
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

    /// Atomically reserves `key` in `scope` inside `tx`.
    ///
    /// - PostgreSQL: a transaction-scoped advisory *try*-lock on the key guards the insert,
    ///   so a request never blocks on another uncommitted reservation of the same key (64
    ///   requests on one hot key do not pin 64 connections): it gets
    ///   [`Reservation::InFlight`] at once. The UNIQUE primary key remains the guarantee.
    /// - SQLite: the transaction already holds the database's write lock (`BEGIN
    ///   IMMEDIATE`), so the insert never races.
    ///
    /// `now_ms` is the reservation time (Unix ms).
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
        let owner = uuid::Uuid::new_v4().to_string();
        let tenant = scope.tenant.as_str();
        let operation = scope.operation.as_str();
        let inserted = match tx {
            Tx::Sqlite(t) => sqlx::query(
                "INSERT INTO oncely_idempotency \
                 (tenant, operation, key, fingerprint, route_digest, state, owner, created_at) \
                 VALUES ($1, $2, $3, $4, $5, 'processing', $6, $7) ON CONFLICT DO NOTHING",
            )
            .bind(tenant)
            .bind(operation)
            .bind(key.as_str())
            .bind(&fingerprint.full()[..])
            .bind(&fingerprint.route()[..])
            .bind(&owner)
            .bind(now_ms)
            .execute(&mut **t)
            .await?
            .rows_affected(),
            Tx::Postgres(t) => sqlx::query(
                "INSERT INTO oncely_idempotency \
                 (tenant, operation, key, fingerprint, route_digest, state, owner, created_at) \
                 SELECT $1, $2, $3, $4, $5, 'processing', $6, $7 \
                 WHERE pg_try_advisory_xact_lock($8) ON CONFLICT DO NOTHING",
            )
            .bind(tenant)
            .bind(operation)
            .bind(key.as_str())
            .bind(&fingerprint.full()[..])
            .bind(&fingerprint.route()[..])
            .bind(&owner)
            .bind(now_ms)
            .bind(advisory_lock_id(tenant, operation, key.as_str()))
            .execute(&mut **t)
            .await?
            .rows_affected(),
        };
        if inserted == 1 {
            return Ok(Reservation::Reserved(ReservationToken {
                tenant: tenant.to_owned(),
                operation: operation.to_owned(),
                key: key.as_str().to_owned(),
                owner,
            }));
        }
        let row: Option<RecordRow> = on_tx!(tx, |c| sqlx::query_as(SELECT_RECORD)
            .bind(tenant)
            .bind(operation)
            .bind(key.as_str())
            .fetch_optional(c)
            .await)?;
        match row {
            Some(row) => Ok(Reservation::Existing(row.into_record()?)),
            None => Ok(Reservation::InFlight),
        }
    }

    /// Stores the final answer of the reservation `token` in `tx`: state
    /// ([`RecordState::for_status`]), response, `completed_at = now_ms` and
    /// `expires_at = now_ms + retention`. The caller commits `tx`.
    ///
    /// # Errors
    /// [`StoreError::NotHeld`] when the record is no longer this reservation's;
    /// [`StoreError`] when the database fails.
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
        let n = on_tx!(tx, |c| sqlx::query(
            "UPDATE oncely_idempotency SET state = $1, response_status = $2, \
             response_headers = $3, response_body = $4, completed_at = $5, expires_at = $6, \
             lease_until = NULL \
             WHERE tenant = $7 AND operation = $8 AND key = $9 AND owner = $10 \
             AND state = 'processing'",
        )
        .bind(state.as_str())
        .bind(i32::from(response.status))
        .bind(&headers)
        .bind(&response.body)
        .bind(now_ms)
        .bind(expires_at)
        .bind(&token.tenant)
        .bind(&token.operation)
        .bind(&token.key)
        .bind(&token.owner)
        .execute(c)
        .await
        .map(|r| r.rows_affected()))?;
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
        };
        row.map(RecordRow::into_record).transpose()
    }

    /// Deletes up to `batch` finished records whose `expires_at` is before `now_ms`.
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
            Database::Postgres(p) => sqlx::query(
                "DELETE FROM oncely_idempotency WHERE (tenant, operation, key) IN \
                 (SELECT tenant, operation, key FROM oncely_idempotency WHERE expires_at < $1 \
                 AND state IN ('succeeded', 'failed') LIMIT $2 FOR UPDATE SKIP LOCKED)",
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
