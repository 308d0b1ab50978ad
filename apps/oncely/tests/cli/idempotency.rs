//! `oncely idempotency resolve` as a process: an `unknown` operation resolved as found
//! stores the answer the person gives (replayed from then on), as absent frees the key;
//! each writes an audit row; a record that is not `unknown` is refused and left alone.

use std::process::{Output, Stdio};
use std::time::Duration;

use oncely_core::{Fingerprint, IdempotencyKey, Operation, RecordState, Scope, TenantId};
use oncely_sql::{IdempotencyStore, LeaseReservation, OperatorAudit};
use oncely_testkit::TestDb;

const OPERATION: &str = "POST /orders";

fn scope() -> Scope {
    Scope::new(
        TenantId::parse("acme").unwrap(),
        Operation::new("POST", "/orders"),
    )
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k.as_bytes()).unwrap()
}

/// Reserves `k` under a 1 ms lease and sweeps it: an `unknown` record, as a gateway that
/// sent the request and got no answer leaves it.
async fn unknown(store: &IdempotencyStore, k: &str) {
    let fp = Fingerprint::compute("POST", "/orders", "/orders", None, b"{}").unwrap();
    let now = oncely_core::now_ms();
    let r = store
        .reserve_leased(&scope(), &key(k), &fp, now, Duration::from_millis(1))
        .await
        .unwrap();
    assert!(matches!(r, LeaseReservation::Leased(_)));
    assert_eq!(store.expire_leases(now + 1_000, 10).await.unwrap(), 1);
}

fn resolve(t: &TestDb, k: &str, how: &[&str]) -> Output {
    oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(["idempotency", "--database-url", &t.url, "resolve"])
        .args(["--tenant", "acme", "--operation", OPERATION, "--key", k])
        .args([
            "--reason",
            "checked the upstream's order list",
            "--actor",
            "ops@acme",
        ])
        .args(how)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

pub(crate) async fn idempotency_resolve_stores_a_found_answer_or_frees_the_key_with_an_audit_row(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let store = IdempotencyStore::new(t.db.clone(), Duration::from_secs(60));
    unknown(&store, "k-found").await;
    unknown(&store, "k-absent").await;

    let body = r#"{"id":"o-17","status":"created"}"#;
    let found = resolve(&t, "k-found", &["--status", "201", "--body", body]);
    assert!(found.status.success(), "{found:?}");
    let record = store
        .lookup(&scope(), &key("k-found"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.state, RecordState::Succeeded);
    let answer = record.response.unwrap();
    assert_eq!((answer.status, &answer.body[..]), (201, body.as_bytes()));
    assert!(
        answer
            .headers
            .contains(&("content-type".into(), "application/json".into())),
        "{:?}",
        answer.headers
    );

    let absent = resolve(&t, "k-absent", &["--absent"]);
    assert!(absent.status.success(), "{absent:?}");
    assert!(
        store
            .lookup(&scope(), &key("k-absent"))
            .await
            .unwrap()
            .is_none(),
        "key freed"
    );

    // Resolved already: refused, nothing changed.
    let again = resolve(&t, "k-found", &["--absent"]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("not unknown"),
        "{again:?}"
    );
    assert!(store
        .lookup(&scope(), &key("k-found"))
        .await
        .unwrap()
        .is_some());
    let missing = resolve(&t, "k-none", &["--absent"]);
    assert!(!missing.status.success(), "{missing:?}");

    let audit = OperatorAudit::new(t.db.clone())
        .recent(None, 10)
        .await
        .unwrap();
    let rows: Vec<(&str, &str, &str)> = audit
        .iter()
        .map(|a| (a.actor.as_str(), a.action.as_str(), a.target.as_str()))
        .collect();
    assert_eq!(
        rows,
        [
            (
                "ops@acme",
                "resolve-idempotency",
                "idempotency:acme:POST /orders:k-absent"
            ),
            (
                "ops@acme",
                "resolve-idempotency",
                "idempotency:acme:POST /orders:k-found"
            ),
        ]
    );
    assert!(audit[1].detail.contains("found: 201"), "{:?}", audit[1]);
}
