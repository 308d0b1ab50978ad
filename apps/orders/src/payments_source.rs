//! The payments endpoint's charges as a source of local intents for reconciliation
//! (`oncely_effects::LocalSource`): without it, every charge made through `POST
//! /v1/orders/{id}/payments` would be reported `missing_local`.

use futures_util::future::BoxFuture;
use oncely_effects::{
    Completion, LocalIntent, LocalSource, LocalStatus, ObjectState, RemoteObject,
};
use oncely_sql::{Database, StoreError};

use crate::payment_store::{self as store, EvidenceRow, PaymentRow};

/// The rows of `order_payments` made by the payments endpoint, as reconciliation's local
/// intents of provider `payments`, operation `charge`, by their reference
/// `order:{id}:payment`. An `unknown` payment whose PaymentIntent the run found is
/// completed in the table (state and PaymentIntent id, a `status` evidence row); its
/// idempotency record is completed by the client's next retry (the status check finds the
/// same object).
#[derive(Debug, Clone)]
pub struct PaymentsSource {
    db: Database,
}

impl PaymentsSource {
    /// The endpoint's payments in `db` (the order service's database, migrated).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    fn intent((row, tenant): (PaymentRow, String)) -> LocalIntent {
        let status = match row.state.as_str() {
            "succeeded" => LocalStatus::Succeeded {
                provider_id: row.payment_intent.clone(),
            },
            "declined" => LocalStatus::Failed,
            "unknown" => LocalStatus::Unknown,
            _ => LocalStatus::InProgress,
        };
        LocalIntent {
            source: "order_payments".to_owned(),
            id: row.order_id,
            tenant,
            reference: row.reference,
            status,
            state: row.state,
            amount: Some(row.amount_minor),
            currency: Some(row.currency.to_ascii_lowercase()),
        }
    }

    fn applies(provider: &str, operation: &str) -> bool {
        provider == crate::PAYMENTS && operation == crate::CHARGE
    }
}

impl LocalSource for PaymentsSource {
    fn name(&self) -> &'static str {
        "order_payments"
    }

    fn intents<'a>(
        &'a self,
        provider: &'a str,
        operation: &'a str,
        since_ms: i64,
    ) -> BoxFuture<'a, Result<Vec<LocalIntent>, StoreError>> {
        Box::pin(async move {
            if !Self::applies(provider, operation) {
                return Ok(Vec::new());
            }
            let rows = store::endpoint_since(&self.db, since_ms).await?;
            Ok(rows.into_iter().map(Self::intent).collect())
        })
    }

    fn by_reference<'a>(
        &'a self,
        provider: &'a str,
        operation: &'a str,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<Option<LocalIntent>, StoreError>> {
        Box::pin(async move {
            if !Self::applies(provider, operation) {
                return Ok(None);
            }
            let row = store::endpoint_by_reference(&self.db, reference).await?;
            Ok(row.map(Self::intent))
        })
    }

    fn complete<'a>(
        &'a self,
        intent: &'a LocalIntent,
        found: &'a [RemoteObject],
        run_id: &'a str,
    ) -> BoxFuture<'a, Result<Completion, StoreError>> {
        Box::pin(async move {
            let Some((row, _)) = store::endpoint_by_reference(&self.db, &intent.reference).await?
            else {
                return Ok(Completion::Busy);
            };
            if row.state != "unknown" {
                return Ok(Completion::Busy);
            }
            let now = oncely_core::now_ms();
            // Live: charged; ended in Stripe's words: declined. Pending or a word nobody
            // listed proves neither: the payment stays unknown (docs/DESIGN.md "Status
            // vocabularies").
            let object = RemoteObject::deciding(found);
            if let Some(o) = object {
                let state = match o.state {
                    ObjectState::Live => "succeeded",
                    ObjectState::Ended => "declined",
                    _ => return Ok(Completion::Busy),
                };
                store::set_outcome(
                    &self.db,
                    &row.order_id,
                    &row.idempotency_key,
                    state,
                    Some(&o.id),
                    now,
                )
                .await?;
            }
            let evidence = EvidenceRow {
                fence: row.fence,
                kind: "status".to_owned(),
                provider_key: row.provider_key.clone(),
                started_at: now,
                finished_at: Some(now),
                outcome: if object.is_some() { "found" } else { "absent" }.to_owned(),
                http_status: None,
                provider_id: object.map(|o| o.id.clone()),
                detail: Some(format!("reconciliation run {run_id}")),
            };
            store::add_evidence(&self.db, &row.order_id, &evidence).await?;
            Ok(if object.is_some() {
                Completion::Completed
            } else {
                Completion::StillUnknown
            })
        })
    }
}
