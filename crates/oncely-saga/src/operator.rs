//! What operators do with sagas (`oncely saga list|show|retry`): read them across tenants,
//! and put a parked step back to work, audited.

use oncely_sql::{Database, EffectStore, StoreError, Tx};

use crate::engine::Engine;
use crate::store::{self, AuditEntry, SagaRow, StepRow};
use crate::{Orchestrator, Phase, Saga, SagaError, SagaState, StepRecord, StepState};

/// The operator's read view of every tenant's sagas (no definitions needed).
#[derive(Debug, Clone)]
pub struct SagaOperator {
    db: Database,
}

/// One operator action on a saga, as audited (`oncely_saga_audit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaAudit {
    /// Unix ms.
    pub at: i64,
    /// Who did it (`--actor`).
    pub actor: String,
    /// What (`retry`).
    pub action: String,
    /// The saga's state before.
    pub from: String,
    /// The saga's state after.
    pub to: String,
    /// The step acted on.
    pub step: String,
    /// What was done, in words.
    pub detail: String,
}

/// A saga step parked in `needs_review`, with its saga's kind and tenant
/// ([`SagaOperator::steps_in_review`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StepInReview {
    /// The saga's id.
    pub saga_id: String,
    /// The saga's kind (its definition's name).
    pub kind: String,
    /// The saga's tenant.
    pub tenant: String,
    /// The step's index in the definition (0-based).
    pub step: i64,
    /// `forward` or `compensate`, as stored.
    pub phase: String,
    /// The step's name.
    pub name: String,
    /// How many times the step ran.
    pub attempts: i64,
    /// The effect the step waits on, when it has one.
    pub effect_id: Option<String>,
}

/// What [`Orchestrator::retry`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Retried {
    /// The saga as it is now.
    pub saga: Saga,
    /// The step put back to work.
    pub step: String,
    /// Its forward run or its compensation.
    pub phase: Phase,
    /// What was done, in words (also in the audit row).
    pub detail: String,
}

impl SagaOperator {
    /// The view over `db` (migrated with `Database::migrate`).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// Up to `limit` sagas of every tenant (or of `tenant`), in `state` when given, newest
    /// first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn list(
        &self,
        tenant: Option<&str>,
        state: Option<SagaState>,
        limit: u32,
    ) -> Result<Vec<Saga>, StoreError> {
        store::list_any(&self.db, tenant, state, limit)
            .await?
            .into_iter()
            .map(SagaRow::into_saga)
            .collect()
    }

    /// Saga `id`, whatever its tenant.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is corrupt.
    pub async fn get(&self, id: &str) -> Result<Option<Saga>, StoreError> {
        store::get_any(&self.db, id)
            .await?
            .map(SagaRow::into_saga)
            .transpose()
    }

    /// The step log of saga `id`, in the order the steps started.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn steps(&self, id: &str) -> Result<Vec<StepRecord>, StoreError> {
        store::steps_any(&self.db, id)
            .await?
            .into_iter()
            .map(StepRow::into_record)
            .collect()
    }

    /// How many sagas of every tenant are in each state: `(state, count)`, by state, only
    /// states that have sagas.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn state_counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let mut by_state = std::collections::BTreeMap::<String, i64>::new();
        for (_, state, n) in store::counts(&self.db).await? {
            *by_state.entry(state).or_default() += n;
        }
        Ok(by_state.into_iter().collect())
    }

    /// How many steps of every tenant's sagas are in `needs_review`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn steps_in_review_count(&self) -> Result<i64, StoreError> {
        Ok(store::review_counts(&self.db)
            .await?
            .iter()
            .map(|(_, n)| n)
            .sum())
    }

    /// Up to `limit` steps of every tenant's sagas in `needs_review`, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn steps_in_review(&self, limit: u32) -> Result<Vec<StepInReview>, StoreError> {
        store::steps_in_review(&self.db, limit).await
    }

    /// The sagas of every tenant whose input (as stored, JSON text) contains `text` — for
    /// an order's lineage, the sagas that name the order — oldest first. `%` and `_` in
    /// `text` match as SQL `LIKE` wildcards.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn input_containing(&self, text: &str) -> Result<Vec<Saga>, StoreError> {
        store::input_containing(&self.db, text)
            .await?
            .into_iter()
            .map(SagaRow::into_saga)
            .collect()
    }

    /// The operators' actions on saga `id`, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn audit(&self, id: &str) -> Result<Vec<SagaAudit>, StoreError> {
        Ok(store::audit_trail(&self.db, id)
            .await?
            .into_iter()
            .map(|r| SagaAudit {
                at: r.at,
                actor: r.actor,
                action: r.action,
                from: r.from_state,
                to: r.to_state,
                step: r.step,
                detail: r.detail,
            })
            .collect())
    }
}

/// The row a parked saga waits on: its newest `needs_review` row, else the forward row
/// at its cursor that a refusal failed (a retriable step refused before any effect).
fn parked(rows: &[StepRow], cursor: i64) -> Option<&StepRow> {
    rows.iter()
        .filter(|r| r.state == StepState::NeedsReview.as_str())
        .max_by_key(|r| (r.finished_at.unwrap_or(r.started_at), r.started_at))
        .or_else(|| {
            rows.iter().find(|r| {
                r.step == cursor
                    && r.phase == Phase::Forward.as_str()
                    && r.state == StepState::Failed.as_str()
            })
        })
}

impl SagaOperator {
    /// An operator's retry of saga `id` in `needs_review`, audited, by a process that is not
    /// the service (`oncely saga retry`): as [`Orchestrator::retry`], except that a local
    /// step is not run here — the retry is recorded on the saga and the service's
    /// orchestrator runs the step in its sweep ([`Orchestrator::rerun_due`]), with the
    /// service's definitions. A step with an effect needs no definition: its effect is put
    /// back to work here and the service's runner continues it.
    ///
    /// # Errors
    /// As [`Orchestrator::retry`].
    pub async fn retry(&self, id: &str, actor: &str) -> Result<Retried, SagaError> {
        retry(&self.db, None, id, actor).await
    }
}

impl Orchestrator {
    /// An operator's retry of saga `id` in `needs_review`, audited (`oncely_saga_audit`,
    /// and the effect's own audit): its parked step goes back to work in one transaction.
    ///
    /// - A step whose effect is `needs_review` or `unknown` (outcome not known): the effect
    ///   goes back to `unknown` and the runner asks the provider's status before anything
    ///   is sent; a `failed` effect (a refused compensation, a retriable step exhausted) is
    ///   sent again under its next key (`EffectStore::retry_in`). The step's row turns
    ///   `running` again (`timed_out` for a forward step that had timed out) and the saga
    ///   `running` (a forward step at its cursor, without a deadline now) or
    ///   `compensating`; the settle continues it as usual.
    /// - A local step (a compensation refused, a retriable local step refused): it runs
    ///   again here, in this transaction, from where the saga stood.
    ///
    /// # Errors
    /// [`SagaError::NotFound`], [`SagaError::NotInReview`], [`SagaError::NothingToRetry`];
    /// [`SagaError::UnknownKind`] when a local step must run and its definition is not
    /// registered here; [`SagaError::Store`] when the database fails or the effect is in
    /// a state that is not retried (nothing changed).
    pub async fn retry(&self, id: &str, actor: &str) -> Result<Retried, SagaError> {
        retry(&self.db, Some(self), id, actor).await
    }

    /// Runs the local steps operators asked to run again from outside the service
    /// ([`SagaOperator::retry`]), up to [`OrchestratorConfig::batch`](crate::OrchestratorConfig::batch),
    /// each in its own transaction that clears the request — a conditional update under
    /// the saga's claim, so of two orchestrators only one runs it. Returns how many ran.
    /// [`Orchestrator::run`] calls it every sweep.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (steps run before stay run).
    pub async fn rerun_due(&self) -> Result<usize, StoreError> {
        let kinds: Vec<&str> = self.definitions.keys().map(String::as_str).collect();
        let mut n = 0;
        for id in store::reruns_due(&self.db, &kinds, self.config.batch).await? {
            // One saga's failing step must not hold back the others: it is logged, its
            // request goes to the back of the queue, and the sweep goes on.
            match self.rerun_one(&id).await {
                Ok(ran) => n += usize::from(ran),
                Err(e) => {
                    tracing::warn!(saga = %id, error = %e, "a step an operator retried failed again");
                    store::defer_rerun(&self.db, &id, oncely_core::now_ms()).await?;
                }
            }
        }
        Ok(n)
    }

    /// Runs saga `id`'s requested rerun, if this transaction takes the request and the
    /// saga still waits on a parked local step: `true` when a step ran.
    async fn rerun_one(&self, id: &str) -> Result<bool, StoreError> {
        let now = oncely_core::now_ms();
        let mut tx = self.db.begin().await?;
        let Some(saga) = store::claim(&mut tx, id).await? else {
            return Ok(false);
        };
        if !store::take_rerun(&mut tx, id).await? {
            return Ok(false);
        }
        let rows = store::steps_in(&mut tx, id).await?;
        let parked = (saga.state()? == SagaState::NeedsReview)
            .then(|| parked(&rows, saga.step).cloned())
            .flatten()
            .filter(|row| row.effect_id.is_none());
        let mut ran = false;
        if let Some(row) = parked {
            let (saga, detail) = self
                .rerun_local(&mut tx, saga, &row, now)
                .await
                .map_err(|e| StoreError::Conflict(e.to_string()))?;
            tracing::info!(saga = %saga.id, %detail, "ran a step an operator retried");
            ran = true;
        }
        tx.commit().await?;
        Ok(ran)
    }
}

/// The retry both [`SagaOperator::retry`] (`orchestrator` `None`: a local step is recorded
/// for the service's orchestrator) and [`Orchestrator::retry`] (run here) make.
async fn retry(
    db: &Database,
    orchestrator: Option<&Orchestrator>,
    id: &str,
    actor: &str,
) -> Result<Retried, SagaError> {
    let now = oncely_core::now_ms();
    let mut tx = db.begin().await?;
    let saga = store::claim(&mut tx, id)
        .await?
        .ok_or_else(|| SagaError::NotFound(id.to_owned()))?;
    let from = saga.state()?;
    if from != SagaState::NeedsReview {
        return Err(SagaError::NotInReview {
            id: id.to_owned(),
            state: from,
        });
    }
    let rows = store::steps_in(&mut tx, id).await?;
    let row = parked(&rows, saga.step)
        .cloned()
        .ok_or_else(|| SagaError::NothingToRetry(id.to_owned()))?;
    if orchestrator.is_some() || row.effect_id.is_some() {
        // Retried now: an earlier request recorded for the service's orchestrator is
        // spent, or it would run whatever step the saga parks at next.
        store::take_rerun(&mut tx, id).await?;
    }
    let (saga, detail) = match (row.effect_id.clone(), orchestrator) {
        (Some(effect), _) => retry_effect(db, &mut tx, saga, &row, &effect, actor, now).await?,
        (None, Some(o)) => o.rerun_local(&mut tx, saga, &row, now).await?,
        (None, None) => {
            store::request_rerun(&mut tx, id, now).await?;
            let detail = format!(
                "{} {}: run again by the service's orchestrator",
                row.name, row.phase
            );
            (saga, detail)
        }
    };
    let to = saga.state()?;
    let entry = AuditEntry {
        saga: id,
        at: now,
        actor,
        action: "retry",
        from,
        to,
        step: &row.name,
        detail: &detail,
    };
    store::audit(&mut tx, &entry).await?;
    tx.commit().await?;
    Ok(Retried {
        saga: saga.into_saga()?,
        step: row.name,
        phase: Phase::parse(&row.phase).map_err(StoreError::from)?,
        detail,
    })
}

/// The parked step's effect retried, its row and the saga put back to wait for it.
async fn retry_effect(
    db: &Database,
    tx: &mut Tx,
    mut saga: SagaRow,
    row: &StepRow,
    effect_id: &str,
    actor: &str,
    now: i64,
) -> Result<(SagaRow, String), SagaError> {
    let effects = EffectStore::new(db.clone());
    let next = |e: &oncely_sql::Effect| oncely_effects::next_key(&e.key, e.key_generation + 1);
    let (was, is) = effects.retry_in(tx, effect_id, next, actor, now).await?;
    let forward = row.phase == Phase::Forward.as_str();
    let (step_state, saga_state) = if forward && row.step == saga.step {
        (StepState::Running, SagaState::Running)
    } else if forward {
        (StepState::TimedOut, SagaState::Compensating)
    } else {
        (StepState::Running, SagaState::Compensating)
    };
    let note = format!("retried by {actor}: effect {was} -> {is}");
    store::reopen_step(tx, row, step_state, &note).await?;
    saga_state.as_str().clone_into(&mut saga.state);
    if saga_state == SagaState::Running {
        saga.error = None;
    }
    saga.deadline = None;
    store::save(tx, &mut saga, now).await?;
    let detail = format!(
        "{} {}: effect {effect_id} {was} -> {is}; step {step_state}",
        row.name, row.phase
    );
    Ok((saga, detail))
}

impl Orchestrator {
    /// The parked local step's row removed and the step run again from where the saga
    /// stood.
    async fn rerun_local(
        &self,
        tx: &mut Tx,
        mut saga: SagaRow,
        row: &StepRow,
        now: i64,
    ) -> Result<(SagaRow, String), SagaError> {
        let def = self
            .definitions
            .get(&saga.kind)
            .ok_or_else(|| SagaError::UnknownKind(saga.kind.clone()))?;
        store::delete_step(tx, row).await?;
        let forward = row.phase == Phase::Forward.as_str();
        saga.step = row.step;
        saga.deadline = None;
        let mut engine = Engine { tx, saga, def, now };
        if forward {
            engine.saga.error = None;
            engine.set_state(SagaState::Running);
            engine.forward().await?;
        } else {
            engine.set_state(SagaState::Compensating);
            engine.compensate().await?;
        }
        let detail = format!(
            "{} {}: run again; saga {}",
            row.name, row.phase, engine.saga.state
        );
        Ok((engine.saga, detail))
    }
}
