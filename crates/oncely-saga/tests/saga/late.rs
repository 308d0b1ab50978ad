//! A step that commits after its timeout: the shipping provider books the shipment at
//! once but answers 2.5 s later (the simulator's `late_after`), past the ship step's
//! 600 ms timeout. The timeout starts compensation (refund, release) while the booking is
//! open; the late success is then compensated too (the shipment cancelled), and only then
//! is the saga `compensated` — nothing both confirmed and compensated.

use std::time::{Duration, Instant};

use oncely_saga::{Phase, SagaState, StepState};
use oncely_testkit::TestDb;

use crate::harness::{log, order, sample, Shape, World};

pub(crate) async fn a_shipment_booked_after_its_timeout_is_cancelled_and_none_stays_live(
    t: TestDb,
) {
    let w = World::new(
        t,
        "late",
        Shape {
            ship_timeout: Duration::from_millis(600),
            ..Shape::default()
        },
        2_500,
    )
    .await;
    w.stock("sku-1", 5).await;
    World::next_fault(&w.shipping_url, "late_after").await;
    w.run_in_background();
    let id = "saga-ord-late";
    w.start(id, &order("ord-late", "sku-1", 2, "pm_card_visa"))
        .await;
    // The timeout fires while the booking's answer is still on its way: the saga
    // compensates, and it is not `compensated` while the booking is open.
    let waited = Instant::now();
    loop {
        let steps = w.steps(id).await;
        if steps
            .iter()
            .any(|s| s.name == "ship" && s.state == StepState::TimedOut)
        {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(20),
            "no timeout: {steps:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(w.saga(id).await.state, SagaState::Compensating);
    assert_eq!(
        w.shipping.stats().booked,
        1,
        "the booking took effect already"
    );
    let saga = w.until(id, SagaState::Compensated, false).await;
    assert!(saga.error.unwrap().contains("ship timed out"));
    let ship = w.shipping.stats();
    assert_eq!(
        (ship.shipments, ship.booked, ship.cancelled),
        (1, 0, 1),
        "exactly zero live shipments at the provider"
    );
    let pay = w.payments.stats();
    assert_eq!(
        (pay.payment_intents, pay.refunds, pay.refunded_amount),
        (1, 1, 1250)
    );
    assert_eq!(w.stock_of("sku-1").await, (5, 0));
    let steps = w.steps(id).await;
    let ship_fwd = steps
        .iter()
        .find(|s| s.name == "ship" && s.phase == Phase::Forward)
        .unwrap();
    assert_eq!(ship_fwd.state, StepState::Succeeded);
    assert!(ship_fwd
        .evidence
        .as_deref()
        .unwrap()
        .contains("after its timeout"));
    let mut rows = log(&steps);
    rows.sort();
    assert_eq!(
        rows,
        [
            ("charge".into(), "compensate", "succeeded"),
            ("charge".into(), "forward", "succeeded"),
            ("reserve".into(), "compensate", "succeeded"),
            ("reserve".into(), "forward", "succeeded"),
            ("ship".into(), "compensate", "succeeded"),
            ("ship".into(), "forward", "succeeded"),
        ]
    );
    let kind = &w.kind;
    assert_eq!(
        sample(&format!(
            "oncely_saga_step_timeouts_total{{kind=\"{kind}\"}}"
        )),
        1
    );
    assert_eq!(
        sample(&format!(
            "oncely_saga_late_commits_total{{kind=\"{kind}\"}}"
        )),
        1
    );
}

oncely_testkit::matrix! {
    tests: [a_shipment_booked_after_its_timeout_is_cancelled_and_none_stays_live],
}
