//! The periodic reconciler a service runs beside its other workers: every configured
//! provider's records against the local intents, once per interval, over a trailing
//! window (`oncely_effects::Reconciler`; `oncely reconcile` is one run by hand).

use std::time::{Duration, SystemTime};

use oncely_effects::Reconciler;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// When and over what the periodic reconciler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileSchedule {
    /// Time between the starts of two rounds (the first round runs one interval after
    /// start-up, so a restart loop does not hammer the provider's list).
    pub every: Duration,
    /// Each run compares the records created within this long before it (plus the
    /// reconciler's clock skew). Default 24 h.
    pub window: Duration,
}

impl ReconcileSchedule {
    /// Every `every`, over the last 24 h.
    pub fn every(every: Duration) -> Self {
        Self {
            every,
            window: Duration::from_secs(24 * 3600),
        }
    }
}

/// Starts the periodic reconciler: each round runs every reconciler of `reconcilers` (one
/// per provider) in turn; each run stores what it found and sets
/// `oncely_reconcile_discrepancies{provider,kind}` and
/// `oncely_reconcile_last_run_timestamp_seconds{provider}`. A failed run (a provider
/// down) is logged and tried again at the next round. Cancel `shutdown` and await the
/// handle to stop it (a run in progress finishes first).
///
/// Must be called within a Tokio runtime.
pub fn spawn_reconciler(
    reconcilers: Vec<Reconciler>,
    schedule: ReconcileSchedule,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let every = schedule.every.max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            for reconciler in &reconcilers {
                run_once(reconciler, schedule.window).await;
            }
        }
    })
}

async fn run_once(reconciler: &Reconciler, window: Duration) {
    let since = SystemTime::now()
        .checked_sub(window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    match reconciler.run(since).await {
        Ok(report) => {
            let level_warn = !report.discrepancies.is_empty();
            if level_warn {
                tracing::warn!(
                    provider = %report.run.provider,
                    run = %report.run.id,
                    records = report.run.objects,
                    intents = report.run.intents,
                    discrepancies = report.discrepancies.len(),
                    completed = report.completed.len(),
                    "reconciliation found discrepancies (oncely reconcile --provider … lists them)"
                );
            } else {
                tracing::info!(
                    provider = %report.run.provider,
                    run = %report.run.id,
                    records = report.run.objects,
                    intents = report.run.intents,
                    completed = report.completed.len(),
                    "reconciliation: no discrepancies"
                );
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "reconciliation run failed; trying again at the next round");
        }
    }
}
