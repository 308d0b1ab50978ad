//! The runner's retry policy on every backend (issue 16): a provider that is down is waited
//! out with a growing backoff over the effect's consecutive-unavailable streak, its retry
//! budget drawn down and then spreading the waits over the cap, no attempt counted — and one
//! charge once it is back; the attempt limit and the deadline decided by
//! `RetryPolicy::decide`, failing only what provably did not happen and parking an unknown
//! outcome for a person.

use std::sync::Arc;
use std::time::Duration;

use oncely_core::{RetryBudget, RetryPolicy};
use oncely_effects::{
    EffectRunner, NoHandler, Provider, RunnerConfig, StripeConfig, StripePayments,
};
use oncely_sql::{Effect, EffectState, EffectStore};
use oncely_testkit::TestDb;
use serde_json::json;

use super::s6::{recorder, sample};
use super::{next_fault, payments_sim, set_faults, settle, SK};

fn stripe(base: &str) -> Arc<dyn Provider> {
    Arc::new(
        StripePayments::new(StripeConfig {
            base_url: base.to_owned(),
            secret_key: SK.into(),
            timeout: Duration::from_millis(800),
            search: false,
            // A list proves absence once the settle window after the send has passed.
            settle_time: Duration::from_millis(300),
            ..StripeConfig::default()
        })
        .unwrap(),
    )
}

async fn enqueue(db: &oncely_sql::Database, invoice: &str) -> String {
    let request = json!({"amount": 900, "currency": "eur", "metadata": {"order_id": "ord"}});
    super::enqueue_effect(db, ("payments", "charge"), invoice, &request).await
}

/// Waits until `effect` is due, then runs one round; returns the effect as it is after.
async fn round(runner: &Arc<EffectRunner>, store: &EffectStore, effect: &Effect) -> Effect {
    let wait = effect.available_at - oncely_core::now_ms();
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait.unsigned_abs() + 5)).await;
    }
    for _ in 0..100 {
        if runner.run_once().await.unwrap() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    store.get(&effect.id).await.unwrap().unwrap()
}

fn trail(store_evidence: &[oncely_sql::EvidenceRow]) -> Vec<String> {
    store_evidence
        .iter()
        .map(|e| format!("{}:{}", e.kind, e.outcome))
        .collect()
}

const BASE: Duration = Duration::from_millis(10);
const CAP: Duration = Duration::from_secs(1);

/// The payments simulator answers every charge with 429 (`Retry-After: 0`, rate 1.0): ten
/// rounds leave the effect pending with 0 attempts and a streak of 10; each wait is within
/// the backoff ceiling of its streak and they grow (the old runner drew every wait from the
/// first step, ≤ 10 ms); the budget of 40 tokens pays for 8 retries, then the waits are
/// the cap and the exhaustion is counted. The provider comes back: one charge, the effect
/// succeeded at its first counted attempt, the retry's cost refunded — and the refunded
/// budget pays for the next outage's first retry again.
pub(crate) async fn a_provider_that_is_down_is_waited_out_with_a_growing_backoff_and_its_budget(
    t: TestDb,
) {
    let handle = recorder();
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = payments_sim(Duration::ZERO).await;
    set_faults(&base, json!({"rate_limit": 1.0, "retry_after_secs": 0})).await;
    let config = RunnerConfig {
        poll: Duration::from_millis(10),
        outage: RetryPolicy {
            base: BASE,
            cap: CAP,
            max_attempts: u32::MAX,
            ..RetryPolicy::default()
        },
        budget_capacity: 8 * RetryBudget::RETRY_COST,
        ..RunnerConfig::default()
    };
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![stripe(&base)],
        Arc::new(NoHandler),
        config.clone(),
    ));
    let budget = || runner.budget("payments").unwrap().available();
    let before = handle.render();
    let id = enqueue(&t.db, "inv-down").await;
    let mut effect = store.get(&id).await.unwrap().unwrap();
    let mut gaps = Vec::new();
    for n in 1..=10_i32 {
        effect = round(&runner, &store, &effect).await;
        assert_eq!(
            (
                effect.state().unwrap(),
                effect.attempts,
                effect.unavailable_streak
            ),
            (EffectState::Pending, 0, n),
            "round {n}: nothing counted, the streak grows"
        );
        let gap = effect.available_at - effect.updated_at;
        let ceiling = i64::try_from(config.outage.ceiling(n.unsigned_abs()).as_millis()).unwrap();
        if n <= 8 {
            assert!(gap <= ceiling, "round {n}: wait {gap} ms over {ceiling} ms");
            assert_eq!(budget(), 40 - 5 * n.unsigned_abs(), "round {n}");
        } else {
            assert!(
                gap <= 1_000,
                "round {n}: the spent budget waits within the cap, got {gap} ms"
            );
            assert_eq!(budget(), 0);
        }
        gaps.push(gap);
    }
    assert!(
        gaps[4..8].iter().any(|&g| g > 2 * 10),
        "the waits grow past the first steps: {gaps:?}"
    );
    let after = handle.render();
    let exhausted = sample(
        &after,
        r#"oncely_effect_budget_exhausted_total{provider="payments"}"#,
    ) - sample(
        &before,
        r#"oncely_effect_budget_exhausted_total{provider="payments"}"#,
    );
    assert!(exhausted >= 2.0, "{after}");
    assert_eq!(sim.stats().payment_intents, 0);

    // Back up.
    set_faults(&base, json!({"rate_limit": 0.0})).await;
    effect = round(&runner, &store, &effect).await;
    assert_eq!(
        (
            effect.state().unwrap(),
            effect.attempts,
            effect.unavailable_streak
        ),
        (EffectState::Succeeded, 1, 0),
        "{effect:?}"
    );
    let intents = sim.stats().payment_intents_by_metadata["invoice_id"]["inv-down"];
    assert_eq!((intents.total, intents.succeeded), (1, 1));
    let evidence = store.evidence(&id).await.unwrap();
    let mut expected = vec!["call:retryable".to_owned(); 10];
    expected.push("call:succeeded".to_owned());
    assert_eq!(trail(&evidence), expected);
    assert_eq!(
        budget(),
        RetryBudget::RETRY_COST,
        "the retry's cost refunded"
    );

    // Down again: the refunded budget pays for a retry at the first step, not the cap.
    set_faults(&base, json!({"rate_limit": 1.0})).await;
    let id = enqueue(&t.db, "inv-down-again").await;
    let effect = round(&runner, &store, &store.get(&id).await.unwrap().unwrap()).await;
    assert_eq!((effect.attempts, effect.unavailable_streak), (0, 1));
    assert!(effect.available_at - effect.updated_at <= 10);
    assert_eq!(budget(), 0);
}

/// A refused connection (nothing listens) is never sent: no attempt counted while the
/// streak grows; once the deadline (1.5 s from the intent's creation) has passed the
/// effect is `failed` — it provably did not happen — with the deadline as its reason.
pub(crate) async fn refused_calls_count_no_attempt_and_the_deadline_fails_what_was_never_sent(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![stripe(&format!("http://{closed}"))],
        Arc::new(NoHandler),
        RunnerConfig {
            retry: RetryPolicy {
                deadline: Some(Duration::from_millis(1_500)),
                ..RetryPolicy::default()
            },
            outage: RetryPolicy {
                base: Duration::from_millis(50),
                cap: Duration::from_millis(200),
                ..RetryPolicy::default()
            },
            ..RunnerConfig::default()
        },
    ));
    let id = enqueue(&t.db, "inv-refused").await;
    let effect = round(&runner, &store, &store.get(&id).await.unwrap().unwrap()).await;
    assert_eq!(
        (
            effect.state().unwrap(),
            effect.attempts,
            effect.unavailable_streak
        ),
        (EffectState::Pending, 0, 1)
    );
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(
        (effect.state().unwrap(), effect.attempts),
        (EffectState::Failed, 0),
        "{effect:?}"
    );
    assert!(
        effect.last_error.as_deref().unwrap().contains("deadline"),
        "{effect:?}"
    );
    // No retry starts whose wait (≤ 200 ms) would end after the deadline.
    assert!(oncely_core::now_ms() - effect.created_at >= 1_300);
    let evidence = trail(&store.evidence(&id).await.unwrap());
    assert!(evidence.len() >= 3, "{evidence:?}");
    assert!(
        evidence.iter().all(|e| e == "call:not_sent"),
        "{evidence:?}"
    );
}

/// The attempt limit (2), through `RetryPolicy::decide`: every charge fails with a 500
/// before the effect (rate 1.0) — unknown, so the status is asked first each time, and
/// proves absence; after the second attempt the effect is `failed` (nothing exists at the
/// provider), never a third call. An unknown outcome (the answer dropped after the charge)
/// whose status cannot be asked because the provider went down waits without counting a
/// check — and past the deadline goes to `needs_review`, never `failed`, never a new call.
pub(crate) async fn the_attempt_limit_fails_proven_absent_calls_and_the_deadline_parks_unknown_ones(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let config = RunnerConfig {
        poll: Duration::from_millis(10),
        check_delay: Duration::from_millis(50),
        retry: RetryPolicy {
            base: Duration::from_millis(20),
            max_attempts: 2,
            deadline: Some(Duration::from_secs(3)),
            ..RetryPolicy::default()
        },
        outage: RetryPolicy {
            base: Duration::from_millis(20),
            cap: Duration::from_millis(100),
            ..RetryPolicy::default()
        },
        ..RunnerConfig::default()
    };
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![stripe(&base)],
        Arc::new(NoHandler),
        config.clone(),
    ));
    set_faults(&base, json!({"error_before": 1.0})).await;
    let id = enqueue(&t.db, "inv-limit").await;
    let effect = settle(&runner, &store, &id).await;
    let evidence = trail(&store.evidence(&id).await.unwrap());
    assert_eq!(
        (effect.state().unwrap(), effect.attempts),
        (EffectState::Failed, 2),
        "{evidence:?}"
    );
    // Each "not found" within the settle window (300 ms) proves nothing yet; after it,
    // absent.
    let proven: Vec<&String> = evidence
        .iter()
        .filter(|e| *e != "status:not_yet_visible")
        .collect();
    assert_eq!(
        proven,
        [
            "call:unknown",
            "status:absent",
            "call:unknown",
            "status:absent"
        ]
    );
    assert!(effect
        .last_error
        .as_deref()
        .unwrap()
        .contains("attempt limit"));
    assert_eq!(sim.stats().payment_intents, 0);

    // An unknown outcome, then the provider is down for its status checks.
    set_faults(&base, json!({"error_before": 0.0})).await;
    let id = enqueue(&t.db, "inv-unknown").await;
    next_fault(&base, "drop_after").await;
    let mut effect = round(&runner, &store, &store.get(&id).await.unwrap().unwrap()).await;
    assert_eq!(effect.state().unwrap(), EffectState::Unknown);
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let down = Arc::new(EffectRunner::new(
        store.clone(),
        vec![stripe(&format!("http://{closed}"))],
        Arc::new(NoHandler),
        config,
    ));
    effect = round(&down, &store, &effect).await;
    assert_eq!(
        (
            effect.state().unwrap(),
            effect.checks,
            effect.unavailable_streak
        ),
        (EffectState::Unknown, 0, 1),
        "an unavailable status check counts no check"
    );
    let effect = settle(&down, &store, &id).await;
    let evidence = trail(&store.evidence(&id).await.unwrap());
    assert_eq!(
        (effect.state().unwrap(), effect.attempts, effect.checks),
        (EffectState::NeedsReview, 1, 0),
        "{evidence:?}"
    );
    assert!(oncely_core::now_ms() - effect.created_at >= 2_900);
    assert_eq!(evidence[0], "call:unknown");
    assert!(
        evidence[1..].iter().all(|e| e == "status:unavailable"),
        "no second call: {evidence:?}"
    );
    let intents = sim.stats().payment_intents_by_metadata["invoice_id"]["inv-unknown"];
    assert_eq!(
        intents.total, 1,
        "the dropped answer's charge, and no other"
    );
}

oncely_testkit::matrix! {
    tests: [
        a_provider_that_is_down_is_waited_out_with_a_growing_backoff_and_its_budget,
        refused_calls_count_no_attempt_and_the_deadline_fails_what_was_never_sent,
        the_attempt_limit_fails_proven_absent_calls_and_the_deadline_parks_unknown_ones,
    ],
    cannot_apply: [],
}
