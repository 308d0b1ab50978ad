//! What `year` prints: intake phases beside their baseline, preloads, sweeps, sizes.

use std::time::Duration;

use crate::intake::Timed;
use crate::stats::{median, quantile};

/// Intake over some phases: the median phase's creates/s, and latency quantiles over
/// every request of every phase.
#[derive(Debug, Clone, Copy)]
pub(super) struct Intake {
    pub(super) per_sec: f64,
    /// Requests answered over all the phases.
    pub(super) requests: usize,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
}

impl Intake {
    pub(super) fn of(phases: Vec<Timed>) -> Self {
        let mut rates: Vec<f64> = phases.iter().map(|p| p.per_sec).collect();
        let mut latencies: Vec<u32> = phases.into_iter().flat_map(|p| p.latencies_us).collect();
        latencies.sort_unstable();
        Self {
            per_sec: median(&mut rates),
            requests: latencies.len(),
            p50_ms: quantile_ms(&latencies, 0.50),
            p99_ms: quantile_ms(&latencies, 0.99),
        }
    }

    /// One line; beside `baseline` when given, as ratios.
    pub(super) fn print(&self, what: &str, baseline: Option<&Intake>) {
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

/// The `q` quantile of sorted µs latencies, in ms ([`quantile`]); 0 when there are none.
fn quantile_ms(sorted_us: &[u32], q: f64) -> f64 {
    quantile(sorted_us, q).map_or(0.0, |us| f64::from(us) / 1000.0)
}

pub(super) fn print_preload(what: &str, rows: u64, took: Duration) {
    println!(
        "{:<38} {rows} rows in {:.1} s = {:.0} rows/s",
        format!("preload, {what}"),
        took.as_secs_f64(),
        rows as f64 / took.as_secs_f64()
    );
}

/// The inbox consumer's messages/s on the full table beside the empty one.
pub(super) fn print_consumer(messages: u32, empty: f64, full: f64) {
    println!(
        "{:<38} {full:>8.1} msg/s (billing, {messages} messages)   beside empty table \
         {empty:.1}/s = {:.2}× (target ≥ 0.9)",
        "inbox consumer, full inbox table",
        full / empty
    );
}

/// A retention sweep's round under intake.
pub(super) struct Swept {
    pub(super) rows: u64,
    pub(super) took: Duration,
    pub(super) intake: Intake,
    /// The next round, right after: rows and time.
    pub(super) again: (u64, Duration),
}

impl Swept {
    /// Three lines: the sweep's rows/s, the next round's time, and intake during the sweep
    /// beside `without`.
    pub(super) fn print(&self, sweep: &str, without: &Intake) {
        println!(
            "{:<38} {} rows in {:.1} s = {:.0} rows/s",
            format!("{sweep} sweep (under intake)"),
            self.rows,
            self.took.as_secs_f64(),
            self.rows as f64 / self.took.as_secs_f64()
        );
        println!(
            "{:<38} {} rows in {:.1} ms",
            "  one more round",
            self.again.0,
            self.again.1.as_secs_f64() * 1e3
        );
        let with = &self.intake;
        println!(
            "{:<38} {:>8.1} creates/s  p50 {:>6.1} ms  p99 {:>6.1} ms   beside {:.1}/s = \
             {:.2}×; p99 beside {:.1} ms without the sweep = {:.2}× (target ≤ 2)",
            "  intake during it",
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

/// Bytes of one table: everything, the table alone, its indexes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sizes {
    pub(super) total: i64,
    pub(super) table: i64,
    pub(super) indexes: i64,
}

/// One table's sizes before its sweep (the baseline), after it, and after `last`
/// (`VACUUM (ANALYZE)` or `ANALYZE TABLE`).
pub(super) fn print_sizes(table: &str, last: &str, [before, after, vacuumed]: [Sizes; 3]) {
    println!("sizes of {table}, MB (total = table + indexes):");
    for (what, s) in [
        ("before the sweeps (baseline)", before),
        ("after the sweeps", after),
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
