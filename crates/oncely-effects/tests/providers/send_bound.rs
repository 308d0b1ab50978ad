//! The send bound (`oncely_effects::SEND_BOUND`), on every backend, against the keyless
//! shipping simulator: a call that leaves within the bound of its claim goes out under the
//! claim as it stands; one that waited longer for its call slot records its send first,
//! fenced by the claim's lease version, and does not leave at all when another runner has
//! taken the effect over meanwhile.

use std::sync::Arc;
use std::time::Duration;

use oncely_effects::{
    EffectRunner, NoHandler, Provider, RunnerConfig, ShippingClient, ShippingConfig, SEND_BOUND,
};
use oncely_sim::{FaultConfig, FaultKind, FaultRates, ShippingSim};
use oncely_sql::{Effect, EffectState, EffectStore};
use oncely_testkit::TestDb;
use serde_json::json;

use super::{enqueue_effect, listen, settle};

/// Every booking is held this long before it commits and is answered: longer than the
/// send bound, so the second of two claimed bookings waits past it for the one call slot.
const HELD: Duration = Duration::from_millis(1_600);

async fn shipping_sim() -> (ShippingSim, String) {
    let sim = ShippingSim::new(oncely_sim::ShippingConfig {
        faults: FaultConfig {
            rates: FaultRates {
                latency: 1.0,
                ..FaultRates::default()
            },
            latency_ms: u64::try_from(HELD.as_millis()).unwrap(),
            seed: Some(11),
            ..FaultConfig::default()
        },
        ..oncely_sim::ShippingConfig::default()
    });
    let base = listen(sim.router()).await;
    (sim, base)
}

/// A runner with one call slot and a batch of two, so that a claim takes both bookings and
/// the second waits for the first's answer.
fn runner(db: &oncely_sql::Database, base: &str, lease: Duration) -> Arc<EffectRunner> {
    let provider: Arc<dyn Provider> = Arc::new(
        ShippingClient::new(ShippingConfig {
            base_url: base.to_owned(),
            timeout: Duration::from_secs(5),
            settle_time: Duration::from_secs(1),
            ..ShippingConfig::default()
        })
        .unwrap(),
    );
    Arc::new(EffectRunner::new(
        EffectStore::new(db.clone()),
        vec![provider],
        Arc::new(NoHandler),
        RunnerConfig {
            lease,
            poll: Duration::from_millis(50),
            check_delay: Duration::from_millis(100),
            concurrency: 1,
            batch: 2,
            ..RunnerConfig::default()
        },
    ))
}

async fn enqueue_two(db: &oncely_sql::Database) -> [String; 2] {
    let mut ids = Vec::new();
    for order in ["order-sb-1", "order-sb-2"] {
        let request = json!({"order_id": order, "items": [{"sku": "sku-1", "quantity": 1}]});
        ids.push(enqueue_effect(db, ("shipping", "book"), order, &request).await);
    }
    ids.try_into().unwrap()
}

fn arrived(sim: &ShippingSim) -> u64 {
    sim.stats()
        .faults_injected
        .get(&FaultKind::Latency)
        .copied()
        .unwrap_or(0)
}

async fn call_started_at(store: &EffectStore, effect: &Effect) -> i64 {
    let trail = store.evidence(&effect.id).await.unwrap();
    let calls: Vec<i64> = trail
        .iter()
        .filter(|e| e.kind == "call")
        .map(|e| e.started_at)
        .collect();
    assert_eq!(calls.len(), 1, "{trail:?}");
    calls[0]
}

/// Without another runner, both bookings go out once: the first within the bound, under
/// its claim's `sent_at` (not written again); the second, past the bound, with its send
/// recorded — `sent_at` moved to the moment its call left.
async fn a_call_past_its_send_bound_records_its_send_and_leaves(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = shipping_sim().await;
    let runner = runner(&t.db, &base, Duration::from_secs(10));
    let [first, second] = enqueue_two(&t.db).await;
    runner.run_once().await.unwrap();
    let mut effects = Vec::new();
    for id in [&first, &second] {
        let effect = store.get(id).await.unwrap().unwrap();
        assert_eq!(
            effect.state().unwrap(),
            EffectState::Succeeded,
            "{effect:?}"
        );
        let started = call_started_at(&store, &effect).await;
        effects.push((started, effect.sent_at.unwrap()));
    }
    assert_eq!(sim.stats().shipments, 2);
    // The one call slot may take either booking first: order them by when they left.
    effects.sort_unstable();
    let [(first_left, first_sent), (second_left, second_sent)] = effects[..] else {
        unreachable!("two effects")
    };
    // Both were claimed by one statement at one instant; only the late one was stamped.
    assert!(first_sent <= first_left, "{effects:?}");
    assert_eq!(second_sent, second_left, "{effects:?}");
    let held = i64::try_from(HELD.as_millis()).unwrap();
    assert!(
        second_sent - first_sent >= held,
        "the later booking's send is recorded when it left: {first_sent} → {second_sent}"
    );
    assert!(HELD > SEND_BOUND);
}

/// The first runner's lease runs out while its second booking waits for the call slot;
/// another runner takes both over (they are `unknown` to it: the first is on its way, the
/// second may be). When the slot frees, past the send bound, the first runner's stamp
/// matches nothing and its call never leaves; the other runner finds the first booking and
/// books the second once its absence is proven. One shipment per order.
async fn a_call_past_its_send_bound_never_leaves_once_its_claim_was_taken_over(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = shipping_sim().await;
    let slow = runner(&t.db, &base, Duration::from_millis(100));
    let [first, second] = enqueue_two(&t.db).await;
    let first_round = tokio::spawn({
        let slow = slow.clone();
        async move { slow.run_once().await }
    });
    // Past the first runner's lease (lease + the send bound from its claim), before its
    // first booking is answered.
    tokio::time::sleep(SEND_BOUND + Duration::from_millis(300)).await;
    let other = runner(&t.db, &base, Duration::from_secs(10));
    assert_eq!(other.run_once().await.unwrap(), 2, "both taken over");
    assert_eq!(first_round.await.unwrap().unwrap(), 2);
    assert_eq!(
        arrived(&sim),
        1,
        "only the first booking left the first runner; the second's claim was taken over"
    );
    for id in [&first, &second] {
        let effect = settle(&other, &store, id).await;
        assert_eq!(
            effect.state().unwrap(),
            EffectState::Succeeded,
            "{effect:?}"
        );
    }
    let stats = sim.stats();
    assert_eq!(stats.shipments, 2, "{stats:?}");
    assert_eq!(
        arrived(&sim),
        2,
        "the second booking went out once, from the other runner"
    );
}

oncely_testkit::matrix! {
    tests: [
        a_call_past_its_send_bound_records_its_send_and_leaves,
        a_call_past_its_send_bound_never_leaves_once_its_claim_was_taken_over,
    ],
    cannot_apply: [],
}
