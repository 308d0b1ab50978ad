//! `POST /v1/orders/{id}/payments` (multi-phase) through `orders serve` processes, on every
//! backend: a serve process aborted (`FAILPOINTS=payments.after_call=panic(abort)`, as a SIGKILL
//! would end it) after the provider committed and before the outcome was stored, or
//! (`payment-abort-before-call`) before it called; a second serve process on the same
//! database answers the retries. While the lease runs: 409 with the status link. Past it
//! (turned `unknown` by the second process's lease sweep, without any retry): the status
//! check completes the record from the provider and the retry replays the charge — or,
//! nothing found, sends the call again under the same derived key. Exactly one charge at
//! the provider, counted at the simulator's `/_sim/stats` and at localstripe's list (which
//! ignores `Idempotency-Key`, so one charge there is the status check's doing).
//!
//! Also the periodic reconciler of `serve --reconcile-every`: a charge seeded at the
//! simulator is counted in `/metrics` without running `oncely reconcile`.

use std::time::{Duration, Instant};

use oncely_testkit::{LocalStripe, TestDb};
use serde_json::Value;

use super::{order, post, serve_with_env, sim, stats, wait_exit, Proc, API_KEY};

const SK: &str = "sk_test_oncely_sim";
/// The lease of a payment holder in these tests; the provider timeout is below it.
const LEASE_SECS: u64 = 5;

oncely_testkit::matrix! {
    tests: [
        serve_killed_after_the_provider_committed_answers_409_then_replays_the_one_charge,
        serve_killed_before_the_call_sends_it_again_with_the_same_key_after_the_lease,
        serve_killed_after_or_before_the_call_charges_once_at_localstripe,
        serve_reconciles_periodically_and_counts_a_charge_seeded_at_the_simulator_in_metrics,
    ],
    cannot_apply: [],
}

/// Which fault the first process dies of.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kill {
    AfterCall,
    BeforeCall,
}

impl Kill {
    /// A name for the keys and references of a run (no characters a URL escapes).
    fn name(self) -> &'static str {
        match self {
            Self::AfterCall => "after-call",
            Self::BeforeCall => "before-call",
        }
    }

    fn env(self) -> &'static str {
        match self {
            Self::AfterCall => "payments.after_call=panic(abort)",
            Self::BeforeCall => "payments.before_call=panic(abort)",
        }
    }
}

/// The serve flags of the payments endpoint against `payments` (no relay, consumers or
/// runner: only the endpoint charges).
fn flags(payments: &str, no_search: bool) -> Vec<String> {
    let mut f: Vec<String> = [
        "--payments-url",
        payments,
        "--payments-secret-key",
        SK,
        "--payments-settle-secs",
        "1",
        "--provider-timeout-ms",
        "2000",
        "--payment-lease-secs",
        &LEASE_SECS.to_string(),
        "--lease-sweep-secs",
        "1",
        "--no-relay",
        "--no-consumer",
        "--no-runner",
        "--db-max-connections",
        "3",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if no_search {
        f.push("--payments-no-search".to_owned());
    }
    f
}

fn serve_pay(url: &str, flags: &[String], fault: Option<Kill>) -> Proc {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = fault.map(|k| ("FAILPOINTS", k.env())).into_iter().collect();
    serve_with_env(url, &flags, &env)
}

async fn pay(base: &str, order: &str, key: &str) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .post(format!("{base}/v1/orders/{order}/payments"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}")
        .timeout(Duration::from_secs(10))
        .send()
        .await
}

async fn operation(base: &str, key: &str) -> Value {
    reqwest::Client::new()
        .get(format!("{base}/v1/operations/{key}"))
        .bearer_auth(API_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Charges at the provider for `order`'s reference: (total, succeeded).
type Counter<'a> =
    &'a (dyn Fn(String) -> futures_util::future::BoxFuture<'static, (u64, u64)> + Sync);

async fn sim_charges(base: String, reference: String) -> (u64, u64) {
    let s = stats(&base).await;
    let c = &s["payment_intents_by_metadata"]["invoice_id"][&reference];
    (
        c["total"].as_u64().unwrap_or(0),
        c["succeeded"].as_u64().unwrap_or(0),
    )
}

/// PaymentIntents at localstripe whose `metadata[invoice_id]` is `reference`: (total,
/// succeeded), every page.
async fn localstripe_charges(base: String, reference: String) -> (u64, u64) {
    let intents = oncely_testkit::localstripe_payment_intents(&base, SK).await;
    let mine = intents
        .iter()
        .filter(|pi| pi["metadata"]["invoice_id"] == reference.as_str());
    mine.fold((0, 0), |(total, succeeded), pi| {
        (
            total + 1,
            succeeded + u64::from(pi["status"] == "succeeded"),
        )
    })
}

/// One killed payment: `dying` aborts at `kill` on the first request; `survivor` (the same
/// database) answers 409 with the status link while the lease runs, shows the record
/// turned `unknown` by its sweep after it, then completes the payment on the retry.
#[allow(
    clippy::too_many_lines,
    reason = "one crash scenario: abort, 409 under the lease, sweep, resolve, count at the provider"
)]
async fn killed_payment(
    mut dying: Proc,
    survivor: &Proc,
    kill: Kill,
    ext: &str,
    charges: Counter<'_>,
) {
    let client = reqwest::Client::new();
    let (code, _, created) = post(
        &client,
        &survivor.base,
        &format!("order-{ext}"),
        &order(ext),
    )
    .await;
    assert_eq!(code, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    let reference = format!("order:{id}:payment");
    let key = format!("kill-{ext}");

    let first = pay(&dying.base, &id, &key).await;
    assert!(
        first
            .as_ref()
            .map_or(true, |r| r.status().is_server_error()),
        "the first process was to abort: {first:?}"
    );
    let status = wait_exit(&mut dying.child).await;
    assert!(
        !status.success(),
        "{kill:?}: the process aborted ({status})"
    );
    let after_kill = Instant::now();
    let expected = u64::from(kill == Kill::AfterCall);
    assert_eq!(
        charges(reference.clone()).await,
        (expected, expected),
        "{kill:?}: charges at the provider before the retry"
    );

    // While the lease runs: 409 with the status link, nothing sent.
    let res = pay(&survivor.base, &id, &key).await.unwrap();
    assert!(
        after_kill.elapsed() < Duration::from_secs(LEASE_SECS - 1),
        "the retry came too late to be under the lease"
    );
    assert_eq!(res.status(), 409, "{kill:?}: under the lease");
    let link = res.headers()["link"].to_str().unwrap().to_owned();
    assert_eq!(link, format!("</v1/operations/{key}>; rel=\"monitor\""));
    let problem: Value = res.json().await.unwrap();
    assert_eq!(
        problem["type"], "urn:oncely:problem:request-in-flight",
        "{problem}"
    );
    assert_eq!(problem["status_url"], format!("/v1/operations/{key}"));
    let op = operation(&survivor.base, &key).await;
    assert_eq!(
        (op["state"].as_str(), op["attempts"].as_i64()),
        (Some("processing"), Some(1)),
        "{op}"
    );

    // Past the lease the survivor's sweep turns it unknown — no retry needed.
    let deadline = Instant::now() + Duration::from_secs(LEASE_SECS + 10);
    let op = loop {
        let op = operation(&survivor.base, &key).await;
        if op["state"] == "unknown" {
            break op;
        }
        assert!(Instant::now() < deadline, "never turned unknown: {op}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let calls: Vec<&Value> = op["evidence"].as_array().unwrap().iter().collect();
    assert_eq!(calls.len(), usize::from(kill == Kill::AfterCall), "{op}");
    // The sweep's next round counts it in the gauge of unknown records.
    loop {
        let metrics = reqwest::get(format!("{}/metrics", survivor.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let unknown = gauge(
            &metrics,
            "oncely_idempotency_unknown_records",
            &["age=\"under_5m\""],
        );
        if unknown.is_some_and(|n| n >= 1.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the unknown gauge never counted it: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The retry: the status check first.
    let res = pay(&survivor.base, &id, &key).await.unwrap();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    assert_eq!(res.status(), 201, "{kill:?}: resolved");
    let body: Value = res.json().await.unwrap();
    let intent = body["payment_intent"].as_str().unwrap().to_owned();
    // Found at the provider → completed from it and replayed; absent → run again.
    assert_eq!(replayed, kill == Kill::AfterCall, "{body}");
    assert_eq!(
        charges(reference.clone()).await,
        (1, 1),
        "{kill:?}: exactly one charge"
    );
    let again = pay(&survivor.base, &id, &key).await.unwrap();
    assert!(again.headers().get("idempotent-replayed").is_some());
    assert_eq!(again.json::<Value>().await.unwrap(), body);

    let op = operation(&survivor.base, &key).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    assert_eq!(op["payment"]["payment_intent"], intent.as_str(), "{op}");
    assert_eq!(op["payment"]["state"], "succeeded", "{op}");
    let evidence: Vec<(String, String, i64)> = op["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["outcome"].as_str().unwrap().to_owned(),
                e["fence"].as_i64().unwrap(),
            )
        })
        .collect();
    let expected: Vec<(String, String, i64)> = match kill {
        // The call's outcome was never stored; the status check found it.
        Kill::AfterCall => vec![("call", "sent", 1), ("status", "found", 1)],
        // Nothing went out; the status check found nothing; the take-over (fence 2)
        // called with the same key (every evidence row here is of this key).
        Kill::BeforeCall => vec![("status", "absent", 1), ("call", "succeeded", 2)],
    }
    .into_iter()
    .map(|(k, o, f)| (k.to_owned(), o.to_owned(), f))
    .collect();
    assert_eq!(evidence, expected, "{op}");
    assert_eq!(
        op["attempts"],
        if kill == Kill::AfterCall { 1 } else { 2 },
        "{op}"
    );
    assert!(op["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["provider_key"] == op["provider_key"]));
}

async fn serve_killed_after_the_provider_committed_answers_409_then_replays_the_one_charge(
    t: TestDb,
) {
    orders::migrate(&t.db).await.unwrap();
    let (_sim, base) = sim("payments", &["--search-lag-ms", "200"]);
    let f = flags(&base, false);
    let survivor = serve_pay(&t.url, &f, None);
    let dying = serve_pay(&t.url, &f, Some(Kill::AfterCall));
    let count = |r: String| -> futures_util::future::BoxFuture<'static, (u64, u64)> {
        Box::pin(sim_charges(base.clone(), r))
    };
    killed_payment(dying, &survivor, Kill::AfterCall, "after", &count).await;
    assert_eq!(stats(&base).await["payment_intents"], 1);
}

async fn serve_killed_before_the_call_sends_it_again_with_the_same_key_after_the_lease(t: TestDb) {
    orders::migrate(&t.db).await.unwrap();
    let (_sim, base) = sim("payments", &["--search-lag-ms", "200"]);
    let f = flags(&base, false);
    let survivor = serve_pay(&t.url, &f, None);
    let dying = serve_pay(&t.url, &f, Some(Kill::BeforeCall));
    let count = |r: String| -> futures_util::future::BoxFuture<'static, (u64, u64)> {
        Box::pin(sim_charges(base.clone(), r))
    };
    killed_payment(dying, &survivor, Kill::BeforeCall, "before", &count).await;
    let s = stats(&base).await;
    assert_eq!(s["payment_intents"], 1, "{s}");
    assert_eq!(
        s["requests"]["replayed"], 0,
        "one create, never replayed: {s}"
    );
}

async fn serve_killed_after_or_before_the_call_charges_once_at_localstripe(t: TestDb) {
    let Some(ls) = LocalStripe::start().await else {
        return;
    };
    orders::migrate(&t.db).await.unwrap();
    // localstripe has no search: the status check pages the list.
    let f = flags(ls.base_url(), true);
    let survivor = serve_pay(&t.url, &f, None);
    let base = ls.base_url().to_owned();
    let count = |r: String| -> futures_util::future::BoxFuture<'static, (u64, u64)> {
        Box::pin(localstripe_charges(base.clone(), r))
    };
    for kill in [Kill::AfterCall, Kill::BeforeCall] {
        let dying = serve_pay(&t.url, &f, Some(kill));
        let ext = format!("ls-{}", kill.name());
        killed_payment(dying, &survivor, kill, &ext, &count).await;
    }
}

/// The value of the gauge line of `metrics` with `name` and every label of `labels`.
fn gauge(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn serve_reconciles_periodically_and_counts_a_charge_seeded_at_the_simulator_in_metrics(
    t: TestDb,
) {
    orders::migrate(&t.db).await.unwrap();
    let (_sim, base) = sim("payments", &[]);
    let mut f = flags(&base, false);
    f.extend(["--reconcile-every".to_owned(), "1".to_owned()]);
    let serve = serve_pay(&t.url, &f, None);
    // A charge nobody recorded, made at the provider directly.
    let seeded = reqwest::Client::new()
        .post(format!("{base}/v1/payment_intents"))
        .bearer_auth(SK)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("amount=700&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[invoice_id]=inv-seeded")
        .send()
        .await
        .unwrap();
    assert!(seeded.status().is_success());
    let labels = ["provider=\"payments\"", "kind=\"missing_local\""];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = reqwest::get(format!("{}/metrics", serve.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let found = gauge(&metrics, "oncely_reconcile_discrepancies", &labels);
        let last = gauge(
            &metrics,
            "oncely_reconcile_last_run_timestamp_seconds",
            &["provider=\"payments\""],
        );
        if found == Some(1.0) {
            assert!(last.is_some_and(|t| t > 0.0), "{metrics}");
            break;
        }
        assert!(Instant::now() < deadline, "never counted: {metrics}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let open: Vec<(String,)> =
        t.db.fetch_all(oncely_sql::query(format!(
            "SELECT {} FROM oncely_discrepancies WHERE resolved_at IS NULL",
            t.db.backend().text_column("reference")
        )))
        .await
        .unwrap();
    assert_eq!(open, vec![("inv-seeded".to_owned(),)]);
}
