//! The operator console over HTTP, on every backend: off without an admin token, sign-in
//! and its refusals, every page's queries against seeded rows, and each action — requeue
//! a dead letter, resolve an effect, acknowledge a discrepancy — with its CSRF check and
//! audit row. (The browser path is `apps/oncely`'s headless-Chromium test.)

use std::time::Duration;

use oncely_testkit::TestDb;
use reqwest::StatusCode;

use super::{config, order, start, unique, KEY_A};

pub(super) const ADMIN: &str = "console-admin-token-abcdef012345";

pub(super) fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// Signs in; returns the `Cookie` header value of the session.
pub(super) async fn sign_in(client: &reqwest::Client, base: &str) -> String {
    let res = client
        .post(format!("{base}/console/login"))
        .form(&[("token", ADMIN), ("name", "acceptance")])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    let set = res.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    set.split(';').next().unwrap().to_owned()
}

pub(super) async fn page(client: &reqwest::Client, base: &str, cookie: &str, path: &str) -> String {
    let res = client
        .get(format!("{base}{path}"))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK, "{path}");
    assert_eq!(res.headers()["content-type"], "text/html; charset=utf-8");
    res.text().await.unwrap()
}

/// The CSRF token in a page's forms.
pub(super) fn csrf(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("a form") + 19;
    html[at..at + html[at..].find('"').unwrap()].to_owned()
}

pub(super) async fn post(
    client: &reqwest::Client,
    base: &str,
    cookie: &str,
    path: &str,
    form: &impl serde::Serialize,
) -> (StatusCode, String) {
    let res = client
        .post(format!("{base}{path}"))
        .header("cookie", cookie)
        .form(form)
        .send()
        .await
        .unwrap();
    (res.status(), res.text().await.unwrap())
}

/// A dead `order.created` of the `billing` consumer on the SQL transport; its message id.
async fn dead_letter(t: &TestDb, order_id: &str) -> String {
    use oncely_broker::Publisher as _;
    let transport = oncely_broker::SqlTransport::new(t.db.clone(), 1 << 20);
    transport
        .subscribe("billing", "console-topic")
        .await
        .unwrap();
    let id = oncely_core::MessageId::new_random();
    let message = oncely_broker::Message {
        id,
        topic: "console-topic".to_owned(),
        partition_key: order_id.to_owned(),
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
    assert!(transport
        .dead(&d[0], "handler <b>failed</b>")
        .await
        .unwrap());
    id.to_string()
}

/// What the console reads through oncely's stores: idempotency records by state and saga
/// counts (`IdempotencyStore`, `SagaOperator`) on the overview; the order's outbox rows
/// (their idempotency key) and its dead delivery (`OutboxStore`, `QueueStore`) on its
/// lineage.
fn read_through_the_stores(overview: &str, lineage: &str, key: &str, message_id: &str) {
    assert!(overview.contains("id=\"count-idempotency-succeeded\">"));
    assert!(overview.contains("id=\"count-saga-steps-review\">0<"));
    assert!(
        lineage.contains(&format!("class=\"key\">{key}<")),
        "{lineage}"
    );
    assert!(lineage.contains(message_id), "the dead delivery: {lineage}");
}

/// A `missing_local` charge whose record names `order_id` (`metadata[order_id]`).
async fn open_discrepancy(t: &TestDb, order_id: &str) -> String {
    let store = oncely_sql::DiscrepancyStore::new(t.db.clone());
    let new = oncely_sql::NewDiscrepancy {
        provider: "payments".to_owned(),
        kind: oncely_sql::DiscrepancyKind::MissingLocal,
        reference: unique("pi"),
        tenant: None,
        effect_id: None,
        provider_ids: vec!["pi_console".to_owned()],
        details: serde_json::json!({"detail": "seen only at the provider", "business_ref": order_id}),
    };
    match store.record("run-console", &new, 3_000).await.unwrap() {
        oncely_sql::Recorded::New(d) => d.id,
        other => panic!("{other:?}"),
    }
}

/// Without an admin token `/console` is the service's 404; with one, the sign-in refuses a
/// tenant key (403) and a wrong token (401), a tenant key as bearer is a 403 problem.
pub(crate) async fn console_is_off_without_a_token_and_refuses_tenant_keys(t: TestDb) {
    let off = start(&t.db, config()).await;
    let client = no_redirects();
    let res = client
        .get(format!("{}/console", off.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    drop(off);
    let s = start(
        &t.db,
        orders::AppConfig {
            admin_token: Some(ADMIN.to_owned()),
            ..config()
        },
    )
    .await;
    let res = client
        .get(format!("{}/console", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER, "to the sign-in form");
    assert_eq!(res.headers()["location"], "/console/login");
    for (token, status) in [
        (KEY_A, StatusCode::FORBIDDEN),
        ("not-the-token-0123456789", StatusCode::UNAUTHORIZED),
    ] {
        let res = client
            .post(format!("{}/console/login", s.base))
            .form(&[("token", token)])
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), status);
        assert!(res.headers().get("set-cookie").is_none());
    }
    let res = client
        .get(format!("{}/console/review", s.base))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let res = client
        .get(format!("{}/console", s.base))
        .header("cookie", "oncely_console=1.b3Bz.x.forged")
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::SEE_OTHER,
        "a forged session is none"
    );
}

/// Every page renders the seeded rows (escaped), and each action runs once with its CSRF
/// token, is audited, and is refused without it.
pub(crate) async fn console_pages_show_seeded_rows_and_actions_are_csrf_checked_and_audited(
    t: TestDb,
) {
    let s = start(
        &t.db,
        orders::AppConfig {
            admin_token: Some(ADMIN.to_owned()),
            ..config()
        },
    )
    .await;
    let key = unique("k");
    let created = s.post(KEY_A, &key, &order(&unique("ext"), 700)).await;
    let order_id = created.id();
    let message_id = dead_letter(&t, &order_id).await;
    let effect_id = oncely_testkit::park_effect(&t.db, "tenant-a", &unique("inv")).await;
    let discrepancy_id = open_discrepancy(&t, &order_id).await;
    let client = no_redirects();
    let cookie = sign_in(&client, &s.base).await;

    let overview = page(&client, &s.base, &cookie, "/console").await;
    assert!(overview.contains("id=\"count-orders\">1<"), "{overview}");
    assert!(
        overview.contains("id=\"count-dead-billing\">1<"),
        "{overview}"
    );
    assert!(overview.contains("id=\"count-effects-payments-needs_review\">1<"));
    assert!(overview.contains("id=\"count-discrepancies-payments\">1<"));
    let stuck = page(&client, &s.base, &cookie, "/console/stuck").await;
    assert!(stuck.contains(&format!("id=\"stuck-{effect_id}\"")));
    let lineage = page(
        &client,
        &s.base,
        &cookie,
        &format!("/console/orders/{order_id}"),
    )
    .await;
    assert!(lineage.contains("order.created") && lineage.contains("700 EUR"));
    read_through_the_stores(&overview, &lineage, &key, &message_id);
    let dead = page(&client, &s.base, &cookie, "/console/dead-letters").await;
    assert!(dead.contains(&message_id));
    assert!(
        dead.contains("handler &lt;b&gt;failed&lt;/b&gt;"),
        "escaped"
    );
    let token = csrf(&dead);

    let requeue = [("consumer", "billing"), ("message_id", message_id.as_str())];
    let (status, body) = post(
        &client,
        &s.base,
        &cookie,
        "/console/dead-letters/requeue",
        &requeue,
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "no CSRF token: {body}");
    let with = |form: &[(&str, &str)]| {
        let mut f: Vec<(String, String)> = form
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        f.push(("csrf".to_owned(), token.clone()));
        f
    };
    let form = with(&requeue);
    let (status, body) = post(
        &client,
        &s.base,
        &cookie,
        "/console/dead-letters/requeue",
        &form,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = post(
        &client,
        &s.base,
        &cookie,
        "/console/dead-letters/requeue",
        &form,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "requeued already");
    let again = oncely_broker::SqlTransport::new(t.db.clone(), 1 << 20)
        .claim("billing", 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "pending again");
    let audit = oncely_sql::OperatorAudit::new(t.db.clone())
        .recent(Some(&format!("inbox:billing:{message_id}")), 10)
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].actor, "console:acceptance");

    let ids = (
        effect_id.as_str(),
        discrepancy_id.as_str(),
        order_id.as_str(),
    );
    resolve_and_acknowledge(&t, &s.base, &client, &cookie, &token, ids).await;
}

/// The effect resolved as failed (once; a second time is 409) and the discrepancy
/// acknowledged, both audited as the signed-in name; then sign-out.
async fn resolve_and_acknowledge(
    t: &TestDb,
    base: &str,
    client: &reqwest::Client,
    cookie: &str,
    token: &str,
    (effect_id, discrepancy_id, order_id): (&str, &str, &str),
) {
    let with = |form: &[(&str, &str)]| {
        let mut f: Vec<(String, String)> = form
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        f.push(("csrf".to_owned(), token.to_owned()));
        f
    };
    let review = page(client, base, cookie, "/console/review").await;
    assert!(review.contains(&format!("id=\"effect-{effect_id}\"")));
    let resolve = with(&[
        ("outcome", "failed"),
        ("reason", "declined at the provider"),
    ]);
    let path = format!("/console/effects/{effect_id}/resolve");
    let (status, body) = post(client, base, cookie, &path, &resolve).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = post(client, base, cookie, &path, &resolve).await;
    assert_eq!(status, StatusCode::CONFLICT, "resolved already");
    let effects = oncely_sql::EffectStore::new(t.db.clone());
    assert_eq!(
        effects.get(effect_id).await.unwrap().unwrap().state_word,
        "failed"
    );
    let trail = effects.audit_trail(effect_id).await.unwrap();
    assert!(
        trail
            .iter()
            .any(|r| r.1 == "console:acceptance" && r.2 == "resolve"),
        "{trail:?}"
    );

    let recon = page(client, base, cookie, "/console/reconciliation").await;
    assert!(recon.contains(discrepancy_id));
    // The charge no local intent names links to the order its record names.
    assert!(
        recon.contains(&format!(
            "<a href=\"/console/orders/{order_id}\">{order_id}</a>"
        )),
        "{recon}"
    );
    let ack = with(&[("action", "acknowledge"), ("reason", "known test charge")]);
    let path = format!("/console/discrepancies/{discrepancy_id}/resolve");
    let (status, body) = post(client, base, cookie, &path, &ack).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let store = oncely_sql::DiscrepancyStore::new(t.db.clone());
    let d = store.get(discrepancy_id).await.unwrap().unwrap();
    assert_eq!(d.resolution.as_deref(), Some("acknowledge"));
    assert_eq!(d.resolved_by.as_deref(), Some("console:acceptance"));

    let logout = with(&[]);
    let (status, _) = post(client, base, cookie, "/console/logout", &logout).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
}
