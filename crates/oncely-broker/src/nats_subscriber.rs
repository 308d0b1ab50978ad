use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures_util::{FutureExt as _, StreamExt as _};
use oncely_core::MessageId;
use tokio::sync::Mutex;

use crate::message::headers;
use crate::subscriber::retry_headers;
use crate::{DeliveryPosition, Incoming, ReceivedMessage, SubscribeError, Subscriber, Undecodable};

/// Settings of [`NatsSubscriber`].
#[derive(Debug, Clone)]
pub struct NatsSubscriberConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// The stream holding the events (the relay's, e.g. `ONCELY`); it must exist.
    pub stream: String,
    /// The consumer group: the durable consumer's name (no `.`, `*`, `>` or whitespace).
    pub consumer: String,
    /// Filter subject of the durable consumer (the event topic, e.g. `orders`; wildcards
    /// allowed).
    pub topic: String,
    /// `ack_wait`: an unacknowledged delivery comes again after it. Must exceed the
    /// handler's longest run plus the time a delivery waits for a handler slot. Default
    /// 30 s.
    pub ack_wait: Duration,
    /// Messages pulled ahead per request (the prefetch). Default 32.
    pub batch: usize,
    /// Dead letters go to `<dlq_prefix>.<consumer>.<subject>`. Default `oncely.dlq`.
    pub dlq_prefix: String,
    /// Stream created on subscribe if missing, capturing `<dlq_prefix>.>` (empty: create
    /// none; then another stream must capture the DLQ subjects). Default `ONCELY_DLQ`.
    pub dlq_stream: String,
    /// Connection establishment timeout. Default 5 s.
    pub connect_timeout: Duration,
    /// Where the group's durable consumer starts when the group is new. Default
    /// [`NatsStart::Beginning`].
    pub start: NatsStart,
}

/// Where a new consumer group starts reading the stream: the first time its durable
/// consumer is created. A group whose durable consumer exists keeps its own position (its
/// acknowledged messages never come again), whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum NatsStart {
    /// The stream's first message still held (`DeliverPolicy::All`): a group that first
    /// consumes late gets every event the stream kept, so none published before its
    /// consumer started is lost. How far back that reaches is the stream's retention.
    #[default]
    Beginning,
    /// The first message stored at or after this time (`DeliverPolicy::ByStartTime`): for
    /// a group added to a stream whose older history it must not handle, or a durable
    /// created again after deletion (which would otherwise read the stream again).
    At(std::time::SystemTime),
}

impl NatsStart {
    fn deliver_policy(self) -> jetstream::consumer::DeliverPolicy {
        match self {
            Self::Beginning => jetstream::consumer::DeliverPolicy::All,
            Self::At(t) => jetstream::consumer::DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from(t),
            },
        }
    }
}

impl NatsSubscriberConfig {
    /// Defaults for group `consumer` of `topic` in `stream` at `url`.
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        consumer: impl Into<String>,
        topic: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            consumer: consumer.into(),
            topic: topic.into(),
            ack_wait: Duration::from_secs(30),
            batch: 32,
            dlq_prefix: "oncely.dlq".to_owned(),
            dlq_stream: "ONCELY_DLQ".to_owned(),
            connect_timeout: Duration::from_secs(5),
            start: NatsStart::Beginning,
        }
    }

    /// The DLQ subject of a message first published to `subject`.
    pub fn dlq_subject(&self, subject: &str) -> String {
        format!("{}.{}.{subject}", self.dlq_prefix, self.consumer)
    }
}

/// The settling token of a JetStream delivery (the message, which carries its ack
/// subject).
#[derive(Debug, Clone)]
pub struct NatsHandle {
    message: jetstream::Message,
}

/// [`Subscriber`] for one consumer group on NATS JetStream (async-nats).
///
/// - A durable pull consumer named after the group on the stream, filtered on the topic,
///   `AckPolicy::Explicit`; a new group starts at the stream's first message
///   (`DeliverPolicy::All`) or at [`NatsSubscriberConfig::start`], so events published
///   before its consumer first ran are not lost, while an existing group keeps its
///   position; `max_deliver` unlimited (the consumer runtime counts and
///   dead-letters), `ack_wait` from the settings. Each group is its own durable consumer,
///   so every group gets every event.
/// - Ack after commit (`+ACK`, not awaited: a lost ack means a redelivery after `ack_wait`
///   that the inbox recognises).
/// - Retry: `NAK` with the backoff delay (`AckKind::Nak(Some(delay))`): the server
///   redelivers to this durable consumer only, after the delay. The failure count is the
///   server's delivery count minus one (`info.delivered - 1`).
/// - Dead: a copy is published (PubAck awaited) to `<dlq_prefix>.<consumer>.<subject>`
///   with headers `x-oncely-last-error`, `x-oncely-attempts`, `x-oncely-consumer`,
///   `x-oncely-topic`, then the original is terminated (`+TERM`: not redelivered).
/// - A message carrying `x-oncely-requeued-for` naming another group (a dead letter
///   [`NatsDeadLetters`](crate::NatsDeadLetters) requeued for that group) is acknowledged
///   and not handed out.
pub struct NatsSubscriber {
    config: NatsSubscriberConfig,
    js: Mutex<Option<jetstream::Context>>,
    messages: Mutex<Option<pull::Stream>>,
}

/// JetStream's de-duplication header.
const NATS_MSG_ID: &str = "Nats-Msg-Id";

impl std::fmt::Debug for NatsSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSubscriber")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: &impl std::fmt::Display) -> SubscribeError {
    SubscribeError::unavailable(e.to_string())
}

impl NatsSubscriber {
    /// A subscriber that connects on [`Subscriber::subscribe`].
    pub fn new(config: NatsSubscriberConfig) -> Self {
        Self {
            config,
            js: Mutex::new(None),
            messages: Mutex::new(None),
        }
    }

    /// The settings.
    pub fn config(&self) -> &NatsSubscriberConfig {
        &self.config
    }

    async fn context(&self) -> Result<jetstream::Context, SubscribeError> {
        let c = &self.config;
        let name = format!("oncely-consumer-{}", c.consumer);
        Ok(crate::nats::cached_context(&self.js, &c.url, name, c.connect_timeout).await?)
    }

    async fn open(&self) -> Result<pull::Stream, SubscribeError> {
        let js = self.context().await?;
        let c = &self.config;
        if !c.dlq_stream.is_empty() {
            js.get_or_create_stream(jetstream::stream::Config {
                name: c.dlq_stream.clone(),
                subjects: vec![format!("{}.>", c.dlq_prefix)],
                ..jetstream::stream::Config::default()
            })
            .await
            .map_err(|e| SubscribeError::rejected(format!("DLQ stream {}: {e}", c.dlq_stream)))?;
        }
        let stream = js
            .get_stream(&c.stream)
            .await
            .map_err(|e| SubscribeError::rejected(format!("stream {}: {e}", c.stream)))?;
        let consumer: jetstream::consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(
                &c.consumer,
                pull::Config {
                    durable_name: Some(c.consumer.clone()),
                    filter_subject: c.topic.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    // Read only when the durable is created: an existing group keeps
                    // its position.
                    deliver_policy: c.start.deliver_policy(),
                    ack_wait: c.ack_wait,
                    max_deliver: -1,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(|e| SubscribeError::rejected(format!("consumer {}: {e}", c.consumer)))?;
        consumer
            .stream()
            .max_messages_per_batch(c.batch.max(1))
            .messages()
            .await
            .map_err(|e| unavailable(&e))
    }

    fn decode(message: jetstream::Message) -> Incoming<NatsHandle> {
        let mut hdrs: BTreeMap<String, String> = BTreeMap::new();
        if let Some(h) = message.message.headers.as_ref() {
            for (k, vs) in h.iter() {
                if let Some(v) = vs.last() {
                    hdrs.insert(k.to_string(), v.as_str().to_owned());
                }
            }
        }
        let (seq, delivered, published_ms) = match message.info() {
            Ok(info) => (
                info.stream_sequence,
                info.delivered,
                i64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0),
            ),
            Err(_) => (0, 1, 0),
        };
        let attempts = u32::try_from(delivered.saturating_sub(1).max(0)).unwrap_or(u32::MAX);
        let id = hdrs
            .get(headers::MESSAGE_ID)
            .or_else(|| hdrs.get(NATS_MSG_ID))
            .cloned();
        let decoded = match id.as_deref().map(MessageId::parse) {
            None => Err(Undecodable(
                "no message-id or Nats-Msg-Id header".to_owned(),
            )),
            Some(Err(e)) => Err(Undecodable(format!("message id: {e}"))),
            Some(Ok(id)) => {
                hdrs.remove(NATS_MSG_ID);
                Ok(ReceivedMessage {
                    position: DeliveryPosition::StreamSequence(seq),
                    id,
                    topic: message.message.subject.to_string(),
                    partition_key: hdrs
                        .get(headers::PARTITION_KEY)
                        .cloned()
                        .unwrap_or_default(),
                    event_type: hdrs.get(headers::EVENT_TYPE).cloned().unwrap_or_default(),
                    headers: hdrs,
                    payload: message.message.payload.to_vec(),
                    enqueued_at: published_ms,
                })
            }
        };
        Incoming::new(decoded, attempts, NatsHandle { message })
    }
}

impl NatsSubscriber {
    /// Whether `d` is a copy [`NatsDeadLetters`](crate::NatsDeadLetters) requeued for
    /// another consumer group (header [`REQUEUED_FOR`](crate::REQUEUED_FOR)).
    fn requeued_for_another(&self, d: &Incoming<NatsHandle>) -> bool {
        d.handle
            .message
            .message
            .headers
            .as_ref()
            .and_then(|h| h.get(crate::REQUEUED_FOR))
            .is_some_and(|g| g.as_str() != self.config.consumer)
    }
}

impl Subscriber for NatsSubscriber {
    type Handle = NatsHandle;

    fn broker(&self) -> &'static str {
        "nats"
    }

    fn consumer(&self) -> &str {
        &self.config.consumer
    }

    async fn subscribe(&self) -> Result<(), SubscribeError> {
        crate::subscriber::open_once(&self.messages, Box::pin(self.open())).await
    }

    async fn receive(
        &self,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Incoming<NatsHandle>>, SubscribeError> {
        let mut guard = self.messages.lock().await;
        if guard.is_none() {
            *guard = Some(self.open().await?);
        }
        let stream = guard.as_mut().expect("opened above");
        let mut out = Vec::new();
        match tokio::time::timeout(wait, stream.next()).await {
            Err(_) => return Ok(out),
            Ok(None) => {
                *guard = None;
                return Err(SubscribeError::unavailable("pull stream ended".to_owned()));
            }
            // Missed heartbeats and the like: the stream goes on by itself.
            Ok(Some(Err(e))) => return Err(unavailable(&e)),
            Ok(Some(Ok(m))) => out.push(Self::decode(m)),
        }
        while out.len() < max.max(1) as usize {
            match stream.next().now_or_never() {
                Some(Some(Ok(m))) => out.push(Self::decode(m)),
                _ => break,
            }
        }
        drop(guard);
        let mut mine = Vec::with_capacity(out.len());
        for d in out {
            if self.requeued_for_another(&d) {
                // A dead letter another group requeued for itself: not this group's.
                if let Err(e) = self.ack(&d).await {
                    tracing::warn!(error = %e, "cannot acknowledge another group's requeued copy");
                }
            } else {
                mine.push(d);
            }
        }
        Ok(mine)
    }

    async fn ack<'a>(&'a self, delivery: &'a Incoming<NatsHandle>) -> Result<(), SubscribeError> {
        delivery
            .handle
            .message
            .ack()
            .await
            .map_err(|e| unavailable(&e))
    }

    async fn hold<'a>(&'a self, delivery: &'a Incoming<NatsHandle>) -> Result<(), SubscribeError> {
        delivery
            .handle
            .message
            .ack_with(async_nats::jetstream::AckKind::Progress)
            .await
            .map_err(|e| unavailable(&e))
    }

    async fn retry<'a>(
        &'a self,
        delivery: &'a Incoming<NatsHandle>,
        delay: Duration,
        _error: &'a str,
    ) -> Result<(), SubscribeError> {
        delivery
            .handle
            .message
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(|e| unavailable(&e))
    }

    async fn dead<'a>(
        &'a self,
        delivery: &'a Incoming<NatsHandle>,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        let js = self.context().await?;
        let original = &delivery.handle.message.message;
        let mut h = original.headers.clone().unwrap_or_default();
        // The DLQ copy is a new stream message: keep the id in `message-id` only, or the DLQ
        // stream's duplicate window would drop a second dead letter of one message.
        let id = h
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_owned());
        if let (Some(id), None) = (id, h.get(headers::MESSAGE_ID)) {
            h.insert(headers::MESSAGE_ID, id.as_str());
        }
        let mut clean = async_nats::HeaderMap::new();
        for (k, vs) in h.iter() {
            let k = k.to_string();
            if k.eq_ignore_ascii_case(NATS_MSG_ID) {
                continue;
            }
            if let Some(v) = vs.last() {
                clean.insert(k.as_str(), v.as_str());
            }
        }
        // Header values are one line.
        let error: String = error
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(2048)
            .collect();
        clean.insert(retry_headers::LAST_ERROR, error.as_str());
        clean.insert(
            retry_headers::ATTEMPTS,
            delivery.attempts.saturating_add(1).to_string().as_str(),
        );
        clean.insert(retry_headers::CONSUMER, self.config.consumer.as_str());
        clean.insert(retry_headers::TOPIC, original.subject.as_str());
        let subject = self.config.dlq_subject(original.subject.as_str());
        js.publish_with_headers(subject, clean, original.payload.clone())
            .await
            .map_err(|e| unavailable(&e))?
            .await
            .map_err(|e| SubscribeError::rejected(format!("DLQ publish: {e}")))?;
        delivery
            .handle
            .message
            .ack_with(AckKind::Term)
            .await
            .map_err(|e| unavailable(&e))
    }

    async fn close(&self) {
        *self.messages.lock().await = None;
        if let Some(js) = self.js.lock().await.take() {
            drop(js.client().drain().await);
        }
    }
}
