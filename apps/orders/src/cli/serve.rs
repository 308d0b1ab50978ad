//! `orders serve`: the order service, and what runs beside it in-process as configured —
//! the relay, its consumers, the effect runner and the periodic reconciler.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use oncely_effects::StripeConfig;
use oncely_http::IdempotencyConfig;
use oncely_runtime::{redact, shutdown_signal};
use oncely_sql::Database;

use super::consume::{consumer_name, ConsumerName, Flow};
use super::effects::{service_handler, FulfilmentArgs};
use crate::AppConfig;

/// `orders serve`.
#[derive(Debug, Args)]
pub(super) struct ServeArgs {
    /// API keys and their tenants: `key=tenant[,key=tenant…]` (keys ≥ 16 characters).
    #[arg(long, env = "ONCELY_API_KEYS", hide_env_values = true)]
    api_keys: String,
    /// Listen address.
    #[arg(long, env = "ONCELY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The operator console's admin token (at least 16 characters): `/console` is served and
    /// a browser signs in with this token. Unset: the console is off (404).
    #[arg(long, env = "ONCELY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    #[command(flatten, next_help_heading = "Database")]
    db: oncely_cli::DbArgs,
    #[command(flatten, next_help_heading = "Outbox relay")]
    relay: oncely_cli::RelayArgs,
    /// Do not run the outbox relay in this process (run `oncely relay` elsewhere).
    #[arg(help_heading = "Outbox relay", long, env = "ONCELY_NO_RELAY")]
    no_relay: bool,
    #[command(flatten, next_help_heading = "Consumers")]
    consumer: oncely_cli::ConsumerArgs,
    /// Do not run the `billing` consumer (nor, with `--shipping-url`, the `shipping` one)
    /// in this process (run `orders consume billing|shipping` elsewhere). They read from
    /// the relay's broker (`--broker`).
    #[arg(help_heading = "Consumers", long, env = "ONCELY_NO_CONSUMER")]
    no_consumer: bool,
    /// Topic of the order service's events: AMQP routing key, NATS subject, SQL-transport
    /// topic.
    #[arg(help_heading = "Consumers", long, env = "ONCELY_EVENTS_TOPIC", default_value = crate::ORDERS_TOPIC)]
    events_topic: String,
    #[command(flatten, next_help_heading = "Providers and effects")]
    providers: oncely_cli::ProviderArgs,
    #[command(flatten, next_help_heading = "Providers and effects")]
    fulfilment: FulfilmentArgs,
    /// Do not run the effect runner in this process although a provider is configured (run
    /// `orders effects run` elsewhere).
    #[arg(help_heading = "Providers and effects", long, env = "ONCELY_NO_RUNNER")]
    no_runner: bool,
    /// Lease of a `POST /v1/orders/{id}/payments` holder (multi-phase mode), in seconds;
    /// must exceed --provider-timeout-ms. Past it a retry asks the provider by reference.
    #[arg(
        help_heading = "Providers and effects",
        long,
        env = "ONCELY_PAYMENT_LEASE_SECS",
        default_value_t = 60
    )]
    payment_lease_secs: u64,
    /// How often multi-phase records whose lease ran out are turned `unknown` (and the
    /// lease gauges set), in seconds.
    #[arg(
        help_heading = "Providers and effects",
        long,
        env = "ONCELY_LEASE_SWEEP_SECS",
        default_value_t = 10
    )]
    lease_sweep_secs: u64,
    /// Stripe webhook signing secrets (`whsec_…`), comma-separated or the flag repeated
    /// (several while a secret rolls): serves `POST /v1/webhooks/stripe`, which settles an
    /// unknown charge from Stripe's signed event. Needs --payments-url. Unset: no such
    /// route (404).
    #[arg(
        help_heading = "Providers and effects",
        long,
        env = "ONCELY_STRIPE_WEBHOOK_SECRET",
        hide_env_values = true,
        value_delimiter = ','
    )]
    stripe_webhook_secret: Vec<String>,
    /// How far a Stripe-Signature timestamp may lie from our clock, either way, in seconds.
    #[arg(
        help_heading = "Providers and effects",
        long,
        env = "ONCELY_STRIPE_WEBHOOK_TOLERANCE_SECS",
        default_value_t = 300
    )]
    stripe_webhook_tolerance_secs: u64,
    /// Reconcile every configured provider every SECS seconds, in process (0: off — run
    /// `oncely reconcile` by hand or from cron).
    #[arg(
        help_heading = "Reconciliation",
        long,
        env = "ONCELY_RECONCILE_EVERY",
        default_value_t = 0,
        value_name = "SECS"
    )]
    reconcile_every: u64,
    /// Window of each periodic reconciliation run, in seconds back from its start.
    #[arg(
        help_heading = "Reconciliation",
        long,
        env = "ONCELY_RECONCILE_WINDOW_SECS",
        default_value_t = 86_400
    )]
    reconcile_window_secs: u64,
    /// Retention of finished idempotency records, in seconds (default 24 h).
    #[arg(
        help_heading = "Idempotency",
        long,
        env = "ONCELY_RETENTION_SECS",
        default_value_t = 86_400
    )]
    retention_secs: u64,
    /// How long a retry that finds its key in flight waits for the first answer, in ms
    /// (0: answer 409 with Retry-After at once).
    #[arg(
        help_heading = "Idempotency",
        long,
        env = "ONCELY_IN_FLIGHT_WAIT_MS",
        default_value_t = 0
    )]
    in_flight_wait_ms: u64,
    /// Largest request body, in bytes.
    #[arg(help_heading = "Idempotency", long, env = "ONCELY_MAX_REQUEST_BYTES", default_value_t = 1024 * 1024)]
    max_request_bytes: usize,
    /// Largest response stored for replay, in bytes.
    #[arg(help_heading = "Idempotency", long, env = "ONCELY_MAX_STORED_RESPONSE_BYTES", default_value_t = 256 * 1024)]
    max_stored_response_bytes: usize,
    /// Interval of the retention collector, in seconds.
    #[arg(
        help_heading = "Idempotency",
        long,
        env = "ONCELY_COLLECTOR_INTERVAL_SECS",
        default_value_t = 60
    )]
    collector_interval_secs: u64,
    #[command(flatten)]
    http: oncely_cli::HttpLimitArgs,
}

/// `orders serve`: the service and what runs beside it, until SIGTERM / Ctrl-C.
pub(super) async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    args.consumer.refuse_topic_other_than(&args.events_topic);
    let listener = oncely_cli::bind(args.listen, "--listen").await?;
    serve_on(args, listener).await
}

/// [`serve`] on `listener`, bound by the caller (`orders dev` binds before it starts its
/// simulators, so a port in use stops it first).
pub(super) async fn serve_on(
    mut args: ServeArgs,
    listener: tokio::net::TcpListener,
) -> anyhow::Result<()> {
    let api_keys = crate::parse_api_keys(&args.api_keys).context("parsing --api-keys")?;
    anyhow::ensure!(
        !api_keys.is_empty(),
        "no API keys configured: set --api-keys or ONCELY_API_KEYS"
    );
    if let Some(token) = &args.admin_token {
        anyhow::ensure!(
            token.trim().len() >= 16 && token.trim() == token,
            "--admin-token must be at least 16 characters, without surrounding spaces"
        );
        anyhow::ensure!(
            !api_keys.contains_key(token),
            "--admin-token must not also be a tenant API key"
        );
    }
    let mut config = AppConfig {
        admin_token: args.admin_token.clone(),
        dead_letters: {
            let broker = args.relay.broker.config();
            match broker.kind {
                oncely_runtime::BrokerKind::Sql => None,
                _ => Some(broker.dead_letters(None)?),
            }
        },
        api_keys,
        retention: Duration::from_secs(args.retention_secs),
        collector_interval: Duration::from_secs(args.collector_interval_secs.max(1)),
        idempotency: IdempotencyConfig {
            max_request_body: args.max_request_bytes,
            max_stored_response: args.max_stored_response_bytes,
            in_flight_wait: (args.in_flight_wait_ms > 0)
                .then(|| Duration::from_millis(args.in_flight_wait_ms)),
            ..IdempotencyConfig::default()
        },
        events_topic: args.events_topic.clone(),
        http: args.http.limits(),
        dependencies: dependencies(&args),
        fulfilment: args.fulfilment.config(),
        payments: args
            .providers
            .config()
            .payments
            .map(|payments| {
                payment_settings(
                    payments,
                    Duration::from_secs(args.payment_lease_secs.max(1)),
                )
            })
            .transpose()?,
        lease_sweep_interval: Duration::from_secs(args.lease_sweep_secs.max(1)),
        ..AppConfig::default()
    };
    anyhow::ensure!(
        !args.fulfilment.saga() || (args.providers.payments() && args.providers.shipping()),
        "--fulfilment saga needs payments and shipping configured (--payments-url, --shipping-url)"
    );
    args.db.require_pool(&pool_users(&args));
    let db = super::connect(&args.db).await?;
    config.stripe_webhook = stripe_webhook(&args, &db)?;
    let shutdown = shutdown_signal();
    tracing::info!(
        listen = %listener.local_addr()?,
        database = %redact(&args.db.database_url),
        tenants = config.api_keys.len(),
        retention_secs = args.retention_secs,
        "orders serve: order service ready"
    );
    // Install the metrics recorder before the relay records anything.
    let _ = crate::metrics_handle();
    let stop_workers = tokio_util::sync::CancellationToken::new();
    let workers = spawn_workers(&mut args, &db, &stop_workers).await?;
    crate::serve(listener, db, config, shutdown).await?;
    stop_workers.cancel();
    for worker in workers {
        worker.await?;
    }
    tracing::info!("stopped");
    Ok(())
}

/// `POST /v1/webhooks/stripe`'s settings, with `--stripe-webhook-secret`: the payments
/// provider's PaymentIntent reading, and the handler the service's runner settles with
/// (the saga's orchestrator under `--fulfilment saga`, else the resolution handler).
///
/// # Errors
/// Secrets without `--payments-url`; an empty secret; an HTTP client that cannot be built.
fn stripe_webhook(
    args: &ServeArgs,
    db: &Database,
) -> anyhow::Result<Option<crate::StripeWebhookSettings>> {
    let secrets: Vec<String> = args
        .stripe_webhook_secret
        .iter()
        .map(|s| s.trim().to_owned())
        .collect();
    if secrets.is_empty() {
        return Ok(None);
    }
    anyhow::ensure!(
        secrets.iter().all(|s| !s.is_empty()),
        "--stripe-webhook-secret: an empty secret"
    );
    let Some(payments) = args.providers.config().payments else {
        anyhow::bail!("--stripe-webhook-secret needs payments configured (--payments-url)");
    };
    let handler: Arc<dyn oncely_effects::EffectHandler> = if args.fulfilment.saga() {
        Arc::new(crate::fulfilment_orchestrator(
            db.clone(),
            &args.fulfilment.config(),
            oncely_saga::OrchestratorConfig::default(),
            service_handler(&args.events_topic),
        ))
    } else {
        crate::resolution_handler(db.clone(), &args.events_topic)
    };
    let config = oncely_effects::StripeWebhookConfig {
        secrets,
        tolerance: Duration::from_secs(args.stripe_webhook_tolerance_secs),
    };
    Ok(Some(crate::StripeWebhookSettings {
        webhook: oncely_effects::StripeWebhook::new(
            config,
            oncely_effects::StripePayments::new(payments)?,
        ),
        handler,
        lease: Duration::from_secs(60),
    }))
}

/// What shares `serve`'s pool: the service, and the workers it runs in-process.
fn pool_users(args: &ServeArgs) -> Vec<oncely_cli::PoolUser> {
    use oncely_cli::PoolUser;
    let runner = !args.no_runner && !args.providers.config().is_empty();
    [
        (true, PoolUser::Service),
        (!args.no_relay, PoolUser::Relay),
        (!args.no_consumer, PoolUser::Consumer),
        (runner, PoolUser::Runner),
    ]
    .into_iter()
    .filter_map(|(runs, user)| runs.then_some(user))
    .collect()
}

/// What `/readyz` checks besides the database: the broker when this process relays or
/// consumes, and each configured provider.
fn dependencies(args: &ServeArgs) -> Vec<crate::Dependency> {
    let mut deps = Vec::new();
    if !args.no_relay || !args.no_consumer {
        let broker = args.relay.broker.config();
        let target = match broker.kind {
            oncely_runtime::BrokerKind::Sql => "",
            oncely_runtime::BrokerKind::Rabbitmq => broker.amqp_url.as_str(),
            oncely_runtime::BrokerKind::Nats => broker.nats_url.as_str(),
            oncely_runtime::BrokerKind::Kafka => broker.kafka_brokers.as_str(),
        };
        deps.push(crate::Dependency::broker(broker.kind.as_str(), target));
    }
    let providers = [
        (crate::PAYMENTS, &args.providers.payments_url),
        (crate::SHIPPING, &args.providers.shipping_url),
    ];
    for (name, url) in providers {
        if let Some(url) = url {
            deps.push(crate::Dependency::Provider {
                name: name.to_owned(),
                url: url.clone(),
            });
        }
    }
    deps
}

/// Starts what `serve` runs beside the HTTP service, as configured: the relay; under the
/// choreography the `billing` consumer (charging with payments configured) and the
/// `shipping` consumer (with `--shipping-url`), under `--fulfilment saga` the
/// `fulfilment` consumer and the saga's timeout sweep; and the effect runner (with a
/// provider configured; under the saga with the orchestrator as its handler) and the
/// periodic reconciler (with `--reconcile-every`). Cancel `stop` and await the handles to
/// stop them.
async fn spawn_workers(
    args: &mut ServeArgs,
    db: &Database,
    stop: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut workers = Vec::new();
    // The in-process consumers read what this service publishes.
    args.consumer.consumer_topic = Some(args.events_topic.clone());
    let broker = args.relay.broker.config();
    let order_effects = service_handler(&args.events_topic);
    let saga = args.fulfilment.saga().then(|| {
        Arc::new(crate::fulfilment_orchestrator(
            db.clone(),
            &args.fulfilment.config(),
            oncely_saga::OrchestratorConfig::default(),
            order_effects.clone(),
        ))
    });
    if !args.no_consumer {
        for flow in consumers(args, saga.as_ref()) {
            let settings = args.consumer.settings(consumer_name(flow.name));
            workers.push(settings.spawn(&broker, db, &flow, stop.clone()).await?);
        }
    }
    // The relay after the consumers: each has subscribed (a RabbitMQ group's queue bound)
    // before the first event is published, so no group misses one (issue 26).
    if !args.no_relay {
        workers.push(args.relay.supervisor().spawn(db, stop.clone())?);
    }
    let effects = args.providers.config();
    if !args.no_runner && !effects.is_empty() {
        let handler: Arc<dyn oncely_effects::EffectHandler> = match &saga {
            Some(orchestrator) => orchestrator.clone(),
            // Under the choreography too a runner may be owed a saga step's continuation
            // (recorded by `oncely effects resolve` after a change of fulfilment mode):
            // the resolution handler continues the saga and completes every other effect
            // as `OrderEffects` would.
            None => crate::resolution_handler(db.clone(), &args.events_topic),
        };
        workers.push(effects.spawn(db, handler, stop.clone())?);
    }
    if let Some(orchestrator) = saga {
        workers.push(tokio::spawn(orchestrator.run(stop.clone())));
    }
    if args.reconcile_every > 0 {
        let reconcilers = reconcilers(db, &effects, &args.events_topic)?;
        let schedule = oncely_runtime::ReconcileSchedule {
            every: Duration::from_secs(args.reconcile_every),
            window: Duration::from_secs(args.reconcile_window_secs.max(1)),
        };
        workers.push(oncely_runtime::spawn_reconciler(
            reconcilers,
            schedule,
            stop.clone(),
        ));
    }
    Ok(workers)
}

/// The consumers `serve` runs in-process: `fulfilment` under the saga, else `billing` (and
/// `shipping` with shipping configured).
fn consumers(args: &ServeArgs, saga: Option<&Arc<oncely_saga::Orchestrator>>) -> Vec<Flow> {
    if let Some(orchestrator) = saga {
        return vec![Flow {
            name: ConsumerName::Fulfilment,
            charge: false,
            orchestrator: Some(orchestrator.clone()),
        }];
    }
    let mut consumers = vec![Flow {
        name: ConsumerName::Billing,
        charge: args.providers.payments(),
        orchestrator: None,
    }];
    if args.providers.shipping() {
        consumers.push(Flow {
            name: ConsumerName::Shipping,
            charge: false,
            orchestrator: None,
        });
    }
    consumers
}

/// The payments endpoint's settings for `payments` (`POST /v1/orders/{id}/payments`, multi-phase with
/// holders leased for `lease`), when payments are configured.
///
/// # Errors
/// Payments without a secret key; a lease that does not exceed the provider timeout;
/// an HTTP client that cannot be built.
fn payment_settings(
    payments: StripeConfig,
    lease: Duration,
) -> anyhow::Result<crate::PaymentsSettings> {
    anyhow::ensure!(
        !payments.secret_key.is_empty(),
        "--payments-url needs --payments-secret-key"
    );
    anyhow::ensure!(
        lease > payments.timeout,
        "--payment-lease-secs ({lease:?}) must exceed --provider-timeout-ms ({:?})",
        payments.timeout
    );
    Ok(crate::PaymentsSettings {
        provider: Arc::new(oncely_effects::StripePayments::new(payments)?),
        lease,
    })
}

/// One reconciler per provider `effects` configures (for `--reconcile-every`): the
/// effects and the payments endpoint's charges as local intents, completions through the
/// order service's handler (events to `events_topic`).
///
/// # Errors
/// As `EffectsConfig::providers`.
fn reconcilers(
    db: &Database,
    effects: &oncely_runtime::EffectsConfig,
    events_topic: &str,
) -> anyhow::Result<Vec<oncely_effects::Reconciler>> {
    let service = super::service(db, events_topic);
    Ok(effects
        .providers()?
        .into_iter()
        .map(|provider| service.reconciler(db, provider))
        .collect())
}
