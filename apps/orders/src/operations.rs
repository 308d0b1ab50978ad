//! `GET /v1/operations/{key}`: the status resource of a multi-phase operation (the link of
//! the payments endpoint's 409s), in the caller's tenant.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use oncely_core::{now_ms, IdempotencyKey, Operation, RecordState, Scope, TenantId};
use oncely_http::{Problem, StoreFailure};
use oncely_sql::{Database, IdempotencyStore, Record, StoreError};
use serde_json::json;

use crate::payment_store as store;
use crate::payments::PAYMENT_ROUTE;
use crate::problem;

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

/// `GET /v1/operations/{key}`: the payment operation under `key` — its record's state
/// (`processing`, `succeeded`, `failed`, `unknown`), attempts (the fencing token: one per
/// holding), lease, the stored answer's status, the order's payment and the evidence of
/// each call and status check. 404 problem when the tenant has no such operation.
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
) -> Result<serde_json::Value, StoreError> {
    let now = now_ms();
    let payment = store::by_key(db, scope.tenant.as_str(), key.as_str()).await?;
    let provider_key = oncely_core::derive_key(scope, key, "charge", 0);
    let evidence = match &payment {
        Some(p) => store::evidence(db, &p.order_id, &provider_key).await?,
        None => Vec::new(),
    };
    Ok(json!({
        "key": key.as_str(),
        "operation": scope.operation.as_str(),
        "state": record.state.as_str(),
        "attempts": record.fence,
        "lease_until": record.lease_until,
        "lease_expired": record.state == RecordState::Processing
            && record.lease_until.is_some_and(|u| u < now),
        "created_at": record.created_at,
        "completed_at": record.completed_at,
        "response_status": record.response.as_ref().map(|r| r.status),
        "advice": advice(record, now),
        "provider_key": provider_key,
        "payment": payment.as_ref().map(store::PaymentRow::view),
        "evidence": evidence,
    }))
}
