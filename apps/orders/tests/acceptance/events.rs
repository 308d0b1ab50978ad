//! Orders created through the real router, on every backend × broker, each yield exactly
//! one `order.created` through the relay: ids derived from the idempotency key, the
//! request's headers carried, nothing for rolled-back orders, the relay's metrics on the
//! service's endpoint.

use std::collections::HashSet;
use std::time::Duration;

use oncely_core::{IdempotencyKey, MessageId, Operation, RetryPolicy, Scope, TenantId};
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::OutboxStore;
use oncely_testkit::{MatrixBroker, TestBackend, TestDb, TestTopic};
use tokio_util::sync::CancellationToken;

/// A fresh database (oncely's migrations applied) and a fresh topic with a consumer.
struct Harness {
    db: TestDb,
    t: TestTopic,
}

impl Harness {
    fn store(&self) -> OutboxStore {
        OutboxStore::new(self.db.db.clone())
    }

    /// A relay with a short poll and retry schedule that keeps published rows.
    fn relay(&self) -> Relay {
        Relay::new(
            self.db.db.clone(),
            self.t.publisher.clone(),
            RelayConfig {
                batch_size: 32,
                lease: Duration::from_secs(30),
                poll_interval: Duration::from_millis(50),
                retry: RetryPolicy {
                    base: Duration::from_millis(20),
                    cap: Duration::from_millis(200),
                    max_attempts: 1000,
                    ..RetryPolicy::default()
                },
                retention: Duration::from_secs(3600),
                ..RelayConfig::default()
            },
        )
    }
}

/// Runs `scenario` on a fresh [`Harness`] for `backend` and the broker `B` (or skips).
async fn run<B: MatrixBroker>(backend: TestBackend, scenario: impl AsyncFnOnce(Harness)) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    db.db.migrate().await.expect("migrate");
    if let Some(t) = TestTopic::new(B::BROKER, &db.db).await {
        scenario(Harness { db, t }).await;
    }
}

oncely_testkit::matrix! {
    run: run,
    tests: [every_created_order_yields_exactly_one_order_created],
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

/// Orders created through the real router each yield exactly one `order.created`, with the
/// id derived from the idempotency key; retries and replays add none; orders whose
/// transaction rolled back yield none.
#[allow(
    clippy::too_many_lines,
    reason = "one end-to-end scenario over every broker's fixture, read top to bottom"
)]
async fn every_created_order_yields_exactly_one_order_created(mut h: Harness) {
    use oncely_http::IdempotencyConfig;
    let metrics = orders::metrics_handle();
    orders::migrate(&h.db.db).await.expect("order migrations");
    let api_key = "test-key-0123456789abcdef";
    let base_config = orders::AppConfig {
        api_keys: orders::parse_api_keys(&format!("{api_key}=acme")).unwrap(),
        events_topic: h.t.topic.clone(),
        ..orders::AppConfig::default()
    };
    // A second service on the same database whose stored-response bound is too small: every
    // create there rolls back (500 response-too-large) — the order and its outbox row.
    let rollback_config = orders::AppConfig {
        idempotency: IdempotencyConfig {
            max_stored_response: 32,
            ..IdempotencyConfig::default()
        },
        ..base_config.clone()
    };
    let serve = |config: orders::AppConfig| {
        let db = h.db.db.clone();
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let app = orders::router(db, &config);
            tokio::spawn(async move { axum::serve(listener, app).await });
            format!("http://{addr}")
        }
    };
    let ok_base = serve(base_config).await;
    let rb_base = serve(rollback_config).await;
    let client = reqwest::Client::new();
    let body = |ext: &str| {
        serde_json::json!({"source": "shop", "external_ref": ext, "customer_id": "c-1",
            "items": [{"sku": "s-1", "quantity": 1}], "amount_minor": 100, "currency": "EUR"})
    };
    let post = |base: String, key: String, ext: String| {
        let client = client.clone();
        let b = body(&ext);
        async move {
            client
                .post(format!("{base}/v1/orders"))
                .bearer_auth(api_key)
                .header("Idempotency-Key", key)
                .header(
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                )
                .json(&b)
                .send()
                .await
                .expect("POST")
                .status()
                .as_u16()
        }
    };
    // 12 orders, each sent 3 times concurrently and once more afterwards (a replay).
    let mut created = Vec::new();
    for i in 0..12 {
        let key = format!("key-{i}");
        let ext = format!("ext-{i}");
        let statuses = futures_util::future::join_all(
            (0..3).map(|_| post(ok_base.clone(), key.clone(), ext.clone())),
        )
        .await;
        assert!(statuses.contains(&201), "one attempt creates: {statuses:?}");
        assert_eq!(post(ok_base.clone(), key.clone(), ext.clone()).await, 201);
        // A new key for the same business order: the existing order, no new event.
        assert_eq!(
            post(ok_base.clone(), format!("other-{i}"), ext.clone()).await,
            200
        );
        created.push((key, ext));
    }
    for i in 0..4 {
        let status = post(
            rb_base.clone(),
            format!("rb-key-{i}"),
            format!("rb-ext-{i}"),
        )
        .await;
        assert_eq!(status, 500, "the oversized answer rolls the order back");
    }
    let relay = spawn_relay(h.relay());
    let got =
        h.t.collector
            .collect(
                created.len(),
                Duration::from_secs(30),
                Duration::from_millis(1500),
            )
            .await;
    stop(relay).await;
    assert_eq!(
        got.len(),
        created.len(),
        "exactly one event per created order: {got:#?}"
    );
    let scope = Scope::new(
        TenantId::parse("acme").unwrap(),
        Operation::new("POST", "/v1/orders"),
    );
    let mut seen_orders = HashSet::new();
    for d in &got {
        assert_eq!(d.event_type, "order.created");
        let payload: serde_json::Value = serde_json::from_slice(&d.payload).unwrap();
        let ext = payload["external_ref"].as_str().unwrap().to_owned();
        assert!(
            !ext.starts_with("rb-"),
            "a rolled-back order published {ext}"
        );
        let i: usize = ext.trim_start_matches("ext-").parse().unwrap();
        let key: IdempotencyKey = created[i].0.parse().unwrap();
        assert_eq!(
            d.id,
            MessageId::derive(&scope, &key, "order.created", 0).to_string(),
            "message id derives from the operation key"
        );
        assert_eq!(d.partition_key, payload["id"].as_str().unwrap());
        assert_eq!(
            d.headers.get("idempotency-key").map(String::as_str),
            Some(key.as_str())
        );
        assert_eq!(
            d.headers.get("traceparent").map(String::as_str),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        assert!(d.headers.contains_key("correlation-id"));
        assert!(seen_orders.insert(ext), "two events for one order");
    }
    let stats = h.store().stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 0));
    // The relay's metrics reach the service's Prometheus endpoint.
    let text = metrics.render();
    assert!(text.contains("oncely_outbox_published_total"), "{text}");
    assert!(
        text.contains("oncely_outbox_publish_latency_seconds_bucket"),
        "{text}"
    );
    h.t.finish().await;
}
