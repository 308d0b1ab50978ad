//! [`OutboxBackend`] on PostgreSQL: a claim deletes its rows in a transaction held open
//! while they are published ([`OutboxStore::claim_batch`]), published rows move to
//! `oncely_outbox_published`, claims and sweeps run with pinned plans (`crate::plan`).

use std::collections::BTreeMap;

use super::PgStore;
use crate::outbox::driver::{
    bind_new_row, headers_json, Claim, HeldClaim, NewRow, OutboxBackend, Published, Row, COLUMNS,
};
use crate::outbox::types::{
    ClaimedBatch, Hold, OutboxRow, OutboxState, Outcome, Rescheduled, Settled,
};
use crate::{StoreError, PINNED_PLAN};

/// The columns a row keeps when it moves between `oncely_outbox` and
/// `oncely_outbox_published` (PostgreSQL): all but `state`, `published_at` and the lease.
macro_rules! moved_columns {
    () => {
        "id, message_id, topic, partition_key, event_type, payload, headers, created_at, \
         available_at, attempts, last_error"
    };
}

/// [`COLUMNS`] read from `oncely_outbox_published` (PostgreSQL).
const PUBLISHED_COLUMNS: &str = concat!(moved_columns!(), ", 'published' AS state, published_at");

/// PostgreSQL: takes the transaction-scoped advisory lock of the partition of the row
/// aliased `alias`, false when another transaction holds it. The key is a 64-bit hash of
/// the partition key seeded with the outbox table's OID and 1869505381 (`"once"` in ASCII):
/// advisory locks are one namespace per database, and with a key of the partition alone
/// the relays of an outbox in another schema (another service, another test) held up this
/// one's partitions of the same name — a claim skipped them while the other relay
/// published. A `claim_batch` relay holds the partitions of
/// its batch until the batch is settled, so no other relay takes a row of theirs — in
/// particular not a row that committed late, after a newer row of its partition was
/// claimed: the anti-join on lower ids cannot see that newer row (it looks pending), only
/// its partition lock can. Two partition keys with the same hash only wait for each other.
/// Each row a relay holds takes one entry of PostgreSQL's lock table: size
/// `max_locks_per_transaction` for the batch size (`max_locks_per_transaction ×
/// max_connections` slots in all; the defaults, 64 × 100, hold 25 batches of 256).
///
/// `alias` names the claim's materialised candidate CTE (columns `id`, `partition_key`,
/// `table_oid`), never the outbox table itself: a lock-taking function in a `WHERE` clause
/// over the table is evaluated on whatever rows the planner's scan visits, and a plan made
/// while the table was believed empty (a seq scan of the outbox as the join's outer side)
/// took a lock for every pending row's partition — 20,000 partitions exhausted the
/// server-wide lock table (`out of shared memory`). A CTE with a volatile function is never
/// inlined (PostgreSQL 12+ inlines only side-effect-free CTEs), so the lock is tried on the
/// candidate rows alone, at most `LIMIT` of them, and no statement takes a lock for a row it
/// does not return (a candidate whose partition lock fails is returned by neither).
fn partition_lock(alias: &str) -> String {
    format!(
        "pg_try_advisory_xact_lock(hashtextextended({alias}.partition_key, \
         {alias}.table_oid::bigint # 1869505381))"
    )
}

/// The candidate partition heads of a PostgreSQL claim, as the body of a CTE with columns
/// `id`, `partition_key`, `table_oid`: pending, available, not leased by a live lease, the
/// oldest pending row of its partition, outside the `$skip` id multirange (`'{}'`: none),
/// and of no partition with a live lease; `LIMIT $limit` of them in id order, locked
/// `FOR UPDATE OF o SKIP LOCKED` (`LIMIT` applies after locking, so skipped rows do not
/// count against it). `$now`, `$limit`, `$skip` are placeholders to substitute.
const CLAIM_CANDIDATES: &str = "SELECT o.id, o.partition_key, o.tableoid AS table_oid \
     FROM oncely_outbox o \
     WHERE o.state = 'pending' AND o.available_at <= $now \
     AND (o.locked_until IS NULL OR o.locked_until < $now) \
     AND NOT (CAST($skip::text AS int8multirange) @> o.id) \
     AND NOT EXISTS (SELECT 1 FROM oncely_outbox p \
       WHERE p.partition_key = o.partition_key AND p.state = 'pending' \
       AND (p.partition_key, p.id) < (o.partition_key, o.id) OFFSET 0) \
     AND o.partition_key NOT IN (SELECT l.partition_key FROM oncely_outbox l \
       WHERE l.state = 'pending' AND l.locked_until >= $now) \
     ORDER BY o.id LIMIT $limit FOR UPDATE OF o SKIP LOCKED";

/// [`CLAIM_CANDIDATES`] with its placeholders bound to `now`, `limit` and `skip` (each a
/// `$n` parameter of the statement).
fn claim_candidates(now: &str, limit: &str, skip: &str) -> String {
    CLAIM_CANDIDATES
        .replace("$now", now)
        .replace("$limit", limit)
        .replace("$skip", skip)
}

/// [`COLUMNS`] prefixed with a table alias.
fn qualified(alias: &str) -> String {
    COLUMNS
        .split(", ")
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One column of `rows`, as an array parameter for `UNNEST`.
fn column<'a, T>(rows: &[&'a OutboxRow], f: impl Fn(&'a OutboxRow) -> T) -> Vec<T> {
    rows.iter().map(|r| f(r)).collect()
}

/// The `UNNEST` arguments of [`insert_rows`]: `moved_columns!`' arrays, `$1`–`$11`.
const MOVED_ARRAYS: &str = "$1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], \
     $6::bytea[], $7::text[], $8::bigint[], $9::bigint[], $10::int[], $11::text[]";

/// Where [`insert_rows`] writes.
enum Destination {
    /// Back into `oncely_outbox`, each row with its state.
    Outbox,
    /// Into `oncely_outbox_published`, published at `at_ms` (Unix ms). A message id recorded
    /// already (a copy enqueued while its original was being published, published again
    /// with the same id) keeps its first record.
    Published { at_ms: i64 },
}

/// Inserts rows (PostgreSQL) with their ids and message ids, in one statement; nothing
/// when there are none.
async fn insert_rows<'a>(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    rows: impl IntoIterator<Item = &'a OutboxRow>,
    to: Destination,
) -> Result<(), StoreError> {
    let rows: Vec<&OutboxRow> = rows.into_iter().collect();
    if rows.is_empty() {
        return Ok(());
    }
    let headers = rows
        .iter()
        .map(|r| headers_json(&r.event.headers))
        .collect::<Result<Vec<_>, _>>()?;
    let sql = match to {
        Destination::Outbox => format!(
            "INSERT INTO oncely_outbox ({}, state) SELECT * FROM UNNEST({MOVED_ARRAYS}, $12::text[])",
            moved_columns!()
        ),
        Destination::Published { .. } => format!(
            "INSERT INTO oncely_outbox_published ({}, published_at) \
             SELECT u.*, $12 FROM UNNEST({MOVED_ARRAYS}) AS u ON CONFLICT DO NOTHING",
            moved_columns!()
        ),
    };
    let query = sqlx::query(&sql)
        .bind(column(&rows, |r| r.id))
        .bind(column(&rows, |r| r.event.message_id.to_string()))
        .bind(column(&rows, |r| r.event.topic.as_str()))
        .bind(column(&rows, |r| r.event.partition_key.as_str()))
        .bind(column(&rows, |r| r.event.event_type.as_str()))
        .bind(column(&rows, |r| r.event.payload.as_slice()))
        .bind(headers)
        .bind(column(&rows, |r| r.created_at))
        .bind(column(&rows, |r| r.available_at))
        .bind(column(&rows, |r| {
            i32::try_from(r.attempts).unwrap_or(i32::MAX)
        }))
        .bind(column(&rows, |r| r.last_error.as_deref()));
    let query = match to {
        Destination::Outbox => query.bind(column(&rows, |r| r.state.as_str())),
        Destination::Published { at_ms } => query.bind(at_ms),
    };
    query.execute(&mut **tx).await?;
    Ok(())
}

/// `ranges` as a PostgreSQL `int8multirange` literal, e.g. `{[1,128],[200,311]}`.
fn multirange(ranges: &[std::ops::RangeInclusive<i64>]) -> String {
    let parts: Vec<String> = ranges
        .iter()
        .filter(|r| r.start() <= r.end())
        .map(|r| format!("[{},{}]", r.start(), r.end()))
        .collect();
    format!("{{{}}}", parts.join(","))
}

impl OutboxBackend for PgStore {
    /// Published events live in `oncely_outbox_published`; the UNIQUE(message_id) there
    /// and the check here keep an id from being enqueued again while its published record
    /// is kept.
    async fn enqueue(tx: &mut Self::Tx, row: NewRow<'_>) -> Result<i64, StoreError> {
        let insert = sqlx::query_scalar(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
             payload, headers, created_at, available_at, attempts, state) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $7, 0, 'pending' \
             WHERE NOT EXISTS (SELECT 1 FROM oncely_outbox_published WHERE message_id = $1) \
             RETURNING id",
        );
        let id: Option<i64> = bind_new_row!(insert, row).fetch_optional(&mut **tx).await?;
        id.ok_or_else(|| StoreError::AlreadyPublished(row.event.message_id.to_string()))
    }

    // The locking subquery sits in a CTE so it runs exactly once: as an `IN (…)`
    // subquery the planner may rescan it, and with SKIP LOCKED a rescan returns
    // other rows (more than LIMIT in all). The partition locks are tried on its rows
    // only ([`partition_lock`]), leaving out partitions a `claim_batch` relay
    // holds; the UPDATE re-checks the lease on the row version the lock returned.
    async fn claim(&self, claim: Claim<'_>) -> Result<Vec<Row>, StoreError> {
        let mut tx = self
            .pool()
            .begin_with(format!("BEGIN; {PINNED_PLAN}"))
            .await?;
        let rows = sqlx::query_as(&format!(
            "WITH c AS ({}), h AS (SELECT c.id FROM c WHERE {}) \
             UPDATE oncely_outbox t SET locked_by = $1, locked_until = $2 \
             WHERE t.id = ANY (ARRAY(SELECT h.id FROM h)) AND t.state = 'pending' \
             AND (t.locked_until IS NULL OR t.locked_until < $3) \
             RETURNING {}",
            claim_candidates("$3", "$4", "'{}'"),
            partition_lock("c"),
            qualified("t")
        ))
        .bind(claim.owner)
        .bind(claim.until)
        .bind(claim.now_ms)
        .bind(claim.batch)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows)
    }

    async fn claim_held(&self, held: HeldClaim<'_>) -> Result<Option<ClaimedBatch>, StoreError> {
        let HeldClaim {
            batch,
            now_ms,
            skip,
            keep,
        } = held;
        let batch = i64::from(batch.max(1));
        // The claim's plan is pinned ([`PINNED_PLAN`]: the statistics say the table is empty
        // right when a backlog arrives; with the seq scans it took 7 s instead of 6 ms to
        // claim 256 of 30,000 rows), set in the same round trip as `BEGIN`; the head check is
        // an `OFFSET 0` subquery on a row comparison only `oncely_outbox_pending` can serve,
        // and the ids are taken as `= ANY (ARRAY(…))`, so no join is left to plan.
        //
        // `plan_cache_mode = force_generic_plan`: the claim's plan does not depend on its
        // parameters, but PostgreSQL 15 kept choosing a custom plan for it on every
        // execution (`pg_prepared_statements`: 0 generic, 8 custom), planning it each time
        // for about 1 ms — as long as the claim itself.
        //
        // `synchronous_commit = off` for this transaction only: its commit (the settle)
        // returns before the WAL is flushed. A server crash in that window can only undo
        // the settle — the rows come back `pending` and are republished with the same
        // message ids, which at-least-once delivery already allows; no event is lost and no
        // business data is in this transaction. It saves one WAL flush per batch on the
        // relay's critical path.
        let mut tx = self
            .pool()
            .begin_with(format!(
                "BEGIN; {PINNED_PLAN}; \
                 SET LOCAL plan_cache_mode = force_generic_plan; \
                 SET LOCAL synchronous_commit = off"
            ))
            .await?;
        // The claim *is* the delete: the candidates are locked `FOR UPDATE OF o SKIP
        // LOCKED` and deleted in the same statement — those whose partition this
        // transaction can lock ([`partition_lock`]); a candidate whose partition another
        // relay holds stays locked by this transaction, untouched, until it ends. Until
        // this transaction commits, other relays still see the rows (so a partition whose
        // head is in flight stays blocked) and skip them (they are locked); a rollback —
        // relay crash, lost connection, failed settle — puts them back untouched. A live
        // lease (a relay using `claim`) is honoured as in `claim`.
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "WITH c AS ({}), h AS (SELECT c.id FROM c WHERE {}) \
             DELETE FROM oncely_outbox x WHERE x.id = ANY (ARRAY(SELECT h.id FROM h)) \
             RETURNING {}",
            claim_candidates("$1", "$2", "$3"),
            partition_lock("c"),
            qualified("x")
        ))
        .bind(now_ms)
        .bind(batch)
        .bind(multirange(skip))
        .fetch_all(&mut *tx)
        .await?;
        let mut rows = rows
            .into_iter()
            .map(Row::into_row)
            .collect::<Result<Vec<_>, _>>()?;
        rows.sort_by_key(|r| r.id);
        if rows.is_empty() {
            // Nothing to hold: give the connection back now.
            tx.rollback().await?;
            return Ok(Some(ClaimedBatch {
                rows,
                hold: Hold::Nothing,
            }));
        }
        Ok(Some(ClaimedBatch {
            rows,
            hold: Hold::Locked {
                tx: Box::new(tx),
                keep,
            },
        }))
    }

    async fn mark_published(&self, published: Published<'_>) -> Result<u64, StoreError> {
        let Published {
            owner,
            ids,
            now_ms,
            keep,
        } = published;
        // The row moves to `oncely_outbox_published` (or goes, without retention).
        // A message id recorded already keeps its first record (see `Destination`).
        if keep {
            let n: i64 = sqlx::query_scalar(concat!(
                "WITH d AS (DELETE FROM oncely_outbox \
                     WHERE id = ANY($2) AND locked_by = $3 AND state = 'pending' \
                     RETURNING *), \
                     i AS (INSERT INTO oncely_outbox_published (",
                moved_columns!(),
                ", published_at) SELECT ",
                moved_columns!(),
                ", $1 FROM d ON CONFLICT DO NOTHING) SELECT count(*) FROM d"
            ))
            .bind(now_ms)
            .bind(ids)
            .bind(owner)
            .fetch_one(self.pool())
            .await?;
            return Ok(u64::try_from(n).unwrap_or(0));
        }
        Ok(sqlx::query(
            "DELETE FROM oncely_outbox \
             WHERE id = ANY($1) AND locked_by = $2 AND state = 'pending'",
        )
        .bind(ids)
        .bind(owner)
        .execute(self.pool())
        .await?
        .rows_affected())
    }

    /// A published row lives in `oncely_outbox_published` (migration 0005).
    async fn get_published(&self, id: i64) -> Result<Option<Row>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "SELECT {PUBLISHED_COLUMNS} FROM oncely_outbox_published WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await?)
    }

    /// Plan pinned, rows taken by TID (`crate::plan`): the oldest rows first, read from
    /// the B-tree on `published_at` (migration 0038).
    async fn delete_published(&self, before_ms: i64, batch: i64) -> Result<u64, StoreError> {
        Ok(crate::plan::execute_pinned(
            self.pool(),
            sqlx::query(
                "WITH c AS (SELECT ctid FROM oncely_outbox_published \
                 WHERE published_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 DELETE FROM oncely_outbox_published \
                 WHERE ctid = ANY (ARRAY(SELECT c.ctid FROM c))",
            )
            .bind(before_ms)
            .bind(batch),
        )
        .await?)
    }

    async fn vacuum(&self) -> Result<(), StoreError> {
        // Simple query protocol: VACUUM cannot run inside a transaction block.
        sqlx::raw_sql("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON, TRUNCATE false) oncely_outbox")
            .execute(self.pool())
            .await?;
        Ok(())
    }
}

/// Settles a batch held by [`Hold::Locked`]: the claim deleted the rows in `tx`, still
/// open; see [`ClaimedBatch::settle`].
pub(crate) async fn settle_locked(
    mut tx: Box<sqlx::Transaction<'static, sqlx::Postgres>>,
    keep: bool,
    rows: &[OutboxRow],
    outcome: Outcome<'_>,
) -> Result<Settled, StoreError> {
    let Outcome {
        published,
        published_at_ms,
        failures,
        max_attempts,
    } = outcome;
    let mut settled = Settled::default();
    // The claim deleted the rows in this still-open transaction: a published row
    // is recorded in the published table (or, without retention, nothing more);
    // a failed one goes back with its attempt recorded, the rest go back as they
    // were (same ids, so the partitions' order holds).
    let published: std::collections::HashSet<i64> = published.iter().copied().collect();
    let (done, rest): (Vec<&OutboxRow>, Vec<&OutboxRow>) =
        rows.iter().partition(|r| published.contains(&r.id));
    let mut back: BTreeMap<i64, OutboxRow> = rest.into_iter().map(|r| (r.id, r.clone())).collect();
    let max = max_attempts.max(1);
    for f in failures {
        let Some(row) = back.get_mut(&f.id) else {
            settled.failures.push((f.id, Rescheduled::NotHeld));
            continue;
        };
        row.attempts = row.attempts.saturating_add(1);
        row.last_error = Some(f.error.chars().take(2000).collect());
        row.available_at = f.retry_at_ms;
        let outcome = if row.attempts >= max || f.permanent {
            row.state = OutboxState::Dead;
            Rescheduled::Dead
        } else {
            Rescheduled::Retry
        };
        settled.failures.push((f.id, outcome));
    }
    settled.published = done.len() as u64;
    insert_rows(&mut tx, back.values(), Destination::Outbox).await?;
    if keep {
        let to = Destination::Published {
            at_ms: published_at_ms,
        };
        insert_rows(&mut tx, done, to).await?;
    }
    tx.commit().await?;
    Ok(settled)
}
