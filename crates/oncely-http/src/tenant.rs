//! Tenant extraction: the [`TenantId`] the idempotency layer scopes every key by.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use oncely_core::TenantId;
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use crate::problem::kind;
use crate::Problem;

/// How a [`TenantLayer`] finds a request's tenant in its head, and how it refuses a request
/// without one.
///
/// Any `Fn(&http::request::Parts) -> Option<TenantId>` is one (refusing with the default
/// 401); [`ApiKeys`] is one for bearer API keys.
pub trait TenantExtractor: Send + Sync + 'static {
    /// The tenant `parts` authenticate as; `None` refuses the request.
    fn tenant(&self, parts: &http::request::Parts) -> Option<TenantId>;

    /// The answer to a request without a tenant: by default 401 (RFC 9110 §15.5.2) with an
    /// `unauthenticated` problem body and `WWW-Authenticate: Bearer`.
    fn refusal(&self) -> Response {
        unauthenticated(
            "Authentication required",
            "the request carries no credential this service knows",
        )
    }
}

impl<F> TenantExtractor for F
where
    F: Fn(&http::request::Parts) -> Option<TenantId> + Send + Sync + 'static,
{
    fn tenant(&self, parts: &http::request::Parts) -> Option<TenantId> {
        self(parts)
    }
}

/// Puts the request's [`TenantId`] into its extensions, where
/// [`IdempotencyLayer`](crate::IdempotencyLayer) reads it, using a [`TenantExtractor`] the
/// service supplies — a function of the request head (typically "which tenant does this
/// credential belong to") or [`ApiKeys`]. When it answers `None` the request is refused
/// ([`TenantExtractor::refusal`]: by default a 401 problem,
/// `urn:oncely:problem:unauthenticated`, RFC 9457) and the inner service is not called.
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
///
/// With bearer API keys, each naming its tenant:
///
/// ```
/// use oncely_core::TenantId;
/// use oncely_http::{ApiKeys, TenantLayer};
///
/// let keys = ApiKeys::new([("key-of-acme-0123456789".to_owned(), TenantId::parse("acme").unwrap())]);
/// let layer = TenantLayer::new(keys);
/// # let _ = layer;
/// ```
pub struct TenantLayer<F> {
    extract: Arc<F>,
}

impl<F: TenantExtractor> TenantLayer<F> {
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
    F: TenantExtractor,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        match self.extract.tenant(&parts) {
            Some(tenant) => {
                parts.extensions.insert(tenant.clone());
                let answer = self.inner.call(Request::from_parts(parts, body));
                Box::pin(async move {
                    let mut res = answer.await?;
                    // For the layers outside (the request log): who was answered.
                    res.extensions_mut().insert(tenant);
                    Ok(res)
                })
            }
            None => Box::pin(std::future::ready(Ok(self.extract.refusal()))),
        }
    }
}

/// The refusal of a request without a tenant: 401 (RFC 9110 §15.5.2) with an
/// `unauthenticated` problem body titled `title`, and `WWW-Authenticate: Bearer`.
fn unauthenticated(title: &str, detail: &str) -> Response {
    let mut res = Problem::new(StatusCode::UNAUTHORIZED, kind::UNAUTHENTICATED, title)
        .detail(detail)
        .into_response();
    res.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    res
}

/// Bearer API keys (RFC 6750 §2.1, `Authorization: Bearer <key>`), each naming the tenant
/// it authenticates: a [`TenantExtractor`] for [`TenantLayer`].
///
/// A request authenticates when it carries exactly one `Authorization` header (with two,
/// which credential counts is ambiguous), its scheme is `Bearer` (any case) and its token
/// is one of the keys. Keys are kept as their SHA-256 digests and a token is compared with
/// every one of them in constant time, so the answer's timing says nothing about how much
/// of a key a guess got right. A request without a known key gets 401 `unauthenticated`
/// ("A valid API key is required") with `WWW-Authenticate: Bearer`. Cloning is cheap (the
/// keys are shared); `Debug` shows how many keys there are, never a key.
#[derive(Clone)]
pub struct ApiKeys {
    /// (SHA-256 of the key, its tenant).
    keys: Arc<[([u8; 32], TenantId)]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys")
            .field("len", &self.keys.len())
            .finish_non_exhaustive()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// The keys `keys`, each `(key, tenant)`.
    pub fn new(keys: impl IntoIterator<Item = (String, TenantId)>) -> Self {
        Self {
            keys: keys.into_iter().map(|(k, t)| (digest(&k), t)).collect(),
        }
    }

    /// The tenant of API key `key`, `None` when it is not one of the keys. Compares `key`'s
    /// digest with every key's, each in constant time, without stopping at a match.
    pub fn tenant_of(&self, key: &str) -> Option<TenantId> {
        let candidate = digest(key);
        let mut found = None;
        for (d, tenant) in self.keys.iter() {
            let diff = d
                .iter()
                .zip(candidate.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if std::hint::black_box(diff) == 0 {
                found = Some(tenant);
            }
        }
        found.cloned()
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// `true` when there are no keys (every request is refused).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// A malformed API key list ([`parse_api_keys`]). Key values never appear in it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiKeysError {
    /// An entry is not `api-key=tenant`.
    #[error("API key entry {0} is not of the form <api-key>=<tenant>")]
    ApiKeyEntry(usize),
    /// An API key shorter than 16 characters.
    #[error("API key entry {0} is shorter than 16 characters")]
    ApiKeyTooShort(usize),
    /// Two entries with the same API key: which tenant it authenticates would be whichever
    /// came last. The key itself is not shown.
    #[error("API key entry {1} repeats the API key of entry {0}; each key must name one tenant")]
    DuplicateApiKey(usize, usize),
    /// A tenant id that does not validate.
    #[error("API key entry {0}: {1}")]
    Tenant(usize, #[source] oncely_core::TenantError),
}

/// Parses the `ONCELY_API_KEYS` form `key1=tenant-a,key2=tenant-b` (entries separated by
/// commas, whitespace trimmed, empty entries skipped) into `(key, tenant)` pairs in entry
/// order, for [`ApiKeys::new`]. The one reader of that form (`orders serve`,
/// `oncely gateway`). Entries are numbered from 1 in errors.
///
/// # Errors
/// [`ApiKeysError`] for an entry without `=`, a key shorter than 16 characters, a key that
/// appears twice or an invalid tenant id.
pub fn parse_api_keys(s: &str) -> Result<Vec<(String, TenantId)>, ApiKeysError> {
    let mut keys: Vec<(String, TenantId)> = Vec::new();
    for (i, entry) in s
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .enumerate()
    {
        let n = i + 1;
        let (key, tenant) = entry.split_once('=').ok_or(ApiKeysError::ApiKeyEntry(n))?;
        let key = key.trim();
        if key.len() < 16 {
            return Err(ApiKeysError::ApiKeyTooShort(n));
        }
        let tenant = TenantId::parse(tenant.trim()).map_err(|e| ApiKeysError::Tenant(n, e))?;
        if let Some(first) = keys.iter().position(|(k, _)| k == key) {
            return Err(ApiKeysError::DuplicateApiKey(first + 1, n));
        }
        keys.push((key.to_owned(), tenant));
    }
    Ok(keys)
}

/// The token of an `Authorization: Bearer <token>` header value (scheme in any case,
/// token trimmed); `None` for another scheme or a value that is not visible ASCII.
pub fn bearer(value: &HeaderValue) -> Option<&str> {
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The bearer token of `headers` when they carry exactly one `Authorization` header.
fn only_bearer(headers: &HeaderMap) -> Option<&str> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => bearer(v),
        _ => None,
    }
}

impl TenantExtractor for ApiKeys {
    fn tenant(&self, parts: &http::request::Parts) -> Option<TenantId> {
        self.tenant_of(only_bearer(&parts.headers)?)
    }

    fn refusal(&self) -> Response {
        unauthenticated(
            "A valid API key is required",
            "send Authorization: Bearer <api key>",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(auth: &[&str]) -> http::request::Parts {
        let mut b = Request::builder();
        for a in auth {
            b = b.header(header::AUTHORIZATION, *a);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn api_keys_name_their_tenant_only_for_one_bearer_header() {
        let acme = TenantId::parse("acme").unwrap();
        let keys = ApiKeys::new([("key-of-acme-0123456789".to_owned(), acme.clone())]);
        assert_eq!(keys.tenant_of("key-of-acme-0123456789"), Some(acme.clone()));
        assert_eq!(keys.tenant_of("key-of-acme-012345678"), None);
        assert_eq!(
            keys.tenant(&parts(&["bearer  key-of-acme-0123456789 "])),
            Some(acme)
        );
        assert_eq!(keys.tenant(&parts(&["Basic key-of-acme-0123456789"])), None);
        let twice = "Bearer key-of-acme-0123456789";
        assert_eq!(keys.tenant(&parts(&[twice, twice])), None, "two headers");
        assert_eq!(keys.tenant(&parts(&[])), None);
        assert!(!format!("{keys:?}").contains("acme"));
        assert_eq!(keys.refusal().status(), StatusCode::UNAUTHORIZED);
    }
}
