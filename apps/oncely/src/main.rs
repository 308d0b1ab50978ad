//! The `oncely` binary: argument parsing and wiring over the libraries (the runtime assembly
//! — brokers, supervision, metrics endpoint, signals, logging — is `oncely-runtime`).
//!
//! - `oncely serve` — the reference order service (SQLite by default).
//! - `oncely migrate` — applies the embedded migrations and exits.
//! - `oncely relay` — the outbox relay alone (`serve` runs one in-process by default).
//! - `oncely outbox stats|dead list|dead requeue` — outbox operator commands.
//! - `oncely consume billing|shipping` — an inbox consumer alone, on the SQL transport,
//!   RabbitMQ or NATS (`--broker`; `serve` runs `billing` — and, with `--shipping-url`,
//!   `shipping` — in-process by default on the relay's broker).
//! - `oncely orders import FILE --tenant T` — the manual fallback: NDJSON order bodies
//!   through the service's own rules (idempotency key per line, business key).
//! - `oncely inbox dead list|requeue` — a consumer group's dead letters on any broker.
//! - `oncely effects list|show|retry|resolve` — outgoing effects, audited operator actions;
//!   `oncely effects run` — the effect runner alone (`serve` runs one in-process when a
//!   provider is configured).
//! - `oncely saga list|show|retry` — sagas across tenants, one with its step log and
//!   evidence, the audited retry of a parked step (logic in `oncely-saga`).
//! - `oncely reconcile [resolve]` — a provider's records against the local intents over a
//!   window, and the audited resolution of a discrepancy (logic in `oncely-effects`).
//! - `oncely verify` — the idempotency acceptance checks against any HTTP endpoint
//!   (logic in `oncely-verify`).
//! - `oncely sim payments|shipping` — a provider simulator (logic in `oncely-sim`).
//!
//! The benchmarks are their own binary: `cargo run --release -p oncely-bench -- intake|relay|inbox …`.

mod consume_cmd;
mod effects_cmd;
mod idempotency_cmd;
mod orders_cmd;
mod reconcile_cmd;
mod relay_cmd;
mod saga_cmd;
mod sim_cmd;
mod verify_cmd;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use oncely_http::IdempotencyConfig;
use oncely_runtime::{redact, shutdown_signal, LogFormat, MetricsEndpoint};
use oncely_sql::{Database, DbOptions};
use orders::AppConfig;

#[derive(Debug, Parser)]
#[command(
    name = "oncely",
    version,
    about = "One business operation, one business effect — however often it is delivered."
)]
struct Cli {
    /// Log format.
    #[arg(long, env = "ONCELY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the order service.
    Serve(Box<ServeArgs>),
    /// Apply the embedded migrations and exit.
    Migrate(DbArgs),
    /// Run the outbox relay alone (publishes outbox events to the broker).
    Relay(RelayCmdArgs),
    /// Outbox operator commands.
    Outbox(OutboxArgs),
    /// Run an inbox consumer alone (from the broker `--broker` names).
    Consume(ConsumeCmdArgs),
    /// Inbox consumer operator commands: dead letters on the broker `--broker` names.
    Inbox(InboxArgs),
    /// Outgoing effects: list, show with evidence, retry, resolve (audited).
    Effects(EffectsArgs),
    /// Sagas: list, show with steps and evidence, retry a parked step (audited).
    Saga(SagaArgs),
    /// Idempotency records: list them, e.g. the multi-phase ones left `processing` or
    /// `unknown`.
    Idempotency(IdempotencyArgs),
    /// Reconcile a provider's records with the local intents over a window; resolve a
    /// discrepancy (audited).
    Reconcile(reconcile_cmd::ReconcileArgs),
    /// Orders: the manual fallback `import` (NDJSON through the service's rules).
    Orders(OrdersArgs),
    /// Check that an HTTP endpoint is idempotent under retries (key handling, S1-S4, scope).
    Verify(verify_cmd::VerifyArgs),
    /// Run a provider simulator (Stripe v1 subset or keyless shipping) with fault injection.
    Sim(sim_cmd::SimArgs),
}

#[derive(Debug, Args)]
struct EffectsArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: effects_cmd::EffectsCommand,
}

#[derive(Debug, Args)]
struct SagaArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: saga_cmd::SagaCommand,
}

#[derive(Debug, Args)]
struct IdempotencyArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: idempotency_cmd::IdempotencyCommand,
}

#[derive(Debug, Args)]
struct OrdersArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: orders_cmd::OrdersCommand,
}

#[derive(Debug, Args)]
struct InboxArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: consume_cmd::InboxCommand,
}

#[derive(Debug, Args)]
struct ConsumeCmdArgs {
    /// Which consumer.
    #[arg(value_enum)]
    name: consume_cmd::ConsumerName,
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    broker: relay_cmd::BrokerArgs,
    #[command(flatten)]
    consumer: consume_cmd::ConsumerArgs,
    /// Billing: payments are configured (the URL the runner charges at), so each new
    /// invoice's charge is enqueued with it. Unset: billing stops at the invoice.
    #[arg(long, env = "ONCELY_PAYMENTS_URL")]
    payments_url: Option<String>,
    /// Serve the consumer's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9465).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

#[derive(Debug, Args)]
struct RelayCmdArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    relay: relay_cmd::RelayArgs,
    /// Serve the relay's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9464).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

#[derive(Debug, Args)]
struct OutboxArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: relay_cmd::OutboxCommand,
}

/// `global`: also accepted after a subcommand's own subcommand (`oncely outbox stats
/// --database-url …` as well as `oncely outbox --database-url … stats`).
#[derive(Debug, Args)]
struct DbArgs {
    /// Database URL: sqlite://FILE, postgres://… or mysql://… (MySQL 8.0+ / MariaDB 10.6+)
    #[arg(
        long,
        env = "ONCELY_DATABASE_URL",
        default_value = "sqlite://oncely.db",
        global = true
    )]
    database_url: String,
    /// Largest number of pooled database connections.
    #[arg(
        long,
        env = "ONCELY_DB_MAX_CONNECTIONS",
        default_value_t = 16,
        global = true
    )]
    db_max_connections: u32,
    /// PostgreSQL / MySQL: seconds a request may wait for pool acquire + BEGIN + the key
    /// claim before it answers 503 (a frozen or paused database).
    #[arg(
        long,
        env = "ONCELY_DB_STORE_TIMEOUT_SECS",
        default_value_t = DbOptions::default().store_timeout.as_secs(),
        global = true
    )]
    db_store_timeout_secs: u64,
    /// Seconds the database lets a session idle inside a transaction before it ends the
    /// session, freeing the keys of a process that died or lost its path mid-request.
    #[arg(
        long,
        env = "ONCELY_DB_IDLE_TRANSACTION_TIMEOUT_SECS",
        default_value_t = DbOptions::default().idle_transaction_timeout.as_secs(),
        global = true
    )]
    db_idle_transaction_timeout_secs: u64,
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    relay: relay_cmd::RelayArgs,
    /// Do not run the outbox relay in this process (run `oncely relay` elsewhere).
    #[arg(long, env = "ONCELY_NO_RELAY")]
    no_relay: bool,
    #[command(flatten)]
    consumer: consume_cmd::ConsumerArgs,
    /// Do not run the `billing` consumer (nor, with `--shipping-url`, the `shipping` one)
    /// in this process (run `oncely consume billing|shipping` elsewhere). They read from
    /// the relay's broker (`--broker`).
    #[arg(long, env = "ONCELY_NO_CONSUMER")]
    no_consumer: bool,
    #[command(flatten)]
    providers: effects_cmd::ProviderArgs,
    #[command(flatten)]
    fulfilment: saga_cmd::FulfilmentArgs,
    /// Do not run the effect runner in this process although a provider is configured (run
    /// `oncely effects run` elsewhere).
    #[arg(long, env = "ONCELY_NO_RUNNER")]
    no_runner: bool,
    /// Lease of a `POST /v1/orders/{id}/payments` holder (multi-phase mode), in seconds;
    /// must exceed --provider-timeout-ms. Past it a retry asks the provider by reference.
    #[arg(long, env = "ONCELY_PAYMENT_LEASE_SECS", default_value_t = 60)]
    payment_lease_secs: u64,
    /// How often multi-phase records whose lease ran out are turned `unknown` (and the
    /// lease gauges set), in seconds.
    #[arg(long, env = "ONCELY_LEASE_SWEEP_SECS", default_value_t = 10)]
    lease_sweep_secs: u64,
    /// Reconcile every configured provider every SECS seconds, in process (0: off — run
    /// `oncely reconcile` by hand or from cron).
    #[arg(
        long,
        env = "ONCELY_RECONCILE_EVERY",
        default_value_t = 0,
        value_name = "SECS"
    )]
    reconcile_every: u64,
    /// Window of each periodic reconciliation run, in seconds back from its start.
    #[arg(long, env = "ONCELY_RECONCILE_WINDOW_SECS", default_value_t = 86_400)]
    reconcile_window_secs: u64,
    /// Listen address.
    #[arg(long, env = "ONCELY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// API keys and their tenants: `key=tenant[,key=tenant…]` (keys ≥ 16 characters).
    #[arg(long, env = "ONCELY_API_KEYS", hide_env_values = true)]
    api_keys: String,
    /// The operator console's admin token (at least 16 characters): `/console` is served and
    /// a browser signs in with this token. Unset: the console is off (404).
    #[arg(long, env = "ONCELY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Retention of finished idempotency records, in seconds (default 24 h).
    #[arg(long, env = "ONCELY_RETENTION_SECS", default_value_t = 86_400)]
    retention_secs: u64,
    /// How long a retry that finds its key in flight waits for the first answer, in ms
    /// (0: answer 409 with Retry-After at once).
    #[arg(long, env = "ONCELY_IN_FLIGHT_WAIT_MS", default_value_t = 0)]
    in_flight_wait_ms: u64,
    /// Largest request body, in bytes.
    #[arg(long, env = "ONCELY_MAX_REQUEST_BYTES", default_value_t = 1024 * 1024)]
    max_request_bytes: usize,
    /// Largest response stored for replay, in bytes.
    #[arg(long, env = "ONCELY_MAX_STORED_RESPONSE_BYTES", default_value_t = 256 * 1024)]
    max_stored_response_bytes: usize,
    /// Interval of the retention collector, in seconds.
    #[arg(long, env = "ONCELY_COLLECTOR_INTERVAL_SECS", default_value_t = 60)]
    collector_interval_secs: u64,
    /// Topic of the order service's events: AMQP routing key, NATS subject, SQL-transport
    /// topic.
    #[arg(long, env = "ONCELY_EVENTS_TOPIC", default_value = orders::ORDERS_TOPIC)]
    events_topic: String,
    /// Seconds a client may take to send a request's head before its connection is closed
    /// (slowloris guard).
    #[arg(long, env = "ONCELY_HEADER_READ_TIMEOUT_SECS", default_value_t = 30)]
    header_read_timeout_secs: u64,
    /// Seconds a client may take to send a request's whole body after its head (a total
    /// deadline; 408 past it).
    #[arg(long, env = "ONCELY_BODY_READ_TIMEOUT_SECS", default_value_t = 30)]
    body_read_timeout_secs: u64,
    /// Seconds a response write may stall (the client not reading) before the connection
    /// is closed.
    #[arg(long, env = "ONCELY_WRITE_TIMEOUT_SECS", default_value_t = 30)]
    write_timeout_secs: u64,
    /// Most connections served at once; more wait in the listen backlog.
    #[arg(long, env = "ONCELY_MAX_CONNECTIONS", default_value_t = 512)]
    max_connections: usize,
    /// Most request-body bytes buffered at once over all requests; a request beyond it gets
    /// 503 with Retry-After.
    #[arg(long, env = "ONCELY_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = 64 * 1024 * 1024)]
    max_body_bytes_in_flight: usize,
}

impl DbArgs {
    fn options(&self) -> DbOptions {
        DbOptions {
            max_connections: self.db_max_connections,
            store_timeout: Duration::from_secs(self.db_store_timeout_secs.max(1)),
            idle_transaction_timeout: Duration::from_secs(
                self.db_idle_transaction_timeout_secs.max(1),
            ),
            ..DbOptions::default()
        }
    }

    /// Connects and applies oncely's and the order service's migrations (for the commands
    /// that use the orders schema: `serve`, `migrate`, `consume billing`).
    async fn connect_orders(&self) -> anyhow::Result<Database> {
        let db = oncely_runtime::connect(&self.database_url, &self.options()).await?;
        orders::migrate(&db).await.context("applying migrations")?;
        Ok(db)
    }

    /// Connects and applies oncely's own migrations only (the relay: outbox and queue).
    async fn connect_oncely(&self) -> anyhow::Result<Database> {
        let db = oncely_runtime::connect(&self.database_url, &self.options()).await?;
        db.migrate().await.context("applying migrations")?;
        Ok(db)
    }

    /// Connects to a database a service set up, migrating nothing (operator commands).
    async fn connect_existing(&self) -> anyhow::Result<Database> {
        Ok(oncely_runtime::connect_existing(&self.database_url, &self.options()).await?)
    }
}

/// `GET /metrics` on `listen`, with the order service's recorder (installed on first use).
fn metrics_endpoint(listen: Option<SocketAddr>) -> Option<MetricsEndpoint> {
    listen.map(|listen| MetricsEndpoint {
        listen,
        handle: orders::metrics_handle(),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    oncely_runtime::init_logging(cli.log_format);
    match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Migrate(args) => {
            args.connect_orders().await?;
            tracing::info!(database = %redact(&args.database_url), "migrations applied");
            Ok(())
        }
        Command::Relay(args) => {
            let db = args.db.connect_oncely().await?;
            let metrics = metrics_endpoint(args.metrics_listen);
            let relay = args.relay.supervisor();
            Ok(oncely_runtime::run_relay(&db, &relay, metrics, shutdown_signal()).await?)
        }
        Command::Outbox(args) => {
            relay_cmd::outbox(args.db.connect_existing().await?, args.command).await
        }
        Command::Orders(args) => orders_cmd::run(args.command, || args.db.connect_orders()).await,
        Command::Inbox(args) => {
            let broker = args.command.broker().config();
            // Only the SQL transport keeps its dead letters in the database.
            let db = match broker.kind {
                oncely_runtime::BrokerKind::Sql => Some(args.db.connect_existing().await?),
                _ => None,
            };
            consume_cmd::inbox(broker.dead_letters(db.as_ref())?, args.command).await
        }
        Command::Effects(args) => match args.command {
            effects_cmd::EffectsCommand::Run(run) => effects_run(&args.db, &run).await,
            command => effects_cmd::effects(args.db.connect_existing().await?, command).await,
        },
        Command::Saga(args) => {
            let db = args.db.connect_existing().await?;
            saga_cmd::saga(db, orders::saga_definitions(), args.command).await
        }
        Command::Idempotency(args) => {
            idempotency_cmd::idempotency(args.db.connect_existing().await?, args.command).await
        }
        Command::Reconcile(args) => reconcile_cmd::reconcile(args).await,
        Command::Verify(args) => verify_cmd::run(&args).await,
        Command::Sim(args) => sim_cmd::run(args, shutdown_signal()).await,
        Command::Consume(args) => {
            let db = args.db.connect_orders().await?;
            let metrics = metrics_endpoint(args.metrics_listen);
            let broker = args.broker.config();
            let settings = args.consumer.settings(args.name);
            let flow = consume_cmd::Flow {
                name: args.name,
                charge: args.payments_url.is_some(),
                orchestrator: None,
            };
            Ok(oncely_runtime::run_consumer(
                &db,
                &broker,
                &settings,
                &flow,
                metrics,
                shutdown_signal(),
            )
            .await?)
        }
    }
}

/// `oncely effects run`: the effect runner alone; under `--fulfilment saga` with the
/// orchestrator as its handler and the saga's timeout sweep beside it.
async fn effects_run(db: &DbArgs, run: &effects_cmd::RunArgs) -> anyhow::Result<()> {
    let db = db.connect_orders().await?;
    let metrics = metrics_endpoint(run.metrics_listen);
    let order_effects = effects_cmd::service_handler(&run.events_topic);
    let effects = run.providers.config();
    if !run.fulfilment.saga() {
        return Ok(oncely_runtime::run_effects(
            &db,
            &effects,
            order_effects,
            metrics,
            shutdown_signal(),
        )
        .await?);
    }
    let orchestrator = Arc::new(orders::fulfilment_orchestrator(
        db.clone(),
        &run.fulfilment.config(),
        oncely_saga::OrchestratorConfig::default(),
        order_effects,
    ));
    let stop = tokio_util::sync::CancellationToken::new();
    let sweep = tokio::spawn(orchestrator.clone().run(stop.clone()));
    let ran =
        oncely_runtime::run_effects(&db, &effects, orchestrator, metrics, shutdown_signal()).await;
    stop.cancel();
    sweep.await?;
    Ok(ran?)
}

async fn serve(mut args: ServeArgs) -> anyhow::Result<()> {
    let api_keys = orders::parse_api_keys(&args.api_keys).context("parsing --api-keys")?;
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
    let config = AppConfig {
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
        header_read_timeout: Duration::from_secs(args.header_read_timeout_secs.max(1)),
        body_read_timeout: Duration::from_secs(args.body_read_timeout_secs.max(1)),
        write_timeout: Duration::from_secs(args.write_timeout_secs.max(1)),
        max_connections: args.max_connections.max(1),
        max_body_bytes_in_flight: args.max_body_bytes_in_flight.max(1),
        dependencies: dependencies(&args),
        fulfilment: args.fulfilment.config(),
        payments: args
            .providers
            .payment_settings(Duration::from_secs(args.payment_lease_secs.max(1)))?,
        lease_sweep_interval: Duration::from_secs(args.lease_sweep_secs.max(1)),
        ..AppConfig::default()
    };
    anyhow::ensure!(
        !args.fulfilment.saga() || (args.providers.payments() && args.providers.shipping()),
        "--fulfilment saga needs payments and shipping configured (--payments-url, --shipping-url)"
    );
    let db = args.db.connect_orders().await?;
    let shutdown = shutdown_signal();
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(
        listen = %listener.local_addr()?,
        database = %redact(&args.db.database_url),
        tenants = config.api_keys.len(),
        retention_secs = args.retention_secs,
        "oncely serve: order service ready"
    );
    // Install the metrics recorder before the relay records anything.
    let _ = orders::metrics_handle();
    let stop_workers = tokio_util::sync::CancellationToken::new();
    let workers = spawn_workers(&mut args, &db, &stop_workers).await?;
    orders::serve(listener, db, config, shutdown).await?;
    stop_workers.cancel();
    for worker in workers {
        worker.await?;
    }
    tracing::info!("stopped");
    Ok(())
}

/// What `/readyz` checks besides the database: the broker when this process relays or
/// consumes, and each configured provider.
fn dependencies(args: &ServeArgs) -> Vec<orders::Dependency> {
    let mut deps = Vec::new();
    if !args.no_relay || !args.no_consumer {
        let broker = args.relay.broker.config();
        let target = match broker.kind {
            oncely_runtime::BrokerKind::Sql => "",
            oncely_runtime::BrokerKind::Rabbitmq => broker.amqp_url.as_str(),
            oncely_runtime::BrokerKind::Nats => broker.nats_url.as_str(),
            oncely_runtime::BrokerKind::Kafka => broker.kafka_brokers.as_str(),
        };
        deps.push(orders::Dependency::broker(broker.kind.as_str(), target));
    }
    let providers = [
        (orders::PAYMENTS, &args.providers.payments_url),
        (orders::SHIPPING, &args.providers.shipping_url),
    ];
    for (name, url) in providers {
        if let Some(url) = url {
            deps.push(orders::Dependency::Provider {
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
    args.consumer.consumer_topic.clone_from(&args.events_topic);
    let broker = args.relay.broker.config();
    let order_effects = effects_cmd::service_handler(&args.events_topic);
    let saga = args.fulfilment.saga().then(|| {
        Arc::new(orders::fulfilment_orchestrator(
            db.clone(),
            &args.fulfilment.config(),
            oncely_saga::OrchestratorConfig::default(),
            order_effects.clone(),
        ))
    });
    if !args.no_consumer {
        for flow in consumers(args, saga.as_ref()) {
            let settings = args.consumer.settings(flow.name);
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
            None => order_effects,
        };
        workers.push(effects.spawn(db, handler, stop.clone())?);
    }
    if let Some(orchestrator) = saga {
        workers.push(tokio::spawn(orchestrator.run(stop.clone())));
    }
    if args.reconcile_every > 0 {
        let reconcilers = reconcile_cmd::reconcilers(db, &effects, &args.events_topic)?;
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
fn consumers(
    args: &ServeArgs,
    saga: Option<&Arc<oncely_saga::Orchestrator>>,
) -> Vec<consume_cmd::Flow> {
    if let Some(orchestrator) = saga {
        return vec![consume_cmd::Flow {
            name: consume_cmd::ConsumerName::Fulfilment,
            charge: false,
            orchestrator: Some(orchestrator.clone()),
        }];
    }
    let mut consumers = vec![consume_cmd::Flow {
        name: consume_cmd::ConsumerName::Billing,
        charge: args.providers.payments(),
        orchestrator: None,
    }];
    if args.providers.shipping() {
        consumers.push(consume_cmd::Flow {
            name: consume_cmd::ConsumerName::Shipping,
            charge: false,
            orchestrator: None,
        });
    }
    consumers
}
