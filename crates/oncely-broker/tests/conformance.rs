//! The publisher/subscriber conformance suite (`oncely_testkit::broker_conformance`), run
//! against every broker: the SQL transport on SQLite, PostgreSQL and MariaDB, RabbitMQ,
//! NATS JetStream and Kafka. Each broker gets a namespace of its own per test (topic,
//! exchange, stream, consumer groups). An unreachable service skips, or fails under
//! `ONCELY_TEST_REQUIRE_SERVICES=1`.
//!
//! Cases that cannot apply, per broker:
//! - `a_republished_copy_with_the_same_message_id_is_delivered_once`: RabbitMQ and Kafka do
//!   not de-duplicate by message id (a republished copy is a new message there; the
//!   consumers' inboxes recognise it).
//! - `two_consumers_of_a_new_group_subscribing_while_events_are_published_receive_each_once`:
//!   on Kafka a second member of a group makes it rebalance, which redelivers records not
//!   yet committed (at least once; the inbox recognises them), so "each once" is not
//!   Kafka's promise between two members.
//! - `publishing_to_an_unreachable_broker_is_a_transient_failure` and
//!   `subscribing_at_an_unreachable_broker_is_a_transient_failure`: the SQL transport on
//!   SQLite has no network path to cut (an embedded file).

use std::time::Duration;

use oncely_broker::{DeadLetters, Message, Publisher, SqlDeadLetters, SqlSubscriber, SqlTransport};
use oncely_sql::{Database, DbOptions};
use oncely_testkit::broker_conformance::{message, BrokerUnderTest, DeadLetter};
use oncely_testkit::{FaultProxy, TestBackend, TestDb};

/// A fresh namespace for one test.
fn ns() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

type KeepAlive = Box<dyn std::any::Any + Send>;

// --- SQL transport -------------------------------------------------------------------

/// Payload limit of the SQL transport under test, bytes.
const SQL_MAX_BYTES: usize = 1024;

struct SqlBroker {
    t: TestDb,
    transport: SqlTransport,
    topic: String,
}

impl SqlBroker {
    async fn new(backend: TestBackend) -> Option<Self> {
        let t = TestDb::new(backend).await?;
        t.db.migrate().await.expect("migrate");
        let transport = SqlTransport::new(t.db.clone(), SQL_MAX_BYTES);
        Some(Self {
            t,
            transport,
            topic: format!("t{}.orders", ns()),
        })
    }
}

impl BrokerUnderTest for SqlBroker {
    type Sub = SqlSubscriber;

    fn publisher(&self) -> &dyn Publisher {
        &self.transport
    }

    fn topic(&self) -> String {
        self.topic.clone()
    }

    fn subscriber(&self, group: &str, settle: Duration) -> SqlSubscriber {
        SqlSubscriber::new(self.transport.clone(), group, self.topic.clone(), settle)
    }

    fn refused_message(&self) -> Message {
        let mut m = message(&self.topic, "p-1", "too large");
        m.payload = vec![b'x'; SQL_MAX_BYTES * 4];
        m
    }

    async fn unreachable_publisher(&self) -> Option<(KeepAlive, Box<dyn Publisher>)> {
        if self.t.url.starts_with("sqlite:") {
            return None;
        }
        let (proxy, via) = FaultProxy::in_front_of(&self.t.url).await;
        let db = Database::connect(&via, &cut_options())
            .await
            .expect("connect");
        proxy.cut();
        let transport = SqlTransport::new(db, SQL_MAX_BYTES);
        Some((Box::new(proxy), Box::new(transport)))
    }

    async fn unreachable_subscriber(&self, group: &str) -> Option<(KeepAlive, SqlSubscriber)> {
        if self.t.url.starts_with("sqlite:") {
            return None;
        }
        let (proxy, via) = FaultProxy::in_front_of(&self.t.url).await;
        let db = Database::connect(&via, &cut_options())
            .await
            .expect("connect");
        proxy.cut();
        let transport = SqlTransport::new(db, SQL_MAX_BYTES);
        let sub = SqlSubscriber::new(transport, group, self.topic.clone(), Duration::from_secs(5));
        Some((Box::new(proxy), sub))
    }

    async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
        self.transport
            .dead_deliveries(group, 100)
            .await
            .expect("dead deliveries")
            .into_iter()
            .map(|d| DeadLetter {
                id: Some(d.id),
                attempts: d.attempts,
                error: d.last_error.unwrap_or_default(),
            })
            .collect()
    }

    fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
        Box::new(SqlDeadLetters::new(self.t.db.clone()))
    }

    async fn cleanup(&self) {}
}

/// Pool settings for a database behind a proxy that is about to be cut: failures within
/// 1-2 s.
fn cut_options() -> DbOptions {
    DbOptions {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(1),
        store_timeout: Duration::from_secs(2),
        ..DbOptions::default()
    }
}

/// Every case applies to the SQL transport.
macro_rules! sql_cases {
    ($module:ident, $backend:expr) => {
        oncely_testkit::broker_conformance!($module, SqlBroker::new($backend).await, [
            published_message_is_received_with_its_fields_and_gone_after_ack,
            retried_delivery_comes_again_to_its_group_only_after_the_delay_with_attempts_raised,
            delivery_dead_lettered_at_the_attempt_limit_lands_in_the_dead_letters_and_comes_no_more,
            a_republished_copy_with_the_same_message_id_is_delivered_once,
            messages_of_one_partition_key_arrive_in_publish_order,
            a_message_the_broker_refuses_is_a_permanent_failure_and_the_rest_of_its_batch_goes,
            dead_letters_are_listed_paged_and_requeued_to_their_group_only_with_attempts_reset,
            a_group_started_after_one_hundred_events_were_published_receives_each_once,
            two_consumers_of_a_new_group_subscribing_while_events_are_published_receive_each_once,
        ]);
    };
}

sql_cases!(sql_sqlite, TestBackend::Sqlite);
sql_cases!(sql_postgres, TestBackend::Postgres);
sql_cases!(sql_mysql, TestBackend::MySql);

// No network path on SQLite (see the module comment).
oncely_testkit::broker_conformance!(
    sql_postgres_net,
    SqlBroker::new(TestBackend::Postgres).await,
    [
        publishing_to_an_unreachable_broker_is_a_transient_failure,
        subscribing_at_an_unreachable_broker_is_a_transient_failure,
    ]
);
oncely_testkit::broker_conformance!(
    sql_mysql_net,
    SqlBroker::new(TestBackend::MySql).await,
    [
        publishing_to_an_unreachable_broker_is_a_transient_failure,
        subscribing_at_an_unreachable_broker_is_a_transient_failure,
    ]
);

/// `url` with its `host:port` replaced by `proxy`'s.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
fn via(proxy: &FaultProxy, url: &str) -> String {
    let authority = oncely_testkit::url_authority(url).expect("host:port");
    url.replacen(&authority, &proxy.addr().to_string(), 1)
}

/// A [`FaultProxy`] in front of the service at `url`.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
async fn proxy_for(url: &str) -> FaultProxy {
    let target = oncely_testkit::url_authority(url).expect("host:port");
    let target = tokio::net::lookup_host(&target)
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    FaultProxy::start(target).await
}

// --- RabbitMQ --------------------------------------------------------------------------

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    use std::sync::Mutex;
    use std::time::Duration;

    use lapin::options::{BasicGetOptions, ExchangeDeleteOptions};
    use oncely_broker::{
        retry_headers, DeadLetters, Message, Publisher, RabbitMqConfig, RabbitMqDeadLetters,
        RabbitMqDeadLettersConfig, RabbitMqPublisher, RabbitMqSubscriber, RabbitMqSubscriberConfig,
    };
    use oncely_core::MessageId;
    use oncely_testkit::broker_conformance::{message, BrokerUnderTest, DeadLetter};
    use oncely_testkit::{amqp_url, service_reachable};

    use super::{ns, proxy_for, via, KeepAlive};

    pub(super) struct RabbitBroker {
        ns: String,
        publisher: RabbitMqPublisher,
        queues: Mutex<Vec<RabbitMqSubscriberConfig>>,
    }

    impl RabbitBroker {
        pub(super) async fn new() -> Option<Self> {
            if !service_reachable("RabbitMQ", &amqp_url()).await {
                return None;
            }
            let ns = ns();
            let publisher = RabbitMqPublisher::connect(Self::config(&ns, amqp_url()))
                .await
                .expect("RabbitMQ");
            Some(Self {
                ns,
                publisher,
                queues: Mutex::new(Vec::new()),
            })
        }

        fn config(ns: &str, url: String) -> RabbitMqConfig {
            let mut c = RabbitMqConfig::new(url);
            c.exchange = format!("t.{ns}");
            c
        }

        async fn channel() -> (lapin::Connection, lapin::Channel) {
            let conn = lapin::Connection::connect(
                &amqp_url(),
                oncely_broker::amqp_connection_properties(),
            )
            .await
            .expect("connect");
            let ch = conn.create_channel().await.expect("channel");
            (conn, ch)
        }
    }

    fn amqp_str(v: &lapin::types::AMQPValue) -> String {
        match v {
            lapin::types::AMQPValue::LongString(s) => {
                String::from_utf8_lossy(s.as_bytes()).into_owned()
            }
            other => format!("{other:?}"),
        }
    }

    impl BrokerUnderTest for RabbitBroker {
        type Sub = RabbitMqSubscriber;

        fn publisher(&self) -> &dyn Publisher {
            &self.publisher
        }

        fn topic(&self) -> String {
            "orders".to_owned()
        }

        fn subscriber(&self, group: &str, _settle: Duration) -> RabbitMqSubscriber {
            let mut c = RabbitMqSubscriberConfig::new(amqp_url(), group, self.topic());
            c.exchange = format!("t.{}", self.ns);
            c.queue = format!("t.{}.{group}", self.ns);
            c.retry_queue = format!("t.{}.{group}.retry", self.ns);
            c.dead_queue = format!("t.{}.{group}.dead", self.ns);
            c.prefetch = 16;
            self.queues.lock().unwrap().push(c.clone());
            RabbitMqSubscriber::new(c)
        }

        async fn declare_group(&self, group: &str) {
            self.subscriber(group, Duration::ZERO)
                .declare_queues()
                .await
                .expect("declare the group's queues");
        }

        fn refused_message(&self) -> Message {
            // No queue is bound for it: the mandatory message comes back.
            message("orders_nowhere", "p-1", "unroutable")
        }

        async fn unreachable_publisher(&self) -> Option<(KeepAlive, Box<dyn Publisher>)> {
            let proxy = proxy_for(&amqp_url()).await;
            proxy.cut();
            let publisher =
                RabbitMqPublisher::new(Self::config(&self.ns, via(&proxy, &amqp_url())));
            Some((Box::new(proxy), Box::new(publisher)))
        }

        async fn unreachable_subscriber(
            &self,
            group: &str,
        ) -> Option<(KeepAlive, RabbitMqSubscriber)> {
            let proxy = proxy_for(&amqp_url()).await;
            proxy.cut();
            let mut c =
                RabbitMqSubscriberConfig::new(via(&proxy, &amqp_url()), group, self.topic());
            c.exchange = format!("t.{}", self.ns);
            c.queue = format!("t.{}.{group}", self.ns);
            c.retry_queue = format!("t.{}.{group}.retry", self.ns);
            c.dead_queue = format!("t.{}.{group}.dead", self.ns);
            c.connect_timeout = Duration::from_secs(2);
            Some((Box::new(proxy), RabbitMqSubscriber::new(c)))
        }

        async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
            let (conn, ch) = Self::channel().await;
            let queue = format!("t.{}.{group}.dead", self.ns);
            let mut out = Vec::new();
            while let Some(m) = ch
                .basic_get(&queue, BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get")
            {
                let h = m.delivery.properties.headers().clone().unwrap_or_default();
                let get = |k: &str| h.inner().get(k).map(amqp_str);
                out.push(DeadLetter {
                    id: m
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .and_then(|s| MessageId::parse(s.as_str()).ok()),
                    attempts: get(retry_headers::ATTEMPTS)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                    error: get(retry_headers::LAST_ERROR).unwrap_or_default(),
                });
            }
            drop(conn.close(200, "bye").await);
            out
        }

        fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
            let mut c = RabbitMqDeadLettersConfig::new(amqp_url());
            c.queue_prefix = format!("t.{}", self.ns);
            Box::new(RabbitMqDeadLetters::new(c))
        }

        async fn cleanup(&self) {
            let configs = self.queues.lock().unwrap().clone();
            let mut seen = std::collections::BTreeSet::new();
            for c in configs {
                if seen.insert(c.queue.clone()) {
                    RabbitMqSubscriber::new(c)
                        .delete_queues()
                        .await
                        .expect("delete queues");
                }
            }
            let (conn, ch) = Self::channel().await;
            drop(
                ch.exchange_delete(&format!("t.{}", self.ns), ExchangeDeleteOptions::default())
                    .await,
            );
            drop(conn.close(200, "bye").await);
        }
    }

    // RabbitMQ does not de-duplicate by message id (see the module comment).
    oncely_testkit::broker_conformance!(
        cases,
        RabbitBroker::new().await,
        [
            published_message_is_received_with_its_fields_and_gone_after_ack,
            retried_delivery_comes_again_to_its_group_only_after_the_delay_with_attempts_raised,
            delivery_dead_lettered_at_the_attempt_limit_lands_in_the_dead_letters_and_comes_no_more,
            messages_of_one_partition_key_arrive_in_publish_order,
            a_message_the_broker_refuses_is_a_permanent_failure_and_the_rest_of_its_batch_goes,
            dead_letters_are_listed_paged_and_requeued_to_their_group_only_with_attempts_reset,
            a_group_started_after_one_hundred_events_were_published_receives_each_once,
            two_consumers_of_a_new_group_subscribing_while_events_are_published_receive_each_once,
            publishing_to_an_unreachable_broker_is_a_transient_failure,
            subscribing_at_an_unreachable_broker_is_a_transient_failure,
        ]
    );
}

// --- NATS JetStream ----------------------------------------------------------------------

#[cfg(feature = "nats")]
mod nats {
    use std::time::Duration;

    use oncely_broker::{
        retry_headers, DeadLetters, Message, NatsConfig, NatsDeadLetters, NatsDeadLettersConfig,
        NatsPublisher, NatsSubscriber, NatsSubscriberConfig, Publisher,
    };
    use oncely_core::MessageId;
    use oncely_testkit::broker_conformance::{message, BrokerUnderTest, DeadLetter};
    use oncely_testkit::{nats_url, service_reachable};

    use super::{ns, proxy_for, via, KeepAlive};

    pub(super) struct NatsBroker {
        ns: String,
        publisher: NatsPublisher,
    }

    impl NatsBroker {
        pub(super) async fn new() -> Option<Self> {
            if !service_reachable("NATS", &nats_url()).await {
                return None;
            }
            let ns = ns();
            let publisher = NatsPublisher::connect(NatsConfig::new(nats_url()))
                .await
                .expect("NATS");
            publisher
                .ensure_stream(&format!("T{ns}"), &[format!("t{ns}.orders")])
                .await
                .expect("stream");
            Some(Self { ns, publisher })
        }
    }

    impl BrokerUnderTest for NatsBroker {
        type Sub = NatsSubscriber;

        fn publisher(&self) -> &dyn Publisher {
            &self.publisher
        }

        fn topic(&self) -> String {
            format!("t{}.orders", self.ns)
        }

        fn subscriber(&self, group: &str, settle: Duration) -> NatsSubscriber {
            let mut c =
                NatsSubscriberConfig::new(nats_url(), format!("T{}", self.ns), group, self.topic());
            c.ack_wait = settle;
            c.batch = 16;
            c.dlq_prefix = format!("t{}.dlq", self.ns);
            c.dlq_stream = format!("T{}_DLQ", self.ns);
            NatsSubscriber::new(c)
        }

        fn refused_message(&self) -> Message {
            // Outside the stream's subjects: no stream takes it ("no responders").
            message(&format!("t{}.nowhere", self.ns), "p-1", "unroutable")
        }

        async fn unreachable_publisher(&self) -> Option<(KeepAlive, Box<dyn Publisher>)> {
            let proxy = proxy_for(&nats_url()).await;
            let mut config = NatsConfig::new(via(&proxy, &nats_url()));
            config.ack_timeout = Duration::from_secs(2);
            let publisher = NatsPublisher::connect(config)
                .await
                .expect("NATS via proxy");
            proxy.cut();
            Some((Box::new(proxy), Box::new(publisher)))
        }

        async fn unreachable_subscriber(&self, group: &str) -> Option<(KeepAlive, NatsSubscriber)> {
            let proxy = proxy_for(&nats_url()).await;
            proxy.cut();
            let mut c = NatsSubscriberConfig::new(
                via(&proxy, &nats_url()),
                format!("T{}", self.ns),
                group,
                self.topic(),
            );
            c.dlq_prefix = format!("t{}.dlq", self.ns);
            c.dlq_stream = format!("T{}_DLQ", self.ns);
            c.connect_timeout = Duration::from_secs(2);
            Some((Box::new(proxy), NatsSubscriber::new(c)))
        }

        async fn dead_letters(&self, _group: &str) -> Vec<DeadLetter> {
            let js = self.publisher.jetstream();
            let Ok(mut stream) = js.get_stream(format!("T{}_DLQ", self.ns)).await else {
                return Vec::new();
            };
            let last = stream
                .info()
                .await
                .expect("stream info")
                .state
                .last_sequence;
            let mut out = Vec::new();
            for seq in 1..=last {
                let Ok(m) = stream.get_raw_message(seq).await else {
                    continue;
                };
                let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned());
                out.push(DeadLetter {
                    id: get("message-id").and_then(|s| MessageId::parse(&s).ok()),
                    attempts: get(retry_headers::ATTEMPTS)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                    error: get(retry_headers::LAST_ERROR).unwrap_or_default(),
                });
            }
            out
        }

        fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
            let mut c = NatsDeadLettersConfig::new(nats_url());
            c.dlq_prefix = format!("t{}.dlq", self.ns);
            c.dlq_stream = format!("T{}_DLQ", self.ns);
            Box::new(NatsDeadLetters::new(c))
        }

        async fn cleanup(&self) {
            let js = self.publisher.jetstream();
            drop(js.delete_stream(format!("T{}", self.ns)).await);
            drop(js.delete_stream(format!("T{}_DLQ", self.ns)).await);
        }
    }

    oncely_testkit::broker_conformance!(
        cases,
        NatsBroker::new().await,
        [
            published_message_is_received_with_its_fields_and_gone_after_ack,
            retried_delivery_comes_again_to_its_group_only_after_the_delay_with_attempts_raised,
            delivery_dead_lettered_at_the_attempt_limit_lands_in_the_dead_letters_and_comes_no_more,
            a_republished_copy_with_the_same_message_id_is_delivered_once,
            messages_of_one_partition_key_arrive_in_publish_order,
            a_message_the_broker_refuses_is_a_permanent_failure_and_the_rest_of_its_batch_goes,
            dead_letters_are_listed_paged_and_requeued_to_their_group_only_with_attempts_reset,
            a_group_started_after_one_hundred_events_were_published_receives_each_once,
            two_consumers_of_a_new_group_subscribing_while_events_are_published_receive_each_once,
            publishing_to_an_unreachable_broker_is_a_transient_failure,
            subscribing_at_an_unreachable_broker_is_a_transient_failure,
        ]
    );

    /// `NatsStart::At`: a new group declared to start at a time gets the messages stored
    /// from then on, each once, and none stored before it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_new_group_with_a_start_time_receives_the_messages_stored_from_then_on() {
        use oncely_broker::{NatsStart, Subscriber as _};
        use oncely_testkit::broker_conformance::receive_n;
        let Some(broker) = NatsBroker::new().await else {
            return;
        };
        let topic = broker.topic();
        let batch = |tag: &str| -> Vec<Message> {
            (0..10)
                .map(|i| message(&topic, "p-1", &format!("{tag}-{i}")))
                .collect()
        };
        let (before, after) = (batch("before"), batch("after"));
        for r in broker.publisher.publish(&before).await {
            r.expect("published");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let start = std::time::SystemTime::now();
        tokio::time::sleep(Duration::from_millis(300)).await;
        for r in broker.publisher.publish(&after).await {
            r.expect("published");
        }
        let mut c = broker
            .subscriber("from-then", Duration::from_secs(30))
            .config()
            .clone();
        c.start = NatsStart::At(start);
        let sub = NatsSubscriber::new(c);
        sub.subscribe().await.expect("subscribe");
        let got = receive_n(&sub, 20, Duration::from_secs(5)).await;
        let ids: Vec<_> = got
            .iter()
            .map(|d| d.message.as_ref().expect("decodable").id)
            .collect();
        assert_eq!(
            ids,
            after.iter().map(|m| m.id).collect::<Vec<_>>(),
            "from the start time on"
        );
        sub.close().await;
        broker.cleanup().await;
    }
}

// --- Kafka (tansu) ---------------------------------------------------------------------------

#[cfg(feature = "kafka")]
mod kafka {
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

        async fn unreachable_subscriber(
            &self,
            group: &str,
        ) -> Option<(KeepAlive, KafkaSubscriber)> {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .expect("bind")
                .local_addr()
                .expect("address")
                .port();
            let mut c =
                KafkaSubscriberConfig::new(format!("127.0.0.1:{port}"), group, self.topic());
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
}
