use std::sync::Arc;

use oncely_broker::{BoxFuture, ReceivedMessage, Subscriber};
use oncely_core::{IdempotencyKey, Operation, Scope, TenantId};
use oncely_inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Rejected};
use oncely_sql::{query, Database, EffectStore, NewEffect, Tx};
use serde::Deserialize;

use crate::events::{decode, ORDER_CREATED};
use crate::flow::{CHARGE, PAYMENTS};

/// Name of the billing consumer (its consumer group and inbox).
pub const BILLING_CONSUMER: &str = "billing";
/// The invoice kind billing creates for a new order.
pub const INVOICE_KIND_ORDER: &str = "order";

/// The fields of an `order.created` payload billing needs.
#[derive(Debug, Deserialize)]
struct OrderCreated {
    id: String,
    amount_minor: i64,
    currency: String,
}

/// The `billing` handler: creates the invoice of each `order.created` event in the
/// consumer's transaction (the same one that holds the inbox row). `UNIQUE(order_id, kind)`
/// stands behind the inbox: a message with a new id for the same order creates nothing.
/// Other event types are acknowledged without effect; an `order.created` that does not
/// decode is [`Rejected`] (dead at once).
///
/// [`BillingHandler::charging`] also enqueues, in the same transaction and only for an
/// invoice it actually inserted, the invoice's charge: an effect of provider `payments`,
/// operation `charge`, reference = the invoice id, its key derived with
/// [`oncely_effects::derive_key`] from scope (tenant, `CONSUME billing`), the order id and
/// step `charge` — the same key however often the event is delivered. Its request is what
/// [`oncely_effects::StripePayments`] reads: `amount` (minor units), `currency` (lower
/// case), `metadata` {`order_id`, `invoice_id`}. [`crate::OrderEffects`] completes it.
/// The charge first claims the order's payment (`order_payments`, via `flow`): an order
/// that `POST /v1/orders/{id}/payments` claimed first gets no charge effect.
/// [`BillingHandler::default`] stops at the invoice.
#[derive(Debug, Default, Clone, Copy)]
pub struct BillingHandler {
    charge: bool,
}

impl BillingHandler {
    /// A handler that creates invoices only (no payments configured).
    pub fn invoices_only() -> Self {
        Self { charge: false }
    }

    /// A handler that creates each invoice and enqueues its charge.
    pub fn charging() -> Self {
        Self { charge: true }
    }

    /// Whether invoices get a charge enqueued.
    pub fn charges(&self) -> bool {
        self.charge
    }
}

impl Handler for BillingHandler {
    fn handle<'a>(
        &'a self,
        tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let Some((order, tenant)) = decode::<OrderCreated>(message, ORDER_CREATED)? else {
                return Ok(());
            };
            let invoice_id = uuid::Uuid::now_v7().to_string();
            let message_id = message.id.to_string();
            let correlation = message
                .headers
                .get("correlation-id")
                .filter(|c| !c.is_empty() && c.len() <= 200)
                .map_or(order.id.as_str(), String::as_str);
            let now = oncely_core::now_ms();
            // UNIQUE(order_id, kind): an invoice that exists already is left as it is.
            let inserted = tx
                .insert_ignoring_duplicate(
                    query(
                        "INSERT INTO invoices (id, tenant, order_id, kind, amount_minor, \
                         currency, message_id, created_at, correlation_id) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    )
                    .bind(invoice_id.as_str())
                    .bind(tenant.as_str())
                    .bind(order.id.as_str())
                    .bind(INVOICE_KIND_ORDER)
                    .bind(order.amount_minor)
                    .bind(order.currency.as_str())
                    .bind(message_id)
                    .bind(now)
                    .bind(correlation),
                    "(order_id, kind)",
                )
                .await?;
            if inserted && self.charge {
                enqueue_charge(tx, tenant, &order, &invoice_id, now).await?;
            }
            Ok(())
        })
    }
}

/// Enqueues the charge of the invoice `invoice_id` just inserted for `order`, in `tx`.
async fn enqueue_charge(
    tx: &mut Tx,
    tenant: &str,
    order: &OrderCreated,
    invoice_id: &str,
    now: i64,
) -> Result<(), HandlerError> {
    let tenant_id = TenantId::parse(tenant)
        .map_err(|e| Rejected(format!("order.created tenant header: {e}")))?;
    let parent = IdempotencyKey::parse(order.id.as_bytes())
        .map_err(|e| Rejected(format!("order.created id as a key: {e}")))?;
    let scope = Scope::new(tenant_id, Operation::new("CONSUME", BILLING_CONSUMER));
    let key = oncely_effects::derive_key(&scope, &parent, CHARGE, 0);
    // One payment per order: the payments endpoint may have claimed it first.
    let claim = crate::payment_store::NewPayment {
        order_id: &order.id,
        tenant,
        via: crate::payment_store::VIA_FLOW,
        idempotency_key: "",
        reference: invoice_id,
        provider_key: &key,
        amount_minor: order.amount_minor,
        currency: &order.currency,
        state: crate::payment_store::VIA_FLOW,
        fence: 0,
    };
    let insert = crate::payment_store::insert_payment(&claim, now);
    if !tx.insert_ignoring_duplicate(insert, "(order_id)").await? {
        tracing::info!(order_id = %order.id, "the order's payment was claimed by the payments endpoint; no charge effect");
        return Ok(());
    }
    let request = serde_json::json!({
        "amount": order.amount_minor,
        "currency": order.currency.to_ascii_lowercase(),
        "metadata": {"order_id": order.id, "invoice_id": invoice_id},
    });
    EffectStore::enqueue(
        tx,
        &NewEffect {
            tenant,
            provider: PAYMENTS,
            operation: CHARGE,
            reference: invoice_id,
            key: &key,
            request: &request,
        },
        now,
    )
    .await?;
    Ok(())
}

/// The billing consumer over `subscriber`, which must be consumer group
/// [`BILLING_CONSUMER`] of the order service's events topic (SQL transport, RabbitMQ or
/// NATS JetStream), handler [`BillingHandler::invoices_only`]. Call
/// [`Consumer::subscribe`] before running it.
pub fn billing_consumer<S: Subscriber>(
    db: Database,
    subscriber: S,
    config: ConsumerConfig,
) -> Consumer<S> {
    billing_consumer_with(db, subscriber, config, BillingHandler::invoices_only())
}

/// As [`billing_consumer`], with `handler` (e.g. [`BillingHandler::charging`] when
/// payments are configured).
pub fn billing_consumer_with<S: Subscriber>(
    db: Database,
    subscriber: S,
    config: ConsumerConfig,
    handler: BillingHandler,
) -> Consumer<S> {
    Consumer::new(db, subscriber, Arc::new(handler), config)
}
