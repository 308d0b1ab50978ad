use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use oncely_core::TenantId;
use oncely_http::Problem;

/// Authenticates `Authorization: Bearer <api key>` and puts the key's [`TenantId`] in the
/// request extensions. Runs before the idempotency layer, so an unauthenticated request
/// never reaches a stored record (401 before any lookup).
pub(crate) async fn authenticate(
    State(keys): State<Arc<HashMap<String, TenantId>>>,
    mut req: Request,
    next: Next,
) -> Response {
    // Exactly one Authorization header: with two, which credential counts is ambiguous.
    let mut values = req.headers().get_all(header::AUTHORIZATION).iter();
    let only = match (values.next(), values.next()) {
        (Some(v), None) => Some(v),
        _ => None,
    };
    let tenant = only
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .and_then(|token| keys.get(token))
        .cloned();
    if let Some(t) = tenant {
        req.extensions_mut().insert(t);
        return next.run(req).await;
    }
    let mut res = Problem::new(
        StatusCode::UNAUTHORIZED,
        oncely_http::kind::UNAUTHENTICATED,
        "A valid API key is required",
    )
    .detail("send Authorization: Bearer <api key>")
    .into_response();
    res.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    res
}
