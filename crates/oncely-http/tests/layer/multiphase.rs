//! Multi-phase mode over real HTTP on `127.0.0.1:0`, on SQLite, PostgreSQL and MariaDB: a
//! payment route whose handler charges the payments simulator (`oncely_sim::PaymentsSim`,
//! real HTTP through `oncely_effects::StripePayments`) with the operation's derived key.
//!
//! A holder that "dies" runs in a server of its own on its own Tokio runtime, which the test
//! shuts down (every task and connection of it ends, as with a killed process) at the chosen
//! point: after the provider answered, or before the call went out.

use std::future::pending;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};
use oncely_core::{now_ms, IdempotencyKey, Operation, RecordState, Scope, TenantId};
use oncely_effects::{
    CallOutcome, EffectRequest, Provider, RemoteObject, StatusOutcome, StatusQuery, StripeConfig,
    StripePayments,
};
use oncely_http::{
    IdempotencyConfig, IdempotencyLayer, MultiPhase, OperationContext, Resolution, ResolveQuery,
    Resolver,
};
use oncely_sim::{PaymentsConfig, PaymentsSim};
use oncely_sql::{on_pool, Database, DbOptions, IdempotencyStore};
use oncely_testkit::TestDb;
use serde_json::{json, Value};
use tokio::sync::Notify;

const SK: &str = "sk_test_oncely_http";
const ROUTE: &str = "/v1/orders/{id}/payments";

/// The payments simulator on `127.0.0.1:0`, with the base URL.
async fn payments_sim() -> (PaymentsSim, String) {
    let sim = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.into()],
        ..PaymentsConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(oncely_sim::serve(listener, sim.router(), pending()));
    (sim, base)
}

/// The Stripe adapter on the simulator; status by listing (read from the same store as
/// creation, so "absent" is final at once).
fn payments(base: &str) -> StripePayments {
    StripePayments::new(StripeConfig {
        base_url: base.to_owned(),
        secret_key: SK.to_owned(),
        timeout: Duration::from_secs(5),
        search: false,
        ..StripeConfig::default()
    })
    .unwrap()
}

/// The charge of `order`, under the operation's derived key, which it also carries as
/// metadata so the test can count charges per key at the provider.
fn charge(ctx: &OperationContext, order: &str) -> EffectRequest {
    let key = ctx.derived_key("charge");
    EffectRequest {
        operation: "charge".into(),
        reference: order.to_owned(),
        params: json!({"amount": 1500, "currency": "eur", "metadata": {"derived_key": key}}),
        key,
    }
}

/// The answer for a PaymentIntent: what the handler and the resolver both give.
fn paid(intent: &RemoteObject, fence: i64) -> Response {
    (
        StatusCode::CREATED,
        Json(json!({"payment_intent": intent.id, "fence": fence})),
    )
        .into_response()
}

/// The handler's shared state: how often it started, a signal when it reached its chosen
/// point (`x-mode`), and the gates that `x-mode: gate` / `gate2` wait on before calling.
#[derive(Clone)]
struct Pay {
    payments: StripePayments,
    calls: Arc<AtomicU32>,
    reached: Arc<Notify>,
    gate: Arc<Notify>,
    gate2: Arc<Notify>,
}

/// `POST /v1/orders/{id}/payments`: charges the order. `x-mode` (not fingerprinted) picks
/// how this execution ends: `normal`, `die-before` / `die-after` (signal, then never
/// finish: the test kills the runtime), `gate` / `gate2` (signal, wait for that gate, then
/// charge), `fail` (503 before calling).
async fn charge_order(
    State(p): State<Pay>,
    ctx: OperationContext,
    Path(order): Path<String>,
    headers: HeaderMap,
) -> Response {
    p.calls.fetch_add(1, Ordering::SeqCst);
    let mode = headers
        .get("x-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("normal")
        .to_owned();
    match mode.as_str() {
        "die-before" => {
            p.reached.notify_one();
            pending::<()>().await;
        }
        "gate" => {
            p.reached.notify_one();
            p.gate.notified().await;
        }
        "gate2" => {
            p.reached.notify_one();
            p.gate2.notified().await;
        }
        "fail" => return (StatusCode::SERVICE_UNAVAILABLE, "down").into_response(),
        _ => {}
    }
    let outcome = p.payments.call(&charge(&ctx, &order)).await;
    if mode == "die-after" {
        p.reached.notify_one();
        pending::<()>().await;
    }
    match outcome {
        CallOutcome::Succeeded(intent) => paid(&intent, ctx.fence),
        other => (StatusCode::BAD_GATEWAY, format!("{other:?}")).into_response(),
    }
}

/// Asks the provider for the order's charge (by its reference, the order id).
#[derive(Debug)]
struct ChargeStatus(StripePayments);

impl Resolver for ChargeStatus {
    fn resolve<'a>(&'a self, q: ResolveQuery<'a>) -> BoxFuture<'a, Resolution> {
        Box::pin(async move {
            let order = q.request.uri.path().split('/').nth(3).unwrap_or_default();
            let request = charge(q.context, order);
            let status = self.0.status(StatusQuery {
                request: &request,
                last_sent: None,
                since: SystemTime::now() - Duration::from_secs(3600),
            });
            match status.await {
                Ok(StatusOutcome::Found(found)) => {
                    Resolution::Found(paid(&found[0], q.context.fence))
                }
                Ok(StatusOutcome::Absent) => Resolution::Absent,
                Ok(other) => Resolution::Unknown(format!("{other:?}")),
                Err(e) => Resolution::Unknown(e.to_string()),
            }
        })
    }
}

/// One server of the payment route on `db`.
struct Server {
    base: String,
    pay: Pay,
}

async fn serve(db: Database, sim: &str, lease: Duration, resolver: bool) -> Server {
    let mut mode = MultiPhase::new(lease).status_link("/v1/operations/{key}");
    if resolver {
        mode = mode.resolver(ChargeStatus(payments(sim)));
    }
    let layer = IdempotencyLayer::new(
        IdempotencyStore::new(db, Duration::from_secs(3600)),
        IdempotencyConfig::default(),
    )
    .multi_phase(mode);
    let pay = Pay {
        payments: payments(sim),
        calls: Arc::default(),
        reached: Arc::default(),
        gate: Arc::default(),
        gate2: Arc::default(),
    };
    let app = Router::new()
        .route(ROUTE, post(charge_order))
        .route_layer(layer)
        .route_layer(axum::middleware::from_fn(super::tenant_from_header))
        .with_state(pay.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { base, pay }
}

/// A server on a runtime of its own, as a separate process would be: [`Process::kill`]
/// ends every task and connection of it at once.
struct Process {
    runtime: Option<tokio::runtime::Runtime>,
    server: Server,
}

impl Process {
    async fn start(url: &str, sim: &str, lease: Duration) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (url, sim) = (url.to_owned(), sim.to_owned());
        let server = runtime
            .spawn(async move {
                let opts = DbOptions {
                    max_connections: 2,
                    ..DbOptions::default()
                };
                let db = Database::connect(&url, &opts).await.unwrap();
                serve(db, &sim, lease, false).await
            })
            .await
            .unwrap();
        Self {
            runtime: Some(runtime),
            server,
        }
    }

    fn kill(mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

struct Client(reqwest::Client);

impl Client {
    async fn pay(&self, server: &Server, order: &str, key: &str, mode: &str) -> reqwest::Response {
        self.0
            .post(format!("{}/v1/orders/{order}/payments", server.base))
            .header("x-tenant", "t1")
            .header("idempotency-key", key)
            .header("x-mode", mode)
            .header("content-type", "application/json")
            .body(r#"{"amount":1500}"#)
            .send()
            .await
            .unwrap()
    }
}

fn scope() -> Scope {
    Scope::new(
        TenantId::parse("t1").unwrap(),
        Operation::new("POST", ROUTE),
    )
}

/// Charges at the provider made under `key`'s derived charge key.
fn charges_under(sim: &PaymentsSim, key: &str) -> u64 {
    let derived = oncely_core::derive_key(
        &scope(),
        &IdempotencyKey::parse(key.as_bytes()).unwrap(),
        "charge",
        0,
    );
    sim.stats()
        .payment_intents_by_metadata
        .get("derived_key")
        .and_then(|m| m.get(&derived))
        .map_or(0, |c| c.total)
}

async fn reached(pay: &Pay) {
    tokio::time::timeout(Duration::from_secs(10), pay.reached.notified())
        .await
        .expect("the handler reached its point");
}

/// `(state, fence)` of the record for `key`.
async fn record(db: &Database, key: &str) -> (RecordState, i64) {
    let store = IdempotencyStore::new(db.clone(), Duration::from_secs(3600));
    let r = store
        .lookup(&scope(), &IdempotencyKey::parse(key.as_bytes()).unwrap())
        .await
        .unwrap()
        .expect("a record");
    (r.state, r.fence)
}

fn replayed(r: &reqwest::Response) -> bool {
    super::replayed(r)
}

fn link(r: &reqwest::Response) -> String {
    r.headers()
        .get("link")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

async fn problem(r: reqwest::Response) -> Value {
    assert_eq!(
        r.headers().get("content-type").unwrap(),
        "application/problem+json"
    );
    r.json().await.unwrap()
}

/// Fencing: the first holder waits past its lease; a retry finds the lease ended and the
/// provider without a charge, so it takes the record over (fence 2) and waits in turn. The
/// first holder now charges (same derived key: the provider replays the same
/// PaymentIntent) and tries to complete while the new holder is still `processing`: its
/// fence is stale, nothing changes, and it answers 409 with the status link. The new
/// holder's outcome is the one stored and replayed.
async fn a_taken_over_holder_cannot_complete_and_the_new_holders_outcome_stands(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (sim, sim_base) = payments_sim().await;
    let lease = Duration::from_secs(1);
    let server = Arc::new(serve(t.db.clone(), &sim_base, lease, true).await);
    let client = Arc::new(Client(reqwest::Client::new()));
    let send = |mode: &'static str| {
        let (server, client) = (server.clone(), client.clone());
        tokio::spawn(async move { client.pay(&server, "o-1", "k-fence", mode).await })
    };
    let first = send("gate");
    reached(&server.pay).await;
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let second = send("gate2");
    reached(&server.pay).await;
    assert_eq!(record(&t.db, "k-fence").await, (RecordState::Processing, 2));

    server.pay.gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!(
        first.status(),
        StatusCode::CONFLICT,
        "the stale holder stored nothing"
    );
    assert_eq!(link(&first), "</v1/operations/k-fence>; rel=\"monitor\"");
    assert_eq!(record(&t.db, "k-fence").await, (RecordState::Processing, 2));
    assert_eq!(sim.stats().payment_intents, 1);

    server.pay.gate2.notify_one();
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(!replayed(&second), "the new holder ran");
    let second: Value = second.json().await.unwrap();
    assert_eq!(second["fence"], 2);
    assert_eq!(record(&t.db, "k-fence").await, (RecordState::Succeeded, 2));
    let again = client.pay(&server, "o-1", "k-fence", "normal").await;
    assert!(replayed(&again));
    assert_eq!(
        again.json::<Value>().await.unwrap(),
        second,
        "the new holder's outcome stands"
    );
    assert_eq!(server.pay.calls.load(Ordering::SeqCst), 2);
    assert_eq!(sim.stats().payment_intents, 1, "one charge at the provider");
    assert_eq!(charges_under(&sim, "k-fence"), 1);
}

/// A holder killed after the provider charged and before its outcome was stored: while its
/// lease runs a retry gets 409 with the status link; after it, without a resolver, 409
/// `outcome-unknown` (the handler does not run again); with one, the record is completed
/// from the provider and the retry replays the charge. One charge at the provider.
async fn a_holder_killed_after_the_charge_is_completed_from_the_provider(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (sim, sim_base) = payments_sim().await;
    let lease = Duration::from_millis(1500);
    let doomed = Process::start(&t.url, &sim_base, lease).await;
    let client = Client(reqwest::Client::new());
    let request = {
        let base = doomed.server.base.clone();
        tokio::spawn(async move {
            let c = reqwest::Client::new();
            c.post(format!("{base}/v1/orders/o-2/payments"))
                .header("x-tenant", "t1")
                .header("idempotency-key", "k-after")
                .header("x-mode", "die-after")
                .header("content-type", "application/json")
                .body(r#"{"amount":1500}"#)
                .send()
                .await
        })
    };
    reached(&doomed.server.pay).await;
    doomed.kill();
    // A killed process answers nothing. The runtime shut down under the test may still let
    // the connection task write the 500 of its cancelled handler task: never the charge.
    if let Ok(answer) = request.await.unwrap() {
        assert!(
            answer.status().is_server_error(),
            "the killed server answered {}",
            answer.status()
        );
    }
    assert_eq!(sim.stats().payment_intents, 1, "the provider charged");

    let plain = serve(t.db.clone(), &sim_base, lease, false).await;
    let during = client.pay(&plain, "o-2", "k-after", "normal").await;
    assert_eq!(during.status(), StatusCode::CONFLICT);
    assert_eq!(link(&during), "</v1/operations/k-after>; rel=\"monitor\"");
    let body = problem(during).await;
    assert!(body["type"]
        .as_str()
        .unwrap()
        .ends_with("request-in-flight"));
    assert_eq!(body["status_url"], "/v1/operations/k-after");

    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let unknown = client.pay(&plain, "o-2", "k-after", "normal").await;
    assert_eq!(unknown.status(), StatusCode::CONFLICT);
    assert_eq!(link(&unknown), "</v1/operations/k-after>; rel=\"monitor\"");
    assert!(problem(unknown).await["type"]
        .as_str()
        .unwrap()
        .ends_with("outcome-unknown"));
    assert_eq!(
        plain.pay.calls.load(Ordering::SeqCst),
        0,
        "never a blind second run"
    );
    assert_eq!(record(&t.db, "k-after").await, (RecordState::Unknown, 1));

    let resolving = serve(t.db.clone(), &sim_base, lease, true).await;
    let resolved = client.pay(&resolving, "o-2", "k-after", "normal").await;
    assert_eq!(resolved.status(), StatusCode::CREATED);
    assert!(replayed(&resolved), "the charge is replayed, not made");
    let resolved: Value = resolved.json().await.unwrap();
    assert!(resolved["payment_intent"]
        .as_str()
        .unwrap()
        .starts_with("pi_"));
    assert_eq!(record(&t.db, "k-after").await, (RecordState::Succeeded, 1));
    for server in [&plain, &resolving] {
        let again = client.pay(server, "o-2", "k-after", "normal").await;
        assert!(replayed(&again));
        assert_eq!(again.json::<Value>().await.unwrap(), resolved);
    }
    assert_eq!(plain.pay.calls.load(Ordering::SeqCst), 0);
    assert_eq!(resolving.pay.calls.load(Ordering::SeqCst), 0);
    assert_eq!(sim.stats().payment_intents, 1, "one charge at the provider");
    assert_eq!(charges_under(&sim, "k-after"), 1);
}

/// A holder killed before it called the provider: after its lease the resolver finds
/// nothing, the record is taken over (fence 2) and the handler runs again with the same
/// derived key. One charge at the provider, under that key.
async fn a_holder_killed_before_the_call_runs_again_with_the_same_key(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (sim, sim_base) = payments_sim().await;
    let lease = Duration::from_secs(1);
    let doomed = Process::start(&t.url, &sim_base, lease).await;
    let base = doomed.server.base.clone();
    let request = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("{base}/v1/orders/o-3/payments"))
            .header("x-tenant", "t1")
            .header("idempotency-key", "k-before")
            .header("x-mode", "die-before")
            .header("content-type", "application/json")
            .body(r#"{"amount":1500}"#)
            .send()
            .await
    });
    reached(&doomed.server.pay).await;
    doomed.kill();
    // As above: the runtime shut down under the test is not a real kill, so an answer may
    // slip out; it is never a success.
    if let Ok(answer) = request.await.unwrap() {
        assert!(
            answer.status().is_server_error(),
            "the killed server answered {}",
            answer.status()
        );
    }
    assert_eq!(sim.stats().payment_intents, 0, "nothing was sent");

    let client = Client(reqwest::Client::new());
    let server = serve(t.db.clone(), &sim_base, lease, true).await;
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let res = client.pay(&server, "o-3", "k-before", "normal").await;
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(!replayed(&res), "the handler ran again");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["fence"], 2, "under a raised fence");
    assert_eq!(record(&t.db, "k-before").await, (RecordState::Succeeded, 2));
    let again = client.pay(&server, "o-3", "k-before", "normal").await;
    assert!(replayed(&again));
    assert_eq!(again.json::<Value>().await.unwrap(), body);
    assert_eq!(server.pay.calls.load(Ordering::SeqCst), 1);
    assert_eq!(sim.stats().payment_intents, 1, "one charge at the provider");
    assert_eq!(charges_under(&sim, "k-before"), 1, "under the derived key");
}

/// The retention collector deletes an expired finished record but never a `processing` or
/// an `unknown` one, however old; the lease report and the operators' list see them.
async fn the_collector_leaves_processing_and_unknown_records_alone(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (_sim, sim_base) = payments_sim().await;
    let server = Arc::new(serve(t.db.clone(), &sim_base, Duration::from_secs(60), true).await);
    let client = Arc::new(Client(reqwest::Client::new()));
    let done = client.pay(&server, "o-4", "k-done", "normal").await;
    assert_eq!(done.status(), StatusCode::CREATED);
    let failed = client.pay(&server, "o-5", "k-unknown", "fail").await;
    assert_eq!(failed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let _held = {
        let (server, client) = (server.clone(), client.clone());
        tokio::spawn(async move { client.pay(&server, "o-6", "k-held", "gate").await })
    };
    reached(&server.pay).await;
    assert_eq!(record(&t.db, "k-done").await.0, RecordState::Succeeded);
    assert_eq!(record(&t.db, "k-unknown").await.0, RecordState::Unknown);
    assert_eq!(record(&t.db, "k-held").await.0, RecordState::Processing);

    let store = IdempotencyStore::new(t.db.clone(), Duration::from_secs(3600));
    let report = store.lease_report(now_ms()).await.unwrap();
    assert_eq!(
        (
            report.processing,
            report.processing_past_lease,
            report.unknown
        ),
        (1, 0, 1)
    );
    assert_eq!(report.unknown_by_age, [1, 0, 0, 0]);
    let later = now_ms() + 30 * 24 * 3_600_000;
    let report = store.lease_report(later).await.unwrap();
    assert_eq!(report.processing_past_lease, 1);
    assert_eq!(report.unknown_by_age, [0, 0, 0, 1]);
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let gauges = recorder.handle();
    metrics::with_local_recorder(&recorder, || oncely_http::record_lease_gauges(&report));
    let text = gauges.render();
    for sample in [
        "oncely_idempotency_processing 1",
        "oncely_idempotency_processing_past_lease 1",
        "oncely_idempotency_unknown_records{age=\"under_5m\"} 0",
        "oncely_idempotency_unknown_records{age=\"over_24h\"} 1",
    ] {
        assert!(text.lines().any(|l| l == sample), "{sample} in {text}");
    }
    assert!(
        text.contains("oncely_idempotency_oldest_unknown_seconds 2592"),
        "about 30 days: {text}"
    );

    assert_eq!(store.collect_expired(later, 100).await.unwrap(), 1);
    let states: Vec<String> = on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT state FROM oncely_idempotency ORDER BY state"
    )
    .fetch_all(p)
    .await)
    .unwrap();
    assert_eq!(states, ["processing", "unknown"]);
    let unknown = store
        .list_records(Some(RecordState::Unknown), 10)
        .await
        .unwrap();
    assert_eq!(unknown.len(), 1);
    assert_eq!(unknown[0].key, "k-unknown");
    // The sweep turns the held record unknown once its lease is over, and only then.
    assert_eq!(store.expire_leases(now_ms(), 10).await.unwrap(), 0);
    assert_eq!(store.expire_leases(later, 10).await.unwrap(), 1);
    assert_eq!(record(&t.db, "k-held").await.0, RecordState::Unknown);
}

oncely_testkit::matrix! {
    tests: [
        a_taken_over_holder_cannot_complete_and_the_new_holders_outcome_stands,
        a_holder_killed_after_the_charge_is_completed_from_the_provider,
        a_holder_killed_before_the_call_runs_again_with_the_same_key,
        the_collector_leaves_processing_and_unknown_records_alone,
    ],
}
