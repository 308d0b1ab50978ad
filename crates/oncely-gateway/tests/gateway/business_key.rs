//! A business key read from the body (`business_key = "/external_ref"`): requests with the
//! same value are one operation whatever `Idempotency-Key` they carry (or none); a missing
//! or invalid value is a problem and the upstream is not called. SQLite, PostgreSQL,
//! MariaDB.

use oncely_gateway::RouteConfig;
use oncely_testkit::TestBackend;
use serde_json::{json, Value};

use crate::support::{
    gateway, operation_status, orders_route, post, test_db, Upstream, KEY_A, KEY_B,
};

fn business_key_route() -> RouteConfig {
    let mut route = orders_route();
    route.business_key = Some("/external_ref".to_owned());
    route
}

async fn one_business_key_is_one_operation_whatever_the_header(backend: TestBackend) {
    let Some(db) = test_db(backend, 4).await else {
        return;
    };
    let up = Upstream::start();
    let gw = gateway(&db.db, &up.base, vec![business_key_route()]).await;
    let body = json!({"external_ref": "bk-1", "amount_minor": 100});
    let first = post(&gw.base, "/orders", KEY_A, Some("header-1"), &body).await;
    assert_eq!(first.status(), 201);
    let first_body = first.bytes().await.unwrap();
    let order: Value = serde_json::from_slice(&first_body).unwrap();
    assert_eq!(
        order["idempotency_key"], "header-1",
        "the client's header is passed on"
    );

    for key in [Some("header-2"), None] {
        let again = post(&gw.base, "/orders", KEY_A, key, &body).await;
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.bytes().await.unwrap(), first_body);
    }
    assert_eq!(up.count().await, 1, "one business key, one forward");

    // Without a header the upstream gets the business key; the status resource knows it.
    let second = json!({"external_ref": "bk-2", "amount_minor": 100});
    let res = post(&gw.base, "/orders", KEY_A, None, &second).await;
    assert_eq!(res.status(), 201);
    assert_eq!(
        res.json::<Value>().await.unwrap()["idempotency_key"],
        "bk-2"
    );
    assert_eq!(
        operation_status(&gw.base, "bk-2").await["state"],
        "succeeded"
    );
    let changed = json!({"external_ref": "bk-2", "amount_minor": 999});
    let res = post(&gw.base, "/orders", KEY_A, Some("header-3"), &changed).await;
    assert_eq!(res.status(), 422);
    assert_eq!(res.json::<Value>().await.unwrap()["differs"], "body");

    // A number is a key in its canonical form; another tenant's same key is its own.
    let numeric = json!({"external_ref": 1e3, "amount_minor": 1});
    let res = post(&gw.base, "/orders", KEY_A, None, &numeric).await;
    assert_eq!(
        res.json::<Value>().await.unwrap()["idempotency_key"],
        "1000"
    );
    let res = post(&gw.base, "/orders", KEY_B, None, &second).await;
    assert_eq!(res.status(), 201);
    assert!(res.headers().get("idempotent-replayed").is_none());
    assert_eq!(up.count().await, 4);
}

#[tokio::test]
async fn one_business_key_is_one_operation_whatever_the_header_on_sqlite() {
    one_business_key_is_one_operation_whatever_the_header(TestBackend::Sqlite).await;
}

#[tokio::test]
async fn one_business_key_is_one_operation_whatever_the_header_on_postgres() {
    one_business_key_is_one_operation_whatever_the_header(TestBackend::Postgres).await;
}

#[tokio::test]
async fn one_business_key_is_one_operation_whatever_the_header_on_mariadb() {
    one_business_key_is_one_operation_whatever_the_header(TestBackend::MySql).await;
}

#[tokio::test]
async fn a_missing_or_invalid_business_key_is_a_problem_and_the_upstream_is_not_called() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![business_key_route()]).await;
    let cases = [
        (json!({"amount_minor": 1}), 400, "business-key-missing"),
        (json!({"external_ref": null}), 400, "business-key-missing"),
        (
            json!({"external_ref": "has space"}),
            422,
            "business-key-invalid",
        ),
        (
            json!({"external_ref": "x".repeat(256)}),
            422,
            "business-key-invalid",
        ),
        (json!({"external_ref": true}), 422, "business-key-invalid"),
        (
            json!({"external_ref": {"id": 1}}),
            422,
            "business-key-invalid",
        ),
    ];
    for (body, status, kind) in cases {
        for key in [None, Some("a-valid-header")] {
            let res = post(&gw.base, "/orders", KEY_A, key, &body).await;
            assert_eq!(res.status(), status, "{body}");
            assert_eq!(res.headers()["content-type"], "application/problem+json");
            let p: Value = res.json().await.unwrap();
            assert_eq!(p["type"], format!("urn:oncely:problem:{kind}"));
            assert_eq!(p["pointer"], "/external_ref");
            assert!(
                !p.to_string().contains("has space"),
                "never echoes values: {p}"
            );
        }
    }
    let not_json = reqwest::Client::new()
        .post(format!("{}/orders", gw.base))
        .bearer_auth(KEY_A)
        .header("Content-Type", "text/plain")
        .body("external_ref=x")
        .send()
        .await
        .unwrap();
    assert_eq!(not_json.status(), 415);
    assert_eq!(up.count().await, 0, "nothing was forwarded");
}
