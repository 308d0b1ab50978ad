//! `oncely-bench year`: a year of traffic. Order intake on an idempotency table of
//! `--records` rows beside the same intake on the empty table, and the service's retention
//! collector deleting `--expired` of them while intake runs.
//!
//! Phases, in order: intake on the empty table (the baseline); the preload; intake right
//! after it, before any `ANALYZE` (PostgreSQL's statistics still say the table is empty,
//! as a table that grew since its last analyze meets production); intake after `ANALYZE`;
//! table and index sizes; the collector's round ([`orders::collector_sweep`], one sweep
//! until no expired record is left) under intake; sizes after it, and after
//! `VACUUM (ANALYZE)` (PostgreSQL) or `ANALYZE TABLE` (MariaDB).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use oncely_sql::sqlx::{self, MySqlPool, PgPool};
use oncely_sql::{Backend, Database, DbOptions, IdempotencyStore};
use oncely_testkit::TestDb;
use orders::AppConfig;
use tokio_util::sync::CancellationToken;

use crate::intake::{self, IntakeArgs, Timed, API_KEY};

/// Flags of `year`: intake's load flags and the preloaded table's shape.
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
    /// Rows per statement of the collector (the service's `collector_batch` default).
    #[arg(long, default_value_t = 500)]
    sweep_batch: u32,
    /// Rows per preload statement (one `INSERT … SELECT` each).
    #[arg(long, default_value_t = 100_000)]
    chunk: u64,
}

/// The operation the order service's creates are recorded under.
const OPERATION: &str = "POST /v1/orders";

/// Live preloaded records expire at least this long after the preload, so that none
/// turns expired while the benchmark runs.
const LIVE_MARGIN_MS: i64 = 3_600_000;

/// Seconds of each intake phase while the collector runs: short, so intake stops soon
/// after the sweep does and the tail measured is the sweep's.
const SWEEP_PHASE_SECS: u64 = 1;

pub(crate) async fn run(args: YearArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.expired <= args.records, "--expired exceeds --records");
    let year = Year::start(&args).await?;
    year.header(&args);
    let empty = year.intake(&args.load, "empty").await?;
    empty.print("intake, empty table (baseline)", None);
    let (rows, took) = year.preload(&args).await?;
    print_preload(rows, took);
    let stale = year.intake(&args.load, "stale").await?;
    stale.print("intake, full table, before ANALYZE", Some(&empty));
    year.analyze().await?;
    let full = year.intake(&args.load, "full").await?;
    full.print("intake, full table, after ANALYZE", Some(&empty));
    let before = year.sizes().await?;
    let swept = year.sweep_under_load(&args).await?;
    swept.print(&full);
    let after = year.sizes().await?;
    year.vacuum().await?;
    let vacuumed = year.sizes().await?;
    print_sizes(year.backend(), before, after, vacuumed);
    Ok(())
}

/// The order service on a fresh database, and one client.
struct Year {
    /// Kept so the fresh schema outlives the server.
    test_db: TestDb,
    config: AppConfig,
    url: String,
    client: reqwest::Client,
}

impl Year {
    async fn start(args: &YearArgs) -> anyhow::Result<Self> {
        let options = DbOptions {
            // The clients' connections, the collector's and the benchmark's own.
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
        Ok(Self {
            test_db,
            config,
            url,
            client,
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
            "oncely-bench year — {}, {} records preloaded ({} past retention), {} concurrent \
             clients over HTTP/1.1 on loopback, {} round(s) × {} s per intake phase, \
             collector batch {}",
            self.backend(),
            args.records,
            args.expired,
            args.load.concurrency,
            args.load.rounds,
            args.load.seconds,
            args.sweep_batch
        );
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

    /// Inserts `--records` finished records in `--chunk`-row statements, oldest first
    /// (as they arrived); returns the rows and the time it took.
    async fn preload(&self, args: &YearArgs) -> anyhow::Result<(u64, Duration)> {
        let plan = Preload::new(args, self.config.retention, oncely_core::now_ms());
        let started = Instant::now();
        let mut first = 0;
        while first < args.records {
            let last = (first + args.chunk).min(args.records) - 1;
            self.raw(&plan.chunk_sql(self.backend(), first, last))
                .await?;
            first = last + 1;
        }
        Ok((args.records, started.elapsed()))
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

    async fn analyze(&self) -> anyhow::Result<()> {
        match self.backend() {
            Backend::Postgres => self.raw("ANALYZE oncely_idempotency").await,
            _ => self.raw("ANALYZE TABLE oncely_idempotency").await,
        }
    }

    async fn vacuum(&self) -> anyhow::Result<()> {
        match self.backend() {
            Backend::Postgres => self.raw("VACUUM (ANALYZE) oncely_idempotency").await,
            _ => self.raw("ANALYZE TABLE oncely_idempotency").await,
        }
    }

    async fn sizes(&self) -> anyhow::Result<Sizes> {
        if let Some(pool) = self.db().as_postgres() {
            return pg_sizes(pool).await;
        }
        let pool = self.db().as_mysql().expect("PostgreSQL or MariaDB");
        self.analyze().await?;
        mysql_sizes(pool).await
    }

    /// One round of the service's collector (batches until none is full) while the
    /// clients create orders in [`SWEEP_PHASE_SECS`] phases, until the round ends.
    async fn sweep_under_load(&self, args: &YearArgs) -> anyhow::Result<Swept> {
        let store = IdempotencyStore::new(self.db().clone(), self.config.retention);
        let sweep =
            orders::collector_sweep(store, self.config.collector_interval, args.sweep_batch);
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
        let rows = rows.map_err(|e| anyhow::anyhow!("collector: {e}"))?;
        Ok(Swept {
            rows,
            took,
            intake: Intake::of(phases),
        })
    }
}

/// Where each preloaded record's `completed_at` falls: the first `expired` rows evenly
/// over the retention window before the last one (so `expires_at` is in the past), the
/// others evenly over the last window from [`LIVE_MARGIN_MS`] after its start (so
/// `expires_at` is at least that far in the future).
struct Preload {
    records: u64,
    expired: u64,
    now_ms: i64,
    retention_ms: i64,
}

impl Preload {
    fn new(args: &YearArgs, retention: Duration, now_ms: i64) -> Self {
        Self {
            records: args.records,
            expired: args.expired,
            now_ms,
            retention_ms: i64::try_from(retention.as_millis()).unwrap_or(i64::MAX),
        }
    }

    /// SQL for `completed_at` of row `n` (the column `n` of a number series); `div` is
    /// the backend's integer division.
    fn completed_at(&self, div: &str) -> String {
        let Self {
            records,
            expired,
            now_ms,
            retention_ms: r,
        } = *self;
        let old_start = now_ms - 2 * r;
        let live_start = now_ms - r + LIVE_MARGIN_MS;
        let live_span = r - LIVE_MARGIN_MS;
        format!(
            "CASE WHEN n < {expired} THEN {old_start} + n * {r} {div} {e} \
             ELSE {live_start} + (n - {expired}) * {live_span} {div} {l} END",
            e = expired.max(1),
            l = (records - expired).max(1),
        )
    }

    /// One `INSERT … SELECT` of rows `first..=last`.
    fn chunk_sql(&self, backend: Backend, first: u64, last: u64) -> String {
        let r = self.retention_ms;
        let body = r#"{"id":"0190c8a2-7d1e-7c4b-9a55-3f1e0b6c2d11","status":"pending","source":"bench","external_ref":"year","customer_id":"c-1","amount_minor":1999,"currency":"EUR"}"#;
        let headers = r#"[["content-type","application/json"]]"#;
        let completed = self.completed_at(div(backend));
        let (key, fingerprint, route, body, series) = match backend {
            Backend::Postgres => (
                "'year-' || lpad(n::text, 10, '0')",
                "sha256(int8send(n))",
                "sha256('POST /v1/orders'::bytea)",
                format!("convert_to('{body}', 'UTF8')"),
                format!("(SELECT g AS n FROM generate_series({first}::bigint, {last}) g)"),
            ),
            _ => (
                "CONCAT('year-', LPAD(n, 10, '0'))",
                "UNHEX(SHA2(n, 256))",
                "UNHEX(SHA2('POST /v1/orders', 256))",
                format!("'{body}'"),
                // The sequence engine's `seq` is unsigned; the arithmetic above is signed.
                format!("(SELECT CAST(seq AS SIGNED) AS n FROM seq_{first}_to_{last})"),
            ),
        };
        let key_column = if backend == Backend::Postgres {
            "key"
        } else {
            "`key`"
        };
        format!(
            "INSERT INTO oncely_idempotency (tenant, operation, {key_column}, fingerprint, \
             route_digest, state, owner, response_status, response_headers, response_body, \
             created_at, completed_at, expires_at) \
             SELECT 'bench', '{OPERATION}', {key}, {fingerprint}, {route}, 'succeeded', \
             'year-preload', 201, '{headers}', {body}, c - 5, c, c + {r} \
             FROM (SELECT n, {completed} AS c FROM {series} s) t"
        )
    }
}

/// Integer division: PostgreSQL's `/` on bigints, MariaDB's `DIV`.
fn div(backend: Backend) -> &'static str {
    if backend == Backend::Postgres {
        "/"
    } else {
        "DIV"
    }
}

/// Intake over some phases: the median phase's creates/s, and latency quantiles over
/// every request of every phase.
#[derive(Debug, Clone, Copy)]
struct Intake {
    per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
}

impl Intake {
    fn of(phases: Vec<Timed>) -> Self {
        let mut rates: Vec<f64> = phases.iter().map(|p| p.per_sec).collect();
        let mut latencies: Vec<u32> = phases.into_iter().flat_map(|p| p.latencies_us).collect();
        latencies.sort_unstable();
        Self {
            per_sec: median(&mut rates),
            p50_ms: quantile_ms(&latencies, 0.50),
            p99_ms: quantile_ms(&latencies, 0.99),
        }
    }

    /// One line; beside `baseline` when given, as ratios.
    fn print(&self, what: &str, baseline: Option<&Intake>) {
        print!(
            "{what:<38} {:>8.1} creates/s  p50 {:>6.1} ms  p99 {:>6.1} ms",
            self.per_sec, self.p50_ms, self.p99_ms
        );
        match baseline {
            None => println!("   (baseline)"),
            Some(b) => println!(
                "   beside baseline {:.1}/s = {:.2}× (target ≥ 0.9); p99 beside {:.1} ms = {:.2}×",
                b.per_sec,
                self.per_sec / b.per_sec,
                b.p99_ms,
                self.p99_ms / b.p99_ms
            ),
        }
    }
}

fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        f64::midpoint(values[mid - 1], values[mid])
    }
}

/// The `q` quantile of sorted µs latencies, in ms (nearest rank).
fn quantile_ms(sorted_us: &[u32], q: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let rank = ((sorted_us.len() as f64 * q).ceil() as usize).clamp(1, sorted_us.len());
    f64::from(sorted_us[rank - 1]) / 1000.0
}

fn print_preload(rows: u64, took: Duration) {
    println!(
        "{:<38} {rows} rows in {:.1} s = {:.0} rows/s",
        "preload",
        took.as_secs_f64(),
        rows as f64 / took.as_secs_f64()
    );
}

/// The collector's round under intake.
struct Swept {
    rows: u64,
    took: Duration,
    intake: Intake,
}

impl Swept {
    fn print(&self, without: &Intake) {
        println!(
            "{:<38} {} rows in {:.1} s = {:.0} rows/s",
            "collector sweep (under intake)",
            self.rows,
            self.took.as_secs_f64(),
            self.rows as f64 / self.took.as_secs_f64()
        );
        let with = &self.intake;
        println!(
            "{:<38} {:>8.1} creates/s  p50 {:>6.1} ms  p99 {:>6.1} ms   beside {:.1}/s = \
             {:.2}×; p99 beside {:.1} ms without the sweep = {:.2}× (target ≤ 2)",
            "intake during the sweep",
            with.per_sec,
            with.p50_ms,
            with.p99_ms,
            without.per_sec,
            with.per_sec / without.per_sec,
            without.p99_ms,
            with.p99_ms / without.p99_ms
        );
    }
}

/// Bytes of the idempotency table: everything, the table alone, its indexes.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    total: i64,
    table: i64,
    indexes: i64,
}

async fn pg_sizes(pool: &PgPool) -> anyhow::Result<Sizes> {
    let (total, table, indexes): (i64, i64, i64) = sqlx::query_as(
        "SELECT pg_total_relation_size('oncely_idempotency'), \
         pg_relation_size('oncely_idempotency'), pg_indexes_size('oncely_idempotency')",
    )
    .fetch_one(pool)
    .await?;
    Ok(Sizes {
        total,
        table,
        indexes,
    })
}

async fn mysql_sizes(pool: &MySqlPool) -> anyhow::Result<Sizes> {
    let (table, indexes): (i64, i64) = sqlx::query_as(
        "SELECT CAST(data_length AS SIGNED), CAST(index_length AS SIGNED) \
         FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = 'oncely_idempotency'",
    )
    .fetch_one(pool)
    .await?;
    Ok(Sizes {
        total: table + indexes,
        table,
        indexes,
    })
}

fn print_sizes(backend: Backend, before: Sizes, after: Sizes, vacuumed: Sizes) {
    let last = if backend == Backend::Postgres {
        "after VACUUM (ANALYZE)"
    } else {
        "after ANALYZE TABLE"
    };
    println!("sizes, MB (total = table + indexes):");
    for (what, s) in [
        ("before the sweep (baseline)", before),
        ("after the sweep", after),
        (last, vacuumed),
    ] {
        println!(
            "  {what:<28} total {:>8.1}  table {:>8.1}  indexes {:>8.1}   beside baseline \
             {:.1} = {:.2}×",
            mb(s.total),
            mb(s.table),
            mb(s.indexes),
            mb(before.total),
            ratio(s.total, before.total)
        );
    }
}

fn mb(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

fn ratio(a: i64, b: i64) -> f64 {
    a as f64 / b.max(1) as f64
}
