//! Stock per tenant and SKU (table `stock`, migration 10006) and the fulfilment saga's
//! reservations (`stock_reservations`, `UNIQUE(order_id, sku)`): `PUT`/`GET
//! /v1/stock/{sku}` for the operator's seeding, and the saga's local steps — reserve,
//! release (its compensation), consume (on fulfilment).

use std::collections::BTreeMap;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http::StatusCode;
use oncely_core::TenantId;
use oncely_http::{Path, Problem, StoreFailure};
use oncely_saga::StepError;
use oncely_sql::{query, Database, StoreError, Tx};
use serde::{Deserialize, Serialize};

/// Body of `PUT /v1/stock/{sku}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SetStock {
    /// The quantity that can be reserved, 0–10^9.
    available: i64,
}

/// A SKU's stock as `GET`/`PUT /v1/stock/{sku}` show it.
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
struct StockView {
    sku: String,
    /// What new orders can reserve.
    available: i64,
    /// Held by reservations of orders not yet fulfilled or compensated.
    reserved: i64,
    /// Unix ms.
    updated_at: i64,
}

fn invalid(detail: &str) -> Response {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        crate::problem::INVALID_STOCK,
        "The stock is invalid",
    )
    .detail(detail.to_owned())
    .into_response()
}

fn valid_sku(sku: &str) -> bool {
    !sku.is_empty()
        && sku.chars().count() <= 64
        && sku.trim() == sku
        && !sku.chars().any(char::is_control)
}

async fn read(db: &Database, tenant: &str, sku: &str) -> Result<Option<StockView>, StoreError> {
    let sql = format!(
        "SELECT {}, available, reserved, updated_at FROM stock WHERE tenant = $1 AND sku = $2",
        db.backend().text_column("sku")
    );
    db.fetch_optional(query(sql).bind(tenant).bind(sku)).await
}

/// `PUT /v1/stock/{sku}` `{"available": N}`: sets what the tenant's orders can reserve
/// of `sku` (absolute, so a repeated request changes nothing more; reservations held stay
/// held). 200 with the stock; 422 problem for a bad SKU or quantity.
#[utoipa::path(
    put,
    path = "/v1/stock/{sku}",
    tag = "orders",
    operation_id = "set_stock",
    summary = "Set what the tenant's orders can reserve of a SKU",
    params(("sku" = String, Path, description = "The SKU, 1 to 64 printable characters")),
    request_body(content = SetStock, content_type = "application/json"),
    responses(
        (status = 200, description = "The stock", body = StockView),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 422, description = "invalid-stock: a bad SKU, body or quantity",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 500, description = "store-error", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable or server-busy",
            body = crate::schema::Problem, content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn set_stock(
    State(db): State<Database>,
    axum::Extension(tenant): axum::Extension<TenantId>,
    Path(sku): Path<String>,
    body: Bytes,
) -> Response {
    let Ok(set) = serde_json::from_slice::<SetStock>(&body) else {
        return invalid("the body must be {\"available\": <integer>}");
    };
    if !valid_sku(&sku) {
        return invalid("the SKU must have 1 to 64 printable characters");
    }
    if !(0..=1_000_000_000).contains(&set.available) {
        return invalid("available must be between 0 and 10^9");
    }
    match upsert(&db, tenant.as_str(), &sku, set.available).await {
        Ok(()) => get_stock(State(db), axum::Extension(tenant), Path(sku)).await,
        Err(e) => StoreFailure::from(e).into_response(),
    }
}

async fn upsert(db: &Database, tenant: &str, sku: &str, available: i64) -> Result<(), StoreError> {
    let now = oncely_core::now_ms();
    let mut tx = db.begin().await?;
    let inserted = tx
        .insert_ignoring_duplicate(
            query(
                "INSERT INTO stock (tenant, sku, available, reserved, updated_at) \
                 VALUES ($1, $2, $3, 0, $4)",
            )
            .bind(tenant)
            .bind(sku)
            .bind(available)
            .bind(now),
            "(tenant, sku)",
        )
        .await?;
    if !inserted {
        tx.execute(
            query(
                "UPDATE stock SET available = $1, updated_at = $2 WHERE tenant = $3 AND sku = $4",
            )
            .bind(available)
            .bind(now)
            .bind(tenant)
            .bind(sku),
        )
        .await?;
    }
    tx.commit().await
}

/// `GET /v1/stock/{sku}`: the tenant's stock of `sku`, 404 problem when it has none (or
/// the SKU could not be one: never sent to the database).
#[utoipa::path(
    get,
    path = "/v1/stock/{sku}",
    tag = "orders",
    operation_id = "get_stock",
    summary = "Read the tenant's stock of a SKU",
    params(("sku" = String, Path, description = "The SKU")),
    responses(
        (status = 200, description = "The stock", body = StockView),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "not-found: no stock of this SKU in the caller's tenant",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 500, description = "store-error", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable or server-busy",
            body = crate::schema::Problem, content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn get_stock(
    State(db): State<Database>,
    axum::Extension(tenant): axum::Extension<TenantId>,
    Path(sku): Path<String>,
) -> Response {
    let found = if valid_sku(&sku) {
        read(&db, tenant.as_str(), &sku).await
    } else {
        Ok(None)
    };
    match found {
        Ok(Some(view)) => Json(view).into_response(),
        Ok(None) => Problem::new(
            StatusCode::NOT_FOUND,
            crate::problem::NOT_FOUND,
            "No stock of this SKU",
        )
        .into_response(),
        Err(e) => StoreFailure::from(e).into_response(),
    }
}

/// An order's lines merged per SKU (two lines of one SKU are one reservation).
pub(crate) fn lines(items: &serde_json::Value) -> Result<BTreeMap<String, i64>, StepError> {
    let mut merged = BTreeMap::new();
    for item in items.as_array().into_iter().flatten() {
        let (Some(sku), Some(quantity)) = (item["sku"].as_str(), item["quantity"].as_i64()) else {
            return Err(StepError::Refused(
                "an order line without sku or quantity".into(),
            ));
        };
        *merged.entry(sku.to_owned()).or_insert(0) += quantity;
    }
    if merged.is_empty() {
        return Err(StepError::Refused("an order without lines".into()));
    }
    Ok(merged)
}

/// Reserves `lines` of `tenant`'s stock for `order_id` in `tx`. Checks every line first
/// and refuses (out of stock) before writing anything; then takes each line with a
/// guarded update (`available >= quantity`) and records its reservation. A concurrent
/// reservation that took the stock between the check and the update makes this a store
/// conflict: the whole transaction rolls back and is tried again (when the check refuses).
///
/// # Errors
/// [`StepError::Refused`] when a SKU has too little stock (nothing written);
/// [`StepError::Store`] when the database fails or a guard lost its race.
pub(crate) async fn reserve(
    tx: &mut Tx,
    tenant: &str,
    order_id: &str,
    lines: &BTreeMap<String, i64>,
) -> Result<serde_json::Value, StepError> {
    for (sku, quantity) in lines {
        let row: Option<(i64,)> = tx
            .fetch_optional(
                query("SELECT available FROM stock WHERE tenant = $1 AND sku = $2")
                    .bind(tenant)
                    .bind(sku.as_str()),
            )
            .await?;
        let available = row.map_or(0, |r| r.0);
        if available < *quantity {
            return Err(StepError::Refused(format!(
                "out of stock: {sku} has {available}, the order needs {quantity}"
            )));
        }
    }
    let now = oncely_core::now_ms();
    for (sku, quantity) in lines {
        let taken = tx
            .execute(
                query(
                    "UPDATE stock SET available = available - $1, reserved = reserved + $2, \
                     updated_at = $3 WHERE tenant = $4 AND sku = $5 AND available >= $6",
                )
                .bind(*quantity)
                .bind(*quantity)
                .bind(now)
                .bind(tenant)
                .bind(sku.as_str())
                .bind(*quantity),
            )
            .await?;
        if taken != 1 {
            return Err(StepError::Store(StoreError::Conflict(format!(
                "the stock of {sku} was taken between its check and its reservation"
            ))));
        }
        tx.execute(
            query(
                "INSERT INTO stock_reservations (order_id, sku, tenant, quantity, state, \
                 created_at, updated_at) VALUES ($1, $2, $3, $4, 'held', $5, $6)",
            )
            .bind(order_id)
            .bind(sku.as_str())
            .bind(tenant)
            .bind(*quantity)
            .bind(now)
            .bind(now),
        )
        .await?;
    }
    Ok(serde_json::json!({ "reserved": lines }))
}

/// Ends `order_id`'s held reservations in `tx`: `released` puts their quantities back
/// in `available` (the compensation), `consumed` only drops them from `reserved` (the
/// order is fulfilled: stock leaves for good). Each reservation ends once: only `held`
/// ones are ended.
///
/// # Errors
/// [`StoreError`] when the database fails.
pub(crate) async fn end_reservations(
    tx: &mut Tx,
    tenant: &str,
    order_id: &str,
    release: bool,
) -> Result<serde_json::Value, StoreError> {
    let sql = format!(
        "SELECT {}, quantity FROM stock_reservations WHERE order_id = $1 AND tenant = $2 \
         AND state = 'held' ORDER BY sku",
        tx.backend().text_column("sku")
    );
    let held: Vec<(String, i64)> = tx.fetch_all(query(sql).bind(order_id).bind(tenant)).await?;
    let now = oncely_core::now_ms();
    let (state, back) = if release {
        ("released", 1)
    } else {
        ("consumed", 0)
    };
    for (sku, quantity) in &held {
        tx.execute(
            query(
                "UPDATE stock SET available = available + $1, reserved = reserved - $2, \
                 updated_at = $3 WHERE tenant = $4 AND sku = $5",
            )
            .bind(quantity * back)
            .bind(*quantity)
            .bind(now)
            .bind(tenant)
            .bind(sku.as_str()),
        )
        .await?;
        tx.execute(
            query(
                "UPDATE stock_reservations SET state = $1, updated_at = $2 \
                 WHERE order_id = $3 AND sku = $4 AND state = 'held'",
            )
            .bind(state)
            .bind(now)
            .bind(order_id)
            .bind(sku.as_str()),
        )
        .await?;
    }
    let lines: BTreeMap<_, _> = held.into_iter().collect();
    Ok(serde_json::json!({ "ended": state, "lines": lines }))
}
