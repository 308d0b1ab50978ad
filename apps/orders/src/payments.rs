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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{FromRequestParts, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{middleware, Json, Router};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::request::Parts;
use http::StatusCode;
use oncely_core::TenantId;
use oncely_effects::{
    CallOutcome, EffectRequest, ObjectState, Provider, RemoteObject, StatusOutcome, StatusQuery,
};
use oncely_http::{
    IdempotencyLayer, MultiPhase, NotStored, OperationContext, Problem, Resolution, ResolveQuery,
    Resolver, StoreFailure,
};
use oncely_sql::{query, Database, IdempotencyStore, StoreError};
use serde::Deserialize;
use serde_json::json;

use crate::payment_store::{self as store, EvidenceRow, NewPayment, PaymentRow};
use crate::problem;
use crate::AppConfig;

/// The route template of the payments endpoint (its idempotency records' operation is
/// `POST` + this).
pub const PAYMENT_ROUTE: &str = "/v1/orders/{id}/payments";
/// The template of the operation status resource, the 409s' status link.
pub const OPERATIONS_ROUTE: &str = "/v1/operations/{key}";
/// The step name the charge's key is derived with.
const STEP: &str = "charge";

/// A fault injected into the payments endpoint (crash tests and chaos drills only): the
/// process aborts at that point, as a SIGKILL would end it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PaymentFault {
    /// After the payment was claimed, before the provider call went out.
    AbortBeforeCall,
    /// After the provider answered, before the outcome was stored anywhere.
    AbortAfterCall,
}

/// The payments provider of the endpoint and its multi-phase settings.
#[derive(Debug, Clone)]
pub struct PaymentsSettings {
    /// The provider charged (`oncely_effects::StripePayments`: Stripe, localstripe, `oncely
    /// sim payments`); its reference field carries `order:{id}:payment`.
    pub provider: Arc<dyn Provider>,
    /// The lease of each holder. Must exceed the provider's timeout: past it a retry takes
    /// the outcome as unknown and asks the provider. The handler is also cut off at it.
    pub lease: Duration,
    /// Fault injection; `None` in production.
    pub fault: Option<PaymentFault>,
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
pub(crate) fn routes(
    db: &Database,
    config: &AppConfig,
    keys: Arc<HashMap<String, TenantId>>,
) -> Router {
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
        crate::limits::BodyLimits::new(config),
        crate::limits::read_body,
    ))
    .route(
        OPERATIONS_ROUTE,
        axum::routing::get(crate::operations::get_operation),
    )
    .route_layer(middleware::from_fn_with_state(
        keys,
        crate::auth::authenticate,
    ))
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

/// A refusal that stores nothing (the key stays usable).
fn not_stored(mut res: Response) -> Response {
    res.extensions_mut().insert(NotStored);
    res
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

/// The answer of a charge that took place (the handler's and the resolver's alike).
fn paid(order_id: &str, amount: i64, currency: &str, intent: &RemoteObject) -> Response {
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
fn declined(order_id: &str, code: Option<&str>, message: &str, intent: Option<&str>) -> Response {
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
        crate::openapi::IdempotencyKey,
    ),
    request_body(content = Option<NewPaymentBody>, content_type = "application/json",
        description = "Empty, or the payment method to charge"),
    responses(
        (status = 201, description = "Charged", body = PaymentReceipt, headers(
            ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer of an earlier request with the same key, replayed"),
        )),
        (status = 400, description = "idempotency-key-missing, idempotency-key-malformed or \
            request-body", body = crate::openapi::Problem,
            content_type = "application/problem+json"),
        (status = 401, description = "unauthenticated", body = crate::openapi::Problem,
            content_type = "application/problem+json"),
        (status = 402, description = "payment-declined (stored: a retry with the same key \
            replays it; a new key may try again)", body = crate::openapi::Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "not-found: no such order in the caller's tenant",
            body = crate::openapi::Problem, content_type = "application/problem+json"),
        (status = 408, description = "request-timeout: the body did not arrive in time",
            body = crate::openapi::Problem, content_type = "application/problem+json"),
        (status = 409, description = "request-in-flight (the lease runs; `status_url`), \
            outcome-unknown (the provider could not tell yet), payment-in-progress (another \
            key's payment of the order), order-already-paid or order-charged-by-flow",
            body = crate::openapi::Problem, content_type = "application/problem+json", headers(
            ("Retry-After" = u32, description = "Seconds to wait before the retry"),
        )),
        (status = 413, description = "request-too-large", body = crate::openapi::Problem,
            content_type = "application/problem+json"),
        (status = 415, description = "unsupported-media-type", body = crate::openapi::Problem,
            content_type = "application/problem+json"),
        (status = 422, description = "invalid-payment (not stored) or idempotency-key-reused",
            body = crate::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, description = "store-error or internal", body = crate::openapi::Problem,
            content_type = "application/problem+json"),
        (status = 502, description = "payment-outcome-unknown: the charge may or may not have \
            taken place; the record turns unknown and a retry asks the provider first",
            body = crate::openapi::Problem, content_type = "application/problem+json"),
        (status = 503, description = "payments-not-configured, payments-unavailable (nothing \
            was charged), store-unavailable or server-busy", body = crate::openapi::Problem,
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
    if pay.settings.fault == Some(PaymentFault::AbortBeforeCall) {
        tracing::error!("fault injection: aborting before the payment call");
        std::process::abort();
    }
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

/// The provider's object as the row recorded it (for a replay from the row).
fn remote_of(row: &PaymentRow) -> RemoteObject {
    RemoteObject {
        id: row.payment_intent.clone().unwrap_or_default(),
        status: "succeeded".to_owned(),
        state: ObjectState::Live,
        reference: Some(row.reference.clone()),
        amount: Some(row.amount_minor),
        currency: Some(row.currency.to_ascii_lowercase()),
        created: None,
        raw: serde_json::Value::Null,
    }
}

fn charged_by_flow(order_id: &str) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        problem::ORDER_CHARGED_BY_FLOW,
        "The order is charged through its invoice",
    )
    .detail("the billing flow claimed this order's payment (its invoice's charge effect); see GET /v1/orders/{id}")
    .with("order_id", order_id)
    .into_response()
}

fn charged_by_saga(order_id: &str) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        problem::ORDER_CHARGED_BY_FLOW,
        "The order is charged by its fulfilment saga",
    )
    .detail("this service charges every order in the charge step of its fulfilment saga; see GET /v1/orders/{id}")
    .with("order_id", order_id)
    .into_response()
}

fn already_paid(order_id: &str, row: &PaymentRow) -> Response {
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
fn in_progress(order_id: &str, row: Option<&PaymentRow>) -> Response {
    let mut p = Problem::new(
        StatusCode::CONFLICT,
        problem::PAYMENT_IN_PROGRESS,
        "A payment of this order is in progress or its outcome is unknown",
    )
    .detail("retry later; the operation status resource shows where it stands")
    .with("order_id", order_id)
    .retry_after(1);
    if let Some(row) = row {
        let url = OPERATIONS_ROUTE.replace("{key}", &percent_encode(&row.idempotency_key));
        p = p.with("status_url", url).with("state", row.state.as_str());
    }
    not_stored(p.into_response())
}

/// `s` with every character but RFC 3986's unreserved ones percent-encoded.
pub(crate) fn percent_encode(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Calls the provider once (the call's evidence written first), records what it proved
/// and answers: 201 charged; 402 declined; 503 not charged (not stored: the key stays
/// usable); 502 unknown (the record turns `unknown`, to be resolved by the status check).
async fn charge(
    pay: &Pay,
    ctx: &OperationContext,
    order_id: &str,
    request: &EffectRequest,
    (amount, currency): (i64, &str),
) -> Response {
    let db = &pay.db;
    let started = EvidenceRow {
        fence: ctx.fence,
        kind: "call".to_owned(),
        provider_key: request.key.clone(),
        started_at: oncely_core::now_ms(),
        finished_at: None,
        outcome: "sent".to_owned(),
        http_status: None,
        provider_id: None,
        detail: None,
    };
    let evidence = match store::add_evidence(db, order_id, &started).await {
        Ok(id) => id,
        // Nothing went out: the payment row stays `charging` under this fence, which the
        // same key's retry takes again.
        Err(e) => return StoreFailure::from(e).into_response(),
    };
    let outcome = pay.settings.provider.call(request).await;
    if pay.settings.fault == Some(PaymentFault::AbortAfterCall) {
        tracing::error!(?outcome, "fault injection: aborting after the payment call");
        std::process::abort();
    }
    let (state, answer) = answer(order_id, (amount, currency), &outcome);
    let (http_status, provider_id, detail) = describe(&outcome);
    let now = oncely_core::now_ms();
    let recorded = async {
        store::finish_evidence(
            db,
            &evidence,
            state,
            http_status,
            provider_id.as_deref(),
            &detail,
        )
        .await?;
        store::set_outcome(
            db,
            order_id,
            ctx.key.as_str(),
            state,
            provider_id.as_deref(),
            now,
        )
        .await
    };
    if let Err(e) = recorded.await {
        // The record still says what the answer is; the row is corrected by the next
        // status check or reconciliation.
        tracing::warn!(error = %e, order_id, "recording the payment's outcome failed");
    }
    answer
}

/// The payment row's state and the answer for what a call proved.
fn answer(
    order_id: &str,
    (amount, currency): (i64, &str),
    outcome: &CallOutcome,
) -> (&'static str, Response) {
    match outcome {
        CallOutcome::Succeeded(intent) => ("succeeded", paid(order_id, amount, currency, intent)),
        CallOutcome::Failed {
            code,
            message,
            object,
            ..
        } => (
            "declined",
            declined(
                order_id,
                code.as_deref(),
                message,
                object.as_ref().map(|o| o.id.as_str()),
            ),
        ),
        CallOutcome::Retryable { retry_after, .. } => {
            let secs = retry_after.map_or(1, |d| u32::try_from(d.as_secs().max(1)).unwrap_or(60));
            let res = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                problem::PAYMENTS_UNAVAILABLE,
                "The payments provider is unavailable",
            )
            .detail("nothing was charged; retry with the same key")
            .retry_after(secs)
            .into_response();
            ("not_charged", not_stored(res))
        }
        CallOutcome::NotSent { .. } => {
            let res = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                problem::PAYMENTS_UNAVAILABLE,
                "The payments provider cannot be reached",
            )
            .detail("nothing was sent; retry with the same key")
            .retry_after(1)
            .into_response();
            ("not_charged", not_stored(res))
        }
        _ => {
            let res = Problem::new(
                StatusCode::BAD_GATEWAY,
                problem::PAYMENT_OUTCOME_UNKNOWN,
                "The outcome of the charge is unknown",
            )
            .detail("the provider may have charged; retry with the same key: the charge is looked up at the provider before anything is sent again")
            .into_response();
            ("unknown", res)
        }
    }
}

/// HTTP status, provider id and a description of `outcome`, for the evidence.
fn describe(outcome: &CallOutcome) -> (Option<i64>, Option<String>, String) {
    match outcome {
        CallOutcome::Succeeded(o) => (None, Some(o.id.clone()), format!("{} {}", o.id, o.status)),
        CallOutcome::Failed {
            status,
            code,
            message,
            object,
        } => (
            Some(i64::from(*status)),
            object.as_ref().map(|o| o.id.clone()),
            format!("{}: {message}", code.as_deref().unwrap_or("refused")),
        ),
        CallOutcome::Retryable { status, .. } => {
            (Some(i64::from(*status)), None, "retryable".to_owned())
        }
        CallOutcome::Unknown { status, reason } => (status.map(i64::from), None, reason.clone()),
        CallOutcome::NotSent { reason } => (None, None, reason.clone()),
        _ => (None, None, format!("{outcome:?}")),
    }
}

/// The status check of an `unknown` payment record: the provider's PaymentIntents by the
/// order's reference (search, or the list), since the record's creation.
#[derive(Debug)]
pub(crate) struct PaymentStatus {
    db: Database,
    provider: Arc<dyn Provider>,
}

fn system_time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl Resolver for PaymentStatus {
    fn resolve<'a>(&'a self, q: ResolveQuery<'a>) -> BoxFuture<'a, Resolution> {
        Box::pin(async move {
            // No such order: the handler answers 404 and stores nothing.
            let Some(order_id) = order_id_of(q.request).await else {
                return Resolution::Absent;
            };
            match self.check(q, &order_id).await {
                Ok(r) => r,
                Err(e) => Resolution::Unknown(format!("the database failed: {e}")),
            }
        })
    }
}

impl PaymentStatus {
    /// What the order's PaymentIntents found by the status check mean for this key,
    /// three-valued (docs/DESIGN.md "Status vocabularies"): live — the receipt, but only to
    /// the key that charged (another key's charge is 409 `order-already-paid`); ended in
    /// Stripe's words — declined; pending or a word nobody listed — still unknown, never a
    /// refusal. Returns the resolution and the id of the object it rests on.
    async fn settle_found(
        &self,
        q: ResolveQuery<'_>,
        order_id: &str,
        (amount, currency): (i64, &str),
        found: &[RemoteObject],
        now: i64,
    ) -> Result<(Resolution, String), StoreError> {
        let first_in = |state| found.iter().find(|o| o.state == state);
        let object = first_in(ObjectState::Live)
            .or_else(|| first_in(ObjectState::Pending))
            .or_else(|| first_in(ObjectState::Unrecognised))
            .unwrap_or(&found[0]);
        let key = q.context.key.as_str();
        let owner = store::by_order(&self.db, q.context.scope.tenant.as_str(), order_id).await?;
        if let Some(row) = owner.as_ref().filter(|r| r.idempotency_key != key) {
            // Another key (or the billing flow) owns the order's payment now: its receipt
            // is not this key's to replay.
            let resolution = if row.via == store::VIA_FLOW {
                Resolution::Found(charged_by_flow(order_id))
            } else if row.state == "succeeded" {
                Resolution::Found(already_paid(order_id, row))
            } else {
                Resolution::Unknown(format!(
                    "another key's payment of the order is {}",
                    row.state
                ))
            };
            return Ok((resolution, object.id.clone()));
        }
        let (state, res) = match object.state {
            ObjectState::Live => ("succeeded", paid(order_id, amount, currency, object)),
            ObjectState::Ended => {
                let msg = format!("the PaymentIntent is {}", object.status);
                (
                    "declined",
                    declined(order_id, Some(&object.status), &msg, Some(&object.id)),
                )
            }
            _ => {
                let why = format!(
                    "the PaymentIntent {} is {} ({:?}): not an outcome yet",
                    object.id, object.status, object.state
                );
                return Ok((Resolution::Unknown(why), object.id.clone()));
            }
        };
        store::set_outcome(&self.db, order_id, key, state, Some(&object.id), now).await?;
        Ok((Resolution::Found(res), object.id.clone()))
    }

    async fn check(&self, q: ResolveQuery<'_>, order_id: &str) -> Result<Resolution, StoreError> {
        let tenant = q.context.scope.tenant.as_str();
        let Some((amount, currency)) = order_amount(&self.db, tenant, order_id).await? else {
            // No such order: the handler answers 404 and stores nothing.
            return Ok(Resolution::Absent);
        };
        let request = charge_request(q.context, order_id, (amount, &currency), None);
        let last_sent = store::last_call(&self.db, order_id, &request.key).await?;
        let status = self.provider.status(StatusQuery {
            request: &request,
            last_sent: last_sent.map(system_time),
            since: system_time(q.record.created_at) - Duration::from_secs(300),
        });
        let started_at = oncely_core::now_ms();
        let (outcome, resolution, provider_id) = match status.await {
            Ok(StatusOutcome::Found(found)) => {
                let (resolution, object) = self
                    .settle_found(q, order_id, (amount, &currency), &found, started_at)
                    .await?;
                ("found", resolution, Some(object))
            }
            Ok(StatusOutcome::Absent) => ("absent", Resolution::Absent, None),
            Ok(other) => (
                "unknown",
                Resolution::Unknown(format!("the provider's lookup may still lag: {other:?}")),
                None,
            ),
            Err(e) => (
                "unavailable",
                Resolution::Unknown(format!("the provider could not be asked: {e}")),
                None,
            ),
        };
        let detail = match &resolution {
            Resolution::Unknown(why) => why.clone(),
            _ => format!("status check of fence {}", q.context.fence),
        };
        store::add_evidence(
            &self.db,
            order_id,
            &EvidenceRow {
                fence: q.context.fence,
                kind: "status".to_owned(),
                provider_key: request.key.clone(),
                started_at,
                finished_at: Some(oncely_core::now_ms()),
                outcome: outcome.to_owned(),
                http_status: None,
                provider_id,
                detail: Some(detail),
            },
        )
        .await?;
        Ok(resolution)
    }
}
