//! What each backend implements for [`EffectStore`](crate::EffectStore) (in `sqlite/`,
//! `postgres/`, `mysql/`): the claim and the multi-row fenced settle update, with the columns
//! and SQL texts they share. It names no backend.

use super::types::Effect;
use crate::driver::Store;
use crate::StoreError;

/// The columns of [`Effect`], for `SELECT`s and `RETURNING`.
pub(crate) const EFFECT_COLUMNS: &str = "id, tenant, provider, operation, reference, \
    idem_key, key_generation, request, state, attempts, checks, unavailable_streak, \
    available_at, provider_id, response, last_error, lease_version, created_at, updated_at, \
    sent_at";

/// Binds each [`SettleRow`] of `$rows`, in the column order of the backends that take
/// the group as a list of value rows (SQLite's `VALUES`, MySQL's derived table): id,
/// lease version, uncount, checks, state, available_at, provider id, response, error, key,
/// key generation, streak.
macro_rules! bind_settle_rows {
    ($query:expr, $rows:expr) => {{
        let mut q = $query;
        for r in $rows {
            q = q
                .bind(r.id.as_str())
                .bind(r.lease_version)
                .bind(r.uncount)
                .bind(r.checks)
                .bind(r.state)
                .bind(r.available_at)
                .bind(r.provider_id.as_deref())
                .bind(r.response.as_deref())
                .bind(r.error.as_deref())
                .bind(r.key.as_str())
                .bind(r.key_generation)
                .bind(r.streak);
        }
        q
    }};
}
pub(crate) use bind_settle_rows;

/// One effect's fenced settle update, as every backend binds it.
pub(crate) struct SettleRow {
    pub(crate) id: String,
    /// The version the effect was claimed with: the update applies only while it holds.
    pub(crate) lease_version: i64,
    /// Subtracted from `attempts`.
    pub(crate) uncount: i64,
    /// Added to `checks`.
    pub(crate) checks: i64,
    pub(crate) state: &'static str,
    pub(crate) available_at: i64,
    pub(crate) provider_id: Option<String>,
    pub(crate) response: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) key: String,
    pub(crate) key_generation: i64,
    /// The new `unavailable_streak`.
    pub(crate) streak: i64,
}

/// A claim's parameters, handed to each backend.
pub(crate) struct Claim<'a> {
    pub(crate) provider: &'a str,
    pub(crate) runner: &'a str,
    pub(crate) limit: i64,
    pub(crate) lease_until: i64,
    pub(crate) now_ms: i64,
}

/// The `SET` list of a claim, shared by every backend. `attempts` comes first: MySQL
/// evaluates assignments left to right, so a later one would see the new `state`.
pub(crate) const CLAIM_SET: &str = "attempts = CASE WHEN state IN ('pending', 'absent') \
    THEN attempts + 1 ELSE attempts END, \
    sent_at = CASE WHEN state IN ('pending', 'absent') THEN $3 ELSE sent_at END, \
    state = CASE WHEN state IN ('pending', 'absent') THEN 'in_flight' ELSE 'unknown' END, \
    locked_by = $1, locked_until = $2, lease_version = lease_version + 1, updated_at = $3";

/// The due-rows condition of a claim (`$4` provider, `$3` now). Its `state IN` list is
/// spelled exactly as the partial index `oncely_effects_due` (migration 0020) spells its
/// `WHERE`: SQLite uses a partial index only when the query repeats its condition term for
/// term, and with the four states in another order it claimed by reading every row of the
/// provider, finished ones included, and sorting them (see
/// `sqlite::plans::a_claim_reads_the_due_index_in_order`).
pub(crate) const CLAIM_DUE: &str = "provider = $4 AND state IN ('pending', 'in_flight', \
    'unknown', 'absent') AND available_at <= $3 AND (locked_until IS NULL OR locked_until < $3)";

/// The effect store's per-backend half: the claim (its locking differs per backend) and the
/// fenced settle of a group (how a backend learns which rows it wrote differs: `RETURNING`
/// on SQLite and PostgreSQL, the rows matched on MySQL).
pub(crate) trait EffectsBackend: Store {
    /// The select list that decodes into [`Effect`] on this backend.
    const COLUMNS: &'static str = EFFECT_COLUMNS;

    /// Claims as [`EffectStore::claim`] documents, returning the claimed rows as updated.
    async fn claim(&self, claim: &Claim<'_>) -> Result<Vec<Effect>, StoreError>;

    /// Applies `rows` in `tx` as one multi-row fenced `UPDATE` (a row is written only while
    /// the effect's `lease_version` is still the one it was claimed with), clearing the
    /// lease and setting `updated_at` to `now_ms` (Unix ms). Returns, per row of `rows` in
    /// order, whether its lease was held (and the row written): a lost lease is `false` and
    /// leaves that effect untouched, the others are written all the same. `rows` holds at
    /// most [`SETTLE_CHUNK`](super::settle::SETTLE_CHUNK) rows.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the caller rolls `tx` back.
    async fn settle_rows(
        tx: &mut Self::Tx,
        rows: &[SettleRow],
        now_ms: i64,
    ) -> Result<Vec<bool>, StoreError>;
}

/// Per row of `rows`, whether `updated` (the `(id, lease_version)` pairs of the rows a
/// multi-row settle wrote, or of the rows as read back after it in its transaction) holds
/// it.
pub(crate) fn held_rows(rows: &[SettleRow], updated: &[(String, i64)]) -> Vec<bool> {
    let updated: std::collections::HashSet<(&str, i64)> =
        updated.iter().map(|(id, v)| (id.as_str(), *v)).collect();
    rows.iter()
        .map(|r| updated.contains(&(r.id.as_str(), r.lease_version)))
        .collect()
}
