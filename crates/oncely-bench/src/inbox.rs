//! `oncely-bench inbox`: consumed messages/s through the inbox (the `billing` consumer)
//! beside the same handler acknowledging without the inbox, in one run. `year` drains the
//! consumer the same way ([`publish`], [`drain`]) on an empty and on a full inbox table.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use oncely_broker::{Message, Publisher, SqlSubscriber, SqlTransport};
use oncely_core::MessageId;
use oncely_inbox::{ConsumerConfig, Handler, SqlConsumer};
use oncely_sql::Database;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::stats::median;

/// Lease on claimed deliveries, both sides.
pub(crate) const LEASE: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub(crate) struct InboxBenchArgs {
    /// Database to measure on; a fresh schema (PostgreSQL) or file (SQLite) is used.
    #[arg(
        long,
        env = "ONCELY_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// Messages consumed per side.
    #[arg(long, default_value_t = 10_000)]
    messages: u32,
    /// Messages handled at once, on both sides.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Deliveries claimed at once, on both sides.
    #[arg(long, default_value_t = 32)]
    batch: u32,
    /// Rounds, each the baseline then the inbox on `--messages` new messages; each round is
    /// printed, then the medians of the rounds' rates and of their ratios.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
}

/// The topic the benchmark publishes on and the consumers subscribe to.
pub(crate) const TOPIC: &str = "bench.orders";

pub(crate) async fn run(args: InboxBenchArgs) -> anyhow::Result<()> {
    let t = crate::db::fresh(&args.database_url, args.concurrency).await?;
    orders::migrate(&t.db).await?;
    let transport = SqlTransport::new(t.db.clone(), 1 << 20);
    let config = ConsumerConfig {
        concurrency: args.concurrency.max(1),
        batch: args.batch.max(1),
        poll: Duration::from_millis(5),
        ..ConsumerConfig::default()
    };
    transport.subscribe("bare", TOPIC).await?;
    println!(
        "inbox bench on {}: {} messages per side and round, concurrency {}, batch {}, {} round(s)",
        t.db.backend(),
        args.messages,
        config.concurrency,
        config.batch,
        args.rounds
    );
    let mut rounds = Vec::new();
    for round in 1..=args.rounds {
        let billing = orders::billing_consumer(
            t.db.clone(),
            SqlSubscriber::new(transport.clone(), orders::BILLING_CONSUMER, TOPIC, LEASE),
            config.clone(),
        );
        billing.subscribe().await?;
        publish(&transport, &format!("bench-r{round}"), args.messages).await?;
        // Baseline first, then remove its invoices so both sides insert the same rows.
        clear_invoices(&t.db).await?;
        let bare = bare_drain(&t.db, &transport, &config, args.messages).await?;
        clear_invoices(&t.db).await?;
        let inbox = drain(billing, args.messages).await?;
        println!(
            "round {round}: bare handler {bare:.0} msg/s, through the inbox {inbox:.0} msg/s, \
             ratio {:.2}",
            inbox / bare
        );
        rounds.push((bare, inbox));
    }
    let of = |f: fn(&(f64, f64)) -> f64| median(&mut rounds.iter().map(f).collect::<Vec<_>>());
    println!(
        "bare handler (tx + ack, no inbox): {:>9.0} msg/s (median)",
        of(|r| r.0)
    );
    println!(
        "through the inbox:                 {:>9.0} msg/s (median)",
        of(|r| r.1)
    );
    println!(
        "ratio inbox / bare:                {:>9.2} (median of rounds; target ≥ 0.9)",
        of(|r| r.1 / r.0)
    );
    Ok(())
}

/// Messages/s of `consumer` (subscribed before the `n` messages it is to take were
/// published): runs it until it has consumed `n`, then stops it.
///
/// # Errors
/// When the consumer's task panics.
pub(crate) async fn drain(consumer: SqlConsumer, n: u32) -> anyhow::Result<f64> {
    let stats = consumer.stats();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(consumer.run(stop.clone()));
    while stats.consumed() < u64::from(n) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = f64::from(n) / started.elapsed().as_secs_f64();
    stop.cancel();
    running.await?;
    Ok(rate)
}

/// Publishes `n` `order.created` messages for orders `<prefix>-<i>` on [`TOPIC`], with ids
/// derived from the order (random-looking, as the order service's are).
///
/// # Errors
/// When the transport fails.
pub(crate) async fn publish(transport: &SqlTransport, prefix: &str, n: u32) -> anyhow::Result<()> {
    let mut batch = Vec::with_capacity(500);
    for i in 0..n {
        let order = format!("{prefix}-{i}");
        let payload = serde_json::json!({"id": order, "amount_minor": 1999, "currency": "EUR"});
        batch.push(Message {
            id: MessageId::derive_from_parts(&[TOPIC, &order]),
            topic: TOPIC.to_owned(),
            partition_key: order,
            event_type: orders::ORDER_CREATED.to_owned(),
            payload: serde_json::to_vec(&payload)?,
            headers: [("tenant".to_owned(), "bench".to_owned())].into(),
        });
        if batch.len() == 500 || i + 1 == n {
            for r in transport.publish(&batch).await {
                r?;
            }
            batch.clear();
        }
    }
    Ok(())
}

async fn clear_invoices(db: &Database) -> anyhow::Result<()> {
    let mut tx = db.begin().await?;
    tx.execute(oncely_sql::query("DELETE FROM invoices"))
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The same claim / concurrency / handler / ack loop as the consumer, without the inbox
/// row. Returns messages/s.
async fn bare_drain(
    db: &Database,
    transport: &SqlTransport,
    config: &ConsumerConfig,
    n: u32,
) -> anyhow::Result<f64> {
    let handler = Arc::new(orders::BillingHandler::invoices_only());
    let slots = Arc::new(Semaphore::new(config.concurrency));
    let tracker = TaskTracker::new();
    let done = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let started = Instant::now();
    while done.load(std::sync::atomic::Ordering::Relaxed) < n {
        let free = u32::try_from(slots.available_permits()).unwrap_or(u32::MAX);
        if free == 0 {
            drop(slots.clone().acquire_owned().await?);
            continue;
        }
        let deliveries = transport
            .claim("bare", free.min(config.batch), LEASE)
            .await?;
        if deliveries.is_empty() {
            tokio::time::sleep(config.poll).await;
            continue;
        }
        for d in deliveries {
            let permit = slots.clone().acquire_owned().await?;
            let (db, transport, handler, done) =
                (db.clone(), transport.clone(), handler.clone(), done.clone());
            tracker.spawn(async move {
                let result: anyhow::Result<()> = async {
                    let mut tx = db.begin().await?;
                    handler
                        .handle(&mut tx, &d.message)
                        .await
                        .map_err(|e| anyhow::anyhow!(e))?;
                    tx.commit().await?;
                    transport.ack(&d).await?;
                    Ok(())
                }
                .await;
                match result {
                    Ok(()) => {
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!(error = %e, "bare handler failed"),
                }
                drop(permit);
            });
        }
    }
    let rate = f64::from(n) / started.elapsed().as_secs_f64();
    tracker.close();
    tracker.wait().await;
    Ok(rate)
}
