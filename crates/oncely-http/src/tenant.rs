//! Tenant extraction: the [`TenantId`] the idempotency layer scopes every key by.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, Request, StatusCode};
use oncely_core::TenantId;
use tower::{Layer, Service};

use crate::problem::kind;
use crate::Problem;

/// Puts the request's [`TenantId`] into its extensions, where
/// [`IdempotencyLayer`](crate::IdempotencyLayer) reads it, using a function of the request
/// head that the service supplies — typically "which tenant does this credential belong
/// to". When it answers `None` the request is refused with a 401 problem
/// (`urn:oncely:problem:unauthenticated`, RFC 9457) and the inner service is not called.
///
/// Apply it *outside* the idempotency layer (in axum: the later `.layer` /
/// `.route_layer` call), so authentication runs first and an unauthenticated request never
/// reaches a stored record. Keys are scoped by tenant: the same key sent by two tenants
/// names two operations, and neither sees the other's record.
///
/// ```
/// use oncely_core::TenantId;
/// use oncely_http::TenantLayer;
///
/// let layer = TenantLayer::new(|parts: &http::request::Parts| {
///     let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
///     TenantId::parse(tenant).ok()
/// });
/// # let _ = layer;
/// ```
pub struct TenantLayer<F> {
    extract: Arc<F>,
}

impl<F> TenantLayer<F>
where
    F: Fn(&http::request::Parts) -> Option<TenantId> + Send + Sync + 'static,
{
    /// A layer that asks `extract` for each request's tenant.
    pub fn new(extract: F) -> Self {
        Self {
            extract: Arc::new(extract),
        }
    }
}

impl<F> Clone for TenantLayer<F> {
    fn clone(&self) -> Self {
        Self {
            extract: self.extract.clone(),
        }
    }
}

impl<F> std::fmt::Debug for TenantLayer<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantLayer").finish_non_exhaustive()
    }
}

impl<S, F> Layer<S> for TenantLayer<F> {
    type Service = Tenant<S, F>;
    fn layer(&self, inner: S) -> Self::Service {
        Tenant {
            inner,
            extract: self.extract.clone(),
        }
    }
}

/// The service built by [`TenantLayer`].
pub struct Tenant<S, F> {
    inner: S,
    extract: Arc<F>,
}

impl<S: Clone, F> Clone for Tenant<S, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            extract: self.extract.clone(),
        }
    }
}

impl<S, F> std::fmt::Debug for Tenant<S, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant").finish_non_exhaustive()
    }
}

impl<S, F> Service<Request<Body>> for Tenant<S, F>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>,
    S::Future: Send + 'static,
    F: Fn(&http::request::Parts) -> Option<TenantId> + Send + Sync + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        match (self.extract)(&parts) {
            Some(tenant) => {
                parts.extensions.insert(tenant);
                Box::pin(self.inner.call(Request::from_parts(parts, body)))
            }
            None => Box::pin(std::future::ready(Ok(unauthenticated()))),
        }
    }
}

/// The refusal of a request without a tenant: 401 (RFC 9110 §15.5.2) with a problem body.
fn unauthenticated() -> Response {
    let mut res = Problem::new(
        StatusCode::UNAUTHORIZED,
        kind::UNAUTHENTICATED,
        "Authentication required",
    )
    .detail("the request carries no credential this service knows")
    .into_response();
    res.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    res
}
