//! `oncely-bench gateway`: requests through `oncely gateway` beside the same requests sent
//! directly to the same upstream.
//!
//! The upstream is a small order service in this process: `POST /orders` inserts one row
//! into a table of the benchmark's database and answers 201 with the order, the work a
//! real service does per create. Four phases alternate per round, each `--seconds` long
//! with `--concurrency` clients:
//! - **direct**: new keys straight to the upstream (the baseline);
//! - **gateway, passed through**: the same create on a path the gateway does not guard
//!   (the cost of the proxy hop alone, which bounds any gateway);
//! - **gateway, new keys**: the same through the gateway (reserve, forward, store);
//! - **gateway, replays**: keys already answered, sent again (served from the store; the
//!   upstream is not called).

use std::sync::Arc;

use clap::Args;
use oncely_gateway::{Authentication, GatewayConfig, RouteConfig};
use oncely_sql::{query, Database};

use crate::intake::{load, IntakeArgs, API_KEY};

#[derive(Debug, Args)]
pub(crate) struct GatewayBenchArgs {
    /// The database (the gateway's store and the upstream's orders), clients, rounds.
    #[command(flatten)]
    load: IntakeArgs,
    /// Milliseconds the upstream works per create besides its insert (a real service's
    /// validation and calls). 0 measures the gateway beside the cheapest upstream there
    /// is: one insert, where the gateway's own two commits per new key dominate.
    #[arg(long, default_value_t = 0)]
    upstream_ms: u64,
}

/// The upstream's state: its database and its work per create.
#[derive(Clone)]
struct Upstream {
    db: Database,
    work: std::time::Duration,
}

/// `POST /orders` of the upstream: one row, 201 with it.
async fn create(
    axum::extract::State(Upstream { db, work }): axum::extract::State<Upstream>,
    body: String,
) -> (http::StatusCode, String) {
    if !work.is_zero() {
        tokio::time::sleep(work).await;
    }
    let id = uuid::Uuid::now_v7().to_string();
    let insert = query("INSERT INTO bench_upstream_orders (id, body) VALUES ($1, $2)")
        .bind(id.as_str())
        .bind(body.as_str());
    match db.execute(insert).await {
        Ok(_) => (
            http::StatusCode::CREATED,
            serde_json::json!({"id": id, "status": "created"}).to_string(),
        ),
        Err(e) => (http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Serves `router` on a free loopback port; its base URL.
async fn start(router: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(base)
}

pub(crate) async fn run(args: GatewayBenchArgs) -> anyhow::Result<()> {
    // The gateway's store and the upstream share the pool: both sides of each request.
    let test_db = crate::db::fresh(&args.load.database_url, args.load.concurrency * 2).await?;
    let db = test_db.db.clone();
    db.migrate().await?;
    db.execute(query(
        "CREATE TABLE bench_upstream_orders (id VARCHAR(64) PRIMARY KEY, body TEXT NOT NULL)",
    ))
    .await?;
    let upstream = start(
        axum::Router::new()
            .route("/orders", axum::routing::post(create))
            // The same create on a path the gateway does not guard: passed through.
            .route("/plain/orders", axum::routing::post(create))
            .with_state(Upstream {
                db: db.clone(),
                work: std::time::Duration::from_millis(args.upstream_ms),
            }),
    )
    .await?;
    let mut config = GatewayConfig::new(upstream.as_str());
    config.routes.push(RouteConfig::parse("POST /orders")?);
    let keys = oncely_http::parse_api_keys(&format!("{API_KEY}=bench"))?;
    let router = oncely_gateway::router(
        &config,
        &db,
        Authentication::ApiKeys(oncely_http::ApiKeys::new(keys)),
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gateway = format!("http://{}/orders", listener.local_addr()?);
    let proxied = format!("http://{}/plain/orders", listener.local_addr()?);
    let served = db.clone();
    tokio::spawn(async move {
        let limits = config.http;
        oncely_gateway::serve(listener, router, &served, &limits, std::future::pending()).await
    });
    let direct = format!("{upstream}/orders");
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.load.concurrency)
        .build()?;
    println!(
        "oncely-gateway bench — {}, {} concurrent clients over HTTP/1.1 on loopback, {} round(s) × {} s per phase, upstream work {} ms per create",
        db.backend(),
        args.load.concurrency,
        args.load.rounds,
        args.load.seconds,
        args.upstream_ms
    );
    let seeded = seed(&client, &gateway).await?;
    let (mut bare, mut proxy, mut guarded, mut replayed) = (0.0, 0.0, 0.0, 0.0);
    for round in 0..args.load.rounds {
        let fresh = |tag: &'static str| -> Arc<dyn Fn(u64) -> (String, String) + Send + Sync> {
            Arc::new(move |n| {
                let key = format!("{tag}-{round}-{n}");
                (
                    key.clone(),
                    format!(r#"{{"ref":"{key}","amount_minor":1999}}"#),
                )
            })
        };
        let (c, s) = (args.load.concurrency, args.load.seconds);
        bare += load(&client, &direct, c, s, 201, fresh("direct")).await?;
        proxy += load(&client, &proxied, c, s, 201, fresh("proxy")).await?;
        guarded += load(&client, &gateway, c, s, 201, fresh("gateway")).await?;
        let again = seeded.clone();
        let replay: Arc<dyn Fn(u64) -> (String, String) + Send + Sync> =
            Arc::new(move |n| again[(n as usize) % again.len()].clone());
        replayed += load(&client, &gateway, c, s, 201, replay).await?;
    }
    let rounds = f64::from(args.load.rounds);
    let (bare, proxy) = (bare / rounds, proxy / rounds);
    let (guarded, replayed) = (guarded / rounds, replayed / rounds);
    println!("direct to the upstream, new keys:   {bare:>9.0} req/s  (baseline)");
    println!(
        "through the gateway, passed through:{proxy:>9.0} req/s  {:.2} × direct (the proxy hop alone: no key, nothing stored)",
        proxy / bare
    );
    println!(
        "through the gateway, new keys:      {guarded:>9.0} req/s  {:.2} × direct (target ≥ 0.8)",
        guarded / bare
    );
    println!(
        "through the gateway, replays:       {replayed:>9.0} req/s  {:.2} × direct (target > 1)",
        replayed / bare
    );
    Ok(())
}

/// Sends 256 keys through the gateway once, so the replay phase finds them answered.
async fn seed(
    client: &reqwest::Client,
    gateway: &str,
) -> anyhow::Result<Arc<Vec<(String, String)>>> {
    let mut set = Vec::new();
    for n in 0..256 {
        let key = format!("seed-{n}");
        let body = format!(r#"{{"ref":"{key}","amount_minor":1999}}"#);
        let res = client
            .post(gateway)
            .bearer_auth(API_KEY)
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await?;
        anyhow::ensure!(res.status() == 201, "seeding {key}: {}", res.status());
        set.push((key, body));
    }
    Ok(Arc::new(set))
}
