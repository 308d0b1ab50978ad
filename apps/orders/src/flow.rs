//! The payment + shipping flow after billing: the effect handler that completes a charge
//! (invoice paid, `invoice.paid` in the outbox, one transaction) and the names the flow's
//! effects carry.

use futures_util::future::BoxFuture;
use oncely_core::MessageId;
use oncely_effects::{EffectHandler, Settled};
use oncely_sql::{query, Effect, OutboxEvent, OutboxStore, StoreError, Tx};

use crate::events::INVOICE_PAID;

/// Provider name of the payments effects (`oncely_effects::StripePayments`).
pub const PAYMENTS: &str = "payments";
/// Operation of an invoice's charge; its reference is the invoice id.
pub const CHARGE: &str = "charge";
/// Provider name of the shipping effects (`oncely_effects::ShippingClient`).
pub const SHIPPING: &str = "shipping";
/// Operation of an order's shipment booking; its reference is the order id.
pub const BOOK: &str = "book";
/// Operation of a refund of an order's charge (the saga's compensation of its charge; under
/// the choreography, of a shipment refused for good, reference `{order}:refund`).
pub const REFUND: &str = "refund";

/// Refunds the charge of the order whose booking `effect` was refused for good: a
/// `payments`/[`REFUND`] effect of the order's paid invoice's PaymentIntent, its key derived
/// from the booking's, enqueued in `tx` (once: the effect store's UNIQUE on provider,
/// operation and reference). An order without a paid invoice has nothing to refund.
async fn refund_order(tx: &mut Tx, effect: &Effect) -> Result<(), StoreError> {
    let paid: Option<(Option<String>,)> = tx
        .fetch_optional(
            query(
                "SELECT payment_id FROM invoices WHERE order_id = $1 AND tenant = $2 \
                 AND paid_at IS NOT NULL",
            )
            .bind(effect.reference.as_str())
            .bind(effect.tenant.as_str()),
        )
        .await?;
    let Some((Some(payment_intent),)) = paid else {
        return Ok(());
    };
    let reference = format!("{}:refund", effect.reference);
    let key = oncely_core::derive_key(
        &oncely_core::Scope::new(
            oncely_core::TenantId::parse(effect.tenant.as_str())
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            oncely_core::Operation::new("EFFECT", "shipping/book"),
        ),
        &oncely_core::IdempotencyKey::parse(effect.key.as_bytes())
            .map_err(|e| StoreError::Corrupt(e.to_string()))?,
        REFUND,
        0,
    );
    let request = serde_json::json!({ "payment_intent": payment_intent });
    oncely_sql::EffectStore::enqueue(
        tx,
        &oncely_sql::NewEffect {
            tenant: effect.tenant.as_str(),
            provider: PAYMENTS,
            operation: REFUND,
            reference: &reference,
            key: &key,
            request: &request,
        },
        oncely_core::now_ms(),
    )
    .await?;
    Ok(())
}

/// The order service's part of settling an effect ([`EffectHandler`]), inside the settle
/// transaction:
/// - `payments`/`charge` succeeded: the invoice (the effect's reference, in the effect's
///   tenant) is marked paid — `paid_at` now, `payment_id` the provider's object id — and,
///   when this settle is what paid it, `invoice.paid` is written to the outbox on `topic`:
///   message id derived from (`invoice.paid`, invoice id), partition key the order id,
///   headers `tenant` and `correlation-id` (the order's), payload `order_id`, `invoice_id`,
///   `amount_minor`, `currency`, `payment_id`, `paid_at`. A second settle of the same
///   charge (a status check that found it again) changes nothing.
/// - `failed` / `needs_review`: the invoice stays open (`GET` shows the payment's state);
///   logged at `WARN`.
/// - `shipping`/`book` booked: nothing beyond the effect's own row (`GET` reads it);
///   refused for good (undeliverable): the order's charge is refunded — a `payments`/
///   [`REFUND`] effect of the paid invoice's PaymentIntent, reference `{order}:refund`, in
///   the same transaction — so no order keeps a live charge without a shipment; a review
///   is logged at `WARN`.
#[derive(Debug, Clone)]
pub struct OrderEffects {
    topic: String,
}

impl OrderEffects {
    /// A handler writing `invoice.paid` to the events topic `topic` (the service's
    /// [`crate::AppConfig::events_topic`]).
    pub fn new(topic: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
        }
    }
}

/// The invoice columns `invoice.paid` needs.
#[derive(sqlx::FromRow)]
struct PaidInvoice {
    order_id: String,
    amount_minor: i64,
    currency: String,
    correlation_id: Option<String>,
}

impl EffectHandler for OrderEffects {
    fn settled<'a>(
        &'a self,
        tx: &'a mut Tx,
        effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let charge = effect.provider == PAYMENTS && effect.operation == CHARGE;
            let booking = effect.provider == SHIPPING && effect.operation == BOOK;
            match outcome {
                Settled::Succeeded(object) if charge => {
                    self.invoice_paid(tx, effect, &object.id).await
                }
                Settled::Failed { error } if booking => {
                    tracing::warn!(effect = %effect.id, order = %effect.reference, error,
                        "the shipment was refused for good; the order's charge is refunded");
                    refund_order(tx, effect).await
                }
                Settled::Failed { error } => {
                    tracing::warn!(effect = %effect.id, provider = %effect.provider,
                        operation = %effect.operation, reference = %effect.reference,
                        error, "effect failed; the business object stays as it is");
                    Ok(())
                }
                Settled::NeedsReview { error } => {
                    tracing::warn!(effect = %effect.id, provider = %effect.provider,
                        operation = %effect.operation, reference = %effect.reference,
                        error, "effect needs review (oncely effects show / resolve)");
                    Ok(())
                }
                // A booked shipment needs nothing beyond its effect row; Settled is
                // non_exhaustive: what a later runner adds changes nothing here.
                _ => Ok(()),
            }
        })
    }
}

impl OrderEffects {
    /// Marks the charged invoice paid and writes `invoice.paid`, once.
    async fn invoice_paid(
        &self,
        tx: &mut Tx,
        effect: &Effect,
        payment_id: &str,
    ) -> Result<(), StoreError> {
        let invoice_id = effect.reference.as_str();
        let tenant = effect.tenant.as_str();
        let now = oncely_core::now_ms();
        let paid = tx
            .execute(
                query(
                    "UPDATE invoices SET paid_at = $1, payment_id = $2 \
                     WHERE id = $3 AND tenant = $4 AND paid_at IS NULL",
                )
                .bind(now)
                .bind(payment_id)
                .bind(invoice_id)
                .bind(tenant),
            )
            .await?;
        if paid == 0 {
            // Paid already (a second settle of the same charge), or no such invoice of
            // this tenant: nothing to announce.
            return Ok(());
        }
        let invoice: PaidInvoice = tx
            .fetch_one(
                query(
                    "SELECT order_id, amount_minor, currency, correlation_id FROM invoices \
                     WHERE id = $1 AND tenant = $2",
                )
                .bind(invoice_id)
                .bind(tenant),
            )
            .await?;
        let payload = serde_json::json!({
            "order_id": invoice.order_id,
            "invoice_id": invoice_id,
            "amount_minor": invoice.amount_minor,
            "currency": invoice.currency,
            "payment_id": payment_id,
            "paid_at": now,
        });
        let correlation = invoice
            .correlation_id
            .unwrap_or_else(|| invoice.order_id.clone());
        let event = OutboxEvent::new(
            MessageId::derive_from_parts(&[INVOICE_PAID, invoice_id]),
            self.topic.as_str(),
            invoice.order_id.as_str(),
            INVOICE_PAID,
            payload.to_string().into_bytes(),
        )
        .with_header("tenant", tenant)
        .with_header("correlation-id", correlation);
        OutboxStore::enqueue(tx, &event).await?;
        metrics::counter!(crate::metrics::ORDERS_INVOICES_PAID_TOTAL).increment(1);
        Ok(())
    }
}
