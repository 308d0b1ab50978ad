//! The operations endpoints that need no authentication: `GET /healthz` and `GET /metrics`,
//! with the process-wide Prometheus recorder.

use std::sync::Once;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use metrics_exporter_prometheus::PrometheusHandle;
use oncely_http::Problem;
use oncely_sql::Database;

/// The process-wide Prometheus recorder ([`oncely_cli::metrics_handle`]), installed on
/// first use, with the `# HELP` text of the service's own metrics besides the libraries'.
pub fn metrics_handle() -> PrometheusHandle {
    static DESCRIBED: Once = Once::new();
    let handle = oncely_cli::metrics_handle();
    DESCRIBED.call_once(crate::metrics::describe);
    handle
}

/// `{"status":"ok","checks":{"database":"ok"}}`, or a 503 problem with
/// `"checks":{"database":"unavailable"}`. Unauthenticated, so it names each dependency's
/// state with a stable word and never the driver's error text (which can carry host names,
/// users, paths); the error goes to the log instead.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "The process is up and reaches its database",
         content_type = "application/json", body = Object),
        (status = 503, description = "store-unavailable: the database cannot be reached",
         body = crate::schema::Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn healthz(State(db): State<Database>) -> Response {
    match db.ping().await {
        Ok(()) => {
            Json(serde_json::json!({"status": "ok", "checks": {"database": "ok"}})).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "health check: the database cannot be reached");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                oncely_http::kind::STORE_UNAVAILABLE,
                "The database cannot be reached",
            )
            .with("checks", serde_json::json!({"database": "unavailable"}))
            .into_response()
        }
    }
}

/// `GET /metrics`: every metric in the Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "The Prometheus text exposition format",
         content_type = "text/plain", body = String),
    )
)]
pub(crate) async fn metrics() -> String {
    metrics_handle().render()
}
