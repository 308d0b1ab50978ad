//! Operator resolutions: retrying, resolving by hand, and their audit trail.

use super::types::{Effect, EffectState, Resolution};
use super::EffectStore;
use crate::{query, StoreError, Tx};

impl EffectStore {
    /// An operator's retry of effect `id` (`oncely effects retry`), audited: a
    /// `needs_review` or `unknown` effect goes back to `unknown` with its status checks
    /// reset — the runner asks the provider's status before anything is sent, never a blind
    /// call; a `failed` effect becomes `absent` under `next_key` (its old key would replay
    /// the stored refusal), so the runner sends it again.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] for an effect
    /// in another state (pending, in flight, succeeded, absent); other [`StoreError`]s
    /// when the database fails.
    pub async fn retry(
        &self,
        id: &str,
        next_key: &str,
        actor: &str,
        now_ms: i64,
    ) -> Result<Effect, StoreError> {
        let mut tx = self.db.begin().await?;
        self.retry_in(&mut tx, id, |_| next_key.to_owned(), actor, now_ms)
            .await?;
        tx.commit().await?;
        self.get(id)
            .await?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))
    }

    /// [`EffectStore::retry`] in the caller's transaction `tx`, so a change that depends
    /// on it (a saga step put back to wait for the effect) commits with it; `next_key`
    /// builds a failed effect's next key from the effect as locked. Returns the state the
    /// effect was in and the one it is in now.
    ///
    /// # Errors
    /// As [`EffectStore::retry`]; the caller rolls back.
    pub async fn retry_in(
        &self,
        tx: &mut Tx,
        id: &str,
        next_key: impl FnOnce(&Effect) -> String,
        actor: &str,
        now_ms: i64,
    ) -> Result<(EffectState, EffectState), StoreError> {
        let effect = self.locked(tx, id).await?;
        let next_key = next_key(&effect);
        let from = effect.state()?;
        let (to, sql) = match from {
            EffectState::NeedsReview | EffectState::Unknown => (
                EffectState::Unknown,
                "UPDATE oncely_effects SET state = 'unknown', checks = 0, \
                 unavailable_streak = 0, available_at = $1, updated_at = $2, \
                 lease_version = lease_version + 1 WHERE id = $3 AND continuation_at IS NULL",
            ),
            EffectState::Failed => (
                EffectState::Absent,
                "UPDATE oncely_effects SET state = 'absent', unavailable_streak = 0, \
                 available_at = $1, updated_at = $2, lease_version = lease_version + 1, \
                 key_generation = key_generation + 1, idem_key = $3 \
                 WHERE id = $4 AND continuation_at IS NULL",
            ),
            other => {
                return Err(StoreError::Conflict(format!(
                "effect {id} is {other}; only needs_review, unknown or failed effects are retried"
            )))
            }
        };
        let q = query(sql).bind(now_ms).bind(now_ms);
        let q = if to == EffectState::Absent {
            q.bind(next_key.as_str()).bind(id)
        } else {
            q.bind(id)
        };
        if tx.execute(q).await? == 0 {
            // A decision recorded for the service's runner and not yet continued: trying the
            // effect again now would let that stale outcome land on the new attempt's step.
            return Err(StoreError::Conflict(format!(
                "effect {id} owes its service the continuation of a decision; retry it once \
                 the service's runner has continued it"
            )));
        }
        let detail = format!("retry: {from} -> {to}");
        Self::audit(tx, id, now_ms, actor, "retry", from, to, &detail).await?;
        Ok((from, to))
    }

    /// An operator's resolution of effect `id` (`oncely effects resolve`), audited: a
    /// person who checked the provider records what happened — `succeeded` with the
    /// provider's object id, or `failed` — for an effect in `needs_review`, `unknown` or
    /// `absent`. Runs in the caller's `tx`, so the business update that follows (an invoice
    /// marked paid) commits with it.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] for an effect
    /// in another state or `succeeded` without a provider id; other [`StoreError`]s when
    /// the database fails.
    pub async fn resolve(
        &self,
        tx: &mut Tx,
        id: &str,
        resolution: &Resolution<'_>,
        now_ms: i64,
    ) -> Result<Effect, StoreError> {
        let Resolution {
            to,
            provider_id,
            actor,
            reason,
        } = *resolution;
        let effect = self.locked(tx, id).await?;
        let from = effect.state()?;
        if !matches!(
            from,
            EffectState::NeedsReview | EffectState::Unknown | EffectState::Absent
        ) {
            return Err(StoreError::Conflict(format!(
                "effect {id} is {from}; only needs_review, unknown or absent effects are resolved"
            )));
        }
        match (to, provider_id) {
            (EffectState::Succeeded, Some(pid)) => {
                tx.execute(
                    query(
                        "UPDATE oncely_effects SET state = 'succeeded', provider_id = $1, \
                         last_error = NULL, updated_at = $2, lease_version = lease_version + 1 \
                         WHERE id = $3",
                    )
                    .bind(pid)
                    .bind(now_ms)
                    .bind(id),
                )
                .await?;
            }
            (EffectState::Failed, _) => {
                tx.execute(
                    query(
                        "UPDATE oncely_effects SET state = 'failed', last_error = $1, \
                         updated_at = $2, lease_version = lease_version + 1 WHERE id = $3",
                    )
                    .bind(format!("resolved by {actor}: {reason}"))
                    .bind(now_ms)
                    .bind(id),
                )
                .await?;
            }
            (EffectState::Succeeded, None) => {
                return Err(StoreError::Conflict(
                    "resolving as succeeded needs the provider's object id".to_owned(),
                ))
            }
            (other, _) => {
                return Err(StoreError::Conflict(format!(
                    "an effect is resolved as succeeded or failed, not {other}"
                )))
            }
        }
        let detail = match provider_id {
            Some(pid) => format!("resolve: {from} -> {to} ({pid}): {reason}"),
            None => format!("resolve: {from} -> {to}: {reason}"),
        };
        Self::audit(tx, id, now_ms, actor, "resolve", from, to, &detail).await?;
        let columns = self.columns();
        tx.fetch_one(
            query(format!(
                "SELECT {columns} FROM oncely_effects WHERE id = $1"
            ))
            .bind(id),
        )
        .await
    }

    /// The audit rows of effect `id`, oldest first: `(at, actor, action, from, to, detail)`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn audit_trail(
        &self,
        id: &str,
    ) -> Result<Vec<(i64, String, String, String, String, String)>, StoreError> {
        self.db
            .fetch_all(
                query(
                    "SELECT at, actor, action, from_state, to_state, detail \
                     FROM oncely_effect_audit WHERE effect_id = $1 ORDER BY id",
                )
                .bind(id),
            )
            .await
    }

    /// Effect `id`, its row locked by `tx` (`SELECT … FOR UPDATE`; SQLite's writer holds
    /// the whole database) so a runner's settle cannot interleave with the operator's
    /// change — the lease version the change raises fences the runner off afterwards.
    pub(crate) async fn locked(&self, tx: &mut Tx, id: &str) -> Result<Effect, StoreError> {
        let columns = self.columns();
        let lock = if self.db.backend().supports_row_locks() {
            " FOR UPDATE"
        } else {
            ""
        };
        tx.fetch_optional(
            query(format!(
                "SELECT {columns} FROM oncely_effects WHERE id = $1{lock}"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))
    }

    #[allow(clippy::too_many_arguments)] // one audit row's columns, each named at the call
    pub(crate) async fn audit(
        tx: &mut Tx,
        id: &str,
        at: i64,
        actor: &str,
        action: &str,
        from: EffectState,
        to: EffectState,
        detail: &str,
    ) -> Result<(), StoreError> {
        tx.execute(
            query(
                "INSERT INTO oncely_effect_audit (effect_id, at, actor, action, from_state, \
                 to_state, detail) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(id)
            .bind(at)
            .bind(actor)
            .bind(action)
            .bind(from.as_str())
            .bind(to.as_str())
            .bind(detail),
        )
        .await?;
        Ok(())
    }
}
