use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use oncely_sql::StoreError;
use serde::Serialize;

/// The problem kinds this crate answers with: the last segment of each `type` URI
/// (`urn:oncely:problem:<kind>`), stable across releases so clients can branch on them.
pub mod kind {
    /// 401: no tenant in the request extensions (authentication did not run or failed).
    pub const UNAUTHENTICATED: &str = "unauthenticated";
    /// 400: the `Idempotency-Key` header is not a valid key, or there is more than one.
    pub const IDEMPOTENCY_KEY_MALFORMED: &str = "idempotency-key-malformed";
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    pub const IDEMPOTENCY_KEY_MISSING: &str = "idempotency-key-missing";
    /// 422: the key was first used with a different request (its `differs` member names
    /// `route`, `headers` or `body`).
    pub const IDEMPOTENCY_KEY_REUSED: &str = "idempotency-key-reused";
    /// 400: the route takes its key from the JSON body
    /// ([`KeySource::Body`](crate::KeySource::Body)) and the body has no value (or `null`)
    /// at that pointer (its `pointer` member).
    pub const BUSINESS_KEY_MISSING: &str = "business-key-missing";
    /// 422: the route takes its key from the JSON body and the value at that pointer (its
    /// `pointer` member) is not a string or number forming a valid key.
    pub const BUSINESS_KEY_INVALID: &str = "business-key-invalid";
    /// 409 + `Retry-After`: the first request with this key is still being processed.
    pub const REQUEST_IN_FLIGHT: &str = "request-in-flight";
    /// 409: the record is `unknown`; its outcome awaits a status check or reconciliation.
    pub const OUTCOME_UNKNOWN: &str = "outcome-unknown";
    /// 503 + `Retry-After`: the execution ran out of time or its commit was not confirmed; the retry learns the outcome.
    pub const EXECUTION_OUTCOME_UNKNOWN: &str = "execution-outcome-unknown";
    /// 503 + `Retry-After`: the store cannot be reached; nothing was stored.
    pub const STORE_UNAVAILABLE: &str = "store-unavailable";
    /// 500: the store failed for another reason (a bug or corrupt data); nothing was stored.
    pub const STORE_ERROR: &str = "store-error";
    /// 413: the request body is over the bound.
    pub const REQUEST_TOO_LARGE: &str = "request-too-large";
    /// 503 + `Retry-After`: the budget of request-body bytes in flight is spent; nothing
    /// ran ([`read_body`](crate::read_body)).
    pub const SERVER_BUSY: &str = "server-busy";
    /// 408: the request body did not arrive within the body deadline
    /// ([`read_body`](crate::read_body)).
    pub const REQUEST_TIMEOUT: &str = "request-timeout";
    /// 400: the request body could not be read.
    pub const REQUEST_BODY: &str = "request-body";
    /// 400: a JSON request body that does not parse, so it has no fingerprint.
    pub const MALFORMED_JSON: &str = "malformed-json";
    /// 415: a body that must be `application/json` was sent as something else.
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported-media-type";
    /// 422: a JSON body that parses but does not have the operation's shape (a missing or
    /// unknown field, a value of the wrong type).
    pub const INVALID_BODY: &str = "invalid-body";
    /// 400: a path parameter that does not have the form the route takes.
    pub const INVALID_PATH: &str = "invalid-path";
    /// 400: query parameters that are missing, unknown or of the wrong type, or a value
    /// the operation does not take.
    pub const INVALID_QUERY: &str = "invalid-query";
    /// 500: a finished record without its stored response.
    pub const RECORD_CORRUPT: &str = "record-corrupt";
    /// 500: the handler's answer is over the stored-response bound; rolled back.
    pub const RESPONSE_TOO_LARGE: &str = "response-too-large";
    /// 500: the handler's answer body failed while being read for storage; rolled back.
    pub const RESPONSE_BODY: &str = "response-body";
    /// 409: the operation finished (its `answered_status` member is the first answer's status), but
    /// that answer was over the stored-response bound and went to the first caller only;
    /// it is not run again.
    pub const RESPONSE_NOT_REPLAYABLE: &str = "response-not-replayable";
    /// 500: the handler panicked; rolled back, nothing stored.
    pub const HANDLER_FAILED: &str = "handler-failed";
    /// 500: the handler's transaction was not available (the route is not behind the layer, or it was taken twice).
    pub const NO_TRANSACTION: &str = "no-transaction";

    /// Every kind above, for documents that list them (the order service's OpenAPI
    /// document names each `type` URI).
    pub const ALL: &[&str] = &[
        UNAUTHENTICATED,
        IDEMPOTENCY_KEY_MALFORMED,
        IDEMPOTENCY_KEY_MISSING,
        IDEMPOTENCY_KEY_REUSED,
        BUSINESS_KEY_MISSING,
        BUSINESS_KEY_INVALID,
        REQUEST_IN_FLIGHT,
        OUTCOME_UNKNOWN,
        EXECUTION_OUTCOME_UNKNOWN,
        STORE_UNAVAILABLE,
        STORE_ERROR,
        REQUEST_TOO_LARGE,
        SERVER_BUSY,
        REQUEST_TIMEOUT,
        REQUEST_BODY,
        MALFORMED_JSON,
        UNSUPPORTED_MEDIA_TYPE,
        INVALID_BODY,
        INVALID_PATH,
        INVALID_QUERY,
        RECORD_CORRUPT,
        RESPONSE_TOO_LARGE,
        RESPONSE_BODY,
        RESPONSE_NOT_REPLAYABLE,
        HANDLER_FAILED,
        NO_TRANSACTION,
    ];
}

/// `application/problem+json` (RFC 9457 §3).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem details object. `type` is a stable URI per error kind,
/// `urn:oncely:problem:<kind>`; `detail` never echoes request values.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    /// HTTP status.
    #[serde(skip)]
    pub status: StatusCode,
    /// Problem type URI (RFC 9457 §3.1.1).
    #[serde(rename = "type")]
    pub type_uri: String,
    /// Short, human-readable summary of the type.
    pub title: String,
    /// Explanation specific to this occurrence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Extension members (RFC 9457 §3.2), flattened into the object.
    #[serde(flatten)]
    pub extensions: serde_json::Map<String, serde_json::Value>,
    /// `Retry-After` in seconds, sent as a header (RFC 9110 §10.2.3).
    #[serde(skip)]
    pub retry_after_secs: Option<u32>,
}

impl Problem {
    /// A problem of kind `kind` (the last segment of its type URI).
    pub fn new(status: StatusCode, kind: &str, title: &str) -> Self {
        Self {
            status,
            type_uri: format!("urn:oncely:problem:{kind}"),
            title: title.to_owned(),
            detail: None,
            extensions: serde_json::Map::new(),
            retry_after_secs: None,
        }
    }

    /// Sets `detail`.
    #[must_use]
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds an extension member.
    #[must_use]
    pub fn with(mut self, name: &str, value: impl Into<serde_json::Value>) -> Self {
        self.extensions.insert(name.to_owned(), value.into());
        self
    }

    /// Sets the `Retry-After` header, in seconds.
    #[must_use]
    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| b"{}".to_vec());
        let mut res = (self.status, body).into_response();
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after_secs {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// A store error as an HTTP answer: the one mapping shared by the layer and by handlers, so
/// a lost database is never a generic 500.
///
/// - [`StoreError::is_unavailable`] (connection refused or lost, pool timed out, store
///   timeout, lock or statement timeout, deadlock, disk full): 503 problem
///   `store-unavailable` + `Retry-After`. Inside the layer's transaction a 5xx rolls back,
///   so nothing was stored and the retry with the same key runs again.
/// - anything else (a bug: bad SQL, a constraint the code did not expect, a corrupt row):
///   500 problem `store-error`.
///
/// The error itself (with its root cause, e.g. "Connection refused") goes to the log; the
/// body never carries driver text.
#[derive(Debug)]
pub struct StoreFailure {
    error: StoreError,
    retry_after_secs: u32,
}

impl StoreFailure {
    /// Sets the `Retry-After` of the 503, in seconds (default 1).
    #[must_use]
    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after_secs = secs;
        self
    }

    /// The error this answer is for.
    pub fn error(&self) -> &StoreError {
        &self.error
    }
}

impl From<StoreError> for StoreFailure {
    fn from(error: StoreError) -> Self {
        Self {
            error,
            retry_after_secs: 1,
        }
    }
}

impl From<oncely_sql::sqlx::Error> for StoreFailure {
    fn from(e: oncely_sql::sqlx::Error) -> Self {
        StoreError::from(e).into()
    }
}

impl IntoResponse for StoreFailure {
    fn into_response(self) -> Response {
        if self.error.is_unavailable() {
            metrics::counter!(crate::metrics::STORE_UNAVAILABLE_TOTAL).increment(1);
            tracing::warn!(error = %self.error, "store unreachable; failing closed");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                kind::STORE_UNAVAILABLE,
                "The store cannot be reached",
            )
            .detail("nothing was stored; retry later with the same key")
            .retry_after(self.retry_after_secs)
            .into_response()
        } else {
            tracing::error!(error = %self.error, "store failed");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                kind::STORE_ERROR,
                "The store failed",
            )
            .detail("nothing was stored")
            .into_response()
        }
    }
}
