use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool};
use sqlx::pool::{PoolConnection, PoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous};
use sqlx::{Executor, MySql, Postgres, Sqlite};

use crate::StoreError;

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

/// Which database a [`Database`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// SQLite, the embedded default.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL 8.0+ or MariaDB 10.6+.
    MySql,
}

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

/// PostgreSQL: one pool; `lock_timeout` and `idle_in_transaction_session_timeout` set on
/// every connection.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    store_timeout: Duration,
}

/// MySQL / MariaDB: one pool. Every connection runs at `READ COMMITTED` with
/// `innodb_lock_wait_timeout` set from [`DbOptions::lock_timeout`].
///
/// Why `READ COMMITTED` (InnoDB's default is `REPEATABLE READ`): a locking read or a
/// UNIQUE-index insert under `REPEATABLE READ` takes *gap* locks, so concurrent inserts of
/// neighbouring keys (idempotency records, inbox rows, outbox rows) block and deadlock on
/// each other although they never conflict; and its snapshot is fixed at the first read,
/// so a claim could miss a record committed a moment later and run the operation only to
/// lose at the insert. `READ COMMITTED` takes record locks only and each statement sees
/// the latest committed rows — the same semantics the PostgreSQL store relies on.
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    store_timeout: Duration,
}

impl MySqlStore {
    /// The connection pool (`READ COMMITTED` sessions).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }
}

/// A MySQL / MariaDB transaction on a pooled connection, begun with `BEGIN` and ended with
/// `COMMIT` or `ROLLBACK`. Dereferences to the connection, so queries run on `&mut **tx`.
///
/// The idempotency claim takes a *session*-scoped named lock (`GET_LOCK`), so ending such a
/// transaction also releases every named lock of the session (`RELEASE_ALL_LOCKS()`, sent
/// with the `COMMIT`/`ROLLBACK` in one round trip) before the connection goes back to the
/// pool; a transaction dropped unfinished (an
/// error path, a panic, a timed-out request) closes its connection instead, and the server
/// then rolls back and frees the locks with the session.
#[derive(Debug)]
pub struct MySqlTx {
    conn: Option<PoolConnection<MySql>>,
    /// Set by the idempotency claim: the session may hold a named lock to release.
    named_lock: bool,
}

impl std::ops::Deref for MySqlTx {
    type Target = MySqlConnection;
    fn deref(&self) -> &Self::Target {
        self.conn.as_ref().expect("MySqlTx used after it ended")
    }
}

impl std::ops::DerefMut for MySqlTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn.as_mut().expect("MySqlTx used after it ended")
    }
}

impl MySqlTx {
    async fn begin(pool: &MySqlPool) -> Result<Self, sqlx::Error> {
        // Wrapped before `BEGIN` goes out: if this future is dropped while `BEGIN` waits (a
        // frozen connection under the store timeout), the drop closes the session instead
        // of handing a connection with an unknown state back to the pool.
        let mut tx = Self {
            conn: Some(pool.acquire().await?),
            named_lock: false,
        };
        (&mut *tx).execute("BEGIN").await?;
        Ok(tx)
    }

    /// Records that this transaction's session took a named lock (`GET_LOCK`), so ending
    /// the transaction must release it.
    pub(crate) fn took_named_lock(&mut self) {
        self.named_lock = true;
    }

    async fn finish(mut self, commit: bool) -> Result<(), sqlx::Error> {
        let mut conn = self.conn.take().expect("MySqlTx ends once");
        // One round trip: the server runs the release only if the COMMIT/ROLLBACK succeeded
        // (a multi-statement text query stops at the first error).
        let end = match (commit, self.named_lock) {
            (true, false) => "COMMIT",
            (false, false) => "ROLLBACK",
            (true, true) => "COMMIT; DO RELEASE_ALL_LOCKS()",
            (false, true) => "ROLLBACK; DO RELEASE_ALL_LOCKS()",
        };
        let result = (&mut *conn).execute(end).await;
        if result.is_err() {
            // The session's state (transaction, named locks) is unknown: never hand it to
            // another request; closing it makes the server roll back and free the locks.
            conn.close_on_drop();
        }
        result.map(|_| ())
    }
}

impl Drop for MySqlTx {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            // Unfinished: closing the session rolls back and releases its named locks.
            conn.close_on_drop();
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
}

impl PgStore {
    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// A database oncely stores into. Cheap to clone (pools are reference counted).
///
/// Exhaustive on purpose: [`on_tx!`] and [`on_pool!`] expand one arm per backend, and a new
/// backend must be a compile error wherever SQL is dispatched.
#[derive(Debug, Clone)]
pub enum Database {
    /// SQLite file.
    Sqlite(SqliteStore),
    /// PostgreSQL server.
    Postgres(PgStore),
    /// MySQL or MariaDB server.
    MySql(MySqlStore),
}

/// An open transaction on either backend. Dropping it rolls back.
#[derive(Debug)]
pub enum Tx {
    /// SQLite transaction (holds the write lock).
    Sqlite(SqliteTx),
    /// PostgreSQL transaction.
    Postgres(sqlx::Transaction<'static, Postgres>),
    /// MySQL / MariaDB transaction (`READ COMMITTED`).
    MySql(MySqlTx),
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
        if url.starts_with("sqlite:") {
            let opts = SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(options.lock_timeout)
                .foreign_keys(true);
            let write = PoolOptions::<Sqlite>::new()
                .max_connections(1)
                .acquire_timeout(options.acquire_timeout)
                .connect_with(opts.clone())
                .await?;
            let read = PoolOptions::<Sqlite>::new()
                .max_connections(options.max_connections.clamp(1, 8))
                .acquire_timeout(options.acquire_timeout)
                .connect_with(opts.read_only(true))
                .await?;
            Ok(Self::Sqlite(SqliteStore {
                write,
                read,
                poisoned: Arc::new(AtomicBool::new(false)),
            }))
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let opts = PgConnectOptions::from_str(url)?;
            Self::connect_postgres(opts, options).await
        } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
            let url = url
                .strip_prefix("mariadb:")
                .map_or_else(|| url.to_owned(), |rest| format!("mysql:{rest}"));
            let opts = MySqlConnectOptions::from_str(&url)?;
            Self::connect_mysql(opts, options).await
        } else {
            Err(StoreError::UnsupportedUrl(url.to_owned()))
        }
    }

    /// Connects to PostgreSQL with explicit connect options (tests use this to pin a
    /// `search_path`).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the server cannot be reached.
    pub async fn connect_postgres(
        opts: PgConnectOptions,
        options: &DbOptions,
    ) -> Result<Self, StoreError> {
        let lock_ms = options.lock_timeout.as_millis().to_string();
        // A session that stalls inside a transaction (a client that died or froze
        // mid-request) must not hold its locks for ever: the server ends it.
        let idle_ms = options
            .idle_transaction_timeout
            .as_millis()
            .max(1)
            .to_string();
        let opts = opts.options([
            ("lock_timeout", lock_ms.as_str()),
            ("idle_in_transaction_session_timeout", idle_ms.as_str()),
        ]);
        let pool = PoolOptions::<Postgres>::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .connect_with(opts)
            .await?;
        Ok(Self::Postgres(PgStore {
            pool,
            store_timeout: options.store_timeout,
        }))
    }

    /// Connects to MySQL / MariaDB with explicit connect options. Each new connection is
    /// set to `READ COMMITTED` (see [`MySqlStore`] for why) with `innodb_lock_wait_timeout`
    /// and `lock_wait_timeout` = [`DbOptions::lock_timeout`] rounded up to whole seconds.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the server cannot be reached.
    pub async fn connect_mysql(
        opts: MySqlConnectOptions,
        options: &DbOptions,
    ) -> Result<Self, StoreError> {
        let lock_secs = options
            .lock_timeout
            .as_millis()
            .div_ceil(1000)
            .clamp(1, 1_073_741_824);
        // innodb_lock_wait_timeout bounds row-lock waits, lock_wait_timeout metadata-lock
        // waits (a table held by DDL or LOCK TABLES; default one day): both end in error
        // 1205, which is `StoreError::Unavailable` (503), never a stuck request.
        let idle_secs = options
            .idle_transaction_timeout
            .as_millis()
            .div_ceil(1000)
            .clamp(1, 31_536_000);
        // A session idle inside a transaction is ended by the server after `idle_secs`,
        // which rolls it back and frees its named locks (they belong to the session):
        // MariaDB's `idle_transaction_timeout` (read only by MariaDB, in a `/*M! */`
        // comment); MySQL 8 has no such variable, so there `wait_timeout` (any idle
        // session) is lowered instead, and MariaDB keeps its own `wait_timeout`.
        let init = format!(
            "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; \
             SET SESSION innodb_lock_wait_timeout = {lock_secs}; \
             SET SESSION lock_wait_timeout = {lock_secs} \
             /*M! , idle_transaction_timeout = {idle_secs} */; \
             SET SESSION wait_timeout = \
             IF(VERSION() LIKE '%MariaDB%', @@SESSION.wait_timeout, {idle_secs})"
        );
        let pool = PoolOptions::<MySql>::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .after_connect(move |conn, _| {
                let init = init.clone();
                Box::pin(async move {
                    conn.execute(init.as_str()).await?;
                    Ok(())
                })
            })
            .connect_with(opts)
            .await?;
        Ok(Self::MySql(MySqlStore {
            pool,
            store_timeout: options.store_timeout,
        }))
    }

    /// Applies oncely's embedded migrations (idempotency tables). Safe to run from several
    /// processes at once; applications with their own tables run their own migrator too
    /// (migration versions 1–9999 belong to oncely).
    ///
    /// # Errors
    /// [`StoreError::Migrate`] when a migration fails or the database cannot be reached.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.run_migrator(
            sqlx::migrate!("./migrations/sqlite"),
            sqlx::migrate!("./migrations/postgres"),
            sqlx::migrate!("./migrations/mysql"),
        )
        .await
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
        let (migrator, table_exists) = match self {
            Self::Sqlite(_) => (
                sqlx::migrate!("./migrations/sqlite"),
                "SELECT COUNT(*) FROM sqlite_master \
                 WHERE type = 'table' AND name = '_sqlx_migrations'",
            ),
            Self::Postgres(_) => (
                sqlx::migrate!("./migrations/postgres"),
                "SELECT COUNT(to_regclass('_sqlx_migrations'))",
            ),
            Self::MySql(_) => (
                sqlx::migrate!("./migrations/mysql"),
                "SELECT COUNT(*) FROM information_schema.tables \
                 WHERE table_schema = DATABASE() AND table_name = '_sqlx_migrations'",
            ),
        };
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

    /// Runs one migrator per backend against this database (the one matching its backend),
    /// tolerating migrations applied by other migrators in the same database.
    ///
    /// # Errors
    /// [`StoreError::Migrate`] when a migration fails.
    pub async fn run_migrator(
        &self,
        sqlite: sqlx::migrate::Migrator,
        postgres: sqlx::migrate::Migrator,
        mysql: sqlx::migrate::Migrator,
    ) -> Result<(), StoreError> {
        let mut m = match self {
            Self::Sqlite(_) => sqlite,
            Self::Postgres(_) => postgres,
            Self::MySql(_) => mysql,
        };
        m.set_ignore_missing(true);
        match self {
            Self::Sqlite(s) => m.run(&s.write).await,
            Self::Postgres(p) => m.run(&p.pool).await,
            Self::MySql(p) => m.run(&p.pool).await,
        }
        .map_err(StoreError::Migrate)
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
            match self.begin_unbounded().await {
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
        let limit = match self {
            Self::Sqlite(_) => return op.await,
            Self::Postgres(p) => p.store_timeout,
            Self::MySql(p) => p.store_timeout,
        };
        tokio::time::timeout(limit, op)
            .await
            .unwrap_or(Err(StoreError::TimedOut(limit)))
    }

    /// sqlx reports "pool timed out" both when every connection is busy and when none can
    /// be opened (it retries a refused connect until the acquire deadline). One direct
    /// connection attempt (at most 1 s) tells which, so the error names the root cause.
    async fn why_no_connection(&self) -> StoreError {
        let failure = match self {
            Self::Sqlite(_) => None,
            Self::Postgres(p) => connect_error(&p.pool).await,
            Self::MySql(p) => connect_error(&p.pool).await,
        };
        StoreError::Unavailable(failure.unwrap_or(sqlx::Error::PoolTimedOut))
    }

    async fn begin_unbounded(&self) -> Result<Tx, StoreError> {
        Ok(match self {
            Self::Sqlite(s) => {
                if s.poisoned.swap(false, Ordering::SeqCst) {
                    tracing::warn!(
                        "recycling the SQLite writer connection after a failed transaction"
                    );
                    let conn = s.write.acquire().await?;
                    drop(conn.close().await);
                }
                Tx::Sqlite(SqliteTx {
                    tx: Some(s.write.begin_with("BEGIN IMMEDIATE").await?),
                    poisoned: s.poisoned.clone(),
                })
            }
            Self::Postgres(p) => Tx::Postgres(p.pool.begin().await?),
            Self::MySql(p) => Tx::MySql(MySqlTx::begin(&p.pool).await?),
        })
    }

    /// Which backend this is.
    pub fn backend(&self) -> Backend {
        match self {
            Self::Sqlite(_) => Backend::Sqlite,
            Self::Postgres(_) => Backend::Postgres,
            Self::MySql(_) => Backend::MySql,
        }
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
        match self {
            Self::Sqlite(s) => {
                s.write.close().await;
                s.read.close().await;
            }
            Self::Postgres(p) => p.pool.close().await,
            Self::MySql(p) => p.pool.close().await,
        }
    }

    /// The SQLite pools (writer, readers), if this is SQLite.
    pub fn as_sqlite(&self) -> Option<(&SqlitePool, &SqlitePool)> {
        match self {
            Self::Sqlite(s) => Some((&s.write, &s.read)),
            Self::Postgres(_) | Self::MySql(_) => None,
        }
    }

    /// The PostgreSQL pool, if this is PostgreSQL.
    pub fn as_postgres(&self) -> Option<&PgPool> {
        match self {
            Self::Postgres(p) => Some(&p.pool),
            Self::Sqlite(_) | Self::MySql(_) => None,
        }
    }

    /// The MySQL / MariaDB pool, if this is MySQL.
    pub fn as_mysql(&self) -> Option<&MySqlPool> {
        match self {
            Self::MySql(p) => Some(&p.pool),
            Self::Sqlite(_) | Self::Postgres(_) => None,
        }
    }
}

/// The error of one direct connection attempt with `pool`'s options (at most 1 s), or `None`
/// when it connects (or cannot tell within the second).
async fn connect_error<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> Option<sqlx::Error> {
    use sqlx::{ConnectOptions as _, Connection as _};
    let opts = pool.connect_options();
    match tokio::time::timeout(Duration::from_secs(1), opts.connect()).await {
        Ok(Ok(conn)) => {
            drop(conn.close().await);
            None
        }
        Ok(Err(e)) => Some(e),
        Err(_) => None,
    }
}

impl Tx {
    /// Commits.
    ///
    /// # Errors
    /// [`StoreError`] when the commit fails; the transaction's writes are then lost.
    pub async fn commit(self) -> Result<(), StoreError> {
        match self {
            Self::Sqlite(t) => t.finish(true).await?,
            Self::Postgres(t) => t.commit().await?,
            Self::MySql(t) => t.finish(true).await?,
        }
        Ok(())
    }

    /// Rolls back.
    ///
    /// # Errors
    /// [`StoreError`] when the rollback cannot be sent (the database discards the
    /// transaction anyway when the connection drops).
    pub async fn rollback(self) -> Result<(), StoreError> {
        match self {
            Self::Sqlite(t) => t.finish(false).await?,
            Self::Postgres(t) => t.rollback().await?,
            Self::MySql(t) => t.finish(false).await?,
        }
        Ok(())
    }

    /// Which backend this transaction runs on.
    pub fn backend(&self) -> Backend {
        match self {
            Self::Sqlite(_) => Backend::Sqlite,
            Self::Postgres(_) => Backend::Postgres,
            Self::MySql(_) => Backend::MySql,
        }
    }
}

/// Runs the same expression on whichever connection a [`Tx`] holds. The expression is
/// compiled once per backend, so one SQL text serves all three: write it with `$1`-style
/// placeholders (SQLite and PostgreSQL) and pass it through [`sql_text`], which turns them
/// into MySQL's `?` on a MySQL connection.
///
/// ```text
/// let n = on_tx!(tx, |c| sqlx::query(&sql_text(c, "DELETE FROM t WHERE id = $1"))
///     .bind(id).execute(c).await)?;
/// ```
#[macro_export]
macro_rules! on_tx {
    ($tx:expr, |$c:ident| $body:expr) => {
        match $tx {
            $crate::Tx::Sqlite(t) => {
                let $c = &mut **t;
                $body
            }
            $crate::Tx::Postgres(t) => {
                let $c = &mut **t;
                $body
            }
            $crate::Tx::MySql(t) => {
                let $c = &mut **t;
                $body
            }
        }
    };
}

/// Runs the same expression on a [`Database`]'s read pool (the SQLite reader pool, the
/// PostgreSQL or the MySQL pool), compiled once per backend like [`on_tx!`].
#[macro_export]
macro_rules! on_pool {
    ($db:expr, |$p:ident| $body:expr) => {
        match $db {
            $crate::Database::Sqlite(s) => {
                let $p = s.reader();
                $body
            }
            $crate::Database::Postgres(s) => {
                let $p = s.pool();
                $body
            }
            $crate::Database::MySql(s) => {
                let $p = s.pool();
                $body
            }
        }
    };
}

/// Runs the same expression on a [`Database`]'s *write* side (the SQLite single-writer pool,
/// the PostgreSQL or the MySQL pool), compiled once per backend like [`on_tx!`]: for
/// statements outside a caller's transaction whose SQL text is the same on every backend
/// (placeholders through [`sql_text`]).
#[macro_export]
macro_rules! on_writer {
    ($db:expr, |$p:ident| $body:expr) => {
        match $db {
            $crate::Database::Sqlite(s) => {
                let $p = s.writer();
                $body
            }
            $crate::Database::Postgres(s) => {
                let $p = s.pool();
                $body
            }
            $crate::Database::MySql(s) => {
                let $p = s.pool();
                $body
            }
        }
    };
}
