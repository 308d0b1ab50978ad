//! The fresh database a benchmark runs on.

use oncely_sql::DbOptions;
use oncely_testkit::TestDb;

/// A fresh database at `url` (a new schema or file, dropped with the value), pooled for
/// `concurrency` workers and four more connections for the benchmark's own reads.
///
/// # Errors
/// When the database is unreachable.
pub(crate) async fn fresh(url: &str, concurrency: usize) -> anyhow::Result<TestDb> {
    let options = DbOptions {
        max_connections: u32::try_from(concurrency).unwrap_or(64) + 4,
        ..DbOptions::default()
    };
    TestDb::fresh(url, &options)
        .await
        .ok_or_else(|| anyhow::anyhow!("database unreachable"))
}
