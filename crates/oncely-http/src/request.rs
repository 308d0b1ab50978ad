//! The keyed request: its scope, its `Idempotency-Key`, its body read within bounds and
//! fingerprinted.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderName, Request, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use oncely_core::{Fingerprint, IdempotencyKey, Operation, Scope, TenantId};
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

/// The request's [`Fingerprint`] (method, route template, path, and the body canonicalized
/// by its content type); 400 for a JSON body that does not parse.
#[allow(clippy::result_large_err)] // the error is the finished answer, built at most once per request and returned at once
pub(crate) fn fingerprint_of(
    parts: &http::request::Parts,
    template: &str,
    bytes: &Bytes,
) -> Result<Fingerprint, Response> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    Fingerprint::compute(
        parts.method.as_str(),
        template,
        parts.uri.path(),
        content_type,
        bytes,
    )
    .map_err(|e| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            kind::MALFORMED_JSON,
            "The request body is not valid JSON",
        )
        .detail(e.to_string())
        .into_response()
    })
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
