//! `POST /v1/orders/{id}/payments`: charges the order's amount synchronously at the payments
//! provider, in the idempotency layer's multi-phase mode (docs/DESIGN.md "Multi-phase
//! idempotency, unknown outcomes, reconciliation").
//!
//! The record commits `processing` under a lease before the handler runs; the handler
//! claims the order's payment (`order_payments`, one per order whatever the key), writes
//! the call's evidence, then calls the provider with the key derived from the operation
//! ([`OperationContext::derived_key`], step `charge`), reference `order:{id}:payment`,
//! metadata `order_id`. A retry while the lease runs gets 409 with the status link
//! (`/v1/operations/{key}`); after it, [`PaymentStatus`] asks the provider by reference:
//! found → the charge's answer is stored and replayed; absent → the handler runs again
//! with the same key; can't tell → 409 `outcome-unknown`.

mod answers;
mod charge;
mod status;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequestParts, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{middleware, Router};
use bytes::Bytes;
use http::request::Parts;
use http::StatusCode;
use oncely_effects::{EffectRequest, Provider};
use oncely_http::{IdempotencyLayer, MultiPhase, OperationContext, Problem, StoreFailure};
use oncely_sql::{query, Database, IdempotencyStore, StoreError};
use serde::Deserialize;
use serde_json::json;

use crate::payment_store::{self as store, NewPayment};
use crate::problem;
use crate::routes::{OPERATIONS_ROUTE, PAYMENT_ROUTE};
use crate::AppConfig;
use answers::{already_paid, charged_by_flow, charged_by_saga, in_progress, not_stored, paid};
use charge::{charge, remote_of};
use status::PaymentStatus;

/// The step name the charge's key is derived with.
const STEP: &str = "charge";

/// The payments provider of the endpoint and its multi-phase settings.
#[derive(Debug, Clone)]
pub struct PaymentsSettings {
    /// The provider charged (`oncely_effects::StripePayments`: Stripe, localstripe, `oncely
    /// sim payments`); its reference field carries `order:{id}:payment`.
    pub provider: Arc<dyn Provider>,
    /// The lease of each holder. Must exceed the provider's timeout: past it a retry takes
    /// the outcome as unknown and asks the provider. The handler is also cut off at it.
    pub lease: Duration,
}

#[derive(Clone)]
pub(crate) struct Pay {
    db: Database,
    settings: PaymentsSettings,
    /// The service fulfils orders with its saga, whose `charge` step holds every order's
    /// charge role: the endpoint never charges then (one business effect per role).
    saga: bool,
}

/// The stable reference of the order's payment (the provider's metadata reference field).
pub(crate) fn reference(order_id: &str) -> String {
    format!("order:{order_id}:payment")
}

/// The routes `POST /v1/orders/{id}/payments` and `GET /v1/operations/{key}`, each behind
/// authentication (and the body guard for the `POST`).
pub(crate) fn routes(db: &Database, config: &AppConfig, keys: oncely_http::ApiKeys) -> Router {
    let pay = match &config.payments {
        Some(settings) => {
            let store = IdempotencyStore::new(db.clone(), config.retention);
            let mode = MultiPhase::new(settings.lease)
                .status_link(OPERATIONS_ROUTE)
                .resolver(PaymentStatus {
                    db: db.clone(),
                    provider: settings.provider.clone(),
                });
            let idempotency = oncely_http::IdempotencyConfig {
                execution_timeout: settings.lease.min(config.idempotency.execution_timeout),
                ..config.idempotency.clone()
            };
            Router::new()
                .route(
                    PAYMENT_ROUTE,
                    post(create_payment).layer(axum::extract::DefaultBodyLimit::disable()),
                )
                .route_layer(IdempotencyLayer::new(store, idempotency).multi_phase(mode))
                .with_state(Pay {
                    db: db.clone(),
                    settings: settings.clone(),
                    saga: config.fulfilment.mode == crate::Fulfilment::Saga,
                })
        }
        None => Router::new().route(PAYMENT_ROUTE, post(not_configured)),
    };
    pay.route_layer(middleware::from_fn_with_state(
        config.body_limits(),
        oncely_http::read_body,
    ))
    .route(
        OPERATIONS_ROUTE,
        axum::routing::get(crate::operations::get_operation),
    )
    .route_layer(oncely_http::TenantLayer::new(keys))
    .with_state(db.clone())
}

async fn not_configured() -> Response {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        problem::PAYMENTS_NOT_CONFIGURED,
        "No payments provider is configured",
    )
    .detail("start the service with --payments-url and --payments-secret-key")
    .into_response()
}

/// Body of `POST /v1/orders/{id}/payments`: empty, or `{"payment_method": "pm_…"}`.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPaymentBody {
    /// The provider's payment method (`pm_…`); the provider's default when absent.
    payment_method: Option<String>,
}

/// The answer of a charge that took place: 201, stored and replayed to every retry with
/// the same key.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PaymentReceipt {
    order_id: String,
    /// Always `succeeded`.
    status: &'static str,
    /// The provider's PaymentIntent (`pi_…`).
    payment_intent: String,
    /// The amount charged, in the currency's minor unit.
    amount_minor: i64,
    /// ISO 4217, as the order has it.
    currency: String,
    /// The stable reference the provider carries in its metadata: `order:{id}:payment`.
    reference: String,
}

/// The order id of a payments request, read once for the handler and the resolver alike:
/// the matched route's `{id}`, percent-decoded by the router (`%2D` is `-`). `None` for an
/// id that is not a UUID — no order, and PostgreSQL refuses NUL in text — which is a 404
/// before any query.
async fn order_id_of(parts: &Parts) -> Option<String> {
    let mut parts = parts.clone();
    let Path(id) = Path::<String>::from_request_parts(&mut parts, &())
        .await
        .ok()?;
    uuid::Uuid::try_parse(&id).is_ok().then_some(id)
}

/// The order's amount and currency, in the caller's tenant.
async fn order_amount(
    db: &Database,
    tenant: &str,
    order_id: &str,
) -> Result<Option<(i64, String)>, StoreError> {
    db.fetch_optional(
        query("SELECT amount_minor, currency FROM orders WHERE id = $1 AND tenant = $2")
            .bind(order_id)
            .bind(tenant),
    )
    .await
}

/// The charge of `order_id` under the operation's derived key.
fn charge_request(
    ctx: &OperationContext,
    order_id: &str,
    (amount, currency): (i64, &str),
    payment_method: Option<&str>,
) -> EffectRequest {
    let mut params = json!({
        "amount": amount,
        "currency": currency.to_ascii_lowercase(),
        "metadata": {"order_id": order_id},
    });
    if let Some(m) = payment_method {
        params["payment_method"] = m.into();
    }
    EffectRequest {
        operation: STEP.to_owned(),
        reference: reference(order_id),
        key: ctx.derived_key(STEP),
        params,
    }
}

/// What claiming the order's payment led to.
enum Claimed {
    Charge,
    Answer(Response),
}

/// `POST /v1/orders/{id}/payments`.
#[utoipa::path(
    post,
    path = "/v1/orders/{id}/payments",
    tag = "orders",
    operation_id = "create_payment",
    summary = "Pay an order at the payments provider, exactly once per order",
    description = "Multi-phase idempotency: the `Idempotency-Key` record commits `processing` \
                   under a lease before the provider is called with a key derived from the \
                   operation. A retry during the lease gets 409 request-in-flight with the \
                   status link `/v1/operations/{key}`; after it, the provider is asked by the \
                   order's reference before anything is charged again. One payment per order \
                   whatever the key. 503 payments-not-configured when the service runs \
                   without a payments provider.",
    params(
        ("id" = String, Path, description = "The order's id, from `Location`"),
        crate::schema::IdempotencyKey,
    ),
    request_body(content = Option<NewPaymentBody>, content_type = "application/json",
        description = "Empty, or the payment method to charge"),
    responses(
        (status = 201, description = "Charged", body = PaymentReceipt, headers(
            ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer of an earlier request with the same key, replayed"),
        )),
        (status = 400, description = "idempotency-key-missing, idempotency-key-malformed or \
            request-body", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 402, description = "payment-declined (stored: a retry with the same key \
            replays it; a new key may try again)", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "not-found: no such order in the caller's tenant",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 408, description = "request-timeout: the body did not arrive in time",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 409, description = "request-in-flight (the lease runs; `status_url`), \
            outcome-unknown (the provider could not tell yet), payment-in-progress (another \
            key's payment of the order), order-already-paid or order-charged-by-flow",
            body = crate::schema::Problem, content_type = "application/problem+json", headers(
            ("Retry-After" = u32, description = "Seconds to wait before the retry"),
        )),
        (status = 413, description = "request-too-large", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 415, description = "unsupported-media-type", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 422, description = "invalid-payment (not stored) or idempotency-key-reused",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 500, description = "store-error or internal", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 502, description = "payment-outcome-unknown: the charge may or may not have \
            taken place; the record turns unknown and a retry asks the provider first",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 503, description = "payments-not-configured, payments-unavailable (nothing \
            was charged), store-unavailable or server-busy", body = crate::schema::Problem,
            content_type = "application/problem+json", headers(
            ("Retry-After" = u32, description = "Seconds to wait before the retry"),
        )),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn create_payment(
    State(pay): State<Pay>,
    ctx: OperationContext,
    parts: Parts,
    body: Bytes,
) -> Response {
    let not_found = || {
        not_stored(
            Problem::new(StatusCode::NOT_FOUND, problem::NOT_FOUND, "No such order")
                .into_response(),
        )
    };
    let Some(order_id) = order_id_of(&parts).await else {
        return not_found();
    };
    let input: NewPaymentBody = if body.iter().all(u8::is_ascii_whitespace) {
        NewPaymentBody::default()
    } else {
        // `null` is no body too (the document's body is optional).
        match serde_json::from_slice::<Option<NewPaymentBody>>(&body) {
            Ok(b) => b.unwrap_or_default(),
            Err(e) => {
                return not_stored(
                    Problem::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        problem::INVALID_PAYMENT,
                        "The payment request is invalid",
                    )
                    .detail(format!(
                        "expected {{}} or {{\"payment_method\": \"pm_…\"}}: {e}"
                    ))
                    .into_response(),
                )
            }
        }
    };
    let tenant = ctx.scope.tenant.as_str().to_owned();
    let (amount, currency) = match order_amount(&pay.db, &tenant, &order_id).await {
        Ok(Some(a)) => a,
        Ok(None) => return not_found(),
        Err(e) => return not_stored(StoreFailure::from(e).into_response()),
    };
    if pay.saga {
        // The order's charge belongs to its fulfilment saga: a second path to it would be
        // a second charge (docs/DESIGN.md "One business effect per business role").
        return not_stored(charged_by_saga(&order_id));
    }
    let request = charge_request(
        &ctx,
        &order_id,
        (amount, &currency),
        input.payment_method.as_deref(),
    );
    match claim(&pay.db, &ctx, &request, (amount, &currency), &order_id).await {
        Ok(Claimed::Charge) => {}
        Ok(Claimed::Answer(res)) => return res,
        Err(e) => return not_stored(StoreFailure::from(e).into_response()),
    }
    // Claimed, nothing sent yet.
    oncely_core::failpoint::fail_point!("payments.before_call");
    charge(&pay, &ctx, &order_id, &request, (amount, &currency)).await
}

/// Claims the order's payment for this operation, or answers why not.
async fn claim(
    db: &Database,
    ctx: &OperationContext,
    request: &EffectRequest,
    (amount, currency): (i64, &str),
    order_id: &str,
) -> Result<Claimed, StoreError> {
    let now = oncely_core::now_ms();
    let new = NewPayment {
        order_id,
        tenant: ctx.scope.tenant.as_str(),
        via: store::VIA_ENDPOINT,
        idempotency_key: ctx.key.as_str(),
        reference: &request.reference,
        provider_key: &request.key,
        amount_minor: amount,
        currency,
        state: "charging",
        fence: ctx.fence,
    };
    if store::claim(db, &new, now).await? {
        return Ok(Claimed::Charge);
    }
    let Some(row) = store::by_order(db, new.tenant, order_id).await? else {
        // Deleted meanwhile (nothing deletes payments): a conflict to retry.
        return Ok(Claimed::Answer(in_progress(order_id, None)));
    };
    if row.via == store::VIA_FLOW {
        return Ok(Claimed::Answer(charged_by_flow(order_id)));
    }
    if row.idempotency_key == ctx.key.as_str() {
        if row.state == "succeeded" {
            let intent = remote_of(&row);
            return Ok(Claimed::Answer(paid(order_id, amount, currency, &intent)));
        }
        return Ok(
            if store::recharge(db, order_id, new.idempotency_key, ctx.fence, now).await? {
                Claimed::Charge
            } else {
                Claimed::Answer(in_progress(order_id, Some(&row)))
            },
        );
    }
    match row.state.as_str() {
        "succeeded" => Ok(Claimed::Answer(already_paid(order_id, &row))),
        "declined" | "not_charged" => Ok(if store::take_over(db, &row, &new, now).await? {
            Claimed::Charge
        } else {
            Claimed::Answer(in_progress(order_id, Some(&row)))
        }),
        _ => Ok(Claimed::Answer(in_progress(order_id, Some(&row)))),
    }
}
