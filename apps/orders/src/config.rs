use std::collections::HashMap;
use std::time::Duration;

use oncely_core::TenantId;
use oncely_http::IdempotencyConfig;

/// Configuration of the order service.
#[derive(Debug, Clone)]
pub struct AppConfig {
    /// API key → tenant. Requests authenticate with `Authorization: Bearer <api key>`.
    pub api_keys: HashMap<String, TenantId>,
    /// Retention of finished idempotency records (docs/DESIGN.md default 24 h). Must exceed the
    /// callers' retry window; past it, the business key still prevents a second order.
    pub retention: Duration,
    /// How often the collector deletes expired records. Default 60 s.
    pub collector_interval: Duration,
    /// Rows the collector deletes per statement. Default 500.
    pub collector_batch: u32,
    /// Idempotency layer settings.
    pub idempotency: IdempotencyConfig,
    /// Topic of the order events written to the outbox (AMQP routing key, NATS subject,
    /// SQL-transport topic). Default `orders`.
    pub events_topic: String,
    /// How long a client may take to send a request's head (request line and headers)
    /// before [`crate::serve`] closes its connection — the slowloris guard (hyper's HTTP/1
    /// header read timeout). Default 30 s.
    pub header_read_timeout: Duration,
    /// How long a client may take to send a request's whole body, counted from the end of
    /// its head: a total deadline, not an idle timeout, so a body trickled a byte at a time
    /// is cut too. Past it the client gets 408 and the connection closes. Default 30 s.
    pub body_read_timeout: Duration,
    /// How long a write of a response may stall — the client not taking its bytes, its
    /// receive window full — before [`crate::serve`] closes the connection. Without it a
    /// client that sends requests and never reads the answers holds its connection, and at
    /// [`AppConfig::max_connections`] of them nobody else is served. Default 30 s.
    pub write_timeout: Duration,
    /// Most connections served at once. At the cap the server stops accepting (new
    /// connections wait in the kernel's listen backlog) until one closes. Default 512,
    /// below the usual 1024 file-descriptor soft limit with room for the database pools and
    /// broker connections.
    pub max_connections: usize,
    /// Most request-body bytes buffered at once, over all requests in flight. A request
    /// reserves its `Content-Length` (or the request-body bound when the length is not
    /// known) before its body is read; when the budget is spent it gets 503 with
    /// `Retry-After` at once. Default 64 MiB. See [`crate::serve`] for why 503 and not a
    /// wait.
    pub max_body_bytes_in_flight: usize,
    /// What `GET /readyz` checks besides the database: the broker and the providers this
    /// process uses. Default none.
    pub dependencies: Vec<crate::Dependency>,
    /// How orders are fulfilled after `order.created` (the choreography or the saga) and
    /// the saga's step timeouts. Default: the choreography.
    pub fulfilment: crate::FulfilmentConfig,
    /// The payments provider of `POST /v1/orders/{id}/payments` (multi-phase mode); `None`:
    /// the route answers 503 `payments-not-configured`.
    pub payments: Option<crate::PaymentsSettings>,
    /// How often [`crate::serve`] sweeps multi-phase records whose lease ran out into
    /// `unknown` and sets the lease gauges (`oncely_http::lease_sweep`). Default 10 s.
    pub lease_sweep_interval: Duration,
    /// The operator console's admin token (`/console`, signed in once per browser). `None`:
    /// the console is off and `/console` is a 404. Default `None`.
    pub admin_token: Option<String>,
    /// The dead letters of the broker the service's events travel on, for the console's
    /// dead-letter page (list, requeue) and overview counts. `None`: the SQL transport's, in
    /// the service's database. Default `None`.
    pub dead_letters: Option<std::sync::Arc<dyn oncely_broker::DeadLetters>>,
    /// Stripe's webhook endpoint, `POST /v1/webhooks/stripe` (docs/webhooks.md). `None`:
    /// the route is absent (the service's 404). Default `None`.
    pub stripe_webhook: Option<crate::StripeWebhookSettings>,
}

impl Default for AppConfig {
    fn default() -> Self {
        Self {
            api_keys: HashMap::new(),
            retention: Duration::from_secs(24 * 3600),
            collector_interval: Duration::from_secs(60),
            collector_batch: 500,
            idempotency: IdempotencyConfig::default(),
            events_topic: crate::ORDERS_TOPIC.to_owned(),
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_body_bytes_in_flight: 64 * 1024 * 1024,
            dependencies: Vec::new(),
            fulfilment: crate::FulfilmentConfig::default(),
            payments: None,
            lease_sweep_interval: Duration::from_secs(10),
            admin_token: None,
            dead_letters: None,
            stripe_webhook: None,
        }
    }
}

/// A malformed API key list: oncely-http's [`ApiKeysError`](oncely_http::ApiKeysError),
/// the one reader of the `ONCELY_API_KEYS` form (shared with `oncely gateway`).
pub type ConfigError = oncely_http::ApiKeysError;

/// Parses `key1=tenant-a,key2=tenant-b` (entries separated by commas, whitespace
/// trimmed) with [`oncely_http::parse_api_keys`]. Entries are numbered from 1 in errors;
/// key values never appear in errors.
///
/// # Errors
/// [`ConfigError`] for an entry without `=`, a key shorter than 16 characters, a key that
/// appears twice or an invalid tenant id.
pub fn parse_api_keys(s: &str) -> Result<HashMap<String, TenantId>, ConfigError> {
    Ok(oncely_http::parse_api_keys(s)?.into_iter().collect())
}
