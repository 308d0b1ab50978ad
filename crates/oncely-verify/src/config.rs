//! What to check: the endpoint, the request template and how to read an answer.

use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::{Method, Url};
use serde_json::Value;

/// The placeholder replaced by a fresh UUIDv7 in each logical operation's body.
pub const UUID_PLACEHOLDER: &str = "{{uuid}}";

/// Why a verification cannot be configured as given.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The URL does not parse or is not `http://` / `https://`.
    #[error("invalid URL {url:?}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A header is not `Name: value`, or its name or value is not valid HTTP.
    #[error("invalid header {0:?}: expected `Name: value`")]
    Header(String),
    /// A mutation is not `<json-pointer>=<value>` with a pointer starting with `/`.
    #[error("invalid mutation {0:?}: expected `/json/pointer=value`")]
    Mutation(String),
    /// A mutation's pointer names nothing in the body.
    #[error("the mutation pointer {0:?} names nothing in the body")]
    MutationTarget(String),
    /// `--mutate` needs a JSON body.
    #[error("--mutate needs a JSON body")]
    MutationNeedsJson,
    /// The body file could not be read.
    #[error("reading the body file {path:?}")]
    BodyFile {
        /// The path as given.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `--object-id` is neither `Location` nor a JSON pointer.
    #[error("invalid --object-id {0:?}: expected `Location` or a JSON pointer such as `/id`")]
    ObjectId(String),
}

/// A request body with placeholders, rendered afresh for each logical operation.
///
/// Every occurrence of [`UUID_PLACEHOLDER`] (`{{uuid}}`) in one rendering gets the same new
/// UUIDv7, so two operations never share a business-level unique key (an order's external
/// reference, say) while the retries of one operation send the same bytes.
#[derive(Debug, Clone)]
pub struct BodyTemplate {
    text: String,
}

/// One rendering of a [`BodyTemplate`]: the bytes to send and, when they are JSON, the value.
#[derive(Debug, Clone)]
pub struct RenderedBody {
    /// The body as sent.
    pub text: String,
    /// The body parsed as JSON, when it is JSON.
    pub json: Option<Value>,
}

impl BodyTemplate {
    /// A template from its text.
    pub fn new(text: impl Into<String>) -> Self {
        Self { text: text.into() }
    }

    /// The `--body` argument: inline JSON when it starts with `{` or `[` (after
    /// whitespace), otherwise a file path (a leading `@` is dropped: `@body.json`).
    ///
    /// # Errors
    /// [`ConfigError::BodyFile`] when the file cannot be read.
    pub fn from_arg(arg: &str) -> Result<Self, ConfigError> {
        let trimmed = arg.trim_start();
        if trimmed.starts_with('{') || trimmed.starts_with('[') {
            return Ok(Self::new(arg));
        }
        let path = arg.strip_prefix('@').unwrap_or(arg);
        std::fs::read_to_string(path)
            .map(Self::new)
            .map_err(|source| ConfigError::BodyFile {
                path: path.to_owned(),
                source,
            })
    }

    /// The template text, placeholders unfilled.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the template holds a placeholder at all.
    pub fn has_placeholders(&self) -> bool {
        self.text.contains(UUID_PLACEHOLDER)
    }

    /// Renders the template for one new logical operation.
    pub fn render(&self) -> RenderedBody {
        let id = uuid::Uuid::now_v7().to_string();
        let text = self.text.replace(UUID_PLACEHOLDER, &id);
        let json = serde_json::from_str(&text).ok();
        RenderedBody { text, json }
    }
}

/// `--mutate <json-pointer>=<value>`: a change to the body that must make a reused key a
/// conflict (draft-ietf-httpapi-idempotency-key-header-07 §2.7: 422).
#[derive(Debug, Clone)]
pub struct Mutation {
    /// RFC 6901 JSON pointer, e.g. `/amount_minor`.
    pub pointer: String,
    /// The new value: the text after `=` as JSON when it parses, else as a string.
    pub value: Value,
}

impl Mutation {
    /// Parses `/pointer=value`.
    ///
    /// # Errors
    /// [`ConfigError::Mutation`] when there is no `=` or the pointer does not start with `/`.
    pub fn parse(arg: &str) -> Result<Self, ConfigError> {
        let (pointer, value) = arg
            .split_once('=')
            .ok_or_else(|| ConfigError::Mutation(arg.to_owned()))?;
        if !pointer.starts_with('/') {
            return Err(ConfigError::Mutation(arg.to_owned()));
        }
        let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
        Ok(Self {
            pointer: pointer.to_owned(),
            value,
        })
    }

    /// Applies the mutation to `body`.
    ///
    /// # Errors
    /// [`ConfigError::MutationTarget`] when the pointer names nothing in `body`.
    pub fn apply(&self, body: &mut Value) -> Result<(), ConfigError> {
        let slot = body
            .pointer_mut(&self.pointer)
            .ok_or_else(|| ConfigError::MutationTarget(self.pointer.clone()))?;
        *slot = self.value.clone();
        Ok(())
    }
}

/// Where the id of the object an answer created or replayed is found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectIdSource {
    /// The JSON pointer `/id` in the body, else the `Location` header.
    Auto,
    /// The `Location` header.
    Location,
    /// An RFC 6901 JSON pointer into the response body.
    Pointer(String),
}

impl ObjectIdSource {
    /// Parses `Location` (any case) or a JSON pointer.
    ///
    /// # Errors
    /// [`ConfigError::ObjectId`] for anything else.
    pub fn parse(arg: &str) -> Result<Self, ConfigError> {
        if arg.eq_ignore_ascii_case("location") {
            Ok(Self::Location)
        } else if arg.starts_with('/') {
            Ok(Self::Pointer(arg.to_owned()))
        } else {
            Err(ConfigError::ObjectId(arg.to_owned()))
        }
    }
}

/// One header sent with every request of a credential.
#[derive(Debug, Clone)]
pub struct Header {
    /// Its name.
    pub name: HeaderName,
    /// Its value.
    pub value: HeaderValue,
}

impl Header {
    /// Parses `Name: value`.
    ///
    /// # Errors
    /// [`ConfigError::Header`] when there is no `:` or the name or value is not valid HTTP.
    pub fn parse(arg: &str) -> Result<Self, ConfigError> {
        let err = || ConfigError::Header(arg.to_owned());
        let (name, value) = arg.split_once(':').ok_or_else(err)?;
        Ok(Self {
            name: HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| err())?,
            value: HeaderValue::from_str(value.trim()).map_err(|_| err())?,
        })
    }
}

/// Everything `oncely verify` needs to run the checks against one endpoint.
#[derive(Debug, Clone)]
pub struct VerifyConfig {
    /// The endpoint, e.g. `http://127.0.0.1:8080/v1/orders`.
    pub url: Url,
    /// The method; `POST` by default.
    pub method: Method,
    /// The request body template.
    pub body: BodyTemplate,
    /// Headers of the first credential (authorization, content type, …).
    pub headers: Vec<Header>,
    /// Headers of a second credential, replacing same-named headers of [`Self::headers`];
    /// `None` makes the scope check not applicable.
    pub headers_b: Option<Vec<Header>>,
    /// Changes that must make a reused key a conflict; none makes the mutation check not
    /// applicable.
    pub mutations: Vec<Mutation>,
    /// Where answers carry the object id.
    pub object_id: ObjectIdSource,
    /// A URL answering the number of objects (a JSON number, a JSON array, an object with a
    /// `count` or `total` member, or plain text), fetched with the first credential's headers
    /// before and after every check.
    pub count_url: Option<Url>,
    /// Simultaneous requests in S2.
    pub concurrency: usize,
    /// Requests with one key in S1 (the first and its retries).
    pub sequential: usize,
    /// The idempotency key header, `Idempotency-Key` by default.
    pub key_header: HeaderName,
    /// The header that marks a replayed answer (any value but `false`),
    /// `Idempotent-Replayed` by default.
    pub replay_header: HeaderName,
    /// Send keys as RFC 8941 sf-strings (`"…"`), as the draft writes them, instead of bare.
    pub quote_keys: bool,
    /// Timeout of each request.
    pub request_timeout: Duration,
    /// How long a check retries an answer of 409 (in flight) before it gives up.
    pub settle_timeout: Duration,
}

impl VerifyConfig {
    /// A configuration with the defaults: `POST`, no headers, object id `Auto`, 16
    /// simultaneous requests, 5 sequential ones, bare `Idempotency-Key`, replay marker
    /// `Idempotent-Replayed`, 30 s per request, 10 s to settle.
    ///
    /// # Errors
    /// [`ConfigError::Url`] when `url` does not parse or is not `http(s)://`.
    pub fn new(url: &str, body: BodyTemplate) -> Result<Self, ConfigError> {
        Ok(Self {
            url: parse_url(url)?,
            method: Method::POST,
            body,
            headers: Vec::new(),
            headers_b: None,
            mutations: Vec::new(),
            object_id: ObjectIdSource::Auto,
            count_url: None,
            concurrency: 16,
            sequential: 5,
            key_header: HeaderName::from_static("idempotency-key"),
            replay_header: HeaderName::from_static("idempotent-replayed"),
            quote_keys: false,
            request_timeout: Duration::from_secs(30),
            settle_timeout: Duration::from_secs(10),
        })
    }

    /// Headers of credential B: [`Self::headers`] with the same-named ones of
    /// [`Self::headers_b`] replaced.
    pub(crate) fn credential_b(&self) -> Option<Vec<Header>> {
        let b = self.headers_b.as_ref()?;
        let mut out: Vec<Header> = self
            .headers
            .iter()
            .filter(|h| !b.iter().any(|o| o.name == h.name))
            .cloned()
            .collect();
        out.extend(b.iter().cloned());
        Some(out)
    }
}

/// Parses an `http://` or `https://` URL.
///
/// # Errors
/// [`ConfigError::Url`] otherwise.
pub fn parse_url(url: &str) -> Result<Url, ConfigError> {
    let parsed = Url::parse(url).map_err(|e| ConfigError::Url {
        url: url.to_owned(),
        reason: e.to_string(),
    })?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(ConfigError::Url {
            url: url.to_owned(),
            reason: "expected http://host[:port]/path or https://…".into(),
        });
    }
    Ok(parsed)
}
