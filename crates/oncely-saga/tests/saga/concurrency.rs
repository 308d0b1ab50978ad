//! Two orchestrators complete one step at the same moment: the continuation — here a
//! local `record` step that writes a ledger row under no unique key, then the shipment's
//! intent — runs once.

use std::sync::Arc;

use oncely_effects::{CallOutcome, EffectHandler, EffectRequest, Provider, RemoteObject, Settled};
use oncely_saga::{Orchestrator, OrchestratorConfig, SagaState};
use oncely_sql::{query, Database, Effect, EffectStore};
use oncely_testkit::TestDb;
use tokio::sync::Barrier;

use crate::harness::{definition, log, order, Shape, World};

/// Per saga: the charge made for real at the payments simulator, then its settlement
/// handed to two orchestrators (one definition, one store) in two tasks, each in its own
/// transaction, released together. One ledger row, one shipping intent, and the saga then
/// completes with one shipment.
pub(crate) async fn two_concurrent_completions_of_one_step_run_the_continuation_once(t: TestDb) {
    let w = World::new(
        t,
        "concurrent",
        Shape {
            ledger: true,
            ..Shape::default()
        },
        5_000,
    )
    .await;
    w.stock("sku-1", 50).await;
    let second = Arc::new(
        Orchestrator::new(
            w.db.clone(),
            vec![definition(
                &w.kind,
                Shape {
                    ledger: true,
                    ..Shape::default()
                },
            )],
            OrchestratorConfig::default(),
        )
        .unwrap(),
    );
    let effects = EffectStore::new(w.db.clone());
    for n in 0..3 {
        let id = format!("saga-conc-{n}");
        w.start(
            &id,
            &order(&format!("ord-c{n}"), "sku-1", 1, "pm_card_visa"),
        )
        .await;
        let (effect, object) = charge_for_real(&w, &effects, &id).await;
        complete_twice(
            [w.orchestrator.clone(), second.clone()],
            &w.db,
            &effect,
            &object,
        )
        .await;
        let (rows,): (i64,) =
            w.db.fetch_optional(
                query("SELECT COUNT(*) FROM ledger WHERE saga_id = $1").bind(id.as_str()),
            )
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rows, 1, "the continuation ran once for {id}");
        let saga = w.saga(&id).await;
        assert_eq!(
            (saga.state, saga.step),
            (SagaState::Running, 3),
            "waiting for ship"
        );
        assert!(effects
            .find("shipping", "book", &format!("{id}:ship"))
            .await
            .unwrap()
            .is_some());
        assert_eq!(
            log(&w.steps(&id).await),
            [
                ("reserve".into(), "forward", "succeeded"),
                ("charge".into(), "forward", "succeeded"),
                ("record".into(), "forward", "succeeded"),
                ("ship".into(), "forward", "running"),
            ]
        );
    }
    // The charges' own effects are still pending (settled by hand above): the runner sends
    // them again under their keys — the provider replays the same PaymentIntent — and
    // their settle is one more completion of the step, which continues nothing; then it
    // books the three shipments.
    for n in 0..3 {
        w.until(&format!("saga-conc-{n}"), SagaState::Completed, true)
            .await;
    }
    assert_eq!(
        (
            w.shipping.stats().shipments,
            w.payments.stats().payment_intents
        ),
        (3, 3)
    );
}

/// The saga's charge intent, and the provider's answer to it (a real call).
async fn charge_for_real(w: &World, effects: &EffectStore, id: &str) -> (Effect, RemoteObject) {
    let effect = effects
        .find("payments", "charge", &format!("{id}:charge"))
        .await
        .unwrap()
        .expect("the charge's intent");
    let request = EffectRequest {
        operation: effect.operation.clone(),
        reference: effect.reference.clone(),
        key: effect.key.clone(),
        params: effect.params().unwrap(),
    };
    let CallOutcome::Succeeded(object) = w.stripe.call(&request).await else {
        panic!("the charge succeeds");
    };
    (effect, object)
}

/// Hands `effect`'s success to both handlers at once, each in its own transaction.
async fn complete_twice(
    handlers: [Arc<dyn EffectHandler>; 2],
    db: &Database,
    effect: &Effect,
    object: &RemoteObject,
) {
    let barrier = Arc::new(Barrier::new(2));
    let tasks: Vec<_> = handlers
        .into_iter()
        .map(|handler| {
            let (db, effect, object, barrier) =
                (db.clone(), effect.clone(), object.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut tx = db.begin().await.unwrap();
                handler
                    .settled(&mut tx, &effect, Settled::Succeeded(&object))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

oncely_testkit::matrix! {
    tests: [two_concurrent_completions_of_one_step_run_the_continuation_once],
}
