//! The three-step order saga — reserve (local) → charge (payments) → ship (shipping, the
//! pivot) — fulfilled, and compensated when the card is declined or the shipment refused.

use oncely_core::{IdempotencyKey, Operation, Scope, TenantId};
use oncely_saga::{SagaState, Started};
use oncely_sql::EffectStore;
use oncely_testkit::TestDb;

use crate::harness::{log, order, sample, Shape, World, TENANT, UNDELIVERABLE};

fn key(kind: &str, saga: &str, step: &str) -> String {
    let scope = Scope::new(
        TenantId::parse(TENANT).unwrap(),
        Operation::new("SAGA", kind),
    );
    oncely_effects::derive_key(
        &scope,
        &IdempotencyKey::parse(saga.as_bytes()).unwrap(),
        step,
        0,
    )
}

/// Every step once, at the provider and in the database: one PaymentIntent, one
/// shipment, the stock reserved; the effects carry the keys derived from the saga id and
/// step; another tenant sees nothing of the saga.
pub(crate) async fn a_fulfilled_order_reserves_charges_and_ships_once(t: TestDb) {
    let w = World::new(t, "fulfilled", Shape::default(), 5_000).await;
    w.stock("sku-1", 5).await;
    let id = "saga-ord-1";
    let started = w
        .start(id, &order("ord-1", "sku-1", 2, "pm_card_visa"))
        .await;
    assert_eq!(started, Started::Created(SagaState::Running));
    assert_eq!(
        w.start(id, &order("ord-1", "sku-1", 2, "pm_card_visa"))
            .await,
        Started::Existing,
        "a redelivered start records nothing"
    );
    let saga = w.until(id, SagaState::Completed, true).await;
    assert_eq!(saga.step, 3);
    assert_eq!(w.stock_of("sku-1").await, (3, 2));
    let pay = w.payments.stats();
    assert_eq!(
        (
            pay.payment_intents,
            pay.payment_intents_by_status.get("succeeded").copied(),
            pay.refunds
        ),
        (1, Some(1), 0)
    );
    let ship = w.shipping.stats();
    assert_eq!((ship.shipments, ship.booked), (1, 1));
    let steps = w.steps(id).await;
    assert_eq!(
        log(&steps),
        [
            ("reserve".into(), "forward", "succeeded"),
            ("charge".into(), "forward", "succeeded"),
            ("ship".into(), "forward", "succeeded"),
        ]
    );
    assert!(steps[1].output.as_ref().unwrap()["id"]
        .as_str()
        .unwrap()
        .starts_with("pi_"));
    let effects = EffectStore::new(w.db.clone());
    for (provider, operation, step) in [
        ("payments", "charge", "charge"),
        ("shipping", "book", "ship"),
    ] {
        let reference = format!("{id}:{step}");
        let effect = effects
            .find(provider, operation, &reference)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            effect.key,
            key(&w.kind, id, step),
            "{step}'s key is derived"
        );
        assert_eq!(effect.tenant, TENANT);
    }
    assert!(w.orchestrator.get("tenant-b", id).await.unwrap().is_none());
    assert!(w
        .orchestrator
        .steps("tenant-b", id)
        .await
        .unwrap()
        .is_empty());
    assert!(w
        .orchestrator
        .list("tenant-b", None, 10)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        w.orchestrator
            .list(TENANT, Some(SagaState::Completed), 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

/// A declined card fails the charge: the reservation is released, nothing is refunded
/// (nothing was charged) and nothing ships.
pub(crate) async fn a_declined_card_releases_the_reservation_and_ships_nothing(t: TestDb) {
    let w = World::new(t, "declined", Shape::default(), 5_000).await;
    w.stock("sku-1", 5).await;
    let id = "saga-ord-declined";
    w.start(id, &order("ord-2", "sku-1", 2, "pm_card_chargeDeclined"))
        .await;
    let saga = w.until(id, SagaState::Compensated, true).await;
    assert!(saga.error.unwrap().contains("charge failed"));
    assert_eq!(w.stock_of("sku-1").await, (5, 0));
    let pay = w.payments.stats();
    assert_eq!(
        (
            pay.payment_intents_by_status.get("succeeded").copied(),
            pay.refunds
        ),
        (None, 0)
    );
    assert_eq!(w.shipping.stats().shipments, 0);
    assert_eq!(
        log(&w.steps(id).await),
        [
            ("reserve".into(), "forward", "succeeded"),
            ("charge".into(), "forward", "failed"),
            ("reserve".into(), "compensate", "succeeded"),
        ]
    );
}

/// The shipping provider refuses the shipment (422): the charge is refunded once at the
/// provider — its first refund answered 500 after it took effect, so the runner resolved
/// it by status instead of refunding twice — and the reservation released. The counters
/// record one compensation started and completed.
pub(crate) async fn a_refused_shipment_refunds_the_charge_once_and_releases_the_stock(t: TestDb) {
    let w = World::new(t, "refused", Shape::default(), 5_000).await;
    w.stock(UNDELIVERABLE, 5).await;
    let id = "saga-ord-refused";
    w.start(id, &order("ord-3", UNDELIVERABLE, 1, "pm_card_visa"))
        .await;
    // The charge: the runner's first round.
    w.runner.run_once().await.unwrap();
    assert_eq!(w.payments.stats().payment_intents, 1);
    World::next_fault(&w.payments_url, "error_after").await;
    let saga = w.until(id, SagaState::Compensated, true).await;
    assert!(
        saga.error.unwrap().contains("ship failed"),
        "the pivot's refusal is why"
    );
    let pay = w.payments.stats();
    let intent = w.steps(id).await[1].output.as_ref().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        (pay.refunds, pay.refunded_amount),
        (1, 1250),
        "refunded once, in full"
    );
    assert_eq!(pay.refunds_by_payment_intent.get(&intent), Some(&1));
    assert_eq!(
        pay.faults_injected.values().sum::<u64>(),
        1,
        "the refund's 500 fired"
    );
    let ship = w.shipping.stats();
    assert_eq!((ship.shipments, ship.refused), (0, 1));
    assert_eq!(w.stock_of(UNDELIVERABLE).await, (5, 0));
    assert_eq!(
        log(&w.steps(id).await),
        [
            ("reserve".into(), "forward", "succeeded"),
            ("charge".into(), "forward", "succeeded"),
            ("ship".into(), "forward", "failed"),
            ("charge".into(), "compensate", "succeeded"),
            ("reserve".into(), "compensate", "succeeded"),
        ]
    );
    let kind = &w.kind;
    assert_eq!(
        sample(&format!(
            "oncely_saga_compensations_started_total{{kind=\"{kind}\"}}"
        )),
        1
    );
    assert_eq!(
        sample(&format!(
            "oncely_saga_compensations_completed_total{{kind=\"{kind}\"}}"
        )),
        1
    );
    w.orchestrator.record_gauges().await.unwrap();
    assert_eq!(
        sample(&format!(
            "oncely_sagas{{kind=\"{kind}\",state=\"compensated\"}}"
        )),
        1
    );
    assert_eq!(
        sample(&format!(
            "oncely_saga_steps_needs_review{{kind=\"{kind}\"}}"
        )),
        0
    );
}

/// After the pivot the saga only goes forward: a retriable step refused for good is issued
/// again under its attempt's key, then parked for review with its evidence — and nothing
/// before it is compensated (the shipment stays booked, the charge stays).
pub(crate) async fn a_retriable_step_after_the_pivot_is_retried_then_parked_without_compensating(
    t: TestDb,
) {
    let shape = Shape {
        gift: Some(UNDELIVERABLE),
        ..Shape::default()
    };
    let w = World::new(t, "retriable", shape, 5_000).await;
    w.stock("sku-1", 5).await;
    let id = "saga-ord-gift";
    w.start(id, &order("ord-4", "sku-1", 2, "pm_card_visa"))
        .await;
    let saga = w.until(id, SagaState::NeedsReview, true).await;
    assert!(saga.error.unwrap().contains("gift failed 2 times"));
    let steps = w.steps(id).await;
    assert_eq!(
        log(&steps),
        [
            ("reserve".into(), "forward", "succeeded"),
            ("charge".into(), "forward", "succeeded"),
            ("ship".into(), "forward", "succeeded"),
            ("gift".into(), "forward", "needs_review"),
        ]
    );
    assert_eq!(steps[3].attempts, 2);
    let evidence = steps[3].evidence.as_deref().unwrap();
    assert!(evidence.contains("cannot be shipped"), "{evidence}");
    let ship = w.shipping.stats();
    assert_eq!(
        (ship.booked, ship.refused),
        (1, 2),
        "the pivot's shipment stays"
    );
    assert_eq!(w.payments.stats().refunds, 0);
    assert_eq!(w.stock_of("sku-1").await, (3, 2));
    let effects = EffectStore::new(w.db.clone());
    for (reference, generation) in [(format!("{id}:gift"), 0), (format!("{id}:gift#2"), 1)] {
        let effect = effects
            .find("shipping", "book", &reference)
            .await
            .unwrap()
            .unwrap();
        let scope = Scope::new(
            TenantId::parse(TENANT).unwrap(),
            Operation::new("SAGA", &w.kind),
        );
        let parent = IdempotencyKey::parse(id.as_bytes()).unwrap();
        assert_eq!(
            effect.key,
            oncely_effects::derive_key(&scope, &parent, "gift", generation)
        );
    }
    w.orchestrator.record_gauges().await.unwrap();
    let kind = &w.kind;
    assert_eq!(
        sample(&format!(
            "oncely_saga_steps_needs_review{{kind=\"{kind}\"}}"
        )),
        1
    );
    assert_eq!(
        sample(&format!(
            "oncely_sagas{{kind=\"{kind}\",state=\"needs_review\"}}"
        )),
        1
    );
}

/// The first step, local, refuses (not enough stock): the saga ends `compensated` in the
/// start's own transaction, and no provider is called.
pub(crate) async fn an_order_out_of_stock_ends_compensated_at_start_and_calls_no_provider(
    t: TestDb,
) {
    let w = World::new(t, "nostock", Shape::default(), 5_000).await;
    w.stock("sku-1", 1).await;
    let id = "saga-ord-nostock";
    let started = w
        .start(id, &order("ord-5", "sku-1", 2, "pm_card_visa"))
        .await;
    assert_eq!(started, Started::Created(SagaState::Compensated));
    assert_eq!(
        w.runner.run_once().await.unwrap(),
        0,
        "no effect was recorded"
    );
    assert_eq!(w.payments.stats().payment_intents, 0);
    assert_eq!(w.stock_of("sku-1").await, (1, 0));
    let saga = w.saga(id).await;
    assert!(saga.error.unwrap().contains("not enough stock"));
    assert_eq!(
        log(&w.steps(id).await),
        [("reserve".into(), "forward", "failed")]
    );
}

oncely_testkit::matrix! {
    tests: [
        a_fulfilled_order_reserves_charges_and_ships_once,
        a_declined_card_releases_the_reservation_and_ships_nothing,
        a_refused_shipment_refunds_the_charge_once_and_releases_the_stock,
        a_retriable_step_after_the_pivot_is_retried_then_parked_without_compensating,
        an_order_out_of_stock_ends_compensated_at_start_and_calls_no_provider,
    ],
}
