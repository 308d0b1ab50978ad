//! Atomic mode (the default): the reservation, the handler's business writes and the
//! stored answer commit in one transaction.
//!
//! reserve (in the transaction) → run the handler with the transaction lent through
//! [`IdempotentTx`](crate::IdempotentTx) → keep or roll back → read the answer → store it →
//! commit. [`run_in_tx`] is also the whole of [`TransactionLayer`](crate::TransactionLayer)
//! and of a request without a key where keys are optional.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{Request, StatusCode};
use oncely_core::{now_ms, Failure, OutcomeClass, RetryDecision, RetryPolicy};
use oncely_sql::{Database, IdempotencyStore, Reservation, ReservationToken, StoreError};
use tokio::sync::Mutex;
use tower::ServiceExt;

use crate::answer::{
    answer_existing, in_flight, outcome_unknown, panic_message, panicked, read_answer,
    store_problem, stored_response, NotStored,
};
use crate::cache::{ReplayCache, Settled};
use crate::extract::TxSlot;
use crate::metrics as metric;
use crate::problem::kind;
use crate::request::{Keyed, Route, Subject};
use crate::{IdempotencyConfig, Problem};

/// The wait between two looks at a key in flight (`in_flight_wait`): 10 ms doubling to
/// 200 ms, no jitter, while the next look starts within `within` of the first.
fn in_flight_polling(within: Duration) -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(10),
        cap: Duration::from_millis(200),
        max_attempts: u32::MAX,
        deadline: Some(within),
        ..RetryPolicy::default()
    }
}

/// Reserves the key and runs the handler under the reservation, or answers from the record
/// that holds it. While another request holds the key: 409 at once, or — with
/// `in_flight_wait` — polling with backoff (10 ms doubling to 200 ms, a [`RetryPolicy`])
/// until its outcome can be replayed or the wait is over.
pub(crate) async fn reserve_and_run<S: Route>(
    inner: S,
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    request: Keyed,
) -> Response {
    let polling = config.in_flight_wait.map(in_flight_polling);
    let started = Instant::now();
    let db = store.database().clone();
    for looks in 1.. {
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
                cache.remember(&request.scope, &request.key, &record);
                // `None`: still processing; wait below if configured.
                if let Some(res) = answer_existing(&record, &request.fingerprint) {
                    return res;
                }
            }
            Reservation::InFlight => release(&db, tx).await,
            _ => return store_problem(StoreError::NotHeld, config.retry_after_secs),
        }
        let look = Failure {
            failures: looks,
            class: OutcomeClass::NotSent,
            retry_after: None,
            elapsed: started.elapsed(),
            timed_out: false,
        };
        // Unit 1.0: the whole ceiling, no jitter. Gives up once the next look would start
        // at or after the end of the wait.
        match polling.map(|p| p.decide(&look, None, 1.0)) {
            Some(RetryDecision::RetryAfter(pause)) => tokio::time::sleep(pause).await,
            _ => break,
        }
    }
    in_flight(config.retry_after_secs)
}

/// Runs the handler under a fresh reservation, bounded by `execution_timeout`.
async fn execute<S: Route>(
    inner: S,
    store: IdempotencyStore,
    config: &IdempotencyConfig,
    cache: Arc<ReplayCache>,
    request: Keyed,
    tx: oncely_sql::Tx,
    token: ReservationToken,
) -> Response {
    // The key is reserved in `tx`, which nothing has committed: a crash frees it.
    oncely_core::failpoint::fail_point!("request.after_reserve");
    let (req, subject) = request.start();
    let claim = Claim {
        store,
        cache,
        token,
        subject,
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
pub(crate) struct Claim {
    store: IdempotencyStore,
    cache: Arc<ReplayCache>,
    token: ReservationToken,
    subject: Subject,
}

/// Runs `inner` with `tx` lent through the request extensions, then stores the answer (when
/// `claim` is given) and commits: run → keep or roll back → read the answer → store →
/// commit. Callers run it in a spawned task, so a client that hangs up mid-request cannot
/// cancel an operation half way: it runs to commit or rollback.
pub(crate) async fn run_in_tx<S: Route>(
    inner: S,
    req: Request<Body>,
    tx: oncely_sql::Tx,
    claim: Option<Claim>,
    max_stored_response: usize,
) -> Response {
    let (res, tx) = match run_handler(inner, req, tx).await {
        Ok(ran) => ran,
        Err(res) => return res,
    };
    // The handler's writes and the reservation are in `tx`, uncommitted.
    oncely_core::failpoint::fail_point!("request.after_handler");
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
    // The answer is stored beside the handler's writes; the commit decides for both.
    oncely_core::failpoint::fail_point!("request.before_commit");
    if let Err(e) = tx.commit().await {
        // The commit may or may not have happened; a retry with the same key finds out.
        tracing::warn!(error = %e, "commit failed; outcome unknown until the retry");
        return outcome_unknown("the commit could not be confirmed", 1);
    }
    // Committed, not answered: the client's retry must get this answer as a replay.
    oncely_core::failpoint::fail_point!("request.after_commit");
    if let Some((cache, subject, entry)) = settled {
        cache.insert(&subject.scope, &subject.key, entry);
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Runs the handler with `tx` in the request extensions and takes the transaction back.
/// A panic rolls back before answering 500: a transaction merely dropped is rolled back
/// when its connection is next used, and a retry arriving first would find the key still
/// reserved (MySQL: 409 in flight) although the answer said "retry".
async fn run_handler<S: Route>(
    inner: S,
    mut req: Request<Body>,
    tx: oncely_sql::Tx,
) -> Result<(Response, oncely_sql::Tx), Response> {
    let slot = TxSlot(Arc::new(Mutex::new(Some(tx))));
    req.extensions_mut().insert(slot.clone());
    let run = std::panic::AssertUnwindSafe(inner.oneshot(req));
    let res = match futures_util::FutureExt::catch_unwind(run).await {
        Ok(res) => res.unwrap_or_else(|e| match e {}),
        Err(panic) => {
            if let Some(tx) = slot.0.lock().await.take() {
                drop(tx.rollback().await);
            }
            return Err(panicked(&panic_message(panic.as_ref())));
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
type CacheEntry = (Arc<ReplayCache>, Subject, Settled);

/// Completes the claimed record with the answer in `tx`. When another transaction committed
/// the key first (the reservation was lost), this execution rolls back and the client gets
/// the committed answer; on a store error it rolls back and answers 503/500.
async fn store_outcome(
    claim: Claim,
    mut tx: oncely_sql::Tx,
    parts: &http::response::Parts,
    bytes: &Bytes,
) -> Result<(oncely_sql::Tx, CacheEntry), Response> {
    let Claim {
        store,
        cache,
        token,
        subject,
    } = claim;
    let stored = stored_response(parts, bytes);
    let now = now_ms();
    match store.complete(&mut tx, token, &stored, now).await {
        Ok(()) => {
            let entry = Settled::new(subject.fingerprint, stored, now, store.retention());
            Ok((tx, (cache, subject, entry)))
        }
        Err(StoreError::NotHeld) => {
            drop(tx.rollback().await);
            metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "lost_race").increment(1);
            Err(match store.lookup(&subject.scope, &subject.key).await {
                Ok(Some(record)) => {
                    answer_existing(&record, &subject.fingerprint).unwrap_or_else(|| in_flight(1))
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
