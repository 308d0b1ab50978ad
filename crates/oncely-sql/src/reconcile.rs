use std::time::Duration;

use crate::backend::with_store;
use crate::driver::Store;
use crate::effects::driver::EffectsBackend;
use crate::{query, Database, Effect, EffectState, EffectStore, StoreError, Tx};

oncely_core::stored_words! {
    /// The kinds of discrepancy a reconciliation run reports (docs/DESIGN.md "Multi-phase
    /// idempotency, unknown outcomes, reconciliation"); stored as `missing_remote`,
    /// `missing_local`, `amount_mismatch`, `status_mismatch`, `duplicate_remote`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    #[non_exhaustive]
    pub enum DiscrepancyKind {
        /// We recorded the effect as done (succeeded, with a provider id); the provider has no
        /// such object.
        MissingRemote => "missing_remote",
        /// The provider has an object (for a reference, or without one) that no local intent
        /// records.
        MissingLocal => "missing_local",
        /// Both sides have the effect, with different amounts (or currencies).
        AmountMismatch => "amount_mismatch",
        /// Both sides have the effect, and disagree on whether it took place (a local
        /// `succeeded` whose object is cancelled or declined; a local `failed` or
        /// `needs_review` whose object succeeded).
        StatusMismatch => "status_mismatch",
        /// More than one live provider object for one reference: the effect happened twice.
        DuplicateRemote => "duplicate_remote",
    }
}

/// A discrepancy as a run found it ([`DiscrepancyStore::record`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NewDiscrepancy {
    /// The provider's name (`payments`, `shipping`).
    pub provider: String,
    /// What is wrong.
    pub kind: DiscrepancyKind,
    /// The stable business reference both sides were matched by (for a provider object
    /// without one: its provider id).
    pub reference: String,
    /// The tenant of the local intent, when there is one.
    pub tenant: Option<String>,
    /// The local effect's id, when there is one.
    pub effect_id: Option<String>,
    /// The provider objects involved.
    pub provider_ids: Vec<String>,
    /// The rest of what was seen, a JSON object (amounts, statuses, a human `detail`, and
    /// `business_ref`: the business object the provider records name, e.g. an order id).
    pub details: serde_json::Value,
}

/// A discrepancy as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Discrepancy {
    /// Its id (UUIDv7).
    pub id: String,
    /// The provider's name.
    pub provider: String,
    /// The kind's stored word ([`Discrepancy::kind`] parses it).
    #[sqlx(rename = "kind")]
    pub kind_word: String,
    /// The business reference.
    pub reference: String,
    /// The local intent's tenant, if any.
    pub tenant: Option<String>,
    /// The local effect's id, if any.
    pub effect_id: Option<String>,
    /// Provider ids, comma-separated.
    pub provider_ids: String,
    /// JSON text: see [`NewDiscrepancy::details`].
    pub details: String,
    /// The run that first found it.
    pub run_id: String,
    /// The latest run that found it.
    pub last_run_id: String,
    /// Unix ms.
    pub found_at: i64,
    /// Unix ms, the latest run that found it.
    pub last_seen_at: i64,
    /// Unix ms, once resolved.
    pub resolved_at: Option<i64>,
    /// The action that resolved it (`acknowledge`, `mark-succeeded`, …).
    pub resolution: Option<String>,
    /// Who resolved it.
    pub resolved_by: Option<String>,
}

/// The effects (`columns`) of provider `$1`'s operation `$2` created at or after `$3`, oldest
/// first: a range of the index on `(provider, operation, created_at)` (SQLite migration
/// 0039), not every effect of the provider.
pub(crate) fn created_since_sql(columns: &str) -> String {
    format!(
        "SELECT {columns} FROM oncely_effects WHERE provider = $1 \
         AND operation = $2 AND created_at >= $3 ORDER BY created_at, id"
    )
}

impl Discrepancy {
    /// The kind.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for a word no kind has.
    pub fn kind(&self) -> Result<DiscrepancyKind, StoreError> {
        Ok(DiscrepancyKind::parse(&self.kind_word)?)
    }

    /// The provider ids, as a list.
    pub fn provider_id_list(&self) -> Vec<String> {
        self.provider_ids
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The details, parsed.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the stored text is not JSON.
    pub fn details_json(&self) -> Result<serde_json::Value, StoreError> {
        serde_json::from_str(&self.details)
            .map_err(|e| StoreError::Corrupt(format!("discrepancy {} details: {e}", self.id)))
    }

    /// The business object the provider's records name (`business_ref` of the details,
    /// where the reconciler's business pointer found one: for payments the order id of
    /// `metadata[order_id]`); `None` when they name none or the details do not parse.
    pub fn business_ref(&self) -> Option<String> {
        let details = self.details_json().ok()?;
        details.get("business_ref")?.as_str().map(str::to_owned)
    }

    /// `true` until resolved.
    pub fn is_open(&self) -> bool {
        self.resolved_at.is_none()
    }
}

/// What [`DiscrepancyStore::record`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recorded {
    /// A new open discrepancy.
    New(Discrepancy),
    /// The same (provider, kind, reference) was open already: refreshed (latest run, time,
    /// details), not duplicated.
    Refreshed(Discrepancy),
    /// An operator acknowledged (or refunded) this (provider, kind, reference) before: not
    /// reported again.
    Acknowledged,
}

/// One reconciliation run, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ReconcileRun {
    /// Its id (UUIDv7).
    pub id: String,
    /// The provider reconciled.
    pub provider: String,
    /// The window's start, Unix ms.
    pub since_ms: i64,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub finished_at: i64,
    /// Provider objects read.
    pub objects: i64,
    /// Local intents read.
    pub intents: i64,
    /// Discrepancies found (new and refreshed).
    pub discrepancies: i64,
    /// Unknown effects completed from the provider's record.
    pub completed: i64,
}

/// One audit row of a discrepancy.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DiscrepancyAudit {
    /// Unix ms.
    pub at: i64,
    /// Who.
    pub actor: String,
    /// The action (`acknowledge`, `mark-succeeded`, …).
    pub action: String,
    /// Why, as the operator said.
    pub reason: String,
    /// What the action did.
    pub detail: String,
}

/// The discrepancy store over tables `oncely_discrepancies` (one open row per provider,
/// kind and reference: `UNIQUE(provider, kind, reference, open_slot)` with `open_slot` 1
/// while open, NULL once resolved), `oncely_reconcile_runs` and `oncely_discrepancy_audit`.
/// Timestamps are Unix ms.
#[derive(Debug, Clone)]
pub struct DiscrepancyStore {
    db: Database,
}

/// The columns of [`Discrepancy`].
pub(crate) const DISCREPANCY_COLUMNS: &str = "id, provider, kind, reference, tenant, \
    effect_id, provider_ids, details, run_id, last_run_id, found_at, last_seen_at, \
    resolved_at, resolution, resolved_by";

const INSERT_DISCREPANCY: &str = "INSERT INTO oncely_discrepancies (id, provider, kind, \
    reference, tenant, effect_id, provider_ids, details, run_id, last_run_id, found_at, \
    last_seen_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

/// The resolution word of an operator who accepts a discrepancy as it is: the same
/// (provider, kind, reference) is not reported again.
pub const ACKNOWLEDGE: &str = "acknowledge";
/// The resolution word of an operator who had the extra charge refunded: not reported again
/// either (a refunded PaymentIntent stays `succeeded` at the provider).
pub const REFUND: &str = "refund";

impl DiscrepancyStore {
    /// The store on `db` (migrated with [`Database::migrate`]).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    fn columns(&self) -> &'static str {
        fn of<S: ReconcileBackend>(_: &S) -> &'static str {
            S::COLUMNS
        }
        with_store!(&self.db, |s| of(s))
    }

    /// Records what run `run_id` found: a new open discrepancy, or — when the same
    /// provider, kind and reference is open already — that row refreshed (the unique key
    /// decides, not a lookup). One an operator acknowledged (or refunded) before is not
    /// recorded again.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn record(
        &self,
        run_id: &str,
        new: &NewDiscrepancy,
        now_ms: i64,
    ) -> Result<Recorded, StoreError> {
        let mut tx = self.db.begin().await?;
        let acknowledged: Option<(String,)> = tx
            .fetch_optional(
                query(
                    "SELECT id FROM oncely_discrepancies WHERE provider = $1 AND kind = $2 \
                     AND reference = $3 AND resolution IN ($4, $5)",
                )
                .bind(new.provider.as_str())
                .bind(new.kind.as_str())
                .bind(new.reference.as_str())
                .bind(ACKNOWLEDGE)
                .bind(REFUND),
            )
            .await?;
        if acknowledged.is_some() {
            tx.commit().await?;
            return Ok(Recorded::Acknowledged);
        }
        let id = uuid::Uuid::now_v7().to_string();
        let details = new.details.to_string();
        let ids = new.provider_ids.join(",");
        let inserted = tx
            .insert_ignoring_duplicate(
                query(INSERT_DISCREPANCY)
                    .bind(id.as_str())
                    .bind(new.provider.as_str())
                    .bind(new.kind.as_str())
                    .bind(new.reference.as_str())
                    .bind(new.tenant.as_deref())
                    .bind(new.effect_id.as_deref())
                    .bind(ids.as_str())
                    .bind(details.as_str())
                    .bind(run_id)
                    .bind(run_id)
                    .bind(now_ms)
                    .bind(now_ms),
                "",
            )
            .await?;
        if !inserted {
            tx.execute(
                query(
                    "UPDATE oncely_discrepancies SET last_run_id = $1, last_seen_at = $2, \
                     provider_ids = $3, details = $4 WHERE provider = $5 AND kind = $6 \
                     AND reference = $7 AND open_slot = 1",
                )
                .bind(run_id)
                .bind(now_ms)
                .bind(ids.as_str())
                .bind(details.as_str())
                .bind(new.provider.as_str())
                .bind(new.kind.as_str())
                .bind(new.reference.as_str()),
            )
            .await?;
        }
        let columns = self.columns();
        let row: Discrepancy = tx
            .fetch_one(
                query(format!(
                    "SELECT {columns} FROM oncely_discrepancies WHERE provider = $1 \
                     AND kind = $2 AND reference = $3 AND open_slot = 1"
                ))
                .bind(new.provider.as_str())
                .bind(new.kind.as_str())
                .bind(new.reference.as_str()),
            )
            .await?;
        tx.commit().await?;
        Ok(if inserted {
            Recorded::New(row)
        } else {
            Recorded::Refreshed(row)
        })
    }

    /// Records a finished run.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn record_run(&self, run: &ReconcileRun) -> Result<(), StoreError> {
        let mut tx = self.db.begin().await?;
        tx.execute(
            query(
                "INSERT INTO oncely_reconcile_runs (id, provider, since_ms, started_at, \
                 finished_at, objects, intents, discrepancies, completed) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .bind(run.id.as_str())
            .bind(run.provider.as_str())
            .bind(run.since_ms)
            .bind(run.started_at)
            .bind(run.finished_at)
            .bind(run.objects)
            .bind(run.intents)
            .bind(run.discrepancies)
            .bind(run.completed),
        )
        .await?;
        tx.commit().await
    }

    /// Per provider, when its latest run finished (Unix ms).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn last_runs(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.db
            .fetch_all(query(format!(
                "SELECT {}, MAX(finished_at) FROM oncely_reconcile_runs GROUP BY provider \
                 ORDER BY provider",
                self.db.backend().text_column("provider")
            )))
            .await
    }

    /// The discrepancy with `id`, open or resolved.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn get(&self, id: &str) -> Result<Option<Discrepancy>, StoreError> {
        let columns = self.columns();
        self.db
            .fetch_optional(
                query(format!(
                    "SELECT {columns} FROM oncely_discrepancies WHERE id = $1"
                ))
                .bind(id),
            )
            .await
    }

    /// The open discrepancies, of `provider` when given, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn open(&self, provider: Option<&str>) -> Result<Vec<Discrepancy>, StoreError> {
        let columns = self.columns();
        let q = match provider {
            Some(p) => query(format!(
                "SELECT {columns} FROM oncely_discrepancies WHERE resolved_at IS NULL \
                 AND provider = $1 ORDER BY found_at, id"
            ))
            .bind(p),
            None => query(format!(
                "SELECT {columns} FROM oncely_discrepancies WHERE resolved_at IS NULL \
                 ORDER BY found_at, id"
            )),
        };
        self.db.fetch_all(q).await
    }

    /// Open discrepancies per provider: `(provider, count)`, by provider (providers without
    /// any are absent).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn open_counts_by_provider(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.db
            .fetch_all(query(format!(
                "SELECT {}, COUNT(*) AS n FROM oncely_discrepancies WHERE resolved_at IS NULL \
                 GROUP BY provider ORDER BY provider",
                self.db.backend().text_column("provider")
            )))
            .await
    }

    /// Open discrepancies of `provider` per kind (kinds without any are absent).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn open_counts(
        &self,
        provider: &str,
    ) -> Result<Vec<(DiscrepancyKind, i64)>, StoreError> {
        let rows: Vec<(String, i64)> = self
            .db
            .fetch_all(
                query(
                    "SELECT kind, COUNT(*) FROM oncely_discrepancies WHERE resolved_at IS NULL \
                     AND provider = $1 GROUP BY kind ORDER BY kind",
                )
                .bind(provider),
            )
            .await?;
        rows.into_iter()
            .map(|(k, n)| Ok((DiscrepancyKind::parse(&k)?, n)))
            .collect()
    }

    /// Closes open discrepancy `id` as `action` (e.g. `acknowledge`, `mark-succeeded`) and
    /// writes its audit row, in the caller's `tx` — so the change the action makes (an
    /// effect resolved, a refund enqueued) commits with it.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] when it is
    /// resolved already; other [`StoreError`]s when the database fails.
    #[allow(clippy::too_many_arguments)] // one audit row's columns, each named at the call
    pub async fn resolve(
        &self,
        tx: &mut Tx,
        id: &str,
        action: &str,
        actor: &str,
        reason: &str,
        detail: &str,
        now_ms: i64,
    ) -> Result<Discrepancy, StoreError> {
        let columns = self.columns();
        let lock = if self.db.backend().supports_row_locks() {
            " FOR UPDATE"
        } else {
            ""
        };
        let current: Discrepancy = tx
            .fetch_optional(
                query(format!(
                    "SELECT {columns} FROM oncely_discrepancies WHERE id = $1{lock}"
                ))
                .bind(id),
            )
            .await?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        if let Some(how) = &current.resolution {
            return Err(StoreError::Conflict(format!(
                "discrepancy {id} is resolved already ({how})"
            )));
        }
        tx.execute(
            query(
                "UPDATE oncely_discrepancies SET resolved_at = $1, resolution = $2, \
                 resolved_by = $3, open_slot = NULL WHERE id = $4",
            )
            .bind(now_ms)
            .bind(action)
            .bind(actor)
            .bind(id),
        )
        .await?;
        tx.execute(
            query(
                "INSERT INTO oncely_discrepancy_audit (discrepancy_id, at, actor, action, \
                 reason, detail) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(id)
            .bind(now_ms)
            .bind(actor)
            .bind(action)
            .bind(reason)
            .bind(detail),
        )
        .await?;
        tx.fetch_one(
            query(format!(
                "SELECT {columns} FROM oncely_discrepancies WHERE id = $1"
            ))
            .bind(id),
        )
        .await
    }

    /// The audit rows of discrepancy `id`, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn audit_trail(&self, id: &str) -> Result<Vec<DiscrepancyAudit>, StoreError> {
        self.db
            .fetch_all(
                query(
                    "SELECT at, actor, action, reason, detail FROM oncely_discrepancy_audit \
                     WHERE discrepancy_id = $1 ORDER BY id",
                )
                .bind(id),
            )
            .await
    }
}

/// Effect queries reconciliation needs.
impl EffectStore {
    fn effect_columns(&self) -> &'static str {
        fn of<S: EffectsBackend>(_: &S) -> &'static str {
            S::COLUMNS
        }
        with_store!(self.database(), |s| of(s))
    }

    /// The effects of `provider`'s `operation` created at or after `since_ms` (Unix ms),
    /// oldest first, in any state.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn created_since(
        &self,
        provider: &str,
        operation: &str,
        since_ms: i64,
    ) -> Result<Vec<Effect>, StoreError> {
        self.database()
            .fetch_all(
                query(created_since_sql(self.effect_columns()))
                    .bind(provider)
                    .bind(operation)
                    .bind(since_ms),
            )
            .await
    }

    /// Leases one `unknown` effect `id` for `runner` for `lease`, as a runner's claim does
    /// (its lease version raised, so a runner that held it before is fenced off) — unless a
    /// runner holds it now. Reconciliation settles what it found under this lease
    /// ([`EffectStore::settle`]). `None` when the effect is not `unknown` or is leased.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn lease_unknown(
        &self,
        id: &str,
        runner: &str,
        lease: Duration,
        now_ms: i64,
    ) -> Result<Option<Effect>, StoreError> {
        let mut tx = self.database().begin().await?;
        let effect = self
            .lease_unknown_in(&mut tx, id, runner, lease, now_ms)
            .await?;
        tx.commit().await?;
        Ok(effect)
    }

    /// [`EffectStore::lease_unknown`] in the caller's `tx`: the lease and what the caller
    /// settles under it commit together, or — a crash, a rollback — neither does, so no
    /// lease outlives its holder (a provider's pushed event is applied this way).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn lease_unknown_in(
        &self,
        tx: &mut Tx,
        id: &str,
        runner: &str,
        lease: Duration,
        now_ms: i64,
    ) -> Result<Option<Effect>, StoreError> {
        let until = oncely_core::ms_after(now_ms, lease);
        let n = tx
            .execute(
                query(
                    "UPDATE oncely_effects SET locked_by = $1, locked_until = $2, \
                     lease_version = lease_version + 1 WHERE id = $3 AND state = $4 \
                     AND (locked_until IS NULL OR locked_until < $5)",
                )
                .bind(runner)
                .bind(until)
                .bind(id)
                .bind(EffectState::Unknown.as_str())
                .bind(now_ms),
            )
            .await?;
        if n == 0 {
            return Ok(None);
        }
        let columns = self.effect_columns();
        tx.fetch_optional(
            query(format!(
                "SELECT {columns} FROM oncely_effects WHERE id = $1"
            ))
            .bind(id),
        )
        .await
    }
}

/// The discrepancy store's per-backend half: the select list that decodes into
/// [`Discrepancy`] (MySQL reads its binary-collated columns back as text).
pub(crate) trait ReconcileBackend: Store {
    /// The select list of [`Discrepancy`] on this backend.
    const COLUMNS: &'static str = DISCREPANCY_COLUMNS;
}
