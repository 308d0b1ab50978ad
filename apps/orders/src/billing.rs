use std::sync::Arc;

use oncely_broker::{BoxFuture, ReceivedMessage, Subscriber};
use oncely_inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Rejected};
use oncely_sql::{query, Database, Tx};
use serde::Deserialize;

use crate::events::ORDER_CREATED;

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
#[derive(Debug, Default, Clone, Copy)]
pub struct BillingHandler;

impl Handler for BillingHandler {
    fn handle<'a>(
        &'a self,
        tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if message.event_type != ORDER_CREATED {
                return Ok(());
            }
            // An undecodable event will not decode on a retry either: dead at once.
            let order: OrderCreated = serde_json::from_slice(&message.payload)
                .map_err(|e| Rejected(format!("order.created payload: {e}")))?;
            let tenant = message
                .headers
                .get("tenant")
                .ok_or_else(|| Rejected("order.created without a tenant header".to_owned()))?;
            let invoice_id = uuid::Uuid::now_v7().to_string();
            let message_id = message.id.to_string();
            let now = oncely_core::now_ms();
            // UNIQUE(order_id, kind): an invoice that exists already is left as it is.
            tx.insert_ignoring_duplicate(
                query(
                    "INSERT INTO invoices (id, tenant, order_id, kind, amount_minor, currency, \
                     message_id, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                )
                .bind(invoice_id)
                .bind(tenant.as_str())
                .bind(order.id)
                .bind(INVOICE_KIND_ORDER)
                .bind(order.amount_minor)
                .bind(order.currency)
                .bind(message_id)
                .bind(now),
                "(order_id, kind)",
            )
            .await?;
            Ok(())
        })
    }
}

/// The billing consumer over `subscriber`, which must be consumer group
/// [`BILLING_CONSUMER`] of the order service's events topic (SQL transport, RabbitMQ or
/// NATS JetStream), handler [`BillingHandler`]. Call [`Consumer::subscribe`] before running
/// it.
pub fn billing_consumer<S: Subscriber>(
    db: Database,
    subscriber: S,
    config: ConsumerConfig,
) -> Consumer<S> {
    Consumer::new(db, subscriber, Arc::new(BillingHandler), config)
}
