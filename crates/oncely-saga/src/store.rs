//! The saga tables' SQL (`oncely_sagas`, `oncely_saga_steps`, migration 0024).
//!
//! Every statement here is portable — plain `SELECT`/`INSERT`/`UPDATE` with `$1, $2, …`
//! in order, no `RETURNING`, no `ON CONFLICT` beyond [`Tx::insert_ignoring_duplicate`],
//! no row locks — so it goes through `oncely_sql`'s portable [`query`] API instead of a
//! per-backend module in `oncely-sql`. The one backend difference, MySQL decoding its
//! binary-collated `tenant` column as bytes, is [`oncely_sql::Backend::text_column`]'s.
//! Concurrency rests on the version column alone: [`claim`] is the only way to a saga row
//! one may change (`UPDATE … SET version = version + 1 WHERE id = $1 AND version = $2`);
//! the row lock that `UPDATE` takes (PostgreSQL, MySQL) or the single writer (SQLite) then
//! keeps the saga this transaction's until it ends.

use oncely_sql::{query, Backend, Database, StoreError, Tx};

use crate::{Phase, Saga, SagaState, StepRecord, StepState};

/// A saga row as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct SagaRow {
    pub(crate) id: String,
    pub(crate) tenant: String,
    pub(crate) kind: String,
    pub(crate) state: String,
    pub(crate) version: i64,
    pub(crate) step: i64,
    pub(crate) input: String,
    pub(crate) error: Option<String>,
    pub(crate) deadline: Option<i64>,
    pub(crate) created_at: i64,
    pub(crate) updated_at: i64,
}

impl SagaRow {
    pub(crate) fn state(&self) -> Result<SagaState, StoreError> {
        Ok(SagaState::parse(&self.state)?)
    }

    pub(crate) fn into_saga(self) -> Result<Saga, StoreError> {
        let input = serde_json::from_str(&self.input)
            .map_err(|e| StoreError::Corrupt(format!("saga {} input: {e}", self.id)))?;
        Ok(Saga {
            state: SagaState::parse(&self.state)?,
            id: self.id,
            tenant: self.tenant,
            kind: self.kind,
            version: self.version,
            step: self.step,
            input,
            error: self.error,
            deadline: self.deadline,
            created_at: self.created_at,
            updated_at: self.updated_at,
        })
    }
}

/// A step-log row as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct StepRow {
    pub(crate) saga_id: String,
    pub(crate) step: i64,
    pub(crate) phase: String,
    pub(crate) name: String,
    pub(crate) state: String,
    pub(crate) attempts: i64,
    pub(crate) effect_id: Option<String>,
    pub(crate) started_at: i64,
    pub(crate) finished_at: Option<i64>,
    pub(crate) output: Option<String>,
    pub(crate) evidence: Option<String>,
}

impl StepRow {
    pub(crate) fn state(&self) -> Result<StepState, StoreError> {
        Ok(StepState::parse(&self.state)?)
    }

    pub(crate) fn into_record(self) -> Result<StepRecord, StoreError> {
        let output = self
            .output
            .as_deref()
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| StoreError::Corrupt(format!("saga {} step output: {e}", self.saga_id)))?;
        Ok(StepRecord {
            state: StepState::parse(&self.state)?,
            phase: Phase::parse(&self.phase)?,
            saga_id: self.saga_id,
            step: self.step,
            name: self.name,
            attempts: self.attempts,
            effect_id: self.effect_id,
            started_at: self.started_at,
            finished_at: self.finished_at,
            output,
            evidence: self.evidence,
        })
    }
}

fn saga_columns(backend: Backend) -> String {
    format!(
        "id, {}, kind, state, version, step, input, error, deadline, created_at, updated_at",
        backend.text_column("tenant")
    )
}

const STEP_COLUMNS: &str = "saga_id, step, phase, name, state, attempts, effect_id, started_at, \
    finished_at, output, evidence";

/// A new saga's fields.
pub(crate) struct NewRow<'a> {
    pub(crate) id: &'a str,
    pub(crate) tenant: &'a str,
    pub(crate) kind: &'a str,
    pub(crate) input: &'a str,
    pub(crate) now: i64,
}

/// Inserts a `running` saga at step 0, version 0; `false` when the id exists.
pub(crate) async fn insert_saga(tx: &mut Tx, new: &NewRow<'_>) -> Result<bool, StoreError> {
    tx.insert_ignoring_duplicate(
        query(
            "INSERT INTO oncely_sagas (id, tenant, kind, state, version, step, input, \
             created_at, updated_at) VALUES ($1, $2, $3, 'running', 0, 0, $4, $5, $6)",
        )
        .bind(new.id)
        .bind(new.tenant)
        .bind(new.kind)
        .bind(new.input)
        .bind(new.now)
        .bind(new.now),
        "(id)",
    )
    .await
}

/// Inserts a saga cancelled before it started: `compensated` with nothing run, cursor
/// -1, `error` its reason; `false` when the id exists.
pub(crate) async fn insert_cancelled(
    tx: &mut Tx,
    new: &NewRow<'_>,
    reason: &str,
) -> Result<bool, StoreError> {
    tx.insert_ignoring_duplicate(
        query(
            "INSERT INTO oncely_sagas (id, tenant, kind, state, version, step, input, error, \
             created_at, updated_at) VALUES ($1, $2, $3, 'compensated', 0, -1, $4, $5, $6, $7)",
        )
        .bind(new.id)
        .bind(new.tenant)
        .bind(new.kind)
        .bind(new.input)
        .bind(reason)
        .bind(new.now)
        .bind(new.now),
        "(id)",
    )
    .await
}

async fn read_saga(tx: &mut Tx, id: &str) -> Result<Option<SagaRow>, StoreError> {
    let columns = saga_columns(tx.backend());
    tx.fetch_optional(query(format!("SELECT {columns} FROM oncely_sagas WHERE id = $1")).bind(id))
        .await
}

/// How many times [`claim`] reads and tries again after another transaction moved the
/// saga on between its read and its update.
const CLAIM_TRIES: usize = 8;

/// Makes saga `id` this transaction's: reads it, then raises its version naming the
/// version read. When another transaction changed it in between (0 rows), reads again —
/// on PostgreSQL and MySQL the update waited for that transaction to end, so the next read
/// sees what it did. Returns the row as now held (its version raised), `None` when there
/// is no such saga.
///
/// # Errors
/// [`StoreError::Conflict`] after [`CLAIM_TRIES`] lost races; other [`StoreError`]s when
/// the database fails.
pub(crate) async fn claim(tx: &mut Tx, id: &str) -> Result<Option<SagaRow>, StoreError> {
    for _ in 0..CLAIM_TRIES {
        let Some(mut row) = read_saga(tx, id).await? else {
            return Ok(None);
        };
        let n = tx
            .execute(
                query(
                    "UPDATE oncely_sagas SET version = version + 1 WHERE id = $1 AND version = $2",
                )
                .bind(id)
                .bind(row.version),
            )
            .await?;
        if n == 1 {
            row.version += 1;
            return Ok(Some(row));
        }
    }
    Err(StoreError::Conflict(format!(
        "saga {id} changed under {CLAIM_TRIES} continuations in a row"
    )))
}

/// Writes the held saga's state, cursor, error and deadline, naming the version held
/// (and raising it).
///
/// # Errors
/// [`StoreError::Conflict`] when the version is not the one held (a defect: only
/// [`claim`]ed rows are saved).
pub(crate) async fn save(tx: &mut Tx, row: &mut SagaRow, now: i64) -> Result<(), StoreError> {
    let n = tx
        .execute(
            query(
                "UPDATE oncely_sagas SET state = $1, step = $2, error = $3, \
                 deadline = NULLIF($4, 0), version = version + 1, updated_at = $5 \
                 WHERE id = $6 AND version = $7",
            )
            .bind(row.state.as_str())
            .bind(row.step)
            .bind(row.error.as_deref())
            .bind(row.deadline.unwrap_or(0))
            .bind(now)
            .bind(row.id.as_str())
            .bind(row.version),
        )
        .await?;
    if n != 1 {
        return Err(StoreError::Conflict(format!(
            "saga {} is no longer at version {}",
            row.id, row.version
        )));
    }
    row.version += 1;
    row.updated_at = now;
    Ok(())
}

/// Step `step` of `saga` in `phase`, if it was started.
pub(crate) async fn step(
    tx: &mut Tx,
    saga: &str,
    step: i64,
    phase: Phase,
) -> Result<Option<StepRow>, StoreError> {
    tx.fetch_optional(
        query(format!(
            "SELECT {STEP_COLUMNS} FROM oncely_saga_steps \
             WHERE saga_id = $1 AND step = $2 AND phase = $3"
        ))
        .bind(saga)
        .bind(step)
        .bind(phase.as_str()),
    )
    .await
}

/// The saga step whose effect is `effect_id`: `(saga id, step, phase)`.
pub(crate) async fn step_of_effect(
    tx: &mut Tx,
    effect_id: &str,
) -> Result<Option<(String, i64, String)>, StoreError> {
    tx.fetch_optional(
        query("SELECT saga_id, step, phase FROM oncely_saga_steps WHERE effect_id = $1")
            .bind(effect_id),
    )
    .await
}

/// A step that starts: its log row, `running`.
pub(crate) struct NewStep<'a> {
    pub(crate) saga: &'a str,
    pub(crate) step: i64,
    pub(crate) phase: Phase,
    pub(crate) name: &'a str,
    pub(crate) effect_id: Option<&'a str>,
    pub(crate) now: i64,
}

pub(crate) async fn insert_step(tx: &mut Tx, s: &NewStep<'_>) -> Result<(), StoreError> {
    tx.execute(
        query(
            "INSERT INTO oncely_saga_steps (saga_id, step, phase, name, state, attempts, \
             effect_id, started_at) VALUES ($1, $2, $3, $4, 'running', 1, $5, $6)",
        )
        .bind(s.saga)
        .bind(s.step)
        .bind(s.phase.as_str())
        .bind(s.name)
        .bind(s.effect_id)
        .bind(s.now),
    )
    .await?;
    Ok(())
}

/// A retriable step issued again: one more attempt, under a new effect.
pub(crate) async fn reissue_step(
    tx: &mut Tx,
    saga: &str,
    step: i64,
    effect_id: &str,
    evidence: &str,
) -> Result<(), StoreError> {
    tx.execute(
        query(
            "UPDATE oncely_saga_steps SET state = 'running', attempts = attempts + 1, \
             effect_id = $1, evidence = $2, finished_at = NULL \
             WHERE saga_id = $3 AND step = $4 AND phase = 'forward'",
        )
        .bind(effect_id)
        .bind(evidence)
        .bind(saga)
        .bind(step),
    )
    .await?;
    Ok(())
}

/// How a step ended.
pub(crate) struct Finish<'a> {
    pub(crate) state: StepState,
    pub(crate) output: Option<&'a str>,
    pub(crate) evidence: Option<&'a str>,
    pub(crate) now: i64,
}

pub(crate) async fn finish_step(
    tx: &mut Tx,
    saga: &str,
    step: i64,
    phase: Phase,
    f: &Finish<'_>,
) -> Result<(), StoreError> {
    tx.execute(
        query(
            "UPDATE oncely_saga_steps SET state = $1, output = $2, evidence = $3, \
             finished_at = $4 WHERE saga_id = $5 AND step = $6 AND phase = $7",
        )
        .bind(f.state.as_str())
        .bind(f.output)
        .bind(f.evidence)
        .bind(f.now)
        .bind(saga)
        .bind(step)
        .bind(phase.as_str()),
    )
    .await?;
    Ok(())
}

/// The outputs of the saga's succeeded forward steps: `(name, output JSON text)`.
pub(crate) async fn outputs(tx: &mut Tx, saga: &str) -> Result<Vec<(String, String)>, StoreError> {
    tx.fetch_all(
        query(
            "SELECT name, output FROM oncely_saga_steps WHERE saga_id = $1 \
             AND phase = 'forward' AND state = 'succeeded' AND output IS NOT NULL",
        )
        .bind(saga),
    )
    .await
}

/// Work of a compensating saga still open: forward steps that timed out and have not
/// settled, and compensations in flight.
pub(crate) async fn outstanding(tx: &mut Tx, saga: &str) -> Result<i64, StoreError> {
    let (n,): (i64,) = tx
        .fetch_one(
            query(
                "SELECT COUNT(*) FROM oncely_saga_steps WHERE saga_id = $1 AND \
                 ((phase = 'forward' AND state = 'timed_out') OR \
                  (phase = 'compensate' AND state = 'running'))",
            )
            .bind(saga),
        )
        .await?;
    Ok(n)
}

/// Moves the effect `id`'s next attempt to `at` (Unix ms): a retriable step's backoff.
pub(crate) async fn delay_effect(tx: &mut Tx, id: &str, at: i64) -> Result<(), StoreError> {
    tx.execute(
        query("UPDATE oncely_effects SET available_at = $1 WHERE id = $2")
            .bind(at)
            .bind(id),
    )
    .await?;
    Ok(())
}

/// The ids of up to `$2` running sagas whose step deadline is at or before `$1`, read from
/// the partial index `oncely_sagas_deadline` in deadline order, pinned on SQLite: without
/// statistics SQLite read every running saga from `oncely_sagas_state (state, kind)` and
/// sorted them (`USE TEMP B-TREE FOR ORDER BY`).
pub(crate) fn due_sql(backend: Backend) -> String {
    format!(
        "SELECT id FROM oncely_sagas{} WHERE state = 'running' AND deadline IS NOT NULL \
         AND deadline <= $1 ORDER BY deadline LIMIT $2",
        backend.indexed_by("oncely_sagas_deadline")
    )
}

/// Ids of up to `limit` running sagas whose step deadline is at or before `now`.
pub(crate) async fn due(db: &Database, now: i64, limit: u32) -> Result<Vec<String>, StoreError> {
    let rows: Vec<(String,)> = db
        .fetch_all(
            query(due_sql(db.backend()))
                .bind(now)
                .bind(i64::from(limit)),
        )
        .await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// Records in `tx` that saga `id`'s parked local step is to run again by the service's
/// orchestrator (an operator's retry from outside the service), at `now` (Unix ms).
pub(crate) async fn request_rerun(tx: &mut Tx, id: &str, now: i64) -> Result<(), StoreError> {
    tx.execute(
        query("UPDATE oncely_sagas SET rerun_at = $1 WHERE id = $2")
            .bind(now)
            .bind(id),
    )
    .await?;
    Ok(())
}

/// Clears saga `id`'s rerun request in `tx`: `true` when this transaction took it.
pub(crate) async fn take_rerun(tx: &mut Tx, id: &str) -> Result<bool, StoreError> {
    let n = tx
        .execute(
            query("UPDATE oncely_sagas SET rerun_at = NULL WHERE id = $1 AND rerun_at IS NOT NULL")
                .bind(id),
        )
        .await?;
    Ok(n == 1)
}

/// Ids of up to `limit` sagas of one of `kinds` (the orchestrator's definitions) with a
/// rerun request, oldest request first. A kind another service defines is left to it.
pub(crate) async fn reruns_due(
    db: &Database,
    kinds: &[&str],
    limit: u32,
) -> Result<Vec<String>, StoreError> {
    if kinds.is_empty() {
        return Ok(Vec::new());
    }
    // Placeholders in text order, as the portable query API wants them.
    let list: Vec<String> = (1..=kinds.len()).map(|i| format!("${i}")).collect();
    let sql = format!(
        "SELECT id FROM oncely_sagas WHERE rerun_at IS NOT NULL AND kind IN ({}) \
         ORDER BY rerun_at LIMIT ${}",
        list.join(", "),
        kinds.len() + 1
    );
    let mut q = query(sql);
    for kind in kinds {
        q = q.bind(*kind);
    }
    let q = q.bind(i64::from(limit.max(1)));
    let rows: Vec<(String,)> = db.fetch_all(q).await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// Puts saga `id`'s rerun request, whose step failed, behind the others: its time becomes
/// `now` (Unix ms). A request already taken stays taken.
pub(crate) async fn defer_rerun(db: &Database, id: &str, now: i64) -> Result<(), StoreError> {
    db.execute(
        query("UPDATE oncely_sagas SET rerun_at = $1 WHERE id = $2 AND rerun_at IS NOT NULL")
            .bind(now)
            .bind(id),
    )
    .await?;
    Ok(())
}

/// Saga `id` of `tenant`.
pub(crate) async fn get(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Option<SagaRow>, StoreError> {
    let columns = saga_columns(db.backend());
    db.fetch_optional(
        query(format!(
            "SELECT {columns} FROM oncely_sagas WHERE tenant = $1 AND id = $2"
        ))
        .bind(tenant)
        .bind(id),
    )
    .await
}

/// The step log of saga `id` of `tenant`, in the order the steps started.
pub(crate) async fn steps(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Vec<StepRow>, StoreError> {
    db.fetch_all(
        query(format!(
            "SELECT {STEP_COLUMNS} FROM oncely_saga_steps WHERE saga_id = $1 AND saga_id IN \
             (SELECT id FROM oncely_sagas WHERE tenant = $2) ORDER BY started_at, step, phase"
        ))
        .bind(id)
        .bind(tenant),
    )
    .await
}

/// Up to `limit` sagas of `tenant`, in `state` when given, newest first.
pub(crate) async fn list(
    db: &Database,
    tenant: &str,
    state: Option<SagaState>,
    limit: u32,
) -> Result<Vec<SagaRow>, StoreError> {
    let columns = saga_columns(db.backend());
    let q = match state {
        Some(s) => query(format!(
            "SELECT {columns} FROM oncely_sagas WHERE tenant = $1 AND state = $2 \
             ORDER BY created_at DESC, id DESC LIMIT $3"
        ))
        .bind(tenant)
        .bind(s.as_str()),
        None => query(format!(
            "SELECT {columns} FROM oncely_sagas WHERE tenant = $1 \
             ORDER BY created_at DESC, id DESC LIMIT $2"
        ))
        .bind(tenant),
    };
    db.fetch_all(q.bind(i64::from(limit))).await
}

/// Sagas per kind and state.
pub(crate) async fn counts(db: &Database) -> Result<Vec<(String, String, i64)>, StoreError> {
    db.fetch_all(query(
        "SELECT kind, state, COUNT(*) FROM oncely_sagas GROUP BY kind, state ORDER BY kind, state",
    ))
    .await
}

/// Steps in `needs_review`, per saga kind.
pub(crate) async fn review_counts(db: &Database) -> Result<Vec<(String, i64)>, StoreError> {
    db.fetch_all(query(
        "SELECT s.kind, COUNT(*) FROM oncely_saga_steps t JOIN oncely_sagas s ON s.id = t.saga_id \
         WHERE t.state = 'needs_review' GROUP BY s.kind ORDER BY s.kind",
    ))
    .await
}

/// Up to `limit` steps in `needs_review` of every tenant, oldest first, each with its
/// saga's kind and tenant.
pub(crate) async fn steps_in_review(
    db: &Database,
    limit: u32,
) -> Result<Vec<crate::StepInReview>, StoreError> {
    db.fetch_all(
        query(format!(
            "SELECT saga_id, kind, {}, step, phase, name, attempts, effect_id FROM \
             (SELECT t.saga_id AS saga_id, s.kind AS kind, s.tenant AS tenant, t.step AS step, \
             t.phase AS phase, t.name AS name, t.attempts AS attempts, \
             t.effect_id AS effect_id, t.started_at AS started_at \
             FROM oncely_saga_steps t JOIN oncely_sagas s ON s.id = t.saga_id \
             WHERE t.state = 'needs_review') r ORDER BY started_at LIMIT $1",
            db.backend().text_column("tenant")
        ))
        .bind(i64::from(limit)),
    )
    .await
}

/// Sagas of every tenant whose input's JSON text contains `text`, oldest first.
pub(crate) async fn input_containing(
    db: &Database,
    text: &str,
) -> Result<Vec<SagaRow>, StoreError> {
    let columns = saga_columns(db.backend());
    db.fetch_all(
        query(format!(
            "SELECT {columns} FROM oncely_sagas WHERE input LIKE $1 ORDER BY created_at"
        ))
        .bind(format!("%{text}%")),
    )
    .await
}

/// Up to `limit` sagas of every tenant (or of `tenant`), in `state` when given, newest
/// first: the operator's list.
pub(crate) async fn list_any(
    db: &Database,
    tenant: Option<&str>,
    state: Option<SagaState>,
    limit: u32,
) -> Result<Vec<SagaRow>, StoreError> {
    let columns = saga_columns(db.backend());
    let mut filters = Vec::new();
    let mut n = 0;
    let mut next = || {
        n += 1;
        n
    };
    if tenant.is_some() {
        filters.push(format!("tenant = ${}", next()));
    }
    if state.is_some() {
        filters.push(format!("state = ${}", next()));
    }
    let filter = if filters.is_empty() {
        String::new()
    } else {
        format!("WHERE {} ", filters.join(" AND "))
    };
    let limit_at = next();
    let mut q = query(format!(
        "SELECT {columns} FROM oncely_sagas {filter}ORDER BY created_at DESC, id DESC \
         LIMIT ${limit_at}"
    ));
    if let Some(t) = tenant {
        q = q.bind(t);
    }
    if let Some(s) = state {
        q = q.bind(s.as_str());
    }
    db.fetch_all(q.bind(i64::from(limit))).await
}

/// Saga `id`, whatever its tenant (operators).
pub(crate) async fn get_any(db: &Database, id: &str) -> Result<Option<SagaRow>, StoreError> {
    let columns = saga_columns(db.backend());
    db.fetch_optional(query(format!("SELECT {columns} FROM oncely_sagas WHERE id = $1")).bind(id))
        .await
}

/// The step log of saga `id` in `tx`, in the order the steps started.
pub(crate) async fn steps_in(tx: &mut Tx, id: &str) -> Result<Vec<StepRow>, StoreError> {
    tx.fetch_all(
        query(format!(
            "SELECT {STEP_COLUMNS} FROM oncely_saga_steps WHERE saga_id = $1 \
             ORDER BY started_at, step, phase"
        ))
        .bind(id),
    )
    .await
}

/// The step log of saga `id`, whatever its tenant (operators).
pub(crate) async fn steps_any(db: &Database, id: &str) -> Result<Vec<StepRow>, StoreError> {
    db.fetch_all(
        query(format!(
            "SELECT {STEP_COLUMNS} FROM oncely_saga_steps WHERE saga_id = $1 \
             ORDER BY started_at, step, phase"
        ))
        .bind(id),
    )
    .await
}

/// Puts a parked step-log row back to `state` (`running`, or `timed_out` for a forward
/// step that timed out), its end cleared, the operator's retry noted in its evidence.
pub(crate) async fn reopen_step(
    tx: &mut Tx,
    row: &StepRow,
    state: StepState,
    note: &str,
) -> Result<(), StoreError> {
    let evidence = match &row.evidence {
        Some(e) => format!("{e}; {note}"),
        None => note.to_owned(),
    };
    tx.execute(
        query(
            "UPDATE oncely_saga_steps SET state = $1, finished_at = NULL, evidence = $2 \
             WHERE saga_id = $3 AND step = $4 AND phase = $5",
        )
        .bind(state.as_str())
        .bind(evidence)
        .bind(row.saga_id.as_str())
        .bind(row.step)
        .bind(row.phase.as_str()),
    )
    .await?;
    Ok(())
}

/// Deletes a local step's parked row, so the engine runs the step again.
pub(crate) async fn delete_step(tx: &mut Tx, row: &StepRow) -> Result<(), StoreError> {
    tx.execute(
        query("DELETE FROM oncely_saga_steps WHERE saga_id = $1 AND step = $2 AND phase = $3")
            .bind(row.saga_id.as_str())
            .bind(row.step)
            .bind(row.phase.as_str()),
    )
    .await?;
    Ok(())
}

/// One operator action on a saga.
pub(crate) struct AuditEntry<'a> {
    pub(crate) saga: &'a str,
    pub(crate) at: i64,
    pub(crate) actor: &'a str,
    pub(crate) action: &'a str,
    pub(crate) from: SagaState,
    pub(crate) to: SagaState,
    pub(crate) step: &'a str,
    pub(crate) detail: &'a str,
}

pub(crate) async fn audit(tx: &mut Tx, a: &AuditEntry<'_>) -> Result<(), StoreError> {
    tx.execute(
        query(
            "INSERT INTO oncely_saga_audit (saga_id, at, actor, action, from_state, to_state, \
             step, detail) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(a.saga)
        .bind(a.at)
        .bind(a.actor)
        .bind(a.action)
        .bind(a.from.as_str())
        .bind(a.to.as_str())
        .bind(a.step)
        .bind(a.detail),
    )
    .await?;
    Ok(())
}

/// The audit rows of saga `id`, oldest first.
pub(crate) async fn audit_trail(db: &Database, id: &str) -> Result<Vec<AuditRow>, StoreError> {
    db.fetch_all(
        query(
            "SELECT at, actor, action, from_state, to_state, step, detail \
             FROM oncely_saga_audit WHERE saga_id = $1 ORDER BY id",
        )
        .bind(id),
    )
    .await
}

/// An audit row as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct AuditRow {
    pub(crate) at: i64,
    pub(crate) actor: String,
    pub(crate) action: String,
    pub(crate) from_state: String,
    pub(crate) to_state: String,
    pub(crate) step: String,
    pub(crate) detail: String,
}
