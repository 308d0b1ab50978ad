//! Keys, replays, headers, 422, 409, tenant scope and pass-through, on SQLite.

use std::time::Duration;

use oncely_testkit::TestBackend;
use serde_json::{json, Value};

use crate::support::{
    gateway, orders_route, post, retries_get_not_replayable, test_db, Upstream, KEY_A, KEY_B,
};

#[tokio::test]
async fn a_keyed_post_is_forwarded_once_and_replayed_byte_for_byte_without_set_cookie() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let body = json!({"external_ref": "r-1", "amount_minor": 2500});

    let first = post(&gw.base, "/orders", KEY_A, Some("k-1"), &body).await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers()["location"].clone();
    let first_body = first.bytes().await.unwrap();
    let order: Value = serde_json::from_slice(&first_body).unwrap();
    assert_eq!(order["idempotency_key"], "k-1", "the key is passed on");
    assert_eq!(order["tenant"], "a", "the tenant header is set");

    for _ in 0..3 {
        let again = post(&gw.base, "/orders", KEY_A, Some("k-1"), &body).await;
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["location"], location);
        assert_eq!(again.headers()["content-type"], "application/json");
        assert!(
            again.headers().get("set-cookie").is_none(),
            "never Set-Cookie"
        );
        assert_eq!(again.bytes().await.unwrap(), first_body, "byte for byte");
    }
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn a_changed_body_is_422_naming_the_body_and_a_missing_or_bad_key_is_400() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let body = json!({"external_ref": "r-2", "amount_minor": 2500});
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, Some("k-2"), &body)
            .await
            .status(),
        201
    );
    let changed = json!({"external_ref": "r-2", "amount_minor": 2999});
    let res = post(&gw.base, "/orders", KEY_A, Some("k-2"), &changed).await;
    assert_eq!(res.status(), 422);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let problem: Value = res.json().await.unwrap();
    assert_eq!(problem["differs"], "body");

    let missing = post(&gw.base, "/orders", KEY_A, None, &body).await;
    assert_eq!(missing.status(), 400);
    let bad = post(&gw.base, "/orders", KEY_A, Some(""), &body).await;
    assert_eq!(bad.status(), 400);
    let unauthenticated = post(
        &gw.base,
        "/orders",
        "not-a-key-0123456789",
        Some("k"),
        &body,
    )
    .await;
    assert_eq!(unauthenticated.status(), 401);
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn an_upstream_4xx_is_stored_and_replayed() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let body = json!({"external_ref": "r-3", "amount_minor": -1});
    let first = post(&gw.base, "/orders", KEY_A, Some("k-3"), &body).await;
    assert_eq!(first.status(), 422);
    let again = post(&gw.base, "/orders", KEY_A, Some("k-3"), &body).await;
    assert_eq!(again.status(), 422);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
}

#[tokio::test]
async fn a_body_over_the_bound_is_413_and_a_request_in_flight_is_409_with_retry_after() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let mut route = orders_route();
    route.max_request_bytes = 64;
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    let big = json!({"external_ref": "x".repeat(100)});
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, Some("k-big"), &big)
            .await
            .status(),
        413
    );

    up.fault("slow:1.0").await;
    let body = json!({"external_ref": "r-4"});
    let base = gw.base.clone();
    let first = tokio::spawn({
        let body = body.clone();
        async move { post(&base, "/orders", KEY_A, Some("k-4"), &body).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = post(&gw.base, "/orders", KEY_A, Some("k-4"), &body).await;
    assert_eq!(second.status(), 409);
    assert_eq!(second.headers()["retry-after"], "1");
    assert_eq!(
        second.headers()["link"],
        "</_oncely/routes/0/operations/k-4>; rel=\"monitor\""
    );
    assert_eq!(first.await.unwrap().status(), 201);
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn an_answer_over_the_stored_bound_reaches_the_first_caller_whole_and_is_never_run_again() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let mut route = orders_route();
    route.max_stored_response_bytes = 1024;
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    // The upstream echoes the body, so its answer is over 200 KiB: many reads.
    let note = "n".repeat(200 * 1024);
    let body = json!({"external_ref": "r-large", "note": note});

    let first = post(&gw.base, "/orders", KEY_A, Some("k-large"), &body).await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("location").is_some());
    let order: Value = first.json().await.unwrap();
    assert_eq!(
        order["note"].as_str().map(str::len),
        Some(200 * 1024),
        "whole"
    );

    let status = retries_get_not_replayable(&gw.base, "k-large", &body).await;
    assert_eq!(status["state"], "succeeded", "{status}");
    assert_eq!(up.count().await, 1, "never a second execution");
}

#[tokio::test]
async fn tenant_b_never_sees_tenant_a_s_operation_under_the_same_key() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let body = json!({"external_ref": "r-5"});
    let a: Value = post(&gw.base, "/orders", KEY_A, Some("shared"), &body)
        .await
        .json()
        .await
        .unwrap();
    let b = post(&gw.base, "/orders", KEY_B, Some("shared"), &body).await;
    assert_eq!(b.status(), 201);
    assert!(b.headers().get("idempotent-replayed").is_none());
    let b: Value = b.json().await.unwrap();
    assert_ne!(a["id"], b["id"], "B's operation is its own");
    assert_eq!(b["tenant"], "b");
    let b_again: Value = post(&gw.base, "/orders", KEY_B, Some("shared"), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(b_again["id"], b["id"]);

    let client = reqwest::Client::new();
    let status = |api_key: &'static str| {
        client
            .get(format!("{}/_oncely/routes/0/operations/shared", gw.base))
            .bearer_auth(api_key)
            .send()
    };
    let seen: Value = status(KEY_A).await.unwrap().json().await.unwrap();
    assert_eq!(seen["state"], "succeeded");
    assert_eq!(seen["response_status"], 201);
    post(
        &gw.base,
        "/orders",
        KEY_A,
        Some("only-a"),
        &json!({"external_ref": "r-6"}),
    )
    .await;
    let only_a = |api_key: &'static str| {
        client
            .get(format!("{}/_oncely/routes/0/operations/only-a", gw.base))
            .bearer_auth(api_key)
            .send()
    };
    assert_eq!(only_a(KEY_A).await.unwrap().status(), 200);
    assert_eq!(
        only_a(KEY_B).await.unwrap().status(),
        404,
        "B cannot see A's key"
    );
    assert_eq!(up.count().await, 3);
}

#[tokio::test]
async fn requests_off_the_routes_pass_through_untouched() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let client = reqwest::Client::new();
    // Another path, no credential, no key; its headers come back as the upstream sent them.
    let res = client
        .post(format!("{}/hello?x=1", gw.base))
        .header("Oncely-Tenant", "forged")
        .body("plain")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers().get("set-cookie").is_some());
    assert_eq!(res.headers()["x-upstream"], "yes");
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["path"], "/hello?x=1");
    assert_eq!(v["body"], "plain");
    assert_eq!(
        v["tenant"],
        Value::Null,
        "a client's tenant header is removed"
    );
    // Another method on a guarded path.
    let res = client
        .get(format!("{}/orders?external_ref=none", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.json::<Value>().await.unwrap(), json!([]));
    assert_eq!(up.count().await, 0);
}

/// `/_oncely/metrics` counts the forward by route and outcome with its upstream latency,
/// and the layer's replays beside it (the recorder is shared by the binary's tests, so
/// only this test's route is read).
#[tokio::test]
async fn metrics_count_forwards_by_route_and_outcome_with_upstream_latency_and_replays() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let route = oncely_gateway::RouteConfig::parse("POST /metered").unwrap();
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    let body = json!({"external_ref": "m-1", "amount_minor": 100});
    // The upstream has no `/metered`: its 404 is stored and the second request replayed.
    post(&gw.base, "/metered", KEY_A, Some("m-1"), &body).await;
    let again = post(&gw.base, "/metered", KEY_A, Some("m-1"), &body).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let text = reqwest::get(format!("{}/_oncely/metrics", gw.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix) && l.contains(r#"route="POST /metered""#))
            .unwrap_or_else(|| panic!("no {prefix} line for the route in:\n{text}"))
            .to_owned()
    };
    let forwards = line("oncely_gateway_forwards_total{");
    assert!(
        forwards.contains(r#"outcome="answered""#) && forwards.ends_with(" 1"),
        "one forward for two requests: {forwards}"
    );
    assert!(line("oncely_gateway_upstream_duration_seconds_count{").ends_with(" 1"));
    assert!(
        text.lines()
            .any(|l| l.starts_with("oncely_idempotency_replays_total")),
        "{text}"
    );
}
