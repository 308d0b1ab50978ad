//! The simulators over real HTTP on 127.0.0.1:0, driven with reqwest: Stripe v1 semantics
//! (idempotency, pagination, search lag, refunds, declines), the keyless shipping API, and
//! every fault kind as a client sees it — with the objects counted at the provider.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use oncely_sim::{FaultKind, PaymentsConfig, PaymentsSim};
use serde_json::{json, Value};

#[path = "sim/adapter.rs"]
mod adapter;
use adapter::stripe_sequence;

#[path = "sim/faults.rs"]
mod faults;

#[path = "sim/shipping.rs"]
mod shipping;

#[path = "sim/support.rs"]
mod support;
use support::{
    client, create, get_json, intent_form, intents_for, json_of, listen, parts, payments,
    payments_config, post_form, search_path, stats, SK, SK_OTHER,
};

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
    faults::error_after_creates_the_intent_answers_500_and_replays_that_500_under_the_key().await;
}

#[tokio::test]
async fn error_before_answers_500_creates_nothing_and_still_stores_the_500_under_the_key() {
    faults::error_before_answers_500_creates_nothing_and_still_stores_the_500_under_the_key().await;
}

#[tokio::test]
async fn rate_limit_answers_429_with_retry_after_and_creates_and_stores_nothing() {
    faults::rate_limit_answers_429_with_retry_after_and_creates_and_stores_nothing().await;
}

#[tokio::test]
async fn drop_after_closes_the_connection_without_an_answer_and_the_intent_exists() {
    faults::drop_after_closes_the_connection_without_an_answer_and_the_intent_exists().await;
}

#[tokio::test]
async fn late_after_answers_after_the_callers_timeout_and_the_intent_exists() {
    faults::late_after_answers_after_the_callers_timeout_and_the_intent_exists().await;
}

#[tokio::test]
async fn latency_fault_delays_the_request_by_the_configured_ms_once() {
    faults::latency_fault_delays_the_request_by_the_configured_ms_once().await;
}

#[tokio::test]
async fn fault_rates_are_set_at_runtime_drawn_per_request_and_reproducible_with_a_seed() {
    faults::fault_rates_are_set_at_runtime_drawn_per_request_and_reproducible_with_a_seed().await;
}

#[tokio::test]
async fn shipping_has_no_keys_so_a_second_post_books_a_second_shipment() {
    shipping::shipping_has_no_keys_so_a_second_post_books_a_second_shipment().await;
}

#[tokio::test]
async fn shipping_cancel_is_idempotent_and_stats_count_live_and_cancelled() {
    shipping::shipping_cancel_is_idempotent_and_stats_count_live_and_cancelled().await;
}

#[tokio::test]
async fn shipping_refuses_an_undeliverable_sku_with_a_422_problem_and_books_nothing() {
    shipping::shipping_refuses_an_undeliverable_sku_with_a_422_problem_and_books_nothing().await;
}

#[tokio::test]
async fn shipping_faults_are_seen_by_the_client_exactly_as_specified() {
    shipping::shipping_faults_are_seen_by_the_client_exactly_as_specified().await;
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
