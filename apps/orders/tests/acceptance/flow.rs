//! The payment + shipping flow (order → invoice → charge → `invoice.paid` → shipment) through
//! the real router, relay, `billing` and `shipping` consumers and effect runner, against the
//! payments and shipping simulators on `127.0.0.1:0` — and against localstripe for payments —
//! on every backend. Every charge and shipment is counted at the provider.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{Message, Publisher, SqlSubscriber, SqlTransport};
use oncely_core::{MessageId, RetryPolicy};
use oncely_effects::{
    EffectRunner, Provider, RunnerConfig, ShippingClient, ShippingConfig, StripeConfig,
    StripePayments,
};
use oncely_inbox::ConsumerConfig;
use oncely_sim::{PaymentsConfig, PaymentsSim, ShippingSim};
use oncely_sql::{on_pool, Database, EffectStore};
use oncely_testkit::{LocalStripe, TestDb};
use serde_json::{json, Value};

use super::{serve_sim, Sim};
use tokio_util::sync::CancellationToken;

pub(super) const KEY_A: &str = "flow-key-tenant-a-0123456789";
const KEY_B: &str = "flow-key-tenant-b-0123456789";
const SK: &str = "sk_test_flow";
/// Orders per tenant.
const PER_TENANT: usize = 5;

oncely_testkit::matrix! {
    tests: [
        every_order_is_charged_once_and_shipped_once_counted_at_the_simulators,
        redelivered_order_created_and_invoice_paid_create_no_second_effect,
        a_payment_or_shipment_of_another_tenant_is_not_shown,
        against_localstripe_every_invoice_is_charged_once_and_shipped_once,
    ],
}

/// The order service with everything the flow runs beside it, on the SQL transport.
pub(super) struct Flow {
    base: String,
    client: reqwest::Client,
    transport: SqlTransport,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Flow {
    pub(super) async fn start(db: &Database, payments: StripeConfig, shipping_url: &str) -> Self {
        orders::migrate(db).await.unwrap();
        let transport = SqlTransport::new(db.clone(), 1 << 20);
        let stop = CancellationToken::new();
        let config = orders::AppConfig {
            api_keys: orders::parse_api_keys(&format!("{KEY_A}=tenant-a,{KEY_B}=tenant-b"))
                .unwrap(),
            ..orders::AppConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let mut tasks = vec![tokio::spawn({
            let (db, stop) = (db.clone(), stop.clone());
            async move {
                orders::serve(listener, db, config, stop.cancelled_owned())
                    .await
                    .unwrap();
            }
        })];
        let relay = oncely_outbox::Relay::new(
            db.clone(),
            Arc::new(transport.clone()),
            oncely_outbox::RelayConfig {
                poll_interval: Duration::from_millis(20),
                ..oncely_outbox::RelayConfig::default()
            },
        );
        tasks.push(tokio::spawn(relay.run(stop.clone())));
        let sub = |group: &str| {
            SqlSubscriber::new(
                transport.clone(),
                group,
                orders::ORDERS_TOPIC,
                Duration::from_secs(30),
            )
        };
        let billing = orders::billing_consumer_with(
            db.clone(),
            sub(orders::BILLING_CONSUMER),
            consumer_config(),
            orders::BillingHandler::charging(),
        );
        let shipping = orders::shipping_consumer(
            db.clone(),
            sub(orders::SHIPPING_CONSUMER),
            consumer_config(),
        );
        billing.subscribe().await.unwrap();
        shipping.subscribe().await.unwrap();
        tasks.push(tokio::spawn(billing.run(stop.clone())));
        tasks.push(tokio::spawn(shipping.run(stop.clone())));
        let providers: Vec<Arc<dyn Provider>> = vec![
            Arc::new(StripePayments::new(payments).unwrap()),
            Arc::new(
                ShippingClient::new(ShippingConfig {
                    base_url: shipping_url.to_owned(),
                    timeout: Duration::from_secs(5),
                    settle_time: Duration::from_secs(2),
                    ..ShippingConfig::default()
                })
                .unwrap(),
            ),
        ];
        let runner = Arc::new(EffectRunner::new(
            EffectStore::new(db.clone()),
            providers,
            Arc::new(orders::OrderEffects::new(orders::ORDERS_TOPIC)),
            RunnerConfig {
                lease: Duration::from_secs(10),
                poll: Duration::from_millis(20),
                check_delay: Duration::from_millis(100),
                ..RunnerConfig::default()
            },
        ));
        tasks.push(tokio::spawn(runner.run(stop.clone())));
        Self {
            base,
            client: reqwest::Client::new(),
            transport,
            stop,
            tasks,
        }
    }

    pub(super) async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap();
        }
    }

    /// Creates an order as the tenant of `api_key`; its id.
    pub(super) async fn order(&self, api_key: &str, external_ref: &str) -> String {
        let res = self
            .client
            .post(format!("{}/v1/orders", self.base))
            .bearer_auth(api_key)
            .header("Idempotency-Key", format!("k-{external_ref}"))
            .json(&json!({"source": "shop", "external_ref": external_ref,
                "customer_id": "c-1", "items": [{"sku": "sku-1", "quantity": 2},
                {"sku": "sku-2", "quantity": 1}], "amount_minor": 2500, "currency": "EUR"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let body: Value = res.json().await.unwrap();
        body["id"].as_str().unwrap().to_owned()
    }

    pub(super) async fn get(&self, api_key: &str, id: &str) -> (u16, Value) {
        let res = self
            .client
            .get(format!("{}/v1/orders/{id}", self.base))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    /// Creates `PER_TENANT` orders per tenant and waits until `GET` shows each one's
    /// shipment succeeded: `(api key, order id)`.
    async fn run_orders(&self) -> Vec<(&'static str, String)> {
        let mut orders = Vec::new();
        for i in 0..PER_TENANT {
            for key in [KEY_A, KEY_B] {
                let ext = format!("{}-{i}", &key[9..17]);
                orders.push((key, self.order(key, &ext).await));
            }
        }
        for (key, id) in &orders {
            self.wait_shipped(key, id).await;
        }
        orders
    }

    pub(super) async fn wait_shipped(&self, api_key: &str, id: &str) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (status, got) = self.get(api_key, id).await;
            assert_eq!(status, 200);
            if got["shipment"]["state"] == "succeeded" {
                return got;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "order {id} not shipped within 60 s: {got}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn consumer_config() -> ConsumerConfig {
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

pub(super) fn sim_payments(base: &str) -> StripeConfig {
    StripeConfig {
        base_url: base.to_owned(),
        secret_key: SK.to_owned(),
        timeout: Duration::from_secs(5),
        settle_time: Duration::from_secs(2),
        ..StripeConfig::default()
    }
}

pub(super) async fn start_sims() -> (PaymentsSim, Sim, ShippingSim, Sim) {
    let payments = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.to_owned()],
        search_lag: Duration::from_millis(200),
        ..PaymentsConfig::default()
    });
    let shipping = ShippingSim::new(oncely_sim::ShippingConfig::default());
    let payments_srv = serve_sim(payments.router()).await;
    let shipping_srv = serve_sim(shipping.router()).await;
    (payments, payments_srv, shipping, shipping_srv)
}

async fn scalar(db: &Database, sql: &str, bind: &str) -> i64 {
    on_pool!(db, |p| sqlx::query_scalar::<_, i64>(&oncely_sql::sql_text(
        p, sql
    ))
    .bind(bind)
    .fetch_one(p)
    .await)
    .unwrap()
}

/// What `GET` shows of a flowed order: paid and shipped (`fulfilled`, as under the saga),
/// invoice paid, payment and shipment succeeded with provider ids. The invoice id.
fn assert_flowed(got: &Value) -> String {
    assert_eq!(got["status"], "fulfilled", "{got}");
    assert_eq!(got["invoice"]["status"], "paid", "{got}");
    assert!(got["invoice"]["paid_at"].as_i64().unwrap() > 0, "{got}");
    assert_eq!(got["invoice"]["amount_minor"], 2500);
    assert_eq!(got["invoice"]["currency"], "EUR");
    assert_eq!(got["payment"]["state"], "succeeded", "{got}");
    assert!(
        got["payment"]["provider_id"]
            .as_str()
            .is_some_and(|p| p.starts_with("pi_")),
        "{got}"
    );
    assert!(got["payment"]["effect_id"].is_string());
    assert_eq!(got["shipment"]["state"], "succeeded", "{got}");
    assert!(got["shipment"]["provider_id"].is_string(), "{got}");
    got["invoice"]["id"].as_str().unwrap().to_owned()
}

async fn every_order_is_charged_once_and_shipped_once_counted_at_the_simulators(t: TestDb) {
    let (payments, p_srv, shipping, s_srv) = start_sims().await;
    let flow = Flow::start(&t.db, sim_payments(&p_srv.base), &s_srv.base).await;
    let orders = flow.run_orders().await;
    // Let any stray second call arrive before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (pay, ship) = (payments.stats(), shipping.stats());
    assert_eq!(pay.payment_intents, orders.len() as u64, "{pay:?}");
    assert_eq!(ship.shipments, orders.len() as u64, "{ship:?}");
    for (key, id) in &orders {
        let (_, got) = flow.get(key, id).await;
        let invoice = assert_flowed(&got);
        let at_provider = pay.payment_intents_by_metadata["invoice_id"][&invoice];
        assert_eq!((at_provider.total, at_provider.succeeded), (1, 1));
        assert_eq!(
            pay.payment_intents_by_metadata["order_id"][id].total, 1,
            "the charge carries the order id"
        );
        let shipped = ship.by_merchant_reference[id];
        assert_eq!((shipped.total, shipped.booked), (1, 1));
    }
    assert_eq!(
        scalar(
            &t.db,
            "SELECT COUNT(*) FROM invoices WHERE paid_at IS NOT NULL AND payment_id LIKE $1",
            "pi_%"
        )
        .await,
        orders.len() as i64
    );
    flow.stop().await;
}

fn order_created(tenant: &str, order: &str) -> Message {
    let payload = json!({"id": order, "status": "created", "source": "shop",
        "external_ref": order, "customer_id": "c-1", "items": [{"sku": "s", "quantity": 1}],
        "amount_minor": 2500, "currency": "EUR", "created_at": 1});
    Message {
        id: MessageId::new_random(),
        topic: orders::ORDERS_TOPIC.to_owned(),
        partition_key: order.to_owned(),
        event_type: orders::ORDER_CREATED.to_owned(),
        payload: serde_json::to_vec(&payload).unwrap(),
        headers: [("tenant".to_owned(), tenant.to_owned())].into(),
    }
}

fn invoice_paid(id: MessageId, tenant: &str, order: &str, invoice: &str) -> Message {
    let payload = json!({"order_id": order, "invoice_id": invoice, "amount_minor": 2500,
        "currency": "EUR", "payment_id": "pi_x", "paid_at": 1});
    Message {
        id,
        topic: orders::ORDERS_TOPIC.to_owned(),
        partition_key: order.to_owned(),
        event_type: orders::INVOICE_PAID.to_owned(),
        payload: serde_json::to_vec(&payload).unwrap(),
        headers: [("tenant".to_owned(), tenant.to_owned())].into(),
    }
}

async fn redelivered_order_created_and_invoice_paid_create_no_second_effect(t: TestDb) {
    let (payments, p_srv, shipping, s_srv) = start_sims().await;
    let flow = Flow::start(&t.db, sim_payments(&p_srv.base), &s_srv.base).await;
    let orders = flow.run_orders().await;
    let mut copies = Vec::new();
    for (key, id) in &orders {
        let tenant = if *key == KEY_A {
            "tenant-a"
        } else {
            "tenant-b"
        };
        let (_, got) = flow.get(key, id).await;
        let invoice = assert_flowed(&got);
        copies.push(order_created(tenant, id));
        // The same invoice.paid again (its derived id: the inbox drops it) and under a new
        // id (the effect's unique reference holds).
        let derived = MessageId::derive_from_parts(&[orders::INVOICE_PAID, &invoice]);
        copies.push(invoice_paid(derived, tenant, id, &invoice));
        copies.push(invoice_paid(MessageId::new_random(), tenant, id, &invoice));
    }
    for r in flow.transport.publish(&copies).await {
        r.unwrap();
    }
    let open = "SELECT COUNT(*) FROM oncely_deliveries WHERE state = 'pending' AND consumer <> $1";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while scalar(&t.db, open, "-").await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "copies not consumed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let n = orders.len() as i64;
    let effects = |provider: &'static str| {
        let db = t.db.clone();
        async move {
            scalar(
                &db,
                "SELECT COUNT(*) FROM oncely_effects WHERE provider = $1",
                provider,
            )
            .await
        }
    };
    assert_eq!(effects(orders::PAYMENTS).await, n, "one charge per invoice");
    assert_eq!(effects(orders::SHIPPING).await, n, "one booking per order");
    assert_eq!(
        scalar(
            &t.db,
            "SELECT COUNT(*) FROM invoices WHERE kind = $1",
            orders::INVOICE_KIND_ORDER
        )
        .await,
        n
    );
    assert_eq!(payments.stats().payment_intents, n as u64);
    assert_eq!(shipping.stats().shipments, n as u64);
    let dead = flow
        .transport
        .dead_deliveries(orders::SHIPPING_CONSUMER, 10)
        .await
        .unwrap();
    assert!(dead.is_empty(), "{dead:?}");
    flow.stop().await;
}

async fn a_payment_or_shipment_of_another_tenant_is_not_shown(t: TestDb) {
    let (_payments, p_srv, _shipping, s_srv) = start_sims().await;
    let flow = Flow::start(&t.db, sim_payments(&p_srv.base), &s_srv.base).await;
    let orders = flow.run_orders().await;
    let (key_a, order_a) = orders.iter().find(|(k, _)| *k == KEY_A).unwrap();
    let (_, got) = flow.get(key_a, order_a).await;
    let invoice = assert_flowed(&got);
    // The other tenant does not see the order at all.
    assert_eq!(flow.get(KEY_B, order_a).await.0, 404);
    // The effect rows carry the tenant that owns them…
    let sql = format!(
        "SELECT {}, COUNT(*) FROM oncely_effects GROUP BY tenant",
        t.db.backend().text_column("tenant")
    );
    let tenants: BTreeMap<String, i64> = on_pool!(&t.db, |p| sqlx::query_as::<_, (String, i64)>(
        &oncely_sql::sql_text(p, &sql)
    )
    .fetch_all(p)
    .await)
    .unwrap()
    .into_iter()
    .collect();
    let per = (2 * PER_TENANT) as i64;
    assert_eq!(tenants.get("tenant-a"), Some(&per), "{tenants:?}");
    assert_eq!(tenants.get("tenant-b"), Some(&per), "{tenants:?}");
    // …and the read names it: effects that belong to someone else are not shown, even for
    // the tenant's own order and invoice.
    flow.stop().await;
    for (reference, what) in [
        (invoice.as_str(), "payment"),
        (order_a.as_str(), "shipment"),
    ] {
        t.db.execute(
            oncely_sql::query("UPDATE oncely_effects SET tenant = $1 WHERE reference = $2")
                .bind("tenant-b")
                .bind(reference),
        )
        .await
        .unwrap();
        let app = orders::router(
            t.db.clone(),
            &orders::AppConfig {
                api_keys: orders::parse_api_keys(&format!("{KEY_A}=tenant-a")).unwrap(),
                ..orders::AppConfig::default()
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let got: Value = reqwest::Client::new()
            .get(format!("{base}/v1/orders/{order_a}"))
            .bearer_auth(KEY_A)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        server.abort();
        assert!(got[what].is_null(), "{what} of another tenant shown: {got}");
        assert_eq!(got["invoice"]["status"], "paid");
    }
}

/// PaymentIntents at localstripe per `metadata[invoice_id]`, every status.
async fn localstripe_charges(base: &str) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for pi in oncely_testkit::localstripe_payment_intents(base, SK).await {
        if let Some(inv) = pi["metadata"]["invoice_id"].as_str() {
            *counts.entry(inv.to_owned()).or_default() += 1;
        }
    }
    counts
}

async fn against_localstripe_every_invoice_is_charged_once_and_shipped_once(t: TestDb) {
    let Some(ls) = LocalStripe::start().await else {
        return;
    };
    let (_payments, _p_srv, shipping, s_srv) = start_sims().await;
    let payments = StripeConfig {
        base_url: ls.base_url().to_owned(),
        secret_key: SK.to_owned(),
        timeout: Duration::from_secs(5),
        // localstripe has no search: status checks page the list.
        search: false,
        ..StripeConfig::default()
    };
    let flow = Flow::start(&t.db, payments, &s_srv.base).await;
    let orders = flow.run_orders().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let charges = localstripe_charges(ls.base_url()).await;
    assert_eq!(charges.len(), orders.len(), "{charges:?}");
    let ship = shipping.stats();
    assert_eq!(ship.shipments, orders.len() as u64);
    for (key, id) in &orders {
        let (_, got) = flow.get(key, id).await;
        let invoice = assert_flowed(&got);
        assert_eq!(charges.get(&invoice), Some(&1), "one charge for {invoice}");
        assert_eq!(ship.by_merchant_reference[id].total, 1);
    }
    flow.stop().await;
}
