//! The operator's `oncely` binary against the store and the service: `oncely inbox dead
//! list|requeue`, `oncely effects` (retry, resolve, show) continued by the service's runner,
//! `oncely verify`.

use std::process::Stdio;
use std::time::Duration;

use oncely_testkit::process::SpawnTied as _;
use oncely_testkit::TestDb;
use serde_json::Value;

use super::{oncely_bin, serve, Proc, API_KEY, API_KEY_B, ORDERS};

pub(super) async fn inbox_dead_list_and_requeue_commands_show_and_revive_a_dead_delivery(
    t: TestDb,
) {
    use oncely_broker::Publisher as _;
    orders::migrate(&t.db).await.unwrap();
    let transport = oncely_broker::SqlTransport::new(t.db.clone(), 1 << 20);
    transport.subscribe("billing", "orders").await.unwrap();
    let id = oncely_core::MessageId::new_random();
    let message = oncely_broker::Message {
        id,
        topic: "orders".to_owned(),
        partition_key: "o-1".to_owned(),
        event_type: "order.created".to_owned(),
        payload: b"{}".to_vec(),
        headers: std::collections::BTreeMap::new(),
    };
    for r in transport.publish(&[message]).await {
        r.unwrap();
    }
    let d = transport
        .claim("billing", 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(transport.dead(&d[0], "boom\tin billing").await.unwrap());
    let run = |args: &[&str]| {
        oncely_testkit::process::command(oncely_bin())
            .args(["inbox", "--database-url", &t.url, "dead"])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let list = run(&["list"]);
    assert!(list.status.success());
    let out = String::from_utf8(list.stdout).unwrap();
    assert!(
        out.contains(&format!("{id}\t1\tboom in billing\torders\t")),
        "{out}"
    );
    let json = run(&["list", "--json", "--consumer", "billing"]);
    assert!(json.status.success());
    let rows: Vec<Value> = String::from_utf8(json.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["message_id"], id.to_string());
    assert_eq!(rows[0]["attempts"], 1);
    assert_eq!(rows[0]["last_error"], "boom\tin billing");
    assert_eq!(rows[0]["payload_preview"], "{}");
    let position = rows[0]["position"].as_str().unwrap().to_owned();
    assert!(position.starts_with("sql:"), "{position}");
    let after = run(&["list", "--json", "--after", &position]);
    assert!(after.status.success());
    assert!(after.stdout.is_empty(), "nothing after the last letter");
    let requeue = run(&["requeue", &id.to_string()]);
    assert!(requeue.status.success());
    assert!(String::from_utf8(requeue.stdout)
        .unwrap()
        .contains("requeued 1"));
    assert!(
        !run(&["requeue", &id.to_string()]).status.success(),
        "nothing dead any more"
    );
    let again = transport
        .claim("billing", 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "pending again");
}

/// `oncely effects`: a parked (`needs_review`) effect is listed, retried — back to
/// `unknown`, never a blind call — resolved as succeeded with the provider's id, and shown
/// with its evidence and both audit rows; a second resolution is refused. The `oncely`
/// binary only records the resolution (its continuation marked in the store, the invoice
/// untouched): a running `orders effects run` continues it with the service's handler —
/// its invoice paid and one `invoice.paid` written.
#[allow(
    clippy::too_many_lines,
    reason = "one effect through every operator command, read top to bottom"
)]
pub(super) async fn effects_commands_retry_and_resolve_a_parked_effect_and_show_its_audit_trail(
    t: TestDb,
) {
    orders::migrate(&t.db).await.unwrap();
    // The invoice the parked charge pays: resolving the charge as succeeded marks it paid
    // and writes invoice.paid, as the runner's settle would have.
    t.db.execute(oncely_sql::query(
        "INSERT INTO invoices (id, tenant, order_id, kind, amount_minor, currency, \
             message_id, created_at) VALUES ('inv-ops', 'acme', 'ord-ops', 'order', 100, \
             'eur', 'm-ops', 1000)",
    ))
    .await
    .unwrap();
    let id = oncely_testkit::park_effect(&t.db, "acme", "inv-ops").await;
    let run = |args: &[&str]| {
        oncely_testkit::process::command(oncely_bin())
            .args(["effects", "--database-url", &t.url])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let list = run(&["list", "--state", "needs-review"]);
    let out = String::from_utf8(list.stdout).unwrap();
    assert!(
        list.status.success()
            && out.contains(&format!("{id}\tpayments\tcharge\tinv-ops\tneeds_review")),
        "{out}"
    );
    let retry = run(&["retry", &id, "--actor", "ops@acme"]);
    let retried: Value = serde_json::from_slice(&retry.stdout).unwrap();
    assert_eq!(
        retried["state"], "unknown",
        "a retry checks the status first"
    );
    let resolve = run(&[
        "resolve",
        &id,
        "--as",
        "succeeded",
        "--provider-id",
        "pi_seen",
        "--actor",
        "ops@acme",
    ]);
    let resolved: Value = serde_json::from_slice(&resolve.stdout).unwrap();
    assert_eq!(
        (resolved["state"].as_str(), resolved["provider_id"].as_str()),
        (Some("succeeded"), Some("pi_seen"))
    );
    let invoice = || async {
        let row: (Option<i64>, Option<String>) =
            t.db.fetch_optional(oncely_sql::query(format!(
                "SELECT paid_at, {} FROM invoices WHERE id = 'inv-ops'",
                t.db.backend().text_column("payment_id")
            )))
            .await
            .unwrap()
            .expect("the invoice");
        row
    };
    assert_eq!(
        invoice().await.0,
        None,
        "the CLI runs no handler of the service"
    );
    let (pending,): (i64,) =
        t.db.fetch_optional(oncely_sql::query(
            "SELECT COUNT(*) FROM oncely_effects WHERE continuation_at IS NOT NULL",
        ))
        .await
        .unwrap()
        .expect("a count");
    assert_eq!(pending, 1, "the resolution's continuation is recorded");
    // The service's runner (no provider is ever called: a shipping provider nobody books
    // with) continues it.
    let runner = Proc {
        child: oncely_testkit::process::command(ORDERS)
            .args(["effects", "run", "--database-url", &t.url])
            .args([
                "--shipping-url",
                "http://127.0.0.1:9",
                "--runner-poll-ms",
                "50",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn_tied()
            .expect("spawn orders effects run"),
        base: String::new(),
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (paid_at, payment_id) = loop {
        let row = invoice().await;
        if row.0.is_some() || std::time::Instant::now() > deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    drop(runner);
    assert!(paid_at.is_some(), "the service's runner paid the invoice");
    assert_eq!(payment_id.as_deref(), Some("pi_seen"));
    let (paid_events,): (i64,) =
        t.db.fetch_optional(oncely_sql::query(
            "SELECT COUNT(*) FROM oncely_outbox WHERE event_type = 'invoice.paid'",
        ))
        .await
        .unwrap()
        .expect("a count");
    assert_eq!(paid_events, 1, "one invoice.paid from the continuation");
    assert!(
        !run(&["resolve", &id, "--as", "failed"]).status.success(),
        "settled: refused"
    );
    assert!(
        !run(&["resolve", &id, "--as", "succeeded"]).status.success(),
        "no provider id"
    );
    let show: Value = serde_json::from_slice(&run(&["show", &id]).stdout).unwrap();
    assert_eq!(show["evidence"][0]["outcome"], "unavailable");
    let audit: Vec<_> = show["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["action"].as_str().unwrap(),
                a["actor"].as_str().unwrap(),
                a["to"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        audit,
        [
            ("retry", "ops@acme", "unknown"),
            ("resolve", "ops@acme", "succeeded")
        ]
    );
}

pub(super) async fn verify_command_against_serve_finds_every_check_holding(t: TestDb) {
    let p = serve(&t.url);
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("report.json");
    let body_path = dir.path().join("order.json");
    std::fs::write(
        &body_path,
        r#"{"source":"verify","external_ref":"{{uuid}}","customer_id":"c-42",
            "items":[{"sku":"sku-1","quantity":2}],"amount_minor":1999,"currency":"EUR"}"#,
    )
    .unwrap();
    let url = format!("{}/v1/orders", p.base);
    // The service's own list counts the first credential's orders (`total`).
    let count_url = format!("{}/v1/orders?limit=1", p.base);
    let (auth_a, auth_b) = (
        format!("Authorization: Bearer {API_KEY}"),
        format!("Authorization: Bearer {API_KEY_B}"),
    );
    let out = tokio::task::spawn_blocking({
        let (body, report) = (body_path.clone(), report_path.clone());
        move || {
            oncely_testkit::process::command(oncely_bin())
                .args(["verify", "--url", &url, "--body"])
                .arg(&body)
                .args(["--header", &auth_a, "--header-b", &auth_b])
                .args(["--mutate", "/amount_minor=2999", "--object-id", "/id"])
                .args(["--count-url", &count_url])
                .args(["--concurrency", "16", "--json"])
                .arg(&report)
                .stderr(Stdio::inherit())
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    println!("{table}");
    assert!(out.status.success(), "oncely verify exits 0: {table}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    let checks = report["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 9);
    for c in checks {
        assert_eq!(c["outcome"], "holds", "{c}");
    }
    assert_eq!(report["all_applicable_hold"], true);
    let s2 = checks.iter().find(|c| c["id"] == "s2-concurrent").unwrap();
    assert_eq!(
        s2["count_after"].as_u64().unwrap() - s2["count_before"].as_u64().unwrap(),
        1,
        "{s2}"
    );
    assert!(table.contains("9 checks: 9 hold, 0 fail, 0 not applicable"));
    // One object per logical operation: key-max-length, S1, S2, S3 (twice), S4, scope (2).
    let orders: i64 = oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM orders WHERE source = 'verify'"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(orders, 8);

    // Exit status 1 when a check fails: told to look for a replay marker the service does
    // not send, S1 cannot find it.
    let out = oncely_testkit::process::command(oncely_bin())
        .args([
            "verify",
            "--url",
            &format!("{}/v1/orders", p.base),
            "--body",
        ])
        .arg(&body_path)
        .args(["--header", &format!("Authorization: Bearer {API_KEY}")])
        .args(["--replay-header", "x-no-such-marker"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // Exit status 2 when the endpoint refuses the sample request: the checks could not
    // judge idempotency (a body without the order's fields is a 4xx of the service).
    let out = oncely_testkit::process::command(oncely_bin())
        .args([
            "verify",
            "--url",
            &format!("{}/v1/orders", p.base),
            "--body",
            r#"{"source":"verify"}"#,
        ])
        .args(["--header", &format!("Authorization: Bearer {API_KEY}")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("refused the sample request"), "{stderr}");
    // Exit status 2 when the checks cannot run.
    let out = oncely_testkit::process::command(oncely_bin())
        .args(["verify", "--url", "ftp://x", "--body", "{}"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
