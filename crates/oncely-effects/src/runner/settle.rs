//! The settle stage: finished effects settled in groups, each group in one store call.

use std::sync::Arc;

use oncely_sql::{EffectStore, SettleItem, StoreError};
use tokio::sync::mpsc;

use super::{now_ms, Done, EffectRunner};

impl EffectRunner {
    /// The settle stage: a task that takes every outcome ready (up to
    /// [`RunnerConfig::settle_batch`]) and settles them together, until every sender is
    /// gone and the queue is empty.
    pub(super) fn start_settler(
        self: &Arc<Self>,
    ) -> (mpsc::UnboundedSender<Done>, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Done>();
        let runner = self.clone();
        let handle = tokio::spawn(async move {
            let limit = runner.settle_batch();
            let mut group = Vec::with_capacity(limit);
            while rx.recv_many(&mut group, limit).await > 0 {
                // Its own task, so that a panicking handler loses only its group (left
                // leased, checked again after the lease), never the settle stage.
                let settling = runner.clone();
                let batch = std::mem::take(&mut group);
                if let Err(e) =
                    tokio::spawn(async move { settling.settle_group(batch).await }).await
                {
                    tracing::error!(error = %e, "an effect settle group panicked; its effects are checked again after their lease");
                }
                runner.freed.notify_one();
            }
        });
        (tx, handle)
    }

    /// Settles `group` in one transaction; when that fails, each outcome in a transaction
    /// of its own (one effect's handler error or bad row must not hold back the others).
    /// An outcome that cannot be settled leaves its effect leased: after the lease it is
    /// checked again, never called blindly.
    pub(super) async fn settle_group(&self, group: Vec<Done>) {
        if group.len() > 1 {
            match self.settle_together(&group).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::debug!(error = %e, effects = group.len(), "group settle failed; settling each alone");
                }
            }
        }
        for done in &group {
            if let Err(e) = self.settle_together(std::slice::from_ref(done)).await {
                tracing::warn!(effect = %done.pending.effect.id, error = %e, "effect not settled; checked again after its lease");
            }
        }
    }

    /// One transaction: every outcome's fenced update and evidence
    /// ([`EffectStore::settle_batch`]), then the handler's business update of each effect
    /// whose lease held. An effect whose lease was lost is skipped (its successor settles
    /// it).
    pub(super) async fn settle_together(&self, group: &[Done]) -> Result<(), StoreError> {
        // Every outcome of `group` is known here and recorded nowhere yet.
        oncely_core::failpoint::fail_point!("runner.before_settle");
        let db = self.store.database();
        let mut tx = db.begin().await?;
        let items: Vec<SettleItem<'_>> = group.iter().map(|d| d.pending.item()).collect();
        let held = EffectStore::settle_batch(&mut tx, &items, now_ms()).await?;
        for (done, held) in group.iter().zip(held) {
            let pending = &done.pending;
            if !held {
                tracing::warn!(effect = %pending.effect.id, "lease lost before the settle; another runner has the effect");
                continue;
            }
            if let Some(outcome) = pending.settled() {
                self.handler
                    .settled(&mut tx, &pending.effect, outcome)
                    .await?;
            }
        }
        // The effects' updates and the service's business updates are written, not committed.
        oncely_core::failpoint::fail_point!("runner.before_settle_commit");
        tx.commit().await
    }
}
