use std::time::Duration;

use oncely_sql::{Database, DbOptions};

/// `true` when `ONCELY_TEST_REQUIRE_SERVICES=1`: unreachable services fail tests.
pub fn require_services() -> bool {
    std::env::var("ONCELY_TEST_REQUIRE_SERVICES").is_ok_and(|v| v == "1" || v == "true")
}

/// `ONCELY_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
pub fn postgres_url() -> String {
    std::env::var("ONCELY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// `ONCELY_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test` (MariaDB 10.6+ or
/// MySQL 8.0+; the user must be allowed to create databases).
pub fn mysql_url() -> String {
    std::env::var("ONCELY_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// The backends the conformance suites run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestBackend {
    /// A fresh SQLite file in a temporary directory.
    Sqlite,
    /// A fresh schema on the PostgreSQL test server.
    Postgres,
    /// A fresh database (`t_<uuid>`) on the MySQL / MariaDB test server.
    MySql,
}

/// A fresh, migrated-by-the-caller database for one test. Its `url` reaches the same
/// database from another process (PostgreSQL: the schema is pinned with
/// `options[search_path]`).
#[derive(Debug)]
pub struct TestDb {
    /// Connection URL for this database.
    pub url: String,
    /// Connected pools.
    pub db: Database,
    _dir: Option<tempfile::TempDir>,
    /// For a server database: the server's URL and the schema (PostgreSQL) or database
    /// (MySQL) to drop when the test ends.
    server: Option<(String, String)>,
}

impl Drop for TestDb {
    /// Drops the test's schema (PostgreSQL) or database (MySQL) on the way out, whether
    /// the test passed or panicked; SQLite's file goes with its temporary directory. The
    /// drop runs on a thread of its own with its own runtime (a `Drop` cannot await), is
    /// bounded by 10 s and best-effort: `.ci/run` sweeps whatever a killed run leaves.
    fn drop(&mut self) {
        let Some((base, schema)) = self.server.take() else {
            return;
        };
        crate::process::clean_up_blocking(async move { drop_server_db(&base, &schema).await });
    }
}

/// Drops `schema` on the server `base` names, through a connection of its own. The
/// test's pools are left to their own drop: closing them here would wait on connections
/// whose I/O belongs to the test's runtime, which this thread is blocking. Their
/// connections are idle, so they hold no lock the drop waits for.
async fn drop_server_db(base: &str, schema: &str) {
    let one = DbOptions {
        max_connections: 1,
        ..DbOptions::default()
    };
    let Ok(admin) = Database::connect(base, &one).await else {
        return;
    };
    let sql = if admin.as_mysql().is_some() {
        format!("DROP DATABASE IF EXISTS {schema}")
    } else {
        format!("DROP SCHEMA IF EXISTS {schema} CASCADE")
    };
    if let Some(pool) = admin.as_mysql() {
        drop(sqlx::query(&sql).execute(pool).await);
    } else if let Some(pool) = admin.as_postgres() {
        drop(sqlx::query(&sql).execute(pool).await);
    }
    admin.close().await;
}

impl TestDb {
    /// A fresh database on `backend`, or `None` (after printing why) when the server is
    /// unreachable and services are not required.
    ///
    /// # Panics
    /// When the server is unreachable and [`require_services`] is set.
    pub async fn new(backend: TestBackend) -> Option<Self> {
        Self::with_options(backend, &DbOptions::default()).await
    }

    /// As [`TestDb::new`] with explicit pool options.
    ///
    /// # Panics
    /// When the server is unreachable and [`require_services`] is set.
    pub async fn with_options(backend: TestBackend, options: &DbOptions) -> Option<Self> {
        match backend {
            TestBackend::Sqlite => Self::fresh("sqlite://", options).await,
            TestBackend::Postgres => Self::fresh(&postgres_url(), options).await,
            TestBackend::MySql => Self::fresh(&mysql_url(), options).await,
        }
    }

    /// A fresh database next to `base_url`: for `sqlite:` a new file in a temporary
    /// directory (the path in `base_url` is ignored), for `postgres:` a new schema in the
    /// database `base_url` names, for `mysql:` a new database `t_<uuid>` on that server
    /// (MySQL has no schemas inside a database; `.ci/run` drops old `t_%` databases).
    /// `None` (after printing why) when the server is unreachable and services are not
    /// required.
    ///
    /// # Panics
    /// When the server is unreachable and [`require_services`] is set, or the schema
    /// cannot be created.
    pub async fn fresh(base_url: &str, options: &DbOptions) -> Option<Self> {
        if base_url.starts_with("sqlite:") {
            let dir = tempfile::tempdir().expect("temporary directory");
            let url = format!("sqlite://{}", dir.path().join("oncely.db").display());
            let db = Database::connect(&url, options).await.expect("open SQLite");
            Some(Self {
                url,
                db,
                _dir: Some(dir),
                server: None,
            })
        } else {
            let base = base_url.to_owned();
            let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
            let admin = match tokio::time::timeout(
                Duration::from_secs(5),
                Database::connect(
                    &base,
                    &DbOptions {
                        max_connections: 1,
                        ..DbOptions::default()
                    },
                ),
            )
            .await
            {
                Ok(Ok(db)) => db,
                other => {
                    let why = match other {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timed out".to_owned(),
                    };
                    let server = if base.starts_with("mysql:") {
                        "MySQL"
                    } else {
                        "PostgreSQL"
                    };
                    assert!(
                        !require_services(),
                        "{server} at {base} is required but unreachable: {why}"
                    );
                    eprintln!("SKIPPED: {server} at {base} unreachable ({why})");
                    return None;
                }
            };
            if let Some(pool) = admin.as_mysql() {
                sqlx::query(&format!("CREATE DATABASE {schema} CHARACTER SET utf8mb4"))
                    .execute(pool)
                    .await
                    .expect("create test database");
                admin.close().await;
                let url = with_database(&base, &schema);
                let db = Database::connect(&url, options)
                    .await
                    .expect("connect to test database");
                return Some(Self {
                    url,
                    db,
                    _dir: None,
                    server: Some((base, schema)),
                });
            }
            let pool = admin.as_postgres().expect("postgres");
            sqlx::query(&format!("CREATE SCHEMA {schema}"))
                .execute(pool)
                .await
                .expect("create test schema");
            admin.close().await;
            let sep = if base.contains('?') { '&' } else { '?' };
            let url = format!("{base}{sep}options[search_path]={schema}");
            let db = Database::connect(&url, options)
                .await
                .expect("connect to test schema");
            Some(Self {
                url,
                db,
                _dir: None,
                server: Some((base, schema)),
            })
        }
    }
}

/// `base` (a `mysql://` URL) with its path replaced by `/database`, query kept.
fn with_database(base: &str, database: &str) -> String {
    let (head, query) = match base.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (base, None),
    };
    let authority_start = head.find("://").map_or(0, |i| i + 3);
    let path_start = head[authority_start..]
        .find('/')
        .map_or(head.len(), |i| authority_start + i);
    let mut url = format!("{}/{database}", &head[..path_start]);
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    url
}

/// Enqueues a `payments`/`charge` effect of `tenant` under `reference` (key
/// `key-<reference>`, request `{"amount": 100, "currency": "eur"}`) and parks it in
/// `needs_review` as the runner leaves one whose outcome it could not establish: claimed,
/// then settled with a status check's `unavailable` evidence ("provider down") and the error
/// "still unknown". Returns the effect's id. For the operator tests (commands, console).
///
/// # Panics
/// When the database fails.
pub async fn park_effect(db: &oncely_sql::Database, tenant: &str, reference: &str) -> String {
    use oncely_sql::{EffectStore, Enqueued, Evidence, EvidenceKind, NewEffect, Settle};
    let store = EffectStore::new(db.clone());
    let key = format!("key-{reference}");
    let request = serde_json::json!({"amount": 100, "currency": "eur"});
    let mut tx = db.begin().await.unwrap();
    let new = NewEffect {
        tenant,
        provider: "payments",
        operation: "charge",
        reference,
        key: &key,
        request: &request,
    };
    let Enqueued::Created(id) = EffectStore::enqueue(&mut tx, &new, 1_000).await.unwrap() else {
        panic!("{reference}: an effect of this reference exists already")
    };
    tx.commit().await.unwrap();
    let claimed = store
        .claim(
            "payments",
            "r",
            1,
            std::time::Duration::from_secs(30),
            2_000,
        )
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        claimed.id, id,
        "another payments effect was due before {reference}"
    );
    let evidence = Evidence {
        kind: EvidenceKind::Status,
        key,
        started_at: 2_000,
        finished_at: 2_010,
        outcome: "unavailable".into(),
        http_status: None,
        provider_ids: Vec::new(),
        detail: "provider down".into(),
    };
    let park = Settle::NeedsReview {
        error: "still unknown".into(),
    };
    let mut tx = db.begin().await.unwrap();
    EffectStore::settle(&mut tx, &claimed, &park, &evidence, 2_010)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn mysql_test_urls_name_the_fresh_database() {
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306/test", "t_1"),
            "mysql://root@127.0.0.1:3306/t_1"
        );
        assert_eq!(
            with_database("mysql://u:p@h/test?ssl-mode=disabled", "t_1"),
            "mysql://u:p@h/t_1?ssl-mode=disabled"
        );
        assert_eq!(with_database("mysql://h:3306", "t_1"), "mysql://h:3306/t_1");
    }
}
