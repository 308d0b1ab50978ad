//! The order endpoint over HTTP: bodies and their limits, a held lock on the idempotency
//! table, ambiguous credentials and unknown routes, the retries of S1–S4 and S7, tenant
//! isolation, business keys, invalid input, missing and malformed keys, unauthenticated calls.

use std::sync::Arc;
use std::time::Duration;

use oncely_sql::{Database, DbOptions};
use oncely_testkit::TestDb;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use super::{
    config, count_orders, count_records, order, start, start_migrated, unique, Answer, Server,
    KEY_A, KEY_B,
};

pub(super) async fn ambiguous_or_unsupported_bodies_are_rejected_and_not_stored(t: TestDb) {
    let s = start(&t.db, config()).await;
    let ext = unique("ext");
    let body = order(&ext, 1999).to_string();
    // The same bytes without a JSON media type: 415, nothing stored, the key stays usable.
    let key = unique("ct");
    let res = s
        .client
        .post(format!("{}/v1/orders", s.base))
        .bearer_auth(KEY_A)
        .header("idempotency-key", &key)
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(
        s.post_raw(KEY_A, Some(&key), body.clone()).await.status,
        StatusCode::CREATED
    );
    // A duplicate member name is ambiguous (RFC 8785 §3.1 needs I-JSON): 400, not a replay.
    let dup = body.replacen(
        "\"amount_minor\":1999",
        "\"amount_minor\":5,\"amount_minor\":1999",
        1,
    );
    assert_ne!(dup, body);
    let res = s.post_raw(KEY_A, Some(&key), dup).await;
    assert_eq!(res.status, StatusCode::BAD_REQUEST);
    assert!(!res.replayed);
    // Values are never echoed in problem details.
    let mut secret = order(&unique("ext"), 1);
    secret["amount_minor"] = json!("SECRET-VALUE-123");
    let res = s.post(KEY_A, &unique("secret"), &secret).await;
    assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!String::from_utf8_lossy(&res.body).contains("SECRET"));
    // Invisible differences in business identifiers would make distinct orders.
    for bad in ["A-1 ", " A-1", "A-1\u{200b}", "A-\u{202e}1"] {
        let res = s.post(KEY_A, &unique("inv"), &order(bad, 1)).await;
        assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY, "{bad:?}");
    }
    assert_eq!(
        count_records(&t.db).await,
        1,
        "only the created order's record exists"
    );
}

pub(super) async fn bodies_over_two_mebibytes_within_the_bound_are_not_a_stored_413(t: TestDb) {
    let mut cfg = config();
    cfg.idempotency.max_request_body = 4_000_000;
    let s = start(&t.db, cfg).await;
    let (key, ext) = (unique("big"), unique("ext"));
    let body = order(&ext, 1999).to_string();
    let padded = format!("{}{}}}", &body[..body.len() - 1], " ".repeat(2_200_000));
    let first = s.post_raw(KEY_A, Some(&key), padded).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    // The same JSON without the padding is the same request (RFC 8785): a replay.
    let again = s.post_raw(KEY_A, Some(&key), body).await;
    assert!(again.replayed);
    assert_eq!(again.body, first.body);
    // Over the configured bound: 413 before any reservation, nothing stored.
    let over = format!(
        "{}{}}}",
        &order(&unique("ext"), 1).to_string()[..10],
        " ".repeat(4_100_000)
    );
    let res = s.post_raw(KEY_A, Some(&unique("over")), over).await;
    assert_eq!(res.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(count_records(&t.db).await, 1);
}

pub(super) async fn a_held_lock_on_the_idempotency_table_is_503_not_500(t: TestDb) {
    orders::migrate(&t.db).await.unwrap();
    let opts = DbOptions {
        lock_timeout: Duration::from_millis(300),
        ..DbOptions::default()
    };
    let db = Database::connect(&t.url, &opts).await.unwrap();
    let s = start_migrated(&db, config()).await;
    // Another session holds the table (a migration, VACUUM FULL, a long writer).
    let blocker = Database::connect(&t.url, &DbOptions::default())
        .await
        .unwrap();
    let mut held = blocker.begin().await.unwrap();
    match &mut held {
        oncely_sql::Tx::Postgres(c) => {
            sqlx::query("LOCK TABLE oncely_idempotency IN ACCESS EXCLUSIVE MODE")
                .execute(&mut **c)
                .await
                .unwrap();
        }
        oncely_sql::Tx::Sqlite(_) => {} // BEGIN IMMEDIATE already holds the write lock
        // The request's read then waits for the metadata lock at most lock_wait_timeout.
        oncely_sql::Tx::MySql(c) => {
            sqlx::query("LOCK TABLES oncely_idempotency WRITE")
                .execute(&mut **c)
                .await
                .unwrap();
        }
    }
    let (key, ext) = (unique("lock"), unique("ext"));
    let res = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(
        res.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&res.body)
    );
    assert!(res.retry_after.is_some());
    if let oncely_sql::Tx::MySql(c) = &mut held {
        // ROLLBACK does not end LOCK TABLES.
        sqlx::query("UNLOCK TABLES")
            .execute(&mut **c)
            .await
            .unwrap();
    }
    held.rollback().await.unwrap();
    let res = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(res.status, StatusCode::CREATED);
}

pub(super) async fn ambiguous_credentials_and_unknown_routes_are_problems(t: TestDb) {
    let s = start(&t.db, config()).await;
    let res = s
        .client
        .post(format!("{}/v1/orders", s.base))
        .header("authorization", format!("Bearer {KEY_A}"))
        .header("authorization", format!("Bearer {KEY_B}"))
        .header("idempotency-key", unique("two"))
        .header("content-type", "application/json")
        .body(order(&unique("ext"), 1).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    for (method, path, status) in [("GET", "/nope", 404), ("PUT", "/v1/orders", 405)] {
        let res = s
            .client
            .request(method.parse().unwrap(), format!("{}{path}", s.base))
            .bearer_auth(KEY_A)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), status);
        assert_eq!(res.headers()["content-type"], "application/problem+json");
    }
}

pub(super) async fn s1_sequential_retries_create_one_order(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("s1"), unique("ext"));
    let body = order(&ext, 1999);
    let first = s.post(KEY_A, &key, &body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed);
    let location = first.location.clone().expect("Location");
    assert_eq!(location, format!("/v1/orders/{}", first.id()));
    for _ in 0..20 {
        let again = s.post(KEY_A, &key, &body).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed, "every answer after the first is a replay");
        assert_eq!(again.body, first.body, "replay is byte-identical");
        assert_eq!(again.location.as_deref(), Some(location.as_str()));
    }
    assert_eq!(count_orders(&t.db, &ext).await, 1);
    let got = s
        .client
        .get(format!("{}{location}", s.base))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), StatusCode::OK);
    assert_eq!(got.json::<Value>().await.unwrap()["id"], first.json()["id"]);
}

pub(super) async fn s2_concurrent_requests_with_one_key_create_one_order(t: TestDb) {
    let s = Arc::new(start(&t.db, config()).await);
    let (key, ext) = (unique("s2"), unique("ext"));
    let body = order(&ext, 1999);
    let n = 64;
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (s, key, body, barrier) = (s.clone(), key.clone(), body.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            s.post(KEY_A, &key, &body).await
        }));
    }
    let mut executed = 0;
    let mut ids = std::collections::HashSet::new();
    for task in tasks {
        let a = task.await.unwrap();
        match a.status {
            StatusCode::CREATED => {
                if !a.replayed {
                    executed += 1;
                }
                ids.insert(a.id());
            }
            StatusCode::CONFLICT => {
                assert_eq!(a.json()["type"], "urn:oncely:problem:request-in-flight");
                assert!(a.retry_after.is_some(), "409 carries Retry-After");
            }
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&a.body)),
        }
    }
    assert_eq!(
        executed, 1,
        "exactly one execution; every other answer is a replay or 409"
    );
    assert_eq!(ids.len(), 1, "every 201 names the same order");
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn s3_same_key_other_amount_is_422_and_reordered_json_replays(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("s3"), unique("ext"));
    let first = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let other = s.post(KEY_A, &key, &order(&ext, 2999)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem = other.json();
    assert_eq!(problem["type"], "urn:oncely:problem:idempotency-key-reused");
    assert_eq!(problem["differs"], "body");
    assert!(
        !String::from_utf8_lossy(&other.body).contains("2999"),
        "never echoes values"
    );

    let mut recipient = order(&ext, 1999);
    recipient["customer_id"] = json!("c-43");
    assert_eq!(
        s.post(KEY_A, &key, &recipient).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );

    // The same JSON with keys reordered and other whitespace is the same request.
    let reordered = format!(
        "{{\n  \"currency\" : \"EUR\", \"amount_minor\":1999,\n\t\"items\": [ {{\"quantity\":2,\"sku\":\"sku-1\"}}, {{\"quantity\": 1, \"sku\": \"sku-2\"}} ],\
         \"customer_id\":\"c-42\", \"external_ref\": \"{ext}\", \"source\":\"shop\" }}"
    );
    let replay = s.post_raw(KEY_A, Some(&key), reordered).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);

    // Nothing changed.
    assert_eq!(count_orders(&t.db, &ext).await, 1);
    let again = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(again.body, first.body);
}

/// Writes a whole order request on a raw socket; the caller decides when to hang up.
async fn send_raw(s: &Server, key: &str, body: &str) -> tokio::net::TcpStream {
    let mut sock = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let req = format!(
        "POST /v1/orders HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {KEY_A}\r\n\
         Idempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        s.addr,
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    sock.flush().await.unwrap();
    sock
}

/// Retries while the answer is 409 "in flight" (at most 5 s).
async fn retry_until_settled(s: &Server, key: &str, body: &str) -> Answer {
    let mut retry = s.post_raw(KEY_A, Some(key), body.to_owned()).await;
    for _ in 0..100 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        retry = s.post_raw(KEY_A, Some(key), body.to_owned()).await;
    }
    retry
}

pub(super) async fn s4_connection_dropped_before_answer_retry_returns_same_order(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("s4"), unique("ext"));
    let body = order(&ext, 1999).to_string();
    let sock = send_raw(&s, &key, &body).await;
    // The server executes and commits; the client hangs up without reading the answer.
    for _ in 0..200 {
        if count_orders(&t.db, &ext).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(sock);
    let retry = retry_until_settled(&s, &key, &body).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed,
        "the retry is the replay of the executed request"
    );
    let got = s
        .client
        .get(format!("{}/v1/orders/{}", s.base, retry.id()))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), StatusCode::OK);
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn client_hanging_up_mid_request_cannot_cause_a_second_order(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("s4b"), unique("ext"));
    let body = order(&ext, 1999).to_string();
    // Hang up at once, before the server can have answered.
    drop(send_raw(&s, &key, &body).await);
    let retry = retry_until_settled(&s, &key, &body).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    for _ in 0..3 {
        let again = s.post_raw(KEY_A, Some(&key), body.clone()).await;
        assert!(again.replayed);
        assert_eq!(again.id(), retry.id());
    }
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn s7_after_retention_business_key_prevents_second_order(t: TestDb) {
    let mut cfg = config();
    cfg.retention = Duration::from_millis(200);
    cfg.collector_interval = Duration::from_millis(100);
    let s = start(&t.db, cfg).await;
    let (key, ext) = (unique("s7"), unique("ext"));
    let first = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Wait for the collector to delete the expired record.
    let mut gone = false;
    for _ in 0..100 {
        if count_records(&t.db).await == 0 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the collector deleted the expired record");

    // The same key, past retention: the record is gone, the business key still holds.
    let same_key = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(same_key.status, StatusCode::OK);
    assert_eq!(same_key.id(), first.id());
    // A new key for the same business operation.
    let new_key = s.post(KEY_A, &unique("s7-new"), &order(&ext, 1999)).await;
    assert_eq!(new_key.status, StatusCode::OK);
    assert_eq!(new_key.id(), first.id());
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn tenants_never_see_each_others_records(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("iso"), unique("ext"));
    let body = order(&ext, 1999);
    let a = s.post(KEY_A, &key, &body).await;
    assert_eq!(a.status, StatusCode::CREATED);
    // Same key, same body, other tenant: a new operation, never A's stored answer.
    let b = s.post(KEY_B, &key, &body).await;
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed);
    assert_ne!(a.id(), b.id());
    // Same key, other body, other tenant: no 422 either — the key is B's own.
    let b2 = s
        .post(KEY_B, &unique("iso2"), &order(&unique("ext"), 5))
        .await;
    assert_eq!(b2.status, StatusCode::CREATED);
    // B cannot read A's order.
    let res = s
        .client
        .get(format!("{}/v1/orders/{}", s.base, a.id()))
        .bearer_auth(KEY_B)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
}

pub(super) async fn business_key_reused_with_new_key_answers_existing_or_conflict(t: TestDb) {
    let s = start(&t.db, config()).await;
    let ext = unique("ext");
    let first = s.post(KEY_A, &unique("bk1"), &order(&ext, 1999)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let same = s.post(KEY_A, &unique("bk2"), &order(&ext, 1999)).await;
    assert_eq!(same.status, StatusCode::OK);
    assert_eq!(same.id(), first.id());
    let conflict_key = unique("bk3");
    let conflict = s.post(KEY_A, &conflict_key, &order(&ext, 5000)).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.json()["type"], "urn:oncely:problem:order-conflict");
    // A business rejection after execution is stored and replayed.
    let replayed = s.post(KEY_A, &conflict_key, &order(&ext, 5000)).await;
    assert_eq!(replayed.status, StatusCode::CONFLICT);
    assert!(replayed.replayed);
    assert_eq!(replayed.body, conflict.body);
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn invalid_input_is_rejected_and_not_stored(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("inv"), unique("ext"));
    let mut bad = order(&ext, 1999);
    bad["currency"] = json!("eur");
    let a = s.post(KEY_A, &key, &bad).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.json()["type"], "urn:oncely:problem:invalid-order");
    let malformed = s
        .post_raw(KEY_A, Some(&unique("inv2")), "{\"source\":".into())
        .await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    let mut unknown_field = order(&ext, 1999);
    unknown_field["surprise"] = json!(1);
    assert_eq!(
        s.post(KEY_A, &unique("inv3"), &unknown_field).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        count_records(&t.db).await,
        0,
        "validation failures leave no record"
    );
    // The key stays usable once the client fixes its request.
    let fixed = s.post(KEY_A, &key, &order(&ext, 1999)).await;
    assert_eq!(fixed.status, StatusCode::CREATED);
    assert!(!fixed.replayed);
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn missing_and_malformed_keys_are_400_problems(t: TestDb) {
    let s = start(&t.db, config()).await;
    let ext = unique("ext");
    let body = order(&ext, 1999).to_string();
    let missing = s.post_raw(KEY_A, None, body.clone()).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.json()["type"],
        "urn:oncely:problem:idempotency-key-missing"
    );
    let long = "k".repeat(256);
    for bad in [long.as_str(), "has space", "\"unterminated", "\"\""] {
        let a = s.post_raw(KEY_A, Some(bad), body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "key {bad:?}");
        assert_eq!(
            a.json()["type"],
            "urn:oncely:problem:idempotency-key-malformed"
        );
    }
    // A 255-character key and a quoted sf-string are valid, and name the same key.
    let k255 = "k".repeat(255);
    assert_eq!(
        s.post_raw(KEY_A, Some(&k255), body.clone()).await.status,
        StatusCode::CREATED
    );
    let quoted = format!("\"{k255}\"");
    let replay = s.post_raw(KEY_A, Some(&quoted), body).await;
    assert!(replay.replayed);
    assert_eq!(count_orders(&t.db, &ext).await, 1);
}

pub(super) async fn unauthenticated_requests_are_401_before_any_lookup(t: TestDb) {
    let s = start(&t.db, config()).await;
    let (key, ext) = (unique("auth"), unique("ext"));
    assert_eq!(
        s.post(KEY_A, &key, &order(&ext, 1999)).await.status,
        StatusCode::CREATED
    );
    // Another caller who knows the key gets nothing of the stored answer.
    let res = s
        .client
        .post(format!("{}/v1/orders", s.base))
        .bearer_auth("not-a-configured-key-000")
        .header("idempotency-key", &key)
        .header("content-type", "application/json")
        .body(order(&ext, 1999).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(res.headers()["www-authenticate"], "Bearer");
    assert!(res.headers().get("idempotent-replayed").is_none());
    let problem: Value = res.json().await.unwrap();
    assert_eq!(problem["type"], "urn:oncely:problem:unauthenticated");
}
