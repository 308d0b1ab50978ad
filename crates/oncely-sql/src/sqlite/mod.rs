//! SQLite: [`SqliteStore`] (one writer, a pool of readers over WAL), [`SqliteTx`], connecting
//! and migrations, and the stores' SQLite statements.

mod effects;
mod idempotency;
mod outbox;
#[cfg(test)]
mod plans;
mod queue;
mod reconcile;

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous};
use sqlx::Sqlite;

use crate::driver::{Backend, Store, Sweep};
use crate::{Database, DbOptions, StoreError, Tx};

/// SQLite: one writer connection (SQLite has one writer; every transaction starts with
/// `BEGIN IMMEDIATE` so it takes the write lock up front and waits at most the busy
/// timeout) and a pool of readers over WAL.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    write: SqlitePool,
    read: SqlitePool,
    /// Set when a transaction on the writer ended abnormally (failed COMMIT or ROLLBACK,
    /// or dropped unfinished). sqlx can then keep the connection marked "inside a
    /// transaction" although SQLite already rolled back (e.g. after SQLITE_FULL), and every
    /// later `BEGIN` fails; so the next [`Database::begin`] closes the writer connection and
    /// the pool opens a fresh one.
    poisoned: Arc<AtomicBool>,
}

/// A SQLite transaction on the writer connection. Dereferences to the connection, so
/// queries run on `&mut **tx` exactly as on a sqlx transaction.
#[derive(Debug)]
pub struct SqliteTx {
    tx: Option<sqlx::Transaction<'static, Sqlite>>,
    poisoned: Arc<AtomicBool>,
}

impl std::ops::Deref for SqliteTx {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        self.tx.as_ref().expect("SqliteTx used after it ended")
    }
}

impl std::ops::DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.tx.as_mut().expect("SqliteTx used after it ended")
    }
}

impl SqliteTx {
    async fn finish(mut self, commit: bool) -> Result<(), sqlx::Error> {
        let tx = self.tx.take().expect("SqliteTx ends once");
        let result = if commit {
            tx.commit().await
        } else {
            tx.rollback().await
        };
        if result.is_err() {
            self.poisoned.store(true, Ordering::SeqCst);
        }
        result
    }
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        // Dropped unfinished (an error path or a panic): sqlx queues a ROLLBACK, which can
        // fail silently if SQLite already rolled back; recycle the writer to be safe.
        if self.tx.is_some() {
            self.poisoned.store(true, Ordering::SeqCst);
        }
    }
}

impl SqliteStore {
    /// The single-connection writer pool.
    pub fn writer(&self) -> &SqlitePool {
        &self.write
    }

    /// The read-only reader pool.
    pub fn reader(&self) -> &SqlitePool {
        &self.read
    }

    /// The pool reads go to: [`SqliteStore::reader`] ([`on_pool!`](crate::on_pool)).
    pub fn read_pool(&self) -> &SqlitePool {
        &self.read
    }

    /// The pool writes go to: [`SqliteStore::writer`] ([`on_writer!`](crate::on_writer)).
    pub fn write_pool(&self) -> &SqlitePool {
        &self.write
    }

    /// Opens the writer and the readers on `url` (`sqlite://path`; the file is created
    /// when missing).
    pub(crate) async fn connect(url: &str, options: &DbOptions) -> Result<Self, StoreError> {
        let opts = SqliteConnectOptions::from_str(url)?;
        let write = PoolOptions::<Sqlite>::new()
            .max_connections(1)
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connection_settings(opts.clone(), options))
            .await?;
        let read = PoolOptions::<Sqlite>::new()
            .max_connections(options.max_connections.clamp(1, 8))
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connection_settings(opts, options).read_only(true))
            .await?;
        Ok(Self::from_pools(write, read))
    }

    fn from_pools(write: SqlitePool, read: SqlitePool) -> Self {
        Self {
            write,
            read,
            poisoned: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// The per-connection settings every oncely SQLite connection has: created when missing,
/// WAL, `synchronous = NORMAL`, busy timeout [`DbOptions::lock_timeout`], foreign keys on.
fn connection_settings(opts: SqliteConnectOptions, options: &DbOptions) -> SqliteConnectOptions {
    opts.create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(options.lock_timeout)
        .foreign_keys(true)
}

impl Database {
    /// A database over pools the caller built: `writer` must have exactly one connection
    /// (SQLite has one writer; oncely's transactions begin with `BEGIN IMMEDIATE` on it),
    /// `reader` any number (open them read-only). oncely cannot change the settings of
    /// connections it did not open, so the caller sets on both what
    /// [`Database::connect`] sets: WAL (`journal_mode`), `synchronous = NORMAL`, a busy
    /// timeout (oncely's default is [`DbOptions::lock_timeout`], 5 s) and
    /// `foreign_keys = ON`; [`Database::sqlite_connect_options`] gives options with
    /// exactly those.
    pub fn from_sqlite_pools(writer: SqlitePool, reader: SqlitePool) -> Self {
        Self::Sqlite(SqliteStore::from_pools(writer, reader))
    }

    /// `opts` with the per-connection settings [`Database::connect`] gives a SQLite
    /// connection (see [`Database::from_sqlite_pools`]).
    pub fn sqlite_connect_options(
        opts: SqliteConnectOptions,
        options: &DbOptions,
    ) -> SqliteConnectOptions {
        connection_settings(opts, options)
    }

    /// The SQLite pools (writer, readers), if this is SQLite.
    // `_`: whichever other backends are compiled in (none, one or two).
    #[allow(unreachable_patterns, clippy::match_wildcard_for_single_variants)]
    pub fn as_sqlite(&self) -> Option<(&SqlitePool, &SqlitePool)> {
        match self {
            Self::Sqlite(s) => Some((&s.write, &s.read)),
            _ => None,
        }
    }
}

/// The SQLite statement of `sweep` (`$1` the bound, `$2` the batch): the batch's rowids read
/// from `sweep.index`, pinned with `INDEXED BY`. Without statistics SQLite read the
/// idempotency sweep's rows from `oncely_idempotency_state (state, lease_until)`: every
/// finished record on each round that found few expired ones.
pub(crate) fn sweep_sql(sweep: &Sweep) -> String {
    let Sweep {
        table,
        filter,
        index,
        ..
    } = sweep;
    format!(
        "DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} INDEXED BY {index} \
         WHERE {filter} LIMIT $2)"
    )
}

impl Store for SqliteStore {
    type Tx = SqliteTx;
    const BACKEND: Backend = Backend::Sqlite;
    const MIGRATIONS_TABLE_EXISTS: &'static str = "SELECT COUNT(*) FROM sqlite_master \
         WHERE type = 'table' AND name = '_sqlx_migrations'";

    fn migrations() -> sqlx::migrate::Migrator {
        sqlx::migrate!("./migrations/sqlite")
    }

    fn store_timeout(&self) -> Option<Duration> {
        None
    }

    async fn begin(&self) -> Result<Tx, StoreError> {
        if self.poisoned.swap(false, Ordering::SeqCst) {
            tracing::warn!("recycling the SQLite writer connection after a failed transaction");
            let conn = self.write.acquire().await?;
            drop(conn.close().await);
        }
        Ok(Tx::Sqlite(SqliteTx {
            tx: Some(self.write.begin_with("BEGIN IMMEDIATE").await?),
            poisoned: self.poisoned.clone(),
        }))
    }

    async fn finish(tx: SqliteTx, commit: bool) -> Result<(), sqlx::Error> {
        tx.finish(commit).await
    }

    async fn connect_error(&self) -> Option<sqlx::Error> {
        None
    }

    async fn close(&self) {
        self.write.close().await;
        self.read.close().await;
    }

    async fn sweep(&self, sweep: &Sweep, bound: i64, batch: i64) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(&sweep_sql(sweep))
            .bind(bound)
            .bind(batch)
            .execute(&self.write)
            .await?
            .rows_affected())
    }
}
