//! Resolution actions an operator takes on a discrepancy ([`ResolveAction`], [`resolve`]).

use oncely_sql::{
    Discrepancy, DiscrepancyKind, DiscrepancyStore, EffectState, EffectStore, Enqueued, NewEffect,
    Resolution, StoreError,
};
use serde_json::json;

use crate::Continue;

/// An operator's action on a discrepancy ([`resolve`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResolveAction {
    /// Any kind: a person looked and accepts it; the same provider, kind and reference is
    /// not reported again.
    Acknowledge,
    /// `status_mismatch` of an effect in `needs_review` (or `unknown`, `absent`) whose
    /// record is live at the provider: the effect is resolved as succeeded with that record
    /// (`provider_id`, or the one live record the run found) and continued as
    /// [`crate::resolve_effect`] continues it.
    MarkSucceeded {
        /// The provider's object id; needed when the run found more than one.
        provider_id: Option<String>,
    },
    /// `duplicate_remote` or `missing_local` on payments: a refund of one PaymentIntent is
    /// enqueued as an effect (reference `refund:<id>`, its key derived from it, so asking
    /// twice refunds once); the effect runner sends it. Never the PaymentIntent a local
    /// effect recorded as its charge. Not reported again afterwards.
    Refund {
        /// The PaymentIntent to refund; needed when more than one could be meant.
        provider_id: Option<String>,
    },
}

impl ResolveAction {
    /// The action's word in the audit row: `acknowledge`, `mark-succeeded`, `refund`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Acknowledge => oncely_sql::ACKNOWLEDGE,
            Self::MarkSucceeded { .. } => "mark-succeeded",
            Self::Refund { .. } => oncely_sql::REFUND,
        }
    }
}

/// Resolves open discrepancy `id` by `action`, audited (actor, reason, what was done) — the
/// action's change and the discrepancy's closing commit together; an effect resolved as
/// succeeded is continued as `how` says ([`Continue`]), in that transaction too.
///
/// # Errors
/// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] when it is resolved
/// already, or the action does not apply to its kind or state (the message says why);
/// other [`StoreError`]s when the database fails.
pub async fn resolve(
    store: &DiscrepancyStore,
    how: Continue<'_>,
    id: &str,
    action: &ResolveAction,
    actor: &str,
    reason: &str,
) -> Result<Discrepancy, StoreError> {
    let d = store
        .get(id)
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    let kind = d.kind()?;
    let now = oncely_core::now_ms();
    let effects = EffectStore::new(store.database().clone());
    let mut tx = store.database().begin().await?;
    let detail = match action {
        ResolveAction::Acknowledge => format!("{kind} acknowledged"),
        ResolveAction::MarkSucceeded { provider_id } => {
            mark_succeeded(
                &effects,
                &mut tx,
                how,
                &d,
                provider_id.as_deref(),
                actor,
                reason,
                now,
            )
            .await?
        }
        ResolveAction::Refund { provider_id } => {
            enqueue_refund(&effects, &mut tx, &d, provider_id.as_deref(), now).await?
        }
    };
    let resolved = store
        .resolve(&mut tx, id, action.as_str(), actor, reason, &detail, now)
        .await?;
    tx.commit().await?;
    Ok(resolved)
}

fn conflict(why: String) -> StoreError {
    StoreError::Conflict(why)
}

/// The one id of `ids` meant: `chosen` (which must be among them), or the only one.
fn one_of(ids: &[String], chosen: Option<&str>, what: &str) -> Result<String, StoreError> {
    match chosen {
        Some(c) if ids.iter().any(|i| i == c) => Ok(c.to_owned()),
        Some(c) => Err(conflict(format!(
            "{c} is not among the records found ({})",
            ids.join(", ")
        ))),
        None if ids.len() == 1 => Ok(ids[0].clone()),
        None => Err(conflict(format!(
            "more than one {what} could be meant ({}): name one with --provider-id",
            ids.join(", ")
        ))),
    }
}

#[allow(clippy::too_many_arguments)] // the resolution's parts, each named at the call
async fn mark_succeeded(
    effects: &EffectStore,
    tx: &mut oncely_sql::Tx,
    how: Continue<'_>,
    d: &Discrepancy,
    provider_id: Option<&str>,
    actor: &str,
    reason: &str,
    now: i64,
) -> Result<String, StoreError> {
    let kind = d.kind()?;
    let Some(effect_id) = d
        .effect_id
        .as_deref()
        .filter(|_| kind == DiscrepancyKind::StatusMismatch)
    else {
        return Err(conflict(format!(
            "mark-succeeded applies to a status_mismatch of a local effect, not {kind}"
        )));
    };
    let live: Vec<String> = d.details_json()?["remote_statuses"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|o| {
                    matches!(
                        o["status"].as_str(),
                        Some("succeeded" | "booked" | "requires_capture")
                    )
                })
                .filter_map(|o| o["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let pid = one_of(&live, provider_id, "live record")?;
    let resolution = Resolution {
        to: EffectState::Succeeded,
        provider_id: Some(&pid),
        actor,
        reason,
    };
    let effect = crate::operator::resolve_in(effects, tx, how, effect_id, &resolution, now).await?;
    Ok(format!(
        "effect {} resolved as succeeded with {pid}",
        effect.id
    ))
}

async fn enqueue_refund(
    effects: &EffectStore,
    tx: &mut oncely_sql::Tx,
    d: &Discrepancy,
    provider_id: Option<&str>,
    now: i64,
) -> Result<String, StoreError> {
    let kind = d.kind()?;
    if d.provider != "payments"
        || !matches!(
            kind,
            DiscrepancyKind::DuplicateRemote | DiscrepancyKind::MissingLocal
        )
    {
        return Err(conflict(format!(
            "refund applies to a payments duplicate_remote or missing_local, not {} {kind}",
            d.provider
        )));
    }
    // Never the charge a local effect recorded.
    let recorded = match d.effect_id.as_deref() {
        Some(id) => effects.get(id).await?.and_then(|e| e.provider_id),
        None => None,
    };
    let candidates: Vec<String> = d
        .provider_id_list()
        .into_iter()
        .filter(|i| Some(i) != recorded.as_ref())
        .collect();
    let pid = one_of(&candidates, provider_id, "PaymentIntent to refund")?;
    let reference = format!("refund:{pid}");
    let key = crate::next_key(&reference, 0);
    let request = json!({ "payment_intent": pid });
    let new = NewEffect {
        tenant: d.tenant.as_deref().unwrap_or("reconciliation"),
        provider: "payments",
        operation: "refund",
        reference: &reference,
        key: &key,
        request: &request,
    };
    Ok(match EffectStore::enqueue(tx, &new, now).await? {
        Enqueued::Created(effect) => format!("refund of {pid} enqueued as effect {effect}"),
        _ => format!("a refund of {pid} was enqueued before"),
    })
}
