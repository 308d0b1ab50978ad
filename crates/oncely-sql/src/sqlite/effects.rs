//! [`EffectsBackend`] on SQLite: one statement on the single writer, so claims never race.

use super::SqliteStore;
use crate::effects::{Claim, Effect, EffectsBackend, CLAIM_DUE, CLAIM_SET, EFFECT_COLUMNS};
use crate::StoreError;

impl EffectsBackend for SqliteStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<Vec<Effect>, StoreError> {
        let sql = format!(
            "UPDATE oncely_effects SET {CLAIM_SET} WHERE id IN (SELECT id FROM oncely_effects \
             WHERE {CLAIM_DUE} ORDER BY available_at, id LIMIT $5) RETURNING {EFFECT_COLUMNS}"
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
}
