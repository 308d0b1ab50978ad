//! `GET /v1/operations/{key}`: the status resource of a multi-phase operation (the link of
//! the payments endpoint's 409s), in the caller's tenant.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use oncely_core::{now_ms, IdempotencyKey, Operation, RecordState, Scope, TenantId};
use oncely_http::{Problem, StoreFailure};
use oncely_sql::{Database, IdempotencyStore, Record, StoreError};
use serde::Serialize;

use crate::payment_store::{self as store, EvidenceRow, PaymentRow};
use crate::problem;
use crate::routes::PAYMENT_ROUTE;

/// What a client does with each state, as the resource says it (`advice`).
fn advice(record: &Record, now: i64) -> &'static str {
    match record.state {
        RecordState::Processing if record.lease_until.is_some_and(|u| u >= now) => {
            "in progress: retry the request with the same key after the lease"
        }
        RecordState::Processing | RecordState::Unknown => {
            "unknown: the holder stopped before it stored the outcome; retry the request with the same key — the provider is asked first, nothing is charged twice"
        }
        RecordState::Succeeded => "done: a retry with the same key replays the answer",
        _ => "failed: a retry with the same key replays the refusal; use a new key to try again",
    }
}

/// The operation status resource: where a payment operation stands and what proves it.
/// Times are Unix milliseconds.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct OperationStatus {
    /// The operation's `Idempotency-Key`.
    key: String,
    /// `POST /v1/orders/{id}/payments`.
    operation: String,
    /// The record's state: `processing`, `succeeded`, `failed` or `unknown`.
    state: String,
    /// Holdings so far (the fencing token: one per holder, the first is 1).
    attempts: i64,
    /// When the current holder's lease runs out; null once completed.
    lease_until: Option<i64>,
    /// `processing` with its lease run out: the holder stopped; a retry asks the provider.
    lease_expired: bool,
    created_at: i64,
    completed_at: Option<i64>,
    /// The stored answer's HTTP status, once there is one.
    response_status: Option<u16>,
    /// What the client should do next, in words.
    advice: String,
    /// The key sent to the provider (derived from the operation, never minted per attempt).
    provider_key: String,
    /// The order's payment claimed by this operation, if any.
    payment: Option<PaymentRow>,
    /// Each call to the provider and each status check, oldest first.
    evidence: Vec<EvidenceRow>,
}

/// `GET /v1/operations/{key}`: the payment operation under `key` — its record's state
/// (`processing`, `succeeded`, `failed`, `unknown`), attempts (the fencing token: one per
/// holding), lease, the stored answer's status, the order's payment and the evidence of
/// each call and status check. 404 problem when the tenant has no such operation.
#[utoipa::path(
    get,
    path = "/v1/operations/{key}",
    tag = "orders",
    operation_id = "get_operation",
    summary = "Where a payment operation stands (the status link of its 409s)",
    params(("key" = String, Path, description = "The operation's Idempotency-Key")),
    responses(
        (status = 200, description = "The operation", body = OperationStatus),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "not-found: no payment operation with this key in the \
            caller's tenant", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 500, description = "store-error", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable or server-busy",
            body = crate::schema::Problem, content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn get_operation(
    State(db): State<Database>,
    axum::Extension(tenant): axum::Extension<TenantId>,
    key: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let not_found = || {
        Problem::new(
            StatusCode::NOT_FOUND,
            problem::NOT_FOUND,
            "No such operation",
        )
        .into_response()
    };
    let Some(key) = key
        .ok()
        .and_then(|Path(k)| IdempotencyKey::parse(k.as_bytes()).ok())
    else {
        return not_found();
    };
    let scope = Scope::new(tenant, Operation::new("POST", PAYMENT_ROUTE));
    let store = IdempotencyStore::new(db.clone(), std::time::Duration::ZERO);
    let record = match store.lookup(&scope, &key).await {
        Ok(Some(r)) => r,
        Ok(None) => return not_found(),
        Err(e) => return StoreFailure::from(e).into_response(),
    };
    match view(&db, &scope, &key, &record).await {
        Ok(body) => Json(body).into_response(),
        Err(e) => StoreFailure::from(e).into_response(),
    }
}

async fn view(
    db: &Database,
    scope: &Scope,
    key: &IdempotencyKey,
    record: &Record,
) -> Result<OperationStatus, StoreError> {
    let now = now_ms();
    let payment = store::by_key(db, scope.tenant.as_str(), key.as_str()).await?;
    let provider_key = oncely_core::derive_key(scope, key, "charge", 0);
    let evidence = match &payment {
        Some(p) => store::evidence(db, &p.order_id, &provider_key).await?,
        None => Vec::new(),
    };
    Ok(OperationStatus {
        key: key.as_str().to_owned(),
        operation: scope.operation.as_str().to_owned(),
        state: record.state.as_str().to_owned(),
        attempts: record.fence,
        lease_until: record.lease_until,
        lease_expired: record.state == RecordState::Processing
            && record.lease_until.is_some_and(|u| u < now),
        created_at: record.created_at,
        completed_at: record.completed_at,
        response_status: record.response.as_ref().map(|r| r.status),
        advice: advice(record, now).to_owned(),
        provider_key,
        payment,
        evidence,
    })
}
