//! An idempotency gateway in front of any HTTP service (issue 30): the guarantees of
//! oncely's HTTP layer for a service written in any language, without changing it.
//!
//! Each idempotent route (`POST /orders`, `PATCH /orders/{id}`) goes through
//! authentication ([`Authentication`]: bearer API keys, or a tenant header set by a
//! trusted proxy) and oncely-http's idempotency layer in multi-phase mode: the key is
//! parsed, the body bounded (413) and fingerprinted, the key reserved under a lease in the
//! SQL store (SQLite, PostgreSQL, MariaDB/MySQL; any number of gateway instances on one
//! database), and the request forwarded **once** with its `Idempotency-Key`. The answer is
//! stored and replayed byte for byte with an allow-list of headers (never `Set-Cookie`) and
//! `Idempotent-Replayed: true`. A changed body under a key is 422 naming what differs; a
//! second request while the first is in flight is 409 with `Retry-After`.
//!
//! Per route, the fingerprint may cover only some JSON pointers of the body and some
//! request headers' values (`fingerprint_body`, `fingerprint_headers`: oncely-http's
//! [`FingerprintParts`](oncely_core::FingerprintParts)), and the operation's key may be a
//! business key read from the body (`business_key`: [`KeySource::Body`](oncely_http::KeySource)),
//! with which the `Idempotency-Key` header identifies nothing and is optional.
//!
//! | upstream | gateway |
//! |---|---|
//! | 1xx–4xx answer | stored and replayed |
//! | 5xx (not 504) | per route ([`On5xx`]): key freed (default), stored, or unknown |
//! | 504 | unknown (stored under [`On5xx::Store`]) |
//! | connect refused / connect timeout | 502 `upstream-unreachable`; nothing was sent, key freed |
//! | timeout or reset after the request was sent | 503 `upstream-outcome-unknown` + status link; the operation is `unknown` |
//! | retry of an unknown operation, route with a probe | the probe's object, stored and replayed (`Oncely-Resolved-By: probe`; one over the stored bound goes whole to that retry, later ones get 409 `response-not-replayable`); or, absent past the settle time, one new forward |
//! | retry of an unknown operation, no probe | 409 `outcome-unknown` + status link, until an operator resolves it |
//!
//! Every other request passes through untouched (streamed both ways).
//!
//! # Layout
//! - `config` — [`GatewayConfig`], [`RouteConfig`], [`ProbeConfig`], [`KeyPolicy`],
//!   [`On5xx`]: flags and the TOML file.
//! - `forward` — [`Upstream`]: the guarded forward and its classification, the
//!   pass-through; the problem kinds the gateway adds ([`kind`]).
//! - `metrics` — the gateway's metric names and [`with_metrics`] (`/_oncely/metrics`).
//! - `probe` — the status probe, an [`oncely_http::Resolver`].
//! - `app` — [`router`], the status resource, health, and [`serve`] with the retention
//!   sweeps.

mod app;
mod config;
mod forward;
pub mod metrics;
mod probe;
mod template;

use http::HeaderName;
use oncely_core::TenantId;
use oncely_http::{bearer, ApiKeys};

pub use app::{router, serve, status_link};
pub use config::{ConfigError, GatewayConfig, KeyPolicy, On5xx, ProbeConfig, RouteConfig};
pub use forward::{kind, Upstream, TENANT_HEADER};
pub use metrics::with_metrics;
pub use probe::RESOLVED_BY;

/// How the gateway learns a request's tenant, which scopes every key.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Authentication {
    /// `Authorization: Bearer <api key>`, each key naming its tenant (`ONCELY_API_KEYS`,
    /// as `orders serve` reads it: [`oncely_http::parse_api_keys`]).
    ApiKeys(ApiKeys),
    /// A tenant header set by an authentication proxy in front of the gateway; see
    /// [`TrustedHeader`].
    TrustedHeader(TrustedHeader),
}

/// The tenant from a header an authentication proxy in front sets (`X-Tenant: acme`).
///
/// **How trust is established:** the proxy also sends `Authorization: Bearer <secret>`, a
/// shared secret only it and the gateway know (at least 16 characters). A request without
/// that exact secret is refused with 401, whatever tenant header it carries, so a client
/// that reaches the gateway directly cannot name a tenant. The secret is compared in
/// constant time ([`ApiKeys`]).
#[derive(Debug, Clone)]
pub struct TrustedHeader {
    header: HeaderName,
    secret: ApiKeys,
}

impl TrustedHeader {
    /// Trusts `header` on requests carrying `Authorization: Bearer <secret>`.
    pub fn new(header: HeaderName, secret: &str) -> Self {
        let marker = TenantId::parse("trusted-proxy").expect("a valid tenant id");
        Self {
            header,
            secret: ApiKeys::new([(secret.to_owned(), marker)]),
        }
    }

    fn tenant(&self, parts: &http::request::Parts) -> Option<TenantId> {
        let token = bearer(parts.headers.get(http::header::AUTHORIZATION)?)?;
        self.secret.tenant_of(token)?;
        let mut values = parts.headers.get_all(&self.header).iter();
        match (values.next(), values.next()) {
            (Some(v), None) => TenantId::parse(v.to_str().ok()?).ok(),
            _ => None,
        }
    }
}
