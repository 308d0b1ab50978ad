//! `oncely verify` against the order service's router over real HTTP on `127.0.0.1:0`,
//! on every backend: every check holds.

use axum::Router;
use oncely_testkit::TestDb;
use oncely_verify::{
    verify, BodyTemplate, CheckId, Header, Mutation, Outcome, VerifyConfig, ALL_CHECKS,
};

const KEY_A: &str = "verify-tenant-a-0123456789";
const KEY_B: &str = "verify-tenant-b-0123456789";

/// Aborts the server task when the test ends.
struct Server {
    base: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn spawn(router: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    Server { base, task }
}

fn order_body() -> BodyTemplate {
    BodyTemplate::new(
        r#"{"source":"verify","external_ref":"{{uuid}}","customer_id":"c-42",
            "items":[{"sku":"sku-1","quantity":2},{"sku":"sku-2","quantity":1}],
            "amount_minor":1999,"currency":"EUR"}"#,
    )
}

oncely_testkit::matrix! {
    tests: [every_check_holds_against_the_order_service],
}

async fn every_check_holds_against_the_order_service(t: TestDb) {
    orders::migrate(&t.db).await.unwrap();
    let config = orders::AppConfig {
        api_keys: orders::parse_api_keys(&format!("{KEY_A}=tenant-a,{KEY_B}=tenant-b")).unwrap(),
        ..orders::AppConfig::default()
    };
    let router = orders::router(t.db.clone(), &config);
    let s = spawn(router).await;

    let mut cfg = VerifyConfig::new(&format!("{}/v1/orders", s.base), order_body()).unwrap();
    cfg.headers = vec![Header::parse(&format!("Authorization: Bearer {KEY_A}")).unwrap()];
    cfg.headers_b = Some(vec![Header::parse(&format!(
        "Authorization: Bearer {KEY_B}"
    ))
    .unwrap()]);
    cfg.mutations = vec![Mutation::parse("/amount_minor=2999").unwrap()];
    // The service's own list: its `total` counts the credential's tenant's orders.
    cfg.count_url = Some(format!("{}/v1/orders?limit=1", s.base).parse().unwrap());
    let report = verify(cfg).await.unwrap();
    println!("{}", report.to_table());

    let expected: Vec<_> = ALL_CHECKS.iter().map(|&c| (c, Outcome::Holds)).collect();
    let outcomes: Vec<_> = report.checks.iter().map(|c| (c.id, c.outcome)).collect();
    assert_eq!(outcomes, expected);
    assert!(report.passed());
    // Evidence: S2 saw one object, and the count moved by exactly one.
    let s2 = report.check(CheckId::S2Concurrent).unwrap();
    assert_eq!(s2.ids_seen.len(), 1);
    assert_eq!(s2.count_after.unwrap() - s2.count_before.unwrap(), 1);
    assert!(s2.requests.len() > 16);
    // The list counts the first credential's tenant only: the second tenant's order under
    // the same key is not in it.
    let scope = report.check(CheckId::Scope).unwrap();
    assert_eq!(scope.count_after.unwrap() - scope.count_before.unwrap(), 1);
    // The same key under quoted sf-string syntax is the same key.
    let mut quoted = VerifyConfig::new(&format!("{}/v1/orders", s.base), order_body()).unwrap();
    quoted.headers = vec![Header::parse(&format!("Authorization: Bearer {KEY_A}")).unwrap()];
    quoted.quote_keys = true;
    let report = verify(quoted).await.unwrap();
    assert_eq!(report.outcome(CheckId::S1Sequential), Some(Outcome::Holds));
    assert_eq!(report.outcome(CheckId::Scope), Some(Outcome::NotApplicable));
    assert_eq!(
        report.outcome(CheckId::S3Mutated),
        Some(Outcome::NotApplicable)
    );
    assert!(report.passed(), "checks that do not apply do not fail");
}
