//! PostgreSQL: [`PgStore`], connecting and migrations, and the stores' PostgreSQL
//! statements.

mod effects;
mod idempotency;
mod outbox;
mod queue;
mod reconcile;

pub(crate) use outbox::settle_locked;

use std::time::Duration;

use sqlx::pool::PoolOptions;
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::Postgres;

use crate::driver::{Backend, Store, Sweep};
use crate::{Database, DbOptions, StoreError, Tx};

/// PostgreSQL: one pool; `lock_timeout` and `idle_in_transaction_session_timeout` set on
/// every connection.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    store_timeout: Duration,
}

impl PgStore {
    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The pool reads go to: [`PgStore::pool`] ([`on_pool!`](crate::on_pool)).
    pub fn read_pool(&self) -> &PgPool {
        &self.pool
    }

    /// The pool writes go to: [`PgStore::pool`] ([`on_writer!`](crate::on_writer)).
    pub fn write_pool(&self) -> &PgPool {
        &self.pool
    }
}

/// The session settings every oncely PostgreSQL connection has: `lock_timeout` =
/// [`DbOptions::lock_timeout`], `idle_in_transaction_session_timeout` =
/// [`DbOptions::idle_transaction_timeout`] (both in ms).
fn session_settings(opts: PgConnectOptions, options: &DbOptions) -> PgConnectOptions {
    let lock_ms = options.lock_timeout.as_millis().to_string();
    // A session that stalls inside a transaction (a client that died or froze
    // mid-request) must not hold its locks for ever: the server ends it.
    let idle_ms = options
        .idle_transaction_timeout
        .as_millis()
        .max(1)
        .to_string();
    opts.options([
        ("lock_timeout", lock_ms.as_str()),
        ("idle_in_transaction_session_timeout", idle_ms.as_str()),
    ])
}

impl Database {
    /// Connects to PostgreSQL with explicit connect options (tests use this to pin a
    /// `search_path`).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the server cannot be reached.
    pub async fn connect_postgres(
        opts: PgConnectOptions,
        options: &DbOptions,
    ) -> Result<Self, StoreError> {
        let pool = PoolOptions::<Postgres>::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .connect_with(session_settings(opts, options))
            .await?;
        Ok(Self::from_postgres_pool(pool, options))
    }

    /// A database over a pool the caller built; [`DbOptions::store_timeout`] applies as on
    /// a connected one (pool sizes and acquire timeout are the pool's own). oncely cannot
    /// change the settings of connections it did not open, so the caller sets on the
    /// pool's connect options what [`Database::connect`] sets on every connection:
    /// `lock_timeout` and `idle_in_transaction_session_timeout` (see [`DbOptions`]);
    /// [`Database::postgres_connect_options`] gives options with exactly those. Without
    /// them a lock wait or a stalled transaction is bounded only by the server's defaults
    /// (none).
    pub fn from_postgres_pool(pool: PgPool, options: &DbOptions) -> Self {
        Self::Postgres(PgStore {
            pool,
            store_timeout: options.store_timeout,
        })
    }

    /// `opts` with the session settings [`Database::connect`] gives a PostgreSQL
    /// connection (see [`Database::from_postgres_pool`]).
    pub fn postgres_connect_options(
        opts: PgConnectOptions,
        options: &DbOptions,
    ) -> PgConnectOptions {
        session_settings(opts, options)
    }

    /// The PostgreSQL pool, if this is PostgreSQL.
    // `_`: whichever other backends are compiled in (none, one or two).
    #[allow(unreachable_patterns, clippy::match_wildcard_for_single_variants)]
    pub fn as_postgres(&self) -> Option<&PgPool> {
        match self {
            Self::Postgres(p) => Some(&p.pool),
            _ => None,
        }
    }
}

impl Store for PgStore {
    type Tx = sqlx::Transaction<'static, Postgres>;
    const BACKEND: Backend = Backend::Postgres;
    const MIGRATIONS_TABLE_EXISTS: &'static str = "SELECT COUNT(to_regclass('_sqlx_migrations'))";

    fn migrations() -> sqlx::migrate::Migrator {
        sqlx::migrate!("./migrations/postgres")
    }

    fn store_timeout(&self) -> Option<Duration> {
        Some(self.store_timeout)
    }

    async fn begin(&self) -> Result<Tx, StoreError> {
        Ok(Tx::Postgres(self.pool.begin().await?))
    }

    async fn finish(tx: Self::Tx, commit: bool) -> Result<(), sqlx::Error> {
        if commit {
            tx.commit().await
        } else {
            tx.rollback().await
        }
    }

    async fn connect_error(&self) -> Option<sqlx::Error> {
        crate::driver::connect_error(&self.pool).await
    }

    async fn close(&self) {
        self.pool.close().await;
    }

    async fn sweep(&self, sweep: &Sweep, bound: i64, batch: i64) -> Result<u64, sqlx::Error> {
        let Sweep { table, filter, .. } = sweep;
        let sql = format!(
            "WITH doomed AS MATERIALIZED (SELECT ctid FROM {table} \
             WHERE {filter} LIMIT $2 FOR UPDATE SKIP LOCKED) \
             DELETE FROM {table} WHERE ctid = ANY (ARRAY(SELECT d.ctid FROM doomed d))"
        );
        crate::execute_pinned(&self.pool, sqlx::query(&sql).bind(bound).bind(batch)).await
    }
}
