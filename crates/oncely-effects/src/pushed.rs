//! A provider's own word about an object, pushed to us (a Stripe webhook event): applied to
//! the effect the object names through the decision a status check takes, once per event.

use std::time::Duration;

use oncely_core::MessageId;
use oncely_sql::{
    Effect, EffectState, EffectStore, Evidence, EvidenceKind, InboxOutcome, InboxStore, Settle,
    StoreError,
};

use crate::runner::{continue_outcome, of_this_key, verdict};
use crate::{Continue, RemoteObject};

/// The inbox consumer under which pushed events are recorded (`oncely_inbox.consumer`):
/// the primary key `(consumer, message_id)` applies each event once.
pub const PUSHED_CONSUMER: &str = "provider-events";

/// One event a provider pushed, already authenticated (its signature checked): what it
/// says of one object, and which effect kind the object belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct PushedEvent {
    /// The provider's name for where it came from (`stripe`), in the evidence.
    pub source: String,
    /// The event's id at the provider (`evt_…`): the same on every delivery.
    pub id: String,
    /// The event's type (`payment_intent.succeeded`).
    pub kind: String,
    /// When the event happened at the provider, Unix seconds.
    pub created: i64,
    /// The effects' provider the object belongs to (`payments`).
    pub provider: String,
    /// Their operation (`charge`).
    pub operation: String,
    /// The object, read through the provider's status vocabulary; its
    /// [`RemoteObject::reference`] names the effect.
    pub object: RemoteObject,
}

/// What [`apply_pushed`] did with an event.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Applied {
    /// The event was applied before (a redelivery): nothing done.
    Duplicate,
    /// The object names no effect (no reference, or none of ours): recorded as seen.
    NoEffect,
    /// The `unknown` effect was settled from the object, into `state` (`succeeded`,
    /// `failed`, `needs_review`), or stays `unknown` (a pending object) with the evidence.
    Resolved {
        /// The effect.
        effect_id: String,
        /// Its tenant.
        tenant: String,
        /// Its state afterwards.
        state: String,
    },
    /// The effect was settled already (or parked): the event only added evidence.
    Noted {
        /// The effect.
        effect_id: String,
        /// Its tenant.
        tenant: String,
        /// Its state, unchanged.
        state: String,
    },
    /// The effect is being worked on (a runner holds its lease, or its call has not
    /// returned yet): nothing recorded, so a later delivery applies the event.
    Busy {
        /// The effect.
        effect_id: String,
    },
}

/// Applies `event` once: its id recorded in the inbox ([`PUSHED_CONSUMER`], the primary key
/// tells a redelivery apart, never a SELECT first) in the same transaction as what it does
/// to the effect its object names by reference (provider, operation, reference — unique,
/// so the effect, and with it the tenant, is the one the charge was made for; an event
/// never reaches another effect):
/// - an `unknown` effect is leased in that transaction (a runner holding it makes it
///   [`Applied::Busy`]) and settled through the decision a status check takes — live →
///   `succeeded`, ended in the provider's words → `failed`, a word nobody listed →
///   `needs_review`, pending → stays `unknown` — with evidence `status`/`webhook` naming
///   the event, and continued as `how` says (the service's business update);
/// - a settled or parked effect (`succeeded`, `failed`, `needs_review`) only gets the
///   evidence: an event never moves a state back (a late `processing` after `succeeded`);
/// - an effect not yet called back (`pending`, `in_flight`, `absent`) is
///   [`Applied::Busy`]: the runner's own call decides it first.
///
/// A crash anywhere before the commit leaves nothing: the lease, the inbox row and the
/// settle are one transaction, and a redelivery applies the event then.
///
/// # Errors
/// [`StoreError`] when the database fails (nothing is applied; the provider delivers again).
pub async fn apply_pushed(
    store: &EffectStore,
    how: Continue<'_>,
    event: &PushedEvent,
    lease: Duration,
) -> Result<Applied, StoreError> {
    let effect = match &event.object.reference {
        Some(reference) => {
            store
                .find(&event.provider, &event.operation, reference)
                .await?
        }
        None => None,
    };
    // Read before the transaction: on SQLite the transaction holds the only writer.
    let trail = match &effect {
        Some(e) => store.evidence(&e.id).await?,
        None => Vec::new(),
    };
    let now = oncely_core::now_ms();
    let mut tx = store.database().begin().await?;
    let id = MessageId::derive_from_parts(&[&event.source, &event.id]);
    if InboxStore::record(&mut tx, PUSHED_CONSUMER, &id, now).await? == InboxOutcome::Duplicate {
        tx.commit().await?;
        return Ok(Applied::Duplicate);
    }
    let Some(effect) = effect else {
        tx.commit().await?;
        return Ok(Applied::NoEffect);
    };
    let state = effect.state()?;
    let evidence = evidence_of(&effect, event, now);
    match state {
        EffectState::Succeeded | EffectState::Failed | EffectState::NeedsReview => {
            EffectStore::note(&mut tx, &effect.id, &evidence).await?;
            tx.commit().await?;
            return Ok(Applied::Noted {
                effect_id: effect.id,
                tenant: effect.tenant,
                state: state.as_str().to_owned(),
            });
        }
        EffectState::Unknown => {}
        _ => return busy(tx, effect).await,
    }
    let holder = format!("{}-event-{}", event.source, event.id);
    let Some(leased) = store
        .lease_unknown_in(&mut tx, &effect.id, &holder, lease, now)
        .await?
    else {
        return busy(tx, effect).await;
    };
    // The event is verified, recorded and the effect leased — nothing of it committed.
    oncely_core::failpoint::fail_point!("webhook.before_resolve");
    // The status check's reading: an ended object of an earlier key says nothing of this
    // key's attempt; the deciding object settles it.
    let objects = of_this_key(&leased, &trail, vec![event.object.clone()]);
    let decided = RemoteObject::deciding(&objects).and_then(verdict);
    let state = if let Some((settle, outcome)) = &decided {
        EffectStore::settle(&mut tx, &leased, settle, &evidence, now).await?;
        continue_outcome(&mut tx, &leased, outcome, how, now).await?;
        settled_state(settle)
    } else {
        // Pending (or an ended object of an earlier key): still unknown, due when it was;
        // the runner's own status checks decide.
        let settle = Settle::Unknown {
            at: leased.available_at,
            error: leased.last_error.clone().unwrap_or_default(),
        };
        EffectStore::settle(&mut tx, &leased, &settle, &evidence, now).await?;
        EffectState::Unknown
    };
    tx.commit().await?;
    Ok(Applied::Resolved {
        effect_id: leased.id,
        tenant: leased.tenant,
        state: state.as_str().to_owned(),
    })
}

async fn busy(tx: oncely_sql::Tx, effect: Effect) -> Result<Applied, StoreError> {
    tx.rollback().await?;
    Ok(Applied::Busy {
        effect_id: effect.id,
    })
}

fn settled_state(settle: &Settle) -> EffectState {
    match settle {
        Settle::Succeeded { .. } => EffectState::Succeeded,
        Settle::Failed { .. } => EffectState::Failed,
        _ => EffectState::NeedsReview,
    }
}

/// The evidence of `event` on `effect`: a `status` row (the provider's word on the
/// object, as a status check's) whose outcome is `webhook` and whose detail names the
/// event — its source, id, type and creation time — and the object's status.
fn evidence_of(effect: &Effect, event: &PushedEvent, now: i64) -> Evidence {
    Evidence {
        kind: EvidenceKind::Status,
        key: effect.key.clone(),
        started_at: now,
        finished_at: now,
        outcome: "webhook".to_owned(),
        http_status: None,
        provider_ids: vec![event.object.id.clone()],
        detail: format!(
            "{} event {} {} created {}: {} {}",
            event.source, event.id, event.kind, event.created, event.object.id, event.object.status
        ),
    }
}
