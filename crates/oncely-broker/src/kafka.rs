use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;

use crate::{BoxFuture, Message, PublishError, Publisher};

/// Settings of [`KafkaPublisher`].
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated `host:port` (librdkafka `bootstrap.servers`), e.g.
    /// `127.0.0.1:9092`.
    pub brokers: String,
    /// How long librdkafka may try to deliver one message, retries included
    /// (`message.timeout.ms`, also `request.timeout.ms`); after it the message fails with
    /// [`TransientError::Timeout`](crate::TransientError::Timeout). A publish call returns within
    /// [`KafkaConfig::publish_deadline`] whatever the broker does. Default 10 s.
    pub delivery_timeout: Duration,
    /// How long the producer waits to fill a batch (`linger.ms`). Default 2 ms.
    pub linger: Duration,
    /// Largest message the producer accepts (`message.max.bytes`), bytes. Larger messages
    /// fail at once with [`PermanentError::TooLarge`](crate::PermanentError::TooLarge). Default 1
    /// MiB.
    pub max_message_bytes: usize,
    /// How long the producer keeps a message for a topic the cluster does not know
    /// (`topic.metadata.propagation.max.ms`) before failing it with
    /// [`PermanentError::Unroutable`](crate::PermanentError::Unroutable). Default 2 s.
    pub unknown_topic_timeout: Duration,
    /// Most records in one record batch (`batch.num.messages`). Default
    /// [`SAFE_BATCH_RECORDS`] (1): see there why; raise it for throughput only on a cluster
    /// that serves a fetch from inside a batch (Apache Kafka does).
    pub batch_records: usize,
}

impl KafkaConfig {
    /// Defaults for `brokers`.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            delivery_timeout: Duration::from_secs(10),
            linger: Duration::from_millis(2),
            max_message_bytes: 1024 * 1024,
            unknown_topic_timeout: Duration::from_secs(2),
            batch_records: SAFE_BATCH_RECORDS,
        }
    }

    /// The longest a publish call waits for its delivery reports: twice
    /// [`KafkaConfig::delivery_timeout`] (a produce request sent just before a message's
    /// timeout may take `request.timeout.ms` more to fail) plus 1 s (librdkafka scans for
    /// timed-out messages about once a second, and after a reconnect backoff). Messages
    /// without a report by then fail with
    /// [`TransientError::Timeout`](crate::TransientError::Timeout); librdkafka still holds them and
    /// may deliver them later, a copy with the same `message-id` that consumers de-duplicate. With
    /// the defaults 21 s, within the relay's default 30 s lease.
    pub fn publish_deadline(&self) -> Duration {
        self.delivery_timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(1))
    }

    /// The librdkafka producer settings oncely uses: the idempotent producer
    /// (`enable.idempotence=true`, which implies `acks=all`, at most 5 requests in flight
    /// per connection and retries without reordering within a partition). The raw-client
    /// baseline of `oncely bench relay` uses exactly these.
    pub fn producer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("client.id", "oncely-relay")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", millis(self.delivery_timeout))
            // A produce request in flight when the connection silently dies fails after
            // this, not after librdkafka's default 30 s (the idempotent producer cannot time
            // out a message while its request is in flight).
            .set("request.timeout.ms", millis(self.delivery_timeout))
            // While a partition leader is unreachable, librdkafka (2.12) times out the
            // messages in that broker's transmit queue only when the broker's thread wakes
            // up, and while it waits to reconnect it sleeps the whole backoff (it does not
            // wake for those messages' timeouts): with librdkafka's default ceiling of 10 s
            // deliveries failed up to 10 s after `message.timeout.ms`. 1 s (the Java
            // client's default) keeps the timeouts within about a second of it.
            .set("reconnect.backoff.max.ms", millis(RECONNECT_BACKOFF_MAX))
            .set("linger.ms", millis(self.linger))
            .set("batch.num.messages", self.batch_records.max(1).to_string())
            .set("message.max.bytes", self.max_message_bytes.to_string())
            .set(
                "topic.metadata.propagation.max.ms",
                millis(self.unknown_topic_timeout),
            );
        c
    }
}

/// Records per record batch of every oncely producer (librdkafka `batch.num.messages`):
/// one, so that every offset is the first of its batch.
///
/// A consumer resumes at an arbitrary offset: a group's committed offset after a rebalance
/// or a restart (oncely commits up to the lowest record still in flight), the next offset
/// of a partition resumed after a pause. Kafka answers a fetch from offset `o` with the
/// batch that holds `o` and the client drops the records before it. tansu 0.6 (the Kafka
/// API server CI runs) answers only with the batches that *start* at or after `o`
/// (`DynoStore::fetch` keeps the batch base offsets `>= o`), so the records from `o` to the
/// end of the batch holding it are never delivered to that group, and its next commit moves
/// past them for good. Issue 28: 51 of 2,000 published events never reached the billing
/// group in a chaos run; the consumer conformance case
/// `a_member_resuming_from_a_commit_inside_a_published_batch_receives_the_rest_of_it`
/// reproduces it. One record per batch costs throughput (a produce request carries one
/// record per partition) and loses nothing on any broker.
pub const SAFE_BATCH_RECORDS: usize = 1;

/// librdkafka `reconnect.backoff.max.ms`: the longest pause between two connection attempts
/// to a broker, and so the longest librdkafka is late in timing out the messages queued for
/// an unreachable one.
pub(crate) const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(1);

fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

/// Publishes to Kafka with rdkafka's idempotent producer: the message's topic is the Kafka
/// topic, its `partition_key` the record key (the default partitioner hashes it, so one
/// aggregate's events land in one partition, in order), every header of
/// [`Message::all_headers`] a record header. A message counts as published only when its
/// delivery report arrives without error (acknowledged by all in-sync replicas).
///
/// The producer de-duplicates its own retries within one producer session per partition;
/// a relay that crashes after the delivery report and before marking the row republishes
/// it as a second record with the same `message-id` header — consumers de-duplicate on
/// that (the inbox does).
///
/// librdkafka reconnects by itself; messages it cannot deliver within
/// [`KafkaConfig::delivery_timeout`] fail with
/// [`TransientError::Timeout`](crate::TransientError::Timeout), and a publish call never waits
/// longer than [`KafkaConfig::publish_deadline`] for its delivery reports. After a fatal
/// idempotence error the producer is replaced on the next call.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: Arc<Mutex<FutureProducer>>,
    /// Set when a delivery failed with a producer-state error: the next call replaces the
    /// producer (see [`needs_new_session`]).
    stale: Arc<AtomicBool>,
    config: KafkaConfig,
}

/// Errors after which this producer session cannot deliver again: the broker no longer
/// accepts its producer id / epoch / sequence. librdkafka reports some of them as fatal
/// (then [`FutureProducer`]'s client has a `fatal_error`), but not all: tansu 0.6 answers
/// every produce with `PRODUCER_FENCED` after librdkafka bumped the epoch following
/// delivery timeouts (an outage), and librdkafka keeps retrying with that epoch. A new
/// producer (a new session) delivers again; its first records may duplicate ones the old
/// session delivered, which consumers de-duplicate by `message-id` anyway.
pub(crate) fn needs_new_session(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
            | RDKafkaErrorCode::OutOfOrderSequenceNumber
            | RDKafkaErrorCode::UnknownProducerId
            | RDKafkaErrorCode::InvalidProducerIdMapping
            | RDKafkaErrorCode::Fatal
    )
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// Creates the producer. librdkafka connects lazily, so an unreachable cluster shows up
    /// as failed deliveries, not here.
    ///
    /// # Errors
    /// [`PermanentError::Rejected`](crate::PermanentError::Rejected) when librdkafka refuses the
    /// configuration.
    pub fn new(config: KafkaConfig) -> Result<Self, PublishError> {
        let producer = Self::create(&config)?;
        Ok(Self {
            producer: Arc::new(Mutex::new(producer)),
            stale: Arc::new(AtomicBool::new(false)),
            config,
        })
    }

    fn create(config: &KafkaConfig) -> Result<FutureProducer, PublishError> {
        config
            .producer_config()
            .create()
            .map_err(|e| PublishError::rejected(format!("kafka producer: {e}")))
    }

    /// The current producer (tests and tools flush or inspect it).
    ///
    /// # Panics
    /// When the lock is poisoned.
    pub fn producer(&self) -> FutureProducer {
        self.producer.lock().expect("producer lock").clone()
    }

    /// Creates topic `name` with `partitions` partitions and replication factor 1 unless it
    /// exists (an existing topic is left as it is), waiting up to 10 s for the answer.
    ///
    /// # Errors
    /// [`PermanentError::Rejected`](crate::PermanentError::Rejected) when the cluster refuses,
    /// [`TransientError::Unavailable`](crate::TransientError::Unavailable) when it cannot be
    /// reached.
    pub async fn ensure_topic(&self, name: &str, partitions: i32) -> Result<(), PublishError> {
        ensure_topic(&self.config.brokers, name, partitions).await
    }

    /// The record sent for `m`: topic = the message's topic, key = its partition key (one
    /// aggregate's events share a partition and keep their order), value = the payload, and
    /// every header of [`Message::all_headers`] as a record header. Public so benchmarks can
    /// send the very same records with the raw producer.
    pub fn record(m: &Message) -> FutureRecord<'_, [u8], [u8]> {
        let mut headers = OwnedHeaders::new_with_capacity(6);
        for (k, v) in m.all_headers() {
            headers = headers.insert(Header {
                key: &k,
                value: Some(v.as_bytes()),
            });
        }
        FutureRecord::to(&m.topic)
            .key(m.partition_key.as_bytes())
            .payload(m.payload.as_slice())
            .headers(headers)
    }

    fn map_error(e: &KafkaError, m: &Message, config: &KafkaConfig) -> PublishError {
        match e.rdkafka_error_code() {
            Some(RDKafkaErrorCode::MessageTimedOut) => PublishError::timeout(
                u64::try_from(config.delivery_timeout.as_millis()).unwrap_or(u64::MAX),
            ),
            Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::InvalidMessageSize) => {
                PublishError::too_large(m.payload.len(), config.max_message_bytes)
            }
            Some(RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition) => {
                PublishError::unroutable(m.topic.clone())
            }
            Some(
                RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::Resolve
                | RDKafkaErrorCode::QueueFull,
            ) => PublishError::unavailable(e.to_string()),
            _ => PublishError::rejected(e.to_string()),
        }
    }

    /// Replaces the producer after a fatal error or a producer-state error (idempotence
    /// state lost: the old one refuses every message).
    fn healthy_producer(&self) -> Result<FutureProducer, PublishError> {
        let mut guard = self.producer.lock().expect("producer lock");
        let fatal = guard.client().fatal_error();
        if fatal.is_some() || self.stale.swap(false, Ordering::SeqCst) {
            tracing::warn!(
                ?fatal,
                "kafka producer session unusable; creating a new one"
            );
            *guard = Self::create(&self.config)?;
        }
        Ok(guard.clone())
    }

    async fn publish_batch(&self, batch: &[Message]) -> Vec<Result<(), PublishError>> {
        let wait = self.config.publish_deadline();
        let deadline = tokio::time::Instant::now() + wait;
        let producer = match self.healthy_producer() {
            Ok(p) => p,
            Err(e) => {
                return batch
                    .iter()
                    .map(|_| Err(PublishError::rejected(e.to_string())))
                    .collect()
            }
        };
        // Enqueue everything first (librdkafka batches and pipelines), then await the
        // delivery reports in order, until the deadline: librdkafka reports every message
        // eventually, but not always on time (see `RECONNECT_BACKOFF_MAX`), and a relay
        // must not sit on its claimed rows.
        let pending: Vec<Result<DeliveryFuture, PublishError>> = batch
            .iter()
            .map(|m| {
                producer
                    .send_result(Self::record(m))
                    .map_err(|(e, _)| Self::map_error(&e, m, &self.config))
            })
            .collect();
        let mut results = Vec::with_capacity(batch.len());
        let mut overdue = 0_usize;
        for (m, p) in batch.iter().zip(pending) {
            let r = match p {
                Err(e) => Err(e),
                Ok(delivery) => match tokio::time::timeout_at(deadline, delivery).await {
                    Err(_elapsed) => {
                        overdue += 1;
                        Err(PublishError::timeout(
                            u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                        ))
                    }
                    Ok(Ok(Ok(_))) => Ok(()),
                    Ok(Ok(Err((e, _)))) => {
                        if e.rdkafka_error_code().is_some_and(needs_new_session) {
                            self.stale.store(true, Ordering::SeqCst);
                        }
                        Err(Self::map_error(&e, m, &self.config))
                    }
                    Ok(Err(_canceled)) => Err(PublishError::unavailable(
                        "producer dropped the delivery report".to_owned(),
                    )),
                },
            };
            results.push(r);
        }
        if overdue > 0 {
            tracing::warn!(
                overdue,
                wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                "kafka delivery reports overdue; reporting the messages as timed out \
                 (librdkafka may still deliver them: copies with the same message ids)"
            );
        }
        results
    }
}

impl Publisher for KafkaPublisher {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(self.publish_batch(batch))
    }

    fn name(&self) -> &'static str {
        "kafka"
    }
}

/// Creates topic `name` on the cluster at `brokers` with `partitions` partitions and
/// replication factor 1 unless it exists, waiting up to 10 s.
///
/// # Errors
/// [`PermanentError::Rejected`](crate::PermanentError::Rejected) when the cluster refuses,
/// [`TransientError::Unavailable`](crate::TransientError::Unavailable) when it cannot be reached
/// within 10 s.
pub async fn ensure_topic(brokers: &str, name: &str, partitions: i32) -> Result<(), PublishError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| PublishError::rejected(format!("kafka admin client: {e}")))?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let results = tokio::time::timeout(
        Duration::from_secs(10),
        admin.create_topics([&topic], &opts),
    )
    .await
    .map_err(|_| PublishError::unavailable("create topic timed out".to_owned()))?
    .map_err(|e| PublishError::unavailable(e.to_string()))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => {
                return Err(PublishError::rejected(format!("create topic {t}: {code}")))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_backoff_is_capped_so_timeouts_fire_on_time() {
        let c = KafkaConfig::new("127.0.0.1:9092").producer_config();
        assert_eq!(c.get("reconnect.backoff.max.ms"), Some("1000"));
        // librdkafka accepts the whole configuration (connects lazily).
        let _producer: FutureProducer = c.create().expect("producer");
    }

    #[test]
    fn publish_deadline_covers_an_in_flight_request_and_the_scan() {
        let mut c = KafkaConfig::new("127.0.0.1:9092");
        assert_eq!(c.publish_deadline(), Duration::from_secs(21));
        c.delivery_timeout = Duration::from_secs(2);
        assert_eq!(c.publish_deadline(), Duration::from_secs(5));
    }
}
