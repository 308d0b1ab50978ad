//! `POST /v1/orders/{id}/payments` (multi-phase) and `GET /v1/operations/{key}` over real
//! HTTP against the payments simulator, on every backend: one charge per order counted at
//! the simulator, replays, the status resource with its evidence and tenant scope, a
//! declined card, the business guard against a second key, the 503 problem without a
//! provider, and reconciliation seeing the endpoint's charges as local intents. The kill
//! tests (a process killed after or before the call) are `oncely`'s CLI tests.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely_effects::{ReconcileConfig, Reconciler, StripeConfig, StripePayments};
use oncely_sim::{PaymentsConfig, PaymentsSim};
use oncely_sql::EffectStore;
use oncely_testkit::TestDb;
use reqwest::StatusCode;
use serde_json::Value;

use super::{config, order, serve_sim, start, Server, Sim, KEY_A, KEY_B};

const SK: &str = "sk_test_payments_endpoint";

oncely_testkit::matrix! {
    tests: [
        a_payment_charges_the_order_once_and_its_retry_replays_with_the_operation_shown,
        a_declined_card_is_stored_as_402_and_a_new_key_may_pay_the_order,
        without_a_payments_provider_the_route_answers_a_503_problem,
    ],
    cannot_apply: [],
}

/// The payments simulator on `127.0.0.1:0`.
async fn payments_sim() -> (PaymentsSim, Sim) {
    let sim = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.to_owned()],
        search_lag: Duration::from_millis(100),
        ..PaymentsConfig::default()
    });
    let served = serve_sim(sim.router()).await;
    (sim, served)
}

fn stripe(base: &str) -> StripePayments {
    StripePayments::new(StripeConfig {
        base_url: base.to_owned(),
        secret_key: SK.to_owned(),
        timeout: Duration::from_secs(5),
        search: false,
        ..StripeConfig::default()
    })
    .unwrap()
}

async fn start_paying(t: &TestDb, base: &str) -> Server {
    let mut c = config();
    c.payments = Some(orders::PaymentsSettings {
        provider: Arc::new(stripe(base)),
        lease: Duration::from_secs(10),
    });
    start(&t.db, c).await
}

impl Server {
    async fn pay(&self, api_key: &str, order: &str, key: &str, body: &str) -> super::Answer {
        let res = self
            .client
            .post(format!("{}/v1/orders/{order}/payments", self.base))
            .bearer_auth(api_key)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let h = |n: &str| res.headers().get(n).map(|v| v.to_str().unwrap().to_owned());
        let (status, replayed, retry_after, location) = (
            res.status(),
            h("idempotent-replayed").is_some(),
            h("retry-after"),
            h("location"),
        );
        super::Answer {
            status,
            replayed,
            retry_after,
            location,
            body: res.bytes().await.unwrap().to_vec(),
        }
    }

    async fn operation(&self, api_key: &str, key: &str) -> (StatusCode, Value) {
        let res = self
            .client
            .get(format!("{}/v1/operations/{key}", self.base))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap();
        (res.status(), res.json().await.unwrap_or(Value::Null))
    }

    async fn new_order(&self, ext: &str, amount: i64) -> String {
        let created = self
            .post_raw(
                KEY_A,
                Some(&format!("order-{ext}")),
                order(ext, amount).to_string(),
            )
            .await;
        assert_eq!(created.status, StatusCode::CREATED);
        created.id()
    }
}

async fn a_payment_charges_the_order_once_and_its_retry_replays_with_the_operation_shown(
    t: TestDb,
) {
    let (sim, srv) = payments_sim().await;
    let server = start_paying(&t, &srv.base).await;
    let id = server.new_order("pay-1", 2500).await;
    let first = server.pay(KEY_A, &id, "pay-key-1", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.json());
    let intent = first.json()["payment_intent"].as_str().unwrap().to_owned();
    assert!(intent.starts_with("pi_"), "{}", first.json());
    assert_eq!(first.json()["reference"], format!("order:{id}:payment"));
    let again = server.pay(KEY_A, &id, "pay-key-1", "{}").await;
    assert!(again.replayed);
    assert_eq!((again.status, &again.body), (first.status, &first.body));
    // Another key for the same order: the business guard, nothing sent.
    let other = server.pay(KEY_A, &id, "pay-key-2", "{}").await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(
        other.json()["type"],
        "urn:oncely:problem:order-already-paid"
    );
    assert_eq!(other.json()["payment_intent"], intent.as_str());

    let stats = sim.stats();
    assert_eq!(stats.payment_intents, 1, "one charge at the provider");
    let reference = format!("order:{id}:payment");
    assert_eq!(
        stats.payment_intents_by_metadata["invoice_id"][&reference].succeeded,
        1
    );
    assert_eq!(stats.payment_intents_by_metadata["order_id"][&id].total, 1);

    let (code, op) = server.operation(KEY_A, "pay-key-1").await;
    assert_eq!(code, StatusCode::OK, "{op}");
    assert_eq!(op["state"], "succeeded", "{op}");
    assert_eq!(op["attempts"], 1, "{op}");
    assert_eq!(op["response_status"], 201, "{op}");
    assert_eq!(op["payment"]["payment_intent"], intent.as_str(), "{op}");
    let evidence = op["evidence"].as_array().unwrap();
    assert_eq!(evidence.len(), 1, "{op}");
    assert_eq!(
        (
            evidence[0]["kind"].as_str(),
            evidence[0]["outcome"].as_str()
        ),
        (Some("call"), Some("succeeded"))
    );
    // Tenant-scoped: the other tenant does not see it.
    assert_eq!(
        server.operation(KEY_B, "pay-key-1").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        server.operation(KEY_A, "no-such-key").await.0,
        StatusCode::NOT_FOUND
    );
    // Another tenant cannot pay tenant A's order.
    let foreign = server.pay(KEY_B, &id, "pay-key-b", "{}").await;
    assert_eq!(foreign.status, StatusCode::NOT_FOUND);
    assert_eq!(sim.stats().payment_intents, 1);

    // Reconciliation takes the endpoint's charge as a local intent: nothing to report.
    let reconciler = Reconciler::new(
        Arc::new(stripe(&srv.base)),
        EffectStore::new(t.db.clone()),
        Arc::new(orders::OrderEffects::new(orders::ORDERS_TOPIC)),
        ReconcileConfig::new("charge"),
    )
    .with_source(Arc::new(orders::PaymentsSource::new(t.db.clone())));
    let report = reconciler
        .run(SystemTime::now() - Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(
        report.discrepancies.is_empty(),
        "{:?}",
        report.discrepancies
    );
    assert_eq!(report.run.intents, 1);
}

async fn a_declined_card_is_stored_as_402_and_a_new_key_may_pay_the_order(t: TestDb) {
    let (sim, srv) = payments_sim().await;
    let server = start_paying(&t, &srv.base).await;
    let id = server.new_order("pay-declined", 900).await;
    let body = r#"{"payment_method": "pm_card_chargeDeclined"}"#;
    let declined = server.pay(KEY_A, &id, "declined-1", body).await;
    assert_eq!(
        declined.status,
        StatusCode::PAYMENT_REQUIRED,
        "{}",
        declined.json()
    );
    assert_eq!(
        declined.json()["type"],
        "urn:oncely:problem:payment-declined"
    );
    let replay = server.pay(KEY_A, &id, "declined-1", body).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, declined.body);
    let (_, op) = server.operation(KEY_A, "declined-1").await;
    assert_eq!(op["state"], "failed", "{op}");
    assert_eq!(op["payment"]["state"], "declined", "{op}");
    // Not JSON of the expected shape: 422, nothing stored, nothing sent.
    let bad = server.pay(KEY_A, &id, "bad-body", r#"{"amount": 5}"#).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY);
    let paid = server.pay(KEY_A, &id, "declined-2", "").await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.json());
    let stats = sim.stats();
    let reference = format!("order:{id}:payment");
    let counts = &stats.payment_intents_by_metadata["invoice_id"][&reference];
    assert_eq!(
        (counts.total, counts.succeeded),
        (2, 1),
        "one declined, one paid"
    );
    let (_, op) = server.operation(KEY_A, "declined-2").await;
    assert_eq!(op["payment"]["state"], "succeeded", "{op}");
}

async fn without_a_payments_provider_the_route_answers_a_503_problem(t: TestDb) {
    let server = start(&t.db, config()).await;
    let id = server.new_order("pay-none", 100).await;
    let res = server.pay(KEY_A, &id, "none-1", "{}").await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        res.json()["type"],
        "urn:oncely:problem:payments-not-configured"
    );
    let unauthenticated = server
        .client
        .post(format!("{}/v1/orders/{id}/payments", server.base))
        .header("idempotency-key", "none-2")
        .send()
        .await
        .unwrap();
    assert_eq!(unauthenticated.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        server.operation(KEY_A, "none-1").await.0,
        StatusCode::NOT_FOUND
    );
}
