//! The database from a URL.

use oncely_sql::{Database, DbOptions};

use crate::RuntimeError;

/// Connects to the database at `url` (`sqlite://FILE`, `postgres://…`, `mysql://…`) with
/// `options`, migrating nothing. A SQLite file that does not exist is created.
///
/// Apply the schema afterwards with [`Database::migrate`] (oncely's own tables: outbox,
/// inbox, idempotency records, SQL transport) or the service's own migrator.
///
/// # Errors
/// [`RuntimeError::Connect`], naming `url` without its password, when the database cannot
/// be reached or the URL is not one of the three.
pub async fn connect(url: &str, options: &DbOptions) -> Result<Database, RuntimeError> {
    Database::connect(url, options)
        .await
        .map_err(|source| RuntimeError::Connect {
            url: redact(url),
            source,
        })
}

/// Connects to a database a service already set up, for operator commands, which read what
/// a service wrote and migrate nothing: a SQLite file that does not exist is an error (a
/// wrong path or working directory), and so is a database without oncely's schema — not a
/// new empty schema reporting that all is well, made with DDL rights an operator may not
/// have.
///
/// # Errors
/// [`RuntimeError::NoSqliteFile`] for a SQLite URL whose file does not exist (`:memory:`
/// aside); [`RuntimeError::Connect`] as [`connect`]; [`RuntimeError::SchemaMissing`] when
/// not every one of oncely's migrations is applied there.
pub async fn connect_existing(url: &str, options: &DbOptions) -> Result<Database, RuntimeError> {
    if let Some(path) = sqlite_path(url) {
        if path != ":memory:" && !std::path::Path::new(path).exists() {
            return Err(RuntimeError::NoSqliteFile {
                path: path.to_owned(),
            });
        }
    }
    let db = connect(url, options).await?;
    db.check_schema()
        .await
        .map_err(|source| RuntimeError::SchemaMissing {
            url: redact(url),
            source,
        })?;
    Ok(db)
}

/// The file of a `sqlite:` URL (`sqlite://FILE`, `sqlite:FILE`, query string dropped);
/// `None` for other databases.
fn sqlite_path(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("sqlite:")?;
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    Some(rest.split('?').next().unwrap_or(rest))
}

/// `url` with its password, if any, replaced by `***` (`postgres://u:***@host/db`), for
/// logs and error messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => match url[s + 3..at].find(':') {
            Some(c) => format!("{}:***{}", &url[..s + 3 + c], &url[at..]),
            None => url.to_owned(),
        },
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_drops_the_password_and_keeps_the_rest() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("sqlite://oncely.db"), "sqlite://oncely.db");
    }

    #[test]
    fn sqlite_path_is_the_file_without_the_query() {
        assert_eq!(sqlite_path("sqlite://a/b.db?mode=rwc"), Some("a/b.db"));
        assert_eq!(sqlite_path("sqlite:b.db"), Some("b.db"));
        assert_eq!(sqlite_path("postgres://h/db"), None);
    }
}
