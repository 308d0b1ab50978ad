//! The table of the metrics to alert on (docs/operating.md), against a running `orders serve`
//! (PostgreSQL, SQL transport, the payments and shipping simulators): every metric of the
//! table is on `/metrics` with `# HELP`, and each moves under the traffic that should move it
//! — a replay, a key reused with another body, a key still in flight, a missing key, an
//! invalid order, a business-key hit, a lock wait that runs out, a dead outbox event, a dead
//! inbox delivery, charges and shipments (one charge's answer dropped, so its outcome is
//! unknown until the status check finds it). The table is parsed from docs/operating.md, so
//! the two cannot drift. `/readyz` names the database, the broker and both providers, and
//! turns 503 naming the provider that went away.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use oncely_broker::Publisher as _;
use oncely_testkit::{TestBackend, TestDb};
use serde_json::{json, Value};

use super::{order, post, serve_with, sim, API_KEY};

/// The metric names of docs/operating.md's "metrics to alert on" table (its first column).
fn readme_metrics() -> Vec<String> {
    let readme = include_str!("../../../../../docs/operating.md");
    let section = readme
        .split("## Operating the service")
        .nth(1)
        .expect("docs/operating.md has the operating section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| name.starts_with("oncely_"))
        .map(str::to_owned)
        .collect()
}

/// `/metrics` as series (name with labels → value), and the names with `# HELP`.
async fn scrape(base: &str) -> (BTreeMap<String, f64>, BTreeSet<String>) {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut series = BTreeMap::new();
    let mut helped = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            if let Some(name) = rest.split(' ').next() {
                helped.insert(name.to_owned());
            }
        } else if !line.starts_with('#') {
            if let Some((s, v)) = line.rsplit_once(' ') {
                if let Ok(v) = v.parse::<f64>() {
                    series.insert(s.to_owned(), v);
                }
            }
        }
    }
    (series, helped)
}

/// The series of metric `name` (a histogram: its `_count`).
fn of(series: &BTreeMap<String, f64>, name: &str) -> BTreeMap<String, f64> {
    let count = format!("{name}_count");
    series
        .iter()
        .filter(|(s, _)| {
            let base = s.split('{').next().unwrap_or(s);
            base == name || base == count
        })
        .map(|(s, v)| (s.clone(), *v))
        .collect()
}

async fn post_raw(base: &str, key: Option<&str>, body: &Value) -> u16 {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/orders"))
        .bearer_auth(API_KEY)
        .json(body);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.send().await.unwrap().status().as_u16()
}

async fn readyz(base: &str) -> (u16, Value) {
    let res = reqwest::get(format!("{base}/readyz")).await.unwrap();
    (
        res.status().as_u16(),
        res.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn every_metric_of_the_readme_table_moves_on_a_running_serve() {
    let Some(t) = TestDb::new(TestBackend::Postgres).await else {
        return;
    };
    let table = readme_metrics();
    assert!(table.len() >= 15, "docs/operating.md table: {table:?}");
    let (_payments_sim, payments) = sim("payments", &["--search-lag-ms", "0"]);
    let (shipping_sim, shipping) = sim("shipping", &[]);
    let p = serve_with(
        &t.url,
        &[
            "--payments-url",
            &payments,
            "--payments-secret-key",
            "sk_test_oncely_sim",
            "--shipping-url",
            &shipping,
            "--runner-poll-ms",
            "20",
            "--runner-check-delay-ms",
            "200",
        ],
    );
    let (status, ready) = readyz(&p.base).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(
        ready["checks"],
        json!({"database": {"status": "ok", "backend": "postgres"},
               "broker": {"status": "ok", "backend": "sql"},
               "providers": {"payments": {"status": "ok"}, "shipping": {"status": "ok"}}})
    );
    let (before, _) = scrape(&p.base).await;
    drive(&t, &p.base, &payments).await;

    // Each metric of the table moves (gauges and counters alike: a series appears or its
    // value changes). The relay's and runner's gauges are sampled every few seconds.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut still = table.clone();
    let mut last = (BTreeMap::new(), BTreeSet::new());
    while !still.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        last = scrape(&p.base).await;
        still.retain(|name| of(&last.0, name) == of(&before, name));
    }
    assert!(still.is_empty(), "did not move within 60 s: {still:?}");
    let unhelped: Vec<&String> = table.iter().filter(|n| !last.1.contains(*n)).collect();
    assert!(unhelped.is_empty(), "no # HELP for {unhelped:?}");

    // A provider that went away: 503, and the body says which.
    drop(shipping_sim);
    let (status, ready) = readyz(&p.base).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["type"], "urn:oncely:problem:not-ready");
    assert_eq!(
        ready["checks"]["providers"]["shipping"]["status"],
        "unavailable"
    );
    assert_eq!(ready["checks"]["providers"]["payments"]["status"], "ok");
    assert_eq!(ready["checks"]["database"]["status"], "ok");
}

/// The traffic that moves each metric of the table.
async fn drive(t: &TestDb, base: &str, payments: &str) {
    let client = reqwest::Client::new();
    // The first charge's answer is dropped after the simulator committed it: its outcome is
    // unknown until the status check finds it.
    let armed = client
        .post(format!("{payments}/_sim/faults/next"))
        .json(&json!({"kind": "drop_after", "count": 1}))
        .send()
        .await
        .unwrap();
    assert!(armed.status().is_success());
    // An order (execution, creation, relay, billing, charge, shipment), its replay, the key
    // reused with another body, a second key for the same order (business key).
    assert_eq!(post(&client, base, "m-1", &order("m-1")).await.0, 201);
    let replay = post(&client, base, "m-1", &order("m-1")).await;
    assert_eq!((replay.0, replay.1), (201, true));
    assert_eq!(post(&client, base, "m-1", &order("m-other")).await.0, 422);
    assert_eq!(post(&client, base, "m-2", &order("m-1")).await.0, 200);
    // No key; an invalid order (rolled back, not stored).
    assert_eq!(post_raw(base, None, &order("m-3")).await, 400);
    let mut invalid = order("m-4");
    invalid["currency"] = json!("euro");
    assert_eq!(post_raw(base, Some("m-4"), &invalid).await, 422);
    in_flight_and_lock_timeout(t, base).await;
    dead_letters(t).await;
}

/// A key still in flight (409) and a lock wait that runs out (503 store-unavailable): the
/// `orders` table is locked from outside, so the first request holds its key while its insert
/// waits out the lock timeout (5 s) and a retry of the same key finds it in flight.
async fn in_flight_and_lock_timeout(t: &TestDb, base: &str) {
    let mut lock = t.db.begin().await.unwrap();
    lock.execute(oncely_sql::query("LOCK TABLE orders IN EXCLUSIVE MODE"))
        .await
        .unwrap();
    let first = tokio::spawn({
        let base = base.to_owned();
        async move { post_raw(&base, Some("m-5"), &order("m-5")).await }
    });
    let mut retry = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = post_raw(base, Some("m-5"), &order("m-5")).await;
        if retry == 409 {
            break;
        }
    }
    assert_eq!(retry, 409, "the retry finds its key in flight");
    assert_eq!(first.await.unwrap(), 503, "the lock wait runs out");
    drop(lock);
}

/// A dead outbox event (over the SQL transport's 1 MiB message bound: final at once) and a
/// dead inbox delivery (an `order.created` the billing consumer cannot decode).
async fn dead_letters(t: &TestDb) {
    let big = oncely_sql::OutboxEvent::new(
        oncely_core::MessageId::new_random(),
        "orders",
        "m-big",
        "order.big",
        vec![b'x'; 2 << 20],
    );
    let mut tx = t.db.begin().await.unwrap();
    oncely_sql::OutboxStore::enqueue(&mut tx, &big)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let transport = oncely_broker::SqlTransport::new(t.db.clone(), 1 << 20);
    let undecodable = oncely_broker::Message {
        id: oncely_core::MessageId::new_random(),
        topic: "orders".to_owned(),
        partition_key: "m-undecodable".to_owned(),
        event_type: orders::ORDER_CREATED.to_owned(),
        payload: b"{}".to_vec(),
        headers: BTreeMap::new(),
    };
    for r in transport.publish(&[undecodable]).await {
        r.unwrap();
    }
}
