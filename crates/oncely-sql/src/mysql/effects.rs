//! [`EffectsBackend`] on MySQL / MariaDB: the due ids locked with `FOR UPDATE SKIP LOCKED`,
//! then updated and read back in the same transaction (no `UPDATE … RETURNING`); a group of
//! settles as one `UPDATE` joined to a derived table of the new values, whose rows matched
//! say whether every lease was held (read back only when one was not).

use super::MySqlStore;
use crate::effects::driver::{bind_settle_rows, held_rows, Claim, EffectsBackend, SettleRow};
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
            "SELECT id FROM oncely_effects FORCE INDEX (oncely_effects_due_at) \
             WHERE provider = ? AND due_at <= ? \
             AND (locked_until IS NULL OR locked_until < ?) \
             ORDER BY due_at, id LIMIT ? FOR UPDATE SKIP LOCKED",
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

    /// The group as one `UPDATE … JOIN` a derived table of its new values, read back only
    /// when a lease was lost: one statement per group when every lease was held, two
    /// otherwise — not one per effect, and fewer than the other correct shape, which locks
    /// the group first (`SELECT id, lease_version … FOR UPDATE`, always a second round
    /// trip) and then updates the rows that still match.
    ///
    /// The `UPDATE` joins each row of the derived table [`settle_values`] to its effect on
    /// `id` *and* `lease_version`. An `UPDATE` reads each effect's latest committed version
    /// under an exclusive lock (waiting for a concurrent claim to commit or roll back), so
    /// an effect whose lease another runner took over has a higher `lease_version` and is
    /// not matched — and the ones matched stay locked, with this version, until `tx` ends.
    /// MySQL has no `RETURNING`, but its count of rows matched (sqlx connects with
    /// `CLIENT_FOUND_ROWS`: matched, not changed) is at most the number of distinct ids in
    /// the group, and equals `rows.len()` only when every row matched. Otherwise the group
    /// is read back in `tx`: since `lease_version` only grows (every claim and operator
    /// action raises it, a settle keeps it), an effect still at the version it was claimed
    /// with is exactly one this `UPDATE` wrote.
    ///
    /// `STRAIGHT_JOIN` pins the plan: the derived table drives and each effect is found by
    /// its primary key, never by a scan of `oncely_effects` under lock.
    async fn settle_rows(
        tx: &mut Self::Tx,
        rows: &[SettleRow],
        now_ms: i64,
    ) -> Result<Vec<bool>, StoreError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "UPDATE ({}) v STRAIGHT_JOIN oncely_effects e \
             ON e.id = v.id AND e.lease_version = v.lease_version \
             SET e.attempts = e.attempts - v.uncount, e.checks = e.checks + v.checks, \
             e.state = v.state, e.available_at = v.available_at, \
             e.provider_id = v.provider_id, e.response = v.response, \
             e.last_error = v.last_error, e.idem_key = v.idem_key, \
             e.key_generation = v.key_generation, e.locked_by = NULL, e.locked_until = NULL, \
             e.updated_at = ?, e.unavailable_streak = v.streak",
            settle_values(rows.len())
        );
        let q = bind_settle_rows!(sqlx::query(&sql), rows);
        let matched = q.bind(now_ms).execute(&mut **tx).await?.rows_affected();
        if usize::try_from(matched).is_ok_and(|m| m == rows.len()) {
            return Ok(vec![true; rows.len()]);
        }
        let select = format!(
            "SELECT id, lease_version FROM oncely_effects WHERE id IN ({})",
            crate::in_list(rows.len())
        );
        let mut q = sqlx::query_as(&select);
        for r in rows {
            q = q.bind(r.id.as_str());
        }
        let now: Vec<(String, i64)> = q.fetch_all(&mut **tx).await?;
        Ok(held_rows(rows, &now))
    }
}

/// The derived table of a settle of `n` (≥ 1) rows: `SELECT … UNION ALL SELECT …`, one
/// `SELECT` of 12 placeholders per row, bound as [`SettleRow`]'s fields in order (a table
/// value constructor would do too, but MariaDB's `VALUES (…)` and MySQL's
/// `VALUES ROW(…)` are spelled differently).
///
/// Each text value but the id goes through `CAST(? AS CHAR)`: a bare text parameter in a
/// derived table is typed from its bound value, and MariaDB 10.11 keeps one longer than
/// 65,535 bytes with its length wrapped (a 70,000-byte response arrived as 4,464 bytes);
/// cast, the column is text as long as the group's longest value. The id stays bare: cast,
/// it no longer matches the primary key's type and the join scans `oncely_effects`.
fn settle_values(n: usize) -> String {
    let first = "SELECT ? AS id, ? AS lease_version, ? AS uncount, ? AS checks, \
        CAST(? AS CHAR) AS state, ? AS available_at, CAST(? AS CHAR) AS provider_id, \
        CAST(? AS CHAR) AS response, CAST(? AS CHAR) AS last_error, \
        CAST(? AS CHAR) AS idem_key, ? AS key_generation, ? AS streak";
    let more = " UNION ALL SELECT ?, ?, ?, ?, CAST(? AS CHAR), ?, CAST(? AS CHAR), \
        CAST(? AS CHAR), CAST(? AS CHAR), CAST(? AS CHAR), ?, ?";
    format!("{first}{}", more.repeat(n.saturating_sub(1)))
}
