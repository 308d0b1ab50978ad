/// A store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database cannot be reached or is too busy to answer now (connection refused or
    /// lost, pool timed out or closed, lock or statement timeout, deadlock, disk full).
    /// Transient: callers fail closed (HTTP 503 + `Retry-After`), nothing runs unprotected.
    #[error("the store is unreachable: {0}")]
    Unavailable(#[source] sqlx::Error),
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
    /// A database URL that is not `sqlite:`, `postgres:` or `postgresql:`.
    #[error("unsupported database URL scheme in {0:?}; use sqlite://, postgres://")]
    UnsupportedUrl(String),
}

impl StoreError {
    /// `true` when the store is unreachable (answer 503, retry later).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
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

/// Connection-level failures: I/O, TLS, pool exhaustion or shutdown, protocol breakage,
/// and server errors of SQLSTATE class 08 (connection exception) or 57P0x (shutdown).
fn is_unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            // PostgreSQL: connection exception (08), shutdown (57P0x), too many connections
            // (53300), lock_timeout (55P03), statement_timeout (57014), serialization
            // failure (40001), deadlock (40P01): all transient, retry later.
            // SQLite (primary result code = extended code & 0xff): BUSY (5), LOCKED (6),
            // IOERR (10), FULL (13), CANTOPEN (14).
            c.starts_with("08")
                || c.starts_with("57P0")
                || matches!(c.as_ref(), "53300" | "55P03" | "57014" | "40001" | "40P01")
                || c.parse::<i32>()
                    .is_ok_and(|n| matches!(n & 0xff, 5 | 6 | 10 | 13 | 14))
        }),
        _ => false,
    }
}
