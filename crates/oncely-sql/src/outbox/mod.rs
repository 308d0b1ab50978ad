//! [`OutboxStore`]: the transactional outbox over table `oncely_outbox`.
//!
//! - `types` — the values: [`OutboxEvent`], [`OutboxRow`], [`OutboxState`], [`OutboxStats`],
//!   [`ClaimedBatch`], [`PublishFailure`], [`Settled`], [`Rescheduled`], [`RequeueTarget`].
//! - `batch` — settling a [`ClaimedBatch`].
//! - `driver` — `OutboxBackend`, what `sqlite/`, `postgres/` and `mysql/` implement, with
//!   the row and SQL texts they share; it names no backend, so they import it, never this
//!   module.

mod batch;
pub(crate) mod driver;
pub(crate) mod types;

use std::time::Duration;

use crate::backend::{with_store, with_tx};
use crate::{on_pool, on_writer, sql_text, Backend, Database, StoreError, Tx};
use driver::{
    columns_of, headers_json, reschedule_sql, Claim, Failure, HeldClaim, NewRow, OutboxBackend,
    Published, Row, STATS, STATS_BY_STATE,
};
use types::Hold;
pub use types::{
    ClaimedBatch, OutboxEvent, OutboxRow, OutboxState, OutboxStats, PublishFailure, RequeueTarget,
    Rescheduled, Settled,
};

/// The transactional outbox over table `oncely_outbox` (docs/DESIGN.md "Outbox, relay, inbox").
///
/// - **Enqueue** in the caller's transaction ([`OutboxStore::enqueue`]): no event without
///   its business change, no business change without its event.
/// - **Claim by state, never by cursor** ([`OutboxStore::claim`]): a relay leases the
///   *head* of each partition — its oldest pending row — so a row whose transaction commits
///   after a higher-numbered row is still found, and at most one event per partition key is
///   in flight across all relays, which keeps each partition's events in order however
///   many relays run. PostgreSQL and MySQL 8.0+ / MariaDB 10.6+ lock candidates with
///   `FOR UPDATE SKIP LOCKED`, so relays never wait on each other; SQLite serialises claims
///   on its single writer.
/// - **Settle**: [`ClaimedBatch::settle`] for a batch of [`OutboxStore::claim_batch`];
///   for leases of [`OutboxStore::claim`], [`OutboxStore::mark_published`] after the broker
///   confirmed and [`OutboxStore::reschedule`] after a failure (backoff computed by the
///   caller; `dead` after the attempt limit), both acting only on rows the caller still
///   leases.
/// - **Published rows**: on PostgreSQL they leave `oncely_outbox` for
///   `oncely_outbox_published` (or are forgotten, see [`OutboxStore::keep_published`]);
///   elsewhere they stay, state `published`. [`OutboxStore::get`] finds them either way
///   until [`OutboxStore::delete_published`] removes them.
///
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct OutboxStore {
    db: Database,
    keep_published: bool,
}

impl OutboxStore {
    /// A store on `db` (migrated with [`Database::migrate`]) that keeps published rows
    /// until [`OutboxStore::delete_published`] removes them.
    pub fn new(db: Database) -> Self {
        Self {
            db,
            keep_published: true,
        }
    }

    /// Whether rows are kept once published (default `true`). With `false` (a relay with
    /// zero retention), PostgreSQL forgets a row when its publish is settled, which spares
    /// the write of the published record; SQLite and MySQL mark it and leave it to
    /// [`OutboxStore::delete_published`].
    #[must_use]
    pub fn keep_published(mut self, keep: bool) -> Self {
        self.keep_published = keep;
        self
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// The select list [`Row`] decodes on this store's backend.
    fn columns(&self) -> &'static str {
        with_store!(&self.db, |s| columns_of(s))
    }

    /// Adds `event` to the outbox inside `tx`, state `pending`, available at once. It
    /// becomes visible to relays when `tx` commits (PostgreSQL then notifies channel
    /// `oncely_outbox`) and vanishes if `tx` rolls back. Returns the row id.
    ///
    /// # Errors
    /// [`StoreError::Database`] when the insert fails — including a unique violation on
    /// `message_id`, which means the same event was enqueued twice; the caller must then
    /// roll back. [`StoreError::AlreadyPublished`] (PostgreSQL) when an event with this
    /// message id was published within the retention. Either guard is best effort across
    /// the retention boundary and against a copy enqueued while the first is being
    /// published; such a copy goes out with the same message id, which JetStream and the
    /// consumers' inboxes drop.
    pub async fn enqueue(tx: &mut Tx, event: &OutboxEvent) -> Result<i64, StoreError> {
        let now = oncely_core::now_ms();
        let headers = headers_json(&event.headers)?;
        let row = NewRow {
            event,
            headers: &headers,
            now,
        };
        with_tx!(tx, |t: S| S::enqueue(t, row).await)
    }

    /// Leases up to `batch` rows for `owner` until `now_ms + lease` and returns them in id
    /// order. A row is claimable when it is `pending`, available (`available_at ≤ now`), not
    /// leased by a live lease, the oldest pending row of its partition key, and no other row
    /// of its partition is leased — so each partition contributes at most one row, and none
    /// while another row of it is in flight (even one with a higher id whose transaction
    /// committed first) or an earlier one is in backoff.
    ///
    /// `lease` must exceed the publish timeout: a relay that outlives its lease may see its
    /// rows republished by another (same message ids, so consumers' inboxes and JetStream's
    /// de-duplication recognise them).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing is leased then.
    pub async fn claim(
        &self,
        owner: &str,
        batch: u32,
        lease: Duration,
        now_ms: i64,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let until = oncely_core::ms_after(now_ms, lease);
        let claim = Claim {
            owner,
            until,
            now_ms,
            batch: i64::from(batch.max(1)),
        };
        let rows = with_store!(&self.db, |s| s.claim(claim).await)?;
        let mut rows = rows
            .into_iter()
            .map(Row::into_row)
            .collect::<Result<Vec<_>, _>>()?;
        rows.sort_by_key(|r| r.id);
        Ok(rows)
    }

    /// Claims up to `batch` partition heads (the rows [`OutboxStore::claim`] would take) and
    /// holds them until [`ClaimedBatch::settle`]:
    ///
    /// - **PostgreSQL**: one statement locks the rows `FOR UPDATE SKIP LOCKED` and deletes
    ///   them, in a transaction that stays open while they are published; `settle` commits
    ///   it together with the outcome (published rows recorded in
    ///   `oncely_outbox_published` when the store keeps them, failed and unsettled rows
    ///   re-inserted with their ids). Until then other relays still see the rows — so the
    ///   rest of each partition stays unclaimable — and skip them, as they are locked. A
    ///   relay that dies mid-batch loses its connection, PostgreSQL rolls the transaction
    ///   back and the rows are claimable again at once, untouched (republished with the same
    ///   message ids) — no lease to wait out. The hot table thus only ever holds pending and
    ///   dead rows, and a published row costs no second version of itself. Measured with
    ///   `oncely-bench relay`: see the README.
    /// - **SQLite**: a lease for `owner` until `now_ms + lease`, as [`OutboxStore::claim`]
    ///   (one writer: there is no row lock to hold).
    /// - **MySQL / MariaDB**: a lease as well, written by [`OutboxStore::claim`]'s
    ///   `FOR UPDATE SKIP LOCKED` transaction (holding the locks across the publish, as on
    ///   PostgreSQL, is not built for MySQL yet).
    ///
    /// `skip`: id ranges the claim need not look at (PostgreSQL), because their rows are
    /// held by the caller's own batches in flight — rows there that the caller does not
    /// hold are only left for a later claim. Pass `&[]` when there are none.
    ///
    /// Each held batch keeps one pooled connection (PostgreSQL) until it is settled or
    /// dropped; dropping it unsettled rolls back (PostgreSQL, when the pool takes the
    /// connection back) or leaves the lease to run out (SQLite, MySQL).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing is held then.
    pub async fn claim_batch(
        &self,
        owner: &str,
        batch: u32,
        lease: Duration,
        now_ms: i64,
        skip: &[std::ops::RangeInclusive<i64>],
    ) -> Result<ClaimedBatch, StoreError> {
        let held = HeldClaim {
            batch,
            now_ms,
            skip,
            keep: self.keep_published,
        };
        let held = with_store!(&self.db, |s| s.claim_held(held).await)?;
        if let Some(held) = held {
            return Ok(held);
        }
        let rows = self.claim(owner, batch, lease, now_ms).await?;
        Ok(ClaimedBatch {
            rows,
            hold: Hold::Leased {
                store: self.clone(),
                owner: owner.to_owned(),
            },
        })
    }

    /// Marks `ids` published at `now_ms`, for those rows `owner` still leases. Returns how
    /// many rows were marked (fewer than `ids.len()` when a lease ran out and another relay
    /// took the row over).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the rows stay leased and are republished
    /// after the lease runs out (same message ids).
    pub async fn mark_published(
        &self,
        owner: &str,
        ids: &[i64],
        now_ms: i64,
    ) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let published = Published {
            owner,
            ids,
            now_ms,
            keep: self.keep_published,
        };
        let n = with_store!(&self.db, |s| s.mark_published(published).await)?;
        Ok(n)
    }

    /// Records a failed publish of row `id` held by `owner`: `attempts + 1`, `last_error`,
    /// lease released; the row becomes `dead` when the new attempt count reaches
    /// `max_attempts`, else `pending` again from `retry_at_ms` (Unix ms; the caller applies
    /// backoff with jitter). `error` is cut to 2,000 characters.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the row stays leased and is retried after
    /// the lease runs out.
    pub async fn reschedule(
        &self,
        owner: &str,
        id: i64,
        error: &str,
        retry_at_ms: i64,
        max_attempts: u32,
    ) -> Result<Rescheduled, StoreError> {
        let error: String = error.chars().take(2000).collect();
        let failure = Failure {
            owner,
            id,
            error: &error,
            retry_at_ms,
            max: i64::from(max_attempts.max(1)),
        };
        let state = match with_store!(&self.db, |s| s.reschedule(failure).await)? {
            Some(state) => state,
            None => on_writer!(&self.db, |p| sqlx::query_scalar(&reschedule_sql())
                .bind(failure.max)
                .bind(failure.error)
                .bind(failure.retry_at_ms)
                .bind(failure.id)
                .bind(failure.owner)
                .fetch_optional(p)
                .await)?,
        };
        Ok(Rescheduled::from_state(state.as_deref()))
    }

    /// Gives back the leases `owner` holds on `ids` without counting an attempt (a relay
    /// shutting down with claimed rows it did not publish).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the leases then simply run out.
    pub async fn release(&self, owner: &str, ids: &[i64]) -> Result<u64, StoreError> {
        let mut n = 0;
        for id in ids {
            let sql = "UPDATE oncely_outbox SET locked_by = NULL, locked_until = NULL \
                       WHERE id = $1 AND locked_by = $2 AND state = 'pending'";
            n += on_writer!(&self.db, |p| sqlx::query(&sql_text(p, sql))
                .bind(id)
                .bind(owner)
                .execute(p)
                .await
                .map(|r| r.rows_affected()))?;
        }
        Ok(n)
    }

    /// Pending and dead counts and the oldest pending row's time.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let sql = match self.db.backend() {
            Backend::Sqlite => STATS_BY_STATE,
            _ => STATS,
        };
        let (pending, oldest, dead): (i64, Option<i64>, i64) =
            on_pool!(&self.db, |p| sqlx::query_as(sql).fetch_one(p).await)?;
        Ok(OutboxStats {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest_pending_created_at: oldest,
            dead: u64::try_from(dead).unwrap_or(0),
        })
    }

    /// Reads one row by id.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is corrupt.
    pub async fn get(&self, id: i64) -> Result<Option<OutboxRow>, StoreError> {
        let sql = format!("SELECT {} FROM oncely_outbox WHERE id = $1", self.columns());
        let row: Option<Row> = on_pool!(&self.db, |p| sqlx::query_as(&sql_text(p, &sql))
            .bind(id)
            .fetch_optional(p)
            .await)?;
        let row = match row {
            Some(row) => Some(row),
            None => with_store!(&self.db, |s| s.get_published(id).await)?,
        };
        row.map(Row::into_row).transpose()
    }

    /// Up to `limit` dead rows with ids above `after_id` (0 to start), in id order.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn dead(&self, after_id: i64, limit: u32) -> Result<Vec<OutboxRow>, StoreError> {
        let limit = i64::from(limit.max(1));
        let sql = format!(
            "SELECT {} FROM oncely_outbox WHERE state = 'dead' AND id > $1 ORDER BY id LIMIT $2",
            self.columns()
        );
        let rows: Vec<Row> = on_pool!(&self.db, |p| sqlx::query_as(&sql_text(p, &sql))
            .bind(after_id)
            .bind(limit)
            .fetch_all(p)
            .await)?;
        rows.into_iter().map(Row::into_row).collect()
    }

    /// The rows of partition `partition_key` still in `oncely_outbox` (pending, dead, and
    /// published ones not yet collected), in id order — for operators following one
    /// aggregate's events.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn partition(&self, partition_key: &str) -> Result<Vec<OutboxRow>, StoreError> {
        let sql = format!(
            "SELECT {} FROM oncely_outbox WHERE partition_key = $1 ORDER BY id",
            self.columns()
        );
        let rows: Vec<Row> = on_pool!(&self.db, |p| sqlx::query_as(&sql_text(p, &sql))
            .bind(partition_key)
            .fetch_all(p)
            .await)?;
        rows.into_iter().map(Row::into_row).collect()
    }

    /// Puts dead rows back to `pending` with `attempts = 0`, available at `now_ms`
    /// (`last_error` is kept for the record). Returns how many rows were requeued. A
    /// requeued row is published after the rows of its partition that overtook it while it
    /// was dead.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn requeue_dead(
        &self,
        target: RequeueTarget,
        now_ms: i64,
    ) -> Result<u64, StoreError> {
        let (sql, id) = match target {
            RequeueTarget::Id(id) => (
                "UPDATE oncely_outbox SET state = 'pending', attempts = 0, available_at = $1, \
                 locked_by = NULL, locked_until = NULL WHERE state = 'dead' AND id = $2",
                Some(id),
            ),
            RequeueTarget::All => (
                "UPDATE oncely_outbox SET state = 'pending', attempts = 0, available_at = $1, \
                 locked_by = NULL, locked_until = NULL WHERE state = 'dead'",
                None,
            ),
        };
        let n = on_writer!(&self.db, |p| {
            let sql = sql_text(p, sql);
            let mut q = sqlx::query(&sql).bind(now_ms);
            if let Some(id) = id {
                q = q.bind(id);
            }
            q.execute(p).await.map(|r| r.rows_affected())
        })?;
        Ok(n)
    }

    /// Deletes up to `batch` rows published before `before_ms` (Unix ms). Returns how many
    /// were deleted; call again while it returns `batch`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn delete_published(&self, before_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        let n = with_store!(&self.db, |s| s.delete_published(before_ms, batch).await)?;
        Ok(n)
    }

    /// PostgreSQL: `VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON, TRUNCATE false) oncely_outbox` —
    /// removes the index entries and row versions left by claimed (deleted) rows; skipped
    /// when another session holds the table's vacuum lock (another relay vacuuming it,
    /// autovacuum). `TRUNCATE false`: giving empty trailing pages back to the file system
    /// takes an `ACCESS EXCLUSIVE` lock that would stall the business transactions
    /// enqueueing events (and, replayed on a standby, cancel its queries); the pages are
    /// reused by the next inserts anyway, and autovacuum still truncates. Does nothing on
    /// SQLite (freed pages are reused) and MySQL (InnoDB's purge runs by itself).
    ///
    /// Why a relay calls it (see `RelayConfig::vacuum_after_rows` in `oncely-outbox`): the
    /// claim walks the pending rows in id order, and every row claimed since the last
    /// vacuum leaves a dead entry at the low end of that walk. Autovacuum visits a database
    /// at most once per `autovacuum_naptime` (60 s by default); at tens of thousands of
    /// events per second each claim then steps over hundreds of thousands of dead entries
    /// (`oncely-bench relay` to NATS lost 15–20 % of its throughput within five
    /// 50,000-event runs).
    ///
    /// Needs the table's owner (or, PostgreSQL 17+, `MAINTAIN`); without it PostgreSQL only
    /// warns and skips the table.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn vacuum(&self) -> Result<(), StoreError> {
        with_store!(&self.db, |s| s.vacuum().await)
    }
}
