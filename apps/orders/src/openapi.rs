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

use std::borrow::Cow;
use std::sync::OnceLock;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue};
use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder, Schema, SchemaFormat, Type};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::RefOr;
use utoipa::{Modify, OpenApi};

/// Name of the security scheme every `/v1` operation requires.
pub(crate) const API_KEY_SCHEME: &str = "api_key";

/// The `type` URI prefix of every problem (`urn:oncely:problem:<kind>`).
const PROBLEM_TYPE_PREFIX: &str = "urn:oncely:problem:";

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
        crate::fulfilment::cancel_order,
        crate::stock::get_stock,
        crate::stock::set_stock,
        crate::payments::create_payment,
        crate::operations::get_operation,
        crate::app::healthz,
        crate::ready::readyz,
        crate::app::metrics,
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

/// The RFC 9457 problem details object (doc-only: the service builds
/// [`oncely_http::Problem`]), with the closed list of `type` URIs.
pub(crate) struct Problem;

impl utoipa::PartialSchema for Problem {
    fn schema() -> RefOr<Schema> {
        let types: Vec<String> = crate::problem::ALL
            .iter()
            .chain(oncely_http::kind::ALL)
            .map(|kind| format!("{PROBLEM_TYPE_PREFIX}{kind}"))
            .collect();
        let text = |description: &str| {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some(description))
        };
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(Some(
                "RFC 9457 problem details (`application/problem+json`). `type` is stable per \
                 kind, so clients branch on it; `detail` never echoes request values. Extension \
                 members (RFC 9457 §3.2) may follow, e.g. `differs` on idempotency-key-reused, \
                 `order` on order-conflict, `checks` on a failed health check. A 503 or a 409 \
                 request-in-flight carries `Retry-After`.",
            ))
            .property(
                "type",
                text("The problem type URI (RFC 9457 §3.1.1).")
                    .format(Some(SchemaFormat::Custom("uri".to_owned())))
                    .enum_values(Some(types)),
            )
            .required("type")
            .property("title", text("A short summary of the type."))
            .required("title")
            .property("detail", text("What happened in this occurrence."))
            .additional_properties(Some(AdditionalProperties::FreeForm(true)))
            .into()
    }
}

impl utoipa::ToSchema for Problem {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Problem")
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

/// The `Idempotency-Key` request header (draft-ietf-httpapi-idempotency-key-header-07 §2),
/// as the idempotency layer parses it.
pub(crate) struct IdempotencyKey;

impl utoipa::IntoParams for IdempotencyKey {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        use utoipa::openapi::path::{ParameterBuilder, ParameterIn};
        let schema = ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(255))
            .pattern(Some(r"^[\x21-\x7E]+$"))
            .examples(["7c1d2f0e-order-1001"]);
        vec![ParameterBuilder::new()
            .name("Idempotency-Key")
            .parameter_in(ParameterIn::Header)
            .required(utoipa::openapi::Required::True)
            .description(Some(
                "The client's key for this operation (draft-ietf-httpapi-idempotency-key-header \
                 §2): 1–255 visible ASCII characters (0x21–0x7E), also accepted as a quoted \
                 Structured Field string. One per request. Scoped by the tenant and the route; \
                 reused with a different body it is refused (422 idempotency-key-reused). A \
                 finished key is remembered for the service's retention (24 h by default).",
            ))
            .schema(Some(schema))
            .build()]
    }
}
