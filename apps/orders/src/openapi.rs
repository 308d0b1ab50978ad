//! The service's OpenAPI 3.1 document, generated from the handlers' `#[utoipa::path]`
//! attributes and the types' `ToSchema` derives, served at `GET /openapi.json` (no
//! authentication).
//!
//! It describes, besides each route: the RFC 9457 problem object with every `type` URI the
//! service and its idempotency layer answer with ([`crate::problem::ALL`],
//! [`oncely_http::kind::ALL`]); the `Idempotency-Key` request header
//! (draft-ietf-httpapi-idempotency-key-header-07 §2) and the `Idempotent-Replayed` response
//! header; and the API key sent as `Authorization: Bearer <api key>`, as
//! [`crate::auth`] reads it.

use std::sync::OnceLock;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::schema::Problem;

/// Name of the security scheme every `/v1` operation requires.
pub(crate) const API_KEY_SCHEME: &str = "api_key";

/// The generated document; [`document`] is what the service serves.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "oncely order service",
        description = "Idempotent order intake: `POST /v1/orders` creates exactly one order \
                       however often a client retries with the same `Idempotency-Key`. Every \
                       error is an RFC 9457 `application/problem+json` object whose `type` is \
                       `urn:oncely:problem:<kind>`."
    ),
    paths(
        crate::orders::create_order,
        crate::list::list_orders,
        crate::orders::get_order,
        crate::caller::get_tenant,
        crate::fulfilment::cancel_order,
        crate::stock::get_stock,
        crate::stock::set_stock,
        crate::payments::create_payment,
        crate::operations::get_operation,
        crate::probes::healthz,
        crate::ready::readyz,
        crate::probes::metrics,
        openapi_json,
    ),
    components(schemas(Problem)),
    modifiers(&ApiKeyScheme),
    tags(
        (name = "orders", description = "Orders of the caller's tenant"),
        (name = "operations", description = "Health, metrics and this document; no authentication"),
    )
)]
struct ApiDoc;

/// Adds the API key scheme: `Authorization: Bearer <api key>`.
struct ApiKeyScheme;

impl Modify for ApiKeyScheme {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            API_KEY_SCHEME,
            SecurityScheme::Http(
                Http::builder()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("API key")
                    .description(Some(
                        "An API key of the service (`--api-keys key=tenant`), sent as \
                         `Authorization: Bearer <api key>`; it names the tenant every read and \
                         write is scoped to. Without a valid one: 401 `unauthenticated` with \
                         `WWW-Authenticate: Bearer`.",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as JSON, built once.
///
/// The response schemas of orders reuse the request's `NewOrder` fields, which refuse
/// unknown members (`additionalProperties: false`, as `POST` does); inside an `allOf`
/// that would refuse the order's own `id`, so the response side gets `OrderFields`, the same
/// object without that bound.
pub fn document() -> &'static serde_json::Value {
    static DOC: OnceLock<serde_json::Value> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc =
            serde_json::to_value(ApiDoc::openapi()).expect("an OpenAPI document always serialises");
        let schemas = &mut doc["components"]["schemas"];
        let mut fields = schemas["NewOrder"].clone();
        if let Some(o) = fields.as_object_mut() {
            o.remove("additionalProperties");
            o.insert(
                "description".to_owned(),
                "The fields of an order as it was submitted.".into(),
            );
        }
        schemas["OrderFields"] = fields;
        retarget(
            &mut schemas["Order"],
            "#/components/schemas/NewOrder",
            "#/components/schemas/OrderFields",
        );
        doc
    })
}

/// Replaces every `$ref` to `from` in `v` with one to `to`.
fn retarget(v: &mut serde_json::Value, from: &str, to: &str) {
    match v {
        serde_json::Value::Object(o) => {
            if o.get("$ref").and_then(serde_json::Value::as_str) == Some(from) {
                o.insert("$ref".to_owned(), to.into());
            }
            for child in o.values_mut() {
                retarget(child, from, to);
            }
        }
        serde_json::Value::Array(a) => {
            for child in a {
                retarget(child, from, to);
            }
        }
        _ => {}
    }
}

/// `GET /openapi.json`: this document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "The OpenAPI 3.1 document of this service",
         content_type = "application/json", body = Object),
    )
)]
pub(crate) async fn openapi_json() -> Response {
    let body = serde_json::to_vec(document()).unwrap_or_default();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}
