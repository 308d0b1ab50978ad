//! Publishers for oncely's outbox relay, behind one [`Publisher`] trait, and subscribers
//! for its inbox consumers, behind one [`Subscriber`] trait.
//!
//! Every publisher confirms each message before it reports success, so the relay marks an
//! outbox row published only when the broker has taken responsibility for it. A message
//! carries its [`MessageId`](oncely_core::MessageId) where each broker expects one (AMQP
//! `message_id`, JetStream `Nats-Msg-Id`, a Kafka record header) and the same set of headers everywhere:
//! `message-id`, `event-type`, `partition-key`, and the event's own (`correlation-id`,
//! `idempotency-key`, `traceparent`).
//!
//! # Layout
//! - `dead_letter` — the [`DeadLetters`] trait (list a consumer group's dead letters,
//!   requeue them to that group only), [`DeadLetter`], [`DeadLetterPosition`],
//!   [`Requeue`], [`DeadLetterError`]; the design (requeue first, then remove) in its
//!   module docs. [`SqlDeadLetters`] (in `sql`) is the SQL transport's.
//! - `rabbitmq_dead_letter` (feature `rabbitmq`) — [`RabbitMqDeadLetters`]: the group's
//!   dead queue, requeued through the default exchange to the group's queue.
//! - `nats_dead_letter` (feature `nats`) — [`NatsDeadLetters`]: the DLQ stream, requeued
//!   to the original subject for the group alone.
//! - `kafka_dead_letter` (feature `kafka`) — [`KafkaDeadLetters`]: the dead-letter topic,
//!   requeued to the group's retry topic, with a marker topic of requeued letters.
//! - `delivery` — [`ReceivedMessage`], a delivered message in the same shape for every
//!   broker, and its [`DeliveryPosition`] (SQL row id, AMQP delivery tag, JetStream stream
//!   sequence, Kafka partition and offset).
//! - `failure` — [`TransientError`] (unavailable, timed out: says nothing about the message)
//!   and [`PermanentError`] (refused, unroutable, too large), the two halves of
//!   [`PublishError`] and [`SubscribeError`]; [`Cause`], the client's underlying error.
//! - `health` — [`DependencyHealth`]: a dependency's up/down state as a relay or consumer
//!   sees it (one log line per change, gauge [`DEPENDENCY_UP`]); [`error_chain`].
//! - `message` — [`Message`], [`PublishError`], the [`Publisher`] trait and header names.
//! - `sql` — [`SqlTransport`]: the embedded default, a queue table (`oncely_queue`) in the
//!   same database, over [`oncely_sql::QueueStore`] (which holds each backend's SQL);
//!   consumer groups with leased deliveries ([`SqlTransport::claim`],
//!   [`SqlTransport::ack`], [`SqlTransport::nack`], [`SqlTransport::dead`]).
//! - `subscriber` — the [`Subscriber`] trait (receive, ack after commit, retry after a
//!   delay for one consumer group, dead-letter), [`Incoming`], [`SubscribeError`],
//!   [`retry_headers`]. [`SqlSubscriber`] (in `sql`) is the SQL transport's.
//! - `rabbitmq_subscriber` (feature `rabbitmq`) — [`RabbitMqSubscriber`]: a durable queue
//!   per consumer group, manual ack, prefetch, a per-group delay queue (per-message TTL,
//!   dead-lettered back to the group's queue) and dead queue.
//! - `nats_subscriber` (feature `nats`) — [`NatsSubscriber`]: a durable pull consumer per
//!   group, explicit ack, NAK with delay, a DLQ subject per group.
//! - `rabbitmq` (feature `rabbitmq`) — [`RabbitMqPublisher`]: lapin, persistent messages,
//!   mandatory routing, publisher confirms over a pipelined window.
//! - `nats` (feature `nats`) — [`NatsPublisher`]: async-nats JetStream, `Nats-Msg-Id`
//!   server-side de-duplication, awaited PubAcks.
//! - `kafka` (feature `kafka`) — [`KafkaPublisher`]: rdkafka idempotent producer
//!   (`acks=all`), record key = partition key, awaited delivery reports; [`ensure_topic`].
//! - `kafka_subscriber` (feature `kafka`) — [`KafkaSubscriber`]: a consumer group with
//!   manual offset commits after the inbox commit, a per-group retry topic with a
//!   not-before header, a per-group dead-letter topic.

mod dead_letter;
mod delivery;
mod failure;
mod health;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "kafka")]
mod kafka_dead_letter;
#[cfg(feature = "kafka")]
mod kafka_subscriber;
mod message;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "nats")]
mod nats_dead_letter;
#[cfg(feature = "nats")]
mod nats_subscriber;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "rabbitmq")]
mod rabbitmq_dead_letter;
#[cfg(feature = "rabbitmq")]
mod rabbitmq_subscriber;
mod sql;
mod subscriber;

pub use dead_letter::{
    BadPosition, DeadLetter, DeadLetterError, DeadLetterPosition, DeadLetters, Requeue,
    PREVIEW_BYTES, REQUEUED_FOR,
};
pub use delivery::{DeliveryPosition, ReceivedMessage};
pub use failure::{Cause, PermanentError, TransientError};
pub use health::{describe_metrics, DependencyHealth, DEPENDENCY_UP};
#[cfg(feature = "kafka")]
pub use kafka::{ensure_topic, KafkaConfig, KafkaPublisher, SAFE_BATCH_RECORDS};
#[cfg(feature = "kafka")]
pub use kafka_dead_letter::{KafkaDeadLetters, KafkaDeadLettersConfig};
#[cfg(feature = "kafka")]
pub use kafka_subscriber::{KafkaHandle, KafkaSubscriber, KafkaSubscriberConfig};
pub use message::{headers, BoxFuture, Message, PublishError, Publisher};
#[cfg(feature = "nats")]
pub use nats::{NatsConfig, NatsPublisher};
#[cfg(feature = "nats")]
pub use nats_dead_letter::{NatsDeadLetters, NatsDeadLettersConfig};
#[cfg(feature = "nats")]
pub use nats_subscriber::{NatsHandle, NatsStart, NatsSubscriber, NatsSubscriberConfig};
/// Re-exported from `oncely-core`, its home.
pub use oncely_core::error_chain;
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::{amqp_connection_properties, RabbitMqConfig, RabbitMqPublisher};
#[cfg(feature = "rabbitmq")]
pub use rabbitmq_dead_letter::{RabbitMqDeadLetters, RabbitMqDeadLettersConfig};
#[cfg(feature = "rabbitmq")]
pub use rabbitmq_subscriber::{RabbitMqHandle, RabbitMqSubscriber, RabbitMqSubscriberConfig};
pub use sql::{DeadDelivery, Delivery, SqlDeadLetters, SqlHandle, SqlSubscriber, SqlTransport};
pub use subscriber::{retry_headers, Incoming, SubscribeError, Subscriber, Undecodable};
