//! Issue 26 at the effect runner, on every backend: whatever a provider answers, an effect
//! whose object exists is never `failed` and never sent twice.
//!
//! - a charge committed and then answered with 503, 507, 520, 524 or 409 is unknown, found
//!   by the status check and settled `succeeded` (scenario 3);
//! - a shipment found live in a carrier's word settles `succeeded`; one in a word nobody
//!   listed parks in `needs_review`; a PaymentIntent found `processing` stays unknown
//!   (scenario 2);
//! - a booking that a keyless provider commits after the caller gave up is found, not booked
//!   again (scenario 5).

use std::sync::Arc;
use std::time::Duration;

use oncely_effects::{
    EffectRunner, NoHandler, Provider, RunnerConfig, ShippingClient, ShippingConfig, StripeConfig,
    StripePayments,
};
use oncely_sim::{FaultConfig, ShippingSim};
use oncely_sql::{EffectState, EffectStore};
use oncely_testkit::TestDb;
use serde_json::{json, Value};

use super::{enqueue_effect as enqueue, listen, next_fault, payments_sim, settle, SK};

fn runner(
    db: &oncely_sql::Database,
    provider: Arc<dyn Provider>,
    max_checks: u32,
) -> Arc<EffectRunner> {
    Arc::new(EffectRunner::new(
        EffectStore::new(db.clone()),
        vec![provider],
        Arc::new(NoHandler),
        RunnerConfig {
            lease: Duration::from_secs(5),
            poll: Duration::from_millis(50),
            check_delay: Duration::from_millis(100),
            max_checks,
            ..RunnerConfig::default()
        },
    ))
}

fn stripe(base: &str) -> Arc<dyn Provider> {
    Arc::new(
        StripePayments::new(StripeConfig {
            base_url: base.to_owned(),
            secret_key: SK.into(),
            timeout: Duration::from_millis(800),
            search: false,
            settle_time: Duration::from_secs(1),
            ..StripeConfig::default()
        })
        .unwrap(),
    )
}

async fn shipping_sim(live_status: Option<&str>, faults: FaultConfig) -> (ShippingSim, String) {
    let sim = ShippingSim::new(oncely_sim::ShippingConfig {
        live_status: live_status.map(str::to_owned),
        faults,
        ..oncely_sim::ShippingConfig::default()
    });
    let base = listen(sim.router()).await;
    (sim, base)
}

fn shipping(base: &str, timeout: Duration, settle: Duration) -> Arc<dyn Provider> {
    Arc::new(
        ShippingClient::new(ShippingConfig {
            base_url: base.to_owned(),
            timeout,
            settle_time: settle,
            ..ShippingConfig::default()
        })
        .unwrap(),
    )
}

fn book(order: &str) -> Value {
    json!({"order_id": order, "items": [{"sku": "sku-1", "quantity": 1}]})
}

async fn charge_answered_after_commit_with_any_5xx_or_409_settles_succeeded_once(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let store = EffectStore::new(t.db.clone());
    let runner = runner(&t.db, stripe(&base), 20);
    for status in [503_u16, 507, 520, 524, 409, 418] {
        super::set_faults(&base, json!({ "error_after_status": status })).await;
        next_fault(&base, "error_after").await;
        let invoice = format!("inv-{status}");
        let request = json!({"amount": 700, "currency": "eur"});
        let id = enqueue(&t.db, ("payments", "charge"), &invoice, &request).await;
        let effect = settle(&runner, &store, &id).await;
        assert_eq!(
            effect.state().unwrap(),
            EffectState::Succeeded,
            "a charge committed and answered {status} is live: {effect:?}"
        );
        assert_eq!(super::intents_for(&sim, &invoice), 1, "after a {status}");
    }
}

async fn a_shipment_found_live_in_a_carrier_word_is_never_failed(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    // The booking's answer is lost; the status check finds it `label_created`.
    let (sim, base) = shipping_sim(Some("label_created"), FaultConfig::default()).await;
    let runner = runner(
        &t.db,
        shipping(&base, Duration::from_secs(2), Duration::from_secs(1)),
        20,
    );
    next_fault(&base, "drop_after").await;
    let id = enqueue(&t.db, ("shipping", "book"), "order-lc", &book("order-lc")).await;
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(
        effect.state().unwrap(),
        EffectState::Succeeded,
        "{effect:?}"
    );
    assert_eq!(sim.stats().by_merchant_reference["order-lc"].total, 1);

    // A word nobody listed: parked for a person with the object, never failed, never resent.
    let (sim, base) = shipping_sim(Some("awaiting_pickup_v2"), FaultConfig::default()).await;
    let runner = self::runner(
        &t.db,
        shipping(&base, Duration::from_secs(2), Duration::from_secs(1)),
        20,
    );
    next_fault(&base, "drop_after").await;
    let id = enqueue(&t.db, ("shipping", "book"), "order-odd", &book("order-odd")).await;
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(
        effect.state().unwrap(),
        EffectState::NeedsReview,
        "{effect:?}"
    );
    assert!(
        effect
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("awaiting_pickup_v2")),
        "{effect:?}"
    );
    assert_eq!(sim.stats().by_merchant_reference["order-odd"].total, 1);
}

async fn a_payment_intent_found_processing_stays_unknown_and_is_never_failed(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let store = EffectStore::new(t.db.clone());
    // Three checks, each finding it `processing`: then a person decides.
    let runner = runner(&t.db, stripe(&base), 3);
    let request = json!({"amount": 700, "currency": "eur", "payment_method": "pm_card_processing"});
    let id = enqueue(&t.db, ("payments", "charge"), "inv-processing", &request).await;
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(
        effect.state().unwrap(),
        EffectState::NeedsReview,
        "{effect:?}"
    );
    assert_eq!(super::intents_for(&sim, "inv-processing"), 1);
    let evidence = store.evidence(&id).await.unwrap();
    assert!(
        evidence.iter().filter(|e| e.kind == "status").count() >= 3,
        "{evidence:?}"
    );
    assert_eq!(evidence.iter().filter(|e| e.kind == "call").count(), 1);
}

async fn a_booking_a_keyless_provider_commits_after_the_caller_gave_up_is_not_booked_again(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    // The provider holds the first booking 1.5 s, then books it; the caller gives up after
    // 0.5 s. Its settle window (3 s) keeps "not found" from meaning absent meanwhile.
    let (sim, base) = shipping_sim(
        None,
        FaultConfig {
            latency_ms: 1_500,
            ..FaultConfig::default()
        },
    )
    .await;
    let store = EffectStore::new(t.db.clone());
    let runner = runner(
        &t.db,
        shipping(&base, Duration::from_millis(500), Duration::from_secs(3)),
        50,
    );
    next_fault(&base, "latency").await;
    let id = enqueue(
        &t.db,
        ("shipping", "book"),
        "order-slow",
        &book("order-slow"),
    )
    .await;
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(
        effect.state().unwrap(),
        EffectState::Succeeded,
        "{effect:?}"
    );
    // Counted once the slow booking has surely committed (1.5 s after its send): a second
    // booking sent within the window would show here as a second shipment.
    let committed = effect.created_at + 2_000 - oncely_core::now_ms();
    if committed > 0 {
        tokio::time::sleep(Duration::from_millis(committed.unsigned_abs())).await;
    }
    assert_eq!(
        sim.stats().by_merchant_reference["order-slow"].total,
        1,
        "one shipment: the slow booking was found, not booked again"
    );
    let evidence = store.evidence(&id).await.unwrap();
    assert_eq!(
        evidence.iter().filter(|e| e.kind == "call").count(),
        1,
        "{evidence:?}"
    );
}

/// Two live charges of one order made under different references (the payments endpoint's
/// `order:{id}:payment` and a saga's `{saga}:charge`, each with its own key): reconciliation
/// names them one `duplicate_remote` by the order they carry (scenario 1).
async fn two_live_charges_of_one_order_under_different_references_are_a_duplicate(t: TestDb) {
    t.db.migrate().await.unwrap();
    let (_sim, base) = payments_sim(Duration::ZERO).await;
    let provider = stripe(&base);
    for reference in ["order:ord-2x:payment", "saga-2x:charge"] {
        let request = oncely_effects::EffectRequest {
            operation: "charge".into(),
            reference: reference.into(),
            key: format!("key-{reference}"),
            params: json!({"amount": 700, "currency": "eur", "metadata": {"order_id": "ord-2x"}}),
        };
        super::succeeded(provider.call(&request).await);
    }
    let reconciler = oncely_effects::Reconciler::new(
        provider,
        EffectStore::new(t.db.clone()),
        Arc::new(NoHandler),
        oncely_effects::ReconcileConfig::new("charge"),
    );
    let report = reconciler
        .run(std::time::SystemTime::now() - Duration::from_secs(600))
        .await
        .unwrap();
    let duplicates: Vec<_> = report
        .discrepancies
        .iter()
        .filter(|d| d.kind().unwrap() == oncely_sql::DiscrepancyKind::DuplicateRemote)
        .collect();
    assert_eq!(duplicates.len(), 1, "{:?}", report.discrepancies);
    assert_eq!(duplicates[0].reference, "/metadata/order_id=ord-2x");
    assert_eq!(duplicates[0].provider_ids.matches("pi_").count(), 2);
}

oncely_testkit::matrix! {
    tests: [
        two_live_charges_of_one_order_under_different_references_are_a_duplicate,
        charge_answered_after_commit_with_any_5xx_or_409_settles_succeeded_once,
        a_shipment_found_live_in_a_carrier_word_is_never_failed,
        a_payment_intent_found_processing_stays_unknown_and_is_never_failed,
        a_booking_a_keyless_provider_commits_after_the_caller_gave_up_is_not_booked_again,
    ],
    cannot_apply: [],
}
