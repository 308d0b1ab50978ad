//! [`PaymentStatus`]: the multi-phase resolver that asks the provider what became of a
//! charge whose outcome is unknown.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use oncely_effects::{ObjectState, Provider, RemoteObject, StatusOutcome, StatusQuery};
use oncely_http::{Resolution, ResolveQuery, Resolver};
use oncely_sql::{Database, StoreError};

use crate::payment_store::{self as store, EvidenceRow};

use super::answers::{already_paid, charged_by_flow, declined, paid};
use super::{charge_request, order_amount, order_id_of};

/// The status check of an `unknown` payment record: the provider's PaymentIntents by the
/// order's reference (search, or the list), since the record's creation.
#[derive(Debug)]
pub(crate) struct PaymentStatus {
    pub(super) db: Database,
    pub(super) provider: Arc<dyn Provider>,
}

fn system_time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl Resolver for PaymentStatus {
    fn resolve<'a>(&'a self, q: ResolveQuery<'a>) -> BoxFuture<'a, Resolution> {
        Box::pin(async move {
            // No such order: the handler answers 404 and stores nothing.
            let Some(order_id) = order_id_of(q.request).await else {
                return Resolution::Absent;
            };
            match self.check(q, &order_id).await {
                Ok(r) => r,
                Err(e) => Resolution::Unknown(format!("the database failed: {e}")),
            }
        })
    }
}

impl PaymentStatus {
    /// What the order's PaymentIntents found by the status check mean for this key,
    /// three-valued (docs/DESIGN.md "Status vocabularies"): live — the receipt, but only to
    /// the key that charged (another key's charge is 409 `order-already-paid`); ended in
    /// Stripe's words — declined; pending or a word nobody listed — still unknown, never a
    /// refusal. Returns the resolution and the id of the object it rests on.
    async fn settle_found(
        &self,
        q: ResolveQuery<'_>,
        order_id: &str,
        (amount, currency): (i64, &str),
        found: &[RemoteObject],
        now: i64,
    ) -> Result<(Resolution, String), StoreError> {
        let object = RemoteObject::deciding(found).unwrap_or(&found[0]);
        let key = q.context.key.as_str();
        let owner = store::by_order(&self.db, q.context.scope.tenant.as_str(), order_id).await?;
        if let Some(row) = owner.as_ref().filter(|r| r.idempotency_key != key) {
            // Another key (or the billing flow) owns the order's payment now: its receipt
            // is not this key's to replay.
            let resolution = if row.via == store::VIA_FLOW {
                Resolution::Found(charged_by_flow(order_id))
            } else if row.state == "succeeded" {
                Resolution::Found(already_paid(order_id, row))
            } else {
                Resolution::Unknown(format!(
                    "another key's payment of the order is {}",
                    row.state
                ))
            };
            return Ok((resolution, object.id.clone()));
        }
        let (state, res) = match object.state {
            ObjectState::Live => ("succeeded", paid(order_id, amount, currency, object)),
            ObjectState::Ended => {
                let msg = format!("the PaymentIntent is {}", object.status);
                (
                    "declined",
                    declined(order_id, Some(&object.status), &msg, Some(&object.id)),
                )
            }
            _ => {
                let why = format!(
                    "the PaymentIntent {} is {} ({:?}): not an outcome yet",
                    object.id, object.status, object.state
                );
                return Ok((Resolution::Unknown(why), object.id.clone()));
            }
        };
        store::set_outcome(&self.db, order_id, key, state, Some(&object.id), now).await?;
        Ok((Resolution::Found(res), object.id.clone()))
    }

    async fn check(&self, q: ResolveQuery<'_>, order_id: &str) -> Result<Resolution, StoreError> {
        let tenant = q.context.scope.tenant.as_str();
        let Some((amount, currency)) = order_amount(&self.db, tenant, order_id).await? else {
            // No such order: the handler answers 404 and stores nothing.
            return Ok(Resolution::Absent);
        };
        let request = charge_request(q.context, order_id, (amount, &currency), None);
        let last_sent = store::last_call(&self.db, order_id, &request.key).await?;
        let status = self.provider.status(StatusQuery {
            request: &request,
            last_sent: last_sent.map(system_time),
            since: system_time(q.record.created_at) - Duration::from_secs(300),
        });
        let started_at = oncely_core::now_ms();
        let (outcome, resolution, provider_id) = match status.await {
            Ok(StatusOutcome::Found(found)) => {
                let (resolution, object) = self
                    .settle_found(q, order_id, (amount, &currency), &found, started_at)
                    .await?;
                ("found", resolution, Some(object))
            }
            Ok(StatusOutcome::Absent) => ("absent", Resolution::Absent, None),
            Ok(other) => (
                "unknown",
                Resolution::Unknown(format!("the provider's lookup may still lag: {other:?}")),
                None,
            ),
            Err(e) => (
                "unavailable",
                Resolution::Unknown(format!("the provider could not be asked: {e}")),
                None,
            ),
        };
        let detail = match &resolution {
            Resolution::Unknown(why) => why.clone(),
            _ => format!("status check of fence {}", q.context.fence),
        };
        store::add_evidence(
            &self.db,
            order_id,
            &EvidenceRow {
                fence: q.context.fence,
                kind: "status".to_owned(),
                provider_key: request.key.clone(),
                started_at,
                finished_at: Some(oncely_core::now_ms()),
                outcome: outcome.to_owned(),
                http_status: None,
                provider_id,
                detail: Some(detail),
            },
        )
        .await?;
        Ok(resolution)
    }
}
