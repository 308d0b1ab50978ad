//! Inbox consumers on the configured broker.

use std::future::Future;
use std::time::Duration;

use oncely_broker::{SqlSubscriber, SqlTransport, Subscriber};
use oncely_inbox::{Consumer, ConsumerConfig};
use oncely_sql::Database;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::broker::not_built;
use crate::metrics::run_until_shutdown;
use crate::{BrokerConfig, BrokerKind, MetricsEndpoint, RuntimeError};

/// Builds a service's consumer on whichever subscriber the configuration picks — the one
/// place a service names its handler. For a consumer with a plain handler:
///
/// ```
/// # use std::sync::Arc;
/// # use oncely_broker::Subscriber;
/// # use oncely_inbox::{Consumer, ConsumerConfig, Handler};
/// # use oncely_sql::Database;
/// struct Billing(Arc<dyn Handler>);
/// impl oncely_runtime::ConsumerFactory for Billing {
///     fn build<S: Subscriber>(&self, db: &Database, s: S, c: ConsumerConfig) -> Consumer<S> {
///         Consumer::new(db.clone(), s, self.0.clone(), c)
///     }
/// }
/// ```
pub trait ConsumerFactory {
    /// The consumer of `subscriber`'s group, with its inbox and effects in `db`, configured
    /// by `config`.
    fn build<S: Subscriber>(
        &self,
        db: &Database,
        subscriber: S,
        config: ConsumerConfig,
    ) -> Consumer<S>;
}

/// One inbox consumer group's settings, for any broker.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// The group (the inbox's `consumer` column; the RabbitMQ queue / NATS durable /
    /// Kafka group id is derived from it), e.g. `billing`.
    pub group: String,
    /// The topic read (AMQP routing key, NATS subject, Kafka or SQL-transport topic).
    pub topic: String,
    /// Lease on a claimed message (SQL transport) / `ack_wait` (NATS): an unacknowledged
    /// message is delivered again after it; must exceed the handler's longest run.
    /// RabbitMQ redelivers when the channel closes, Kafka from the last committed offset.
    pub lease: Duration,
    /// The consumer's settings. Its `concurrency` also sets the RabbitMQ prefetch and the
    /// NATS fetch batch.
    pub consumer: ConsumerConfig,
}

impl ConsumerSettings {
    /// Subscribes the consumer `factory` builds on `broker` and starts it on `db` (with the
    /// service's schema migrated); cancel `shutdown` and await the handle to stop it.
    ///
    /// A broker that is down at start-up is not fatal: the subscription is retried by the
    /// consumer's receive loop once it is up (logged at `WARN`). For NATS the configured
    /// stream is ensured first, as the relay does, since the consumer may start first.
    ///
    /// Must be called within a Tokio runtime.
    ///
    /// # Errors
    /// [`RuntimeError::NatsStreamRequired`] for NATS without
    /// [`BrokerConfig::nats_stream`]; [`RuntimeError::BrokerNotBuilt`] for a broker whose
    /// feature is off.
    pub async fn spawn<F: ConsumerFactory>(
        &self,
        broker: &BrokerConfig,
        db: &Database,
        factory: &F,
        shutdown: CancellationToken,
    ) -> Result<JoinHandle<()>, RuntimeError> {
        let (group, topic) = (self.group.as_str(), self.topic.as_str());
        match broker.kind {
            BrokerKind::Sql => {
                // Receiving only: the transport's publish limit does not apply.
                let transport = SqlTransport::new(db.clone(), usize::MAX);
                let sub = SqlSubscriber::new(transport, group, topic, self.lease);
                Ok(self.start(db, sub, factory, shutdown).await)
            }
            #[cfg(feature = "rabbitmq")]
            BrokerKind::Rabbitmq => {
                let mut c =
                    oncely_broker::RabbitMqSubscriberConfig::new(&broker.amqp_url, group, topic)
                        .with_queue_prefix(&broker.amqp_queue_prefix);
                c.exchange.clone_from(&broker.amqp_exchange);
                c.prefetch = u16::try_from(self.prefetch()).unwrap_or(u16::MAX);
                let sub = oncely_broker::RabbitMqSubscriber::new(c);
                Ok(self.start(db, sub, factory, shutdown).await)
            }
            #[cfg(feature = "nats")]
            BrokerKind::Nats => {
                if broker.nats_stream.is_empty() {
                    return Err(RuntimeError::NatsStreamRequired);
                }
                // The stream may not exist yet when the consumer starts before the relay. A
                // broker that is down is not fatal: the consumer keeps trying (as the relay).
                if let Err(e) = broker.nats_publisher().await {
                    tracing::warn!(error = %oncely_broker::error_chain(&e), "NATS stream not ensured; the consumer retries");
                }
                let mut c = oncely_broker::NatsSubscriberConfig::new(
                    &broker.nats_url,
                    &broker.nats_stream,
                    group,
                    topic,
                );
                c.ack_wait = self.lease;
                c.batch = self.prefetch();
                let sub = oncely_broker::NatsSubscriber::new(c);
                Ok(self.start(db, sub, factory, shutdown).await)
            }
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                let mut c =
                    oncely_broker::KafkaSubscriberConfig::new(&broker.kafka_brokers, group, topic);
                if let Some(prefix) = &broker.kafka_group_prefix {
                    c.group_id = format!("{prefix}.{group}");
                }
                let sub = oncely_broker::KafkaSubscriber::new(c);
                Ok(self.start(db, sub, factory, shutdown).await)
            }
            #[allow(unreachable_patterns)] // with every broker feature on
            other => Err(not_built(other)),
        }
    }

    /// Messages in flight per receive: the consumer's concurrency (at least 1).
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    fn prefetch(&self) -> usize {
        self.consumer.concurrency.max(1)
    }

    async fn start<S: Subscriber, F: ConsumerFactory>(
        &self,
        db: &Database,
        subscriber: S,
        factory: &F,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        let consumer = factory.build(db, subscriber, self.consumer.clone());
        // A broker that is down at start-up is not fatal (the relay starts without it too):
        // the consumer's receive loop connects and subscribes once it is up.
        if let Err(e) = consumer.subscribe().await {
            tracing::warn!(consumer = consumer.name(), error = %e, "cannot subscribe yet; retrying in the background");
        }
        tracing::info!(
            consumer = consumer.name(),
            broker = consumer.subscriber().broker(),
            topic = %self.topic,
            "inbox consumer starting"
        );
        tokio::spawn(consumer.run(shutdown))
    }
}

/// Runs the consumer `factory` builds, per `consumer` on `broker`, on `db` until `shutdown`
/// resolves, with `GET /metrics` on `metrics` when given; then stops the consumer (messages
/// in hand finish) and the metrics listener, and returns.
///
/// # Errors
/// [`RuntimeError::Bind`] when the metrics address cannot be bound; the errors of
/// [`ConsumerSettings::spawn`]; [`RuntimeError::Task`] when a task panicked.
pub async fn run_consumer<F: ConsumerFactory>(
    db: &Database,
    broker: &BrokerConfig,
    consumer: &ConsumerSettings,
    factory: &F,
    metrics: Option<MetricsEndpoint>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RuntimeError> {
    run_until_shutdown(metrics, shutdown, |stop| {
        consumer.spawn(broker, db, factory, stop)
    })
    .await
}
