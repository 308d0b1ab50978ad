//! One run of plans: the service under a flow with its proxies and simulators ([`Rig`]),
//! the orders and the endpoint's client, then each order's outcome counted at the provider
//! and checked against the invariants.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncely_effects::{Provider, ShippingClient, ShippingConfig};
use oncely_saga::SagaOperator;
use oncely_sim::{PaymentsConfig, PaymentsSim, ShippingSim};
use oncely_sql::{Database, EffectStore};
use oncely_testkit::{HttpFaultProxy, ProxyOptions, TestDb};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::super::{serve_sim, Sim};
use super::services::{spawn_choreography, spawn_saga, stripe};
use super::{
    env_u64, FlowKind, Kind, Plan, HIDE_WINDOW, KEY, PROVIDER_TIMEOUT, SETTLE, SK, UNDELIVERABLE,
};

/// The service under one flow with its proxies and simulators.
struct Rig {
    db: Database,
    base: String,
    client: reqwest::Client,
    payments: PaymentsSim,
    payments_srv: Sim,
    shipping: ShippingSim,
    _shipping_srv: Sim,
    pay_proxy: HttpFaultProxy,
    ship_proxy: HttpFaultProxy,
    stop: CancellationToken,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Rig {
    async fn start(db: &Database, flow: FlowKind, kind: Kind) -> Self {
        orders::migrate(db).await.unwrap();
        let payments = PaymentsSim::new(PaymentsConfig {
            secret_keys: vec![SK.to_owned()],
            search_lag: Duration::ZERO,
            ..PaymentsConfig::default()
        });
        let shipping = ShippingSim::new(oncely_sim::ShippingConfig {
            undeliverable_skus: [UNDELIVERABLE.to_owned()].into(),
            ..oncely_sim::ShippingConfig::default()
        });
        let payments_srv = serve_sim(payments.router()).await;
        let shipping_srv = serve_sim(shipping.router()).await;
        let options = ProxyOptions {
            strip_idempotency_key: kind == Kind::Keyless,
            hide_window: HIDE_WINDOW,
            ..ProxyOptions::default()
        };
        let pay_proxy = HttpFaultProxy::start(&payments_srv.base, options.clone()).await;
        let ship_proxy = HttpFaultProxy::start(&shipping_srv.base, options).await;
        let stop = CancellationToken::new();
        let mut config = orders::AppConfig {
            api_keys: orders::parse_api_keys(&format!("{KEY}=tenant-a")).unwrap(),
            ..orders::AppConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let providers = || -> Vec<Arc<dyn Provider>> {
            vec![
                Arc::new(stripe(&pay_proxy.base_url(), kind)),
                Arc::new(
                    ShippingClient::new(ShippingConfig {
                        base_url: ship_proxy.base_url(),
                        timeout: PROVIDER_TIMEOUT,
                        // The keyless provider's settle window, as the payments one's.
                        settle_time: SETTLE,
                        ..ShippingConfig::default()
                    })
                    .unwrap(),
                ),
            ]
        };
        let fulfilment = orders::FulfilmentConfig {
            mode: orders::Fulfilment::Saga,
            charge_timeout: Duration::from_secs(6),
            ship_timeout: Duration::from_secs(6),
        };
        match flow {
            FlowKind::Endpoint => {
                config.payments = Some(orders::PaymentsSettings {
                    provider: Arc::new(stripe(&pay_proxy.base_url(), kind)),
                    lease: Duration::from_secs(3),
                });
                config.lease_sweep_interval = Duration::from_millis(500);
            }
            FlowKind::Choreography => {}
            FlowKind::Saga => config.fulfilment = fulfilment.clone(),
        }
        let serving = orders::serve(listener, db.clone(), config, stop.clone().cancelled_owned());
        tokio::spawn(serving);
        match flow {
            FlowKind::Endpoint => {}
            FlowKind::Choreography => spawn_choreography(db, &stop, providers()).await,
            FlowKind::Saga => spawn_saga(db, &stop, &fulfilment, providers()).await,
        }
        let rig = Self {
            db: db.clone(),
            base,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
            payments,
            payments_srv,
            shipping,
            _shipping_srv: shipping_srv,
            pay_proxy,
            ship_proxy,
            stop,
        };
        if flow == FlowKind::Saga {
            rig.stock_up().await;
        }
        rig
    }

    /// Stock enough of every SKU for any run.
    async fn stock_up(&self) {
        for sku in ["sku-1", "sku-2", UNDELIVERABLE] {
            let res = self
                .client
                .put(format!("{}/v1/stock/{sku}", self.base))
                .bearer_auth(KEY)
                .json(&json!({ "available": 1_000_000 }))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 200);
        }
    }

    /// Creates the order of `plan`; its id.
    async fn order(&self, plan: &Plan) -> String {
        let mut items = vec![json!({"sku": "sku-1", "quantity": 2})];
        if plan.undeliverable {
            items.push(json!({"sku": UNDELIVERABLE, "quantity": 1}));
        }
        let mut body = json!({"source": "shop", "external_ref": format!("fs-{}", plan.seed),
            "customer_id": "c-1", "items": items, "amount_minor": 2500, "currency": "EUR"});
        if plan.declined {
            body["payment_method"] = "pm_card_chargeDeclined".into();
        }
        loop {
            let res = self
                .client
                .post(format!("{}/v1/orders", self.base))
                .bearer_auth(KEY)
                .header("Idempotency-Key", format!("fs-{}", plan.seed))
                .json(&body)
                .send()
                .await;
            match res {
                Ok(r) if r.status().is_success() => {
                    let v: Value = r.json().await.unwrap();
                    return v["id"].as_str().unwrap().to_owned();
                }
                // A busy SQLite or pool: the same key again.
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// The endpoint's client: pays with one key, retrying with it while the answer says
    /// to, until a final answer or `deadline`.
    async fn pay(&self, order: &str, plan: &Plan, deadline: Instant) -> ClientSaw {
        let body = if plan.declined {
            r#"{"payment_method": "pm_card_chargeDeclined"}"#
        } else {
            "{}"
        };
        let mut answers = Vec::new();
        loop {
            let res = self
                .client
                .post(format!("{}/v1/orders/{order}/payments", self.base))
                .bearer_auth(KEY)
                .header("idempotency-key", format!("pay-{}", plan.seed))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await;
            let (code, kind) = match res {
                Ok(r) => {
                    let code = r.status().as_u16();
                    let v: Value = r.json().await.unwrap_or(Value::Null);
                    (code, v["type"].as_str().unwrap_or_default().to_owned())
                }
                Err(e) => (0, format!("transport: {e}")),
            };
            answers.push(format!("{code} {kind}"));
            let saw = match code {
                200..=299 => Some(ClientSaw::Success(answers.clone())),
                409 | 429 | 0 | 500..=599 => None,
                _ => Some(ClientSaw::FinalFailure(answers.clone())),
            };
            if let Some(s) = saw {
                return s;
            }
            if Instant::now() > deadline {
                return ClientSaw::GaveUp(answers);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// What the endpoint's client was told, every answer in order (status and problem type).
#[derive(Debug, Clone)]
enum ClientSaw {
    Success(Vec<String>),
    FinalFailure(Vec<String>),
    GaveUp(Vec<String>),
}

impl ClientSaw {
    fn answers(&self) -> &[String] {
        match self {
            Self::Success(a) | Self::FinalFailure(a) | Self::GaveUp(a) => a,
        }
    }
}

/// What settled for one order, at the provider and in the service.
#[allow(
    clippy::struct_excessive_bools,
    reason = "each flag is one fact the invariants read"
)]
#[derive(Debug, Default)]
struct Outcome {
    live_charges: Vec<String>,
    all_charges: Vec<String>,
    live_shipments: u64,
    all_shipments: u64,
    effects: Vec<String>,
    failed_charge_effect: bool,
    failed_ship_effect: bool,
    in_review: bool,
    unsettled: bool,
    saga: Option<String>,
    client: Option<ClientSaw>,
}

/// Runs `plans` (one order each, all at once) under `flow` against a provider of `kind`,
/// then checks every order; panics with every violation found.
pub(super) async fn run_plans(t: TestDb, flow: FlowKind, kind: Kind, plans: Vec<Plan>, test: &str) {
    let started = Instant::now();
    let rig = Arc::new(Rig::start(&t.db, flow, kind).await);
    let settle_deadline =
        Duration::from_secs(env_u64("ONCELY_FAULT_SPACE_SETTLE_SECS").unwrap_or(120));
    // Orders are created a few at a time; each one's schedule is set as soon as its id is
    // known (its requests wait at the proxy until then).
    let mut ids = Vec::with_capacity(plans.len());
    let mut clients = Vec::new();
    for chunk in plans.chunks(16) {
        let created = futures_util::future::join_all(chunk.iter().map(|p| rig.order(p))).await;
        for (plan, id) in chunk.iter().zip(created) {
            rig.pay_proxy.plan(&id, plan.payments.clone());
            rig.ship_proxy.plan(&id, plan.shipping.clone());
            if flow == FlowKind::Endpoint {
                let (rig, id, plan) = (rig.clone(), id.clone(), plan.clone());
                let deadline = Instant::now() + settle_deadline / 2;
                clients.push(tokio::spawn(
                    async move { rig.pay(&id, &plan, deadline).await },
                ));
            }
            ids.push(id);
        }
    }
    let mut saw = Vec::new();
    for c in clients {
        saw.push(Some(c.await.unwrap()));
    }
    saw.resize(ids.len(), None);
    let settled = wait_settled(&rig, flow, &ids, started + settle_deadline).await;
    // Let detached slow commits land before counting.
    tokio::time::sleep(Duration::from_millis(2_800)).await;
    let outcomes = outcomes(&rig, flow, &ids, plans.iter().map(|p| p.seed), saw).await;
    let elapsed = started.elapsed();
    let details = env_u64("ONCELY_FAULT_SPACE_DETAILS").unwrap_or(20) as usize;
    let mut report = String::new();
    let mut classes: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
    for ((plan, id), o) in plans.iter().zip(&ids).zip(&outcomes) {
        let found = violations(flow, o, settled);
        if found.is_empty() {
            continue;
        }
        for v in &found {
            classes.entry(v).or_default().push(plan.seed);
        }
        if classes.values().map(Vec::len).sum::<usize>() <= details {
            let _ = writeln!(
                report,
                "\n== order {id} (schedule seed {}): {}\n   replay: ONCELY_FAULT_SPACE_SEED={} \
                 ONCELY_FAULT_SPACE_SCHEDULES=1 cargo test -p orders --test acceptance -- {test} --exact\n   \
                 plan: {plan:?}\n   outcome: {o:?}\n   client answers: {:?}\n   payments proxy:\n     {}\n   shipping proxy:\n     {}",
                plan.seed,
                found.join(", "),
                plan.seed,
                o.client.as_ref().map(ClientSaw::answers),
                rig.pay_proxy.log(id).join("\n     "),
                rig.ship_proxy.log(id).join("\n     "),
            );
        }
    }
    let total: usize = classes.values().map(Vec::len).sum();
    println!(
        "{test}: {} schedules in {:.1} s, settled: {settled}, {total} violations {:?}",
        plans.len(),
        elapsed.as_secs_f64(),
        classes
            .iter()
            .map(|(k, v)| format!("{k}×{} (seeds {:?})", v.len(), &v[..v.len().min(5)]))
            .collect::<Vec<_>>()
    );
    assert!(total == 0, "{test}: {total} violations{report}");
}

/// Waits until every order's effects and saga are in a final state (or review).
async fn wait_settled(rig: &Rig, flow: FlowKind, ids: &[String], deadline: Instant) -> bool {
    let store = EffectStore::new(rig.db.clone());
    let sagas = SagaOperator::new(rig.db.clone());
    loop {
        let effects = store.list(None, 1_000_000).await.unwrap();
        let open = effects.iter().any(|e| {
            !matches!(
                e.state_word.as_str(),
                "succeeded" | "failed" | "needs_review"
            )
        });
        let done = match flow {
            FlowKind::Endpoint => true,
            FlowKind::Choreography => {
                let charges = effects.iter().filter(|e| e.provider == orders::PAYMENTS);
                let paid = charges
                    .clone()
                    .filter(|e| e.state_word == "succeeded")
                    .count();
                let ships = effects
                    .iter()
                    .filter(|e| e.provider == orders::SHIPPING)
                    .count();
                charges.count() == ids.len() && ships == paid
            }
            FlowKind::Saga => {
                let all = sagas.list(None, None, 1_000_000).await.unwrap();
                all.len() == ids.len()
                    && all.iter().all(|s| {
                        matches!(
                            s.state.as_str(),
                            "completed" | "compensated" | "needs_review"
                        )
                    })
            }
        };
        if done && !open {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Each order's outcome, counted at the provider (directly, not through the proxy) and
/// read from the service's tables.
async fn outcomes(
    rig: &Rig,
    flow: FlowKind,
    ids: &[String],
    seeds: impl Iterator<Item = u64>,
    saw: Vec<Option<ClientSaw>>,
) -> Vec<Outcome> {
    let intents = oncely_testkit::localstripe_payment_intents(&rig.payments_srv.base, SK).await;
    let refunds = rig.payments.stats().refunds_by_payment_intent;
    let ships = rig.shipping.stats().by_merchant_reference;
    let effects = EffectStore::new(rig.db.clone())
        .list(None, 1_000_000)
        .await
        .unwrap();
    let sagas: BTreeMap<String, String> = SagaOperator::new(rig.db.clone())
        .list(None, None, 1_000_000)
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.id, s.state.as_str().to_owned()))
        .collect();
    let mut out = Vec::new();
    for ((id, seed), saw) in ids.iter().zip(seeds).zip(saw) {
        let mut o = Outcome {
            client: saw,
            saga: sagas.get(id).cloned(),
            ..Outcome::default()
        };
        for pi in intents
            .iter()
            .filter(|pi| pi["metadata"]["order_id"] == id.as_str())
        {
            let pid = pi["id"].as_str().unwrap_or_default().to_owned();
            let refunded = refunds.get(&pid).copied().unwrap_or(0) > 0;
            o.all_charges.push(format!(
                "{pid}:{}{}",
                pi["status"].as_str().unwrap_or("?"),
                if refunded { ":refunded" } else { "" }
            ));
            if pi["status"] == "succeeded" && !refunded {
                o.live_charges.push(pid);
            }
        }
        let reference = match flow {
            FlowKind::Saga => format!("{id}:ship"),
            _ => id.clone(),
        };
        if let Some(c) = ships.get(&reference) {
            o.live_shipments = c.booked;
            o.all_shipments = c.total;
        }
        for e in effects
            .iter()
            .filter(|e| e.reference.contains(id.as_str()) || e.request.contains(id.as_str()))
        {
            o.effects.push(format!(
                "{}/{} {} attempts={} checks={} err={:?}",
                e.provider, e.operation, e.state_word, e.attempts, e.checks, e.last_error
            ));
            match e.state_word.as_str() {
                "needs_review" => o.in_review = true,
                "succeeded" | "failed" => {}
                _ => o.unsettled = true,
            }
            if e.state_word == "failed" {
                match (e.provider.as_str(), e.operation.as_str()) {
                    (orders::PAYMENTS, "charge") => o.failed_charge_effect = true,
                    (orders::SHIPPING, "book") => o.failed_ship_effect = true,
                    _ => {}
                }
            }
        }
        match o.saga.as_deref() {
            Some("needs_review") => o.in_review = true,
            Some("completed" | "compensated") | None => {}
            Some(_) => o.unsettled = true,
        }
        if flow == FlowKind::Endpoint {
            if let Some(ClientSaw::GaveUp(_)) = &o.client {
                let state = operation_state(rig, &format!("pay-{seed}")).await;
                o.in_review = state == "unknown";
                o.unsettled = state == "processing";
                o.effects.push(format!("operation state {state}"));
            }
        }
        out.push(o);
    }
    out
}

/// The state of the endpoint's operation under `key` as `GET /v1/operations/{key}` shows
/// it (`processing`, `succeeded`, `failed`, `unknown`), or the status when it shows none.
async fn operation_state(rig: &Rig, key: &str) -> String {
    let res = rig
        .client
        .get(format!("{}/v1/operations/{key}", rig.base))
        .bearer_auth(KEY)
        .send()
        .await;
    match res {
        Ok(r) => {
            let code = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            v["state"]
                .as_str()
                .map_or_else(|| format!("status {code}"), str::to_owned)
        }
        Err(e) => format!("transport: {e}"),
    }
}

/// The invariants one order's outcome breaks, by name.
fn violations(flow: FlowKind, o: &Outcome, settled: bool) -> Vec<&'static str> {
    let mut v = Vec::new();
    let charges = o.live_charges.len();
    if charges > 1 {
        v.push("two_live_charges");
    }
    if o.live_shipments > 1 {
        v.push("two_live_shipments");
    }
    if o.failed_charge_effect && charges > 0 {
        v.push("charge_effect_failed_while_its_charge_is_live");
    }
    if o.failed_ship_effect && o.live_shipments > 0 {
        v.push("booking_effect_failed_while_its_shipment_is_live");
    }
    if o.unsettled {
        v.push(if settled {
            "left_unsettled"
        } else {
            "did_not_settle"
        });
    }
    match flow {
        FlowKind::Endpoint => match &o.client {
            Some(ClientSaw::FinalFailure(_)) if charges > 0 => {
                v.push("client_told_final_failure_while_a_charge_is_live");
            }
            Some(ClientSaw::Success(_)) if charges == 0 => {
                v.push("client_told_success_with_no_live_charge");
            }
            Some(ClientSaw::GaveUp(_)) if !o.in_review && !o.unsettled => {
                v.push("client_left_without_an_answer_and_nothing_in_review");
            }
            _ => {}
        },
        FlowKind::Choreography | FlowKind::Saga => {
            let fulfilled = charges == 1 && o.live_shipments == 1;
            let compensated = charges == 0 && o.live_shipments == 0;
            if !fulfilled && !compensated && !o.in_review && !o.unsettled {
                v.push("neither_fulfilled_nor_compensated_nor_in_review");
            }
            if o.saga.as_deref() == Some("completed") && !fulfilled {
                v.push("saga_completed_without_both_live");
            }
            // `GET /v1/orders/{id}` then says `rejected` or `cancelled`: a final failure.
            if o.saga.as_deref() == Some("compensated") && !compensated {
                v.push("saga_compensated_while_a_charge_or_shipment_is_live");
            }
        }
    }
    v
}
