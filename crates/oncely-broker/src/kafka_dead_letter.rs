use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use oncely_core::MessageId;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::dead_letter::{dead_letters_impl, preview, Page};
use crate::kafka_subscriber::header_map;
use crate::message::headers;
use crate::subscriber::retry_headers;
use crate::{ensure_topic, DeadLetter, DeadLetterError, DeadLetterPosition, Requeue};

/// Settings of [`KafkaDeadLetters`].
#[derive(Debug, Clone)]
pub struct KafkaDeadLettersConfig {
    /// Bootstrap servers, comma-separated `host:port`.
    pub brokers: String,
    /// The event topics the groups read (`orders`): group `g` of topic `t` dead-letters to
    /// `t.dlq.g` and retries through `t.retry.g`.
    pub topics: Vec<String>,
    /// Partitions of a retry topic created by a requeue (when no subscriber created it).
    /// Default 3.
    pub partitions: i32,
    /// How long one produce may take (`message.timeout.ms`). Default 10 s.
    pub delivery_timeout: Duration,
    /// How long reading a dead-letter or marker topic to its end may take. Default 15 s.
    pub read_timeout: Duration,
}

impl KafkaDeadLettersConfig {
    /// Defaults for the cluster at `brokers` and event topics `topics`.
    pub fn new(brokers: impl Into<String>, topics: Vec<String>) -> Self {
        Self {
            brokers: brokers.into(),
            topics,
            partitions: 3,
            delivery_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(15),
        }
    }

    /// `<topic>.dlq.<group>`.
    pub fn dlq_topic(topic: &str, group: &str) -> String {
        format!("{topic}.dlq.{group}")
    }

    /// `<topic>.retry.<group>`.
    pub fn retry_topic(topic: &str, group: &str) -> String {
        format!("{topic}.retry.{group}")
    }

    /// `<topic>.dlq.<group>.requeued`: one marker record per requeued dead letter, keyed by
    /// its position.
    pub fn marker_topic(topic: &str, group: &str) -> String {
        format!("{topic}.dlq.{group}.requeued")
    }
}

/// [`DeadLetters`] on Kafka: group `g`'s dead-letter topics `<topic>.dlq.g`, one per
/// configured event topic.
///
/// - List: the dead-letter topic is read from its start to its high watermarks, leaving
///   out every record with a marker in `<topic>.dlq.g.requeued`; positions are
///   [`DeadLetterPosition::Kafka`] (topic, partition, offset), dead-lettered at = the
///   record's timestamp.
/// - Requeue: the record is produced (delivery report awaited) to the group's retry topic
///   `<topic>.retry.g` — only `g` reads it — with `x-oncely-not-before` = now and without
///   `x-oncely-attempts` (attempts reset), `x-oncely-last-error`, `x-oncely-consumer`;
///   then a marker keyed by the dead letter's position goes to `<topic>.dlq.g.requeued`.
///   Kafka cannot delete one record, and a committed offset cannot skip one in the middle
///   of a partition; a marker can say exactly which letters are done. Both topics keep
///   the cluster's retention.
///
/// Reads run on Tokio's blocking pool (librdkafka's `BaseConsumer`).
#[derive(Debug, Clone)]
pub struct KafkaDeadLetters {
    config: KafkaDeadLettersConfig,
}

/// A dead letter not requeued yet, its record, and the event topic whose dead-letter topic
/// holds it.
struct Open {
    letter: DeadLetter,
    record: OwnedMessage,
    topic: String,
}

fn unavailable(e: &impl std::fmt::Display) -> DeadLetterError {
    DeadLetterError::unavailable(e.to_string())
}

/// Every record of `topic` up to its high watermarks (none when it does not exist).
fn read_all(
    brokers: &str,
    topic: &str,
    within: Duration,
) -> Result<Vec<OwnedMessage>, DeadLetterError> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "oncely-dlq-admin")
        .set("enable.auto.commit", "false")
        .set("allow.auto.create.topics", "false")
        .create()
        .map_err(|e| DeadLetterError::rejected(format!("kafka consumer: {e}")))?;
    let metadata = consumer
        .fetch_metadata(Some(topic), within)
        .map_err(|e| unavailable(&e))?;
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(Vec::new());
    };
    if t.error().is_some() {
        // Unknown topic: nothing was dead-lettered (or requeued) there.
        return Ok(Vec::new());
    }
    let mut tpl = TopicPartitionList::new();
    let mut ends = BTreeMap::new();
    for p in t.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(topic, p.id(), within)
            .map_err(|e| unavailable(&e))?;
        if high > low {
            tpl.add_partition_offset(topic, p.id(), Offset::Offset(low))
                .map_err(|e| unavailable(&e))?;
            ends.insert(p.id(), high);
        }
    }
    if ends.is_empty() {
        return Ok(Vec::new());
    }
    consumer.assign(&tpl).map_err(|e| unavailable(&e))?;
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while !ends.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DeadLetterError::unavailable(format!(
                "{topic} not read to its end within {within:?}"
            )));
        }
        match consumer.poll(left.min(Duration::from_millis(500))) {
            None => {}
            Some(Err(e)) => return Err(unavailable(&e)),
            Some(Ok(m)) => {
                let (p, o) = (m.partition(), m.offset());
                if ends.get(&p).is_some_and(|end| o + 1 >= *end) {
                    ends.remove(&p);
                }
                out.push(m.detach());
            }
        }
    }
    Ok(out)
}

impl KafkaDeadLetters {
    /// Dead letters on the cluster `config` names.
    pub fn new(config: KafkaDeadLettersConfig) -> Self {
        Self { config }
    }

    /// The settings.
    pub fn config(&self) -> &KafkaDeadLettersConfig {
        &self.config
    }

    async fn read(&self, topic: String) -> Result<Vec<OwnedMessage>, DeadLetterError> {
        let (brokers, within) = (self.config.brokers.clone(), self.config.read_timeout);
        tokio::task::spawn_blocking(move || read_all(&brokers, &topic, within))
            .await
            .map_err(|e| DeadLetterError::unavailable(format!("reader task: {e}")))?
    }

    /// Group `group`'s dead letters of every topic not requeued yet, in position order,
    /// with their records.
    async fn open_letters(&self, group: &str) -> Result<Vec<Open>, DeadLetterError> {
        let mut out = Vec::new();
        for topic in self.config.topics.iter().filter(|t| !t.is_empty()) {
            let dlq = KafkaDeadLettersConfig::dlq_topic(topic, group);
            let records = self.read(dlq.clone()).await?;
            if records.is_empty() {
                continue;
            }
            let marked: BTreeSet<String> = self
                .read(KafkaDeadLettersConfig::marker_topic(topic, group))
                .await?
                .iter()
                .filter_map(|m| m.key().map(|k| String::from_utf8_lossy(k).into_owned()))
                .collect();
            for m in records {
                let letter = decode(&dlq, topic, group, &m);
                if !marked.contains(&letter.position.to_string()) {
                    out.push(Open {
                        letter,
                        record: m,
                        topic: topic.clone(),
                    });
                }
            }
        }
        out.sort_by(|a, b| a.letter.position.cmp(&b.letter.position));
        Ok(out)
    }

    async fn page(&self, group: &str, limit: u32, after: Option<&DeadLetterPosition>) -> Page {
        if let Some(p) = after {
            if !matches!(p, DeadLetterPosition::Kafka { .. }) {
                return Err(DeadLetterError::rejected(format!(
                    "position {p} is not a Kafka position"
                )));
            }
        }
        Ok(self
            .open_letters(group)
            .await?
            .into_iter()
            .map(|o| o.letter)
            .filter(|l| after.is_none_or(|a| l.position > *a))
            .take(limit as usize)
            .collect())
    }

    fn producer(&self) -> Result<FutureProducer, DeadLetterError> {
        ClientConfig::new()
            .set("bootstrap.servers", &self.config.brokers)
            .set("client.id", "oncely-dead-letters")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // Requeued records are read by the groups from their committed offsets.
            .set(
                "batch.num.messages",
                crate::kafka::SAFE_BATCH_RECORDS.to_string(),
            )
            .set(
                "message.timeout.ms",
                self.config.delivery_timeout.as_millis().to_string(),
            )
            .create()
            .map_err(|e| DeadLetterError::rejected(format!("kafka producer: {e}")))
    }

    async fn send(
        &self,
        producer: &FutureProducer,
        record: FutureRecord<'_, [u8], [u8]>,
    ) -> Result<(), DeadLetterError> {
        let topic = record.topic.to_owned();
        producer
            .send(record, self.config.delivery_timeout)
            .await
            .map(drop)
            .map_err(|(e, _)| DeadLetterError::unavailable(format!("produce to {topic}: {e}")))
    }

    async fn requeue_selected(&self, group: &str, which: Requeue) -> Result<u64, DeadLetterError> {
        let letters: Vec<_> = self
            .open_letters(group)
            .await?
            .into_iter()
            .filter(|o| which.selects(o.letter.message_id.as_ref()))
            .collect();
        if letters.is_empty() {
            return Ok(0);
        }
        let producer = self.producer()?;
        let mut ensured = BTreeSet::new();
        let mut n = 0;
        for Open {
            letter,
            record: m,
            topic,
        } in &letters
        {
            let retry = KafkaDeadLettersConfig::retry_topic(topic, group);
            let marker = KafkaDeadLettersConfig::marker_topic(topic, group);
            if ensured.insert(topic.clone()) {
                for (t, partitions) in [(&retry, self.config.partitions.max(1)), (&marker, 1)] {
                    ensure_topic(&self.config.brokers, t, partitions)
                        .await
                        .map_err(|e| DeadLetterError::unavailable(format!("topic {t}: {e}")))?;
                }
            }
            // Requeue first, then mark: dying in between leaves a duplicate.
            let hdrs = requeue_headers(m);
            let mut record = FutureRecord::to(&retry)
                .payload(m.payload().unwrap_or_default())
                .headers(hdrs);
            if let Some(k) = m.key() {
                record = record.key(k);
            }
            self.send(&producer, record).await?;
            let key = letter.position.to_string();
            let id = letter.message_id.map(|i| i.to_string()).unwrap_or_default();
            self.send(
                &producer,
                FutureRecord::to(&marker)
                    .key(key.as_bytes())
                    .payload(id.as_bytes()),
            )
            .await?;
            n += 1;
        }
        Ok(n)
    }
}

/// The dead letter record `m` of `dlq` (group `group`, event topic `topic`).
fn decode(dlq: &str, topic: &str, group: &str, m: &OwnedMessage) -> DeadLetter {
    let h = header_map(m);
    let payload = m.payload().unwrap_or_default();
    DeadLetter {
        position: DeadLetterPosition::Kafka {
            topic: dlq.to_owned(),
            partition: m.partition(),
            offset: m.offset(),
        },
        message_id: h
            .get(headers::MESSAGE_ID)
            .and_then(|s| MessageId::parse(s).ok()),
        topic: h
            .get(retry_headers::TOPIC)
            .cloned()
            .unwrap_or_else(|| topic.to_owned()),
        group: group.to_owned(),
        event_type: h.get(headers::EVENT_TYPE).cloned().unwrap_or_default(),
        attempts: h
            .get(retry_headers::ATTEMPTS)
            .and_then(|a| a.parse().ok())
            .unwrap_or(0),
        last_error: h.get(retry_headers::LAST_ERROR).cloned(),
        dead_at_ms: m.timestamp().to_millis().unwrap_or(0),
        payload_size: payload.len(),
        payload_preview: preview(payload),
    }
}

/// The retry record's headers: the dead letter's without the dead-letter ones, due now.
fn requeue_headers(m: &OwnedMessage) -> OwnedHeaders {
    let mut h = header_map(m);
    for k in [
        retry_headers::ATTEMPTS,
        retry_headers::LAST_ERROR,
        retry_headers::CONSUMER,
        retry_headers::DEAD_AT,
    ] {
        h.remove(k);
    }
    h.insert(
        retry_headers::NOT_BEFORE.to_owned(),
        oncely_core::now_ms().to_string(),
    );
    let mut owned = OwnedHeaders::new_with_capacity(h.len());
    for (k, v) in &h {
        owned = owned.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    owned
}

dead_letters_impl!(KafkaDeadLetters, "kafka" {});
