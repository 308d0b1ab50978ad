//! The layers: [`IdempotencyLayer`] reads the keyed request and hands it to its mode
//! ([`atomic`](crate::atomic) or [`multiphase`](crate::multiphase)); [`TransactionLayer`]
//! runs requests in a transaction without keys.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use futures_util::future::BoxFuture;
use http::{Method, Request};
use oncely_core::now_ms;
use oncely_sql::{Database, IdempotencyStore};
use tower::{Layer, Service, ServiceExt};

use crate::answer::{answer, key_missing, panicked, store_problem};
use crate::atomic::{self, run_in_tx};
use crate::cache::ReplayCache;
use crate::extract::IdempotencyContext;
use crate::metrics as metric;
use crate::multiphase::{self, MultiPhase};
use crate::request::{body_key, fingerprint_of, key_of, read_body, scope_of, Keyed, Route};
use crate::{IdempotencyConfig, KeySource};

/// The future of the layers' services: the spawned handling of one request.
type Handling = BoxFuture<'static, Result<Response, Infallible>>;

/// How a layer runs the handler under a key.
#[derive(Debug, Clone)]
enum Mode {
    /// One transaction for reservation, business writes and stored answer.
    Atomic,
    /// Reservation committed first under a lease and a fence.
    MultiPhase(Arc<MultiPhase>),
}

/// What a layer and each of its services share.
#[derive(Debug)]
struct Guard {
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    mode: Mode,
}

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
    guard: Arc<Guard>,
}

impl IdempotencyLayer {
    /// A layer storing records in `store`.
    pub fn new(store: IdempotencyStore, config: IdempotencyConfig) -> Self {
        // Counters show 0 from the start, so `rate()` and alerts see them before the first
        // event.
        for name in metric::COUNTERS {
            metrics::counter!(*name).increment(0);
        }
        let guard = Guard {
            store,
            cache: Arc::new(ReplayCache::new(config.replay_cache_bytes)),
            config: Arc::new(config),
            mode: Mode::Atomic,
        };
        Self {
            guard: Arc::new(guard),
        }
    }

    /// This layer in multi-phase mode: the reservation commits first as `processing` under
    /// a lease and a fencing token, the handler runs outside any transaction (it takes
    /// [`OperationContext`](crate::OperationContext), not
    /// [`IdempotentTx`](crate::IdempotentTx)), and its answer is stored by the holder of the
    /// current fence only. See [`MultiPhase`] for the answers this mode adds.
    #[must_use]
    pub fn multi_phase(self, mode: MultiPhase) -> Self {
        multiphase::register_metrics();
        let guard = Guard {
            store: self.guard.store.clone(),
            config: self.guard.config.clone(),
            cache: self.guard.cache.clone(),
            mode: Mode::MultiPhase(Arc::new(mode)),
        };
        Self {
            guard: Arc::new(guard),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            guard: self.guard.clone(),
        }
    }
}

/// The service built by [`IdempotencyLayer`].
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    guard: Arc<Guard>,
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

/// `Service` for a layer's service `$service { inner, $field }`: each call takes the ready
/// inner service and runs `$handle(inner, $field.clone(), request)` in a task of its own
/// (see [`spawned`]).
macro_rules! spawning_service {
    ($service:ident, $field:ident, $handle:expr) => {
        impl<S> Service<Request<Body>> for $service<S>
        where
            S: Route + Clone,
        {
            type Response = Response;
            type Error = Infallible;
            type Future = Handling;

            fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
                self.inner.poll_ready(cx)
            }

            fn call(&mut self, req: Request<Body>) -> Self::Future {
                // The clone is not ready; the service `poll_ready` readied is the one used.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                spawned($handle(inner, self.$field.clone(), req))
            }
        }
    };
}

spawning_service!(Transaction, db, in_transaction);
spawning_service!(Idempotency, guard, handle);

/// [`TransactionLayer`]'s handling of one request.
async fn in_transaction<S: Route>(inner: S, db: Database, req: Request<Body>) -> Response {
    match db.begin().await {
        Ok(tx) => run_in_tx(inner, req, tx, None, usize::MAX).await,
        Err(e) => store_problem(e, 1),
    }
}

/// Runs a request's handling in its own task: once a request has been received, a client
/// hanging up (which makes the server drop the service future) cannot cancel it between
/// reservation and commit. A panic in the task becomes a 500 problem. A task cancelled
/// (the only canceller is the runtime shutting down: the process is going away) answers
/// nothing: its outcome is not known here, so neither "failed" nor "nothing was stored" may
/// be said, and the connection closes unanswered as it would in a kill.
fn spawned(handling: impl Future<Output = Response> + Send + 'static) -> Handling {
    let task = tokio::spawn(handling);
    Box::pin(async move {
        match task.await {
            Ok(answer) => Ok(answer),
            Err(e) if e.is_cancelled() => std::future::pending().await,
            Err(e) => Ok(panicked(&e.to_string())),
        }
    })
}

/// The layer's path for one request, in its named steps: tenant and route → key → body →
/// fingerprint → cached outcome → the mode (reserve → run → store). Each step either hands
/// its result on or answers.
async fn handle<S: Route>(inner: S, guard: Arc<Guard>, req: Request<Body>) -> Response {
    if !(req.method() == Method::POST || req.method() == Method::PATCH) {
        return inner.oneshot(req).await.unwrap_or_else(|e| match e {});
    }
    let Guard {
        store,
        config,
        cache,
        mode,
    } = &*guard;
    let (mut parts, body) = req.into_parts();
    let (scope, template) = match scope_of(&parts) {
        Ok(found) => found,
        Err(res) => return res,
    };
    // The header is checked on every route; on a business-key route it identifies nothing.
    let header_key = match key_of(&parts.headers) {
        Ok(key) => key,
        Err(res) => return res,
    };
    if header_key.is_none() && config.key_source == KeySource::Header {
        if config.require_key {
            return key_missing();
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
    }
    let bytes = match read_body(body, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err(res) => return res,
    };
    let key = match &config.key_source {
        KeySource::Body(pointer) => body_key(&parts, &bytes, pointer),
        _ => header_key.ok_or_else(key_missing),
    };
    let key = match key {
        Ok(key) => key,
        Err(res) => return res,
    };
    let fingerprint = match fingerprint_of(&parts, &template, &bytes, &config.fingerprint) {
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
    let (store, config, cache) = (store.clone(), config.clone(), cache.clone());
    match mode {
        Mode::Atomic => atomic::reserve_and_run(inner, store, config, cache, request).await,
        Mode::MultiPhase(mode) => {
            let mode = mode.clone();
            multiphase::reserve_and_run(inner, store, config, cache, mode, request).await
        }
    }
}
