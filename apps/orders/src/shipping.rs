use std::sync::Arc;

use oncely_broker::{BoxFuture, ReceivedMessage, Subscriber};
use oncely_core::{IdempotencyKey, Operation, Scope, TenantId};
use oncely_inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Rejected};
use oncely_sql::{query, Database, EffectStore, NewEffect, Tx};
use serde::Deserialize;

use crate::events::{decode, INVOICE_PAID};
use crate::flow::{BOOK, SHIPPING};

/// Name of the shipping consumer (its consumer group and inbox).
pub const SHIPPING_CONSUMER: &str = "shipping";

/// The fields of an `invoice.paid` payload shipping needs.
#[derive(Debug, Deserialize)]
struct InvoicePaid {
    order_id: String,
}

/// The `shipping` handler: for each `invoice.paid` event, enqueues in the consumer's
/// transaction one effect of provider `shipping`, operation `book`, reference = the order
/// id, request {`merchant_reference`, `order_id`, `items`} (the order's lines, read in the
/// event's tenant) — the shape [`oncely_effects::ShippingClient`] sends. The effect's key is
/// derived from scope (tenant, `CONSUME shipping`), the order id and step `book`;
/// `UNIQUE(provider, operation, reference)` stands behind the inbox, so a redelivered or
/// re-identified `invoice.paid` books nothing more. Other event types are acknowledged
/// without effect; an `invoice.paid` that does not decode, has no tenant or names an order
/// the tenant does not have is [`Rejected`] (dead at once).
#[derive(Debug, Default, Clone, Copy)]
pub struct ShippingHandler;

impl Handler for ShippingHandler {
    fn handle<'a>(
        &'a self,
        tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let Some((paid, tenant)) = decode::<InvoicePaid>(message, INVOICE_PAID)? else {
                return Ok(());
            };
            let tenant_id = TenantId::parse(tenant)
                .map_err(|e| Rejected(format!("invoice.paid tenant header: {e}")))?;
            let parent = IdempotencyKey::parse(paid.order_id.as_bytes())
                .map_err(|e| Rejected(format!("invoice.paid order_id as a key: {e}")))?;
            let items: Option<(String,)> = tx
                .fetch_optional(
                    query("SELECT items FROM orders WHERE id = $1 AND tenant = $2")
                        .bind(paid.order_id.as_str())
                        .bind(tenant.as_str()),
                )
                .await?;
            let Some((items,)) = items else {
                return Err(Rejected(format!(
                    "invoice.paid for order {} which tenant {tenant} does not have",
                    paid.order_id
                ))
                .into());
            };
            let items: serde_json::Value = serde_json::from_str(&items)?;
            let scope = Scope::new(tenant_id, Operation::new("CONSUME", SHIPPING_CONSUMER));
            let key = oncely_effects::derive_key(&scope, &parent, BOOK, 0);
            let request = serde_json::json!({
                "merchant_reference": paid.order_id,
                "order_id": paid.order_id,
                "items": items,
            });
            EffectStore::enqueue(
                tx,
                &NewEffect {
                    tenant,
                    provider: SHIPPING,
                    operation: BOOK,
                    reference: &paid.order_id,
                    key: &key,
                    request: &request,
                },
                oncely_core::now_ms(),
            )
            .await?;
            Ok(())
        })
    }
}

/// The shipping consumer over `subscriber`, which must be consumer group
/// [`SHIPPING_CONSUMER`] of the order service's events topic, handler [`ShippingHandler`].
/// Call [`Consumer::subscribe`] before running it.
pub fn shipping_consumer<S: Subscriber>(
    db: Database,
    subscriber: S,
    config: ConsumerConfig,
) -> Consumer<S> {
    Consumer::new(db, subscriber, Arc::new(ShippingHandler), config)
}
