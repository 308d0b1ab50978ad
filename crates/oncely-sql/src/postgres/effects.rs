//! [`EffectsBackend`] on PostgreSQL: the due rows locked with SKIP LOCKED in a materialised
//! CTE (so the `LIMIT` holds), the plan pinned (`crate::plan`: a table the statistics
//! believe empty must not be seq-scanned under lock); a group of settles as one `UPDATE`
//! from `UNNEST`ed arrays (one statement text whatever the group's size, so it is prepared
//! once).

use super::PgStore;
use crate::effects::driver::{
    held_rows, Claim, EffectsBackend, SettleRow, CLAIM_DUE, CLAIM_SET, EFFECT_COLUMNS,
};
use crate::effects::types::Effect;
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

    async fn settle_rows(
        tx: &mut Self::Tx,
        rows: &[SettleRow],
        now_ms: i64,
    ) -> Result<Vec<bool>, StoreError> {
        let text = |f: fn(&SettleRow) -> &str| rows.iter().map(f).collect::<Vec<_>>();
        let opt = |f: fn(&SettleRow) -> Option<&str>| rows.iter().map(f).collect::<Vec<_>>();
        let int = |f: fn(&SettleRow) -> i64| rows.iter().map(f).collect::<Vec<_>>();
        let updated: Vec<(String, i64)> = sqlx::query_as(SETTLE_ROWS)
            .bind(now_ms)
            .bind(text(|r| &r.id))
            .bind(int(|r| r.lease_version))
            .bind(int(|r| r.uncount))
            .bind(int(|r| r.checks))
            .bind(text(|r| r.state))
            .bind(int(|r| r.available_at))
            .bind(opt(|r| r.provider_id.as_deref()))
            .bind(opt(|r| r.response.as_deref()))
            .bind(opt(|r| r.error.as_deref()))
            .bind(text(|r| &r.key))
            .bind(int(|r| r.key_generation))
            .bind(int(|r| r.streak))
            .fetch_all(&mut **tx)
            .await?;
        Ok(held_rows(rows, &updated))
    }
}

/// The fenced settle of many effects: row `i` of the arrays is effect `i`'s new values.
const SETTLE_ROWS: &str = "UPDATE oncely_effects e SET attempts = e.attempts - v.uncount, \
    checks = e.checks + v.checks, state = v.state, available_at = v.available_at, \
    provider_id = v.provider_id, response = v.response, last_error = v.last_error, \
    idem_key = v.idem_key, key_generation = v.key_generation, locked_by = NULL, \
    locked_until = NULL, updated_at = $1, unavailable_streak = v.streak \
    FROM UNNEST($2::text[], $3::int8[], $4::int8[], $5::int8[], $6::text[], $7::int8[], \
    $8::text[], $9::text[], $10::text[], $11::text[], $12::int8[], $13::int8[]) \
    AS v(id, lease_version, uncount, checks, state, available_at, provider_id, response, \
    last_error, idem_key, key_generation, streak) \
    WHERE e.id = v.id AND e.lease_version = v.lease_version \
    RETURNING e.id, e.lease_version";
