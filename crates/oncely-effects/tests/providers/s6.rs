//! S6 (docs/ACCEPTANCE.md): let the external service time out — the system first asks the
//! service for the status of the earlier attempt; no blind second call. The effect runner
//! on every backend, against the payments simulator with each fault fired once and against
//! localstripe (which ignores keys, so only the status check can keep it at one charge),
//! and with the runner's settle failing right after the provider committed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use oncely_effects::{
    EffectHandler, EffectRunner, Provider, RunnerConfig, Settled, StripeConfig, StripePayments,
};
use oncely_sql::{Effect, EffectState, EffectStore, StoreError, Tx};
use oncely_testkit::{LocalStripe, TestDb};
use serde_json::json;

use super::{next_fault, payments_sim, settle, SK};

/// Fails its first `failures` settles — the runner "dies" after the provider committed and
/// before the outcome was recorded — then counts the successes it sees.
#[derive(Default)]
struct CrashOnSettle {
    failures: usize,
    seen: AtomicUsize,
    succeeded: AtomicUsize,
}

impl EffectHandler for CrashOnSettle {
    fn settled<'a>(
        &'a self,
        _tx: &'a mut Tx,
        _effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            if self.seen.fetch_add(1, Ordering::SeqCst) < self.failures {
                return Err(StoreError::Corrupt(
                    "the runner died before recording".into(),
                ));
            }
            if matches!(outcome, Settled::Succeeded(_)) {
                self.succeeded.fetch_add(1, Ordering::SeqCst);
            }
            Ok(())
        })
    }
}

fn config() -> RunnerConfig {
    RunnerConfig {
        lease: Duration::from_millis(1_500),
        poll: Duration::from_millis(50),
        check_delay: Duration::from_millis(100),
        ..RunnerConfig::default()
    }
}

async fn enqueue(db: &oncely_sql::Database, invoice: &str) -> String {
    let request = json!({"amount": 4200, "currency": "eur", "metadata": {"order_id": "ord"}});
    super::enqueue_effect(db, ("payments", "charge"), invoice, &request).await
}

fn calls(evidence: &[oncely_sql::EvidenceRow]) -> usize {
    evidence.iter().filter(|e| e.kind == "call").count()
}

/// Every fault of the payments simulator, once each, on this backend: each ends with one
/// PaymentIntent for the invoice, the effect succeeded with its id, and — where the first
/// call's outcome was unknown — a status check before anything else.
pub(crate) async fn every_payments_fault_ends_with_one_charge_and_the_status_asked_first(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = payments_sim(Duration::from_millis(600)).await;
    let stripe = |search| {
        Arc::new(
            StripePayments::new(StripeConfig {
                base_url: base.clone(),
                secret_key: SK.into(),
                timeout: Duration::from_millis(800),
                search,
                settle_time: Duration::from_secs(1),
                ..StripeConfig::default()
            })
            .unwrap(),
        ) as Arc<dyn Provider>
    };
    // (fault, use search): late and dropped answers, a 500 after the charge replayed under
    // the key, a 500 before it (stored under the key: the next key generation goes out once
    // the status proved nothing exists), a rate limit, and a search that lags.
    for (fault, search) in [
        ("late_after", false),
        ("drop_after", false),
        ("error_after", false),
        ("error_before", false),
        ("rate_limit", false),
        ("drop_after", true),
    ] {
        let invoice = format!("inv-{fault}-{search}");
        let runner = Arc::new(EffectRunner::new(
            store.clone(),
            vec![stripe(search)],
            Arc::new(CrashOnSettle::default()),
            config(),
        ));
        let id = enqueue(&t.db, &invoice).await;
        next_fault(&base, fault).await;
        let effect = settle(&runner, &store, &id).await;
        let intents = sim.stats().payment_intents_by_metadata["invoice_id"][&invoice];
        assert_eq!(
            (effect.state().unwrap(), intents.total, intents.succeeded),
            (EffectState::Succeeded, 1, 1),
            "{fault}: {effect:?}"
        );
        let evidence = store.evidence(&id).await.unwrap();
        let outcomes: Vec<_> = evidence
            .iter()
            .map(|e| format!("{}:{}", e.kind, e.outcome))
            .collect();
        if fault != "rate_limit" {
            assert_eq!(evidence[0].outcome, "unknown", "{fault}: {outcomes:?}");
            assert_eq!(
                evidence[1].kind, "status",
                "{fault}: the status is asked first: {outcomes:?}"
            );
        }
        if fault == "error_before" {
            // Same key: the stored 500 again; then a new generation once absence is proven.
            assert!(effect.key_generation >= 1, "{outcomes:?}");
        } else if fault != "rate_limit" {
            assert_eq!(calls(&evidence), 1, "{fault}: no second call: {outcomes:?}");
        }
        if search {
            assert!(
                outcomes.iter().any(|o| o == "status:not_yet_visible"),
                "the lagging search is waited out: {outcomes:?}"
            );
        }
    }
}

/// The runner's settle fails right after the provider committed (the process "dies" there):
/// the effect stays in flight until its lease runs out, then the status check finds the
/// charge — one charge at the provider, recorded.
pub(crate) async fn a_runner_dying_after_the_provider_committed_leaves_one_charge(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = payments_sim(Duration::ZERO).await;
    let provider = Arc::new(
        StripePayments::new(StripeConfig {
            base_url: base.clone(),
            secret_key: SK.into(),
            search: false,
            ..StripeConfig::default()
        })
        .unwrap(),
    );
    let handler = Arc::new(CrashOnSettle {
        failures: 1,
        ..CrashOnSettle::default()
    });
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![provider],
        handler.clone(),
        config(),
    ));
    let id = enqueue(&t.db, "inv-crash").await;
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(effect.state().unwrap(), EffectState::Succeeded);
    assert_eq!(sim.stats().payment_intents, 1);
    assert_eq!(handler.succeeded.load(Ordering::SeqCst), 1);
    let evidence = store.evidence(&id).await.unwrap();
    assert_eq!(
        evidence
            .iter()
            .map(|e| (e.kind.as_str(), e.outcome.as_str()))
            .collect::<Vec<_>>(),
        [("status", "found")],
        "the lost call left no evidence; the status check found its charge"
    );
}

/// The same against localstripe, which ignores `Idempotency-Key`: a blind re-send would
/// charge twice there, so one charge proves the status check decided.
pub(crate) async fn against_localstripe_a_runner_dying_after_the_charge_leaves_one_charge(
    t: TestDb,
) {
    let Some(ls) = LocalStripe::start().await else {
        return;
    };
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let provider = Arc::new(
        StripePayments::new(StripeConfig {
            base_url: ls.base_url().to_owned(),
            secret_key: "sk_test_localstripe".into(),
            search: false,
            timeout: Duration::from_secs(5),
            ..StripeConfig::default()
        })
        .unwrap(),
    );
    let handler = Arc::new(CrashOnSettle {
        failures: 1,
        ..CrashOnSettle::default()
    });
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![provider.clone()],
        handler,
        config(),
    ));
    let id = enqueue(&t.db, "inv-ls-crash").await;
    let effect = settle(&runner, &store, &id).await;
    assert_eq!(effect.state().unwrap(), EffectState::Succeeded);
    let request = oncely_effects::EffectRequest {
        operation: "charge".into(),
        reference: "inv-ls-crash".into(),
        key: effect.key.clone(),
        params: json!({}),
    };
    let found = provider
        .status(oncely_effects::StatusQuery {
            request: &request,
            last_sent: None,
            since: std::time::SystemTime::now() - Duration::from_secs(600),
        })
        .await
        .unwrap();
    match found {
        oncely_effects::StatusOutcome::Found(objects) => {
            assert_eq!(objects.len(), 1, "one charge at localstripe");
            assert_eq!(effect.provider_id.as_deref(), Some(objects[0].id.as_str()));
        }
        other => panic!("{other:?}"),
    }
}

/// The process's Prometheus recorder (one per test process; counters add up across the
/// tests that share it, so the checks below are lower bounds or per-label).
pub(crate) fn recorder() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of this test process")
    })
}

/// The value of the sample `name{labels}` in Prometheus text.
pub(crate) fn sample(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A dropped answer counts one `unknown` attempt and one `found` resolution; the gauges show
/// the effect succeeded and nothing unknown or in review.
pub(crate) async fn runner_metrics_count_attempts_and_resolutions_and_gauge_the_states(t: TestDb) {
    let handle = recorder();
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (_sim, base) = payments_sim(Duration::ZERO).await;
    let provider = Arc::new(
        StripePayments::new(StripeConfig {
            base_url: base.clone(),
            secret_key: SK.into(),
            search: false,
            ..StripeConfig::default()
        })
        .unwrap(),
    );
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![provider],
        Arc::new(CrashOnSettle::default()),
        config(),
    ));
    let before = handle.render();
    let id = enqueue(&t.db, "inv-metrics").await;
    next_fault(&base, "drop_after").await;
    settle(&runner, &store, &id).await;
    runner.record_gauges().await.unwrap();
    let after = handle.render();
    let delta = |s: &str| sample(&after, s) - sample(&before, s);
    assert!(
        delta(r#"oncely_effect_attempts_total{provider="payments",outcome="unknown"}"#) >= 1.0,
        "{after}"
    );
    assert!(
        delta(r#"oncely_effect_resolutions_total{provider="payments",result="found"}"#) >= 1.0,
        "{after}"
    );
    assert!(
        sample(
            &after,
            r#"oncely_effects{provider="payments",state="succeeded"}"#
        ) >= 1.0
    );
    assert!(
        after.contains(r#"oncely_effects_needs_review{provider="payments"}"#),
        "{after}"
    );
}

/// Found by the effect protocol's model (`an_ended_object_of_an_earlier_key_can_fail_a_live_effect`):
/// an effect under its key's next generation (an operator retried it after a declined
/// charge) whose call's answer is lost, checked while the lagging search still shows only
/// the earlier key's declined PaymentIntent. That object says nothing of this attempt: the
/// effect is not `failed`, it is checked again until the new charge shows, and succeeds —
/// one live charge beside the old declined one.
pub(crate) async fn an_ended_object_of_an_earlier_key_never_fails_the_retried_effect(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = EffectStore::new(t.db.clone());
    let (sim, base) = payments_sim(Duration::from_millis(600)).await;
    let invoice = "inv-earlier-key";
    // The earlier key's attempt: declined, so its PaymentIntent ended.
    let declined = reqwest::Client::new()
        .post(format!("{base}/v1/payment_intents"))
        .bearer_auth(SK)
        .header("Idempotency-Key", "key-inv-earlier-key")
        .form(&[
            ("amount", "4200"),
            ("currency", "eur"),
            ("confirm", "true"),
            ("payment_method", "pm_card_chargeDeclined"),
            ("metadata[invoice_id]", invoice),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(declined.status().as_u16(), 402, "the card is declined");
    // Objects carry whole seconds: the retry goes out in a later second.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let id = enqueue(&t.db, invoice).await;
    // As `oncely effects retry` leaves a failed effect: under the key's next generation.
    t.db.execute(
        oncely_sql::query(
            "UPDATE oncely_effects SET key_generation = 1, idem_key = $1 WHERE id = $2",
        )
        .bind("key-inv-earlier-key~1")
        .bind(id.as_str()),
    )
    .await
    .unwrap();
    let provider = Arc::new(
        StripePayments::new(StripeConfig {
            base_url: base.clone(),
            secret_key: SK.into(),
            timeout: Duration::from_millis(800),
            search: true,
            settle_time: Duration::from_secs(1),
            ..StripeConfig::default()
        })
        .unwrap(),
    ) as Arc<dyn Provider>;
    let runner = Arc::new(EffectRunner::new(
        store.clone(),
        vec![provider],
        Arc::new(CrashOnSettle::default()),
        config(),
    ));
    next_fault(&base, "drop_after").await;
    let effect = settle(&runner, &store, &id).await;
    let outcomes: Vec<String> = store
        .evidence(&id)
        .await
        .unwrap()
        .iter()
        .map(|e| format!("{}:{}", e.kind, e.outcome))
        .collect();
    let intents = sim.stats().payment_intents_by_metadata["invoice_id"][invoice];
    assert_eq!(
        (effect.state().unwrap(), intents.total, intents.succeeded),
        (EffectState::Succeeded, 2, 1),
        "{effect:?} {outcomes:?}"
    );
}

oncely_testkit::matrix! {
    tests: [
        every_payments_fault_ends_with_one_charge_and_the_status_asked_first,
        an_ended_object_of_an_earlier_key_never_fails_the_retried_effect,
        a_runner_dying_after_the_provider_committed_leaves_one_charge,
        against_localstripe_a_runner_dying_after_the_charge_leaves_one_charge,
        runner_metrics_count_attempts_and_resolutions_and_gauge_the_states,
    ],
    cannot_apply: [],
}
