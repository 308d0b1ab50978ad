//! Publishers for oncely's outbox relay, behind one [`Publisher`] trait.
//!
//! Every publisher confirms each message before it reports success, so the relay marks an
//! outbox row published only when the broker has taken responsibility for it. A message
//! carries its [`MessageId`](oncely_core::MessageId) where each broker expects one (AMQP
//! `message_id`, JetStream `Nats-Msg-Id`) and the same set of headers everywhere:
//! `message-id`, `event-type`, `partition-key`, and the event's own (`correlation-id`,
//! `idempotency-key`, `traceparent`).
//!
//! # Layout
//! - `message` — [`Message`], [`PublishError`], the [`Publisher`] trait and header names.
//! - `sql` — [`SqlTransport`]: the embedded default, a queue table (`oncely_queue`) in the
//!   same database; consumer groups with leased deliveries ([`SqlTransport::claim`],
//!   [`SqlTransport::ack`], [`SqlTransport::nack`], [`SqlTransport::dead`]).
//! - `rabbitmq` (feature `rabbitmq`) — [`RabbitMqPublisher`]: lapin, persistent messages,
//!   mandatory routing, publisher confirms over a pipelined window.
//! - `nats` (feature `nats`) — [`NatsPublisher`]: async-nats JetStream, `Nats-Msg-Id`
//!   server-side de-duplication, awaited PubAcks.

mod message;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
mod sql;

pub use message::{headers, BoxFuture, Message, PublishError, Publisher};
#[cfg(feature = "nats")]
pub use nats::{NatsConfig, NatsPublisher};
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::{RabbitMqConfig, RabbitMqPublisher};
pub use sql::{DeadDelivery, Delivery, ReceivedMessage, SqlTransport};
