//! `oncely-bench year`: a year of traffic. Order intake on tables preloaded to a year's
//! size — `--records` idempotency records, `--outbox-rows` published outbox rows,
//! `--inbox-rows` inbox rows — beside the same intake on the empty tables; the inbox
//! consumer on the full inbox beside the empty one; each table's retention sweep (the
//! services' own) deleting its expired rows while intake runs; the tables' sizes.
//!
//! Phases, in order: intake on the empty tables (the baseline) and the `billing` consumer
//! on the empty inbox; the preloads; intake right after them, before any `ANALYZE`
//! (PostgreSQL's statistics still say the tables are empty, as a table that grew since its
//! last analyze meets production); intake after `ANALYZE`; the consumer on the full inbox;
//! table and index sizes; one round of each sweep ([`orders::collector_sweep`],
//! [`oncely_outbox::published_sweep`], [`oncely_inbox::inbox_sweep`]) under intake; sizes
//! after them, and after `VACUUM (ANALYZE)` (PostgreSQL) or `ANALYZE TABLE` (MariaDB).
//! Both consumer phases print the server's counters per message beside each other.
//!
//! Layout: `preload` — the tables and the SQL that fills them; `report` — what is printed;
//! `counters` — the server's counters around a phase.

mod counters;
mod preload;
mod report;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use oncely_broker::{SqlSubscriber, SqlTransport};
use oncely_inbox::ConsumerConfig;
use oncely_outbox::RelayConfig;
use oncely_sql::sqlx::{self, MySqlPool, PgPool};
use oncely_sql::{
    Backend, Database, DbOptions, IdempotencyStore, InboxStore, OutboxStore, RetentionSweep,
};
use oncely_testkit::TestDb;
use orders::AppConfig;
use tokio_util::sync::CancellationToken;

use crate::intake::{self, IntakeArgs, Timed, API_KEY};
use crate::stats::median;
use counters::{Counters, Window};
use preload::{Plan, Table};
use report::{Intake, Sizes, Swept};

/// Flags of `year`: intake's load flags and the preloaded tables' shapes.
#[derive(Debug, Args)]
pub(crate) struct YearArgs {
    #[command(flatten)]
    load: IntakeArgs,
    /// Idempotency records preloaded, spread over the retention window (24 h) and, for the
    /// expired ones, the window before it.
    #[arg(long, default_value_t = 10_000_000)]
    records: u64,
    /// How many of `--records` are past retention, for the collector to delete.
    #[arg(long, default_value_t = 2_000_000)]
    expired: u64,
    /// Published outbox rows preloaded (`order.created` events, kept by a relay with a
    /// 24 h retention), spread as `--records`; 0 skips the outbox.
    #[arg(long, default_value_t = 10_000_000)]
    outbox_rows: u64,
    /// How many of `--outbox-rows` are past retention, for the relay's sweep to delete;
    /// by default one in [`EXPIRED_SHARE`] (250,000 of 10M).
    #[arg(long)]
    outbox_expired: Option<u64>,
    /// Inbox rows preloaded (the `billing` consumer's), spread over the consumer's default
    /// retention (7 days) and the window before it; 0 skips the inbox.
    #[arg(long, default_value_t = 5_000_000)]
    inbox_rows: u64,
    /// How many of `--inbox-rows` are past retention, for the consumer's sweep to delete;
    /// by default one in [`EXPIRED_SHARE`] (125,000 of 5M).
    #[arg(long)]
    inbox_expired: Option<u64>,
    /// Messages the `billing` consumer takes on the empty and on the full inbox, in each of
    /// `--rounds` rounds (the median is printed).
    #[arg(long, default_value_t = 5_000)]
    inbox_messages: u32,
    /// Rows per statement of the idempotency collector (the service's `collector_batch`
    /// default); the relay's and the consumer's sweeps use their own defaults (500).
    #[arg(long, default_value_t = 500)]
    sweep_batch: u32,
    /// Rows per preload statement (one `INSERT … SELECT` each).
    #[arg(long, default_value_t = 100_000)]
    chunk: u64,
}

impl YearArgs {
    /// Published outbox rows and how many of them are expired.
    fn outbox(&self) -> (u64, u64) {
        let expired = self.outbox_expired;
        (
            self.outbox_rows,
            expired.unwrap_or(self.outbox_rows / EXPIRED_SHARE),
        )
    }

    /// Inbox rows and how many of them are expired.
    fn inbox(&self) -> (u64, u64) {
        let expired = self.inbox_expired;
        (
            self.inbox_rows,
            expired.unwrap_or(self.inbox_rows / EXPIRED_SHARE),
        )
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.expired <= self.records, "--expired exceeds --records");
        let (outbox, inbox) = (self.outbox(), self.inbox());
        anyhow::ensure!(
            outbox.1 <= outbox.0,
            "--outbox-expired exceeds --outbox-rows"
        );
        anyhow::ensure!(inbox.1 <= inbox.0, "--inbox-expired exceeds --inbox-rows");
        anyhow::ensure!(self.chunk > 0, "--chunk must be positive");
        Ok(())
    }
}

/// One in this many outbox and inbox rows is expired unless the flags say otherwise: a
/// share that gives each sweep enough rows to time (tens of seconds) without the 2M of the
/// idempotency records, which alone take 4 to 6 minutes of the 20.
const EXPIRED_SHARE: u64 = 40;

/// The retention of published outbox rows the preload assumes: a day, as the idempotency
/// records'.
const OUTBOX_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Preload statements in flight at once on MariaDB: its `INSERT … SELECT` of a chunk keeps
/// one core busy, so two connections use both of this machine's (2M rows per table:
/// 130.8 s on one connection, 82.9 s on two). PostgreSQL's preload runs on one.
const PRELOAD_STREAMS: usize = 2;

/// Seconds of each intake phase while a sweep runs: short, so intake stops soon after the
/// sweep does and the tail measured is the sweep's.
const SWEEP_PHASE_SECS: u64 = 1;

pub(crate) async fn run(args: YearArgs) -> anyhow::Result<()> {
    args.check()?;
    let year = Year::start(&args).await?;
    year.header(&args);
    let full = year.intake_phases(&args).await?;
    let before = year.sizes(&year.plans).await?;
    for plan in &year.plans {
        let swept = year.sweep_under_load(plan.table, &args).await?;
        swept.print(plan.table.sweep(), &full);
    }
    let after = year.sizes(&year.plans).await?;
    year.vacuum().await?;
    let vacuumed = year.sizes(&year.plans).await?;
    let last = if year.backend() == Backend::Postgres {
        "after VACUUM (ANALYZE)"
    } else {
        "after ANALYZE TABLE"
    };
    for (i, plan) in year.plans.iter().enumerate() {
        let name = plan.table.name(year.backend());
        report::print_sizes(name, last, [before[i], after[i], vacuumed[i]]);
    }
    Ok(())
}

/// The order service on a fresh database, one client, and the tables to preload.
struct Year {
    /// Kept so the fresh schema outlives the server.
    test_db: TestDb,
    config: AppConfig,
    url: String,
    client: reqwest::Client,
    plans: Vec<Plan>,
}

impl Year {
    async fn start(args: &YearArgs) -> anyhow::Result<Self> {
        let options = DbOptions {
            // The clients' connections, the sweep's and the benchmark's own.
            max_connections: u32::try_from(args.load.concurrency).unwrap_or(64) + 4,
            ..DbOptions::default()
        };
        let test_db = TestDb::fresh(&args.load.database_url, &options)
            .await
            .ok_or_else(|| anyhow::anyhow!("database unreachable: {}", args.load.database_url))?;
        anyhow::ensure!(
            test_db.db.backend() != Backend::Sqlite,
            "year measures PostgreSQL or MariaDB"
        );
        orders::migrate(&test_db.db).await?;
        let config = AppConfig {
            api_keys: orders::parse_api_keys(&format!("{API_KEY}=bench"))?,
            ..AppConfig::default()
        };
        let url = intake::start(orders::router(test_db.db.clone(), &config)).await?;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(args.load.concurrency)
            .build()?;
        let plans = plans(args, config.retention);
        Ok(Self {
            test_db,
            config,
            url,
            client,
            plans,
        })
    }

    fn db(&self) -> &Database {
        &self.test_db.db
    }

    fn backend(&self) -> Backend {
        self.db().backend()
    }

    fn header(&self, args: &YearArgs) {
        println!(
            "oncely-bench year — {}, preloaded: {} idempotency records ({} past retention), \
             {} published outbox rows ({}), {} inbox rows ({}); {} concurrent clients over \
             HTTP/1.1 on loopback, {} round(s) × {} s per intake phase, collector batch {}",
            self.backend(),
            args.records,
            args.expired,
            args.outbox().0,
            args.outbox().1,
            args.inbox().0,
            args.inbox().1,
            args.load.concurrency,
            args.load.rounds,
            args.load.seconds,
            args.sweep_batch
        );
    }

    /// Intake on the empty tables, the consumer on the empty inbox, the preloads, then the
    /// same on the full tables, each phase printed with the server's counters per request
    /// beside the empty tables' ([`counters`]); returns intake on the full tables after
    /// `ANALYZE`.
    ///
    /// On PostgreSQL a `CHECKPOINT` follows the preloads: they leave gigabytes of dirty
    /// buffers and WAL behind, whose flush is the preload's cost, not intake's. Every write
    /// after it pays its full-page image as steady traffic does after each checkpoint.
    async fn intake_phases(&self, args: &YearArgs) -> anyhow::Result<Intake> {
        let (empty, empty_counted) = self.counted_intake(&args.load, "empty").await?;
        empty.print("intake, empty tables (baseline)", None);
        let consumed = self.consume(args, "empty").await?;
        for plan in &self.plans {
            let took = self.preload(plan, args.chunk).await?;
            report::print_preload(plan.table.rows(), plan.rows, took);
        }
        if self.backend() == Backend::Postgres {
            self.raw("CHECKPOINT").await?;
        }
        let (stale, counted) = self.counted_intake(&args.load, "stale").await?;
        stale.print("intake, full tables, before ANALYZE", Some(&empty));
        counters::print_beside("intake", "create", &empty_counted, &counted);
        self.analyze().await?;
        let (full, counted) = self.counted_intake(&args.load, "full").await?;
        full.print("intake, full tables, after ANALYZE", Some(&empty));
        counters::print_beside("intake", "create", &empty_counted, &counted);
        if let Some((empty_rate, empty_window)) = consumed {
            if let Some((full_rate, full_window)) = self.consume(args, "full").await? {
                report::print_consumer(args.inbox_messages, empty_rate, full_rate);
                counters::print_beside("inbox consumer", "message", &empty_window, &full_window);
            }
        }
        Ok(full)
    }

    /// [`Self::intake`] with the server's counters read around it.
    async fn counted_intake(
        &self,
        load: &IntakeArgs,
        tag: &str,
    ) -> anyhow::Result<(Intake, Window)> {
        let before = Counters::settled(self.db()).await?;
        let intake = self.intake(load, tag).await?;
        let after = Counters::settled(self.db()).await?;
        let ops = intake.requests as f64;
        Ok((intake, Window { before, after, ops }))
    }

    /// Intake for `--rounds` phases of `--seconds`; `tag` keeps the phases' keys apart.
    async fn intake(&self, load: &IntakeArgs, tag: &str) -> anyhow::Result<Intake> {
        let mut rounds = Vec::new();
        for round in 0..load.rounds {
            let tag = format!("{tag}{round}-{}", uuid::Uuid::now_v7().simple());
            rounds.push(self.phase(load.concurrency, load.seconds, tag).await?);
        }
        Ok(Intake::of(rounds))
    }

    async fn phase(&self, concurrency: usize, secs: u64, tag: String) -> anyhow::Result<Timed> {
        let make = Arc::new(move |n| (format!("{tag}-{n}"), intake::body(n, &tag)));
        intake::load_timed(&self.client, &self.url, concurrency, secs, 201, make).await
    }

    /// The `billing` consumer's messages/s taking `--inbox-messages` new messages (orders
    /// `<prefix><round>-<i>`) through the inbox, as `oncely-bench inbox` measures it: the
    /// median of `--rounds` rounds, with the server's counters around them all; `None`
    /// when the inbox is skipped.
    async fn consume(
        &self,
        args: &YearArgs,
        prefix: &str,
    ) -> anyhow::Result<Option<(f64, Window)>> {
        if args.inbox_rows == 0 || args.inbox_messages == 0 {
            return Ok(None);
        }
        let before = Counters::settled(self.db()).await?;
        let mut rates = Vec::new();
        for round in 0..args.load.rounds.max(1) {
            let prefix = format!("{prefix}{round}");
            rates.push(self.consume_round(args.inbox_messages, &prefix).await?);
        }
        let after = Counters::settled(self.db()).await?;
        let ops = f64::from(args.inbox_messages) * rates.len() as f64;
        Ok(Some((median(&mut rates), Window { before, after, ops })))
    }

    async fn consume_round(&self, messages: u32, prefix: &str) -> anyhow::Result<f64> {
        let transport = SqlTransport::new(self.db().clone(), 1 << 20);
        let config = ConsumerConfig {
            concurrency: 8,
            batch: 32,
            poll: Duration::from_millis(5),
            // The consumer's own sweep runs at its start: far beyond the preload's windows,
            // it leaves the expired rows to the timed sweep.
            inbox_retention: ConsumerConfig::default().inbox_retention * 10,
            ..ConsumerConfig::default()
        };
        let subscriber = SqlSubscriber::new(
            transport.clone(),
            orders::BILLING_CONSUMER,
            crate::inbox::TOPIC,
            crate::inbox::LEASE,
        );
        let billing = orders::billing_consumer(self.db().clone(), subscriber, config);
        billing.subscribe().await?;
        crate::inbox::publish(&transport, prefix, messages).await?;
        crate::inbox::drain(billing, messages).await
    }

    /// Inserts `plan`'s rows in `chunk`-row statements, oldest first ([`PRELOAD_STREAMS`]
    /// at a time); returns the time it took.
    async fn preload(&self, plan: &Plan, chunk: u64) -> anyhow::Result<Duration> {
        use futures_util::{StreamExt, TryStreamExt};
        let started = Instant::now();
        let contract = self.drop_outbox_contract(plan.table).await?;
        let chunk = chunk.max(1);
        let streams = match self.backend() {
            Backend::MySql => PRELOAD_STREAMS,
            _ => 1,
        };
        futures_util::stream::iter((0..plan.rows).step_by(usize::try_from(chunk)?))
            .map(|first| {
                let last = (first + chunk).min(plan.rows) - 1;
                self.raw_owned(plan.chunk_sql(self.backend(), first, last))
            })
            .buffered(streams)
            .try_collect::<()>()
            .await?;
        if let Some(create) = contract {
            self.raw(&create).await?;
        }
        Ok(started.elapsed())
    }

    /// MariaDB's outbox checks each inserted row's message id and headers in a trigger
    /// (migration 0035), a JSON walk that holds the preload to about 8,000 rows/s; the
    /// preload's rows pass it by construction, so the trigger is dropped for the preload
    /// and re-created after it from `SHOW CREATE TRIGGER` (returned), and intake pays it as
    /// in production. `None` elsewhere.
    async fn drop_outbox_contract(&self, table: Table) -> anyhow::Result<Option<String>> {
        let Some(pool) = self.db().as_mysql().filter(|_| table == Table::Outbox) else {
            return Ok(None);
        };
        let shown = sqlx::raw_sql("SHOW CREATE TRIGGER oncely_outbox_contract")
            .fetch_one(pool)
            .await?;
        let create: String = sqlx::Row::try_get(&shown, "SQL Original Statement")?;
        self.raw("DROP TRIGGER oncely_outbox_contract").await?;
        Ok(Some(create))
    }

    async fn raw_owned(&self, sql: String) -> anyhow::Result<()> {
        self.raw(&sql).await
    }

    /// Runs `sql` with the simple query protocol (`VACUUM` cannot run in a transaction
    /// block; the preload's literals need no binds).
    async fn raw(&self, sql: &str) -> anyhow::Result<()> {
        if let Some(pool) = self.db().as_postgres() {
            sqlx::raw_sql(sql).execute(pool).await?;
        } else if let Some(pool) = self.db().as_mysql() {
            sqlx::raw_sql(sql).execute(pool).await?;
        }
        Ok(())
    }

    /// The preloaded tables' names, comma-separated.
    fn tables(&self) -> String {
        let names: Vec<&str> = self
            .plans
            .iter()
            .map(|p| p.table.name(self.backend()))
            .collect();
        names.join(", ")
    }

    async fn analyze(&self) -> anyhow::Result<()> {
        match self.backend() {
            Backend::Postgres => self.raw(&format!("ANALYZE {}", self.tables())).await,
            _ => self.raw(&format!("ANALYZE TABLE {}", self.tables())).await,
        }
    }

    async fn vacuum(&self) -> anyhow::Result<()> {
        match self.backend() {
            Backend::Postgres => {
                self.raw(&format!("VACUUM (ANALYZE) {}", self.tables()))
                    .await
            }
            _ => self.analyze().await,
        }
    }

    /// Each planned table's sizes, in plan order (MariaDB: after `ANALYZE TABLE`, as
    /// InnoDB's sizes are its persistent statistics).
    async fn sizes(&self, plans: &[Plan]) -> anyhow::Result<Vec<Sizes>> {
        if self.backend() != Backend::Postgres {
            self.analyze().await?;
        }
        let mut sizes = Vec::new();
        for plan in plans {
            let name = plan.table.name(self.backend());
            sizes.push(match (self.db().as_postgres(), self.db().as_mysql()) {
                (Some(pool), _) => pg_sizes(pool, name).await?,
                (_, Some(pool)) => mysql_sizes(pool, name).await?,
                _ => anyhow::bail!("year measures PostgreSQL or MariaDB"),
            });
        }
        Ok(sizes)
    }

    /// The service's own sweep of `table`'s expired rows.
    fn sweep(&self, table: Table, args: &YearArgs) -> RetentionSweep {
        let db = self.db().clone();
        match table {
            Table::Idempotency => orders::collector_sweep(
                IdempotencyStore::new(db, self.config.retention),
                self.config.collector_interval,
                args.sweep_batch,
            ),
            Table::Outbox => oncely_outbox::published_sweep(
                OutboxStore::new(db),
                &RelayConfig {
                    retention: OUTBOX_RETENTION,
                    ..RelayConfig::default()
                },
            ),
            Table::Inbox => oncely_inbox::inbox_sweep(
                InboxStore::new(db),
                orders::BILLING_CONSUMER,
                &ConsumerConfig::default(),
            ),
        }
    }

    /// One round of `table`'s sweep (batches until none is full) while the clients create
    /// orders in [`SWEEP_PHASE_SECS`] phases, until the round ends.
    async fn sweep_under_load(&self, table: Table, args: &YearArgs) -> anyhow::Result<Swept> {
        let sweep = self.sweep(table, args);
        let started = Instant::now();
        let round = tokio::spawn(async move {
            let rows = sweep.round(&CancellationToken::new()).await;
            (rows, started.elapsed())
        });
        let mut phases = Vec::new();
        while !round.is_finished() {
            let tag = format!("sweep{}-{}", phases.len(), uuid::Uuid::now_v7().simple());
            let phase = self
                .phase(args.load.concurrency, SWEEP_PHASE_SECS, tag)
                .await?;
            phases.push(phase);
        }
        let (rows, took) = round.await?;
        let rows = rows.map_err(|e| anyhow::anyhow!("{} sweep: {e}", table.sweep()))?;
        // The next round finds nothing due: what every later round of the service costs.
        let started = Instant::now();
        let again = self
            .sweep(table, args)
            .round(&CancellationToken::new())
            .await
            .map_err(|e| anyhow::anyhow!("{} sweep: {e}", table.sweep()))?;
        Ok(Swept {
            rows,
            took,
            intake: Intake::of(phases),
            again: (again, started.elapsed()),
        })
    }
}

/// The tables to preload, in order (those with rows), each over its retention window.
fn plans(args: &YearArgs, idempotency_retention: Duration) -> Vec<Plan> {
    let now = oncely_core::now_ms();
    let inbox_retention = ConsumerConfig::default().inbox_retention;
    [
        (
            Table::Idempotency,
            (args.records, args.expired),
            idempotency_retention,
        ),
        (Table::Outbox, args.outbox(), OUTBOX_RETENTION),
        (Table::Inbox, args.inbox(), inbox_retention),
    ]
    .into_iter()
    .filter(|(_, (rows, _), _)| *rows > 0)
    .map(|(table, shape, retention)| Plan::new(table, shape, retention, now))
    .collect()
}

async fn pg_sizes(pool: &PgPool, table: &str) -> anyhow::Result<Sizes> {
    let (total, table, indexes): (i64, i64, i64) = sqlx::query_as(
        "SELECT pg_total_relation_size($1::regclass), pg_relation_size($1::regclass), \
         pg_indexes_size($1::regclass)",
    )
    .bind(table)
    .fetch_one(pool)
    .await?;
    Ok(Sizes {
        total,
        table,
        indexes,
    })
}

async fn mysql_sizes(pool: &MySqlPool, table: &str) -> anyhow::Result<Sizes> {
    let (data, indexes): (i64, i64) = sqlx::query_as(
        "SELECT CAST(data_length AS SIGNED), CAST(index_length AS SIGNED) \
         FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(table)
    .fetch_one(pool)
    .await?;
    Ok(Sizes {
        total: data + indexes,
        table: data,
        indexes,
    })
}
