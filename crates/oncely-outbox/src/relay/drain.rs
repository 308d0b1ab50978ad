//! Draining the outbox: batches claimed, published and settled concurrently, each claim skipping the id ranges other batches hold, until the outbox is dry.

use std::sync::Arc;

use oncely_sql::{ClaimedBatch, StoreError};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{lock, Relay, RelayConfig, RelayError, RoundReport};
use crate::metrics as m;

impl Relay {
    /// [`Relay::drain`], also claiming again on `wake` (new rows committed) while batches
    /// wait for their confirmations: events committed during a slow confirmation go out
    /// in the next window instead of queueing behind it.
    ///
    /// Each batch is one task: claim, publish, settle. While claims come back full (a
    /// backlog), every free slot gets a task at once, so claims run concurrently with
    /// each other as well as with publishes (`FOR UPDATE SKIP LOCKED` keeps them apart);
    /// otherwise one claim runs at a time, so an idle outbox is not polled by several
    /// claims per wake-up.
    pub(super) async fn drain_woken(
        &self,
        shutdown: &CancellationToken,
        wake: Option<&Notify>,
    ) -> Result<RoundReport, RelayError> {
        let (mut drain, mut rx) = Drain::new(&self.config);
        let tasks = TaskTracker::new();
        loop {
            while drain.may_claim(shutdown) {
                tasks.spawn(self.clone().run_batch(drain.start_batch()));
            }
            if drain.in_flight == 0 {
                break;
            }
            let event = tokio::select! {
                e = rx.recv() => e,
                () = woken(wake), if drain.dry => {
                    drain.dry = false;
                    continue;
                }
                () = tokio::time::sleep(self.config.poll_interval), if drain.dry => {
                    drain.dry = false;
                    continue;
                }
            };
            // `None` is unreachable while `drain` holds a sender.
            let Some(event) = event else { break };
            drain.record(event);
        }
        tasks.close();
        tasks.wait().await;
        drain.finish()
    }

    /// One batch task of [`Relay::drain_woken`]: claim, publish, settle, reporting to the
    /// drain through `slot`'s reporter.
    pub(super) async fn run_batch(self, slot: BatchSlot) {
        let BatchSlot {
            held,
            no,
            settles_before,
            mut reporter,
        } = slot;
        let skip: Vec<_> = lock(&held).iter().map(|(_, r)| r.clone()).collect();
        let batch = match self.claim_skipping(&skip).await {
            Ok(batch) => batch,
            Err(e) => {
                reporter.send(BatchEvent::ClaimFailed(e));
                return;
            }
        };
        reporter.send(BatchEvent::Claimed {
            rows: batch.rows().len(),
            settles_before,
        });
        let (Some(first), Some(last)) = (batch.rows().first(), batch.rows().last()) else {
            return;
        };
        // Removed however the task ends (a panic while publishing included):
        // a range left behind would hide its rows from this drain's claims.
        let held_range = HeldRange::new(held, no, first.id..=last.id);
        // Claimed under this relay's lease, nothing published: another relay takes the rows
        // once the lease ends.
        oncely_core::failpoint::fail_point!("relay.after_claim");
        let results = self.publish(batch.rows()).await;
        let report = self.settle(batch, results).await;
        drop(held_range);
        reporter.send(BatchEvent::Settled(report));
    }

    pub(super) async fn claim(&self) -> Result<ClaimedBatch, StoreError> {
        self.claim_skipping(&[]).await
    }

    /// Claims a batch; `held` are the id ranges of this relay's batches in flight (their
    /// rows are locked by this relay, so the claim need not look at them).
    pub(super) async fn claim_skipping(
        &self,
        held: &[std::ops::RangeInclusive<i64>],
    ) -> Result<ClaimedBatch, StoreError> {
        let started = std::time::Instant::now();
        let batch = self
            .store
            .claim_batch(
                &self.config.relay_id,
                self.config.batch_size,
                self.config.lease,
                oncely_core::now_ms(),
                held,
            )
            .await;
        match &batch {
            Ok(_) => self.health.database.up(),
            Err(e) => self.health.database.down(e),
        }
        tracing::trace!(
            rows = batch.as_ref().map_or(0, |b| b.rows().len()),
            micros = started.elapsed().as_micros() as u64,
            oldest_age_ms = batch
                .as_ref()
                .ok()
                .and_then(|b| b.rows().iter().map(|r| r.created_at).min())
                .map_or(0, |c| oncely_core::now_ms() - c),
            "claim"
        );
        batch
    }

    /// Counts rows claimed (PostgreSQL: deleted) and, every
    /// [`RelayConfig::vacuum_after_rows`], starts a background vacuum of the outbox unless
    /// one of this relay's is still running.
    pub(super) fn count_claimed(&self, rows: usize) {
        use std::sync::atomic::Ordering;
        let every = self.config.vacuum_after_rows;
        if every == 0 || rows == 0 || !self.store.database().backend().needs_vacuum() {
            return;
        }
        let v = &self.vacuum;
        let since = v.rows.fetch_add(rows as u64, Ordering::Relaxed) + rows as u64;
        if since < every || v.running.swap(true, Ordering::AcqRel) {
            return;
        }
        v.rows.fetch_sub(since, Ordering::Relaxed);
        let (store, v) = (self.store.clone(), self.vacuum.clone());
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            match store.vacuum().await {
                Ok(()) => {
                    metrics::counter!(m::VACUUMS_TOTAL).increment(1);
                    tracing::debug!(
                        rows = since,
                        ms = oncely_core::millis(started.elapsed()),
                        "outbox vacuumed"
                    );
                }
                Err(e) => tracing::warn!(error = %e, "outbox vacuum failed"),
            }
            v.running.store(false, Ordering::Release);
        });
    }
}

/// What a batch task of [`Relay::drain_woken`] reports to its drain.
pub(super) enum BatchEvent {
    /// `settles_before`: batches settled when the task started; a settle since then may have
    /// made rows claimable that this claim did not see.
    Claimed {
        rows: usize,
        settles_before: u64,
    },
    ClaimFailed(StoreError),
    Settled(RoundReport),
    /// The task ended without reporting (it panicked); `claimed`: after its claim.
    Lost {
        claimed: bool,
    },
}

/// A batch task's line to its drain; reports [`BatchEvent::Lost`] if the task ends before
/// its last report.
pub(super) struct Reporter {
    events: tokio::sync::mpsc::UnboundedSender<BatchEvent>,
    claimed: bool,
    done: bool,
}

impl Reporter {
    fn send(&mut self, event: BatchEvent) {
        match event {
            BatchEvent::Claimed { rows, .. } => {
                self.claimed = true;
                self.done = rows == 0;
            }
            _ => self.done = true,
        }
        drop(self.events.send(event));
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if !self.done {
            drop(self.events.send(BatchEvent::Lost {
                claimed: self.claimed,
            }));
        }
    }
}

/// What a batch task of [`Relay::drain_woken`] starts with.
pub(super) struct BatchSlot {
    held: Arc<std::sync::Mutex<HeldRanges>>,
    /// The task's number, its key in `held`.
    no: u64,
    /// See [`BatchEvent::Claimed`].
    settles_before: u64,
    reporter: Reporter,
}

/// The state of one [`Relay::drain_woken`]: its batch tasks and what they reported.
#[allow(clippy::struct_excessive_bools)] // four independent conditions of the claim loop, not a mode
pub(super) struct Drain {
    events: tokio::sync::mpsc::UnboundedSender<BatchEvent>,
    /// [`RelayConfig::max_in_flight_batches`], at least 1.
    windows: usize,
    /// Rows in a full claim.
    full: usize,
    /// Tasks started and not finished; of them, those still claiming.
    in_flight: usize,
    claiming: usize,
    /// The last claim came back full: more is likely waiting.
    backlog: bool,
    /// The last claim found nothing: wait for a settle, a wake-up or the poll interval.
    dry: bool,
    claimed_any: bool,
    failed: Option<StoreError>,
    /// A batch found the broker or the database unavailable: claim no more, so the relay
    /// backs off as a whole instead of re-claiming the rows it just gave back.
    halted: bool,
    /// Id ranges of the batches in flight, by task number.
    held: Arc<std::sync::Mutex<HeldRanges>>,
    task_no: u64,
    /// Batches settled so far.
    settles: u64,
    total: RoundReport,
}

impl Drain {
    fn new(config: &RelayConfig) -> (Self, tokio::sync::mpsc::UnboundedReceiver<BatchEvent>) {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let drain = Self {
            events,
            windows: config.max_in_flight_batches.max(1),
            full: usize::try_from(config.batch_size.max(1)).unwrap_or(usize::MAX),
            in_flight: 0,
            claiming: 0,
            backlog: false,
            dry: false,
            claimed_any: false,
            failed: None,
            halted: false,
            held: Arc::default(),
            task_no: 0,
            settles: 0,
            total: RoundReport::default(),
        };
        (drain, rx)
    }

    /// Whether to start another batch task now: while claims come back full, in every free
    /// slot; otherwise only when no claim is running.
    fn may_claim(&self, shutdown: &CancellationToken) -> bool {
        self.failed.is_none()
            && !self.halted
            && !self.dry
            && !shutdown.is_cancelled()
            && self.in_flight < self.windows
            && (self.claiming == 0 || self.backlog)
    }

    /// Counts a new batch task in; it starts with what this returns.
    fn start_batch(&mut self) -> BatchSlot {
        self.in_flight += 1;
        self.claiming += 1;
        self.task_no += 1;
        BatchSlot {
            held: self.held.clone(),
            no: self.task_no,
            settles_before: self.settles,
            reporter: Reporter {
                events: self.events.clone(),
                claimed: false,
                done: false,
            },
        }
    }

    fn record(&mut self, event: BatchEvent) {
        match event {
            BatchEvent::Claimed {
                rows,
                settles_before,
            } => self.claimed(rows, settles_before),
            BatchEvent::Settled(report) => self.settled(report),
            BatchEvent::ClaimFailed(e) => self.claim_failed(e),
            BatchEvent::Lost { claimed } => self.lost(claimed),
        }
    }

    fn claimed(&mut self, rows: usize, settles_before: u64) {
        self.claiming -= 1;
        self.backlog = rows >= self.full;
        if rows == 0 {
            // Settling what is in flight may make further partition heads claimable; so may
            // new commits. A batch settled while this claim ran may have done so already:
            // then claim again at once.
            self.in_flight -= 1;
            self.dry = self.settles == settles_before;
        } else {
            self.claimed_any = true;
        }
    }

    fn settled(&mut self, report: RoundReport) {
        self.in_flight -= 1;
        self.settles += 1;
        self.halted |= report.deferred > 0;
        self.total.add(report);
        self.dry = false;
    }

    fn claim_failed(&mut self, e: StoreError) {
        self.claiming -= 1;
        self.in_flight -= 1;
        tracing::debug!(error = %e, "relay claim failed");
        self.failed.get_or_insert(e);
    }

    fn lost(&mut self, claimed: bool) {
        if !claimed {
            self.claiming -= 1;
        }
        self.in_flight -= 1;
    }

    /// The drain's totals, or the claim failure if no claim succeeded.
    fn finish(self) -> Result<RoundReport, RelayError> {
        match self.failed {
            Some(e) if !self.claimed_any => Err(e.into()),
            _ => Ok(self.total),
        }
    }
}

/// Resolves on `wake`'s next notification; without one, never.
pub(super) async fn woken(wake: Option<&Notify>) {
    match wake {
        Some(w) => w.notified().await,
        None => std::future::pending().await,
    }
}

/// Id ranges (first..=last claimed id) of a relay's batches in flight, by task number.
pub(super) type HeldRanges = Vec<(u64, std::ops::RangeInclusive<i64>)>;

/// One batch's entry in [`HeldRanges`], removed when dropped.
pub(super) struct HeldRange {
    held: Arc<std::sync::Mutex<HeldRanges>>,
    no: u64,
}

impl HeldRange {
    fn new(
        held: Arc<std::sync::Mutex<HeldRanges>>,
        no: u64,
        range: std::ops::RangeInclusive<i64>,
    ) -> Self {
        lock(&held).push((no, range));
        Self { held, no }
    }
}

impl Drop for HeldRange {
    fn drop(&mut self) {
        lock(&self.held).retain(|(n, _)| *n != self.no);
    }
}
