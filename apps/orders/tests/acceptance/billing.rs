//! The order service's `billing` consumer on the SQL transport (table `invoices`,
//! `UNIQUE(order_id, kind)`), on every backend: a redelivered or re-identified
//! `order.created` bills once, an undecodable one is dead at once, and orders created through
//! the service (relay, transport, consumer) each get one invoice that `GET` shows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{Message, Publisher, SqlSubscriber, SqlTransport};
use oncely_core::{MessageId, RetryPolicy};
use oncely_inbox::{ConsumerConfig, SqlConsumer};
use oncely_sql::{on_pool, Database};
use oncely_testkit::TestDb;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(30);

fn config() -> ConsumerConfig {
    ConsumerConfig {
        concurrency: 4,
        batch: 16,
        poll: Duration::from_millis(10),
        retry: RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(200),
            max_attempts: 5,
            ..RetryPolicy::default()
        },
        ..ConsumerConfig::default()
    }
}

async fn scalar(db: &Database, sql: &str, consumer: &str) -> i64 {
    on_pool!(db, |p| sqlx::query_scalar::<_, i64>(&oncely_sql::sql_text(
        p, sql
    ))
    .bind(consumer)
    .fetch_one(p)
    .await)
    .unwrap()
}

async fn open_deliveries(db: &Database, consumer: &str) -> i64 {
    scalar(
        db,
        "SELECT COUNT(*) FROM oncely_deliveries WHERE consumer = $1 AND state = 'pending'",
        consumer,
    )
    .await
}

/// Runs `step` until `done` holds or `within` passes.
async fn eventually<F, Fut>(within: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn billing_on_sql(
    db: &Database,
    transport: &SqlTransport,
    config: ConsumerConfig,
    lease: Duration,
) -> SqlConsumer {
    orders::billing_consumer(
        db.clone(),
        SqlSubscriber::new(
            transport.clone(),
            orders::BILLING_CONSUMER,
            orders::ORDERS_TOPIC,
            lease,
        ),
        config,
    )
}

oncely_testkit::matrix! {
    tests: [
        s5_billing_killed_after_commit_before_ack_creates_one_invoice,
        order_created_with_a_new_message_id_for_the_same_order_creates_no_second_invoice,
        orders_created_through_the_service_get_one_invoice_each_shown_by_get,
        undecodable_order_created_is_dead_at_once,
    ],
}

async fn billing_setup(t: &TestDb) -> SqlTransport {
    orders::migrate(&t.db).await.unwrap();
    SqlTransport::new(t.db.clone(), 1 << 20)
}

fn order_created(message_id: MessageId, order: &str) -> Message {
    let payload = serde_json::json!({"id": order, "status": "created", "source": "shop",
        "external_ref": order, "customer_id": "c-1", "items": [{"sku": "s", "quantity": 1}],
        "amount_minor": 1999, "currency": "EUR", "created_at": 1});
    Message {
        id: message_id,
        topic: orders::ORDERS_TOPIC.to_owned(),
        partition_key: order.to_owned(),
        event_type: orders::ORDER_CREATED.to_owned(),
        payload: serde_json::to_vec(&payload).unwrap(),
        headers: [("tenant".to_owned(), "acme".to_owned())].into(),
    }
}

async fn invoice_rows(db: &Database, order: &str) -> i64 {
    scalar(
        db,
        "SELECT COUNT(*) FROM invoices WHERE order_id = $1",
        order,
    )
    .await
}

async fn s5_billing_killed_after_commit_before_ack_creates_one_invoice(t: TestDb) {
    let transport = billing_setup(&t).await;
    let crashed = Arc::new(AtomicBool::new(false));
    let crash = crashed.clone();
    let billing = billing_on_sql(&t.db, &transport, config(), Duration::from_millis(300))
        .with_fault_after_commit(move |_| !crash.swap(true, Ordering::SeqCst));
    billing.subscribe().await.unwrap();
    for r in transport
        .publish(&[order_created(MessageId::new_random(), "ord-1")])
        .await
    {
        r.unwrap();
    }
    assert_eq!(billing.run_once().await.unwrap(), 1);
    assert!(crashed.load(Ordering::SeqCst));
    assert_eq!(invoice_rows(&t.db, "ord-1").await, 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(billing.run_once().await.unwrap(), 1, "redelivered");
    assert_eq!(invoice_rows(&t.db, "ord-1").await, 1, "one invoice");
    assert_eq!(
        billing.stats().duplicates(),
        1,
        "the duplicate counter moved"
    );
    assert_eq!(open_deliveries(&t.db, orders::BILLING_CONSUMER).await, 0);
}

async fn order_created_with_a_new_message_id_for_the_same_order_creates_no_second_invoice(
    t: TestDb,
) {
    let transport = billing_setup(&t).await;
    let billing = billing_on_sql(&t.db, &transport, config(), LEASE);
    billing.subscribe().await.unwrap();
    let batch = [
        order_created(MessageId::new_random(), "ord-1"),
        order_created(MessageId::new_random(), "ord-1"),
    ];
    for r in transport.publish(&batch).await {
        r.unwrap();
    }
    assert_eq!(billing.run_once().await.unwrap(), 2);
    // Both ids are new to the inbox; UNIQUE(order_id, kind) holds the business rule.
    assert_eq!(billing.stats().consumed(), 2);
    assert_eq!(invoice_rows(&t.db, "ord-1").await, 1);
}

#[allow(
    clippy::too_many_lines,
    reason = "one end-to-end scenario, read top to bottom"
)]
async fn orders_created_through_the_service_get_one_invoice_each_shown_by_get(t: TestDb) {
    let transport = billing_setup(&t).await;
    let billing = billing_on_sql(&t.db, &transport, config(), LEASE);
    billing.subscribe().await.unwrap();
    let api_key = "test-key-0123456789abcdef";
    let app_config = orders::AppConfig {
        api_keys: orders::parse_api_keys(&format!("{api_key}=acme")).unwrap(),
        ..orders::AppConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = orders::router(t.db.clone(), &app_config);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let shutdown = CancellationToken::new();
    let relay = oncely_outbox::Relay::new(
        t.db.clone(),
        Arc::new(transport.clone()),
        oncely_outbox::RelayConfig {
            poll_interval: Duration::from_millis(20),
            ..oncely_outbox::RelayConfig::default()
        },
    );
    let relay = tokio::spawn(relay.run(shutdown.clone()));
    let billing_stats = billing.stats();
    let consumer = tokio::spawn(billing.run(shutdown.clone()));

    let client = reqwest::Client::new();
    let post = |key: String, ext: String| {
        let client = client.clone();
        let url = format!("{base}/v1/orders");
        async move {
            let res = client
                .post(url)
                .bearer_auth(api_key)
                .header("Idempotency-Key", key)
                .json(&serde_json::json!({"source": "shop", "external_ref": ext,
                    "customer_id": "c-1", "items": [{"sku": "s-1", "quantity": 1}],
                    "amount_minor": 1999, "currency": "EUR"}))
                .send()
                .await
                .expect("POST");
            let status = res.status().as_u16();
            let body: serde_json::Value = res.json().await.expect("JSON body");
            (status, body)
        }
    };
    let mut ids = Vec::new();
    for i in 0..20 {
        // Each order sent twice at once with its key, then with a new key.
        let (a, b) = tokio::join!(
            post(format!("k-{i}"), format!("e-{i}")),
            post(format!("k-{i}"), format!("e-{i}"))
        );
        let (c, _) = post(format!("other-{i}"), format!("e-{i}")).await;
        assert!([a.0, b.0].contains(&201), "created: {} {}", a.0, b.0);
        assert_eq!(c, 200);
        let created = if a.0 == 201 { a.1 } else { b.1 };
        assert!(
            created.get("invoice").is_none(),
            "no invoice in the create answer"
        );
        ids.push(created["id"].as_str().unwrap().to_owned());
    }
    eventually(Duration::from_secs(20), || async {
        scalar(
            &t.db,
            "SELECT COUNT(*) FROM invoices WHERE tenant = $1",
            "acme",
        )
        .await
            >= 20
    })
    .await;
    // Let any stray copies arrive before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    relay.await.unwrap();
    consumer.await.unwrap();
    assert_eq!(
        scalar(
            &t.db,
            "SELECT COUNT(*) FROM invoices WHERE tenant = $1",
            "acme"
        )
        .await,
        20
    );
    assert_eq!(billing_stats.consumed(), 20);
    for id in &ids {
        assert_eq!(invoice_rows(&t.db, id).await, 1);
        let got: serde_json::Value = client
            .get(format!("{base}/v1/orders/{id}"))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["id"], id.as_str());
        assert_eq!(got["invoice"]["kind"], "order");
        assert_eq!(got["invoice"]["amount_minor"], 1999);
        assert_eq!(got["invoice"]["currency"], "EUR");
    }
    server.abort();
}

async fn undecodable_order_created_is_dead_at_once(t: TestDb) {
    let transport = billing_setup(&t).await;
    let billing = billing_on_sql(&t.db, &transport, config(), LEASE);
    billing.subscribe().await.unwrap();
    let good = order_created(MessageId::new_random(), "ord-ok");
    let bad = Message {
        payload: b"{not json".to_vec(),
        ..order_created(MessageId::new_random(), "ord-bad")
    };
    for r in transport.publish(&[bad.clone(), good]).await {
        r.unwrap();
    }
    assert_eq!(billing.run_once().await.unwrap(), 2);
    let dead = transport
        .dead_deliveries(orders::BILLING_CONSUMER, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, bad.id);
    assert_eq!(
        dead[0].attempts, 1,
        "no retry for a message that cannot decode"
    );
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("order.created payload"));
    assert_eq!(billing.stats().retries(), 0);
    assert_eq!(invoice_rows(&t.db, "ord-ok").await, 1);
}
