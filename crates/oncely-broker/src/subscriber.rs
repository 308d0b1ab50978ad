use std::future::Future;
use std::time::Duration;

use oncely_sql::StoreError;

use crate::{Cause, PermanentError, ReceivedMessage, TransientError};

/// Header names the subscribers add to a message they retry or dead-letter (RabbitMQ
/// headers table, NATS headers of the DLQ copy, Kafka record headers).
pub mod retry_headers {
    /// Failed handler runs so far (decimal integer). RabbitMQ carries the count of a
    /// retried message in it; on a dead letter it is the final count.
    pub const ATTEMPTS: &str = "x-oncely-attempts";
    /// The last handler error of a retried or dead-lettered message.
    pub const LAST_ERROR: &str = "x-oncely-last-error";
    /// The topic (routing key / subject) the message was first published to; kept because
    /// a retried RabbitMQ message arrives again through the consumer's own queue.
    pub const TOPIC: &str = "x-oncely-topic";
    /// The consumer group that dead-lettered the message.
    pub const CONSUMER: &str = "x-oncely-consumer";
    /// Kafka retry records: Unix ms before which the record must not be handled (the
    /// retry's delay; the subscriber waits until then).
    pub const NOT_BEFORE: &str = "x-oncely-not-before";
    /// RabbitMQ dead letters: when the message was dead-lettered, Unix ms (NATS and Kafka
    /// keep the dead letter's own publish time instead).
    pub const DEAD_AT: &str = "x-oncely-dead-at";
}

/// A subscriber could not receive or settle a delivery, or dead letters could not be listed
/// or requeued ([`crate::DeadLetterError`], the same type).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubscribeError {
    /// The broker cannot be reached, the connection broke, or it did not answer in time.
    /// The delivery is not settled: the broker delivers it again (RabbitMQ: when the
    /// channel closes; JetStream: after `ack_wait`; SQL transport: after the lease).
    #[error(transparent)]
    Transient(#[from] TransientError),
    /// The broker refused the operation (declaration mismatch, missing stream or queue, a
    /// dead letter it would not take, …).
    #[error(transparent)]
    Permanent(#[from] PermanentError),
    /// The SQL transport's database failed (transient when it is unreachable,
    /// [`StoreError::is_unavailable`]).
    #[error("store failed")]
    Store(#[source] StoreError),
}

impl SubscribeError {
    /// [`TransientError::Unavailable`]: the broker cannot be reached or the connection
    /// broke.
    pub fn unavailable(cause: impl Into<Cause>) -> Self {
        Self::Transient(TransientError::Unavailable(cause.into()))
    }

    /// [`PermanentError::Rejected`]: the broker refused the operation.
    pub fn rejected(cause: impl Into<Cause>) -> Self {
        Self::Permanent(PermanentError::Rejected(cause.into()))
    }

    /// `true` when the failure says nothing about the delivery or the group's setup: the
    /// broker (or the SQL transport's database) is unreachable or did not answer in time,
    /// and the same call can succeed later. The inbox consumer backs off on every receive
    /// failure alike; this tells an operator's outage from a configuration to fix.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Transient(_) => true,
            Self::Permanent(_) => false,
            Self::Store(e) => e.is_unavailable(),
        }
    }
}

impl From<StoreError> for SubscribeError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// Opens what `slot` holds (a connection, a stream) with `open` unless it holds it already:
/// a subscriber's [`Subscriber::subscribe`].
///
/// # Errors
/// `open`'s; `slot` stays empty then.
#[cfg(any(feature = "nats", feature = "rabbitmq"))]
pub(crate) async fn open_once<T, E>(
    slot: &tokio::sync::Mutex<Option<T>>,
    open: impl Future<Output = Result<T, E>>,
) -> Result<(), E> {
    let mut guard = slot.lock().await;
    if guard.is_none() {
        *guard = Some(open.await?);
    }
    Ok(())
}

/// A message a broker delivered that is not a valid oncely message (e.g. no parseable
/// message id). It cannot be de-duplicated, so it goes to the dead-letter destination at
/// once, with this description as its error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable message: {0}")]
pub struct Undecodable(pub String);

/// One delivery of a message to one consumer group, not settled yet.
///
/// `handle` is the subscriber's own token for settling it ([`Subscriber::ack`],
/// [`Subscriber::retry`], [`Subscriber::dead`]); settle each delivery once.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Incoming<H> {
    /// The message, or why it cannot be read (dead-lettered at once by the consumer).
    pub message: Result<ReceivedMessage, Undecodable>,
    /// Failed handler runs before this delivery (0 on the first delivery). SQL transport
    /// and RabbitMQ count failures only; JetStream counts deliveries (`delivered - 1`), so
    /// a delivery lost to an expired `ack_wait` counts as well.
    pub attempts: u32,
    /// The subscriber's settling token.
    pub handle: H,
}

impl<H> Incoming<H> {
    /// A delivery (subscribers build these; tests may too).
    pub fn new(message: Result<ReceivedMessage, Undecodable>, attempts: u32, handle: H) -> Self {
        Self {
            message,
            attempts,
            handle,
        }
    }
}

/// The receiving side of a broker, for one consumer group: what the inbox consumer runtime
/// needs from the SQL transport, RabbitMQ and NATS JetStream alike.
///
/// Contract (at least once, settle after commit):
/// - [`Subscriber::receive`] hands out deliveries; one that is not settled comes again
///   later (lease, `ack_wait`, channel close), to this group only.
/// - [`Subscriber::ack`] is called only after the effect committed.
/// - [`Subscriber::retry`] makes the message come again after `delay`, **to this consumer
///   group only** (never re-published to the fan-out where other groups would get it), with
///   its failure count raised by one.
/// - [`Subscriber::dead`] moves it to this group's dead-letter destination with `error`.
///
/// The trait is generic (associated [`Subscriber::Handle`], `impl Future` methods) rather
/// than object-safe: a consumer is built for one broker, and nothing is boxed per message.
pub trait Subscriber: Send + Sync + std::fmt::Debug + 'static {
    /// The token that settles one delivery.
    type Handle: Send + Sync + std::fmt::Debug + 'static;

    /// A short name for logs and metric labels: `sql`, `rabbitmq`, `nats`.
    fn broker(&self) -> &'static str;

    /// The consumer group (also the inbox's `consumer` column).
    fn consumer(&self) -> &str;

    /// Creates what the group needs (idempotent): SQL subscription row; RabbitMQ queues and
    /// binding; JetStream durable consumer and DLQ stream; Kafka topics and group
    /// membership. A group gets every message published after it was created; a new group
    /// also gets what the broker still holds from before: the SQL transport's queued
    /// messages of the topic, JetStream's stream from its start, Kafka's topic from
    /// `earliest`. A RabbitMQ queue gets only what is routed after it is bound, so a new
    /// group's queues are declared before the relay publishes
    /// (`RabbitMqSubscriber::declare_queues`) — see each implementation.
    ///
    /// # Errors
    /// [`SubscribeError`] when the broker is unreachable or refuses.
    fn subscribe(&self) -> impl Future<Output = Result<(), SubscribeError>> + Send;

    /// Up to `max` deliveries; waits up to `wait` for the first, returns an empty batch
    /// after that.
    ///
    /// # Errors
    /// [`SubscribeError`] when the broker fails; nothing was handed out then.
    fn receive(
        &self,
        max: u32,
        wait: Duration,
    ) -> impl Future<Output = Result<Vec<Incoming<Self::Handle>>, SubscribeError>> + Send;

    /// Acknowledges a delivery whose effect committed (or that the inbox recognised).
    ///
    /// # Errors
    /// [`SubscribeError`] when the acknowledgement could not be sent; the delivery comes
    /// again and the inbox recognises it.
    fn ack<'a>(
        &'a self,
        delivery: &'a Incoming<Self::Handle>,
    ) -> impl Future<Output = Result<(), SubscribeError>> + Send + 'a;

    /// Counts a failed attempt and delivers the message again to this group after `delay`
    /// (ms precision), recording `error`.
    ///
    /// # Errors
    /// [`SubscribeError`] when the broker fails; the delivery then comes again by the
    /// broker's own redelivery (attempts not raised).
    fn retry<'a>(
        &'a self,
        delivery: &'a Incoming<Self::Handle>,
        delay: Duration,
        error: &'a str,
    ) -> impl Future<Output = Result<(), SubscribeError>> + Send + 'a;

    /// Moves the delivery to the group's dead-letter destination with `error` (and the
    /// final attempt count); it is not delivered again.
    ///
    /// # Errors
    /// [`SubscribeError`] when the broker fails; the delivery then comes again.
    fn dead<'a>(
        &'a self,
        delivery: &'a Incoming<Self::Handle>,
        error: &'a str,
    ) -> impl Future<Output = Result<(), SubscribeError>> + Send + 'a;

    /// Tells the broker that a delivery is still being worked on, so it is not handed out
    /// again meanwhile: the consumer holds a message while its database is unreachable and
    /// calls this every few seconds (at least once per `ack_wait`). JetStream: `+WPI`
    /// (in-progress), which restarts `ack_wait`. The default does nothing: RabbitMQ keeps
    /// an unacknowledged delivery for as long as the channel lives, the SQL transport's
    /// lease lives in the unreachable database itself (a delivery whose lease runs out
    /// comes again without its failure count raised).
    ///
    /// # Errors
    /// [`SubscribeError`] when the broker cannot be told; the delivery may then come again
    /// (the inbox recognises it if it was handled).
    fn hold<'a>(
        &'a self,
        delivery: &'a Incoming<Self::Handle>,
    ) -> impl Future<Output = Result<(), SubscribeError>> + Send + 'a {
        let _ = delivery;
        std::future::ready(Ok(()))
    }

    /// Housekeeping the runtime calls every collection interval with a cut-off (Unix ms)
    /// and a batch size; returns how many items went. The SQL transport deletes fanned-out
    /// queue rows; brokers have nothing to do.
    ///
    /// # Errors
    /// [`SubscribeError`] when the store fails.
    fn collect(
        &self,
        before_ms: i64,
        batch: u32,
    ) -> impl Future<Output = Result<u64, SubscribeError>> + Send {
        let _ = (before_ms, batch);
        std::future::ready(Ok(0))
    }

    /// Releases the connection; unsettled deliveries go back to the broker (RabbitMQ:
    /// requeued at once; JetStream: after `ack_wait`; SQL: after the lease). Used on
    /// shutdown and to simulate a crash in tests.
    fn close(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}
