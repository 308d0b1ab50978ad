//! The regressions: each violation class the driver met, as its one schedule.

use oncely_testkit::{Answer, BodyFault, HttpFault as Fault, Schedule, TestDb};

use super::run::run_plans;
use super::{backend_name, FlowKind, Kind, Plan};

/// A regression: one order under `plan`, as the driver runs it.
async fn regression(t: TestDb, flow: FlowKind, kind: Kind, name: &str, plan: Plan) {
    let test = format!("fault_space::{}::{name}", backend_name(&t.db));
    println!("{test}: flow {}, provider {}", flow.name(), kind.name());
    run_plans(t, flow, kind, vec![plan], &test).await;
}

fn after(status: u16, body: BodyFault) -> Fault {
    Fault::After(Answer::Status { status, body })
}

fn payments_faults(effects: Vec<Fault>, lookups: Vec<Fault>) -> Plan {
    Plan {
        seed: 1,
        payments: Schedule {
            effects,
            lookups,
            lag_ms: 0,
        },
        ..Plan::default()
    }
}

fn shipping_faults(effects: Vec<Fault>, lag_ms: u64) -> Plan {
    Plan {
        seed: 1,
        shipping: Schedule {
            effects,
            lookups: Vec::new(),
            lag_ms,
        },
        ..Plan::default()
    }
}

/// The charge committed, its answer a 200 without a body: the client must not be told
/// `payment-declined` (found by the driver, seed 26: answered 402 with the charge live).
pub(super) async fn payments_endpoint_a_charge_answered_200_with_an_empty_body_is_not_told_declined(
    t: TestDb,
) {
    let plan = payments_faults(vec![after(200, BodyFault::Empty)], vec![]);
    let name = "payments_endpoint_a_charge_answered_200_with_an_empty_body_is_not_told_declined";
    regression(t, FlowKind::Endpoint, Kind::Keyed, name, plan).await;
}

/// The charge committed, then a 422 without a Stripe error object (a middlebox's answer):
/// not a decline (seed 5: answered 402 with the charge live).
pub(super) async fn payments_endpoint_a_charge_answered_422_after_its_commit_is_not_told_declined(
    t: TestDb,
) {
    let plan = payments_faults(vec![after(422, BodyFault::Empty)], vec![]);
    let name = "payments_endpoint_a_charge_answered_422_after_its_commit_is_not_told_declined";
    regression(t, FlowKind::Endpoint, Kind::Keyed, name, plan).await;
}

/// The charge committed behind a 503; the status check finds it as `requires_action` (a
/// word the client does not take as final): not `failed` (seed 7019: failed, "found pi_…
/// requires_action", the charge live; also `in_transit`, `processing`, `on_hold`).
pub(super) async fn a_charge_found_in_a_status_word_the_client_does_not_know_is_not_failed(
    t: TestDb,
) {
    let plan = payments_faults(
        vec![after(503, BodyFault::Garbled)],
        vec![Fault::StatusWord("requires_action".into())],
    );
    let name = "a_charge_found_in_a_status_word_the_client_does_not_know_is_not_failed";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}

/// The charge committed, then a 400 with no body: not a refusal (seed 1006: the effect
/// `failed`, "failed: no message", the charge live).
pub(super) async fn a_charge_answered_400_without_a_stripe_error_after_its_commit_is_not_failed(
    t: TestDb,
) {
    let plan = payments_faults(vec![after(400, BodyFault::Empty)], vec![]);
    let name = "a_charge_answered_400_without_a_stripe_error_after_its_commit_is_not_failed";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}

/// The charge committed, its 2xx answer garbled: unknown, not `failed` (seed 1009: failed,
/// "the PaymentIntent is ", the charge live).
pub(super) async fn a_charge_answered_2xx_with_a_garbled_body_is_not_failed(t: TestDb) {
    let plan = payments_faults(vec![after(200, BodyFault::Garbled)], vec![]);
    let name = "a_charge_answered_2xx_with_a_garbled_body_is_not_failed";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}

/// The keyless shipping provider booked, then answered 429: the booking must be looked up
/// before it is sent again (seed 1003: two live shipments).
pub(super) async fn a_booking_answered_429_after_it_was_made_is_not_booked_twice(t: TestDb) {
    let plan = shipping_faults(vec![after(429, BodyFault::Empty)], 0);
    let name = "a_booking_answered_429_after_it_was_made_is_not_booked_twice";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}

/// The shipping provider booked, then answered 404 with the booking's body: not `failed`
/// (seed 1013: failed, the shipment live).
pub(super) async fn a_booking_answered_404_after_it_was_made_is_not_failed(t: TestDb) {
    let plan = shipping_faults(vec![after(404, BodyFault::Upstream)], 0);
    let name = "a_booking_answered_404_after_it_was_made_is_not_failed";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}

/// A provider that ignores keys made the charge, then answered 429: the charge must be
/// looked up before it is sent again (seed 7018: two live PaymentIntents).
pub(super) async fn a_charge_answered_429_after_its_commit_by_a_keyless_provider_is_not_made_twice(
    t: TestDb,
) {
    let plan = payments_faults(vec![after(429, BodyFault::Empty)], vec![]);
    let name = "a_charge_answered_429_after_its_commit_by_a_keyless_provider_is_not_made_twice";
    regression(t, FlowKind::Choreography, Kind::Keyless, name, plan).await;
}

/// The shipping provider booked and the connection was reset; its lookup lags (the new
/// shipment hidden 900 ms, within the settle window): "not found" then is not "absent".
pub(super) async fn a_booking_hidden_by_a_lagging_lookup_is_not_booked_twice(t: TestDb) {
    let plan = shipping_faults(vec![Fault::After(Answer::Reset)], 900);
    let name = "a_booking_hidden_by_a_lagging_lookup_is_not_booked_twice";
    regression(t, FlowKind::Choreography, Kind::Lagging, name, plan).await;
}

/// The keyless shipping provider commits a booking 1.4 s after it was sent (past the
/// caller's 1 s timeout, within the 3 s settle window): the lookup right after the timeout
/// finds nothing yet, which is not "absent" (seed 9165: two live shipments, the saga
/// `completed`).
pub(super) async fn a_booking_still_in_flight_when_looked_up_is_not_booked_twice(t: TestDb) {
    let plan = shipping_faults(vec![Fault::SlowCommit(1_400)], 0);
    let name = "a_booking_still_in_flight_when_looked_up_is_not_booked_twice";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}

/// The keyless shipping provider commits a booking 1.3 s after it was sent and its first
/// lookup shows an empty page; the settle window runs from when the call ended, not from
/// the claim — under load the runner's pipeline sent it well after claiming it, and a window
/// from the claim ended while the booking was still hidden (found by the large run, seed
/// 27157 of `postgres::choreography_listing`: two live shipments).
pub(super) async fn a_slow_booking_hidden_from_its_first_lookup_is_not_booked_twice(t: TestDb) {
    let mut plan = shipping_faults(
        vec![Fault::SlowCommit(1_300), Fault::After(Answer::Reset)],
        0,
    );
    plan.shipping.lookups = vec![Fault::EmptyPage];
    let name = "a_slow_booking_hidden_from_its_first_lookup_is_not_booked_twice";
    regression(t, FlowKind::Choreography, Kind::Listing, name, plan).await;
}

/// The booking is answered 206 with no body and never reaches the provider: nothing is
/// booked, so the saga must not complete (seed 9141: `completed`, the booking effect
/// `succeeded`, no shipment at the provider).
pub(super) async fn a_booking_answered_2xx_without_a_body_before_it_was_made_does_not_complete_the_saga(
    t: TestDb,
) {
    let plan = shipping_faults(
        vec![Fault::Before(Answer::Status {
            status: 206,
            body: BodyFault::Empty,
        })],
        0,
    );
    let name =
        "a_booking_answered_2xx_without_a_body_before_it_was_made_does_not_complete_the_saga";
    regression(t, FlowKind::Saga, Kind::Keyed, name, plan).await;
}

/// The charge committed, its answer late past the timeout; the endpoint's status check
/// then finds it as `label_created`: the client must not be told `payment-declined`
/// (seed 9029: 502, then 402 with the charge live; also `in_transit`, `pending`).
pub(super) async fn payments_endpoint_a_charge_found_in_a_status_word_the_client_does_not_know_is_not_told_declined(
    t: TestDb,
) {
    let plan = payments_faults(
        vec![Fault::After(Answer::Late(2_200))],
        vec![Fault::StatusWord("label_created".into())],
    );
    let name = "payments_endpoint_a_charge_found_in_a_status_word_the_client_does_not_know_is_not_told_declined";
    regression(t, FlowKind::Endpoint, Kind::Keyed, name, plan).await;
}

/// Under the choreography an undeliverable order's charge succeeds and its booking is
/// refused (422): the order has a live charge and no shipment, so it must be named in
/// review (or refunded) — today the booking is `failed` and nothing names the order
/// (seed 9013, there a 402 from the proxy).
pub(super) async fn choreography_a_refused_booking_leaves_its_live_charge_in_review_or_refunded(
    t: TestDb,
) {
    let plan = Plan {
        seed: 1,
        undeliverable: true,
        ..Plan::default()
    };
    let name = "choreography_a_refused_booking_leaves_its_live_charge_in_review_or_refunded";
    regression(t, FlowKind::Choreography, Kind::Keyed, name, plan).await;
}
