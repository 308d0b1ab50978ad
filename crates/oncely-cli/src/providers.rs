//! [`ProviderArgs`]: the outgoing-effect providers and the effect runner's settings.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use oncely_effects::{Provider, RunnerConfig, ShippingConfig, StripeConfig};
use oncely_runtime::{EffectsConfig, RuntimeError};

/// The outgoing-effect providers and the effect runner's settings (a service's `serve` and
/// `effects run`, and `oncely reconcile`). Without `--payments-url` and `--shipping-url` no
/// provider is configured: the order service then stops at the invoice.
#[derive(Debug, Clone, Args)]
pub struct ProviderArgs {
    /// Payments provider (Stripe API v1) base URL: https://api.stripe.com (with a test-mode
    /// key: test mode), a localstripe, or `oncely sim payments`. Set: billing enqueues a
    /// charge per new invoice.
    #[arg(long, env = "ONCELY_PAYMENTS_URL")]
    pub payments_url: Option<String>,
    /// Payments secret key (sk_test_… / sk_live_…), sent as Authorization: Bearer.
    #[arg(long, env = "ONCELY_PAYMENTS_SECRET_KEY", hide_env_values = true)]
    payments_secret_key: Option<String>,
    /// Payments: check an unknown outcome by paging the PaymentIntent list instead of the
    /// search API (localstripe has no search; Stripe's lags writes by up to a minute).
    #[arg(long, env = "ONCELY_PAYMENTS_NO_SEARCH")]
    payments_no_search: bool,
    /// Payments: seconds after the latest create before a status lookup that finds nothing
    /// proves the charge absent (Stripe's search lags writes by up to a minute).
    #[arg(long, env = "ONCELY_PAYMENTS_SETTLE_SECS", default_value_t = 60)]
    payments_settle_secs: u64,
    /// Shipping provider base URL (e.g. `oncely sim shipping`). Set: the `shipping` consumer
    /// books one shipment per paid invoice.
    #[arg(long, env = "ONCELY_SHIPPING_URL")]
    pub shipping_url: Option<String>,
    /// Shipping API key, sent as Authorization: Bearer when set.
    #[arg(long, env = "ONCELY_SHIPPING_API_KEY", hide_env_values = true)]
    shipping_api_key: Option<String>,
    /// Shipping: seconds after the latest booking before a lookup that finds no shipment
    /// proves it absent and lets it be booked again (the contract has no keys: a booking
    /// may commit after the caller gave up).
    #[arg(long, env = "ONCELY_SHIPPING_SETTLE_SECS", default_value_t = 60)]
    shipping_settle_secs: u64,
    /// Bound on one provider HTTP exchange, in ms; past it the outcome is unknown.
    #[arg(long, env = "ONCELY_PROVIDER_TIMEOUT_MS", default_value_t = 30_000)]
    provider_timeout_ms: u64,
    /// Provider calls in flight at once, per provider.
    #[arg(long, env = "ONCELY_RUNNER_CONCURRENCY", default_value_t = 8)]
    runner_concurrency: usize,
    /// Effects claimed per provider per round.
    #[arg(long, env = "ONCELY_RUNNER_BATCH", default_value_t = 16)]
    runner_batch: u32,
    /// Provider outcomes settled together in one transaction, at most (group commit).
    #[arg(long, env = "ONCELY_RUNNER_SETTLE_BATCH", default_value_t = 64)]
    runner_settle_batch: usize,
    /// Lease on a claimed effect, in seconds; must exceed the provider timeout. A runner
    /// that dies mid-call leaves its effect to be checked (never re-sent blindly) after it.
    #[arg(long, env = "ONCELY_RUNNER_LEASE_SECS", default_value_t = 60)]
    runner_lease_secs: u64,
    /// Idle polling interval of the runner, in ms.
    #[arg(long, env = "ONCELY_RUNNER_POLL_MS", default_value_t = 200)]
    runner_poll_ms: u64,
    /// Counted attempts (answers that prove nothing happened do not count; an unavailable
    /// provider never counts) before an effect goes to needs_review.
    #[arg(long, env = "ONCELY_RUNNER_MAX_ATTEMPTS", default_value_t = 10)]
    runner_max_attempts: u32,
    /// Wait before the first status check after an unknown outcome, in ms.
    #[arg(long, env = "ONCELY_RUNNER_CHECK_DELAY_MS", default_value_t = 1_000)]
    runner_check_delay_ms: u64,
    /// Status checks after which a still-unknown effect goes to needs_review.
    #[arg(long, env = "ONCELY_RUNNER_MAX_CHECKS", default_value_t = 20)]
    runner_max_checks: u32,
}

impl ProviderArgs {
    /// `true` when a payments provider is configured (billing then enqueues charges).
    pub fn payments(&self) -> bool {
        self.payments_url.is_some()
    }

    /// `true` when a shipping provider is configured (the shipping consumer then runs).
    pub fn shipping(&self) -> bool {
        self.shipping_url.is_some()
    }

    /// The providers and runner settings these arguments describe.
    pub fn config(&self) -> EffectsConfig {
        let timeout = Duration::from_millis(self.provider_timeout_ms.max(1));
        let payments = self.payments_url.as_ref().map(|url| StripeConfig {
            base_url: url.clone(),
            secret_key: self.payments_secret_key.clone().unwrap_or_default(),
            timeout,
            search: !self.payments_no_search,
            settle_time: Duration::from_secs(self.payments_settle_secs),
            ..StripeConfig::default()
        });
        let shipping = self.shipping_url.as_ref().map(|url| ShippingConfig {
            base_url: url.clone(),
            api_key: self.shipping_api_key.clone(),
            timeout,
            settle_time: Duration::from_secs(self.shipping_settle_secs),
            ..ShippingConfig::default()
        });
        let defaults = RunnerConfig::default();
        let runner = RunnerConfig {
            lease: Duration::from_secs(self.runner_lease_secs.max(1)),
            poll: Duration::from_millis(self.runner_poll_ms.max(1)),
            batch: self.runner_batch.max(1),
            concurrency: self.runner_concurrency.max(1),
            settle_batch: self.runner_settle_batch.max(1),
            retry: oncely_core::RetryPolicy {
                max_attempts: self.runner_max_attempts.max(1),
                ..defaults.retry
            },
            check_delay: Duration::from_millis(self.runner_check_delay_ms),
            max_checks: self.runner_max_checks.max(1),
            ..defaults
        };
        EffectsConfig {
            payments,
            shipping,
            runner,
        }
    }

    /// The configured providers' adapters (for the runner, and for `reconcile`).
    ///
    /// # Errors
    /// As [`EffectsConfig::providers`].
    pub fn providers(&self) -> Result<Vec<Arc<dyn Provider>>, RuntimeError> {
        self.config().providers()
    }
}
