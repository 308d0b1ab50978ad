//! The order service's own problem kinds (the last segment of each RFC 9457 `type` URI,
//! `urn:oncely:problem:<kind>`); the idempotency layer's are [`oncely_http::kind`].

/// 409: an order with this `(source, external_ref)` exists with other content (the
/// business key, S7).
pub const ORDER_CONFLICT: &str = "order-conflict";
/// 400/422: the order body is malformed or invalid; nothing was stored, so the same key
/// may be retried with a fixed body.
pub const INVALID_ORDER: &str = "invalid-order";
/// 404: no such order or resource (also for another tenant's order).
pub const NOT_FOUND: &str = "not-found";
/// 405: the route exists, the method does not.
pub const METHOD_NOT_ALLOWED: &str = "method-not-allowed";
/// 503 + `Retry-After` (the request-body budget is spent; retry later) and 408 (the request
/// body did not arrive within the body deadline): the body guard's kinds.
pub use oncely_http::kind::{REQUEST_TIMEOUT, SERVER_BUSY};
/// 500: an unexpected failure (never driver text).
pub const INTERNAL: &str = "internal";
/// 415 (the order body is not `application/json`) and 400 (a `GET /v1/orders` query with
/// a limit outside 1–100, a cursor the service did not issue, or an unknown parameter):
/// the kinds of the layer's extractors, one name each.
pub use oncely_http::kind::{INVALID_QUERY, UNSUPPORTED_MEDIA_TYPE};
/// 503: `GET /readyz` found a dependency (database, broker or provider) unavailable; its
/// `checks` member names which.
pub const NOT_READY: &str = "not-ready";

/// 422: a `PUT /v1/stock/{sku}` with a bad SKU or quantity.
pub const INVALID_STOCK: &str = "invalid-stock";
/// 409: `POST /v1/orders/{id}/cancel` after the fulfilment saga's pivot (the shipment
/// booking was sent), or for an order that completed, waits for review, or is fulfilled
/// by the choreography (which cannot be cancelled).
pub const ORDER_NOT_CANCELLABLE: &str = "order-not-cancellable";

/// 503: `POST /v1/orders/{id}/payments` on a service started without a payments provider.
pub const PAYMENTS_NOT_CONFIGURED: &str = "payments-not-configured";
/// 402: the provider refused the charge (a declined card); stored, so a retry with the
/// same key replays it. A new key may try again (e.g. with another payment method).
pub const PAYMENT_DECLINED: &str = "payment-declined";
/// 409 + `Retry-After` (not stored): another key's payment of the order is charging or its
/// outcome is unknown; `status_url` names that operation.
pub const PAYMENT_IN_PROGRESS: &str = "payment-in-progress";
/// 409: another key paid the order already (`payment_intent`).
pub const ORDER_ALREADY_PAID: &str = "order-already-paid";
/// 409: the billing flow claimed the order's payment (the invoice's charge effect).
pub const ORDER_CHARGED_BY_FLOW: &str = "order-charged-by-flow";
/// 503 + `Retry-After` (not stored): the provider refused the call for now (429, 503) or
/// could not be reached; nothing was charged.
pub const PAYMENTS_UNAVAILABLE: &str = "payments-unavailable";
/// 502: the charge may or may not have taken place (a timeout after sending, a dropped
/// answer, a 5xx); the record turns `unknown` and a retry asks the provider first.
pub const PAYMENT_OUTCOME_UNKNOWN: &str = "payment-outcome-unknown";
/// 422: the payment body is neither empty nor `{"payment_method": "pm_…"}`.
pub const INVALID_PAYMENT: &str = "invalid-payment";
/// 403: a tenant API key on the operator console (it takes the admin token).
pub const FORBIDDEN: &str = "forbidden";
/// 403: a console form without its session's CSRF token; nothing was done.
pub const CSRF_REJECTED: &str = "csrf-rejected";

/// 400: `POST /v1/webhooks/stripe` without a valid `Stripe-Signature` (none, malformed, a
/// timestamp outside the tolerance, or no `v1` that a configured secret signed); nothing
/// was applied.
pub const WEBHOOK_SIGNATURE_INVALID: &str = "webhook-signature-invalid";
/// 400: a correctly signed `POST /v1/webhooks/stripe` whose body is not a Stripe event.
pub const INVALID_WEBHOOK_EVENT: &str = "invalid-webhook-event";
/// 503 + `Retry-After`: the webhook's effect is being worked on (a runner holds it, or its
/// call has not returned), or the database is unavailable; nothing was applied and the
/// provider's redelivery applies it.
pub const WEBHOOK_RETRY_LATER: &str = "webhook-retry-later";

/// Every kind above, for the OpenAPI document (which names each `type` URI); a test keeps
/// it complete.
pub const ALL: &[&str] = &[
    ORDER_CONFLICT,
    INVALID_ORDER,
    NOT_FOUND,
    METHOD_NOT_ALLOWED,
    INTERNAL,
    NOT_READY,
    INVALID_STOCK,
    ORDER_NOT_CANCELLABLE,
    PAYMENTS_NOT_CONFIGURED,
    PAYMENT_DECLINED,
    PAYMENT_IN_PROGRESS,
    ORDER_ALREADY_PAID,
    ORDER_CHARGED_BY_FLOW,
    PAYMENTS_UNAVAILABLE,
    PAYMENT_OUTCOME_UNKNOWN,
    INVALID_PAYMENT,
    FORBIDDEN,
    CSRF_REJECTED,
    WEBHOOK_SIGNATURE_INVALID,
    INVALID_WEBHOOK_EVENT,
    WEBHOOK_RETRY_LATER,
];

#[cfg(test)]
mod tests {
    /// `pub const NAME: &str = "kind";` lines of `source`, ALL excepted.
    pub(crate) fn declared(source: &str) -> Vec<String> {
        source
            .lines()
            .map(str::trim)
            .filter_map(|l| l.strip_prefix("pub const "))
            .filter(|l| l.contains(": &str = \""))
            .filter_map(|l| l.split('"').nth(1).map(str::to_owned))
            .collect()
    }

    #[test]
    fn every_problem_kind_is_listed_in_all() {
        let own = declared(include_str!("problem.rs"));
        assert!(own.len() >= 9, "{own:?}");
        for kind in &own {
            assert!(
                super::ALL.contains(&kind.as_str()),
                "{kind} missing from problem::ALL"
            );
        }
        let layer = declared(include_str!("../../../crates/oncely-http/src/problem.rs"));
        assert!(layer.len() >= 17, "{layer:?}");
        for kind in &layer {
            if kind != "application/problem+json" {
                assert!(
                    oncely_http::kind::ALL.contains(&kind.as_str()),
                    "{kind} missing from oncely_http::kind::ALL"
                );
            }
        }
    }
}
