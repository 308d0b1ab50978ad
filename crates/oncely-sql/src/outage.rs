/// `true` when `error`, or any error in its [`source`](std::error::Error::source) chain, says
/// that the database could not be reached: an I/O or TLS failure, a connection the server
/// closed or refused, a pool that timed out waiting for a connection or is closed, a server
/// shutting down (PostgreSQL SQLSTATE class 08, 57P01–57P03, 53300; MySQL / MariaDB 1040,
/// 1053, 1927, 4031 and SQLSTATE class 08), or a database that did not answer within the
/// store timeout ([`StoreError::TimedOut`](crate::StoreError::TimedOut): a frozen network
/// path or a paused server).
///
/// Narrower than [`StoreError::is_unavailable`](crate::StoreError::is_unavailable), which
/// also counts a lock timeout or a deadlock: those are answers of a running database about
/// this transaction, so a consumer counts them as a failed attempt of the message, while an
/// outage is nobody's attempt. The chain is walked, so a handler error that wraps a
/// [`sqlx::Error`] or a [`StoreError`](crate::StoreError) (`?` into a boxed error, a
/// `#[source]` field) is recognised; an error turned into plain text is not.
pub fn is_outage(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.downcast_ref::<sqlx::Error>().is_some_and(sqlx_outage)
            || e.downcast_ref::<crate::StoreError>()
                .is_some_and(|s| matches!(s, crate::StoreError::TimedOut(_)))
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The database could not be reached, as one [`sqlx::Error`] says it (see [`is_outage`]).
pub(crate) fn sqlx_outage(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            matches!(mysql_error_number(e), Some(1040 | 1053 | 1927 | 4031))
                || db.code().is_some_and(|c| {
                    c.starts_with("08") || c.starts_with("57P0") || c.as_ref() == "53300"
                })
        }
        _ => false,
    }
}

/// The MySQL / MariaDB server error number (`ER_…`), if `e` is one.
#[cfg(feature = "mysql")]
pub(crate) fn mysql_error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(sqlx::mysql::MySqlDatabaseError::number),
        _ => None,
    }
}

/// Without the `mysql` feature no error is a MySQL one.
#[cfg(not(feature = "mysql"))]
pub(crate) fn mysql_error_number(_: &sqlx::Error) -> Option<u16> {
    None
}

#[cfg(test)]
mod tests {
    use super::is_outage;
    use crate::StoreError;

    #[test]
    fn outages_are_recognised_through_wrappers_and_other_failures_are_not() {
        let boxed: Box<dyn std::error::Error + Send + Sync> = sqlx::Error::PoolTimedOut.into();
        assert!(is_outage(&*boxed));
        assert!(is_outage(&StoreError::from(sqlx::Error::PoolClosed)));
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(is_outage(&StoreError::from(sqlx::Error::Io(refused))));
        assert!(!is_outage(&StoreError::from(sqlx::Error::RowNotFound)));
        assert!(is_outage(&StoreError::TimedOut(
            std::time::Duration::from_secs(1)
        )));
        let text: Box<dyn std::error::Error + Send + Sync> = "pool timed out".into();
        assert!(!is_outage(&*text));
    }
}
