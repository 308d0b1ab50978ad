//! The upstream's faults (issue 30 "Done when"): 5xx before doing anything, connection
//! refused, the answer dropped after the commit, a timeout then a commit; the probe that
//! resolves an unknown operation, and an operation that stays unknown without one.

use std::time::Duration;

use oncely_gateway::{On5xx, ProbeConfig, RouteConfig};
use oncely_testkit::TestBackend;
use serde_json::{json, Value};

use crate::support::{
    gateway, operation_status, orders_route, post, retries_get_not_replayable, test_db, Upstream,
    KEY_A,
};

/// `POST /orders` with a probe by `external_ref` that trusts an absence after `settle_ms`.
fn probed_route(settle_ms: u64) -> RouteConfig {
    let mut route = orders_route();
    route.probe = Some(ProbeConfig {
        url: "/orders?external_ref={/external_ref}".to_owned(),
        select: Some("/0".to_owned()),
        found_status: Some(201),
        settle_ms,
    });
    route
}

async fn problem_type(res: reqwest::Response) -> String {
    let v: Value = res.json().await.unwrap();
    v["type"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn an_upstream_5xx_before_doing_anything_frees_the_key_and_the_retry_is_forwarded() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let body = json!({"external_ref": "f-1"});
    up.fault("fail_503").await;
    let first = post(&gw.base, "/orders", KEY_A, Some("f-1"), &body).await;
    assert_eq!(first.status(), 503);
    let retry = post(&gw.base, "/orders", KEY_A, Some("f-1"), &body).await;
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn a_route_that_stores_5xx_replays_the_upstream_s_5xx() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let mut route = orders_route();
    route.on_5xx = On5xx::Store;
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    let body = json!({"external_ref": "f-2"});
    up.fault("fail_503").await;
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, Some("f-2"), &body)
            .await
            .status(),
        503
    );
    let retry = post(&gw.base, "/orders", KEY_A, Some("f-2"), &body).await;
    assert_eq!(retry.status(), 503);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(up.count().await, 0);
}

#[tokio::test]
async fn connection_refused_frees_the_key() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(
        &db.db,
        &format!("http://127.0.0.1:{port}"),
        vec![orders_route()],
    )
    .await;
    let body = json!({"external_ref": "f-3"});
    let refused = post(&gw.base, "/orders", KEY_A, Some("f-3"), &body).await;
    assert_eq!(refused.status(), 502);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(
        problem_type(refused).await,
        "urn:oncely:problem:upstream-unreachable"
    );
    let up = Upstream::on_port(port);
    let retry = post(&gw.base, "/orders", KEY_A, Some("f-3"), &body).await;
    assert_eq!(retry.status(), 201, "the key was freed");
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn an_answer_dropped_after_the_commit_is_unknown_never_reforwarded_and_the_probe_resolves_it()
{
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![probed_route(60_000)]).await;
    let body = json!({"external_ref": "f-4", "amount_minor": 100});
    up.fault("drop").await;
    let first = post(&gw.base, "/orders", KEY_A, Some("f-4"), &body).await;
    assert_eq!(first.status(), 503);
    assert_eq!(
        first.headers()["link"],
        "</_oncely/routes/0/operations/f-4>; rel=\"monitor\""
    );
    assert_eq!(
        problem_type(first).await,
        "urn:oncely:problem:upstream-outcome-unknown"
    );
    assert_eq!(up.count().await, 1, "the upstream committed");

    let retry = post(&gw.base, "/orders", KEY_A, Some("f-4"), &body).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["oncely-resolved-by"], "probe");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let found: Value = retry.json().await.unwrap();
    assert_eq!(found["external_ref"], "f-4");
    assert_eq!(found["idempotency_key"], "f-4");

    let again = post(&gw.base, "/orders", KEY_A, Some("f-4"), &body).await;
    assert_eq!(again.headers()["oncely-resolved-by"], "probe");
    assert_eq!(again.json::<Value>().await.unwrap(), found);
    assert_eq!(up.count().await, 1, "never forwarded again");
}

#[tokio::test]
async fn without_a_probe_an_unknown_operation_stays_unknown() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let body = json!({"external_ref": "f-5"});
    up.fault("drop").await;
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, Some("f-5"), &body)
            .await
            .status(),
        503
    );
    for _ in 0..2 {
        let retry = post(&gw.base, "/orders", KEY_A, Some("f-5"), &body).await;
        assert_eq!(retry.status(), 409);
        assert!(retry.headers().get("link").is_some());
        assert_eq!(
            problem_type(retry).await,
            "urn:oncely:problem:outcome-unknown"
        );
    }
    let status = operation_status(&gw.base, "f-5").await;
    assert_eq!(status["state"], "unknown");
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn an_upstream_slow_past_the_timeout_that_then_commits_is_resolved_by_the_probe() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let mut route = probed_route(3_000);
    route.timeout_ms = 300;
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    let body = json!({"external_ref": "f-6"});
    up.fault("slow:1.0").await;
    let first = post(&gw.base, "/orders", KEY_A, Some("f-6"), &body).await;
    assert_eq!(first.status(), 503);
    // Not committed yet, and the absence is not trusted before the settle time.
    let early = post(&gw.base, "/orders", KEY_A, Some("f-6"), &body).await;
    assert_eq!(early.status(), 409);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(up.count().await, 1, "the upstream committed late");
    let retry = post(&gw.base, "/orders", KEY_A, Some("f-6"), &body).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["oncely-resolved-by"], "probe");
    assert_eq!(up.count().await, 1);
}

#[tokio::test]
async fn an_absence_past_the_settle_time_allows_one_new_forward_under_the_same_key() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![probed_route(200)]).await;
    let body = json!({"external_ref": "f-7"});
    up.fault("vanish").await;
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, Some("f-7"), &body)
            .await
            .status(),
        503
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = post(&gw.base, "/orders", KEY_A, Some("f-7"), &body).await;
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().get("oncely-resolved-by").is_none());
    let again = post(&gw.base, "/orders", KEY_A, Some("f-7"), &body).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(up.count().await, 1);
}

async fn an_object_the_probe_finds_over_the_stored_bound(backend: TestBackend) {
    let Some(db) = test_db(backend, 4).await else {
        return;
    };
    let up = Upstream::start();
    let mut route = probed_route(60_000);
    route.max_stored_response_bytes = 256;
    let gw = gateway(&db.db, &up.base, vec![route]).await;
    let body = json!({"external_ref": "big-1", "note": "x".repeat(1_000)});
    up.fault("drop").await;
    let first = post(&gw.base, "/orders", KEY_A, Some("big-1"), &body).await;
    assert_eq!(first.status(), 503);
    assert_eq!(up.count().await, 1, "the upstream committed");

    // The retry that ran the probe gets the object whole, though it cannot be stored.
    let retry = post(&gw.base, "/orders", KEY_A, Some("big-1"), &body).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["oncely-resolved-by"], "probe");
    let found = retry.bytes().await.unwrap();
    assert!(found.len() > 1_000, "whole: {} bytes", found.len());
    let found: Value = serde_json::from_slice(&found).unwrap();
    assert_eq!(found["note"], body["note"]);
    assert_eq!(found["idempotency_key"], "big-1");

    // Every later retry: the stored 409, never a second forward.
    let status = retries_get_not_replayable(&gw.base, "big-1", &body).await;
    assert_eq!(status["state"], "succeeded", "from the found status");
    assert_eq!(status["response_status"], 409);
    assert_eq!(up.count().await, 1, "never forwarded again");
}

#[tokio::test]
async fn an_object_the_probe_finds_over_the_stored_bound_goes_whole_to_its_caller_and_409_to_later_retries_on_sqlite(
) {
    an_object_the_probe_finds_over_the_stored_bound(TestBackend::Sqlite).await;
}

#[tokio::test]
async fn an_object_the_probe_finds_over_the_stored_bound_goes_whole_to_its_caller_and_409_to_later_retries_on_postgres(
) {
    an_object_the_probe_finds_over_the_stored_bound(TestBackend::Postgres).await;
}
