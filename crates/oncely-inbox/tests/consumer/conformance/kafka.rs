//! The Kafka (tansu) fixture: a topic and consumer groups of its own per test.

use std::time::Duration;

use oncely_broker::{
    retry_headers, DeadLetters, KafkaConfig, KafkaDeadLetters, KafkaDeadLettersConfig,
    KafkaPublisher, KafkaSubscriber, KafkaSubscriberConfig, Message, Publisher,
};
use oncely_core::MessageId;
use oncely_sql::Database;
use oncely_testkit::{kafka_brokers, kafka_url, service_reachable, TestBackend, TestDb};

use super::{ns, test_db, DeadLetter, Fixture};

pub(crate) struct KafkaFixture {
    t: TestDb,
    ns: String,
    publisher: KafkaPublisher,
}

/// Partitions of the test topics (event, retry, dead-letter).
const KAFKA_PARTITIONS: i32 = 3;

impl KafkaFixture {
    pub(super) async fn new(backend: TestBackend) -> Option<Self> {
        if !service_reachable("Kafka", &kafka_url()).await {
            return None;
        }
        let t = test_db(backend).await?;
        let ns = ns();
        let publisher = KafkaPublisher::new(KafkaConfig::new(kafka_brokers())).unwrap();
        publisher
            .ensure_topic(&format!("t{ns}.orders"), KAFKA_PARTITIONS)
            .await
            .unwrap();
        Some(Self { t, ns, publisher })
    }
}

impl Fixture for KafkaFixture {
    type S = KafkaSubscriber;
    fn db(&self) -> &Database {
        &self.t.db
    }
    fn topic(&self) -> String {
        format!("t{}.orders", self.ns)
    }
    fn url(&self) -> &str {
        &self.t.url
    }
    fn subscriber(&self, group: &str, _settle: Duration) -> KafkaSubscriber {
        // Kafka redelivers on a rebalance (a member leaves or times out), not after a
        // settle time. The group id is namespaced so parallel tests do not share one
        // group (and its rebalances).
        let mut c = KafkaSubscriberConfig::new(kafka_brokers(), group, self.topic());
        c.group_id = format!("t{}.{group}", self.ns);
        c.partitions = KAFKA_PARTITIONS;
        c.session_timeout = Duration::from_secs(6);
        KafkaSubscriber::new(c)
    }
    async fn publish(&self, batch: &[Message]) {
        for r in self.publisher.publish(batch).await {
            r.expect("delivered");
        }
    }
    async fn publish_copy(&self, m: &Message) -> bool {
        // A relay that republishes after a crash produces a second record with the same
        // id (the idempotent producer only drops its own retries within a session).
        self.publish(std::slice::from_ref(m)).await;
        true
    }
    async fn publish_undecodable(&self) -> bool {
        let topic = self.topic();
        let record =
            rdkafka::producer::FutureRecord::<(), [u8]>::to(&topic).payload(b"no id".as_slice());
        self.publisher
            .producer()
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        true
    }
    async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
        use rdkafka::consumer::{BaseConsumer, Consumer as _};
        use rdkafka::message::{Headers as _, Message as _};
        let topic = format!("{}.dlq.{group}", self.topic());
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", kafka_brokers())
            .set("group.id", format!("t{}.dlq-reader", self.ns))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..KAFKA_PARTITIONS {
            tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&tpl).unwrap();
        let mut out = Vec::new();
        // Up to 10 s for the first record, then until nothing more arrives for 2 s.
        let mut wait = Duration::from_secs(10);
        while let Some(r) = consumer.poll(wait) {
            wait = Duration::from_secs(2);
            let m = r.unwrap();
            let mut h = std::collections::BTreeMap::new();
            if let Some(hs) = m.headers() {
                for x in hs.iter() {
                    h.insert(
                        x.key.to_owned(),
                        String::from_utf8_lossy(x.value.unwrap_or_default()).into_owned(),
                    );
                }
            }
            out.push(DeadLetter {
                id: h.get("message-id").and_then(|s| MessageId::parse(s).ok()),
                attempts: h
                    .get(retry_headers::ATTEMPTS)
                    .and_then(|a| a.parse().ok())
                    .unwrap_or(0),
                error: h
                    .get(retry_headers::LAST_ERROR)
                    .cloned()
                    .unwrap_or_default(),
            });
        }
        out
    }
    fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
        let mut c = KafkaDeadLettersConfig::new(kafka_brokers(), vec![self.topic()]);
        c.partitions = KAFKA_PARTITIONS;
        Box::new(KafkaDeadLetters::new(c))
    }
    async fn cleanup(&self) {}
}
