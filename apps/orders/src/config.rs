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
    /// The slow-client timeouts, connection cap and body-byte budget [`crate::serve`]
    /// enforces (oncely-http's [`HttpLimits`](oncely_http::HttpLimits), shared with
    /// `oncely gateway`). Default: 30 s each, 512 connections, 64 MiB.
    pub http: oncely_http::HttpLimits,
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
            http: oncely_http::HttpLimits::default(),
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

impl AppConfig {
    /// The request-body guard of this configuration: the shared in-flight budget of
    /// [`AppConfig::http`], each body bounded as the idempotency layer bounds it.
    pub(crate) fn body_limits(&self) -> oncely_http::BodyLimits {
        oncely_http::BodyLimits::new(
            &self.http,
            self.idempotency.max_request_body,
            self.idempotency.retry_after_secs,
        )
    }
}
