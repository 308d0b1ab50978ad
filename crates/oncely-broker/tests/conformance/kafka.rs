//! The conformance suite on Kafka (tansu): the broker under test (topics and groups of its
//! own per test), its cases, and the issue-28 regression of a resumed commit.

use std::time::Duration;

use oncely_broker::{
    retry_headers, DeadLetters, KafkaConfig, KafkaDeadLetters, KafkaDeadLettersConfig,
    KafkaPublisher, KafkaSubscriber, KafkaSubscriberConfig, Message, Publisher,
};
use oncely_core::MessageId;
use oncely_testkit::broker_conformance::{message, BrokerUnderTest, DeadLetter};
use oncely_testkit::{kafka_brokers, kafka_url, service_reachable};

use super::{ns, KeepAlive};

/// Partitions of the test topics (event, retry, dead-letter).
const PARTITIONS: i32 = 3;

/// The producer's message size limit under test, bytes.
const MAX_BYTES: usize = 64 * 1024;

pub(super) struct KafkaBroker {
    ns: String,
    publisher: KafkaPublisher,
}

impl KafkaBroker {
    pub(super) async fn new() -> Option<Self> {
        if !service_reachable("Kafka", &kafka_url()).await {
            return None;
        }
        let ns = ns();
        let mut config = KafkaConfig::new(kafka_brokers());
        config.max_message_bytes = MAX_BYTES;
        let publisher = KafkaPublisher::new(config).expect("producer");
        publisher
            .ensure_topic(&format!("t{ns}.orders"), PARTITIONS)
            .await
            .expect("topic");
        Some(Self { ns, publisher })
    }
}

impl BrokerUnderTest for KafkaBroker {
    type Sub = KafkaSubscriber;

    fn publisher(&self) -> &dyn Publisher {
        &self.publisher
    }

    fn topic(&self) -> String {
        format!("t{}.orders", self.ns)
    }

    fn subscriber(&self, group: &str, _settle: Duration) -> KafkaSubscriber {
        // Kafka redelivers on a rebalance, not after a settle time. The group id is
        // namespaced so parallel tests do not share one group (and its rebalances).
        let mut c = KafkaSubscriberConfig::new(kafka_brokers(), group, self.topic());
        c.group_id = format!("t{}.{group}", self.ns);
        c.partitions = PARTITIONS;
        c.session_timeout = Duration::from_secs(6);
        KafkaSubscriber::new(c)
    }

    fn refused_message(&self) -> Message {
        let mut m = message(&self.topic(), "p-1", "too large");
        m.payload = vec![b'x'; MAX_BYTES * 2];
        m
    }

    async fn unreachable_publisher(&self) -> Option<(KeepAlive, Box<dyn Publisher>)> {
        // Nothing listens on a port just released; librdkafka retries until the
        // delivery timeout, then reports a timeout (transient).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("address")
            .port();
        let mut config = KafkaConfig::new(format!("127.0.0.1:{port}"));
        config.delivery_timeout = Duration::from_secs(2);
        let publisher = KafkaPublisher::new(config).expect("producer");
        Some((Box::new(()), Box::new(publisher)))
    }

    async fn unreachable_subscriber(&self, group: &str) -> Option<(KeepAlive, KafkaSubscriber)> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("address")
            .port();
        let mut c = KafkaSubscriberConfig::new(format!("127.0.0.1:{port}"), group, self.topic());
        c.group_id = format!("t{}.{group}", self.ns);
        c.partitions = PARTITIONS;
        Some((Box::new(()), KafkaSubscriber::new(c)))
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
            .expect("consumer");
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
                .expect("partition");
        }
        consumer.assign(&tpl).expect("assign");
        let mut out = Vec::new();
        // Up to 10 s for the first record, then until nothing more arrives for 2 s.
        let mut wait = Duration::from_secs(10);
        while let Some(r) = consumer.poll(wait) {
            wait = Duration::from_secs(2);
            let m = r.expect("record");
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
        c.partitions = PARTITIONS;
        Box::new(KafkaDeadLetters::new(c))
    }

    async fn cleanup(&self) {}
}

/// Regression (issue 28): a group's committed offset lies inside a record batch
/// whenever a member acknowledged part of what one publish call sent to a partition;
/// the member that resumes there (after a rebalance, a restart) must receive the rest.
/// tansu 0.6 serves a fetch only with batches that start at or after its offset, so
/// with multi-record batches the second member received none of the 15 records left
/// (see [`oncely_broker::SAFE_BATCH_RECORDS`]).
#[tokio::test]
async fn a_member_resuming_from_a_commit_inside_a_published_batch_receives_the_rest_of_it() {
    use oncely_broker::Subscriber as _;
    use std::collections::BTreeSet;

    let Some(b) = KafkaBroker::new().await else {
        return;
    };
    // One partition key: one partition, and one publish call (one batch unless the
    // producer caps its batches).
    let batch: Vec<Message> = (0..20)
        .map(|i| message(&b.topic(), "p-1", &format!("m{i}")))
        .collect();
    for r in b.publisher.publish(&batch).await {
        r.expect("published");
    }
    let ids: Vec<MessageId> = batch.iter().map(|m| m.id).collect();

    let first = b.subscriber("resume", Duration::ZERO);
    first.subscribe().await.expect("subscribe");
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while got.len() < ids.len() && std::time::Instant::now() < deadline {
        got.extend(
            first
                .receive(32, Duration::from_secs(1))
                .await
                .expect("receive"),
        );
    }
    assert_eq!(got.len(), ids.len(), "the first member received the batch");
    got.sort_by_key(|d| d.handle.offset());
    // Settle the first five only: the group commits the offset of the sixth.
    for d in &got[..5] {
        first.ack(d).await.expect("ack");
    }
    // The commit is asynchronous; give it time to land before the member leaves.
    tokio::time::sleep(Duration::from_secs(2)).await;
    first.close().await;

    let second = b.subscriber("resume", Duration::ZERO);
    second.subscribe().await.expect("subscribe");
    let want: BTreeSet<MessageId> = ids[5..].iter().copied().collect();
    let mut seen = BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(45);
    while !want.is_subset(&seen) && std::time::Instant::now() < deadline {
        for d in second
            .receive(32, Duration::from_secs(1))
            .await
            .expect("receive")
        {
            seen.insert(d.message.as_ref().expect("decodable").id);
            second.ack(&d).await.expect("ack");
        }
    }
    second.close().await;
    let missing: Vec<_> = want.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "{} of the 15 records after the commit never came to the group: {missing:?}",
        missing.len()
    );
}

// Kafka does not de-duplicate by message id (see the module comment).
oncely_testkit::broker_conformance!(
    cases,
    KafkaBroker::new().await,
    [
        published_message_is_received_with_its_fields_and_gone_after_ack,
        retried_delivery_comes_again_to_its_group_only_after_the_delay_with_attempts_raised,
        delivery_dead_lettered_at_the_attempt_limit_lands_in_the_dead_letters_and_comes_no_more,
        messages_of_one_partition_key_arrive_in_publish_order,
        a_message_the_broker_refuses_is_a_permanent_failure_and_the_rest_of_its_batch_goes,
        dead_letters_are_listed_paged_and_requeued_to_their_group_only_with_attempts_reset,
        a_group_started_after_one_hundred_events_were_published_receives_each_once,
        publishing_to_an_unreachable_broker_is_a_transient_failure,
        subscribing_at_an_unreachable_broker_is_a_transient_failure,
    ]
);
