use http::HeaderMap;
use oncely_broker::ReceivedMessage;
use oncely_core::{MessageId, TenantId};
use oncely_http::IdempotencyContext;
use oncely_inbox::{HandlerError, Rejected};
use oncely_sql::OutboxEvent;

/// Topic of the order service's events (AMQP routing key, NATS subject, SQL-transport topic).
pub const ORDERS_TOPIC: &str = "orders";
/// Event type announcing a new order.
pub const ORDER_CREATED: &str = "order.created";
/// Event type announcing that an order's invoice was paid (its charge succeeded at the
/// payments provider). Payload: `order_id`, `invoice_id`, `amount_minor`, `currency`,
/// `payment_id` (the provider's object id), `paid_at` (Unix ms).
pub const INVOICE_PAID: &str = "invoice.paid";

/// The payload of `message` as `T` with its `tenant` header, when `message` is an
/// `event_type` event; `None` for any other type (the consumer acknowledges it without
/// effect). A payload that does not decode, or no tenant header, will not change on a
/// retry: [`Rejected`] (dead at once).
pub(crate) fn decode<'m, T: serde::de::DeserializeOwned>(
    message: &'m ReceivedMessage,
    event_type: &str,
) -> Result<Option<(T, &'m String)>, HandlerError> {
    if message.event_type != event_type {
        return Ok(None);
    }
    let payload = serde_json::from_slice(&message.payload)
        .map_err(|e| Rejected(format!("{event_type} payload: {e}")))?;
    let tenant = message
        .headers
        .get("tenant")
        .ok_or_else(|| Rejected(format!("{event_type} without a tenant header")))?;
    Ok(Some((payload, tenant)))
}

/// Settings the handlers read from a request extension.
#[derive(Debug, Clone)]
pub(crate) struct EventSettings {
    /// See [`crate::AppConfig::events_topic`].
    pub(crate) topic: String,
}

/// The `order.created` event of a newly inserted order, for the outbox.
///
/// - Message id: derived from the operation's scope and idempotency key
///   ([`MessageId::derive`]), so a re-executed request cannot mint a second id; without a
///   key, from the business key `(tenant, source, external_ref)`, which the `orders` table
///   keeps unique.
/// - Partition key: the order id (one aggregate, one ordered stream).
/// - Headers: `correlation-id` (the request's `x-correlation-id` or `x-request-id`, else the
///   order id), `idempotency-key` (when sent), `traceparent` (the request's, when it is a
///   valid W3C Trace Context version-00 value, else a new one whose trace id is the message
///   id), `tenant`.
pub(crate) fn order_created(
    topic: &str,
    context: Option<&IdempotencyContext>,
    tenant: &TenantId,
    (source, external_ref): (&str, &str),
    order_id: &str,
    payload: Vec<u8>,
    request_headers: &HeaderMap,
) -> OutboxEvent {
    let key = context.and_then(|c| c.key.as_ref().map(|k| (&c.scope, k)));
    let message_id = match key {
        Some((scope, key)) => MessageId::derive(scope, key, ORDER_CREATED, 0),
        None => {
            MessageId::derive_from_parts(&[ORDER_CREATED, tenant.as_str(), source, external_ref])
        }
    };
    let header = |name: &str| {
        request_headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.len() <= 200)
    };
    let correlation = header("x-correlation-id")
        .or_else(|| header("x-request-id"))
        .unwrap_or(order_id)
        .to_owned();
    let traceparent = header("traceparent")
        .filter(|v| is_traceparent(v))
        .map_or_else(|| new_traceparent(&message_id), str::to_owned);
    let mut event = OutboxEvent::new(message_id, topic, order_id, ORDER_CREATED, payload)
        .with_header("correlation-id", correlation)
        .with_header("traceparent", traceparent)
        .with_header("tenant", tenant.as_str());
    if let Some((_, key)) = key {
        event = event.with_header("idempotency-key", key.as_str());
    }
    event
}

/// W3C Trace Context §3.2: `00-<32 lower hex, not all zero>-<16 lower hex, not all
/// zero>-<2 lower hex>`.
fn is_traceparent(v: &str) -> bool {
    let parts: Vec<&str> = v.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && parts[0] == "00"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

fn new_traceparent(message_id: &MessageId) -> String {
    let span = uuid::Uuid::new_v4().simple().to_string();
    format!("00-{}-{}-01", message_id.as_uuid().simple(), &span[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_validation_follows_w3c_trace_context() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent("garbage"));
        let id = MessageId::new_random();
        assert!(is_traceparent(&new_traceparent(&id)));
    }
}
