//! Claiming due effects and running each through its lane: the pipeline that feeds the settle stage.

use std::sync::Arc;
use std::time::Instant;

use oncely_sql::{Effect, EffectState, StoreError};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::{now_ms, Done, EffectRunner, Pending, SEND_BOUND};

impl EffectRunner {
    /// Claims for every lane with room — in `run`, only once half a batch has room (or
    /// nothing is in hand), so that a busy lane claims in batches rather than one effect
    /// per freed slot — and starts each claimed effect: it waits for a call slot, is called
    /// or checked, and its outcome goes to the settle stage (`settle_tx`).
    pub(super) async fn claim_round(
        self: &Arc<Self>,
        tasks: &tokio_util::task::TaskTracker,
        settle_tx: &mpsc::UnboundedSender<Done>,
        batched: bool,
    ) -> Result<usize, StoreError> {
        let batch = self.config.batch.max(1) as usize;
        let mut started = 0;
        for (name, lane) in &self.lanes {
            let room = lane.room(batch);
            let threshold = if batched && lane.busy(self.capacity()) {
                batch.div_ceil(2)
            } else {
                1
            };
            if room < threshold
                || (batched && *lane.next_claim.lock().expect("lane lock") > Instant::now())
            {
                continue;
            }
            let (Ok(mut claimed), Ok(mut unsettled)) = (
                lane.claimed.clone().try_acquire_many_owned(room as u32),
                lane.unsettled.clone().try_acquire_many_owned(room as u32),
            ) else {
                continue;
            };
            // Taken before the round trip: the send bound, measured from here, errs long.
            let claimed_at = Instant::now();
            let effects = self
                .store
                .claim(
                    name,
                    &self.config.runner_id,
                    room as u32,
                    self.config.lease + SEND_BOUND,
                    now_ms(),
                )
                .await?;
            if effects.len() < room {
                *lane.next_claim.lock().expect("lane lock") = Instant::now() + self.config.poll;
            }
            for effect in effects {
                let (Some(claimed), Some(unsettled)) = (claimed.split(1), unsettled.split(1))
                else {
                    break;
                };
                started += 1;
                tasks.spawn(self.clone().start(
                    lane.calls.clone(),
                    effect,
                    claimed_at,
                    claimed,
                    unsettled,
                    settle_tx.clone(),
                ));
            }
        }
        Ok(started)
    }

    /// Waits for a call slot, calls or checks `effect`, frees the slot as soon as the
    /// provider answered, and hands the outcome to the settle stage.
    pub(super) async fn start(
        self: Arc<Self>,
        calls: Arc<Semaphore>,
        effect: Effect,
        claimed_at: Instant,
        claimed: OwnedSemaphorePermit,
        unsettled: OwnedSemaphorePermit,
        settle_tx: mpsc::UnboundedSender<Done>,
    ) {
        let Ok(slot) = calls.acquire_owned().await else {
            return;
        };
        let pending = self.process(effect, claimed_at).await;
        drop(slot);
        drop(claimed);
        self.freed.notify_one();
        if let Some(pending) = pending {
            // The settle stage outlives every call task (it ends when the last sender does).
            let _ = settle_tx.send(Done {
                pending,
                _unsettled: unsettled,
            });
        }
    }

    /// Calls or checks one claimed effect (claimed at `claimed_at`); its outcome, to be
    /// settled. A failure before that (a corrupt row, the evidence unreadable) leaves the
    /// effect leased; after the lease it is checked again, so nothing is lost or repeated.
    pub(super) async fn process(&self, effect: Effect, claimed_at: Instant) -> Option<Pending> {
        let lane = self.lanes.get(&effect.provider)?;
        let result = match effect.state() {
            Ok(EffectState::InFlight) => self.call(lane, &effect, claimed_at).await,
            Ok(EffectState::Unknown) => self.check(lane, &effect).await,
            Ok(other) => {
                tracing::warn!(effect = %effect.id, state = %other, "claimed in an unexpected state");
                return None;
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(pending) => Some(pending),
            Err(e) => {
                tracing::warn!(effect = %effect.id, error = %e, "effect not settled; checked again after its lease");
                None
            }
        }
    }
}
