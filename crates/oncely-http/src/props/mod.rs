//! Property tests (issue 28 item 5) of what the layer reads from untrusted requests — the
//! `Idempotency-Key` header ([`key_of`](crate::request::key_of)) and the fingerprinted
//! body ([`fingerprint_of`](crate::request::fingerprint_of)) — and of the one mapping of
//! store errors to RFC 9457 answers ([`StoreFailure`](crate::StoreFailure)).
//!
//! Each property runs a fixed number of cases ([`config`]); `PROPTEST_CASES` overrides it.
//! Failures are not persisted to files: every shrunk failure found is kept as a named
//! `#[test]` with its exact input, next to the property that found it.

mod request;
mod store;

use axum::response::Response;
use futures_util::FutureExt as _;
use http_body_util::BodyExt as _;
use proptest::test_runner::Config;

/// A proptest configuration of `cases` cases (or `PROPTEST_CASES` when set), with no
/// failure files.
pub(crate) fn config(cases: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

/// The problem in `res`: its status, `Content-Type`, `Retry-After` and JSON body. The
/// body of a problem is in memory, so it is read without a runtime.
pub(crate) fn problem_of(
    res: Response,
) -> (
    http::StatusCode,
    Option<String>,
    Option<String>,
    serde_json::Value,
) {
    let header = |name| {
        res.headers()
            .get(name)
            .map(|v: &http::HeaderValue| v.to_str().unwrap().to_owned())
    };
    let (content_type, retry_after) = (
        header(http::header::CONTENT_TYPE),
        header(http::header::RETRY_AFTER),
    );
    let status = res.status();
    let body = res
        .into_body()
        .collect()
        .now_or_never()
        .expect("an in-memory body")
        .expect("readable")
        .to_bytes();
    let json = serde_json::from_slice(&body).expect("a JSON problem body");
    (status, content_type, retry_after, json)
}
