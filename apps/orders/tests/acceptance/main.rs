//! Acceptance checks of docs/ACCEPTANCE.md for the order service, over real HTTP on
//! `127.0.0.1:0`, on SQLite, PostgreSQL and MariaDB / MySQL.
//!
//! - this file: the HTTP service (keys, replays, limits, outages);
//! - `billing`: the `billing` consumer of `order.created`;
//! - `binary`: the `orders` binary as a process (and the `oncely` binary against it): S8,
//!   migrations, SIGTERM, the consumers on every broker, import, the flows with chaos,
//!   slow clients, the console in a browser, schemathesis, `/metrics`;
//! - `chain`: an order's whole chain from the durable stores (after publication, under the
//!   choreography and the saga), the console's timeline and tenant-scoped search, `orders
//!   show --json`, server-side sign-out;
//! - `console`: the operator console over HTTP (sign-in, pages, audited CSRF-checked actions);
//! - `events`: every created order yields one `order.created` through the relay, on every
//!   broker;
//! - `fault_space`: the endpoint, the choreography and the saga under a seeded fault
//!   schedule per order at an HTTP fault proxy in front of each provider, against providers
//!   that honour keys, ignore them, search with lag or only list; checked at the provider;
//! - `flow`: order → invoice → charge → `invoice.paid` → shipment against the provider
//!   simulators and localstripe, counted at the provider;
//! - `fulfilment`: the fulfilment saga (reserve → charge → ship → invoice) with its
//!   compensations and `POST /v1/orders/{id}/cancel`, against the simulators;
//! - `list`: `GET /v1/orders` pages, tenant scope, bad cursors;
//! - `openapi`: `GET /openapi.json` is OpenAPI 3.1 and lists every route the router serves;
//! - `payments`: `POST /v1/orders/{id}/payments` (multi-phase) and `GET /v1/operations/{key}`;
//! - `verify`: `oncely verify` finds every check holding against the service.

mod billing;
mod binary;
mod chain;
mod console;
mod events;
mod fault_space;
mod flow;
mod fulfilment;
mod list;
mod money;
mod openapi;
mod payments;
mod verify;

use std::sync::Arc;
use std::time::Duration;

use console::{
    console_is_off_without_a_token_and_refuses_tenant_keys,
    console_pages_show_seeded_rows_and_actions_are_csrf_checked_and_audited,
};
use oncely_sql::{on_pool, Database, DbOptions};
use oncely_testkit::{without_statement_cache, Fault, FaultProxy, TestDb};
use orders::AppConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

/// A provider simulator served on `127.0.0.1:0`, stopped on drop.
pub(crate) struct Sim {
    pub(crate) base: String,
    stop: CancellationToken,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Serves a simulator's `router` on `127.0.0.1:0` until the returned [`Sim`] is dropped.
pub(crate) async fn serve_sim(router: axum::Router) -> Sim {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(oncely_sim::serve(
        listener,
        router,
        stop.clone().cancelled_owned(),
    ));
    Sim { base, stop }
}

const KEY_A: &str = "key-tenant-a-0123456789";
const KEY_B: &str = "key-tenant-b-0123456789";

struct Server {
    base: String,
    addr: std::net::SocketAddr,
    stop: CancellationToken,
    client: reqwest::Client,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn config() -> AppConfig {
    AppConfig {
        api_keys: orders::parse_api_keys(&format!("{KEY_A}=tenant-a,{KEY_B}=tenant-b")).unwrap(),
        ..AppConfig::default()
    }
}

async fn start(db: &Database, config: AppConfig) -> Server {
    orders::migrate(db).await.expect("migrate");
    start_migrated(db, config).await
}

/// As [`start`] on a database that is migrated already: for a pool whose lock timeout is
/// too short to wait out the locks a migration takes while other tests migrate theirs
/// (`a_held_lock_…` failed with 55P03 inside `migrate` under a loaded run).
async fn start_migrated(db: &Database, config: AppConfig) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let shutdown = stop.clone().cancelled_owned();
    tokio::spawn(orders::serve(listener, db.clone(), config, shutdown));
    Server {
        base: format!("http://{addr}"),
        addr,
        stop,
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(128)
            .build()
            .unwrap(),
    }
}

fn order(external_ref: &str, amount: i64) -> Value {
    json!({
        "source": "shop",
        "external_ref": external_ref,
        "customer_id": "c-42",
        "items": [{"sku": "sku-1", "quantity": 2}, {"sku": "sku-2", "quantity": 1}],
        "amount_minor": amount,
        "currency": "EUR"
    })
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    location: Option<String>,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn id(&self) -> String {
        self.json()["id"].as_str().unwrap_or_default().to_owned()
    }
}

impl Server {
    async fn post_raw(&self, api_key: &str, key: Option<&str>, body: String) -> Answer {
        let mut req = self
            .client
            .post(format!("{}/v1/orders", self.base))
            .bearer_auth(api_key)
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let res = req.send().await.expect("request");
        let h = |n: &str| res.headers().get(n).map(|v| v.to_str().unwrap().to_owned());
        let (status, replayed, retry_after, location) = (
            res.status(),
            h("idempotent-replayed").as_deref() == Some("true"),
            h("retry-after"),
            h("location"),
        );
        Answer {
            status,
            replayed,
            retry_after,
            location,
            body: res.bytes().await.unwrap().to_vec(),
        }
    }

    async fn post(&self, api_key: &str, key: &str, body: &Value) -> Answer {
        self.post_raw(api_key, Some(key), body.to_string()).await
    }
}

async fn count_orders(db: &Database, external_ref: &str) -> i64 {
    on_pool!(db, |p| sqlx::query_scalar::<_, i64>(&oncely_sql::sql_text(
        p,
        "SELECT COUNT(*) FROM orders WHERE external_ref = $1"
    ))
    .bind(external_ref)
    .fetch_one(p)
    .await)
    .unwrap()
}

async fn count_records(db: &Database) -> i64 {
    on_pool!(db, |p| sqlx::query_scalar::<_, i64>(
        "SELECT COUNT(*) FROM oncely_idempotency"
    )
    .fetch_one(p)
    .await)
    .unwrap()
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7())
}

oncely_testkit::matrix! {
    tests: [
        slow_request_head_is_cut_off_after_the_header_read_timeout,
        connections_over_the_cap_wait_until_one_closes,
        s1_sequential_retries_create_one_order,
        s2_concurrent_requests_with_one_key_create_one_order,
        s3_same_key_other_amount_is_422_and_reordered_json_replays,
        s4_connection_dropped_before_answer_retry_returns_same_order,
        client_hanging_up_mid_request_cannot_cause_a_second_order,
        s7_after_retention_business_key_prevents_second_order,
        tenants_never_see_each_others_records,
        business_key_reused_with_new_key_answers_existing_or_conflict,
        invalid_input_is_rejected_and_not_stored,
        missing_and_malformed_keys_are_400_problems,
        unauthenticated_requests_are_401_before_any_lookup,
        store_unreachable_answers_503_and_runs_nothing,
        healthz_and_metrics_answer,
        healthz_with_the_database_unreachable_names_no_driver_error,
        unknown_and_undecodable_order_ids_are_404_problems,
        ambiguous_or_unsupported_bodies_are_rejected_and_not_stored,
        bodies_over_two_mebibytes_within_the_bound_are_not_a_stored_413,
        a_held_lock_on_the_idempotency_table_is_503_not_500,
        ambiguous_credentials_and_unknown_routes_are_problems,
        connection_lost_inside_the_handler_is_503_store_unavailable_and_the_retry_creates_one_order,
        console_is_off_without_a_token_and_refuses_tenant_keys,
        console_pages_show_seeded_rows_and_actions_are_csrf_checked_and_audited,
    ],
    cannot_apply: [
        // PostgreSQL and MariaDB only: SQLite is embedded and has no connection to lose; its
        // aborted transactions are covered by the layer's disk-full test.
        connection_lost_inside_the_handler_is_503_store_unavailable_and_the_retry_creates_one_order on sqlite,
    ],
}

async fn ambiguous_or_unsupported_bodies_are_rejected_and_not_stored(t: TestDb) {
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

async fn bodies_over_two_mebibytes_within_the_bound_are_not_a_stored_413(t: TestDb) {
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

async fn a_held_lock_on_the_idempotency_table_is_503_not_500(t: TestDb) {
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

async fn ambiguous_credentials_and_unknown_routes_are_problems(t: TestDb) {
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

async fn s1_sequential_retries_create_one_order(t: TestDb) {
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

async fn s2_concurrent_requests_with_one_key_create_one_order(t: TestDb) {
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

async fn s3_same_key_other_amount_is_422_and_reordered_json_replays(t: TestDb) {
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

async fn s4_connection_dropped_before_answer_retry_returns_same_order(t: TestDb) {
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

async fn client_hanging_up_mid_request_cannot_cause_a_second_order(t: TestDb) {
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

async fn s7_after_retention_business_key_prevents_second_order(t: TestDb) {
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

async fn tenants_never_see_each_others_records(t: TestDb) {
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

async fn business_key_reused_with_new_key_answers_existing_or_conflict(t: TestDb) {
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

async fn invalid_input_is_rejected_and_not_stored(t: TestDb) {
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

async fn missing_and_malformed_keys_are_400_problems(t: TestDb) {
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

async fn unauthenticated_requests_are_401_before_any_lookup(t: TestDb) {
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

async fn store_unreachable_answers_503_and_runs_nothing(t: TestDb) {
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
async fn healthz_with_the_database_unreachable_names_no_driver_error(t: TestDb) {
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
async fn connection_lost_inside_the_handler_is_503_store_unavailable_and_the_retry_creates_one_order(
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
async fn unknown_and_undecodable_order_ids_are_404_problems(t: TestDb) {
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

async fn healthz_and_metrics_answer(t: TestDb) {
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
async fn slow_request_head_is_cut_off_after_the_header_read_timeout(t: TestDb) {
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
async fn connections_over_the_cap_wait_until_one_closes(t: TestDb) {
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
