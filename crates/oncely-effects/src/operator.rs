//! An operator's decision on an effect, carried through to the service's business update.

use oncely_sql::{Effect, EffectState, EffectStore, Resolution, StoreError};

use crate::{EffectHandler, ObjectState, RemoteObject, Settled};

/// Resolves effect `id` as a person found it at the provider (`oncely effects resolve`,
/// the console) and runs the service's [`EffectHandler`] on that outcome in the same
/// transaction, exactly as the runner would have settled it: a charge resolved as
/// `succeeded` marks its invoice paid and writes `invoice.paid` (or continues its saga), a
/// `failed` one is handled as a refusal. The resolution, its audit row and the business
/// update commit together or not at all.
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
    handler: &dyn EffectHandler,
    id: &str,
    resolution: &Resolution<'_>,
    now_ms: i64,
) -> Result<Effect, StoreError> {
    let mut tx = store.database().begin().await?;
    let effect = store.resolve(&mut tx, id, resolution, now_ms).await?;
    match (resolution.to, resolution.provider_id) {
        (EffectState::Succeeded, Some(provider_id)) => {
            let object = RemoteObject {
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
            };
            handler
                .settled(&mut tx, &effect, Settled::Succeeded(&object))
                .await?;
        }
        (EffectState::Failed, _) => {
            let error = format!("resolved by {}: {}", resolution.actor, resolution.reason);
            handler
                .settled(&mut tx, &effect, Settled::Failed { error: &error })
                .await?;
        }
        // EffectStore::resolve refused every other combination.
        _ => {}
    }
    tx.commit().await?;
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
