//! The payment simulator's fault kinds as a client sees them: one-shot faults (500 before
//! and after the effect, 429, a dropped connection, a late answer, latency) and fault
//! rates drawn per request from a seed.

use std::time::{Duration, Instant};

use oncely_sim::{FaultKind, FaultRates};
use serde_json::{json, Value};

use super::support::{
    client, control, create, get_json, intent_form, intents_for, is_closed_without_answer, json_of,
    once, parts, payments, post_form, stats, SK,
};

pub(crate) async fn error_after_creates_the_intent_answers_500_and_replays_that_500_under_the_key()
{
    let (_sim, base) = payments().await;
    once(&base, "error_after").await;
    let form = intent_form("inv-500-after");
    let (s, r, b) = parts(create(&base, Some("key-500"), &form).await).await;
    assert_eq!((s, r), (500, false));
    assert_eq!(json_of(&b)["error"]["type"], "api_error");
    assert_eq!(
        intents_for(&base, "inv-500-after").await,
        1,
        "the effect happened"
    );
    let (s2, r2, b2) = parts(create(&base, Some("key-500"), &form).await).await;
    assert_eq!(
        (s2, r2),
        (500, true),
        "the 500 is what is stored under the key"
    );
    assert_eq!(b2, b);
    assert_eq!(intents_for(&base, "inv-500-after").await, 1);
    let (_, list) = get_json(&base, "/v1/payment_intents").await;
    assert_eq!(list["data"][0]["metadata"]["invoice_id"], "inv-500-after");
}

pub(crate) async fn error_before_answers_500_creates_nothing_and_still_stores_the_500_under_the_key(
) {
    let (_sim, base) = payments().await;
    once(&base, "error_before").await;
    let form = intent_form("inv-500-before");
    let (s, r, b) = parts(create(&base, Some("key-b"), &form).await).await;
    assert_eq!((s, r), (500, false));
    assert_eq!(json_of(&b)["error"]["type"], "api_error");
    assert_eq!(intents_for(&base, "inv-500-before").await, 0);
    let (s2, r2, _) = parts(create(&base, Some("key-b"), &form).await).await;
    assert_eq!((s2, r2), (500, true));
    assert_eq!(intents_for(&base, "inv-500-before").await, 0);
    let (s3, _, _) = parts(create(&base, Some("key-b2"), &form).await).await;
    assert_eq!(s3, 200);
    assert_eq!(intents_for(&base, "inv-500-before").await, 1);
}

pub(crate) async fn rate_limit_answers_429_with_retry_after_and_creates_and_stores_nothing() {
    let (sim, base) = payments().await;
    once(&base, "rate_limit").await;
    let form = intent_form("inv-429");
    let res = create(&base, Some("key-429"), &form).await;
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "3");
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["code"],
        "rate_limit"
    );
    assert_eq!(intents_for(&base, "inv-429").await, 0);
    let (s, r, _) = parts(create(&base, Some("key-429"), &form).await).await;
    assert_eq!((s, r), (200, false), "the key was not used up by the 429");
    assert_eq!(intents_for(&base, "inv-429").await, 1);
    assert_eq!(sim.stats().faults_injected[&FaultKind::RateLimit], 1);
}

pub(crate) async fn drop_after_closes_the_connection_without_an_answer_and_the_intent_exists() {
    let (_sim, base) = payments().await;
    once(&base, "drop_after").await;
    let form = intent_form("inv-drop");
    let err = post_form(
        &client(),
        &format!("{base}/v1/payment_intents"),
        SK,
        Some("key-drop"),
        &form,
    )
    .await
    .expect_err("no answer");
    assert!(!err.is_timeout() && err.status().is_none(), "{err:?}");
    assert!(
        is_closed_without_answer(&err),
        "a closed connection, got {err:?}"
    );
    assert_eq!(
        intents_for(&base, "inv-drop").await,
        1,
        "the effect happened"
    );
    // The retry with the key gets the stored success.
    let (s, r, b) = parts(create(&base, Some("key-drop"), &form).await).await;
    assert_eq!((s, r), (200, true));
    assert_eq!(json_of(&b)["status"], "succeeded");
    assert_eq!(intents_for(&base, "inv-drop").await, 1);
}

pub(crate) async fn late_after_answers_after_the_callers_timeout_and_the_intent_exists() {
    let (_sim, base) = payments().await;
    once(&base, "late_after").await;
    let form = intent_form("inv-late");
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let err = post_form(
        &impatient,
        &format!("{base}/v1/payment_intents"),
        SK,
        Some("key-late"),
        &form,
    )
    .await
    .expect_err("timed out");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(
        intents_for(&base, "inv-late").await,
        1,
        "committed before the late answer"
    );
    let (s, r, _) = parts(create(&base, Some("key-late"), &form).await).await;
    assert_eq!((s, r), (200, true));
    // A patient caller gets the late answer.
    once(&base, "late_after").await;
    let started = Instant::now();
    let (s, _, _) = parts(create(&base, None, &intent_form("inv-late-2")).await).await;
    assert_eq!(s, 200);
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_eq!(intents_for(&base, "inv-late").await, 1);
}

pub(crate) async fn latency_fault_delays_the_request_by_the_configured_ms_once() {
    let (sim, base) = payments().await;
    once(&base, "latency").await;
    let started = Instant::now();
    let (s, _, _) = parts(create(&base, None, &intent_form("inv-latency")).await).await;
    assert_eq!(s, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
    create(&base, None, &intent_form("inv-latency")).await;
    assert_eq!(
        sim.stats().faults_injected[&FaultKind::Latency],
        1,
        "a one-shot fires once"
    );
    assert_eq!(intents_for(&base, "inv-latency").await, 2);
}

pub(crate) async fn fault_rates_are_set_at_runtime_drawn_per_request_and_reproducible_with_a_seed()
{
    let mut rates = FaultRates::default();
    rates.set_from_str("error_after=0.05").unwrap();
    assert!((rates.error_after - 0.05).abs() < f64::EPSILON);
    assert!(rates.set_from_str("error_after=1.5").is_err());
    assert!(rates.set_from_str("explode=0.1").is_err());
    assert!(rates.set_from_str("error_after").is_err());

    let run = || async {
        let (_sim, base) = payments().await;
        let settings = control(
            &base,
            "/_sim/faults",
            &json!({"error_before": 0.5, "seed": 42}),
        )
        .await;
        assert_eq!(settings["error_before"], 0.5);
        assert_eq!(settings["seed"], 42);
        let mut statuses = Vec::new();
        for i in 0..60 {
            statuses.push(
                create(&base, None, &intent_form(&format!("inv-rate-{i}")))
                    .await
                    .status()
                    .as_u16(),
            );
        }
        let st = stats(&base).await;
        (statuses, st["payment_intents"].as_u64().unwrap(), base)
    };
    let (a, created_a, base) = run().await;
    let (b, _, _) = run().await;
    assert_eq!(a, b, "the same seed draws the same faults");
    let failed = a.iter().filter(|s| **s == 500).count();
    assert!((10..=50).contains(&failed), "about half fail: {failed}");
    assert_eq!(
        created_a as usize,
        60 - failed,
        "a 500 before the effect created nothing"
    );

    let bad = client()
        .post(format!("{base}/_sim/faults"))
        .json(&json!({"error_after": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let bad = client()
        .post(format!("{base}/_sim/faults"))
        .json(&json!({"typo": 0.1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let now: Value = reqwest::get(format!("{base}/_sim/faults"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(now["error_before"], 0.5);
    control(&base, "/_sim/faults", &json!({"error_before": 0.0})).await;
    assert_eq!(
        create(&base, None, &intent_form("inv-rate-x"))
            .await
            .status(),
        200
    );
}
