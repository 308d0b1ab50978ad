//! PostgreSQL plans for claims and sweeps that hold whatever the statistics say.
//!
//! A claim or sweep meets its largest backlog right after a quiet period, which is exactly
//! when PostgreSQL believes the table is empty: a vacuum or autovacuum of the idle table set
//! `reltuples = 0`, and until the next ANALYZE every plan is made for an empty table — a seq
//! scan of the whole table, per statement, or per row of a join (measured on the SQL
//! transport's queue: 3.2 s to take 64 messages of 100,000 with the `DELETE … USING` join
//! planned for an empty table, 0.3 ms with the plan pinned and the join gone).
//! So these statements run in a transaction begun with [`PINNED_PLAN`], and are written
//! without a join for the planner to get wrong: the rows a locking CTE chose are addressed
//! as `ctid = ANY (ARRAY(SELECT ctid FROM …))`, a TID scan (a row locked `FOR UPDATE` by the
//! statement cannot move). Not by primary key: with the table believed empty every index on
//! the column ties, and the planner walked the queue's `(topic, id)` index end to end,
//! filtering on `id` (300 ms for 64 rows).

use sqlx::{PgPool, Postgres, Transaction};

/// Settings, local to the transaction, that leave a claim or sweep only index, TID and
/// index-ordered paths: no seq scan, no bitmap scan, no sort. A statement with no index to
/// use still runs (the planner falls back to a seq scan); these statements all have one.
pub const PINNED_PLAN: &str = "SET LOCAL enable_seqscan = off; \
     SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off";

/// Begins a transaction on `pool` with `settings` (`SET LOCAL …` statements), in one round
/// trip.
///
/// # Errors
/// The [`sqlx::Error`] of `BEGIN` (the pool's acquire timeout included).
async fn begin_with(
    pool: &PgPool,
    settings: &str,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    pool.begin_with(format!("BEGIN; {settings}")).await
}

/// Runs `statement` (a query built by the caller) in a transaction begun with
/// [`PINNED_PLAN`] and commits; returns the rows affected.
///
/// # Errors
/// The [`sqlx::Error`] of any of the three round trips; nothing is committed then.
pub async fn execute_pinned(
    pool: &PgPool,
    statement: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
) -> Result<u64, sqlx::Error> {
    let mut tx = begin_with(pool, PINNED_PLAN).await?;
    let n = statement.execute(&mut *tx).await?.rows_affected();
    tx.commit().await?;
    Ok(n)
}

/// As [`execute_pinned`], for a statement returning rows of type `T`.
///
/// # Errors
/// As [`execute_pinned`].
pub async fn fetch_all_pinned<'q, T>(
    pool: &PgPool,
    statement: sqlx::query::QueryAs<'q, Postgres, T, sqlx::postgres::PgArguments>,
) -> Result<Vec<T>, sqlx::Error>
where
    T: Send + Unpin + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    let mut tx = begin_with(pool, PINNED_PLAN).await?;
    let rows = statement.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(rows)
}
