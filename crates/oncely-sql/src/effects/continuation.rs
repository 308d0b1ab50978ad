//! Continuations: an outcome decided outside the service's runner (an operator's
//! resolution, a reconciliation run without the service's handler) recorded on the effect,
//! for the service's own runner to hand to its handler (migration 0031).

use super::EffectStore;
use crate::{query, StoreError, Tx};

/// A continuation the service's runner owes ([`EffectStore::continuations`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Continuation {
    /// The effect's id.
    pub effect_id: String,
    /// The outcome to hand to the service's handler, JSON text (its shape is
    /// `oncely_effects`'s: the store keeps it opaque).
    pub outcome: String,
    /// When it was recorded (or last put off after a failed run), Unix ms; it also fences
    /// [`EffectStore::take_continuation`].
    pub at: i64,
}

/// Up to `$2` continuations due at `$1`, oldest first, read from the partial index
/// `oncely_effects_continuation (continuation_at)` in its order so that the `LIMIT` stops
/// the read. Ties (a reconciliation run marks many effects in one millisecond) come in the
/// index's order: ordering them by `id` as well made SQLite sort every tied row on each poll
/// (`USE TEMP B-TREE FOR LAST TERM OF ORDER BY`).
pub(crate) const DUE_CONTINUATIONS: &str =
    "SELECT id AS effect_id, continuation AS outcome, continuation_at AS at \
     FROM oncely_effects WHERE continuation_at IS NOT NULL \
     AND continuation_at <= $1 ORDER BY continuation_at LIMIT $2";

impl EffectStore {
    /// Records in `tx` that the business update of effect `id`'s `outcome` (JSON text) is
    /// owed by the service's runner, at `now_ms` — in the transaction that decided the
    /// outcome, so the decision and the mark commit together.
    ///
    /// # Errors
    /// [`StoreError::Conflict`] for an unknown id or one that already owes a continuation
    /// (an owed outcome is never overwritten); other [`StoreError`]s when the database
    /// fails (the caller rolls back).
    pub async fn mark_continuation(
        tx: &mut Tx,
        id: &str,
        outcome: &str,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let n = tx
            .execute(
                query(
                    "UPDATE oncely_effects SET continuation = $1, continuation_at = $2 \
                     WHERE id = $3 AND continuation_at IS NULL",
                )
                .bind(outcome)
                .bind(now_ms)
                .bind(id),
            )
            .await?;
        if n == 0 {
            // Its row was found and locked by the resolution that marks it: an outcome
            // already owed is never overwritten (it would be lost).
            return Err(StoreError::Conflict(format!(
                "effect {id} is unknown or already owes its service a continuation"
            )));
        }
        Ok(())
    }

    /// Up to `limit` continuations due at `now_ms`, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn continuations(
        &self,
        limit: u32,
        now_ms: i64,
    ) -> Result<Vec<Continuation>, StoreError> {
        self.db
            .fetch_all(
                query(DUE_CONTINUATIONS)
                    .bind(now_ms)
                    .bind(i64::from(limit.max(1))),
            )
            .await
    }

    /// Clears continuation `c` in `tx`, in the transaction that runs the handler: `true`
    /// when this call took it, `false` when another runner did (or it was put off) — the
    /// conditional `UPDATE` waits for a concurrent taker's commit and then matches nothing,
    /// so a continuation runs once. A rollback leaves it set.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn take_continuation(tx: &mut Tx, c: &Continuation) -> Result<bool, StoreError> {
        let n = tx
            .execute(
                query(
                    "UPDATE oncely_effects SET continuation = NULL, continuation_at = NULL \
                     WHERE id = $1 AND continuation_at = $2",
                )
                .bind(c.effect_id.as_str())
                .bind(c.at),
            )
            .await?;
        Ok(n == 1)
    }

    /// Puts continuation `c` off until `at` (its handler failed; the runner tries again
    /// then), unless another runner took it meanwhile.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn defer_continuation(&self, c: &Continuation, at: i64) -> Result<(), StoreError> {
        self.db
            .execute(
                query(
                    "UPDATE oncely_effects SET continuation_at = $1 \
                     WHERE id = $2 AND continuation_at = $3",
                )
                .bind(at)
                .bind(c.effect_id.as_str())
                .bind(c.at),
            )
            .await?;
        Ok(())
    }
}
