//! Route templates more than one module names: a leaf, so the handlers that share them do
//! not import each other.

/// The route template of the payments endpoint (its idempotency records' operation is
/// `POST` + this).
pub const PAYMENT_ROUTE: &str = "/v1/orders/{id}/payments";

/// The template of the operation status resource, the 409s' status link.
pub const OPERATIONS_ROUTE: &str = "/v1/operations/{key}";

/// The route template of order creation (its idempotency records' operation is `POST` +
/// this).
pub(crate) const ORDERS_ROUTE: &str = "/v1/orders";
