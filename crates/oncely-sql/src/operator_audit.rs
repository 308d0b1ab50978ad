//! [`OperatorAudit`]: the audit trail of operator actions that have no audit table of their
//! own (table `oncely_operator_audit`, migration 0030) — the console's dead-letter requeue.
//! Effects and discrepancies keep theirs (`oncely_effect_audit`, `oncely_discrepancy_audit`).

use crate::{query, Database, StoreError};

/// One operator action as recorded.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
#[non_exhaustive]
pub struct OperatorAction {
    /// When, Unix ms.
    pub at: i64,
    /// Who (the name the operator signed in with).
    pub actor: String,
    /// What, e.g. `requeue-dead-letter`.
    pub action: String,
    /// On what, e.g. `inbox:billing:<message id>`.
    pub target: String,
    /// The outcome, e.g. `requeued 1`.
    pub detail: String,
}

/// The operator audit store over `oncely_operator_audit`.
#[derive(Debug, Clone)]
pub struct OperatorAudit {
    db: Database,
}

impl OperatorAudit {
    /// A store on `db` (migrated with [`Database::migrate`]).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// Appends one row: `actor` did `action` on `target` at `at` (Unix ms), with `detail`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn record(
        &self,
        at: i64,
        actor: &str,
        action: &str,
        target: &str,
        detail: &str,
    ) -> Result<(), StoreError> {
        self.db
            .execute(
                query(
                    "INSERT INTO oncely_operator_audit (at, actor, action, target, detail) \
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(at)
                .bind(actor)
                .bind(action)
                .bind(target)
                .bind(detail),
            )
            .await?;
        Ok(())
    }

    /// The newest `limit` rows, newest first; only those on `target` when it is given.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn recent(
        &self,
        target: Option<&str>,
        limit: u32,
    ) -> Result<Vec<OperatorAction>, StoreError> {
        let limit = i64::from(limit.max(1));
        let q = match target {
            Some(t) => query(
                "SELECT at, actor, action, target, detail FROM oncely_operator_audit \
                 WHERE target = $1 ORDER BY at DESC, id DESC LIMIT $2",
            )
            .bind(t)
            .bind(limit),
            None => query(
                "SELECT at, actor, action, target, detail FROM oncely_operator_audit \
                 ORDER BY at DESC, id DESC LIMIT $1",
            )
            .bind(limit),
        };
        self.db.fetch_all(q).await
    }
}
