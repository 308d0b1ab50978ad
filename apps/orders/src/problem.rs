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
