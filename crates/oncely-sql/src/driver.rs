//! The driver contract, naming no driver: [`Backend`] (a backend's name and capabilities),
//! [`Migrations`], and `Store`, what every backend's store provides to the portable
//! [`Database`](crate::Database) and [`Tx`](crate::Tx) methods, with the batched retention
//! `Sweep` each backend spells once. `sqlite/`, `postgres/` and `mysql/` implement it, below
//! it; `backend` dispatches to them.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use crate::{StoreError, Tx};

/// Which database a [`Database`](crate::Database) talks to. `Display` gives a human name ("SQLite",
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

    /// ` INDEXED BY index` on SQLite, to follow a table name in `FROM`: it pins the index the
    /// statement reads, where SQLite's planner picks another with or without `ANALYZE`
    /// statistics (a statement whose pinned index cannot be used then fails to prepare
    /// instead of reading the table). Empty on PostgreSQL and MySQL.
    pub fn indexed_by(self, index: &str) -> String {
        match self {
            Self::Sqlite => format!(" INDEXED BY {index}"),
            Self::Postgres | Self::MySql => String::new(),
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

/// An application's own migration sets, one per backend it supports, for
/// [`Database::run_migrator`](crate::Database::run_migrator): give only the sets of the backends the application runs on.
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

/// What every backend's store provides to the portable [`Database`](crate::Database) and [`Tx`] methods.
pub(crate) trait Store {
    /// The backend's transaction type, as held by [`Tx`].
    type Tx;
    /// Which backend this is.
    const BACKEND: Backend;
    /// oncely's embedded migrations for this backend.
    fn migrations() -> sqlx::migrate::Migrator;
    /// One row, one `i64` column: 1 when sqlx's `_sqlx_migrations` table exists.
    const MIGRATIONS_TABLE_EXISTS: &'static str;
    /// The bound of [`Database::within_store_timeout`](crate::Database::within_store_timeout); `None` for unbounded (SQLite).
    fn store_timeout(&self) -> Option<Duration>;
    /// Begins a transaction, unbounded by the store timeout.
    async fn begin(&self) -> Result<Tx, StoreError>;
    /// Ends `tx`, committing when `commit`.
    async fn finish(tx: Self::Tx, commit: bool) -> Result<(), sqlx::Error>;
    /// Why a new connection cannot be opened (one attempt, at most 1 s), if it cannot.
    async fn connect_error(&self) -> Option<sqlx::Error>;
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
    /// The index SQLite reads the rows by (`INDEXED BY`, see `sqlite::sweep_sql`).
    pub(crate) index: &'static str,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// The error of one direct connection attempt with `pool`'s options (at most 1 s), or `None`
/// when it connects (or cannot tell within the second).
pub(crate) async fn connect_error<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> Option<sqlx::Error> {
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
