//! A fresh topic on one broker of the matrix, with a publisher and a test consumer that
//! was subscribed before anything is published ([`TestTopic`]), and the consumers
//! themselves ([`Collector`]): what a test reads back of what a relay published.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
use futures_util::StreamExt as _;
#[cfg(feature = "kafka")]
use oncely_broker::{KafkaConfig, KafkaPublisher};
#[cfg(feature = "nats")]
use oncely_broker::{NatsConfig, NatsPublisher};
use oncely_broker::{Publisher, SqlTransport};
#[cfg(feature = "rabbitmq")]
use oncely_broker::{RabbitMqConfig, RabbitMqPublisher};
use oncely_sql::Database;

#[cfg(feature = "rabbitmq")]
use crate::amqp_url;
#[cfg(feature = "nats")]
use crate::nats_url;
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
use crate::service_reachable;
use crate::TestBroker;
#[cfg(feature = "kafka")]
use crate::{kafka_brokers, kafka_url};

/// The RabbitMQ topic exchange the test publishers ([`rabbitmq_config`]) publish to.
pub const TEST_EXCHANGE: &str = "oncely.test";

/// Partitions of the Kafka test topics: more than one, so per-key ordering is exercised.
pub const KAFKA_PARTITIONS: i32 = 3;

/// The SQL transport's message size limit in the test topics, bytes.
pub const SQL_MAX_MESSAGE_BYTES: usize = 1024;

/// One message as a test consumer saw it.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// The message id (RabbitMQ `message_id`, JetStream `Nats-Msg-Id`, the `message-id`
    /// header on Kafka, the queue row's id on the SQL transport).
    pub id: String,
    /// The partition key (the Kafka record key).
    pub partition_key: String,
    /// The event type (RabbitMQ `type`, the `event-type` header elsewhere).
    pub event_type: String,
    /// Every header the message carried.
    pub headers: BTreeMap<String, String>,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

/// A test consumer of one topic: reads every message published there.
#[derive(Debug)]
pub struct Collector(Source);

#[derive(Debug)]
enum Source {
    /// The SQL transport, polled (group-less receive from the queue table).
    Sql(SqlTransport, String),
    /// A broker consumer task feeding a channel.
    #[cfg_attr(
        not(any(feature = "rabbitmq", feature = "nats", feature = "kafka")),
        allow(dead_code)
    )]
    Channel(tokio::sync::mpsc::UnboundedReceiver<Delivered>),
}

impl Collector {
    /// The next message, or `None` when none arrives within `wait`.
    ///
    /// # Panics
    /// When the SQL transport cannot be read.
    pub async fn next(&mut self, wait: Duration) -> Option<Delivered> {
        let deadline = tokio::time::Instant::now() + wait;
        match &mut self.0 {
            Source::Channel(rx) => tokio::time::timeout_at(deadline, rx.recv())
                .await
                .ok()
                .flatten(),
            Source::Sql(t, topic) => loop {
                let got = t.receive(topic, 1).await.expect("receive from SQL queue");
                if let Some(m) = got.into_iter().next() {
                    return Some(Delivered {
                        id: m.id.to_string(),
                        partition_key: m.partition_key,
                        event_type: m.event_type,
                        headers: m.headers,
                        payload: m.payload,
                    });
                }
                if tokio::time::Instant::now() >= deadline {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            },
        }
    }

    /// Receives until `n` messages arrived (or `timeout` passed), then keeps listening until
    /// nothing arrives for `quiet`, so extra copies are caught too.
    ///
    /// # Panics
    /// As [`Collector::next`].
    pub async fn collect(
        &mut self,
        n: usize,
        timeout: Duration,
        quiet: Duration,
    ) -> Vec<Delivered> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut out = Vec::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match self.next(left).await {
                Some(d) => out.push(d),
                None => break,
            }
        }
        while let Some(d) = self.next(quiet).await {
            out.push(d);
        }
        out
    }
}

/// A fresh topic (`t<uuid>`) on `broker`, a publisher connected straight to the broker, and
/// a [`Collector`] subscribed to the topic before anything is published.
#[derive(Debug)]
pub struct TestTopic {
    /// The broker.
    pub broker: TestBroker,
    /// The topic (RabbitMQ routing key, JetStream subject, Kafka topic, SQL queue topic).
    pub topic: String,
    /// A publisher to the topic's broker ([`rabbitmq_config`], [`nats_config`],
    /// [`kafka_config`]; the SQL transport with a [`SQL_MAX_MESSAGE_BYTES`] limit).
    pub publisher: Arc<dyn Publisher>,
    /// Reads what is published to the topic.
    pub collector: Collector,
    /// NATS: the publisher and the JetStream stream (`T<uuid>`) that captures the topic,
    /// deleted by [`TestTopic::finish`].
    #[cfg(feature = "nats")]
    pub nats: Option<(NatsPublisher, String)>,
}

impl TestTopic {
    /// A fresh topic on `broker`; the SQL transport lives in `db`. `None` (after printing
    /// why) when the broker is unreachable and services are not required.
    ///
    /// # Panics
    /// When the broker is unreachable and [`require_services`](crate::require_services) is
    /// set, or the topic, stream or consumer cannot be created.
    pub async fn new(broker: TestBroker, db: &Database) -> Option<Self> {
        let topic = format!("t{}", uuid::Uuid::new_v4().simple());
        let (publisher, collector, nats) = match broker {
            TestBroker::Sql => {
                let t = SqlTransport::new(db.clone(), SQL_MAX_MESSAGE_BYTES);
                let publisher: Arc<dyn Publisher> = Arc::new(t.clone());
                (
                    publisher,
                    Collector(Source::Sql(t, topic.clone())),
                    NatsExtra::default(),
                )
            }
            TestBroker::RabbitMq => rabbitmq_topic(&topic).await?,
            TestBroker::Nats => nats_topic(&topic).await?,
            TestBroker::Kafka => kafka_topic(&topic).await?,
        };
        #[cfg(not(feature = "nats"))]
        let () = nats;
        Some(Self {
            broker,
            topic,
            publisher,
            collector,
            #[cfg(feature = "nats")]
            nats,
        })
    }

    /// Deletes what the topic left on the broker (the JetStream stream). A topic dropped
    /// without `finish` (a failed test) is cleaned up by its `Drop`.
    #[cfg_attr(not(feature = "nats"), allow(clippy::unused_async))]
    pub async fn finish(mut self) {
        #[cfg(feature = "nats")]
        if let Some((p, stream)) = self.nats.take() {
            drop(p.jetstream().delete_stream(&stream).await);
        }
        #[cfg(not(feature = "nats"))]
        let _ = &mut self;
    }
}

/// A [`TestTopic`] taken apart by [`TestTopic::into_parts`]: broker, topic, publisher,
/// collector, and (NATS) the publisher and stream the owner now deletes.
pub type TopicParts = (TestBroker, String, Arc<dyn Publisher>, Collector, NatsExtra);

impl TestTopic {
    /// The topic's parts, for a harness that keeps them in fields of its own; the stream
    /// (NATS) is then the caller's to delete.
    #[must_use]
    pub fn into_parts(mut self) -> TopicParts {
        let (_, closed) = tokio::sync::mpsc::unbounded_channel();
        let collector = std::mem::replace(&mut self.collector, Collector(Source::Channel(closed)));
        #[cfg(feature = "nats")]
        let nats = self.nats.take();
        #[cfg(not(feature = "nats"))]
        let nats = ();
        (
            self.broker,
            std::mem::take(&mut self.topic),
            self.publisher.clone(),
            collector,
            nats,
        )
    }
}

impl Drop for TestTopic {
    /// Deletes the JetStream stream of a topic whose test ended without
    /// [`TestTopic::finish`] (a panic), through a connection of its own on a thread of its
    /// own (a `Drop` cannot await, and the test's runtime is the one being blocked).
    /// Best-effort and bounded by 10 s. RabbitMQ's test queues are auto-delete; Kafka's
    /// topics live in the CI broker's memory.
    fn drop(&mut self) {
        #[cfg(feature = "nats")]
        if let Some((_, stream)) = self.nats.take() {
            crate::process::clean_up_blocking(async move {
                if let Ok(c) = async_nats::connect(nats_url()).await {
                    let js = async_nats::jetstream::new(c);
                    drop(js.delete_stream(&stream).await);
                }
            });
        }
    }
}

#[cfg(feature = "nats")]
type NatsExtra = Option<(NatsPublisher, String)>;
#[cfg(not(feature = "nats"))]
type NatsExtra = ();

/// What one broker's topic set-up gives [`TestTopic::new`].
type Parts = (Arc<dyn Publisher>, Collector, NatsExtra);

#[cfg(feature = "rabbitmq")]
async fn rabbitmq_topic(topic: &str) -> Option<Parts> {
    let url = amqp_url();
    if !service_reachable("RabbitMQ", &url).await {
        return None;
    }
    let collector = rabbitmq_collector(&url, topic).await;
    let p = RabbitMqPublisher::connect(rabbitmq_config(&url))
        .await
        .expect("connect to RabbitMQ");
    Some((Arc::new(p), collector, NatsExtra::default()))
}

#[cfg(feature = "nats")]
async fn nats_topic(topic: &str) -> Option<Parts> {
    let url = nats_url();
    if !service_reachable("NATS", &url).await {
        return None;
    }
    let p = NatsPublisher::connect(nats_config(&url))
        .await
        .expect("connect to NATS");
    let stream = format!("T{}", uuid::Uuid::new_v4().simple());
    p.jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![topic.to_owned()],
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("create stream");
    let collector = nats_collector(&p, &stream).await;
    Some((Arc::new(p.clone()), collector, Some((p, stream))))
}

#[cfg(feature = "kafka")]
async fn kafka_topic(topic: &str) -> Option<Parts> {
    let brokers = kafka_brokers();
    if !service_reachable("Kafka", &kafka_url()).await {
        return None;
    }
    let collector = kafka_collector(&brokers, topic).await;
    let p = KafkaPublisher::new(kafka_config(&brokers)).expect("kafka producer");
    Some((Arc::new(p), collector, NatsExtra::default()))
}

#[cfg(not(feature = "rabbitmq"))]
#[allow(clippy::unused_async)]
async fn rabbitmq_topic(_topic: &str) -> Option<Parts> {
    panic!("oncely-testkit was built without its `rabbitmq` feature")
}

#[cfg(not(feature = "nats"))]
#[allow(clippy::unused_async)]
async fn nats_topic(_topic: &str) -> Option<Parts> {
    panic!("oncely-testkit was built without its `nats` feature")
}

#[cfg(not(feature = "kafka"))]
#[allow(clippy::unused_async)]
async fn kafka_topic(_topic: &str) -> Option<Parts> {
    panic!("oncely-testkit was built without its `kafka` feature")
}

/// RabbitMQ publisher settings for tests: exchange [`TEST_EXCHANGE`], 3 s confirm timeout,
/// 2 s connect timeout.
#[cfg(feature = "rabbitmq")]
pub fn rabbitmq_config(url: &str) -> RabbitMqConfig {
    let mut c = RabbitMqConfig::new(url);
    TEST_EXCHANGE.clone_into(&mut c.exchange);
    c.confirm_timeout = Duration::from_secs(3);
    c.connect_timeout = Duration::from_secs(2);
    c
}

/// Kafka producer settings for tests: 2 s delivery timeout, 64 KiB message limit.
#[cfg(feature = "kafka")]
pub fn kafka_config(brokers: &str) -> KafkaConfig {
    let mut c = KafkaConfig::new(brokers);
    c.delivery_timeout = Duration::from_secs(2);
    c.max_message_bytes = 64 * 1024;
    c
}

/// NATS publisher settings for tests: 2 s ack timeout.
#[cfg(feature = "nats")]
pub fn nats_config(url: &str) -> NatsConfig {
    let mut c = NatsConfig::new(url);
    c.ack_timeout = Duration::from_secs(2);
    c
}

#[cfg(feature = "rabbitmq")]
fn header_text(v: &lapin::types::AMQPValue) -> String {
    match v {
        lapin::types::AMQPValue::LongString(s) => {
            String::from_utf8_lossy(s.as_bytes()).into_owned()
        }
        other => format!("{other:?}"),
    }
}

/// A server-named, exclusive queue bound to `topic` on [`TEST_EXCHANGE`] (declared if
/// missing), consumed into a [`Collector`]. Checks that every message is persistent and that
/// its `message_id` property equals its `message-id` header.
///
/// # Panics
/// When RabbitMQ cannot be reached or the queue cannot be declared, bound or consumed.
#[cfg(feature = "rabbitmq")]
pub async fn rabbitmq_collector(url: &str, topic: &str) -> Collector {
    use lapin::options::{
        BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    };
    use lapin::types::FieldTable;
    let conn = lapin::Connection::connect(url, oncely_broker::amqp_connection_properties())
        .await
        .expect("consumer connection");
    let ch = conn.create_channel().await.expect("consumer channel");
    ch.exchange_declare(
        TEST_EXCHANGE,
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare exchange");
    let q = ch
        .queue_declare(
            "",
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare queue");
    ch.queue_bind(
        q.name().as_str(),
        TEST_EXCHANGE,
        topic,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind queue");
    let mut consumer = ch
        .basic_consume(
            q.name().as_str(),
            "test",
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _keep = (conn, ch);
        while let Some(Ok(d)) = consumer.next().await {
            let p = &d.properties;
            let headers: BTreeMap<String, String> = p
                .headers()
                .as_ref()
                .map(|t| {
                    t.inner()
                        .iter()
                        .map(|(k, v)| (k.to_string(), header_text(v)))
                        .collect()
                })
                .unwrap_or_default();
            assert_eq!(*p.delivery_mode(), Some(2), "messages must be persistent");
            let id = p
                .message_id()
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default();
            assert_eq!(
                headers.get("message-id"),
                Some(&id),
                "message_id property = header"
            );
            let delivered = Delivered {
                id,
                partition_key: headers.get("partition-key").cloned().unwrap_or_default(),
                event_type: p
                    .kind()
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                headers,
                payload: d.data.clone(),
            };
            if tx.send(delivered).is_err() {
                break;
            }
        }
    });
    Collector(Source::Channel(rx))
}

/// A durable pull consumer (`test`) on `stream`, delivering everything from the start into
/// a [`Collector`]. Checks that `Nats-Msg-Id` equals the `message-id` header.
///
/// # Panics
/// When the consumer cannot be created.
#[cfg(feature = "nats")]
pub async fn nats_collector(p: &NatsPublisher, stream: &str) -> Collector {
    use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
    let consumer: async_nats::jetstream::consumer::Consumer<pull::Config> = p
        .jetstream()
        .create_consumer_on_stream(
            pull::Config {
                durable_name: Some("test".to_owned()),
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            },
            stream,
        )
        .await
        .expect("create consumer");
    let mut messages = consumer.messages().await.expect("consumer messages");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(m)) = messages.next().await {
            let headers: BTreeMap<String, String> = m
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .filter_map(|(k, v)| Some((k.to_string(), v.first()?.as_str().to_owned())))
                        .collect()
                })
                .unwrap_or_default();
            drop(m.ack().await);
            let id = headers.get("Nats-Msg-Id").cloned().unwrap_or_default();
            assert_eq!(
                headers.get("message-id"),
                Some(&id),
                "Nats-Msg-Id = message-id"
            );
            let delivered = Delivered {
                id,
                partition_key: headers.get("partition-key").cloned().unwrap_or_default(),
                event_type: headers.get("event-type").cloned().unwrap_or_default(),
                headers,
                payload: m.payload.to_vec(),
            };
            if tx.send(delivered).is_err() {
                break;
            }
        }
    });
    Collector(Source::Channel(rx))
}

/// Creates `topic` ([`KAFKA_PARTITIONS`] partitions) and reads every partition from the
/// beginning (manual assignment, no committed offsets) into a [`Collector`]. Checks that
/// the record key is the partition key.
///
/// # Panics
/// When the topic or the consumer cannot be created.
#[cfg(feature = "kafka")]
pub async fn kafka_collector(brokers: &str, topic: &str) -> Collector {
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    use rdkafka::message::{Headers as _, Message as _};
    oncely_broker::ensure_topic(brokers, topic, KAFKA_PARTITIONS)
        .await
        .expect("create topic");
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("test-{topic}"))
        .set("enable.auto.commit", "false")
        // After a fetch error, start over rather than jump to the end and miss records.
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("kafka consumer");
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..KAFKA_PARTITIONS {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .expect("partition offset");
    }
    consumer.assign(&tpl).expect("assign partitions");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let m = match consumer.recv().await {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("kafka test consumer: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let headers: BTreeMap<String, String> = m
                .headers()
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
                .unwrap_or_default();
            let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
            assert_eq!(
                headers.get("partition-key"),
                Some(&key),
                "record key = partition key"
            );
            let delivered = Delivered {
                id: headers.get("message-id").cloned().unwrap_or_default(),
                partition_key: key,
                event_type: headers.get("event-type").cloned().unwrap_or_default(),
                headers,
                payload: m.payload().unwrap_or_default().to_vec(),
            };
            if tx.send(delivered).is_err() {
                break;
            }
        }
    });
    Collector(Source::Channel(rx))
}
