//! The provider adapters against real HTTP servers: our simulators (`oncely-sim`, on
//! `127.0.0.1:0`, with each fault of docs/DESIGN.md "Provider contracts" fired once) and
//! `localstripe` (PyPI), a fake Stripe written by others that ignores `Idempotency-Key`.
//!
//! What every fault must show: the call's outcome class tells "may have happened" from
//! "did not happen", and the status check by reference finds the object the call made —
//! so the runner can record it instead of creating a second one.

use std::time::{Duration, SystemTime};

use oncely_core::OutcomeClass;
use oncely_effects::{
    CallOutcome, EffectRequest, Provider, ShippingClient, ShippingConfig, StatusOutcome,
    StatusQuery, StripeConfig, StripePayments,
};
use oncely_sim::{serve, FaultConfig, PaymentsConfig, PaymentsSim, ShippingSim};
use oncely_testkit::LocalStripe;
use serde_json::json;

#[path = "providers/continuation.rs"]
mod continuation;
#[path = "providers/group.rs"]
mod group;
#[path = "providers/money.rs"]
mod money;
#[path = "providers/outage.rs"]
mod outage;
#[path = "providers/reconcile.rs"]
mod reconcile;
#[path = "providers/s6.rs"]
mod s6;
#[path = "providers/send_bound.rs"]
mod send_bound;

pub(crate) const SK: &str = "sk_test_oncely_effects";

/// Enqueues an effect of tenant `acme` (key `key-<reference>`); its id.
pub(crate) async fn enqueue_effect(
    db: &oncely_sql::Database,
    (provider, operation): (&str, &str),
    reference: &str,
    request: &serde_json::Value,
) -> String {
    let mut tx = db.begin().await.unwrap();
    let new = oncely_sql::NewEffect {
        tenant: "acme",
        provider,
        operation,
        reference,
        key: &format!("key-{reference}"),
        request,
    };
    let created = oncely_sql::EffectStore::enqueue(&mut tx, &new, oncely_core::now_ms())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    match created {
        oncely_sql::Enqueued::Created(id) => id,
        other => panic!("{other:?}"),
    }
}

/// Runs rounds until the effect is settled (at most 20 s).
pub(crate) async fn settle(
    runner: &std::sync::Arc<oncely_effects::EffectRunner>,
    store: &oncely_sql::EffectStore,
    id: &str,
) -> oncely_sql::Effect {
    for _ in 0..400 {
        runner.run_once().await.unwrap();
        let effect = store.get(id).await.unwrap().unwrap();
        if effect.state().unwrap().is_settled() {
            return effect;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{id} did not settle: {:?}", store.get(id).await.unwrap());
}

pub(crate) async fn listen(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, router, std::future::pending()));
    format!("http://{addr}")
}

/// A payments simulator whose search lags by `search_lag` and whose late answers come
/// after 1.5 s.
pub(crate) async fn payments_sim(search_lag: Duration) -> (PaymentsSim, String) {
    let sim = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.into()],
        search_lag,
        faults: FaultConfig {
            late_ms: 1_500,
            retry_after_secs: 3,
            seed: Some(7),
            ..FaultConfig::default()
        },
    });
    let base = listen(sim.router()).await;
    (sim, base)
}

fn stripe(base: &str, search: bool) -> StripePayments {
    StripePayments::new(StripeConfig {
        base_url: base.to_owned(),
        secret_key: SK.to_owned(),
        timeout: Duration::from_millis(800),
        search,
        settle_time: Duration::from_secs(2),
        page_limit: 2,
        ..StripeConfig::default()
    })
    .unwrap()
}

fn charge(invoice: &str, key: &str) -> EffectRequest {
    EffectRequest {
        operation: "charge".into(),
        reference: invoice.into(),
        key: key.into(),
        params: json!({"amount": 1250, "currency": "eur", "metadata": {"order_id": "ord-1"}}),
    }
}

/// Sets a simulator's fault settings (`POST /_sim/faults`).
pub(crate) async fn set_faults(base: &str, settings: serde_json::Value) {
    let res = reqwest::Client::new()
        .post(format!("{base}/_sim/faults"))
        .json(&settings)
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "{settings}: {}", res.status());
}

/// Arms one fault of `kind` for the simulator's next effect.
pub(crate) async fn next_fault(base: &str, kind: &str) {
    let res = reqwest::Client::new()
        .post(format!("{base}/_sim/faults/next"))
        .json(&json!({"kind": kind}))
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "arming {kind}: {}", res.status());
}

fn query(request: &EffectRequest) -> StatusQuery<'_> {
    StatusQuery {
        request,
        last_sent: Some(SystemTime::now()),
        since: SystemTime::now() - Duration::from_secs(60),
    }
}

/// A status query of a call last sent a minute ago: past every settle time here, so
/// "not found" is absent.
fn settled_query(request: &EffectRequest) -> StatusQuery<'_> {
    StatusQuery {
        last_sent: Some(SystemTime::now() - Duration::from_secs(60)),
        ..query(request)
    }
}

fn found(outcome: StatusOutcome) -> Vec<oncely_effects::RemoteObject> {
    match outcome {
        StatusOutcome::Found(objects) => objects,
        other => panic!("expected Found, got {other:?}"),
    }
}

fn succeeded(outcome: CallOutcome) -> oncely_effects::RemoteObject {
    match outcome {
        CallOutcome::Succeeded(o) => o,
        other => panic!("expected Succeeded, got {other:?}"),
    }
}

pub(crate) fn intents_for(sim: &PaymentsSim, invoice: &str) -> u64 {
    sim.stats()
        .payment_intents_by_metadata
        .get("invoice_id")
        .and_then(|m| m.get(invoice))
        .map_or(0, |c| c.total)
}

#[tokio::test]
async fn a_charge_succeeds_and_the_same_key_resent_returns_the_first_intent() {
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, true);
    let request = charge("inv-ok", "key-ok");
    let first = succeeded(p.call(&request).await);
    assert_eq!(
        (
            first.status.as_str(),
            first.amount,
            first.reference.as_deref()
        ),
        ("succeeded", Some(1250), Some("inv-ok"))
    );
    let again = succeeded(p.call(&request).await);
    assert_eq!(
        again.id, first.id,
        "Stripe v1 replays the first answer under a key"
    );
    assert_eq!(intents_for(&sim, "inv-ok"), 1);
    assert_eq!(
        found(p.status(query(&request)).await.unwrap())[0].id,
        first.id
    );
}

#[tokio::test]
async fn a_connection_dropped_after_the_charge_is_unknown_and_the_status_finds_the_charge() {
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, true);
    let request = charge("inv-drop", "key-drop");
    next_fault(&base, "drop_after").await;
    let outcome = p.call(&request).await;
    assert_eq!(outcome.class(), OutcomeClass::Unknown, "{outcome:?}");
    let objects = found(p.status(query(&request)).await.unwrap());
    assert_eq!(objects.len(), 1);
    assert!(objects[0].is_live());
    assert_eq!(intents_for(&sim, "inv-drop"), 1);
}

#[tokio::test]
async fn an_answer_after_the_callers_timeout_is_unknown_and_the_status_finds_the_charge() {
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, false);
    let request = charge("inv-late", "key-late");
    next_fault(&base, "late_after").await;
    let outcome = p.call(&request).await;
    assert!(
        matches!(outcome, CallOutcome::Unknown { status: None, .. }),
        "{outcome:?}"
    );
    assert_eq!(found(p.status(query(&request)).await.unwrap()).len(), 1);
    assert_eq!(intents_for(&sim, "inv-late"), 1);
}

/// Stripe v1 stores the first answer under the key, a 500 included: the re-sent key gets
/// the same 500 back. Neither is an answer — both are unknown, and the status check is
/// what finds the charge the first request made.
#[tokio::test]
async fn a_500_after_the_charge_and_its_replay_under_the_key_are_unknown_not_answers() {
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, false);
    let request = charge("inv-500", "key-500");
    next_fault(&base, "error_after").await;
    let first = p.call(&request).await;
    assert!(
        matches!(
            first,
            CallOutcome::Unknown {
                status: Some(500),
                ..
            }
        ),
        "{first:?}"
    );
    let replayed = p.call(&request).await;
    match &replayed {
        CallOutcome::Unknown {
            status: Some(500),
            reason,
        } => assert!(reason.contains("replayed"), "{reason}"),
        other => panic!("the replayed 500 must be unknown, got {other:?}"),
    }
    let objects = found(p.status(query(&request)).await.unwrap());
    assert_eq!((objects.len(), objects[0].is_live()), (1, true));
    assert_eq!(intents_for(&sim, "inv-500"), 1);
}

/// Search lags writes: until the settle time after the latest attempt has passed, an empty
/// search proves nothing — so no second create may go out on its word.
#[tokio::test]
async fn an_empty_search_within_the_settle_time_is_not_yet_visible_never_absent() {
    let (sim, base) = payments_sim(Duration::from_millis(1_200)).await;
    let p = stripe(&base, true);
    let request = charge("inv-lag", "key-lag");
    next_fault(&base, "drop_after").await;
    assert_eq!(p.call(&request).await.class(), OutcomeClass::Unknown);
    let sent = SystemTime::now();
    let q = StatusQuery {
        request: &request,
        last_sent: Some(sent),
        since: sent - Duration::from_secs(60),
    };
    match p.status(q).await.unwrap() {
        StatusOutcome::NotYetVisible { settles_at } => {
            assert!(settles_at >= sent + Duration::from_secs(2));
        }
        other => panic!("the lagging search must not say {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1_400)).await;
    assert_eq!(found(p.status(q).await.unwrap()).len(), 1);
    assert_eq!(intents_for(&sim, "inv-lag"), 1);
    // A reference never charged is absent once the settle time has passed.
    let never = charge("inv-never", "key-never");
    let old = StatusQuery {
        request: &never,
        last_sent: Some(sent - Duration::from_secs(10)),
        since: sent - Duration::from_secs(60),
    };
    assert_eq!(p.status(old).await.unwrap(), StatusOutcome::Absent);
}

#[tokio::test]
async fn failures_before_the_charge_are_told_apart_from_unknown_outcomes() {
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, false);
    // 429 with Retry-After: nothing happened, retry after the asked wait.
    next_fault(&base, "rate_limit").await;
    let limited = p.call(&charge("inv-429", "key-429")).await;
    assert_eq!(
        (limited.class(), limited.retry_after()),
        (OutcomeClass::Retryable, Some(Duration::from_secs(3)))
    );
    // A 500 before the effect is still unknown to the caller; within the settle window
    // "not found" proves nothing, after it the status says absent.
    let before = charge("inv-before", "key-before");
    next_fault(&base, "error_before").await;
    assert_eq!(p.call(&before).await.class(), OutcomeClass::Unknown);
    assert!(matches!(
        p.status(query(&before)).await.unwrap(),
        StatusOutcome::NotYetVisible { .. }
    ));
    assert_eq!(
        p.status(settled_query(&before)).await.unwrap(),
        StatusOutcome::Absent
    );
    // A declined card is final, with the PaymentIntent it left behind.
    let mut declined = charge("inv-declined", "key-declined");
    declined.params["payment_method"] = json!("pm_card_chargeDeclined");
    match p.call(&declined).await {
        CallOutcome::Failed {
            status: 402,
            code,
            object: Some(pi),
            ..
        } => assert_eq!(
            (code.as_deref(), pi.is_live()),
            (Some("card_declined"), false)
        ),
        other => panic!("a declined card is a final failure, got {other:?}"),
    }
    // Nothing listens: the request never left.
    let closed = stripe("http://127.0.0.1:9", false);
    assert_eq!(
        closed
            .call(&charge("inv-closed", "key-closed"))
            .await
            .class(),
        OutcomeClass::NotSent
    );
    assert_eq!(
        sim.stats().payment_intents,
        1,
        "only the declined intent exists"
    );
}

#[tokio::test]
async fn the_list_pages_newest_first_down_to_the_window() {
    let (_sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, false);
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            succeeded(
                p.call(&charge(&format!("inv-l{i}"), &format!("key-l{i}")))
                    .await,
            )
            .id,
        );
    }
    let since = SystemTime::now() - Duration::from_secs(60);
    let mut listed = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = p.list("charge", since, cursor.as_deref()).await.unwrap();
        assert!(page.objects.len() <= 2, "page_limit 2");
        listed.extend(page.objects.into_iter().map(|o| o.id));
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    ids.reverse();
    assert_eq!(listed, ids);
    // A window that starts in the future holds nothing.
    let future = SystemTime::now() + Duration::from_secs(3_600);
    assert!(p
        .list("charge", future, None)
        .await
        .unwrap()
        .objects
        .is_empty());
}

#[tokio::test]
async fn a_refund_is_made_once_under_its_key_and_found_by_its_payment_intent() {
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let p = stripe(&base, false);
    let pi = succeeded(p.call(&charge("inv-r", "key-r")).await);
    let refund = EffectRequest {
        operation: "refund".into(),
        reference: "inv-r".into(),
        key: "key-r-refund".into(),
        params: json!({"payment_intent": pi.id}),
    };
    next_fault(&base, "drop_after").await;
    assert_eq!(p.call(&refund).await.class(), OutcomeClass::Unknown);
    let refunds = found(p.status(query(&refund)).await.unwrap());
    assert_eq!((refunds.len(), refunds[0].is_live()), (1, true));
    assert_eq!(sim.stats().refunds, 1);
}

async fn shipping() -> (ShippingSim, ShippingClient, String) {
    let sim = ShippingSim::new(oncely_sim::ShippingConfig {
        undeliverable_skus: ["sku-nowhere".to_owned()].into(),
        faults: FaultConfig {
            late_ms: 1_500,
            seed: Some(3),
            ..FaultConfig::default()
        },
        ..oncely_sim::ShippingConfig::default()
    });
    let base = listen(sim.router()).await;
    let client = ShippingClient::new(ShippingConfig {
        base_url: base.clone(),
        timeout: Duration::from_millis(800),
        settle_time: Duration::from_secs(2),
        ..ShippingConfig::default()
    })
    .unwrap();
    (sim, client, base)
}

fn booking(order: &str, sku: &str) -> EffectRequest {
    EffectRequest {
        operation: "book".into(),
        reference: order.into(),
        key: format!("key-{order}"),
        params: json!({"order_id": order, "items": [{"sku": sku, "quantity": 1}]}),
    }
}

/// The shipping provider has no keys: a second POST books a second shipment, so after an
/// unknown outcome the status by `merchant_reference` is the only safe next step.
#[tokio::test]
async fn a_keyless_booking_whose_answer_was_lost_is_found_by_its_merchant_reference() {
    let (sim, client, base) = shipping().await;
    assert!(!client.honours_keys());
    for (order, fault) in [
        ("ord-drop", "drop_after"),
        ("ord-late", "late_after"),
        ("ord-500", "error_after"),
    ] {
        let request = booking(order, "sku-1");
        next_fault(&base, fault).await;
        let outcome = client.call(&request).await;
        assert_eq!(
            outcome.class(),
            OutcomeClass::Unknown,
            "{fault}: {outcome:?}"
        );
        let shipments = found(client.status(query(&request)).await.unwrap());
        assert_eq!(
            (shipments.len(), shipments[0].is_live()),
            (1, true),
            "{fault}"
        );
        assert_eq!(sim.stats().by_merchant_reference[order].total, 1, "{fault}");
    }
    // 503 before the effect: nothing booked, but a 503 after the request left proves
    // nothing (it may be an egress proxy's): unknown. The status says not yet visible
    // within the settle window, absent after it.
    let before = booking("ord-503", "sku-1");
    next_fault(&base, "error_before").await;
    assert_eq!(client.call(&before).await.class(), OutcomeClass::Unknown);
    assert!(matches!(
        client.status(query(&before)).await.unwrap(),
        StatusOutcome::NotYetVisible { .. }
    ));
    assert_eq!(
        client.status(settled_query(&before)).await.unwrap(),
        StatusOutcome::Absent
    );
}

#[tokio::test]
async fn an_undeliverable_booking_is_final_and_a_cancellation_is_found_cancelled() {
    let (sim, client, base) = shipping().await;
    match client.call(&booking("ord-x", "sku-nowhere")).await {
        CallOutcome::Failed {
            status: 422, code, ..
        } => assert_eq!(code.as_deref(), Some("undeliverable")),
        other => panic!("undeliverable is final, got {other:?}"),
    }
    let booked = succeeded(client.call(&booking("ord-c", "sku-1")).await);
    let cancel = EffectRequest {
        operation: "cancel".into(),
        reference: "ord-c".into(),
        key: "key-ord-c-cancel".into(),
        params: json!({"shipment_id": booked.id}),
    };
    next_fault(&base, "drop_after").await;
    assert_eq!(client.call(&cancel).await.class(), OutcomeClass::Unknown);
    let cancelled = found(client.status(query(&cancel)).await.unwrap());
    assert_eq!(cancelled[0].status, "cancelled");
    assert_eq!(sim.stats().cancelled, 1);
    let listed = client
        .list("book", SystemTime::now() - Duration::from_secs(60), None)
        .await
        .unwrap();
    assert_eq!(listed.objects.len(), 1);
}

/// localstripe ignores `Idempotency-Key`: a re-sent key there *does* charge twice. So the
/// adapter's status check — list by reference, localstripe has no search — is what tells
/// the runner the first charge exists.
#[tokio::test]
async fn against_localstripe_the_status_check_finds_the_charge_that_a_resent_key_would_duplicate() {
    let Some(ls) = LocalStripe::start().await else {
        return;
    };
    let p = StripePayments::new(StripeConfig {
        base_url: ls.base_url().to_owned(),
        secret_key: "sk_test_localstripe".to_owned(),
        timeout: Duration::from_secs(5),
        search: false,
        page_limit: 2,
        ..StripeConfig::default()
    })
    .unwrap();
    let request = charge("inv-ls", "key-ls");
    let first = succeeded(p.call(&request).await);
    assert_eq!(first.reference.as_deref(), Some("inv-ls"));
    for i in 0..3 {
        succeeded(
            p.call(&charge(&format!("inv-ls-other{i}"), &format!("k{i}")))
                .await,
        );
    }
    let objects = found(p.status(query(&request)).await.unwrap());
    assert_eq!(
        objects.iter().map(|o| &o.id).collect::<Vec<_>>(),
        [&first.id]
    );
    let never = charge("inv-ls-never", "key-ls-never");
    assert_eq!(
        p.status(settled_query(&never)).await.unwrap(),
        StatusOutcome::Absent
    );
    // The proof that the key alone would not have saved us: localstripe charges again.
    let second = succeeded(p.call(&request).await);
    assert_ne!(second.id, first.id, "localstripe ignores Idempotency-Key");
    assert_eq!(found(p.status(query(&request)).await.unwrap()).len(), 2);
    // Refunds, found by their PaymentIntent.
    let refund = EffectRequest {
        operation: "refund".into(),
        reference: "inv-ls".into(),
        key: "key-ls-refund".into(),
        params: json!({"payment_intent": second.id}),
    };
    assert!(succeeded(p.call(&refund).await).is_live());
    assert_eq!(found(p.status(query(&refund)).await.unwrap()).len(), 1);
}
