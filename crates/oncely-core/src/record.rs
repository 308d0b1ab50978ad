use serde::{Deserialize, Serialize};

crate::stored_words! {
    /// State of an idempotency record (table `oncely_idempotency`, column `state`; stored
    /// as `processing`, `succeeded`, `failed`, `unknown`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum RecordState {
        /// Reserved; the operation is running (atomic mode: its transaction is still open).
        Processing => "processing",
        /// Finished with a 1xx–3xx answer; replayed to every retry.
        Succeeded => "succeeded",
        /// Finished with a deliberate business rejection (4xx after execution); final and
        /// replayed like a success.
        Failed => "failed",
        /// The outcome is not known (a lease ran out during an external call); resolved by
        /// a status check, never by running again.
        Unknown => "unknown",
    }
}

impl RecordState {
    /// The final state for a response with this status: `failed` for 4xx, `succeeded`
    /// otherwise. (5xx answers are never stored: their transaction is rolled back.)
    pub fn for_status(status: u16) -> Self {
        if (400..500).contains(&status) {
            Self::Failed
        } else {
            Self::Succeeded
        }
    }

    /// `true` for the states whose stored response is replayed.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

/// Response headers a replay repeats, lower-case. Everything else — `Set-Cookie`,
/// `Authorization`, `WWW-Authenticate`, hop-by-hop and per-response headers such as `Date`
/// — is dropped before storage.
pub const REPLAYABLE_HEADERS: &[&str] = &[
    "content-type",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
    "link",
    "cache-control",
    "retry-after",
    // Set by oncely itself on an outcome a status check found (the gateway's probe).
    "oncely-resolved-by",
];

/// `true` when `name` (any case) is on [`REPLAYABLE_HEADERS`].
pub fn is_replayable_header(name: &str) -> bool {
    REPLAYABLE_HEADERS
        .iter()
        .any(|h| h.eq_ignore_ascii_case(name))
}

/// A finished operation's answer, as stored and replayed: status, allow-listed headers and
/// the body byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Allow-listed headers, lower-case names, in response order.
    pub headers: Vec<(String, String)>,
    /// Body bytes, exactly as first sent.
    #[serde(skip)]
    pub body: Vec<u8>,
}

/// A stored response that cannot be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoredResponseError {
    /// The stored header list is not the JSON this crate writes.
    #[error("stored response headers are corrupt: {0}")]
    Headers(#[source] serde_json::Error),
}

impl StoredResponse {
    /// A response with the given status and body; `headers` are filtered through
    /// [`is_replayable_header`].
    pub fn new<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a str)>,
        body: Vec<u8>,
    ) -> Self {
        let headers = headers
            .into_iter()
            .filter(|(n, _)| is_replayable_header(n))
            .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
            .collect();
        Self {
            status,
            headers,
            body,
        }
    }

    /// The header list as JSON text (`[["location","/v1/orders/1"], …]`), the form stored in
    /// the record's `response_headers` column.
    pub fn headers_json(&self) -> String {
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "[]".to_owned())
    }

    /// Rebuilds a stored response from its columns.
    ///
    /// # Errors
    /// [`StoredResponseError::Headers`] when `headers_json` is not a list of name/value pairs.
    pub fn from_columns(
        status: u16,
        headers_json: &str,
        body: Vec<u8>,
    ) -> Result<Self, StoredResponseError> {
        let headers = serde_json::from_str(headers_json).map_err(StoredResponseError::Headers)?;
        Ok(Self {
            status,
            headers,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allow_listed_headers_are_kept() {
        let r = StoredResponse::new(
            201,
            [
                ("Location", "/v1/orders/1"),
                ("Set-Cookie", "s=1"),
                ("Content-Type", "application/json"),
                ("WWW-Authenticate", "Bearer"),
            ],
            b"{}".to_vec(),
        );
        assert_eq!(
            r.headers,
            vec![
                ("location".into(), "/v1/orders/1".into()),
                ("content-type".into(), "application/json".into())
            ]
        );
        let back = StoredResponse::from_columns(201, &r.headers_json(), r.body.clone()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn states_round_trip_and_4xx_is_failed() {
        for s in [
            RecordState::Processing,
            RecordState::Succeeded,
            RecordState::Failed,
            RecordState::Unknown,
        ] {
            assert_eq!(RecordState::parse(s.as_str()), Ok(s));
        }
        assert_eq!(RecordState::for_status(201), RecordState::Succeeded);
        assert_eq!(RecordState::for_status(409), RecordState::Failed);
    }
}
