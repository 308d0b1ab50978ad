//! The effect runner with its providers, from configuration.

use std::future::Future;
use std::sync::Arc;

use oncely_effects::{
    EffectHandler, EffectRunner, Provider, RunnerConfig, ShippingClient, ShippingConfig,
    StripeConfig, StripePayments,
};
use oncely_sql::{Database, EffectStore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::run_until_shutdown;
use crate::{MetricsEndpoint, RuntimeError};

/// Which providers outgoing effects go to, and how the runner works them. [`Default`]: no
/// provider (a service without external effects) and [`RunnerConfig::default`].
#[derive(Debug, Clone, Default)]
pub struct EffectsConfig {
    /// Provider `payments` (Stripe API v1: api.stripe.com, localstripe or `oncely sim
    /// payments`), when configured.
    pub payments: Option<StripeConfig>,
    /// Provider `shipping` (the keyless shipping contract), when configured.
    pub shipping: Option<ShippingConfig>,
    /// The runner's settings (lease, polling, concurrency, retries, fault injection).
    pub runner: RunnerConfig,
}

impl EffectsConfig {
    /// `true` when no provider is configured: there is nothing for a runner to do.
    pub fn is_empty(&self) -> bool {
        self.payments.is_none() && self.shipping.is_none()
    }

    /// The configured providers' adapters, `payments` first.
    ///
    /// # Errors
    /// [`RuntimeError::PaymentsSecretKeyMissing`] for payments without a secret key;
    /// [`RuntimeError::LeaseTooShort`] when the runner's lease does not exceed a provider's
    /// timeout (a call still running could be taken over); [`RuntimeError::ProviderClient`]
    /// when an HTTP client cannot be built.
    pub fn providers(&self) -> Result<Vec<Arc<dyn Provider>>, RuntimeError> {
        let mut providers: Vec<Arc<dyn Provider>> = Vec::new();
        let lease = self.runner.lease;
        if let Some(payments) = &self.payments {
            if payments.secret_key.is_empty() {
                return Err(RuntimeError::PaymentsSecretKeyMissing);
            }
            if lease <= payments.timeout {
                return Err(RuntimeError::LeaseTooShort {
                    lease,
                    timeout: payments.timeout,
                });
            }
            let client = StripePayments::new(payments.clone()).map_err(|e| {
                RuntimeError::ProviderClient {
                    provider: "payments",
                    source: e.into(),
                }
            })?;
            providers.push(Arc::new(client));
        }
        if let Some(shipping) = &self.shipping {
            if lease <= shipping.timeout {
                return Err(RuntimeError::LeaseTooShort {
                    lease,
                    timeout: shipping.timeout,
                });
            }
            let client = ShippingClient::new(shipping.clone()).map_err(|e| {
                RuntimeError::ProviderClient {
                    provider: "shipping",
                    source: e.into(),
                }
            })?;
            providers.push(Arc::new(client));
        }
        Ok(providers)
    }

    /// Starts the effect runner on `db` (migrated) for the configured providers, settling
    /// through `handler` (the service's business update per settled effect); cancel
    /// `shutdown` and await the handle to stop it (calls in flight settle first).
    ///
    /// Must be called within a Tokio runtime.
    ///
    /// # Errors
    /// As [`EffectsConfig::providers`].
    pub fn spawn(
        &self,
        db: &Database,
        handler: Arc<dyn EffectHandler>,
        shutdown: CancellationToken,
    ) -> Result<JoinHandle<()>, RuntimeError> {
        let providers = self.providers()?;
        let names: Vec<String> = providers.iter().map(|p| p.name().to_owned()).collect();
        let runner = Arc::new(EffectRunner::new(
            EffectStore::new(db.clone()),
            providers,
            handler,
            self.runner.clone(),
        ));
        tracing::info!(providers = ?names, runner = %self.runner.runner_id, "effect runner starting");
        Ok(tokio::spawn(runner.run(shutdown)))
    }
}

/// Runs the effect runner `effects` describes on `db` (migrated) until `shutdown` resolves,
/// with `GET /metrics` on `metrics` when given; then stops it (calls in flight settle) and
/// the metrics listener, and returns.
///
/// # Errors
/// [`RuntimeError::NoProviders`] when no provider is configured; [`RuntimeError::Bind`]
/// when the metrics address cannot be bound; the errors of [`EffectsConfig::providers`];
/// [`RuntimeError::Task`] when a task panicked.
pub async fn run_effects(
    db: &Database,
    effects: &EffectsConfig,
    handler: Arc<dyn EffectHandler>,
    metrics: Option<MetricsEndpoint>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RuntimeError> {
    if effects.is_empty() {
        return Err(RuntimeError::NoProviders);
    }
    // Fail on a bad configuration before binding anything.
    effects.providers()?;
    run_until_shutdown(metrics, shutdown, |stop| async move {
        effects.spawn(db, handler, stop)
    })
    .await
}
