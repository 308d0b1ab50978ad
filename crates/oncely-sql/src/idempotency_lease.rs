//! Multi-phase idempotency records (docs/DESIGN.md "Multi-phase idempotency, unknown
//! outcomes, reconciliation"): for an operation whose handler calls an external provider,
//! the reservation commits first as `processing` with a lease (`lease_until`) and a fencing
//! token (`fence`, raised on every take-over); the outcome is stored later, by the holder
//! of the current fence only. A lease that runs out makes the record `unknown`, which is
//! resolved by a status check — completed from the provider's answer, or taken over (fence
//! raised) to run again with the same key — never by a blind second execution.
//!
//! Each operation here is one short statement (or transaction) of its own, never the
//! handler's transaction: the record must be visible to retries while the call is out.

use std::time::Duration;

use oncely_core::{Fingerprint, IdempotencyKey, RecordState, Scope, StoredResponse};

use crate::backend::with_store;
use crate::idempotency::{async_commit_from, key_column, IdempotencyBackend};
use crate::{query, Database, IdempotencyStore, Query, Record, StoreError};

/// Proof of holding a multi-phase record under one fencing token: required to complete,
/// release, renew or abandon it. Not `Clone`. A lease whose record was taken over since
/// (a larger fence) can change nothing: every write names the fence and fails with
/// [`StoreError::Fenced`].
#[derive(Debug)]
pub struct Lease {
    tenant: String,
    operation: String,
    key: String,
    owner: String,
    fence: i64,
    until: i64,
}

impl Lease {
    /// The fencing token (1 for the first holder, raised by one on each take-over). Hand it
    /// to anything the holder writes elsewhere that should be fenced too.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// The end of the lease, Unix ms.
    pub fn lease_until(&self) -> i64 {
        self.until
    }

    /// A value unique to this holding (`owner` column).
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

/// What [`IdempotencyStore::reserve_leased`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseReservation {
    /// The record was committed as `processing` under this lease: run the operation.
    Leased(Lease),
    /// A committed record with this key exists (any state): compare its fingerprint, then
    /// answer from it, wait, expire its lease or resolve it.
    Existing(Record),
    /// Another transaction is writing this key right now; nothing was written.
    InFlight,
}

/// Multi-phase records that need attention, for gauges and operators
/// ([`IdempotencyStore::lease_report`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseReport {
    /// Records in `processing`.
    pub processing: i64,
    /// Of those, records whose lease has run out (not yet turned `unknown`).
    pub processing_past_lease: i64,
    /// Records in `unknown`.
    pub unknown: i64,
    /// `unknown` records by how long they have been unknown (since their lease ended):
    /// under 5 minutes, 5 minutes to 1 hour, 1 to 24 hours, over 24 hours.
    pub unknown_by_age: [i64; 4],
    /// How long the oldest `unknown` record has been unknown, in ms.
    pub oldest_unknown_ms: Option<i64>,
}

/// The labels of [`LeaseReport::unknown_by_age`], in order.
pub const UNKNOWN_AGE_BUCKETS: [&str; 4] = ["under_5m", "5m_to_1h", "1h_to_24h", "over_24h"];

/// One record as an operator lists it ([`IdempotencyStore::list_records`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
#[non_exhaustive]
pub struct RecordSummary {
    /// The tenant.
    pub tenant: String,
    /// The operation (method and route template).
    pub operation: String,
    /// The client's key.
    #[sqlx(rename = "record_key")]
    pub key: String,
    /// The stored state word (`processing`, `succeeded`, `failed`, `unknown`).
    pub state: String,
    /// The fencing token (0 in atomic mode).
    pub fence: i64,
    /// End of the lease, Unix ms.
    pub lease_until: Option<i64>,
    /// Reservation time, Unix ms.
    pub created_at: i64,
    /// Completion time, Unix ms.
    pub completed_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct Counts {
    processing: i64,
    past_lease: i64,
    unknown: i64,
    young: i64,
    hour: i64,
    day: i64,
    oldest: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct Expired {
    tenant: String,
    operation: String,
    record_key: String,
    fence: i64,
}

#[derive(sqlx::FromRow)]
struct FenceRow {
    fence: i64,
}

fn select_ids_of<S: IdempotencyBackend>(_: &S) -> &'static str {
    S::SELECT_IDS
}

/// `tenant, operation, record_key` in a select list, as text on every backend.
fn select_ids(db: &Database) -> &'static str {
    with_store!(db, |s| select_ids_of(s))
}

/// `… WHERE tenant = $a AND operation = $b AND key = $c AND fence = $d` with the
/// placeholders numbered from `first`.
fn by_fence(key_column: &str, n: u32) -> String {
    format!(
        "tenant = ${n} AND operation = ${} AND {key_column} = ${} AND fence = ${}",
        n + 1,
        n + 2,
        n + 3
    )
}

impl IdempotencyStore {
    /// Reserves `key` in `scope` for a multi-phase operation and **commits** the record as
    /// `processing`, fence 1, leased until `now_ms + lease`: one autocommit `INSERT … ON
    /// CONFLICT DO NOTHING` (MySQL: a plain `INSERT` whose duplicate-key error means the
    /// same). The primary key is the claim: unlike the atomic mode, whose record is written
    /// only at the end of the business transaction (so a lock must hold the key while the
    /// handler runs), a multi-phase record exists before the operation runs, and the
    /// unique index alone lets one of several concurrent requests of a key insert it and
    /// makes the others wait for that commit. A key already taken reads the record
    /// (`Existing`), or answers `InFlight` when it is gone by then (released). `lease`
    /// must exceed the longest the holder may take (its provider call's timeout
    /// included): past it, retries treat the outcome as unknown.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (the caller must not run the operation; a
    /// failed commit may have committed the record, which a retry then finds).
    pub async fn reserve_leased(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        now_ms: i64,
        lease: Duration,
    ) -> Result<LeaseReservation, StoreError> {
        let owner = uuid::Uuid::new_v4().to_string();
        let lease_until = oncely_core::ms_after(now_ms, lease);
        // `query` sends a NULL as text, which PostgreSQL will not put in a bytea column:
        // no headers digest is a literal NULL.
        let headers = if fingerprint.headers().is_some() {
            "$9"
        } else {
            "NULL"
        };
        let mut insert = query(format!(
            "INSERT INTO oncely_idempotency (tenant, operation, {}, fingerprint, \
             route_digest, state, owner, lease_until, fence, created_at, headers_digest) \
             VALUES ($1, $2, $3, $4, $5, 'processing', $6, $7, 1, $8, {headers})",
            key_column(self.database())
        ))
        .bind(scope.tenant.as_str())
        .bind(scope.operation.as_str())
        .bind(key.as_str())
        .bind(&fingerprint.full()[..])
        .bind(&fingerprint.route()[..])
        .bind(owner.as_str())
        .bind(lease_until)
        .bind(now_ms);
        if let Some(digest) = fingerprint.headers() {
            insert = insert.bind(&digest[..]);
        }
        if !self
            .database()
            .insert_ignoring_duplicate(insert, "(tenant, operation, key)")
            .await?
        {
            return Ok(match self.lookup(scope, key).await? {
                Some(record) => LeaseReservation::Existing(record),
                None => LeaseReservation::InFlight,
            });
        }
        Ok(LeaseReservation::Leased(Lease {
            tenant: scope.tenant.as_str().to_owned(),
            operation: scope.operation.as_str().to_owned(),
            key: key.as_str().to_owned(),
            owner,
            fence: 1,
            until: lease_until,
        }))
    }

    /// Stores the holder's outcome: the record (in `processing`, or `unknown` if its lease
    /// ran out but nobody took it over) becomes final with `response`
    /// ([`RecordState::for_status`]), `completed_at = now_ms`, `expires_at = now_ms +
    /// retention`, lease cleared — only while its fence is still `lease`'s.
    ///
    /// On PostgreSQL this one write commits without waiting for its WAL flush
    /// (`synchronous_commit = off` for its own transaction): a database crash in the
    /// ~3 × `wal_writer_delay` after it can only undo the stored answer, and the record
    /// reads `processing` again → `unknown` past its lease → the status check — the
    /// reservation, committed durably before anything was sent, still holds the key, so
    /// nothing runs twice. It saves one WAL flush on each new key's path. The reservation
    /// and every other write stay synchronous.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when the record was taken over (nothing changed; the new
    /// holder's outcome stands); [`StoreError::NotHeld`] when it is final already or gone;
    /// [`StoreError`] when the database fails.
    pub async fn complete_leased(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let state = RecordState::for_status(response.status);
        self.complete_leased_as(lease, state, response, now_ms)
            .await
    }

    /// [`IdempotencyStore::complete_leased`] with the record's `state` given rather than
    /// derived from `response.status`: for an operation that finished with one status
    /// but is replayed with another answer (a 2xx whose body was too large to keep is
    /// `succeeded`, replayed as a `response-not-replayable` problem).
    ///
    /// # Errors
    /// As [`IdempotencyStore::complete_leased`].
    pub async fn complete_leased_as(
        &self,
        lease: &Lease,
        state: RecordState,
        response: &StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let ids = (&lease.tenant[..], &lease.operation[..], &lease.key[..]);
        self.complete_fenced(ids, lease.fence, state, response, now_ms)
            .await
    }

    /// Completes an `unknown` record from what a status check found at the provider
    /// (`response`, the answer the operation would have given), if its fence is still
    /// `fence` (the one read with the record). The same write as
    /// [`IdempotencyStore::complete_leased`].
    ///
    /// # Errors
    /// As [`IdempotencyStore::complete_leased`]: another request resolved or took it over
    /// first.
    pub async fn complete_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fence: i64,
        response: &StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let state = RecordState::for_status(response.status);
        self.complete_unknown_as(scope, key, fence, state, response, now_ms)
            .await
    }

    /// [`IdempotencyStore::complete_unknown`] with the record's `state` given: for an
    /// outcome that is stored with another answer (an object found too large to keep is
    /// `succeeded`, replayed as a `response-not-replayable` problem).
    ///
    /// # Errors
    /// As [`IdempotencyStore::complete_unknown`].
    pub async fn complete_unknown_as(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fence: i64,
        state: RecordState,
        response: &StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let ids = (
            scope.tenant.as_str(),
            scope.operation.as_str(),
            key.as_str(),
        );
        self.complete_fenced(ids, fence, state, response, now_ms)
            .await
    }

    async fn complete_fenced(
        &self,
        (tenant, operation, key): (&str, &str, &str),
        fence: i64,
        state: RecordState,
        response: &StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let db = self.database();
        let update = query(format!(
            "UPDATE oncely_idempotency SET state = $1, response_status = $2, \
             response_headers = $3, response_body = $4, completed_at = $5, expires_at = $6, \
             lease_until = NULL{} WHERE {} AND state IN ('processing', 'unknown')",
            async_commit_from(db),
            by_fence(key_column(db), 7)
        ))
        .bind(state.as_str())
        .bind(i64::from(response.status))
        .bind(response.headers_json())
        .bind(&response.body[..])
        .bind(now_ms)
        .bind(oncely_core::ms_after(now_ms, self.retention()))
        .bind(tenant)
        .bind(operation)
        .bind(key)
        .bind(fence);
        self.fenced_write(update, (tenant, operation, key), fence)
            .await
    }

    /// Deletes the holder's `processing` record, freeing the key — for an operation that
    /// provably had no effect (it refused its input before calling out).
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when the record was taken over; [`StoreError::NotHeld`] when
    /// it is no longer `processing`; [`StoreError`] when the database fails.
    pub async fn release_leased(&self, lease: Lease) -> Result<(), StoreError> {
        let sql = format!(
            "DELETE FROM oncely_idempotency WHERE {} AND state = 'processing'",
            by_fence(key_column(self.database()), 1)
        );
        self.fenced_write(lease.bind_ids(query(sql)), lease.ids(), lease.fence)
            .await
    }

    /// Deletes an `unknown` record whose fence is still `fence`, freeing the key: a person
    /// found at the other side that the operation had no effect (`oncely idempotency
    /// resolve --absent`), so the next request with the key runs it once more.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when a retry took it over first; [`StoreError::NotHeld`]
    /// when it is no longer `unknown`; [`StoreError`] when the database fails.
    pub async fn release_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fence: i64,
    ) -> Result<(), StoreError> {
        let ids = (
            scope.tenant.as_str(),
            scope.operation.as_str(),
            key.as_str(),
        );
        let sql = format!(
            "DELETE FROM oncely_idempotency WHERE {} AND state = 'unknown'",
            by_fence(key_column(self.database()), 1)
        );
        let delete = query(sql).bind(ids.0).bind(ids.1).bind(ids.2).bind(fence);
        self.fenced_write(delete, ids, fence).await
    }

    /// Turns the holder's `processing` record `unknown` now (lease ended at `now_ms`): the
    /// operation failed or was cut off after it may have called out, so only a status check
    /// may decide its outcome.
    ///
    /// # Errors
    /// As [`IdempotencyStore::release_leased`].
    pub async fn abandon_leased(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE oncely_idempotency SET state = 'unknown', lease_until = $1 \
             WHERE {} AND state = 'processing'",
            by_fence(key_column(self.database()), 2)
        );
        let update = lease.bind_ids(query(sql).bind(now_ms));
        self.fenced_write(update, lease.ids(), lease.fence).await
    }

    /// Extends the holder's lease to `now_ms + lease` while its record is still
    /// `processing` under its fence (a holder that needs longer than it reserved for).
    ///
    /// # Errors
    /// As [`IdempotencyStore::release_leased`].
    pub async fn renew_lease(
        &self,
        held: &mut Lease,
        now_ms: i64,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let until = oncely_core::ms_after(now_ms, lease);
        let sql = format!(
            "UPDATE oncely_idempotency SET lease_until = $1 WHERE {} AND state = 'processing'",
            by_fence(key_column(self.database()), 2)
        );
        let update = held.bind_ids(query(sql).bind(until));
        self.fenced_write(update, held.ids(), held.fence).await?;
        held.until = until;
        Ok(())
    }

    /// Turns the record `unknown` if it is still `processing` under `fence` with its lease
    /// ended before `now_ms` (a holder that renewed in the meantime keeps it). Returns
    /// whether it changed.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn expire_lease(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fence: i64,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let ids = (
            scope.tenant.as_str(),
            scope.operation.as_str(),
            key.as_str(),
        );
        self.expire(ids, fence, now_ms).await
    }

    async fn expire(
        &self,
        (tenant, operation, key): (&str, &str, &str),
        fence: i64,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let db = self.database();
        let sql = format!(
            "UPDATE oncely_idempotency SET state = 'unknown' \
             WHERE {} AND state = 'processing' AND lease_until < $5",
            by_fence(key_column(db), 1)
        );
        let q = query(sql)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(fence)
            .bind(now_ms);
        Ok(db.execute(q).await? == 1)
    }

    /// Takes over an `unknown` record whose fence is still `fence` — after a status check
    /// proved the provider has nothing for it — so the operation may run again **with the
    /// same key**: the record becomes `processing` under a new owner, fence `fence + 1`,
    /// leased until `now_ms + lease`. The previous holder, should it still be alive, can no
    /// longer complete it.
    ///
    /// # Errors
    /// [`StoreError::NotHeld`] when the record is no longer `unknown` under `fence`
    /// (another request resolved or took it over first); [`StoreError`] when the database
    /// fails.
    pub async fn take_over(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fence: i64,
        now_ms: i64,
        lease: Duration,
    ) -> Result<Lease, StoreError> {
        let db = self.database();
        let owner = uuid::Uuid::new_v4().to_string();
        let lease_until = oncely_core::ms_after(now_ms, lease);
        let sql = format!(
            "UPDATE oncely_idempotency SET state = 'processing', owner = $1, \
             lease_until = $2, fence = fence + 1 WHERE {} AND state = 'unknown'",
            by_fence(key_column(db), 3)
        );
        let update = query(sql)
            .bind(owner.as_str())
            .bind(lease_until)
            .bind(scope.tenant.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .bind(fence);
        if db.execute(update).await? != 1 {
            return Err(StoreError::NotHeld);
        }
        Ok(Lease {
            tenant: scope.tenant.as_str().to_owned(),
            operation: scope.operation.as_str().to_owned(),
            key: key.as_str().to_owned(),
            owner,
            fence: fence + 1,
            until: lease_until,
        })
    }

    /// The lease sweep: turns up to `batch` `processing` records whose lease ended before
    /// `now_ms` `unknown` (oldest lease first), each with the fenced update of
    /// [`IdempotencyStore::expire_lease`]. Returns how many changed; call again while it
    /// returns `batch`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn expire_leases(&self, now_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let db = self.database();
        let due: Vec<Expired> = db
            .fetch_all(
                query(format!(
                    "SELECT {}, fence FROM oncely_idempotency \
                     WHERE state = 'processing' AND lease_until < $1 \
                     ORDER BY lease_until LIMIT $2",
                    select_ids(db)
                ))
                .bind(now_ms)
                .bind(i64::from(batch.max(1))),
            )
            .await?;
        let mut changed = 0;
        for r in &due {
            let ids = (&r.tenant[..], &r.operation[..], &r.record_key[..]);
            if self.expire(ids, r.fence, now_ms).await? {
                changed += 1;
            }
        }
        Ok(changed)
    }

    /// Counts the multi-phase records that need attention at `now_ms` (one aggregate over
    /// the `processing` and `unknown` records; index `oncely_idempotency_state`).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn lease_report(&self, now_ms: i64) -> Result<LeaseReport, StoreError> {
        const MINUTE: i64 = 60_000;
        let ended = "COALESCE(lease_until, created_at)";
        let c: Counts = self
            .database()
            .fetch_optional(
                query(format!(
                    "SELECT COUNT(CASE WHEN state = 'processing' THEN 1 END) AS processing, \
                     COUNT(CASE WHEN state = 'processing' AND lease_until < $1 THEN 1 END) \
                     AS past_lease, COUNT(CASE WHEN state = 'unknown' THEN 1 END) AS unknown, \
                     COUNT(CASE WHEN state = 'unknown' AND {ended} >= $2 THEN 1 END) AS young, \
                     COUNT(CASE WHEN state = 'unknown' AND {ended} >= $3 THEN 1 END) AS hour, \
                     COUNT(CASE WHEN state = 'unknown' AND {ended} >= $4 THEN 1 END) AS day, \
                     MIN(CASE WHEN state = 'unknown' THEN {ended} END) AS oldest \
                     FROM oncely_idempotency WHERE state IN ('processing', 'unknown')"
                ))
                .bind(now_ms)
                .bind(now_ms - 5 * MINUTE)
                .bind(now_ms - 60 * MINUTE)
                .bind(now_ms - 24 * 60 * MINUTE),
            )
            .await?
            .ok_or_else(|| StoreError::Corrupt("an aggregate returned no row".into()))?;
        Ok(LeaseReport {
            processing: c.processing,
            processing_past_lease: c.past_lease,
            unknown: c.unknown,
            unknown_by_age: [c.young, c.hour - c.young, c.day - c.hour, c.unknown - c.day],
            oldest_unknown_ms: c.oldest.map(|t| (now_ms - t).max(0)),
        })
    }

    /// How many records of every tenant are in each state: `(state word, count)`, by state,
    /// only states that have records — for operators (not a tenant-facing view).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn state_counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let db = self.database();
        db.fetch_all(query(format!(
            "SELECT {}, COUNT(*) AS n FROM oncely_idempotency GROUP BY state ORDER BY state",
            db.backend().text_column("state")
        )))
        .await
    }

    /// Up to `limit` records, oldest first, in `state` when given — for operators (every
    /// tenant's; this is not a tenant-facing view).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn list_records(
        &self,
        state: Option<RecordState>,
        limit: u32,
    ) -> Result<Vec<RecordSummary>, StoreError> {
        let db = self.database();
        let columns = format!(
            "SELECT {}, state, fence, lease_until, created_at, completed_at \
             FROM oncely_idempotency",
            select_ids(db)
        );
        let limit = i64::from(limit.max(1));
        let q = match state {
            Some(s) => query(format!(
                "{columns} WHERE state = $1 ORDER BY created_at LIMIT $2"
            ))
            .bind(s.as_str())
            .bind(limit),
            None => query(format!("{columns} ORDER BY created_at LIMIT $1")).bind(limit),
        };
        db.fetch_all(q).await
    }

    /// Runs a write naming `fence` for the record `ids`; when it changed nothing, tells a
    /// take-over ([`StoreError::Fenced`]) from a record that is final or gone
    /// ([`StoreError::NotHeld`]).
    async fn fenced_write(
        &self,
        write: Query,
        (tenant, operation, key): (&str, &str, &str),
        fence: i64,
    ) -> Result<(), StoreError> {
        let db = self.database();
        if db.execute(write).await? == 1 {
            return Ok(());
        }
        let current: Option<FenceRow> = db
            .fetch_optional(
                query(format!(
                    "SELECT fence FROM oncely_idempotency \
                     WHERE tenant = $1 AND operation = $2 AND {} = $3",
                    key_column(db)
                ))
                .bind(tenant)
                .bind(operation)
                .bind(key),
            )
            .await?;
        match current {
            Some(FenceRow { fence: current }) if current != fence => Err(StoreError::Fenced {
                held: fence,
                current,
            }),
            _ => Err(StoreError::NotHeld),
        }
    }
}

impl Lease {
    fn ids(&self) -> (&str, &str, &str) {
        (&self.tenant, &self.operation, &self.key)
    }

    /// Binds tenant, operation, key and fence, in that order (after `q`'s binds so far).
    fn bind_ids(&self, q: Query) -> Query {
        q.bind(self.tenant.as_str())
            .bind(self.operation.as_str())
            .bind(self.key.as_str())
            .bind(self.fence)
    }
}
