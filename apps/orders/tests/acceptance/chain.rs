//! An order's whole chain ([`orders::order_chain`]) on every backend, read from the durable
//! stores: after the outbox rows were published (the key is the order's own, the events
//! derived), under the choreography (charge and booking with their evidence, `status`
//! `fulfilled`) and under the saga (each step's effect: charge, refused booking, refund);
//! drawn by the console as a timeline, found by the console's tenant-scoped search, printed
//! by `orders show --json`; and the console's server-side sign-out.

use std::time::Duration;

use oncely_core::TenantId;
use oncely_testkit::TestDb;
use orders::{EffectPath, OrderChain, StepState};
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::console::{csrf, no_redirects, page, post, sign_in, ADMIN};
use super::flow::{sim_payments, start_sims, Flow, KEY_A};
use super::Sim;

oncely_testkit::matrix! {
    tests: [
        the_chain_after_publish_reads_key_events_deliveries_and_effects_from_durable_stores,
        the_console_draws_the_chain_and_its_search_stays_in_one_tenant,
        the_saga_chain_shows_every_steps_effect_with_its_evidence,
        sign_out_revokes_the_session_so_the_old_cookie_is_refused,
    ],
}

fn tenant(t: &str) -> TenantId {
    TenantId::parse(t).unwrap()
}

/// Waits (at most 30 s) until the relay published every outbox row of order `id` (the
/// relay deletes a row once its broker took it) and every delivery of them was
/// acknowledged.
async fn until_published(db: &oncely_sql::Database, id: &str) {
    let outbox = oncely_sql::OutboxStore::new(db.clone());
    let queue = oncely_sql::QueueStore::new(db.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let rows = outbox.partition(id).await.unwrap();
        let unacked = queue.partition_deliveries(id).await.unwrap();
        if unacked.is_empty()
            && rows
                .iter()
                .all(|r| r.state == oncely_sql::OutboxState::Published)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "outbox rows of {id} not published within 30 s: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A choreography order of tenant-a, paid and shipped, all its events published: the flow
/// and the simulators (to stop), and the order id.
async fn shipped_order(t: &TestDb, ext: &str) -> (Flow, [Sim; 2], String) {
    let (_pay, p_srv, _ship, s_srv) = start_sims().await;
    let flow = Flow::start(&t.db, sim_payments(&p_srv.base), &s_srv.base).await;
    let id = flow.order(KEY_A, ext).await;
    flow.wait_shipped(KEY_A, &id).await;
    until_published(&t.db, &id).await;
    (flow, [p_srv, s_srv], id)
}

fn is_sorted(chain: &OrderChain) -> bool {
    chain.timeline.windows(2).all(|w| w[0].at <= w[1].at)
}

async fn the_chain_after_publish_reads_key_events_deliveries_and_effects_from_durable_stores(
    t: TestDb,
) {
    let ext = super::unique("chain");
    let (flow, _sims, id) = shipped_order(&t, &ext).await;
    let (_, got) = flow.get(KEY_A, &id).await;
    assert_eq!(got["status"], "fulfilled", "paid and shipped: {got}");
    // The service's own outbox rows and idempotency record may go: the chain holds without.
    let chain = orders::order_chain(&t.db, &tenant("tenant-a"), &id)
        .await
        .unwrap()
        .expect("the order");
    let key = format!("k-{ext}");
    assert_eq!(chain.order.idempotency_key.as_deref(), Some(key.as_str()));
    assert_eq!(chain.order.status, "fulfilled");
    let record = chain
        .record
        .as_ref()
        .expect("the record, within its retention");
    assert_eq!(
        (record.state, record.response_status),
        ("succeeded", Some(201))
    );
    let events: Vec<(&str, &str)> = chain
        .events
        .iter()
        .map(|e| (e.event_type.as_str(), e.state.as_str()))
        .collect();
    assert_eq!(
        events,
        [
            ("order.created", "published"),
            ("invoice.paid", "published")
        ],
        "{chain:#?}"
    );
    let received: Vec<&str> = chain
        .deliveries
        .iter()
        .filter(|d| d.state == "processed")
        .map(|d| d.consumer.as_str())
        .collect();
    assert!(received.contains(&orders::BILLING_CONSUMER), "{chain:#?}");
    assert!(received.contains(&orders::SHIPPING_CONSUMER), "{chain:#?}");
    assert_eq!(chain.invoices.len(), 1);
    let effects: Vec<(EffectPath, &str, &str)> = chain
        .effects
        .iter()
        .map(|e| (e.path, e.operation.as_str(), e.state.as_str()))
        .collect();
    assert_eq!(
        effects,
        [
            (EffectPath::Choreography, "charge", "succeeded"),
            (EffectPath::Choreography, "book", "succeeded"),
        ]
    );
    assert!(
        chain.effects.iter().all(|e| !e.evidence.is_empty()),
        "each call recorded: {chain:#?}"
    );
    assert!(is_sorted(&chain));
    assert!(
        chain.timeline.iter().all(|s| s.state == StepState::Done),
        "{:#?}",
        chain.timeline
    );
    // Another tenant has no such order.
    assert!(orders::order_chain(&t.db, &tenant("tenant-b"), &id)
        .await
        .unwrap()
        .is_none());
    show_json_prints_the_same_chain(&t, &id, &chain).await;
    flow.stop().await;
}

/// `orders show ID --tenant T --json` prints the chain [`orders::order_chain`] reads; for
/// another tenant it exits 1.
async fn show_json_prints_the_same_chain(t: &TestDb, id: &str, chain: &OrderChain) {
    let run = |tenant: &str| {
        let (url, id, tenant) = (t.url.clone(), id.to_owned(), tenant.to_owned());
        tokio::task::spawn_blocking(move || {
            oncely_testkit::process::command(env!("CARGO_BIN_EXE_orders"))
                .args(["show", &id, "--tenant", &tenant, "--json"])
                .args(["--database-url", &url])
                .output()
                .unwrap()
        })
    };
    let out = run("tenant-a").await.unwrap();
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown, serde_json::to_value(chain).unwrap());
    assert_eq!(shown["order"]["status"], "fulfilled");
    let at = shown["timeline"][0]["at"].as_str().unwrap();
    assert!(
        at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "RFC 3339: {at}"
    );
    let other = run("tenant-b").await.unwrap();
    assert_eq!(other.status.code(), Some(1), "{other:?}");
    assert!(other.stdout.is_empty());
}

async fn the_console_draws_the_chain_and_its_search_stays_in_one_tenant(t: TestDb) {
    let ext = super::unique("drawn");
    let (flow, _sims, id) = shipped_order(&t, &ext).await;
    let s = super::start(
        &t.db,
        orders::AppConfig {
            admin_token: Some(ADMIN.to_owned()),
            ..super::config()
        },
    )
    .await;
    let client = no_redirects();
    let cookie = sign_in(&client, &s.base).await;
    let html = page(&client, &s.base, &cookie, &format!("/console/orders/{id}")).await;
    let key = format!("k-{ext}");
    assert!(html.contains(&format!("class=\"key\">{key}<")), "{html}");
    assert!(html.contains("id=\"status\">fulfilled<"), "{html}");
    for title in [
        "event order.created",
        "event invoice.paid",
        "choreography: payments/charge",
    ] {
        assert!(html.contains(title), "{title}: {html}");
    }
    assert!(html.contains("class=\"step done\""), "{html}");
    assert!(
        html.contains("<details><summary>Evidence</summary>"),
        "{html}"
    );
    assert!(!html.contains("<script"), "no script");
    for q in [id.clone(), ext.clone(), key.clone()] {
        let search = |tenant: &str| format!("/console/orders?tenant={tenant}&q={q}");
        let hits = page(&client, &s.base, &cookie, &search("tenant-a")).await;
        assert!(
            hits.contains(&format!("/console/orders/{id}?tenant=tenant-a")),
            "{q}: {hits}"
        );
        let foreign = page(&client, &s.base, &cookie, &search("tenant-b")).await;
        assert!(foreign.contains("id=\"no-hits\""), "{q}: {foreign}");
        assert!(
            !foreign.contains(&format!("/console/orders/{id}")),
            "{q}: {foreign}"
        );
    }
    let res = client
        .get(format!("{}/console/orders/{id}?tenant=tenant-b", s.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::NOT_FOUND,
        "another tenant's order"
    );
    flow.stop().await;
}

async fn the_saga_chain_shows_every_steps_effect_with_its_evidence(t: TestDb) {
    use super::fulfilment::{Saga, SagaOptions, KEY_A as SAGA_KEY};
    let s = Saga::start_opts(&t.db, SagaOptions::default()).await;
    s.set_stock(SAGA_KEY, "sku-1", 5).await;
    s.set_stock(SAGA_KEY, "sku-fragile", 2).await;
    let items = json!([{"sku": "sku-1", "quantity": 1}, {"sku": "sku-fragile", "quantity": 1}]);
    let id = s.order(SAGA_KEY, &super::unique("saga"), items, None).await;
    s.until(SAGA_KEY, &id, "rejected").await;
    until_published(&t.db, &id).await;
    let chain = orders::order_chain(&t.db, &tenant("tenant-a"), &id)
        .await
        .unwrap()
        .expect("the order");
    assert_eq!(chain.order.status, "rejected");
    assert_eq!(chain.sagas.len(), 1);
    assert_eq!(chain.sagas[0].state, "compensated");
    let effects: Vec<(EffectPath, &str, &str)> = chain
        .effects
        .iter()
        .map(|e| (e.path, e.operation.as_str(), e.state.as_str()))
        .collect();
    assert_eq!(
        effects,
        [
            (EffectPath::Saga, "charge", "succeeded"),
            (EffectPath::Saga, "book", "failed"),
            (EffectPath::Saga, "refund", "succeeded"),
        ],
        "{chain:#?}"
    );
    assert!(chain.effects.iter().all(|e| !e.evidence.is_empty()));
    let states: Vec<(&str, StepState)> = chain
        .timeline
        .iter()
        .filter(|s| s.kind == "effect" || s.kind == "saga")
        .map(|s| (s.title.as_str(), s.state))
        .collect();
    assert!(
        states.contains(&("saga step ship: shipping/book", StepState::Failed)),
        "{states:?}"
    );
    assert!(states.contains(&("saga step charge: payments/refund", StepState::Done)));
    assert!(is_sorted(&chain));
    let events: Vec<&str> = chain.events.iter().map(|e| e.state.as_str()).collect();
    assert_eq!(events, ["published"], "order.created, after publication");
}

async fn sign_out_revokes_the_session_so_the_old_cookie_is_refused(t: TestDb) {
    let s = super::start(
        &t.db,
        orders::AppConfig {
            admin_token: Some(ADMIN.to_owned()),
            ..super::config()
        },
    )
    .await;
    let client = no_redirects();
    let cookie = sign_in(&client, &s.base).await;
    let other = sign_in(&client, &s.base).await;
    let overview = page(&client, &s.base, &cookie, "/console").await;
    let token = csrf(&overview);
    let (status, _) = post(
        &client,
        &s.base,
        &cookie,
        "/console/logout",
        &[("csrf", &token)],
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    for path in ["/console", "/console/orders"] {
        let res = client
            .get(format!("{}{path}", s.base))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(
            res.status(),
            StatusCode::SEE_OTHER,
            "{path}: the old cookie"
        );
        assert_eq!(res.headers()["location"], "/console/login");
    }
    let (status, _) = post(
        &client,
        &s.base,
        &cookie,
        "/console/logout",
        &[("csrf", &token)],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "a revoked session cannot act"
    );
    // Another instance on the same database refuses it too; another session still holds.
    let second = super::start(
        &t.db,
        orders::AppConfig {
            admin_token: Some(ADMIN.to_owned()),
            ..super::config()
        },
    )
    .await;
    let res = client
        .get(format!("{}/console", second.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    page(&client, &second.base, &other, "/console").await;
}
