//! The webhook scenario ([`super::Flow::Webhook`]): every charge's answer is dropped after
//! the simulator committed it (each effect `unknown`, its status check ten minutes off),
//! Stripe's signed `payment_intent.succeeded` of each is delivered to a process that dies
//! between reading the verified event and writing its resolution; a clean process gets the
//! same events again (the same ids: Stripe's redelivery) and each resolves its charge
//! once — one `webhook` evidence row per charge — and the flow's invariant holds.

use std::time::{Duration, Instant};

use oncely_sql::EffectStore;
use oncely_testkit::TestDb;

use super::super::webhooks::{
    drop_answers, event, from_webhooks, intent_of, post_event, unknown_charges,
};
use super::{check, died_at, start, Client};

/// Runs the scenario on `t` with `flags` (which name the endpoint's secret).
pub(super) async fn webhook_crash(
    t: &TestDb,
    client: &mut Client,
    flags: &[String],
    (payments, shipping): (&str, &str),
    points: &[&str],
    settle: Duration,
) {
    let n = client.external_refs().count();
    drop_answers(payments, u32::try_from(n).unwrap()).await;
    let began = Instant::now();
    let mut events = Vec::new();
    for point in points {
        let dying = start(t, flags, Some(point));
        client.drive_once(&dying.base).await;
        if events.is_empty() {
            for charge in unknown_charges(t, n).await {
                let pi = intent_of(payments, &charge.reference).await;
                let id = format!("evt_crash_{}", uuid::Uuid::new_v4().simple());
                events.push((charge.id, event(&id, "payment_intent.succeeded", &pi)));
            }
        }
        // The first delivery ends the process; the rest meet a closed port.
        for (_, body) in &events {
            let signature = oncely_effects::sign_stripe_event(
                super::super::webhooks::SECRET,
                oncely_core::now_ms() / 1000,
                body.as_bytes(),
            );
            let _ = reqwest::Client::new()
                .post(format!("{}/v1/webhooks/stripe", dying.base))
                .header("Stripe-Signature", signature)
                .body(body.clone())
                .timeout(Duration::from_secs(5))
                .send()
                .await;
        }
        died_at(dying, point).await;
        eprintln!("crash: died at {point} after {:?}", began.elapsed());
    }
    let store = EffectStore::new(t.db.clone());
    for (id, _) in &events {
        let e = store.get(id).await.unwrap().unwrap();
        assert_eq!(e.state_word, "unknown", "the crash left {id} unresolved");
    }
    let clean = start(t, flags, None);
    client.drive(&clean.base, settle).await;
    for (id, body) in &events {
        let (status, answer) = post_event(&clean.base, body).await;
        assert_eq!(
            (status, answer["result"].as_str()),
            (200, Some("resolved")),
            "{id}: {answer}"
        );
        let (status, again) = post_event(&clean.base, body).await;
        assert_eq!(
            (status, again["result"].as_str()),
            (200, Some("duplicate")),
            "{id}: {again}"
        );
    }
    check::settled(t, client, payments, shipping, settle).await;
    for (id, _) in &events {
        let trail = store.evidence(id).await.unwrap();
        assert_eq!(from_webhooks(&trail).len(), 1, "{id}: {trail:?}");
    }
    eprintln!("crash: settled after {:?}", began.elapsed());
    client.replays_match(&clean.base).await;
}
