/// A store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database cannot be reached (connection refused or lost, pool timed out or
    /// closed). Callers fail closed: HTTP answers 503, nothing runs unprotected.
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
            // PostgreSQL: connection exception, shutdown, too many connections.
            // SQLite: SQLITE_BUSY (5) and SQLITE_LOCKED (6) after the busy timeout,
            // SQLITE_CANTOPEN (14).
            c.starts_with("08")
                || c.starts_with("57P0")
                || c == "53300"
                || c == "5"
                || c == "6"
                || c == "14"
        }),
        _ => false,
    }
}
