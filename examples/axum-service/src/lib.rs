//! A transfers service of a user's own, made idempotent with oncely — the walk-through of
//! the README's "Embedding oncely in your own axum service". Everything here is the user's:
//! the `transfers` table, the API keys, the handler. oncely adds the `Idempotency-Key`
//! handling: a retry with the same key gets the stored answer (`Idempotent-Replayed:
//! true`), never a second transfer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use axum::{http::StatusCode, routing::post, Router};
use oncely_core::TenantId;
// oncely's `Json`, not axum's: a body that does not deserialize is refused (422) before the
// handler runs and is not stored under its key, so the corrected retry with the same key
// runs. With axum's `Json` that refusal would be stored and replayed.
use oncely_http::{
    IdempotencyConfig, IdempotencyLayer, IdempotentTx, Json, StoreFailure, TenantLayer,
};
use oncely_sql::{query, Database, DbOptions, IdempotencyStore, StoreError};
use serde::Deserialize;
use serde_json::json;

/// The body of `POST /transfers`.
#[derive(Debug, Deserialize)]
pub struct NewTransfer {
    /// Account debited.
    pub from: String,
    /// Account credited.
    pub to: String,
    /// Amount in cents.
    pub amount_minor: i64,
}

/// Hands oncely the service's existing PostgreSQL pool, creates the service's own table and
/// oncely's tables, and builds the router. `api_keys` maps an `X-Api-Key` to its tenant.
///
/// # Errors
/// The database refused the migrations.
pub async fn app(
    pool: sqlx::PgPool,
    api_keys: BTreeMap<String, TenantId>,
) -> Result<Router, StoreError> {
    let db = Database::from_postgres_pool(pool, &DbOptions::default());
    db.migrate().await?; // oncely's own tables (oncely_idempotency, …)
    db.execute(query(
        "CREATE TABLE IF NOT EXISTS transfers (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, \
         from_account TEXT NOT NULL, to_account TEXT NOT NULL, amount_minor BIGINT NOT NULL)",
    ))
    .await?;
    let store = IdempotencyStore::new(db, Duration::from_secs(24 * 3600));
    let keys = Arc::new(api_keys);
    // Your own tenant extraction: here an API key header. No tenant → 401 problem.
    let tenant = TenantLayer::new(move |parts: &axum::http::request::Parts| {
        let api_key = parts.headers.get("x-api-key")?.to_str().ok()?;
        keys.get(api_key).cloned()
    });
    Ok(Router::new()
        .route("/transfers", post(create_transfer))
        .route_layer(IdempotencyLayer::new(store, IdempotencyConfig::default()))
        .route_layer(tenant)) // the outer layer: authentication runs first
}

/// Writes the transfer in the transaction oncely opened for this key: the row and the
/// stored answer commit together, or neither does.
async fn create_transfer(mut tx: IdempotentTx, Json(t): Json<NewTransfer>) -> Response {
    let id = uuid::Uuid::now_v7().to_string();
    let tenant = tx
        .context()
        .map(|c| c.scope.tenant.as_str().to_owned())
        .unwrap_or_default();
    let insert = query("INSERT INTO transfers (id, tenant, from_account, to_account, amount_minor) VALUES ($1, $2, $3, $4, $5)")
        .bind(id.as_str()).bind(tenant).bind(t.from.as_str()).bind(t.to.as_str()).bind(t.amount_minor);
    match tx.execute(insert).await {
        Ok(_) => (
            StatusCode::CREATED,
            Json(json!({"id": id, "from": t.from, "to": t.to, "amount_minor": t.amount_minor})),
        )
            .into_response(),
        Err(e) => StoreFailure::from(e).into_response(),
    }
}
