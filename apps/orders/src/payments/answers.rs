//! The endpoint's answers: paid, declined, and the conflicts (charged by the flow or the
//! saga, already paid, in progress with its status link).

use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use oncely_effects::RemoteObject;
use oncely_http::{NotStored, Problem};

use crate::payment_store::PaymentRow;
use crate::problem;
use crate::routes::OPERATIONS_ROUTE;

use super::{reference, PaymentReceipt};

/// A refusal that stores nothing (the key stays usable).
pub(crate) fn not_stored(mut res: Response) -> Response {
    res.extensions_mut().insert(NotStored);
    res
}

/// The answer of a charge that took place (the handler's and the resolver's alike).
pub(crate) fn paid(order_id: &str, amount: i64, currency: &str, intent: &RemoteObject) -> Response {
    (
        StatusCode::CREATED,
        Json(PaymentReceipt {
            order_id: order_id.to_owned(),
            status: "succeeded",
            payment_intent: intent.id.clone(),
            amount_minor: amount,
            currency: currency.to_owned(),
            reference: reference(order_id),
        }),
    )
        .into_response()
}

/// The answer of a charge the provider refused (402, stored: the key's final answer).
pub(crate) fn declined(
    order_id: &str,
    code: Option<&str>,
    message: &str,
    intent: Option<&str>,
) -> Response {
    Problem::new(
        StatusCode::PAYMENT_REQUIRED,
        problem::PAYMENT_DECLINED,
        "The payment was declined",
    )
    .detail(message.to_owned())
    .with("order_id", order_id)
    .with("code", code)
    .with("payment_intent", intent)
    .into_response()
}

pub(crate) fn charged_by_flow(order_id: &str) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        problem::ORDER_CHARGED_BY_FLOW,
        "The order is charged through its invoice",
    )
    .detail("the billing flow claimed this order's payment (its invoice's charge effect); see GET /v1/orders/{id}")
    .with("order_id", order_id)
    .into_response()
}

pub(crate) fn charged_by_saga(order_id: &str) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        problem::ORDER_CHARGED_BY_FLOW,
        "The order is charged by its fulfilment saga",
    )
    .detail("this service charges every order in the charge step of its fulfilment saga; see GET /v1/orders/{id}")
    .with("order_id", order_id)
    .into_response()
}

pub(crate) fn already_paid(order_id: &str, row: &PaymentRow) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        problem::ORDER_ALREADY_PAID,
        "The order is paid already",
    )
    .detail("another request (another Idempotency-Key) paid this order")
    .with("order_id", order_id)
    .with("payment_intent", row.payment_intent.as_deref())
    .into_response()
}

/// 409 (not stored): another key's payment of the order is charging or unknown.
pub(crate) fn in_progress(order_id: &str, row: Option<&PaymentRow>) -> Response {
    let mut p = Problem::new(
        StatusCode::CONFLICT,
        problem::PAYMENT_IN_PROGRESS,
        "A payment of this order is in progress or its outcome is unknown",
    )
    .detail("retry later; the operation status resource shows where it stands")
    .with("order_id", order_id)
    .retry_after(1);
    if let Some(row) = row {
        let url = oncely_http::status_url(OPERATIONS_ROUTE, &row.idempotency_key);
        p = p.with("status_url", url).with("state", row.state.as_str());
    }
    not_stored(p.into_response())
}
