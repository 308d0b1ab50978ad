use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt as _;
use oncely_core::MessageId;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::kafka::needs_new_session;
use crate::message::headers;
use crate::subscriber::retry_headers;
use crate::{
    ensure_topic, DeliveryPosition, Incoming, ReceivedMessage, SubscribeError, Subscriber,
    Undecodable,
};

/// Settings of [`KafkaSubscriber`].
#[derive(Debug, Clone)]
pub struct KafkaSubscriberConfig {
    /// Bootstrap servers, comma-separated `host:port`.
    pub brokers: String,
    /// The consumer (the inbox's `consumer` column; names the retry and dead-letter topics).
    pub consumer: String,
    /// The Kafka consumer group id. Default: [`KafkaSubscriberConfig::consumer`].
    pub group_id: String,
    /// The topic the relay publishes to, e.g. `orders`.
    pub topic: String,
    /// Partitions of the retry and dead-letter topics created on subscribe. Default 3.
    pub partitions: i32,
    /// Group session timeout (`session.timeout.ms`): a member that stops heartbeating for
    /// this long loses its partitions, whose uncommitted messages go to another member.
    /// Default 10 s.
    pub session_timeout: Duration,
    /// How long a retry or dead-letter publish may take (`message.timeout.ms`). Default
    /// 10 s.
    pub delivery_timeout: Duration,
}

impl KafkaSubscriberConfig {
    /// Defaults for consumer `consumer` of `topic` on the cluster at `brokers`.
    pub fn new(
        brokers: impl Into<String>,
        consumer: impl Into<String>,
        topic: impl Into<String>,
    ) -> Self {
        let consumer = consumer.into();
        Self {
            brokers: brokers.into(),
            group_id: consumer.clone(),
            consumer,
            topic: topic.into(),
            partitions: 3,
            session_timeout: Duration::from_secs(10),
            delivery_timeout: Duration::from_secs(10),
        }
    }

    /// `<topic>.retry.<consumer>`: this group's delayed retries.
    pub fn retry_topic(&self) -> String {
        format!("{}.retry.{}", self.topic, self.consumer)
    }

    /// `<topic>.dlq.<consumer>`: this group's dead letters.
    pub fn dlq_topic(&self) -> String {
        format!("{}.dlq.{}", self.topic, self.consumer)
    }
}

/// The settling token of a Kafka delivery: where the record sits and the record itself
/// (re-published to the retry or dead-letter topic).
#[derive(Debug, Clone)]
pub struct KafkaHandle {
    message: OwnedMessage,
}

impl KafkaHandle {
    /// The Kafka topic the record was read from (the event topic or the group's retry
    /// topic).
    pub fn topic(&self) -> &str {
        self.message.topic()
    }

    /// Its partition.
    pub fn partition(&self) -> i32 {
        self.message.partition()
    }

    /// Its offset.
    pub fn offset(&self) -> i64 {
        self.message.offset()
    }
}

/// Offsets handed out and not settled yet, per partition; the committed offset never
/// passes the lowest of them, so a crash redelivers every unsettled record (and some
/// settled ones after it, which the inbox recognises).
#[derive(Debug, Default)]
struct PartitionState {
    in_flight: BTreeSet<i64>,
    /// Highest offset handed out + 1.
    next: i64,
    committed: i64,
}

#[derive(Debug, Default)]
struct State {
    partitions: HashMap<(String, i32), PartitionState>,
    /// Retry records read before their not-before time, with their partition paused.
    held: Vec<(i64, OwnedMessage)>,
}

/// [`Subscriber`] for one consumer group on Kafka (rdkafka).
///
/// - A consumer group ([`KafkaSubscriberConfig::group_id`]) subscribed to the event topic
///   and to the group's retry topic `<topic>.retry.<consumer>`;
///   `enable.auto.commit=false`, `auto.offset.reset=earliest` (a new group reads the
///   topics from their start; the inbox recognises what it already handled).
/// - Ack after commit: the record's offset is settled, and the group's committed offset
///   moves to the lowest offset still in flight on that partition (records are handled
///   concurrently; a commit never passes an unsettled one). Commits are asynchronous: a
///   lost commit means a redelivery that the inbox recognises.
/// - Retry: the record is re-published (delivery report awaited) to the group's retry
///   topic with `x-oncely-attempts` raised, `x-oncely-last-error`, `x-oncely-topic` and
///   `x-oncely-not-before` (Unix ms), then settled. Only this group reads that topic, so
///   other groups never see the retry. A retry record read before its time is held and its
///   partition paused until then (retries of one partition wait behind each other).
/// - Dead: re-published to `<topic>.dlq.<consumer>` with `x-oncely-last-error`,
///   `x-oncely-attempts`, `x-oncely-consumer`, `x-oncely-topic`, then settled.
/// - Undecodable records (no parseable `message-id` header) are dead-lettered the same way.
///
/// Redelivery happens when the group rebalances (a member closes, crashes past
/// [`KafkaSubscriberConfig::session_timeout`], or joins): the new owner of a partition
/// starts at its committed offset.
pub struct KafkaSubscriber {
    config: KafkaSubscriberConfig,
    consumer: tokio::sync::Mutex<Option<Arc<StreamConsumer>>>,
    producer: Mutex<Option<FutureProducer>>,
    state: Mutex<State>,
}

impl std::fmt::Debug for KafkaSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSubscriber")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: &impl std::fmt::Display) -> SubscribeError {
    SubscribeError::unavailable(e.to_string())
}

pub(crate) fn header_map(m: &OwnedMessage) -> BTreeMap<String, String> {
    m.headers()
        .map(|h| {
            h.iter()
                .map(|h| {
                    (
                        h.key.to_owned(),
                        String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

impl KafkaSubscriber {
    /// A subscriber that connects on [`Subscriber::subscribe`].
    pub fn new(config: KafkaSubscriberConfig) -> Self {
        Self {
            config,
            consumer: tokio::sync::Mutex::new(None),
            producer: Mutex::new(None),
            state: Mutex::new(State::default()),
        }
    }

    /// The settings.
    pub fn config(&self) -> &KafkaSubscriberConfig {
        &self.config
    }

    async fn open(&self) -> Result<Arc<StreamConsumer>, SubscribeError> {
        let c = &self.config;
        for t in [c.topic.clone(), c.retry_topic(), c.dlq_topic()] {
            ensure_topic(&c.brokers, &t, c.partitions.max(1))
                .await
                .map_err(|e| {
                    // The cluster's answer keeps its class: unreachable stays transient.
                    let cause = format!("topic {t}: {e}");
                    if e.is_transient() {
                        SubscribeError::unavailable(cause)
                    } else {
                        SubscribeError::rejected(cause)
                    }
                })?;
        }
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &c.brokers)
            .set("group.id", &c.group_id)
            .set("client.id", format!("oncely-consumer-{}", c.consumer))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set(
                "session.timeout.ms",
                c.session_timeout.as_millis().to_string(),
            )
            .create()
            .map_err(|e| SubscribeError::rejected(format!("kafka consumer: {e}")))?;
        consumer
            .subscribe(&[c.topic.as_str(), c.retry_topic().as_str()])
            .map_err(|e| unavailable(&e))?;
        *self.state.lock().expect("state lock") = State::default();
        Ok(Arc::new(consumer))
    }

    async fn current(&self) -> Result<Arc<StreamConsumer>, SubscribeError> {
        let mut guard = self.consumer.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let c = self.open().await?;
        *guard = Some(c.clone());
        Ok(c)
    }

    fn producer(&self) -> Result<FutureProducer, SubscribeError> {
        let mut guard = self.producer.lock().expect("producer lock");
        if let Some(p) = guard.as_ref() {
            if p.client().fatal_error().is_none() {
                return Ok(p.clone());
            }
        }
        let p: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &self.config.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // Retry records are read from wherever a paused partition resumes.
            .set(
                "batch.num.messages",
                crate::kafka::SAFE_BATCH_RECORDS.to_string(),
            )
            .set(
                "message.timeout.ms",
                self.config.delivery_timeout.as_millis().to_string(),
            )
            // As the relay's producer: timeouts reported on time during an outage.
            .set(
                "reconnect.backoff.max.ms",
                crate::kafka::RECONNECT_BACKOFF_MAX.as_millis().to_string(),
            )
            .create()
            .map_err(|e| SubscribeError::rejected(format!("kafka producer: {e}")))?;
        *guard = Some(p.clone());
        Ok(p)
    }

    fn tpl(topic: &str, partition: i32) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        tpl
    }

    /// Registers a record read from the group's topics as unsettled, so that no commit of
    /// its partition passes it until it is settled: whether handed out now or held as a
    /// retry not due yet. A held record is unsettled too: a later record of its partition
    /// read before the pause took hold, or due sooner, may be acknowledged first, and a
    /// commit past the held one would lose it to the next owner of the partition (a
    /// rebalance, a restart).
    fn track(&self, message: &OwnedMessage) {
        let mut state = self.state.lock().expect("state lock");
        let p = state
            .partitions
            .entry((message.topic().to_owned(), message.partition()))
            .or_default();
        p.in_flight.insert(message.offset());
        p.next = p.next.max(message.offset() + 1);
    }

    /// Registers a record as handed out and decodes it.
    fn hand_out(&self, message: OwnedMessage) -> Incoming<KafkaHandle> {
        self.track(&message);
        let mut hdrs = header_map(&message);
        let attempts = if message.topic() == self.config.topic {
            0
        } else {
            hdrs.get(retry_headers::ATTEMPTS)
                .and_then(|a| a.parse().ok())
                .unwrap_or(0)
        };
        hdrs.remove(retry_headers::NOT_BEFORE);
        let topic = hdrs
            .get(retry_headers::TOPIC)
            .cloned()
            .unwrap_or_else(|| message.topic().to_owned());
        let key = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned());
        let decoded = match hdrs.get(headers::MESSAGE_ID).map(|s| MessageId::parse(s)) {
            None => Err(Undecodable("no message-id header".to_owned())),
            Some(Err(e)) => Err(Undecodable(format!("message id: {e}"))),
            Some(Ok(id)) => Ok(ReceivedMessage {
                position: DeliveryPosition::KafkaOffset {
                    partition: message.partition(),
                    offset: message.offset(),
                },
                id,
                topic,
                partition_key: key
                    .or_else(|| hdrs.get(headers::PARTITION_KEY).cloned())
                    .unwrap_or_default(),
                event_type: hdrs.get(headers::EVENT_TYPE).cloned().unwrap_or_default(),
                headers: hdrs,
                payload: message.payload().unwrap_or_default().to_vec(),
                enqueued_at: message.timestamp().to_millis().unwrap_or(0),
            }),
        };
        Incoming::new(decoded, attempts, KafkaHandle { message })
    }

    /// A record just read: handed out, or held (partition paused) when it is a retry whose
    /// time has not come.
    fn accept(
        &self,
        consumer: &StreamConsumer,
        message: OwnedMessage,
        now_ms: i64,
        out: &mut Vec<Incoming<KafkaHandle>>,
    ) {
        let not_before = (message.topic() != self.config.topic)
            .then(|| header_map(&message).get(retry_headers::NOT_BEFORE).cloned())
            .flatten()
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or(0);
        if not_before > now_ms {
            self.track(&message);
            if let Err(e) = consumer.pause(&Self::tpl(message.topic(), message.partition())) {
                tracing::warn!(error = %e, "cannot pause the retry partition");
            }
            self.state
                .lock()
                .expect("state lock")
                .held
                .push((not_before, message));
        } else {
            out.push(self.hand_out(message));
        }
    }

    /// Held retry records whose time has come, their partitions resumed.
    fn due(&self, consumer: &StreamConsumer, now_ms: i64) -> Vec<Incoming<KafkaHandle>> {
        let due: Vec<OwnedMessage> = {
            let mut state = self.state.lock().expect("state lock");
            let (due, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut state.held)
                .into_iter()
                .partition(|(t, _)| *t <= now_ms);
            state.held = wait;
            due.into_iter().map(|(_, m)| m).collect()
        };
        due.into_iter()
            .map(|m| {
                if let Err(e) = consumer.resume(&Self::tpl(m.topic(), m.partition())) {
                    tracing::warn!(error = %e, "cannot resume the retry partition");
                }
                self.hand_out(m)
            })
            .collect()
    }

    /// Settles a record: commits its partition up to the lowest offset still in flight.
    async fn settle(&self, handle: &KafkaHandle) -> Result<(), SubscribeError> {
        let (topic, partition) = (handle.topic().to_owned(), handle.partition());
        let commit_to = {
            let mut state = self.state.lock().expect("state lock");
            let Some(p) = state.partitions.get_mut(&(topic.clone(), partition)) else {
                return Ok(());
            };
            p.in_flight.remove(&handle.offset());
            let to = p.in_flight.first().copied().unwrap_or(p.next);
            (to > p.committed).then(|| {
                p.committed = to;
                to
            })
        };
        let Some(to) = commit_to else {
            return Ok(());
        };
        let Some(consumer) = self.consumer.lock().await.clone() else {
            // Closed: the record comes again to whoever owns the partition next.
            return Ok(());
        };
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, partition, Offset::Offset(to))
            .map_err(|e| unavailable(&e))?;
        consumer
            .commit(&tpl, CommitMode::Async)
            .map_err(|e| unavailable(&e))
    }

    /// Re-publishes the record to `topic` with its headers plus `extra` (which win), and
    /// awaits the delivery report.
    async fn republish(
        &self,
        handle: &KafkaHandle,
        topic: &str,
        extra: &[(&str, String)],
    ) -> Result<(), SubscribeError> {
        let producer = self.producer()?;
        let mut hdrs = header_map(&handle.message);
        hdrs.remove(retry_headers::NOT_BEFORE);
        for (k, v) in extra {
            hdrs.insert((*k).to_owned(), v.clone());
        }
        let mut owned = OwnedHeaders::new_with_capacity(hdrs.len());
        for (k, v) in &hdrs {
            owned = owned.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic)
            .payload(handle.message.payload().unwrap_or_default())
            .headers(owned);
        if let Some(k) = handle.message.key() {
            record = record.key(k);
        }
        producer
            .send(record, self.config.delivery_timeout)
            .await
            .map(drop)
            .map_err(|(e, _)| {
                if e.rdkafka_error_code().is_some_and(needs_new_session) {
                    // This producer session cannot deliver again: a new one next time.
                    *self.producer.lock().expect("producer lock") = None;
                }
                SubscribeError::unavailable(format!("publish to {topic}: {e}"))
            })
    }

    fn original_topic(handle: &KafkaHandle) -> String {
        header_map(&handle.message)
            .get(retry_headers::TOPIC)
            .cloned()
            .unwrap_or_else(|| handle.topic().to_owned())
    }
}

fn one_line(error: &str) -> String {
    error
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(2048)
        .collect()
}

impl Subscriber for KafkaSubscriber {
    type Handle = KafkaHandle;

    fn broker(&self) -> &'static str {
        "kafka"
    }

    fn consumer(&self) -> &str {
        &self.config.consumer
    }

    async fn subscribe(&self) -> Result<(), SubscribeError> {
        self.current().await.map(drop)
    }

    async fn receive(
        &self,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Incoming<KafkaHandle>>, SubscribeError> {
        let consumer = self.current().await?;
        let max = max.max(1) as usize;
        let mut out = self.due(&consumer, oncely_core::now_ms());
        if out.len() >= max {
            return Ok(out);
        }
        if out.is_empty() {
            // Wait for a record, or until the earliest held retry is due.
            let next_due = self
                .state
                .lock()
                .expect("state lock")
                .held
                .iter()
                .map(|(t, _)| *t)
                .min();
            let wait = next_due.map_or(wait, |t| {
                let left = u64::try_from(t - oncely_core::now_ms()).unwrap_or(0);
                wait.min(Duration::from_millis(left))
            });
            match tokio::time::timeout(wait, consumer.recv()).await {
                Err(_) => return Ok(self.due(&consumer, oncely_core::now_ms())),
                Ok(Err(e)) => return Err(unavailable(&e)),
                Ok(Ok(m)) => {
                    let m = m.detach();
                    self.accept(&consumer, m, oncely_core::now_ms(), &mut out);
                }
            }
        }
        while out.len() < max {
            match consumer.recv().now_or_never() {
                Some(Ok(m)) => {
                    let m = m.detach();
                    self.accept(&consumer, m, oncely_core::now_ms(), &mut out);
                }
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack<'a>(&'a self, delivery: &'a Incoming<KafkaHandle>) -> Result<(), SubscribeError> {
        self.settle(&delivery.handle).await
    }

    async fn retry<'a>(
        &'a self,
        delivery: &'a Incoming<KafkaHandle>,
        delay: Duration,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        let not_before =
            oncely_core::now_ms() + i64::try_from(delay.as_millis()).unwrap_or(i64::MAX / 2);
        let topic = Self::original_topic(&delivery.handle);
        self.republish(
            &delivery.handle,
            &self.config.retry_topic(),
            &[
                (
                    retry_headers::ATTEMPTS,
                    delivery.attempts.saturating_add(1).to_string(),
                ),
                (retry_headers::LAST_ERROR, one_line(error)),
                (retry_headers::TOPIC, topic),
                (retry_headers::NOT_BEFORE, not_before.to_string()),
            ],
        )
        .await?;
        self.settle(&delivery.handle).await
    }

    async fn dead<'a>(
        &'a self,
        delivery: &'a Incoming<KafkaHandle>,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        let topic = Self::original_topic(&delivery.handle);
        self.republish(
            &delivery.handle,
            &self.config.dlq_topic(),
            &[
                (
                    retry_headers::ATTEMPTS,
                    delivery.attempts.saturating_add(1).to_string(),
                ),
                (retry_headers::LAST_ERROR, one_line(error)),
                (retry_headers::CONSUMER, self.config.consumer.clone()),
                (retry_headers::TOPIC, topic),
            ],
        )
        .await?;
        self.settle(&delivery.handle).await
    }

    async fn close(&self) {
        let consumer = self.consumer.lock().await.take();
        if let Some(c) = consumer {
            // Leaving the group hands its partitions to the other members at once; their
            // uncommitted records come again there.
            c.unsubscribe();
            drop(c);
        }
        *self.state.lock().expect("state lock") = State::default();
    }
}
