//! The fulfilment saga as processes under fire (issue 18's 1,000-order run).
//!
//! `orders serve --fulfilment saga` takes the orders, the stock (`PUT /v1/stock/{sku}`) and
//! the cancels; separate `oncely relay`, `orders consume fulfilment` and `orders effects run
//! --fulfilment saga` processes (two of each) carry the sagas to the payments and shipping
//! simulators (`oncely sim …`, every fault at 5%, on calls and compensations alike) and are
//! SIGKILLed at random and restarted throughout. The orders mix a plain line, a scarce SKU
//! (some out of stock), a declined card, an undeliverable SKU (422 at the pivot) and a
//! cancel at a random moment. At the end each order is fulfilled (stock consumed once, one
//! live charge, one live shipment, one invoice) or compensated (stock restored, the charge
//! refunded or never made, no live shipment), or its saga waits in `needs_review` with
//! evidence; never charged without stock, never refunded and shipped.
//!
//! `…_runner_aborted_after_every_provider_call_…` (every backend): the crash at the exact
//! step boundary. The effects runner process aborts right after each provider call of a
//! saga step (the charge, the shipment booking that is the pivot, a refund, a cancelled
//! booking) returns and before its outcome is recorded, and is restarted; every step is then
//! settled from a status check after the lease, never by a second call.
//!
//! Knobs: `ONCELY_SAGA_CHAOS_ORDERS` (1000 on every backend), `ONCELY_CHAOS_KILLS` (at least this many SIGKILLs, 30), `ONCELY_CHAOS_SEED`,
//! `ONCELY_CHAOS_FAULT_RATE` (0.05).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncely_testkit::{TestBackend, TestDb};
use serde_json::{json, Value};

use super::chaos::{chaos_dir, faults, provider_args, strings, strs, Slot};
use super::{env_u64, serve_with, sim, stats, Rng, API_KEY};

oncely_testkit::matrix! {
    tests: [sagas_whose_runner_is_aborted_after_every_provider_call_end_fulfilled_or_compensated],
    cannot_apply: [],
}

/// A SKU the shipping simulator refuses for good.
const FRAGILE: &str = "sku-fragile";
/// Units of the scarce SKU: fewer than the orders that ask for it.
fn scarce_units(n: u64) -> i64 {
    i64::try_from(n / 20).unwrap_or(1).max(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_one_thousand_sagas_through_processes_sigkilled_at_random_end_fulfilled_or_compensated(
) {
    if let Some(t) = TestDb::new(TestBackend::Postgres).await {
        saga_orders(t, 1000).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_one_thousand_sagas_through_processes_sigkilled_at_random_end_fulfilled_or_compensated(
) {
    if let Some(t) = TestDb::new(TestBackend::MySql).await {
        saga_orders(t, 1000).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_one_thousand_sagas_through_processes_sigkilled_at_random_end_fulfilled_or_compensated(
) {
    if let Some(t) = TestDb::new(TestBackend::Sqlite).await {
        saga_orders(t, 1000).await;
    }
}

/// What order `i` is made to meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    Plain,
    Scarce,
    Declined,
    Fragile,
    Cancelled,
}

fn plan(rng: &mut Rng) -> Plan {
    match rng.below(100) {
        0..=64 => Plan::Plain,
        65..=76 => Plan::Scarce,
        77..=84 => Plan::Declined,
        85..=92 => Plan::Fragile,
        _ => Plan::Cancelled,
    }
}

fn body(i: usize, plan: Plan) -> Value {
    let mut items = vec![json!({"sku": "sku-a", "quantity": 1})];
    match plan {
        Plan::Scarce => items.push(json!({"sku": "sku-b", "quantity": 1})),
        Plan::Fragile => items.push(json!({"sku": FRAGILE, "quantity": 1})),
        _ => {}
    }
    let mut b = json!({"source": "saga-chaos", "external_ref": format!("sc-{i:05}"),
        "customer_id": "c", "items": items, "amount_minor": 1000, "currency": "EUR"});
    if plan == Plan::Declined {
        b["payment_method"] = "pm_card_chargeDeclined".into();
    }
    b
}

/// Sends `req` until it has an answer below 500 (not 409-in-flight / 429); its status and
/// body.
async fn until_answered(req: impl Fn() -> reqwest::RequestBuilder) -> (u16, Value) {
    loop {
        if let Ok(res) = req().send().await {
            let code = res.status().as_u16();
            let in_flight = code == 409 && res.headers().contains_key("retry-after");
            if code < 500 && code != 429 && !in_flight {
                return (code, res.json().await.unwrap_or(Value::Null));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Posts the orders at 16 at a time (each retried with its key until answered) and cancels
/// the ones planned so after 0–1.5 s; their ids.
async fn post_orders(
    base: String,
    plans: Vec<Plan>,
    seed: u64,
    done: Arc<AtomicUsize>,
) -> Vec<String> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let n = plans.len();
    let plans = Arc::new(plans);
    let next = Arc::new(AtomicUsize::new(0));
    let ids = Arc::new(std::sync::Mutex::new(vec![String::new(); n]));
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..16u64 {
        let (client, base, next, done) = (client.clone(), base.clone(), next.clone(), done.clone());
        let (plans, ids) = (plans.clone(), ids.clone());
        workers.spawn(async move {
            let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x9E37_79B9));
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let b = body(i, plans[i]);
                let (code, created) = until_answered(|| {
                    client
                        .post(format!("{base}/v1/orders"))
                        .bearer_auth(API_KEY)
                        .header("idempotency-key", format!("saga-chaos-{i:05}"))
                        .json(&b)
                })
                .await;
                assert!(matches!(code, 200 | 201), "order {i}: {code} {created}");
                let id = created["id"].as_str().unwrap().to_owned();
                if plans[i] == Plan::Cancelled {
                    tokio::time::sleep(Duration::from_millis(rng.below(1500))).await;
                    let (code, got) = until_answered(|| {
                        client
                            .post(format!("{base}/v1/orders/{id}/cancel"))
                            .bearer_auth(API_KEY)
                    })
                    .await;
                    assert!(matches!(code, 200 | 409), "cancel {i}: {code} {got}");
                }
                ids.lock().unwrap()[i].clone_from(&id);
                done.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    while let Some(r) = workers.join_next().await {
        r.unwrap();
    }
    let ids = ids.lock().unwrap().clone();
    ids
}

/// The fleet: two relays, two fulfilment consumers, two saga runners.
fn fleet(providers: &[String]) -> Vec<Slot> {
    let relay = strings(&["relay", "--relay-poll-ms", "50", "--relay-lease-secs", "3"]);
    let consumer = strings(&[
        "consume",
        "fulfilment",
        "--consumer-poll-ms",
        "50",
        "--consumer-lease-secs",
        "3",
    ]);
    let mut runner = strings(&[
        "effects",
        "run",
        "--fulfilment",
        "saga",
        "--runner-lease-secs",
        "4",
        "--provider-timeout-ms",
        "1500",
        "--runner-poll-ms",
        "50",
    ]);
    runner.extend(providers.iter().cloned());
    let kinds: [(&'static str, Vec<String>); 3] = [
        ("relay", relay),
        ("fulfilment", consumer),
        ("runner", runner),
    ];
    kinds
        .into_iter()
        .flat_map(|(name, args)| {
            (0..2).map(move |_| Slot {
                name,
                args: args.clone(),
                env: Vec::new(),
                child: None,
                started: 0,
                log: None,
            })
        })
        .collect()
}

async fn wait_for_subscription(t: &TestDb) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let sql = format!(
            "SELECT {} FROM oncely_subscriptions WHERE topic = 'orders'",
            t.db.backend().text_column("consumer")
        );
        let groups: Vec<(String,)> = t.db.fetch_all(oncely_sql::query(sql)).await.unwrap();
        if groups.iter().any(|(c,)| c == "fulfilment") {
            return;
        }
        assert!(Instant::now() < deadline, "never subscribed: {groups:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sagas per state.
async fn saga_states(t: &TestDb) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        t.db.fetch_all(oncely_sql::query(
            "SELECT state, COUNT(*) FROM oncely_sagas GROUP BY state",
        ))
        .await
        .unwrap();
    rows.into_iter().collect()
}

pub(super) async fn put_stock(base: &str, sku: &str, available: i64) {
    let client = reqwest::Client::new();
    let (code, got) = until_answered(|| {
        client
            .put(format!("{base}/v1/stock/{sku}"))
            .bearer_auth(API_KEY)
            .json(&json!({ "available": available }))
    })
    .await;
    assert_eq!(code, 200, "{got}");
}

#[allow(
    clippy::too_many_lines,
    reason = "one scenario: start, fire, converge, count at the providers"
)]
async fn saga_orders(t: TestDb, default_n: u64) {
    let _turn = super::POSTGRES_FLEET.lock().await;
    let n = env_u64("ONCELY_SAGA_CHAOS_ORDERS", default_n);
    let min_kills = env_u64("ONCELY_CHAOS_KILLS", 30);
    let seed = env_u64("ONCELY_CHAOS_SEED", oncely_core::now_ms() as u64) | 1;
    let rate: f64 = std::env::var("ONCELY_CHAOS_FAULT_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.05);
    let logs = chaos_dir(&format!("saga-{}", uuid::Uuid::new_v4().simple()));
    eprintln!(
        "saga chaos: {n} orders, seed {seed}, faults at {rate}, url {}, logs {}",
        t.url,
        logs.display()
    );
    orders::migrate(&t.db).await.unwrap();
    let (payments, _) = sim("payments", &strs(&faults(rate, seed)));
    let mut ship_args = faults(rate, seed ^ 0x5DEE_CE66);
    ship_args.extend(strings(&["--undeliverable-sku", FRAGILE]));
    let (shipping, _) = sim("shipping", &strs(&ship_args));
    let providers = provider_args(&payments.base, &shipping.base);
    let mut serve_args = strings(&[
        "--no-relay",
        "--no-consumer",
        "--no-runner",
        "--fulfilment",
        "saga",
    ]);
    // A pool of 4 beside the fleet's 3 per worker, as the chaos test's serve: with the
    // default 16 this test held 60 of PostgreSQL's 100 connections with one more test.
    serve_args.extend(strings(&["--db-max-connections", "4"]));
    serve_args.extend(providers.iter().cloned());
    let server = serve_with(&t.url, &strs(&serve_args));
    let n_i = i64::try_from(n).unwrap();
    let stock = [
        ("sku-a", n_i * 2),
        ("sku-b", scarce_units(n)),
        (FRAGILE, n_i),
    ];
    for (sku, units) in stock {
        put_stock(&server.base, sku, units).await;
    }

    let mut slots = fleet(&providers);
    for s in &mut slots {
        s.start(&t.url, &logs);
    }
    wait_for_subscription(&t).await;
    let mut rng = Rng(seed);
    let plans: Vec<Plan> = (0..n).map(|_| plan(&mut rng)).collect();
    let posted = Arc::new(AtomicUsize::new(0));
    let posting = tokio::spawn(post_orders(
        server.base.clone(),
        plans.clone(),
        seed,
        posted.clone(),
    ));

    let mut kills = 0u64;
    let deadline = Instant::now() + Duration::from_secs(1200);
    let firing = AtomicBool::new(true);
    while firing.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "no end within 20 minutes");
        tokio::time::sleep(Duration::from_millis(100 + rng.below(600))).await;
        let victim = rng.below(slots.len() as u64) as usize;
        kills += u64::from(slots[victim].kill());
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        slots[victim].start(&t.url, &logs);
        if posted.load(Ordering::SeqCst) >= n as usize && kills >= min_kills {
            firing.store(false, Ordering::SeqCst);
        }
    }
    let ids = posting.await.unwrap();
    eprintln!("saga chaos: {kills} SIGKILLs while {n} orders were posted; converging");
    loop {
        let states = saga_states(&t).await;
        let open = states.get("running").copied().unwrap_or(0)
            + states.get("compensating").copied().unwrap_or(0);
        let all: i64 = states.values().sum();
        if all == n_i && open == 0 {
            eprintln!("saga chaos: sagas {states:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sagas not ended within 20 minutes: {states:?}"
        );
        for s in &mut slots {
            s.assert_alive();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Compensations of sagas parked in review may still settle: let them.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_each_order_ends_consistent(&t, &payments.base, &shipping.base, &ids, &stock).await;
    drop(slots);
    drop(server);
}

/// One order's facts, from the database and the simulators.
#[derive(Debug, Default)]
struct Facts {
    saga: String,
    error: String,
    evidence: bool,
    /// Reservations by state.
    held: i64,
    consumed: i64,
    released: i64,
    invoices: i64,
    charges_live: u64,
    charges_total: u64,
    refunds: u64,
    shipments_live: u64,
    shipments_total: u64,
}

async fn rows<T: oncely_sql::FromBackendRow>(t: &TestDb, sql: String) -> Vec<T> {
    t.db.fetch_all(oncely_sql::query(sql)).await.unwrap()
}

#[allow(
    clippy::too_many_lines,
    reason = "every invariant of the run, each checked per order"
)]
async fn assert_each_order_ends_consistent(
    t: &TestDb,
    payments: &str,
    shipping: &str,
    ids: &[String],
    stock: &[(&str, i64)],
) {
    let b = t.db.backend();
    let pay = stats(payments).await;
    let ship = stats(shipping).await;
    eprintln!(
        "saga chaos: payments faults {} requests {}; shipping faults {}",
        pay["faults_injected"], pay["requests"], ship["faults_injected"]
    );
    let mut facts: BTreeMap<String, Facts> = ids
        .iter()
        .map(|id| (id.clone(), Facts::default()))
        .collect();
    let sagas: Vec<(String, String, Option<String>)> =
        rows(t, "SELECT id, state, error FROM oncely_sagas".to_owned()).await;
    for (id, state, error) in sagas {
        let f = facts.get_mut(&id).expect("a saga of a posted order");
        f.saga = state;
        f.error = error.unwrap_or_default();
    }
    let evidence: Vec<(String,)> = rows(
        t,
        "SELECT DISTINCT saga_id FROM oncely_saga_steps WHERE evidence IS NOT NULL".to_owned(),
    )
    .await;
    for (id,) in evidence {
        if let Some(f) = facts.get_mut(&id) {
            f.evidence = true;
        }
    }
    let reservations: Vec<(String, String, i64)> = rows(
        t,
        "SELECT order_id, state, COUNT(*) FROM stock_reservations GROUP BY order_id, state"
            .to_owned(),
    )
    .await;
    for (id, state, count) in reservations {
        let f = facts.get_mut(&id).expect("a reservation of a posted order");
        match state.as_str() {
            "held" => f.held += count,
            "consumed" => f.consumed += count,
            _ => f.released += count,
        }
    }
    let invoices: Vec<(String, i64)> = rows(
        t,
        "SELECT order_id, COUNT(*) FROM invoices GROUP BY order_id".to_owned(),
    )
    .await;
    for (id, count) in invoices {
        facts
            .get_mut(&id)
            .expect("an invoice of a posted order")
            .invoices = count;
    }
    let charges: Vec<(String, Option<String>)> = rows(
        t,
        format!(
            "SELECT {}, {} FROM oncely_effects WHERE provider = 'payments' AND operation = 'charge'",
            b.text_column("reference"),
            b.text_column("provider_id")
        ),
    )
    .await;
    let refunds = &pay["refunds_by_payment_intent"];
    for (reference, pi) in charges {
        let id = reference.trim_end_matches(":charge");
        let f = facts.get_mut(id).expect("a charge of a posted order");
        let c = &pay["payment_intents_by_metadata"]["order_id"][id];
        f.charges_total = c["total"].as_u64().unwrap_or(0);
        f.charges_live = c["succeeded"].as_u64().unwrap_or(0);
        f.refunds = pi.map_or(0, |pi| refunds[&pi].as_u64().unwrap_or(0));
    }
    for (id, f) in &mut facts {
        let c = &ship["by_merchant_reference"][format!("{id}:ship")];
        f.shipments_total = c["total"].as_u64().unwrap_or(0);
        f.shipments_live = c["booked"].as_u64().unwrap_or(0);
    }

    let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
    for (id, f) in &facts {
        *by_state.entry(f.saga.as_str()).or_default() += 1;
        assert!(f.charges_total <= 1, "{id}: {f:?}");
        assert!(f.shipments_total <= 1, "{id}: {f:?}");
        assert!(
            f.charges_live == 0 || f.consumed + f.held + f.released > 0,
            "{id} charged without stock: {f:?}"
        );
        assert!(
            !(f.refunds > 0 && f.shipments_live > 0),
            "{id} refunded and shipped: {f:?}"
        );
        match f.saga.as_str() {
            "completed" => {
                assert!(
                    f.consumed > 0 && f.held == 0 && f.released == 0,
                    "{id}: {f:?}"
                );
                assert_eq!((f.charges_live, f.refunds), (1, 0), "{id}: {f:?}");
                assert_eq!(f.shipments_live, 1, "{id}: {f:?}");
                assert_eq!(f.invoices, 1, "{id}: {f:?}");
            }
            "compensated" => {
                assert!(
                    f.consumed == 0 && f.held == 0,
                    "{id}: stock not restored {f:?}"
                );
                assert_eq!(f.charges_live, f.refunds.min(1), "{id}: charge left {f:?}");
                assert!(f.refunds <= 1, "{id}: {f:?}");
                assert_eq!(f.shipments_live, 0, "{id}: live shipment {f:?}");
                assert_eq!(f.invoices, 0, "{id}: {f:?}");
            }
            "needs_review" => {
                assert!(
                    !f.error.is_empty() && f.evidence,
                    "{id}: in review without evidence {f:?}"
                );
                eprintln!("saga chaos: needs_review {id}: {} ({f:?})", f.error);
            }
            other => panic!("{id}: saga {other:?} at the end: {f:?}"),
        }
    }
    eprintln!("saga chaos: orders by saga state {by_state:?}");
    let levels: Vec<(String, i64, i64)> = rows(
        t,
        format!(
            "SELECT {}, available, reserved FROM stock",
            b.text_column("sku")
        ),
    )
    .await;
    let kept: Vec<(String, i64)> = rows(
        t,
        format!(
            "SELECT {}, quantity FROM stock_reservations WHERE state <> 'released'",
            b.text_column("sku")
        ),
    )
    .await;
    for (sku, initial) in stock {
        let (_, available, _) = levels.iter().find(|l| l.0 == *sku).unwrap();
        let gone: i64 = kept.iter().filter(|c| c.0 == *sku).map(|c| c.1).sum();
        assert_eq!(
            available + gone,
            *initial,
            "{sku}: available {available} + consumed or held {gone} != {initial}"
        );
    }
}

/// Orders of every plan through a saga whose one effects runner process is started with
/// `FAILPOINTS=runner.after_send=panic(abort)`: it aborts (as a SIGKILL would end it) as soon as
/// any provider call returns, before the outcome is recorded, and is restarted at once —
/// so every step boundary with a provider call (charge, booking, refund, cancellation) is
/// crossed through a crash after the provider acted. The simulators inject no other fault.
/// At the end every order ends as the 1,000-order run requires; the runner aborted at least
/// once per provider object created; every settled call effect was settled from a status
/// check (its evidence has one), and no reference reached the provider twice.
pub(crate) async fn sagas_whose_runner_is_aborted_after_every_provider_call_end_fulfilled_or_compensated(
    t: TestDb,
) {
    const N: u64 = 12;
    let seed = env_u64("ONCELY_CHAOS_SEED", oncely_core::now_ms() as u64) | 1;
    let logs = chaos_dir(&format!("saga-abort-{}", uuid::Uuid::new_v4().simple()));
    eprintln!(
        "saga abort: {N} orders, seed {seed}, logs {}",
        logs.display()
    );
    orders::migrate(&t.db).await.unwrap();
    let (payments, _) = sim("payments", &strs(&faults(0.0, seed)));
    let mut ship_args = faults(0.0, seed);
    ship_args.extend(strings(&["--undeliverable-sku", FRAGILE]));
    let (shipping, _) = sim("shipping", &strs(&ship_args));
    let providers = provider_args(&payments.base, &shipping.base);
    let mut serve_args = strings(&["--no-relay", "--no-consumer", "--no-runner"]);
    serve_args.extend(strings(&[
        "--fulfilment",
        "saga",
        "--db-max-connections",
        "4",
    ]));
    serve_args.extend(providers.iter().cloned());
    let server = serve_with(&t.url, &strs(&serve_args));
    let stock = [("sku-a", 2 * N as i64), ("sku-b", 2), (FRAGILE, N as i64)];
    for (sku, units) in stock {
        put_stock(&server.base, sku, units).await;
    }
    let mut slots = fleet(&providers);
    // One relay, one consumer, one runner: the runner with the fault and a short lease.
    slots.dedup_by(|a, b| a.name == b.name);
    for s in &mut slots {
        if s.name == "runner" {
            s.env = vec![(
                "FAILPOINTS".to_owned(),
                "runner.after_send=panic(abort)".to_owned(),
            )];
            // A refusal that leaves nothing at the provider (the undeliverable SKU's 422)
            // dies with the process each time: the status check proves it absent, so it is
            // sent again, up to the attempt limit, then failed and compensated.
            let lease = s
                .args
                .iter()
                .position(|a| a == "--runner-lease-secs")
                .unwrap();
            "2".clone_into(&mut s.args[lease + 1]);
            s.args.extend(strings(&["--runner-max-attempts", "3"]));
        }
        s.start(&t.url, &logs);
    }
    wait_for_subscription(&t).await;
    let mut rng = Rng(seed);
    // Every plan at least once, the rest drawn.
    let mut plans = vec![
        Plan::Plain,
        Plan::Scarce,
        Plan::Declined,
        Plan::Fragile,
        Plan::Cancelled,
    ];
    plans.extend((plans.len() as u64..N).map(|_| plan(&mut rng)));
    let posted = Arc::new(AtomicUsize::new(0));
    let ids = post_orders(server.base.clone(), plans, seed, posted).await;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut aborts = 0u64;
    loop {
        for s in &mut slots {
            let exited = s.child.as_mut().unwrap().try_wait().unwrap();
            if let Some(status) = exited {
                assert_eq!(s.name, "runner", "{} exited: {status:?}", s.name);
                assert!(!status.success(), "the runner exited cleanly: {status:?}");
                aborts += 1;
                s.start(&t.url, &logs);
            }
        }
        let states = saga_states(&t).await;
        let open = states.get("running").copied().unwrap_or(0)
            + states.get("compensating").copied().unwrap_or(0);
        if states.values().sum::<i64>() == N as i64 && open == 0 {
            eprintln!("saga abort: sagas {states:?} after {aborts} runner aborts");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sagas not ended within 10 minutes: {states:?}, {aborts} aborts"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_each_order_ends_consistent(&t, &payments.base, &shipping.base, &ids, &stock).await;
    assert_settled_by_status_checks(&t, aborts).await;
    drop(slots);
    drop(server);
}

/// Every effect a call settled was settled from a status check (the call's own outcome died
/// with the process), and the runner aborted at least once per effect that reached a
/// provider.
async fn assert_settled_by_status_checks(t: &TestDb, aborts: u64) {
    let store = oncely_sql::EffectStore::new(t.db.clone());
    let effects = store.list(None, 1_000).await.unwrap();
    let mut sent = 0u64;
    for effect in &effects {
        let evidence = store.evidence(&effect.id).await.unwrap();
        let kinds: Vec<String> = evidence
            .iter()
            .map(|e| format!("{}:{}", e.kind, e.outcome))
            .collect();
        if effect.state_word == "succeeded" || effect.state_word == "failed" {
            assert!(
                kinds.iter().any(|k| k.starts_with("status:")),
                "{} {}: settled without a status check although its call's outcome died \
                 with the runner: {kinds:?}",
                effect.reference,
                effect.state_word
            );
            sent += 1;
            assert!(
                !kinds.iter().any(|k| k == "call:succeeded"),
                "{} {}: settled by its call although the runner aborts after every call: \
                 {kinds:?}",
                effect.reference,
                effect.state_word
            );
        }
    }
    eprintln!(
        "saga abort: {} effects, {sent} settled from a status check, {aborts} aborts",
        effects.len()
    );
    assert!(sent > 0, "no effect was settled from a status check");
    assert!(aborts >= 1, "the runner never aborted");
}
