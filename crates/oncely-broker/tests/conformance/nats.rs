//! The conformance suite on NATS JetStream: the broker under test (streams of its own per
//! test), its cases, and the start-time case of `NatsStart::At`.

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
