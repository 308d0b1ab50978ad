//! [`EffectsBackend`] on MySQL / MariaDB: the due ids locked with `FOR UPDATE SKIP LOCKED`,
//! then updated and read back in the same transaction (no `UPDATE … RETURNING`).

use super::MySqlStore;
use crate::effects::driver::{Claim, EffectsBackend};
use crate::effects::types::Effect;
use crate::StoreError;

/// The binary-collated text columns (compared byte for byte, as on the other backends) are
/// reported as VARBINARY: cast back to text to decode.
const COLUMNS: &str = "id, CAST(tenant AS CHAR) AS tenant, CAST(provider AS CHAR) AS provider, \
    CAST(operation AS CHAR) AS operation, CAST(reference AS CHAR) AS reference, \
    CAST(idem_key AS CHAR) AS idem_key, key_generation, request, state, attempts, checks, \
    unavailable_streak, available_at, CAST(provider_id AS CHAR) AS provider_id, response, \
    last_error, lease_version, created_at, updated_at, sent_at";

impl EffectsBackend for MySqlStore {
    const COLUMNS: &'static str = COLUMNS;

    async fn claim(&self, claim: &Claim<'_>) -> Result<Vec<Effect>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM oncely_effects WHERE state IN ('pending', 'absent', 'unknown', \
             'in_flight') AND provider = ? AND available_at <= ? \
             AND (locked_until IS NULL OR locked_until < ?) \
             ORDER BY available_at, id LIMIT ? FOR UPDATE SKIP LOCKED",
        )
        .bind(claim.provider)
        .bind(claim.now_ms)
        .bind(claim.now_ms)
        .bind(claim.limit)
        .fetch_all(&mut *tx)
        .await?;
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let list = crate::in_list(ids.len());
        // `attempts` before `state`: MySQL evaluates assignments left to right.
        let update = format!(
            "UPDATE oncely_effects SET attempts = CASE WHEN state IN ('pending', 'absent') \
             THEN attempts + 1 ELSE attempts END, \
             sent_at = CASE WHEN state IN ('pending', 'absent') THEN ? ELSE sent_at END, \
             state = CASE WHEN state IN ('pending', 'absent') THEN 'in_flight' ELSE 'unknown' END, \
             locked_by = ?, locked_until = ?, lease_version = lease_version + 1, updated_at = ? \
             WHERE id IN ({list})"
        );
        let mut q = sqlx::query(&update)
            .bind(claim.now_ms)
            .bind(claim.runner)
            .bind(claim.lease_until)
            .bind(claim.now_ms);
        for id in &ids {
            q = q.bind(id);
        }
        q.execute(&mut *tx).await?;
        let select = format!("SELECT {COLUMNS} FROM oncely_effects WHERE id IN ({list})");
        let mut q = sqlx::query_as(&select);
        for id in &ids {
            q = q.bind(id);
        }
        let rows = q.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(rows)
    }
}
