//! Issue 26 at the order service, on every backend: one charge and one shipment per order
//! whatever the payments or shipping provider answers, and no client told a final failure
//! while an object is live.
//!
//! - the payments endpoint answers a charge committed and then answered 503, 507, 520, 524
//!   or 409 as unknown, never `402 payment-declined`, and its retry finds the one charge
//!   (scenario 3);
//! - a retry sent to a percent-encoded path is resolved from the same order (scenario 4);
//! - a `503 payments-unavailable` frees the key at once, and another key's receipt is never
//!   replayed to it (scenario 7);
//! - with `--fulfilment saga` the endpoint never charges: the saga's charge is the order's
//!   one charge (scenario 1);
//! - a saga whose booking is found live in a carrier's word ships and is never refunded
//!   around the shipment (scenario 2).

use std::sync::Arc;
use std::time::Duration;

use oncely_effects::{StripeConfig, StripePayments};
use oncely_sim::{PaymentsConfig, PaymentsSim};
use oncely_testkit::TestDb;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::fulfilment::{Saga, SagaOptions};
use super::{config, serve_sim, start, Server, Sim, KEY_A};

const SK: &str = "sk_test_money_path";
/// The payments endpoint's lease: a retry after it asks the provider.
const LEASE: Duration = Duration::from_secs(2);

oncely_testkit::matrix! {
    tests: [
        a_charge_answered_with_any_5xx_or_409_after_it_committed_is_never_declined,
        a_retry_to_a_percent_encoded_path_is_resolved_from_the_same_order,
        a_payments_unavailable_answer_frees_the_key_and_another_keys_receipt_is_never_replayed,
        with_the_saga_the_payments_endpoint_never_charges_a_second_time,
        a_saga_booking_found_live_in_a_carrier_word_ships_and_is_never_refunded,
    ],
    cannot_apply: [],
}

async fn payments() -> (PaymentsSim, Sim) {
    let sim = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.to_owned()],
        ..PaymentsConfig::default()
    });
    let served = serve_sim(sim.router()).await;
    (sim, served)
}

async fn start_paying(t: &TestDb, base: &str) -> Server {
    let mut c = config();
    c.payments = Some(orders::PaymentsSettings {
        provider: Arc::new(
            StripePayments::new(StripeConfig {
                base_url: base.to_owned(),
                secret_key: SK.to_owned(),
                timeout: Duration::from_secs(1),
                search: false,
                settle_time: Duration::from_secs(1),
                ..StripeConfig::default()
            })
            .unwrap(),
        ),
        lease: LEASE,
    });
    start(&t.db, c).await
}

/// `POST {base}{path}` to a simulator's control endpoint.
async fn control(base: &str, path: &str, body: Value) {
    let res = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "{path} {body}: {}", res.status());
}

/// PaymentIntents at the simulator carrying `metadata[order_id] = order`: (all, succeeded).
fn intents_of(sim: &PaymentsSim, order: &str) -> (u64, u64) {
    sim.stats()
        .payment_intents_by_metadata
        .get("order_id")
        .and_then(|m| m.get(order))
        .map_or((0, 0), |c| (c.total, c.succeeded))
}

/// Pays `path` (`/v1/orders/{id}/payments`, spelled as given) with `key`.
async fn pay_path(server: &Server, path: &str, key: &str) -> (StatusCode, Value) {
    let res = server
        .client
        .post(format!("{}{path}", server.base))
        .bearer_auth(KEY_A)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    (res.status(), res.json().await.unwrap_or(Value::Null))
}

async fn pay(server: &Server, order: &str, key: &str) -> (StatusCode, Value) {
    pay_path(server, &format!("/v1/orders/{order}/payments"), key).await
}

/// Retries `key` on `path` until the answer is not a 409 (at most 15 s).
async fn pay_until_settled(server: &Server, path: &str, key: &str) -> (StatusCode, Value) {
    for _ in 0..60 {
        let (status, body) = pay_path(server, path, key).await;
        if status != StatusCode::CONFLICT {
            return (status, body);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("{path} with {key} stayed 409");
}

/// `GET /v1/operations/{key}` as tenant A.
async fn operation(server: &Server, key: &str) -> Value {
    server
        .client
        .get(format!("{}/v1/operations/{key}", server.base))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap()
}

async fn new_order(server: &Server, ext: &str) -> String {
    let created = server
        .post_raw(
            KEY_A,
            Some(&format!("order-{ext}")),
            super::order(ext, 1200).to_string(),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED);
    created.id()
}

async fn a_charge_answered_with_any_5xx_or_409_after_it_committed_is_never_declined(t: TestDb) {
    let (sim, srv) = payments().await;
    let server = start_paying(&t, &srv.base).await;
    for status in [503_u16, 507, 520, 524, 409] {
        control(
            &srv.base,
            "/_sim/faults",
            json!({"error_after_status": status}),
        )
        .await;
        control(
            &srv.base,
            "/_sim/faults/next",
            json!({"kind": "error_after"}),
        )
        .await;
        let id = new_order(&server, &format!("after-{status}")).await;
        let (first, body) = pay(&server, &id, &format!("pay-{status}")).await;
        assert_ne!(
            first,
            StatusCode::PAYMENT_REQUIRED,
            "a {status} is no refusal: {body}"
        );
        assert_eq!(
            (first, body["type"].as_str()),
            (
                StatusCode::BAD_GATEWAY,
                Some("urn:oncely:problem:payment-outcome-unknown")
            ),
            "after a {status}: {body}"
        );
        let path = format!("/v1/orders/{id}/payments");
        let (again, body) = pay_until_settled(&server, &path, &format!("pay-{status}")).await;
        assert_eq!(
            again,
            StatusCode::CREATED,
            "the retry finds the charge: {body}"
        );
        let (other, body) = pay(&server, &id, &format!("pay-{status}-other")).await;
        assert_eq!(other, StatusCode::CONFLICT, "{body}");
        assert_eq!(intents_of(&sim, &id), (1, 1), "one charge after a {status}");
    }
}

async fn a_retry_to_a_percent_encoded_path_is_resolved_from_the_same_order(t: TestDb) {
    let (sim, srv) = payments().await;
    let server = start_paying(&t, &srv.base).await;
    let id = new_order(&server, "encoded").await;
    // The same order id with every `-` sent as `%2D`: the router decodes it.
    let path = format!("/v1/orders/{}/payments", id.replace('-', "%2D"));
    control(
        &srv.base,
        "/_sim/faults/next",
        json!({"kind": "error_after"}),
    )
    .await;
    let (first, body) = pay_path(&server, &path, "enc-1").await;
    assert_eq!(first, StatusCode::BAD_GATEWAY, "{body}");
    let (again, body) = pay_until_settled(&server, &path, "enc-1").await;
    assert_eq!(
        again,
        StatusCode::CREATED,
        "found by its status check: {body}"
    );
    assert_eq!(body["order_id"], id.as_str());
    for _ in 0..2 {
        let (replay, _) = pay_path(&server, &path, "enc-1").await;
        assert_eq!(replay, StatusCode::CREATED);
    }
    assert_eq!(intents_of(&sim, &id), (1, 1));
    let op = operation(&server, "enc-1").await;
    let evidence = op["evidence"].as_array().unwrap();
    assert!(
        evidence
            .iter()
            .any(|e| e["kind"] == "status" && e["outcome"] == "found"),
        "{op:#}"
    );
}

async fn a_payments_unavailable_answer_frees_the_key_and_another_keys_receipt_is_never_replayed(
    t: TestDb,
) {
    let (_sim, srv) = payments().await;
    let server = start_paying(&t, &srv.base).await;
    let id = new_order(&server, "unavailable").await;
    control(
        &srv.base,
        "/_sim/faults/next",
        json!({"kind": "rate_limit"}),
    )
    .await;
    let (first, body) = pay(&server, &id, "free-1").await;
    assert_eq!(first, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["type"], "urn:oncely:problem:payments-unavailable");
    // "Nothing was charged, retry with the same key": at once, not after a lease, and as
    // a fresh run — no status check of a record left `unknown`.
    let (again, body) = pay(&server, &id, "free-1").await;
    assert_eq!(again, StatusCode::CREATED, "{body}");
    let op = operation(&server, "free-1").await;
    let evidence: Vec<String> = op["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            format!(
                "{}:{}",
                e["kind"].as_str().unwrap(),
                e["outcome"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(evidence, ["call:not_charged", "call:succeeded"], "{op:#}");

    // Another order: the first key is refused, another key pays, then the first key's
    // retry must not get the other key's receipt as its own.
    let id = new_order(&server, "two-keys").await;
    control(
        &srv.base,
        "/_sim/faults/next",
        json!({"kind": "rate_limit"}),
    )
    .await;
    assert_eq!(
        pay(&server, &id, "first-key").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (paid, receipt) = pay(&server, &id, "second-key").await;
    assert_eq!(paid, StatusCode::CREATED, "{receipt}");
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    let (retry, body) = pay(&server, &id, "first-key").await;
    assert_eq!(
        (retry, body["type"].as_str()),
        (
            StatusCode::CONFLICT,
            Some("urn:oncely:problem:order-already-paid")
        ),
        "{body}"
    );
    assert_eq!(body["payment_intent"], receipt["payment_intent"]);
}

async fn with_the_saga_the_payments_endpoint_never_charges_a_second_time(t: TestDb) {
    let s = Saga::start_opts(
        &t.db,
        SagaOptions {
            endpoint: true,
            ..SagaOptions::default()
        },
    )
    .await;
    s.set_stock(super::fulfilment::KEY_A, "sku-1", 5).await;
    let items = json!([{"sku": "sku-1", "quantity": 1}]);
    let id = s
        .order(super::fulfilment::KEY_A, "saga-pay", items, None)
        .await;
    let pay = |key: &'static str| {
        let (client, base, id) = (s.client.clone(), s.base.clone(), id.clone());
        async move {
            let res = client
                .post(format!("{base}/v1/orders/{id}/payments"))
                .bearer_auth(super::fulfilment::KEY_A)
                .header("idempotency-key", key)
                .send()
                .await
                .unwrap();
            (
                res.status(),
                res.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    // Before the saga charged, and after: the saga holds the order's charge.
    let (before, body) = pay("saga-pay-1").await;
    assert_eq!(before, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["type"], "urn:oncely:problem:order-charged-by-flow");
    s.until(super::fulfilment::KEY_A, &id, "fulfilled").await;
    let (after, body) = pay("saga-pay-2").await;
    assert_eq!(after, StatusCode::CONFLICT, "{body}");
    assert_eq!(
        intents_of(&s.payments, &id),
        (1, 1),
        "one live charge for the order"
    );
}

async fn a_saga_booking_found_live_in_a_carrier_word_ships_and_is_never_refunded(t: TestDb) {
    let s = Saga::start_opts(
        &t.db,
        SagaOptions {
            live_status: Some("label_created".to_owned()),
            ..SagaOptions::default()
        },
    )
    .await;
    s.set_stock(super::fulfilment::KEY_A, "sku-1", 5).await;
    // The booking commits and its answer is lost: the status check finds `label_created`.
    control(
        &s.shipping_srv.base,
        "/_sim/faults/next",
        json!({"kind": "drop_after"}),
    )
    .await;
    let items = json!([{"sku": "sku-1", "quantity": 1}]);
    let id = s
        .order(super::fulfilment::KEY_A, "saga-lc", items, None)
        .await;
    let got = s
        .until_with(super::fulfilment::KEY_A, &id, |v| {
            v["status"] == "fulfilled" || v["status"] == "cancelled" || v["status"] == "rejected"
        })
        .await;
    assert_eq!(got["status"], "fulfilled", "{got:#}");
    assert_eq!(
        s.payments.stats().refunds,
        0,
        "nothing refunded around a live shipment"
    );
    let shipped = s.shipping.stats().by_merchant_reference;
    assert_eq!(
        shipped.values().map(|c| c.total).sum::<u64>(),
        1,
        "{shipped:?}"
    );
    assert_eq!(shipped.values().map(|c| c.cancelled).sum::<u64>(), 0);
}
