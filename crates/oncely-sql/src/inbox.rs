use oncely_core::MessageId;

use crate::backend::with_store;
use crate::driver::{Store, Sweep};
use crate::{Database, StoreError, Tx};

/// What [`InboxStore::record`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InboxOutcome {
    /// First time this consumer sees the message: run the effect in the same transaction.
    New,
    /// The consumer already committed this message: skip the effect, acknowledge.
    Duplicate,
}

/// The consumer inbox over table `oncely_inbox` (primary key `(consumer, message_id)`,
/// `received_at` in Unix ms).
///
/// A consumer records each message id with [`InboxStore::record`] in the *same*
/// transaction as its effect: the primary key (`INSERT … ON CONFLICT DO NOTHING`, never
/// SELECT-then-INSERT) tells a redelivery apart, and a rolled-back effect leaves no row, so
/// the retry runs the effect again. Rows are kept for a retention that must be longer than
/// the broker's redelivery window (after it, a redelivered copy would run the effect again)
/// and deleted in small batches by [`InboxStore::collect`].
#[derive(Debug, Clone)]
pub struct InboxStore {
    db: Database,
}

impl InboxStore {
    /// An inbox on `db` (migrated with [`Database::migrate`]).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// Records that `consumer` received message `id` at `now_ms` (Unix ms), inside `tx`.
    ///
    /// On PostgreSQL and MySQL a concurrent transaction recording the same pair waits for
    /// the first to finish (at most the lock timeout): after its commit this one sees
    /// [`InboxOutcome::Duplicate`], after its rollback [`InboxOutcome::New`]. SQLite
    /// transactions are serialised by its writer.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (the caller rolls back).
    pub async fn record(
        tx: &mut Tx,
        consumer: &str,
        id: &MessageId,
        now_ms: i64,
    ) -> Result<InboxOutcome, StoreError> {
        let id = id.to_string();
        // The primary key tells a redelivery apart (MySQL: its duplicate-key error).
        let inserted = tx
            .insert_ignoring_duplicate(
                crate::query(INSERT_ROW)
                    .bind(consumer)
                    .bind(id)
                    .bind(now_ms),
                "(consumer, message_id)",
            )
            .await?;
        Ok(if inserted {
            InboxOutcome::New
        } else {
            InboxOutcome::Duplicate
        })
    }

    /// Deletes up to `batch` rows received before `before_ms` (Unix ms; callers pass
    /// `now - retention`), returning how many went. Call it in a loop until it returns
    /// less than `batch`; small batches keep locks short (PostgreSQL: the locked batch is a
    /// materialised CTE, so the `LIMIT` holds — an `IN (SELECT … LIMIT … SKIP LOCKED)`
    /// subquery may be re-run and delete more).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn collect(&self, before_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        let n = with_store!(&self.db, |s| s
            .sweep(&RECEIVED_BEFORE, before_ms, batch)
            .await)?;
        Ok(n)
    }
}

/// The inbox row insert (see [`InboxStore::record`]).
const INSERT_ROW: &str =
    "INSERT INTO oncely_inbox (consumer, message_id, received_at) VALUES ($1, $2, $3)";

/// Rows received before the bound (`$1`).
pub(crate) const RECEIVED_BEFORE: Sweep = Sweep {
    table: "oncely_inbox",
    filter: "received_at < $1",
    order_by: "received_at",
    index: "oncely_inbox_received",
};
