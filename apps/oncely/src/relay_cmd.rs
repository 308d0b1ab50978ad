//! `oncely relay`, the relay settings `oncely serve` shares, and `oncely outbox …`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use oncely_broker::{
    KafkaConfig, KafkaPublisher, NatsConfig, NatsPublisher, Publisher, RabbitMqConfig,
    RabbitMqPublisher, SqlTransport,
};
use oncely_core::RetryPolicy;
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::{Database, OutboxStore, RequeueTarget};
use tokio_util::sync::CancellationToken;

/// Which broker the relay publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BrokerKind {
    /// The SQL transport: table `oncely_queue` in the same database (no broker needed).
    Sql,
    /// RabbitMQ (AMQP 0-9-1) with publisher confirms.
    Rabbitmq,
    /// NATS JetStream with `Nats-Msg-Id` de-duplication.
    Nats,
    /// Kafka: idempotent producer, `acks=all`, record key = partition key.
    Kafka,
}

/// Which broker, and how to reach it (shared by the relay's publisher and the inbox
/// consumers' subscriber).
#[derive(Debug, Clone, Args)]
pub(crate) struct BrokerArgs {
    /// Broker the relay publishes to and the inbox consumers read from.
    #[arg(long, env = "ONCELY_BROKER", value_enum, default_value_t = BrokerKind::Sql)]
    pub(crate) broker: BrokerKind,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "ONCELY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    pub(crate) amqp_url: String,
    /// RabbitMQ exchange (declared durable, type topic); the event topic is the routing key.
    #[arg(long, env = "ONCELY_AMQP_EXCHANGE", default_value = "oncely")]
    pub(crate) amqp_exchange: String,
    /// Prefix of the consumer groups' RabbitMQ queues: `<prefix>.<group>`, `….retry`,
    /// `….dead`. Give each environment sharing a vhost its own.
    #[arg(long, env = "ONCELY_AMQP_QUEUE_PREFIX", default_value = "oncely")]
    pub(crate) amqp_queue_prefix: String,
    /// NATS URL.
    #[arg(long, env = "ONCELY_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub(crate) nats_url: String,
    /// JetStream stream created at start-up if missing (empty: create none).
    #[arg(long, env = "ONCELY_NATS_STREAM", default_value = "ONCELY")]
    pub(crate) nats_stream: String,
    /// Subjects of that stream, comma-separated.
    #[arg(
        long,
        env = "ONCELY_NATS_SUBJECTS",
        default_value = "orders,orders.>",
        value_delimiter = ','
    )]
    nats_subjects: Vec<String>,
    /// Kafka bootstrap servers, comma-separated `host:port`.
    #[arg(long, env = "ONCELY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub(crate) kafka_brokers: String,
    /// Kafka topics created at start-up if missing, comma-separated (empty: create none).
    #[arg(
        long,
        env = "ONCELY_KAFKA_TOPICS",
        default_value = "orders",
        value_delimiter = ','
    )]
    kafka_topics: Vec<String>,
    /// Partitions of the topics created at start-up.
    #[arg(long, env = "ONCELY_KAFKA_PARTITIONS", default_value_t = 3)]
    kafka_partitions: i32,
    /// Prefix of the consumer groups' Kafka group ids: `<prefix>.<group>` (unset: the group
    /// name alone, e.g. `billing`). Give each environment sharing a cluster its own.
    #[arg(long, env = "ONCELY_KAFKA_GROUP_PREFIX")]
    pub(crate) kafka_group_prefix: Option<String>,
    /// SQL transport: largest payload, in bytes.
    #[arg(long, env = "ONCELY_SQL_MAX_MESSAGE_BYTES", default_value_t = 1024 * 1024)]
    sql_max_message_bytes: usize,
}

impl BrokerArgs {
    /// Creates the configured Kafka topics if missing.
    pub(crate) async fn ensure_kafka_topics(&self) -> anyhow::Result<()> {
        for t in self.kafka_topics.iter().filter(|t| !t.is_empty()) {
            oncely_broker::ensure_topic(&self.kafka_brokers, t, self.kafka_partitions.max(1))
                .await
                .with_context(|| format!("creating Kafka topic {t}"))?;
        }
        Ok(())
    }

    /// Creates the configured JetStream stream if missing (no-op when `--nats-stream` is
    /// empty).
    pub(crate) async fn ensure_nats_stream(&self, p: &NatsPublisher) -> anyhow::Result<()> {
        if !self.nats_stream.is_empty() {
            p.ensure_stream(&self.nats_stream, &self.nats_subjects)
                .await
                .with_context(|| format!("creating stream {}", self.nats_stream))?;
        }
        Ok(())
    }
}

/// Broker and relay settings (shared by `serve` and `relay`).
#[derive(Debug, Clone, Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    pub(crate) broker: BrokerArgs,
    /// Rows claimed and published per round (the confirmation window).
    #[arg(long, env = "ONCELY_RELAY_BATCH", default_value_t = 256)]
    relay_batch: u32,
    /// Idle polling interval, in ms (PostgreSQL also wakes the relay by LISTEN/NOTIFY).
    #[arg(long, env = "ONCELY_RELAY_POLL_MS", default_value_t = 250)]
    relay_poll_ms: u64,
    /// Lease on claimed rows, in seconds (must exceed the broker confirm timeout, 10 s).
    #[arg(long, env = "ONCELY_RELAY_LEASE_SECS", default_value_t = 30)]
    relay_lease_secs: u64,
    /// Failed publishes after which an event is dead.
    #[arg(long, env = "ONCELY_RELAY_MAX_ATTEMPTS", default_value_t = 10)]
    relay_max_attempts: u32,
    /// Backoff: upper bound of the first retry's wait, in ms (full jitter, doubling).
    #[arg(long, env = "ONCELY_RELAY_BACKOFF_BASE_MS", default_value_t = 500)]
    relay_backoff_base_ms: u64,
    /// Backoff: upper bound of any wait, in seconds.
    #[arg(long, env = "ONCELY_RELAY_BACKOFF_CAP_SECS", default_value_t = 300)]
    relay_backoff_cap_secs: u64,
    /// How long published outbox rows are kept, in seconds. 0 (the default): not kept — on
    /// PostgreSQL a row is gone once its publish is settled, elsewhere the next cleanup
    /// deletes it. Keeping them costs the relay a write per event.
    #[arg(long, env = "ONCELY_OUTBOX_RETENTION_SECS", default_value_t = 0)]
    outbox_retention_secs: u64,
    /// PostgreSQL: rows the relay claims between two `VACUUM`s of `oncely_outbox` (each
    /// claimed row leaves a dead entry that later claims step over). 0: leave it to
    /// autovacuum.
    #[arg(
        long,
        env = "ONCELY_OUTBOX_VACUUM_AFTER_ROWS",
        default_value_t = 20_000
    )]
    outbox_vacuum_after_rows: u64,
}

impl RelayArgs {
    /// The relay configuration these arguments describe.
    pub(crate) fn config(&self) -> RelayConfig {
        RelayConfig {
            batch_size: self.relay_batch.max(1),
            poll_interval: Duration::from_millis(self.relay_poll_ms.max(1)),
            lease: Duration::from_secs(self.relay_lease_secs.max(1)),
            retry: RetryPolicy {
                base: Duration::from_millis(self.relay_backoff_base_ms),
                cap: Duration::from_secs(self.relay_backoff_cap_secs),
                max_attempts: self.relay_max_attempts.max(1),
            },
            retention: Duration::from_secs(self.outbox_retention_secs),
            vacuum_after_rows: self.outbox_vacuum_after_rows,
            ..RelayConfig::default()
        }
    }

    /// Connects the configured broker.
    pub(crate) async fn publisher(&self, db: &Database) -> anyhow::Result<Arc<dyn Publisher>> {
        let b = &self.broker;
        Ok(match b.broker {
            BrokerKind::Sql => Arc::new(SqlTransport::new(db.clone(), b.sql_max_message_bytes)),
            BrokerKind::Rabbitmq => {
                let mut c = RabbitMqConfig::new(&b.amqp_url);
                c.exchange.clone_from(&b.amqp_exchange);
                Arc::new(
                    RabbitMqPublisher::connect(c)
                        .await
                        .context("connecting to RabbitMQ")?,
                )
            }
            BrokerKind::Nats => {
                let p = NatsPublisher::connect(NatsConfig::new(&b.nats_url))
                    .await
                    .context("connecting to NATS")?;
                b.ensure_nats_stream(&p).await?;
                Arc::new(p)
            }
            BrokerKind::Kafka => {
                b.ensure_kafka_topics().await?;
                Arc::new(
                    KafkaPublisher::new(KafkaConfig::new(&b.kafka_brokers))
                        .context("creating the Kafka producer")?,
                )
            }
        })
    }

    /// Starts a relay task; cancel `shutdown` and await the handle to stop it.
    ///
    /// A broker that cannot be reached at start-up does not stop the process: the outbox
    /// keeps every event while the task retries the connection (1 s doubling to 30 s,
    /// logged), then relays. Set `ONCELY_FAULT=relay-abort-after-confirm` (tests and chaos
    /// drills only) to abort the process right after the broker confirmed a batch and
    /// before the outbox records it — the crash window of at-least-once publishing.
    pub(crate) fn spawn(
        &self,
        db: &Database,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let (args, db) = (self.clone(), db.clone());
        tokio::spawn(async move {
            let mut backoff = Duration::from_secs(1);
            let publisher = loop {
                match args.publisher(&db).await {
                    Ok(p) => break p,
                    Err(e) => {
                        tracing::warn!(
                            error = format!("{e:#}"),
                            retry_in_s = backoff.as_secs(),
                            "broker unreachable; events wait in the outbox"
                        );
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                }
            };
            tracing::info!(broker = publisher.name(), "outbox relay starting");
            let mut relay = Relay::new(db, publisher.clone(), args.config());
            if std::env::var("ONCELY_FAULT").as_deref() == Ok("relay-abort-after-confirm") {
                tracing::warn!("fault injection: aborting after the first confirmed batch");
                relay = relay.with_fault_after_confirm(Arc::new(|rows| {
                    if !rows.is_empty() {
                        eprintln!(
                            "ONCELY_FAULT: aborting after confirm of {} rows",
                            rows.len()
                        );
                        std::process::abort();
                    }
                }));
            }
            relay.run(shutdown).await;
            publisher.close().await;
        })
    }
}

/// Serves `GET /metrics` (the process's metrics in the Prometheus text format) on `addr`
/// until `shutdown` is cancelled.
pub(crate) async fn serve_metrics(
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let handle = orders::metrics_handle();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    );
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(listen = %listener.local_addr()?, "metrics on /metrics");
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "metrics listener failed");
        }
    }))
}

/// `oncely outbox …`: operator commands.
#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// Depth, oldest pending age and dead count.
    Stats,
    /// Dead events.
    #[command(subcommand)]
    Dead(DeadCommand),
}

/// `oncely outbox dead …`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// Lists dead events (id, message id, topic, partition key, type, attempts, last error).
    List {
        /// Most rows to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Puts dead events back to pending (attempts reset).
    Requeue {
        /// The outbox row id to requeue.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<i64>,
        /// Requeue every dead event.
        #[arg(long)]
        all: bool,
    },
}

/// Runs an `oncely outbox` command, printing to stdout.
pub(crate) async fn outbox(db: Database, cmd: OutboxCommand) -> anyhow::Result<()> {
    let store = OutboxStore::new(db);
    match cmd {
        OutboxCommand::Stats => {
            let s = store.stats().await?;
            let age_ms = s.oldest_pending_age_ms(oncely_core::now_ms());
            println!(
                "{}",
                serde_json::json!({
                    "pending": s.pending,
                    "oldest_pending_age_seconds": age_ms as f64 / 1000.0,
                    "dead": s.dead,
                })
            );
        }
        OutboxCommand::Dead(DeadCommand::List { limit }) => {
            let rows = store.dead(0, limit).await?;
            println!("id\tmessage_id\ttopic\tpartition_key\tevent_type\tattempts\tlast_error");
            for r in rows {
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    r.id,
                    r.event.message_id,
                    r.event.topic,
                    r.event.partition_key,
                    r.event.event_type,
                    r.attempts,
                    r.last_error.unwrap_or_default().replace(['\t', '\n'], " "),
                );
            }
        }
        OutboxCommand::Dead(DeadCommand::Requeue { id, all }) => {
            let target = match (id, all) {
                (_, true) => RequeueTarget::All,
                (Some(id), false) => RequeueTarget::Id(id),
                (None, false) => anyhow::bail!("give an id or --all"),
            };
            let n = store.requeue_dead(target, oncely_core::now_ms()).await?;
            if let (RequeueTarget::Id(id), 0) = (target, n) {
                anyhow::bail!("no dead event with id {id}");
            }
            println!("requeued {n}");
        }
    }
    Ok(())
}
