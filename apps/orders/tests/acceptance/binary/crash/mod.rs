//! A crash at every step that matters (issue 28): one test per named failpoint
//! (`oncely_core::failpoint`), on SQLite, PostgreSQL and MariaDB.
//!
//! Each test runs the reference flow through `orders serve` processes (the relay, both
//! consumers and the effect runner in process, the payments and shipping simulators as
//! `oncely sim` processes):
//! 1. a process starts with `FAILPOINTS=<point>=panic(abort)` and is driven until it dies
//!    there: the test fails if it never reaches the point, or dies of anything else
//!    (SIGABRT is the point's own signal);
//! 2. where the scenario names several points, the next process dies at the next one;
//! 3. a clean process restarts on the same database, the client retries every request
//!    with its own key until it has a final answer;
//! 4. once the flow settles (bounded), the global invariant is checked ([`check`]): one
//!    order per key, one invoice per order, one live charge and one live shipment per
//!    order at the simulators, every effect succeeded, every client answer the same as the
//!    replay of its key, nothing `processing` or `unknown`, nothing pending in the outbox.
//!
//! [`points`] scans the sources for `fail_point!` and fails when a point has no scenario
//! here, or a scenario names a point that no longer exists.
//!
//! Knobs: `ONCELY_CRASH_ORDERS` (orders per test, default 3), `ONCELY_CRASH_SETTLE_SECS`
//! (the bound on settling, default 90).

mod check;
pub(super) mod drive;
mod points;
mod webhook;

use std::os::unix::process::ExitStatusExt as _;
use std::time::Duration;

use oncely_testkit::TestDb;

use super::{env_u64, serve_with_env, sim, Proc};
use drive::Client;

/// How the reference flow is driven for a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flow {
    /// Orders created through `POST /v1/orders`, carried by the choreography (relay,
    /// billing and shipping consumers, effect runner) on the SQL transport.
    Choreography,
    /// As [`Flow::Choreography`], through RabbitMQ.
    RabbitMq,
    /// As [`Flow::Choreography`], fulfilled by the saga orchestrator.
    Saga,
    /// Orders created, then paid through `POST /v1/orders/{id}/payments` (multi-phase);
    /// no consumer runs.
    Payment,
    /// The choreography settles, then `orders reconcile` finds a charge seeded at the
    /// simulator; the reconcile process is the one that crashes.
    Reconcile,
    /// The choreography with every charge's answer dropped (each `unknown`, its status
    /// check ten minutes off): Stripe's signed events settle them through
    /// `POST /v1/webhooks/stripe` ([`webhook`]).
    Webhook,
}

/// One crash test: the points successive processes die at, and the flow that reaches
/// them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scenario {
    pub(super) points: &'static [&'static str],
    pub(super) flow: Flow,
}

macro_rules! crash_tests {
    ($($test:ident => [$($point:literal),+] $flow:ident;)+) => {
        $(
            async fn $test(t: TestDb) {
                run(Scenario { points: &[$($point),+], flow: Flow::$flow }, t).await;
            }
        )+
        /// Every scenario of this module, for [`points`]' one-for-one check.
        pub(super) const SCENARIOS: &[Scenario] = &[
            $(Scenario { points: &[$($point),+], flow: Flow::$flow }),+
        ];
        oncely_testkit::matrix! {
            tests: [$($test),+],
            cannot_apply: [],
        }
    };
}

crash_tests! {
    crash_request_after_reserve => ["request.after_reserve"] Choreography;
    crash_request_after_handler => ["request.after_handler"] Choreography;
    crash_request_before_commit => ["request.before_commit"] Choreography;
    crash_request_after_commit => ["request.after_commit"] Choreography;
    crash_relay_after_claim => ["relay.after_claim"] Choreography;
    crash_relay_after_publish => ["relay.after_publish"] RabbitMq;
    crash_relay_after_confirm => ["relay.after_confirm"] Choreography;
    crash_consumer_after_receive => ["consumer.after_receive"] Choreography;
    crash_consumer_after_inbox_commit => ["consumer.after_inbox_commit"] Choreography;
    crash_runner_before_send => ["runner.before_send"] Choreography;
    crash_runner_after_send => ["runner.after_send"] Choreography;
    crash_runner_after_check => ["runner.after_send", "runner.after_check"] Choreography;
    crash_runner_before_settle => ["runner.before_settle"] Choreography;
    crash_runner_before_settle_commit => ["runner.before_settle_commit"] Choreography;
    crash_saga_before_save => ["saga.before_save"] Saga;
    crash_saga_after_step_settled => ["saga.after_step_settled"] Saga;
    crash_multiphase_after_lease_commit => ["multiphase.after_lease_commit"] Payment;
    crash_multiphase_after_answer => ["multiphase.after_answer"] Payment;
    crash_payments_before_call => ["payments.before_call"] Payment;
    crash_payments_after_call => ["payments.after_call"] Payment;
    crash_reconcile_before_apply => ["reconcile.before_apply"] Reconcile;
    crash_webhook_before_resolve => ["webhook.before_resolve"] Webhook;
}

/// The simulators' secret key.
const SK: &str = "sk_test_oncely_sim";

/// The settings every process of a scenario takes: short leases and polls, so a crashed
/// holder's work is taken over within seconds.
fn flags(flow: Flow, payments: &str, shipping: &str) -> Vec<String> {
    let mut f = super::chaos::provider_args(payments, shipping);
    f.extend(super::chaos::strings(&[
        "--relay-poll-ms",
        "50",
        "--relay-lease-secs",
        "2",
        "--consumer-poll-ms",
        "50",
        "--consumer-lease-secs",
        "2",
        "--runner-lease-secs",
        "3",
        "--runner-poll-ms",
        "50",
        "--provider-timeout-ms",
        "1500",
        "--payment-lease-secs",
        "3",
        "--lease-sweep-secs",
        "1",
        "--db-max-connections",
        "4",
    ]));
    match flow {
        Flow::Saga => f.extend(super::chaos::strings(&["--fulfilment", "saga"])),
        Flow::Payment => f.push("--no-consumer".to_owned()),
        Flow::Webhook => f.extend(super::chaos::strings(&[
            "--runner-check-delay-ms",
            "600000",
            "--stripe-webhook-secret",
            super::webhooks::SECRET,
        ])),
        Flow::Choreography | Flow::RabbitMq | Flow::Reconcile => {}
    }
    f
}

/// A RabbitMQ exchange and queue prefix of this test, deleted when dropped.
pub(super) struct Rabbit {
    exchange: String,
    prefix: String,
}

impl Rabbit {
    pub(super) fn new() -> Self {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        Self {
            exchange: format!("crash.{suffix}"),
            prefix: format!("crash-{suffix}"),
        }
    }

    fn flags(&self) -> Vec<String> {
        let mut f = self.flags_at(&oncely_testkit::amqp_url());
        f.extend(super::chaos::strings(&["--relay-backoff-base-ms", "50"]));
        f
    }

    /// The broker flags of a process that reaches RabbitMQ at `url` (a proxy, say).
    pub(super) fn flags_at(&self, url: &str) -> Vec<String> {
        super::chaos::strings(&[
            "--broker",
            "rabbitmq",
            "--amqp-url",
            url,
            "--amqp-exchange",
            &self.exchange,
            "--amqp-queue-prefix",
            &self.prefix,
        ])
    }

    /// `true` once the queues of `groups` exist (a passive declare of each succeeds).
    pub(super) async fn queues_exist(&self, groups: &[&str]) -> bool {
        let Ok(conn) = lapin::Connection::connect(
            &oncely_testkit::amqp_url(),
            oncely_broker::amqp_connection_properties(),
        )
        .await
        else {
            return false;
        };
        let mut all = true;
        for group in groups {
            // A failed passive declare closes the channel: one channel per queue.
            let Ok(ch) = conn.create_channel().await else {
                all = false;
                break;
            };
            let queue = format!("{}.{group}", self.prefix);
            let passive = lapin::options::QueueDeclareOptions {
                passive: true,
                ..lapin::options::QueueDeclareOptions::default()
            };
            all &= ch
                .queue_declare(queue.as_str(), passive, lapin::types::FieldTable::default())
                .await
                .is_ok();
        }
        drop(conn.close(200, "checked").await);
        all
    }

    /// Deletes the queues of both groups and the exchange.
    pub(super) async fn delete(mut self) {
        self.delete_objects().await;
        self.exchange.clear();
    }

    async fn delete_objects(&self) {
        let Ok(conn) = lapin::Connection::connect(
            &oncely_testkit::amqp_url(),
            oncely_broker::amqp_connection_properties(),
        )
        .await
        else {
            return;
        };
        if let Ok(ch) = conn.create_channel().await {
            for group in ["billing", "shipping"] {
                for suffix in ["", ".retry", ".dead"] {
                    let queue = format!("{}.{group}{suffix}", self.prefix);
                    drop(
                        ch.queue_delete(
                            queue.as_str(),
                            lapin::options::QueueDeleteOptions::default(),
                        )
                        .await,
                    );
                }
            }
            drop(
                ch.exchange_delete(
                    self.exchange.as_str(),
                    lapin::options::ExchangeDeleteOptions::default(),
                )
                .await,
            );
        }
        drop(conn.close(200, "crash test done").await);
    }
}

impl Drop for Rabbit {
    /// A test that fails before [`Rabbit::delete`] leaves its queues and exchange: they are
    /// deleted from a detached thread with a runtime of its own (a `Drop` cannot await, and
    /// joining it would block the failing test's runtime that lapin's I/O may need).
    /// Best-effort: the process may end first.
    fn drop(&mut self) {
        if !std::thread::panicking() || self.exchange.is_empty() {
            return;
        }
        let this = Self {
            exchange: std::mem::take(&mut self.exchange),
            prefix: std::mem::take(&mut self.prefix),
        };
        std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                drop(tokio::time::timeout(Duration::from_secs(10), this.delete()).await);
            });
        });
    }
}

/// Runs `scenario` on `t` and checks the invariant.
async fn run(scenario: Scenario, t: TestDb) {
    let n = env_u64("ONCELY_CRASH_ORDERS", 3) as usize;
    let settle = Duration::from_secs(env_u64("ONCELY_CRASH_SETTLE_SECS", 90));
    eprintln!("crash: {scenario:?}, {n} orders, {}", t.url);
    orders::migrate(&t.db).await.unwrap();
    let (payments, _) = sim("payments", &[]);
    let (shipping, _) = sim("shipping", &[]);
    let mut flags = flags(scenario.flow, &payments.base, &shipping.base);
    let rabbit = (scenario.flow == Flow::RabbitMq).then(Rabbit::new);
    if let Some(r) = &rabbit {
        if !oncely_testkit::service_reachable("RabbitMQ", &oncely_testkit::amqp_url()).await {
            return;
        }
        flags.extend(r.flags());
    }
    let mut client = Client::new(scenario.flow, n);
    if scenario.flow == Flow::Webhook {
        let sims = (payments.base.as_str(), shipping.base.as_str());
        webhook::webhook_crash(&t, &mut client, &flags, sims, scenario.points, settle).await;
    } else if scenario.flow == Flow::Reconcile {
        reconcile_crash(
            &t,
            &mut client,
            &flags,
            &payments.base,
            scenario.points,
            settle,
        )
        .await;
    } else {
        let began = std::time::Instant::now();
        for (i, point) in scenario.points.iter().enumerate() {
            let dying = start(&t, &flags, Some(point));
            if i == 0 && scenario.flow == Flow::Saga {
                // The saga's first step reserves stock.
                super::saga_chaos::put_stock(&dying.base, "s", 1000).await;
            }
            client.drive_once(&dying.base).await;
            died_at(dying, point).await;
            eprintln!("crash: died at {point} after {:?}", began.elapsed());
        }
        let clean = start(&t, &flags, None);
        client.drive(&clean.base, settle).await;
        check::settled(&t, &client, &payments.base, &shipping.base, settle).await;
        eprintln!("crash: settled after {:?}", began.elapsed());
        client.replays_match(&clean.base).await;
    }
    if let Some(r) = rabbit {
        r.delete().await;
    }
}

/// `orders serve` on `t` with `flags`, dying at `point` when given.
fn start(t: &TestDb, flags: &[String], point: Option<&str>) -> Proc {
    let failpoints = point.map(|p| format!("{p}=panic({})", oncely_core::failpoint::ABORT));
    let env: Vec<(&str, &str)> = failpoints
        .as_deref()
        .map(|f| ("FAILPOINTS", f))
        .into_iter()
        .collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    serve_with_env(&t.url, &flags, &env)
}

/// Waits for `dying` to end at `point`: SIGABRT within 60 s, or the test fails (the flow
/// never reached the point, or the process died of something else).
async fn died_at(mut dying: Proc, point: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = dying.child.try_wait().unwrap() {
            assert_eq!(
                status.signal(),
                Some(libc_sigabrt()),
                "the process was to abort at {point}, it ended {status}"
            );
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the reference flow never reached {point} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGABRT's number on Linux (POSIX leaves it to the platform; every Linux ABI uses 6).
const fn libc_sigabrt() -> i32 {
    6
}

/// The choreography settles under a clean process; a charge nobody recorded is seeded at
/// the simulator; `orders reconcile` dies at each of `points`, then runs clean: the
/// seeded charge is one open discrepancy, and the flow's invariant still holds.
async fn reconcile_crash(
    t: &TestDb,
    client: &mut Client,
    flags: &[String],
    payments: &str,
    points: &[&str],
    settle: Duration,
) {
    let clean = start(t, flags, None);
    client.drive(&clean.base, settle).await;
    let shipping = flags
        .iter()
        .skip_while(|f| *f != "--shipping-url")
        .nth(1)
        .cloned()
        .unwrap();
    check::settled(t, client, payments, &shipping, settle).await;
    let seeded = reqwest::Client::new()
        .post(format!("{payments}/v1/payment_intents"))
        .bearer_auth(SK)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("amount=700&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[invoice_id]=inv-seeded")
        .send()
        .await
        .unwrap();
    assert!(seeded.status().is_success(), "{seeded:?}");
    let providers = super::chaos::provider_args(payments, &shipping);
    for point in points {
        let status = reconcile(t, &providers, Some(point));
        assert_eq!(
            status.signal(),
            Some(libc_sigabrt()),
            "orders reconcile was to abort at {point}: {status}"
        );
    }
    let status = reconcile(t, &providers, None);
    assert_eq!(
        status.code(),
        Some(oncely_cli::EXIT_OPEN_DISCREPANCIES),
        "the clean reconcile leaves the seeded charge open: {status}"
    );
    check::one_open_discrepancy(t, "inv-seeded").await;
    check::settled(t, client, payments, &shipping, settle).await;
    client.replays_match(&clean.base).await;
}

/// Runs `orders reconcile --provider payments` to its end.
fn reconcile(t: &TestDb, providers: &[String], point: Option<&str>) -> std::process::ExitStatus {
    let mut c = oncely_testkit::process::command(super::ORDERS);
    c.args([
        "reconcile",
        "--provider",
        "payments",
        "--json",
        "--since",
        "2h",
    ])
    .args(["--database-url", &t.url])
    .args(providers)
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    if let Some(p) = point {
        c.env(
            "FAILPOINTS",
            format!("{p}=panic({})", oncely_core::failpoint::ABORT),
        );
    }
    c.status().expect("run orders reconcile")
}
