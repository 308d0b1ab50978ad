//! `orders import` (S8, the manual fallback) on every backend: a file imported twice
//! and an overlapping file give each order once — counted in the database and through
//! `GET /v1/orders` — each with exactly one `order.created` event; a conflicting line is
//! reported and not applied; an invalid line is reported with its number and the rest is
//! still imported. Both paths: in-process on `--database-url`, and `--url` to `orders serve`.

use std::process::Output;

use oncely_testkit::TestDb;
use serde_json::Value;

use super::{serve_with, API_KEY, API_KEY_B};

oncely_testkit::matrix! {
    tests: [
        import_twice_and_overlapping_gives_each_order_once_and_reports_every_line,
        a_line_with_a_duplicate_member_or_a_byte_that_is_not_utf8_is_invalid_and_the_rest_imported,
    ],
}

fn line(external_ref: &str, amount: i64) -> String {
    format!(
        r#"{{"source":"import","external_ref":"{external_ref}","customer_id":"c-1","items":[{{"sku":"s-1","quantity":1}}],"amount_minor":{amount},"currency":"EUR"}}"#
    )
}

/// Runs `orders import FILE --tenant cli --json` with `extra`; the per-line reports
/// by line number, the summary, the exit code.
async fn import(db_url: &str, file: &std::path::Path, extra: &[&str]) -> (Vec<Value>, Value, i32) {
    let (db_url, file) = (db_url.to_owned(), file.to_owned());
    let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
    let out: Output = tokio::task::spawn_blocking(move || {
        oncely_testkit::process::command(super::ORDERS)
            .arg("import")
            .arg(&file)
            .args(["--tenant", "cli", "--json", "--database-url", &db_url])
            .args(&extra)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.stderr.is_empty() || !String::from_utf8_lossy(&out.stderr).contains('\u{1b}'),
        "no progress bar when stderr is not a terminal"
    );
    let mut lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
        .collect();
    let summary = lines.pop().expect("a summary")["summary"].clone();
    (lines, summary, out.status.code().unwrap_or(-1))
}

fn outcomes(lines: &[Value]) -> Vec<(u64, String)> {
    lines
        .iter()
        .map(|l| {
            (
                l["line"].as_u64().unwrap(),
                l["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn scalar(t: &TestDb, sql: &str) -> i64 {
    oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(p)
        .await)
    .unwrap()
}

async fn import_twice_and_overlapping_gives_each_order_once_and_reports_every_line(t: TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.ndjson");
    let keyed = line("r-3", 300).replacen('{', r#"{"key":"client-key-r3","#, 1);
    std::fs::write(
        &first,
        format!("{}\n{}\n\n{keyed}\n", line("r-1", 100), line("r-2", 200)),
    )
    .unwrap();
    let (lines, summary, code) = import(&t.url, &first, &[]).await;
    assert_eq!(code, 0, "{lines:?}");
    assert_eq!(
        outcomes(&lines),
        [
            (1, "created".into()),
            (2, "created".into()),
            (4, "created".into())
        ]
    );
    assert_eq!(summary["created"], 3);
    // The same file again: nothing new.
    let (lines, summary, code) = import(&t.url, &first, &[]).await;
    assert_eq!(code, 0);
    assert!(
        lines.iter().all(|l| l["outcome"] == "existing"),
        "{lines:?}"
    );
    assert_eq!(summary["existing"], 3);

    // An overlapping file: r-2 with its members in another order (the same canonical
    // content, so the same derived key), r-1 with other content (the business key's
    // conflict), a new r-4, an invalid currency, a line that is not JSON, and r-3 again.
    let reordered = r#"{"currency":"EUR","amount_minor":200,"items":[{"quantity":1,"sku":"s-1"}],"customer_id":"c-1","external_ref":"r-2","source":"import"}"#;
    let overlapping = dir.path().join("overlapping.ndjson");
    let invalid = line("r-5", 500).replace("EUR", "eur");
    std::fs::write(
        &overlapping,
        format!(
            "{reordered}\n{}\n{}\n{invalid}\n{{not json\n{keyed}\n",
            line("r-1", 999),
            line("r-4", 400)
        ),
    )
    .unwrap();
    let (lines, summary, code) = import(&t.url, &overlapping, &[]).await;
    assert_eq!(code, 1, "a conflict or an invalid line is a failing exit");
    assert_eq!(
        outcomes(&lines),
        [
            (1, "existing".into()),
            (2, "conflict".into()),
            (3, "created".into()),
            (4, "invalid".into()),
            (5, "invalid".into()),
            (6, "existing".into()),
        ]
    );
    assert_eq!(summary["created"], 1);
    assert_eq!(summary["conflict"], 1);
    assert_eq!(summary["invalid"], 2);

    each_order_once_with_one_event(&t).await;

    // Through the running service: the same file over HTTP creates nothing, and the list
    // counts four orders.
    let p = serve_with(&t.url, &["--no-relay"]);
    let (lines, summary, code) = import(
        &t.url,
        &overlapping,
        &["--url", &p.base, "--api-key", API_KEY],
    )
    .await;
    assert_eq!(code, 1);
    assert_eq!(summary["created"], 0, "{lines:?}");
    assert_eq!(summary["existing"], 3, "r-2, r-4 and r-3");
    assert_eq!(summary["conflict"], 1);
    let list: Value = reqwest::Client::new()
        .get(format!("{}/v1/orders?limit=100&source=import", p.base))
        .bearer_auth(API_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["total"], 4, "{list}");
    assert_eq!(list["orders"].as_array().unwrap().len(), 4);
    another_tenant_than_the_keys_is_refused(&t, &p.base, &overlapping).await;
    assert_eq!(
        scalar(
            &t,
            "SELECT COUNT(*) FROM oncely_outbox WHERE event_type = 'order.created'"
        )
        .await,
        4
    );
}

/// The API refuses a body with a duplicate member (400 `malformed-json`), so the import
/// does too, rather than store the last value; a line that is not UTF-8 is that line's
/// report, not the end of the import.
async fn a_line_with_a_duplicate_member_or_a_byte_that_is_not_utf8_is_invalid_and_the_rest_imported(
    t: TestDb,
) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.ndjson");
    let duplicate = line("d-1", 100).replacen(
        r#""currency":"EUR"}"#,
        r#""currency":"EUR","amount_minor":999999}"#,
        1,
    );
    let mut not_utf8 = line("d-2", 200).into_bytes();
    not_utf8[5] = 0xff; // inside `"source"`
    let mut bytes = format!("{duplicate}\n").into_bytes();
    bytes.extend(not_utf8);
    bytes.extend(format!("\n{}\n", line("d-3", 300)).as_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let (lines, summary, code) = import(&t.url, &file, &[]).await;
    assert_eq!(code, 1, "an invalid line is a failing exit");
    assert_eq!(
        outcomes(&lines),
        [
            (1, "invalid".into()),
            (2, "invalid".into()),
            (3, "created".into())
        ],
        "{lines:?}"
    );
    let detail = |i: usize| lines[i]["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail(0).contains("duplicate member"), "{}", detail(0));
    assert!(detail(1).contains("not UTF-8"), "{}", detail(1));
    assert_eq!(summary["created"], 1);
    assert_eq!(summary["invalid"], 2);
    assert_eq!(scalar(&t, "SELECT COUNT(*) FROM orders").await, 1);
    assert_eq!(
        scalar(
            &t,
            "SELECT COUNT(*) FROM orders WHERE amount_minor = 999999"
        )
        .await,
        0,
        "the duplicate's last value was not stored"
    );
}

/// Four orders, r-1 as first imported, one `order.created` event each.
async fn each_order_once_with_one_event(t: &TestDb) {
    // In the database: each order once, r-1 unchanged, one order.created event each.
    assert_eq!(scalar(t, "SELECT COUNT(*) FROM orders").await, 4);
    assert_eq!(
        scalar(
            t,
            "SELECT amount_minor FROM orders WHERE external_ref = 'r-1'"
        )
        .await,
        100,
        "the conflicting line was not applied"
    );
    assert_eq!(
        scalar(
            t,
            "SELECT COUNT(*) FROM oncely_outbox WHERE event_type = 'order.created'"
        )
        .await,
        4
    );
    assert_eq!(
        scalar(
            t,
            "SELECT COUNT(DISTINCT partition_key) FROM oncely_outbox WHERE partition_key IN \
             (SELECT id FROM orders)"
        )
        .await,
        4,
        "one event per order"
    );
}

/// `--url` with `--tenant` other than the API key's (`cli-b`'s key, `--tenant cli`): refused
/// before any line is sent, naming both tenants; the other tenant has no orders after it.
async fn another_tenant_than_the_keys_is_refused(t: &TestDb, base: &str, file: &std::path::Path) {
    let (url, file, base) = (t.url.clone(), file.to_owned(), base.to_owned());
    let out: Output = tokio::task::spawn_blocking(move || {
        oncely_testkit::process::command(super::ORDERS)
            .arg("import")
            .arg(&file)
            .args(["--tenant", "cli", "--json", "--database-url", &url])
            .args(["--url", &base, "--api-key", API_KEY_B])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(r#"belongs to tenant "cli-b", not --tenant "cli""#),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "no line reported");
    let total = scalar(t, "SELECT COUNT(*) FROM orders WHERE tenant = 'cli-b'").await;
    assert_eq!(total, 0);
}
