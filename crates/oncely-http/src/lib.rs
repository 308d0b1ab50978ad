//! HTTP server side of oncely: a tower [`Layer`](tower::Layer) that makes `POST`/`PATCH`
//! handlers idempotent under the `Idempotency-Key` header
//! (draft-ietf-httpapi-idempotency-key-header-07), and an axum extractor that hands the
//! handler the transaction in which the key was reserved.
//!
//! In atomic mode (the default) the reservation, the handler's business writes and
//! the stored response commit in **one** transaction: an order and its idempotency record
//! exist together or not at all. A handler error, panic, 5xx answer or failed commit leaves
//! nothing behind, so the key is free for the retry. Routes whose handlers call an
//! external provider use multi-phase mode instead ([`IdempotencyLayer::multi_phase`],
//! [`MultiPhase`]): the reservation commits first under a lease and a fencing token, and
//! an outcome left unknown is resolved by a status check, never by running again blindly.
//!
//! | situation | answer |
//! |---|---|
//! | key required and missing | 400 problem |
//! | key malformed | 400 problem |
//! | body over the request bound | 413 problem |
//! | first request | run, store, answer |
//! | retry, same fingerprint, finished | stored answer + `Idempotent-Replayed: true` |
//! | retry, same fingerprint, in flight | 409 problem + `Retry-After`, or a bounded wait then replay |
//! | retry, other fingerprint | 422 problem naming `route`, `headers` or `body` |
//! | business-key route ([`KeySource::Body`]): no value at the pointer / not a key | 400 `business-key-missing` / 422 `business-key-invalid` |
//! | record `unknown` | 409 problem |
//! | store unreachable, or acquire + `BEGIN` + claim over the store timeout (`DbOptions::store_timeout`) | 503 problem `store-unavailable` + `Retry-After` |
//! | handler, stored response and commit over `execution_timeout` | 503 problem `execution-outcome-unknown` + `Retry-After` |
//! | response body over the stored-response bound | atomic: 500 problem; rolled back, nothing stored. Multi-phase: the whole answer to the first caller, 409 `response-not-replayable` to every retry |
//! | an extractor of this crate refused the request before the handler ran | its 400/415/422 problem; nothing stored |
//!
//! # Refusals before the handler runs
//! An answer is stored under its key unless it is a 5xx or carries [`NotStored`]. axum's
//! own extractors answer their rejections (a body that does not deserialize: 422; a bad
//! path or query: 400) without that mark, so with them a malformed request is stored, and
//! the corrected retry with the same key gets `422 idempotency-key-reused`. Take this
//! crate's [`Json`], [`Path`] and [`Query`] instead (the same extractors, with a
//! problem+json [`Rejection`] marked [`NotStored`]), and wrap any other extractor in
//! [`Unstored`]:
//!
//! ```
//! use oncely_http::{IdempotentTx, Json, Path};
//! # #[derive(serde::Deserialize)] struct NewTransfer { amount_minor: i64 }
//! async fn create(Path(account): Path<String>, tx: IdempotentTx, Json(t): Json<NewTransfer>) {
//!     // Runs only for a well-formed request; a malformed one left the key free.
//! #   let _ = (account, tx, t.amount_minor);
//! }
//! ```
//!
//! To store such a refusal anyway (the client must mint a new key to correct it), take
//! `Result<Json<T>, Rejection>` and answer [`Rejection::stored`], or keep axum's extractor.
//!
//! # Layout
//! Request parsing and the answers at the bottom, one module per mode above them, and the
//! layer on top, which reads the keyed request and matches on the mode.
//! - `config` — [`IdempotencyConfig`]: key requirement and source ([`KeySource`]: the
//!   header or a business key in the body), what the fingerprint covers, size bounds,
//!   in-flight policy.
//! - `request` — the keyed request: its scope, `Idempotency-Key`, bounded body and
//!   fingerprint, read once by the layer for either mode.
//! - `answer` — the answers both modes give: a missing key, replays
//!   ([`IDEMPOTENT_REPLAYED`]), fingerprint mismatches, in-flight and unknown outcomes,
//!   store failures, panics, [`NotStored`], and the stored form of a handler's answer.
//! - `cache` — the per-process cache of finished outcomes that serves replays without a
//!   database round trip (moka, weighed in bytes, each entry expiring with its record).
//! - `extract` — [`IdempotentTx`], the handler's transaction, and [`IdempotencyContext`].
//! - `reject` — [`Json`], [`Path`], [`Query`], [`Unstored`]: extractors whose
//!   [`Rejection`] leaves the key free.
//! - `atomic` — atomic mode: reservation, handler and stored answer in one transaction,
//!   the in-flight wait (a [`RetryPolicy`](oncely_core::RetryPolicy)).
//! - `multiphase` — multi-phase mode: [`MultiPhase`], [`OperationContext`] (the handler's
//!   key, derived keys and fencing token), [`Resolver`] / [`Resolution`].
//! - `layer` — [`IdempotencyLayer`] / [`Idempotency`] (the service: parse, cached outcome,
//!   then the mode) and [`TransactionLayer`] (the same transaction handling without keys).
//! - `lease` — the lease sweep of multi-phase records with its gauges ([`sweep_leases`],
//!   [`lease_sweep`] for a `Retention` runner, [`record_lease_gauges`]).
//! - `metrics` — the names of the metrics the layer records.
//! - `tenant` — [`TenantLayer`]: the service's own tenant extraction
//!   ([`TenantExtractor`]: a function of the request head, or bearer [`ApiKeys`]), which
//!   puts the [`TenantId`](oncely_core::TenantId) the layer scopes keys by into the request
//!   (and on the answer, for the request log).
//! - `request_log` — [`log_request`]: one `INFO` line per request (route template, status,
//!   tenant, replayed, key hash, duration, [`REQUEST_ID`]).
//! - `problem` — [`Problem`], RFC 9457 problem details, and the stable `type` URIs;
//!   [`StoreFailure`], the one mapping of store errors to answers (503 when unreachable).
//! - `server` — [`serve_http`], the HTTP/1.1 accept loop with the slow-client and
//!   connection limits of [`HttpLimits`]; `body_limits` — [`read_body`], the request-body
//!   guard (bound, total read deadline, budget of bytes in flight).
//! - `props` (tests only) — property tests (proptest) of the key header, the request
//!   fingerprint and the store-error answers.

mod answer;
mod atomic;
mod body_limits;
mod cache;
mod config;
mod extract;
mod layer;
mod lease;
pub mod metrics;
mod multiphase;
mod problem;
#[cfg(test)]
mod props;
mod reject;
mod request;
mod request_log;
mod server;
mod tenant;

pub use answer::{NotStored, StoreServerError, IDEMPOTENT_REPLAYED};
pub use body_limits::{read_body, BodyLimits};
pub use config::{IdempotencyConfig, KeySource};
pub use extract::{IdempotencyContext, IdempotentTx, TxRejection};
pub use layer::{Idempotency, IdempotencyLayer, Transaction, TransactionLayer};
pub use lease::{lease_sweep, record_lease_gauges, sweep_leases};
pub use multiphase::{
    status_url, ContextRejection, MultiPhase, OperationContext, Resolution, ResolveQuery, Resolver,
};
pub use problem::{kind, Problem, StoreFailure, PROBLEM_JSON};
pub use reject::{Json, Path, Query, Rejection, Unstored};
pub use request_log::{log_request, REQUEST_ID, REQUEST_LOG_TARGET};
pub use server::{serve_http, HttpLimits};
pub use tenant::{
    bearer, parse_api_keys, ApiKeys, ApiKeysError, Tenant, TenantExtractor, TenantLayer,
};
