//! Outbox + relay conformance, written once and run on every database (SQLite, PostgreSQL,
//! MariaDB / MySQL) × every broker (the SQL transport, RabbitMQ, NATS JetStream, Kafka),
//! against the real servers (Kafka: tansu, a Kafka-API broker), as
//! `<backend>::<broker>::<scenario>` (`oncely_testkit::matrix!`; the combinations that cannot
//! apply are listed there with their reasons). A consumer is subscribed before each run;
//! every scenario checks what it received. The store rules run on every backend
//! (`store::<backend>::…`), the claim-by-delete tests on PostgreSQL (`claim::postgres::…`).
//! (That the order service's created orders each yield one `order.created` is tested in
//! apps/orders.)

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{
    KafkaPublisher, Message, NatsPublisher, Publisher, RabbitMqPublisher, SqlTransport,
};
use oncely_core::{MessageId, RetryBudget, RetryPolicy};
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::{OutboxEvent, OutboxState, OutboxStore, RequeueTarget};
use oncely_testkit::{
    kafka_collector, kafka_config, nats_config, rabbitmq_config, Collector, FaultProxy,
    MatrixBroker, TestBackend, TestBroker as Broker, TestDb, TestTopic, KAFKA_PARTITIONS,
};
use tokio_util::sync::CancellationToken;

struct Harness {
    db: TestDb,
    broker: Broker,
    topic: String,
    /// Publisher connected straight to the broker.
    publisher: Arc<dyn Publisher>,
    consumer: Collector,
    stream: Option<String>,
    nats: Option<NatsPublisher>,
}

impl Harness {
    async fn new(backend: TestBackend, broker: Broker) -> Option<Self> {
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

    fn store(&self) -> OutboxStore {
        OutboxStore::new(self.db.db.clone())
    }

    fn event(&self, partition: &str, seq: usize) -> OutboxEvent {
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
    fn poison(&self, partition: &str) -> OutboxEvent {
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

    async fn enqueue(&self, events: &[OutboxEvent]) -> Vec<i64> {
        let mut tx = self.db.db.begin().await.expect("begin");
        let mut ids = Vec::new();
        for e in events {
            ids.push(OutboxStore::enqueue(&mut tx, e).await.expect("enqueue"));
        }
        tx.commit().await.expect("commit");
        ids
    }

    fn relay(&self, publisher: Arc<dyn Publisher>, tweak: impl FnOnce(&mut RelayConfig)) -> Relay {
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

    async fn finish(self) {
        if let (Some(stream), Some(n)) = (&self.stream, &self.nats) {
            drop(n.jetstream().delete_stream(stream).await);
        }
    }
}

/// Delays every batch by a random 0–15 ms before handing it to the real publisher.
#[derive(Debug)]
struct Jittery(Arc<dyn Publisher>);

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
struct Observed {
    inner: Arc<dyn Publisher>,
    failures: std::sync::atomic::AtomicUsize,
}

impl Observed {
    fn new(inner: Arc<dyn Publisher>) -> Self {
        Self {
            inner,
            failures: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn failures(&self) -> usize {
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

fn spawn_relay(relay: Relay) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let token = CancellationToken::new();
    let handle = tokio::spawn(relay.run(token.clone()));
    (token, handle)
}

async fn stop(relay: (CancellationToken, tokio::task::JoinHandle<()>)) {
    relay.0.cancel();
    relay.1.await.expect("relay task");
}

// ---------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------

/// Three relays, 1,000 events over 50 aggregates written while they run: every event
/// arrives, and each aggregate's events arrive in the order they were committed.
async fn three_relays_keep_each_aggregates_order(mut h: Harness) {
    const AGGREGATES: usize = 50;
    const PER: usize = 20;
    let event = |a: usize, seq: usize| h.event(&format!("agg-{a}"), seq);
    // A backlog first (the first half of every aggregate's events), so the relays start by
    // competing for the same partitions; then four writers add the rest while they run.
    let backlog: Vec<OutboxEvent> = (0..PER / 2)
        .flat_map(|seq| (0..AGGREGATES).map(move |a| (a, seq)))
        .map(|(a, seq)| event(a, seq))
        .collect();
    h.enqueue(&backlog).await;
    // Each relay's broker round trips get a random extra 0–15 ms, so their batches
    // interleave every which way (the brokers are still the real ones).
    let relays: Vec<_> = (0..3)
        .map(|i| {
            let jittery: Arc<dyn Publisher> = Arc::new(Jittery(h.publisher.clone()));
            spawn_relay(h.relay(jittery, |c| {
                c.relay_id = format!("relay-{i}");
                c.batch_size = 16;
            }))
        })
        .collect();
    // Four writers, each owning a disjoint set of aggregates and writing each aggregate's
    // events in sequence (one transaction per event, as a service would).
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let db = h.db.db.clone();
            let events: Vec<OutboxEvent> = (PER / 2..PER)
                .flat_map(|seq| {
                    (0..AGGREGATES)
                        .filter(move |a| a % 4 == w)
                        .map(move |a| (a, seq))
                })
                .map(|(a, seq)| event(a, seq))
                .collect();
            tokio::spawn(async move {
                for e in events {
                    let mut tx = db.begin().await.expect("begin");
                    OutboxStore::enqueue(&mut tx, &e).await.expect("enqueue");
                    tx.commit().await.expect("commit");
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let got = h
        .consumer
        .collect(
            AGGREGATES * PER,
            Duration::from_secs(60),
            Duration::from_secs(1),
        )
        .await;
    for r in relays {
        stop(r).await;
    }
    assert_eq!(got.len(), AGGREGATES * PER, "every event once");
    let mut per: HashMap<String, Vec<usize>> = HashMap::new();
    for d in &got {
        let text = String::from_utf8(d.payload.clone()).unwrap();
        let (agg, seq) = text.split_once(':').unwrap();
        assert_eq!(agg, d.partition_key);
        per.entry(agg.to_owned())
            .or_default()
            .push(seq.parse().unwrap());
    }
    assert_eq!(per.len(), AGGREGATES);
    for (agg, seqs) in per {
        assert_eq!(seqs, (0..PER).collect::<Vec<_>>(), "{agg} out of order");
    }
    h.finish().await;
}

/// A relay that dies after the broker confirmed but before it marked the rows: another
/// relay republishes them, after the lease, with the same message ids. JetStream drops the
/// copies within its duplicate window; the SQL transport while the first copy is queued;
/// RabbitMQ delivers them again, with the same ids, for the consumer's inbox to skip.
async fn relay_killed_after_confirm_republishes_with_same_ids(mut h: Harness) {
    let events: Vec<OutboxEvent> = (0..5).map(|i| h.event(&format!("k-{i}"), 0)).collect();
    let ids = h.enqueue(&events).await;
    let store = h.store();
    // Relay A: claim and publish (confirmed), then "crash" before marking. The lease must
    // outlast that publish: a fresh Kafka producer first connects and obtains its producer
    // id (InitProducerId), which can take longer than the other brokers' round trip.
    let lease = match h.broker {
        Broker::Kafka => Duration::from_secs(3),
        _ => Duration::from_millis(500),
    };
    let claimed = store
        .claim("relay-a", 100, lease, oncely_core::now_ms())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 5);
    let messages: Vec<_> = claimed
        .iter()
        .map(|r| oncely_outbox::to_message(r.event.clone()))
        .collect();
    let results = h.publisher.publish(&messages).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // While A's lease holds, nobody else takes the rows.
    let b = h.relay(h.publisher.clone(), |c| {
        "relay-b".clone_into(&mut c.relay_id);
    });
    assert_eq!(b.run_once().await.unwrap().claimed, 0);
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let report = b.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published), (5, 5));
    for id in &ids {
        assert_eq!(
            store.get(*id).await.unwrap().unwrap().state,
            OutboxState::Published
        );
    }
    let got = h
        .consumer
        .collect(10, Duration::from_secs(5), Duration::from_millis(500))
        .await;
    let expected: HashSet<String> = events.iter().map(|e| e.message_id.to_string()).collect();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for d in &got {
        *counts.entry(d.id.clone()).or_default() += 1;
    }
    assert_eq!(
        counts.keys().cloned().collect::<HashSet<_>>(),
        expected,
        "same ids only"
    );
    // Kafka's idempotent producer de-duplicates its own retries within one producer
    // session only: the second relay's copy is a second record with the same id.
    let copies = match h.broker {
        Broker::RabbitMq | Broker::Kafka => 2,
        Broker::Nats | Broker::Sql => 1,
    };
    assert!(
        counts.values().all(|&c| c == copies),
        "copies per id: {counts:?}"
    );
    if let (Some(stream), Some(n)) = (&h.stream, &h.nats) {
        let mut s = n.jetstream().get_stream(stream).await.unwrap();
        assert_eq!(
            s.info().await.unwrap().state.messages,
            5,
            "JetStream dropped the copies"
        );
    }
    h.finish().await;
}

/// The broker is unreachable (TCP cut) for 6 s while 40 events are enqueued — far longer
/// than the whole backoff schedule of the relay's short configuration (3 attempts, 50 ms
/// doubling to 1 s: all attempts are spent within about 150 ms of waiting). An unavailable
/// broker or a confirmation timeout is not the message's fault: the relay keeps trying, no
/// attempt is counted, nothing goes dead, and every event arrives, in partition order, once
/// the broker is back. (Before the fix every event was dead with `attempts = 3`.)
async fn broker_outage_longer_than_the_backoff_schedule_kills_no_event(mut h: Harness) {
    if h.broker == Broker::Kafka {
        // Kafka clients bootstrap, then connect to the broker's advertised listener, so a
        // proxy in front of the shared broker would not cut them: this run gets its own
        // tansu that advertises the proxy.
        let (proxy, tansu, brokers) = private_tansu().await;
        h.consumer = kafka_collector(&brokers, &h.topic).await;
        let publisher: Arc<dyn Publisher> =
            Arc::new(KafkaPublisher::new(kafka_config(&brokers)).unwrap());
        broker_down_through(h, &proxy, publisher).await;
        drop(tansu);
        return;
    }
    let target = oncely_testkit::url_authority(&match h.broker {
        Broker::RabbitMq => oncely_testkit::amqp_url(),
        _ => oncely_testkit::nats_url(),
    })
    .unwrap();
    let target: std::net::SocketAddr = tokio::net::lookup_host(&target)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(target).await;
    let via = |url: String| {
        let authority = oncely_testkit::url_authority(&url).unwrap();
        url.replacen(&authority, &proxy.addr().to_string(), 1)
    };
    let publisher: Arc<dyn Publisher> = match h.broker {
        Broker::RabbitMq => Arc::new(RabbitMqPublisher::new(rabbitmq_config(&via(
            oncely_testkit::amqp_url(),
        )))),
        _ => Arc::new(
            NatsPublisher::connect(nats_config(&via(oncely_testkit::nats_url())))
                .await
                .unwrap(),
        ),
    };
    broker_down_through(h, &proxy, publisher).await;
}

/// The relay's own database (PostgreSQL or MariaDB, behind a [`FaultProxy`]) is cut for 5 s
/// while the service keeps enqueueing (through its own pool): the relay waits and retries
/// as a whole (claims and settles fail, nothing is counted), and once the database is back
/// every event is published, none dead, none with an attempt on record.
async fn database_outage_under_the_relay_delays_without_counting(mut h: Harness) {
    let (proxy, via) = FaultProxy::in_front_of(&h.db.url).await;
    let options = oncely_sql::DbOptions {
        max_connections: 4,
        acquire_timeout: Duration::from_secs(1),
        ..oncely_sql::DbOptions::default()
    };
    let db = oncely_sql::Database::connect(&via, &options).await.unwrap();
    let mut config = h
        .relay(h.publisher.clone(), |c| {
            c.retry.max_attempts = 3;
            c.outage.cap = Duration::from_millis(500);
        })
        .config()
        .clone();
    config.relay_id = uuid::Uuid::new_v4().to_string();
    let relay = spawn_relay(Relay::new(db, h.publisher.clone(), config));
    let first: Vec<_> = (0..10)
        .map(|i| h.event(&format!("p-{}", i % 3), i))
        .collect();
    h.enqueue(&first).await;
    let mut got = h
        .consumer
        .collect(10, Duration::from_secs(20), Duration::ZERO)
        .await;
    assert_eq!(got.len(), 10);
    proxy.cut();
    let second: Vec<_> = (10..40)
        .map(|i| h.event(&format!("p-{}", i % 3), i))
        .collect();
    let ids = h.enqueue(&second).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.restore();
    got.extend(
        h.consumer
            .collect(30, Duration::from_secs(60), Duration::from_secs(1))
            .await,
    );
    stop(relay).await;
    let ids_got: HashSet<String> = got.iter().map(|d| d.id.clone()).collect();
    for e in first.iter().chain(&second) {
        assert!(
            ids_got.contains(&e.message_id.to_string()),
            "lost {}",
            e.message_id
        );
    }
    let store = h.store();
    for id in ids {
        let row = store.get(id).await.unwrap().unwrap();
        assert_eq!((row.state, row.attempts), (OutboxState::Published, 0));
    }
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 0));
    h.finish().await;
}

/// A tansu broker of its own (`ONCELY_TEST_TANSU`, default `tansu` on the PATH; in-memory
/// storage) listening on a free port and advertising a [`FaultProxy`] in front of it, so
/// every client connection runs through the proxy. Returns the proxy, the process (killed
/// on drop) and the bootstrap address (the proxy's).
async fn private_tansu() -> (FaultProxy, tokio::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let target: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let proxy = FaultProxy::start(target).await;
    let bin = std::env::var("ONCELY_TEST_TANSU").unwrap_or_else(|_| "tansu".to_owned());
    let child = tokio::process::Command::from(oncely_testkit::process::command(&bin))
        .args([
            "broker",
            "--storage-engine",
            "memory://tansu/",
            "--listener-url",
            &format!("tcp://{target}"),
            "--advertised-listener-url",
            &format!("tcp://{}", proxy.addr()),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {bin} (a tansu binary is required): {e}"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(target).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "private tansu did not listen on {target}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let brokers = proxy.addr().to_string();
    (proxy, child, brokers)
}

async fn broker_down_through(mut h: Harness, proxy: &FaultProxy, publisher: Arc<dyn Publisher>) {
    let observed = Arc::new(Observed::new(publisher));
    // A budget for one outage retry: the 6 s outage spends it (on NATS a round lasts as
    // long as the publish's confirmation timeout, so there are only a few), after which
    // the relay probes at the outage cap; the rounds after the broker's return refill it.
    let budget = Arc::new(RetryBudget::new(RetryBudget::RETRY_COST));
    let relay = spawn_relay(h.relay(observed.clone(), |c| {
        c.budget = budget.clone();
        c.retry = RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_secs(1),
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        c.outage.cap = Duration::from_millis(500);
    }));
    let first: Vec<_> = (0..20)
        .map(|i| h.event(&format!("p-{}", i % 5), i))
        .collect();
    h.enqueue(&first).await;
    let mut got = h
        .consumer
        .collect(20, Duration::from_secs(20), Duration::ZERO)
        .await;
    assert_eq!(got.len(), 20);
    proxy.cut();
    let second: Vec<_> = (20..60)
        .map(|i| h.event(&format!("p-{}", i % 5), i))
        .collect();
    let ids = h.enqueue(&second).await;
    let store = h.store();
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        observed.failures() >= 3,
        "the relay tried during the outage ({} failed results)",
        observed.failures()
    );
    for id in &ids {
        let row = store.get(*id).await.unwrap().unwrap();
        assert_eq!(
            (row.state, row.attempts),
            (OutboxState::Pending, 0),
            "an outage is no attempt (last error {:?})",
            row.last_error
        );
    }
    assert_eq!(budget.available(), 0, "the outage rounds spent the budget");
    proxy.restore();
    got.extend(
        h.consumer
            .collect(40, Duration::from_secs(60), Duration::from_secs(1))
            .await,
    );
    stop(relay).await;
    let ids_got: HashSet<String> = got.iter().map(|d| d.id.clone()).collect();
    for e in first.iter().chain(&second) {
        assert!(
            ids_got.contains(&e.message_id.to_string()),
            "lost {}",
            e.message_id
        );
    }
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 0));
    assert!(
        budget.available() >= RetryBudget::RETRY_COST,
        "the rounds after the outage refill the budget ({})",
        budget.available()
    );
    // Per-partition order survives the outage (retries may add copies of the same id).
    let mut per: HashMap<String, Vec<usize>> = HashMap::new();
    for d in &got {
        let text = String::from_utf8(d.payload.clone()).unwrap();
        let seq: usize = text.split_once(':').unwrap().1.parse().unwrap();
        let v = per.entry(d.partition_key.clone()).or_default();
        if !v.contains(&seq) {
            v.push(seq);
        }
    }
    for (p, seqs) in per {
        let mut sorted = seqs.clone();
        sorted.sort_unstable();
        assert_eq!(seqs, sorted, "{p} out of order");
    }
    h.finish().await;
}

/// Regression (sqlite::kafka::broker_outage_longer_than_the_backoff_schedule_kills_no_event was flaky): while
/// the partition leader is unreachable, librdkafka times out the messages queued for it only
/// when that broker's thread wakes up to reconnect, which its reconnect backoff can put off by
/// up to `reconnect.backoff.max.ms` (librdkafka's default 10 s) past `message.timeout.ms`. A
/// publish must still return within [`KafkaConfig::publish_deadline`] (plus scheduling slack),
/// call after call, however long the outage lasts, and deliver again once the broker is back.
async fn kafka_publish_returns_in_time_while_the_broker_is_down() {
    use oncely_broker::{Message, PublishError, TransientError};
    if !oncely_testkit::service_reachable("Kafka", &oncely_testkit::kafka_url()).await {
        return;
    }
    let (proxy, tansu, brokers) = private_tansu().await;
    let topic = format!("t{}", uuid::Uuid::new_v4().simple());
    oncely_broker::ensure_topic(&brokers, &topic, KAFKA_PARTITIONS)
        .await
        .expect("create topic");
    let config = kafka_config(&brokers);
    let publisher = KafkaPublisher::new(config.clone()).unwrap();
    let batch = |n: usize| -> Vec<Message> {
        (0..n)
            .map(|i| Message {
                id: MessageId::new_random(),
                topic: topic.clone(),
                partition_key: format!("p-{i}"),
                event_type: "test.event".to_owned(),
                payload: format!("p-{i}").into_bytes(),
                headers: BTreeMap::new(),
            })
            .collect()
    };
    // Connected, partition leaders known.
    let up = publisher.publish(&batch(3)).await;
    assert!(up.iter().all(Result::is_ok), "{up:?}");
    proxy.cut();
    // librdkafka's reconnect backoff doubles from 100 ms on every failed connection: over
    // these calls (about 4 × 3 s) it would reach its 10 s default ceiling, and without the
    // fix calls 1..3 took 7-10 s. The bound: the publisher's own plus 1 s of scheduling slack
    // on a loaded machine.
    let bound = config.publish_deadline() + Duration::from_secs(1);
    for call in 0..4 {
        let started = tokio::time::Instant::now();
        let results = publisher.publish(&batch(3)).await;
        let took = started.elapsed();
        assert!(
            took <= bound,
            "publish call {call} while down took {took:?} (bound {bound:?})"
        );
        assert_eq!(results.len(), 3);
        for r in &results {
            assert!(
                matches!(r, Err(PublishError::Transient(TransientError::Timeout(_)))),
                "call {call}: {r:?}"
            );
        }
    }
    proxy.restore();
    // Back: deliveries succeed again (a call or two may still fail while the producer
    // reconnects or replaces a fenced session).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let results = publisher.publish(&batch(3)).await;
        if results.iter().all(Result::is_ok) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no delivery after the broker came back: {results:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(tansu);
}

mod publish_kafka {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn returns_in_time_while_the_broker_is_down() {
        super::kafka_publish_returns_in_time_while_the_broker_is_down().await;
    }
}

/// A poison event fails on every attempt, goes `dead` after the limit (attempts and the
/// error recorded, counted in stats), and meanwhile every other event flows — including
/// the one queued behind it in its own partition, once it is dead. Requeue puts it back.
async fn poison_event_goes_dead_while_the_rest_flow(mut h: Harness) {
    let poison = h.poison("shared");
    let follower = h.event("shared", 1);
    let mut events = vec![poison.clone(), follower.clone()];
    events.extend((0..20).map(|i| h.event(&format!("other-{i}"), 0)));
    let ids = h.enqueue(&events).await;
    let relay = spawn_relay(h.relay(h.publisher.clone(), |c| c.retry.max_attempts = 3));
    let got = h
        .consumer
        .collect(21, Duration::from_secs(30), Duration::from_millis(800))
        .await;
    stop(relay).await;
    let got_ids: HashSet<String> = got.iter().map(|d| d.id.clone()).collect();
    assert_eq!(got.len(), 21, "every healthy event once");
    assert!(!got_ids.contains(&poison.message_id.to_string()));
    assert!(got_ids.contains(&follower.message_id.to_string()));
    let store = h.store();
    let row = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.state, OutboxState::Dead);
    // Too large for the SQL transport's and Kafka's limits: dead at its first attempt (it
    // can never fit). Unroutable on RabbitMQ and NATS (a stream or binding may come): dead
    // at the limit.
    let (attempts, error) = match h.broker {
        Broker::Sql | Broker::Kafka => (1, "exceeds the limit"),
        Broker::RabbitMq | Broker::Nats => (3, "no destination"),
    };
    assert_eq!(row.attempts, attempts);
    let last_error = row.last_error.unwrap_or_default();
    assert!(last_error.contains(error), "last error {last_error:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 1));
    let dead = store.dead(0, 10).await.unwrap();
    assert_eq!(dead.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[0]]);
    assert_eq!(
        store
            .requeue_dead(RequeueTarget::All, oncely_core::now_ms())
            .await
            .unwrap(),
        1
    );
    let row = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!((row.state, row.attempts), (OutboxState::Pending, 0));
    h.finish().await;
}

/// Rows whose transaction commits after a higher-numbered row's are still published: the
/// relay claims by state, never by an "id > cursor" scan. PostgreSQL only: SQLite has one
/// writer, so its ids are assigned in commit order and the case cannot arise.
async fn late_committing_rows_are_not_skipped(mut h: Harness) {
    let store = h.store();
    let relay = h.relay(h.publisher.clone(), |_| {});
    let early = [h.event("late", 0), h.event("x", 0)];
    let later = [h.event("b", 0), h.event("x", 1)];
    let mut slow = h.db.db.begin().await.unwrap();
    let mut early_ids = Vec::new();
    for e in &early {
        early_ids.push(OutboxStore::enqueue(&mut slow, e).await.unwrap());
    }
    let later_ids = h.enqueue(&later).await;
    assert!(early_ids.iter().max() < later_ids.iter().min());
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.published, 2, "the committed rows go out");
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.claimed, 0);
    slow.commit().await.unwrap();
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.published, 2, "the late rows are not skipped");
    let got = h
        .consumer
        .collect(4, Duration::from_secs(10), Duration::from_millis(300))
        .await;
    let order: Vec<String> = got.iter().map(|d| d.id.clone()).collect();
    let all: HashSet<String> = early
        .iter()
        .chain(&later)
        .map(|e| e.message_id.to_string())
        .collect();
    assert_eq!(order.iter().cloned().collect::<HashSet<_>>(), all);
    assert_eq!(order.len(), 4);
    // In partition x, commit order was x:1 then x:0; that is the publish order too.
    let pos = |e: &OutboxEvent| order.iter().position(|i| *i == e.message_id.to_string());
    assert!(pos(&later[1]) < pos(&early[1]));
    for id in early_ids.iter().chain(&later_ids) {
        assert_eq!(
            store.get(*id).await.unwrap().unwrap().state,
            OutboxState::Published
        );
    }
    h.finish().await;
}

/// On PostgreSQL a commit wakes the relay through LISTEN/NOTIFY: with polling every 30 s,
/// events still arrive at once.
async fn postgres_notify_wakes_an_idle_relay(mut h: Harness) {
    let relay = spawn_relay(h.relay(h.publisher.clone(), |c| {
        c.poll_interval = Duration::from_secs(30);
    }));
    // Let the relay finish its first (empty) round and go idle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for round in 0..3 {
        let e = h.event("woken", round);
        h.enqueue(std::slice::from_ref(&e)).await;
        let got = h
            .consumer
            .collect(1, Duration::from_secs(5), Duration::ZERO)
            .await;
        assert_eq!(got.len(), 1, "round {round}: the relay was not woken");
        assert_eq!(got[0].id, e.message_id.to_string());
    }
    stop(relay).await;
    h.finish().await;
}

/// One publish call of 300 messages — more than a confirmation window (256), and more than
/// the 30 futures above which `join_all` stops polling in order — reaches the consumer in
/// the call's order, one copy each: the publishers queue a window's messages in order.
async fn a_batch_reaches_the_broker_in_the_order_given(mut h: Harness) {
    let messages: Vec<Message> = (0..300)
        .map(|i| oncely_outbox::to_message(h.event("one-aggregate", i)))
        .collect();
    let results = h.publisher.publish(&messages).await;
    assert_eq!(results.len(), messages.len());
    for (i, r) in results.iter().enumerate() {
        assert!(r.is_ok(), "message {i}: {r:?}");
    }
    let got = h
        .consumer
        .collect(300, Duration::from_secs(30), Duration::from_millis(300))
        .await;
    let seqs: Vec<usize> = got
        .iter()
        .map(|d| {
            let text = String::from_utf8(d.payload.clone()).unwrap();
            text.split_once(':').unwrap().1.parse().unwrap()
        })
        .collect();
    assert_eq!(seqs, (0..300).collect::<Vec<_>>());
    h.finish().await;
}

/// Runs `scenario` on a fresh [`Harness`] for `backend` and the broker `B` (or skips).
async fn run<B: MatrixBroker>(backend: TestBackend, scenario: impl AsyncFnOnce(Harness)) {
    if let Some(h) = Harness::new(backend, B::BROKER).await {
        scenario(h).await;
    }
}

oncely_testkit::matrix! {
    run: run,
    tests: [
        a_batch_reaches_the_broker_in_the_order_given,
        three_relays_keep_each_aggregates_order,
        relay_killed_after_confirm_republishes_with_same_ids,
        broker_outage_longer_than_the_backoff_schedule_kills_no_event,
        poison_event_goes_dead_while_the_rest_flow,
        database_outage_under_the_relay_delays_without_counting,
        late_committing_rows_are_not_skipped,
        postgres_notify_wakes_an_idle_relay,
    ],
    cannot_apply: [
        // The SQL transport's queue is a table in the test database: there is no broker
        // connection to cut (a cut database is `database_outage_…`).
        broker_outage_longer_than_the_backoff_schedule_kills_no_event on (_, sql),
        // SQLite is embedded: there is no connection to the database to cut.
        database_outage_under_the_relay_delays_without_counting on (sqlite, _),
        // SQLite has one writer: ids are assigned in commit order, so no row can commit
        // after a higher-numbered one.
        late_committing_rows_are_not_skipped on (sqlite, _),
        // LISTEN/NOTIFY is PostgreSQL's; relays on SQLite and MySQL poll.
        postgres_notify_wakes_an_idle_relay on (sqlite, _),
        postgres_notify_wakes_an_idle_relay on (mysql, _),
    ],
}

// ---------------------------------------------------------------------------------------
// Store rules, broker-independent
// ---------------------------------------------------------------------------------------

fn plain_event(partition: &str) -> OutboxEvent {
    OutboxEvent::new(
        MessageId::new_random(),
        "store-test",
        partition,
        "test.event",
        b"x".to_vec(),
    )
}

async fn enqueue_all(db: &oncely_sql::Database, events: &[OutboxEvent]) -> Vec<i64> {
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for e in events {
        ids.push(OutboxStore::enqueue(&mut tx, e).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

/// A claim takes only the oldest pending row of each partition, none of a partition with a
/// leased row, and nothing another relay leases; a reschedule records the failure and
/// blocks the partition until the row is available again; a lease that runs out frees it.
async fn claim_takes_partition_heads_and_honours_leases(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let ids = enqueue_all(
        &t.db,
        &[plain_event("a"), plain_event("a"), plain_event("b")],
    )
    .await;
    let lease = Duration::from_secs(60);
    let now = oncely_core::now_ms();
    let r1 = store.claim("r1", 10, lease, now).await.unwrap();
    assert_eq!(
        r1.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[0], ids[2]]
    );
    assert!(store.claim("r2", 10, lease, now).await.unwrap().is_empty());
    // Settling rows r1 does not hold changes nothing.
    assert_eq!(store.mark_published("r2", &[ids[0]], now).await.unwrap(), 0);
    assert_eq!(store.mark_published("r1", &[ids[0]], now).await.unwrap(), 1);
    let r2 = store.claim("r2", 10, lease, now).await.unwrap();
    assert_eq!(r2.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[1]]);
    // A failure: attempts and error recorded, back to pending after the backoff.
    let outcome = store
        .reschedule("r2", ids[1], "broker said no", now + 60_000, 5)
        .await
        .unwrap();
    assert_eq!(outcome, oncely_sql::Rescheduled::Retry);
    let row = store.get(ids[1]).await.unwrap().unwrap();
    assert_eq!(
        (row.attempts, row.last_error.as_deref()),
        (1, Some("broker said no"))
    );
    assert!(
        store.claim("r3", 10, lease, now).await.unwrap().is_empty(),
        "in backoff"
    );
    let later = store.claim("r3", 10, lease, now + 60_000).await.unwrap();
    assert_eq!(later.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[1]]);
    // b's lease (r1) runs out: another relay may take it.
    let expired = store.claim("r4", 10, lease, now + 61_000).await.unwrap();
    assert_eq!(
        expired.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[2]]
    );
    assert_eq!(store.mark_published("r1", &[ids[2]], now).await.unwrap(), 0);
}

/// Stats count pending and dead rows and age the oldest pending one; a dead row can be
/// requeued by id.
async fn stats_and_requeue_by_id(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let ids = enqueue_all(&t.db, &[plain_event("a"), plain_event("b")]).await;
    let now = oncely_core::now_ms();
    let rows = store
        .claim("r", 10, Duration::from_secs(60), now)
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    let dead = store
        .reschedule("r", ids[0], "poison", now, 1)
        .await
        .unwrap();
    assert_eq!(dead, oncely_sql::Rescheduled::Dead);
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (1, 1));
    let age = s.oldest_pending_age_ms(s.oldest_pending_created_at.unwrap() + 1500);
    assert_eq!(age, 1500);
    assert_eq!(
        store
            .requeue_dead(RequeueTarget::Id(ids[1]), now)
            .await
            .unwrap(),
        0,
        "not dead"
    );
    assert_eq!(
        store
            .requeue_dead(RequeueTarget::Id(ids[0]), now)
            .await
            .unwrap(),
        1
    );
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (2, 0));
}

/// Published rows past the retention are deleted in batches of the given size; pending and
/// newer rows stay.
async fn published_rows_are_deleted_after_retention_in_batches(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let events: Vec<_> = (0..5).map(|i| plain_event(&format!("p{i}"))).collect();
    let ids = enqueue_all(&t.db, &events).await;
    let pending = enqueue_all(&t.db, &[plain_event("q")]).await;
    let now = oncely_core::now_ms();
    let claimed = store
        .claim("r", 5, Duration::from_secs(60), now)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 5);
    assert_eq!(
        store.mark_published("r", &ids[..4], 1_000).await.unwrap(),
        4
    );
    assert_eq!(
        store.mark_published("r", &ids[4..], 9_000).await.unwrap(),
        1
    );
    assert_eq!(store.delete_published(5_000, 3).await.unwrap(), 3);
    assert_eq!(store.delete_published(5_000, 3).await.unwrap(), 1);
    assert_eq!(store.delete_published(5_000, 3).await.unwrap(), 0);
    assert!(
        store.get(ids[4]).await.unwrap().is_some(),
        "newer than the cut-off"
    );
    assert!(
        store.get(pending[0]).await.unwrap().is_some(),
        "pending rows stay"
    );
    assert!(store.get(ids[0]).await.unwrap().is_none());
}

/// Settling a claimed batch: a published row is recorded as published (with its time) and
/// its message id cannot be enqueued again while it is kept; a failed row is back, same id,
/// with its attempt and error, blocking its partition until it is available again; a row
/// neither published nor failed is back untouched; a batch dropped unsettled gives its rows
/// back (PostgreSQL: its transaction rolls back when the pool takes the connection back;
/// elsewhere after the lease).
async fn settling_a_batch_records_each_row(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let events = [
        plain_event("a"),
        plain_event("b"),
        plain_event("c"),
        plain_event("a"),
    ];
    let ids = enqueue_all(&t.db, &events).await;
    let now = oncely_core::now_ms();
    let lease = Duration::from_millis(300);
    let batch = store.claim_batch("r", 10, lease, now, &[]).await.unwrap();
    let claimed: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[..3], "the heads of a, b, c in id order");
    let failure = oncely_sql::PublishFailure::new(ids[1], "nack", now + 60_000);
    let settled = batch
        .settle(&[ids[0]], now + 5, &[failure], 5)
        .await
        .unwrap();
    assert_eq!(settled.published, 1);
    assert_eq!(
        settled.failures,
        vec![(ids[1], oncely_sql::Rescheduled::Retry)]
    );

    let published = store.get(ids[0]).await.unwrap().expect("kept");
    assert_eq!(published.state, OutboxState::Published);
    assert_eq!(published.published_at, Some(now + 5));
    assert_eq!(published.event, events[0]);
    let mut tx = t.db.begin().await.unwrap();
    let again = OutboxStore::enqueue(&mut tx, &events[0]).await;
    assert!(again.is_err(), "a published id enqueued again: {again:?}");
    drop(tx);

    let failed = store.get(ids[1]).await.unwrap().expect("back");
    assert_eq!(failed.state, OutboxState::Pending);
    assert_eq!(failed.attempts, 1);
    assert_eq!(failed.last_error.as_deref(), Some("nack"));
    assert_eq!(failed.available_at, now + 60_000);
    assert_eq!(failed.event, events[1]);
    let untouched = store.get(ids[2]).await.unwrap().expect("back");
    assert_eq!(
        (untouched.state, untouched.attempts),
        (OutboxState::Pending, 0)
    );
    assert_eq!(untouched.event, events[2]);

    // SQLite and MySQL leased the rows; let the leases of the released ones run out.
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let now = oncely_core::now_ms();
    let batch = store.claim_batch("r", 10, lease, now, &[]).await.unwrap();
    let claimed: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    assert_eq!(
        claimed,
        vec![ids[2], ids[3]],
        "b is in backoff; a's second event is its head now"
    );
    drop(batch);
    if matches!(t.db, oncely_sql::Database::Postgres(_)) {
        // The rollback runs when the pool takes the connection back, a moment later.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let batch = store.claim_batch("r", 10, lease, now, &[]).await.unwrap();
            if batch.rows().len() == 2 {
                break;
            }
            drop(batch);
            assert!(
                std::time::Instant::now() < deadline,
                "an unsettled batch gives its rows back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Without retention, a published row is not kept: PostgreSQL forgets it when the batch is
/// settled; SQLite and MySQL mark it and the next cleanup deletes it.
async fn without_retention_published_rows_are_not_kept(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone()).keep_published(false);
    let ids = enqueue_all(&t.db, &[plain_event("a"), plain_event("b")]).await;
    let now = oncely_core::now_ms();
    let batch = store
        .claim_batch("r", 10, Duration::from_secs(60), now, &[])
        .await
        .unwrap();
    let settled = batch.settle(&ids, now, &[], 5).await.unwrap();
    assert_eq!(settled.published, 2);
    store.delete_published(now + 1, 500).await.unwrap();
    for id in ids {
        assert!(store.get(id).await.unwrap().is_none());
    }
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

/// The store rules on every backend, as `store::<backend>::<test>`.
mod store {
    use super::{
        claim_takes_partition_heads_and_honours_leases,
        published_rows_are_deleted_after_retention_in_batches, settling_a_batch_records_each_row,
        stats_and_requeue_by_id, without_retention_published_rows_are_not_kept,
    };

    oncely_testkit::matrix! {
        tests: [
            settling_a_batch_records_each_row,
            without_retention_published_rows_are_not_kept,
            claim_takes_partition_heads_and_honours_leases,
            stats_and_requeue_by_id,
            published_rows_are_deleted_after_retention_in_batches,
        ],
    }
}

// ---------------------------------------------------------------------------------------
// PostgreSQL claim-by-delete (`claim_batch` holding its transaction across the publish,
// `settle`, the relay's concurrent `drain_woken`): concurrency and fault tests against the
// real server. Each test says whether it is expected to FAIL (it demonstrates a bug) or to
// PASS (a regression test).
// ---------------------------------------------------------------------------------------

/// A recording publisher for the claim tests: keeps, per partition key, the payloads it
/// confirmed in confirmation order; fails each message with probability `fail_pct`%;
/// panics on a whole call with probability `panic_pct`% (the relay task dies with its
/// batch, which is dropped unsettled); and notes every moment two messages of one
/// partition were being published at once (across all relays sharing the recorder).
#[derive(Debug, Default)]
struct Recorder {
    fail_pct: u32,
    panic_pct: u32,
    /// Upper bound of a random delay per call, microseconds.
    max_delay_us: u64,
    /// Panic on the first call only.
    panic_once: std::sync::atomic::AtomicBool,
    state: std::sync::Mutex<RecorderState>,
}

#[derive(Debug, Default)]
struct RecorderState {
    in_flight: HashMap<String, usize>,
    /// "partition: payload overlapped payload" descriptions.
    overlaps: Vec<String>,
    /// What is being published now, per partition (for the overlap descriptions).
    current: HashMap<String, Vec<String>>,
    /// Confirmed payloads per partition, in confirmation order.
    confirmed: HashMap<String, Vec<String>>,
    /// All confirmed payloads, in confirmation order.
    global: Vec<String>,
    calls: usize,
}

impl Recorder {
    fn new(fail_pct: u32, panic_pct: u32, max_delay_us: u64) -> Self {
        Self {
            fail_pct,
            panic_pct,
            max_delay_us,
            panic_once: std::sync::atomic::AtomicBool::new(false),
            state: std::sync::Mutex::default(),
        }
    }

    /// A recorder whose first call panics.
    fn panicking_once(max_delay_us: u64) -> Self {
        let r = Self::new(0, 0, max_delay_us);
        r.panic_once
            .store(true, std::sync::atomic::Ordering::SeqCst);
        r
    }

    fn state(&self) -> std::sync::MutexGuard<'_, RecorderState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Distinct confirmed payloads.
    fn confirmed_distinct(&self) -> usize {
        self.state()
            .confirmed
            .values()
            .map(|v| v.iter().collect::<HashSet<_>>().len())
            .sum()
    }

    fn confirmed(&self) -> HashMap<String, Vec<String>> {
        self.state().confirmed.clone()
    }

    fn overlaps(&self) -> Vec<String> {
        self.state().overlaps.clone()
    }
}

/// Takes the batch's partitions out of the in-flight set when the publish ends (also when
/// its future is dropped).
struct InFlight<'a> {
    recorder: &'a Recorder,
    batch: &'a [Message],
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut s = self.recorder.state();
        for m in self.batch {
            let payload = String::from_utf8_lossy(&m.payload).into_owned();
            if let Some(n) = s.in_flight.get_mut(&m.partition_key) {
                *n = n.saturating_sub(1);
            }
            if let Some(cur) = s.current.get_mut(&m.partition_key) {
                if let Some(i) = cur.iter().position(|p| *p == payload) {
                    cur.remove(i);
                }
            }
        }
    }
}

impl Publisher for Recorder {
    fn publish<'a>(
        &'a self,
        batch: &'a [Message],
    ) -> oncely_broker::BoxFuture<'a, Vec<Result<(), oncely_broker::PublishError>>> {
        Box::pin(async move {
            assert!(
                !self
                    .panic_once
                    .swap(false, std::sync::atomic::Ordering::SeqCst),
                "injected publisher panic (once)"
            );
            assert!(
                self.panic_pct == 0 || rand::random::<u32>() % 100 >= self.panic_pct,
                "injected publisher panic"
            );
            {
                let mut s = self.state();
                s.calls += 1;
                for m in batch {
                    let payload = String::from_utf8_lossy(&m.payload).into_owned();
                    let n = s.in_flight.entry(m.partition_key.clone()).or_default();
                    *n += 1;
                    if *n > 1 {
                        let others = s.current.get(&m.partition_key).cloned().unwrap_or_default();
                        s.overlaps
                            .push(format!("{}: {payload} while {others:?}", m.partition_key));
                    }
                    s.current
                        .entry(m.partition_key.clone())
                        .or_default()
                        .push(payload);
                }
            }
            let guard = InFlight {
                recorder: self,
                batch,
            };
            if self.max_delay_us > 0 {
                let us = rand::random::<u64>() % self.max_delay_us;
                tokio::time::sleep(Duration::from_micros(us)).await;
            }
            let mut results = Vec::with_capacity(batch.len());
            {
                let mut s = self.state();
                for m in batch {
                    if self.fail_pct > 0 && rand::random::<u32>() % 100 < self.fail_pct {
                        results.push(Err(oncely_broker::PublishError::rejected(
                            "injected failure",
                        )));
                    } else {
                        let payload = String::from_utf8_lossy(&m.payload).into_owned();
                        s.global.push(payload.clone());
                        s.confirmed
                            .entry(m.partition_key.clone())
                            .or_default()
                            .push(payload);
                        results.push(Ok(()));
                    }
                }
            }
            drop(guard);
            results
        })
    }

    fn name(&self) -> &'static str {
        "recorder"
    }
}

/// An event of partition `partition` whose payload is `partition:seq`.
fn seq_event(partition: &str, seq: usize) -> OutboxEvent {
    OutboxEvent::new(
        MessageId::new_random(),
        "claim-test",
        partition,
        "test.event",
        format!("{partition}:{seq}").into_bytes(),
    )
}

/// A relay configuration for the claim tests: small batches, fast retries.
fn claim_test_config(i: usize, keep: bool) -> RelayConfig {
    RelayConfig {
        relay_id: format!("relay-{i}"),
        batch_size: 8,
        max_in_flight_batches: 4,
        poll_interval: Duration::from_millis(20),
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(20),
            max_attempts: 10_000,
            ..RetryPolicy::default()
        },
        retention: if keep {
            Duration::from_secs(3600)
        } else {
            Duration::ZERO
        },
        // Vacuums run while other relays claim and settle.
        vacuum_after_rows: 300,
        ..RelayConfig::default()
    }
}

/// How a stress run writes and relays.
#[derive(Debug, Clone, Copy)]
struct Stress {
    partitions: usize,
    per: usize,
    relays: usize,
    fail_pct: u32,
    panic_pct: u32,
    /// Every fifth event of a partition is written by a transaction that commits after
    /// the partition's next event committed (a lower id committing late).
    late: bool,
    keep: bool,
}

/// What a stress run saw.
struct StressOutcome {
    recorder: Arc<Recorder>,
    /// Per partition, the sequence numbers that were written late (committed after their
    /// successor).
    late: HashMap<String, HashSet<usize>>,
    pending_left: u64,
}

/// Runs `s.relays` relays (`Relay::run`, each with its own pool, as separate processes
/// would) against one PostgreSQL outbox while four writers add `s.partitions × s.per`
/// events, until every event was confirmed once or 60 s passed; then [`check_stress`].
///
/// One stress run at a time, each relay with a pool of 6 (its LISTEN connection, four
/// batches in flight, one for its loops): two runs at once with default pools of 16 drove
/// the suite's PostgreSQL connections to 98 of the server's 100.
async fn stress(t: &TestDb, s: Stress) {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    t.db.migrate().await.unwrap();
    let recorder = Arc::new(Recorder::new(s.fail_pct, s.panic_pct, 3_000));
    let mut relays = Vec::new();
    for i in 0..s.relays {
        let options = oncely_sql::DbOptions {
            max_connections: 6,
            ..oncely_sql::DbOptions::default()
        };
        let db = oncely_sql::Database::connect(&t.url, &options)
            .await
            .unwrap();
        let publisher: Arc<dyn Publisher> = recorder.clone();
        relays.push(spawn_relay(Relay::new(
            db,
            publisher,
            claim_test_config(i, s.keep),
        )));
    }
    let late: Arc<std::sync::Mutex<HashMap<String, HashSet<usize>>>> = Arc::default();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let db = t.db.clone();
            let late = late.clone();
            tokio::spawn(async move {
                let mine: Vec<String> = (0..s.partitions)
                    .filter(|p| p % 4 == w)
                    .map(|p| format!("p{p}"))
                    .collect();
                let mut seq = 0;
                while seq < s.per {
                    for p in &mine {
                        if s.late && seq % 5 == 2 && seq + 1 < s.per {
                            // seq gets the lower id, but seq + 1 commits first.
                            let mut slow = db.begin().await.unwrap();
                            OutboxStore::enqueue(&mut slow, &seq_event(p, seq))
                                .await
                                .unwrap();
                            enqueue_all(&db, &[seq_event(p, seq + 1)]).await;
                            tokio::time::sleep(Duration::from_millis(
                                u64::from(rand::random::<u8>() % 15) + 1,
                            ))
                            .await;
                            slow.commit().await.unwrap();
                            late.lock()
                                .unwrap()
                                .entry(p.clone())
                                .or_default()
                                .insert(seq);
                        } else if !(s.late && seq % 5 == 3) {
                            enqueue_all(&db, &[seq_event(p, seq)]).await;
                        }
                    }
                    seq += 1;
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let total = s.partitions * s.per;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while recorder.confirmed_distinct() < total && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let anything still in flight (a copy) come out.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for r in relays {
        stop(r).await;
    }
    let pending_left = OutboxStore::new(t.db.clone())
        .stats()
        .await
        .unwrap()
        .pending;
    let late = late.lock().unwrap().clone();
    check_stress(
        s,
        &StressOutcome {
            recorder,
            late,
            pending_left,
        },
    );
}

/// Checks a stress run: every event confirmed exactly once, each partition in sequence
/// order (a late-committed event may follow its successor, nothing else may move), and
/// never two events of one partition being published at once.
fn check_stress(s: Stress, o: &StressOutcome) {
    let confirmed = o.recorder.confirmed();
    let mut problems = Vec::new();
    for p in 0..s.partitions {
        let key = format!("p{p}");
        let got: Vec<usize> = confirmed
            .get(&key)
            .map(|v| {
                v.iter()
                    .map(|x| x.split_once(':').unwrap().1.parse().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        let late = o.late.get(&key).cloned().unwrap_or_default();
        let expected: Vec<usize> = (0..s.per).collect();
        let mut alt = expected.clone();
        for l in &late {
            alt.swap(*l, *l + 1);
        }
        // Each late pair may come in either order.
        let ok = {
            let mut pos = HashMap::new();
            for (i, v) in got.iter().enumerate() {
                pos.insert(*v, i);
            }
            got.len() == s.per
                && pos.len() == s.per
                && (0..s.per).all(|a| {
                    (a + 1..s.per).all(|b| {
                        let pair = b == a + 1 && late.contains(&a);
                        pair || pos.get(&a) < pos.get(&b)
                    })
                })
        };
        if !ok {
            problems.push(format!(
                "{key}: confirmed {got:?}, expected {expected:?} (late pairs may swap: {alt:?})"
            ));
        }
    }
    assert!(
        problems.is_empty() && o.pending_left == 0,
        "{} of {} partitions wrong, {} rows still pending:\n{}",
        problems.len(),
        s.partitions,
        o.pending_left,
        problems.join("\n")
    );
    let overlaps = o.recorder.overlaps();
    assert!(
        overlaps.is_empty(),
        "{} times two events of one partition were published at once, e.g. {:?}",
        overlaps.len(),
        &overlaps[..overlaps.len().min(10)]
    );
}

/// Six relays (`Relay::run`, own pools) drain one outbox of 40
/// partitions while four writers add 1,000 events; a fifth of the publishes fail at random
/// (failed rows are re-inserted and then claimed by whichever relay comes next). Every
/// event is confirmed exactly once, each partition in id order, and no two events of one
/// partition are ever being published at the same time.
async fn claim_relays_with_flaky_publishes_lose_nothing_and_keep_order(t: TestDb) {
    let s = Stress {
        partitions: 40,
        per: 25,
        relays: 6,
        fail_pct: 20,
        panic_pct: 0,
        late: false,
        keep: true,
    };
    stress(&t, s).await;
}

/// As above without retention (published rows are forgotten at
/// settle) and with one publish call in ten panicking: the relay task dies with its batch,
/// which is dropped unsettled and rolls back; the rows must come back and be published.
async fn claim_relays_whose_publishes_panic_lose_nothing(t: TestDb) {
    let s = Stress {
        partitions: 30,
        per: 20,
        relays: 4,
        fail_pct: 10,
        panic_pct: 10,
        late: false,
        keep: false,
    };
    stress(&t, s).await;
}

/// `claim_batch_late_head_waits_for_its_partitions_row_in_flight` at scale (it used to
/// fail on overlaps, the loss and order checks passing). Late commits interleaved with draining: every fifth event of each partition is written
/// by a transaction that commits after the next event of the partition has committed (and
/// may already be in flight). Nothing may be lost, and at most one event per partition may
/// be in flight across all relays.
async fn claim_relays_with_late_commits_keep_one_event_per_partition_in_flight(t: TestDb) {
    let s = Stress {
        partitions: 40,
        per: 25,
        relays: 6,
        fail_pct: 20,
        panic_pct: 0,
        late: true,
        keep: true,
    };
    stress(&t, s).await;
}

/// A row whose transaction commits late — after a higher-numbered row of its partition
/// was committed and claimed — must wait until that row is settled: at most one event per
/// partition in flight across all relays (the rule `OutboxStore::claim` enforces with its
/// lease check, see the lease variant below). Row locks show only on the row a claim tries
/// to lock, so before the partition lock `claim_batch` handed the late head to a second
/// relay while the first was still publishing the partition's next row.
async fn claim_batch_late_head_waits_for_its_partitions_row_in_flight(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let lease = Duration::from_secs(60);
    let mut slow = t.db.begin().await.unwrap();
    let early = OutboxStore::enqueue(&mut slow, &plain_event("p"))
        .await
        .unwrap();
    let later = enqueue_all(&t.db, &[plain_event("p")]).await[0];
    assert!(early < later);
    let first = store
        .claim_batch("r1", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(
        first.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![later]
    );
    slow.commit().await.unwrap();
    let second = store
        .claim_batch("r2", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    let second_ids: Vec<i64> = second.rows().iter().map(|r| r.id).collect();
    assert!(
        second_ids.is_empty(),
        "partition p has row {later} in flight (relay r1), yet relay r2 claimed {second_ids:?} \
         of the same partition"
    );
    drop(second);
    drop(first);
}

/// The rule the test above expects of `claim_batch`, as the lease-based `claim` keeps it:
/// a late head waits while a higher row of its partition is leased.
async fn lease_claim_late_head_waits_for_its_partitions_leased_row(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let lease = Duration::from_secs(60);
    let mut slow = t.db.begin().await.unwrap();
    OutboxStore::enqueue(&mut slow, &plain_event("p"))
        .await
        .unwrap();
    let later = enqueue_all(&t.db, &[plain_event("p")]).await[0];
    let now = oncely_core::now_ms();
    let first = store.claim("r1", 10, lease, now).await.unwrap();
    assert_eq!(first.iter().map(|r| r.id).collect::<Vec<_>>(), vec![later]);
    slow.commit().await.unwrap();
    assert!(store.claim("r2", 10, lease, now).await.unwrap().is_empty());
    // claim_batch honours the lease too.
    let b = store.claim_batch("r3", 10, lease, now, &[]).await.unwrap();
    assert!(b.is_empty(), "{:?}", b.rows());
}

/// A writer enqueues an event whose original is being published right now (a retried
/// business transaction, say). Its INSERT waits on the unique index for the relay's
/// transaction; when that commits, the `NOT EXISTS (… oncely_outbox_published …)` guard
/// was already evaluated on the older snapshot, so the copy goes in — which the
/// documentation allows ("such a copy goes out with the same message id"). But with
/// retention on, settling the copy then inserts its message id into
/// `oncely_outbox_published` a second time: before `ON CONFLICT DO NOTHING`,
/// UNIQUE(message_id) failed the whole settle, the batch rolled back, and the relay
/// republished the copy *and every batch mate* forever (thousands of times a second).
async fn claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let original = plain_event("dup");
    enqueue_all(&t.db, std::slice::from_ref(&original)).await;
    let batch = store
        .claim_batch("r", 10, Duration::from_secs(60), oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(batch.rows().len(), 1);
    let db = t.db.clone();
    let copy = original.clone();
    let writer = tokio::spawn(async move {
        let mut tx = db.begin().await.unwrap();
        let r = OutboxStore::enqueue(&mut tx, &copy).await;
        if r.is_ok() {
            tx.commit().await.unwrap();
        }
        r.map_err(|e| e.to_string())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ids: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    batch
        .settle(&ids, oncely_core::now_ms(), &[], 5)
        .await
        .unwrap();
    let enqueued = writer.await.unwrap();
    eprintln!("enqueue of the copy while the original was being published: {enqueued:?}");
    if enqueued.is_err() {
        // The guard held: nothing more to check.
        return;
    }
    // The copy plus an unrelated event of another partition, relayed with retention.
    let mate = seq_event("mate", 0);
    enqueue_all(&t.db, std::slice::from_ref(&mate)).await;
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = spawn_relay(Relay::new(
        t.db.clone(),
        publisher,
        claim_test_config(0, true),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop(relay).await;
    let mate_copies = recorder
        .confirmed()
        .get("mate")
        .map_or(0, std::vec::Vec::len);
    let pending = store.stats().await.unwrap().pending;
    // Show the settle error itself.
    let batch = store
        .claim_batch(
            "probe",
            10,
            Duration::from_secs(60),
            oncely_core::now_ms(),
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    let settle = batch.settle(&ids, oncely_core::now_ms(), &[], 5).await;
    assert!(
        mate_copies == 1 && pending == 0,
        "in 2 s the relay published the batch mate {mate_copies} times and {pending} rows are \
         still pending; settling the batch again gives {settle:?}"
    );
}

/// A race, hence 200 rounds (which made it fail reliably before the fix). `Relay::drain` "publishes until nothing is claimable" (`oncely-bench relay` relies on it,
/// checking `published == n` after one drain, though its events all have partitions of
/// their own and so do not meet this). With several events per partition, the relay's next
/// claim runs while the previous batch settles; when that claim comes back empty (its
/// snapshot still had the partition heads in flight) after the settle was reported, the
/// drain saw nothing in flight and returned with the partitions' next events unpublished.
async fn claim_one_drain_publishes_every_claimable_row(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = Relay::new(
        t.db.clone(),
        publisher,
        RelayConfig {
            batch_size: 64,
            ..claim_test_config(0, false)
        },
    );
    for round in 0..200 {
        let events: Vec<OutboxEvent> = (0..5)
            .flat_map(|seq| (0..8).map(move |p| seq_event(&format!("r{round}p{p}"), seq)))
            .collect();
        enqueue_all(&t.db, &events).await;
        let r = relay.drain(&CancellationToken::new()).await.unwrap();
        let pending = store.stats().await.unwrap().pending;
        assert_eq!(
            pending, 0,
            "round {round}: drain returned {r:?} with {pending} of 40 rows still pending"
        );
    }
}

/// Advisory locks are one namespace per database: a relay holding partition `p` of the
/// outbox in one schema must not hold up partition `p` of an outbox in another schema
/// (another service, another test). It did while the lock key was the partition key alone.
async fn claim_partition_locks_of_another_schemas_outbox_do_not_block(t: TestDb) {
    t.db.migrate().await.unwrap();
    let other = TestDb::new(TestBackend::Postgres).await.unwrap();
    other.db.migrate().await.unwrap();
    let lease = Duration::from_secs(60);
    enqueue_all(&other.db, &[plain_event("p")]).await;
    let held = OutboxStore::new(other.db.clone())
        .claim_batch("other", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(held.rows().len(), 1);
    let id = enqueue_all(&t.db, &[plain_event("p")]).await[0];
    let store = OutboxStore::new(t.db.clone());
    let mine = store
        .claim_batch("mine", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(
        mine.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![id],
        "partition p of this outbox waited for partition p of another schema's outbox"
    );
    // The lease-based claim honours the partition locks too.
    mine.settle(&[], 0, &[], 10).await.unwrap();
    let leased = store
        .claim("mine", 10, lease, oncely_core::now_ms())
        .await
        .unwrap();
    assert_eq!(leased.iter().map(|r| r.id).collect::<Vec<_>>(), vec![id]);
    drop(held);
}

/// Manual vacuums of `oncely_outbox` (`pg_stat_user_tables.vacuum_count`; autovacuum
/// counts apart) since the table was created.
async fn outbox_vacuums(db: &oncely_sql::Database) -> i64 {
    let oncely_sql::Database::Postgres(p) = db else {
        panic!("PostgreSQL only");
    };
    sqlx::query_scalar(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'oncely_outbox'::regclass",
    )
    .fetch_one(p.pool())
    .await
    .unwrap()
}

/// A relay vacuums the outbox after every `vacuum_after_rows` rows it claimed, in the
/// background while it goes on claiming, and never with 0. Dead entries then stop
/// accumulating in front of the claims.
async fn claim_relay_vacuums_the_outbox_every_vacuum_after_rows(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let publisher: Arc<dyn Publisher> = Arc::new(Recorder::new(0, 0, 0));
    let relay = |vacuum_after_rows| {
        Relay::new(
            t.db.clone(),
            publisher.clone(),
            RelayConfig {
                batch_size: 50,
                vacuum_after_rows,
                ..claim_test_config(0, false)
            },
        )
    };
    let events = |round: usize| -> Vec<OutboxEvent> {
        (0..1000)
            .map(|p| seq_event(&format!("r{round}p{p}"), 0))
            .collect()
    };
    // Never with 0, however many rows it claims.
    enqueue_all(&t.db, &events(0)).await;
    let r = relay(0).drain(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.published, 1000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        outbox_vacuums(&t.db).await,
        0,
        "vacuum_after_rows 0 vacuumed"
    );
    // After 400 claimed rows: 1,000 rows make two vacuums (one at a time, so one may be
    // skipped while the first still runs: at least one).
    enqueue_all(&t.db, &events(1)).await;
    let r = relay(400).drain(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.published, 1000);
    assert_eq!(store.stats().await.unwrap().pending, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut vacuums = outbox_vacuums(&t.db).await;
    while vacuums == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        vacuums = outbox_vacuums(&t.db).await;
    }
    assert!(
        (1..=2).contains(&vacuums),
        "{vacuums} vacuums after 1,000 claimed rows, one due every 400"
    );
}

/// Advisory locks held right now, by any session, on the partition locks of this schema's
/// outbox for partition keys `{prefix}0` … `{prefix}{n - 1}` (the key
/// `oncely_sql`'s claim takes: a 64-bit hash of the partition key seeded with the table's
/// OID, shown by `pg_locks` as two 32-bit halves).
async fn partition_locks_held(pool: &sqlx::PgPool, prefix: &str, n: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN (SELECT hashtextextended($1 || g, \
         'oncely_outbox'::regclass::oid::bigint # 1869505381) AS k \
         FROM generate_series(0, $2 - 1) g) x \
         ON l.classid = ((x.k >> 32) & 4294967295)::oid \
         AND l.objid = (x.k & 4294967295)::oid AND l.objsubid = 1 \
         WHERE l.locktype = 'advisory'",
    )
    .bind(prefix)
    .bind(n)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Samples [`partition_locks_held`] every 2 ms until `stop` is cancelled; returns the most
/// seen at once.
fn sample_partition_locks(
    pool: sqlx::PgPool,
    prefix: &'static str,
    n: i64,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut most = 0;
        while !stop.is_cancelled() {
            most = most.max(partition_locks_held(&pool, prefix, n).await);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        most
    })
}

/// Bulk-inserts `rows` pending events over `partitions` partition keys `{prefix}0…` in one
/// statement, as a burst of writers would: payload `partition:seq` (the form of
/// [`seq_event`]), seq counting up within each partition in id order.
async fn bulk_enqueue(pool: &sqlx::PgPool, prefix: &str, rows: i64, partitions: i64) {
    sqlx::query(
        "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, payload, \
         headers, created_at, available_at) \
         SELECT gen_random_uuid()::text, 'claim-test', $1 || (g % $3), 'test.event', \
         convert_to($1 || (g % $3) || ':' || (g / $3), 'UTF8'), '{}', $4, $4 \
         FROM generate_series(0, $2 - 1) g ORDER BY g",
    )
    .bind(prefix)
    .bind(rows)
    .bind(partitions)
    .bind(oncely_core::now_ms())
    .execute(pool)
    .await
    .unwrap();
}

/// An outbox that PostgreSQL believes is empty (`VACUUM ANALYZE` ran while it was, as the
/// relay's own vacuum or autovacuum does after a quiet period) and whose relays already
/// claimed against it, so their cached plans were made for an empty table; then a burst of
/// 30,000 rows over 6,000 partitions. The relay drains it in order, and no session ever
/// holds more partition locks than the relay's batches in flight (`batch_size ×
/// max_in_flight_batches`), read from `pg_locks` throughout. With the lock tried in the
/// claim's `WHERE` over the table, a plan made for the empty table seq-scanned the outbox
/// and locked every pending row's partition (6,000 here; 20,000 exhausted the server's lock
/// table): issue 14, item 1.
async fn claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight(t: TestDb) {
    claim_backlog_believed_empty(t, false).await;
}

/// As [`claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight`], with
/// relays that claim by lease ([`OutboxStore::claim`], the statement SQLite and MySQL relays
/// share in shape): each claim locks at most its own batch's partitions.
async fn lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch(t: TestDb) {
    claim_backlog_believed_empty(t, true).await;
}

async fn claim_backlog_believed_empty(t: TestDb, lease: bool) {
    const ROWS: i64 = 30_000;
    const PARTITIONS: i64 = 6_000;
    const PREFIX: &str = "bp";
    t.db.migrate().await.unwrap();
    let pool = t.db.as_postgres().expect("postgres").clone();
    let store = OutboxStore::new(t.db.clone());
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let config = RelayConfig {
        batch_size: 64,
        max_in_flight_batches: 4,
        vacuum_after_rows: 0,
        ..claim_test_config(0, false)
    };
    let bound = i64::from(config.batch_size) * config.max_in_flight_batches as i64;
    let stop = CancellationToken::new();
    // Relays at work on the empty outbox: their claims plan (and cache) against it.
    let mut relays = Vec::new();
    if lease {
        for i in 0..4 {
            let (store, recorder, stop) = (store.clone(), recorder.clone(), stop.clone());
            let batch = config.batch_size;
            relays.push(tokio::spawn(async move {
                lease_relay(store, recorder, &format!("lease-{i}"), batch, stop).await;
            }));
        }
    } else {
        let relay = Relay::new(t.db.clone(), recorder.clone(), config.clone());
        relays.push(tokio::spawn(relay.run(stop.clone())));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("VACUUM ANALYZE oncely_outbox")
        .execute(&pool)
        .await
        .unwrap();
    // Claims on the freshly analysed empty table, re-planned for it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reltuples: f32 =
        sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE oid = 'oncely_outbox'::regclass")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        reltuples.abs() < f32::EPSILON,
        "believed empty: reltuples {reltuples}"
    );
    let sampling = CancellationToken::new();
    let sampler = sample_partition_locks(pool.clone(), PREFIX, PARTITIONS, sampling.clone());
    bulk_enqueue(&pool, PREFIX, ROWS, PARTITIONS).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while recorder.confirmed_distinct() < ROWS as usize {
        assert!(
            tokio::time::Instant::now() < deadline,
            "drained {} of {ROWS} in 120 s",
            recorder.confirmed_distinct()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sampling.cancel();
    let most = sampler.await.unwrap();
    stop.cancel();
    for r in relays {
        r.await.unwrap();
    }
    assert!(
        most <= bound,
        "a session held {most} partition locks at once; the relay's batches in flight hold at \
         most {bound}"
    );
    assert_eq!(store.stats().await.unwrap().pending, 0);
    let confirmed = recorder.confirmed();
    assert_eq!(confirmed.len(), PARTITIONS as usize);
    for (partition, payloads) in confirmed {
        let expected: Vec<String> = (0..ROWS / PARTITIONS)
            .map(|seq| format!("{partition}:{seq}"))
            .collect();
        assert_eq!(payloads, expected, "partition {partition} out of order");
    }
}

/// Seq scans of this schema's tables so far, as the statistics system counts them, after
/// flushing this backend's pending counts (`pool` must have a single connection: the one
/// whose statements are counted).
async fn seq_scans(pool: &sqlx::PgPool) -> BTreeMap<String, i64> {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_as(
        "SELECT relname::text, seq_scan FROM pg_stat_user_tables \
         WHERE schemaname = current_schema()",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// Every other PostgreSQL claim and sweep on a backlog in tables PostgreSQL believes empty
/// (`VACUUM ANALYZE` while they were, then 20,000 rows each): the SQL transport's receive,
/// its consumers' delivery claim and its fan-out collector, the published-outbox cleanup,
/// the inbox collector and the idempotency collector each do their batch without a single
/// seq scan of their table. With the `DELETE … USING` joins planned for an empty table,
/// each batch seq-scanned the whole table (the queue's receive: 3.2 s for 64 of 100,000).
/// `oncely_subscriptions` is left out: a handful of rows, read by the fan-out trigger.
#[allow(
    clippy::too_many_lines,
    reason = "five tables' backlogs and sweeps checked in one statistics snapshot"
)]
async fn claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan(t: TestDb) {
    const ROWS: i64 = 20_000;
    let db = oncely_sql::Database::connect(
        &t.url,
        &oncely_sql::DbOptions {
            max_connections: 1,
            ..oncely_sql::DbOptions::default()
        },
    )
    .await
    .unwrap();
    db.migrate().await.unwrap();
    let pool = db.as_postgres().expect("postgres").clone();
    let transport = SqlTransport::new(db.clone(), 1 << 20);
    transport.subscribe("c1", "fan").await.unwrap();
    let tables = [
        "oncely_queue",
        "oncely_deliveries",
        "oncely_outbox_published",
        "oncely_inbox",
        "oncely_idempotency",
    ];
    for table in tables {
        sqlx::query(&format!("VACUUM ANALYZE {table}"))
            .execute(&pool)
            .await
            .unwrap();
    }
    for statement in [
        "INSERT INTO oncely_queue (topic, message_id, partition_key, event_type, headers, \
         payload, enqueued_at) SELECT CASE WHEN g % 2 = 0 THEN 'plain' ELSE 'fan' END, \
         gen_random_uuid()::text, 'p' || g, 'e', '{}', '\\x00', 0 \
         FROM generate_series(1, $1 * 2) g",
        "INSERT INTO oncely_outbox_published (id, message_id, topic, partition_key, \
         event_type, payload, headers, created_at, available_at, attempts, published_at) \
         SELECT g, gen_random_uuid()::text, 't', 'p', 'e', '\\x00', '{}', 0, 0, 0, 0 \
         FROM generate_series(1, $1) g",
        "INSERT INTO oncely_inbox (consumer, message_id, received_at) \
         SELECT 'c1', gen_random_uuid()::text, 0 FROM generate_series(1, $1) g",
        "INSERT INTO oncely_idempotency (tenant, operation, key, fingerprint, route_digest, \
         state, owner, created_at, completed_at, expires_at) \
         SELECT 't', 'POST /x', 'k' || g, '\\x00', '\\x00', 'succeeded', 'o', 0, 0, 0 \
         FROM generate_series(1, $1) g",
    ] {
        sqlx::query(statement)
            .bind(ROWS)
            .execute(&pool)
            .await
            .unwrap();
    }
    for table in tables {
        let reltuples: f32 = sqlx::query_scalar(&format!(
            "SELECT reltuples FROM pg_class WHERE oid = '{table}'::regclass"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            reltuples.abs() < f32::EPSILON,
            "{table} believed empty: {reltuples}"
        );
    }
    let before = seq_scans(&pool).await;
    let now = oncely_core::now_ms();
    for _ in 0..3 {
        assert_eq!(transport.receive("plain", 64).await.unwrap().len(), 64);
        let claimed = transport
            .claim("c1", 64, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 64);
        assert_eq!(transport.collect_fanned_out(now, 64).await.unwrap(), 64);
        assert_eq!(
            OutboxStore::new(db.clone())
                .delete_published(now, 64)
                .await
                .unwrap(),
            64
        );
        assert_eq!(
            oncely_sql::InboxStore::new(db.clone())
                .collect(now, 64)
                .await
                .unwrap(),
            64
        );
        assert_eq!(
            oncely_sql::IdempotencyStore::new(db.clone(), Duration::from_secs(60))
                .collect_expired(now, 64)
                .await
                .unwrap(),
            64
        );
    }
    let after = seq_scans(&pool).await;
    for table in tables {
        assert_eq!(
            after.get(table),
            before.get(table),
            "{table} was seq-scanned by a claim or sweep"
        );
    }
}

/// A relay by lease: claim, publish to `recorder`, mark published, until `stop`.
async fn lease_relay(
    store: OutboxStore,
    recorder: Arc<Recorder>,
    owner: &str,
    batch: u32,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let rows = store
            .claim(owner, batch, Duration::from_secs(30), oncely_core::now_ms())
            .await
            .unwrap();
        if rows.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let messages: Vec<Message> = rows
            .into_iter()
            .map(|r| oncely_outbox::to_message(r.event))
            .collect();
        assert!(recorder.publish(&messages).await.iter().all(Result::is_ok));
        store
            .mark_published(owner, &ids, oncely_core::now_ms())
            .await
            .unwrap();
    }
}

/// Migration 0005 on a database migrated up to 0004 that already
/// holds rows published under the old schema (state `published` in `oncely_outbox`): they
/// move to `oncely_outbox_published` (a missing `published_at` becomes `created_at`), stay
/// readable through `get`, their ids cannot be enqueued again, and the pending and dead
/// rows stay where they were and are relayed.
#[allow(
    clippy::too_many_lines,
    reason = "one migration's before and after, read top to bottom"
)]
async fn migration_0005_moves_rows_published_under_the_old_schema(t: TestDb) {
    let pool = t.db.as_postgres().expect("postgres").clone();
    let mut old = sqlx::migrate!("../oncely-sql/migrations/postgres");
    old.migrations = old
        .migrations
        .iter()
        .filter(|m| m.version < 5)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    old.run(&pool).await.unwrap();
    let published_table: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('oncely_outbox_published')::text")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        published_table.as_deref(),
        Some("oncely_outbox_published"),
        "0002's partial index of published rows"
    );
    // Old-schema rows: two published (one without published_at), one pending, one dead.
    let events = [
        plain_event("a"),
        plain_event("b"),
        plain_event("a"),
        plain_event("c"),
    ];
    // The old schema's enqueue (today's checks `oncely_outbox_published`, not yet a table).
    let mut ids = Vec::new();
    for e in &events {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
             payload, headers, created_at, available_at, attempts, state) \
             VALUES ($1, $2, $3, $4, $5, '{}', $6, $6, 0, 'pending') RETURNING id",
        )
        .bind(e.message_id.to_string())
        .bind(&e.topic)
        .bind(&e.partition_key)
        .bind(&e.event_type)
        .bind(&e.payload)
        .bind(oncely_core::now_ms())
        .fetch_one(&pool)
        .await
        .unwrap();
        ids.push(id);
    }
    sqlx::query("UPDATE oncely_outbox SET state = 'published', published_at = 1234 WHERE id = $1")
        .bind(ids[0])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE oncely_outbox SET state = 'published' WHERE id = $1")
        .bind(ids[1])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE oncely_outbox SET state = 'dead', attempts = 3 WHERE id = $1")
        .bind(ids[3])
        .execute(&pool)
        .await
        .unwrap();
    let created_b: i64 = sqlx::query_scalar("SELECT created_at FROM oncely_outbox WHERE id = $1")
        .bind(ids[1])
        .fetch_one(&pool)
        .await
        .unwrap();
    t.db.migrate().await.unwrap();
    let moved: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, published_at FROM oncely_outbox_published ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(moved, vec![(ids[0], 1234), (ids[1], created_b)]);
    let left: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, state FROM oncely_outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        vec![(ids[2], "pending".to_owned()), (ids[3], "dead".to_owned())]
    );
    let store = OutboxStore::new(t.db.clone());
    let a0 = store.get(ids[0]).await.unwrap().expect("kept");
    assert_eq!(
        (a0.state, a0.published_at, &a0.event),
        (OutboxState::Published, Some(1234), &events[0])
    );
    let mut tx = t.db.begin().await.unwrap();
    let again = OutboxStore::enqueue(&mut tx, &events[1]).await;
    assert!(
        matches!(again, Err(oncely_sql::StoreError::AlreadyPublished(_))),
        "{again:?}"
    );
    drop(tx);
    // New ids continue after the old ones; the pending row is relayed.
    let next = enqueue_all(&t.db, &[plain_event("d")]).await[0];
    assert!(next > ids[3]);
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = Relay::new(t.db.clone(), publisher, claim_test_config(0, true));
    let r = relay.drain(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.published, 2, "{r:?}");
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (0, 1));
}

/// `claim_batch`'s `skip` leaves the given id ranges alone (rows
/// there stay for a later claim), empty or reversed ranges skip nothing, and a failed row
/// re-inserted by `settle` keeps its id and message id, goes dead at the attempt limit
/// (dead rows no longer block their partition) and is claimed by the next relay once
/// available.
async fn claim_batch_skip_ranges_and_reinserted_failures(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let lease = Duration::from_secs(60);
    let events: Vec<OutboxEvent> = (0..6).map(|i| plain_event(&format!("s{i}"))).collect();
    let ids = enqueue_all(&t.db, &events).await;
    let now = oncely_core::now_ms();
    #[allow(clippy::reversed_empty_ranges)]
    let skip = [ids[1]..=ids[2], ids[5]..=ids[4]];
    let b = store.claim_batch("r", 10, lease, now, &skip).await.unwrap();
    assert_eq!(
        b.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[0], ids[3], ids[4], ids[5]]
    );
    // s0 fails for good (attempt limit 1), s3 fails once, s4 is published, s5 untouched.
    let failures = [
        oncely_sql::PublishFailure::new(ids[0], "gone", now),
        oncely_sql::PublishFailure::new(ids[3], "later", now),
    ];
    let settled = b.settle(&[ids[4]], now, &failures, 1).await.unwrap();
    assert_eq!(
        settled.failures,
        vec![
            (ids[0], oncely_sql::Rescheduled::Dead),
            (ids[3], oncely_sql::Rescheduled::Dead)
        ]
    );
    let follow = enqueue_all(&t.db, &[plain_event("s0")]).await[0];
    let b = store
        .claim_batch("r2", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(
        b.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[1], ids[2], ids[5], follow],
        "s0's dead head no longer blocks it"
    );
    let dead = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        (dead.state, dead.attempts, dead.event.message_id),
        (OutboxState::Dead, 1, events[0].message_id)
    );
}

/// A relay task that panics mid-batch (here: the publisher panics once) drops its batch,
/// which rolls back, and `drain_woken` counts the task as lost; the batch's id range must
/// leave the relay's `held` list too, or every later claim of that drain keeps skipping
/// those rows. With a backlog the drain never runs dry, so the relay (alone on the outbox)
/// would leave the partitions of the lost batch unpublished until the whole backlog is
/// gone (before the fix: 8 partitions starved behind 12,000 events).
async fn claim_one_relay_republishes_a_panicked_batch_while_busy(t: TestDb) {
    const PARTITIONS: usize = 1200;
    const PER: usize = 10;
    t.db.migrate().await.unwrap();
    let events: Vec<OutboxEvent> = (0..PER)
        .flat_map(|seq| (0..PARTITIONS).map(move |p| seq_event(&format!("b{p}"), seq)))
        .collect();
    let mut ids = Vec::new();
    for chunk in events.chunks(2000) {
        ids.extend(enqueue_all(&t.db, chunk).await);
    }
    let recorder = Arc::new(Recorder::panicking_once(2_000));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = spawn_relay(Relay::new(
        t.db.clone(),
        publisher,
        claim_test_config(0, false),
    ));
    let total = PARTITIONS * PER;
    // Half a second in, the lost batch's rows are back (rolled back, unlocked) and pending.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pool = t.db.as_postgres().expect("postgres").clone();
    let mut probe = pool.begin().await.unwrap();
    let free: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT id FROM oncely_outbox WHERE id = ANY($1) \
         FOR UPDATE SKIP LOCKED) f",
    )
    .bind(&ids[..8])
    .fetch_one(&mut *probe)
    .await
    .unwrap();
    probe.rollback().await.unwrap();
    let confirmed_then = recorder.confirmed_distinct();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while recorder.confirmed_distinct() < total && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop(relay).await;
    let global = recorder.state().global.clone();
    // The first batch claimed the heads of b0..b7 (ids 1..8): where did b0:0 .. b7:0 go out?
    let positions: Vec<Option<usize>> = (0..8)
        .map(|p| global.iter().position(|x| *x == format!("b{p}:0")))
        .collect();
    assert_eq!(recorder.confirmed_distinct(), total, "every event went out");
    assert!(
        positions.iter().all(|p| p.is_some_and(|p| p < total / 2)),
        "the rows of the batch lost to the panic went out at positions {positions:?} of \
         {total}, although 500 ms after the panic {free} of them were unlocked and pending \
         (while {confirmed_then} events had been confirmed)"
    );
}

/// The claim-by-delete tests, as `claim::<backend>::<test>`.
mod claim {
    use super::{
        claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight,
        claim_batch_late_head_waits_for_its_partitions_row_in_flight,
        claim_batch_skip_ranges_and_reinserted_failures,
        claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay,
        claim_one_drain_publishes_every_claimable_row,
        claim_one_relay_republishes_a_panicked_batch_while_busy,
        claim_partition_locks_of_another_schemas_outbox_do_not_block,
        claim_relay_vacuums_the_outbox_every_vacuum_after_rows,
        claim_relays_whose_publishes_panic_lose_nothing,
        claim_relays_with_flaky_publishes_lose_nothing_and_keep_order,
        claim_relays_with_late_commits_keep_one_event_per_partition_in_flight,
        claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan,
        lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch,
        lease_claim_late_head_waits_for_its_partitions_leased_row,
        migration_0005_moves_rows_published_under_the_old_schema,
    };

    oncely_testkit::matrix! {
        tests: [
            claim_relays_with_flaky_publishes_lose_nothing_and_keep_order,
            claim_relays_whose_publishes_panic_lose_nothing,
            claim_relays_with_late_commits_keep_one_event_per_partition_in_flight,
            claim_batch_late_head_waits_for_its_partitions_row_in_flight,
            lease_claim_late_head_waits_for_its_partitions_leased_row,
            claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay,
            claim_one_drain_publishes_every_claimable_row,
            migration_0005_moves_rows_published_under_the_old_schema,
            claim_batch_skip_ranges_and_reinserted_failures,
            claim_one_relay_republishes_a_panicked_batch_while_busy,
            claim_relay_vacuums_the_outbox_every_vacuum_after_rows,
            claim_partition_locks_of_another_schemas_outbox_do_not_block,
            claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight,
            lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch,
            claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan,
        ],
        cannot_apply: [
            // The claim by delete (`claim_batch` holding its transaction across the
            // publish) and what these tests read (advisory locks in `pg_locks`, vacuum and
            // scan counters in `pg_stat_user_tables`) are PostgreSQL's.
            claim_relays_with_flaky_publishes_lose_nothing_and_keep_order on sqlite | mysql,
            claim_relays_whose_publishes_panic_lose_nothing on sqlite | mysql,
            claim_relays_with_late_commits_keep_one_event_per_partition_in_flight on sqlite | mysql,
            claim_batch_late_head_waits_for_its_partitions_row_in_flight on sqlite | mysql,
            lease_claim_late_head_waits_for_its_partitions_leased_row on sqlite | mysql,
            claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay on sqlite | mysql,
            claim_one_drain_publishes_every_claimable_row on sqlite | mysql,
            migration_0005_moves_rows_published_under_the_old_schema on sqlite | mysql,
            claim_batch_skip_ranges_and_reinserted_failures on sqlite | mysql,
            claim_one_relay_republishes_a_panicked_batch_while_busy on sqlite | mysql,
            claim_relay_vacuums_the_outbox_every_vacuum_after_rows on sqlite | mysql,
            claim_partition_locks_of_another_schemas_outbox_do_not_block on sqlite | mysql,
            claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight on sqlite | mysql,
            lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch on sqlite | mysql,
            claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan on sqlite | mysql,
        ],
    }
}
