//! The one place that chooses a backend: the [`Database`] and [`Tx`] enums, [`Backend`],
//! connecting by URL scheme, and the dispatch macros. Every other portable module reaches
//! a backend through [`with_store!`] / [`with_tx!`] and one internal trait per store
//! (implemented in `sqlite/`, `postgres/` and `mysql/`), never by naming a variant.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

#[cfg(feature = "mysql")]
use crate::mysql::{MySqlStore, MySqlTx};
#[cfg(feature = "postgres")]
use crate::postgres::PgStore;
#[cfg(feature = "sqlite")]
use crate::sqlite::{SqliteStore, SqliteTx};
use crate::{DbOptions, StoreError};

/// Which database a [`Database`] talks to. `Display` gives a human name ("SQLite",
/// "PostgreSQL", "MySQL / MariaDB"); [`Backend::as_str`] the short one used in URLs, logs
/// and metrics labels.
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

impl Backend {
    /// The short, stable name: `sqlite`, `postgres` or `mysql`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
        }
    }

    /// `true` when deleted and updated rows leave dead row versions behind that only a
    /// `VACUUM` removes, so a relay that deletes many rows should vacuum the outbox
    /// ([`crate::OutboxStore::vacuum`]) rather than wait for autovacuum: PostgreSQL.
    /// SQLite reuses freed pages and InnoDB purges by itself.
    pub fn needs_vacuum(self) -> bool {
        matches!(self, Self::Postgres)
    }

    /// `true` when `SELECT … FOR UPDATE` locks rows (PostgreSQL, MySQL); SQLite has no row
    /// locks — its single writer already holds the whole database for the transaction.
    pub fn supports_row_locks(self) -> bool {
        !matches!(self, Self::Sqlite)
    }

    /// `true` when placeholders are MySQL's positional `?` (SQL written with `$n` is
    /// rewritten by [`crate::sql_text`] and [`crate::query`]).
    pub fn uses_question_marks(self) -> bool {
        matches!(self, Self::MySql)
    }

    /// A select-list item that reads `column` as text: `column` on SQLite and PostgreSQL;
    /// `CAST(column AS CHAR) AS column` on MySQL, whose binary-collated (`utf8mb4_bin`,
    /// compared byte for byte) columns sqlx decodes as bytes, not text.
    pub fn text_column(self, column: &str) -> Cow<'_, str> {
        match self {
            Self::MySql => Cow::Owned(format!("CAST({column} AS CHAR) AS {column}")),
            Self::Sqlite | Self::Postgres => Cow::Borrowed(column),
        }
    }

    /// `insert` (an `INSERT … VALUES (…)` with `$n` placeholders) as this backend spells an
    /// insert that does nothing when the row's `target` key (e.g. `"(consumer, message_id)"`,
    /// or `""` for any unique key) exists: `… ON CONFLICT target DO NOTHING` on SQLite and
    /// PostgreSQL; on MySQL the plain insert (placeholders rewritten), whose duplicate-key
    /// error [`Backend::duplicate_ignored`] turns into "nothing inserted" (`INSERT IGNORE`
    /// would also silence truncation and other errors).
    pub(crate) fn insert_ignoring_duplicate_sql<'a>(
        self,
        insert: &'a str,
        target: &str,
    ) -> Cow<'a, str> {
        match self {
            Self::MySql => Cow::Owned(crate::dialect::question_marks(insert)),
            Self::Sqlite | Self::Postgres => {
                Cow::Owned(format!("{insert} ON CONFLICT {target} DO NOTHING"))
            }
        }
    }

    /// The outcome of a statement from [`Backend::insert_ignoring_duplicate_sql`] (its rows
    /// affected): `true` when it inserted, `false` on a duplicate — MySQL's `ER_DUP_ENTRY`
    /// (1062, SQLSTATE 23000) included.
    pub(crate) fn duplicate_ignored(
        self,
        rows_affected: Result<u64, sqlx::Error>,
    ) -> Result<bool, sqlx::Error> {
        match rows_affected {
            Ok(n) => Ok(n > 0),
            Err(e) if self == Self::MySql && crate::error::is_unique_violation(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sqlite => "SQLite",
            Self::Postgres => "PostgreSQL",
            Self::MySql => "MySQL / MariaDB",
        })
    }
}

/// A database oncely stores into. Cheap to clone (pools are reference counted).
///
/// One variant per backend feature (`sqlite`, the default; `postgres`; `mysql`).
///
/// Exhaustive on purpose: [`on_tx!`] and [`on_pool!`] expand one arm per backend, and a new
/// backend must be a compile error wherever SQL is dispatched. Matching on the variants is
/// the escape hatch for backend-specific SQL; the portable API ([`crate::query`],
/// [`Database::fetch_optional`], [`Tx::execute`], …) covers the common cases.
#[derive(Debug, Clone)]
pub enum Database {
    /// SQLite file (feature `sqlite`).
    #[cfg(feature = "sqlite")]
    Sqlite(SqliteStore),
    /// PostgreSQL server (feature `postgres`).
    #[cfg(feature = "postgres")]
    Postgres(PgStore),
    /// MySQL or MariaDB server (feature `mysql`).
    #[cfg(feature = "mysql")]
    MySql(MySqlStore),
}

/// An open transaction on either backend. Dropping it rolls back. Matching on the variants
/// is the escape hatch, like [`Database`]'s.
#[derive(Debug)]
pub enum Tx {
    /// SQLite transaction (holds the write lock).
    #[cfg(feature = "sqlite")]
    Sqlite(SqliteTx),
    /// PostgreSQL transaction.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// MySQL / MariaDB transaction (`READ COMMITTED`).
    #[cfg(feature = "mysql")]
    MySql(MySqlTx),
}

/// An application's own migration sets, one per backend it supports, for
/// [`Database::run_migrator`]: give only the sets of the backends the application runs on.
///
/// ```text
/// db.run_migrator(Migrations::new().postgres(sqlx::migrate!("./migrations/postgres"))).await?;
/// ```
#[derive(Debug, Default)]
pub struct Migrations {
    sqlite: Option<sqlx::migrate::Migrator>,
    postgres: Option<sqlx::migrate::Migrator>,
    mysql: Option<sqlx::migrate::Migrator>,
}

impl Migrations {
    /// No sets yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The set for SQLite.
    #[must_use]
    pub fn sqlite(mut self, migrator: sqlx::migrate::Migrator) -> Self {
        self.sqlite = Some(migrator);
        self
    }

    /// The set for PostgreSQL.
    #[must_use]
    pub fn postgres(mut self, migrator: sqlx::migrate::Migrator) -> Self {
        self.postgres = Some(migrator);
        self
    }

    /// The set for MySQL / MariaDB.
    #[must_use]
    pub fn mysql(mut self, migrator: sqlx::migrate::Migrator) -> Self {
        self.mysql = Some(migrator);
        self
    }

    /// The set for `backend`, if one was given.
    pub(crate) fn into_set(self, backend: Backend) -> Option<sqlx::migrate::Migrator> {
        match backend {
            Backend::Sqlite => self.sqlite,
            Backend::Postgres => self.postgres,
            Backend::MySql => self.mysql,
        }
    }
}

/// What every backend's store provides to the portable [`Database`] and [`Tx`] methods.
pub(crate) trait Store {
    /// The backend's transaction type, as held by [`Tx`].
    type Tx;
    /// Which backend this is.
    const BACKEND: Backend;
    /// oncely's embedded migrations for this backend.
    fn migrations() -> sqlx::migrate::Migrator;
    /// One row, one `i64` column: 1 when sqlx's `_sqlx_migrations` table exists.
    const MIGRATIONS_TABLE_EXISTS: &'static str;
    /// The bound of [`Database::within_store_timeout`]; `None` for unbounded (SQLite).
    fn store_timeout(&self) -> Option<Duration>;
    /// Begins a transaction, unbounded by the store timeout.
    async fn begin(&self) -> Result<Tx, StoreError>;
    /// Ends `tx`, committing when `commit`.
    async fn finish(tx: Self::Tx, commit: bool) -> Result<(), sqlx::Error>;
    /// Why a new connection cannot be opened (one attempt, at most 1 s), if it cannot.
    async fn connect_error(&self) -> Option<sqlx::Error>;
    /// Runs `migrator` on the write side.
    async fn run(
        &self,
        migrator: &sqlx::migrate::Migrator,
    ) -> Result<(), sqlx::migrate::MigrateError>;
    /// Closes every pooled connection.
    async fn close(&self);
    /// Deletes up to `batch` rows of `sweep` whose filter matches with `$1` = `bound`, in
    /// its own short transaction; the rows deleted.
    async fn sweep(&self, sweep: &Sweep, bound: i64, batch: i64) -> Result<u64, sqlx::Error>;
}

/// A batched retention sweep: `DELETE` up to a batch of the rows of `table` matching
/// `filter` (with `$1`, the bound, e.g. `expires_at < $1`), oldest `order_by` first where
/// the backend orders deletes. Each backend spells it once (`Store::sweep`):
/// - SQLite: `DELETE … WHERE rowid IN (SELECT rowid … LIMIT n)` on the single writer;
/// - PostgreSQL: the locked batch as a materialised CTE (`FOR UPDATE SKIP LOCKED`, so the
///   `LIMIT` holds — an `IN (SELECT … LIMIT … SKIP LOCKED)` subquery may be re-run and
///   delete more) and rows taken by TID, with the plan pinned (`crate::plan`);
/// - MySQL / MariaDB: a single-table `DELETE … ORDER BY order_by LIMIT n`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sweep {
    /// The table.
    pub(crate) table: &'static str,
    /// The rows to delete, with `$1` for the bound.
    pub(crate) filter: &'static str,
    /// The column MySQL deletes in order of.
    pub(crate) order_by: &'static str,
}

/// Runs `$body` with `$s` bound to the backend store inside a [`Database`].
macro_rules! with_store {
    ($db:expr, |$s:ident| $body:expr) => {
        match $db {
            #[cfg(feature = "sqlite")]
            $crate::Database::Sqlite($s) => $body,
            #[cfg(feature = "postgres")]
            $crate::Database::Postgres($s) => $body,
            #[cfg(feature = "mysql")]
            $crate::Database::MySql($s) => $body,
        }
    };
}
pub(crate) use with_store;

/// Runs `$body` with `$t` bound to the backend transaction inside a [`Tx`] and `$S` naming
/// that backend's store type (whose per-store traits take `&mut $S::Tx`).
macro_rules! with_tx {
    ($tx:expr, |$t:ident : $S:ident| $body:expr) => {
        match $tx {
            #[cfg(feature = "sqlite")]
            $crate::Tx::Sqlite($t) => {
                type $S = $crate::SqliteStore;
                $body
            }
            #[cfg(feature = "postgres")]
            $crate::Tx::Postgres($t) => {
                type $S = $crate::PgStore;
                $body
            }
            #[cfg(feature = "mysql")]
            $crate::Tx::MySql($t) => {
                type $S = $crate::MySqlStore;
                $body
            }
        }
    };
}
pub(crate) use with_tx;

/// Connects to `url` by its scheme (see [`Database::connect`]); a scheme whose backend's
/// feature is off is [`StoreError::UnsupportedUrl`].
pub(crate) async fn connect(url: &str, options: &DbOptions) -> Result<Database, StoreError> {
    #[cfg(feature = "sqlite")]
    if url.starts_with("sqlite:") {
        return Ok(Database::Sqlite(SqliteStore::connect(url, options).await?));
    }
    #[cfg(feature = "postgres")]
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        let opts: sqlx::postgres::PgConnectOptions = url.parse()?;
        return Database::connect_postgres(opts, options).await;
    }
    #[cfg(feature = "mysql")]
    if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        let url = url
            .strip_prefix("mariadb:")
            .map_or_else(|| url.to_owned(), |rest| format!("mysql:{rest}"));
        let opts: sqlx::mysql::MySqlConnectOptions = url.parse()?;
        return Database::connect_mysql(opts, options).await;
    }
    let _ = options;
    Err(StoreError::UnsupportedUrl(url.to_owned()))
}

/// Calls `$crate::$m!` with the list of the backends compiled in (`[Sqlite Postgres
/// MySql]` or a part of it) before `$args`, so the exported dispatch macros expand one arm
/// per enabled backend whatever the features of the crate that invokes them.
#[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([Sqlite Postgres MySql] $($args)*)
    };
}
#[cfg(all(feature = "sqlite", feature = "postgres", not(feature = "mysql")))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([Sqlite Postgres] $($args)*)
    };
}
#[cfg(all(feature = "sqlite", not(feature = "postgres"), feature = "mysql"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([Sqlite MySql] $($args)*)
    };
}
#[cfg(all(not(feature = "sqlite"), feature = "postgres", feature = "mysql"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([Postgres MySql] $($args)*)
    };
}
#[cfg(all(feature = "sqlite", not(feature = "postgres"), not(feature = "mysql")))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([Sqlite] $($args)*)
    };
}
#[cfg(all(not(feature = "sqlite"), feature = "postgres", not(feature = "mysql")))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([Postgres] $($args)*)
    };
}
#[cfg(all(not(feature = "sqlite"), not(feature = "postgres"), feature = "mysql"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __backends {
    ($m:ident!($($args:tt)*)) => {
        $crate::$m!([MySql] $($args)*)
    };
}
#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!("oncely-sql needs at least one backend feature: sqlite, postgres or mysql");

/// [`on_tx!`]'s expansion over the enabled backends `[$v …]`.
#[doc(hidden)]
#[macro_export]
macro_rules! __on_tx {
    ([$($v:ident)*] ($tx:expr, $c:ident, $body:expr)) => {
        match $tx {
            $($crate::Tx::$v(t) => {
                let $c = &mut **t;
                $body
            })*
        }
    };
}

/// [`on_pool!`]'s and [`on_writer!`]'s expansion over the enabled backends `[$v …]`.
#[doc(hidden)]
#[macro_export]
macro_rules! __on_store {
    ([$($v:ident)*] ($db:expr, $pool:ident, $p:ident, $body:expr)) => {
        match $db {
            $($crate::Database::$v(s) => {
                let $p = s.$pool();
                $body
            })*
        }
    };
}

/// Runs the same expression on whichever connection a [`Tx`] holds. The expression is
/// compiled once per backend, so one SQL text serves all three: write it with `$1`-style
/// placeholders (SQLite and PostgreSQL) and pass it through [`sql_text`](crate::sql_text),
/// which turns them into MySQL's `?` on a MySQL connection.
///
/// The escape hatch for SQL the portable API ([`crate::query`] with [`Tx::execute`],
/// [`Tx::fetch_optional`], …) does not cover, e.g. binding a type outside
/// [`crate::Value`].
///
/// ```text
/// let n = on_tx!(tx, |c| sqlx::query(&sql_text(c, "DELETE FROM t WHERE id = $1"))
///     .bind(id).execute(c).await)?;
/// ```
#[macro_export]
macro_rules! on_tx {
    ($tx:expr, |$c:ident| $body:expr) => {
        $crate::__backends!(__on_tx!(($tx, $c, $body)))
    };
}

/// Runs the same expression on a [`Database`]'s read pool (the SQLite reader pool, the
/// PostgreSQL or the MySQL pool: each store's `read_pool()`), compiled once per backend
/// like [`on_tx!`]; the escape hatch next to [`Database::fetch_optional`] and
/// [`Database::fetch_all`].
#[macro_export]
macro_rules! on_pool {
    ($db:expr, |$p:ident| $body:expr) => {
        $crate::__backends!(__on_store!(($db, read_pool, $p, $body)))
    };
}

/// Runs the same expression on a [`Database`]'s *write* side (the SQLite single-writer pool,
/// the PostgreSQL or the MySQL pool: each store's `write_pool()`), compiled once per
/// backend like [`on_tx!`]: for statements outside a caller's transaction whose SQL text is
/// the same on every backend (placeholders through [`sql_text`](crate::sql_text)).
#[macro_export]
macro_rules! on_writer {
    ($db:expr, |$p:ident| $body:expr) => {
        $crate::__backends!(__on_store!(($db, write_pool, $p, $body)))
    };
}
