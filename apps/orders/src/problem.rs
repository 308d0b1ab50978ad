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
/// 503 + `Retry-After`: the request-body budget is spent; retry later.
pub const SERVER_BUSY: &str = "server-busy";
/// 408: the request body did not arrive within the body deadline.
pub const REQUEST_TIMEOUT: &str = "request-timeout";
/// 500: an unexpected failure (never driver text).
pub const INTERNAL: &str = "internal";
/// 415: the order body is not `application/json`.
pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported-media-type";
/// 400: a `GET /v1/orders` query with a limit outside 1–100, a cursor the service did not
/// issue, or an unknown parameter.
pub const INVALID_QUERY: &str = "invalid-query";
/// 503: `GET /readyz` found a dependency (database, broker or provider) unavailable; its
/// `checks` member names which.
pub const NOT_READY: &str = "not-ready";

/// 422: a `PUT /v1/stock/{sku}` with a bad SKU or quantity.
pub const INVALID_STOCK: &str = "invalid-stock";
/// 409: `POST /v1/orders/{id}/cancel` after the fulfilment saga's pivot (the shipment
/// booking was sent), or for an order that completed, waits for review, or is fulfilled
/// by the choreography (which cannot be cancelled).
pub const ORDER_NOT_CANCELLABLE: &str = "order-not-cancellable";

/// Every kind above, for the OpenAPI document (which names each `type` URI); a test keeps
/// it complete.
pub const ALL: &[&str] = &[
    ORDER_CONFLICT,
    INVALID_ORDER,
    NOT_FOUND,
    METHOD_NOT_ALLOWED,
    SERVER_BUSY,
    REQUEST_TIMEOUT,
    INTERNAL,
    UNSUPPORTED_MEDIA_TYPE,
    INVALID_QUERY,
    NOT_READY,
    INVALID_STOCK,
    ORDER_NOT_CANCELLABLE,
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
