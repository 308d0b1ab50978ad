//! `oncely reconcile` against the payments simulator on every backend: the JSON report and
//! the table name what a run found (a charge nobody recorded; a recorded charge the provider
//! never made), `reconcile resolve` closes one with an audit row, an action that does not
//! fit the kind fails, and the acknowledged one is not reported again.

use std::collections::BTreeSet;
use std::process::Stdio;

use oncely_sim::{serve, PaymentsConfig, PaymentsSim};
use oncely_testkit::TestDb;
use serde_json::Value;

const SK: &str = "sk_test_oncely_cli_reconcile";

/// A charge made straight at the provider, naming `invoice` and, when given, the order it
/// was for (`metadata[order_id]`).
async fn direct_charge(base: &str, invoice: &str, order_id: Option<&str>) {
    let order = order_id.map_or(String::new(), |o| format!("&metadata[order_id]={o}"));
    let answer = reqwest::Client::new()
        .post(format!("{base}/v1/payment_intents"))
        .bearer_auth(SK)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(format!(
            "amount=700&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[invoice_id]={invoice}{order}"
        ))
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{}", answer.status());
}

/// A succeeded effect whose provider id the provider never made.
async fn ghost_charge(db: &oncely_sql::Database, invoice: &str) -> String {
    let request = serde_json::json!({"amount": 100, "currency": "eur"});
    let mut tx = db.begin().await.unwrap();
    let new = oncely_sql::NewEffect {
        tenant: "acme",
        provider: "payments",
        operation: "charge",
        reference: invoice,
        key: "key-cli-ghost",
        request: &request,
    };
    let oncely_sql::Enqueued::Created(id) =
        oncely_sql::EffectStore::enqueue(&mut tx, &new, oncely_core::now_ms())
            .await
            .unwrap()
    else {
        panic!("created")
    };
    tx.execute(
        oncely_sql::query(
            "UPDATE oncely_effects SET state = 'succeeded', provider_id = $1 WHERE id = $2",
        )
        .bind("pi_never_made")
        .bind(id.as_str()),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    id
}

fn kinds(report: &Value) -> BTreeSet<(String, String)> {
    report["discrepancies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().unwrap().to_owned(),
                d["reference"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// `reconcile resolve`: an action that does not fit the kind fails; `acknowledge` closes
/// the discrepancy with its audit row.
async fn resolve_refuses_a_misfit_and_acknowledges(
    t: &TestDb,
    oncely: &dyn Fn(&[&str]) -> std::process::Output,
    stranger: &str,
) {
    let wrong = oncely(&["resolve", stranger, "--action", "mark-succeeded"]);
    assert_eq!(
        wrong.status.code(),
        Some(oncely_cli::EXIT_CANNOT_RUN),
        "mark-succeeded does not fit missing_local: {wrong:?}"
    );
    let resolved = oncely(&[
        "resolve",
        stranger,
        "--action",
        "acknowledge",
        "--reason",
        "a test charge",
        "--actor",
        "ops@acme",
    ]);
    assert!(resolved.status.success(), "{resolved:?}");
    let row: Value = serde_json::from_slice(&resolved.stdout).unwrap();
    assert_eq!(row["resolution"], "acknowledge");
    let audit = oncely_sql::DiscrepancyStore::new(t.db.clone())
        .audit_trail(stranger)
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(
        (
            audit[0].actor.as_str(),
            audit[0].action.as_str(),
            audit[0].reason.as_str()
        ),
        ("ops@acme", "acknowledge", "a test charge")
    );
}

pub(crate) async fn reconcile_command_reports_as_json_and_table_and_resolve_writes_an_audit_row(
    t: TestDb,
) {
    // The order service's database: the command also reads its payments endpoint's charges.
    t.db.migrate().await.unwrap();
    let sim = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SK.into()],
        ..PaymentsConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, sim.router(), std::future::pending()));
    direct_charge(&base, "inv-cli-stranger", Some("ord-cli-stranger")).await;
    direct_charge(&base, "inv-cli-other", None).await;
    let ghost = ghost_charge(&t.db, "inv-cli-ghost").await;
    let oncely = |args: &[&str]| {
        oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .arg("reconcile")
            .args(args)
            .args(["--database-url", &t.url])
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let run_args = [
        "--provider",
        "payments",
        "--payments-url",
        &base,
        "--payments-secret-key",
        SK,
        "--since",
        "1h",
        "--page-limit",
        "1",
    ];
    let out = oncely(&[&run_args[..], &["--json"]].concat());
    assert_eq!(
        out.status.code(),
        Some(oncely_cli::EXIT_OPEN_DISCREPANCIES),
        "discrepancies are open: {out:?}"
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let expected: BTreeSet<(String, String)> = [
        ("missing_local", "inv-cli-other"),
        ("missing_local", "inv-cli-stranger"),
        ("missing_remote", "inv-cli-ghost"),
    ]
    .iter()
    .map(|(k, r)| ((*k).to_owned(), (*r).to_owned()))
    .collect();
    assert_eq!(kinds(&report), expected, "{report}");
    assert_eq!(report["run"]["pages"], 2, "two records in pages of one");
    let find = |kind: &str, reference: &str| {
        report["discrepancies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["kind"] == kind && d["reference"] == reference)
            .unwrap()
            .clone()
    };
    let missing_remote = find("missing_remote", "inv-cli-ghost");
    assert_eq!(missing_remote["effect_id"], ghost.as_str());
    assert_eq!(missing_remote["local_status"], "succeeded");
    // The charge no intent names still says which order it was for.
    let stranger = find("missing_local", "inv-cli-stranger");
    assert_eq!(stranger["business_ref"], "ord-cli-stranger");
    assert_eq!(
        find("missing_local", "inv-cli-other")["business_ref"],
        Value::Null
    );
    let stranger = stranger["id"].as_str().unwrap().to_owned();

    let table = oncely(&run_args);
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.status.code() == Some(oncely_cli::EXIT_OPEN_DISCREPANCIES)
            && text.contains(&format!(
                "{stranger}\tmissing_local\tinv-cli-stranger\tord-cli-stranger\t-"
            )),
        "{text}"
    );

    resolve_refuses_a_misfit_and_acknowledges(&t, &oncely, &stranger).await;

    let again = oncely(&[&run_args[..], &["--json"]].concat());
    let report: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(report["acknowledged"], 1);
    assert_eq!(
        kinds(&report),
        expected
            .into_iter()
            .filter(|(_, r)| r != "inv-cli-stranger")
            .collect(),
        "{report}"
    );
    assert_eq!(
        again.status.code(),
        Some(oncely_cli::EXIT_OPEN_DISCREPANCIES)
    );

    all_resolved_exits_0(&oncely, &report, &run_args);
}

/// Once every discrepancy of `report` is acknowledged, the run exits 0.
fn all_resolved_exits_0(
    oncely: &dyn Fn(&[&str]) -> std::process::Output,
    report: &Value,
    run_args: &[&str],
) {
    for d in report["discrepancies"].as_array().unwrap() {
        let id = d["id"].as_str().unwrap();
        let done = oncely(&["resolve", id, "--action", "acknowledge", "--reason", "seen"]);
        assert!(done.status.success(), "{done:?}");
    }
    let clean = oncely(&[run_args, &["--json"]].concat());
    let report: Value = serde_json::from_slice(&clean.stdout).unwrap();
    assert_eq!(kinds(&report), BTreeSet::new(), "{report}");
    assert_eq!(clean.status.code(), Some(0), "{clean:?}");
}
