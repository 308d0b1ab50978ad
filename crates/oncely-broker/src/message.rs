use std::collections::BTreeMap;

use oncely_core::MessageId;

use crate::{Cause, PermanentError, TransientError};

/// Header names every publisher sets (lower case; NATS and AMQP headers are case-preserving,
/// consumers should compare case-insensitively).
pub mod headers {
    /// The message id (also in the broker's own field: AMQP `message_id`, `Nats-Msg-Id`).
    pub const MESSAGE_ID: &str = "message-id";
    /// The event type, e.g. `order.created` (also AMQP `type`).
    pub const EVENT_TYPE: &str = "event-type";
    /// The partition (aggregate) key.
    pub const PARTITION_KEY: &str = "partition-key";
    /// Correlation id of the request that produced the event (also AMQP `correlation_id`).
    pub const CORRELATION_ID: &str = "correlation-id";
    /// The idempotency key of the operation that produced the event.
    pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
    /// W3C Trace Context `traceparent` (<https://www.w3.org/TR/trace-context/> §3.2).
    pub const TRACEPARENT: &str = "traceparent";
}

/// One message to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Identity; brokers and consumers de-duplicate on it.
    pub id: MessageId,
    /// AMQP routing key / NATS subject / SQL-transport topic.
    pub topic: String,
    /// Ordering unit (aggregate id).
    pub partition_key: String,
    /// Event type, e.g. `order.created`.
    pub event_type: String,
    /// Body bytes.
    pub payload: Vec<u8>,
    /// Headers besides the three the publisher derives (`message-id`, `event-type`,
    /// `partition-key`).
    pub headers: BTreeMap<String, String>,
}

impl Message {
    /// Every header to send: the message's own plus `message-id`, `event-type` and
    /// `partition-key` (which win over same-named entries in [`Message::headers`]).
    pub fn all_headers(&self) -> BTreeMap<String, String> {
        let mut h = self.headers.clone();
        h.insert(headers::MESSAGE_ID.to_owned(), self.id.to_string());
        h.insert(headers::EVENT_TYPE.to_owned(), self.event_type.clone());
        h.insert(
            headers::PARTITION_KEY.to_owned(),
            self.partition_key.clone(),
        );
        h
    }
}

/// A message was not confirmed by the broker. The relay retries it with the same message id
/// (so a copy that did arrive is recognised): a fault of the message itself
/// ([`PublishError::Permanent`]) with backoff, until its attempt limit; an unavailable
/// broker ([`PublishError::Transient`]) without counting, see [`PublishError::is_transient`].
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The broker is unreachable or did not confirm in time: nothing is known about the
    /// message.
    #[error(transparent)]
    Transient(#[from] TransientError),
    /// The broker answered and refused the message (or it cannot be sent at all).
    #[error(transparent)]
    Permanent(#[from] PermanentError),
}

impl PublishError {
    /// [`TransientError::Unavailable`]: the broker cannot be reached or the connection
    /// broke; the publisher reconnects on the next call.
    pub fn unavailable(cause: impl Into<Cause>) -> Self {
        Self::Transient(TransientError::Unavailable(cause.into()))
    }

    /// [`TransientError::Timeout`]: no confirmation within `ms` milliseconds (the message
    /// may or may not have been stored: the outcome is unknown, so it is retried with the
    /// same id).
    pub fn timeout(ms: u64) -> Self {
        Self::Transient(TransientError::Timeout(ms))
    }

    /// [`PermanentError::Rejected`]: the broker refused the message (AMQP nack, JetStream
    /// error, SQL error).
    pub fn rejected(cause: impl Into<Cause>) -> Self {
        Self::Permanent(PermanentError::Rejected(cause.into()))
    }

    /// [`PermanentError::Unroutable`]: no queue or stream takes messages of `topic`.
    pub fn unroutable(topic: impl Into<String>) -> Self {
        Self::Permanent(PermanentError::Unroutable(topic.into()))
    }

    /// [`PermanentError::TooLarge`]: a payload of `size` bytes over the transport's `limit`
    /// (bytes).
    pub fn too_large(size: usize, limit: usize) -> Self {
        Self::Permanent(PermanentError::TooLarge { size, limit })
    }

    /// `true` when the failure says nothing about the message ([`PublishError::Transient`]):
    /// the broker, or the way to it, is unavailable ([`TransientError::Unavailable`]) or did
    /// not answer in time ([`TransientError::Timeout`]). The relay does not count such a
    /// failure as an attempt of the message and never makes a row dead for it; it keeps the
    /// rows pending and backs off as a whole until the broker answers again (docs/DESIGN.md:
    /// "nothing goes dead because a dependency was down").
    ///
    /// A confirm timeout is transient because it is what an outage looks like from the
    /// client (a broker that stopped answering, a half-open connection, a partition leader
    /// that is away): the outcome is unknown, not failed, and republishing with the same
    /// message id is safe (JetStream and Kafka de-duplicate, consumers' inboxes do the
    /// rest). Counting it would kill every event of a long brownout. Only the message's
    /// own faults count: [`PermanentError::Rejected`], [`PermanentError::Unroutable`],
    /// [`PermanentError::TooLarge`].
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_))
    }

    /// `true` for [`PermanentError::TooLarge`]: the message can never fit, so the relay
    /// makes it dead at its first attempt.
    pub fn is_too_large(&self) -> bool {
        matches!(self, Self::Permanent(PermanentError::TooLarge { .. }))
    }
}

/// A boxed future, so [`Publisher`] stays object-safe: `futures_util`'s, the one every
/// oncely crate uses (re-exported so implementors need not name `futures_util`).
pub use futures_util::future::BoxFuture;

/// A broker the relay publishes to.
///
/// [`Publisher::publish`] sends a batch and waits for the broker's confirmation of each
/// message; result `i` belongs to message `i`. `Ok` means the broker has the message
/// durably (AMQP confirm ack without return, JetStream PubAck, committed queue row).
/// Implementations pipeline the batch (no wait per message) and reconnect after a broken
/// connection on the next call.
pub trait Publisher: Send + Sync + std::fmt::Debug {
    /// Publishes `batch` and returns one result per message, in order.
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>>;

    /// A short name for logs and metrics labels: `sql`, `rabbitmq`, `nats`.
    fn name(&self) -> &'static str;

    /// Closes the broker connection cleanly at shutdown (AMQP `connection.close`), so the
    /// broker does not log an abrupt disconnect. Publishing again reconnects. The default
    /// does nothing (clients that need no goodbye).
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}
