//! The runner's group commit: several runners on one store, each settling the outcomes
//! that are ready together, with a handler that fails for some effects — every effect is
//! settled exactly once, nothing is lost, and an effect that merely shared a transaction
//! with a failing one is settled at once by the fallback (not left for its lease).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use oncely_effects::{
    EffectHandler, EffectRunner, Provider, RunnerConfig, Settled, StripeConfig, StripePayments,
};
use oncely_sql::{query, Effect, EffectState, EffectStore, NewEffect, StoreError, Tx};
use oncely_testkit::TestDb;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{payments_sim, SK};

const EFFECTS: usize = 500;

/// Effects whose handler fails the first time it runs.
fn fails_once(i: usize) -> bool {
    i % 7 == 3
}

/// Effects whose handler fails the first two times: once in the group, once alone in the
/// fallback, so the effect stays leased and is completed by a status check after its lease.
fn fails_twice(i: usize) -> bool {
    i % 50 == 25
}

/// The business update of a settled effect: a row in `group_settled`, in the settle's
/// transaction — so a settle committed twice would show as two rows. Fails as
/// [`fails_once`] and [`fails_twice`] say, by the effect's reference `g-<i>`.
#[derive(Default)]
struct Flaky {
    tries: Mutex<HashMap<String, usize>>,
    /// Outcomes other than a success (none expected).
    other: Mutex<Vec<String>>,
}

impl EffectHandler for Flaky {
    fn settled<'a>(
        &'a self,
        tx: &'a mut Tx,
        effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            if !matches!(outcome, Settled::Succeeded(_)) {
                self.other
                    .lock()
                    .unwrap()
                    .push(format!("{}: {outcome:?}", effect.reference));
            }
            let i: usize = effect.reference[2..].parse().unwrap();
            let tries = {
                let mut tries = self.tries.lock().unwrap();
                let n = tries.entry(effect.id.clone()).or_default();
                *n += 1;
                *n
            };
            let failures = if fails_twice(i) {
                2
            } else {
                usize::from(fails_once(i))
            };
            if tries <= failures {
                return Err(StoreError::Corrupt(format!(
                    "handler refuses {} (try {tries})",
                    effect.reference
                )));
            }
            tx.execute(
                query("INSERT INTO group_settled (effect_id) VALUES ($1)").bind(effect.id.as_str()),
            )
            .await?;
            Ok(())
        })
    }
}

async fn enqueue_all(db: &oncely_sql::Database) {
    let now = oncely_core::now_ms();
    let mut tx = db.begin().await.unwrap();
    for i in 0..EFFECTS {
        let reference = format!("g-{i}");
        let request =
            json!({"amount": 100 + i, "currency": "eur", "metadata": {"order_id": reference}});
        let new = NewEffect {
            tenant: "acme",
            provider: "payments",
            operation: "charge",
            reference: &reference,
            key: &format!("key-{reference}"),
            request: &request,
        };
        EffectStore::enqueue(&mut tx, &new, now).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// 500 effects, three runners at once on one store, groups of up to 32 settled together;
/// the handler fails for every seventh effect once and for every fiftieth twice. At the end
/// each effect is `succeeded`, its business row exists exactly once, the provider holds one
/// PaymentIntent per effect (no effect was sent twice), and only the effects whose handler
/// failed alone — not the ones that shared their group — were ever checked by status.
pub(crate) async fn group_commit_settles_every_effect_once_across_runners_and_failures(t: TestDb) {
    t.db.migrate().await.unwrap();
    t.db.execute(query(
        "CREATE TABLE group_settled (effect_id VARCHAR(64) NOT NULL)",
    ))
    .await
    .unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let provider: Arc<dyn Provider> = Arc::new(
        StripePayments::new(StripeConfig {
            base_url: base,
            secret_key: SK.into(),
            search: false,
            ..StripeConfig::default()
        })
        .unwrap(),
    );
    enqueue_all(&t.db).await;
    let handler = Arc::new(Flaky::default());
    let stop = CancellationToken::new();
    let runners: Vec<_> = (0..3)
        .map(|r| {
            let runner = Arc::new(EffectRunner::new(
                store.clone(),
                vec![provider.clone()],
                handler.clone(),
                RunnerConfig {
                    runner_id: format!("runner-{r}"),
                    // Long enough that a loaded machine does not expire the leases of
                    // outcomes waiting to be settled (that would be a status check, which
                    // the assertions below read as a neighbour's failure).
                    lease: Duration::from_secs(8),
                    poll: Duration::from_millis(20),
                    check_delay: Duration::from_millis(50),
                    concurrency: 4,
                    batch: 16,
                    settle_batch: 32,
                    ..RunnerConfig::default()
                },
            ));
            tokio::spawn(runner.run(stop.clone()))
        })
        .collect();
    let started = Instant::now();
    loop {
        let counts = store.counts().await.unwrap();
        let succeeded: i64 = counts
            .iter()
            .filter(|c| c.1 == EffectState::Succeeded.as_str())
            .map(|c| c.2)
            .sum();
        if succeeded == EFFECTS as i64 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "not every effect settled: {counts:?}; other outcomes: {:?}",
            handler.other.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    for r in runners {
        r.await.unwrap();
    }
    let (rows, distinct): (i64, i64) =
        t.db.fetch_optional(query(
            "SELECT COUNT(*), COUNT(DISTINCT effect_id) FROM group_settled",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rows, distinct),
        (EFFECTS as i64, EFFECTS as i64),
        "one business update per effect"
    );
    assert_eq!(
        sim.stats().payment_intents,
        EFFECTS as u64,
        "one PaymentIntent per effect"
    );
    let effects = store.list(None, 1_000).await.unwrap();
    assert_eq!(effects.len(), EFFECTS);
    assert_evidence(&store, &effects).await;
}

/// Per effect: at most one call in its evidence, numbered in order; an effect whose handler
/// never failed settled by its call's outcome alone; one whose handler failed twice was
/// completed by a status check.
async fn assert_evidence(store: &EffectStore, effects: &[Effect]) {
    for effect in effects {
        let i: usize = effect.reference[2..].parse().unwrap();
        let evidence = store.evidence(&effect.id).await.unwrap();
        let kinds: Vec<_> = evidence
            .iter()
            .map(|e| format!("{}:{}", e.kind, e.outcome))
            .collect();
        // A call's evidence commits with its settle: one whose handler failed alone was
        // rolled back with it, and the status check recorded what the provider had.
        assert!(
            evidence.iter().filter(|e| e.kind == "call").count() <= 1,
            "{}: sent once: {kinds:?}",
            effect.reference
        );
        assert_eq!(
            evidence.iter().map(|e| e.n).collect::<Vec<_>>(),
            (1..=evidence.len() as i32).collect::<Vec<_>>(),
            "{}: evidence numbered in order",
            effect.reference
        );
        if !fails_once(i) && !fails_twice(i) {
            assert_eq!(
                kinds,
                ["call:succeeded"],
                "{}: its handler never failed, so it was settled by its first call's outcome \
                 (a failing neighbour in its group must not leave it for its lease)",
                effect.reference
            );
        }
        if fails_twice(i) {
            assert!(
                kinds.iter().any(|k| k == "status:found"),
                "{}: left leased by its handler, completed by a status check: {kinds:?}",
                effect.reference
            );
        }
    }
}

oncely_testkit::matrix! {
    tests: [group_commit_settles_every_effect_once_across_runners_and_failures],
    cannot_apply: [],
}
