use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use oncely_core::{
    now_ms, Fingerprint, IdempotencyKey, Operation, RecordState, Scope, StoredResponse, TenantId,
};
use oncely_sql::{Database, IdempotencyStore, Record, Reservation, ReservationToken, StoreError};
use tokio::sync::Mutex;
use tower::{Layer, Service, ServiceExt};

use crate::cache::{ReplayCache, Settled};
use crate::extract::{IdempotencyContext, TxSlot};
use crate::metrics as metric;
use crate::multiphase::{self, MultiPhase};
use crate::problem::kind;
use crate::{IdempotencyConfig, Problem, StoreFailure};

/// `Idempotent-Replayed`: sent as `true` on every replayed answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// Response extension a handler sets on an answer that must leave nothing behind: the
/// layer rolls the transaction back and stores no outcome, exactly as for an error found
/// before the reservation. Use it for input validation failures (400/422), so a client that
/// fixes its request can retry with the same key. Deliberate business rejections (e.g. a
/// conflicting order) are *not* marked: they are stored and replayed like successes.
#[derive(Debug, Clone, Copy, Default)]
pub struct NotStored;

/// Makes the wrapped routes idempotent (see the crate docs for every answer).
///
/// Apply it to routes whose handlers take [`IdempotentTx`](crate::IdempotentTx), *after*
/// authentication: it reads the [`TenantId`] from the request extensions (401 when
/// absent) and the route template from axum's [`MatchedPath`] (so use
/// `Router::route_layer`). Only `POST` and `PATCH` are guarded; other methods pass through.
///
/// Atomic mode by default; [`IdempotencyLayer::multi_phase`] makes a layer for routes whose
/// handlers call external providers (see [`MultiPhase`]). Modes are per layer, so per
/// route: give each multi-phase route its own `route_layer`.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    multi_phase: Option<Arc<MultiPhase>>,
}

impl IdempotencyLayer {
    /// A layer storing records in `store`.
    pub fn new(store: IdempotencyStore, config: IdempotencyConfig) -> Self {
        // Counters show 0 from the start, so `rate()` and alerts see them before the first
        // event.
        for name in metric::COUNTERS {
            metrics::counter!(*name).increment(0);
        }
        Self {
            store,
            cache: Arc::new(ReplayCache::new(config.replay_cache_bytes)),
            config: Arc::new(config),
            multi_phase: None,
        }
    }

    /// This layer in multi-phase mode: the reservation commits first as `processing` under
    /// a lease and a fencing token, the handler runs outside any transaction (it takes
    /// [`OperationContext`](crate::OperationContext), not
    /// [`IdempotentTx`](crate::IdempotentTx)), and its answer is stored by the holder of the
    /// current fence only. See [`MultiPhase`] for the answers this mode adds.
    #[must_use]
    pub fn multi_phase(mut self, mode: MultiPhase) -> Self {
        multiphase::register_metrics();
        self.multi_phase = Some(Arc::new(mode));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            store: self.store.clone(),
            config: self.config.clone(),
            cache: self.cache.clone(),
            multi_phase: self.multi_phase.clone(),
        }
    }
}

/// The service built by [`IdempotencyLayer`].
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    multi_phase: Option<Arc<MultiPhase>>,
}

/// Runs each request in a database transaction lent to the handler through
/// [`IdempotentTx`](crate::IdempotentTx), committed after a non-5xx answer, rolled back
/// otherwise — the idempotency layer's transaction handling without keys. Used for routes
/// that need no key and as the baseline in benchmarks.
#[derive(Debug, Clone)]
pub struct TransactionLayer {
    db: Database,
}

impl TransactionLayer {
    /// A layer opening transactions on `db`.
    pub fn new(db: Database) -> Self {
        Self { db }
    }
}

impl<S> Layer<S> for TransactionLayer {
    type Service = Transaction<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Transaction {
            inner,
            db: self.db.clone(),
        }
    }
}

/// The service built by [`TransactionLayer`].
#[derive(Debug, Clone)]
pub struct Transaction<S> {
    inner: S,
    db: Database,
}

impl<S> Service<Request<Body>> for Transaction<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, inner);
        let db = self.db.clone();
        spawned(async move {
            match db.begin().await {
                Ok(tx) => run_in_tx(inner, req, tx, None, usize::MAX).await,
                Err(e) => store_problem(e, 1),
            }
        })
    }
}

impl<S> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, inner);
        let store = self.store.clone();
        let config = self.config.clone();
        let cache = self.cache.clone();
        let mode = self.multi_phase.clone();
        spawned(handle(inner, store, config, cache, mode, req))
    }
}

/// Runs a request's handling in its own task: once a request has been received, a client
/// hanging up (which makes the server drop the service future) cannot cancel it between
/// reservation and commit. A panic in the task becomes a 500 problem.
fn spawned(handling: impl Future<Output = Response> + Send + 'static) -> BoxFuture {
    let task = tokio::spawn(handling);
    Box::pin(async move { Ok(task.await.unwrap_or_else(|e| panicked(&e.to_string()))) })
}

/// The layer's path for one request, in its named steps: tenant and route → key → body →
/// fingerprint → cached outcome → reserve → run → store (see [`reserve_and_run`] and
/// [`run_in_tx`]). Each step either hands its result on or answers.
async fn handle<S>(
    inner: S,
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    multi_phase: Option<Arc<MultiPhase>>,
    req: Request<Body>,
) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    if !(req.method() == Method::POST || req.method() == Method::PATCH) {
        return inner.oneshot(req).await.unwrap_or_else(|e| match e {});
    }
    let (mut parts, body) = req.into_parts();
    let (scope, template) = match scope_of(&parts) {
        Ok(found) => found,
        Err(res) => return res,
    };
    let key = match key_of(&parts.headers) {
        Ok(key) => key,
        Err(res) => return res,
    };
    let Some(key) = key else {
        if config.require_key {
            metrics::counter!(metric::REJECTED_TOTAL, "reason" => "missing_key").increment(1);
            return Problem::new(
                StatusCode::BAD_REQUEST,
                kind::IDEMPOTENCY_KEY_MISSING,
                "This operation requires an Idempotency-Key header",
            )
            .detail("mint one key (e.g. a UUIDv7) per operation and send it on every retry")
            .into_response();
        }
        parts
            .extensions
            .insert(IdempotencyContext { scope, key: None });
        let tx = match store.database().begin().await {
            Ok(tx) => tx,
            Err(e) => return store_problem(e, config.retry_after_secs),
        };
        let req = Request::from_parts(parts, body);
        return run_in_tx(inner, req, tx, None, config.max_stored_response).await;
    };
    let bytes = match read_body(body, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err(res) => return res,
    };
    let fingerprint = match fingerprint_of(&parts, &template, &bytes) {
        Ok(fingerprint) => fingerprint,
        Err(res) => return res,
    };
    // A finished outcome this process has seen: answered without a database round trip.
    if let Some(settled) = cache.get(&scope, &key, now_ms()) {
        metrics::counter!(metric::REPLAY_CACHE_HITS_TOTAL).increment(1);
        if let Some(res) = answer(
            settled.state,
            &settled.fingerprint,
            Some(&settled.response),
            &fingerprint,
        ) {
            return res;
        }
    }
    let request = Keyed {
        parts,
        bytes,
        scope,
        key,
        fingerprint,
    };
    if let Some(mode) = multi_phase {
        return multiphase::reserve_and_run(inner, store, config, cache, mode, request).await;
    }
    reserve_and_run(inner, store, config, cache, request).await
}

/// The request's [`Scope`] (its tenant and operation) and its route template. The tenant
/// comes from authentication, never from the request: 401 when no [`TenantId`] was put in
/// the extensions.
#[allow(clippy::result_large_err)] // the error is the finished answer, built at most once per request and returned at once
fn scope_of(parts: &http::request::Parts) -> Result<(Scope, String), Response> {
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
fn key_of(headers: &http::HeaderMap) -> Result<Option<IdempotencyKey>, Response> {
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
async fn read_body(body: Body, limit: usize) -> Result<Bytes, Response> {
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
fn fingerprint_of(
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

/// Reserves the key and runs the handler under the reservation, or answers from the record
/// that holds it. While another request holds the key: 409 at once, or — with
/// `in_flight_wait` — polling with backoff (10 ms doubling to 200 ms) until its outcome can
/// be replayed or the wait is over.
async fn reserve_and_run<S>(
    inner: S,
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    request: Keyed,
) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let deadline = config.in_flight_wait.map(|d| Instant::now() + d);
    let mut pause = Duration::from_millis(10);
    let db = store.database().clone();
    loop {
        // Pool acquire, BEGIN and the claim share one deadline (the store timeout): a
        // frozen or paused database answers 503 within it, never hangs the request.
        let claim = db.within_store_timeout(async {
            let mut tx = db.begin().await?;
            let reservation = store
                .reserve(
                    &mut tx,
                    &request.scope,
                    &request.key,
                    &request.fingerprint,
                    now_ms(),
                )
                .await?;
            Ok((tx, reservation))
        });
        let (tx, reservation) = match claim.await {
            Ok(claimed) => claimed,
            Err(e) => return store_problem(e, config.retry_after_secs),
        };
        match reservation {
            Reservation::Reserved(token) => {
                return execute(inner, store, &config, cache, request, tx, token).await;
            }
            Reservation::Existing(record) => {
                release(&db, tx).await;
                remember(&cache, &request, &record);
                // `None`: still processing; wait below if configured.
                if let Some(res) = answer_existing(&record, &request.fingerprint) {
                    return res;
                }
            }
            Reservation::InFlight => release(&db, tx).await,
            _ => return store_problem(StoreError::NotHeld, config.retry_after_secs),
        }
        match deadline {
            Some(d) if Instant::now() + pause < d => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            _ => return in_flight(config.retry_after_secs),
        }
    }
}

/// Keeps a finished record's outcome in the replay cache (until the record expires).
pub(crate) fn remember(cache: &ReplayCache, request: &Keyed, record: &Record) {
    if let (Some(response), Some(expires_at)) = (&record.response, record.expires_at) {
        cache.insert(
            &request.scope,
            &request.key,
            Settled {
                state: record.state,
                fingerprint: record.fingerprint,
                response: response.clone(),
                expires_at,
            },
        );
    }
}

/// Runs the handler under a fresh reservation, bounded by `execution_timeout`.
async fn execute<S>(
    inner: S,
    store: IdempotencyStore,
    config: &IdempotencyConfig,
    cache: Arc<ReplayCache>,
    request: Keyed,
    tx: oncely_sql::Tx,
    token: ReservationToken,
) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    metrics::counter!(metric::EXECUTIONS_TOTAL).increment(1);
    let Keyed {
        mut parts,
        bytes,
        scope,
        key,
        fingerprint,
    } = request;
    parts.extensions.insert(IdempotencyContext {
        scope: scope.clone(),
        key: Some(key.clone()),
    });
    let req = Request::from_parts(parts, Body::from(bytes));
    let claim = Claim {
        store,
        cache,
        token,
        scope,
        key,
        fingerprint,
    };
    let run = run_in_tx(inner, req, tx, Some(claim), config.max_stored_response);
    match tokio::time::timeout(config.execution_timeout, run).await {
        Ok(res) => res,
        // Dropping the execution rolls it back unless its COMMIT already went out; either
        // way the retry with the same key learns the outcome.
        Err(_) => outcome_unknown(
            "the operation did not finish in time",
            config.retry_after_secs,
        ),
    }
}

/// The answer for a committed record, or `None` while it is still `processing`.
pub(crate) fn answer_existing(record: &Record, fingerprint: &Fingerprint) -> Option<Response> {
    answer(
        record.state,
        &record.fingerprint,
        record.response.as_ref(),
        fingerprint,
    )
}

/// The answer for a record in `state`, first requested with `stored_fp`, to a request with
/// `fingerprint`; `None` while it is still `processing`.
pub(crate) fn answer(
    state: RecordState,
    stored_fp: &Fingerprint,
    response: Option<&StoredResponse>,
    fingerprint: &Fingerprint,
) -> Option<Response> {
    // The fingerprint is compared on every path that can return a stored outcome.
    if let Some(res) = mismatch(stored_fp, fingerprint) {
        return Some(res);
    }
    match state {
        RecordState::Succeeded | RecordState::Failed => match response {
            Some(stored) => {
                metrics::counter!(metric::REPLAYS_TOTAL).increment(1);
                Some(replay(stored))
            }
            None => Some(
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    kind::RECORD_CORRUPT,
                    "The stored outcome is missing",
                )
                .into_response(),
            ),
        },
        RecordState::Unknown => {
            metrics::counter!(metric::UNKNOWN_TOTAL).increment(1);
            Some(
                Problem::new(
                    StatusCode::CONFLICT,
                    kind::OUTCOME_UNKNOWN,
                    "The outcome of the first request with this key is unknown",
                )
                .detail("the operation awaits a status check or reconciliation; query its status resource instead of retrying")
                .into_response(),
            )
        }
        _ => None,
    }
}

/// 422 when `fingerprint` is not the one `stored_fp` was first requested with.
pub(crate) fn mismatch(stored_fp: &Fingerprint, fingerprint: &Fingerprint) -> Option<Response> {
    let part = stored_fp.mismatch(fingerprint)?;
    metrics::counter!(metric::FINGERPRINT_MISMATCHES_TOTAL).increment(1);
    Some(
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            kind::IDEMPOTENCY_KEY_REUSED,
            "The Idempotency-Key was already used for a different request",
        )
        .detail(format!(
            "the request's {} differs from the one first sent with this key; mint a new key for a new operation",
            part.as_str()
        ))
        .with("differs", part.as_str())
        .into_response(),
    )
}

fn in_flight(retry_after_secs: u32) -> Response {
    metrics::counter!(metric::IN_FLIGHT_TOTAL).increment(1);
    Problem::new(
        StatusCode::CONFLICT,
        kind::REQUEST_IN_FLIGHT,
        "A request with this Idempotency-Key is still being processed",
    )
    .detail("retry later with the same key to receive its answer")
    .retry_after(retry_after_secs)
    .into_response()
}

/// 503 for an execution whose commit may or may not have happened.
pub(crate) fn outcome_unknown(why: &str, retry_after_secs: u32) -> Response {
    metrics::counter!(metric::OUTCOME_UNKNOWN_TOTAL).increment(1);
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        kind::EXECUTION_OUTCOME_UNKNOWN,
        "The outcome of this request is not known yet",
    )
    .detail(format!(
        "{why}; it either took effect once or not at all — retry with the same key to receive the outcome"
    ))
    .retry_after(retry_after_secs)
    .into_response()
}

pub(crate) fn store_problem(e: StoreError, retry_after_secs: u32) -> Response {
    StoreFailure::from(e)
        .retry_after(retry_after_secs)
        .into_response()
}

/// Rolls back a transaction that did nothing (the key was found taken), within the store
/// timeout: a frozen connection must not hold the answer.
async fn release(db: &Database, tx: oncely_sql::Tx) {
    drop(db.within_store_timeout(tx.rollback()).await);
}

pub(crate) fn replay(stored: &StoredResponse) -> Response {
    let mut res = Response::new(Body::from(stored.body.clone()));
    *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            res.headers_mut().append(n, v);
        }
    }
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}

/// A reservation held by the request being executed.
struct Claim {
    store: IdempotencyStore,
    cache: Arc<ReplayCache>,
    token: ReservationToken,
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
}

/// Runs `inner` with `tx` lent through the request extensions, then stores the answer (when
/// `claim` is given) and commits: run → keep or roll back → read the answer → store →
/// commit. Callers run it in a spawned task, so a client that hangs up mid-request cannot
/// cancel an operation half way: it runs to commit or rollback.
async fn run_in_tx<S>(
    inner: S,
    req: Request<Body>,
    tx: oncely_sql::Tx,
    claim: Option<Claim>,
    max_stored_response: usize,
) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let (res, tx) = match run_handler(inner, req, tx).await {
        Ok(ran) => ran,
        Err(res) => return res,
    };
    if res.status().is_server_error() || res.extensions().get::<NotStored>().is_some() {
        // Nothing of a failed execution is kept: the key stays free for the retry.
        drop(tx.rollback().await);
        let reason = if res.status().is_server_error() {
            "5xx"
        } else {
            "not_stored"
        };
        metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => reason).increment(1);
        return res;
    }
    let (parts, body) = res.into_parts();
    let bytes = match read_answer(body, max_stored_response).await {
        Ok(bytes) => bytes,
        Err(res) => {
            drop(tx.rollback().await);
            return res;
        }
    };
    let (tx, settled) = match claim {
        Some(claim) => match store_outcome(claim, tx, &parts, &bytes).await {
            Ok((tx, settled)) => (tx, Some(settled)),
            Err(res) => return res,
        },
        None => (tx, None),
    };
    if let Err(e) = tx.commit().await {
        // The commit may or may not have happened; a retry with the same key finds out.
        tracing::warn!(error = %e, "commit failed; outcome unknown until the retry");
        return outcome_unknown("the commit could not be confirmed", 1);
    }
    if let Some((cache, scope, key, entry)) = settled {
        cache.insert(&scope, &key, entry);
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Runs the handler with `tx` in the request extensions and takes the transaction back.
/// A panic rolls back before answering 500: a transaction merely dropped is rolled back
/// when its connection is next used, and a retry arriving first would find the key still
/// reserved (MySQL: 409 in flight) although the answer said "retry".
async fn run_handler<S>(
    inner: S,
    mut req: Request<Body>,
    tx: oncely_sql::Tx,
) -> Result<(Response, oncely_sql::Tx), Response>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let slot = TxSlot(Arc::new(Mutex::new(Some(tx))));
    req.extensions_mut().insert(slot.clone());
    let run = std::panic::AssertUnwindSafe(inner.oneshot(req));
    let res = match futures_util::FutureExt::catch_unwind(run).await {
        Ok(res) => res.unwrap_or_else(|e| match e {}),
        Err(panic) => {
            if let Some(tx) = slot.0.lock().await.take() {
                drop(tx.rollback().await);
            }
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            return Err(panicked(&message));
        }
    };
    let Some(tx) = slot.0.lock().await.take() else {
        return Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            kind::NO_TRANSACTION,
            "The transaction was lost",
        )
        .into_response());
    };
    Ok((res, tx))
}

/// The handler's answer body, at most `max_stored_response` bytes: what is stored is what
/// is replayed, so an answer that cannot be stored whole is not given (500; the caller
/// rolls back).
pub(crate) async fn read_answer(body: Body, max_stored_response: usize) -> Result<Bytes, Response> {
    let e = match Limited::new(body, max_stored_response).collect().await {
        Ok(c) => return Ok(c.to_bytes()),
        Err(e) => e,
    };
    if e.downcast_ref::<LengthLimitError>().is_some() {
        metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "response_too_large").increment(1);
        Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            kind::RESPONSE_TOO_LARGE,
            "The response is too large to store for replay",
        )
        .detail(format!(
            "responses over {max_stored_response} bytes are not stored; the operation was rolled back"
        ))
        .into_response())
    } else {
        metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "response_body").increment(1);
        Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            kind::RESPONSE_BODY,
            "The response body failed",
        )
        .into_response())
    }
}

/// What the replay cache learns once the commit succeeds.
type CacheEntry = (Arc<ReplayCache>, Scope, IdempotencyKey, Settled);

/// Completes the claimed record with the answer in `tx`. When another transaction committed
/// the key first (the reservation was lost), this execution rolls back and the client gets
/// the committed answer; on a store error it rolls back and answers 503/500.
async fn store_outcome(
    claim: Claim,
    mut tx: oncely_sql::Tx,
    parts: &http::response::Parts,
    bytes: &Bytes,
) -> Result<(oncely_sql::Tx, CacheEntry), Response> {
    let stored = stored_response(parts, bytes);
    let now = now_ms();
    let retention_ms = i64::try_from(claim.store.retention().as_millis()).unwrap_or(i64::MAX);
    match claim
        .store
        .complete(&mut tx, claim.token, &stored, now)
        .await
    {
        Ok(()) => {
            let entry = Settled {
                state: RecordState::for_status(stored.status),
                fingerprint: claim.fingerprint,
                response: stored,
                expires_at: now.saturating_add(retention_ms),
            };
            Ok((tx, (claim.cache, claim.scope, claim.key, entry)))
        }
        Err(StoreError::NotHeld) => {
            drop(tx.rollback().await);
            metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "lost_race").increment(1);
            Err(match claim.store.lookup(&claim.scope, &claim.key).await {
                Ok(Some(record)) => {
                    answer_existing(&record, &claim.fingerprint).unwrap_or_else(|| in_flight(1))
                }
                Ok(None) => in_flight(1),
                Err(e) => store_problem(e, 1),
            })
        }
        Err(e) => {
            drop(tx.rollback().await);
            Err(store_problem(e, 1))
        }
    }
}

/// An answer as it is stored for replay (allow-listed headers only).
pub(crate) fn stored_response(parts: &http::response::Parts, bytes: &Bytes) -> StoredResponse {
    StoredResponse::new(
        parts.status.as_u16(),
        parts
            .headers
            .iter()
            .filter_map(|(n, v)| Some((n.as_str(), v.to_str().ok()?))),
        bytes.to_vec(),
    )
}

/// A panicking handler: its transaction rolled back, nothing stored.
pub(crate) fn panicked(error: &str) -> Response {
    metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "panic").increment(1);
    tracing::error!(error, "handler panicked; transaction rolled back");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        kind::HANDLER_FAILED,
        "The handler failed",
    )
    .detail("nothing was stored; retry with the same key")
    .into_response()
}
