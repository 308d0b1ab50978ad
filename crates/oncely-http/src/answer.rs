//! The answers both modes give: a missing key, replays, mismatches, in-flight and unknown
//! outcomes, store failures, panics, and the stored form of a handler's answer.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use oncely_core::{Fingerprint, RecordState, StoredResponse};
use oncely_sql::{Record, StoreError};

use crate::metrics as metric;
use crate::problem::kind;
use crate::{Problem, StoreFailure};

/// `Idempotent-Replayed`: sent as `true` on every replayed answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Response extension a handler sets on an answer that must leave nothing behind: the
/// layer rolls the transaction back and stores no outcome, exactly as for an error found
/// before the reservation. Use it for input validation failures (400/422), so a client that
/// fixes its request can retry with the same key. Deliberate business rejections (e.g. a
/// conflicting order) are *not* marked: they are stored and replayed like successes.
#[derive(Debug, Clone, Copy, Default)]
pub struct NotStored;

/// Response extension a multi-phase handler sets on a **5xx** answer that is the
/// operation's outcome and must be stored and replayed like a 4xx (as
/// draft-ietf-httpapi-idempotency-key-header-07 §2.6 and Stripe do), instead of turning the
/// record `unknown`. For a handler that knows the 5xx is final (the gateway's routes with
/// `on_5xx = "store"`). Without it a 5xx is never stored. Atomic mode ignores it.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreServerError;

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

pub(crate) fn in_flight(retry_after_secs: u32) -> Response {
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

/// The handler's answer body, at most `max_stored_response` bytes: what is stored is what
/// is replayed, so an answer that cannot be stored whole is not given (500; the caller
/// rolls back). Atomic mode's read, where a rollback undoes the operation.
pub(crate) async fn read_answer(body: Body, max_stored_response: usize) -> Result<Bytes, Response> {
    match read_bounded(body, max_stored_response).await? {
        Bounded::Whole(bytes) => Ok(bytes),
        Bounded::Over(_) => {
            metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "response_too_large")
                .increment(1);
            Err(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                kind::RESPONSE_TOO_LARGE,
                "The response is too large to store for replay",
            )
            .detail(format!(
                "responses over {max_stored_response} bytes are not stored; the operation was rolled back"
            ))
            .into_response())
        }
    }
}

/// An answer body read against the stored-response bound.
pub(crate) enum Bounded {
    /// The whole body, within the bound.
    Whole(Bytes),
    /// Over the bound: the same body, whole (the part already read, then the rest as it
    /// comes), for the first caller.
    Over(Body),
}

/// Reads `body` until it ends or passes `max` bytes, without losing what was read.
/// `http_body_util::Limited` discards the bytes read once the limit trips, and a
/// multi-phase answer over the bound must still reach its first caller whole.
///
/// # Errors
/// 500 `response-body` when the body fails before the bound is passed.
pub(crate) async fn read_bounded(mut body: Body, max: usize) -> Result<Bounded, Response> {
    let mut read: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                len += data.len();
                read.push(data);
                if len > max {
                    let head =
                        futures_util::stream::iter(read.into_iter().map(Ok::<_, axum::Error>));
                    let rest = futures_util::StreamExt::chain(head, body.into_data_stream());
                    return Ok(Bounded::Over(Body::from_stream(rest)));
                }
            }
            Some(Err(_)) => {
                metrics::counter!(metric::ROLLBACKS_TOTAL, "reason" => "response_body")
                    .increment(1);
                return Err(Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    kind::RESPONSE_BODY,
                    "The response body failed",
                )
                .into_response());
            }
        }
    }
    let mut whole = bytes::BytesMut::with_capacity(len);
    for chunk in read {
        whole.extend_from_slice(&chunk);
    }
    Ok(Bounded::Whole(whole.freeze()))
}

/// What a retry is answered with for an operation that finished with `status` but whose
/// answer was over `max` bytes: 409 `response-not-replayable`, stored in its place.
pub(crate) fn not_replayable(status: StatusCode, max: usize) -> StoredResponse {
    let problem = Problem::new(
        StatusCode::CONFLICT,
        kind::RESPONSE_NOT_REPLAYABLE,
        "The operation finished, but its answer cannot be replayed",
    )
    .detail(format!(
        "the first request with this key was answered with status {} and a body over the {max}-byte bound for stored answers; that answer went to the first caller only, and the operation will not run again — read its result from the service",
        status.as_u16()
    ))
    .with("answered_status", status.as_u16());
    let body = serde_json::to_vec(&problem).unwrap_or_default();
    StoredResponse::new(
        StatusCode::CONFLICT.as_u16(),
        [("content-type", "application/problem+json")],
        body,
    )
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

/// 400: the route requires an `Idempotency-Key` and the request has none.
pub(crate) fn key_missing() -> Response {
    metrics::counter!(metric::REJECTED_TOTAL, "reason" => "missing_key").increment(1);
    Problem::new(
        StatusCode::BAD_REQUEST,
        kind::IDEMPOTENCY_KEY_MISSING,
        "This operation requires an Idempotency-Key header",
    )
    .detail("mint one key (e.g. a UUIDv7) per operation and send it on every retry")
    .into_response()
}

/// The message of a caught panic's payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
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
