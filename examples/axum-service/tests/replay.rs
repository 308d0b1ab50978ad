//! The README's walk-through, as a test: the example service on `127.0.0.1:0` over a real
//! PostgreSQL pool, driven by a real HTTP client.

use std::collections::BTreeMap;

use oncely_core::TenantId;
use oncely_testkit::{TestBackend, TestDb};
use serde_json::{json, Value};

async fn start() -> Option<(TestDb, String)> {
    let db = TestDb::new(TestBackend::Postgres).await?;
    let pool = db
        .db
        .as_postgres()
        .expect("a PostgreSQL test database")
        .clone();
    let keys = BTreeMap::from([
        ("key-a".to_owned(), TenantId::parse("tenant-a").unwrap()),
        ("key-b".to_owned(), TenantId::parse("tenant-b").unwrap()),
    ]);
    let router = oncely_example_axum::app(pool, keys).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    Some((db, format!("http://{addr}/transfers")))
}

async fn post(url: &str, api_key: Option<&str>, key: &str, body: &Value) -> (u16, bool, Value) {
    let mut req = reqwest::Client::new()
        .post(url)
        .header("Idempotency-Key", key)
        .json(body);
    if let Some(k) = api_key {
        req = req.header("X-Api-Key", k);
    }
    let res = req.send().await.unwrap();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    (res.status().as_u16(), replayed, res.json().await.unwrap())
}

async fn transfers(db: &TestDb) -> i64 {
    db.db
        .fetch_all::<(i64,)>(oncely_sql::query("SELECT COUNT(*) FROM transfers"))
        .await
        .unwrap()[0]
        .0
}

#[tokio::test]
async fn a_retried_transfer_is_replayed_not_made_twice() {
    let Some((db, url)) = start().await else {
        return;
    };
    let body = json!({"from": "alice", "to": "bob", "amount_minor": 500});
    let key = "8e0f6b1e-3f7a-4c55-9d2c-1d6f0c1a2b3c";
    let (status, replayed, first) = post(&url, Some("key-a"), key, &body).await;
    assert_eq!((status, replayed), (201, false), "{first}");
    let (status, replayed, again) = post(&url, Some("key-a"), key, &body).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, first, "the retry gets the first answer");
    assert_eq!(transfers(&db).await, 1);

    // The same key from another tenant is another operation.
    let (status, replayed, theirs) = post(&url, Some("key-b"), key, &body).await;
    assert_eq!((status, replayed), (201, false));
    assert_ne!(theirs["id"], first["id"]);
    // The same key with another amount is refused, and changes nothing.
    let other = json!({"from": "alice", "to": "bob", "amount_minor": 900});
    let (status, _, problem) = post(&url, Some("key-a"), key, &other).await;
    assert_eq!((status, problem["differs"].as_str()), (422, Some("body")));
    // No API key: the service's own tenant extraction refuses it before any lookup.
    let (status, _, _) = post(&url, None, key, &body).await;
    assert_eq!(status, 401);
    assert_eq!(transfers(&db).await, 2);
}

#[tokio::test]
async fn a_malformed_transfer_leaves_the_key_free_for_the_corrected_retry() {
    let Some((db, url)) = start().await else {
        return;
    };
    let key = "0b7e2a43-6d1c-4f0e-8a5b-2c9d3e4f5a6b";
    // `amount_minor` as a string: JSON, but not a transfer. Refused before the handler.
    let wrong = json!({"from": "alice", "to": "bob", "amount_minor": "500"});
    let (status, replayed, problem) = post(&url, Some("key-a"), key, &wrong).await;
    assert_eq!((status, replayed), (422, false), "{problem}");
    assert_eq!(problem["type"], "urn:oncely:problem:invalid-body");
    let fixed = json!({"from": "alice", "to": "bob", "amount_minor": 500});
    let (status, replayed, first) = post(&url, Some("key-a"), key, &fixed).await;
    assert_eq!((status, replayed), (201, false), "{first}");
    let (status, replayed, again) = post(&url, Some("key-a"), key, &fixed).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, first);
    assert_eq!(transfers(&db).await, 1);
}
