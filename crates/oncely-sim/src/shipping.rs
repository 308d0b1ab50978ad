//! The shipping simulator: a provider without idempotency keys.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::{Path, Query, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use oncely_http::Problem;
use serde::{Deserialize, Serialize};

use crate::faults::{FaultConfig, FaultKind, Faults, Outcome};

/// The status word of a cancelled shipment.
const CANCELLED: &str = "cancelled";

/// Largest JSON body accepted, in bytes.
const MAX_BODY: usize = 256 * 1024;

/// Settings of the shipping simulator.
#[derive(Debug, Clone, Default)]
pub struct ShippingConfig {
    /// When set, requests must carry `Authorization: Bearer <api_key>` (else 401 problem).
    /// Default: no authentication.
    pub api_key: Option<String>,
    /// SKUs the provider refuses for good: a shipment with one of them is answered 422
    /// (`urn:oncely:problem:undeliverable`) and not booked. Default: none.
    pub undeliverable_skus: BTreeSet<String>,
    /// Fault injection on `POST /v1/shipments` and `POST /v1/shipments/{id}/cancel`.
    pub faults: FaultConfig,
    /// The status word of a live shipment; `None` is `booked`. A carrier's own words
    /// (`created`, `label_created`, `in_transit`) or one nobody lists, for clients that
    /// must not read an unfamiliar word as a failure.
    pub live_status: Option<String>,
}

/// One line of a shipment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShipmentItem {
    /// Stock-keeping unit.
    pub sku: String,
    /// How many, at least 1.
    pub quantity: u32,
}

#[derive(Debug, Deserialize)]
struct NewShipment {
    merchant_reference: String,
    order_id: String,
    items: Vec<ShipmentItem>,
}

/// A shipment as the provider answers it.
#[derive(Debug, Clone, Serialize)]
struct Shipment {
    id: String,
    merchant_reference: String,
    order_id: String,
    items: Vec<ShipmentItem>,
    /// The live word ([`ShippingConfig::live_status`], `booked` by default) or `cancelled`.
    status: String,
    /// Unix seconds.
    created: i64,
    /// Unix seconds; `null` until cancelled.
    cancelled_at: Option<i64>,
}

/// Shipments per `merchant_reference`, in [`ShippingStats`].
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct ReferenceCount {
    /// Shipments booked under this reference, any status.
    pub total: u64,
    /// Of those, still `booked` (live).
    pub booked: u64,
    /// Of those, `cancelled`.
    pub cancelled: u64,
}

/// Counts at the provider (`GET /_sim/stats`).
#[derive(Debug, Default, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub struct ShippingStats {
    /// Shipments created.
    pub shipments: u64,
    /// Of those, still `booked`.
    pub booked: u64,
    /// Of those, `cancelled`.
    pub cancelled: u64,
    /// Per `merchant_reference`.
    pub by_merchant_reference: BTreeMap<String, ReferenceCount>,
    /// Requests refused with 422 (undeliverable).
    pub refused: u64,
    /// Faults injected so far, per kind.
    pub faults_injected: BTreeMap<FaultKind, u64>,
}

/// The shipping simulator: state in memory (one `Mutex` over the shipments, never held
/// across an await), shared by every clone.
///
/// Routes (JSON; errors are RFC 9457 problems): `POST /v1/shipments` →
/// 201 (a second identical POST books a second shipment: there is no idempotency key),
/// `GET /v1/shipments?merchant_reference=…` → `{"data": [...]}` oldest first,
/// `GET /v1/shipments/{id}`, `POST /v1/shipments/{id}/cancel` (cancelling a cancelled
/// shipment answers the same); for tests only and without authentication, `GET /_sim/stats`,
/// `GET`/`POST /_sim/faults`, `POST /_sim/faults/next`.
#[derive(Debug, Clone)]
pub struct ShippingSim {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    api_key: Option<String>,
    undeliverable: BTreeSet<String>,
    faults: Faults,
    live_status: String,
    state: Mutex<Ledger>,
}

#[derive(Debug, Default)]
struct Ledger {
    tag: String,
    shipments: Vec<Shipment>,
    refused: u64,
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn problem(status: StatusCode, kind: &str, title: &str) -> Problem {
    Problem::new(status, kind, title)
}

impl ShippingSim {
    /// A simulator without shipments.
    pub fn new(config: ShippingConfig) -> Self {
        let tag = format!("{:08x}", rand::random::<u32>());
        Self {
            inner: Arc::new(Inner {
                api_key: config.api_key,
                undeliverable: config.undeliverable_skus,
                faults: Faults::new(config.faults),
                live_status: config.live_status.unwrap_or_else(|| "booked".to_owned()),
                state: Mutex::new(Ledger {
                    tag,
                    ..Ledger::default()
                }),
            }),
        }
    }

    /// The simulator's routes; serve them with [`crate::serve`] (for a real `drop_after`).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/shipments", post(create).get(list))
            .route("/v1/shipments/{id}", get(get_one))
            .route("/v1/shipments/{id}/cancel", post(cancel))
            .route("/_sim/stats", get(stats))
            .with_state(self.inner.clone())
            .merge(self.inner.faults.router())
    }

    /// Counts at the provider.
    pub fn stats(&self) -> ShippingStats {
        self.inner.stats()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stats(&self) -> ShippingStats {
        let s = self.lock();
        let mut stats = ShippingStats {
            shipments: s.shipments.len() as u64,
            refused: s.refused,
            faults_injected: self.faults.injected(),
            ..ShippingStats::default()
        };
        for sh in &s.shipments {
            let booked = u64::from(sh.status != CANCELLED);
            stats.booked += booked;
            stats.cancelled += 1 - booked;
            let r = stats
                .by_merchant_reference
                .entry(sh.merchant_reference.clone())
                .or_default();
            r.total += 1;
            r.booked += booked;
            r.cancelled += 1 - booked;
        }
        stats
    }

    /// The 401 to answer, if the request is not authenticated.
    fn unauthorized(&self, headers: &HeaderMap) -> Option<Response> {
        let expected = self.api_key.as_ref()?;
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        (given != Some(expected.as_str())).then(|| {
            problem(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Missing or invalid API key",
            )
            .into_response()
        })
    }
}

/// Validates a booking: 400 when malformed, 422 when an SKU is undeliverable.
fn validate(sim: &Inner, body: &[u8]) -> Result<NewShipment, Problem> {
    let new: NewShipment = serde_json::from_slice(body).map_err(|e| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid-shipment",
            "Invalid shipment",
        )
        .detail(e.to_string())
    })?;
    let bad = |d: &str| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid-shipment",
            "Invalid shipment",
        )
        .detail(d)
    };
    if new.merchant_reference.is_empty() || new.merchant_reference.len() > 255 {
        return Err(bad("merchant_reference: 1-255 characters"));
    }
    if new.items.is_empty()
        || new
            .items
            .iter()
            .any(|i| i.quantity == 0 || i.sku.is_empty())
    {
        return Err(bad(
            "items: at least one, each with an sku and a quantity of 1 or more",
        ));
    }
    let refused: Vec<&str> = new
        .items
        .iter()
        .filter(|i| sim.undeliverable.contains(&i.sku))
        .map(|i| i.sku.as_str())
        .collect();
    if !refused.is_empty() {
        return Err(problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "undeliverable",
            "The shipment cannot be delivered",
        )
        .detail("one or more items cannot be shipped")
        .with("skus", refused));
    }
    Ok(new)
}

/// The effect under the lock with the effect faults drawn: the response and the faults
/// still to apply after it ([`deliver`]). An `error_before` answers 503 and runs nothing.
fn commit(sim: &Inner, effect: impl FnOnce(&mut Ledger) -> Response) -> (Response, Outcome) {
    let outcome = sim.faults.on_effect();
    if outcome.error_before {
        let res = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable; nothing was done",
        )
        .into_response();
        return (res, Outcome::default());
    }
    let mut res = effect(&mut sim.lock());
    if outcome.error_after {
        let status =
            StatusCode::from_u16(outcome.error_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        res = problem(status, "internal", "Internal error").into_response();
    }
    (res, outcome)
}

/// The after-effect faults of `outcome` on the committed answer `res`: a late answer, a
/// dropped connection.
async fn deliver(
    sim: &Inner,
    extensions: &http::Extensions,
    res: Response,
    outcome: Outcome,
) -> Response {
    if outcome.late_after {
        tokio::time::sleep(sim.faults.late()).await;
    }
    if outcome.drop_after {
        return crate::server::drop_connection(extensions).await;
    }
    res
}

/// Runs `work` — the arrival faults, validation and the commit — in a task of its own, as
/// a server keeps working on a request its client stopped waiting for: a booking held by a
/// `latency` fault past the caller's timeout still commits (a slow commit), and only then is
/// the answer delivered with the after-effect faults.
async fn effect_request(
    sim: Arc<Inner>,
    extensions: &http::Extensions,
    work: impl std::future::Future<Output = (Response, Option<Outcome>)> + Send + 'static,
) -> Response {
    match tokio::spawn(work).await {
        Ok((res, Some(outcome))) => deliver(&sim, extensions, res, outcome).await,
        Ok((res, None)) => res,
        Err(_) => problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
        )
        .into_response(),
    }
}

/// Rate limiter and latency faults of an arriving effect request: the 429 to answer, if any.
async fn arrival(sim: &Inner) -> Option<Response> {
    let secs = sim.faults.on_arrival().await?;
    Some(
        problem(
            StatusCode::TOO_MANY_REQUESTS,
            "rate-limited",
            "Too many requests",
        )
        .retry_after(secs)
        .into_response(),
    )
}

async fn create(State(sim): State<Arc<Inner>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    if let Some(res) = sim.unauthorized(&parts.headers) {
        return res;
    }
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "Body too large",
        )
        .into_response();
    };
    let inner = sim.clone();
    let work = async move {
        if let Some(res) = arrival(&inner).await {
            return (res, None);
        }
        let new = match validate(&inner, &body) {
            Ok(n) => n,
            Err(p) => {
                if p.status == StatusCode::UNPROCESSABLE_ENTITY {
                    inner.lock().refused += 1;
                }
                return (p.into_response(), None);
            }
        };
        let live = inner.live_status.clone();
        let (res, outcome) = commit(&inner, move |s| {
            let id = format!("shp_{}{:012}", s.tag, s.shipments.len() + 1);
            let shipment = Shipment {
                id,
                merchant_reference: new.merchant_reference,
                order_id: new.order_id,
                items: new.items,
                status: live,
                created: unix_now(),
                cancelled_at: None,
            };
            s.shipments.push(shipment.clone());
            let mut res = (StatusCode::CREATED, Json(&shipment)).into_response();
            if let Ok(v) = HeaderValue::from_str(&format!("/v1/shipments/{}", shipment.id)) {
                res.headers_mut().insert(header::LOCATION, v);
            }
            res
        });
        (res, Some(outcome))
    };
    effect_request(sim, &parts.extensions, work).await
}

fn not_found() -> Response {
    problem(StatusCode::NOT_FOUND, "not-found", "No such shipment").into_response()
}

async fn cancel(State(sim): State<Arc<Inner>>, Path(id): Path<String>, req: Request) -> Response {
    let (parts, _) = req.into_parts();
    if let Some(res) = sim.unauthorized(&parts.headers) {
        return res;
    }
    if let Some(res) = arrival(&sim).await {
        return res;
    }
    if !sim.lock().shipments.iter().any(|s| s.id == id) {
        return not_found();
    }
    let (res, outcome) = commit(&sim, move |s| {
        match s.shipments.iter_mut().find(|s| s.id == id) {
            Some(sh) => {
                if sh.status != CANCELLED {
                    CANCELLED.clone_into(&mut sh.status);
                    sh.cancelled_at = Some(unix_now());
                }
                Json(&*sh).into_response()
            }
            None => not_found(),
        }
    });
    deliver(&sim, &parts.extensions, res, outcome).await
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    merchant_reference: Option<String>,
}

async fn list(
    State(sim): State<Arc<Inner>>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    if let Some(res) = sim.unauthorized(&headers) {
        return res;
    }
    let s = sim.lock();
    let data: Vec<&Shipment> = s
        .shipments
        .iter()
        .filter(|sh| {
            q.merchant_reference
                .as_ref()
                .is_none_or(|r| *r == sh.merchant_reference)
        })
        .collect();
    Json(serde_json::json!({ "data": data })).into_response()
}

async fn get_one(
    State(sim): State<Arc<Inner>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(res) = sim.unauthorized(&headers) {
        return res;
    }
    let s = sim.lock();
    match s.shipments.iter().find(|sh| sh.id == id) {
        Some(sh) => Json(sh).into_response(),
        None => not_found(),
    }
}

async fn stats(State(sim): State<Arc<Inner>>) -> Json<ShippingStats> {
    Json(sim.stats())
}
