//! The payments simulator: a Stripe API v1 subset.

mod params;
mod search;
mod store;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Path, RawQuery, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde::Serialize;
use serde_json::json;

use crate::faults::{FaultConfig, FaultKind, Faults, Outcome};
use params::{Answer, ApiError, EffectRequest, NewIntent, NewRefund, Params};
use store::{page, Cursor, Lookup, Store};

pub use store::RequestCounts;

/// Largest form body accepted, in bytes.
const MAX_BODY: usize = 256 * 1024;

/// Settings of the payments simulator.
#[derive(Debug, Clone)]
pub struct PaymentsConfig {
    /// Secret keys accepted as `Authorization: Bearer <key>` or as the user of HTTP Basic
    /// (Stripe's two forms). All see the same objects; each key is its own
    /// `Idempotency-Key` scope. Default: `["sk_test_oncely_sim"]`.
    pub secret_keys: Vec<String>,
    /// How long after its creation a PaymentIntent becomes visible to
    /// `GET /v1/payment_intents/search` (Stripe: "under 1 minute" normally). Default 1 s.
    pub search_lag: Duration,
    /// Fault injection on `POST /v1/payment_intents` and `POST /v1/refunds`.
    pub faults: FaultConfig,
}

impl Default for PaymentsConfig {
    fn default() -> Self {
        Self {
            secret_keys: vec!["sk_test_oncely_sim".into()],
            search_lag: Duration::from_secs(1),
            faults: FaultConfig::default(),
        }
    }
}

/// Objects per value of one metadata key, in [`PaymentsStats`].
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct MetadataCount {
    /// PaymentIntents with this value, any status.
    pub total: u64,
    /// Of those, `succeeded` ones.
    pub succeeded: u64,
}

/// Counts at the provider (`GET /_sim/stats`), so tests can count what was really created.
#[derive(Debug, Default, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub struct PaymentsStats {
    /// PaymentIntents created.
    pub payment_intents: u64,
    /// PaymentIntents per `status`.
    pub payment_intents_by_status: BTreeMap<String, u64>,
    /// PaymentIntents per metadata key, then per value:
    /// `payment_intents_by_metadata["invoice_id"]["inv-1"]`.
    pub payment_intents_by_metadata: BTreeMap<String, BTreeMap<String, MetadataCount>>,
    /// Refunds created.
    pub refunds: u64,
    /// Sum of all refunds, in the smallest currency unit.
    pub refunded_amount: u64,
    /// Refunds per PaymentIntent id.
    pub refunds_by_payment_intent: BTreeMap<String, u64>,
    /// Effect requests: executed, replayed, refused as idempotency errors.
    pub requests: RequestCounts,
    /// Faults injected so far, per kind.
    pub faults_injected: BTreeMap<FaultKind, u64>,
}

/// The payments simulator: state in memory (one `Mutex` over the account's maps — short
/// critical sections, never held across an await), shared by every clone.
///
/// Routes (Stripe API v1): `POST /v1/payment_intents`, `GET /v1/payment_intents`,
/// `GET /v1/payment_intents/search`, `GET /v1/payment_intents/{id}`, `POST /v1/refunds`,
/// `GET /v1/refunds`, `GET /v1/refunds/{id}`, `GET /v1/charges/{id}`; and, without
/// authentication and for tests only, `GET /_sim/stats`, `GET`/`POST /_sim/faults`,
/// `POST /_sim/faults/next`.
#[derive(Debug, Clone)]
pub struct PaymentsSim {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    secret_keys: Vec<String>,
    search_lag: Duration,
    faults: Faults,
    store: Mutex<Store>,
    requests: AtomicU64,
}

impl PaymentsSim {
    /// A simulator with an empty account.
    pub fn new(config: PaymentsConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                secret_keys: config.secret_keys,
                search_lag: config.search_lag,
                faults: Faults::new(config.faults),
                store: Mutex::new(Store::new()),
                requests: AtomicU64::new(0),
            }),
        }
    }

    /// The simulator's routes; serve them with [`crate::serve`] (for a real `drop_after`).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/payment_intents", post(create_intent).get(list_intents))
            .route("/v1/payment_intents/search", get(search_intents))
            .route(
                "/v1/payment_intents/{id}",
                get(get_by_id("payment_intent", |s, id| {
                    s.intent(id).map(serde_json::to_value)
                })),
            )
            .route("/v1/refunds", post(create_refund).get(list_refunds))
            .route(
                "/v1/refunds/{id}",
                get(get_by_id("refund", |s, id| {
                    s.refund(id).map(serde_json::to_value)
                })),
            )
            .route(
                "/v1/charges/{id}",
                get(get_by_id("charge", |s, id| {
                    s.charge(id).map(serde_json::to_value)
                })),
            )
            .route("/_sim/stats", get(stats))
            .fallback(unknown_url)
            .with_state(self.inner.clone())
            .merge(self.inner.faults.router())
    }

    /// Counts at the provider.
    pub fn stats(&self) -> PaymentsStats {
        self.inner.stats()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stats(&self) -> PaymentsStats {
        let mut stats = self.lock().stats();
        stats.faults_injected = self.faults.injected();
        stats
    }

    fn request_id(&self) -> String {
        format!(
            "req_sim{:012}",
            self.requests.fetch_add(1, Ordering::Relaxed) + 1
        )
    }

    /// The secret key of the request, or Stripe's 401.
    fn authenticate(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let unauthorized =
            |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", m);
        let Some(value) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return Err(unauthorized(
                "You did not provide an API key. You need to provide your API key in the Authorization header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').",
            ));
        };
        let key = if let Some(token) = value.strip_prefix("Bearer ") {
            token.trim().to_owned()
        } else if let Some(basic) = value.strip_prefix("Basic ") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(basic.trim())
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .unwrap_or_default();
            decoded.split(':').next().unwrap_or_default().to_owned()
        } else {
            String::new()
        };
        if self.secret_keys.contains(&key) {
            Ok(key)
        } else {
            let tail: String = key
                .chars()
                .rev()
                .take(4)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            Err(unauthorized(&format!(
                "Invalid API Key provided: sk_****{tail}"
            )))
        }
    }

    /// The answer to send, with Stripe's headers.
    fn respond(&self, answer: &Answer, key: Option<&str>, replay_of: Option<&str>) -> Response {
        let mut res = (answer.status, answer.body.clone()).into_response();
        let h = res.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Ok(v) = HeaderValue::from_str(&self.request_id()) {
            h.insert("request-id", v);
        }
        if let Some(v) = key.and_then(|k| HeaderValue::from_str(k).ok()) {
            h.insert("idempotency-key", v);
        }
        if let Some(original) = replay_of.and_then(|r| HeaderValue::from_str(r).ok()) {
            h.insert("idempotent-replayed", HeaderValue::from_static("true"));
            h.insert("original-request", original);
        }
        res
    }
}

/// What one effect request came to, under the account's lock.
#[derive(Debug)]
enum Executed {
    /// The effect ran (or an `error_before` fault stood in for it): the answer, and the
    /// after-effect faults still to apply.
    Ran(Answer, Outcome),
    /// The stored answer under the key, and the id of the request that stored it.
    Replay(Answer, String),
    /// The key was first used with other parameters or on another endpoint.
    Mismatch(ApiError),
}

impl Inner {
    /// Looks the key up, runs the effect with the effect faults and stores the answer under
    /// the key — one critical section, so two requests with one key run the effect once.
    fn execute(
        &self,
        scope: &str,
        key: Option<&str>,
        path: &'static str,
        params: &Params,
        request: EffectRequest,
    ) -> Executed {
        let mut store = self.lock();
        if let Some(k) = key {
            match store.lookup(scope, k, path, params) {
                Lookup::New => {}
                Lookup::Replay(stored) => {
                    let replay = Executed::Replay(stored.answer.clone(), stored.request_id.clone());
                    store.counts.replayed += 1;
                    return replay;
                }
                Lookup::Mismatch => {
                    store.counts.idempotency_errors += 1;
                    return Executed::Mismatch(ApiError::new(StatusCode::BAD_REQUEST, "idempotency_error", format!(
                        "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '{k}' if you meant to execute a different request."
                    )));
                }
            }
        }
        store.counts.executed += 1;
        let outcome = self.faults.on_effect();
        let mut answer = if outcome.error_before {
            ApiError::api().answer()
        } else {
            match request {
                EffectRequest::Intent(new) => store.create_intent(new),
                EffectRequest::Refund(new) => store.create_refund(new),
            }
        };
        if outcome.error_after {
            answer = ApiError::api().status(outcome.error_status).answer();
        }
        if let Some(k) = key {
            store.remember(scope, k, path, params, answer.clone(), self.request_id());
        }
        Executed::Ran(answer, outcome)
    }

    /// Stripe's 429 with `Retry-After`.
    fn rate_limited(&self, secs: u32) -> Response {
        let e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "invalid_request_error",
            "Request rate limit exceeded. Learn more about rate limits here https://stripe.com/docs/rate-limits.",
        )
        .code("rate_limit");
        let mut res = self.respond(&e.answer(), None, None);
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        res
    }
}

/// `Idempotency-Key`: up to 255 characters (Stripe); `Ok(None)` when absent.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    match v.to_str() {
        Ok(k) if !k.is_empty() && k.len() <= 255 => Ok(Some(k.to_owned())),
        _ => Err(ApiError::invalid(
            "Keys for idempotent requests can only be 255 characters long and must be visible ASCII.",
        )
        .param("Idempotency-Key")),
    }
}

async fn create_intent(State(sim): State<Arc<Inner>>, req: Request) -> Response {
    effect(&sim, req, "/v1/payment_intents").await
}

async fn create_refund(State(sim): State<Arc<Inner>>, req: Request) -> Response {
    effect(&sim, req, "/v1/refunds").await
}

/// One effect request, in Stripe v1's order: authentication, rate limiter, validation (not
/// stored), idempotency lookup (replay or `idempotency_error`), execution, the answer
/// stored under the key — a fault's 500 included — then the after-effect faults.
async fn effect(sim: &Inner, req: Request, path: &'static str) -> Response {
    let (parts, body) = req.into_parts();
    let scope = match sim.authenticate(&parts.headers) {
        Ok(s) => s,
        Err(e) => return sim.respond(&e.answer(), None, None),
    };
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return sim.respond(
            &ApiError::invalid("The request body could not be read.").answer(),
            None,
            None,
        );
    };
    if let Some(secs) = sim.faults.on_arrival().await {
        return sim.rate_limited(secs);
    }
    let params = Params::parse(&body);
    let key = match idempotency_key(&parts.headers) {
        Ok(k) => k,
        Err(e) => return sim.respond(&e.answer(), None, None),
    };
    let request = match path {
        "/v1/refunds" => NewRefund::parse(&params).map(EffectRequest::Refund),
        _ => NewIntent::parse(&params).map(EffectRequest::Intent),
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return sim.respond(&e.answer(), key.as_deref(), None),
    };
    let (answer, outcome) = match sim.execute(&scope, key.as_deref(), path, &params, request) {
        Executed::Ran(answer, outcome) => (answer, outcome),
        Executed::Replay(answer, original) => {
            return sim.respond(&answer, key.as_deref(), Some(&original));
        }
        Executed::Mismatch(e) => return sim.respond(&e.answer(), key.as_deref(), None),
    };
    if outcome.late_after {
        tokio::time::sleep(sim.faults.late()).await;
    }
    if outcome.drop_after {
        return crate::server::drop_connection(&parts.extensions).await;
    }
    sim.respond(&answer, key.as_deref(), None)
}

/// Authenticates a lookup and parses its query string.
fn lookup_params(
    sim: &Inner,
    headers: &HeaderMap,
    query: Option<&str>,
    names: &[&str],
) -> Result<Params, ApiError> {
    sim.authenticate(headers)?;
    let params = Params::parse(query.unwrap_or_default().as_bytes());
    params.only(names, &["expand", "created"])?;
    Ok(params)
}

/// Answers a lookup: authenticated, its query string parsed (`names` allowed), `body`'s
/// JSON or error.
fn lookup(
    sim: &Inner,
    headers: &HeaderMap,
    query: Option<&str>,
    names: &[&str],
    body: impl FnOnce(&Params) -> Result<serde_json::Value, ApiError>,
) -> Response {
    match lookup_params(sim, headers, query, names).and_then(|p| body(&p)) {
        Ok(v) => ok_json(sim, &v),
        Err(e) => error(sim, &e),
    }
}

fn ok_json(sim: &Inner, value: &serde_json::Value) -> Response {
    sim.respond(&Answer::json(StatusCode::OK, value), None, None)
}

fn error(sim: &Inner, e: &ApiError) -> Response {
    sim.respond(&e.answer(), None, None)
}

/// `starting_after` / `ending_before` → a cursor (an unknown id is Stripe's 404).
fn cursor(store: &Store, params: &Params, object: &str) -> Result<Cursor, ApiError> {
    let seq = |name: &str, id: &str| {
        store
            .seq_of(id)
            .ok_or_else(|| ApiError::missing(object, id, name))
    };
    match (params.get("starting_after"), params.get("ending_before")) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "You may only specify one of these parameters: ending_before, starting_after.",
        )),
        (Some(id), None) => Ok(Cursor::Before(seq("starting_after", id)?)),
        (None, Some(id)) => Ok(Cursor::After(seq("ending_before", id)?)),
        (None, None) => Ok(Cursor::Newest),
    }
}

fn list_body<T: Serialize>(items: &[(u64, &T)], more: bool, url: &str) -> serde_json::Value {
    let data: Vec<&T> = items.iter().map(|(_, t)| *t).collect();
    json!({"object": "list", "data": data, "has_more": more, "url": url})
}

async fn list_intents(
    State(sim): State<Arc<Inner>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let names = ["limit", "starting_after", "ending_before", "customer"];
    lookup(&sim, &headers, q.as_deref(), &names, |params| {
        let limit = params.limit()?;
        let store = sim.lock();
        let cursor = cursor(&store, params, "payment_intent")?;
        let (items, more) = page(&store.intents, cursor, limit, |_| true);
        Ok(list_body(&items, more, "/v1/payment_intents"))
    })
}

/// Search: only intents older than `search_lag` are visible; `page` is the opaque
/// `next_page` of the previous result (here: `page_<sequence>`).
async fn search_intents(
    State(sim): State<Arc<Inner>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let names = ["query", "limit", "page"];
    lookup(&sim, &headers, q.as_deref(), &names, |params| {
        let limit = params.limit()?;
        let query = search::Query::parse(params.required("query")?)
            .map_err(|m| ApiError::invalid(m).param("query"))?;
        let cursor = match params.get("page") {
            None => Cursor::Newest,
            Some(p) => Cursor::Before(
                p.strip_prefix("page_")
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| ApiError::invalid("Invalid page token.").param("page"))?,
            ),
        };
        let store = sim.lock();
        let lag = sim.search_lag;
        let (items, more) = page(&store.intents, cursor, limit, |pi| {
            pi.born.is_some_and(|b| b.elapsed() >= lag) && query.matches(pi)
        });
        let next_page = more
            .then(|| items.last().map(|(s, _)| format!("page_{s}")))
            .flatten();
        let data: Vec<_> = items.iter().map(|(_, pi)| *pi).collect();
        Ok(
            json!({"object": "search_result", "data": data, "has_more": more,
                  "next_page": next_page, "url": "/v1/payment_intents/search"}),
        )
    })
}

/// What a `GET …/{id}` handler finds in the store by id, as JSON (`None`: no such object).
type Find = fn(&Store, &str) -> Option<serde_json::Result<serde_json::Value>>;

/// The handler of `GET …/{id}`: the `object` `find` finds (authenticated), or Stripe's 404.
fn get_by_id(
    object: &'static str,
    find: Find,
) -> impl Fn(State<Arc<Inner>>, HeaderMap, Path<String>) -> std::future::Ready<Response>
       + Clone
       + Send
       + Sync
       + 'static {
    move |State(sim): State<Arc<Inner>>, headers: HeaderMap, Path(id): Path<String>| {
        std::future::ready(get_one(&sim, &headers, object, &id, find))
    }
}

fn get_one(sim: &Inner, headers: &HeaderMap, object: &str, id: &str, find: Find) -> Response {
    if let Err(e) = sim.authenticate(headers) {
        return error(sim, &e);
    }
    let found = find(&sim.lock(), id);
    match found {
        Some(Ok(v)) => ok_json(sim, &v),
        _ => error(sim, &ApiError::missing(object, id, "id")),
    }
}

async fn list_refunds(
    State(sim): State<Arc<Inner>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let names = [
        "limit",
        "starting_after",
        "ending_before",
        "payment_intent",
        "charge",
    ];
    lookup(&sim, &headers, q.as_deref(), &names, |params| {
        let limit = params.limit()?;
        let store = sim.lock();
        let cursor = cursor(&store, params, "refund")?;
        let (pi, ch) = (params.get("payment_intent"), params.get("charge"));
        let (items, more) = page(&store.refunds, cursor, limit, |r| {
            pi.is_none_or(|pi| r.payment_intent == pi) && ch.is_none_or(|ch| r.charge == ch)
        });
        Ok(list_body(&items, more, "/v1/refunds"))
    })
}

async fn stats(State(sim): State<Arc<Inner>>) -> Json<PaymentsStats> {
    Json(sim.stats())
}

async fn unknown_url(State(sim): State<Arc<Inner>>, req: Request) -> Response {
    let e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "Unrecognized request URL ({}: {}).",
            req.method(),
            req.uri().path()
        ),
    );
    error(&sim, &e)
}
