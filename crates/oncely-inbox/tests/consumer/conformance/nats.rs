//! The NATS JetStream fixture: streams of its own per test.

use std::time::Duration;

use oncely_broker::{
    retry_headers, DeadLetters, Message, NatsConfig, NatsDeadLetters, NatsDeadLettersConfig,
    NatsPublisher, NatsSubscriber, NatsSubscriberConfig, Publisher,
};
use oncely_core::MessageId;
use oncely_sql::Database;
use oncely_testkit::{nats_url, service_reachable, TestBackend, TestDb};

use super::{ns, test_db, DeadLetter, Fixture};

pub(crate) struct NatsFixture {
    t: TestDb,
    ns: String,
    publisher: NatsPublisher,
}

impl NatsFixture {
    pub(super) async fn new(backend: TestBackend) -> Option<Self> {
        if !service_reachable("NATS", &nats_url()).await {
            return None;
        }
        let t = test_db(backend).await?;
        let ns = ns();
        let publisher = NatsPublisher::connect(NatsConfig::new(nats_url()))
            .await
            .expect("NATS");
        publisher
            .ensure_stream(&format!("T{ns}"), &[format!("t{ns}.orders")])
            .await
            .unwrap();
        Some(Self { t, ns, publisher })
    }
}

impl Fixture for NatsFixture {
    type S = NatsSubscriber;
    fn db(&self) -> &Database {
        &self.t.db
    }
    fn topic(&self) -> String {
        format!("t{}.orders", self.ns)
    }
    fn url(&self) -> &str {
        &self.t.url
    }
    fn subscriber(&self, group: &str, settle: Duration) -> NatsSubscriber {
        let mut c =
            NatsSubscriberConfig::new(nats_url(), format!("T{}", self.ns), group, self.topic());
        c.ack_wait = settle;
        c.batch = 8;
        c.dlq_prefix = format!("t{}.dlq", self.ns);
        c.dlq_stream = format!("T{}_DLQ", self.ns);
        NatsSubscriber::new(c)
    }
    async fn publish(&self, batch: &[Message]) {
        for r in self.publisher.publish(batch).await {
            r.expect("acknowledged");
        }
    }
    async fn publish_copy(&self, m: &Message) -> bool {
        // Past the stream's duplicate window a republished copy is a new stream message:
        // simulated with another Nats-Msg-Id (the message id travels in `message-id`).
        let mut h = async_nats::HeaderMap::new();
        h.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("{}-copy", m.id).as_str(),
        );
        for (k, v) in m.all_headers() {
            h.insert(k.as_str(), v.as_str());
        }
        self.publisher
            .jetstream()
            .publish_with_headers(m.topic.clone(), h, m.payload.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
        true
    }
    async fn publish_undecodable(&self) -> bool {
        self.publisher
            .jetstream()
            .publish(self.topic(), "no id".into())
            .await
            .unwrap()
            .await
            .unwrap();
        true
    }
    async fn dead_letters(&self, _group: &str) -> Vec<DeadLetter> {
        let js = self.publisher.jetstream();
        let Ok(mut stream) = js.get_stream(format!("T{}_DLQ", self.ns)).await else {
            return Vec::new();
        };
        let last = stream.info().await.unwrap().state.last_sequence;
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
