//! `GET /v1/tenant`: which tenant the caller's API key authenticates, so a client can check
//! the key before it acts for a tenant (`orders import --url` refuses a `--tenant` that is
//! not its key's: the tenant enters the derived idempotency keys).

use axum::Json;
use oncely_core::TenantId;
use serde::Serialize;
use utoipa::ToSchema;

/// The caller's tenant: `{"tenant": "acme"}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Caller {
    /// The tenant the API key authenticates.
    pub(crate) tenant: String,
}

/// `GET /v1/tenant`: the tenant of the API key in `Authorization` (read from the request
/// extensions, where `TenantLayer` put it; 401 before this runs without a valid key).
#[utoipa::path(
    get,
    path = "/v1/tenant",
    tag = "orders",
    operation_id = "get_tenant",
    summary = "Name the tenant the caller's API key authenticates",
    responses(
        (status = 200, description = "The caller's tenant", body = Caller),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn get_tenant(axum::Extension(tenant): axum::Extension<TenantId>) -> Json<Caller> {
    Json(Caller {
        tenant: tenant.as_str().to_owned(),
    })
}
