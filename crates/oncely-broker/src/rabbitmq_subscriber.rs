use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::{FutureExt as _, StreamExt as _};
use lapin::acker::Acker;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, Consumer};
use oncely_core::MessageId;
use tokio::sync::Mutex;

use crate::message::headers;
use crate::subscriber::retry_headers;
use crate::{DeliveryPosition, Incoming, ReceivedMessage, SubscribeError, Subscriber, Undecodable};

/// Settings of [`RabbitMqSubscriber`].
#[derive(Debug, Clone)]
pub struct RabbitMqSubscriberConfig {
    /// AMQP URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: String,
    /// Exchange the relay publishes to ([`crate::RabbitMqConfig::exchange`]). Default
    /// `oncely`.
    pub exchange: String,
    /// Declare the exchange (durable, type `topic`) on subscribe. Default `true`.
    pub declare_exchange: bool,
    /// The consumer group.
    pub consumer: String,
    /// Binding key of the group's queue on the exchange: the event topic (`orders`), or a
    /// topic pattern (`orders.#`).
    pub topic: String,
    /// The group's queue (durable, bound to the exchange). Default `oncely.<consumer>`.
    pub queue: String,
    /// The group's delay queue (durable, no consumer; expired messages dead-letter to
    /// `queue`). Default `oncely.<consumer>.retry`.
    pub retry_queue: String,
    /// The group's dead-letter queue (durable). Default `oncely.<consumer>.dead`.
    pub dead_queue: String,
    /// `basic.qos` prefetch: most unacknowledged deliveries the broker sends this instance.
    /// Default 32.
    pub prefetch: u16,
    /// How long a retry or dead-letter copy may wait for its publisher confirm. Default
    /// 10 s.
    pub confirm_timeout: Duration,
    /// Connection establishment timeout. Default 5 s.
    pub connect_timeout: Duration,
}

impl RabbitMqSubscriberConfig {
    /// Defaults for group `consumer` on `topic` at `url`.
    pub fn new(url: impl Into<String>, consumer: &str, topic: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            exchange: "oncely".to_owned(),
            declare_exchange: true,
            consumer: consumer.to_owned(),
            topic: topic.into(),
            queue: String::new(),
            retry_queue: String::new(),
            dead_queue: String::new(),
            prefetch: 32,
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
        }
        .with_queue_prefix("oncely")
    }

    /// Names the group's queues `<prefix>.<consumer>`, `<prefix>.<consumer>.retry` and
    /// `<prefix>.<consumer>.dead` (default prefix `oncely`): one prefix per environment
    /// sharing a vhost keeps their groups apart.
    #[must_use]
    pub fn with_queue_prefix(mut self, prefix: &str) -> Self {
        self.queue = format!("{prefix}.{}", self.consumer);
        self.retry_queue = format!("{}.retry", self.queue);
        self.dead_queue = format!("{}.dead", self.queue);
        self
    }
}

/// The settling token of a RabbitMQ delivery: its acker, and what a retry or dead-letter
/// copy needs (properties, raw body, original routing key).
#[derive(Debug, Clone)]
pub struct RabbitMqHandle {
    acker: Acker,
    properties: BasicProperties,
    body: Vec<u8>,
    topic: String,
}

struct Conn {
    connection: Connection,
    consumer: Consumer,
}

/// [`Subscriber`] for one consumer group on RabbitMQ (lapin).
///
/// Topology, per group (all durable, declared by [`Subscriber::subscribe`]):
/// - `queue`, bound to `exchange` with binding key `topic`: every group has its own, so
///   each gets every event. Consumed with manual acks and `basic.qos(prefetch)`; a delivery
///   is acknowledged only after the inbox transaction committed.
/// - `retry_queue`: a retry is a copy published (with confirm) to it through the default
///   exchange, with a per-message TTL (`expiration` = the backoff delay in ms) and the
///   failure count in header `x-oncely-attempts`; the queue's `x-dead-letter-exchange` is
///   the default exchange with `x-dead-letter-routing-key` = `queue`, so the expired copy
///   comes back to **this group's queue only** (not to the fan-out exchange, where other
///   groups would get it again). Then the original is acknowledged.
/// - `dead_queue`: after the attempt limit (or at once for an undecodable message) a copy
///   goes there with `x-oncely-last-error`, `x-oncely-attempts`, `x-oncely-consumer`,
///   `x-oncely-topic`; then the original is acknowledged. `queue` also dead-letters to it
///   (a message rejected without requeue ends there too).
///
/// RabbitMQ expires per-message TTLs only at the head of a queue, so a short retry can wait
/// behind a longer one in `retry_queue`: a retry never comes early, and at worst as late
/// as the longest delay ahead of it (bounded by the retry policy's cap).
///
/// A broken connection is re-opened on the next [`Subscriber::receive`]; deliveries of the
/// old one go back to the queue (the broker requeues unacknowledged messages when a
/// channel closes) and the inbox recognises those that committed.
pub struct RabbitMqSubscriber {
    config: RabbitMqSubscriberConfig,
    conn: Mutex<Option<Conn>>,
    /// The current connection's confirm-mode channel, apart from `conn` so that settling
    /// does not wait for a receive in progress.
    publish: std::sync::Mutex<Option<Channel>>,
}

impl std::fmt::Debug for RabbitMqSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqSubscriber")
            .field("consumer", &self.config.consumer)
            .field("queue", &self.config.queue)
            .finish_non_exhaustive()
    }
}

/// What a persistent publish to one queue through the default exchange (`mandatory`, so an
/// absent queue comes back as a return) came to, by its publisher confirm.
pub(crate) enum QueueConfirm {
    /// Acknowledged by the broker and routed.
    Confirmed,
    /// Returned: the queue does not exist.
    NoQueue,
    /// Neither acknowledged nor returned (a nack): the broker did not take it.
    NotConfirmed(String),
    /// The channel or connection failed.
    Unavailable(String),
    /// No confirm within the timeout.
    TimedOut,
}

impl QueueConfirm {
    /// The confirm as a result: `Ok` when confirmed; a `what` (e.g. "copy", "requeue") to a
    /// missing queue or a nack is rejected, a failed channel or no confirm in time is the
    /// broker being unavailable.
    pub(crate) fn into_result(self, what: &str, queue: &str) -> Result<(), SubscribeError> {
        match self {
            Self::Confirmed => Ok(()),
            Self::NoQueue => Err(SubscribeError::rejected(format!(
                "queue {queue} does not exist"
            ))),
            Self::NotConfirmed(why) => Err(SubscribeError::rejected(format!(
                "{what} to {queue} not confirmed: {why}"
            ))),
            Self::Unavailable(e) => Err(SubscribeError::unavailable(e)),
            Self::TimedOut => Err(SubscribeError::unavailable(format!(
                "no confirm for the {what} to {queue}"
            ))),
        }
    }
}

/// Publishes `body` with `props` to `queue` through the default exchange and waits up to
/// `timeout` for its publisher confirm (the channel must be in confirm mode): the requeue
/// and retry copies of the subscriber and the dead-letter requeue alike.
pub(crate) async fn publish_to_queue(
    channel: &lapin::Channel,
    queue: &str,
    body: &[u8],
    props: lapin::BasicProperties,
    timeout: Duration,
) -> QueueConfirm {
    let confirm = match channel
        .basic_publish(
            "",
            queue,
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            props,
        )
        .await
    {
        Ok(confirm) => confirm,
        Err(e) => return QueueConfirm::Unavailable(e.to_string()),
    };
    match tokio::time::timeout(timeout, confirm).await {
        Ok(Ok(Confirmation::Ack(None))) => QueueConfirm::Confirmed,
        Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => QueueConfirm::NoQueue,
        Ok(Ok(other)) => QueueConfirm::NotConfirmed(format!("{other:?}")),
        Ok(Err(e)) => QueueConfirm::Unavailable(e.to_string()),
        Err(_) => QueueConfirm::TimedOut,
    }
}

fn unavailable(e: &lapin::Error) -> SubscribeError {
    SubscribeError::unavailable(e.to_string())
}

/// The headers of a retried or dead-lettered copy of `delivery`: the failed handler runs
/// so far, this one included, and the last `error`.
fn failure_headers(
    delivery: &Incoming<RabbitMqHandle>,
    error: &str,
) -> Vec<(&'static str, String)> {
    let attempts = delivery.attempts.saturating_add(1).to_string();
    vec![
        (retry_headers::ATTEMPTS, attempts),
        (retry_headers::LAST_ERROR, error.to_owned()),
    ]
}

/// Queue arguments that dead-letter through the default exchange into `queue`.
fn dead_lettering_to(queue: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-dead-letter-exchange".into(), long(""));
    args.insert("x-dead-letter-routing-key".into(), long(queue));
    args
}

pub(crate) fn long(v: impl Into<String>) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v.into()))
}

pub(crate) fn value_str(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        AMQPValue::LongUInt(n) => Some(n.to_string()),
        AMQPValue::ShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortUInt(n) => Some(n.to_string()),
        _ => None,
    }
}

impl RabbitMqSubscriber {
    /// A subscriber that connects on [`Subscriber::subscribe`] (or the first receive).
    pub fn new(config: RabbitMqSubscriberConfig) -> Self {
        Self {
            config,
            conn: Mutex::new(None),
            publish: std::sync::Mutex::new(None),
        }
    }

    /// The settings.
    pub fn config(&self) -> &RabbitMqSubscriberConfig {
        &self.config
    }

    /// Deletes the group's three queues (tests and decommissioning). Returns the number of
    /// messages they held.
    ///
    /// # Errors
    /// [`TransientError::Unavailable`](crate::TransientError::Unavailable) when the broker fails.
    pub async fn delete_queues(&self) -> Result<u32, SubscribeError> {
        self.close_conn().await;
        let (connection, channel) = self.plain_channel().await?;
        let mut n = 0;
        for q in [
            &self.config.queue,
            &self.config.retry_queue,
            &self.config.dead_queue,
        ] {
            n += channel
                .queue_delete(q, QueueDeleteOptions::default())
                .await
                .map_err(|e| unavailable(&e))?;
        }
        drop(connection.close(200, "bye").await);
        Ok(n)
    }

    /// Declares the group's three queues and binds `queue` to the exchange with the topic,
    /// without consuming: what [`Subscriber::subscribe`] declares. Run it before the relay
    /// first publishes to the topic (a deployment step): from then on the queue holds every
    /// event for the group, however late its first consumer starts. Idempotent.
    ///
    /// # Errors
    /// [`TransientError::Unavailable`](crate::TransientError::Unavailable) when the broker
    /// cannot be reached or refuses a declaration.
    pub async fn declare_queues(&self) -> Result<(), SubscribeError> {
        let (connection, channel) = self.plain_channel().await?;
        let declared = self.declare(&channel).await;
        drop(connection.close(200, "declared").await);
        declared
    }

    async fn plain_channel(&self) -> Result<(Connection, Channel), SubscribeError> {
        Ok(crate::rabbitmq::connect_channel(
            &self.config.url,
            format!("oncely-consumer-{}", self.config.consumer),
            self.config.connect_timeout,
        )
        .await?)
    }

    async fn declare(&self, channel: &Channel) -> Result<(), SubscribeError> {
        let c = &self.config;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        if c.declare_exchange {
            crate::rabbitmq::declare_topic_exchange(channel, &c.exchange)
                .await
                .map_err(|e| unavailable(&e))?;
        }
        // The dead queue; the main queue dead-letters into it; the retry queue dead-letters
        // (when a message's TTL runs out) back into the main queue.
        for (queue, args) in [
            (&c.dead_queue, FieldTable::default()),
            (&c.queue, dead_lettering_to(&c.dead_queue)),
            (&c.retry_queue, dead_lettering_to(&c.queue)),
        ] {
            channel
                .queue_declare(queue.as_str(), durable, args)
                .await
                .map_err(|e| unavailable(&e))?;
        }
        channel
            .queue_bind(
                c.queue.as_str(),
                c.exchange.as_str(),
                c.topic.as_str(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(())
    }

    async fn open(&self) -> Result<Conn, SubscribeError> {
        let (connection, channel) = self.plain_channel().await?;
        self.declare(&channel).await?;
        channel
            .basic_qos(self.config.prefetch.max(1), BasicQosOptions::default())
            .await
            .map_err(|e| unavailable(&e))?;
        let consumer = channel
            .basic_consume(
                self.config.queue.as_str(),
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable(&e))?;
        let publish = crate::rabbitmq::confirm_channel(&connection)
            .await
            .map_err(|e| unavailable(&e))?;
        *self.publish.lock().expect("publish channel lock") = Some(publish);
        Ok(Conn {
            connection,
            consumer,
        })
    }

    async fn close_conn(&self) {
        if let Some(c) = self.conn.lock().await.take() {
            drop(c.connection.close(200, "consumer stopping").await);
        }
    }

    fn decode(d: lapin::message::Delivery) -> Incoming<RabbitMqHandle> {
        let props = d.properties;
        let mut hdrs: BTreeMap<String, String> = BTreeMap::new();
        if let Some(t) = props.headers() {
            for (k, v) in t {
                if let Some(v) = value_str(v) {
                    hdrs.insert(k.as_str().to_owned(), v);
                }
            }
        }
        let attempts = hdrs
            .get(retry_headers::ATTEMPTS)
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0);
        let topic = hdrs
            .get(retry_headers::TOPIC)
            .cloned()
            .unwrap_or_else(|| d.routing_key.as_str().to_owned());
        let id = props
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .or_else(|| hdrs.get(headers::MESSAGE_ID).cloned());
        let message = match id.as_deref().map(MessageId::parse) {
            None => Err(Undecodable("no message_id property or header".to_owned())),
            Some(Err(e)) => Err(Undecodable(format!("message id: {e}"))),
            Some(Ok(id)) => {
                let event_type = hdrs
                    .get(headers::EVENT_TYPE)
                    .cloned()
                    .or_else(|| props.kind().as_ref().map(|k| k.as_str().to_owned()))
                    .unwrap_or_default();
                let enqueued_at = props
                    .timestamp()
                    .map_or(0, |t| i64::try_from(t).unwrap_or(0).saturating_mul(1000));
                hdrs.retain(|k, _| !k.starts_with("x-"));
                Ok(ReceivedMessage {
                    position: DeliveryPosition::AmqpDeliveryTag(d.delivery_tag),
                    id,
                    topic: topic.clone(),
                    partition_key: hdrs
                        .get(headers::PARTITION_KEY)
                        .cloned()
                        .unwrap_or_default(),
                    event_type,
                    headers: hdrs,
                    payload: d.data.clone(),
                    enqueued_at,
                })
            }
        };
        Incoming::new(
            message,
            attempts,
            RabbitMqHandle {
                acker: d.acker,
                properties: props,
                body: d.data,
                topic,
            },
        )
    }

    /// Publishes a copy of `h` to `queue` through the default exchange with `extra` headers
    /// (and `expiration`), awaiting the confirm.
    async fn publish_copy(
        &self,
        h: &RabbitMqHandle,
        queue: &str,
        extra: &[(&str, String)],
        expiration: Option<Duration>,
    ) -> Result<(), SubscribeError> {
        let channel = self
            .publish
            .lock()
            .expect("publish channel lock")
            .clone()
            .ok_or_else(|| SubscribeError::unavailable("not connected".to_owned()))?;
        let mut table = h.properties.headers().clone().unwrap_or_default();
        table.insert(retry_headers::TOPIC.into(), long(&h.topic));
        for (k, v) in extra {
            table.insert(ShortString::from(*k), long(v.as_str()));
        }
        let mut props = h
            .properties
            .clone()
            .with_headers(table)
            .with_delivery_mode(2);
        if let Some(ttl) = expiration {
            props = props.with_expiration(ttl.as_millis().max(1).to_string().into());
        }
        publish_to_queue(&channel, queue, &h.body, props, self.config.confirm_timeout)
            .await
            .into_result("copy", queue)
    }

    /// Settles the original of `h` once its copy was published (`copied`): acknowledged when
    /// the copy is confirmed, back to its queue when not. A crash between the two: the
    /// original comes again as well as the copy; both carry one message id, so the inbox
    /// lets one effect through.
    async fn settle_moved(
        h: &RabbitMqHandle,
        copied: Result<(), SubscribeError>,
    ) -> Result<(), SubscribeError> {
        if let Err(e) = copied {
            Self::requeue_original(h).await;
            return Err(e);
        }
        Self::ack_original(h).await
    }

    async fn ack_original(h: &RabbitMqHandle) -> Result<(), SubscribeError> {
        h.acker
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(|e| unavailable(&e))
    }

    /// The copy could not be placed: hand the original back to the queue at once rather
    /// than leave it unacknowledged on a live channel until it closes.
    async fn requeue_original(h: &RabbitMqHandle) {
        drop(
            h.acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await,
        );
    }
}

impl Subscriber for RabbitMqSubscriber {
    type Handle = RabbitMqHandle;

    fn broker(&self) -> &'static str {
        "rabbitmq"
    }

    fn consumer(&self) -> &str {
        &self.config.consumer
    }

    async fn subscribe(&self) -> Result<(), SubscribeError> {
        crate::subscriber::open_once(&self.conn, self.open()).await
    }

    async fn receive(
        &self,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Incoming<RabbitMqHandle>>, SubscribeError> {
        let mut guard = self.conn.lock().await;
        let healthy = guard
            .as_ref()
            .is_some_and(|c| c.connection.status().connected());
        if !healthy {
            if let Some(old) = guard.take() {
                drop(old.connection.close(200, "reconnecting").await);
            }
            *guard = Some(self.open().await?);
        }
        let conn = guard.as_mut().expect("connected above");
        let mut out = Vec::new();
        let first = match tokio::time::timeout(wait, conn.consumer.next()).await {
            Err(_) => return Ok(out),
            Ok(None) => {
                *guard = None;
                return Err(SubscribeError::unavailable("consumer cancelled".to_owned()));
            }
            Ok(Some(Err(e))) => {
                *guard = None;
                return Err(unavailable(&e));
            }
            Ok(Some(Ok(d))) => d,
        };
        out.push(Self::decode(first));
        while out.len() < max.max(1) as usize {
            match conn.consumer.next().now_or_never() {
                Some(Some(Ok(d))) => out.push(Self::decode(d)),
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack<'a>(
        &'a self,
        delivery: &'a Incoming<RabbitMqHandle>,
    ) -> Result<(), SubscribeError> {
        Self::ack_original(&delivery.handle).await
    }

    async fn retry<'a>(
        &'a self,
        delivery: &'a Incoming<RabbitMqHandle>,
        delay: Duration,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        let extra = failure_headers(delivery, error);
        let h = &delivery.handle;
        let copied = self
            .publish_copy(h, &self.config.retry_queue, &extra, Some(delay))
            .await;
        Self::settle_moved(h, copied).await
    }

    async fn dead<'a>(
        &'a self,
        delivery: &'a Incoming<RabbitMqHandle>,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        let mut extra = failure_headers(delivery, error);
        extra.push((retry_headers::CONSUMER, self.config.consumer.clone()));
        extra.push((retry_headers::DEAD_AT, oncely_core::now_ms().to_string()));
        let h = &delivery.handle;
        let copied = self
            .publish_copy(h, &self.config.dead_queue, &extra, None)
            .await;
        Self::settle_moved(h, copied).await
    }

    async fn close(&self) {
        self.close_conn().await;
    }
}
