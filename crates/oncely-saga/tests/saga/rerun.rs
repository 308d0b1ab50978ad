//! An operator's retry of a parked local step from outside the service
//! (`SagaOperator::retry`, as `oncely saga retry` makes it): recorded, not run; the
//! service's orchestrator runs the step in its sweep (`Orchestrator::rerun_due`), once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use oncely_core::RetryPolicy;
use oncely_saga::{
    NewSaga, Orchestrator, OrchestratorConfig, SagaDefinition, SagaOperator, SagaState, Step,
    StepError,
};
use oncely_testkit::TestDb;
use serde_json::{json, Value};

const KIND: &str = "rerun";

/// ship (local pivot) → note (local, retriable, one attempt): refused while `refuse` is set;
/// each run of `note` counted in `runs`.
fn definition(refuse: Arc<AtomicBool>, runs: Arc<AtomicUsize>) -> SagaDefinition {
    SagaDefinition::builder(KIND)
        .pivot(Step::local("ship", |_tx, _ctx| {
            Box::pin(async { Ok(Value::Null) })
        }))
        .retriable(
            Step::local("note", move |_tx, _ctx| {
                runs.fetch_add(1, Ordering::SeqCst);
                let refused = refuse.load(Ordering::SeqCst);
                Box::pin(async move {
                    if refused {
                        Err(StepError::Refused("not yet".to_owned()))
                    } else {
                        Ok(json!({"noted": true}))
                    }
                })
            })
            .retry(RetryPolicy {
                max_attempts: 1,
                ..RetryPolicy::default()
            }),
        )
        .build()
        .unwrap()
}

/// The local step refused and parked; the operator view records the retry (the saga stays
/// in review, nothing runs); two orchestrators sweep at once: the step runs once and the
/// saga completes; the request is gone.
pub(crate) async fn a_local_step_retried_from_outside_the_service_is_run_once_by_its_orchestrator(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let refuse = Arc::new(AtomicBool::new(true));
    let runs = Arc::new(AtomicUsize::new(0));
    let orchestrator = |refuse: &Arc<AtomicBool>| {
        Orchestrator::new(
            t.db.clone(),
            vec![definition(refuse.clone(), runs.clone())],
            OrchestratorConfig::default(),
        )
        .unwrap()
    };
    let (first, second) = (orchestrator(&refuse), orchestrator(&refuse));
    let mut tx = t.db.begin().await.unwrap();
    let input = json!({});
    let new = NewSaga {
        id: "saga-rerun",
        tenant: "acme",
        kind: KIND,
        input: &input,
    };
    first.start(&mut tx, &new).await.unwrap();
    tx.commit().await.unwrap();
    let sagas = SagaOperator::new(t.db.clone());
    let state = |s: Option<oncely_saga::Saga>| s.expect("the saga").state;
    assert_eq!(
        state(sagas.get("saga-rerun").await.unwrap()),
        SagaState::NeedsReview
    );
    // The operator's reads across tenants (the console's overview, review and lineage).
    assert_eq!(
        sagas.state_counts().await.unwrap(),
        vec![("needs_review".to_owned(), 1)]
    );
    let in_review = sagas.steps_in_review(10).await.unwrap();
    assert_eq!(
        i64::try_from(in_review.len()).unwrap(),
        sagas.steps_in_review_count().await.unwrap()
    );
    assert!(in_review
        .iter()
        .all(|s| s.tenant == "acme" && s.kind == KIND));
    assert_eq!(sagas.input_containing("{").await.unwrap().len(), 1);
    assert!(sagas.input_containing("order-x").await.unwrap().is_empty());
    refuse.store(false, Ordering::SeqCst);
    let retried = sagas.retry("saga-rerun", "ops@acme").await.unwrap();
    assert_eq!(retried.step, "note");
    assert_eq!(
        retried.saga.state,
        SagaState::NeedsReview,
        "recorded, not run"
    );
    assert!(
        retried.detail.contains("orchestrator"),
        "{}",
        retried.detail
    );
    let (a, b) = tokio::join!(first.rerun_due(), second.rerun_due());
    assert_eq!(a.unwrap() + b.unwrap(), 1, "one orchestrator ran the step");
    assert_eq!(
        state(sagas.get("saga-rerun").await.unwrap()),
        SagaState::Completed
    );
    assert_eq!(first.rerun_due().await.unwrap(), 0, "the request is gone");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "note ran twice: refused, then once on the request"
    );
    let audit = sagas.audit("saga-rerun").await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(
        (audit[0].actor.as_str(), audit[0].step.as_str()),
        ("ops@acme", "note")
    );
}

/// A request recorded from outside the service is spent when the step is retried inside it
/// (the console's `Orchestrator::retry`): left standing, it would run whatever step the saga
/// parked at next. And a service whose orchestrator defines another kind leaves the request
/// to the service that defines it.
pub(crate) async fn a_retry_in_the_service_spends_a_request_recorded_from_outside(t: TestDb) {
    t.db.migrate().await.unwrap();
    let refuse = Arc::new(AtomicBool::new(true));
    let runs = Arc::new(AtomicUsize::new(0));
    let service = Orchestrator::new(
        t.db.clone(),
        vec![definition(refuse.clone(), runs.clone())],
        OrchestratorConfig::default(),
    )
    .unwrap();
    let other_kind = SagaDefinition::builder("other")
        .pivot(Step::local("only", |_tx, _ctx| {
            Box::pin(async { Ok(Value::Null) })
        }))
        .build()
        .unwrap();
    let other = Orchestrator::new(
        t.db.clone(),
        vec![other_kind],
        OrchestratorConfig::default(),
    )
    .unwrap();
    let mut tx = t.db.begin().await.unwrap();
    let input = json!({});
    let new = NewSaga {
        id: "saga-spent",
        tenant: "acme",
        kind: KIND,
        input: &input,
    };
    service.start(&mut tx, &new).await.unwrap();
    tx.commit().await.unwrap();
    let sagas = SagaOperator::new(t.db.clone());
    sagas.retry("saga-spent", "ops@acme").await.unwrap();
    let requested = || async {
        let (at,): (Option<i64>,) =
            t.db.fetch_optional(
                oncely_sql::query("SELECT rerun_at FROM oncely_sagas WHERE id = $1")
                    .bind("saga-spent"),
            )
            .await
            .unwrap()
            .unwrap();
        at.is_some()
    };
    assert!(requested().await, "recorded for the service");
    assert_eq!(other.rerun_due().await.unwrap(), 0);
    assert!(requested().await, "another kind's orchestrator leaves it");
    refuse.store(false, Ordering::SeqCst);
    let done = service.retry("saga-spent", "console@acme").await.unwrap();
    assert_eq!(done.saga.state, SagaState::Completed);
    assert!(
        !requested().await,
        "the retry in the service spent the request"
    );
    assert_eq!(service.rerun_due().await.unwrap(), 0);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "refused once, run once");
}

oncely_testkit::matrix! {
    tests: [
        a_local_step_retried_from_outside_the_service_is_run_once_by_its_orchestrator,
        a_retry_in_the_service_spends_a_request_recorded_from_outside,
    ],
}
