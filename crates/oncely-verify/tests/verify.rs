//! `oncely verify` over real HTTP on `127.0.0.1:0`: against deliberately broken endpoints
//! (each with a real SQLite database) the check that should catch the fault fails — the
//! checker can fail. (That every check holds against the order service is tested in
//! apps/orders.)

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use oncely_verify::{verify, BodyTemplate, CheckId, Mutation, Outcome, Report, VerifyConfig};
use serde_json::{json, Value};
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};

/// Aborts the server task when the test ends.
struct Server {
    base: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn spawn(router: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    Server { base, task }
}

fn print(report: &Report) {
    println!("{}", report.to_table());
}

// --- broken endpoints --------------------------------------------------------------------

/// How a broken endpoint gets idempotency wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Validates the key, then forgets it: every request executes.
    NoKeyStorage,
    /// Looks the key up, and inserts it after the effect — no unique constraint, with an
    /// await in between, so simultaneous requests all find nothing.
    SelectThenInsert,
    /// Claims the key under a primary key, but never compares the request body.
    FingerprintIgnored,
    /// Stores keys correctly, but mints its own key for every incoming request.
    KeyMintedPerRequest,
}

#[derive(Clone)]
struct Broken {
    pool: SqlitePool,
    fault: Fault,
}

async fn broken_service(fault: Fault) -> Server {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    for ddl in [
        "CREATE TABLE objects (id TEXT PRIMARY KEY, body TEXT NOT NULL)",
        // SELECT-then-INSERT's table: no unique constraint on the key.
        "CREATE TABLE keys_unconstrained (key TEXT NOT NULL, request TEXT NOT NULL, response TEXT NOT NULL)",
        "CREATE TABLE keys (key TEXT PRIMARY KEY, request TEXT NOT NULL, response TEXT)",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    let state = Broken { pool, fault };
    spawn(
        Router::new()
            .route("/things", post(broken_create))
            .route("/count", get(broken_count))
            .with_state(state),
    )
    .await
}

async fn broken_count(State(s): State<Broken>) -> Json<Value> {
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM objects")
        .fetch_one(&s.pool)
        .await
        .unwrap();
    Json(json!({ "count": n }))
}

fn answer(status: StatusCode, body: String, replayed: bool) -> Response {
    let mut res = (status, [("content-type", "application/json")], body).into_response();
    if replayed {
        res.headers_mut()
            .insert("idempotent-replayed", "true".parse().unwrap());
    }
    res
}

async fn create_object(pool: &SqlitePool, request: &Value) -> String {
    let id = uuid::Uuid::now_v7().to_string();
    sqlx::query("INSERT INTO objects (id, body) VALUES (?, ?)")
        .bind(&id)
        .bind(request.to_string())
        .execute(pool)
        .await
        .unwrap();
    json!({ "id": id, "request": request }).to_string()
}

async fn broken_create(State(s): State<Broken>, headers: HeaderMap, body: Bytes) -> Response {
    // Key handling is right in every broken endpoint, so that each fails where its fault is.
    let Some(raw) = headers.get("idempotency-key") else {
        return answer(
            StatusCode::BAD_REQUEST,
            r#"{"title":"key missing"}"#.into(),
            false,
        );
    };
    let Ok(key) = oncely_core::IdempotencyKey::parse(raw.as_bytes()) else {
        return answer(
            StatusCode::BAD_REQUEST,
            r#"{"title":"key malformed"}"#.into(),
            false,
        );
    };
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return answer(
            StatusCode::BAD_REQUEST,
            r#"{"title":"not JSON"}"#.into(),
            false,
        );
    };
    let canonical = request.to_string();
    match s.fault {
        Fault::NoKeyStorage => answer(
            StatusCode::CREATED,
            create_object(&s.pool, &request).await,
            false,
        ),
        Fault::SelectThenInsert => {
            let found: Option<(String, String)> = sqlx::query_as(
                "SELECT request, response FROM keys_unconstrained WHERE key = ? LIMIT 1",
            )
            .bind(key.as_str())
            .fetch_optional(&s.pool)
            .await
            .unwrap();
            if let Some((stored_request, response)) = found {
                return if stored_request == canonical {
                    answer(StatusCode::CREATED, response, true)
                } else {
                    answer(StatusCode::UNPROCESSABLE_ENTITY, "{}".into(), false)
                };
            }
            // "Check, then create": the gap every simultaneous request walks through.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let response = create_object(&s.pool, &request).await;
            sqlx::query("INSERT INTO keys_unconstrained (key, request, response) VALUES (?, ?, ?)")
                .bind(key.as_str())
                .bind(&canonical)
                .bind(&response)
                .execute(&s.pool)
                .await
                .unwrap();
            answer(StatusCode::CREATED, response, false)
        }
        Fault::FingerprintIgnored | Fault::KeyMintedPerRequest => {
            let key = if s.fault == Fault::KeyMintedPerRequest {
                uuid::Uuid::now_v7().to_string()
            } else {
                key.as_str().to_owned()
            };
            let claimed = sqlx::query(
                "INSERT INTO keys (key, request) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
            )
            .bind(&key)
            .bind(&canonical)
            .execute(&s.pool)
            .await
            .unwrap()
            .rows_affected()
                == 1;
            if !claimed {
                let response: Option<String> =
                    sqlx::query_scalar("SELECT response FROM keys WHERE key = ?")
                        .bind(&key)
                        .fetch_one(&s.pool)
                        .await
                        .unwrap();
                // The fault: the stored request is never compared with this one.
                return match response {
                    Some(r) => answer(StatusCode::CREATED, r, true),
                    None => answer(StatusCode::CONFLICT, "{}".into(), false),
                };
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let response = create_object(&s.pool, &request).await;
            sqlx::query("UPDATE keys SET response = ? WHERE key = ?")
                .bind(&response)
                .bind(&key)
                .execute(&s.pool)
                .await
                .unwrap();
            answer(StatusCode::CREATED, response, false)
        }
    }
}

async fn verify_broken(fault: Fault) -> Report {
    let s = broken_service(fault).await;
    let mut cfg = VerifyConfig::new(
        &format!("{}/things", s.base),
        BodyTemplate::new(r#"{"ref": "{{uuid}}", "amount": 10}"#),
    )
    .unwrap();
    cfg.mutations = vec![Mutation::parse("/amount=11").unwrap()];
    cfg.count_url = Some(format!("{}/count", s.base).parse().unwrap());
    cfg.concurrency = 8;
    let report = verify(cfg).await.unwrap();
    print(&report);
    assert!(!report.passed());
    // Key handling is right in every broken endpoint: the failures below are the fault's.
    for id in [CheckId::KeyMissing, CheckId::KeyMalformed] {
        assert_eq!(report.outcome(id), Some(Outcome::Holds), "{id:?}");
    }
    // Not applicable is reported as such, never as passed.
    assert_eq!(report.outcome(CheckId::Scope), Some(Outcome::NotApplicable));
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn endpoint_without_key_storage_fails_s1_s2_and_s4() {
    let r = verify_broken(Fault::NoKeyStorage).await;
    for id in [
        CheckId::KeyMaxLength,
        CheckId::S1Sequential,
        CheckId::S2Concurrent,
        CheckId::S3Mutated,
        CheckId::S4HangUp,
    ] {
        assert_eq!(r.outcome(id), Some(Outcome::Fails), "{id:?}");
    }
    let s1 = r.check(CheckId::S1Sequential).unwrap();
    assert_eq!(s1.ids_seen.len(), 5, "every retry created an object");
    assert_eq!(s1.count_after.unwrap() - s1.count_before.unwrap(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn select_then_insert_without_unique_constraint_fails_s2_only() {
    let r = verify_broken(Fault::SelectThenInsert).await;
    assert_eq!(r.outcome(CheckId::S2Concurrent), Some(Outcome::Fails));
    let s2 = r.check(CheckId::S2Concurrent).unwrap();
    assert!(
        s2.ids_seen.len() > 1,
        "simultaneous requests created several objects"
    );
    // Sequential retries find the row: the race is the only fault.
    for id in [
        CheckId::S1Sequential,
        CheckId::S3Mutated,
        CheckId::S3Reordered,
        CheckId::S4HangUp,
    ] {
        assert_eq!(r.outcome(id), Some(Outcome::Holds), "{id:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn endpoint_ignoring_the_fingerprint_fails_s3_mutated_only() {
    let r = verify_broken(Fault::FingerprintIgnored).await;
    assert_eq!(r.outcome(CheckId::S3Mutated), Some(Outcome::Fails));
    assert!(r.check(CheckId::S3Mutated).unwrap().findings[0].contains("expected 422"));
    for id in [
        CheckId::S1Sequential,
        CheckId::S2Concurrent,
        CheckId::S3Reordered,
        CheckId::S4HangUp,
    ] {
        assert_eq!(r.outcome(id), Some(Outcome::Holds), "{id:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_minted_per_request_inside_the_service_fails_s1_and_s4() {
    let r = verify_broken(Fault::KeyMintedPerRequest).await;
    for id in [
        CheckId::KeyMaxLength,
        CheckId::S1Sequential,
        CheckId::S2Concurrent,
        CheckId::S4HangUp,
    ] {
        assert_eq!(r.outcome(id), Some(Outcome::Fails), "{id:?}");
    }
    let s4 = r.check(CheckId::S4HangUp).unwrap();
    assert_eq!(
        s4.count_after.unwrap() - s4.count_before.unwrap(),
        3,
        "the abandoned request and both retries each executed"
    );
}

#[tokio::test]
async fn an_unreachable_endpoint_fails_every_applicable_check() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let mut cfg = VerifyConfig::new(&format!("http://{addr}/x"), BodyTemplate::new("{}")).unwrap();
    cfg.request_timeout = Duration::from_secs(2);
    let report = verify(cfg).await.unwrap();
    print(&report);
    assert!(!report.passed());
    assert!(report.checks.iter().all(|c| c.outcome != Outcome::Holds));
    assert!(report.to_json().contains("\"outcome\": \"fails\""));
}
