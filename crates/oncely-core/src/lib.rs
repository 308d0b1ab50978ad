//! Core types of oncely: the vocabulary every other crate speaks, with no I/O.
//!
//! One business operation must have one business effect however often its request is
//! delivered. The types here make the inputs to that guarantee impossible to get wrong:
//! an [`IdempotencyKey`] can only be built from a valid header value, a [`Scope`] always
//! carries the authenticated [`TenantId`], and a [`Fingerprint`] is always computed over
//! the canonical request.
//!
//! # Layout
//! - `key` — [`IdempotencyKey`] and [`KeyError`]: the caller's key, validated
//!   (draft-ietf-httpapi-idempotency-key-header-07 §2, RFC 8941 §3.3.3).
//! - `scope` — [`TenantId`], [`Operation`], [`Scope`]: who asked for which operation.
//! - `fingerprint` — [`Fingerprint`], [`FingerprintMismatch`]: SHA-256 over the canonical
//!   request, JSON bodies in RFC 8785 (JCS) form; [`FingerprintParts`], what it covers (the
//!   whole body or some JSON pointers in it, some headers); [`parse_i_json`], the JSON
//!   reading it uses (RFC 7493 I-JSON: no duplicate member names).
//! - `pointer` — [`JsonPointer`]: an RFC 6901 pointer into a JSON body, validated.
//! - `record` — [`RecordState`], [`StoredResponse`], the replay header allow-list.
//! - `time` — [`now_ms`]: wall-clock milliseconds, the unit every stored timestamp uses;
//!   [`millis`] and [`ms_after`]: a `Duration` in that unit.
//! - `words` — [`stored_words!`]: an enum stored as one word per value, and
//!   [`UnknownWord`].
//! - `chain` — [`error_chain`]: an error and its causes as one line, for logs and evidence.
//! - `message` — [`MessageId`]: message identity, derived from the operation's key when an
//!   idempotent operation produces the message.
//! - `retry` — [`RetryPolicy`]: exponential backoff with full jitter, cap, attempt limit,
//!   deadline and `Retry-After`; [`OutcomeClass`] of a failed attempt and the
//!   [`RetryDecision`] it leads to, the [`OutageWait`] of a dependency that is down;
//!   [`parse_retry_after`] (RFC 9110 §10.2.3).
//! - `budget` — [`RetryBudget`]: a per-dependency retry token bucket (the AWS SDKs' model).
//! - `failpoint` — named crash points ([`fail_point!`]) and their [`failpoint::setup`]
//!   from `FAILPOINTS`; nothing without the `failpoints` feature.
//! - `derive` — [`derive_key`], [`next_key`]: the idempotency key of an outgoing call,
//!   derived from its parent operation's scope, key and step (UUIDv8 over SHA-256).
//! - `props` (tests only) — property tests (proptest) of the key parser, the JSON
//!   canonicaliser, the fingerprint and the retry policy.

mod budget;
mod chain;
mod derive;
pub mod failpoint;
mod fingerprint;
mod key;
mod message;
mod pointer;
#[cfg(test)]
mod props;
mod record;
mod retry;
mod scope;
mod time;
mod words;

pub use budget::RetryBudget;
pub use chain::error_chain;
pub use derive::{derive_key, next_key};
pub use fingerprint::{
    is_json_media_type, parse_i_json, Fingerprint, FingerprintError, FingerprintInput,
    FingerprintMismatch, FingerprintParts,
};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use message::{MessageId, MessageIdError};
pub use pointer::{JsonPointer, PointerError};
pub use record::{
    is_replayable_header, RecordState, StoredResponse, StoredResponseError, REPLAYABLE_HEADERS,
};
pub use retry::{
    parse_retry_after, Failure, GiveUpReason, OutageWait, OutcomeClass, RetryDecision, RetryPolicy,
};
pub use scope::{Operation, Scope, TenantError, TenantId};
pub use time::{millis, ms_after, now_ms, rfc3339};
pub use words::UnknownWord;
