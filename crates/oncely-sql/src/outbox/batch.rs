//! Settling a claimed batch: the outcome of each row, in the claim's transaction on PostgreSQL.

#[cfg(feature = "postgres")]
use super::types::Outcome;
use super::types::{ClaimedBatch, Hold, OutboxRow, PublishFailure, Settled};
use crate::StoreError;

impl ClaimedBatch {
    /// The claimed rows, in id order.
    pub fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    /// True when nothing was claimed.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Records the outcome of the batch: `published` rows become `published` at
    /// `published_at_ms` (Unix ms) — kept as such, or not kept at all when the store does
    /// not keep published rows ([`OutboxStore::keep_published`](crate::OutboxStore::keep_published); SQLite and MySQL mark them
    /// either way) — each failure is rescheduled or goes `dead` at `max_attempts` (at once when
    /// [`PublishFailure::permanent`]; as
    /// [`OutboxStore::reschedule`](crate::OutboxStore::reschedule)); rows in neither list are released without counting an
    /// attempt. On PostgreSQL all of it commits as one transaction (the claim's, which
    /// deleted the rows: failed and released rows are re-inserted with their ids).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails. Nothing is recorded then: PostgreSQL rolls
    /// back (the rows are claimable again at once), on SQLite the leases run out; either
    /// way the rows are republished with the same message ids.
    pub async fn settle(
        self,
        published: &[i64],
        published_at_ms: i64,
        failures: &[PublishFailure],
        max_attempts: u32,
    ) -> Result<Settled, StoreError> {
        let mut settled = Settled::default();
        match self.hold {
            Hold::Nothing => {}
            Hold::Leased { store, owner } => {
                settled.published = store
                    .mark_published(&owner, published, published_at_ms)
                    .await?;
                for f in failures {
                    // A permanent failure reaches any limit with this attempt.
                    let max = if f.permanent { 1 } else { max_attempts };
                    let r = store
                        .reschedule(&owner, f.id, &f.error, f.retry_at_ms, max)
                        .await?;
                    settled.failures.push((f.id, r));
                }
                let done: std::collections::HashSet<i64> = published
                    .iter()
                    .copied()
                    .chain(failures.iter().map(|f| f.id))
                    .collect();
                let rest: Vec<i64> = self
                    .rows
                    .iter()
                    .map(|r| r.id)
                    .filter(|id| !done.contains(id))
                    .collect();
                if !rest.is_empty() {
                    store.release(&owner, &rest).await?;
                }
            }
            #[cfg(feature = "postgres")]
            Hold::Locked { tx, keep } => {
                let outcome = Outcome {
                    published,
                    published_at_ms,
                    failures,
                    max_attempts,
                };
                settled = crate::postgres::settle_locked(tx, keep, &self.rows, outcome).await?;
            }
        }
        Ok(settled)
    }
}
