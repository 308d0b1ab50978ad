//! Continuations: the business update of an outcome decided outside the runner (an
//! operator's resolution, a reconciliation run), run by the service's handler — at once
//! where the caller holds it, else by the service's runner from a mark in the store.

use oncely_sql::{Continuation, Effect, EffectStore, StoreError, Tx};

use super::{now_ms, EffectHandler, EffectRunner, Outcome};

/// Who runs the service's [`EffectHandler`] on an outcome decided outside the runner.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum Continue<'a> {
    /// This handler, in the transaction that records the outcome: the outcome, its audit
    /// and the business update commit together. For callers inside the service's own
    /// process (its console, its periodic reconciler).
    Here(&'a dyn EffectHandler),
    /// The service's [`EffectRunner`]: the outcome is marked on the effect in the
    /// transaction that records it, and a runner on the store hands it to its handler in
    /// the transaction that clears the mark
    /// ([`EffectRunner::continue_owed`]). For callers that are not the service (the
    /// `oncely` CLI), which must never run an app's handler with another configuration.
    ByRunner,
}

impl std::fmt::Debug for Continue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Here(_) => "Continue::Here",
            Self::ByRunner => "Continue::ByRunner",
        })
    }
}

/// Continues `effect`'s `outcome` as `how` says, in `tx` (at `now_ms`): the handler's
/// business update, or the mark the service's runner picks up.
pub(crate) async fn continue_outcome(
    tx: &mut Tx,
    effect: &Effect,
    outcome: &Outcome,
    how: Continue<'_>,
    now_ms: i64,
) -> Result<(), StoreError> {
    match how {
        Continue::Here(handler) => handler.settled(tx, effect, outcome.settled()).await,
        Continue::ByRunner => {
            let text = serde_json::to_string(outcome)
                .map_err(|e| StoreError::Corrupt(format!("effect {} outcome: {e}", effect.id)))?;
            EffectStore::mark_continuation(tx, &effect.id, &text, now_ms).await
        }
    }
}

impl EffectRunner {
    /// Runs this runner's handler on every continuation due (outcomes an operator or a
    /// reconciliation run recorded with [`Continue::ByRunner`]), up to
    /// [`RunnerConfig::batch`](super::RunnerConfig::batch): per effect, one transaction
    /// clears the mark — a conditional update, so of two runners only one takes it — and
    /// runs the handler with the outcome as recorded. A continuation needs no provider
    /// call, so a runner continues those of every provider, whatever its lanes: give every
    /// runner on a store the service's handler. A handler that fails rolls back (the mark
    /// stays) and is tried again after the lease. Returns how many were continued.
    /// [`EffectRunner::run`] calls it once per [`RunnerConfig::poll`](super::RunnerConfig::poll),
    /// and again at once after a full batch.
    ///
    /// # Errors
    /// [`StoreError`] when the continuations cannot be read.
    pub async fn continue_owed(&self) -> Result<usize, StoreError> {
        let mut continued = 0;
        let owed = self
            .store
            .continuations(self.config.batch, now_ms())
            .await?;
        for c in owed {
            match self.continue_one(&c).await {
                Ok(true) => continued += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(effect = %c.effect_id, error = %e, "continuation failed; tried again after the lease");
                    let at = now_ms().saturating_add(super::ms(self.config.lease));
                    if let Err(e) = self.store.defer_continuation(&c, at).await {
                        tracing::warn!(effect = %c.effect_id, error = %e, "continuation not put off");
                    }
                }
            }
        }
        Ok(continued)
    }

    /// One continuation in one transaction: `false` when another runner took it.
    async fn continue_one(&self, c: &Continuation) -> Result<bool, StoreError> {
        let outcome: Outcome = serde_json::from_str(&c.outcome).map_err(|e| {
            StoreError::Corrupt(format!("effect {} continuation: {e}", c.effect_id))
        })?;
        let effect = self
            .store
            .get(&c.effect_id)
            .await?
            .ok_or_else(|| StoreError::NotFound(c.effect_id.clone()))?;
        let mut tx = self.store.database().begin().await?;
        if !EffectStore::take_continuation(&mut tx, c).await? {
            return Ok(false);
        }
        self.handler
            .settled(&mut tx, &effect, outcome.settled())
            .await?;
        tx.commit().await?;
        tracing::info!(effect = %effect.id, "continued an outcome decided outside the runner");
        Ok(true)
    }
}
