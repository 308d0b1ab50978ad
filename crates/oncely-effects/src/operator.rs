//! An operator's decision on an effect, carried through to the service's business update.

use oncely_sql::{Effect, EffectState, EffectStore, Resolution, StoreError, Tx};

use crate::runner::{continue_outcome, Outcome};
use crate::{Continue, ObjectState, RemoteObject};

/// Resolves effect `id` as a person found it at the provider (`oncely effects resolve`,
/// the console) and continues it as the runner would have settled it: a charge resolved
/// as `succeeded` marks its invoice paid and writes `invoice.paid` (or continues its saga),
/// a `failed` one is handled as a refusal. `how` says who runs the service's
/// [`EffectHandler`](crate::EffectHandler): [`Continue::Here`] in this transaction — the
/// resolution, its audit row and the business update commit together or not at all — or
/// [`Continue::ByRunner`]: the resolution, its audit row and the mark the service's runner
/// continues from commit together.
///
/// The handler sees a [`RemoteObject`] made from the resolution: `id` = the provider id
/// given, `status` `"succeeded"`, `effective`, `reference` the effect's, and `raw`
/// `{"id", "resolved_by", "reason"}` — the operator's word is the evidence.
///
/// Only `needs_review`, `unknown` and `absent` effects are resolved ([`EffectStore::resolve`]),
/// so an effect the runner already settled is never handled twice.
///
/// # Errors
/// Those of [`EffectStore::resolve`] ([`StoreError::NotFound`], [`StoreError::Conflict`]
/// for another state or `succeeded` without a provider id); a [`StoreError`] of the
/// handler rolls the resolution back.
pub async fn resolve_effect(
    store: &EffectStore,
    how: Continue<'_>,
    id: &str,
    resolution: &Resolution<'_>,
    now_ms: i64,
) -> Result<Effect, StoreError> {
    let mut tx = store.database().begin().await?;
    let effect = resolve_in(store, &mut tx, how, id, resolution, now_ms).await?;
    tx.commit().await?;
    Ok(effect)
}

/// [`resolve_effect`] in the caller's `tx` (a discrepancy's `mark-succeeded` closes the
/// discrepancy in the same transaction).
pub(crate) async fn resolve_in(
    store: &EffectStore,
    tx: &mut Tx,
    how: Continue<'_>,
    id: &str,
    resolution: &Resolution<'_>,
    now_ms: i64,
) -> Result<Effect, StoreError> {
    let effect = store.resolve(tx, id, resolution, now_ms).await?;
    let outcome = match (resolution.to, resolution.provider_id) {
        (EffectState::Succeeded, Some(provider_id)) => Outcome::Succeeded(RemoteObject {
            id: provider_id.to_owned(),
            status: "succeeded".to_owned(),
            state: ObjectState::Live,
            reference: Some(effect.reference.clone()),
            amount: None,
            currency: None,
            created: None,
            raw: serde_json::json!({
                "id": provider_id,
                "resolved_by": resolution.actor,
                "reason": resolution.reason,
            }),
        }),
        (EffectState::Failed, _) => Outcome::Failed(format!(
            "resolved by {}: {}",
            resolution.actor, resolution.reason
        )),
        // EffectStore::resolve refused every other combination.
        _ => return Ok(effect),
    };
    continue_outcome(tx, &effect, &outcome, how, now_ms).await?;
    Ok(effect)
}

/// Tries a `needs_review`, `unknown` or `failed` effect `id` again under its key's next
/// generation ([`crate::next_key`]), audited as `actor`'s retry at `now_ms`
/// (`oncely effects retry`, the console). Never a blind call: the runner checks an unknown
/// outcome at the provider first.
///
/// # Errors
/// [`StoreError::NotFound`] for an unknown id; those of [`EffectStore::retry`]
/// ([`StoreError::Conflict`] for a state that cannot be retried).
pub async fn retry_effect(
    store: &EffectStore,
    id: &str,
    actor: &str,
    now_ms: i64,
) -> Result<Effect, StoreError> {
    let current = store
        .get(id)
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    let next = crate::next_key(&current.key, current.key_generation + 1);
    store.retry(id, &next, actor, now_ms).await
}
