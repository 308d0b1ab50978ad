//! What every test here shares: the secret keys, the simulators served on 127.0.0.1:0, and
//! the requests, answers and provider counts the tests read.

use std::time::Duration;

use oncely_sim::{serve, FaultConfig, PaymentsConfig, PaymentsSim, ShippingConfig, ShippingSim};
use serde_json::{json, Value};

pub(crate) const SK: &str = "sk_test_sim_tests";
pub(crate) const SK_OTHER: &str = "sk_test_sim_other";

pub(crate) async fn listen(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, router, std::future::pending()));
    format!("http://{addr}")
}

pub(crate) fn payments_config() -> PaymentsConfig {
    PaymentsConfig {
        secret_keys: vec![SK.into(), SK_OTHER.into()],
        search_lag: Duration::from_millis(400),
        faults: FaultConfig {
            late_ms: 1500,
            latency_ms: 300,
            retry_after_secs: 3,
            seed: Some(1),
            ..FaultConfig::default()
        },
    }
}

pub(crate) async fn payments() -> (PaymentsSim, String) {
    let sim = PaymentsSim::new(payments_config());
    let base = listen(sim.router()).await;
    (sim, base)
}

pub(crate) async fn shipping() -> (ShippingSim, String) {
    let sim = ShippingSim::new(ShippingConfig {
        undeliverable_skus: ["sku-oversize".to_owned()].into(),
        faults: FaultConfig {
            late_ms: 1500,
            ..FaultConfig::default()
        },
        ..ShippingConfig::default()
    });
    let base = listen(sim.router()).await;
    (sim, base)
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::new()
}

pub(crate) fn intent_form(invoice: &str) -> Vec<(&'static str, String)> {
    vec![
        ("amount", "1000".into()),
        ("currency", "eur".into()),
        ("confirm", "true".into()),
        ("payment_method", "pm_card_visa".into()),
        ("metadata[invoice_id]", invoice.into()),
        ("metadata[order_id]", format!("ord-{invoice}")),
    ]
}

/// `POST /v1/payment_intents` with `form`, an optional key, under secret key `sk`.
pub(crate) async fn post_form(
    c: &reqwest::Client,
    url: &str,
    sk: &str,
    key: Option<&str>,
    form: &[(&str, String)],
) -> reqwest::Result<reqwest::Response> {
    let mut req = c.post(url).bearer_auth(sk).form(form);
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    req.send().await
}

pub(crate) async fn create(
    base: &str,
    key: Option<&str>,
    form: &[(&str, String)],
) -> reqwest::Response {
    post_form(
        &client(),
        &format!("{base}/v1/payment_intents"),
        SK,
        key,
        form,
    )
    .await
    .unwrap()
}

/// Status, `Idempotent-Replayed` present, body bytes.
pub(crate) async fn parts(res: reqwest::Response) -> (u16, bool, bytes::Bytes) {
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    (res.status().as_u16(), replayed, res.bytes().await.unwrap())
}

pub(crate) fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

pub(crate) async fn get_json(base: &str, path: &str) -> (u16, Value) {
    let res = client()
        .get(format!("{base}{path}"))
        .bearer_auth(SK)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap())
}

pub(crate) async fn control(base: &str, path: &str, body: &Value) -> Value {
    let res = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "control {path} {body}");
    res.json().await.unwrap()
}

pub(crate) async fn once(base: &str, kind: &str) {
    control(base, "/_sim/faults/next", &json!({ "kind": kind })).await;
}

pub(crate) async fn stats(base: &str) -> Value {
    reqwest::get(format!("{base}/_sim/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The intents the provider holds for `invoice`, counted at the provider.
pub(crate) async fn intents_for(base: &str, invoice: &str) -> u64 {
    stats(base).await["payment_intents_by_metadata"]["invoice_id"][invoice]["total"]
        .as_u64()
        .unwrap_or(0)
}

/// True when `e` is hyper's "connection closed before message completed": the server
/// closed the connection without an answer (not a timeout, not a status).
pub(crate) fn is_closed_without_answer(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message();
        }
        source = s.source();
    }
    false
}

pub(crate) fn search_path(query: &str, extra: &str) -> String {
    let q: String = form_urlencoded::byte_serialize(query.as_bytes()).collect();
    format!("/v1/payment_intents/search?query={q}{extra}")
}
