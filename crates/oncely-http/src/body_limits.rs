//! The request-body guard: the body bound, a total read deadline and a budget of body
//! bytes buffered at once, before any handler or layer sees the body.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, HttpBody as _};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use tokio::sync::Semaphore;

use crate::problem::kind;
use crate::{HttpLimits, Problem};

/// What [`read_body`] enforces on every request body before any handler or layer sees it:
/// the request-body bound, a total read deadline and the process-wide budget of buffered
/// body bytes (one permit per byte).
#[derive(Debug, Clone)]
pub struct BodyLimits {
    max_body: usize,
    deadline: Duration,
    budget: Arc<Semaphore>,
    budget_bytes: usize,
    retry_after_secs: u32,
}

impl BodyLimits {
    /// The guard of `limits` for bodies of at most `max_body` bytes (the idempotency
    /// layer's `max_request_body`); a busy refusal says `Retry-After: retry_after_secs`.
    /// Each call makes a budget of its own: build it once per process and clone it.
    pub fn new(limits: &HttpLimits, max_body: usize, retry_after_secs: u32) -> Self {
        let budget_bytes = limits
            .max_body_bytes_in_flight
            .clamp(1, Semaphore::MAX_PERMITS);
        Self {
            max_body,
            deadline: limits.body_read_timeout,
            budget: Arc::new(Semaphore::new(budget_bytes)),
            budget_bytes,
            retry_after_secs,
        }
    }

    /// The same guard (one budget, shared) for bodies of at most `max_body` bytes: one
    /// per route when routes bound their bodies differently.
    #[must_use]
    pub fn with_max_body(&self, max_body: usize) -> Self {
        Self {
            max_body,
            ..self.clone()
        }
    }

    /// Bytes a request reserves: its declared length, or the body bound when the length is
    /// unknown (chunked); never more than the whole budget, so one request can always run.
    fn reservation(&self, upper: Option<u64>) -> u32 {
        let want = upper.map_or(self.max_body, |u| {
            usize::try_from(u).unwrap_or(usize::MAX).min(self.max_body)
        });
        u32::try_from(want.min(self.budget_bytes)).unwrap_or(u32::MAX)
    }
}

/// Middleware: reads the request body in full — at most the request-body bound, within the
/// body deadline, and only with bytes reserved from the budget — and hands the rest of the
/// stack a buffered body. The reservation is held until the response is produced.
///
/// Answers, all `application/problem+json` with `Connection: close` (the body is left
/// unread or half read, so the connection cannot carry another request):
/// - 503 `server-busy` + `Retry-After` when the budget is spent. Not a wait: a waiting
///   request still holds its connection and its socket buffers and tells the client
///   nothing, while 503 + `Retry-After` is what oncely's retry policy (and most clients')
///   backs off on, and nothing has run, so the retry is safe;
/// - 408 `request-timeout` when the body has not arrived by the deadline (RFC 9110
///   §15.5.9);
/// - 413 `request-too-large` over the bound, before reading when `Content-Length` says so;
/// - 400 `request-body` when the body cannot be read (the client broke the framing).
///
/// The deadline is `tokio::time::timeout` around the whole read, not tower-http's
/// `RequestBodyTimeoutLayer`: its `TimeoutBody` restarts its timer on every frame (an idle
/// timeout), so a body trickled a byte at a time never trips it.
pub async fn read_body(State(limits): State<BodyLimits>, req: Request, next: Next) -> Response {
    let hint = req.body().size_hint();
    if hint.exact() == Some(0) {
        return next.run(req).await;
    }
    if hint.lower() > limits.max_body as u64 {
        linger(req.into_body(), limits.deadline).await;
        return too_large(limits.max_body);
    }
    let Ok(reserved) = limits
        .budget
        .clone()
        .try_acquire_many_owned(limits.reservation(hint.upper()))
    else {
        metrics::counter!(crate::metrics::HTTP_BODY_REJECTED_TOTAL, "reason" => "busy")
            .increment(1);
        return closing(
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                kind::SERVER_BUSY,
                "Too many request bodies are in flight",
            )
            .retry_after(limits.retry_after_secs),
        );
    };
    let (parts, body) = req.into_parts();
    let mut body = body;
    let read = Limited::new(&mut body, limits.max_body).collect();
    let bytes = match tokio::time::timeout(limits.deadline, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            linger(body, limits.deadline).await;
            return too_large(limits.max_body);
        }
        Ok(Err(_)) => {
            return closing(Problem::new(
                StatusCode::BAD_REQUEST,
                kind::REQUEST_BODY,
                "The request body could not be read",
            ));
        }
        Err(_) => {
            metrics::counter!(crate::metrics::HTTP_BODY_REJECTED_TOTAL, "reason" => "timeout")
                .increment(1);
            return closing(
                Problem::new(
                    StatusCode::REQUEST_TIMEOUT,
                    kind::REQUEST_TIMEOUT,
                    "The request body did not arrive in time",
                )
                .detail(format!(
                    "the whole body must arrive within {} s of the request head",
                    limits.deadline.as_secs_f64()
                )),
            );
        }
    };
    let res = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    drop(reserved);
    res
}

/// Most bytes of a refused body read and thrown away before the 413 ([`linger`]).
const LINGER_BYTES: u64 = 16 * 1024 * 1024;

/// Longest wait for the rest of a refused body before the 413 ([`linger`]).
const LINGER_FOR: Duration = Duration::from_secs(5);

/// Reads and discards what is left of a body the server refuses — at most [`LINGER_BYTES`],
/// within [`LINGER_FOR`] or `deadline`, whichever is shorter — so that the client, which is
/// still writing it, reads the 413 instead of a broken pipe: closing a connection whose
/// request body is unread makes the client's next write fail before it reads the answer (a
/// `reqwest` client sending 4 MiB got `BrokenPipe`). Nothing is buffered. nginx's
/// `lingering_close` does the same for the same reason.
async fn linger(mut body: Body, deadline: Duration) {
    let drain = async {
        let mut seen = 0u64;
        while seen < LINGER_BYTES {
            match body.frame().await {
                Some(Ok(frame)) => {
                    seen += frame.data_ref().map_or(0, |d| d.len() as u64);
                }
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_FOR.min(deadline), drain).await;
}

/// The idempotency layer's own 413 (same type, title and detail), answered here before the
/// body is buffered.
fn too_large(max_body: usize) -> Response {
    closing(
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            kind::REQUEST_TOO_LARGE,
            "The request body is too large",
        )
        .detail(format!("at most {max_body} bytes are accepted")),
    )
}

fn closing(problem: Problem) -> Response {
    let mut res = problem.into_response();
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}
