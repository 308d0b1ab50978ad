//! The fulfilment saga (`--fulfilment saga`): reserve stock → charge → ship (pivot) →
//! invoice, through the real router, relay, `fulfilment` consumer, effect runner (the
//! orchestrator its handler) and the orchestrator's timeout sweep, against the payments and
//! shipping simulators on `127.0.0.1:0`, on every backend. Charges, refunds and shipments
//! are counted at the simulators; stock in the service's own tables.

use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{SqlSubscriber, SqlTransport};
use oncely_core::RetryPolicy;
use oncely_effects::{
    EffectRunner, Provider, RunnerConfig, ShippingClient, ShippingConfig, StripeConfig,
    StripePayments,
};
use oncely_inbox::ConsumerConfig;
use oncely_saga::OrchestratorConfig;
use oncely_sim::{FaultConfig, PaymentsConfig, PaymentsSim, ShippingSim};
use oncely_sql::{Database, EffectStore};
use oncely_testkit::TestDb;
use serde_json::{json, Value};

use super::{serve_sim, Sim};
use tokio_util::sync::CancellationToken;

pub(super) const KEY_A: &str = "saga-key-tenant-a-0123456789";
const KEY_B: &str = "saga-key-tenant-b-0123456789";
const SK: &str = "sk_test_saga";
/// A SKU the shipping simulator refuses for good (422).
const UNDELIVERABLE: &str = "sku-fragile";
/// How long the payments simulator holds a charge armed with a latency fault.
const SLOW_CHARGE_MS: u64 = 1_500;

oncely_testkit::matrix! {
    tests: [
        a_fulfilled_order_reserves_charges_ships_and_invoices_once,
        an_order_out_of_stock_is_rejected_and_nothing_is_charged,
        a_declined_card_rejects_the_order_and_restores_the_stock,
        a_refused_shipment_refunds_the_charge_and_restores_the_stock,
        a_cancel_before_the_pivot_compensates_and_after_it_answers_409,
        a_charge_resolved_by_an_operator_continues_its_saga,
    ],
}

/// The service under `--fulfilment saga` with everything it runs beside it, on the SQL
/// transport, and the simulators.
pub(super) struct Saga {
    db: Database,
    pub(super) base: String,
    pub(super) client: reqwest::Client,
    pub(super) payments: PaymentsSim,
    pub(super) payments_srv: Sim,
    pub(super) shipping: ShippingSim,
    pub(super) shipping_srv: Sim,
    stop: CancellationToken,
}

/// How [`Saga::start_opts`] starts the service.
#[derive(Debug, Default)]
pub(super) struct SagaOptions {
    /// The effect runner holds the shipping provider only: nothing claims a charge.
    pub(super) no_payments_lane: bool,
    /// `POST /v1/orders/{id}/payments` configured, against the same payments simulator.
    pub(super) endpoint: bool,
    /// The shipping simulator's word for a live shipment (`booked` when `None`).
    pub(super) live_status: Option<String>,
}

impl Drop for Saga {
    fn drop(&mut self) {
        self.stop.cancel();
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
            max_attempts: 20,
            ..RetryPolicy::default()
        },
        ..ConsumerConfig::default()
    }
}

fn providers(payments: &str, shipping: &str) -> Vec<Arc<dyn Provider>> {
    vec![
        Arc::new(
            StripePayments::new(StripeConfig {
                base_url: payments.to_owned(),
                secret_key: SK.to_owned(),
                timeout: Duration::from_secs(5),
                settle_time: Duration::from_secs(2),
                ..StripeConfig::default()
            })
            .unwrap(),
        ),
        Arc::new(
            ShippingClient::new(ShippingConfig {
                base_url: shipping.to_owned(),
                timeout: Duration::from_secs(5),
                settle_time: Duration::from_secs(2),
                ..ShippingConfig::default()
            })
            .unwrap(),
        ),
    ]
}

/// The payments and shipping simulators of a [`Saga`]; the shipping one reports a live
/// shipment as `live_status` (`booked` when `None`).
fn simulators(live_status: Option<String>) -> (PaymentsSim, ShippingSim) {
    let payments = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.to_owned()],
        search_lag: Duration::from_millis(200),
        faults: FaultConfig {
            latency_ms: SLOW_CHARGE_MS,
            ..FaultConfig::default()
        },
    });
    let shipping = ShippingSim::new(oncely_sim::ShippingConfig {
        undeliverable_skus: [UNDELIVERABLE.to_owned()].into(),
        live_status,
        ..oncely_sim::ShippingConfig::default()
    });
    (payments, shipping)
}

impl Saga {
    async fn start(db: &Database) -> Self {
        Self::start_with(db, true).await
    }

    /// The service as [`Saga::start`]; without `payments_lane` its effect runner holds
    /// the shipping provider only, so nothing claims a charge.
    async fn start_with(db: &Database, payments_lane: bool) -> Self {
        Self::start_opts(
            db,
            SagaOptions {
                no_payments_lane: !payments_lane,
                ..SagaOptions::default()
            },
        )
        .await
    }

    /// The service as [`Saga::start`], started as `opts` says.
    pub(super) async fn start_opts(db: &Database, opts: SagaOptions) -> Self {
        let payments_lane = !opts.no_payments_lane;
        orders::migrate(db).await.unwrap();
        let (payments, shipping) = simulators(opts.live_status);
        let payments_srv = serve_sim(payments.router()).await;
        let shipping_srv = serve_sim(shipping.router()).await;
        let stop = CancellationToken::new();
        let fulfilment = orders::FulfilmentConfig {
            mode: orders::Fulfilment::Saga,
            ..orders::FulfilmentConfig::default()
        };
        let config = orders::AppConfig {
            api_keys: orders::parse_api_keys(&format!("{KEY_A}=tenant-a,{KEY_B}=tenant-b"))
                .unwrap(),
            fulfilment: fulfilment.clone(),
            payments: opts.endpoint.then(|| orders::PaymentsSettings {
                provider: providers(&payments_srv.base, &shipping_srv.base).remove(0),
                lease: Duration::from_secs(10),
            }),
            ..orders::AppConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(orders::serve(
            listener,
            db.clone(),
            config,
            stop.clone().cancelled_owned(),
        ));
        let transport = SqlTransport::new(db.clone(), 1 << 20);
        let relay = oncely_outbox::Relay::new(
            db.clone(),
            Arc::new(transport.clone()),
            oncely_outbox::RelayConfig {
                poll_interval: Duration::from_millis(20),
                ..oncely_outbox::RelayConfig::default()
            },
        );
        tokio::spawn(relay.run(stop.clone()));
        let orchestrator = Arc::new(orders::fulfilment_orchestrator(
            db.clone(),
            &fulfilment,
            OrchestratorConfig {
                poll: Duration::from_millis(50),
                ..OrchestratorConfig::default()
            },
            Arc::new(orders::OrderEffects::new(orders::ORDERS_TOPIC)),
        ));
        let consumer = orders::fulfilment_consumer(
            db.clone(),
            SqlSubscriber::new(
                transport,
                orders::FULFILMENT_CONSUMER,
                orders::ORDERS_TOPIC,
                Duration::from_secs(30),
            ),
            consumer_config(),
            orchestrator.clone(),
        );
        consumer.subscribe().await.unwrap();
        tokio::spawn(consumer.run(stop.clone()));
        let runner = Arc::new(EffectRunner::new(
            EffectStore::new(db.clone()),
            providers(&payments_srv.base, &shipping_srv.base)
                .into_iter()
                .filter(|p| payments_lane || p.name() != "payments")
                .collect(),
            orchestrator.clone(),
            RunnerConfig {
                lease: Duration::from_secs(10),
                poll: Duration::from_millis(20),
                check_delay: Duration::from_millis(100),
                ..RunnerConfig::default()
            },
        ));
        tokio::spawn(runner.run(stop.clone()));
        tokio::spawn(orchestrator.run(stop.clone()));
        Self {
            db: db.clone(),
            base,
            client: reqwest::Client::new(),
            payments,
            payments_srv,
            shipping,
            shipping_srv,
            stop,
        }
    }

    pub(super) async fn set_stock(&self, api_key: &str, sku: &str, available: i64) {
        let res = self
            .client
            .put(format!("{}/v1/stock/{sku}", self.base))
            .bearer_auth(api_key)
            .json(&json!({ "available": available }))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }

    /// `(available, reserved)` of the tenant's `sku`, as `GET /v1/stock/{sku}` shows it.
    pub(super) async fn stock(&self, api_key: &str, sku: &str) -> (i64, i64) {
        let res = self
            .client
            .get(format!("{}/v1/stock/{sku}", self.base))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let v: Value = res.json().await.unwrap();
        (
            v["available"].as_i64().unwrap(),
            v["reserved"].as_i64().unwrap(),
        )
    }

    /// Creates an order of `items` as the tenant of `api_key`; its id.
    pub(super) async fn order(
        &self,
        api_key: &str,
        ext: &str,
        items: Value,
        method: Option<&str>,
    ) -> String {
        let mut body = json!({"source": "shop", "external_ref": ext, "customer_id": "c-1",
            "items": items, "amount_minor": 2500, "currency": "EUR"});
        if let Some(m) = method {
            body["payment_method"] = m.into();
        }
        let res = self
            .client
            .post(format!("{}/v1/orders", self.base))
            .bearer_auth(api_key)
            .header("Idempotency-Key", format!("k-{ext}"))
            .json(&body)
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

    pub(super) async fn cancel(&self, api_key: &str, id: &str) -> (u16, Value) {
        let res = self
            .client
            .post(format!("{}/v1/orders/{id}/cancel", self.base))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    /// Waits (at most 30 s) until `GET` shows the order with `status`.
    pub(super) async fn until(&self, api_key: &str, id: &str, status: &str) -> Value {
        self.until_with(api_key, id, |v| v["status"] == status)
            .await
    }

    pub(super) async fn until_with(
        &self,
        api_key: &str,
        id: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let (code, got) = self.get(api_key, id).await;
            assert_eq!(code, 200, "{got}");
            if done(&got) {
                return got;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "order {id} did not get there within 30 s: {got:#}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Invoices of order `id`.
    pub(super) async fn invoices(&self, id: &str) -> i64 {
        oncely_sql::on_pool!(&self.db, |p| sqlx::query_scalar::<_, i64>(
            &oncely_sql::sql_text(p, "SELECT COUNT(*) FROM invoices WHERE order_id = $1")
        )
        .bind(id)
        .fetch_one(p)
        .await)
        .unwrap()
    }
}

/// `(name, phase, state)` of each row of the saga's step log as `GET` shows it.
fn log(got: &Value) -> Vec<(String, String, String)> {
    got["fulfilment"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                s["phase"].as_str().unwrap().to_owned(),
                s["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn row(name: &str, phase: &str, state: &str) -> (String, String, String) {
    (name.to_owned(), phase.to_owned(), state.to_owned())
}

fn two_lines() -> Value {
    json!([{"sku": "sku-1", "quantity": 2}, {"sku": "sku-2", "quantity": 1}])
}

async fn a_fulfilled_order_reserves_charges_ships_and_invoices_once(t: TestDb) {
    let s = Saga::start(&t.db).await;
    s.set_stock(KEY_A, "sku-1", 5).await;
    s.set_stock(KEY_A, "sku-2", 3).await;
    let id = s.order(KEY_A, "ok-1", two_lines(), None).await;
    let got = s.until(KEY_A, &id, "fulfilled").await;
    assert_eq!(
        log(&got),
        [
            row("reserve", "forward", "succeeded"),
            row("charge", "forward", "succeeded"),
            row("ship", "forward", "succeeded"),
            row("invoice", "forward", "succeeded"),
        ]
    );
    assert_eq!(got["fulfilment"]["state"], "completed");
    assert_eq!(s.stock(KEY_A, "sku-1").await, (3, 0), "decremented once");
    assert_eq!(s.stock(KEY_A, "sku-2").await, (2, 0));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (pay, ship) = (s.payments.stats(), s.shipping.stats());
    let charged = pay.payment_intents_by_metadata["order_id"][&id];
    assert_eq!((charged.total, charged.succeeded, pay.refunds), (1, 1, 0));
    let booked = ship.by_merchant_reference[&format!("{id}:ship")];
    assert_eq!((booked.total, booked.booked, ship.cancelled), (1, 1, 0));
    assert_eq!(s.invoices(&id).await, 1);
    // Another tenant sees neither the order nor its stock.
    assert_eq!(s.get(KEY_B, &id).await.0, 404);
    assert_eq!(s.cancel(KEY_B, &id).await.0, 404);
}

async fn an_order_out_of_stock_is_rejected_and_nothing_is_charged(t: TestDb) {
    let s = Saga::start(&t.db).await;
    s.set_stock(KEY_A, "sku-1", 1).await;
    s.set_stock(KEY_A, "sku-2", 3).await;
    let id = s.order(KEY_A, "oos-1", two_lines(), None).await;
    let got = s.until(KEY_A, &id, "rejected").await;
    assert_eq!(log(&got), [row("reserve", "forward", "failed")]);
    assert!(
        got["fulfilment"]["error"]
            .as_str()
            .unwrap()
            .contains("out of stock: sku-1"),
        "{got}"
    );
    assert_eq!(s.stock(KEY_A, "sku-1").await, (1, 0), "nothing reserved");
    assert_eq!(s.stock(KEY_A, "sku-2").await, (3, 0), "nothing reserved");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.payments.stats().payment_intents, 0, "nothing charged");
    assert_eq!(s.shipping.stats().shipments, 0);
    assert_eq!(s.invoices(&id).await, 0);
}

async fn a_declined_card_rejects_the_order_and_restores_the_stock(t: TestDb) {
    let s = Saga::start(&t.db).await;
    s.set_stock(KEY_A, "sku-1", 5).await;
    s.set_stock(KEY_A, "sku-2", 3).await;
    let id = s
        .order(KEY_A, "dec-1", two_lines(), Some("pm_card_chargeDeclined"))
        .await;
    let got = s.until(KEY_A, &id, "rejected").await;
    assert_eq!(
        log(&got),
        [
            row("reserve", "forward", "succeeded"),
            row("charge", "forward", "failed"),
            row("reserve", "compensate", "succeeded"),
        ]
    );
    assert_eq!(s.stock(KEY_A, "sku-1").await, (5, 0), "restored");
    assert_eq!(s.stock(KEY_A, "sku-2").await, (3, 0), "restored");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pay = s.payments.stats();
    assert_eq!(
        pay.payment_intents_by_metadata["order_id"][&id].succeeded,
        0
    );
    assert_eq!(pay.refunds, 0, "nothing to refund");
    assert_eq!(s.shipping.stats().shipments, 0);
    assert_eq!(s.invoices(&id).await, 0);
}

async fn a_refused_shipment_refunds_the_charge_and_restores_the_stock(t: TestDb) {
    let s = Saga::start(&t.db).await;
    s.set_stock(KEY_A, "sku-1", 5).await;
    s.set_stock(KEY_A, UNDELIVERABLE, 2).await;
    let items = json!([{"sku": "sku-1", "quantity": 1}, {"sku": UNDELIVERABLE, "quantity": 1}]);
    let id = s.order(KEY_A, "ref-1", items, None).await;
    let got = s.until(KEY_A, &id, "rejected").await;
    assert_eq!(
        log(&got),
        [
            row("reserve", "forward", "succeeded"),
            row("charge", "forward", "succeeded"),
            row("ship", "forward", "failed"),
            row("charge", "compensate", "succeeded"),
            row("reserve", "compensate", "succeeded"),
        ]
    );
    assert_eq!(s.stock(KEY_A, "sku-1").await, (5, 0));
    assert_eq!(s.stock(KEY_A, UNDELIVERABLE).await, (2, 0));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (pay, ship) = (s.payments.stats(), s.shipping.stats());
    assert_eq!(
        pay.payment_intents_by_metadata["order_id"][&id].succeeded,
        1
    );
    assert_eq!(pay.refunds, 1, "the charge refunded once");
    assert_eq!((ship.booked, ship.refused), (0, 1), "no live shipment");
    assert_eq!(s.invoices(&id).await, 0);
}

/// Arms one latency fault at the payments simulator: its next charge answers after
/// [`SLOW_CHARGE_MS`].
async fn slow_next_charge(s: &Saga) {
    let res = s
        .client
        .post(format!("{}/_sim/faults/next", s.payments_srv.base))
        .json(&json!({"kind": "latency"}))
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success());
}

async fn a_cancel_before_the_pivot_compensates_and_after_it_answers_409(t: TestDb) {
    let s = Saga::start(&t.db).await;
    s.set_stock(KEY_A, "sku-1", 5).await;
    s.set_stock(KEY_A, "sku-2", 3).await;
    // Before the pivot: cancelled while its charge is in flight at the provider.
    slow_next_charge(&s).await;
    let id = s.order(KEY_A, "can-1", two_lines(), None).await;
    s.until_with(KEY_A, &id, |v| {
        v["fulfilment"]["steps"]
            .as_array()
            .is_some_and(|st| st.iter().any(|r| r["name"] == "charge"))
    })
    .await;
    assert_eq!(s.stock(KEY_A, "sku-1").await, (3, 2), "reserved");
    let (code, got) = s.cancel(KEY_A, &id).await;
    assert_eq!(code, 200, "{got}");
    assert!(
        ["compensating", "cancelled"].contains(&got["status"].as_str().unwrap()),
        "{got}"
    );
    let got = s.until(KEY_A, &id, "cancelled").await;
    assert_eq!(s.stock(KEY_A, "sku-1").await, (5, 0), "restored");
    assert_eq!(s.stock(KEY_A, "sku-2").await, (3, 0), "restored");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (pay, ship) = (s.payments.stats(), s.shipping.stats());
    let charged = pay.payment_intents_by_metadata["order_id"][&id].succeeded;
    assert_eq!(
        pay.refunds_by_payment_intent.values().sum::<u64>(),
        charged,
        "the late charge refunded: {got:#}"
    );
    assert_eq!(ship.shipments, 0, "nothing shipped");
    let (code, again) = s.cancel(KEY_A, &id).await;
    assert_eq!((code, again["status"].as_str()), (200, Some("cancelled")));

    // After the pivot: 409, and nothing undone.
    let done = s.order(KEY_A, "can-2", two_lines(), None).await;
    s.until(KEY_A, &done, "fulfilled").await;
    let (code, problem) = s.cancel(KEY_A, &done).await;
    assert_eq!(code, 409, "{problem}");
    assert_eq!(problem["type"], "urn:oncely:problem:order-not-cancellable");
    assert_eq!(s.get(KEY_A, &done).await.1["status"], "fulfilled");
    assert_eq!(s.stock(KEY_A, "sku-1").await, (3, 0));
}

/// An operator resolves a saga's charge whose outcome the runner could not learn (the
/// effect `unknown`: its runner died after sending, its lease ran out) as succeeded, as
/// `oncely effects resolve` does: the store records the resolution and its continuation
/// ([`oncely_effects::Continue::ByRunner`]), and the service's own runner — whose handler
/// is the saga's orchestrator, with the service's configuration — continues it (it has no
/// payments lane: a continuation calls no provider). The saga continues from the charge:
/// shipped and invoiced once, nothing sent to the payments provider.
async fn a_charge_resolved_by_an_operator_continues_its_saga(t: TestDb) {
    // No payments lane: the charge is enqueued and nothing calls it.
    let s = Saga::start_with(&t.db, false).await;
    s.set_stock(KEY_A, "sku-1", 5).await;
    s.set_stock(KEY_A, "sku-2", 3).await;
    let id = s.order(KEY_A, "op-1", two_lines(), None).await;
    let store = EffectStore::new(t.db.clone());
    let reference = format!("{id}:charge");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let charge = loop {
        let effects = store.list(None, 100).await.unwrap();
        if let Some(e) = effects.into_iter().find(|e| e.reference == reference) {
            break e;
        }
        assert!(tokio::time::Instant::now() < deadline, "no charge effect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    t.db.execute(
        oncely_sql::query("UPDATE oncely_effects SET state = 'unknown' WHERE id = $1")
            .bind(charge.id.as_str()),
    )
    .await
    .unwrap();
    let resolution = oncely_sql::Resolution {
        to: oncely_sql::EffectState::Succeeded,
        provider_id: Some("pi_seen_in_the_dashboard"),
        actor: "ops@acme",
        reason: "the charge is in the provider's dashboard",
    };
    oncely_effects::resolve_effect(
        &store,
        oncely_effects::Continue::ByRunner,
        &charge.id,
        &resolution,
        oncely_core::now_ms(),
    )
    .await
    .unwrap();
    let got = s.until(KEY_A, &id, "fulfilled").await;
    assert_eq!(
        log(&got),
        [
            row("reserve", "forward", "succeeded"),
            row("charge", "forward", "succeeded"),
            row("ship", "forward", "succeeded"),
            row("invoice", "forward", "succeeded"),
        ]
    );
    assert_eq!(s.stock(KEY_A, "sku-1").await, (3, 0));
    let booked = s.shipping.stats().by_merchant_reference[&format!("{id}:ship")];
    assert_eq!((booked.total, booked.booked), (1, 1));
    assert_eq!(s.invoices(&id).await, 1);
    assert_eq!(
        s.payments.stats().payment_intents,
        0,
        "nothing was sent to payments"
    );
}
