//! The RabbitMQ fixture: an exchange and queues of its own per test.

use std::sync::Mutex;
use std::time::Duration;

use lapin::options::{BasicGetOptions, ExchangeDeleteOptions};
use oncely_broker::{
    retry_headers, DeadLetters, Message, Publisher, RabbitMqConfig, RabbitMqDeadLetters,
    RabbitMqDeadLettersConfig, RabbitMqPublisher, RabbitMqSubscriber, RabbitMqSubscriberConfig,
};
use oncely_core::MessageId;
use oncely_sql::Database;
use oncely_testkit::{amqp_url, service_reachable, TestBackend, TestDb};

use super::{ns, test_db, DeadLetter, Fixture};

pub(crate) struct RabbitFixture {
    t: TestDb,
    ns: String,
    publisher: RabbitMqPublisher,
    queues: Mutex<Vec<RabbitMqSubscriberConfig>>,
}

impl RabbitFixture {
    pub(super) async fn new(backend: TestBackend) -> Option<Self> {
        if !service_reachable("RabbitMQ", &amqp_url()).await {
            return None;
        }
        let t = test_db(backend).await?;
        let ns = ns();
        let mut c = RabbitMqConfig::new(amqp_url());
        c.exchange = format!("t.{ns}");
        let publisher = RabbitMqPublisher::connect(c).await.expect("RabbitMQ");
        Some(Self {
            t,
            ns,
            publisher,
            queues: Mutex::new(Vec::new()),
        })
    }

    async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let conn =
            lapin::Connection::connect(&amqp_url(), oncely_broker::amqp_connection_properties())
                .await
                .unwrap();
        let ch = conn.create_channel().await.unwrap();
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

impl Fixture for RabbitFixture {
    type S = RabbitMqSubscriber;
    fn db(&self) -> &Database {
        &self.t.db
    }
    fn topic(&self) -> String {
        "orders".to_owned()
    }
    fn url(&self) -> &str {
        &self.t.url
    }
    fn subscriber(&self, group: &str, _settle: Duration) -> RabbitMqSubscriber {
        let mut c = RabbitMqSubscriberConfig::new(amqp_url(), group, self.topic());
        c.exchange = format!("t.{}", self.ns);
        c.queue = format!("t.{}.{group}", self.ns);
        c.retry_queue = format!("t.{}.{group}.retry", self.ns);
        c.dead_queue = format!("t.{}.{group}.dead", self.ns);
        c.prefetch = 8;
        self.queues.lock().unwrap().push(c.clone());
        RabbitMqSubscriber::new(c)
    }
    async fn publish(&self, batch: &[Message]) {
        for r in self.publisher.publish(batch).await {
            r.expect("confirmed");
        }
    }
    async fn publish_copy(&self, m: &Message) -> bool {
        self.publish(std::slice::from_ref(m)).await;
        true
    }
    async fn publish_undecodable(&self) -> bool {
        let (conn, ch) = self.channel().await;
        ch.basic_publish(
            &format!("t.{}", self.ns),
            &self.topic(),
            lapin::options::BasicPublishOptions::default(),
            b"no id",
            lapin::BasicProperties::default(),
        )
        .await
        .unwrap();
        drop(conn.close(200, "bye").await);
        true
    }
    async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
        let (conn, ch) = self.channel().await;
        let queue = format!("t.{}.{group}.dead", self.ns);
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(&queue, BasicGetOptions { no_ack: true })
            .await
            .unwrap()
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
                RabbitMqSubscriber::new(c).delete_queues().await.unwrap();
            }
        }
        let (conn, ch) = self.channel().await;
        ch.exchange_delete(&format!("t.{}", self.ns), ExchangeDeleteOptions::default())
            .await
            .unwrap();
        drop(conn.close(200, "bye").await);
    }
}
