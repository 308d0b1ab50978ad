//! [`BrokerArgs`] and [`RelayArgs`]: which broker, how to reach it, and the outbox relay's
//! settings (`oncely relay`, a service's in-process relay, the consumers' subscriber).

use std::time::Duration;

use clap::Args;
use oncely_core::RetryPolicy;
use oncely_outbox::RelayConfig;
use oncely_runtime::{BrokerConfig, BrokerKind, RelaySupervisor};

/// Which broker, and how to reach it (shared by the relay's publisher and the inbox
/// consumers' subscriber).
#[derive(Debug, Clone, Args)]
pub struct BrokerArgs {
    /// Broker the relay publishes to and the inbox consumers read from.
    #[arg(long, env = "ONCELY_BROKER", value_enum, default_value_t = BrokerKind::Sql)]
    broker: BrokerKind,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "ONCELY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    amqp_url: String,
    /// RabbitMQ exchange (declared durable, type topic); the event topic is the routing key.
    #[arg(long, env = "ONCELY_AMQP_EXCHANGE", default_value = "oncely")]
    amqp_exchange: String,
    /// Prefix of the consumer groups' RabbitMQ queues: `<prefix>.<group>`, `….retry`,
    /// `….dead`. Give each environment sharing a vhost its own.
    #[arg(long, env = "ONCELY_AMQP_QUEUE_PREFIX", default_value = "oncely")]
    amqp_queue_prefix: String,
    /// NATS URL.
    #[arg(long, env = "ONCELY_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// JetStream stream created at start-up if missing (empty: create none).
    #[arg(long, env = "ONCELY_NATS_STREAM", default_value = "ONCELY")]
    nats_stream: String,
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
    kafka_brokers: String,
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
    kafka_group_prefix: Option<String>,
    /// SQL transport: largest payload, in bytes.
    #[arg(long, env = "ONCELY_SQL_MAX_MESSAGE_BYTES", default_value_t = 1024 * 1024)]
    sql_max_message_bytes: usize,
}

impl BrokerArgs {
    /// The broker configuration these arguments describe.
    pub fn config(&self) -> BrokerConfig {
        BrokerConfig {
            kind: self.broker,
            amqp_url: self.amqp_url.clone(),
            amqp_exchange: self.amqp_exchange.clone(),
            amqp_queue_prefix: self.amqp_queue_prefix.clone(),
            nats_url: self.nats_url.clone(),
            nats_stream: self.nats_stream.clone(),
            nats_subjects: self.nats_subjects.clone(),
            kafka_brokers: self.kafka_brokers.clone(),
            kafka_topics: self.kafka_topics.clone(),
            kafka_partitions: self.kafka_partitions,
            kafka_group_prefix: self.kafka_group_prefix.clone(),
            sql_max_message_bytes: self.sql_max_message_bytes,
        }
    }
}

/// Broker and relay settings (shared by `serve` and `relay`).
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    /// The broker the relay publishes to.
    pub broker: BrokerArgs,
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
    fn config(&self) -> RelayConfig {
        RelayConfig {
            batch_size: self.relay_batch.max(1),
            poll_interval: Duration::from_millis(self.relay_poll_ms.max(1)),
            lease: Duration::from_secs(self.relay_lease_secs.max(1)),
            retry: RetryPolicy {
                base: Duration::from_millis(self.relay_backoff_base_ms),
                cap: Duration::from_secs(self.relay_backoff_cap_secs),
                max_attempts: self.relay_max_attempts.max(1),
                ..RetryPolicy::default()
            },
            retention: Duration::from_secs(self.outbox_retention_secs),
            vacuum_after_rows: self.outbox_vacuum_after_rows,
            ..RelayConfig::default()
        }
    }

    /// The supervised relay these arguments describe.
    pub fn supervisor(&self) -> RelaySupervisor {
        RelaySupervisor {
            broker: self.broker.config(),
            relay: self.config(),
        }
    }
}
