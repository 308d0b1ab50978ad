//! The global invariant of a crash test, read from the database and counted at the
//! simulators once the flow has settled.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use oncely_testkit::TestDb;

use super::super::stats;
use super::drive::Client;

/// What the invariant looks at, read at one moment.
#[derive(Debug, Default, PartialEq)]
struct Snapshot {
    /// Orders per external reference of the client's operations.
    orders: BTreeMap<String, i64>,
    /// Invoices per order (the billing consumer's work; choreography only).
    invoices: BTreeMap<String, i64>,
    /// Effects: (provider, reference) → state.
    effects: BTreeMap<(String, String), String>,
    /// The endpoint's payments: order → state (payment flow only).
    payments: BTreeMap<String, String>,
    /// Outbox rows not published.
    outbox_pending: i64,
    /// Idempotency records `processing` or `unknown`.
    records_open: i64,
}

/// Waits (within `bound`) until the flow has settled, then checks the invariant: one
/// order per key, one invoice per order, one effect of each provider per order, every
/// effect succeeded with exactly one live object at its provider (and no other object
/// for its reference), every endpoint payment charged once, nothing pending in the outbox,
/// no idempotency record left `processing` or `unknown`.
pub(super) async fn settled(
    t: &TestDb,
    client: &Client,
    payments: &str,
    shipping: &str,
    bound: Duration,
) {
    let deadline = Instant::now() + bound;
    let mut snap = snapshot(t, client).await;
    while !done(client, &snap) {
        assert!(
            Instant::now() < deadline,
            "not settled within {bound:?}: {snap:#?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        snap = snapshot(t, client).await;
    }
    for (ext, n) in &snap.orders {
        assert_eq!(*n, 1, "orders of {ext}");
    }
    let pay = stats(payments).await;
    let ship = stats(shipping).await;
    for ((provider, reference), state) in &snap.effects {
        let (total, live) = at_provider(&pay, &ship, provider, reference);
        assert_eq!(
            (state.as_str(), total, live),
            ("succeeded", 1, 1),
            "{provider} {reference}: state, objects at the provider, live ones"
        );
    }
    for (order, state) in &snap.payments {
        let reference = format!("order:{order}:payment");
        let (total, live) = at_provider(&pay, &ship, "payments", &reference);
        assert_eq!(
            (state.as_str(), total, live),
            ("succeeded", 1, 1),
            "the endpoint's payment of {order}"
        );
    }
}

/// `true` once every order, invoice, effect and payment the flow makes exists and has
/// ended, and nothing is left pending.
fn done(client: &Client, snap: &Snapshot) -> bool {
    let n = client.external_refs().count();
    let ended = |s: &String| s == "succeeded" || s == "failed" || s == "needs_review";
    let per_provider = |p: &str| snap.effects.keys().filter(|(q, _)| q == p).count();
    let flow_done = if client.pays() {
        snap.payments.len() == n
            && snap
                .payments
                .values()
                .all(|s| s != "charging" && s != "unknown")
    } else {
        snap.invoices_or_saga(n)
            && per_provider("payments") == n
            && per_provider("shipping") == n
            && snap.effects.values().all(ended)
    };
    snap.orders.len() == n && flow_done && snap.outbox_pending == 0 && snap.records_open == 0
}

impl Snapshot {
    /// The choreography's invoices (one per order), or none at all under the saga (which
    /// keeps no invoice table rows).
    fn invoices_or_saga(&self, n: usize) -> bool {
        self.invoices.is_empty()
            || (self.invoices.len() == n && self.invoices.values().all(|c| *c == 1))
    }
}

/// (objects, live objects) for `reference` at `provider`'s simulator.
fn at_provider(
    pay: &serde_json::Value,
    ship: &serde_json::Value,
    provider: &str,
    reference: &str,
) -> (u64, u64) {
    let (c, live) = if provider == "payments" {
        (
            &pay["payment_intents_by_metadata"]["invoice_id"][reference],
            "succeeded",
        )
    } else {
        (&ship["by_merchant_reference"][reference], "booked")
    };
    (
        c["total"].as_u64().unwrap_or(0),
        c[live].as_u64().unwrap_or(0),
    )
}

async fn snapshot(t: &TestDb, client: &Client) -> Snapshot {
    let b = t.db.backend();
    let mut snap = Snapshot::default();
    for ext in client.external_refs() {
        let n = count(
            t,
            oncely_sql::query("SELECT COUNT(*) FROM orders WHERE external_ref = $1").bind(ext),
        )
        .await;
        if n > 0 {
            snap.orders.insert(ext.to_owned(), n);
        }
    }
    let ids = client.order_ids();
    let invoices: Vec<(String,)> =
        t.db.fetch_all(oncely_sql::query("SELECT order_id FROM invoices"))
            .await
            .unwrap();
    for (order,) in invoices.into_iter().filter(|(o,)| ids.contains(o)) {
        *snap.invoices.entry(order).or_default() += 1;
    }
    let effects: Vec<(String, String, String)> =
        t.db.fetch_all(oncely_sql::query(format!(
            "SELECT {}, {}, state FROM oncely_effects",
            b.text_column("provider"),
            b.text_column("reference")
        )))
        .await
        .unwrap();
    for (provider, reference, state) in effects {
        let prev = snap
            .effects
            .insert((provider.clone(), reference.clone()), state);
        assert!(prev.is_none(), "two effects of {provider} for {reference}");
    }
    if client.pays() {
        let rows: Vec<(String, String)> =
            t.db.fetch_all(oncely_sql::query(
                "SELECT order_id, state FROM order_payments",
            ))
            .await
            .unwrap();
        snap.payments = rows.into_iter().collect();
    }
    snap.outbox_pending = count(
        t,
        oncely_sql::query("SELECT COUNT(*) FROM oncely_outbox WHERE state <> 'published'"),
    )
    .await;
    snap.records_open = count(
        t,
        oncely_sql::query(
            "SELECT COUNT(*) FROM oncely_idempotency WHERE state IN ('processing', 'unknown')",
        ),
    )
    .await;
    snap
}

/// The one number `query` (a `COUNT(*)`) reads.
async fn count(t: &TestDb, query: oncely_sql::Query) -> i64 {
    let rows: Vec<(i64,)> = t.db.fetch_all(query).await.unwrap();
    rows.first().map_or(0, |(n,)| *n)
}

/// Exactly one discrepancy recorded for `reference`, open: a reconcile run that crashed
/// between reading the provider and writing did not record it twice.
pub(super) async fn one_open_discrepancy(t: &TestDb, reference: &str) {
    let rows: Vec<(String, Option<i64>)> =
        t.db.fetch_all(
            oncely_sql::query(format!(
                "SELECT {}, resolved_at FROM oncely_discrepancies WHERE reference = $1",
                t.db.backend().text_column("kind")
            ))
            .bind(reference),
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "discrepancies of {reference}: {rows:?}");
    assert!(rows[0].1.is_none(), "{reference}: {rows:?}");
}
