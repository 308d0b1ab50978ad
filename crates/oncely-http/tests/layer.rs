//! The idempotency layer over real HTTP on `127.0.0.1:0`, against SQLite, PostgreSQL and
//! MariaDB, with test handlers that fail, panic, stall or answer too much, and (PostgreSQL,
//! MariaDB) a database path that freezes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use oncely_core::TenantId;
use oncely_http::{IdempotencyConfig, IdempotencyLayer, IdempotentTx};
use oncely_sql::{on_pool, on_tx, Database, DbOptions, IdempotencyStore};
use oncely_testkit::{without_statement_cache, Fault, FaultProxy, TestDb};
use serde_json::Value;

#[path = "layer/extract.rs"]
mod extract;
#[path = "layer/multiphase.rs"]
mod multiphase;

#[derive(Clone, Default)]
struct Calls(Arc<AtomicU32>);

async fn tenant_from_header(mut req: Request, next: Next) -> Response {
    if let Some(t) = req.headers().get("x-tenant").and_then(|v| v.to_str().ok()) {
        let t = TenantId::parse(t).unwrap();
        req.extensions_mut().insert(t);
    }
    next.run(req).await
}

async fn record_effect(tx: &mut IdempotentTx, name: &str) {
    let tx = &mut **tx;
    on_tx!(tx, |c| sqlx::query(&oncely_sql::sql_text(
        c,
        "INSERT INTO effects (name) VALUES ($1)"
    ))
    .bind(name)
    .execute(c)
    .await
    .map(drop))
    .unwrap();
}

/// Fails the first call with 500 (after writing), succeeds afterwards.
async fn flaky(State(calls): State<Calls>, mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, "flaky").await;
    if calls.0.fetch_add(1, Ordering::SeqCst) == 0 {
        return (StatusCode::INTERNAL_SERVER_ERROR, "temporary failure").into_response();
    }
    (StatusCode::CREATED, "made").into_response()
}

/// Panics on every odd-numbered call — the first, the third, … (after writing) — and
/// succeeds on the others.
async fn panicky(State(calls): State<Calls>, mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, "panicky").await;
    assert!(
        calls.0.fetch_add(1, Ordering::SeqCst) % 2 != 0,
        "handler panics on its odd-numbered calls"
    );
    (StatusCode::CREATED, "made").into_response()
}

/// First call: makes the database full mid-transaction (SQLite: `max_page_count`; the
/// statement fails with SQLITE_FULL and SQLite rolls the transaction back by itself), then
/// answers 500. Later calls succeed.
async fn disk_full(State(calls): State<Calls>, mut tx: IdempotentTx) -> Response {
    if calls.0.fetch_add(1, Ordering::SeqCst) == 0 {
        if let oncely_sql::Tx::Sqlite(t) = &mut *tx {
            let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
                .fetch_one(&mut **t)
                .await
                .unwrap();
            sqlx::query(&format!("PRAGMA max_page_count = {pages}"))
                .execute(&mut **t)
                .await
                .unwrap();
            let big = "x".repeat(2 * 1024 * 1024);
            let err = sqlx::query("INSERT INTO effects (name) VALUES ($1)")
                .bind(big)
                .execute(&mut **t)
                .await
                .expect_err("the database is full");
            return (StatusCode::INTERNAL_SERVER_ERROR, err.to_string()).into_response();
        }
        return (StatusCode::INTERNAL_SERVER_ERROR, "failed").into_response();
    }
    record_effect(&mut tx, "disk-full").await;
    (StatusCode::CREATED, "made").into_response()
}

async fn big(mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, "big").await;
    (StatusCode::CREATED, vec![b'x'; 4096]).into_response()
}

async fn slow(State(calls): State<Calls>, mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, "slow").await;
    let n = calls.0.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(600)).await;
    (StatusCode::CREATED, format!("slow call {n}")).into_response()
}

async fn headers(mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, "headers").await;
    (
        StatusCode::CREATED,
        [
            ("set-cookie", "session=secret"),
            ("etag", "\"v1\""),
            ("location", "/things/1"),
            ("x-internal", "1"),
            ("content-type", "text/plain"),
        ],
        "created",
    )
        .into_response()
}

async fn item(Path(id): Path<String>, mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, &format!("item-{id}")).await;
    (StatusCode::OK, id).into_response()
}

async fn reject(mut tx: IdempotentTx) -> Response {
    record_effect(&mut tx, "reject").await;
    (StatusCode::CONFLICT, "business says no").into_response()
}

struct App {
    base: String,
    db: Database,
    client: reqwest::Client,
    calls: Calls,
}

async fn start(t: &TestDb, wait: Option<Duration>) -> App {
    start_with(t, wait, IdempotencyConfig::default().replay_cache_bytes).await
}

async fn start_with(t: &TestDb, wait: Option<Duration>, replay_cache_bytes: usize) -> App {
    prepare(&t.db).await;
    serve_on(t.db.clone(), wait, replay_cache_bytes).await
}

/// The test's database behind a [`FaultProxy`] (statement texts sent every time, so faults
/// can be armed on them), with a short store timeout, and the app serving on it.
async fn start_proxied(t: &TestDb, store_timeout: Duration) -> (App, FaultProxy) {
    prepare(&t.db).await;
    let (proxy, url) = FaultProxy::in_front_of(&t.url).await;
    let opts = DbOptions {
        max_connections: 4,
        store_timeout,
        ..DbOptions::default()
    };
    let db = Database::connect(&without_statement_cache(&url), &opts)
        .await
        .unwrap();
    let app = serve_on(db, None, 0).await;
    (app, proxy)
}

async fn prepare(db: &Database) {
    db.migrate().await.unwrap();
    let mut tx = db.begin().await.unwrap();
    on_tx!(&mut tx, |c| sqlx::query(
        "CREATE TABLE effects (name TEXT NOT NULL)"
    )
    .execute(c)
    .await
    .map(drop))
    .unwrap();
    tx.commit().await.unwrap();
}

async fn serve_on(db: Database, wait: Option<Duration>, replay_cache_bytes: usize) -> App {
    let config = IdempotencyConfig {
        max_stored_response: 1024,
        max_request_body: 64 * 1024,
        in_flight_wait: wait,
        replay_cache_bytes,
        ..IdempotencyConfig::default()
    };
    let layer = IdempotencyLayer::new(
        IdempotencyStore::new(db.clone(), Duration::from_secs(3600)),
        config,
    );
    let calls = Calls::default();
    let app = Router::new()
        .route("/flaky", post(flaky))
        .route("/panicky", post(panicky))
        .route("/big", post(big))
        .route("/disk-full", post(disk_full))
        .route("/slow", post(slow))
        .route("/headers", post(headers))
        .route("/items/{id}", post(item))
        .route("/reject", post(reject))
        .merge(extract::routes())
        .route_layer(layer)
        .route_layer(middleware::from_fn(tenant_from_header))
        .with_state(calls.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    App {
        base,
        db,
        client: reqwest::Client::new(),
        calls,
    }
}

impl App {
    /// Waits until a handler has started (so its key is reserved), at most 5 s.
    async fn handler_started(&self) {
        for _ in 0..500 {
            if self.calls.0.load(Ordering::SeqCst) > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the first request never reached its handler");
    }

    async fn post(&self, path: &str, key: &str, body: &str) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .header("x-tenant", "t1")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
    }

    async fn effects(&self, name: &str) -> i64 {
        on_pool!(&self.db, |p| sqlx::query_scalar::<_, i64>(
            &oncely_sql::sql_text(p, "SELECT COUNT(*) FROM effects WHERE name = $1")
        )
        .bind(name)
        .fetch_one(p)
        .await)
        .unwrap()
    }

    async fn records(&self) -> i64 {
        on_pool!(&self.db, |p| sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM oncely_idempotency"
        )
        .fetch_one(p)
        .await)
        .unwrap()
    }
}

fn replayed(r: &reqwest::Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

oncely_testkit::matrix! {
    tests: [
        handler_failing_once_then_succeeding_runs_again_on_retry,
        panicking_handler_leaves_nothing_and_retry_runs,
        response_over_the_bound_rolls_back_and_stores_nothing,
        in_flight_retry_gets_409_with_retry_after,
        in_flight_retry_waits_and_replays_when_configured,
        replay_sends_only_allow_listed_headers,
        key_reused_on_another_route_parameter_is_422_route,
        business_rejection_is_stored_and_replayed,
        no_tenant_is_401_and_oversized_body_is_413,
        replays_come_from_the_store_when_the_cache_is_off,
        a_transaction_the_database_aborted_does_not_wedge_later_requests,
        database_paused_before_the_request_answers_503_within_the_store_timeout,
        database_frozen_at_begin_answers_503_within_the_store_timeout,
        database_frozen_during_the_key_claim_answers_503_within_the_store_timeout,
        refused_connections_are_reported_as_refused_and_answered_503_without_driver_text,
    ],
    cannot_apply: [
        // PostgreSQL and MariaDB only: SQLite has no network path to freeze or refuse; its
        // waits are bounded by the acquire and busy timeouts.
        database_paused_before_the_request_answers_503_within_the_store_timeout on sqlite,
        database_frozen_at_begin_answers_503_within_the_store_timeout on sqlite,
        database_frozen_during_the_key_claim_answers_503_within_the_store_timeout on sqlite,
        refused_connections_are_reported_as_refused_and_answered_503_without_driver_text on sqlite,
    ],
}

/// The database's port stops accepting (the proxy cuts every connection, then goes away):
/// the error names the root cause once — the refused connection, not sqlx's "pool timed
/// out" — and the client gets 503 `store-unavailable` without driver text.
async fn refused_connections_are_reported_as_refused_and_answered_503_without_driver_text(
    t: TestDb,
) {
    prepare(&t.db).await;
    let (proxy, url) = FaultProxy::in_front_of(&t.url).await;
    let opts = DbOptions {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(1),
        ..DbOptions::default()
    };
    let db = Database::connect(&url, &opts).await.unwrap();
    let app = serve_on(db.clone(), None, 0).await;
    proxy.cut();
    drop(proxy);
    let error = db.begin().await.unwrap_err().to_string();
    eprintln!("begin failed: {error}");
    // The root cause is a new connection refused, or — when the pool still held an idle
    // connection from before the cut — that connection reset (seen in CI) or closed under
    // the driver's read ("expected to read 4 bytes, got 0 bytes at EOF", MySQL).
    let cause = ["refused", "reset", "EOF"]
        .into_iter()
        .find(|c| error.contains(c))
        .unwrap_or_else(|| panic!("no root cause in {error}"));
    assert!(!error.contains("pool timed out"), "{error}");
    assert_eq!(error.matches(cause).count(), 1, "once: {error}");
    let res = app.post("/flaky", "k-refused", "{}").await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    let body = res.text().await.unwrap();
    let p: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(p["type"], "urn:oncely:problem:store-unavailable");
    assert!(
        !body.contains("refused") && !body.contains("reset") && !body.contains("os error"),
        "{body}"
    );
}

/// Sends a request that must be answered within `bound`; returns the answer and how long
/// it took.
async fn post_within(
    app: &App,
    bound: Duration,
    path: &str,
    key: &str,
) -> (reqwest::Response, Duration) {
    let started = std::time::Instant::now();
    let res = tokio::time::timeout(bound, app.post(path, key, "{}"))
        .await
        .unwrap_or_else(|_| panic!("no answer within {bound:?}: the request hangs"));
    (res, started.elapsed())
}

/// The database path freezes — every connection (`needle` `None`: a paused database, met
/// by the pool's test of an idle connection), or the request's own at `BEGIN` or at the
/// claim: the answer is 503 `store-unavailable` with `Retry-After` once the store timeout
/// has run out, and the key stays free — after the freeze the retry runs, once.
async fn frozen_at(t: &TestDb, needle: Option<&[u8]>) {
    let store_timeout = Duration::from_secs(2);
    let (app, proxy) = start_proxied(t, store_timeout).await;
    match needle {
        Some(needle) => proxy.fault_when_sent(needle, Fault::Freeze),
        None => proxy.freeze(),
    }
    let (res, took) = post_within(&app, store_timeout * 3, "/flaky", "k-frozen").await;
    if needle.is_some() {
        assert_eq!(proxy.faults_applied(), 1, "the fault hit the request");
    }
    assert_eq!(
        app.calls.0.load(Ordering::SeqCst),
        0,
        "the handler never ran"
    );
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    let p: Value = res.json().await.unwrap();
    assert_eq!(p["type"], "urn:oncely:problem:store-unavailable");
    assert!(
        took >= store_timeout && took <= store_timeout + Duration::from_millis(1500),
        "answered after {took:?}; the bound is the store timeout, {store_timeout:?}"
    );
    let at = needle.map_or("every connection".into(), String::from_utf8_lossy);
    eprintln!("frozen at {at}: 503 after {took:?}");
    proxy.restore();
    // The frozen session may still hold the key for a moment after the freeze ends (MySQL
    // closes it when its QUIT, held by the freeze, arrives): 409 until then.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let res = app.post("/flaky", "k-frozen", "{}").await;
        if res.status() != StatusCode::CONFLICT || std::time::Instant::now() > deadline {
            break res;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // `flaky` fails its first run with 500: the 503 above never reached the handler.
    assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(app.effects("flaky").await, 0);
    let again = app.post("/flaky", "k-frozen", "{}").await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(app.effects("flaky").await, 1);
}

async fn database_paused_before_the_request_answers_503_within_the_store_timeout(t: TestDb) {
    frozen_at(&t, None).await;
}

async fn database_frozen_at_begin_answers_503_within_the_store_timeout(t: TestDb) {
    frozen_at(&t, Some(b"BEGIN")).await;
}

async fn database_frozen_during_the_key_claim_answers_503_within_the_store_timeout(t: TestDb) {
    let claim: &[u8] = match t.db {
        Database::MySql(_) => b"GET_LOCK(",
        _ => b"pg_try_advisory_xact_lock(",
    };
    frozen_at(&t, Some(claim)).await;
}

async fn a_transaction_the_database_aborted_does_not_wedge_later_requests(t: TestDb) {
    let app = start(&t, None).await;
    let first = app.post("/disk-full", "k-full", "{}").await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // The next requests, any key, work again: the writer connection was recycled.
    for key in ["k-full", "k-after-1", "k-after-2"] {
        let res = app.post("/disk-full", key, "{}").await;
        let status = res.status();
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{key}: {}",
            res.text().await.unwrap()
        );
    }
    assert_eq!(app.effects("disk-full").await, 3);
}

async fn replays_come_from_the_store_when_the_cache_is_off(t: TestDb) {
    let app = start_with(&t, None, 0).await;
    let first = app.post("/headers", "k-store", "{}").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let replay = app.post("/headers", "k-store", "{ }").await;
    assert!(replayed(&replay));
    assert!(replay.headers().get("set-cookie").is_none());
    let other = app.post("/headers", "k-store", "{\"a\":1}").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.effects("headers").await, 1);
}

async fn handler_failing_once_then_succeeding_runs_again_on_retry(t: TestDb) {
    let app = start(&t, None).await;
    let first = app.post("/flaky", "k-flaky", "{}").await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        app.effects("flaky").await,
        0,
        "the failed execution's writes rolled back"
    );
    assert_eq!(app.records().await, 0, "the key is free again");
    let retry = app.post("/flaky", "k-flaky", "{}").await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(&retry), "the retry executed");
    let again = app.post("/flaky", "k-flaky", "{}").await;
    assert!(replayed(&again));
    assert_eq!(again.text().await.unwrap(), "made");
    assert_eq!(app.effects("flaky").await, 1);
}

async fn panicking_handler_leaves_nothing_and_retry_runs(t: TestDb) {
    let app = start(&t, None).await;
    // The retry goes out the moment the 500 arrives: the key must be free by then (the
    // rollback done before the answer, not when the connection is next used). Twenty
    // rounds, because a late rollback loses the race only some of the time.
    for round in 0..20i64 {
        let key = format!("k-panic-{round}");
        let first = app.post("/panicky", &key, "{}").await;
        assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let problem: Value = first.json().await.unwrap();
        assert_eq!(problem["type"], "urn:oncely:problem:handler-failed");
        assert_eq!(app.effects("panicky").await, round);
        let retry = app.post("/panicky", &key, "{}").await;
        assert_eq!(retry.status(), StatusCode::CREATED, "round {round}");
        assert_eq!(app.effects("panicky").await, round + 1);
    }
}

async fn response_over_the_bound_rolls_back_and_stores_nothing(t: TestDb) {
    let app = start(&t, None).await;
    let res = app.post("/big", "k-big", "{}").await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let problem: Value = res.json().await.unwrap();
    assert_eq!(problem["type"], "urn:oncely:problem:response-too-large");
    assert_eq!(app.effects("big").await, 0);
    assert_eq!(app.records().await, 0);
}

async fn in_flight_retry_gets_409_with_retry_after(t: TestDb) {
    let app = Arc::new(start(&t, None).await);
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.post("/slow", "k-slow", "{}").await })
    };
    app.handler_started().await;
    let second = app.post("/slow", "k-slow", "{}").await;
    // PostgreSQL and MySQL see the key in flight at once (try-lock). SQLite has one writer: the retry queues
    // behind the first request's transaction and then gets its replay. Never a second run.
    match t.db {
        Database::Postgres(_) | Database::MySql(_) => {
            assert_eq!(second.status(), StatusCode::CONFLICT);
            assert_eq!(second.headers()["retry-after"], "1");
            let p: Value = second.json().await.unwrap();
            assert_eq!(p["type"], "urn:oncely:problem:request-in-flight");
        }
        Database::Sqlite(_) => {
            assert!(replayed(&second));
            assert_eq!(second.text().await.unwrap(), "slow call 0");
        }
    }
    assert_eq!(first.await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(app.effects("slow").await, 1);
}

async fn in_flight_retry_waits_and_replays_when_configured(t: TestDb) {
    let app = Arc::new(start(&t, Some(Duration::from_secs(3))).await);
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.post("/slow", "k-wait", "{}").await })
    };
    app.handler_started().await;
    let second = app.post("/slow", "k-wait", "{}").await;
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(
        replayed(&second),
        "the waiting retry gets the first request's answer"
    );
    assert_eq!(second.text().await.unwrap(), "slow call 0");
    assert_eq!(first.await.unwrap().text().await.unwrap(), "slow call 0");
    assert_eq!(app.effects("slow").await, 1);
}

async fn replay_sends_only_allow_listed_headers(t: TestDb) {
    let app = start(&t, None).await;
    let first = app.post("/headers", "k-h", "{}").await;
    assert_eq!(
        first.headers()["set-cookie"],
        "session=secret",
        "the first answer is untouched"
    );
    let replay = app.post("/headers", "k-h", "{}").await;
    assert!(replayed(&replay));
    let h = replay.headers();
    assert_eq!(h["etag"], "\"v1\"");
    assert_eq!(h["location"], "/things/1");
    assert_eq!(h["content-type"], "text/plain");
    assert!(
        h.get("set-cookie").is_none(),
        "Set-Cookie is never replayed"
    );
    assert!(
        h.get("x-internal").is_none(),
        "headers off the allow-list are not replayed"
    );
    assert_eq!(replay.text().await.unwrap(), "created");
}

async fn key_reused_on_another_route_parameter_is_422_route(t: TestDb) {
    let app = start(&t, None).await;
    assert_eq!(
        app.post("/items/1", "k-route", "{}").await.status(),
        StatusCode::OK
    );
    let other = app.post("/items/2", "k-route", "{}").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let p: Value = other.json().await.unwrap();
    assert_eq!(p["differs"], "route");
    assert_eq!(app.effects("item-2").await, 0);
    // Same key, same parameters, body with other whitespace: a replay.
    let again = app.post("/items/1", "k-route", " { } ").await;
    assert!(replayed(&again));
}

async fn business_rejection_is_stored_and_replayed(t: TestDb) {
    let app = start(&t, None).await;
    let first = app.post("/reject", "k-rej", "{}").await;
    assert_eq!(first.status(), StatusCode::CONFLICT);
    let again = app.post("/reject", "k-rej", "{}").await;
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert!(replayed(&again));
    assert_eq!(app.effects("reject").await, 1);
}

async fn no_tenant_is_401_and_oversized_body_is_413(t: TestDb) {
    let app = start(&t, None).await;
    let res = app
        .client
        .post(format!("{}/flaky", app.base))
        .header("idempotency-key", "k-anon")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let big = "x".repeat(65 * 1024);
    let res = app.post("/flaky", "k-413", &format!("\"{big}\"")).await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(app.records().await, 0);
    assert_eq!(app.effects("flaky").await, 0);
}
