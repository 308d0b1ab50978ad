//! The portable [`Database`] and [`Tx`] methods and [`DbOptions`]; the backends' own code
//! is in `sqlite/`, `postgres/` and `mysql/`, reached through [`Store`].

use std::time::Duration;

use crate::backend::{with_store, with_tx};
use crate::driver::Store;
use crate::{Backend, Database, Migrations, StoreError, Tx};

/// Connection settings shared by every backend.
#[derive(Debug, Clone)]
pub struct DbOptions {
    /// Largest number of pooled connections (PostgreSQL, MySQL; SQLite read pool).
    /// Default 16.
    pub max_connections: u32,
    /// How long a request waits for a pooled connection before the store counts as
    /// unreachable (503). Default 5 s.
    pub acquire_timeout: Duration,
    /// PostgreSQL `lock_timeout`, MySQL `innodb_lock_wait_timeout` (whole seconds, at least
    /// 1 s) and SQLite busy timeout: the bound on waiting for a row or database lock held by
    /// another transaction. Default 5 s.
    pub lock_timeout: Duration,
    /// PostgreSQL and MySQL / MariaDB: the bound on beginning a transaction — pool acquire
    /// plus `BEGIN` ([`Database::begin`]) — and on any step run through
    /// [`Database::within_store_timeout`] (the idempotency layer puts acquire, `BEGIN` and
    /// the key claim under one such deadline). A connection whose path froze (a silent
    /// partition, a paused server) then fails with [`StoreError::TimedOut`] (503) instead of
    /// waiting for TCP to give up. SQLite has no network path: its waits are bounded by
    /// `acquire_timeout` and the busy timeout instead. Default 10 s (above
    /// `acquire_timeout`, so a refused connection is reported as such, not as a timeout).
    pub store_timeout: Duration,
    /// How long the server lets a session sit idle inside a transaction before it ends the
    /// *session* (rolling back, freeing row locks, advisory locks and MariaDB's
    /// session-scoped named locks): PostgreSQL `idle_in_transaction_session_timeout`,
    /// MariaDB `idle_transaction_timeout` (whole seconds, at least 1 s). MySQL 8 has no
    /// such variable: there the session's `wait_timeout` is set instead, which also closes
    /// pooled connections idle that long (the pool's test on acquire replaces them). This
    /// is what frees the keys of a process that died, or lost its path to the database,
    /// mid-transaction. Must exceed the longest pause *between two statements* of a
    /// transaction (the handler's own work); default 60 s.
    pub idle_transaction_timeout: Duration,
}

impl Default for DbOptions {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(5),
            store_timeout: Duration::from_secs(10),
            idle_transaction_timeout: Duration::from_secs(60),
        }
    }
}

impl Database {
    /// Connects to `url`: `sqlite://path` (the file is created when missing; `sqlite::memory:`
    /// is refused, one process must see one database), `postgres://…` or `mysql://…`
    /// (MySQL 8.0+, MariaDB 10.6+; also `mariadb://…`).
    ///
    /// Does not run migrations; see [`Database::migrate`].
    ///
    /// # Errors
    /// [`StoreError::UnsupportedUrl`] for another scheme, [`StoreError::Unavailable`] when the
    /// server or file cannot be reached.
    pub async fn connect(url: &str, options: &DbOptions) -> Result<Self, StoreError> {
        crate::backend::connect(url, options).await
    }

    /// Applies oncely's embedded migrations (idempotency tables). Safe to run from several
    /// processes at once; applications with their own tables run their own migrator too
    /// (migration versions 1–9999 belong to oncely).
    ///
    /// # Errors
    /// [`StoreError::Migrate`] when a migration fails or the database cannot be reached.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let migrator = with_store!(self, |s| embedded_migrations(s));
        self.run_one(migrator).await
    }

    /// Checks, changing nothing, that every one of oncely's embedded migrations for this
    /// backend is applied here: sqlx's `_sqlx_migrations` table (resolved as the stores
    /// resolve their tables: PostgreSQL's `search_path`, MySQL's current database) lists
    /// each version as successful. For operator commands, which read what a service wrote
    /// and must neither create a schema nor need DDL rights.
    ///
    /// # Errors
    /// [`StoreError::SchemaMissing`] with the versions not applied (all of them when there
    /// is no migrations table); [`StoreError::Unavailable`] or [`StoreError::Database`]
    /// when the check itself cannot run.
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        let migrator = with_store!(self, |s| embedded_migrations(s));
        let table_exists = with_store!(self, |s| migrations_table_exists(s));
        let tables: i64 = crate::on_pool!(self, |p| sqlx::query_scalar(table_exists)
            .fetch_one(p)
            .await)?;
        let applied: Vec<i64> = if tables == 0 {
            Vec::new()
        } else {
            crate::on_pool!(self, |p| sqlx::query_scalar(
                "SELECT version FROM _sqlx_migrations WHERE success"
            )
            .fetch_all(p)
            .await)?
        };
        let missing: Vec<i64> = migrator
            .iter()
            .filter(|m| !m.migration_type.is_down_migration() && !applied.contains(&m.version))
            .map(|m| m.version)
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(StoreError::SchemaMissing { missing })
        }
    }

    /// Runs the application's own migrations for this database's backend — the set given
    /// for it in `migrations`; an application that supports only some backends gives only
    /// those — tolerating migrations applied by other migrators in the same database
    /// (oncely's own, see [`Database::migrate`]).
    ///
    /// # Errors
    /// [`StoreError::Migrate`] when a migration fails; [`StoreError::NoMigrations`] when
    /// `migrations` has no set for this backend.
    pub async fn run_migrator(&self, migrations: Migrations) -> Result<(), StoreError> {
        let backend = self.backend();
        let migrator = migrations
            .into_set(backend)
            .ok_or(StoreError::NoMigrations(backend))?;
        self.run_one(migrator).await
    }

    async fn run_one(&self, mut migrator: sqlx::migrate::Migrator) -> Result<(), StoreError> {
        migrator.set_ignore_missing(true);
        // On the write side (SQLite's single writer).
        crate::on_writer!(self, |p| migrator.run(p).await).map_err(StoreError::Migrate)
    }

    /// Begins a transaction: `BEGIN IMMEDIATE` on SQLite, `BEGIN` (READ COMMITTED) on
    /// PostgreSQL and MySQL, within [`DbOptions::store_timeout`] there.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when no connection can be had within the acquire timeout
    /// (carrying why a new connection fails, e.g. "connection refused", when that is the
    /// cause), [`StoreError::TimedOut`] when acquire and `BEGIN` take longer than the store
    /// timeout.
    pub async fn begin(&self) -> Result<Tx, StoreError> {
        self.within_store_timeout(async {
            match with_store!(self, |s| s.begin().await) {
                Err(StoreError::Unavailable(sqlx::Error::PoolTimedOut)) => {
                    Err(self.why_no_connection().await)
                }
                other => other,
            }
        })
        .await
    }

    /// Runs `op` within [`DbOptions::store_timeout`] on PostgreSQL and MySQL; past it, `op`
    /// is dropped (a transaction it began is then rolled back by the server when its
    /// session closes or the pool tests the connection). On SQLite `op` runs unbounded by
    /// this: its waits are bounded by the acquire and busy timeouts, and a SQLite command
    /// cancelled half way would still run on the connection's worker thread.
    ///
    /// # Errors
    /// `op`'s error, or [`StoreError::TimedOut`].
    pub async fn within_store_timeout<T>(
        &self,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let Some(limit) = with_store!(self, |s| s.store_timeout()) else {
            return op.await;
        };
        tokio::time::timeout(limit, op)
            .await
            .unwrap_or(Err(StoreError::TimedOut(limit)))
    }

    /// sqlx reports "pool timed out" both when every connection is busy and when none can
    /// be opened (it retries a refused connect until the acquire deadline). One direct
    /// connection attempt (at most 1 s) tells which, so the error names the root cause.
    async fn why_no_connection(&self) -> StoreError {
        let failure = with_store!(self, |s| s.connect_error().await);
        StoreError::Unavailable(failure.unwrap_or(sqlx::Error::PoolTimedOut))
    }

    /// Which backend this is.
    pub fn backend(&self) -> Backend {
        with_store!(self, |s| backend_of(s))
    }

    /// Checks the database answers (`SELECT 1`), for health checks; within
    /// [`DbOptions::store_timeout`] on PostgreSQL and MySQL.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when it does not (naming why a connection cannot be
    /// opened, when that is the cause), [`StoreError::TimedOut`] when it does not answer in
    /// time.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.within_store_timeout(async {
            let pinged = crate::on_pool!(self, |p| sqlx::query("SELECT 1")
                .execute(p)
                .await
                .map(|_| ()));
            match pinged {
                Err(sqlx::Error::PoolTimedOut) => Err(self.why_no_connection().await),
                other => Ok(other?),
            }
        })
        .await
    }

    /// Closes every pooled connection; later calls fail with [`StoreError::Unavailable`].
    pub async fn close(&self) {
        with_store!(self, |s| s.close().await);
    }
}

/// oncely's embedded migrations for `S`'s backend.
fn embedded_migrations<S: Store>(_: &S) -> sqlx::migrate::Migrator {
    S::migrations()
}

fn migrations_table_exists<S: Store>(_: &S) -> &'static str {
    S::MIGRATIONS_TABLE_EXISTS
}

fn backend_of<S: Store>(_: &S) -> Backend {
    S::BACKEND
}

impl Tx {
    /// Commits.
    ///
    /// # Errors
    /// [`StoreError`] when the commit fails; the transaction's writes are then lost.
    pub async fn commit(self) -> Result<(), StoreError> {
        with_tx!(self, |t: S| S::finish(t, true).await)?;
        Ok(())
    }

    /// Rolls back.
    ///
    /// # Errors
    /// [`StoreError`] when the rollback cannot be sent (the database discards the
    /// transaction anyway when the connection drops).
    pub async fn rollback(self) -> Result<(), StoreError> {
        with_tx!(self, |t: S| S::finish(t, false).await)?;
        Ok(())
    }

    /// Which backend this transaction runs on.
    pub fn backend(&self) -> Backend {
        with_tx!(self, |_t: S| S::BACKEND)
    }
}
