//! The conformance suite on RabbitMQ: the broker under test (an exchange and queues of
//! its own per test) and its cases.

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
        let conn =
            lapin::Connection::connect(&amqp_url(), oncely_broker::amqp_connection_properties())
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
        let publisher = RabbitMqPublisher::new(Self::config(&self.ns, via(&proxy, &amqp_url())));
        Some((Box::new(proxy), Box::new(publisher)))
    }

    async fn unreachable_subscriber(&self, group: &str) -> Option<(KeepAlive, RabbitMqSubscriber)> {
        let proxy = proxy_for(&amqp_url()).await;
        proxy.cut();
        let mut c = RabbitMqSubscriberConfig::new(via(&proxy, &amqp_url()), group, self.topic());
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
