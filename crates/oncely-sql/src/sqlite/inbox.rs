//! [`InboxBackend`] on SQLite.

use super::SqliteStore;
use crate::inbox::InboxBackend;

impl InboxBackend for SqliteStore {
    async fn collect(&self, before_ms: i64, batch: i64) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(
            "DELETE FROM oncely_inbox WHERE rowid IN (SELECT rowid FROM oncely_inbox \
             WHERE received_at < $1 LIMIT $2)",
        )
        .bind(before_ms)
        .bind(batch)
        .execute(self.writer())
        .await?
        .rows_affected())
    }
}
