//! The scenario harness: a test database and broker topic with a subscribed consumer
//! ([`Harness`]), the publisher wrappers [`Jittery`] and [`Observed`], and starting and
//! stopping a relay task.

use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{NatsPublisher, Publisher};
use oncely_core::{MessageId, RetryPolicy};
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::{OutboxEvent, OutboxStore};
use oncely_testkit::{Collector, TestBackend, TestBroker as Broker, TestDb, TestTopic};
use tokio_util::sync::CancellationToken;

pub(crate) struct Harness {
    pub(crate) db: TestDb,
    pub(crate) broker: Broker,
    pub(crate) topic: String,
    /// Publisher connected straight to the broker.
    pub(crate) publisher: Arc<dyn Publisher>,
    pub(crate) consumer: Collector,
    pub(crate) stream: Option<String>,
    pub(crate) nats: Option<NatsPublisher>,
}

impl Harness {
    pub(crate) async fn new(backend: TestBackend, broker: Broker) -> Option<Self> {
        let db = TestDb::new(backend).await?;
        db.db.migrate().await.expect("migrate");
        let (broker, topic, publisher, collector, nats) =
            TestTopic::new(broker, &db.db).await?.into_parts();
        let (nats, stream) = nats.map_or((None, None), |(p, s)| (Some(p), Some(s)));
        Some(Self {
            db,
            broker,
            topic,
            publisher,
            consumer: collector,
            stream,
            nats,
        })
    }

    pub(crate) fn store(&self) -> OutboxStore {
        OutboxStore::new(self.db.db.clone())
    }

    pub(crate) fn event(&self, partition: &str, seq: usize) -> OutboxEvent {
        OutboxEvent::new(
            MessageId::new_random(),
            self.topic.clone(),
            partition,
            "test.event",
            format!("{partition}:{seq}").into_bytes(),
        )
        .with_header("correlation-id", format!("c-{partition}-{seq}"))
    }

    /// An event the broker cannot take: too large for the SQL transport (limit 1 KiB here),
    /// unroutable for RabbitMQ (no queue bound), a subject no JetStream stream captures,
    /// larger than the Kafka producer's `message.max.bytes` (64 KiB here).
    pub(crate) fn poison(&self, partition: &str) -> OutboxEvent {
        match self.broker {
            Broker::Kafka => OutboxEvent::new(
                MessageId::new_random(),
                self.topic.clone(),
                partition,
                "test.poison",
                vec![b'x'; 128 * 1024],
            ),
            Broker::Sql => OutboxEvent::new(
                MessageId::new_random(),
                self.topic.clone(),
                partition,
                "test.poison",
                vec![b'x'; 4096],
            ),
            Broker::RabbitMq | Broker::Nats => OutboxEvent::new(
                MessageId::new_random(),
                format!("{}_nowhere", self.topic),
                partition,
                "test.poison",
                b"poison".to_vec(),
            ),
        }
    }

    pub(crate) async fn enqueue(&self, events: &[OutboxEvent]) -> Vec<i64> {
        let mut tx = self.db.db.begin().await.expect("begin");
        let mut ids = Vec::new();
        for e in events {
            ids.push(OutboxStore::enqueue(&mut tx, e).await.expect("enqueue"));
        }
        tx.commit().await.expect("commit");
        ids
    }

    pub(crate) fn relay(
        &self,
        publisher: Arc<dyn Publisher>,
        tweak: impl FnOnce(&mut RelayConfig),
    ) -> Relay {
        let mut config = RelayConfig {
            batch_size: 32,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(50),
            retry: RetryPolicy {
                base: Duration::from_millis(20),
                cap: Duration::from_millis(200),
                max_attempts: 1000,
                ..RetryPolicy::default()
            },
            // Keep published rows, so scenarios can read their state.
            retention: Duration::from_secs(3600),
            ..RelayConfig::default()
        };
        tweak(&mut config);
        Relay::new(self.db.db.clone(), publisher, config)
    }

    pub(crate) async fn finish(self) {
        if let (Some(stream), Some(n)) = (&self.stream, &self.nats) {
            drop(n.jetstream().delete_stream(stream).await);
        }
    }
}

/// Delays every batch by a random 0–15 ms before handing it to the real publisher.
#[derive(Debug)]
pub(crate) struct Jittery(pub(crate) Arc<dyn Publisher>);

impl Publisher for Jittery {
    fn publish<'a>(
        &'a self,
        batch: &'a [oncely_broker::Message],
    ) -> oncely_broker::BoxFuture<'a, Vec<Result<(), oncely_broker::PublishError>>> {
        Box::pin(async move {
            let us = u64::from(uuid::Uuid::new_v4().as_bytes()[0]) * 60;
            tokio::time::sleep(Duration::from_micros(us)).await;
            self.0.publish(batch).await
        })
    }

    fn name(&self) -> &'static str {
        self.0.name()
    }
}

/// Passes every batch to the real publisher and counts the failed results it returns.
#[derive(Debug)]
pub(crate) struct Observed {
    inner: Arc<dyn Publisher>,
    failures: std::sync::atomic::AtomicUsize,
}

impl Observed {
    pub(crate) fn new(inner: Arc<dyn Publisher>) -> Self {
        Self {
            inner,
            failures: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    pub(crate) fn failures(&self) -> usize {
        self.failures.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Publisher for Observed {
    fn publish<'a>(
        &'a self,
        batch: &'a [oncely_broker::Message],
    ) -> oncely_broker::BoxFuture<'a, Vec<Result<(), oncely_broker::PublishError>>> {
        Box::pin(async move {
            let results = self.inner.publish(batch).await;
            let failed = results.iter().filter(|r| r.is_err()).count();
            self.failures
                .fetch_add(failed, std::sync::atomic::Ordering::SeqCst);
            results
        })
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

pub(crate) fn spawn_relay(relay: Relay) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let token = CancellationToken::new();
    let handle = tokio::spawn(relay.run(token.clone()));
    (token, handle)
}

pub(crate) async fn stop(relay: (CancellationToken, tokio::task::JoinHandle<()>)) {
    relay.0.cancel();
    relay.1.await.expect("relay task");
}
