//! A 64-way burst of one key reaches the upstream once: over two gateway instances (each
//! its own pool and replay cache) on one PostgreSQL or MariaDB database, and over one
//! instance on SQLite.

use futures_util::future::join_all;
use oncely_sql::{Database, DbOptions};
use oncely_testkit::TestBackend;
use serde_json::{json, Value};

use crate::support::{gateway, orders_route, post, test_db, Gateway, Upstream, KEY_A};

const BURST: usize = 64;

/// Sends [`BURST`] requests with one key, spread over `gateways`, while the upstream takes
/// 300 ms over the first; then checks one row, and that every answer is the one order
/// (201, first or replayed) or 409 in flight.
async fn burst(up: &Upstream, gateways: &[Gateway]) {
    up.fault("slow:0.3").await;
    let body = json!({"external_ref": "burst", "amount_minor": 500});
    let answers = join_all((0..BURST).map(|i| {
        let base = gateways[i % gateways.len()].base.clone();
        let body = body.clone();
        async move {
            let res = post(&base, "/orders", KEY_A, Some("burst-key"), &body).await;
            let status = res.status().as_u16();
            (status, res.json::<Value>().await.unwrap())
        }
    }))
    .await;
    let mut ids = Vec::new();
    for (status, v) in &answers {
        match status {
            201 => ids.push(v["id"].clone()),
            409 => assert_eq!(v["type"], "urn:oncely:problem:request-in-flight"),
            other => panic!("unexpected {other}: {v}"),
        }
    }
    assert!(!ids.is_empty(), "the first request is answered");
    assert!(ids.iter().all(|id| *id == ids[0]), "one order: {ids:?}");
    println!(
        "burst over {} gateway(s): {} × 201, {} × 409",
        gateways.len(),
        ids.len(),
        BURST - ids.len()
    );
    assert_eq!(up.count().await, 1, "the upstream was reached once");
    // Every later request gets the one order.
    for g in gateways {
        let res = post(&g.base, "/orders", KEY_A, Some("burst-key"), &body).await;
        assert_eq!(res.status(), 201);
        assert_eq!(res.json::<Value>().await.unwrap()["id"], ids[0]);
    }
}

/// Two instances on one server database: two pools of 2 (PostgreSQL allows 100 in all).
async fn two_instances(backend: TestBackend) {
    let Some(first) = test_db(backend, 2).await else {
        return;
    };
    let options = DbOptions {
        max_connections: 2,
        ..DbOptions::default()
    };
    let second = Database::connect(&first.url, &options).await.unwrap();
    let up = Upstream::start();
    let gateways = [
        gateway(&first.db, &up.base, vec![orders_route()]).await,
        gateway(&second, &up.base, vec![orders_route()]).await,
    ];
    burst(&up, &gateways).await;
}

#[tokio::test]
async fn a_burst_of_one_key_over_two_gateways_on_postgres_reaches_the_upstream_once() {
    two_instances(TestBackend::Postgres).await;
}

#[tokio::test]
async fn a_burst_of_one_key_over_two_gateways_on_mariadb_reaches_the_upstream_once() {
    two_instances(TestBackend::MySql).await;
}

#[tokio::test]
async fn a_burst_of_one_key_on_sqlite_reaches_the_upstream_once() {
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let up = Upstream::start();
    let gateways = [gateway(&db.db, &up.base, vec![orders_route()]).await];
    burst(&up, &gateways).await;
}
