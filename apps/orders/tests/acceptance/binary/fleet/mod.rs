//! Several instances at once (issue 28): three `orders serve`, two `oncely relay`, two
//! consumers of each group (`billing`, `shipping`) and two effect runners share one
//! database and one broker — PostgreSQL with RabbitMQ, MariaDB with Kafka — while:
//! - any of them is SIGKILLed at random and restarted (at least `ONCELY_FLEET_KILLS`, 30;
//!   on the Kafka stack the consumers are spared, see [`Broker::spared`]);
//! - the network to a provider simulator, or to RabbitMQ, is cut through the testkit's
//!   [`FaultProxy`] for 0.2–1.5 s at random (Kafka's clients learn the broker's own
//!   address from its metadata, so a proxy in front of it would be bypassed: on that
//!   stack only the providers are cut);
//! - the simulators inject their faults at `ONCELY_FLEET_FAULT_RATE` (0.02);
//! - a client sends `ONCELY_FLEET_ORDERS` (2,000) orders to whichever server is up, each
//!   retried with its own key until it has a final answer ([`client`]).
//!
//! At the end, the same invariant as the crash matrix: one order per key, one invoice per
//! order, one effect per provider per order, counted at the providers at most one object
//! each and exactly one live object for every succeeded effect; `oncely reconcile` finds
//! nothing; nothing pending in the outbox, no idempotency record `processing` or
//! `unknown`; every answer the client had equals its key's replay.
//!
//! `ONCELY_FLEET_SEED` replays a run (the seed is printed). Logs go to
//! `$TMPDIR/oncely-chaos-fleet-<uuid>/`.

mod client;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely_testkit::{FaultProxy, TestBackend, TestDb};

use super::chaos::{self, Slot};
use super::{env_u64, serve_with, sim, Proc, Rng};
use client::{Bases, Client};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_rabbitmq_fleet_sigkilled_and_cut_off_at_random_loses_duplicates_and_contradicts_nothing(
) {
    let Some(t) = TestDb::new(TestBackend::Postgres).await else {
        return;
    };
    run(t, Stack::RabbitMq).await;
}

/// Was ignored after a run on 2026-12-04 (seed 1796410805097, 2,000 orders, 53 SIGKILLs)
/// in which 51 `order.created` events never reached the billing consumer. Not reproduced
/// since: producers SIGKILLed 50 times against tansu lost no acknowledged record
/// (124,000 records, a fresh reader and a live group both saw all), and two runs of this
/// test on 2026-12-06 passed (800 orders, seed 1796528479685; 2,000 orders, seed
/// 1796528541787, 30 SIGKILLs, 321 s). One defect the search found is fixed: a Kafka retry
/// held until its time was not counted as unsettled, so a later record of its partition
/// acknowledged first could move the group's commit past it. If it fails again, the
/// seed and the logs directory are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_kafka_fleet_sigkilled_and_cut_off_at_random_loses_duplicates_and_contradicts_nothing(
) {
    let Some(t) = TestDb::new(TestBackend::MySql).await else {
        return;
    };
    run(t, Stack::Kafka).await;
}

/// How long a run may go without progress (a new answer, a changed effect count) before it
/// fails. Under the whole suite's load on two cores, a run takes several times longer than
/// alone (393 s alone; the 20-minute wall-clock limit this replaced was hit in CI).
const STALL: Duration = Duration::from_secs(300);

/// The most a run may take in all.
const LIMIT: Duration = Duration::from_secs(45 * 60);

/// The broker of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stack {
    RabbitMq,
    Kafka,
}

/// The broker side of a run: the flags of the processes that talk to it, and what is to
/// be cut or deleted.
struct Broker {
    /// `--broker …` and its settings, for serve, relays and consumers.
    flags: Vec<String>,
    /// `--events-topic …`, for `serve` and the runner (which write the events).
    topic: Vec<String>,
    /// `--consumer-topic …`, for the consumers.
    consumer_topic: Vec<String>,
    /// In front of RabbitMQ.
    proxy: Option<Arc<FaultProxy>>,
    /// This run's exchange and queues, deleted at the end.
    rabbit: Option<super::crash::Rabbit>,
    /// Kinds of worker the kill loop leaves alone. Kafka: the consumers, unless
    /// `ONCELY_FLEET_KAFKA_KILL_CONSUMERS=1`. Once, tansu (the Kafka API server CI runs)
    /// never completed a rebalance of groups whose members were SIGKILLed a few times in a
    /// row: the new members waited for an assignment for over ten minutes (session timeout
    /// 10 s). Another run with the consumers killed (600 orders, 40 kills) passed. Until
    /// that is understood, CI kills that stack's relays, runners and servers only.
    spared: &'static [&'static str],
}

impl Broker {
    async fn new(stack: Stack) -> Option<Self> {
        match stack {
            Stack::RabbitMq => {
                let url = oncely_testkit::amqp_url();
                if !oncely_testkit::service_reachable("RabbitMQ", &url).await {
                    return None;
                }
                let (proxy, proxied) = FaultProxy::in_front_of(&url).await;
                let rabbit = super::crash::Rabbit::new();
                Some(Self {
                    flags: rabbit.flags_at(&proxied),
                    topic: Vec::new(),
                    consumer_topic: Vec::new(),
                    proxy: Some(Arc::new(proxy)),
                    rabbit: Some(rabbit),
                    spared: &[],
                })
            }
            Stack::Kafka => {
                if !oncely_testkit::service_reachable("Kafka", &oncely_testkit::kafka_url()).await {
                    return None;
                }
                let suffix = uuid::Uuid::new_v4().simple().to_string();
                let topic = format!("fleet.{suffix}");
                Some(Self {
                    flags: chaos::strings(&[
                        "--broker",
                        "kafka",
                        "--kafka-brokers",
                        &oncely_testkit::kafka_brokers(),
                        "--kafka-topics",
                        &topic,
                        "--kafka-group-prefix",
                        &format!("fleet-{suffix}"),
                    ]),
                    topic: chaos::strings(&["--events-topic", &topic]),
                    consumer_topic: chaos::strings(&["--consumer-topic", &topic]),
                    proxy: None,
                    rabbit: None,
                    spared: if env_u64("ONCELY_FLEET_KAFKA_KILL_CONSUMERS", 0) == 1 {
                        &[]
                    } else {
                        &["billing", "shipping"]
                    },
                })
            }
        }
    }

    /// Waits until both groups can receive: RabbitMQ routes only to queues bound when an
    /// event is published (Kafka's groups start at the earliest offset).
    async fn wait_for_groups(&self) {
        let Some(r) = &self.rabbit else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !r.queues_exist(&["billing", "shipping"]).await {
            assert!(
                Instant::now() < deadline,
                "consumers never declared their queues"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The settings of a run.
struct Knobs {
    n: usize,
    min_kills: u64,
    seed: u64,
    rate: f64,
}

impl Knobs {
    fn from_env() -> Self {
        Self {
            n: env_u64("ONCELY_FLEET_ORDERS", 2000) as usize,
            min_kills: env_u64("ONCELY_FLEET_KILLS", 30),
            seed: env_u64("ONCELY_FLEET_SEED", oncely_core::now_ms() as u64) | 1,
            rate: std::env::var("ONCELY_FLEET_FAULT_RATE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.02),
        }
    }
}

/// The processes of a run.
struct Fleet {
    url: String,
    serve_args: Vec<String>,
    servers: Vec<Proc>,
    bases: Bases,
    workers: Vec<Slot>,
    /// Kinds of worker never killed ([`Broker::spared`]).
    spared: &'static [&'static str],
    logs: std::path::PathBuf,
}

impl Fleet {
    fn start(t: &TestDb, providers: &[String], broker: &Broker) -> Self {
        // Four connections each: the fleet shares PostgreSQL's 100 with the rest of the suite.
        let mut serve_args = chaos::strings(&["--no-relay", "--no-consumer", "--no-runner"]);
        serve_args.extend(chaos::strings(&["--db-max-connections", "4"]));
        serve_args.extend(providers.iter().cloned());
        // No broker flags: these servers neither publish nor consume.
        serve_args.extend(broker.topic.iter().cloned());
        let servers: Vec<Proc> = (0..3)
            .map(|_| serve_with(&t.url, &chaos::strs(&serve_args)))
            .collect();
        let bases = Arc::new(Mutex::new(servers.iter().map(|p| p.base.clone()).collect()));
        let logs = chaos::chaos_dir(&format!("fleet-{}", uuid::Uuid::new_v4().simple()));
        let mut workers = workers(providers, broker);
        for w in &mut workers {
            w.start(&t.url, &logs);
        }
        Self {
            url: t.url.clone(),
            serve_args,
            servers,
            bases,
            workers,
            spared: broker.spared,
            logs,
        }
    }

    /// SIGKILLs one process (or, one time in ten, every worker of one kind), and restarts
    /// it after 0–400 ms. Returns the number of processes killed.
    async fn kill_some(&mut self, rng: &mut Rng) -> u64 {
        let victims: Vec<usize> = (0..self.servers.len() + self.workers.len())
            .filter(|&i| {
                i.checked_sub(self.servers.len())
                    .is_none_or(|w| !self.spared.contains(&self.workers[w].name))
            })
            .collect();
        let victim = victims[rng.below(victims.len() as u64) as usize];
        if let Some(w) = victim.checked_sub(self.servers.len()) {
            let together: Vec<usize> = if rng.below(10) == 0 {
                let name = self.workers[w].name;
                (0..self.workers.len())
                    .filter(|&i| self.workers[i].name == name)
                    .collect()
            } else {
                vec![w]
            };
            let mut kills = 0;
            for &i in &together {
                kills += u64::from(self.workers[i].kill());
            }
            tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
            for &i in &together {
                self.workers[i].start(&self.url, &self.logs);
            }
            return kills;
        }
        let server = &mut self.servers[victim];
        assert!(
            server.child.try_wait().unwrap().is_none(),
            "serve #{victim} exited by itself"
        );
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        *server = serve_with(&self.url, &chaos::strs(&self.serve_args));
        self.bases.lock().unwrap()[victim].clone_from(&server.base);
        1
    }

    /// SIGKILLs and restarts every consumer: after 45 s without progress. Twice on the
    /// Kafka stack (tansu), consumers that had just joined their group sat without an
    /// assignment for many minutes, never killed (spared) or after kills; a new member's
    /// join makes the coordinator rebalance. Printed, so a run that needed it shows.
    fn restart_consumers(&mut self) {
        eprintln!("fleet: no progress for 45 s; restarting the consumers");
        for w in &mut self.workers {
            if w.name == "billing" || w.name == "shipping" {
                w.kill();
                w.start(&self.url, &self.logs);
            }
        }
    }

    /// Fails the test when a worker exited by itself.
    fn all_alive(&mut self) {
        for w in &mut self.workers {
            w.assert_alive();
        }
    }
}

/// Two relays, two consumers of each group, two effect runners, on `broker`.
fn workers(providers: &[String], broker: &Broker) -> Vec<Slot> {
    let mut relay = broker.flags.clone();
    relay.extend(chaos::strings(&["--relay-backoff-base-ms", "50"]));
    let mut consumer = broker.flags.clone();
    consumer.extend(broker.consumer_topic.iter().cloned());
    chaos::workers(providers, &relay, &consumer, &broker.topic)
}

/// Cuts one of `proxies` for 0.2–1.5 s every 1–4 s until `firing` ends; every proxy is
/// restored at the end. Returns the number of cuts.
async fn cut_at_random(proxies: Vec<Arc<FaultProxy>>, seed: u64, firing: Arc<AtomicBool>) -> u64 {
    let mut rng = Rng(seed);
    let mut cuts = 0;
    while firing.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(1000 + rng.below(3000))).await;
        let p = &proxies[rng.below(proxies.len() as u64) as usize];
        p.cut();
        cuts += 1;
        tokio::time::sleep(Duration::from_millis(200 + rng.below(1300))).await;
        p.restore();
    }
    cuts
}

async fn run(t: TestDb, stack: Stack) {
    let _turn = match stack {
        Stack::RabbitMq => Some(super::POSTGRES_FLEET.lock().await),
        Stack::Kafka => None,
    };
    let k = Knobs::from_env();
    let Some(broker) = Broker::new(stack).await else {
        return;
    };
    orders::migrate(&t.db).await.unwrap();
    let (payments, _) = sim("payments", &chaos::strs(&chaos::faults(k.rate, k.seed)));
    let (shipping, _) = sim(
        "shipping",
        &chaos::strs(&chaos::faults(k.rate, k.seed ^ 0x5DEE_CE66)),
    );
    let (pay_proxy, pay_url) = FaultProxy::in_front_of(&payments.base).await;
    let (ship_proxy, ship_url) = FaultProxy::in_front_of(&shipping.base).await;
    let providers = chaos::provider_args(&pay_url, &ship_url);
    let mut fleet = Fleet::start(&t, &providers, &broker);
    eprintln!(
        "fleet: {stack:?}, {} orders, seed {}, faults at {}, url {}, logs {}",
        k.n,
        k.seed,
        k.rate,
        t.url,
        fleet.logs.display()
    );
    broker.wait_for_groups().await;
    let mut proxies = vec![Arc::new(pay_proxy), Arc::new(ship_proxy)];
    proxies.extend(broker.proxy.clone());
    let firing = Arc::new(AtomicBool::new(true));
    let cutting = tokio::spawn(cut_at_random(
        proxies.clone(),
        k.seed ^ 0x00C0_FFEE,
        firing.clone(),
    ));
    let client = Client::new(k.n);
    let driving = tokio::spawn(client.clone().drive(fleet.bases.clone()));
    let deadline = Instant::now() + LIMIT;
    let kills = fire(&mut fleet, &client, &k, deadline).await;
    firing.store(false, Ordering::SeqCst);
    driving.await.unwrap();
    let cuts = cutting.await.unwrap();
    for p in &proxies {
        p.restore();
    }
    eprintln!(
        "fleet: {kills} SIGKILLs, {cuts} cuts, {} requests for {} orders; converging",
        client.sent.load(Ordering::SeqCst),
        k.n
    );
    converge(&t, &mut fleet, k.n, deadline).await;
    let states = chaos::effect_states(&t).await;
    chaos::assert_counted_at_the_providers(&t, &payments.base, &shipping.base, &states).await;
    let direct = chaos::provider_args(&payments.base, &shipping.base);
    for provider in ["payments", "shipping"] {
        chaos::reconcile_reports_nothing(&t, provider, &direct).await;
    }
    let compared = client.replays_match(fleet.bases.clone()).await;
    eprintln!("fleet: {compared} answers equal their key's replay");
    drop(fleet);
    if let Some(r) = broker.rabbit {
        r.delete().await;
    }
}

/// The kill loop: a random process every 100–700 ms until every order has an answer and
/// `min_kills` kills happened. Returns the number of kills. Fails after [`STALL`] without a
/// new answer (the suite's load slows a run down; a stall is what fails it).
async fn fire(fleet: &mut Fleet, client: &Client, k: &Knobs, deadline: Instant) -> u64 {
    let mut rng = Rng(k.seed);
    let mut kills = 0u64;
    let mut last = (0, Instant::now());
    loop {
        let answered = client.answered.load(Ordering::SeqCst);
        if answered >= k.n && kills >= k.min_kills {
            return kills;
        }
        if answered != last.0 {
            last = (answered, Instant::now());
        }
        assert!(
            last.1.elapsed() < STALL,
            "no new answer for {STALL:?}: {answered} of {} orders answered",
            k.n
        );
        assert!(Instant::now() < deadline, "no end within {LIMIT:?}");
        tokio::time::sleep(Duration::from_millis(100 + rng.below(600))).await;
        kills += fleet.kill_some(&mut rng).await;
    }
}

/// Waits until every flow has ended and nothing is pending, then checks the counts of
/// orders and invoices. Fails after [`STALL`] without any change.
async fn converge(t: &TestDb, fleet: &mut Fleet, n: usize, deadline: Instant) {
    let orders = i64::try_from(n).unwrap();
    let mut last = (BTreeMap::new(), Instant::now());
    let mut restarted = Instant::now();
    loop {
        fleet.all_alive();
        let states = chaos::effect_states(t).await;
        if states != last.0 {
            last = (states.clone(), Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(45)
            && restarted.elapsed() > Duration::from_secs(45)
        {
            fleet.restart_consumers();
            restarted = Instant::now();
        }
        let pending = count(
            t,
            "SELECT COUNT(*) FROM oncely_outbox WHERE state <> 'published'",
        )
        .await;
        let open = count(
            t,
            "SELECT COUNT(*) FROM oncely_idempotency WHERE state IN ('processing', 'unknown')",
        )
        .await;
        if chaos::settled(&states, orders) && pending == 0 && open == 0 {
            eprintln!("fleet: effects {states:?}");
            break;
        }
        assert!(
            Instant::now() < deadline && last.1.elapsed() < STALL,
            "not settled ({:?} without a change, {LIMIT:?} in all): {states:?}, outbox pending \
             {pending}, open records {open}; logs in {}",
            last.1.elapsed(),
            fleet.logs.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pairs = [
        ("SELECT COUNT(*) FROM orders", "orders"),
        (
            "SELECT COUNT(DISTINCT external_ref) FROM orders",
            "orders' external references",
        ),
        ("SELECT COUNT(*) FROM invoices", "invoices"),
        (
            "SELECT COUNT(DISTINCT order_id) FROM invoices",
            "invoiced orders",
        ),
    ];
    for (sql, what) in pairs {
        assert_eq!(count(t, sql).await, orders, "{what}");
    }
}

/// The one number `sql` (a `COUNT`) reads.
async fn count(t: &TestDb, sql: &str) -> i64 {
    let rows: Vec<(i64,)> = t.db.fetch_all(oncely_sql::query(sql)).await.unwrap();
    rows.first().map_or(0, |(n,)| *n)
}
