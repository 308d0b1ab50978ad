//! Per-route fingerprint parts: the body narrowed to JSON pointers (a retry that changes
//! only an unlisted field replays) and request headers covered (`differs: headers`), on
//! SQLite and PostgreSQL.

use oncely_gateway::RouteConfig;
use oncely_testkit::TestBackend;
use serde_json::{json, Value};

use crate::support::{gateway, orders_route, post, test_db, Upstream, KEY_A};

/// A `POST {base}/orders` with `key`, tenant a, `headers` and JSON `body`.
async fn post_with(
    base: &str,
    key: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", key)
        .json(body);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.send().await.unwrap()
}

async fn problem(res: reqwest::Response) -> Value {
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    res.json().await.unwrap()
}

fn narrowed_route() -> RouteConfig {
    let mut route = orders_route();
    route.fingerprint_body = Some(vec!["/amount_minor".to_owned(), "/currency".to_owned()]);
    route
}

async fn a_narrowed_body_replays_a_retry_that_changes_only_an_unlisted_field(backend: TestBackend) {
    let Some(db) = test_db(backend, 4).await else {
        return;
    };
    let up = Upstream::start();
    let gw = gateway(&db.db, &up.base, vec![narrowed_route()]).await;
    let body = json!({"external_ref": "n-1", "amount_minor": 100, "currency": "EUR", "nonce": "a"});
    let first = post(&gw.base, "/orders", KEY_A, Some("n-1"), &body).await;
    assert_eq!(first.status(), 201);
    let first_body = first.bytes().await.unwrap();

    let regenerated =
        json!({"nonce": "b", "currency": "EUR", "amount_minor": 100.0, "external_ref": "n-1"});
    let retry = post(&gw.base, "/orders", KEY_A, Some("n-1"), &regenerated).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.bytes().await.unwrap(), first_body);

    let changed =
        json!({"external_ref": "n-1", "amount_minor": 200, "currency": "EUR", "nonce": "a"});
    let res = post(&gw.base, "/orders", KEY_A, Some("n-1"), &changed).await;
    assert_eq!(res.status(), 422);
    let p = problem(res).await;
    assert_eq!(p["type"], "urn:oncely:problem:idempotency-key-reused");
    assert_eq!(p["differs"], "body");
    assert!(!p.to_string().contains("200"), "never echoes values: {p}");

    // A listed field missing is not a listed field `null`.
    let missing = json!({"external_ref": "n-2", "amount_minor": 100});
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, Some("n-2"), &missing)
            .await
            .status(),
        201
    );
    let null = json!({"external_ref": "n-2", "amount_minor": 100, "currency": null});
    let res = post(&gw.base, "/orders", KEY_A, Some("n-2"), &null).await;
    assert_eq!(res.status(), 422);
    assert_eq!(problem(res).await["differs"], "body");

    let text = reqwest::Client::new()
        .post(format!("{}/orders", gw.base))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "n-3")
        .header("Content-Type", "text/plain")
        .body("amount_minor=100")
        .send()
        .await
        .unwrap();
    assert_eq!(text.status(), 415);
    assert_eq!(
        problem(text).await["type"],
        "urn:oncely:problem:unsupported-media-type"
    );
    assert_eq!(up.count().await, 2, "forwarded once per operation");
}

#[tokio::test]
async fn a_narrowed_body_replays_a_retry_that_changes_only_an_unlisted_field_on_sqlite() {
    a_narrowed_body_replays_a_retry_that_changes_only_an_unlisted_field(TestBackend::Sqlite).await;
}

#[tokio::test]
async fn a_narrowed_body_replays_a_retry_that_changes_only_an_unlisted_field_on_postgres() {
    a_narrowed_body_replays_a_retry_that_changes_only_an_unlisted_field(TestBackend::Postgres)
        .await;
}

async fn a_covered_header_that_differs_is_422_naming_headers(backend: TestBackend) {
    let Some(db) = test_db(backend, 4).await else {
        return;
    };
    let up = Upstream::start();
    let mut route = orders_route();
    route.fingerprint_headers = vec!["Stripe-Version".to_owned()];
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    let body = json!({"external_ref": "h-1", "amount_minor": 100});
    let v1 = [("Stripe-Version", "2024-06-20")];
    assert_eq!(post_with(&gw.base, "h-1", &v1, &body).await.status(), 201);
    let same = post_with(
        &gw.base,
        "h-1",
        &[("stripe-version", "2024-06-20"), ("X-Other", "1")],
        &body,
    )
    .await;
    assert_eq!(same.status(), 201);
    assert_eq!(same.headers()["idempotent-replayed"], "true");

    for headers in [&[("Stripe-Version", "2025-01-01")][..], &[]] {
        let res = post_with(&gw.base, "h-1", headers, &body).await;
        assert_eq!(res.status(), 422);
        let p = problem(res).await;
        assert_eq!(p["differs"], "headers");
        assert!(!p.to_string().contains("2025"), "never echoes values: {p}");
    }
    let changed = json!({"external_ref": "h-1", "amount_minor": 101});
    let res = post_with(&gw.base, "h-1", &v1, &changed).await;
    assert_eq!(problem(res).await["differs"], "body");
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn a_covered_header_that_differs_is_422_naming_headers_on_sqlite() {
    a_covered_header_that_differs_is_422_naming_headers(TestBackend::Sqlite).await;
}

#[tokio::test]
async fn a_covered_header_that_differs_is_422_naming_headers_on_postgres() {
    a_covered_header_that_differs_is_422_naming_headers(TestBackend::Postgres).await;
}

#[tokio::test]
async fn a_covered_header_that_differs_is_422_naming_headers_on_mariadb() {
    a_covered_header_that_differs_is_422_naming_headers(TestBackend::MySql).await;
}
