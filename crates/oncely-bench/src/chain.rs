//! `oncely-bench chain`: the whole chain — `POST /v1/orders` → outbox → relay → broker →
//! `billing` consumer → invoice row — in orders/s, beside the intake alone in the same run.
//!
//! Everything runs in this process with the order service's own parts, each "process" on
//! a pool of its own against one fresh PostgreSQL schema: [`orders::serve`] on a loopback
//! listener per instance, [`oncely_runtime::RelaySupervisor`] per relay, and
//! [`orders::billing_consumer`] through [`oncely_runtime::ConsumerSettings`] — what
//! `orders serve` and `orders consume billing` start. Each round runs three phases, each on
//! a fresh schema and a fresh topic (and RabbitMQ queues / NATS stream / Kafka group):
//! - **intake**: one `serve`, no relay, no consumer — orders/s accepted (201);
//! - **chain ×1**: one `serve`, one relay, one consumer;
//! - **chain ×N**: `--serves` instances (clients spread over them), `--relays` relays and one
//!   consumer.
//!
//! A chain phase's end-to-end figure counts the invoices whose `created_at` falls between
//! the window's first invoice and the end of the `--seconds` window of posting, divided by
//! that span (the ramp of one latency is left out; a backlog that grows is not counted);
//! then the tail is awaited until every accepted order has its invoice.
//! Latency is the invoice's `created_at` (the consumer's wall clock in ms, taken in its
//! transaction just before the commit) minus the wall clock at the start of the POST, on
//! the same host: it covers intake, commit, relay, broker and the consumer's handler, and
//! misses only the consumer's commit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use oncely_broker::Subscriber;
use oncely_inbox::{Consumer, ConsumerConfig};
use oncely_outbox::RelayConfig;
use oncely_runtime::{
    BrokerConfig, BrokerKind, ConsumerFactory, ConsumerSettings, RelaySupervisor,
};
use oncely_sql::{query, Database, DbOptions};
use oncely_testkit::TestDb;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::intake::API_KEY;
use crate::stats::{median, quantile};

#[derive(Debug, Args)]
pub(crate) struct ChainBenchArgs {
    /// Database to measure on; a fresh schema per phase is used.
    #[arg(
        long,
        env = "ONCELY_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// The broker between the relay and the consumer.
    #[arg(long, value_enum, default_value_t = BrokerKind::Rabbitmq)]
    broker: BrokerKind,
    #[command(flatten)]
    urls: crate::relay::BrokerUrls,
    /// Seconds of posting per phase.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Rounds of (intake, chain ×1, chain ×N); the figures printed are the medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrent HTTP clients (spread over the `serve` instances).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Connections of each pool: each `serve`, each relay and the consumer have one (the
    /// consumer handles this many messages at once).
    #[arg(long, default_value_t = 6)]
    pool: u32,
    /// Connections of each `serve`'s pool in the scaled phase (default `--pool`): e.g. 2 with
    /// 4 serves keeps the intake's connections near the one-process phase's.
    #[arg(long)]
    scaled_serve_pool: Option<u32>,
    /// `serve` instances of the scaled phase.
    #[arg(long, default_value_t = 4)]
    serves: usize,
    /// Relays of the scaled phase.
    #[arg(long, default_value_t = 2)]
    relays: usize,
    /// Longest wait for the tail (every accepted order invoiced) after posting, seconds.
    #[arg(long, default_value_t = 120)]
    drain_secs: u64,
}

/// What runs in a phase.
#[derive(Debug, Clone, Copy)]
struct Layout {
    serves: usize,
    /// Connections of each serve's pool.
    serve_pool: u32,
    relays: usize,
    consumer: bool,
}

/// Warm-up orders per phase, posted (and invoiced) before the window opens.
const WARM_UP: usize = 20;

/// The RabbitMQ exchange of the benchmark's events (the relay benchmark's).
const EXCHANGE: &str = "oncely.bench";

/// The billing consumer through the service's own constructor.
struct Billing;

impl ConsumerFactory for Billing {
    fn build<S: Subscriber>(&self, db: &Database, s: S, c: ConsumerConfig) -> Consumer<S> {
        orders::billing_consumer(db.clone(), s, c)
    }
}

/// One phase's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    /// Orders accepted (201) per second while posting.
    posts: f64,
    /// Invoices written per second inside the posting window (chain phases).
    invoices: f64,
    /// POST start → invoice row, ms.
    p50: i64,
    p99: i64,
    /// From the window's end to the last invoice, seconds.
    tail: f64,
}

pub(crate) async fn run(args: ChainBenchArgs) -> anyhow::Result<()> {
    println!(
        "oncely-bench chain — PostgreSQL, broker {}, {} concurrent clients over HTTP/1.1 on \
         loopback, {} round(s) × {} s per phase, pools of {} connections, scaled phase: {} \
         serve + {} relays + 1 consumer",
        args.broker.as_str(),
        args.concurrency,
        args.rounds,
        args.seconds,
        args.pool,
        args.serves,
        args.relays
    );
    let one = Layout {
        serves: 1,
        serve_pool: args.pool,
        relays: 1,
        consumer: true,
    };
    let scaled = Layout {
        serves: args.serves.max(1),
        serve_pool: args.scaled_serve_pool.unwrap_or(args.pool).max(1),
        relays: args.relays.max(1),
        consumer: true,
    };
    let intake = Layout {
        serves: 1,
        serve_pool: args.pool,
        relays: 0,
        consumer: false,
    };
    let mut rounds = Vec::new();
    for round in 1..=args.rounds.max(1) {
        let i = phase(&args, intake).await?;
        let c = phase(&args, one).await?;
        let s = phase(&args, scaled).await?;
        print_round(round, &i, &c, &s);
        rounds.push((i, c, s));
    }
    print_medians(&rounds, scaled);
    Ok(())
}

/// A fresh schema and topic, the layout's parts started, `WARM_UP` orders through the whole
/// chain, then the measured window; everything stopped and removed whatever the outcome.
async fn phase(args: &ChainBenchArgs, layout: Layout) -> anyhow::Result<Figures> {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let broker = broker_config(args, &tag);
    prepare(&broker).await?;
    let system = System::start(args, &broker, layout).await?;
    let measured = measure(args, &system, layout).await;
    system.stop().await;
    clean_up(&broker).await;
    measured
}

/// The broker settings of one phase: its own topic, queues, stream and group ids.
fn broker_config(args: &ChainBenchArgs, tag: &str) -> BrokerConfig {
    let topic = format!("chain{tag}");
    BrokerConfig {
        kind: args.broker,
        amqp_url: args.urls.amqp_url.clone(),
        amqp_exchange: EXCHANGE.to_owned(),
        amqp_queue_prefix: format!("oncely-bench.{tag}"),
        nats_url: args.urls.nats_url.clone(),
        nats_stream: format!("CHAIN{}", tag.to_ascii_uppercase()),
        nats_subjects: vec![topic.clone()],
        kafka_brokers: args.urls.kafka_brokers.clone(),
        kafka_topics: vec![topic],
        kafka_group_prefix: Some(format!("oncely-bench.{tag}")),
        ..BrokerConfig::default()
    }
}

fn topic(broker: &BrokerConfig) -> &str {
    &broker.kafka_topics[0]
}

/// Kafka: the topic exists before the consumer subscribes (the relay would create it only
/// once it connects).
async fn prepare(broker: &BrokerConfig) -> anyhow::Result<()> {
    if broker.kind == BrokerKind::Kafka {
        oncely_broker::ensure_topic(&broker.kafka_brokers, topic(broker), 3)
            .await
            .context("creating the Kafka topic (is Kafka up? try --broker rabbitmq)")?;
    }
    Ok(())
}

/// Removes the phase's RabbitMQ queues or NATS stream (best effort). Kafka's topic stays
/// (tansu keeps it in memory; a real cluster's retention removes the records).
async fn clean_up(broker: &BrokerConfig) {
    match broker.kind {
        BrokerKind::Rabbitmq => {
            let Ok(conn) = lapin::Connection::connect(
                &broker.amqp_url,
                oncely_broker::amqp_connection_properties(),
            )
            .await
            else {
                return;
            };
            if let Ok(ch) = conn.create_channel().await {
                let queue = format!("{}.{}", broker.amqp_queue_prefix, orders::BILLING_CONSUMER);
                for q in [format!("{queue}.retry"), format!("{queue}.dead"), queue] {
                    let options = lapin::options::QueueDeleteOptions::default();
                    drop(ch.queue_delete(q.as_str(), options).await);
                }
            }
            drop(conn.close(0, "bench done").await);
        }
        BrokerKind::Nats => {
            let config = oncely_broker::NatsConfig::new(&broker.nats_url);
            if let Ok(p) = oncely_broker::NatsPublisher::connect(config).await {
                drop(p.jetstream().delete_stream(&broker.nats_stream).await);
            }
        }
        BrokerKind::Kafka | BrokerKind::Sql => {}
    }
}

/// The running parts of one phase.
struct System {
    /// Kept so the fresh schema outlives the parts; dropped (and the schema with it) last.
    test_db: TestDb,
    pools: Vec<Database>,
    urls: Vec<String>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl System {
    /// The consumer first, so its group is subscribed before the first event goes out,
    /// then the relays, then the `serve` instances.
    async fn start(
        args: &ChainBenchArgs,
        broker: &BrokerConfig,
        layout: Layout,
    ) -> anyhow::Result<Self> {
        let small = DbOptions {
            max_connections: 2,
            ..DbOptions::default()
        };
        let test_db = TestDb::fresh(&args.database_url, &small)
            .await
            .ok_or_else(|| anyhow::anyhow!("database unreachable: {}", args.database_url))?;
        orders::migrate(&test_db.db).await?;
        let mut system = Self {
            test_db,
            pools: Vec::new(),
            urls: Vec::new(),
            stop: CancellationToken::new(),
            tasks: Vec::new(),
        };
        if let Err(e) = system.spawn_parts(args, broker, layout).await {
            system.stop().await;
            return Err(e);
        }
        Ok(system)
    }

    async fn spawn_parts(
        &mut self,
        args: &ChainBenchArgs,
        broker: &BrokerConfig,
        layout: Layout,
    ) -> anyhow::Result<()> {
        if layout.consumer {
            let db = self.pool(args.pool).await?;
            let settings = ConsumerSettings {
                group: orders::BILLING_CONSUMER.to_owned(),
                topic: topic(broker).to_owned(),
                lease: Duration::from_secs(30),
                consumer: ConsumerConfig {
                    concurrency: args.pool as usize,
                    poll: Duration::from_millis(5),
                    ..ConsumerConfig::default()
                },
            };
            let stop = self.stop.clone();
            self.tasks
                .push(settings.spawn(broker, &db, &Billing, stop).await?);
        }
        for _ in 0..layout.relays {
            let db = self.pool(args.pool).await?;
            let relay = RelaySupervisor {
                broker: broker.clone(),
                relay: RelayConfig::default(),
            };
            self.tasks.push(relay.spawn(&db, self.stop.clone())?);
        }
        for _ in 0..layout.serves {
            let db = self.pool(layout.serve_pool).await?;
            self.spawn_serve(db, topic(broker)).await?;
        }
        Ok(())
    }

    /// A pool of `size` connections of its own on the phase's schema, as a process has.
    async fn pool(&mut self, size: u32) -> anyhow::Result<Database> {
        let options = DbOptions {
            max_connections: size,
            ..DbOptions::default()
        };
        let db = Database::connect(&self.test_db.url, &options).await?;
        self.pools.push(db.clone());
        Ok(db)
    }

    /// `orders::serve` on a free loopback port, events to `topic`.
    async fn spawn_serve(&mut self, db: Database, topic: &str) -> anyhow::Result<()> {
        let config = orders::AppConfig {
            api_keys: orders::parse_api_keys(&format!("{API_KEY}=bench"))?,
            events_topic: topic.to_owned(),
            ..orders::AppConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        self.urls
            .push(format!("http://{}/v1/orders", listener.local_addr()?));
        let stop = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            let shutdown = async move { stop.cancelled().await };
            if let Err(e) = orders::serve(listener, db, config, shutdown).await {
                tracing::warn!(error = %e, "serve failed");
            }
        }));
        Ok(())
    }

    /// Stops every part (bounded wait), closes the pools; the schema goes with `test_db`.
    async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            if tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .is_err()
            {
                tracing::warn!("a part did not stop within 30 s");
            }
        }
        for db in self.pools {
            db.close().await;
        }
        drop(self.test_db);
    }

    /// Invoices written so far, with their order and time.
    async fn invoices(&self) -> anyhow::Result<Vec<(String, i64)>> {
        Ok(self
            .test_db
            .db
            .fetch_all(query("SELECT order_id, created_at FROM invoices"))
            .await?)
    }

    async fn invoice_count(&self) -> anyhow::Result<usize> {
        let row: Option<(i64,)> = self
            .test_db
            .db
            .fetch_optional(query("SELECT COUNT(*) FROM invoices"))
            .await?;
        Ok(usize::try_from(row.map_or(0, |r| r.0)).unwrap_or(0))
    }

    /// Waits until `n` invoices exist; fails past `limit` (naming how far it got).
    async fn await_invoices(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let have = self.invoice_count().await?;
            if have >= n {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the chain did not drain: {have} of {n} invoices after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Warm-up, the window of posting, the tail; the phase's figures.
async fn measure(
    args: &ChainBenchArgs,
    system: &System,
    layout: Layout,
) -> anyhow::Result<Figures> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    let warm = Load::new(&client, &system.urls, "warm");
    warm.post_n(WARM_UP).await?;
    if layout.consumer {
        // Subscriptions bound, relays connected, consumer group joined.
        system
            .await_invoices(WARM_UP, Duration::from_secs(args.drain_secs))
            .await
            .context("warm-up")?;
    }
    let load = Load::new(&client, &system.urls, "run");
    let window = load.run(args.concurrency, args.seconds).await?;
    let mut figures = Figures {
        posts: window.accepted.len() as f64 / window.secs,
        ..Figures::default()
    };
    if layout.consumer {
        let limit = Duration::from_secs(args.drain_secs);
        system
            .await_invoices(WARM_UP + window.accepted.len(), limit)
            .await?;
        chain_figures(&mut figures, &window, &system.invoices().await?)?;
    }
    Ok(figures)
}

/// Fills the end-to-end rate, latency and tail of `figures` from the invoices of the
/// window's orders. The rate counts the invoices written from the window's first invoice
/// to the window's end, over that span: the ramp before the first invoice (one latency)
/// is left out, and so is the tail after the window (a backlog is not counted).
fn chain_figures(
    figures: &mut Figures,
    window: &Window,
    invoices: &[(String, i64)],
) -> anyhow::Result<()> {
    let times: Vec<(i64, i64)> = invoices
        .iter()
        // Warm-up orders are not in the window.
        .filter_map(|(order, created)| Some((*window.accepted.get(order)?, *created)))
        .collect();
    anyhow::ensure!(
        times.len() == window.accepted.len(),
        "{} of {} orders invoiced",
        times.len(),
        window.accepted.len()
    );
    let first = times.iter().map(|t| t.1).min().unwrap_or(window.end_ms);
    let last = times.iter().map(|t| t.1).max().unwrap_or(window.end_ms);
    let inside = times.iter().filter(|t| t.1 <= window.end_ms).count();
    let span_ms = window.end_ms - first;
    anyhow::ensure!(
        span_ms > 0,
        "no invoice within the window; try more --seconds"
    );
    let mut latencies: Vec<i64> = times
        .iter()
        .map(|(at, created)| (created - at).max(0))
        .collect();
    latencies.sort_unstable();
    figures.invoices = inside as f64 * 1000.0 / span_ms as f64;
    figures.p50 = quantile(&latencies, 0.50).unwrap_or(0);
    figures.p99 = quantile(&latencies, 0.99).unwrap_or(0);
    figures.tail = (last - window.end_ms).max(0) as f64 / 1000.0;
    Ok(())
}

/// The accepted orders of a window (id → wall-clock ms at the POST's start), its end (wall
/// clock, ms) and its length.
struct Window {
    accepted: HashMap<String, i64>,
    end_ms: i64,
    secs: f64,
}

/// Clients posting new orders, spread round-robin over `urls`.
struct Load {
    client: reqwest::Client,
    urls: Arc<Vec<String>>,
    run: String,
    seq: Arc<AtomicU64>,
}

impl Load {
    fn new(client: &reqwest::Client, urls: &[String], label: &str) -> Self {
        Self {
            client: client.clone(),
            urls: Arc::new(urls.to_vec()),
            run: format!("{label}-{}", uuid::Uuid::now_v7().simple()),
            seq: Arc::new(AtomicU64::new(0)),
        }
    }

    /// `n` orders one after another.
    async fn post_n(&self, n: usize) -> anyhow::Result<()> {
        for i in 0..n {
            self.post(&self.urls[i % self.urls.len()]).await?;
        }
        Ok(())
    }

    /// `concurrency` clients posting for `secs` (client `i` to `urls[i % len]`).
    async fn run(&self, concurrency: usize, secs: u64) -> anyhow::Result<Window> {
        let accepted = Arc::new(Mutex::new(HashMap::new()));
        let failed = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let deadline = started + Duration::from_secs(secs);
        let end_ms = oncely_core::now_ms() + i64::try_from(secs * 1000).unwrap_or(i64::MAX);
        let mut tasks = Vec::new();
        for i in 0..concurrency.max(1) {
            let this = self.clone_for_task();
            let (accepted, failed) = (accepted.clone(), failed.clone());
            let url = self.urls[i % self.urls.len()].clone();
            tasks.push(tokio::spawn(async move {
                while Instant::now() < deadline {
                    match this.post(&url).await {
                        Ok((id, at)) => drop(accepted.lock().expect("lock").insert(id, at)),
                        Err(_) => drop(failed.fetch_add(1, Ordering::Relaxed)),
                    }
                }
            }));
        }
        for t in tasks {
            t.await?;
        }
        let secs = started.elapsed().as_secs_f64();
        let failed = failed.load(Ordering::Relaxed);
        anyhow::ensure!(failed == 0, "{failed} posts failed");
        let accepted = std::mem::take(&mut *accepted.lock().expect("lock"));
        Ok(Window {
            accepted,
            end_ms,
            secs,
        })
    }

    fn clone_for_task(&self) -> Self {
        Self {
            client: self.client.clone(),
            urls: self.urls.clone(),
            run: self.run.clone(),
            seq: self.seq.clone(),
        }
    }

    /// One new order; its id (from `Location`) and the wall-clock ms at the POST's start.
    async fn post(&self, url: &str) -> anyhow::Result<(String, i64)> {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let body = serde_json::json!({
            "source": "bench",
            "external_ref": format!("{}-{n}", self.run),
            "customer_id": "c-1",
            "items": [{"sku": "sku-1", "quantity": 2}, {"sku": "sku-2", "quantity": 1}],
            "amount_minor": 1999,
            "currency": "EUR"
        });
        let at = oncely_core::now_ms();
        let r = self
            .client
            .post(url)
            .bearer_auth(API_KEY)
            .header("idempotency-key", format!("{}-{n}", self.run))
            .json(&body)
            .send()
            .await?;
        anyhow::ensure!(r.status() == 201, "POST answered {}", r.status());
        let id = r
            .headers()
            .get("location")
            .and_then(|l| l.to_str().ok())
            .and_then(|l| l.strip_prefix("/v1/orders/"))
            .context("no Location")?
            .to_owned();
        drop(r.bytes().await);
        Ok((id, at))
    }
}

fn print_round(round: usize, intake: &Figures, one: &Figures, scaled: &Figures) {
    println!(
        "round {round}: intake {:.0}/s | chain ×1 {:.0}/s e2e ({:.0}/s posted, p50 {} ms, p99 {} \
         ms, tail {:.1} s) | chain scaled {:.0}/s e2e ({:.0}/s posted, p50 {} ms, p99 {} ms, \
         tail {:.1} s)",
        intake.posts,
        one.invoices,
        one.posts,
        one.p50,
        one.p99,
        one.tail,
        scaled.invoices,
        scaled.posts,
        scaled.p50,
        scaled.p99,
        scaled.tail
    );
}

/// The medians over rounds of each figure and of each round's ratios.
fn print_medians(rounds: &[(Figures, Figures, Figures)], scaled: Layout) {
    let m = |f: &dyn Fn(&(Figures, Figures, Figures)) -> f64| {
        median(&mut rounds.iter().map(f).collect::<Vec<_>>())
    };
    let intake = m(&|r| r.0.posts);
    println!(
        "{:<46} {:>8.0} orders/s   (baseline)",
        "intake alone: POST /v1/orders (1 serve)", intake
    );
    println!(
        "{:<46} {:>8.0} orders/s   ratio {:.2}× intake; p50 {:.0} ms, p99 {:.0} ms; posted \
         {:.0}/s",
        "whole chain: POST → invoice (1 serve, 1 relay)",
        m(&|r| r.1.invoices),
        m(&|r| r.1.invoices / r.0.posts),
        m(&|r| r.1.p50 as f64),
        m(&|r| r.1.p99 as f64),
        m(&|r| r.1.posts)
    );
    println!(
        "{:<46} {:>8.0} orders/s   ratio {:.2}× chain ×1 (target ≥ 0.9); p50 {:.0} ms, p99 \
         {:.0} ms; posted {:.0}/s",
        format!(
            "whole chain: {} serves (pools of {}), {} relays",
            scaled.serves, scaled.serve_pool, scaled.relays
        ),
        m(&|r| r.2.invoices),
        m(&|r| r.2.invoices / r.1.invoices),
        m(&|r| r.2.p50 as f64),
        m(&|r| r.2.p99 as f64),
        m(&|r| r.2.posts)
    );
    println!(
        "(medians of {} rounds; latency: POST start → invoice row's created_at)",
        rounds.len()
    );
}
