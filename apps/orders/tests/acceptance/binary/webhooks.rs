//! `POST /v1/webhooks/stripe` on `orders serve` processes, on every backend: a charge
//! made unknown at the payments simulator (`drop_after`: committed, answer dropped) with
//! the runner's status check not due for ten minutes is settled by Stripe's signed event
//! alone — once, however often and however concurrently it is delivered — and a late
//! event never moves it back; refused signatures change nothing; events we cannot apply
//! are acknowledged. localstripe posts its own signed event to the service; the snippet
//! of docs/webhooks.md runs against the service as written there.

use std::time::{Duration, Instant};

use oncely_sql::{Effect, EffectState, EffectStore, EvidenceRow};
use oncely_testkit::TestDb;
use serde_json::{json, Value};

use super::{order, post, serve_with, sim, Proc, API_KEY_B};

/// The simulators' secret key.
const SK: &str = "sk_test_oncely_sim";
/// The endpoint's current secret; [`OLD_SECRET`] is configured beside it (a rotation).
pub(super) const SECRET: &str = "whsec_oncely_test_current";
const OLD_SECRET: &str = "whsec_oncely_test_previous";

oncely_testkit::matrix! {
    tests: [
        stripe_webhook_settles_unknown_charges_once_and_never_moves_them_back,
        localstripe_posts_its_signed_event_and_the_unknown_charge_settles_from_it,
        the_docs_snippet_signs_and_posts_an_event_that_settles_an_unknown_charge,
    ],
    cannot_apply: [],
}

/// `orders serve` charging at `payments` (the simulator's or localstripe's URL), with
/// status checks ten minutes off (only an event can settle an unknown charge meanwhile)
/// and the endpoint's secrets unless `webhook` is false.
pub(super) fn serve_charging(url: &str, payments: &str, extra: &[&str], webhook: bool) -> Proc {
    let secrets = format!("{OLD_SECRET},{SECRET}");
    let mut flags = vec![
        "--payments-url",
        payments,
        "--payments-secret-key",
        SK,
        "--provider-timeout-ms",
        "2000",
        "--runner-poll-ms",
        "50",
        "--relay-poll-ms",
        "50",
        "--consumer-poll-ms",
        "50",
        "--runner-check-delay-ms",
        "600000",
        "--db-max-connections",
        "4",
    ];
    if webhook {
        flags.extend(["--stripe-webhook-secret", secrets.as_str()]);
    }
    flags.extend(extra);
    serve_with(url, &flags)
}

/// A Stripe event of `kind` with `object` as its `data.object`, created now.
pub(super) fn event(id: &str, kind: &str, object: &Value) -> String {
    json!({
        "id": id,
        "object": "event",
        "type": kind,
        "created": now_secs(),
        "data": {"object": object},
    })
    .to_string()
}

fn now_secs() -> i64 {
    oncely_core::now_ms() / 1000
}

/// Posts `body` to `base`'s webhook endpoint with `signature` (none when `None`).
async fn post_signed(base: &str, signature: Option<String>, body: &str) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/webhooks/stripe"))
        .header("Content-Type", "application/json")
        .body(body.to_owned());
    if let Some(s) = signature {
        req = req.header("Stripe-Signature", s);
    }
    let res = req.send().await.unwrap();
    (
        res.status().as_u16(),
        res.json().await.unwrap_or(Value::Null),
    )
}

/// Posts `body` signed now with [`SECRET`], as Stripe would.
pub(super) async fn post_event(base: &str, body: &str) -> (u16, Value) {
    let signature = oncely_effects::sign_stripe_event(SECRET, now_secs(), body.as_bytes());
    post_signed(base, Some(signature), body).await
}

/// Waits (up to 30 s) until `n` charge effects are `unknown`; returns them.
pub(super) async fn unknown_charges(t: &TestDb, n: usize) -> Vec<Effect> {
    let store = EffectStore::new(t.db.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let unknown: Vec<Effect> = store
            .list(Some(EffectState::Unknown), 100)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.provider == "payments" && e.operation == "charge")
            .collect();
        if unknown.len() >= n {
            return unknown;
        }
        assert!(
            Instant::now() < deadline,
            "{n} unknown charges expected, have {unknown:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The PaymentIntent at `payments` whose `metadata.invoice_id` is `reference`.
pub(super) async fn intent_of(payments: &str, reference: &str) -> Value {
    let list: Value = reqwest::Client::new()
        .get(format!("{payments}/v1/payment_intents?limit=100"))
        .bearer_auth(SK)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|pi| pi["metadata"]["invoice_id"] == reference)
        .cloned()
        .unwrap_or_else(|| panic!("no PaymentIntent for {reference}: {list}"))
}

/// Arms `count` one-shot `drop_after` faults at the payments simulator `payments`.
pub(super) async fn drop_answers(payments: &str, count: u32) {
    let armed = reqwest::Client::new()
        .post(format!("{payments}/_sim/faults/next"))
        .json(&json!({"kind": "drop_after", "count": count}))
        .send()
        .await
        .unwrap();
    assert!(armed.status().is_success());
}

async fn effect(t: &TestDb, id: &str) -> (Effect, Vec<EvidenceRow>) {
    let store = EffectStore::new(t.db.clone());
    let e = store.get(id).await.unwrap().unwrap();
    (e, store.evidence(id).await.unwrap())
}

/// The evidence rows an event left (`status`/`webhook`).
pub(super) fn from_webhooks(trail: &[EvidenceRow]) -> Vec<&EvidenceRow> {
    trail
        .iter()
        .filter(|r| r.kind == "status" && r.outcome == "webhook")
        .collect()
}

fn problem_type(v: &Value) -> &str {
    v["type"].as_str().unwrap_or_default()
}

async fn stripe_webhook_settles_unknown_charges_once_and_never_moves_them_back(t: TestDb) {
    orders::migrate(&t.db).await.unwrap();
    let (_sim, payments) = sim("payments", &[]);
    drop_answers(&payments, 2).await;
    let serve = serve_charging(&t.url, &payments, &[], true);
    let client = reqwest::Client::new();
    // Two tenants' orders: `cli`'s charge and `cli-b`'s.
    assert_eq!(
        post(&client, &serve.base, "wh-1", &order("wh-1")).await.0,
        201
    );
    let other_tenant = client
        .post(format!("{}/v1/orders", serve.base))
        .bearer_auth(API_KEY_B)
        .header("idempotency-key", "wh-2")
        .json(&order("wh-2"))
        .send()
        .await
        .unwrap();
    assert_eq!(other_tenant.status(), 201);
    let unknown = unknown_charges(&t, 2).await;
    let of = |tenant: &str| unknown.iter().find(|e| e.tenant == tenant).unwrap();
    let (a, b) = (of("cli"), of("cli-b"));
    let pi = intent_of(&payments, &a.reference).await;
    assert_eq!(pi["status"], "succeeded", "{pi}");
    refused_events_change_nothing(&t, &serve.base, a, &pi).await;
    let body = ten_deliveries_at_once_apply_once(&t, &serve.base, a, &pi).await;
    // One tenant's event touched its own charge only.
    let (untouched, trail) = effect(&t, &b.id).await;
    assert_eq!(untouched.state_word, "unknown");
    assert!(from_webhooks(&trail).is_empty(), "{trail:?}");
    late_and_foreign_events_are_acknowledged(&t, &serve.base, a, &pi).await;
    an_unlisted_status_parks_the_charge(&t, &serve.base, &payments, b).await;

    // Without a secret the route is absent: the service's 404.
    let plain = serve_charging(
        &t.url,
        &payments,
        &["--no-relay", "--no-consumer", "--no-runner"],
        false,
    );
    let (status, answer) = post_event(&plain.base, &body).await;
    assert_eq!(status, 404);
    assert_eq!(problem_type(&answer), "urn:oncely:problem:not-found");
}

/// No header, a secret we do not hold, a timestamp outside the tolerance: 400, nothing
/// changed.
async fn refused_events_change_nothing(t: &TestDb, base: &str, a: &Effect, pi: &Value) {
    let before = effect(t, &a.id).await;
    let body = event("evt_refused", "payment_intent.succeeded", pi);
    let foreign = oncely_effects::sign_stripe_event("whsec_other", now_secs(), body.as_bytes());
    let stale = oncely_effects::sign_stripe_event(SECRET, now_secs() - 301, body.as_bytes());
    for signature in [None, Some(foreign), Some(stale)] {
        let (status, problem) = post_signed(base, signature, &body).await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(
            problem_type(&problem),
            "urn:oncely:problem:webhook-signature-invalid"
        );
    }
    assert_eq!(
        effect(t, &a.id).await,
        before,
        "a refused event changed nothing"
    );
}

/// An event refused while a runner holds the effect, then the same event ten times at
/// once: applied once, every delivery 2xx. Returns its body.
async fn ten_deliveries_at_once_apply_once(
    t: &TestDb,
    base: &str,
    a: &Effect,
    pi: &Value,
) -> String {
    let evt = format!("evt_{}", uuid::Uuid::new_v4().simple());
    let body = event(&evt, "payment_intent.succeeded", pi);
    // While a runner holds the effect the delivery is refused for now (503) and leaves no
    // trace: the same event delivered after the lease is applied.
    let held = EffectStore::new(t.db.clone())
        .lease_unknown(
            &a.id,
            "a-runner",
            Duration::from_secs(1),
            oncely_core::now_ms(),
        )
        .await
        .unwrap();
    assert!(held.is_some());
    let (status, answer) = post_event(base, &body).await;
    assert_eq!(status, 503, "{answer}");
    assert_eq!(
        problem_type(&answer),
        "urn:oncely:problem:webhook-retry-later"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let deliveries: Vec<_> = (0..10)
        .map(|_| {
            let (base, body) = (base.to_owned(), body.clone());
            tokio::spawn(async move { post_event(&base, &body).await })
        })
        .collect();
    let mut results = Vec::new();
    for d in deliveries {
        let (status, answer) = d.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        results.push(answer["result"].as_str().unwrap().to_owned());
    }
    results.sort();
    assert_eq!(
        results.iter().filter(|r| *r == "resolved").count(),
        1,
        "{results:?}"
    );
    assert_eq!(results.iter().filter(|r| *r == "duplicate").count(), 9);
    let (settled, trail) = effect(t, &a.id).await;
    assert_eq!(settled.state_word, "succeeded");
    assert_eq!(settled.provider_id.as_deref(), pi["id"].as_str());
    assert!(
        !trail
            .iter()
            .any(|r| r.kind == "status" && r.outcome != "webhook"),
        "no status check ran: {trail:?}"
    );
    let rows = from_webhooks(&trail);
    assert_eq!(rows.len(), 1, "{trail:?}");
    assert!(
        rows[0].detail.starts_with(&format!(
            "stripe event {evt} payment_intent.succeeded created "
        )),
        "{:?}",
        rows[0]
    );
    assert_eq!(rows[0].provider_ids, pi["id"].as_str().unwrap());

    body
}

/// A late `processing` of the same PaymentIntent is noted, never a step back; a type we
/// do not read and a PaymentIntent of no effect are acknowledged, not applied.
async fn late_and_foreign_events_are_acknowledged(t: &TestDb, base: &str, a: &Effect, pi: &Value) {
    let mut processing = pi.clone();
    processing["status"] = json!("processing");
    let late = event(
        "evt_late_processing",
        "payment_intent.processing",
        &processing,
    );
    let (status, answer) = post_event(base, &late).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (200, Some("noted")),
        "{answer}"
    );
    let (after, trail) = effect(t, &a.id).await;
    assert_eq!(after.state_word, "succeeded");
    assert_eq!(from_webhooks(&trail).len(), 2);

    // Acknowledged, not applied: a type we do not read, a PaymentIntent of no effect.
    let other = event(
        "evt_customer",
        "customer.created",
        &json!({"id": "cus_1", "object": "customer"}),
    );
    let (status, answer) = post_event(base, &other).await;
    assert_eq!((status, answer["result"].as_str()), (200, Some("ignored")));
    let mut stranger = pi.clone();
    stranger["id"] = json!("pi_nobody");
    stranger["metadata"] = json!({"invoice_id": "inv-nobody"});
    let stray = event("evt_stray", "payment_intent.succeeded", &stranger);
    let (status, answer) = post_event(base, &stray).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (200, Some("no_effect"))
    );
    let (status, answer) = post_event(base, "not json").await;
    assert_eq!(status, 400);
    assert_eq!(
        problem_type(&answer),
        "urn:oncely:problem:invalid-webhook-event"
    );
}

/// A status nobody listed parks the charge for a person, as a status check would.
async fn an_unlisted_status_parks_the_charge(t: &TestDb, base: &str, payments: &str, b: &Effect) {
    let mut odd = intent_of(payments, &b.reference).await;
    odd["status"] = json!("requires_reconsideration");
    let (status, answer) =
        post_event(base, &event("evt_odd", "payment_intent.updated", &odd)).await;
    assert_eq!(
        (status, answer["state"].as_str()),
        (200, Some("needs_review")),
        "{answer}"
    );
    let (parked, trail) = effect(t, &b.id).await;
    assert_eq!(parked.state_word, "needs_review");
    assert!(parked
        .last_error
        .unwrap()
        .contains("requires_reconsideration"));
    assert_eq!(from_webhooks(&trail).len(), 1);
}

async fn localstripe_posts_its_signed_event_and_the_unknown_charge_settles_from_it(t: TestDb) {
    use oncely_testkit::{Answer, HttpFault, HttpFaultProxy, ProxyOptions, Schedule};
    let Some(ls) = oncely_testkit::LocalStripe::start().await else {
        return;
    };
    orders::migrate(&t.db).await.unwrap();
    // Every charge reaches localstripe, which commits it; its answer is reset on the way
    // back, so the charge is unknown to the service.
    let proxy = HttpFaultProxy::start(
        ls.base_url(),
        ProxyOptions {
            order_of: std::sync::Arc::new(|req| {
                (req.method == "POST" && req.target.starts_with("/v1/payment_intents"))
                    .then(|| "all".to_owned())
            }),
            ..ProxyOptions::default()
        },
    )
    .await;
    proxy.plan(
        "all",
        Schedule {
            effects: vec![HttpFault::After(Answer::Reset)],
            ..Schedule::default()
        },
    );
    let serve = serve_charging(&t.url, &proxy.base_url(), &["--payments-no-search"], true);
    // localstripe signs with the secret it was given and posts every event to the service.
    let registered = reqwest::Client::new()
        .post(format!("{}/_config/webhooks/oncely", ls.base_url()))
        .json(&json!({
            "url": format!("{}/v1/webhooks/stripe", serve.base),
            "secret": SECRET,
            "events": ["payment_intent.succeeded", "payment_intent.payment_failed"],
        }))
        .send()
        .await
        .unwrap();
    assert!(registered.status().is_success(), "{registered:?}");
    let client = reqwest::Client::new();
    assert_eq!(
        post(&client, &serve.base, "ls-1", &order("ls-1")).await.0,
        201
    );
    let charge = unknown_charges(&t, 1).await.remove(0);
    let store = EffectStore::new(t.db.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let e = store.get(&charge.id).await.unwrap().unwrap();
        if e.state_word != "unknown" {
            assert_eq!(e.state_word, "succeeded");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "localstripe's event never settled {e:?}; proxy: {:?}",
            proxy.log("all")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let trail = store.evidence(&charge.id).await.unwrap();
    let rows = from_webhooks(&trail);
    assert_eq!(rows.len(), 1, "{trail:?}");
    assert!(
        rows[0].detail.contains("payment_intent.succeeded"),
        "{rows:?}"
    );
    assert!(
        !trail
            .iter()
            .any(|r| r.kind == "status" && r.outcome != "webhook"),
        "no status check ran: {trail:?}"
    );
    let intents = oncely_testkit::localstripe_payment_intents(ls.base_url(), SK).await;
    assert_eq!(intents.len(), 1, "one charge at localstripe");
}

/// The first ```python block of docs/webhooks.md after the line `<!-- snippet: sign-and-post -->`.
fn docs_snippet() -> String {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/webhooks.md"),
    )
    .unwrap();
    let after = doc
        .split("<!-- snippet: sign-and-post -->")
        .nth(1)
        .expect("docs/webhooks.md marks its snippet");
    let code = after.split("```python\n").nth(1).expect("a python block");
    code.split("\n```").next().unwrap().to_owned()
}

async fn the_docs_snippet_signs_and_posts_an_event_that_settles_an_unknown_charge(t: TestDb) {
    orders::migrate(&t.db).await.unwrap();
    let (_sim, payments) = sim("payments", &[]);
    drop_answers(&payments, 1).await;
    let serve = serve_charging(&t.url, &payments, &[], true);
    let client = reqwest::Client::new();
    assert_eq!(
        post(&client, &serve.base, "doc-1", &order("doc-1")).await.0,
        201
    );
    let charge = unknown_charges(&t, 1).await.remove(0);
    let pi = intent_of(&payments, &charge.reference).await;
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("post_event.py");
    std::fs::write(&script, docs_snippet()).unwrap();
    let pi_file = dir.path().join("pi.json");
    std::fs::write(&pi_file, pi.to_string()).unwrap();
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(format!("{}/v1/webhooks/stripe", serve.base))
        .arg(&pi_file)
        .env("STRIPE_WEBHOOK_SECRET", SECRET)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let store = EffectStore::new(t.db.clone());
    let e = store.get(&charge.id).await.unwrap().unwrap();
    assert_eq!(e.state_word, "succeeded");
    assert_eq!(
        from_webhooks(&store.evidence(&e.id).await.unwrap()).len(),
        1
    );
}
