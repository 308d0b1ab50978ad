//! Inbox consumers: a redelivered message never repeats its effect.
//!
//! Brokers deliver at least once: a consumer can commit its work and die before it
//! acknowledges, and the message comes again. A [`Consumer`] therefore runs every
//! message as: receive → begin → record the message id in the inbox
//! ([`InboxStore::record`](oncely_sql::InboxStore::record)) → run the [`Handler`] with the
//! same transaction → commit → acknowledge. A message the inbox already holds is
//! acknowledged without running the handler (and counted as a duplicate). A handler error
//! rolls the transaction back and the delivery is retried for this consumer only, after an
//! exponential backoff with full jitter ([`RetryPolicy`](oncely_core::RetryPolicy)); after
//! the attempt limit it is parked as dead with its last error. A [`Rejected`] error (a
//! message that cannot be decoded) goes dead at once; a handler panic counts as a failed
//! attempt. An unreachable database ([`oncely_sql::is_outage`]) counts as nothing: the
//! message is held and its transaction run again with backoff until the database answers
//! ([`ConsumerConfig::outage`]), each state change of the database or the broker logged once
//! and shown in the gauge [`oncely_broker::DEPENDENCY_UP`].
//!
//! # Layout
//! - `consumer` — [`Consumer`] (generic over an
//!   [`oncely_broker::Subscriber`]: SQL transport, RabbitMQ, NATS JetStream; [`SqlConsumer`]
//!   is the SQL transport's), [`ConsumerConfig`], [`Handler`], [`ConsumerStats`],
//!   [`Processed`], [`Rejected`]; [`inbox_sweep`], the retention of inbox rows.
//! - `metrics` — metric names recorded through the `metrics` facade.

mod consumer;
pub mod metrics;

pub use consumer::{
    inbox_sweep, Consumer, ConsumerConfig, ConsumerStats, Handler, HandlerError, Processed,
    Rejected, SqlConsumer,
};
