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
#[path = "conformance/rabbitmq.rs"]
mod rabbitmq;

// --- NATS JetStream ----------------------------------------------------------------------

#[cfg(feature = "nats")]
#[path = "conformance/nats.rs"]
mod nats;

// --- Kafka (tansu) ---------------------------------------------------------------------------

#[cfg(feature = "kafka")]
#[path = "conformance/kafka.rs"]
mod kafka;
