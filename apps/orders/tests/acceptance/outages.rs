//! The service when its store goes away or its clients misbehave: the database cut off
//! (503 and `/healthz`) or lost inside the handler, unknown order ids, `/healthz` and
//! `/metrics`, a slow request head, connections over the cap.

use std::time::Duration;

use oncely_sql::{Database, DbOptions};
use oncely_testkit::{without_statement_cache, Fault, FaultProxy, TestDb};
use orders::AppConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::{config, count_orders, order, start, unique, KEY_A};

/// A connection to `t`'s (migrated) database that the test can take away with [`cut_off`]:
/// through a [`FaultProxy`] on PostgreSQL and MySQL; SQLite is embedded, so its own pools
/// (closed instead).
async fn cuttable(t: &TestDb) -> (Database, Option<FaultProxy>) {
    orders::migrate(&t.db).await.unwrap();
    let opts = DbOptions {
        acquire_timeout: Duration::from_secs(1),
        ..DbOptions::default()
    };
    let (url, default_addr) = match &t.db {
        Database::Sqlite(_) => return (Database::connect(&t.url, &opts).await.unwrap(), None),
        Database::Postgres(_) => (oncely_testkit::postgres_url(), "127.0.0.1:5432"),
        Database::MySql(_) => (oncely_testkit::mysql_url(), "127.0.0.1:3306"),
    };
    assert!(
        url.contains(default_addr),
        "test assumes the default address {default_addr}"
    );
    let proxy = FaultProxy::start(default_addr.parse().unwrap()).await;
    let proxied = t.url.replace(default_addr, &proxy.addr().to_string());
    (
        Database::connect(&proxied, &opts).await.unwrap(),
        Some(proxy),
    )
}

/// Makes `db` (from [`cuttable`]) unreachable.
async fn cut_off(db: &Database, proxy: Option<&FaultProxy>) {
    match proxy {
        Some(p) => p.cut(),
        None => db.close().await,
    }
}

pub(super) async fn store_unreachable_answers_503_and_runs_nothing(t: TestDb) {
    let (db, proxy) = cuttable(&t).await;
    let s = start(&db, config()).await;
    let (key, ext) = (unique("down"), unique("ext"));
    cut_off(&db, proxy.as_ref()).await;
    let a = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(
        a.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&a.body)
    );
    assert_eq!(a.json()["type"], "urn:oncely:problem:store-unavailable");
    assert!(a.retry_after.is_some());
    assert_eq!(
        count_orders(&t.db, &ext).await,
        0,
        "nothing ran unprotected"
    );
    if let Some(p) = &proxy {
        p.restore();
        let b = s.post(KEY_A, &key, &order(&ext, 1999)).await;
        assert_eq!(
            b.status,
            StatusCode::CREATED,
            "the retry with the same key runs once the store is back"
        );
        assert_eq!(count_orders(&t.db, &ext).await, 1);
    }
}

/// `/healthz` is unauthenticated: with the database cut off it says which dependency is
/// down with a stable word, and nothing of the driver's error text (addresses, users,
/// paths, sqlx messages).
pub(super) async fn healthz_with_the_database_unreachable_names_no_driver_error(t: TestDb) {
    let (db, proxy) = cuttable(&t).await;
    let s = start(&db, config()).await;
    let up = s
        .client
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(up.status(), StatusCode::OK);
    cut_off(&db, proxy.as_ref()).await;
    let res = s
        .client
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = res.text().await.unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    // The whole object: no `detail`, no member that could carry the error.
    assert_eq!(
        v,
        json!({
            "type": "urn:oncely:problem:store-unavailable",
            "title": "The database cannot be reached",
            "checks": {"database": "unavailable"},
        }),
        "{body}"
    );
}

/// The handler's connection dies mid-transaction, after the key was claimed: at the
/// business insert, then at the outbox insert. The answer is 503 `store-unavailable` with
/// `Retry-After` (never a generic 500, never driver text), nothing is stored, and the retry
/// with the same key runs and creates exactly one order.
pub(super) async fn connection_lost_inside_the_handler_is_503_store_unavailable_and_the_retry_creates_one_order(
    t: TestDb,
) {
    orders::migrate(&t.db).await.unwrap();
    let (proxy, url) = FaultProxy::in_front_of(&t.url).await;
    let opts = DbOptions {
        max_connections: 4,
        ..DbOptions::default()
    };
    let db = Database::connect(&without_statement_cache(&url), &opts)
        .await
        .unwrap();
    let s = start(&db, config()).await;
    for (n, needle) in ["INSERT INTO orders", "INSERT INTO oncely_outbox"]
        .into_iter()
        .enumerate()
    {
        let (key, ext) = (unique("cut"), unique("ext"));
        proxy.fault_when_sent(needle, Fault::Cut);
        let a = s.post(KEY_A, &key, &order(&ext, 1999)).await;
        assert_eq!(
            proxy.faults_applied(),
            n + 1,
            "{needle}: the cut hit the handler"
        );
        let body = String::from_utf8_lossy(&a.body).into_owned();
        assert_eq!(
            a.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{needle}: {body}"
        );
        assert_eq!(a.json()["type"], "urn:oncely:problem:store-unavailable");
        assert!(a.retry_after.is_some(), "{needle}: Retry-After");
        for driver_text in ["communicating", "os error", "sqlx", "Connection"] {
            assert!(
                !body.contains(driver_text),
                "{needle}: driver text in {body}"
            );
        }
        assert_eq!(
            count_orders(&t.db, &ext).await,
            0,
            "{needle}: nothing stored"
        );
        proxy.restore();
        // MariaDB frees the key when it notices the closed session: 409 until then.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let b = loop {
            let b = s.post(KEY_A, &key, &order(&ext, 1999)).await;
            if b.status != StatusCode::CONFLICT || std::time::Instant::now() > deadline {
                break b;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(b.status, StatusCode::CREATED, "{needle}: the retry runs");
        assert!(!b.replayed);
        assert_eq!(count_orders(&t.db, &ext).await, 1, "{needle}: one order");
    }
}

/// `GET /v1/orders/{id}` for an id that does not exist, or is not UTF-8 once decoded
/// (`%ff`, `%C3%28`), answers the same 404 problem — not axum's plain-text 400 (found by a
/// break run of issue 14).
pub(super) async fn unknown_and_undecodable_order_ids_are_404_problems(t: TestDb) {
    let s = start(&t.db, config()).await;
    for id in ["no-such-order", "%ff", "%C3%28"] {
        let res = s
            .client
            .get(format!("{}/v1/orders/{id}", s.base))
            .bearer_auth(KEY_A)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::NOT_FOUND, "{id}");
        assert_eq!(
            res.headers()["content-type"],
            "application/problem+json",
            "{id}"
        );
        let v: Value = res.json().await.unwrap();
        assert_eq!(v["type"], "urn:oncely:problem:not-found", "{id}");
    }
}

pub(super) async fn healthz_and_metrics_answer(t: TestDb) {
    let s = start(&t.db, config()).await;
    let h = s
        .client
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), StatusCode::OK);
    assert_eq!(
        h.json::<Value>().await.unwrap(),
        json!({"status": "ok", "checks": {"database": "ok"}})
    );
    let key = unique("m");
    let body = order(&unique("ext"), 1);
    s.post(KEY_A, &key, &body).await;
    s.post(KEY_A, &key, &body).await;
    let m = s
        .client
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("oncely_idempotency_replays_total"), "{m}");
}

/// Slowloris: a client that sends a request head and never finishes it loses its connection
/// after the header read timeout, while a normal request on another connection is served.
pub(super) async fn slow_request_head_is_cut_off_after_the_header_read_timeout(t: TestDb) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let server = start(
        &t.db,
        AppConfig {
            http: oncely_http::HttpLimits {
                header_read_timeout: Duration::from_secs(1),
                ..oncely_http::HttpLimits::default()
            },
            ..config()
        },
    )
    .await;
    let mut slow = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = [0_u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                // hyper may answer 408 before closing; keep reading until the close.
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the slow connection was still open after 10 s"
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?}, expected about 1 s"
    );
    // The service itself is fine.
    let res = server
        .client
        .get(format!("{}/healthz", server.base))
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success());
}

/// At `max_connections` the server accepts no more: a further connection waits (in the
/// listen backlog, unanswered) until one of the open ones closes, then it is served.
pub(super) async fn connections_over_the_cap_wait_until_one_closes(t: TestDb) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let server = start(
        &t.db,
        AppConfig {
            http: oncely_http::HttpLimits {
                max_connections: 2,
                ..oncely_http::HttpLimits::default()
            },
            ..config()
        },
    )
    .await;
    let first = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let _second = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let mut third = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let early = tokio::time::timeout(Duration::from_secs(1), third.read_to_end(&mut answer)).await;
    assert!(
        early.is_err(),
        "a third connection was served at a cap of 2: {}",
        String::from_utf8_lossy(&answer)
    );
    drop(first);
    tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut answer))
        .await
        .expect("served once a slot is free")
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
}
