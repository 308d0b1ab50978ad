use crate::outage::mysql_error_number;

/// A store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database cannot be reached or is too busy to answer now (connection refused or
    /// lost, pool timed out or closed, lock or statement timeout, deadlock, disk full).
    /// Transient: callers fail closed (HTTP 503 + `Retry-After`), nothing runs unprotected.
    #[error("the store is unreachable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// PostgreSQL / MySQL: the database did not answer within
    /// [`crate::DbOptions::store_timeout`] (a frozen network path, a paused or overloaded
    /// server). Transient, like [`StoreError::Unavailable`].
    #[error("the store did not answer within {} ms", .0.as_millis())]
    TimedOut(std::time::Duration),
    /// The database answered with an error.
    #[error("the store failed: {0}")]
    Database(#[source] sqlx::Error),
    /// Migrations could not be applied.
    #[error("migrations failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// A stored row does not decode (an unknown state, corrupt headers).
    #[error("a stored record is corrupt: {0}")]
    Corrupt(String),
    /// The record is not held by this reservation (another request owns it, or it has
    /// been completed already). Nothing was changed.
    #[error("the idempotency record is not held by this reservation")]
    NotHeld,
    /// A multi-phase idempotency record was taken over: the lease named fencing token
    /// `held`, the record carries `current` (larger). The stale holder's completion or
    /// release changed nothing; the current holder's outcome stands.
    #[error("stale fencing token {held}: the record was taken over (fence {current})")]
    Fenced {
        /// The fencing token the caller held.
        held: i64,
        /// The record's fencing token now.
        current: i64,
    },
    /// [`crate::OutboxStore::enqueue`]: an event with this message id was published already
    /// and is still within the relay's retention (PostgreSQL keeps published events apart
    /// from the outbox). Nothing was written; the caller must roll back. (A second copy of
    /// a *pending* event is the database's unique violation on `message_id`,
    /// [`StoreError::Database`].)
    #[error("an event with message id {0} was published already")]
    AlreadyPublished(String),
    /// [`crate::Database::check_schema`]: oncely's migrations are not (all) applied in this
    /// database or schema. Nothing was created; apply them (`oncely migrate`) first.
    #[error(
        "oncely's schema is missing or out of date here (migrations not applied: {missing:?})"
    )]
    SchemaMissing {
        /// Versions of oncely's embedded migrations not applied, in order.
        missing: Vec<i64>,
    },
    /// [`crate::Database::run_migrator`]: the application gave no migration set for this
    /// database's backend. Nothing was applied.
    #[error("no migrations given for {0}")]
    NoMigrations(crate::Backend),
    /// No record with this id (an operator command naming an effect that does not exist).
    #[error("no record {0}")]
    NotFound(String),
    /// The record is in a state the operation does not apply to; nothing was changed.
    #[error("{0}")]
    Conflict(String),
    /// A database URL that is not `sqlite:`, `postgres:`, `postgresql:`, `mysql:` or
    /// `mariadb:`.
    #[error("unsupported database URL scheme in {0:?}; use sqlite://, postgres://, mysql://")]
    UnsupportedUrl(String),
}

impl StoreError {
    /// `true` when the store is unreachable (answer 503, retry later).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::TimedOut(_))
    }

    /// `true` when the database gave up waiting for a lock another transaction holds:
    /// [`is_lock_conflict`] of the driver error.
    pub fn is_lock_conflict(&self) -> bool {
        match self {
            Self::Unavailable(e) | Self::Database(e) => is_lock_conflict(e),
            _ => false,
        }
    }
}

impl From<oncely_core::UnknownWord> for StoreError {
    /// A stored word no value names: the row is corrupt ([`StoreError::Corrupt`]).
    fn from(e: oncely_core::UnknownWord) -> Self {
        Self::Corrupt(e.to_string())
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if is_unreachable(&e) {
            Self::Unavailable(e)
        } else {
            Self::Database(e)
        }
    }
}

/// `true` when `e` says the database gave up waiting for a lock another transaction
/// holds, so this transaction lost a race rather than failed: MySQL / MariaDB
/// `ER_LOCK_WAIT_TIMEOUT` (1205) or `ER_LOCK_DEADLOCK` (1213; the statement, resp. the whole
/// transaction, was rolled back), PostgreSQL `lock_not_available` (SQLSTATE 55P03, the
/// `lock_timeout` ran out), SQLite `SQLITE_BUSY` (5, the busy timeout ran out). All of them
/// are also [`StoreError::is_unavailable`] (503, retry).
pub fn is_lock_conflict(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    if let Some(n) = mysql_error_number(e) {
        return matches!(n, 1205 | 1213);
    }
    if is_sqlite(&**db) {
        return db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|n| n & 0xff == 5);
    }
    db.code().is_some_and(|c| c == "55P03")
}

/// A violation of a UNIQUE constraint or primary key (MySQL `ER_DUP_ENTRY`, 1062).
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

/// Transient failures, answered 503: the database is unreachable
/// ([`crate::outage::sqlx_outage`]: I/O, TLS, pool exhaustion or shutdown, protocol
/// breakage, connection-class SQLSTATEs), or it gave up on this transaction for a reason
/// that a later retry does not share — a lock wait or statement timeout, a deadlock, a
/// serialization failure, an interrupted statement, SQLite busy/locked/I/O/full/can't-open.
fn is_unreachable(e: &sqlx::Error) -> bool {
    if crate::outage::sqlx_outage(e) {
        return true;
    }
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    // MySQL / MariaDB: lock wait timeout (1205), deadlock (1213), query interrupted (1317),
    // statement time limit (MariaDB 1969, MySQL 3024).
    if matches!(
        mysql_error_number(e),
        Some(1205 | 1213 | 1317 | 1969 | 3024)
    ) {
        return true;
    }
    let sqlite = is_sqlite(&**db);
    db.code().is_some_and(|c| {
        // PostgreSQL: lock_timeout (55P03), statement_timeout (57014), serialization
        // failure (40001), deadlock (40P01). MySQL: 40001 (deadlock) too.
        // SQLite (primary result code = extended code & 0xff): BUSY (5), LOCKED (6),
        // IOERR (10), FULL (13), CANTOPEN (14).
        matches!(c.as_ref(), "55P03" | "57014" | "40001" | "40P01")
            || (sqlite
                && c.parse::<i32>()
                    .is_ok_and(|n| matches!(n & 0xff, 5 | 6 | 10 | 13 | 14)))
    })
}

/// `true` when `db` is a SQLite error (whose codes are result codes, not SQLSTATEs).
#[cfg(feature = "sqlite")]
fn is_sqlite(db: &dyn sqlx::error::DatabaseError) -> bool {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
}

/// Without the `sqlite` feature no error is a SQLite one.
#[cfg(not(feature = "sqlite"))]
fn is_sqlite(_: &dyn sqlx::error::DatabaseError) -> bool {
    false
}
