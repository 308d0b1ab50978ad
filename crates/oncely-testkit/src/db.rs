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

/// The backends the conformance suites run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestBackend {
    /// A fresh SQLite file in a temporary directory.
    Sqlite,
    /// A fresh schema on the PostgreSQL test server.
    Postgres,
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
        }
    }

    /// A fresh database next to `base_url`: for `sqlite:` a new file in a temporary
    /// directory (the path in `base_url` is ignored), for `postgres:` a new schema in the
    /// database `base_url` names. `None` (after printing why) when PostgreSQL is unreachable
    /// and services are not required.
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
                    assert!(
                        !require_services(),
                        "PostgreSQL at {base} is required but unreachable: {why}"
                    );
                    eprintln!("SKIPPED: PostgreSQL at {base} unreachable ({why})");
                    return None;
                }
            };
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
            })
        }
    }
}
