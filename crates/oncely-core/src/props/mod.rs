//! Property tests (issue 28 item 5) of the code that parses and canonicalises untrusted
//! input: the `Idempotency-Key` value, the JSON canonicaliser (RFC 8785), the fingerprint,
//! the retry policy and `Retry-After` (RFC 9110 §10.2.3).
//!
//! Each property runs a fixed number of cases ([`config`]); `PROPTEST_CASES` overrides it.
//! Failures are not persisted to files: every shrunk failure found is kept as a named
//! `#[test]` with its exact input, next to the property that found it.

mod fingerprint;
mod json;
mod key;
mod retry;

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
