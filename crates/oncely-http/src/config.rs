use std::time::Duration;

use oncely_core::{FingerprintParts, JsonPointer};

/// How the idempotency layer behaves.
#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    /// Answer 400 when a `POST`/`PATCH` comes without `Idempotency-Key`. Default `true`.
    /// When `false`, such a request runs once in a plain transaction, unprotected by a key.
    pub require_key: bool,
    /// Largest request body read, in bytes; larger bodies get 413 before any reservation.
    /// Default 1 MiB.
    pub max_request_body: usize,
    /// Largest response body stored for replay, in bytes. In atomic mode a larger response
    /// is **not** committed: the transaction rolls back (no effect, the key stays free) and
    /// the client gets a 500 problem of type `response-too-large` — replays are
    /// byte-identical, so a response that cannot be stored must not have an effect either.
    /// In multi-phase mode the effect has happened (the provider answered): the first
    /// caller gets the whole answer, and what is stored for the retries is a 409
    /// `response-not-replayable` problem naming the first answer's status; the operation
    /// never runs again. Default 256 KiB.
    pub max_stored_response: usize,
    /// When a retry finds its key in flight: `None` answers 409 at once (with
    /// `Retry-After`); `Some(d)` waits up to `d`, polling with a backoff, then replays the
    /// first request's answer (or runs, if the first request rolled back). Default `None`.
    pub in_flight_wait: Option<Duration>,
    /// `Retry-After` sent with 409 (in flight) and 503 (store unreachable), in seconds.
    /// Default 1.
    pub retry_after_secs: u32,
    /// Bytes of finished outcomes kept in this process to answer replays without a
    /// database round trip (0 disables). Only committed, final records are cached, a hit
    /// still compares the fingerprint, and nothing is served past its `expires_at`. Each
    /// entry weighs its key and stored body plus 128 bytes, and one over a quarter of the
    /// budget is not cached. When the budget is full the least recently used entries leave
    /// first (a moka cache since issue 27; before it, first in first out); each entry
    /// leaves at its record's `expires_at`. Default 16 MiB.
    pub replay_cache_bytes: usize,
    /// Bound on one execution — handler, stored response and commit — once its key is
    /// reserved. Past it the execution is dropped (rolled back unless its commit already
    /// went out) and the client gets 503 `outcome-unknown` with `Retry-After`: the retry
    /// with the same key receives the outcome. Default 30 s.
    pub execution_timeout: Duration,
    /// What a request's fingerprint covers besides its method, route template and path:
    /// the whole body (default) or the values at some JSON pointers in it, and some
    /// request headers' values. A retry that differs in a covered part gets 422
    /// `idempotency-key-reused` naming `route`, `headers` or `body`. The default gives the
    /// digests stored before this option existed. A route whose body is narrowed to
    /// pointers answers 415 `unsupported-media-type` to a body that is not JSON.
    pub fingerprint: FingerprintParts,
    /// Where an operation's key comes from: the `Idempotency-Key` header (default) or a
    /// field of the JSON body ([`KeySource::Body`]).
    pub key_source: KeySource,
}

/// Where the idempotency layer reads an operation's key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// The `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header-07 §2).
    #[default]
    Header,
    /// A business key: the value at this JSON pointer (RFC 6901) in the request's JSON
    /// body, e.g. `/external_ref`. Two requests with the same value are the same operation
    /// within (tenant, route), whatever `Idempotency-Key` they carry; the header is then
    /// optional, must be well formed when sent (400), and identifies nothing (it reaches
    /// the handler unchanged). The value must be a JSON string or number (a number in its
    /// RFC 8785 form: `1e3` is `1000`) that is a valid key: 1–255 visible ASCII
    /// characters, not starting with `"`. Answers, before any reservation: 415
    /// `unsupported-media-type` for a body that is not JSON, 400 `malformed-json`, 400
    /// `business-key-missing` when the pointer finds nothing (or `null`), 422
    /// `business-key-invalid` for any other value that is not a key; each problem names
    /// the pointer, never the value. [`IdempotencyConfig::require_key`] does not apply.
    Body(JsonPointer),
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            require_key: true,
            max_request_body: 1024 * 1024,
            max_stored_response: 256 * 1024,
            in_flight_wait: None,
            retry_after_secs: 1,
            replay_cache_bytes: 16 * 1024 * 1024,
            execution_timeout: Duration::from_secs(30),
            fingerprint: FingerprintParts::default(),
            key_source: KeySource::Header,
        }
    }
}
