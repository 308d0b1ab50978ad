//! [`EffectsBackend`] on PostgreSQL: the due rows locked with SKIP LOCKED in a materialised
//! CTE (so the `LIMIT` holds), the plan pinned (`crate::plan`: a table the statistics
//! believe empty must not be seq-scanned under lock).

use super::PgStore;
use crate::effects::{Claim, Effect, EffectsBackend, CLAIM_DUE, CLAIM_SET, EFFECT_COLUMNS};
use crate::StoreError;

impl EffectsBackend for PgStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<Vec<Effect>, StoreError> {
        let sql = format!(
            "WITH due AS MATERIALIZED (SELECT id FROM oncely_effects WHERE {CLAIM_DUE} \
             ORDER BY provider, available_at LIMIT $5 FOR UPDATE SKIP LOCKED) \
             UPDATE oncely_effects SET {CLAIM_SET} \
             WHERE id = ANY (ARRAY(SELECT d.id FROM due d)) RETURNING {EFFECT_COLUMNS}"
        );
        Ok(crate::fetch_all_pinned(
            self.pool(),
            sqlx::query_as(&sql)
                .bind(claim.runner)
                .bind(claim.lease_until)
                .bind(claim.now_ms)
                .bind(claim.provider)
                .bind(claim.limit),
        )
        .await?)
    }
}
