//! `oncely effects …`: the operator's view of outgoing effects, the two actions a person
//! takes on one (logic in `oncely_sql::EffectStore`; every action writes an audit row), and
//! `oncely effects run`, the effect runner alone. [`ProviderArgs`]: the providers and runner
//! settings shared by `serve`, `effects run` (and later `reconcile`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use oncely_effects::{EffectHandler, Provider, RunnerConfig, ShippingConfig, StripeConfig};
use oncely_runtime::{EffectsConfig, RuntimeError};
use oncely_sql::{Database, Effect, EffectState, EffectStore, Resolution};
use serde_json::json;

/// The outgoing-effect providers and the effect runner's settings (shared by `oncely
/// serve` and `oncely effects run`). Without `--payments-url` and `--shipping-url` no
/// provider is configured: `serve` then stops at the invoice, as before effects existed.
#[derive(Debug, Clone, Args)]
pub(crate) struct ProviderArgs {
    /// Payments provider (Stripe API v1) base URL: https://api.stripe.com (with a test-mode
    /// key: test mode), a localstripe, or `oncely sim payments`. Set: billing enqueues a
    /// charge per new invoice.
    #[arg(long, env = "ONCELY_PAYMENTS_URL")]
    pub(crate) payments_url: Option<String>,
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
    pub(crate) shipping_url: Option<String>,
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
    pub(crate) fn payments(&self) -> bool {
        self.payments_url.is_some()
    }

    /// `true` when a shipping provider is configured (the shipping consumer then runs).
    pub(crate) fn shipping(&self) -> bool {
        self.shipping_url.is_some()
    }

    /// The providers and runner settings these arguments describe.
    /// `ONCELY_FAULT=runner-abort-after-call` (crash tests and chaos drills only) makes the
    /// runner abort the process right after a provider call returned, before it settles.
    pub(crate) fn config(&self) -> EffectsConfig {
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
            abort_after_call: std::env::var("ONCELY_FAULT").as_deref()
                == Ok("runner-abort-after-call"),
            ..defaults
        };
        EffectsConfig {
            payments,
            shipping,
            runner,
        }
    }

    /// The payments endpoint's settings (`POST /v1/orders/{id}/payments`, multi-phase with
    /// holders leased for `lease`), when payments are configured.
    /// `ONCELY_FAULT=payment-abort-before-call` / `payment-abort-after-call` (crash tests
    /// only) make the endpoint abort the process before its provider call went out / after
    /// it returned, before the outcome is stored.
    ///
    /// # Errors
    /// Payments without a secret key; a lease that does not exceed the provider timeout;
    /// an HTTP client that cannot be built.
    pub(crate) fn payment_settings(
        &self,
        lease: Duration,
    ) -> anyhow::Result<Option<orders::PaymentsSettings>> {
        let Some(payments) = self.config().payments else {
            return Ok(None);
        };
        anyhow::ensure!(
            !payments.secret_key.is_empty(),
            "--payments-url needs --payments-secret-key"
        );
        anyhow::ensure!(
            lease > payments.timeout,
            "--payment-lease-secs ({lease:?}) must exceed --provider-timeout-ms ({:?})",
            payments.timeout
        );
        let fault = match std::env::var("ONCELY_FAULT").as_deref() {
            Ok("payment-abort-before-call") => Some(orders::PaymentFault::AbortBeforeCall),
            Ok("payment-abort-after-call") => Some(orders::PaymentFault::AbortAfterCall),
            _ => None,
        };
        if let Some(f) = fault {
            tracing::warn!(fault = ?f, "fault injection in the payments endpoint");
        }
        Ok(Some(orders::PaymentsSettings {
            provider: Arc::new(oncely_effects::StripePayments::new(payments)?),
            lease,
            fault,
        }))
    }

    /// The configured providers' adapters (for the runner, and for `reconcile`).
    ///
    /// # Errors
    /// As [`EffectsConfig::providers`].
    #[allow(dead_code)] // for `oncely reconcile`, which lists the providers' objects
    pub(crate) fn providers(&self) -> Result<Vec<Arc<dyn Provider>>, RuntimeError> {
        self.config().providers()
    }
}

/// `oncely effects run`: the effect runner alone.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) providers: ProviderArgs,
    /// Topic the runner writes the service's events to (`invoice.paid`); the service's
    /// `--events-topic`.
    #[arg(long, env = "ONCELY_EVENTS_TOPIC", default_value = orders::ORDERS_TOPIC)]
    pub(crate) events_topic: String,
    /// Serve the runner's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9466).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// With `--fulfilment saga` the runner continues the fulfilment sagas whose steps'
    /// effects it settles.
    #[command(flatten)]
    pub(crate) fulfilment: crate::saga_cmd::FulfilmentArgs,
}

/// `oncely effects …`.
#[derive(Debug, Subcommand)]
pub(crate) enum EffectsCommand {
    /// Runs the effect runner alone until SIGTERM / Ctrl-C (then lets calls in flight
    /// settle): claims due effects, calls or checks each at its provider, settles it with
    /// the order service's update (invoice paid + invoice.paid).
    Run(RunArgs),
    /// Lists effects (oldest first), in one state when `--state` is given.
    List {
        /// Only effects in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// Most rows to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One effect with its evidence (every call and status check) and its audit trail.
    Show {
        /// The effect's id.
        id: String,
    },
    /// Tries a `needs_review`, `unknown` or `failed` effect again. Never a blind call: an
    /// unknown outcome is checked at the provider first; a failed one is sent under its
    /// key's next generation.
    Retry {
        /// The effect's id.
        id: String,
        /// Who asks (for the audit row).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
    },
    /// Records what a person found at the provider for a `needs_review`, `unknown` or
    /// `absent` effect.
    Resolve {
        /// The effect's id.
        id: String,
        /// What happened.
        #[arg(long = "as", value_enum)]
        outcome: Outcome,
        /// The provider's object id (required with `--as succeeded`).
        #[arg(long, required_if_eq("outcome", "succeeded"))]
        provider_id: Option<String>,
        /// Why (for the audit row).
        #[arg(long, default_value = "resolved by an operator")]
        reason: String,
        /// Who resolves (for the audit row).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
        /// Topic of the event the resolution writes (`invoice.paid` for a charge resolved
        /// as succeeded); the service's `--events-topic`.
        #[arg(long, env = "ONCELY_EVENTS_TOPIC", default_value = orders::ORDERS_TOPIC)]
        events_topic: String,
    },
}

/// The order service's completion of its effects (an invoice marked paid and `invoice.paid`
/// for a succeeded charge), in the transaction that settles each: the runners' handler under
/// the choreography (under the saga, the orchestrator's inner one). Resolutions and
/// reconcilers use [`orders::resolution_handler`], which also continues a saga's step.
pub(crate) fn service_handler(events_topic: &str) -> Arc<dyn EffectHandler> {
    Arc::new(orders::OrderEffects::new(events_topic))
}

/// An effect state on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum StateArg {
    Pending,
    InFlight,
    Succeeded,
    Failed,
    Unknown,
    Absent,
    NeedsReview,
}

impl From<StateArg> for EffectState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Pending => Self::Pending,
            StateArg::InFlight => Self::InFlight,
            StateArg::Succeeded => Self::Succeeded,
            StateArg::Failed => Self::Failed,
            StateArg::Unknown => Self::Unknown,
            StateArg::Absent => Self::Absent,
            StateArg::NeedsReview => Self::NeedsReview,
        }
    }
}

/// What an operator resolves an effect as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Outcome {
    Succeeded,
    Failed,
}

fn row(e: &Effect) -> serde_json::Value {
    json!({
        "id": e.id, "tenant": e.tenant, "provider": e.provider, "operation": e.operation,
        "reference": e.reference, "state": e.state_word, "attempts": e.attempts,
        "checks": e.checks, "key": e.key, "provider_id": e.provider_id,
        "last_error": e.last_error, "created_at": e.created_at, "updated_at": e.updated_at,
    })
}

/// Runs an `oncely effects` command, printing to stdout.
pub(crate) async fn effects(db: Database, cmd: EffectsCommand) -> anyhow::Result<()> {
    let store = EffectStore::new(db);
    let now = oncely_core::now_ms();
    match cmd {
        EffectsCommand::Run(_) => {
            anyhow::bail!("`oncely effects run` is started by main, not as an operator command")
        }
        EffectsCommand::List { state, limit, json } => {
            let rows = store.list(state.map(Into::into), limit).await?;
            if json {
                for e in &rows {
                    println!("{}", row(e));
                }
                return Ok(());
            }
            println!("id\tprovider\toperation\treference\tstate\tattempts\tchecks\tprovider_id\tlast_error");
            for e in rows {
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    e.id,
                    e.provider,
                    e.operation,
                    e.reference,
                    e.state_word,
                    e.attempts,
                    e.checks,
                    e.provider_id.unwrap_or_default(),
                    e.last_error.unwrap_or_default().replace(['\t', '\n'], " "),
                );
            }
        }
        EffectsCommand::Show { id } => {
            let effect = store
                .get(&id)
                .await?
                .ok_or_else(|| anyhow::anyhow!("no effect {id}"))?;
            let evidence: Vec<_> = store
                .evidence(&id)
                .await?
                .into_iter()
                .map(|e| {
                    json!({"n": e.n, "kind": e.kind, "key": e.key, "started_at": e.started_at,
                        "finished_at": e.finished_at, "outcome": e.outcome,
                        "http_status": e.http_status, "provider_ids": e.provider_ids,
                        "detail": e.detail})
                })
                .collect();
            let audit: Vec<_> = store
                .audit_trail(&id)
                .await?
                .into_iter()
                .map(|(at, actor, action, from, to, detail)| {
                    json!({"at": at, "actor": actor, "action": action, "from": from, "to": to,
                        "detail": detail})
                })
                .collect();
            let mut out = row(&effect);
            out["request"] = effect.params()?;
            out["evidence"] = evidence.into();
            out["audit"] = audit.into();
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        EffectsCommand::Retry { id, actor } => {
            let e = oncely_effects::retry_effect(&store, &id, &actor, now).await?;
            println!("{}", row(&e));
        }
        EffectsCommand::Resolve {
            id,
            outcome,
            provider_id,
            reason,
            actor,
            events_topic,
        } => {
            let resolution = Resolution {
                to: match outcome {
                    Outcome::Succeeded => EffectState::Succeeded,
                    Outcome::Failed => EffectState::Failed,
                },
                provider_id: provider_id.as_deref(),
                actor: &actor,
                reason: &reason,
            };
            // The business update the runner would have made (invoice paid, invoice.paid;
            // a saga step's continuation) commits with the resolution and its audit row.
            let handler = orders::resolution_handler(store.database().clone(), &events_topic);
            let e = oncely_effects::resolve_effect(
                &store,
                oncely_effects::Continue::Here(&*handler),
                &id,
                &resolution,
                now,
            )
            .await?;
            println!("{}", row(&e));
        }
    }
    Ok(())
}
