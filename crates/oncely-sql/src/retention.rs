//! The one runner of background retention sweeps: deleting, expiring or collecting old rows
//! on an interval ([`Retention`], [`RetentionSweep`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use oncely_core::RetryPolicy;
use tokio_util::sync::CancellationToken;

/// Why a batch of a sweep failed: a [`StoreError`](crate::StoreError) or any error whose source chain may hold
/// one (a broker's error over the SQL transport).
pub type SweepError = Box<dyn std::error::Error + Send + Sync>;

/// The future of one batch of a sweep: how many rows it deleted (or turned), or why not.
pub type BatchFuture = Pin<Box<dyn Future<Output = Result<u64, SweepError>> + Send>>;

type Batch = Box<dyn Fn(i64, u32) -> BatchFuture + Send + Sync>;

/// One retention sweep: a named batch statement that a [`Retention`] runs every `every`,
/// repeating it while a batch comes back full.
///
/// A round calls the batch with the current time (Unix ms, taken again for each batch) and
/// the batch size; a batch that returns `batch` rows is followed by another after `pause`,
/// a shorter one ends the round. The batch closure records its own metrics.
pub struct RetentionSweep {
    name: String,
    every: Duration,
    batch: u32,
    pause: Duration,
    at_once: bool,
    run: Batch,
}

impl RetentionSweep {
    /// A sweep named `name` (the `sweep` field of its log lines) whose rounds start `every`
    /// apart (at least 1 ms; the first one interval after start-up), each running `run(now_ms,
    /// batch)` until it returns fewer than `batch` rows, back to back.
    pub fn new<F, Fut, E>(name: impl Into<String>, every: Duration, batch: u32, run: F) -> Self
    where
        F: Fn(i64, u32) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<u64, E>> + Send + 'static,
        E: Into<SweepError>,
    {
        Self {
            name: name.into(),
            every: every.max(Duration::from_millis(1)),
            batch: batch.max(1),
            pause: Duration::ZERO,
            at_once: false,
            run: Box::new(move |now, batch| {
                let round = run(now, batch);
                Box::pin(async move { round.await.map_err(Into::into) })
            }),
        }
    }

    /// Waits `pause` between two batches of a round, so the sweep never holds locks long.
    #[must_use]
    pub fn pausing(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// Runs the first round at start-up instead of one interval after it.
    #[must_use]
    pub fn at_once(mut self) -> Self {
        self.at_once = true;
        self
    }

    /// The sweep's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// One round at the current time: batches until one is not full (or `shutdown` is
    /// cancelled between two). Returns the rows of the whole round.
    ///
    /// # Errors
    /// The first failed batch's error; the rows of the batches before it are lost to the
    /// count, not to the database.
    pub async fn round(&self, shutdown: &CancellationToken) -> Result<u64, SweepError> {
        let mut rows = 0_u64;
        loop {
            let n = (self.run)(oncely_core::now_ms(), self.batch).await?;
            rows = rows.saturating_add(n);
            if n < u64::from(self.batch) || shutdown.is_cancelled() {
                return Ok(rows);
            }
            if !self.pause.is_zero() && !wait(shutdown, self.pause).await {
                return Ok(rows);
            }
        }
    }
}

impl std::fmt::Debug for RetentionSweep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetentionSweep")
            .field("name", &self.name)
            .field("every", &self.every)
            .field("batch", &self.batch)
            .field("pause", &self.pause)
            .field("at_once", &self.at_once)
            .finish_non_exhaustive()
    }
}

/// Runs a list of [`RetentionSweep`]s, each on its own interval, until a
/// [`CancellationToken`] is cancelled — the one background retention loop of a process.
///
/// Failures have one policy: a round that finds the store down
/// ([`is_outage`](crate::is_outage)) is tried again after the outage backoff (by default
/// [`RetryPolicy::outage`] from 1 s to 30 s, full jitter), never later than the sweep's
/// interval; any other failure waits the interval. One sweep waiting out a failure does not
/// hold the others. Log lines carry `sweep` and `rows` (debug, per round that removed any)
/// or `sweep`, `error`, `outage` and `retry_in_ms` (warn, per failed round).
#[derive(Debug)]
pub struct Retention {
    sweeps: Vec<RetentionSweep>,
    outage: RetryPolicy,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            sweeps: Vec::new(),
            outage: RetryPolicy::outage(Duration::from_secs(1), Duration::from_secs(30)),
        }
    }
}

impl Retention {
    /// A runner with no sweeps and the default outage backoff.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `sweep`.
    #[must_use]
    pub fn sweep(mut self, sweep: RetentionSweep) -> Self {
        self.sweeps.push(sweep);
        self
    }

    /// Replaces the backoff for rounds that find the store down.
    #[must_use]
    pub fn outage_policy(mut self, policy: RetryPolicy) -> Self {
        self.outage = policy;
        self
    }

    /// Runs every sweep until `shutdown` is cancelled; returns once each has finished the
    /// batch it was running.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tasks = tokio::task::JoinSet::new();
        for sweep in self.sweeps {
            tasks.spawn(run_sweep(sweep, self.outage, shutdown.clone()));
        }
        while tasks.join_next().await.is_some() {}
    }

    /// [`Retention::run`] on a new task. Must be called within a Tokio runtime.
    pub fn spawn(self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(self.run(shutdown))
    }
}

async fn run_sweep(sweep: RetentionSweep, outage: RetryPolicy, shutdown: CancellationToken) {
    if !sweep.at_once && !wait(&shutdown, sweep.every).await {
        return;
    }
    let mut outage_rounds = 0_u32;
    loop {
        let next = match sweep.round(&shutdown).await {
            Ok(rows) => {
                outage_rounds = 0;
                if rows > 0 {
                    tracing::debug!(sweep = %sweep.name, rows, "retention sweep");
                }
                sweep.every
            }
            Err(e) => {
                let down = crate::is_outage(&*e);
                let next = if down {
                    outage_rounds = outage_rounds.saturating_add(1);
                    let unit = rand::random::<f64>();
                    let decided = outage.outage_wait(outage_rounds, None, None, unit);
                    decided.wait.min(sweep.every)
                } else {
                    outage_rounds = 0;
                    sweep.every
                };
                tracing::warn!(
                    sweep = %sweep.name,
                    error = %e,
                    outage = down,
                    retry_in_ms = oncely_core::millis(next),
                    "retention sweep failed"
                );
                next
            }
        };
        if !wait(&shutdown, next).await {
            return;
        }
    }
}

/// Sleeps `d`; `false` when `shutdown` was cancelled first (or already).
async fn wait(shutdown: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(d) => true,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::StoreError;

    #[tokio::test]
    async fn a_sweep_finding_the_store_down_is_retried_by_the_outage_policy_and_the_others_keep_running(
    ) {
        let failing = Arc::new(AtomicU64::new(0));
        let steady = Arc::new(AtomicU64::new(0));
        let (f, s) = (failing.clone(), steady.clone());
        let runner = Retention::new()
            .outage_policy(RetryPolicy::outage(
                Duration::from_millis(5),
                Duration::from_millis(10),
            ))
            .sweep(
                // Every round of this one finds the store down; its interval is long, so
                // only the outage backoff can bring it back within the test.
                RetentionSweep::new("down", Duration::from_secs(3600), 10, move |_, _| {
                    f.fetch_add(1, Ordering::SeqCst);
                    async { Err(StoreError::TimedOut(Duration::from_secs(1))) }
                })
                .at_once(),
            )
            .sweep(RetentionSweep::new(
                "steady",
                Duration::from_millis(5),
                10,
                move |_, _| {
                    s.fetch_add(1, Ordering::SeqCst);
                    async { Ok::<_, StoreError>(3) }
                },
            ));
        let stop = CancellationToken::new();
        let handle = runner.spawn(stop.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(failing.load(Ordering::SeqCst) >= 3, "outage rounds retried");
        assert!(
            steady.load(Ordering::SeqCst) >= 3,
            "the other sweep kept running"
        );
        stop.cancel();
        tokio::time::timeout(Duration::from_millis(200), handle)
            .await
            .expect("cancel stops the runner promptly")
            .expect("no sweep panicked");
    }

    #[tokio::test]
    async fn a_round_repeats_full_batches_with_the_time_of_each() {
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        let sweep = RetentionSweep::new("batches", Duration::from_secs(1), 2, move |now, batch| {
            assert!(now > 0);
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, StoreError>(if n < 2 { u64::from(batch) } else { 1 }) }
        })
        .pausing(Duration::from_millis(1));
        let rows = sweep.round(&CancellationToken::new()).await.unwrap();
        assert_eq!((rows, calls.load(Ordering::SeqCst)), (5, 3));
    }
}
