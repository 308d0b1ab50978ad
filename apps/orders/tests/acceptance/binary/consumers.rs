//! The in-process billing consumer of `orders serve` on every broker: each order billed
//! once through the SQL transport, NATS JetStream, RabbitMQ and Kafka, and the events of a
//! service started with its broker down relayed once the broker is up.

use std::time::Duration;

use oncely_testkit::TestDb;
use serde_json::Value;

use super::{order, post, serve_with, Proc, API_KEY};

pub(super) async fn serve_bills_each_order_once_in_process_and_get_shows_the_invoice(t: TestDb) {
    let p = bills_each_order_once(&t, &[]).await;
    // `/metrics`: counters of events that did not happen are there at 0 (so `rate()` and
    // alerts see them), handler run times are a histogram.
    let expected = [
        "oncely_outbox_dead_total 0",
        "oncely_outbox_publish_failures_total{broker=\"sql\"} 0",
        "oncely_outbox_published_total{broker=\"sql\"} 5",
        "oncely_idempotency_store_unavailable_total 0",
        "oncely_inbox_dead_lettered_total{consumer=\"billing\",broker=\"sql\"} 0",
        "oncely_inbox_consumed_total{consumer=\"billing\",broker=\"sql\"} 5",
        "# TYPE oncely_inbox_handler_seconds histogram",
        "# TYPE oncely_outbox_publish_latency_seconds histogram",
    ];
    // The relay counts a batch after its commit, which the consumer may beat.
    let mut missing = Vec::new();
    for _ in 0..50 {
        let m = reqwest::get(format!("{}/metrics", p.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        missing = expected
            .iter()
            .filter(|line| !m.lines().any(|l| l == **line))
            .map(|line| (*line).to_owned())
            .collect();
        if missing.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("lines missing from /metrics after 5 s: {missing:?}");
}

/// The whole chain through a real broker, as `orders serve --broker nats` runs it: order and
/// `order.created` in one transaction, the relay publishing to JetStream, the in-process
/// billing consumer reading its durable consumer and billing through the inbox — each order
/// billed once, retries and duplicate orders included.
pub(super) async fn serve_bills_each_order_once_through_nats_jetstream(t: TestDb) {
    let nats_url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &nats_url).await {
        return;
    }
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("bill.{suffix}");
    let stream = format!("BILL{suffix}");
    bills_each_order_once(
        &t,
        &[
            "--broker",
            "nats",
            "--nats-url",
            &nats_url,
            "--nats-stream",
            &stream,
            "--nats-subjects",
            &topic,
            "--events-topic",
            &topic,
            "--relay-poll-ms",
            "50",
        ],
    )
    .await;
    let js = async_nats::jetstream::new(async_nats::connect(&nats_url).await.unwrap());
    let messages = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(messages, 5, "one order.created per order in the stream");
    drop(js.delete_stream(&stream).await);
}

/// As [`serve_bills_each_order_once_through_nats_jetstream`], through RabbitMQ: the relay
/// publishes persistent messages with confirms to a topic exchange of this run, the billing
/// consumer reads its group's queue (this run's `--amqp-queue-prefix`, so runs on other
/// backends sharing the broker never take each other's deliveries). Publishes that find no
/// queue bound yet come back unroutable and are retried, so nothing is lost to start-up order.
pub(super) async fn serve_bills_each_order_once_through_rabbitmq(t: TestDb) {
    let amqp_url = oncely_testkit::amqp_url();
    if !oncely_testkit::service_reachable("RabbitMQ", &amqp_url).await {
        return;
    }
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let exchange = format!("bill.{suffix}");
    let prefix = format!("bill-{suffix}");
    bills_each_order_once(
        &t,
        &[
            "--broker",
            "rabbitmq",
            "--amqp-url",
            &amqp_url,
            "--amqp-exchange",
            &exchange,
            "--amqp-queue-prefix",
            &prefix,
            "--relay-poll-ms",
            "50",
            "--relay-backoff-base-ms",
            "50",
        ],
    )
    .await;
    // Nothing left behind in the group's queues: every delivery acknowledged, none dead.
    let conn = lapin::Connection::connect(&amqp_url, oncely_broker::amqp_connection_properties())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    for (queue, dead) in [
        (format!("{prefix}.billing"), false),
        (format!("{prefix}.billing.retry"), false),
        (format!("{prefix}.billing.dead"), true),
    ] {
        let q = ch
            .queue_declare(
                queue.as_str(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..lapin::options::QueueDeclareOptions::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("queue {queue} declared by the consumer: {e}"));
        if dead {
            assert_eq!(q.message_count(), 0, "nothing dead-lettered");
        }
        drop(
            ch.queue_delete(
                queue.as_str(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await,
        );
    }
    drop(
        ch.exchange_delete(
            exchange.as_str(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await,
    );
    drop(conn.close(200, "test done").await);
}

/// As [`serve_bills_each_order_once_through_nats_jetstream`], through Kafka (tansu): the relay
/// produces with the idempotent producer to a topic of this run, the billing consumer reads
/// it in a consumer group of this run (`--kafka-group-prefix`).
pub(super) async fn serve_bills_each_order_once_through_kafka(t: TestDb) {
    if !oncely_testkit::service_reachable("Kafka", &oncely_testkit::kafka_url()).await {
        return;
    }
    let brokers = oncely_testkit::kafka_brokers();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("bill.{suffix}");
    bills_each_order_once(
        &t,
        &[
            "--broker",
            "kafka",
            "--kafka-brokers",
            &brokers,
            "--kafka-topics",
            &topic,
            "--kafka-group-prefix",
            &format!("bill-{suffix}"),
            "--events-topic",
            &topic,
            "--relay-poll-ms",
            "50",
        ],
    )
    .await;
    // The billing consumer read in this run's group.
    let group = format!("bill-{suffix}.billing");
    let groups = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::Consumer as _;
        let c: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .unwrap();
        c.fetch_group_list(Some(&group), Duration::from_secs(10))
            .unwrap()
            .groups()
            .iter()
            .map(|g| g.name().to_owned())
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert_eq!(groups, [format!("bill-{suffix}.billing")]);
}

/// Creates 5 orders through `orders serve` (with `extra` arguments), each retried with its
/// key and repeated under a new key, and checks that each is billed exactly once.
/// Returns the still-running service.
async fn bills_each_order_once(t: &TestDb, extra: &[&str]) -> Proc {
    let p = serve_with(&t.url, extra);
    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let ext = format!("bill-{i}");
        let first = post(&client, &p.base, &format!("bill-key-{i}"), &order(&ext)).await;
        assert_eq!(first.0, 201);
        // A retry and a new key for the same order add nothing.
        assert_eq!(
            post(&client, &p.base, &format!("bill-key-{i}"), &order(&ext))
                .await
                .0,
            201
        );
        assert_eq!(
            post(&client, &p.base, &format!("bill-other-{i}"), &order(&ext))
                .await
                .0,
            200
        );
        ids.push(first.2["id"].as_str().unwrap().to_owned());
    }
    for id in &ids {
        let mut invoice = Value::Null;
        for _ in 0..200 {
            let got: Value = client
                .get(format!("{}/v1/orders/{id}", p.base))
                .bearer_auth(API_KEY)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if !got["invoice"].is_null() {
                invoice = got["invoice"].clone();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(invoice["kind"], "order", "order {id} billed within 10 s");
        assert_eq!(invoice["amount_minor"], 100);
    }
    let invoices: i64 = oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM invoices"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(invoices, 5);
    p
}

/// The broker is down when `orders serve` starts: the service still takes orders, their
/// events wait in the outbox, and once the broker is reachable the relay connects and
/// publishes every one of them exactly once.
pub(super) async fn serve_starts_with_the_broker_down_and_relays_the_events_once_it_is_up(
    t: TestDb,
) {
    let nats_url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &nats_url).await {
        return;
    }
    let target: std::net::SocketAddr = oncely_testkit::url_authority(&nats_url)
        .unwrap()
        .parse()
        .unwrap();
    let proxy = oncely_testkit::FaultProxy::start(target).await;
    proxy.cut();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("down.{suffix}");
    let stream = format!("DOWN{suffix}");
    let proxied = format!("nats://{}", proxy.addr());
    let p = serve_with(
        &t.url,
        &[
            "--broker",
            "nats",
            "--nats-url",
            &proxied,
            "--nats-stream",
            &stream,
            "--nats-subjects",
            &topic,
            "--events-topic",
            &topic,
            "--relay-poll-ms",
            "50",
        ],
    );
    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let ext = format!("down-{suffix}-{i}");
        let (status, _, body) = post(
            &client,
            &p.base,
            &format!("down-{suffix}-{i}"),
            &order(&ext),
        )
        .await;
        assert_eq!(
            status, 201,
            "orders are taken while the broker is down: {body}"
        );
        ids.push(body["id"].as_str().unwrap().to_owned());
    }
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        store.stats().await.unwrap().pending,
        5,
        "the events wait in the outbox"
    );

    proxy.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while store.stats().await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the relay never caught up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let js = async_nats::jetstream::new(async_nats::connect(&nats_url).await.unwrap());
    let mut s = js.get_stream(&stream).await.unwrap();
    let state = s.info().await.unwrap().state.clone();
    assert_eq!(state.messages, 5, "each order's event once");
    let mut partitions = std::collections::HashSet::new();
    for seq in state.first_sequence..=state.last_sequence {
        let m = s.get_raw_message(seq).await.unwrap();
        partitions.insert(
            m.headers
                .get("partition-key")
                .map(|v| v.as_str().to_owned())
                .unwrap(),
        );
    }
    assert_eq!(partitions, ids.into_iter().collect());
    drop(p);
    drop(js.delete_stream(&stream).await);
}
