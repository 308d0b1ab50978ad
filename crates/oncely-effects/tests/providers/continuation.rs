//! Continuations (`Continue::ByRunner`): an operator's resolution recorded by a process
//! that is not the service leaves the business update to the service's runners, and two
//! runners racing for the marks continue each outcome exactly once.

use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use oncely_effects::{Continue, EffectHandler, EffectRunner, RunnerConfig, Settled};
use oncely_sql::{query, Effect, EffectState, EffectStore, Resolution, StoreError, Tx};
use oncely_testkit::TestDb;
use serde_json::json;

const EFFECTS: usize = 24;

/// The business update of a continued outcome: a row in `continued` in the handler's
/// transaction (a continuation run twice would show as two rows), and the outcome's word.
#[derive(Default)]
struct Recording {
    outcomes: Mutex<Vec<(String, String)>>,
}

impl EffectHandler for Recording {
    fn settled<'a>(
        &'a self,
        tx: &'a mut Tx,
        effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let word = match outcome {
                Settled::Succeeded(object) => format!("succeeded {}", object.id),
                Settled::Failed { error } => format!("failed {error}"),
                other => format!("{other:?}"),
            };
            tx.execute(
                query("INSERT INTO continued (effect_id) VALUES ($1)").bind(effect.id.as_str()),
            )
            .await?;
            self.outcomes
                .lock()
                .unwrap()
                .push((effect.reference.clone(), word));
            Ok(())
        })
    }
}

fn runner(store: &EffectStore, handler: Arc<Recording>) -> Arc<EffectRunner> {
    Arc::new(EffectRunner::new(
        store.clone(),
        Vec::new(),
        handler,
        RunnerConfig {
            batch: 8,
            ..RunnerConfig::default()
        },
    ))
}

/// [`EFFECTS`] unknown effects `c-<i>`, each resolved for the runner: even ones as
/// succeeded with `pi_<i>`, odd ones as failed.
async fn record_resolutions(t: &TestDb, store: &EffectStore) {
    for i in 0..EFFECTS {
        let id = super::enqueue_effect(
            &t.db,
            ("payments", "charge"),
            &format!("c-{i}"),
            &json!({"amount": 100, "currency": "eur"}),
        )
        .await;
        t.db.execute(
            query("UPDATE oncely_effects SET state = 'unknown' WHERE id = $1").bind(id.as_str()),
        )
        .await
        .unwrap();
        let pid = format!("pi_{i}");
        let resolution = Resolution {
            to: if i % 2 == 0 {
                EffectState::Succeeded
            } else {
                EffectState::Failed
            },
            provider_id: (i % 2 == 0).then_some(pid.as_str()),
            actor: "ops",
            reason: "seen at the provider",
        };
        let e = oncely_effects::resolve_effect(
            store,
            Continue::ByRunner,
            &id,
            &resolution,
            oncely_core::now_ms(),
        )
        .await
        .unwrap();
        assert_eq!(e.state().unwrap(), resolution.to);
    }
}

/// Resolutions recorded for the runner (half succeeded, half failed) change no business
/// row; two runners then race over the marks, round after round, until none is left: every
/// outcome is continued once, with the resolution's provider id or reason, and no mark
/// stays.
pub(crate) async fn a_continuation_is_run_once_when_two_runners_race(t: TestDb) {
    t.db.migrate().await.unwrap();
    t.db.execute(query(
        "CREATE TABLE continued (effect_id VARCHAR(64) NOT NULL)",
    ))
    .await
    .unwrap();
    let store = EffectStore::new(t.db.clone());
    record_resolutions(&t, &store).await;
    let (rows,): (i64,) =
        t.db.fetch_optional(query("SELECT COUNT(*) FROM continued"))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(rows, 0, "recording a resolution runs no handler");
    let handler = Arc::new(Recording::default());
    let (first, second) = (
        runner(&store, handler.clone()),
        runner(&store, handler.clone()),
    );
    let mut continued = 0;
    for _ in 0..20 {
        let (by_first, by_second) = tokio::join!(first.continue_owed(), second.continue_owed());
        continued += by_first.unwrap() + by_second.unwrap();
        if continued >= EFFECTS {
            break;
        }
    }
    assert_eq!(continued, EFFECTS, "each continuation counted once");
    let (rows, distinct): (i64, i64) =
        t.db.fetch_optional(query(
            "SELECT COUNT(*), COUNT(DISTINCT effect_id) FROM continued",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((rows, distinct), (EFFECTS as i64, EFFECTS as i64));
    let (left,): (i64,) =
        t.db.fetch_optional(query(
            "SELECT COUNT(*) FROM oncely_effects WHERE continuation_at IS NOT NULL",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left, 0, "no mark stays");
    let mut outcomes = handler.outcomes.lock().unwrap().clone();
    outcomes.sort();
    assert_eq!(outcomes.len(), EFFECTS);
    for (reference, word) in outcomes {
        let i: usize = reference[2..].parse().unwrap();
        if i % 2 == 0 {
            assert_eq!(word, format!("succeeded pi_{i}"));
        } else {
            assert_eq!(word, "failed resolved by ops: seen at the provider");
        }
    }
    assert_eq!(
        first.continue_owed().await.unwrap(),
        0,
        "nothing left to continue"
    );
}

/// An effect resolved as failed for the runner is not tried again before the runner has
/// continued that outcome: a retry first would let the stale "failed" land on the new
/// attempt's step (a saga compensating an order whose retried charge then succeeds). Once
/// continued, the retry goes through; and an owed outcome is never overwritten.
pub(crate) async fn an_effect_that_owes_a_continuation_is_retried_only_after_it_is_continued(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    t.db.execute(query(
        "CREATE TABLE continued (effect_id VARCHAR(64) NOT NULL)",
    ))
    .await
    .unwrap();
    let store = EffectStore::new(t.db.clone());
    let id = super::enqueue_effect(
        &t.db,
        ("payments", "charge"),
        "r-1",
        &json!({"amount": 100, "currency": "eur"}),
    )
    .await;
    t.db.execute(
        query("UPDATE oncely_effects SET state = 'unknown' WHERE id = $1").bind(id.as_str()),
    )
    .await
    .unwrap();
    let failed = Resolution {
        to: EffectState::Failed,
        provider_id: None,
        actor: "ops",
        reason: "declined at the provider",
    };
    let now = oncely_core::now_ms();
    oncely_effects::resolve_effect(&store, Continue::ByRunner, &id, &failed, now)
        .await
        .unwrap();
    let early = oncely_effects::retry_effect(&store, &id, "ops", now).await;
    assert!(
        matches!(early, Err(StoreError::Conflict(_))),
        "retried while its outcome is owed: {early:?}"
    );
    let mut tx = t.db.begin().await.unwrap();
    let again = EffectStore::mark_continuation(&mut tx, &id, "{}", now).await;
    assert!(
        matches!(again, Err(StoreError::Conflict(_))),
        "an owed outcome was overwritten: {again:?}"
    );
    drop(tx);
    let handler = Arc::new(Recording::default());
    assert_eq!(
        runner(&store, handler.clone())
            .continue_owed()
            .await
            .unwrap(),
        1
    );
    let retried = oncely_effects::retry_effect(&store, &id, "ops", now + 1)
        .await
        .unwrap();
    assert_eq!(retried.state().unwrap(), EffectState::Absent);
    assert_eq!(handler.outcomes.lock().unwrap().len(), 1);
}

oncely_testkit::matrix! {
    tests: [
        a_continuation_is_run_once_when_two_runners_race,
        an_effect_that_owes_a_continuation_is_retried_only_after_it_is_continued,
    ],
    cannot_apply: [],
}
