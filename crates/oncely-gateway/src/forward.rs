//! The upstream client: a guarded request forwarded once and its answer classified (sent
//! or not, final or unknown), and every other request passed through untouched.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use oncely_http::{MultiPhase, NotStored, OperationContext, Problem, StoreServerError};

use crate::config::On5xx;

/// The header that tells the upstream which tenant the gateway authenticated; a client's
/// own value is always removed.
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("oncely-tenant");

/// `Idempotency-Key`, passed on to the upstream (set from the business key when the client
/// sent none).
pub(crate) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The problem kinds the gateway adds to oncely-http's (`urn:oncely:problem:<kind>`).
pub mod kind {
    /// 502 + `Retry-After`: the upstream could not be connected to; nothing was sent and
    /// the key is free for the same retry.
    pub const UPSTREAM_UNREACHABLE: &str = "upstream-unreachable";
    /// 503 + `Retry-After` + status link: the request was sent and no full answer came
    /// (a timeout, a reset); the operation is `unknown` and is not forwarded again
    /// blindly.
    pub const UPSTREAM_OUTCOME_UNKNOWN: &str = "upstream-outcome-unknown";
    /// 404: no operation with this key for the caller on this route.
    pub const OPERATION_NOT_FOUND: &str = "operation-not-found";
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and `Host`, never forwarded in either direction.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP
        .iter()
        .any(|h| name.as_str().eq_ignore_ascii_case(h))
}

/// The end-to-end headers of `headers` (hop-by-hop ones and the tenant header dropped).
fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if !is_hop_by_hop(name) && *name != TENANT_HEADER {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// The service behind the gateway: its base URL and one pooled HTTP client.
#[derive(Debug, Clone)]
pub struct Upstream {
    base: String,
    client: reqwest::Client,
}

/// How a guarded forward ended, for the route's answer.
enum Forwarded {
    /// An answer: whole within the route's bound, else its head read and the rest
    /// streaming.
    Answer(reqwest::StatusCode, HeaderMap, Body),
    /// Nothing was sent (the connect failed).
    NotSent(String),
    /// Sent; no whole answer (timeout, reset, a body cut off).
    Unknown(String),
}

impl Upstream {
    /// A client of `base` (`http://host:port[/prefix]`): no redirects followed, no proxy
    /// from the environment, connects bounded by `connect_timeout`.
    ///
    /// # Errors
    /// The client cannot be built (a TLS backend that fails to initialise).
    pub fn new(base: &str, connect_timeout: Duration) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(connect_timeout)
            .build()?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            client,
        })
    }

    /// The upstream URL of `path_and_query` (`/orders?x=1`).
    pub fn url(&self, path_and_query: &str) -> String {
        format!("{}{path_and_query}", self.base)
    }

    /// The client, for probes.
    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Forwards `req` as it came (headers end to end, body streamed) and streams the
    /// answer back: the path of every request that is not on an idempotent route. 502
    /// when the upstream cannot be reached or fails mid-request.
    pub async fn pass_through(&self, req: Request<Body>) -> Response {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let sent = self
            .client
            .request(parts.method.clone(), self.url(path))
            .headers(end_to_end(&parts.headers))
            .body(reqwest::Body::wrap_stream(body.into_data_stream()))
            .send()
            .await;
        match sent {
            Ok(res) => {
                let mut out = Response::builder().status(res.status());
                if let Some(h) = out.headers_mut() {
                    *h = end_to_end(res.headers());
                }
                out.body(Body::from_stream(res.bytes_stream()))
                    .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
            }
            Err(e) => Problem::new(
                StatusCode::BAD_GATEWAY,
                kind::UPSTREAM_UNREACHABLE,
                "The upstream service could not be reached",
            )
            .detail(error_chain(&e))
            .into_response(),
        }
    }

    /// Sends a guarded request once, bounded by `timeout` until its answer is read in
    /// full (read whole up to `max_answer` bytes; past that, streamed on to the caller).
    async fn send_once(
        &self,
        parts: &http::request::Parts,
        body: Bytes,
        timeout: Duration,
        max_answer: usize,
    ) -> Forwarded {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut headers = end_to_end(&parts.headers);
        if let Some(context) = parts.extensions.get::<OperationContext>() {
            if let Ok(v) = HeaderValue::try_from(context.scope.tenant.as_str()) {
                headers.insert(TENANT_HEADER, v);
            }
            // A business-key route: the client may send no header; the upstream still
            // gets the operation's key. A client's own header is passed on as it came.
            if !headers.contains_key(&IDEMPOTENCY_KEY) {
                if let Ok(v) = HeaderValue::try_from(context.key.as_str()) {
                    headers.insert(IDEMPOTENCY_KEY, v);
                }
            }
        }
        let sent = self
            .client
            .request(parts.method.clone(), self.url(path))
            .headers(headers)
            .body(body)
            .timeout(timeout)
            .send()
            .await;
        let mut res = match sent {
            Ok(res) => res,
            // A connect error (refused, unreachable, timed out connecting) is raised
            // before any byte of the request is written.
            Err(e) if e.is_connect() => return Forwarded::NotSent(error_chain(&e)),
            Err(e) => return Forwarded::Unknown(error_chain(&e)),
        };
        let (status, headers) = (res.status(), end_to_end(res.headers()));
        let mut body = Vec::new();
        loop {
            match res.chunk().await {
                Ok(Some(chunk)) => {
                    body.extend_from_slice(&chunk);
                    if body.len() > max_answer {
                        // Too large to store: the layer keeps a `response-not-replayable`
                        // answer and streams this one, whole, to the first caller.
                        let head = futures_util::stream::once(async move {
                            Ok::<_, reqwest::Error>(Bytes::from(body))
                        });
                        let rest = futures_util::StreamExt::chain(head, res.bytes_stream());
                        return Forwarded::Answer(status, headers, Body::from_stream(rest));
                    }
                }
                Ok(None) => break,
                Err(e) => return Forwarded::Unknown(error_chain(&e)),
            }
        }
        Forwarded::Answer(status, headers, Body::from(body))
    }

    /// The answer of a guarded route to `req` (the layer has reserved its key): forwards
    /// it once with its `Idempotency-Key` and the tenant header, and marks the answer so
    /// the layer stores it (1xx–4xx), frees the key ([`NotStored`]: nothing was sent, or a
    /// 5xx under [`On5xx::Release`]), stores a 5xx ([`StoreServerError`]) or turns the
    /// operation `unknown` (no mark on a 5xx: sent, no answer; a 504).
    pub(crate) async fn forward_guarded(
        &self,
        req: Request<Body>,
        options: &Forwarding,
    ) -> Response {
        let (parts, body) = req.into_parts();
        // The layer has already read the body within its bound; this only takes it back.
        let body = axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap_or_default();
        let key = parts
            .extensions
            .get::<OperationContext>()
            .map(|c| c.key.clone());
        let started = std::time::Instant::now();
        let sent = self
            .send_once(&parts, body, options.timeout, options.max_answer)
            .await;
        let (outcome, status) = match &sent {
            Forwarded::Answer(status, ..) => ("answered", status.as_str().to_owned()),
            Forwarded::NotSent(_) => ("not_sent", "-".to_owned()),
            Forwarded::Unknown(_) => ("unknown", "-".to_owned()),
        };
        crate::metrics::forwarded(
            &options.route,
            outcome,
            status,
            started.elapsed().as_secs_f64(),
        );
        match sent {
            Forwarded::Answer(status, headers, body) => {
                let mut res = Response::new(body);
                *res.status_mut() = status;
                *res.headers_mut() = headers;
                if status.is_server_error() {
                    match (options.on_5xx, status) {
                        (On5xx::Store, _) => {
                            res.extensions_mut().insert(StoreServerError);
                        }
                        (On5xx::Release, s) if s != StatusCode::GATEWAY_TIMEOUT => {
                            res.extensions_mut().insert(NotStored);
                        }
                        _ => {}
                    }
                }
                res
            }
            Forwarded::NotSent(why) => {
                tracing::warn!(error = %why, "upstream unreachable; nothing sent, key freed");
                let mut res = Problem::new(
                    StatusCode::BAD_GATEWAY,
                    kind::UPSTREAM_UNREACHABLE,
                    "The upstream service could not be reached",
                )
                .detail("nothing was sent; retry with the same key")
                .retry_after(1)
                .into_response();
                res.extensions_mut().insert(NotStored);
                res
            }
            Forwarded::Unknown(why) => {
                tracing::warn!(error = %why, "request sent, no whole answer; outcome unknown");
                let problem = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    kind::UPSTREAM_OUTCOME_UNKNOWN,
                    "The upstream took the request and did not answer",
                )
                .detail("the operation may or may not have taken effect; it will not be forwarded again blindly — retry with the same key, or query its status resource")
                .retry_after(1);
                match key {
                    Some(key) => options.mode.with_status_link(&key, problem),
                    None => problem.into_response(),
                }
            }
        }
    }
}

/// The per-route settings of a guarded forward.
#[derive(Debug, Clone)]
pub(crate) struct Forwarding {
    /// The route's name (`POST /orders`), the metrics' `route` label.
    pub(crate) route: String,
    pub(crate) timeout: Duration,
    pub(crate) max_answer: usize,
    pub(crate) on_5xx: On5xx,
    /// The route's mode, for the status link.
    pub(crate) mode: MultiPhase,
}

/// An error and its causes, `: `-joined (reqwest's own message omits the cause).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
