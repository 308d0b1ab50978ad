use std::collections::BTreeMap;

use oncely_core::MessageId;

/// Where a delivered message sits in the broker it came from: for logs and for ordering
/// deliveries of one receive call. It is not a settling token (that is the subscriber's
/// [`Subscriber::Handle`](crate::Subscriber::Handle)) and means nothing across brokers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeliveryPosition {
    /// SQL transport, [`SqlTransport::claim`](crate::SqlTransport::claim): the row id in
    /// `oncely_deliveries` (claim order within the consumer group).
    SqlDelivery(i64),
    /// SQL transport, [`SqlTransport::receive`](crate::SqlTransport::receive): the row id
    /// in `oncely_queue` (insert order within the topic).
    SqlQueue(i64),
    /// RabbitMQ: the AMQP delivery tag, unique per channel (a reconnect starts again at 1).
    AmqpDeliveryTag(u64),
    /// NATS JetStream: the message's sequence number in its stream.
    StreamSequence(u64),
    /// Kafka: the record's partition and offset in the topic it was read from (the
    /// consumer group's retry topic for a retried message).
    KafkaOffset {
        /// Partition number.
        partition: i32,
        /// Offset within the partition.
        offset: i64,
    },
}

/// A message a broker delivered, decoded into oncely's fields; the same shape for every
/// broker.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceivedMessage {
    /// Where the broker holds it ([`DeliveryPosition`]).
    pub position: DeliveryPosition,
    /// The message id.
    pub id: MessageId,
    /// Topic (AMQP routing key / NATS subject / Kafka topic / SQL-transport topic) it was
    /// first published to.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// Event type.
    pub event_type: String,
    /// All headers as published ([`Message::all_headers`](crate::Message::all_headers)).
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub payload: Vec<u8>,
    /// When the broker took it, Unix ms (0 when the broker does not say).
    pub enqueued_at: i64,
}
