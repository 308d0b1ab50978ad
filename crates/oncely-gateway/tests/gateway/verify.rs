//! `oncely verify` (the checks of `oncely-verify`, as the `oncely verify` command runs
//! them) against the non-idempotent Python upstream: every check holds behind the
//! gateway, and the same upstream fails them when called directly.

use oncely_testkit::TestBackend;
use oncely_verify::{verify, BodyTemplate, CheckId, Header, Mutation, Outcome, VerifyConfig};

use crate::support::{gateway, orders_route, test_db, Upstream, KEY_A, KEY_B};

fn config(base: &str, count_url: &str) -> VerifyConfig {
    let body = BodyTemplate::new(r#"{"external_ref": "{{uuid}}", "amount_minor": 2500}"#);
    let mut cfg = VerifyConfig::new(&format!("{base}/orders"), body).unwrap();
    cfg.headers = vec![Header::parse(&format!("Authorization: Bearer {KEY_A}")).unwrap()];
    cfg.headers_b = Some(vec![Header::parse(&format!(
        "Authorization: Bearer {KEY_B}"
    ))
    .unwrap()]);
    cfg.mutations = vec![Mutation::parse("/amount_minor=2999").unwrap()];
    cfg.count_url = Some(oncely_verify::parse_url(count_url).unwrap());
    cfg
}

#[tokio::test]
async fn the_non_idempotent_upstream_passes_oncely_verify_behind_the_gateway() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let gw = gateway(&db.db, &up.base, vec![orders_route()]).await;
    let report = verify(config(&gw.base, &format!("{}/orders/count", up.base)))
        .await
        .unwrap();
    println!("{}", report.to_table());
    assert!(report.passed(), "every check holds behind the gateway");
    for id in [
        CheckId::KeyMissing,
        CheckId::S1Sequential,
        CheckId::S2Concurrent,
        CheckId::S3Mutated,
        CheckId::S4HangUp,
        CheckId::Scope,
    ] {
        assert_eq!(report.outcome(id), Some(Outcome::Holds), "{}", id.as_str());
    }
}

#[tokio::test]
async fn the_same_upstream_called_directly_fails_oncely_verify() {
    let up = Upstream::start();
    let count = format!("{}/orders/count", up.base);
    let report = verify(config(&up.base, &count)).await.unwrap();
    println!("{}", report.to_table());
    assert!(!report.passed());
    assert_eq!(report.outcome(CheckId::S1Sequential), Some(Outcome::Fails));
    assert_eq!(report.outcome(CheckId::S2Concurrent), Some(Outcome::Fails));
}
