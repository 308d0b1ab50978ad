//! Which broker, how to reach it, and the relay's publisher.

use std::sync::Arc;

use oncely_broker::{DeadLetters, Publisher, SqlDeadLetters, SqlTransport};
use oncely_sql::Database;

use crate::RuntimeError;

/// Which broker the relay publishes to and the inbox consumers read from.
///
/// Every kind exists in every build; one whose feature is off fails at connection with
/// [`RuntimeError::BrokerNotBuilt`], so a configuration parses the same everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum BrokerKind {
    /// The SQL transport: table `oncely_queue` in the same database (no broker needed).
    #[default]
    Sql,
    /// RabbitMQ (AMQP 0-9-1) with publisher confirms.
    Rabbitmq,
    /// NATS JetStream with `Nats-Msg-Id` de-duplication.
    Nats,
    /// Kafka: idempotent producer, `acks=all`, record key = partition key.
    Kafka,
}

impl BrokerKind {
    /// Whether this build supports the kind: always for [`BrokerKind::Sql`], else when the
    /// feature of the same name is on.
    pub fn is_built(self) -> bool {
        match self {
            Self::Sql => true,
            Self::Rabbitmq => cfg!(feature = "rabbitmq"),
            Self::Nats => cfg!(feature = "nats"),
            Self::Kafka => cfg!(feature = "kafka"),
        }
    }

    /// The feature (and `--broker` value) of this kind: `sql`, `rabbitmq`, `nats`, `kafka`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sql => "sql",
            Self::Rabbitmq => "rabbitmq",
            Self::Nats => "nats",
            Self::Kafka => "kafka",
        }
    }
}

/// Which broker, and how to reach it (shared by the relay's publisher and the inbox
/// consumers' subscribers). Only the fields of [`BrokerConfig::kind`] are read.
/// [`Default`] is the `oncely` binary's defaults: the SQL transport, and every broker on
/// its standard loopback port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// The broker.
    pub kind: BrokerKind,
    /// RabbitMQ URL. Default `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub amqp_url: String,
    /// RabbitMQ exchange (declared durable, type topic); the event topic is the routing
    /// key. Default `oncely`.
    pub amqp_exchange: String,
    /// Prefix of the consumer groups' RabbitMQ queues: `<prefix>.<group>`, `….retry`,
    /// `….dead`. Default `oncely`.
    pub amqp_queue_prefix: String,
    /// NATS URL. Default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// JetStream stream created at start-up if missing (empty: create none). Default
    /// `ONCELY`.
    pub nats_stream: String,
    /// Subjects of that stream. Default `orders`, `orders.>`.
    pub nats_subjects: Vec<String>,
    /// Kafka bootstrap servers, comma-separated `host:port`. Default `127.0.0.1:9092`.
    pub kafka_brokers: String,
    /// Kafka topics created at start-up if missing (empty entries skipped). Default
    /// `orders`.
    pub kafka_topics: Vec<String>,
    /// Partitions of the topics created at start-up (at least 1). Default 3.
    pub kafka_partitions: i32,
    /// Prefix of the consumer groups' Kafka group ids: `<prefix>.<group>` (`None`: the
    /// group name alone).
    pub kafka_group_prefix: Option<String>,
    /// SQL transport: largest payload the relay publishes, in bytes. Default 1 MiB.
    pub sql_max_message_bytes: usize,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            kind: BrokerKind::Sql,
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned(),
            amqp_exchange: "oncely".to_owned(),
            amqp_queue_prefix: "oncely".to_owned(),
            nats_url: "nats://127.0.0.1:4222".to_owned(),
            nats_stream: "ONCELY".to_owned(),
            nats_subjects: vec!["orders".to_owned(), "orders.>".to_owned()],
            kafka_brokers: "127.0.0.1:9092".to_owned(),
            kafka_topics: vec!["orders".to_owned()],
            kafka_partitions: 3,
            kafka_group_prefix: None,
            sql_max_message_bytes: 1024 * 1024,
        }
    }
}

impl BrokerConfig {
    /// Connects the relay's publisher: the SQL transport on `db`, or the configured broker
    /// (creating the NATS stream or the Kafka topics first when configured).
    ///
    /// # Errors
    /// [`RuntimeError::BrokerNotBuilt`] for a broker whose feature is off;
    /// [`RuntimeError::RabbitMqConnect`], [`RuntimeError::NatsConnect`],
    /// [`RuntimeError::NatsStream`], [`RuntimeError::KafkaTopic`] or
    /// [`RuntimeError::KafkaProducer`] when the broker cannot be reached or refuses.
    // Async for the brokers; the SQL transport alone connects nothing.
    #[cfg_attr(
        not(any(feature = "rabbitmq", feature = "nats", feature = "kafka")),
        allow(clippy::unused_async)
    )]
    pub async fn publisher(&self, db: &Database) -> Result<Arc<dyn Publisher>, RuntimeError> {
        Ok(match self.kind {
            BrokerKind::Sql => Arc::new(SqlTransport::new(db.clone(), self.sql_max_message_bytes)),
            #[cfg(feature = "rabbitmq")]
            BrokerKind::Rabbitmq => {
                let mut c = oncely_broker::RabbitMqConfig::new(&self.amqp_url);
                c.exchange.clone_from(&self.amqp_exchange);
                Arc::new(
                    oncely_broker::RabbitMqPublisher::connect(c)
                        .await
                        .map_err(|e| RuntimeError::RabbitMqConnect(e.into()))?,
                )
            }
            #[cfg(feature = "nats")]
            BrokerKind::Nats => Arc::new(self.nats_publisher().await?),
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                self.ensure_kafka_topics().await?;
                Arc::new(
                    oncely_broker::KafkaPublisher::new(oncely_broker::KafkaConfig::new(
                        &self.kafka_brokers,
                    ))
                    .map_err(|e| RuntimeError::KafkaProducer(e.into()))?,
                )
            }
            #[allow(unreachable_patterns)] // with every broker feature on
            other => return Err(not_built(other)),
        })
    }

    /// The inbox consumer groups' dead letters on the configured broker, to list and
    /// requeue ([`DeadLetters`]): the SQL transport's in `db`; RabbitMQ's dead queues
    /// `<amqp_queue_prefix>.<group>.dead`; NATS's DLQ stream `ONCELY_DLQ`; Kafka's
    /// `<topic>.dlq.<group>` for each of [`BrokerConfig::kafka_topics`]. Connects nothing
    /// yet: each call reaches the broker.
    ///
    /// # Errors
    /// [`RuntimeError::DatabaseRequired`] for the SQL transport without `db`;
    /// [`RuntimeError::BrokerNotBuilt`] for a broker whose feature is off.
    pub fn dead_letters(
        &self,
        db: Option<&Database>,
    ) -> Result<Arc<dyn DeadLetters>, RuntimeError> {
        Ok(match self.kind {
            BrokerKind::Sql => Arc::new(SqlDeadLetters::new(
                db.ok_or(RuntimeError::DatabaseRequired)?.clone(),
            )),
            #[cfg(feature = "rabbitmq")]
            BrokerKind::Rabbitmq => {
                let mut c = oncely_broker::RabbitMqDeadLettersConfig::new(&self.amqp_url);
                c.queue_prefix.clone_from(&self.amqp_queue_prefix);
                Arc::new(oncely_broker::RabbitMqDeadLetters::new(c))
            }
            #[cfg(feature = "nats")]
            BrokerKind::Nats => Arc::new(oncely_broker::NatsDeadLetters::new(
                oncely_broker::NatsDeadLettersConfig::new(&self.nats_url),
            )),
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                let mut c = oncely_broker::KafkaDeadLettersConfig::new(
                    &self.kafka_brokers,
                    self.kafka_topics.clone(),
                );
                c.partitions = self.kafka_partitions.max(1);
                Arc::new(oncely_broker::KafkaDeadLetters::new(c))
            }
            #[allow(unreachable_patterns)] // with every broker feature on
            other => return Err(not_built(other)),
        })
    }

    /// A NATS publisher on [`BrokerConfig::nats_url`], with the configured stream ensured.
    ///
    /// # Errors
    /// [`RuntimeError::NatsConnect`] or [`RuntimeError::NatsStream`].
    #[cfg(feature = "nats")]
    pub(crate) async fn nats_publisher(
        &self,
    ) -> Result<oncely_broker::NatsPublisher, RuntimeError> {
        let p =
            oncely_broker::NatsPublisher::connect(oncely_broker::NatsConfig::new(&self.nats_url))
                .await
                .map_err(|e| RuntimeError::NatsConnect(e.into()))?;
        if !self.nats_stream.is_empty() {
            p.ensure_stream(&self.nats_stream, &self.nats_subjects)
                .await
                .map_err(|e| RuntimeError::NatsStream {
                    stream: self.nats_stream.clone(),
                    source: e.into(),
                })?;
        }
        Ok(p)
    }

    /// Creates the configured Kafka topics if missing.
    ///
    /// # Errors
    /// [`RuntimeError::KafkaTopic`] naming the first topic that could not be ensured.
    #[cfg(feature = "kafka")]
    pub(crate) async fn ensure_kafka_topics(&self) -> Result<(), RuntimeError> {
        for t in self.kafka_topics.iter().filter(|t| !t.is_empty()) {
            oncely_broker::ensure_topic(&self.kafka_brokers, t, self.kafka_partitions.max(1))
                .await
                .map_err(|e| RuntimeError::KafkaTopic {
                    topic: t.clone(),
                    source: e.into(),
                })?;
        }
        Ok(())
    }
}

/// The error for a broker this build has no support for.
pub(crate) fn not_built(kind: BrokerKind) -> RuntimeError {
    RuntimeError::BrokerNotBuilt {
        broker: kind.as_str(),
    }
}
