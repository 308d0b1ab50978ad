//! The request log: one `INFO` line per answered request, and the request id it carries.
//!
//! An operator reading it sees, for every request, what route it hit, who sent it, whether
//! it was a replay, and how long it took, without the concrete path (ids, keys) that would
//! make lines unsearchable or leak a client's key:
//!
//! ```text
//! INFO oncely::request: request method=POST route=/v1/orders status=201 tenant=acme
//!     replayed=false key_hash=3f1c9a0b52e4d7a1 duration_ms=4.2 request_id=0193…
//! ```
//!
//! In JSON mode (`ONCELY_LOG_FORMAT=json`) the same names are the line's `fields`.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use http::{HeaderName, HeaderValue};
use oncely_core::TenantId;
use sha2::{Digest, Sha256};

use crate::answer::IDEMPOTENT_REPLAYED;
use crate::request::IDEMPOTENCY_KEY;

/// The request id header: taken from the request when a proxy in front set one, else a new
/// UUIDv7, and written on the answer either way (`X-Request-Id`, the de-facto name that
/// Heroku, nginx and tower-http use).
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The `tracing` target of the request log, for a filter such as
/// `ONCELY_LOG=info,oncely::request=warn` (which turns it off).
pub const REQUEST_LOG_TARGET: &str = "oncely::request";

/// The longest request id taken from a client, in bytes; a longer or non-visible one is
/// replaced by a fresh id (a log line is not a place for a client's megabyte).
const MAX_REQUEST_ID: usize = 128;

/// Middleware (`axum::middleware::from_fn(oncely_http::log_request)`, added with
/// `Router::layer` so the route template is known): logs one line per request at `INFO`
/// on [`REQUEST_LOG_TARGET`] with
/// - `method`, `route` (the matched template, `unmatched` for none), `status`;
/// - `tenant` (from the [`TenantId`] that [`crate::TenantLayer`] puts on the answer; `-`
///   when the request was not authenticated);
/// - `replayed` (the answer carries `Idempotent-Replayed`);
/// - `key_hash`: the first 16 hex digits of SHA-256 of the `Idempotency-Key`, so lines of
///   one operation correlate without the key itself in the log (`-` without a key);
/// - `duration_ms` (wall time to the answer's head, ms) and `request_id` ([`REQUEST_ID`]).
///
/// The request id is put on the request (handlers and inner layers see it) and on the
/// answer.
pub async fn log_request(mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |m| m.as_str().to_owned());
    let method = req.method().clone();
    let key_hash = req
        .headers()
        .get(IDEMPOTENCY_KEY)
        .map_or_else(|| "-".to_owned(), |k| key_hash(k.as_bytes()));
    let request_id = request_id(req.headers().get(REQUEST_ID));
    req.headers_mut().insert(REQUEST_ID, request_id.clone());
    let mut res = next.run(req).await;
    let tenant = res
        .extensions()
        .get::<TenantId>()
        .map_or("-", TenantId::as_str)
        .to_owned();
    tracing::info!(
        target: REQUEST_LOG_TARGET,
        method = %method,
        route = %route,
        status = res.status().as_u16(),
        tenant = %tenant,
        replayed = res.headers().contains_key(IDEMPOTENT_REPLAYED),
        key_hash = %key_hash,
        duration_ms = started.elapsed().as_secs_f64() * 1000.0,
        request_id = request_id.to_str().unwrap_or("-"),
        "request"
    );
    res.headers_mut().insert(REQUEST_ID, request_id);
    res
}

/// The client's request id when it is 1 to [`MAX_REQUEST_ID`] visible ASCII characters,
/// else a new UUIDv7.
fn request_id(given: Option<&HeaderValue>) -> HeaderValue {
    given
        .filter(|v| {
            let b = v.as_bytes();
            !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(u8::is_ascii_graphic)
        })
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::now_v7().to_string())
                .expect("a UUID is a header value")
        })
}

/// The first 16 hex digits (64 bits) of SHA-256 of `key`'s bytes.
fn key_hash(key: &[u8]) -> String {
    let digest = Sha256::digest(key);
    format!(
        "{:016x}",
        u64::from_be_bytes(digest[..8].try_into().expect("8 of 32 bytes"))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_request_id_is_kept_only_when_it_is_short_and_visible() {
        let kept = HeaderValue::from_static("req-42");
        assert_eq!(request_id(Some(&kept)), kept);
        for bad in ["", "a b", &"x".repeat(129)] {
            let v = HeaderValue::from_str(bad).unwrap();
            let fresh = request_id(Some(&v));
            assert_ne!(fresh, v);
            assert!(uuid::Uuid::parse_str(fresh.to_str().unwrap()).is_ok());
        }
    }

    #[test]
    fn the_key_hash_is_16_hex_digits_of_sha256() {
        // SHA-256("abc") = ba7816bf8f01cfea…
        assert_eq!(key_hash(b"abc"), "ba7816bf8f01cfea");
    }
}
