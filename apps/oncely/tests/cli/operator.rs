//! `oncely outbox|idempotency` operator commands as processes on every backend: none
//! migrates (on a database without oncely's schema each fails and creates nothing),
//! `idempotency list` by state, and `outbox stats|dead list|dead requeue` reviving a dead event.

use std::process::Stdio;
use std::time::Duration;

use oncely_testkit::TestDb;
use serde_json::Value;

use super::{enqueue, outbox_event, table_names};

/// Operator commands migrate nothing (issue 14 §9): on a database without oncely's schema
/// each fails, saying so, creates no table and prints no sqlx notice; once `oncely
/// migrate` has run, each answers and prints only its answer.
pub(crate) async fn operator_commands_on_a_database_without_the_schema_fail_and_create_nothing(
    t: TestDb,
) {
    let commands: [&[&str]; 5] = [
        &["outbox", "stats"],
        &["outbox", "dead", "list"],
        &["outbox", "dead", "requeue", "--all"],
        &["inbox", "dead", "list"],
        &["inbox", "dead", "requeue", "--all"],
    ];
    let run = |args: &[&str]| {
        oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(args)
            .args(["--database-url", &t.url])
            .env_remove("ONCELY_LOG")
            .output()
            .unwrap()
    };
    for args in commands {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded: {stderr}");
        assert!(
            stderr.contains("no oncely schema in") && stderr.contains("oncely migrate"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("sqlx") && !stderr.contains("NOTICE"),
            "{args:?} printed sqlx output: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed a result");
        assert_eq!(table_names(&t).await, Vec::<String>::new(), "{args:?}");
    }
    let migrate = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(["migrate", "--database-url", &t.url])
        .output()
        .unwrap();
    assert!(migrate.status.success());
    for args in commands {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.is_empty(),
            "{args:?} printed more than its answer: {stderr}"
        );
        assert!(!out.stdout.is_empty(), "{args:?} printed no answer");
    }
}

/// `oncely idempotency list --state processing|unknown`: the multi-phase records a holder
/// still leases, and those whose lease ran out, each in its own listing.
pub(crate) async fn idempotency_list_shows_multi_phase_records_by_state(t: TestDb) {
    use oncely_core::{Fingerprint, IdempotencyKey, Operation, Scope, TenantId};
    t.db.migrate().await.unwrap();
    let store = oncely_sql::IdempotencyStore::new(t.db.clone(), Duration::from_secs(60));
    let scope = Scope::new(
        TenantId::parse("acme").unwrap(),
        Operation::new("POST", "/v1/orders/{id}/payments"),
    );
    let fp = Fingerprint::compute("POST", "/p", "/p", None, b"").unwrap();
    let now = oncely_core::now_ms();
    for (k, lease) in [("k-held", 60_000), ("k-lost", 1)] {
        let key = IdempotencyKey::parse(k.as_bytes()).unwrap();
        let r = store
            .reserve_leased(&scope, &key, &fp, now, Duration::from_millis(lease))
            .await
            .unwrap();
        assert!(matches!(r, oncely_sql::LeaseReservation::Leased(_)));
    }
    assert_eq!(store.expire_leases(now + 1_000, 10).await.unwrap(), 1);
    let run = |args: &[&str]| {
        let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(["idempotency", "--database-url", &t.url, "list"])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let unknown = run(&["--state", "unknown"]);
    assert!(
        unknown.contains("acme\tPOST /v1/orders/{id}/payments\tk-lost\tunknown\t1\t"),
        "{unknown}"
    );
    assert!(!unknown.contains("k-held"), "{unknown}");
    let processing = run(&["--state", "processing", "--json"]);
    let rows: Vec<Value> = processing
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{processing}");
    assert_eq!(rows[0]["key"], "k-held");
    assert_eq!(rows[0]["state"], "processing");
    assert_eq!(rows[0]["fence"], 1);
}

pub(crate) async fn outbox_stats_dead_list_and_requeue_commands_show_and_revive_a_dead_event(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let events: Vec<_> = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(n, p)| outbox_event("ops", p, n))
        .collect();
    let ids = enqueue(&t, &events).await;
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    let claimed = store
        .claim(
            "op-test",
            10,
            Duration::from_secs(30),
            oncely_core::now_ms(),
        )
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    let outcome = store
        .reschedule("op-test", ids[0], "unroutable\tto nowhere", 0, 1)
        .await
        .unwrap();
    assert_eq!(outcome, oncely_sql::Rescheduled::Dead);
    store.release("op-test", &ids[1..]).await.unwrap();
    // `--database-url` after the leaf subcommand, where an operator types it.
    let run = |args: &[&str]| {
        oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .arg("outbox")
            .args(args)
            .args(["--database-url", &t.url])
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let stats = |out: std::process::Output| -> Value {
        assert!(out.status.success());
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let s = stats(run(&["stats"]));
    assert_eq!(
        (s["pending"].as_u64(), s["dead"].as_u64()),
        (Some(2), Some(1)),
        "{s}"
    );
    assert!(s["oldest_pending_age_seconds"].as_f64().unwrap() >= 0.0);

    let list = run(&["dead", "list"]);
    assert!(list.status.success());
    let out = String::from_utf8(list.stdout).unwrap();
    let line = format!(
        "{}\t{}\tops\ta\torder.created\t1\tunroutable to nowhere",
        ids[0], events[0].message_id
    );
    assert!(out.lines().any(|l| l == line), "{out}");
    assert_eq!(
        out.lines().count(),
        2,
        "header and the one dead event: {out}"
    );

    let requeue = run(&["dead", "requeue", &ids[0].to_string()]);
    assert!(requeue.status.success());
    assert!(String::from_utf8(requeue.stdout)
        .unwrap()
        .contains("requeued 1"));
    let again = run(&["dead", "requeue", &ids[0].to_string()]);
    assert!(!again.status.success(), "nothing dead any more");
    assert!(
        again.stdout.is_empty(),
        "a failed requeue prints no count: {:?}",
        String::from_utf8_lossy(&again.stdout)
    );
    let all = run(&["dead", "requeue", "--all"]);
    assert!(all.status.success());
    assert!(String::from_utf8(all.stdout)
        .unwrap()
        .contains("requeued 0"));
    let s = stats(run(&["stats"]));
    assert_eq!(
        (s["pending"].as_u64(), s["dead"].as_u64()),
        (Some(3), Some(0)),
        "{s}"
    );
    let row = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.attempts, 0, "requeue resets the attempts");
    assert_eq!(row.state, oncely_sql::OutboxState::Pending);
}
