use std::future::Future;
use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Router};
use http::StatusCode;
use oncely_http::{ApiKeys, IdempotencyLayer, Problem, TenantLayer, TransactionLayer};
use oncely_sql::{Database, IdempotencyStore, Migrations, StoreError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::probes::{healthz, metrics, metrics_handle};
use crate::{orders, AppConfig};

/// Applies oncely's migrations and the order service's own (tables `orders`, `invoices`,
/// `stock`, `stock_reservations`).
///
/// # Errors
/// [`StoreError::Migrate`] when a migration fails.
pub async fn migrate(db: &Database) -> Result<(), StoreError> {
    db.migrate().await?;
    db.run_migrator(
        Migrations::new()
            .sqlite(sqlx::migrate!("./migrations/sqlite"))
            .postgres(sqlx::migrate!("./migrations/postgres"))
            .mysql(sqlx::migrate!("./migrations/mysql")),
    )
    .await
}

/// The service's routes: `POST /v1/orders` (idempotent, key required),
/// `GET /v1/orders` (a page of the tenant's orders), `GET /v1/orders/{id}`,
/// `POST /v1/orders/{id}/cancel`, `GET`/`PUT /v1/stock/{sku}`, `GET /healthz` (liveness),
/// `GET /readyz` (database, broker and providers), `GET /metrics`, `GET /openapi.json` (the
/// OpenAPI 3.1 document, [`crate::openapi_document`]).
/// With [`AppConfig::admin_token`], the operator console under `/console`; with
/// [`AppConfig::stripe_webhook`], `POST /v1/webhooks/stripe`.
pub fn router(db: Database, config: &AppConfig) -> Router {
    let store = IdempotencyStore::new(db.clone(), config.retention);
    build(
        db,
        config,
        IdempotencyLayer::new(store, config.idempotency.clone()),
    )
}

/// The same routes and handlers with [`TransactionLayer`] in place of the idempotency
/// layer: each `POST` runs once in a plain transaction. For benchmarks' baselines only —
/// it gives no protection against retries.
pub fn router_without_idempotency(db: Database, config: &AppConfig) -> Router {
    build(db.clone(), config, TransactionLayer::new(db))
}

fn build<L>(db: Database, config: &AppConfig, tx_layer: L) -> Router
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service: tower::Service<
            axum::extract::Request,
            Response = Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Future: Send + 'static,
{
    let keys = ApiKeys::new(config.api_keys.clone());
    let (db_console, keys_console) = (db.clone(), keys.clone());
    let api = Router::new()
        // The idempotency layer bounds the body (413 before any reservation); axum's own
        // 2 MiB extractor limit must not answer a second, storable 413 behind it.
        .route(
            "/v1/orders",
            post(orders::create_order).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route_layer(tx_layer)
        // Reads run outside the idempotency layer (which takes only unsafe methods).
        .route("/v1/orders", get(crate::list::list_orders))
        .route("/v1/orders/{id}", get(orders::get_order))
        .route("/v1/tenant", get(crate::caller::get_tenant))
        // A cancel is idempotent by state (a second one changes nothing): no key needed.
        .route(
            "/v1/orders/{id}/cancel",
            post(crate::fulfilment::cancel_order),
        )
        .route(
            "/v1/stock/{sku}",
            get(crate::stock::get_stock).put(crate::stock::set_stock),
        )
        // Inside authentication: an unauthenticated client gets 401 with its body unread
        // and spends none of the body budget.
        .route_layer(middleware::from_fn_with_state(
            config.body_limits(),
            oncely_http::read_body,
        ))
        .route_layer(TenantLayer::new(keys.clone()))
        .layer(axum::Extension(crate::events::EventSettings {
            topic: config.events_topic.clone(),
        }))
        .layer(axum::Extension(crate::fulfilment::CancelSettings {
            mode: config.fulfilment.mode,
            orchestrator: Arc::new(crate::fulfilment_orchestrator(
                db.clone(),
                &config.fulfilment,
                oncely_saga::OrchestratorConfig::default(),
                Arc::new(oncely_effects::NoHandler),
            )),
        }))
        .with_state(db.clone())
        .merge(crate::payments::routes(&db, config, keys));
    let ops = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(crate::ready::readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .layer(axum::Extension(crate::ready::Readiness {
            dependencies: Arc::new(config.dependencies.clone()),
        }))
        .with_state(db);
    let mut app = api
        .merge(ops)
        .merge(crate::webhooks::routes(&db_console, config));
    if let Some(token) = &config.admin_token {
        app = app.merge(crate::console::router(
            db_console,
            token,
            keys_console,
            config,
        ));
    }
    app.fallback(|| async {
        Problem::new(
            StatusCode::NOT_FOUND,
            crate::problem::NOT_FOUND,
            "No such resource",
        )
        .into_response()
    })
    .method_not_allowed_fallback(|| async {
        Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            crate::problem::METHOD_NOT_ALLOWED,
            "This method is not allowed on this resource",
        )
        .into_response()
    })
    .layer(middleware::from_fn(crate::metrics::track))
    .layer(middleware::from_fn(oncely_http::log_request))
}

/// Serves the order service on `listener` until `shutdown` resolves, then drains in-flight
/// requests. Runs the retention runner alongside ([`crate::retention`]: the collector and
/// the lease sweep).
///
/// Slow or stalled clients are bounded three ways ([`AppConfig::http`], enforced by
/// [`oncely_http::serve_http`] and [`oncely_http::read_body`]): a request head must
/// arrive within `header_read_timeout`, its whole body within `body_read_timeout` (a total
/// deadline, 408 past it); at most `max_connections` connections are served at once; and
/// request bodies in flight buffer at most `max_body_bytes_in_flight` bytes together — a
/// request that would exceed it gets 503 + `Retry-After` before its body is read (it has
/// run nothing, so the retry is safe; making it wait would hold its connection and socket
/// buffers while telling the client nothing).
///
/// # Errors
/// I/O errors from the listener.
pub async fn serve(
    listener: TcpListener,
    db: Database,
    config: AppConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let _ = metrics_handle();
    let token = CancellationToken::new();
    let retention = crate::retention(
        &IdempotencyStore::new(db.clone(), config.retention),
        &config,
    )
    .spawn(token.clone());
    let app = router(db, &config);
    let result = oncely_http::serve_http(listener, app, &config.http, shutdown).await;
    token.cancel();
    drop(retention.await);
    result
}
