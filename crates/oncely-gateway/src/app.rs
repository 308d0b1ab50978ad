//! The gateway's router: each idempotent route behind authentication and the multi-phase
//! idempotency layer, the operation status resource, health, and everything else passed
//! through; [`serve`] runs it with the retention sweeps until shutdown.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, MethodFilter, MethodRouter};
use axum::Router;
use http::{header, Request, StatusCode};
use oncely_core::{IdempotencyKey, Operation, Scope, TenantId};
use oncely_http::{
    lease_sweep, IdempotencyConfig, IdempotencyLayer, MultiPhase, Problem, TenantExtractor,
    TenantLayer,
};
use oncely_sql::{Database, IdempotencyStore, Retention, RetentionSweep, StoreError};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tower::{service_fn, Layer, ServiceExt};

use crate::config::{ConfigError, GatewayConfig, KeyPolicy, RouteConfig};
use crate::forward::{kind, Forwarding, Upstream, IDEMPOTENCY_KEY};
use crate::probe::Probe;
use crate::template::Template;
use crate::Authentication;

/// The path of the status resource of route `n` (its index in the configuration):
/// `/_oncely/routes/{n}/operations/{key}`.
pub fn status_link(n: usize) -> String {
    format!("/_oncely/routes/{n}/operations/{{key}}")
}

/// What the status resource needs of each route.
#[derive(Clone)]
struct RouteStore {
    method: String,
    path: String,
    store: IdempotencyStore,
}

/// Builds the gateway's router on `db` (migrated) for `config`, authenticating with
/// `auth`.
///
/// # Errors
/// [`ConfigError`] when the configuration does not validate or the upstream client cannot
/// be built.
pub fn router(
    config: &GatewayConfig,
    db: &Database,
    auth: Authentication,
) -> Result<Router, ConfigError> {
    config.validate()?;
    let upstream = Upstream::new(&config.upstream, config.connect_timeout())
        .map_err(|_| ConfigError::Upstream(config.upstream.clone()))?;
    let pass = {
        let upstream = upstream.clone();
        move |req: Request<Body>| async move { upstream.pass_through(req).await }
    };
    let mut paths: BTreeMap<String, MethodRouter> = BTreeMap::new();
    let mut stores = Vec::new();
    // One budget of body bytes for every guarded route, each with its own bound.
    let bodies = oncely_http::BodyLimits::new(&config.http, 0, 1);
    for (n, route) in config.routes.iter().enumerate() {
        let store = IdempotencyStore::new(db.clone(), route.retention());
        stores.push(RouteStore {
            method: route.method()?.to_string(),
            path: route.path.clone(),
            store: store.clone(),
        });
        let limits = bodies.with_max_body(route.max_request_bytes);
        let guarded = guarded_route(n, route, store, &upstream, auth.clone(), limits)?;
        let filter = MethodFilter::try_from(route.method()?)
            .map_err(|_| ConfigError::Route(route.name(), "unsupported method"))?;
        let methods = paths
            .remove(&route.path)
            .unwrap_or_else(|| MethodRouter::new().fallback(pass.clone()));
        paths.insert(route.path.clone(), methods.on_service(filter, guarded));
    }
    let status = get(operation_status)
        .with_state(Arc::new(stores))
        .route_layer(TenantLayer::new(auth));
    let mut router = Router::new()
        .route("/_oncely/routes/{n}/operations/{key}", status)
        .route("/_oncely/healthz", get(|| async { "ok" }));
    let ready_db = db.clone();
    router = router.route(
        "/_oncely/readyz",
        get(move || async move { ready(&ready_db).await }),
    );
    for (path, methods) in paths {
        router = router.route(&path, methods);
    }
    // The request log of every request, passed through or guarded (its `route` is the
    // configured template, `unmatched` for a pass-through outside every route).
    Ok(router
        .fallback(pass)
        .layer(axum::middleware::from_fn(oncely_http::log_request)))
}

/// One idempotent route: authentication, the body guard (bound, deadline, budget), then
/// the multi-phase layer (its key, fingerprint, lease, probe), then the forward.
fn guarded_route(
    n: usize,
    route: &RouteConfig,
    store: IdempotencyStore,
    upstream: &Upstream,
    auth: Authentication,
    bodies: oncely_http::BodyLimits,
) -> Result<
    impl tower::Service<
            Request<Body>,
            Response = Response,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + Sync
        + 'static,
    ConfigError,
> {
    let timeout = route.timeout();
    // The lease outlasts the upstream timeout, so a live holder is never taken for dead.
    let lease = timeout + Duration::from_secs(5);
    let mut mode = MultiPhase::new(lease).status_link(status_link(n));
    if let Some(probe) = &route.probe {
        let template = Template::parse(&probe.url)
            .map_err(|why| ConfigError::Probe(route.name(), probe.url.clone(), why))?;
        mode = mode.resolver(Probe {
            upstream: upstream.clone(),
            config: probe.clone(),
            template,
            timeout,
        });
    }
    let layer_config = IdempotencyConfig {
        require_key: true,
        max_request_body: route.max_request_bytes,
        max_stored_response: route.max_stored_response_bytes,
        // The forward's own timeout answers first; this only bounds a stuck store write.
        execution_timeout: timeout + Duration::from_secs(2),
        fingerprint: route.fingerprint_parts()?,
        key_source: route.key_source()?,
        ..IdempotencyConfig::default()
    };
    let forwarding = Arc::new(Forwarding {
        route: route.name(),
        timeout,
        max_answer: route.max_stored_response_bytes,
        on_5xx: route.on_5xx,
        mode: mode.clone(),
    });
    let forward = {
        let upstream = upstream.clone();
        service_fn(move |req: Request<Body>| {
            let (upstream, forwarding) = (upstream.clone(), forwarding.clone());
            async move { Ok::<_, Infallible>(upstream.forward_guarded(req, &forwarding).await) }
        })
    };
    let guarded = IdempotencyLayer::new(store, layer_config)
        .multi_phase(mode)
        .layer(forward);
    let optional = route.key == KeyPolicy::Optional;
    let upstream = upstream.clone();
    let dispatch = service_fn(move |req: Request<Body>| {
        let (guarded, upstream) = (guarded.clone(), upstream.clone());
        async move {
            if optional && !req.headers().contains_key(IDEMPOTENCY_KEY) {
                // Documented as unprotected: forwarded once, nothing stored.
                return Ok(upstream.pass_through(req).await);
            }
            guarded.oneshot(req).await
        }
    });
    // Inside authentication: an unauthenticated client gets 401 with its body unread and
    // spends none of the budget.
    let bodies = axum::middleware::from_fn_with_state(bodies, oncely_http::read_body);
    Ok(TenantLayer::new(auth).layer(bodies.layer(dispatch)))
}

/// `GET /_oncely/routes/{n}/operations/{key}`: the caller's operation under that key on
/// route `n` (404 for another tenant's, or none).
async fn operation_status(
    State(stores): State<Arc<Vec<RouteStore>>>,
    Path((n, key)): Path<(usize, String)>,
    req: Request<Body>,
) -> Response {
    let not_found = || {
        Problem::new(
            StatusCode::NOT_FOUND,
            kind::OPERATION_NOT_FOUND,
            "No operation with this key",
        )
        .into_response()
    };
    let (Some(route), Ok(key), Some(tenant)) = (
        stores.get(n),
        IdempotencyKey::parse(key.as_bytes()),
        req.extensions().get::<TenantId>().cloned(),
    ) else {
        return not_found();
    };
    let scope = Scope::new(tenant, Operation::new(&route.method, &route.path));
    match route.store.lookup(&scope, &key).await {
        Ok(Some(record)) => axum::Json(json!({
            "key": key.as_str(),
            "route": format!("{} {}", route.method, route.path),
            "state": record.state.as_str(),
            "attempts": record.fence,
            "lease_until": record.lease_until,
            "created_at": record.created_at,
            "completed_at": record.completed_at,
            "response_status": record.response.as_ref().map(|r| r.status),
        }))
        .into_response(),
        Ok(None) => not_found(),
        Err(e) => store_unavailable(e),
    }
}

fn store_unavailable(e: StoreError) -> Response {
    oncely_http::StoreFailure::from(e)
        .retry_after(1)
        .into_response()
}

/// `GET /_oncely/readyz`: 200 when the store answers, else 503.
async fn ready(db: &Database) -> Response {
    match db.within_store_timeout(db.ping()).await {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain")],
            "ready",
        )
            .into_response(),
        Err(e) => store_unavailable(e),
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, bounding slow clients and
/// connections by `limits` ([`oncely_http::serve_http`]), with the store's periodic
/// work: finished records past their retention are deleted (every minute) and records
/// left `processing` past their lease (a gateway that died mid-forward) are turned
/// `unknown` (every 10 s).
///
/// # Errors
/// The listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    db: &Database,
    limits: &oncely_http::HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stop = CancellationToken::new();
    let store = IdempotencyStore::new(db.clone(), Duration::from_secs(86_400));
    let collect = store.clone();
    let retention = Retention::new()
        .sweep(RetentionSweep::new(
            "idempotency",
            Duration::from_secs(60),
            500,
            move |now_ms, batch| {
                let store = collect.clone();
                async move { store.collect_expired(now_ms, batch).await }
            },
        ))
        .sweep(lease_sweep(store, Duration::from_secs(10)))
        .spawn(stop.clone());
    let served = oncely_http::serve_http(listener, router, limits, shutdown).await;
    stop.cancel();
    drop(retention.await);
    served
}

impl TenantExtractor for Authentication {
    fn tenant(&self, parts: &http::request::Parts) -> Option<TenantId> {
        match self {
            Self::ApiKeys(keys) => keys.tenant(parts),
            Self::TrustedHeader(trusted) => trusted.tenant(parts),
        }
    }

    fn refusal(&self) -> Response {
        match self {
            Self::ApiKeys(keys) => keys.refusal(),
            Self::TrustedHeader(_) => Problem::new(
                StatusCode::UNAUTHORIZED,
                oncely_http::kind::UNAUTHENTICATED,
                "The request did not come through the trusted authentication proxy",
            )
            .into_response(),
        }
    }
}
