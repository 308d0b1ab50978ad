//! The one place that chooses a backend: the [`Database`] and [`Tx`] enums, [`Backend`],
//! connecting by URL scheme, and the dispatch macros. Every other portable module reaches
//! a backend through [`with_store!`] / [`with_tx!`] and one internal trait per store
//! (implemented in `sqlite/`, `postgres/` and `mysql/`), never by naming a variant.

#[cfg(feature = "mysql")]
use crate::mysql::{MySqlStore, MySqlTx};
#[cfg(feature = "postgres")]
use crate::postgres::PgStore;
#[cfg(feature = "sqlite")]
use crate::sqlite::{SqliteStore, SqliteTx};
use crate::{DbOptions, StoreError};

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
