//! The server's own counters around a timed phase, per operation: what a slower phase did
//! more of (blocks read from outside the buffer cache, WAL written, pages flushed), so a
//! miss comes with the counters that place it instead of a guess.
//!
//! PostgreSQL 15 keeps its statistics in shared memory, but a backend publishes what it
//! counted only at the end of a transaction at least 1 s after its last report, or after
//! 10 s idle (`PGSTAT_MIN_INTERVAL`, `PGSTAT_IDLE_INTERVAL`). [`Counters::settled`] waits
//! out that interval before it reads, so the counts of the phase before are all in and
//! the phase's own all arrive before the next read. MariaDB's `SHOW GLOBAL STATUS` is
//! current when read.

use std::time::Duration;

use oncely_sql::sqlx::{self, Row};
use oncely_sql::Database;

/// Longer than PostgreSQL's 10 s idle reporting interval.
const PG_STATS_SETTLE: Duration = Duration::from_secs(11);

/// PostgreSQL: one row of named counters. Blocks are this schema's tables' and indexes'
/// (read: from outside `shared_buffers`); WAL and buffer writes are the server's (nothing
/// else runs during a benchmark).
const PG_COUNTERS: &str = "SELECT \
     (SELECT coalesce(sum(idx_blks_read), 0) FROM pg_statio_user_indexes \
        WHERE schemaname = current_schema())::float8 AS \"index blocks read\", \
     (SELECT coalesce(sum(idx_blks_hit), 0) FROM pg_statio_user_indexes \
        WHERE schemaname = current_schema())::float8 AS \"index blocks hit\", \
     (SELECT coalesce(sum(heap_blks_read), 0) FROM pg_statio_user_tables \
        WHERE schemaname = current_schema())::float8 AS \"table blocks read\", \
     (SELECT wal_fpi FROM pg_stat_wal)::float8 AS \"WAL full-page images\", \
     (SELECT wal_bytes FROM pg_stat_wal)::float8 AS \"WAL bytes\", \
     (SELECT buffers_checkpoint + buffers_clean + buffers_backend FROM pg_stat_bgwriter)::float8 \
        AS \"buffers written\", \
     (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)::float8 \
        AS \"checkpoints\", \
     (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker')::float8 \
        AS \"autovacuum workers now\"";

/// MariaDB: the InnoDB status variables read, each under its own name.
const MYSQL_COUNTERS: &str = "SHOW GLOBAL STATUS WHERE Variable_name IN \
     ('Innodb_buffer_pool_reads', 'Innodb_buffer_pool_read_requests', \
      'Innodb_buffer_pool_pages_flushed', 'Innodb_os_log_written')";

/// MariaDB: InnoDB's B-tree page splits, off by default (enabled by
/// [`MYSQL_ENABLE_SPLITS`]). A key that lands on a full page splits it; the redo log
/// carries the moved records.
const MYSQL_SPLITS: &str =
    "SELECT NAME, CAST(COUNT AS CHAR) FROM information_schema.INNODB_METRICS \
     WHERE NAME = 'index_page_splits'";

/// Turns the page-split metric on (no effect when it is on; counts are kept).
const MYSQL_ENABLE_SPLITS: &str = "SET GLOBAL innodb_monitor_enable = 'index_page_splits'";

/// Counters that are a gauge, not a running total: printed as read, never as a difference.
const GAUGES: [&str; 1] = ["autovacuum workers now"];

/// The server's counters at one moment, in the order read.
#[derive(Debug, Clone)]
pub(super) struct Counters(Vec<(String, f64)>);

impl Counters {
    /// Reads the counters after the statistics settled (PostgreSQL: [`PG_STATS_SETTLE`]).
    ///
    /// # Errors
    /// The server cannot be read, or the backend is SQLite.
    pub(super) async fn settled(db: &Database) -> anyhow::Result<Self> {
        if let Some(pool) = db.as_postgres() {
            tokio::time::sleep(PG_STATS_SETTLE).await;
            let row = sqlx::query(PG_COUNTERS).fetch_one(pool).await?;
            let mut values = Vec::new();
            for (i, column) in row.columns().iter().enumerate() {
                values.push((sqlx::Column::name(column).to_owned(), row.try_get(i)?));
            }
            return Ok(Self(values));
        }
        let Some(pool) = db.as_mysql() else {
            anyhow::bail!("server counters are read on PostgreSQL or MariaDB");
        };
        sqlx::raw_sql(MYSQL_ENABLE_SPLITS).execute(pool).await?;
        let mut rows = sqlx::raw_sql(MYSQL_COUNTERS).fetch_all(pool).await?;
        rows.extend(sqlx::raw_sql(MYSQL_SPLITS).fetch_all(pool).await?);
        let mut values = Vec::new();
        for row in rows {
            let name: String = row.try_get(0)?;
            let value: String = row.try_get(1)?;
            values.push((name, value.parse()?));
        }
        Ok(Self(values))
    }

    /// Each counter's growth from `before` per operation (`ops` of them); gauges as read
    /// now.
    fn per_op(&self, before: &Self, ops: f64) -> Vec<(String, f64)> {
        self.0
            .iter()
            .map(|(name, now)| {
                let then = before
                    .0
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(0.0, |c| c.1);
                if GAUGES.contains(&name.as_str()) {
                    (name.clone(), *now)
                } else {
                    (name.clone(), (now - then) / ops.max(1.0))
                }
            })
            .collect()
    }
}

/// A phase's counters: before it, after it, and the operations it did.
#[derive(Debug, Clone)]
pub(super) struct Window {
    pub(super) before: Counters,
    pub(super) after: Counters,
    pub(super) ops: f64,
}

/// One line per counter: per `op` in `this` beside `baseline`.
pub(super) fn print_beside(what: &str, op: &str, baseline: &Window, this: &Window) {
    let base = baseline.after.per_op(&baseline.before, baseline.ops);
    let this = this.after.per_op(&this.before, this.ops);
    for ((name, b), (_, t)) in base.iter().zip(&this) {
        let per = if GAUGES.contains(&name.as_str()) {
            "at the end".to_owned()
        } else {
            format!("per {op}")
        };
        println!("  {what}: {name} {per}: {t:.3} beside baseline {b:.3}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_per_operation_and_gauges_are_read_as_they_are() {
        let before = Counters(vec![("reads".into(), 10.0), (GAUGES[0].into(), 3.0)]);
        let after = Counters(vec![("reads".into(), 30.0), (GAUGES[0].into(), 1.0)]);
        assert_eq!(
            after.per_op(&before, 4.0),
            vec![("reads".into(), 5.0), (GAUGES[0].into(), 1.0)]
        );
    }
}
