//! The status probe of a route: an upstream `GET` built from the key or the body's fields,
//! run by the multi-phase layer on an operation whose outcome is unknown (an
//! [`oncely_http::Resolver`]).

use std::fmt;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use futures_util::future::BoxFuture;
use http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use oncely_core::now_ms;
use oncely_http::{Resolution, ResolveQuery, Resolver};
use serde_json::Value;

use crate::config::ProbeConfig;
use crate::forward::{error_chain, Upstream, TENANT_HEADER};
use crate::template::Template;

/// The header on an outcome the probe found (stored and replayed with it):
/// `Oncely-Resolved-By: probe`.
pub const RESOLVED_BY: HeaderName = HeaderName::from_static("oncely-resolved-by");

/// A route's probe: asks the upstream whether an unknown operation took effect.
///
/// - 2xx with the object (at `select`, when set) → [`Resolution::Found`]: the object,
///   stored and replayed with `found_status`, `Oncely-Resolved-By: probe` and
///   `Content-Location` naming the probe's URL;
/// - 404, 410, or a 2xx without the object (nothing at `select`, or `null`) → absent:
///   [`Resolution::Absent`] once the operation has been unknown for `settle_ms`, else
///   [`Resolution::Unknown`] (an upstream that commits late must not be sent it twice);
/// - anything else, or no answer → [`Resolution::Unknown`].
pub(crate) struct Probe {
    pub(crate) upstream: Upstream,
    pub(crate) config: ProbeConfig,
    pub(crate) template: Template,
    pub(crate) timeout: Duration,
}

impl fmt::Debug for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Probe")
            .field("url", &self.config.url)
            .finish_non_exhaustive()
    }
}

impl Resolver for Probe {
    fn resolve<'a>(&'a self, query: ResolveQuery<'a>) -> BoxFuture<'a, Resolution> {
        Box::pin(self.run(query))
    }
}

/// What the probe's answer says.
enum Seen {
    Object(StatusCode, Option<HeaderValue>, Vec<u8>),
    Absent,
}

impl Probe {
    async fn run(&self, query: ResolveQuery<'_>) -> Resolution {
        let path = match self.template.render(query.context.key.as_str(), query.body) {
            Ok(path) => path,
            Err(why) => return Resolution::Unknown(format!("the probe cannot be built: {why}")),
        };
        let seen = match self.ask(&path, &query).await {
            Ok(seen) => seen,
            Err(why) => return Resolution::Unknown(why),
        };
        match seen {
            Seen::Object(status, content_type, body) => {
                Resolution::Found(self.found(status, content_type, body, &path))
            }
            Seen::Absent => {
                let since = query.record.lease_until.unwrap_or(query.record.created_at);
                let settled_at = since.saturating_add(self.config.settle_ms as i64);
                if now_ms() < settled_at {
                    Resolution::Unknown(format!(
                        "the probe found nothing yet; an absence is trusted {} ms after the operation turned unknown",
                        self.config.settle_ms
                    ))
                } else {
                    Resolution::Absent
                }
            }
        }
    }

    /// Sends the probe with the retry's credentials and the tenant header.
    async fn ask(&self, path: &str, query: &ResolveQuery<'_>) -> Result<Seen, String> {
        let mut headers = HeaderMap::new();
        for name in [header::AUTHORIZATION, header::ACCEPT] {
            if let Some(v) = query.request.headers.get(&name) {
                headers.insert(name, v.clone());
            }
        }
        if let Ok(v) = HeaderValue::try_from(query.context.scope.tenant.as_str()) {
            headers.insert(TENANT_HEADER, v);
        }
        let res = self
            .upstream
            .client()
            .get(self.upstream.url(path))
            .headers(headers)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| format!("the probe failed: {}", error_chain(&e)))?;
        let status = res.status();
        let content_type = res.headers().get(header::CONTENT_TYPE).cloned();
        let body = res
            .bytes()
            .await
            .map_err(|e| format!("the probe's answer failed: {}", error_chain(&e)))?;
        if status == StatusCode::NOT_FOUND || status == StatusCode::GONE {
            return Ok(Seen::Absent);
        }
        if !status.is_success() {
            return Err(format!("the probe answered {status}"));
        }
        let Some(select) = &self.config.select else {
            return Ok(Seen::Object(status, content_type, body.to_vec()));
        };
        let json: Value = serde_json::from_slice(&body)
            .map_err(|_| "the probe's answer is not JSON".to_owned())?;
        match json.pointer(select) {
            None | Some(Value::Null) => Ok(Seen::Absent),
            Some(object) => Ok(Seen::Object(
                status,
                Some(HeaderValue::from_static("application/json")),
                serde_json::to_vec(object).unwrap_or_default(),
            )),
        }
    }

    /// The stored outcome of a found object.
    fn found(
        &self,
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Vec<u8>,
        path: &str,
    ) -> Response {
        let mut res = Response::new(Body::from(body));
        *res.status_mut() = self
            .config
            .found_status
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(status);
        let headers = res.headers_mut();
        if let Some(ct) = content_type {
            headers.insert(header::CONTENT_TYPE, ct);
        }
        headers.insert(RESOLVED_BY, HeaderValue::from_static("probe"));
        if let Ok(v) = HeaderValue::try_from(path) {
            headers.insert(header::CONTENT_LOCATION, v);
        }
        res
    }
}
