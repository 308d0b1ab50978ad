use std::future::Future;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::Mutex;

use crate::message::headers;
use crate::{BoxFuture, Cause, Message, PublishError, Publisher, TransientError};

/// Settings of [`RabbitMqPublisher`].
#[derive(Debug, Clone)]
pub struct RabbitMqConfig {
    /// AMQP URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: String,
    /// Exchange messages are published to; the message's topic is the routing key.
    /// Default `oncely`.
    pub exchange: String,
    /// Declare the exchange (durable, type `topic`) on connect. Default `true`.
    pub declare_exchange: bool,
    /// Most messages awaiting confirmation at once (the pipelined window). Default 256.
    pub max_in_flight: usize,
    /// How long a window may wait for its confirmations. Default 10 s.
    pub confirm_timeout: Duration,
    /// Connection establishment timeout. Default 5 s.
    pub connect_timeout: Duration,
}

impl RabbitMqConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            exchange: "oncely".to_owned(),
            declare_exchange: true,
            max_in_flight: 256,
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// lapin's connection properties for the current tokio runtime: lapin spawns its tasks on
/// tokio's executor and registers its socket with tokio's reactor (instead of its own
/// defaults). Every oncely AMQP connection — publisher, subscriber, tools, tests — starts
/// from these.
pub fn amqp_connection_properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// Connects to `url` as connection `name` within `timeout` and opens a channel; a timeout
/// or a refusal is the broker being unavailable ([`TransientError::Unavailable`]).
pub(crate) async fn connect_channel(
    url: &str,
    name: String,
    timeout: Duration,
) -> Result<(Connection, Channel), TransientError> {
    let gone = |e: String| TransientError::Unavailable(e.into());
    let props = amqp_connection_properties().with_connection_name(name.into());
    let connection = tokio::time::timeout(timeout, Connection::connect(url, props))
        .await
        .map_err(|_| gone("connect timed out".to_owned()))?
        .map_err(|e| gone(e.to_string()))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| gone(e.to_string()))?;
    Ok((connection, channel))
}

/// A new channel on `connection` in confirm mode (every publish is confirmed).
pub(crate) async fn confirm_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Declares the durable topic exchange `name` (the publisher's and the subscribers'
/// `declare_exchange`).
pub(crate) async fn declare_topic_exchange(
    channel: &Channel,
    name: &str,
) -> Result<(), lapin::Error> {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(name, ExchangeKind::Topic, options, FieldTable::default())
        .await
}

struct Conn {
    connection: Connection,
    channel: Channel,
    generation: u64,
}

/// Publishes to RabbitMQ with lapin: persistent messages (`delivery_mode = 2`), the message
/// id in the `message_id` property, the event type in `type`, the correlation id in
/// `correlation_id`, every header of [`Message::all_headers`] in the headers table.
///
/// The channel is in confirm mode; a batch is sent as windows of up to
/// [`RabbitMqConfig::max_in_flight`] messages whose confirmations are awaited together (no
/// round trip per message). Messages are `mandatory`: one that no queue is bound for comes
/// back (`basic.return`) and counts as
/// [`PermanentError::Unroutable`](crate::PermanentError::Unroutable) instead of vanishing. A broken
/// connection is dropped and re-established on the next call.
pub struct RabbitMqPublisher {
    config: RabbitMqConfig,
    conn: Mutex<Option<Conn>>,
    generation: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for RabbitMqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqPublisher")
            .field("exchange", &self.config.exchange)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: &lapin::Error) -> PublishError {
    PublishError::unavailable(e.to_string())
}

/// What the broker's confirmation of one message, or its absence by the deadline, says.
type Confirmed = Result<Result<Confirmation, lapin::Error>, tokio::time::error::Elapsed>;

impl RabbitMqPublisher {
    /// The result of `m` from its confirmation, and whether the channel is lost (an error or
    /// no confirmation by the deadline: its state is unknown).
    fn confirmation(&self, m: &Message, answer: Confirmed) -> (Result<(), PublishError>, bool) {
        match answer {
            Ok(Ok(Confirmation::Ack(None))) => (Ok(()), false),
            Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => {
                (Err(PublishError::unroutable(m.topic.clone())), false)
            }
            Ok(Ok(Confirmation::Nack(None))) => {
                (Err(PublishError::rejected("nack".to_owned())), false)
            }
            Ok(Ok(Confirmation::NotRequested)) => (
                Err(PublishError::rejected(
                    "the channel is not in confirm mode".to_owned(),
                )),
                false,
            ),
            Ok(Err(e)) => (Err(unavailable(&e)), true),
            Err(_) => (
                Err(PublishError::timeout(
                    u64::try_from(self.config.confirm_timeout.as_millis()).unwrap_or(u64::MAX),
                )),
                true,
            ),
        }
    }

    /// A publisher that connects lazily, on the first batch.
    pub fn new(config: RabbitMqConfig) -> Self {
        Self {
            config,
            conn: Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Connects now (and declares the exchange), to fail fast at start-up.
    ///
    /// # Errors
    /// [`TransientError::Unavailable`](crate::TransientError::Unavailable) when the broker cannot
    /// be reached or refuses the connection, channel or exchange.
    pub async fn connect(config: RabbitMqConfig) -> Result<Self, PublishError> {
        let p = Self::new(config);
        let conn = p.open().await?;
        *p.conn.lock().await = Some(conn);
        Ok(p)
    }

    async fn open(&self) -> Result<Conn, PublishError> {
        let (connection, channel) = connect_channel(
            &self.config.url,
            "oncely-relay".to_owned(),
            self.config.connect_timeout,
        )
        .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable(&e))?;
        if self.config.declare_exchange {
            declare_topic_exchange(&channel, &self.config.exchange)
                .await
                .map_err(|e| unavailable(&e))?;
        }
        Ok(Conn {
            connection,
            channel,
            generation: self
                .generation
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The AMQP properties sent with `m`: persistent (`delivery_mode` 2), `message_id`,
    /// `type` = event type, `correlation_id` when the message has one, and every header of
    /// [`Message::all_headers`] as a long-string header. Public so benchmarks can publish
    /// the very same messages with the raw client.
    pub fn properties(m: &Message) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in m.all_headers() {
            table.insert(
                ShortString::from(k),
                AMQPValue::LongString(LongString::from(v)),
            );
        }
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(m.id.to_string().into())
            .with_type(m.event_type.as_str().into())
            .with_headers(table);
        if let Some(c) = m.headers.get(headers::CORRELATION_ID) {
            props = props.with_correlation_id(c.as_str().into());
        }
        props
    }

    async fn publish_batch(&self, batch: &[Message]) -> Vec<Result<(), PublishError>> {
        let mut guard = self.conn.lock().await;
        let healthy = guard
            .as_ref()
            .is_some_and(|c| c.connection.status().connected() && c.channel.status().connected());
        if !healthy {
            *guard = None;
            match self.open().await {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    // The cause once: not "broker unreachable: broker unreachable: …".
                    let msg = match e {
                        PublishError::Transient(TransientError::Unavailable(cause)) => cause,
                        other => Cause::new(other),
                    };
                    return batch
                        .iter()
                        .map(|_| Err(PublishError::unavailable(msg.clone())))
                        .collect();
                }
            }
        }
        let (channel, generation) = guard
            .as_ref()
            .map(|c| (c.channel.clone(), c.generation))
            .expect("connected above");
        // The lock guards the connection, not the batch: other batches may be sent while
        // this one waits for its confirmations (the channel keeps per-message order).
        drop(guard);
        let mut results = Vec::with_capacity(batch.len());
        let mut broken = false;
        for window in batch.chunks(self.config.max_in_flight.max(1)) {
            let pending: Vec<Result<PublisherConfirm, PublishError>> = if broken {
                window
                    .iter()
                    .map(|_| {
                        Err(PublishError::unavailable(
                            "connection broke earlier in the batch".to_owned(),
                        ))
                    })
                    .collect()
            } else {
                let sent = send_in_order(window.iter().map(|m| {
                    channel.basic_publish(
                        self.config.exchange.as_str(),
                        m.topic.as_str(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &m.payload,
                        Self::properties(m),
                    )
                }))
                .await;
                sent.into_iter()
                    .map(|r| {
                        r.map_err(|e| {
                            broken = true;
                            unavailable(&e)
                        })
                    })
                    .collect()
            };
            // Handed to RabbitMQ, no confirmation read: the broker may route the messages
            // while the outbox still holds them claimed.
            oncely_core::failpoint::fail_point!("relay.after_publish");
            let deadline = tokio::time::Instant::now() + self.config.confirm_timeout;
            for (m, p) in window.iter().zip(pending) {
                let r = match p {
                    Err(e) => Err(e),
                    Ok(confirm) => {
                        let answer = tokio::time::timeout_at(deadline, confirm).await;
                        let (r, lost) = self.confirmation(m, answer);
                        broken |= lost;
                        r
                    }
                };
                results.push(r);
            }
        }
        if broken {
            // Unknown channel state: start from a fresh connection next time (unless another
            // batch already replaced it).
            let mut guard = self.conn.lock().await;
            if guard.as_ref().is_some_and(|c| c.generation == generation) {
                *guard = None;
            }
        }
        results
    }
}

/// Runs every `basic.publish` of a window at once and returns their results in order.
///
/// lapin's `basic_publish` resolves only once its io-loop thread has written the frames, so
/// awaiting each publish in turn costs one hand-off to that thread and back per message
/// (milliseconds each on a busy 2-core machine, the bulk of a small batch's publish time).
/// Here every future is polled in window order on each wake-up, so the frames of the whole
/// window are queued, in order, before the first hand-off, and the io loop writes them
/// together. Polling in a fixed order is the point: `futures_util::future::join_all`
/// switches to `FuturesUnordered` above 30 futures, whose first-poll order is not a
/// documented guarantee, and the delivery tags (publisher confirms) and the frames'
/// order follow the first poll.
async fn send_in_order<F: Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures
        .map(|f| Box::pin(futures_util::future::maybe_done(f)))
        .collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for f in &mut futures {
            done &= f.as_mut().poll(cx).is_ready();
        }
        if done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    futures
        .iter_mut()
        .map(|f| f.as_mut().take_output().expect("polled to completion"))
        .collect()
}

impl Publisher for RabbitMqPublisher {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(self.publish_batch(batch))
    }

    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {
            let conn = self.conn.lock().await.take();
            if let Some(c) = conn {
                // 200 = reply-success (AMQP 0-9-1 §1.9); a failure here means the
                // connection is gone already.
                drop(c.connection.close(200, "oncely relay stopping").await);
            }
        })
    }
}
