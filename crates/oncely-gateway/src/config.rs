//! The gateway's settings: the upstream, the idempotent routes and their options, from
//! command-line flags (`--route 'POST /orders'`) or a TOML file.

use std::time::Duration;

use http::{HeaderName, Method};
use oncely_core::{FingerprintParts, JsonPointer};
use oncely_http::KeySource;
use serde::Deserialize;

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A route is not `METHOD /path`, or its method is not `POST` or `PATCH`.
    #[error("route {0:?}: {1}")]
    Route(String, &'static str),
    /// The same method and path twice.
    #[error("route {0:?} is given twice")]
    DuplicateRoute(String),
    /// The upstream URL does not parse or is not `http(s)://host…`.
    #[error("upstream {0:?} is not an http:// or https:// URL")]
    Upstream(String),
    /// A probe's URL template is not a path (`/…`) with well-formed `{…}` placeholders.
    #[error("route {0:?}: probe url {1:?}: {2}")]
    Probe(String, String, &'static str),
    /// A route's lease would not exceed its upstream timeout.
    #[error("route {0:?}: timeout_ms must be at least 1")]
    Timeout(String),
    /// A route option that names a JSON pointer or a header is malformed:
    /// (route, option, value, why).
    #[error("route {0:?}: {1} {2:?}: {3}")]
    RouteOption(String, &'static str, String, String),
    /// The configuration file cannot be read or parsed.
    #[error("configuration file: {0}")]
    File(String),
}

/// Whether a route's requests must carry an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyPolicy {
    /// 400 `idempotency-key-missing` without one (the default).
    #[default]
    Required,
    /// A request without a key is forwarded once, unprotected (after authentication).
    Optional,
}

/// What the gateway does with an upstream 5xx answer on a route.
///
/// The default is [`On5xx::Release`]: most 5xx answers (a 502 or 503 from the upstream's
/// own load balancer, an overloaded service, a crash before the handler's transaction
/// committed) mean nothing took effect, and a client retries them expecting the retry to
/// run. Storing one would pin a passing failure to the key for its whole retention and
/// push the client to mint a new key, which is the very duplicate the gateway exists to
/// prevent. A 504 is the exception: it says a request was sent and no answer came, so it
/// turns the operation `unknown` under every policy but [`On5xx::Store`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum On5xx {
    /// Not stored; the key is free at once and the retry is forwarded again (with the same
    /// `Idempotency-Key`, so an upstream that honours it deduplicates).
    #[default]
    Release,
    /// Stored and replayed like a 4xx (draft-ietf-httpapi-idempotency-key-header-07 §2.6,
    /// Stripe): for an upstream whose 5xx answers are final.
    Store,
    /// The operation is `unknown`: resolved by the route's probe, or by an operator.
    Unknown,
}

/// A route's status probe (issue 30 item 4): an upstream `GET` that says whether an
/// operation whose outcome is unknown took effect.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeConfig {
    /// Path and query on the upstream, e.g. `/orders?external_ref={/external_ref}`:
    /// `{key}` is the `Idempotency-Key`, `{/json/pointer}` (RFC 6901) a value of the JSON
    /// request body; both percent-encoded (RFC 3986 unreserved characters kept).
    pub url: String,
    /// A JSON pointer into the probe's answer selecting the object, e.g. `/0` for the
    /// first element of a search result, or `/items/0`. Missing: the answer is absent.
    /// Unset: a 2xx answer is the object itself.
    #[serde(default)]
    pub select: Option<String>,
    /// The status stored and replayed for a found object (e.g. 201, what the original
    /// `POST` answers). Unset: the probe's own status.
    #[serde(default)]
    pub found_status: Option<u16>,
    /// Milliseconds an operation must have been unknown before an "absent" answer is
    /// trusted (an upstream that commits late, a search index that lags). Default 5000.
    #[serde(default = "defaults::settle_ms")]
    pub settle_ms: u64,
}

impl ProbeConfig {
    /// The settle time.
    pub fn settle(&self) -> Duration {
        Duration::from_millis(self.settle_ms)
    }
}

/// One idempotent route and its options (a `[[route]]` table of the configuration file).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `POST` or `PATCH`.
    pub method: String,
    /// An axum path template, `{param}` for a segment: `/orders/{id}/payments`.
    pub path: String,
    /// Key required (default) or optional.
    #[serde(default)]
    pub key: KeyPolicy,
    /// Seconds a finished outcome is kept and replayed. Default 86 400 (24 h).
    #[serde(default = "defaults::retention_secs")]
    pub retention_secs: u64,
    /// Milliseconds the upstream has to answer in full once the request is sent; past it
    /// the outcome is unknown. Default 10 000.
    #[serde(default = "defaults::timeout_ms")]
    pub timeout_ms: u64,
    /// Largest request body, bytes (413 above). Default 1 MiB.
    #[serde(default = "defaults::max_request_bytes")]
    pub max_request_bytes: usize,
    /// Largest upstream answer stored for replay, bytes. Default 256 KiB.
    #[serde(default = "defaults::max_stored_response_bytes")]
    pub max_stored_response_bytes: usize,
    /// What an upstream 5xx does; see [`On5xx`].
    #[serde(default)]
    pub on_5xx: On5xx,
    /// The status probe; without one an unknown operation waits for an operator.
    #[serde(default)]
    pub probe: Option<ProbeConfig>,
    /// JSON pointers (RFC 6901) the fingerprint covers instead of the whole body, e.g.
    /// `["/amount", "/currency"]`: a retry whose other fields differ (a timestamp or nonce
    /// the client regenerates) is the same request. The body must then be JSON (415
    /// otherwise). Unset: the whole body.
    #[serde(default)]
    pub fingerprint_body: Option<Vec<String>>,
    /// Request headers whose values the fingerprint covers too, e.g. `["Stripe-Version"]`
    /// (a retry that differs there gets 422 `differs: headers`). Default none.
    #[serde(default)]
    pub fingerprint_headers: Vec<String>,
    /// A JSON pointer to the operation's business key in the body, e.g.
    /// `"/external_ref"`: requests with the same value there are one operation, whatever
    /// `Idempotency-Key` they carry (or none). Cannot be combined with `key = "optional"`.
    #[serde(default)]
    pub business_key: Option<String>,
}

mod defaults {
    pub(super) fn retention_secs() -> u64 {
        86_400
    }
    pub(super) fn timeout_ms() -> u64 {
        10_000
    }
    pub(super) fn max_request_bytes() -> usize {
        1024 * 1024
    }
    pub(super) fn max_stored_response_bytes() -> usize {
        256 * 1024
    }
    pub(super) fn settle_ms() -> u64 {
        5_000
    }
    pub(super) fn connect_timeout_ms() -> u64 {
        2_000
    }
}

impl RouteConfig {
    /// A route with every option at its default, from `METHOD /path` (`--route`).
    ///
    /// # Errors
    /// [`ConfigError::Route`] when `spec` is not of that form or the method is not `POST`
    /// or `PATCH`.
    pub fn parse(spec: &str) -> Result<Self, ConfigError> {
        let (method, path) = spec
            .trim()
            .split_once(char::is_whitespace)
            .ok_or_else(|| ConfigError::Route(spec.to_owned(), "expected METHOD /path"))?;
        let route = Self {
            method: method.to_owned(),
            path: path.trim().to_owned(),
            key: KeyPolicy::default(),
            retention_secs: defaults::retention_secs(),
            timeout_ms: defaults::timeout_ms(),
            max_request_bytes: defaults::max_request_bytes(),
            max_stored_response_bytes: defaults::max_stored_response_bytes(),
            on_5xx: On5xx::default(),
            probe: None,
            fingerprint_body: None,
            fingerprint_headers: Vec::new(),
            business_key: None,
        };
        route.method()?;
        Ok(route)
    }

    /// `METHOD /path`, as the route is named in logs and errors.
    pub fn name(&self) -> String {
        format!("{} {}", self.method, self.path)
    }

    /// The method, upper-cased.
    ///
    /// # Errors
    /// [`ConfigError::Route`] for a method other than `POST` or `PATCH` (the methods the
    /// idempotency layer guards; `PUT` and `DELETE` are idempotent by definition, RFC 9110
    /// §9.2.2) or a path that does not start with `/`.
    pub fn method(&self) -> Result<Method, ConfigError> {
        if !self.path.starts_with('/') || self.path.contains(char::is_whitespace) {
            return Err(ConfigError::Route(
                self.name(),
                "the path must start with /",
            ));
        }
        match self.method.to_ascii_uppercase().as_str() {
            "POST" => Ok(Method::POST),
            "PATCH" => Ok(Method::PATCH),
            _ => Err(ConfigError::Route(
                self.name(),
                "only POST and PATCH routes are guarded",
            )),
        }
    }

    /// The upstream timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// The retention of finished outcomes.
    pub fn retention(&self) -> Duration {
        Duration::from_secs(self.retention_secs)
    }

    /// What the route's fingerprint covers: `fingerprint_body` and `fingerprint_headers`
    /// as oncely-http's [`FingerprintParts`] (the default when neither is set).
    ///
    /// # Errors
    /// [`ConfigError::RouteOption`] for a malformed JSON pointer or header name.
    pub fn fingerprint_parts(&self) -> Result<FingerprintParts, ConfigError> {
        let mut parts = FingerprintParts::default();
        if let Some(pointers) = &self.fingerprint_body {
            let pointers = pointers
                .iter()
                .map(|p| self.pointer("fingerprint_body", p))
                .collect::<Result<Vec<_>, _>>()?;
            parts = parts.body_pointers(pointers);
        }
        for name in &self.fingerprint_headers {
            HeaderName::from_bytes(name.as_bytes()).map_err(|e| {
                ConfigError::RouteOption(
                    self.name(),
                    "fingerprint_headers",
                    name.clone(),
                    e.to_string(),
                )
            })?;
        }
        Ok(parts.headers(&self.fingerprint_headers))
    }

    /// Where the route's operations take their key: `business_key` as a
    /// [`KeySource::Body`], else the `Idempotency-Key` header.
    ///
    /// # Errors
    /// [`ConfigError::RouteOption`] for a malformed pointer; [`ConfigError::Route`] when
    /// it is combined with `key = "optional"` (the key is in the body, never optional).
    pub fn key_source(&self) -> Result<KeySource, ConfigError> {
        let Some(pointer) = &self.business_key else {
            return Ok(KeySource::Header);
        };
        if self.key == KeyPolicy::Optional {
            return Err(ConfigError::Route(
                self.name(),
                "business_key cannot be combined with key = \"optional\"",
            ));
        }
        Ok(KeySource::Body(self.pointer("business_key", pointer)?))
    }

    fn pointer(&self, option: &'static str, text: &str) -> Result<JsonPointer, ConfigError> {
        JsonPointer::parse(text).map_err(|e| {
            ConfigError::RouteOption(self.name(), option, text.to_owned(), e.to_string())
        })
    }
}

/// Everything the gateway needs besides its database and tenants.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// The service behind the gateway, `http://host:port` (a path prefix is kept).
    #[serde(default)]
    pub upstream: String,
    /// Milliseconds a connection to the upstream may take; a connect that fails or times
    /// out sent nothing, so the key is freed. Default 2000.
    #[serde(default = "defaults::connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// The idempotent routes; every other request passes through.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteConfig>,
    /// The slow-client timeouts, connection cap and body-byte budget, as `orders serve`
    /// has them (`--header-read-timeout-secs` …; not read from the file). Guarded routes'
    /// bodies are read under the body deadline and budget; passed-through ones stream.
    #[serde(skip)]
    pub http: oncely_http::HttpLimits,
}

impl GatewayConfig {
    /// A configuration with `upstream` and no routes.
    pub fn new(upstream: impl Into<String>) -> Self {
        Self {
            upstream: upstream.into(),
            connect_timeout_ms: defaults::connect_timeout_ms(),
            routes: Vec::new(),
            http: oncely_http::HttpLimits::default(),
        }
    }

    /// Parses a TOML configuration file's text:
    ///
    /// ```toml
    /// upstream = "http://127.0.0.1:9000"
    ///
    /// [[route]]
    /// method = "POST"
    /// path = "/orders"
    /// timeout_ms = 5000
    /// fingerprint_body = ["/amount", "/currency", "/external_ref"]
    /// fingerprint_headers = ["Stripe-Version"]
    /// business_key = "/external_ref"
    /// probe = { url = "/orders?external_ref={/external_ref}", select = "/0", found_status = 201 }
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::File`] when it does not parse; the checks of
    /// [`GatewayConfig::validate`].
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError::File(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms.max(1))
    }

    /// Checks the upstream URL, each route and each probe template.
    ///
    /// # Errors
    /// The [`ConfigError`] of the first problem found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let url = reqwest::Url::parse(&self.upstream)
            .map_err(|_| ConfigError::Upstream(self.upstream.clone()))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(ConfigError::Upstream(self.upstream.clone()));
        }
        let mut seen = Vec::new();
        for route in &self.routes {
            let method = route.method()?;
            if route.timeout_ms == 0 {
                return Err(ConfigError::Timeout(route.name()));
            }
            if seen.contains(&(method.clone(), route.path.clone())) {
                return Err(ConfigError::DuplicateRoute(route.name()));
            }
            seen.push((method, route.path.clone()));
            route.fingerprint_parts()?;
            route.key_source()?;
            if let Some(probe) = &route.probe {
                crate::template::Template::parse(&probe.url)
                    .map_err(|why| ConfigError::Probe(route.name(), probe.url.clone(), why))?;
            }
        }
        Ok(())
    }
}
