//! The keyed request: its scope, its `Idempotency-Key`, its body read within bounds and
//! fingerprinted.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderName, Request, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use oncely_core::{
    is_json_media_type, parse_i_json, Fingerprint, FingerprintError, FingerprintInput,
    FingerprintParts, IdempotencyKey, JsonPointer, Operation, Scope, TenantId,
};
use serde_json::Value;
use tower::Service;

use crate::extract::IdempotencyContext;
use crate::metrics as metric;
use crate::problem::kind;
use crate::Problem;

/// The wrapped service (the route), as both modes call it: it answers every request, never
/// fails, and it and its future move to a spawned task.
pub(crate) trait Route:
    Service<Request<Body>, Response = Response, Error = Infallible, Future: Send + 'static>
    + Send
    + 'static
{
}

impl<S> Route for S
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
}

pub(crate) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The request's [`Scope`] (its tenant and operation) and its route template. The tenant
/// comes from authentication, never from the request: 401 when no [`TenantId`] was put in
/// the extensions.
#[allow(clippy::result_large_err)] // the error is the finished answer, built at most once per request and returned at once
pub(crate) fn scope_of(parts: &http::request::Parts) -> Result<(Scope, String), Response> {
    let Some(tenant) = parts.extensions.get::<TenantId>().cloned() else {
        return Err(Problem::new(
            StatusCode::UNAUTHORIZED,
            kind::UNAUTHENTICATED,
            "Authentication required",
        )
        .into_response());
    };
    let template = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
    let scope = Scope::new(tenant, Operation::new(parts.method.as_str(), &template));
    Ok((scope, template))
}

/// The request's `Idempotency-Key`, `None` when it sent none; 400 when it is malformed or
/// sent twice (draft-ietf-httpapi-idempotency-key-header-07 §2.1: one key per request).
#[allow(clippy::result_large_err)] // the error is the finished answer, built at most once per request and returned at once
pub(crate) fn key_of(headers: &http::HeaderMap) -> Result<Option<IdempotencyKey>, Response> {
    let malformed = || {
        Problem::new(
            StatusCode::BAD_REQUEST,
            kind::IDEMPOTENCY_KEY_MALFORMED,
            "The Idempotency-Key header is malformed",
        )
    };
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(v), None) => IdempotencyKey::parse(v.as_bytes()).map(Some).map_err(|e| {
            metrics::counter!(metric::REJECTED_TOTAL, "reason" => "malformed_key").increment(1);
            malformed().detail(e.to_string()).into_response()
        }),
        (Some(_), Some(_)) => Err(malformed()
            .detail("exactly one Idempotency-Key header is allowed")
            .into_response()),
    }
}

/// The whole request body, at most `limit` bytes (413 above it, 400 when it cannot be
/// read): the fingerprint covers all of it.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<Bytes, Response> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            kind::REQUEST_TOO_LARGE,
            "The request body is too large",
        )
        .detail(format!("at most {limit} bytes are accepted"))
        .into_response()),
        Err(_) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            kind::REQUEST_BODY,
            "The request body could not be read",
        )
        .into_response()),
    }
}

/// The request's [`Fingerprint`] under `covered` (method, route template, path, and the
/// body canonicalized by its content type, or the values at its pointers; the covered
/// headers); 400 for a JSON body that does not parse, 415 for a body that is not JSON on
/// a route whose fingerprint covers JSON pointers.
#[allow(clippy::result_large_err)] // the error is the finished answer, built at most once per request and returned at once
pub(crate) fn fingerprint_of(
    parts: &http::request::Parts,
    template: &str,
    bytes: &Bytes,
    covered: &FingerprintParts,
) -> Result<Fingerprint, Response> {
    let headers: Vec<(&str, &[u8])> = if covered.header_names().is_empty() {
        Vec::new()
    } else {
        parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect()
    };
    let input = FingerprintInput {
        method: parts.method.as_str(),
        template,
        path: parts.uri.path(),
        content_type: content_type(parts),
        headers: &headers,
        body: bytes,
    };
    covered.compute(&input).map_err(|e| match e {
        FingerprintError::NotJson => {
            not_json("the fingerprint of this route covers fields of a JSON body")
        }
        e => malformed_json(&e.to_string()),
    })
}

fn content_type(parts: &http::request::Parts) -> Option<&str> {
    parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
}

fn malformed_json(detail: &str) -> Response {
    Problem::new(
        StatusCode::BAD_REQUEST,
        kind::MALFORMED_JSON,
        "The request body is not valid JSON",
    )
    .detail(detail)
    .into_response()
}

fn not_json(why: &str) -> Response {
    Problem::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        kind::UNSUPPORTED_MEDIA_TYPE,
        "The request body must be JSON",
    )
    .detail(format!(
        "{why}; send it as application/json (or a +json media type)"
    ))
    .into_response()
}

/// The business key of a request: the value at `pointer` in its JSON body (a string, or a
/// number in its RFC 8785 form) as an [`IdempotencyKey`]. 415 for a body that is not
/// JSON, 400 `malformed-json`, 400 `business-key-missing` (nothing or `null` there), 422
/// `business-key-invalid` (another type, or not a valid key); the problems name the
/// pointer, never the value.
#[allow(clippy::result_large_err)] // the error is the finished answer, built at most once per request and returned at once
pub(crate) fn body_key(
    parts: &http::request::Parts,
    bytes: &Bytes,
    pointer: &JsonPointer,
) -> Result<IdempotencyKey, Response> {
    let refused = |status, kind: &str, title: &str, detail: String| {
        metrics::counter!(metric::REJECTED_TOTAL, "reason" => "business_key").increment(1);
        Problem::new(status, kind, title)
            .detail(detail)
            .with("pointer", pointer.as_str())
            .into_response()
    };
    if !is_json_media_type(content_type(parts)) {
        return Err(not_json(&format!(
            "this route reads the operation's key at {pointer} in a JSON body"
        )));
    }
    let document = parse_i_json(bytes).map_err(|e| malformed_json(&e.to_string()))?;
    match pointer.find(&document) {
        None | Some(Value::Null) => Err(refused(
            StatusCode::BAD_REQUEST,
            kind::BUSINESS_KEY_MISSING,
            "The request body has no business key",
            format!("this route identifies an operation by the value at {pointer} in the body, and the body has none"),
        )),
        Some(value) => IdempotencyKey::from_json(value).ok_or_else(|| {
            refused(
                StatusCode::UNPROCESSABLE_ENTITY,
                kind::BUSINESS_KEY_INVALID,
                "The request body's business key is not a valid key",
                format!("the value at {pointer} must be a string or number of 1-255 visible ASCII characters, not starting with a quote"),
            )
        }),
    }
}

/// A request with a well-formed key, its body read and fingerprinted.
pub(crate) struct Keyed {
    pub(crate) parts: http::request::Parts,
    pub(crate) bytes: Bytes,
    pub(crate) scope: Scope,
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
}

/// The record a request is about (tenant, operation and key), and the request's
/// fingerprint.
pub(crate) struct Subject {
    pub(crate) scope: Scope,
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
}

impl Keyed {
    /// The request as its handler gets it, its [`IdempotencyContext`] in the extensions,
    /// counted as an execution; and what it is about.
    pub(crate) fn start(self) -> (Request<Body>, Subject) {
        metrics::counter!(metric::EXECUTIONS_TOTAL).increment(1);
        let Keyed {
            mut parts,
            bytes,
            scope,
            key,
            fingerprint,
        } = self;
        parts.extensions.insert(IdempotencyContext {
            scope: scope.clone(),
            key: Some(key.clone()),
        });
        let subject = Subject {
            scope,
            key,
            fingerprint,
        };
        (Request::from_parts(parts, Body::from(bytes)), subject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(content_type: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut req = Request::post("/orders").header(header::CONTENT_TYPE, content_type);
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        req.body(()).unwrap().into_parts().0
    }

    fn status(res: &Response) -> (StatusCode, String) {
        let kind = res
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        (res.status(), kind)
    }

    #[test]
    fn the_default_fingerprint_is_the_one_fingerprint_compute_gives() {
        let body = Bytes::from_static(br#"{"b":1,"a":[2]}"#);
        let p = parts("application/json", &[("stripe-version", "1")]);
        let got = fingerprint_of(&p, "/orders", &body, &FingerprintParts::default()).unwrap();
        let want = Fingerprint::compute(
            "POST",
            "/orders",
            "/orders",
            Some("application/json"),
            &body,
        )
        .unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn covered_headers_and_pointers_reach_the_fingerprint() {
        let covered = FingerprintParts::default()
            .body_pointers([JsonPointer::parse("/amount").unwrap()])
            .headers(["Stripe-Version"]);
        let of = |version: &str, body: &'static [u8]| {
            let p = parts("application/json", &[("stripe-version", version)]);
            fingerprint_of(&p, "/orders", &Bytes::from_static(body), &covered).unwrap()
        };
        let first = of("1", br#"{"amount":5,"nonce":"a"}"#);
        assert_eq!(
            first.mismatch(&of("1", br#"{"amount":5,"nonce":"b"}"#)),
            None
        );
        assert_eq!(
            first
                .mismatch(&of("2", br#"{"amount":5}"#))
                .map(oncely_core::FingerprintMismatch::as_str),
            Some("headers")
        );
        assert_eq!(
            first
                .mismatch(&of("1", br#"{"amount":6}"#))
                .map(oncely_core::FingerprintMismatch::as_str),
            Some("body")
        );
        let text = parts("text/plain", &[]);
        let refused = fingerprint_of(&text, "/orders", &Bytes::from_static(b"{}"), &covered);
        assert_eq!(
            refused.unwrap_err().status(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
    }

    #[test]
    fn a_business_key_is_read_or_refused_with_a_problem() {
        let pointer = JsonPointer::parse("/external_ref").unwrap();
        let json = parts("application/json", &[]);
        let key = |body: &'static [u8]| {
            body_key(&json, &Bytes::from_static(body), &pointer)
                .ok()
                .map(|k| k.as_str().to_owned())
        };
        assert_eq!(key(br#"{"external_ref":"r-1"}"#).as_deref(), Some("r-1"));
        assert_eq!(key(br#"{"external_ref":42}"#).as_deref(), Some("42"));
        for (body, code) in [
            (&br#"{"other":1}"#[..], StatusCode::BAD_REQUEST),
            (br#"{"external_ref":null}"#, StatusCode::BAD_REQUEST),
            (
                br#"{"external_ref":"a b"}"#,
                StatusCode::UNPROCESSABLE_ENTITY,
            ),
            (br#"{"external_ref":[1]}"#, StatusCode::UNPROCESSABLE_ENTITY),
            (b"{nope", StatusCode::BAD_REQUEST),
        ] {
            let res = body_key(&json, &Bytes::from_static(body), &pointer).unwrap_err();
            assert_eq!(status(&res), (code, "application/problem+json".to_owned()));
        }
        let text = parts("text/plain", &[]);
        let res = body_key(&text, &Bytes::from_static(b"{}"), &pointer).unwrap_err();
        assert_eq!(res.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
}
