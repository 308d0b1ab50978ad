//! `oncely-bench effects`: charges driven to `succeeded` by the effect runner beside the same
//! charges sent as raw HTTP calls, at the same concurrency, against one payments simulator
//! (`oncely-sim`'s `PaymentsSim` on `127.0.0.1:0`, no faults), in one run.
//!
//! The raw side is what the adapter sends and nothing else: N form-encoded
//! `POST /v1/payment_intents` (as `StripePayments` builds them), each with its own
//! `Idempotency-Key`, C at a time. The runner side enqueues the same N charges
//! (`EffectStore::enqueue`, untimed) and times `EffectRunner` from its start until every one
//! is settled `succeeded`: claim, call, settle with evidence — the durable bookkeeping that
//! makes a retry safe, which is what the ratio prices.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures_util::future::BoxFuture;
use futures_util::StreamExt as _;
use oncely_effects::{
    EffectHandler, EffectRunner, Provider, RunnerConfig, Settled, StripeConfig, StripePayments,
};
use oncely_sim::{serve, FaultConfig, FaultRates, PaymentsConfig, PaymentsSim};
use oncely_sql::{Effect, EffectStore, NewEffect, StoreError, Tx};
use tokio_util::sync::CancellationToken;

use crate::stats::median;

#[derive(Debug, Args)]
pub(crate) struct EffectsBenchArgs {
    /// Database of the effects; a fresh file (SQLite) or schema (PostgreSQL, MySQL) per
    /// round.
    #[arg(long, default_value = "sqlite://bench.db")]
    database_url: String,
    /// Charges per side per round.
    #[arg(long, default_value_t = 2_000)]
    charges: usize,
    /// Calls in flight at once, on both sides (the runner's `concurrency`).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// The runner's claim batch (default: the runner's default).
    #[arg(long)]
    batch: Option<u32>,
    /// The runner's settle group, at most (default: the runner's default).
    #[arg(long)]
    settle_batch: Option<usize>,
    /// The runner's idle poll, ms (default: the runner's default).
    #[arg(long)]
    poll_ms: Option<u64>,
    /// Also measure against a simulator that delays every answer by this many ms (its
    /// `latency` fault at rate 1.0, the same for both sides), printed as a second medians
    /// line after the headline at 0 ms.
    #[arg(long)]
    provider_latency_ms: Option<u64>,
    /// Alternating rounds (raw, then runner); the medians are printed too.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

const SECRET_KEY: &str = "sk_test_oncely_bench";

/// Counts the charges the runner settled as succeeded (inside the settle's transaction; the
/// store is checked at the end).
#[derive(Default)]
struct Count(AtomicUsize);

impl EffectHandler for Count {
    fn settled<'a>(
        &'a self,
        _tx: &'a mut Tx,
        _effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        if matches!(outcome, Settled::Succeeded(_)) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        Box::pin(async { Ok(()) })
    }
}

pub(crate) async fn run(args: EffectsBenchArgs) -> anyhow::Result<()> {
    let config = runner_config(&args);
    println!(
        "effects bench on {}: {} charges per side, concurrency {}, claim batch {}, \
         settle batch {}, poll {} ms, {} rounds",
        oncely_runtime::redact(&args.database_url),
        args.charges,
        config.concurrency,
        config.batch,
        config.settle_batch,
        config.poll.as_millis(),
        args.rounds.max(1)
    );
    let headline = measure(&args, &config, 0).await?;
    let mut lines = vec![headline];
    if let Some(latency) = args.provider_latency_ms.filter(|ms| *ms > 0) {
        lines.push(measure(&args, &config, latency).await?);
    }
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

/// Alternating rounds (raw, then runner) against a fresh simulator that delays every
/// answer by `latency_ms` (its `latency` fault at rate 1.0; none at 0); the medians' line.
async fn measure(
    args: &EffectsBenchArgs,
    config: &RunnerConfig,
    latency_ms: u64,
) -> anyhow::Result<String> {
    let sim = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SECRET_KEY.into()],
        faults: FaultConfig {
            rates: FaultRates {
                latency: if latency_ms > 0 { 1.0 } else { 0.0 },
                ..FaultRates::default()
            },
            latency_ms,
            ..FaultConfig::default()
        },
        ..PaymentsConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(serve(listener, sim.router(), std::future::pending()));
    let concurrency = config.concurrency;
    let client = reqwest::Client::new();
    // Warm-up: connections, the simulator's maps, the runtime.
    raw(&client, &base, "warm", 200, concurrency).await?;
    let (mut raws, mut runs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=args.rounds.max(1) {
        let raw_rate = raw(
            &client,
            &base,
            &format!("raw{round}"),
            args.charges,
            concurrency,
        )
        .await?;
        let runner_rate = runner(args, &base, &format!("run{round}"), config).await?;
        let ratio = runner_rate / raw_rate;
        println!(
            "provider latency {latency_ms} ms, round {round}: runner {runner_rate:>7.0} effects/s \
             | raw HTTP {raw_rate:>7.0} calls/s | ratio {ratio:.2}"
        );
        raws.push(raw_rate);
        runs.push(runner_rate);
        ratios.push(ratio);
    }
    let created = sim.stats().payment_intents;
    let expected = (2 * args.rounds.max(1) * args.charges + 200) as u64;
    anyhow::ensure!(
        created == expected,
        "the simulator holds {created} PaymentIntents, {expected} expected: a charge was lost or duplicated"
    );
    Ok(format!(
        "median at provider latency {latency_ms} ms: runner {:.0} effects/s | raw HTTP {:.0} \
         calls/s | ratio {:.2} (target >= {})",
        median(&mut runs),
        median(&mut raws),
        median(&mut ratios),
        if latency_ms == 0 { "0.6" } else { "0.95" }
    ))
}

fn runner_config(args: &EffectsBenchArgs) -> RunnerConfig {
    let defaults = RunnerConfig::default();
    RunnerConfig {
        concurrency: args.concurrency.max(1),
        batch: args.batch.unwrap_or(defaults.batch).max(1),
        settle_batch: args.settle_batch.unwrap_or(defaults.settle_batch).max(1),
        poll: args.poll_ms.map_or(defaults.poll, Duration::from_millis),
        ..defaults
    }
}

/// The form `StripePayments` sends for a charge of `invoice`.
fn charge_form(invoice: &str) -> String {
    form_urlencoded::Serializer::new(String::new())
        .append_pair("amount", "1999")
        .append_pair("currency", "eur")
        .append_pair("confirm", "true")
        .append_pair("payment_method", "pm_card_visa")
        .append_pair("metadata[order_id]", invoice)
        .append_pair("metadata[invoice_id]", invoice)
        .finish()
}

/// `n` raw `POST /v1/payment_intents`, `concurrency` at a time; calls/s.
async fn raw(
    client: &reqwest::Client,
    base: &str,
    run: &str,
    n: usize,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let url = format!("{base}/v1/payment_intents");
    let started = Instant::now();
    let mut calls = futures_util::stream::iter(0..n)
        .map(|i| {
            let invoice = format!("{run}-{i}");
            client
                .post(&url)
                .bearer_auth(SECRET_KEY)
                .header("Idempotency-Key", format!("key-{invoice}"))
                .header("Content-Type", "application/x-www-form-urlencoded")
                .body(charge_form(&invoice))
                .send()
        })
        .buffer_unordered(concurrency);
    while let Some(answer) = calls.next().await {
        let answer = answer?;
        anyhow::ensure!(
            answer.status().is_success(),
            "raw call: {}",
            answer.status()
        );
        // Read the body, as the adapter does.
        answer.bytes().await?;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Enqueues `args.charges` charges on a fresh database and times the runner driving them to
/// `succeeded`; effects/s.
async fn runner(
    args: &EffectsBenchArgs,
    base: &str,
    run: &str,
    config: &RunnerConfig,
) -> anyhow::Result<f64> {
    let t = crate::db::fresh(&args.database_url, args.concurrency).await?;
    t.db.migrate().await?;
    enqueue(&t.db, run, args.charges).await?;
    let provider = StripePayments::new(StripeConfig {
        base_url: base.to_owned(),
        secret_key: SECRET_KEY.to_owned(),
        ..StripeConfig::default()
    })?;
    let count = Arc::new(Count::default());
    let runner = Arc::new(EffectRunner::new(
        EffectStore::new(t.db.clone()),
        vec![Arc::new(provider) as Arc<dyn Provider>],
        count.clone(),
        config.clone(),
    ));
    let stop = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(runner.run(stop.clone()));
    while count.0.load(Ordering::Relaxed) < args.charges {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "the runner settled {} of {} charges in 10 minutes",
            count.0.load(Ordering::Relaxed),
            args.charges
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let rate = args.charges as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    running.await?;
    // The handler counts inside the settle's transaction, and a group whose transaction
    // failed is settled again alone: the store says what committed.
    let succeeded: i64 = EffectStore::new(t.db.clone())
        .counts()
        .await?
        .iter()
        .filter(|(_, state, _)| state == "succeeded")
        .map(|c| c.2)
        .sum();
    anyhow::ensure!(
        succeeded == args.charges as i64,
        "{succeeded} of {} charges settled succeeded in the store",
        args.charges
    );
    Ok(rate)
}

async fn enqueue(db: &oncely_sql::Database, run: &str, n: usize) -> anyhow::Result<()> {
    let now = oncely_core::now_ms();
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut tx = db.begin().await?;
        for i in chunk {
            let invoice = format!("{run}-{i}");
            let request = serde_json::json!({
                "amount": 1999, "currency": "eur", "metadata": {"order_id": invoice}
            });
            let key = format!("key-{invoice}");
            let new = NewEffect {
                tenant: "bench",
                provider: "payments",
                operation: "charge",
                reference: &invoice,
                key: &key,
                request: &request,
            };
            EffectStore::enqueue(&mut tx, &new, now).await?;
        }
        tx.commit().await?;
    }
    Ok(())
}
