//! Refusals before the handler runs: oncely's `Json`, `Path` and `Query` (and `Unstored`
//! around any other extractor) leave the key free, so the corrected retry with the same key
//! runs and is then replayed; `Rejection::stored` opts out. Over real HTTP on
//! `127.0.0.1:0`, on SQLite, PostgreSQL and MariaDB.

use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use oncely_http::{IdempotentTx, Json, Path, Query, Rejection, Unstored};
use oncely_testkit::TestDb;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{record_effect, replayed, start, App, Calls};

#[derive(Deserialize)]
struct Transfer {
    amount_minor: i64,
}

#[derive(Deserialize)]
struct Options {
    priority: u8,
}

/// `POST /accounts/{n}/transfers?priority=`: every part of the request through oncely's
/// extractors.
async fn transfer(
    Path(account): Path<u32>,
    Query(o): Query<Options>,
    mut tx: IdempotentTx,
    Json(t): Json<Transfer>,
) -> Response {
    record_effect(&mut tx, "transfer").await;
    let body = json!({"account": account, "priority": o.priority, "amount_minor": t.amount_minor});
    (StatusCode::CREATED, Json(body)).into_response()
}

/// `POST /plain`: axum's own `Json` wrapped in `Unstored`.
async fn plain(
    mut tx: IdempotentTx,
    Unstored(axum::Json(t)): Unstored<axum::Json<Transfer>>,
) -> Response {
    record_effect(&mut tx, "plain").await;
    (StatusCode::CREATED, t.amount_minor.to_string()).into_response()
}

/// `POST /strict`: a refusal the service chooses to store ([`Rejection::stored`]).
async fn strict(mut tx: IdempotentTx, t: Result<Json<Transfer>, Rejection>) -> Response {
    let Json(t) = match t {
        Ok(t) => t,
        Err(refused) => return refused.stored().into_response(),
    };
    record_effect(&mut tx, "strict").await;
    (StatusCode::CREATED, t.amount_minor.to_string()).into_response()
}

/// The routes of this module, merged into the test app under its layers.
pub(super) fn routes() -> Router<Calls> {
    Router::new()
        .route("/accounts/{n}/transfers", post(transfer))
        .route("/plain", post(plain))
        .route("/strict", post(strict))
}

async fn problem_type(res: reqwest::Response) -> String {
    let v: Value = res.json().await.unwrap();
    v["type"].as_str().unwrap_or_default().to_owned()
}

/// Sends `body` once refused, then corrected, then the same again: 201, then a replay.
async fn corrected_retry_runs_once(app: &App, path: &str, key: &str, fixed: &str) {
    let first = app.post(path, key, fixed).await;
    assert_eq!(first.status(), StatusCode::CREATED, "{path}");
    assert!(!replayed(&first), "the corrected retry executed");
    let first = first.text().await.unwrap();
    let again = app.post(path, key, fixed).await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(replayed(&again), "the retry after it is a replay");
    assert_eq!(again.text().await.unwrap(), first);
}

async fn a_body_refused_by_json_leaves_the_key_free_for_the_corrected_retry(t: TestDb) {
    let app = start(&t, None).await;
    let path = "/accounts/7/transfers?priority=1";
    let wrong = app.post(path, "k-json", r#"{"amount_minor":"100"}"#).await;
    assert_eq!(wrong.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        wrong.headers()["content-type"],
        oncely_http::PROBLEM_JSON,
        "the refusal is problem+json"
    );
    assert_eq!(problem_type(wrong).await, "urn:oncely:problem:invalid-body");
    assert_eq!(app.records().await, 0, "nothing stored under the key");
    corrected_retry_runs_once(&app, path, "k-json", r#"{"amount_minor":100}"#).await;
    assert_eq!(app.effects("transfer").await, 1);
}

async fn a_path_or_query_refused_before_the_handler_leaves_the_key_free(t: TestDb) {
    let app = start(&t, None).await;
    let body = r#"{"amount_minor":100}"#;
    let bad_path = app
        .post("/accounts/x/transfers?priority=1", "k-path", body)
        .await;
    assert_eq!(bad_path.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        problem_type(bad_path).await,
        "urn:oncely:problem:invalid-path"
    );
    let bad_query = app
        .post("/accounts/7/transfers?priority=high", "k-query", body)
        .await;
    assert_eq!(bad_query.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        problem_type(bad_query).await,
        "urn:oncely:problem:invalid-query"
    );
    assert_eq!(app.records().await, 0);
    // The path is part of the fingerprint: the corrected request under the refused
    // request's key is the first one that counts.
    corrected_retry_runs_once(&app, "/accounts/7/transfers?priority=1", "k-path", body).await;
    corrected_retry_runs_once(&app, "/accounts/7/transfers?priority=2", "k-query", body).await;
    assert_eq!(app.effects("transfer").await, 2);
}

async fn another_extractor_wrapped_in_unstored_leaves_the_key_free(t: TestDb) {
    let app = start(&t, None).await;
    // axum's own answer (422, text), marked: nothing stored.
    let wrong = app
        .post("/plain", "k-plain", r#"{"amount_minor":true}"#)
        .await;
    assert_eq!(wrong.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.records().await, 0);
    corrected_retry_runs_once(&app, "/plain", "k-plain", r#"{"amount_minor":5}"#).await;
    assert_eq!(app.effects("plain").await, 1);
}

async fn a_refusal_marked_stored_is_replayed_to_the_corrected_retry(t: TestDb) {
    let app = start(&t, None).await;
    let wrong = app
        .post("/strict", "k-strict", r#"{"amount_minor":"1"}"#)
        .await;
    assert_eq!(wrong.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        app.records().await,
        1,
        "the refusal is stored under the key"
    );
    let again = app
        .post("/strict", "k-strict", r#"{"amount_minor":"1"}"#)
        .await;
    assert_eq!(again.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(replayed(&again));
    let fixed = app
        .post("/strict", "k-strict", r#"{"amount_minor":1}"#)
        .await;
    assert_eq!(
        problem_type(fixed).await,
        "urn:oncely:problem:idempotency-key-reused"
    );
    assert_eq!(app.effects("strict").await, 0);
}

oncely_testkit::matrix! {
    tests: [
        a_body_refused_by_json_leaves_the_key_free_for_the_corrected_retry,
        a_path_or_query_refused_before_the_handler_leaves_the_key_free,
        another_extractor_wrapped_in_unstored_leaves_the_key_free,
        a_refusal_marked_stored_is_replayed_to_the_corrected_retry,
    ],
}
