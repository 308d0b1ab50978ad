//! The schema types the handlers' `#[utoipa::path]` attributes name and the API document
//! lists: the RFC 9457 problem object and the `Idempotency-Key` header. A leaf, so the
//! handlers and the document (`openapi`) never import each other.

use std::borrow::Cow;

use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder, Schema, SchemaFormat, Type};
use utoipa::openapi::RefOr;

/// The `type` URI prefix of every problem (`urn:oncely:problem:<kind>`).
pub(crate) const PROBLEM_TYPE_PREFIX: &str = "urn:oncely:problem:";

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
