//! MySQL 8.0+ / MariaDB 10.6+: [`MySqlStore`], [`MySqlTx`], connecting and migrations, and
//! the stores' MySQL statements (no `UPDATE … RETURNING`, no `= ANY($1)`, `?` placeholders
//! bound by position, `_bin` columns selected through `CAST(… AS CHAR)` because sqlx
//! decodes a binary-collated column as bytes).

mod effects;
mod idempotency;
mod outbox;
mod queue;
mod reconcile;

use std::time::Duration;

use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlConnection, MySqlPool};
use sqlx::pool::{PoolConnection, PoolOptions};
use sqlx::query::{Query, QueryAs};
use sqlx::{Executor, MySql};

use crate::driver::{Backend, Store, Sweep};
use crate::{Database, DbOptions, StoreError, Tx};

/// [`in_list`](crate::in_list) for `ids`; `None` when there are none (a locking select
/// found nothing to write).
fn id_list(ids: &[i64]) -> Option<String> {
    (!ids.is_empty()).then(|| crate::in_list(ids.len()))
}

/// `query` with `ids` bound in order: the values of an `IN (…)` list of
/// [`in_list`](crate::in_list)`(ids.len())` placeholders (no array parameters on MySQL).
fn bind_ids<'q>(
    query: Query<'q, MySql, MySqlArguments>,
    ids: &[i64],
) -> Query<'q, MySql, MySqlArguments> {
    ids.iter().fold(query, |q, &id| q.bind(id))
}

/// [`bind_ids`] for a query that decodes rows into `O`.
fn bind_ids_as<'q, O>(
    query: QueryAs<'q, MySql, O, MySqlArguments>,
    ids: &[i64],
) -> QueryAs<'q, MySql, O, MySqlArguments> {
    ids.iter().fold(query, |q, &id| q.bind(id))
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

    /// The pool reads go to: [`MySqlStore::pool`] ([`on_pool!`](crate::on_pool)).
    pub fn read_pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The pool writes go to: [`MySqlStore::pool`] ([`on_writer!`](crate::on_writer)).
    pub fn write_pool(&self) -> &MySqlPool {
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

/// The statements every oncely MySQL connection runs when it opens: `READ COMMITTED` (see
/// [`MySqlStore`] for why), `innodb_lock_wait_timeout` and `lock_wait_timeout` =
/// [`DbOptions::lock_timeout`] rounded up to whole seconds, and the idle-transaction bound
/// ([`DbOptions::idle_transaction_timeout`]: MariaDB's `idle_transaction_timeout`, MySQL's
/// `wait_timeout`).
pub(crate) fn session_init(options: &DbOptions) -> String {
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
    format!(
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; \
         SET SESSION innodb_lock_wait_timeout = {lock_secs}; \
         SET SESSION lock_wait_timeout = {lock_secs} \
         /*M! , idle_transaction_timeout = {idle_secs} */; \
         SET SESSION wait_timeout = \
         IF(VERSION() LIKE '%MariaDB%', @@SESSION.wait_timeout, {idle_secs})"
    )
}

impl Database {
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
        let init = session_init(options);
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
        Ok(Self::from_mysql_pool(pool, options))
    }

    /// A database over a pool the caller built; [`DbOptions::store_timeout`] applies as on
    /// a connected one. oncely relies on `READ COMMITTED` sessions (see [`MySqlStore`]) and
    /// cannot change connections it did not open, so the caller's pool must run
    /// [`Database::mysql_session_init`] on every new connection (e.g. in
    /// `PoolOptions::after_connect`); without it the stores' inserts take gap locks and
    /// deadlock on neighbouring keys.
    pub fn from_mysql_pool(pool: MySqlPool, options: &DbOptions) -> Self {
        Self::MySql(MySqlStore {
            pool,
            store_timeout: options.store_timeout,
        })
    }

    /// The statements (one text, `;`-separated) [`Database::connect`] runs on every new
    /// MySQL / MariaDB connection (see [`Database::from_mysql_pool`]).
    pub fn mysql_session_init(options: &DbOptions) -> String {
        session_init(options)
    }

    /// The MySQL / MariaDB pool, if this is MySQL.
    // `_`: whichever other backends are compiled in (none, one or two).
    #[allow(unreachable_patterns, clippy::match_wildcard_for_single_variants)]
    pub fn as_mysql(&self) -> Option<&MySqlPool> {
        match self {
            Self::MySql(p) => Some(&p.pool),
            _ => None,
        }
    }
}

impl Store for MySqlStore {
    type Tx = MySqlTx;
    const BACKEND: Backend = Backend::MySql;
    const MIGRATIONS_TABLE_EXISTS: &'static str = "SELECT COUNT(*) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = '_sqlx_migrations'";

    fn migrations() -> sqlx::migrate::Migrator {
        sqlx::migrate!("./migrations/mysql")
    }

    fn store_timeout(&self) -> Option<Duration> {
        Some(self.store_timeout)
    }

    async fn begin(&self) -> Result<Tx, StoreError> {
        Ok(Tx::MySql(MySqlTx::begin(&self.pool).await?))
    }

    async fn finish(tx: MySqlTx, commit: bool) -> Result<(), sqlx::Error> {
        tx.finish(commit).await
    }

    async fn connect_error(&self) -> Option<sqlx::Error> {
        crate::driver::connect_error(&self.pool).await
    }

    async fn close(&self) {
        self.pool.close().await;
    }

    async fn sweep(&self, sweep: &Sweep, bound: i64, batch: i64) -> Result<u64, sqlx::Error> {
        let Sweep {
            table,
            filter,
            order_by,
            ..
        } = sweep;
        let sql = crate::dialect::question_marks(&format!(
            "DELETE FROM {table} WHERE {filter} ORDER BY {order_by} LIMIT $2"
        ));
        Ok(sqlx::query(&sql)
            .bind(bound)
            .bind(batch)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }
}
