//! [`InboxBackend`] on MySQL / MariaDB.

use super::MySqlStore;
use crate::inbox::InboxBackend;

impl InboxBackend for MySqlStore {
    async fn collect(&self, before_ms: i64, batch: i64) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(
            "DELETE FROM oncely_inbox WHERE received_at < ? ORDER BY received_at LIMIT ?",
        )
        .bind(before_ms)
        .bind(batch)
        .execute(self.pool())
        .await?
        .rows_affected())
    }
}
