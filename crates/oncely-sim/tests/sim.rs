//! The simulators over real HTTP on 127.0.0.1:0, driven with reqwest: Stripe v1 semantics
//! (idempotency, pagination, search lag, refunds, declines), the keyless shipping API, and
//! every fault kind as a client sees it — with the objects counted at the provider.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use oncely_sim::{
    serve, FaultConfig, FaultKind, FaultRates, PaymentsConfig, PaymentsSim, ShippingConfig,
    ShippingSim,
};
use serde_json::{json, Value};

const SK: &str = "sk_test_sim_tests";
const SK_OTHER: &str = "sk_test_sim_other";

async fn listen(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, router, std::future::pending()));
    format!("http://{addr}")
}

fn payments_config() -> PaymentsConfig {
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

async fn payments() -> (PaymentsSim, String) {
    let sim = PaymentsSim::new(payments_config());
    let base = listen(sim.router()).await;
    (sim, base)
}

async fn shipping() -> (ShippingSim, String) {
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

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

fn intent_form(invoice: &str) -> Vec<(&'static str, String)> {
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
async fn post_form(
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

async fn create(base: &str, key: Option<&str>, form: &[(&str, String)]) -> reqwest::Response {
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
async fn parts(res: reqwest::Response) -> (u16, bool, bytes::Bytes) {
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    (res.status().as_u16(), replayed, res.bytes().await.unwrap())
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

async fn get_json(base: &str, path: &str) -> (u16, Value) {
    let res = client()
        .get(format!("{base}{path}"))
        .bearer_auth(SK)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap())
}

async fn control(base: &str, path: &str, body: &Value) -> Value {
    let res = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "control {path} {body}");
    res.json().await.unwrap()
}

async fn once(base: &str, kind: &str) {
    control(base, "/_sim/faults/next", &json!({ "kind": kind })).await;
}

async fn stats(base: &str) -> Value {
    reqwest::get(format!("{base}/_sim/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The intents the provider holds for `invoice`, counted at the provider.
async fn intents_for(base: &str, invoice: &str) -> u64 {
    stats(base).await["payment_intents_by_metadata"]["invoice_id"][invoice]["total"]
        .as_u64()
        .unwrap_or(0)
}

/// True when `e` is hyper's "connection closed before message completed": the server
/// closed the connection without an answer (not a timeout, not a status).
fn is_closed_without_answer(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message();
        }
        source = s.source();
    }
    false
}

#[tokio::test]
async fn payments_accept_the_secret_key_as_bearer_or_basic_and_refuse_others_with_401() {
    let (_sim, base) = payments().await;
    let url = format!("{base}/v1/payment_intents");
    let c = client();
    let none = c.get(&url).send().await.unwrap();
    assert_eq!(none.status(), 401);
    let body: Value = none.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("API key"));
    let wrong = c
        .get(&url)
        .bearer_auth("sk_test_wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let basic = c.get(&url).basic_auth(SK, Some("")).send().await.unwrap();
    assert_eq!(basic.status(), 200);
    let bearer = c.get(&url).bearer_auth(SK).send().await.unwrap();
    assert_eq!(bearer.status(), 200);
    let list: Value = bearer.json().await.unwrap();
    assert_eq!(list["object"], "list");
    // A POST without a key creates nothing.
    let res = post_form(&c, &url, "sk_test_wrong", None, &intent_form("inv-auth"))
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
    assert_eq!(intents_for(&base, "inv-auth").await, 0);
}

#[tokio::test]
async fn idempotent_retry_replays_the_first_answer_byte_for_byte_and_other_params_are_an_idempotency_error(
) {
    let (sim, base) = payments().await;
    let form = intent_form("inv-idem");
    let (s1, r1, b1) = parts(create(&base, Some("key-1"), &form).await).await;
    assert_eq!((s1, r1), (200, false));
    let pi = json_of(&b1);
    assert!(pi["id"].as_str().unwrap().starts_with("pi_"));
    assert_eq!(pi["object"], "payment_intent");
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(pi["amount"], 1000);
    assert_eq!(pi["currency"], "eur");
    assert_eq!(pi["metadata"]["invoice_id"], "inv-idem");
    assert!(pi["created"].as_i64().unwrap() > 1_600_000_000);

    // Same key, same parameters (in another order): the first answer, byte for byte.
    let mut reordered = form.clone();
    reordered.reverse();
    let (s2, r2, b2) = parts(create(&base, Some("key-1"), &reordered).await).await;
    assert_eq!((s2, r2), (200, true));
    assert_eq!(b2, b1, "replayed byte for byte");

    // Same key, other parameters: idempotency_error, nothing created.
    let mut other = form.clone();
    other[0].1 = "2000".into();
    let (s3, r3, b3) = parts(create(&base, Some("key-1"), &other).await).await;
    assert_eq!((s3, r3), (400, false));
    assert_eq!(json_of(&b3)["error"]["type"], "idempotency_error");

    // Keys are scoped per secret key: the other key's "key-1" is a new request.
    let c = client();
    let res = post_form(
        &c,
        &format!("{base}/v1/payment_intents"),
        SK_OTHER,
        Some("key-1"),
        &form,
    )
    .await
    .unwrap();
    let (s4, r4, b4) = parts(res).await;
    assert_eq!((s4, r4), (200, false));
    assert_ne!(json_of(&b4)["id"], pi["id"]);

    // Same key on another endpoint: idempotency_error.
    let refund = [("payment_intent", pi["id"].as_str().unwrap().to_owned())];
    let res = post_form(
        &c,
        &format!("{base}/v1/refunds"),
        SK,
        Some("key-1"),
        &refund,
    )
    .await
    .unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["type"],
        "idempotency_error"
    );

    assert_eq!(intents_for(&base, "inv-idem").await, 2);
    let st = sim.stats();
    assert_eq!(st.requests.replayed, 1);
    assert_eq!(st.requests.idempotency_errors, 2);
    assert_eq!(st.refunds, 0);
}

#[tokio::test]
async fn validation_errors_are_answered_in_stripes_shape_and_not_stored_under_the_key() {
    let (_sim, base) = payments().await;
    let mut form = intent_form("inv-valid");
    form.remove(0);
    let (s, r, b) = parts(create(&base, Some("key-v"), &form).await).await;
    assert_eq!((s, r), (400, false));
    let e = json_of(&b);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(e["error"]["code"], "parameter_missing");
    assert_eq!(e["error"]["param"], "amount");
    assert!(e["error"]["message"].is_string());

    let mut unknown = intent_form("inv-valid");
    unknown.push(("amount_typo", "1".into()));
    let (s, _, b) = parts(create(&base, Some("key-v2"), &unknown).await).await;
    assert_eq!(s, 400);
    assert_eq!(json_of(&b)["error"]["code"], "parameter_unknown");
    assert_eq!(json_of(&b)["error"]["param"], "amount_typo");
    assert_eq!(intents_for(&base, "inv-valid").await, 0);

    // The key was not burnt by the invalid request.
    let (s, r, _) = parts(create(&base, Some("key-v"), &intent_form("inv-valid")).await).await;
    assert_eq!((s, r), (200, false));
    assert_eq!(intents_for(&base, "inv-valid").await, 1);
}

#[tokio::test]
async fn declined_card_answers_402_card_error_and_leaves_one_intent_requiring_a_payment_method() {
    let (sim, base) = payments().await;
    let mut form = intent_form("inv-decline");
    form[3].1 = "pm_card_chargeDeclined".into();
    let (s, _, b) = parts(create(&base, Some("key-d"), &form).await).await;
    assert_eq!(s, 402);
    let e = json_of(&b);
    assert_eq!(e["error"]["type"], "card_error");
    assert_eq!(e["error"]["code"], "card_declined");
    assert_eq!(e["error"]["decline_code"], "generic_decline");
    let pi = &e["error"]["payment_intent"];
    assert_eq!(pi["status"], "requires_payment_method");
    assert_eq!(pi["last_payment_error"]["code"], "card_declined");
    // The intent exists (as on Stripe) and the decline is replayed under the key.
    let id = pi["id"].as_str().unwrap();
    let (status, fetched) = get_json(&base, &format!("/v1/payment_intents/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(fetched["status"], "requires_payment_method");
    let (s2, r2, b2) = parts(create(&base, Some("key-d"), &form).await).await;
    assert_eq!((s2, r2), (402, true));
    assert_eq!(b2, b);
    let st = stats(&base).await;
    assert_eq!(
        st["payment_intents_by_metadata"]["invoice_id"]["inv-decline"],
        json!({"total": 1, "succeeded": 0})
    );
    assert_eq!(
        st["payment_intents_by_status"]["requires_payment_method"],
        1
    );
    // Nothing to refund.
    let res = post_form(
        &client(),
        &format!("{base}/v1/refunds"),
        SK,
        None,
        &[("payment_intent", id.to_owned())],
    )
    .await
    .unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(sim.stats().refunds, 0);
}

#[tokio::test]
async fn refund_refunds_the_charge_once_per_key_and_is_listed_by_payment_intent() {
    let (sim, base) = payments().await;
    let pi = json_of(
        &parts(create(&base, None, &intent_form("inv-refund")).await)
            .await
            .2,
    );
    let id = pi["id"].as_str().unwrap().to_owned();
    let url = format!("{base}/v1/refunds");
    let c = client();
    let partial = [("payment_intent", id.clone()), ("amount", "400".into())];
    let (s, _, b) = parts(
        post_form(&c, &url, SK, Some("refund-1"), &partial)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    let refund = json_of(&b);
    assert!(refund["id"].as_str().unwrap().starts_with("re_"));
    assert_eq!(refund["object"], "refund");
    assert_eq!(
        (refund["amount"].as_u64(), refund["status"].as_str()),
        (Some(400), Some("succeeded"))
    );
    assert_eq!(refund["payment_intent"], id.as_str());
    let (s, r, b2) = parts(
        post_form(&c, &url, SK, Some("refund-1"), &partial)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, r), (200, true));
    assert_eq!(b2, b);

    let (_, charge) = get_json(
        &base,
        &format!("/v1/charges/{}", pi["latest_charge"].as_str().unwrap()),
    )
    .await;
    assert_eq!(
        (
            charge["amount_refunded"].as_u64(),
            charge["refunded"].as_bool()
        ),
        (Some(400), Some(false))
    );

    // The rest (no amount), then nothing is left.
    let rest = [("payment_intent", id.clone())];
    let (s, _, b) = parts(
        post_form(&c, &url, SK, Some("refund-2"), &rest)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((s, json_of(&b)["amount"].as_u64()), (200, Some(600)));
    let (s, _, b) = parts(
        post_form(&c, &url, SK, Some("refund-3"), &rest)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(json_of(&b)["error"]["code"], "charge_already_refunded");
    let (_, charge) = get_json(
        &base,
        &format!("/v1/charges/{}", pi["latest_charge"].as_str().unwrap()),
    )
    .await;
    assert_eq!(
        (
            charge["amount_refunded"].as_u64(),
            charge["refunded"].as_bool()
        ),
        (Some(1000), Some(true))
    );

    let (_, list) = get_json(&base, &format!("/v1/refunds?payment_intent={id}")).await;
    assert_eq!(list["object"], "list");
    let amounts: Vec<_> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["amount"].as_u64().unwrap())
        .collect();
    assert_eq!(amounts, [600, 400], "newest first");
    let st = sim.stats();
    assert_eq!((st.refunds, st.refunded_amount), (2, 1000));
    assert_eq!(st.refunds_by_payment_intent[&id], 2);
}

#[tokio::test]
async fn list_pages_250_intents_newest_first_with_starting_after_and_ending_before() {
    let (_sim, base) = payments().await;
    let mut created = Vec::new();
    for i in 0..250 {
        let res = create(&base, None, &intent_form(&format!("inv-list-{i}"))).await;
        created.push(
            json_of(&res.bytes().await.unwrap())["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    let mut seen = Vec::new();
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let q = after
            .as_ref()
            .map(|a| format!("&starting_after={a}"))
            .unwrap_or_default();
        let (s, page) = get_json(&base, &format!("/v1/payment_intents?limit=100{q}")).await;
        assert_eq!(s, 200);
        assert_eq!(page["url"], "/v1/payment_intents");
        let ids: Vec<String> = page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_str().unwrap().to_owned())
            .collect();
        pages.push((ids.len(), page["has_more"].as_bool().unwrap()));
        after = ids.last().cloned();
        seen.extend(ids);
        if !page["has_more"].as_bool().unwrap() {
            break;
        }
    }
    assert_eq!(pages, [(100, true), (100, true), (50, false)]);
    created.reverse();
    assert_eq!(seen, created, "every intent once, newest first");
    let unique: HashSet<_> = seen.iter().collect();
    assert_eq!(unique.len(), 250);

    // ending_before the first of page 2 gives page 1 back.
    let (_, back) = get_json(
        &base,
        &format!("/v1/payment_intents?limit=100&ending_before={}", seen[100]),
    )
    .await;
    let back_ids: Vec<_> = back["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(back_ids, seen[..100]);
    assert_eq!(back["has_more"], false);
    let (_, default) = get_json(&base, "/v1/payment_intents").await;
    assert_eq!(default["data"].as_array().unwrap().len(), 10);
    let (s, e) = get_json(&base, "/v1/payment_intents?limit=101").await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("limit")));
    let (s, e) = get_json(&base, "/v1/payment_intents?starting_after=pi_nope").await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (404, Some("resource_missing"))
    );
}

fn search_path(query: &str, extra: &str) -> String {
    let q: String = form_urlencoded::byte_serialize(query.as_bytes()).collect();
    format!("/v1/payment_intents/search?query={q}{extra}")
}

#[tokio::test]
async fn search_by_metadata_finds_an_intent_only_after_the_search_lag() {
    // A lag long enough that even a loaded machine searches before it ends.
    let lag = Duration::from_secs(1);
    let sim = PaymentsSim::new(PaymentsConfig {
        search_lag: lag,
        ..payments_config()
    });
    let base = listen(sim.router()).await;
    let started = Instant::now();
    let pi = json_of(
        &parts(create(&base, None, &intent_form("inv-search")).await)
            .await
            .2,
    );
    let by_invoice = search_path("metadata['invoice_id']:'inv-search'", "");
    let (s, early) = get_json(&base, &by_invoice).await;
    assert_eq!(s, 200);
    assert_eq!(early["object"], "search_result");
    if started.elapsed() < lag {
        assert_eq!(
            early["data"],
            json!([]),
            "invisible to search before the lag"
        );
    }
    // Retrieve and list see it at once.
    let (s, _) = get_json(
        &base,
        &format!("/v1/payment_intents/{}", pi["id"].as_str().unwrap()),
    )
    .await;
    assert_eq!(s, 200);

    tokio::time::sleep(lag + Duration::from_millis(50)).await;
    let (_, late) = get_json(&base, &by_invoice).await;
    assert_eq!(late["data"].as_array().unwrap().len(), 1);
    assert_eq!(late["data"][0]["id"], pi["id"]);
    assert_eq!(
        (late["has_more"].as_bool(), late["next_page"].is_null()),
        (Some(false), true)
    );
    let both = search_path(
        "metadata[\"order_id\"]:\"ord-inv-search\" AND status:'succeeded'",
        "",
    );
    assert_eq!(
        get_json(&base, &both).await.1["data"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let none = search_path(
        "metadata['invoice_id']:'inv-search' AND status:'canceled'",
        "",
    );
    assert_eq!(get_json(&base, &none).await.1["data"], json!([]));
    let (s, e) = get_json(&base, &search_path("metadata['invoice_id'] = 'x'", "")).await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("query")));

    // Search pages with next_page.
    for _ in 0..2 {
        create(&base, None, &intent_form("inv-search")).await;
    }
    tokio::time::sleep(lag + Duration::from_millis(50)).await;
    let (_, p1) = get_json(
        &base,
        &search_path("metadata['invoice_id']:'inv-search'", "&limit=2"),
    )
    .await;
    assert_eq!(
        (
            p1["data"].as_array().unwrap().len(),
            p1["has_more"].as_bool()
        ),
        (2, Some(true))
    );
    let next = p1["next_page"].as_str().unwrap();
    let (_, p2) = get_json(
        &base,
        &search_path(
            "metadata['invoice_id']:'inv-search'",
            &format!("&limit=2&page={next}"),
        ),
    )
    .await;
    assert_eq!(p2["data"].as_array().unwrap().len(), 1);
    assert_eq!(p2["data"][0]["id"], pi["id"], "the oldest comes last");
    assert_eq!(p2["has_more"], false);
}

#[tokio::test]
async fn error_after_creates_the_intent_answers_500_and_replays_that_500_under_the_key() {
    let (_sim, base) = payments().await;
    once(&base, "error_after").await;
    let form = intent_form("inv-500-after");
    let (s, r, b) = parts(create(&base, Some("key-500"), &form).await).await;
    assert_eq!((s, r), (500, false));
    assert_eq!(json_of(&b)["error"]["type"], "api_error");
    assert_eq!(
        intents_for(&base, "inv-500-after").await,
        1,
        "the effect happened"
    );
    let (s2, r2, b2) = parts(create(&base, Some("key-500"), &form).await).await;
    assert_eq!(
        (s2, r2),
        (500, true),
        "the 500 is what is stored under the key"
    );
    assert_eq!(b2, b);
    assert_eq!(intents_for(&base, "inv-500-after").await, 1);
    let (_, list) = get_json(&base, "/v1/payment_intents").await;
    assert_eq!(list["data"][0]["metadata"]["invoice_id"], "inv-500-after");
}

#[tokio::test]
async fn error_before_answers_500_creates_nothing_and_still_stores_the_500_under_the_key() {
    let (_sim, base) = payments().await;
    once(&base, "error_before").await;
    let form = intent_form("inv-500-before");
    let (s, r, b) = parts(create(&base, Some("key-b"), &form).await).await;
    assert_eq!((s, r), (500, false));
    assert_eq!(json_of(&b)["error"]["type"], "api_error");
    assert_eq!(intents_for(&base, "inv-500-before").await, 0);
    let (s2, r2, _) = parts(create(&base, Some("key-b"), &form).await).await;
    assert_eq!((s2, r2), (500, true));
    assert_eq!(intents_for(&base, "inv-500-before").await, 0);
    let (s3, _, _) = parts(create(&base, Some("key-b2"), &form).await).await;
    assert_eq!(s3, 200);
    assert_eq!(intents_for(&base, "inv-500-before").await, 1);
}

#[tokio::test]
async fn rate_limit_answers_429_with_retry_after_and_creates_and_stores_nothing() {
    let (sim, base) = payments().await;
    once(&base, "rate_limit").await;
    let form = intent_form("inv-429");
    let res = create(&base, Some("key-429"), &form).await;
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "3");
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["code"],
        "rate_limit"
    );
    assert_eq!(intents_for(&base, "inv-429").await, 0);
    let (s, r, _) = parts(create(&base, Some("key-429"), &form).await).await;
    assert_eq!((s, r), (200, false), "the key was not used up by the 429");
    assert_eq!(intents_for(&base, "inv-429").await, 1);
    assert_eq!(sim.stats().faults_injected[&FaultKind::RateLimit], 1);
}

#[tokio::test]
async fn drop_after_closes_the_connection_without_an_answer_and_the_intent_exists() {
    let (_sim, base) = payments().await;
    once(&base, "drop_after").await;
    let form = intent_form("inv-drop");
    let err = post_form(
        &client(),
        &format!("{base}/v1/payment_intents"),
        SK,
        Some("key-drop"),
        &form,
    )
    .await
    .expect_err("no answer");
    assert!(!err.is_timeout() && err.status().is_none(), "{err:?}");
    assert!(
        is_closed_without_answer(&err),
        "a closed connection, got {err:?}"
    );
    assert_eq!(
        intents_for(&base, "inv-drop").await,
        1,
        "the effect happened"
    );
    // The retry with the key gets the stored success.
    let (s, r, b) = parts(create(&base, Some("key-drop"), &form).await).await;
    assert_eq!((s, r), (200, true));
    assert_eq!(json_of(&b)["status"], "succeeded");
    assert_eq!(intents_for(&base, "inv-drop").await, 1);
}

#[tokio::test]
async fn late_after_answers_after_the_callers_timeout_and_the_intent_exists() {
    let (_sim, base) = payments().await;
    once(&base, "late_after").await;
    let form = intent_form("inv-late");
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let err = post_form(
        &impatient,
        &format!("{base}/v1/payment_intents"),
        SK,
        Some("key-late"),
        &form,
    )
    .await
    .expect_err("timed out");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(
        intents_for(&base, "inv-late").await,
        1,
        "committed before the late answer"
    );
    let (s, r, _) = parts(create(&base, Some("key-late"), &form).await).await;
    assert_eq!((s, r), (200, true));
    // A patient caller gets the late answer.
    once(&base, "late_after").await;
    let started = Instant::now();
    let (s, _, _) = parts(create(&base, None, &intent_form("inv-late-2")).await).await;
    assert_eq!(s, 200);
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_eq!(intents_for(&base, "inv-late").await, 1);
}

#[tokio::test]
async fn latency_fault_delays_the_request_by_the_configured_ms_once() {
    let (sim, base) = payments().await;
    once(&base, "latency").await;
    let started = Instant::now();
    let (s, _, _) = parts(create(&base, None, &intent_form("inv-latency")).await).await;
    assert_eq!(s, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
    create(&base, None, &intent_form("inv-latency")).await;
    assert_eq!(
        sim.stats().faults_injected[&FaultKind::Latency],
        1,
        "a one-shot fires once"
    );
    assert_eq!(intents_for(&base, "inv-latency").await, 2);
}

#[tokio::test]
async fn fault_rates_are_set_at_runtime_drawn_per_request_and_reproducible_with_a_seed() {
    let mut rates = FaultRates::default();
    rates.set_from_str("error_after=0.05").unwrap();
    assert!((rates.error_after - 0.05).abs() < f64::EPSILON);
    assert!(rates.set_from_str("error_after=1.5").is_err());
    assert!(rates.set_from_str("explode=0.1").is_err());
    assert!(rates.set_from_str("error_after").is_err());

    let run = || async {
        let (_sim, base) = payments().await;
        let settings = control(
            &base,
            "/_sim/faults",
            &json!({"error_before": 0.5, "seed": 42}),
        )
        .await;
        assert_eq!(settings["error_before"], 0.5);
        assert_eq!(settings["seed"], 42);
        let mut statuses = Vec::new();
        for i in 0..60 {
            statuses.push(
                create(&base, None, &intent_form(&format!("inv-rate-{i}")))
                    .await
                    .status()
                    .as_u16(),
            );
        }
        let st = stats(&base).await;
        (statuses, st["payment_intents"].as_u64().unwrap(), base)
    };
    let (a, created_a, base) = run().await;
    let (b, _, _) = run().await;
    assert_eq!(a, b, "the same seed draws the same faults");
    let failed = a.iter().filter(|s| **s == 500).count();
    assert!((10..=50).contains(&failed), "about half fail: {failed}");
    assert_eq!(
        created_a as usize,
        60 - failed,
        "a 500 before the effect created nothing"
    );

    let bad = client()
        .post(format!("{base}/_sim/faults"))
        .json(&json!({"error_after": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let bad = client()
        .post(format!("{base}/_sim/faults"))
        .json(&json!({"typo": 0.1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let now: Value = reqwest::get(format!("{base}/_sim/faults"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(now["error_before"], 0.5);
    control(&base, "/_sim/faults", &json!({"error_before": 0.0})).await;
    assert_eq!(
        create(&base, None, &intent_form("inv-rate-x"))
            .await
            .status(),
        200
    );
}

async fn book(
    c: &reqwest::Client,
    base: &str,
    reference: &str,
    sku: &str,
) -> reqwest::Result<reqwest::Response> {
    c.post(format!("{base}/v1/shipments"))
        .json(
            &json!({"merchant_reference": reference, "order_id": format!("ord-{reference}"),
                      "items": [{"sku": sku, "quantity": 2}]}),
        )
        .send()
        .await
}

async fn shipments_for(base: &str, reference: &str) -> Vec<Value> {
    let v: Value = reqwest::get(format!(
        "{base}/v1/shipments?merchant_reference={reference}"
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    v["data"].as_array().unwrap().clone()
}

#[tokio::test]
async fn shipping_has_no_keys_so_a_second_post_books_a_second_shipment() {
    let (sim, base) = shipping().await;
    let c = client();
    let first = book(&c, &base, "ref-1", "sku-a").await.unwrap();
    assert_eq!(first.status(), 201);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["status"], "booked");
    assert_eq!(first["merchant_reference"], "ref-1");
    assert_eq!(first["order_id"], "ord-ref-1");
    assert_eq!(first["items"], json!([{"sku": "sku-a", "quantity": 2}]));
    assert!(first["created"].as_i64().unwrap() > 1_600_000_000);
    assert_eq!(
        location,
        format!("/v1/shipments/{}", first["id"].as_str().unwrap())
    );
    let second: Value = book(&c, &base, "ref-1", "sku-a")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_ne!(second["id"], first["id"]);
    book(&c, &base, "ref-2", "sku-a").await.unwrap();

    let by_ref = shipments_for(&base, "ref-1").await;
    assert_eq!(by_ref.len(), 2);
    assert_eq!(by_ref[0]["id"], first["id"]);
    let one: Value = reqwest::get(format!("{base}{location}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one, first);
    let missing = reqwest::get(format!("{base}/v1/shipments/shp_nope"))
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );
    let st = sim.stats();
    assert_eq!(st.shipments, 3);
    assert_eq!(st.by_merchant_reference["ref-1"].total, 2);
}

#[tokio::test]
async fn shipping_cancel_is_idempotent_and_stats_count_live_and_cancelled() {
    let (_sim, base) = shipping().await;
    let c = client();
    let a: Value = book(&c, &base, "ref-c", "sku-a")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    book(&c, &base, "ref-c", "sku-a").await.unwrap();
    let url = format!("{base}/v1/shipments/{}/cancel", a["id"].as_str().unwrap());
    let first = c.post(&url).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let first = first.bytes().await.unwrap();
    assert_eq!(json_of(&first)["status"], "cancelled");
    let again = c.post(&url).send().await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.bytes().await.unwrap(), first, "the same answer");
    let unknown = c
        .post(format!("{base}/v1/shipments/shp_nope/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let st = stats(&base).await;
    assert_eq!(
        st["by_merchant_reference"]["ref-c"],
        json!({"total": 2, "booked": 1, "cancelled": 1})
    );
    assert_eq!(
        (st["booked"].as_u64(), st["cancelled"].as_u64()),
        (Some(1), Some(1))
    );
}

#[tokio::test]
async fn shipping_refuses_an_undeliverable_sku_with_a_422_problem_and_books_nothing() {
    let (sim, base) = shipping().await;
    let res = book(&client(), &base, "ref-u", "sku-oversize")
        .await
        .unwrap();
    assert_eq!(res.status(), 422);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let p: Value = res.json().await.unwrap();
    assert_eq!(p["type"], "urn:oncely:problem:undeliverable");
    assert_eq!(p["skus"], json!(["sku-oversize"]));
    let bad = client()
        .post(format!("{base}/v1/shipments"))
        .json(&json!({"merchant_reference": "ref-u"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert!(shipments_for(&base, "ref-u").await.is_empty());
    let st = sim.stats();
    assert_eq!((st.shipments, st.refused), (0, 1));
}

#[tokio::test]
async fn shipping_faults_are_seen_by_the_client_exactly_as_specified() {
    let (sim, base) = shipping().await;
    let c = client();
    once(&base, "error_before").await;
    let res = book(&c, &base, "ref-before", "sku-a").await.unwrap();
    assert_eq!(res.status(), 503);
    assert!(
        shipments_for(&base, "ref-before").await.is_empty(),
        "nothing booked"
    );

    once(&base, "error_after").await;
    let res = book(&c, &base, "ref-after", "sku-a").await.unwrap();
    assert_eq!(res.status(), 500);
    assert_eq!(
        shipments_for(&base, "ref-after").await.len(),
        1,
        "booked, then 500"
    );

    once(&base, "drop_after").await;
    let err = book(&c, &base, "ref-drop", "sku-a")
        .await
        .expect_err("no answer");
    assert!(is_closed_without_answer(&err), "{err:?}");
    assert_eq!(
        shipments_for(&base, "ref-drop").await.len(),
        1,
        "booked, then dropped"
    );

    once(&base, "late_after").await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let err = book(&impatient, &base, "ref-late", "sku-a")
        .await
        .expect_err("timeout");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(
        shipments_for(&base, "ref-late").await.len(),
        1,
        "booked, answered late"
    );

    once(&base, "rate_limit").await;
    let res = book(&c, &base, "ref-429", "sku-a").await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(
        shipments_for(&base, "ref-429").await.is_empty(),
        "nothing booked"
    );

    // Cancels are effects too: a drop after the cancel leaves it cancelled.
    let id = shipments_for(&base, "ref-after").await[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    once(&base, "drop_after").await;
    let err = c
        .post(format!("{base}/v1/shipments/{id}/cancel"))
        .send()
        .await
        .expect_err("no answer");
    assert!(is_closed_without_answer(&err), "{err:?}");
    assert_eq!(
        shipments_for(&base, "ref-after").await[0]["status"],
        "cancelled"
    );

    let st = sim.stats();
    assert_eq!(st.shipments, 3);
    for kind in [
        FaultKind::ErrorBefore,
        FaultKind::ErrorAfter,
        FaultKind::LateAfter,
        FaultKind::RateLimit,
    ] {
        assert_eq!(st.faults_injected[&kind], 1, "{kind:?}");
    }
    assert_eq!(st.faults_injected[&FaultKind::DropAfter], 2);
    // Lookups are never faulted.
    control(
        &base,
        "/_sim/faults",
        &json!({"error_before": 1.0, "rate_limit": 1.0}),
    )
    .await;
    assert_eq!(shipments_for(&base, "ref-after").await.len(), 1);
}

/// The JSON type of `v`, and the value itself for the fields whose values must agree.
fn shape(v: &Value, fields: &[&str], values: &[&str]) -> Value {
    let kind = |v: &Value| match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let mut out = serde_json::Map::new();
    for f in fields {
        out.insert((*f).into(), kind(&v[*f]).into());
    }
    for f in values {
        out.insert(format!("{f}="), v[*f].clone());
    }
    if let Some(id) = v["id"].as_str() {
        out.insert(
            "id_prefix".into(),
            id.split('_').next().unwrap_or_default().into(),
        );
    }
    Value::Object(out)
}

/// The small request sequence the payment adapter relies on, reduced to shapes.
#[allow(
    clippy::too_many_lines,
    reason = "one fixed request sequence, compared step by step between two servers"
)]
async fn stripe_sequence(base: &str, sk: &str) -> Vec<(&'static str, u16, Value)> {
    let c = client();
    let mut out = Vec::new();
    let res = c
        .get(format!("{base}/v1/payment_intents"))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap();
    out.push((
        "unauthenticated",
        status,
        json!(body["error"]["type"].is_string()),
    ));

    let form = [
        ("amount", "1000"),
        ("currency", "eur"),
        ("confirm", "true"),
        ("payment_method", "pm_card_visa"),
        ("metadata[invoice_id]", "inv-compat"),
        ("metadata[order_id]", "ord-compat"),
    ];
    let res = c
        .post(format!("{base}/v1/payment_intents"))
        .basic_auth(sk, Some(""))
        .form(&form)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let pi: Value = res.json().await.unwrap();
    let pi_fields = ["id", "amount", "currency", "status", "metadata", "created"];
    let pi_values = [
        "object", "amount", "currency", "status", "metadata", "livemode",
    ];
    out.push(("create intent", status, shape(&pi, &pi_fields, &pi_values)));
    let id = pi["id"].as_str().unwrap().to_owned();

    let res = c
        .get(format!("{base}/v1/payment_intents/{id}"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let got: Value = res.json().await.unwrap();
    assert_eq!(got["id"], pi["id"]);
    out.push((
        "retrieve intent",
        status,
        shape(&got, &pi_fields, &pi_values),
    ));

    let res = c
        .get(format!("{base}/v1/payment_intents?limit=1"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let list: Value = res.json().await.unwrap();
    assert_eq!(list["data"][0]["id"], pi["id"]);
    out.push((
        "list intents",
        status,
        shape(&list, &["data", "has_more"], &["object", "has_more", "url"]),
    ));

    let res = c
        .get(format!("{base}/v1/payment_intents/pi_missing"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap();
    out.push(("retrieve missing", status, json!(body["error"]["type"])));

    let res = c
        .post(format!("{base}/v1/refunds"))
        .bearer_auth(sk)
        .form(&[("payment_intent", id.as_str()), ("amount", "300")])
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let refund: Value = res.json().await.unwrap();
    assert_eq!(refund["payment_intent"], pi["id"]);
    out.push((
        "refund",
        status,
        shape(
            &refund,
            &["id", "charge", "created", "metadata"],
            &["object", "amount", "currency", "status"],
        ),
    ));

    let res = c
        .get(format!("{base}/v1/refunds?payment_intent={id}"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let refunds: Value = res.json().await.unwrap();
    assert_eq!(refunds["data"][0]["id"], refund["id"]);
    out.push((
        "list refunds",
        status,
        shape(
            &refunds,
            &["data", "has_more"],
            &["object", "has_more", "url"],
        ),
    ));
    out
}

#[tokio::test]
async fn payments_simulator_answers_the_adapters_requests_in_the_shapes_localstripe_gives() {
    let Some(ls) = oncely_testkit::LocalStripe::start().await else {
        return;
    };
    let (_sim, base) = payments().await;
    let theirs = stripe_sequence(ls.base_url(), "sk_test_anything").await;
    let ours = stripe_sequence(&base, SK).await;
    for (a, b) in theirs.iter().zip(&ours) {
        assert_eq!(a, b, "localstripe vs oncely-sim");
    }
    assert_eq!(theirs.len(), ours.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_with_one_key_create_one_intent_and_the_rest_replay_it() {
    let (sim, base) = payments().await;
    let form = intent_form("inv-concurrent");
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (base, form) = (base.clone(), form.clone());
            tokio::spawn(async move { parts(create(&base, Some("key-c"), &form).await).await })
        })
        .collect();
    let mut bodies = HashSet::new();
    let mut replays = 0;
    for t in tasks {
        let (status, replayed, body) = t.await.unwrap();
        assert_eq!(status, 200);
        replays += usize::from(replayed);
        bodies.insert(body);
    }
    assert_eq!(
        (bodies.len(), replays),
        (1, 15),
        "one execution, 15 byte-equal replays"
    );
    assert_eq!(intents_for(&base, "inv-concurrent").await, 1);
    assert_eq!(sim.stats().requests.executed, 1);
}

#[tokio::test]
async fn fault_rates_given_at_start_apply_to_effects_and_never_to_lookups() {
    let mut config = payments_config();
    config.faults.rates.set(FaultKind::RateLimit, 1.0).unwrap();
    let sim = PaymentsSim::new(config);
    let base = listen(sim.router()).await;
    for i in 0..5 {
        let res = create(&base, Some(&format!("key-s{i}")), &intent_form("inv-start")).await;
        assert_eq!(res.status(), 429);
    }
    let (s, list) = get_json(&base, "/v1/payment_intents").await;
    assert_eq!((s, list["data"].clone()), (200, json!([])));
    let (s, _) = get_json(&base, &search_path("status:'succeeded'", "")).await;
    assert_eq!(s, 200);
    let st = sim.stats();
    assert_eq!(
        (
            st.payment_intents,
            st.faults_injected[&FaultKind::RateLimit]
        ),
        (0, 5)
    );
}
