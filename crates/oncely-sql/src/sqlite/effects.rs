//! [`EffectsBackend`] on SQLite: one statement on the single writer, so claims never race;
//! a group of settles as one `UPDATE … FROM` a `VALUES` list.

use super::SqliteStore;
use crate::effects::driver::{
    bind_settle_rows, held_rows, Claim, EffectsBackend, SettleRow, CLAIM_DUE, CLAIM_SET,
    EFFECT_COLUMNS,
};
use crate::effects::types::Effect;
use crate::StoreError;

/// The ids a claim takes (`$5` of them): the oldest due, read from the partial index
/// `oncely_effects_due (provider, available_at)` in its order, so that the `LIMIT` stops
/// the read. Ties on `available_at` (a batch enqueued in one millisecond) come in the
/// index's order; ordering them by `id` as well made SQLite sort every tied row first
/// (20,000 effects enqueued at once: 963 effects/s, against 4,076/s at 2,000).
///
/// `INDEXED BY` pins the plan: after `ANALYZE` SQLite preferred the unique index on
/// `(provider, idem_key)` and sorted every row of the provider, finished ones included. A
/// statement whose pinned index cannot be used fails to prepare instead of reading the table.
fn due_ids() -> String {
    format!(
        "SELECT id FROM oncely_effects INDEXED BY oncely_effects_due WHERE {CLAIM_DUE} \
         ORDER BY available_at LIMIT $5"
    )
}

impl EffectsBackend for SqliteStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<Vec<Effect>, StoreError> {
        let sql = format!(
            "UPDATE oncely_effects SET {CLAIM_SET} WHERE id IN ({}) RETURNING {EFFECT_COLUMNS}",
            due_ids()
        );
        Ok(sqlx::query_as(&sql)
            .bind(claim.runner)
            .bind(claim.lease_until)
            .bind(claim.now_ms)
            .bind(claim.provider)
            .bind(claim.limit)
            .fetch_all(self.writer())
            .await?)
    }

    async fn settle_rows(
        tx: &mut Self::Tx,
        rows: &[SettleRow],
        now_ms: i64,
    ) -> Result<Vec<bool>, StoreError> {
        let values = vec!["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"; rows.len()].join(", ");
        // The VALUES columns are prefixed: SET's unqualified names are the table's.
        let sql = format!(
            "WITH v (v_id, v_lease_version, v_uncount, v_checks, v_state, v_available_at, \
             v_provider_id, v_response, v_last_error, v_idem_key, v_key_generation, v_streak) \
             AS (VALUES {values}) \
             UPDATE oncely_effects SET attempts = attempts - v_uncount, \
             checks = checks + v_checks, state = v_state, available_at = v_available_at, \
             provider_id = v_provider_id, response = v_response, last_error = v_last_error, \
             idem_key = v_idem_key, key_generation = v_key_generation, locked_by = NULL, \
             locked_until = NULL, updated_at = ?, unavailable_streak = v_streak \
             FROM v WHERE id = v_id AND lease_version = v_lease_version \
             RETURNING id, lease_version"
        );
        let q = bind_settle_rows!(sqlx::query_as(&sql), rows);
        let updated: Vec<(String, i64)> = q.bind(now_ms).fetch_all(&mut **tx).await?;
        Ok(held_rows(rows, &updated))
    }
}

#[cfg(test)]
mod tests {
    use super::due_ids;
    use crate::{Database, DbOptions, EffectStore, NewEffect};

    /// The claim's plan on a backlog of 3,000 effects due at one instant beside 3,000
    /// finished ones, with no statistics and after `ANALYZE`: a search of the due index,
    /// no sort (a temporary B-tree would mean every due row is read before the `LIMIT`).
    #[tokio::test]
    async fn a_claim_reads_the_due_index_in_order() {
        let path = std::env::temp_dir().join(format!("oncely-plan-{}.db", uuid::Uuid::new_v4()));
        let db = Database::connect(
            &format!("sqlite://{}", path.display()),
            &DbOptions::default(),
        )
        .await
        .unwrap();
        db.migrate().await.unwrap();
        let request = serde_json::json!({});
        let mut tx = db.begin().await.unwrap();
        for i in 0..6_000 {
            let (reference, key) = (format!("inv-{i}"), format!("key-{i}"));
            let new = NewEffect {
                tenant: "acme",
                provider: "payments",
                operation: "charge",
                reference: &reference,
                key: &key,
                request: &request,
            };
            EffectStore::enqueue(&mut tx, &new, 1_000).await.unwrap();
        }
        tx.commit().await.unwrap();
        let Database::Sqlite(store) = &db else {
            unreachable!("a sqlite:// URL")
        };
        sqlx::query("UPDATE oncely_effects SET state = 'succeeded' WHERE reference < 'inv-3'")
            .execute(store.writer())
            .await
            .unwrap();
        for analyzed in [false, true] {
            if analyzed {
                sqlx::query("ANALYZE")
                    .execute(store.writer())
                    .await
                    .unwrap();
            }
            let plan: Vec<(i64, i64, i64, String)> =
                sqlx::query_as(&format!("EXPLAIN QUERY PLAN {}", due_ids()))
                    .bind("runner")
                    .bind(0_i64)
                    .bind(2_000_i64)
                    .bind("payments")
                    .bind(16_i64)
                    .fetch_all(store.writer())
                    .await
                    .unwrap();
            let steps: Vec<&str> = plan.iter().map(|row| row.3.as_str()).collect();
            assert!(
                steps
                    .iter()
                    .any(|s| s.contains("USING INDEX oncely_effects_due ")),
                "analyzed {analyzed}: {steps:?}"
            );
            assert!(
                !steps.iter().any(|s| s.contains("TEMP B-TREE")),
                "analyzed {analyzed}: {steps:?}"
            );
        }
        db.close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
}
