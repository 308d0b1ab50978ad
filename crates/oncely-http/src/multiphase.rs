//! Multi-phase mode (docs/DESIGN.md "Multi-phase idempotency, unknown outcomes,
//! reconciliation"): for a route whose handler calls an external provider in the request.
//!
//! reserve (commit `processing`, lease, fence) → run the handler outside any transaction
//! with its [`OperationContext`] → store its answer, fenced. A record found `processing`
//! under a live lease answers 409 with the status link; past its lease it turns `unknown`;
//! an `unknown` record is resolved by the [`Resolver`] (found → completed from the
//! provider and replayed; absent → taken over and run again with the same key; can't tell
//! → 409 with the status link) or, without one, answers 409. Never a second blind run.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use futures_util::future::BoxFuture;
use futures_util::FutureExt as _;
use http::request::Parts;
use http::{HeaderValue, StatusCode};
use oncely_core::{now_ms, IdempotencyKey, RecordState, Scope};
use oncely_sql::{IdempotencyStore, Lease, LeaseReservation, Record, StoreError};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use tower::ServiceExt;

use crate::answer::{
    answer_existing, mismatch, not_replayable, outcome_unknown, panic_message, panicked,
    read_bounded, replay, store_problem, stored_response, Bounded, NotStored, StoreServerError,
    IDEMPOTENT_REPLAYED,
};
use crate::cache::{ReplayCache, Settled};
use crate::metrics as metric;
use crate::problem::kind;
use crate::request::{Keyed, Route, Subject};
use crate::{IdempotencyConfig, Problem};

/// The settings of a multi-phase route ([`IdempotencyLayer::multi_phase`](crate::IdempotencyLayer::multi_phase)).
///
/// Answers this mode adds to the crate-level table:
///
/// | situation | answer |
/// |---|---|
/// | retry while the holder's lease runs | 409 `request-in-flight` + `Retry-After` + status link |
/// | retry after the lease ran out, no resolver (or it can't tell) | 409 `outcome-unknown` + status link |
/// | … resolver found the provider's object | the outcome it builds, stored, replayed (`Idempotent-Replayed: true`) |
/// | … found an object over the stored-response bound | the object, whole, to this caller (`Idempotent-Replayed: true`); 409 `response-not-replayable` stored for every later retry |
/// | … resolver says the provider has nothing | the handler runs again, same key, fence raised |
/// | handler answered 5xx without [`NotStored`] or [`StoreServerError`], panicked or ran past `execution_timeout` | its answer (or 500/503); the record turns `unknown` |
/// | handler answered 5xx with [`StoreServerError`] | its answer, stored and replayed |
/// | handler answered with [`NotStored`] (a 5xx too) | its answer; the record is deleted (it vouches nothing was sent) |
/// | holder's completion after a take-over | the current holder's stored outcome (or 409 while it runs) |
///
/// The status link is sent as `Link: <url>; rel="monitor"` (RFC 5989) and as the problem's
/// `status_url` member.
#[derive(Clone)]
pub struct MultiPhase {
    lease: Duration,
    status_link: Option<String>,
    resolver: Option<Arc<dyn Resolver>>,
}

impl fmt::Debug for MultiPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiPhase")
            .field("lease", &self.lease)
            .field("status_link", &self.status_link)
            .field("resolver", &self.resolver)
            .finish()
    }
}

impl MultiPhase {
    /// Multi-phase mode with holders leased for `lease`. It must exceed the longest a
    /// handler may take, its provider call's timeout included: past it, a retry treats the
    /// outcome as unknown and may (with a resolver that finds nothing) run it again.
    pub fn new(lease: Duration) -> Self {
        Self {
            lease,
            status_link: None,
            resolver: None,
        }
    }

    /// The URL of the operation's status resource, sent with 409s: `template` with
    /// `{key}` replaced by the key, percent-encoded (RFC 3986 §2.1; unreserved characters
    /// kept), e.g. `/v1/operations/{key}`.
    #[must_use]
    pub fn status_link(mut self, template: impl Into<String>) -> Self {
        self.status_link = Some(template.into());
        self
    }

    /// The status check run on an `unknown` record before any answer (see [`Resolver`]).
    #[must_use]
    pub fn resolver(mut self, resolver: impl Resolver + 'static) -> Self {
        self.resolver = Some(Arc::new(resolver));
        self
    }

    /// The lease of each holder.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    fn status_url(&self, key: &IdempotencyKey) -> Option<String> {
        Some(status_url(self.status_link.as_ref()?, key.as_str()))
    }

    /// `problem` as a response, with the operation's status link (the problem's
    /// `status_url` member and `Link: <url>; rel="monitor"`, RFC 5989) when the mode has a
    /// [`MultiPhase::status_link`]: for a handler's own answers that leave the operation
    /// unknown (the gateway's "sent, no answer").
    pub fn with_status_link(&self, key: &IdempotencyKey, problem: Problem) -> Response {
        self.with_link(key, problem)
    }

    /// `problem` with the status link, as a response.
    fn with_link(&self, key: &IdempotencyKey, problem: Problem) -> Response {
        let Some(url) = self.status_url(key) else {
            return problem.into_response();
        };
        let mut res = problem.with("status_url", url.as_str()).into_response();
        if let Ok(v) = HeaderValue::try_from(format!("<{url}>; rel=\"monitor\"")) {
            res.headers_mut().insert(http::header::LINK, v);
        }
        res
    }

    fn in_flight(&self, key: &IdempotencyKey, retry_after_secs: u32) -> Response {
        metrics::counter!(metric::IN_FLIGHT_TOTAL).increment(1);
        let problem = Problem::new(
            StatusCode::CONFLICT,
            kind::REQUEST_IN_FLIGHT,
            "A request with this Idempotency-Key is still being processed",
        )
        .detail("its holder is calling out; retry later with the same key, or query the status resource")
        .retry_after(retry_after_secs);
        self.with_link(key, problem)
    }

    fn unknown(&self, key: &IdempotencyKey, why: &str) -> Response {
        metrics::counter!(metric::UNKNOWN_TOTAL).increment(1);
        let problem = Problem::new(
            StatusCode::CONFLICT,
            kind::OUTCOME_UNKNOWN,
            "The outcome of the first request with this key is unknown",
        )
        .detail(format!(
            "{why}; the operation awaits a status check or reconciliation and will not run again blindly — query its status resource"
        ));
        self.with_link(key, problem)
    }
}

/// An operation's status URL: `template` (e.g. `/v1/operations/{key}`) with `{key}`
/// replaced by `key`, every character of it but RFC 3986's unreserved ones (§2.3)
/// percent-encoded (§2.1). The one encoding of a key in a link: the layer's 409s and a
/// handler's own answers (the order service's payments endpoint) use it.
pub fn status_url(template: &str, key: &str) -> String {
    template.replace(
        "{key}",
        &utf8_percent_encode(key, NOT_UNRESERVED).to_string(),
    )
}

/// What is percent-encoded in a key put in the status link: every character but RFC
/// 3986's unreserved ones (§2.3).
const NOT_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// What a multi-phase handler gets (request extension and axum extractor): the operation's
/// scope and key, the key of each outgoing call, and the fencing token of this holding.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OperationContext {
    /// Tenant and operation.
    pub scope: Scope,
    /// The caller's key.
    pub key: IdempotencyKey,
    /// The fencing token: 1 for the first holder, raised on each take-over. Pass it to
    /// writes of your own that must be fenced too.
    pub fence: i64,
    /// End of this holding's lease, Unix ms; finish (or stop calling out) before it.
    pub lease_until: i64,
}

impl OperationContext {
    /// The idempotency key of the outgoing call `step` (e.g. `"charge"`):
    /// [`oncely_core::derive_key`] of the scope, the caller's key and the step, generation
    /// 0 — the same for every holder of this operation, so a take-over re-sends the same key.
    pub fn derived_key(&self, step: &str) -> String {
        oncely_core::derive_key(&self.scope, &self.key, step, 0)
    }
}

/// The handler asked for [`OperationContext`] on a route that is not in multi-phase mode
/// (a wiring error): 500 problem `no-transaction`.
#[derive(Debug)]
pub struct ContextRejection;

impl IntoResponse for ContextRejection {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            kind::NO_TRANSACTION,
            "The route is not wrapped by a multi-phase idempotency layer",
        )
        .into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for OperationContext {
    type Rejection = ContextRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ContextRejection> {
        parts
            .extensions
            .get::<OperationContext>()
            .cloned()
            .ok_or(ContextRejection)
    }
}

/// The status check of an `unknown` record: asks the provider whether the operation took
/// effect, by the stable reference or the derived key the handler used.
///
/// Runs on a retry (same key and fingerprint) that found the record `unknown`, before any
/// answer. Object-safe (a boxed future), so a layer holds `Arc<dyn Resolver>`.
pub trait Resolver: Send + Sync + fmt::Debug {
    /// What the provider knows of the operation in `query`. A provider that cannot be asked
    /// now is [`Resolution::Unknown`]: the record stays `unknown` (nothing is counted
    /// against it).
    fn resolve<'a>(&'a self, query: ResolveQuery<'a>) -> BoxFuture<'a, Resolution>;
}

/// The operation a [`Resolver`] is asked about.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ResolveQuery<'a> {
    /// Scope, key and the record's current fence ([`OperationContext::derived_key`] gives
    /// the key the handler sent).
    pub context: &'a OperationContext,
    /// The retry's request head (same fingerprint as the first request's).
    pub request: &'a Parts,
    /// The retry's body, as fingerprinted.
    pub body: &'a [u8],
    /// The record as read.
    pub record: &'a Record,
}

/// What a [`Resolver`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Resolution {
    /// The provider has the effect: the answer the handler would have given (1xx–4xx; a
    /// 5xx counts as [`Resolution::Unknown`]). It is stored as the record's outcome and
    /// replayed; one with a body over `max_stored_response` goes whole to the retry that
    /// ran the check, and a 409 `response-not-replayable` is stored in its place.
    Found(Response),
    /// The provider has nothing for this operation, and its lookup can be trusted to show
    /// it by now: the handler may run again, with the same key.
    Absent,
    /// It cannot tell (a lookup that may lag, a provider down): the record stays `unknown`.
    Unknown(String),
}

/// Registers the mode's counters and gauges at 0 (see [`crate::metrics`]).
pub(crate) fn register_metrics() {
    for name in [
        metric::FENCED_TOTAL,
        metric::ABANDONED_TOTAL,
        metric::RESOLUTIONS_TOTAL,
    ] {
        metrics::counter!(name).increment(0);
    }
}

/// What one look at an existing record leads to.
enum Step {
    Answer(Response),
    Run(Lease),
    Again,
}

/// The shared pieces of one multi-phase request.
struct Ctx<'a> {
    store: &'a IdempotencyStore,
    config: &'a IdempotencyConfig,
    cache: &'a Arc<ReplayCache>,
    mode: &'a MultiPhase,
}

/// Reserves under a lease and runs, or answers from the record that holds the key. A
/// round that loses a race (another request completed, took over or expired the record
/// between the read and the write) reads again; three rounds at most, then 409.
pub(crate) async fn reserve_and_run<S: Route>(
    inner: S,
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
    cache: Arc<ReplayCache>,
    mode: Arc<MultiPhase>,
    request: Keyed,
) -> Response {
    let cx = Ctx {
        store: &store,
        config: &config,
        cache: &cache,
        mode: &mode,
    };
    let db = store.database().clone();
    for _ in 0..3 {
        let reserve = store.reserve_leased(
            &request.scope,
            &request.key,
            &request.fingerprint,
            now_ms(),
            mode.lease,
        );
        let step = match db.within_store_timeout(reserve).await {
            Err(e) => return store_problem(e, config.retry_after_secs),
            Ok(LeaseReservation::Leased(lease)) => Step::Run(lease),
            Ok(LeaseReservation::Existing(record)) => existing(&cx, &request, record).await,
            Ok(_) => return mode.in_flight(&request.key, config.retry_after_secs),
        };
        match step {
            Step::Answer(res) => return res,
            Step::Run(lease) => return execute(&cx, inner, request, lease).await,
            Step::Again => {}
        }
    }
    mode.in_flight(&request.key, config.retry_after_secs)
}

/// The answer for a committed record: 422 on another fingerprint, a replay when final, 409
/// while its lease runs; past its lease it turns `unknown` and is resolved.
async fn existing(cx: &Ctx<'_>, request: &Keyed, mut record: Record) -> Step {
    if let Some(res) = mismatch(&record.fingerprint, &request.fingerprint) {
        return Step::Answer(res);
    }
    match record.state {
        RecordState::Processing => {
            let now = now_ms();
            if record.lease_until.is_some_and(|until| until >= now) {
                return Step::Answer(cx.mode.in_flight(&request.key, cx.config.retry_after_secs));
            }
            let expire = cx
                .store
                .expire_lease(&request.scope, &request.key, record.fence, now);
            match expire.await {
                Ok(true) => {
                    record.state = RecordState::Unknown;
                    resolve(cx, request, &record).await
                }
                // Renewed, completed or taken over meanwhile: read it again.
                Ok(false) => Step::Again,
                Err(e) => Step::Answer(store_problem(e, cx.config.retry_after_secs)),
            }
        }
        RecordState::Unknown => resolve(cx, request, &record).await,
        _ => {
            cx.cache.remember(&request.scope, &request.key, &record);
            Step::Answer(
                answer_existing(&record, &request.fingerprint)
                    .unwrap_or_else(|| cx.mode.in_flight(&request.key, 1)),
            )
        }
    }
}

/// The status check of an `unknown` record, when a resolver is configured.
async fn resolve(cx: &Ctx<'_>, request: &Keyed, record: &Record) -> Step {
    let Some(resolver) = &cx.mode.resolver else {
        return Step::Answer(cx.mode.unknown(&request.key, "its holder's lease ran out"));
    };
    let context = OperationContext {
        scope: request.scope.clone(),
        key: request.key.clone(),
        fence: record.fence,
        lease_until: record.lease_until.unwrap_or(record.created_at),
    };
    let query = ResolveQuery {
        context: &context,
        request: &request.parts,
        body: &request.bytes,
        record,
    };
    match resolver.resolve(query).await {
        Resolution::Found(res) => found(cx, request, record.fence, res).await,
        Resolution::Absent => {
            metrics::counter!(metric::RESOLUTIONS_TOTAL, "outcome" => "absent").increment(1);
            let take = cx.store.take_over(
                &request.scope,
                &request.key,
                record.fence,
                now_ms(),
                cx.mode.lease,
            );
            match take.await {
                Ok(lease) => Step::Run(lease),
                Err(StoreError::NotHeld) => Step::Again,
                Err(e) => Step::Answer(store_problem(e, cx.config.retry_after_secs)),
            }
        }
        Resolution::Unknown(why) => {
            metrics::counter!(metric::RESOLUTIONS_TOTAL, "outcome" => "unknown").increment(1);
            Step::Answer(cx.mode.unknown(&request.key, &why))
        }
    }
}

/// Completes an `unknown` record (still under `fence`) from the resolver's answer and
/// replays it. An answer over the stored-response bound is treated as a first answer over
/// it: this caller gets it whole (marked replayed), the record keeps a 409
/// `response-not-replayable` for every later retry, and the operation never runs again.
async fn found(cx: &Ctx<'_>, request: &Keyed, fence: i64, res: Response) -> Step {
    if res.status().is_server_error() {
        metrics::counter!(metric::RESOLUTIONS_TOTAL, "outcome" => "unknown").increment(1);
        return Step::Answer(
            cx.mode
                .unknown(&request.key, "the status check answered a server error"),
        );
    }
    metrics::counter!(metric::RESOLUTIONS_TOTAL, "outcome" => "found").increment(1);
    let (parts, body) = res.into_parts();
    let max = cx.config.max_stored_response;
    let state = RecordState::for_status(parts.status.as_u16());
    let (stored, whole) = match read_bounded(body, max).await {
        Ok(Bounded::Whole(bytes)) => (stored_response(&parts, &bytes), None),
        Ok(Bounded::Over(body)) => (not_replayable(parts.status, max), Some(body)),
        Err(res) => return Step::Answer(res),
    };
    let now = now_ms();
    let retention = cx.store.retention();
    match cx
        .store
        .complete_unknown_as(&request.scope, &request.key, fence, state, &stored, now)
        .await
    {
        Ok(()) => {
            let settled = Settled::new(request.fingerprint, stored.clone(), now, retention);
            cx.cache.insert(&request.scope, &request.key, settled);
            metrics::counter!(metric::REPLAYS_TOTAL).increment(1);
            Step::Answer(match whole {
                None => replay(&stored),
                Some(body) => {
                    let mut res = Response::from_parts(parts, body);
                    res.headers_mut()
                        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                    res
                }
            })
        }
        Err(StoreError::NotHeld | StoreError::Fenced { .. }) => Step::Again,
        Err(e) => Step::Answer(store_problem(e, cx.config.retry_after_secs)),
    }
}

/// Runs the handler as the holder of `lease`, bounded by `execution_timeout`, then stores
/// its answer (fenced), releases the record ([`NotStored`]) or turns it `unknown` (5xx,
/// panic, timeout).
async fn execute<S: Route>(cx: &Ctx<'_>, inner: S, request: Keyed, lease: Lease) -> Response {
    // `processing` is committed under this holder's lease and fence; nothing has run.
    oncely_core::failpoint::fail_point!("multiphase.after_lease_commit");
    let (mut req, subject) = request.start();
    req.extensions_mut().insert(OperationContext {
        scope: subject.scope.clone(),
        key: subject.key.clone(),
        fence: lease.fence(),
        lease_until: lease.lease_until(),
    });
    let run = std::panic::AssertUnwindSafe(inner.oneshot(req)).catch_unwind();
    let res = match tokio::time::timeout(cx.config.execution_timeout, run).await {
        Ok(Ok(res)) => res.unwrap_or_else(|e| match e {}),
        Ok(Err(panic)) => {
            abandon(cx, &lease, "panic").await;
            return panicked(&panic_message(panic.as_ref()));
        }
        Err(_) => {
            abandon(cx, &lease, "timeout").await;
            return outcome_unknown("the operation did not finish in time", 1);
        }
    };
    settle(cx, &subject, lease, res).await
}

/// Stores the holder's answer `res`; on a lost fence, answers with the record as it is.
async fn settle(cx: &Ctx<'_>, request: &Subject, lease: Lease, res: Response) -> Response {
    // The handler vouches that nothing was sent (a 503 "nothing was charged" among them):
    // the key is free for the same retry at once, whatever the status.
    if res.extensions().get::<NotStored>().is_some() {
        if let Err(e) = cx.store.release_leased(lease).await {
            tracing::warn!(error = %e, "multi-phase release failed; the record stays until its lease ends");
        }
        return res;
    }
    if res.status().is_server_error() && res.extensions().get::<StoreServerError>().is_none() {
        abandon(cx, &lease, "5xx").await;
        return res;
    }
    let (parts, body) = res.into_parts();
    let max = cx.config.max_stored_response;
    let (stored, body) = match read_bounded(body, max).await {
        Ok(Bounded::Whole(bytes)) => (stored_response(&parts, &bytes), Body::from(bytes)),
        // It finished, too large to keep: the first caller gets it whole, a retry a
        // problem saying so, and it never runs twice.
        Ok(Bounded::Over(body)) => (not_replayable(parts.status, max), body),
        Err(res) => {
            abandon(cx, &lease, "response").await;
            return res;
        }
    };
    // The handler answered (its provider may have committed); the record says `processing`.
    oncely_core::failpoint::fail_point!("multiphase.after_answer");
    let now = now_ms();
    let state = RecordState::for_status(parts.status.as_u16());
    match cx
        .store
        .complete_leased_as(&lease, state, &stored, now)
        .await
    {
        Ok(()) => {
            let retention = cx.store.retention();
            let settled = Settled::new(request.fingerprint, stored, now, retention);
            cx.cache.insert(&request.scope, &request.key, settled);
            Response::from_parts(parts, body)
        }
        Err(e @ (StoreError::Fenced { .. } | StoreError::NotHeld)) => {
            if matches!(e, StoreError::Fenced { .. }) {
                metrics::counter!(metric::FENCED_TOTAL).increment(1);
            }
            tracing::warn!(error = %e, "a stale holder's outcome was not stored");
            current_outcome(cx, request).await
        }
        Err(e) => {
            tracing::warn!(error = %e, "storing the outcome failed; it stays processing until its lease ends");
            outcome_unknown(
                "the outcome could not be stored",
                cx.config.retry_after_secs,
            )
        }
    }
}

/// The record's outcome as it stands now (after this holder lost its fence).
async fn current_outcome(cx: &Ctx<'_>, request: &Subject) -> Response {
    match cx.store.lookup(&request.scope, &request.key).await {
        Ok(Some(record)) if record.state == RecordState::Unknown => cx
            .mode
            .unknown(&request.key, "the operation was taken over"),
        Ok(Some(record)) => answer_existing(&record, &request.fingerprint)
            .unwrap_or_else(|| cx.mode.in_flight(&request.key, cx.config.retry_after_secs)),
        Ok(None) => cx.mode.in_flight(&request.key, cx.config.retry_after_secs),
        Err(e) => store_problem(e, cx.config.retry_after_secs),
    }
}

/// Turns the holder's record `unknown` now: it may have called out before it failed.
async fn abandon(cx: &Ctx<'_>, lease: &Lease, reason: &'static str) {
    metrics::counter!(metric::ABANDONED_TOTAL, "reason" => reason).increment(1);
    if let Err(e) = cx.store.abandon_leased(lease, now_ms()).await {
        tracing::warn!(error = %e, "abandoning a multi-phase record failed; it turns unknown when its lease ends");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_link_percent_encodes_all_but_unreserved_characters() {
        let mode = MultiPhase::new(Duration::from_secs(1)).status_link("/v1/operations/{key}");
        let key = IdempotencyKey::parse(b"a/b%c?~_.-Z9").unwrap();
        assert_eq!(
            mode.status_url(&key).as_deref(),
            Some("/v1/operations/a%2Fb%25c%3F~_.-Z9")
        );
    }
}
