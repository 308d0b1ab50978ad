//! Outages under a running relay: the broker cut (through a [`FaultProxy`]; Kafka through a
//! private tansu) and the relay's database cut, plus the Kafka publisher's deadline while its
//! broker is down.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{KafkaPublisher, NatsPublisher, Publisher, RabbitMqPublisher};
use oncely_core::{MessageId, RetryBudget, RetryPolicy};
use oncely_outbox::Relay;
use oncely_sql::OutboxState;
use oncely_testkit::{
    kafka_collector, kafka_config, nats_config, rabbitmq_config, FaultProxy, TestBroker as Broker,
    KAFKA_PARTITIONS,
};

use crate::harness::{spawn_relay, stop, Harness, Observed};

/// The broker is unreachable (TCP cut) for 6 s while 40 events are enqueued — far longer
/// than the whole backoff schedule of the relay's short configuration (3 attempts, 50 ms
/// doubling to 1 s: all attempts are spent within about 150 ms of waiting). An unavailable
/// broker or a confirmation timeout is not the message's fault: the relay keeps trying, no
/// attempt is counted, nothing goes dead, and every event arrives, in partition order, once
/// the broker is back. (Before the fix every event was dead with `attempts = 3`.)
pub(crate) async fn broker_outage_longer_than_the_backoff_schedule_kills_no_event(mut h: Harness) {
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
pub(crate) async fn database_outage_under_the_relay_delays_without_counting(mut h: Harness) {
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
pub(crate) async fn kafka_publish_returns_in_time_while_the_broker_is_down() {
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
