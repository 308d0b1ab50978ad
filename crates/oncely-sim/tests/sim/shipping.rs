//! The keyless shipping simulator: no idempotency keys, idempotent cancels, refused
//! undeliverable SKUs, and every fault kind as its client sees it.

use std::time::Duration;

use oncely_sim::FaultKind;
use serde_json::{json, Value};

use super::support::{client, control, is_closed_without_answer, json_of, once, shipping, stats};

pub(crate) async fn book(
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

pub(crate) async fn shipments_for(base: &str, reference: &str) -> Vec<Value> {
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

pub(crate) async fn shipping_has_no_keys_so_a_second_post_books_a_second_shipment() {
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

pub(crate) async fn shipping_cancel_is_idempotent_and_stats_count_live_and_cancelled() {
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

pub(crate) async fn shipping_refuses_an_undeliverable_sku_with_a_422_problem_and_books_nothing() {
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

pub(crate) async fn shipping_faults_are_seen_by_the_client_exactly_as_specified() {
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
