use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use oncely_core::{now_ms, Fingerprint, IdempotencyKey, RecordState, Scope};
use oncely_sql::{Database, IdempotencyStore, Reservation, ReservationToken, StoreError};
use tokio::sync::Mutex;
use tower::{Layer, Service, ServiceExt};

use crate::answer::{
    answer, answer_existing, in_flight, outcome_unknown, panicked, read_answer, remember,
    store_problem, stored_response, NotStored,
};
use crate::cache::{ReplayCache, Settled};
use crate::extract::{IdempotencyContext, TxSlot};
use crate::metrics as metric;
use crate::multiphase::{self, MultiPhase};
use crate::problem::kind;
use crate::request::{fingerprint_of, key_of, read_body, scope_of, Keyed};
use crate::{IdempotencyConfig, Problem};

pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// Makes the wrapped routes idempotent (see the crate docs for every answer).
///
/// Apply it to routes whose handlers take [`IdempotentTx`](crate::IdempotentTx), *after*
/// authentication: it reads the [`TenantId`](oncely_core::TenantId) from the request extensions (401 when
/// absent) and the route template from axum's [`MatchedPath`](axum::extract::MatchedPath) (so use
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

/// Rolls back a transaction that did nothing (the key was found taken), within the store
/// timeout: a frozen connection must not hold the answer.
async fn release(db: &Database, tx: oncely_sql::Tx) {
    drop(db.within_store_timeout(tx.rollback()).await);
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
