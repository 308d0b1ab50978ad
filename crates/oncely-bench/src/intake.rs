//! `oncely-bench intake`: order intake through the idempotency layer beside the same handler
//! without it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use oncely_sql::DbOptions;
use oncely_testkit::TestDb;
use orders::AppConfig;

use crate::stats::median;

/// The load of `intake` and of `gateway`: where, how long, how many clients, how many rounds.
#[derive(Debug, Args)]
pub(crate) struct IntakeArgs {
    /// Database to measure on; a fresh schema (PostgreSQL) or file (SQLite) is used.
    #[arg(
        long,
        env = "ONCELY_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub(crate) database_url: String,
    /// Seconds per measured phase.
    #[arg(long, default_value_t = 5)]
    pub(crate) seconds: u64,
    /// Concurrent HTTP clients.
    #[arg(long, default_value_t = 16)]
    pub(crate) concurrency: usize,
    /// Alternating rounds of (baseline, guarded, replay); each round is printed, then the
    /// medians of the rounds' rates and of their ratios.
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: u32,
}

/// The benchmark clients' API key (tenant `bench`).
pub(crate) const API_KEY: &str = "bench-key-0123456789abcdef";

pub(crate) async fn start(router: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(format!("http://{addr}/v1/orders"))
}

pub(crate) fn body(n: u64, run: &str) -> String {
    serde_json::json!({
        "source": "bench",
        "external_ref": format!("{run}-{n}"),
        "customer_id": "c-1",
        "items": [{"sku": "sku-1", "quantity": 2}, {"sku": "sku-2", "quantity": 1}],
        "amount_minor": 1999,
        "currency": "EUR"
    })
    .to_string()
}

/// Runs `concurrency` clients for `secs`; each request is built by `make(n)` and counts
/// when its status is `expect`. Returns successful requests per second.
pub(crate) async fn load(
    client: &reqwest::Client,
    url: &str,
    concurrency: usize,
    secs: u64,
    expect: u16,
    make: Arc<dyn Fn(u64) -> (String, String) + Send + Sync>,
) -> anyhow::Result<f64> {
    Ok(load_timed(client, url, concurrency, secs, expect, make)
        .await?
        .per_sec)
}

/// What [`load_timed`] measured: successful requests per second and the latency of each
/// successful request, µs, unordered.
#[derive(Debug, Default)]
pub(crate) struct Timed {
    pub(crate) per_sec: f64,
    pub(crate) latencies_us: Vec<u32>,
}

/// As [`load`], also keeping each successful request's latency (µs, one `Vec` per client,
/// merged at the end so the clients share no lock).
pub(crate) async fn load_timed(
    client: &reqwest::Client,
    url: &str,
    concurrency: usize,
    secs: u64,
    expect: u16,
    make: Arc<dyn Fn(u64) -> (String, String) + Send + Sync>,
) -> anyhow::Result<Timed> {
    let bad = Arc::new(AtomicU64::new(0));
    let seq = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, bad, seq, make) = (
            client.clone(),
            url.to_owned(),
            bad.clone(),
            seq.clone(),
            make.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline {
                let (key, body) = make(seq.fetch_add(1, Ordering::Relaxed));
                let sent = Instant::now();
                let res = client
                    .post(&url)
                    .bearer_auth(API_KEY)
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                match res {
                    Ok(r) if r.status().as_u16() == expect => {
                        drop(r.bytes().await);
                        let us = sent.elapsed().as_micros();
                        latencies.push(u32::try_from(us).unwrap_or(u32::MAX));
                    }
                    _ => {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            latencies
        }));
    }
    let mut latencies_us = Vec::new();
    for t in tasks {
        latencies_us.extend(t.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let bad = bad.load(Ordering::Relaxed);
    anyhow::ensure!(bad == 0, "{bad} requests got an unexpected answer");
    Ok(Timed {
        per_sec: latencies_us.len() as f64 / elapsed,
        latencies_us,
    })
}

pub(crate) async fn run(args: IntakeArgs) -> anyhow::Result<()> {
    let bench = Bench::start(&args).await?;
    let replay_set = bench.seed_replay_set().await?;
    println!(
        "oncely-bench intake — {}, {} concurrent clients over HTTP/1.1 on loopback, {} round(s) × {} s per phase",
        bench.test_db.db.backend(),
        args.concurrency,
        args.rounds,
        args.seconds
    );
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let figures = bench.round(&args, round, &replay_set).await?;
        figures.print_round(round + 1);
        rounds.push(figures);
    }
    Figures::print_medians(&rounds);
    Ok(())
}

/// The three servers under test (same handler, same database) and one client for all.
struct Bench {
    /// Kept so the fresh schema or file outlives the servers.
    test_db: TestDb,
    layer_url: String,
    /// The layer with its replay cache off: replays read the store.
    uncached_url: String,
    bare_url: String,
    client: reqwest::Client,
}

impl Bench {
    async fn start(args: &IntakeArgs) -> anyhow::Result<Self> {
        let options = DbOptions {
            max_connections: 32,
            ..DbOptions::default()
        };
        let test_db = TestDb::fresh(&args.database_url, &options)
            .await
            .ok_or_else(|| anyhow::anyhow!("database unreachable: {}", args.database_url))?;
        orders::migrate(&test_db.db).await?;
        let config = AppConfig {
            api_keys: orders::parse_api_keys(&format!("{API_KEY}=bench"))?,
            ..AppConfig::default()
        };
        let layer_url = start(orders::router(test_db.db.clone(), &config)).await?;
        let mut uncached = config.clone();
        uncached.idempotency.replay_cache_bytes = 0;
        let uncached_url = start(orders::router(test_db.db.clone(), &uncached)).await?;
        let bare_url = start(orders::router_without_idempotency(
            test_db.db.clone(),
            &config,
        ))
        .await?;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(args.concurrency)
            .build()?;
        Ok(Self {
            test_db,
            layer_url,
            uncached_url,
            bare_url,
            client,
        })
    }

    /// Orders created once through the layer, to be re-sent with their keys.
    async fn seed_replay_set(&self) -> anyhow::Result<Arc<Vec<(String, String)>>> {
        let replay_set: Vec<(String, String)> = (0..256)
            .map(|n| (format!("replay-{n}"), body(n, "replay")))
            .collect();
        for (key, body) in &replay_set {
            let r = self
                .client
                .post(&self.layer_url)
                .bearer_auth(API_KEY)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await?;
            anyhow::ensure!(r.status() == 201, "seeding replay set: {}", r.status());
        }
        Ok(Arc::new(replay_set))
    }

    /// One round of the four phases, in this order; `round` keeps its creates' keys apart
    /// from other rounds' and runs'.
    async fn round(
        &self,
        args: &IntakeArgs,
        round: u32,
        replay_set: &Arc<Vec<(String, String)>>,
    ) -> anyhow::Result<Figures> {
        let tag = format!("r{round}-{}", uuid::Uuid::now_v7().simple());
        let t = tag.clone();
        let bare = self
            .phase(
                args,
                &self.bare_url,
                Arc::new(move |n| (format!("{t}-bare-{n}"), body(n, &format!("{t}-bare")))),
            )
            .await?;
        let t = tag;
        let layer = self
            .phase(
                args,
                &self.layer_url,
                Arc::new(move |n| (format!("{t}-layer-{n}"), body(n, &format!("{t}-layer")))),
            )
            .await?;
        let set = replay_set.clone();
        let replay_store = self
            .phase(
                args,
                &self.uncached_url,
                Arc::new(move |n| set[(n as usize) % set.len()].clone()),
            )
            .await?;
        let set = replay_set.clone();
        let replay = self
            .phase(
                args,
                &self.layer_url,
                Arc::new(move |n| set[(n as usize) % set.len()].clone()),
            )
            .await?;
        Ok(Figures {
            bare,
            layer,
            replay,
            replay_store,
        })
    }

    async fn phase(
        &self,
        args: &IntakeArgs,
        url: &str,
        make: Arc<dyn Fn(u64) -> (String, String) + Send + Sync>,
    ) -> anyhow::Result<f64> {
        load(&self.client, url, args.concurrency, args.seconds, 201, make).await
    }
}

/// Successful requests per second of each phase.
#[derive(Debug, Clone, Copy)]
struct Figures {
    bare: f64,
    layer: f64,
    replay: f64,
    replay_store: f64,
}

impl Figures {
    /// The round's rates per second and its ratios to the bare create, on one line.
    fn print_round(self, round: u32) {
        let Self {
            bare,
            layer,
            replay,
            replay_store,
        } = self;
        println!(
            "round {round}: bare {bare:.0}/s, layer {layer:.0}/s ({:.2}×), replays {replay:.0}/s \
             ({:.2}×), from the store {replay_store:.0}/s ({:.2}×)",
            layer / bare,
            replay / bare,
            replay_store / bare
        );
    }

    /// The medians of the rounds' rates, and of each round's ratio (so that a round whose
    /// phases all ran slower does not move the ratio), beside the targets.
    fn print_medians(rounds: &[Self]) {
        let of = |f: fn(&Self) -> f64| median(&mut rounds.iter().map(f).collect::<Vec<_>>());
        let bare = of(|r| r.bare);
        println!(
            "{:<44} {:>10.1} /s   (baseline)",
            "creates, bare handler (no idempotency layer)", bare
        );
        println!(
            "{:<44} {:>10.1} /s   ratio {:.2}× bare (median of rounds; target ≥ 0.9)",
            "creates, idempotency layer",
            of(|r| r.layer),
            of(|r| r.layer / r.bare)
        );
        println!(
            "{:<44} {:>10.1} /s   ratio {:.2}× bare creates (median of rounds; target ≥ 1.5)",
            "replays, idempotency layer (replay cache)",
            of(|r| r.replay),
            of(|r| r.replay / r.bare)
        );
        println!(
            "{:<44} {:>10.1} /s   ratio {:.2}× bare creates (median of rounds; target ≥ 3)",
            "replays, store lookups (replay cache off)",
            of(|r| r.replay_store),
            of(|r| r.replay_store / r.bare)
        );
    }
}
