//! [`InboxBackend`] on PostgreSQL.

use super::PgStore;
use crate::inbox::InboxBackend;

impl InboxBackend for PgStore {
    async fn collect(&self, before_ms: i64, batch: i64) -> Result<u64, sqlx::Error> {
        // The locked batch is a materialised CTE, so the `LIMIT` holds (an
        // `IN (SELECT … LIMIT … SKIP LOCKED)` subquery may be re-run and delete more); plan
        // pinned and rows taken by TID (`crate::plan`).
        crate::execute_pinned(
            self.pool(),
            sqlx::query(
                "WITH doomed AS MATERIALIZED (SELECT ctid FROM oncely_inbox \
                 WHERE received_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 DELETE FROM oncely_inbox \
                 WHERE ctid = ANY (ARRAY(SELECT d.ctid FROM doomed d))",
            )
            .bind(before_ms)
            .bind(batch),
        )
        .await
    }
}
