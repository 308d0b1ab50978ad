//! The state machine over one saga this transaction holds ([`store::claim`]): going
//! forward, compensating newest first, a settled effect's continuation, a step's timeout.
//! Every change is written with the version held, so each of these runs once per
//! transition however many transactions try it.

use std::collections::BTreeMap;

use oncely_core::{IdempotencyKey, Operation, Scope, TenantId};
use oncely_sql::{EffectStore, Enqueued, NewEffect, StoreError, Tx};
use serde_json::Value;

use crate::definition::{Action, EffectStep, Role, SagaDefinition, Step};
use crate::metrics as metric;
use crate::store::{self, Finish, NewStep, SagaRow};
use crate::{Cancelled, Phase, SagaState, StepContext, StepError, StepState};

/// How a step's effect settled, as the engine needs it.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// The provider's object (its answer, with its `id`).
    Succeeded(Value),
    /// Refused for good.
    Failed(String),
    /// The effect runner could not determine the outcome.
    NeedsReview(String),
}

/// What running an action did.
enum Ran {
    /// A local write succeeded, with its output.
    Done(Value),
    /// An effect was recorded; the step waits for it.
    Issued,
    /// A definitive refusal.
    Refused(String),
}

/// Step `i` of `def` (for saga `saga`).
fn step_at<'d>(def: &'d SagaDefinition, saga: &str, i: i64) -> Result<&'d Step, StoreError> {
    usize::try_from(i)
        .ok()
        .and_then(|i| def.steps.get(i))
        .ok_or_else(|| {
            StoreError::Corrupt(format!("saga {saga} of kind {} has no step {i}", def.kind))
        })
}

pub(crate) struct Engine<'t> {
    pub(crate) tx: &'t mut Tx,
    pub(crate) saga: SagaRow,
    pub(crate) def: &'t SagaDefinition,
    pub(crate) now: i64,
}

impl Engine<'_> {
    pub(crate) async fn save(&mut self) -> Result<(), StoreError> {
        // Every transition passes here, inside the transaction that also holds its cause
        // (the step's settled effect, an expiry, a cancel): a crash loses both together.
        oncely_core::failpoint::fail_point!("saga.before_save");
        store::save(self.tx, &mut self.saga, self.now).await
    }

    pub(crate) fn set_state(&mut self, state: SagaState) {
        state.as_str().clone_into(&mut self.saga.state);
    }

    async fn context(&mut self, step: &str, attempt: u32) -> Result<StepContext, StoreError> {
        let input = serde_json::from_str(&self.saga.input)
            .map_err(|e| StoreError::Corrupt(format!("saga {} input: {e}", self.saga.id)))?;
        let mut outputs = BTreeMap::new();
        for (name, text) in store::outputs(self.tx, &self.saga.id).await? {
            let v = serde_json::from_str(&text)
                .map_err(|e| StoreError::Corrupt(format!("saga {} output: {e}", self.saga.id)))?;
            outputs.insert(name, v);
        }
        Ok(StepContext {
            saga_id: self.saga.id.clone(),
            tenant: self.saga.tenant.clone(),
            kind: self.saga.kind.clone(),
            step: step.to_owned(),
            attempt,
            input,
            outputs,
        })
    }

    /// The effect key of `step` (`"{name}"` or `"{name}:compensate"`) at `generation`.
    fn key(&self, step: &str, generation: u32) -> Result<String, StoreError> {
        let tenant = TenantId::parse(&self.saga.tenant)
            .map_err(|e| StoreError::Corrupt(format!("saga {} tenant: {e}", self.saga.id)))?;
        let parent = IdempotencyKey::parse(self.saga.id.as_bytes())
            .map_err(|e| StoreError::Corrupt(format!("saga id {}: {e}", self.saga.id)))?;
        let scope = Scope::new(tenant, Operation::new("SAGA", &self.saga.kind));
        Ok(oncely_effects::derive_key(
            &scope, &parent, step, generation,
        ))
    }

    /// Records `effect`'s intent in this transaction; returns its id, or the refusal when
    /// its parameters cannot be built.
    async fn enqueue(
        &mut self,
        effect: &EffectStep,
        ctx: &StepContext,
        reference: &str,
        key: &str,
    ) -> Result<Result<String, String>, StoreError> {
        let params = match (effect.params)(ctx) {
            Ok(p) => p,
            Err(StepError::Refused(r)) => return Ok(Err(r)),
            Err(StepError::Store(e)) => return Err(e),
        };
        let new = NewEffect {
            tenant: &self.saga.tenant,
            provider: &effect.provider,
            operation: &effect.operation,
            reference,
            key,
            request: &params,
        };
        match EffectStore::enqueue(self.tx, &new, self.now).await? {
            Enqueued::Created(id) => Ok(Ok(id)),
            _ => Err(StoreError::Conflict(format!(
                "an effect {} {} for {reference} exists already",
                effect.provider, effect.operation
            ))),
        }
    }

    fn reference(&self, step: &str, attempt: u32) -> String {
        if attempt <= 1 {
            format!("{}:{step}", self.saga.id)
        } else {
            format!("{}:{step}#{attempt}", self.saga.id)
        }
    }

    fn observe(&self, step: &str, phase: Phase, started_at: i64) {
        metrics::histogram!(metric::STEP_DURATION_SECONDS, "kind" => self.saga.kind.clone(),
            "step" => step.to_owned(), "phase" => phase.as_str())
        .record((self.now - started_at).max(0) as f64 / 1000.0);
    }

    /// Goes forward from the current step: local steps run here, the first effect step is
    /// recorded and the saga waits for it; past the last step the saga is completed.
    pub(crate) async fn forward(&mut self) -> Result<(), StoreError> {
        let def = self.def;
        loop {
            let i = self.saga.step;
            let Some(step) = usize::try_from(i).ok().and_then(|i| def.steps.get(i)) else {
                self.set_state(SagaState::Completed);
                self.saga.deadline = None;
                return self.save().await;
            };
            match self.issue(i, step, 1).await? {
                Ran::Done(_) => self.saga.step = i + 1,
                Ran::Issued => return self.save().await,
                Ran::Refused(reason) => {
                    let reason = format!("step {} refused: {reason}", step.name);
                    return if step.role == Role::Retriable {
                        self.needs_review(reason).await
                    } else {
                        self.compensate_from(i - 1, reason).await
                    };
                }
            }
        }
    }

    /// Runs (local) or records (effect) forward step `i`'s `attempt`, with its log row.
    async fn issue(&mut self, i: i64, step: &Step, attempt: u32) -> Result<Ran, StoreError> {
        let ctx = self.context(&step.name, attempt).await?;
        let saga_id = self.saga.id.clone();
        match &step.action {
            Action::Local(f) => {
                self.start_row(i, Phase::Forward, &step.name, None).await?;
                let ran = match f(self.tx, &ctx).await {
                    Ok(out) => Ran::Done(out),
                    Err(StepError::Refused(r)) => Ran::Refused(r),
                    Err(StepError::Store(e)) => return Err(e),
                };
                self.finish_local(i, Phase::Forward, &step.name, &ran)
                    .await?;
                Ok(ran)
            }
            Action::Effect(effect) => {
                let reference = self.reference(&step.name, attempt);
                let key = self.key(&step.name, attempt - 1)?;
                let id = match self.enqueue(effect, &ctx, &reference, &key).await? {
                    Ok(id) => id,
                    Err(refused) if attempt > 1 => return Ok(Ran::Refused(refused)),
                    Err(refused) => {
                        self.start_row(i, Phase::Forward, &step.name, None).await?;
                        let ran = Ran::Refused(refused);
                        self.finish_local(i, Phase::Forward, &step.name, &ran)
                            .await?;
                        return Ok(ran);
                    }
                };
                if attempt > 1 {
                    let delay = step.retry.delay(attempt - 1, rand::random::<f64>());
                    store::delay_effect(self.tx, &id, self.now + oncely_core::millis(delay))
                        .await?;
                    let evidence = format!("issued again as attempt {attempt}");
                    store::reissue_step(self.tx, &saga_id, i, &id, &evidence).await?;
                } else {
                    self.start_row(i, Phase::Forward, &step.name, Some(&id))
                        .await?;
                }
                self.saga.deadline = step.timeout.map(|t| self.now + oncely_core::millis(t));
                Ok(Ran::Issued)
            }
        }
    }

    async fn start_row(
        &mut self,
        step: i64,
        phase: Phase,
        name: &str,
        effect_id: Option<&str>,
    ) -> Result<(), StoreError> {
        let new = NewStep {
            saga: &self.saga.id,
            step,
            phase,
            name,
            effect_id,
            now: self.now,
        };
        store::insert_step(self.tx, &new).await
    }

    /// Ends a local run's log row: succeeded with its output, or failed (forward) /
    /// needs_review (compensation) with the refusal.
    async fn finish_local(
        &mut self,
        step: i64,
        phase: Phase,
        name: &str,
        ran: &Ran,
    ) -> Result<(), StoreError> {
        let (state, output, evidence) = match ran {
            Ran::Done(v) => (StepState::Succeeded, Some(v.to_string()), None),
            Ran::Refused(r) if phase == Phase::Forward => {
                (StepState::Failed, None, Some(r.clone()))
            }
            Ran::Refused(r) => (StepState::NeedsReview, None, Some(r.clone())),
            Ran::Issued => return Ok(()),
        };
        self.finish(
            step,
            phase,
            name,
            state,
            output.as_deref(),
            evidence.as_deref(),
            self.now,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)] // one log row's columns, each named at the call
    async fn finish(
        &mut self,
        step: i64,
        phase: Phase,
        name: &str,
        state: StepState,
        output: Option<&str>,
        evidence: Option<&str>,
        started_at: i64,
    ) -> Result<(), StoreError> {
        let f = Finish {
            state,
            output,
            evidence,
            now: self.now,
        };
        store::finish_step(self.tx, &self.saga.id, step, phase, &f).await?;
        self.observe(name, phase, started_at);
        Ok(())
    }

    /// [`Self::finish`] of forward step `i`.
    async fn finish_forward(
        &mut self,
        i: i64,
        step: &Step,
        state: StepState,
        output: Option<&str>,
        evidence: Option<&str>,
        started_at: i64,
    ) -> Result<(), StoreError> {
        let name = &step.name;
        self.finish(i, Phase::Forward, name, state, output, evidence, started_at)
            .await
    }

    /// Forward step `i` needs a person: its row records `error`, the saga parks for review
    /// with `reason`.
    async fn forward_needs_review(
        &mut self,
        i: i64,
        step: &Step,
        started_at: i64,
        error: &str,
        reason: String,
    ) -> Result<(), StoreError> {
        let state = StepState::NeedsReview;
        self.finish_forward(i, step, state, None, Some(error), started_at)
            .await?;
        self.needs_review(reason).await
    }

    /// Parks the saga for a person.
    async fn needs_review(&mut self, reason: String) -> Result<(), StoreError> {
        self.set_state(SagaState::NeedsReview);
        self.saga.error = Some(reason);
        self.saga.deadline = None;
        self.save().await
    }

    /// Starts compensating the completed steps from `from` down.
    async fn compensate_from(&mut self, from: i64, reason: String) -> Result<(), StoreError> {
        metrics::counter!(metric::COMPENSATIONS_STARTED_TOTAL, "kind" => self.saga.kind.clone())
            .increment(1);
        self.set_state(SagaState::Compensating);
        self.saga.error = Some(reason);
        self.saga.deadline = None;
        self.saga.step = from;
        self.compensate().await
    }

    /// Walks down from the current step: each step that succeeded and is not compensated
    /// yet gets its compensation (local ones run here; the walk waits for an effect one).
    pub(crate) async fn compensate(&mut self) -> Result<(), StoreError> {
        let def = self.def;
        loop {
            let i = self.saga.step;
            if i < 0 {
                return self.finish_compensation().await;
            }
            let step = step_at(def, &self.saga.id, i)?;
            let succeeded = store::step(self.tx, &self.saga.id, i, Phase::Forward)
                .await?
                .is_some_and(|r| r.state == StepState::Succeeded.as_str());
            let compensated = store::step(self.tx, &self.saga.id, i, Phase::Compensate)
                .await?
                .is_some();
            if !succeeded || compensated {
                self.saga.step = i - 1;
                continue;
            }
            match self.undo(i, step).await? {
                Ran::Done(_) => self.saga.step = i - 1,
                Ran::Issued => return self.save().await,
                Ran::Refused(reason) => {
                    let reason = format!("compensation of {} refused: {reason}", step.name);
                    return self.needs_review(reason).await;
                }
            }
        }
    }

    /// Runs (local) or records (effect) the compensation of succeeded step `i`; a step
    /// without one (a pivot that committed late) is refused: a person decides.
    async fn undo(&mut self, i: i64, step: &Step) -> Result<Ran, StoreError> {
        let Some(action) = &step.compensation else {
            return Ok(Ran::Refused(format!(
                "{} succeeded and has no compensation",
                step.name
            )));
        };
        let ctx = self.context(&step.name, 1).await?;
        match action {
            Action::Local(f) => {
                self.start_row(i, Phase::Compensate, &step.name, None)
                    .await?;
                let ran = match f(self.tx, &ctx).await {
                    Ok(out) => Ran::Done(out),
                    Err(StepError::Refused(r)) => Ran::Refused(r),
                    Err(StepError::Store(e)) => return Err(e),
                };
                self.finish_local(i, Phase::Compensate, &step.name, &ran)
                    .await?;
                Ok(ran)
            }
            Action::Effect(effect) => {
                let reference = self.reference(&step.name, 1);
                let key = self.key(&format!("{}:compensate", step.name), 0)?;
                match self.enqueue(effect, &ctx, &reference, &key).await? {
                    Ok(id) => {
                        self.start_row(i, Phase::Compensate, &step.name, Some(&id))
                            .await?;
                        Ok(Ran::Issued)
                    }
                    Err(refused) => Ok(Ran::Refused(refused)),
                }
            }
        }
    }

    /// A compensation that walked past the first step ends the saga `compensated` once
    /// nothing of it is outstanding (a timed-out step's effect, a compensation in flight).
    async fn finish_compensation(&mut self) -> Result<(), StoreError> {
        if self.saga.state == SagaState::Compensating.as_str()
            && self.saga.step < 0
            && store::outstanding(self.tx, &self.saga.id).await? == 0
        {
            self.set_state(SagaState::Compensated);
            metrics::counter!(metric::COMPENSATIONS_COMPLETED_TOTAL, "kind" => self.saga.kind.clone())
                .increment(1);
        }
        self.save().await
    }

    /// A caller's cancel: while the saga is going forward on a compensable step (before
    /// its pivot was issued), the current step turns `timed_out` with `reason` as its
    /// evidence (its effect may still land; a late success is compensated) and
    /// compensation starts from the step before it.
    pub(crate) async fn cancel(&mut self, reason: &str) -> Result<Cancelled, StoreError> {
        let state = SagaState::parse(&self.saga.state)?;
        match state {
            SagaState::Compensating | SagaState::Compensated => {
                return Ok(Cancelled::Already(state))
            }
            SagaState::Completed | SagaState::NeedsReview => return Ok(Cancelled::Refused(state)),
            _ => {}
        }
        let i = self.saga.step;
        let step = step_at(self.def, &self.saga.id, i)?;
        if step.role != Role::Compensable {
            return Ok(Cancelled::Refused(state));
        }
        if let Some(row) = store::step(self.tx, &self.saga.id, i, Phase::Forward).await? {
            if row.state == StepState::Running.as_str() {
                let f = Finish {
                    state: StepState::TimedOut,
                    output: None,
                    evidence: Some(reason),
                    now: self.now,
                };
                store::finish_step(self.tx, &self.saga.id, i, Phase::Forward, &f).await?;
            }
        }
        self.compensate_from(i - 1, reason.to_owned()).await?;
        Ok(Cancelled::Compensating(SagaState::parse(&self.saga.state)?))
    }

    /// Step `i`'s deadline passed: if the saga still waits for it, it is marked
    /// `timed_out` and compensation starts from the step before it.
    pub(crate) async fn expire(&mut self) -> Result<(), StoreError> {
        let due = self.saga.state == SagaState::Running.as_str()
            && self.saga.deadline.is_some_and(|d| d <= self.now);
        if !due {
            return Ok(());
        }
        let i = self.saga.step;
        let step = step_at(self.def, &self.saga.id, i)?;
        let name = step.name.clone();
        let timeout = step.timeout.map_or(0, oncely_core::millis);
        let Some(row) = store::step(self.tx, &self.saga.id, i, Phase::Forward).await? else {
            return Ok(());
        };
        if row.state != StepState::Running.as_str() {
            return Ok(());
        }
        metrics::counter!(metric::STEP_TIMEOUTS_TOTAL, "kind" => self.saga.kind.clone())
            .increment(1);
        let evidence = format!("not settled within its timeout of {timeout} ms");
        let f = Finish {
            state: StepState::TimedOut,
            output: None,
            evidence: Some(&evidence),
            now: self.now,
        };
        store::finish_step(self.tx, &self.saga.id, i, Phase::Forward, &f).await?;
        self.compensate_from(i - 1, format!("step {name} timed out after {timeout} ms"))
            .await
    }

    /// The effect `effect_id` of step `i` in `phase` settled with `outcome`.
    pub(crate) async fn settled(
        &mut self,
        i: i64,
        phase: Phase,
        effect_id: &str,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        let Some(row) = store::step(self.tx, &self.saga.id, i, phase).await? else {
            return Ok(());
        };
        if row.effect_id.as_deref() != Some(effect_id) {
            return Ok(());
        }
        let state = row.state()?;
        // The step's effect is settled in this transaction; the saga has not moved yet.
        oncely_core::failpoint::fail_point!("saga.after_step_settled");
        match (phase, state) {
            (Phase::Forward, StepState::Running) if self.is_current(i) => {
                self.forward_settled(i, row.started_at, row.attempts, outcome)
                    .await
            }
            (Phase::Forward, StepState::TimedOut) => {
                self.late_settled(i, row.started_at, outcome).await
            }
            (Phase::Compensate, StepState::Running) => {
                self.compensation_settled(i, row.started_at, outcome).await
            }
            // Settled already (a second completion of the step): nothing to continue.
            _ => Ok(()),
        }
    }

    fn is_current(&self, i: i64) -> bool {
        self.saga.state == SagaState::Running.as_str() && self.saga.step == i
    }

    async fn forward_settled(
        &mut self,
        i: i64,
        started_at: i64,
        attempts: i64,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        let def = self.def;
        let step = step_at(def, &self.saga.id, i)?;
        self.saga.deadline = None;
        match outcome {
            Outcome::Succeeded(object) => {
                let out = object.to_string();
                self.finish_forward(i, step, StepState::Succeeded, Some(&out), None, started_at)
                    .await?;
                self.saga.step = i + 1;
                self.forward().await
            }
            Outcome::Failed(error) => {
                self.forward_failed(i, step, started_at, attempts, &error)
                    .await
            }
            Outcome::NeedsReview(error) => {
                let reason = format!("step {}: {error}", step.name);
                self.forward_needs_review(i, step, started_at, &error, reason)
                    .await
            }
        }
    }

    /// Step `i` was refused for good: before the pivot (and the pivot itself) the saga
    /// compensates; a retriable step is issued again within its policy, and parked for
    /// review (its row too) once the policy is spent.
    async fn forward_failed(
        &mut self,
        i: i64,
        step: &Step,
        started_at: i64,
        attempts: i64,
        error: &str,
    ) -> Result<(), StoreError> {
        let attempt = u32::try_from(attempts).unwrap_or(u32::MAX);
        let exhausted = step.role == Role::Retriable && step.retry.exhausted(attempt);
        let state = if exhausted {
            StepState::NeedsReview
        } else {
            StepState::Failed
        };
        self.finish_forward(i, step, state, None, Some(error), started_at)
            .await?;
        if step.role != Role::Retriable {
            let reason = format!("step {} failed: {error}", step.name);
            self.compensate_from(i - 1, reason).await
        } else if exhausted {
            let reason = format!("step {} failed {attempt} times, last: {error}", step.name);
            self.needs_review(reason).await
        } else {
            match self.issue(i, step, attempt + 1).await? {
                Ran::Refused(r) => self.needs_review(format!("step {}: {r}", step.name)).await,
                _ => self.save().await,
            }
        }
    }

    /// A timed-out step's effect settled after compensation started: a success is
    /// compensated now (a late charge refunded, a late shipment cancelled).
    async fn late_settled(
        &mut self,
        i: i64,
        started_at: i64,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        let def = self.def;
        let step = step_at(def, &self.saga.id, i)?;
        match outcome {
            Outcome::Succeeded(object) => {
                metrics::counter!(metric::LATE_COMMITS_TOTAL, "kind" => self.saga.kind.clone())
                    .increment(1);
                let out = object.to_string();
                let evidence = "committed after its timeout had started compensation";
                self.finish_forward(
                    i,
                    step,
                    StepState::Succeeded,
                    Some(&out),
                    Some(evidence),
                    started_at,
                )
                .await?;
                match self.undo(i, step).await? {
                    Ran::Refused(reason) => {
                        let reason = format!("late commit of {} not undone: {reason}", step.name);
                        self.needs_review(reason).await
                    }
                    Ran::Done(_) | Ran::Issued => self.finish_compensation().await,
                }
            }
            Outcome::Failed(error) => {
                let evidence = format!("refused after its timeout: {error}");
                self.finish_forward(
                    i,
                    step,
                    StepState::Failed,
                    None,
                    Some(&evidence),
                    started_at,
                )
                .await?;
                self.finish_compensation().await
            }
            Outcome::NeedsReview(error) => {
                let reason = format!("timed-out step {}: {error}", step.name);
                self.forward_needs_review(i, step, started_at, &error, reason)
                    .await
            }
        }
    }

    async fn compensation_settled(
        &mut self,
        i: i64,
        started_at: i64,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        let name = step_at(self.def, &self.saga.id, i)?.name.clone();
        match outcome {
            Outcome::Succeeded(object) => {
                let out = object.to_string();
                self.finish(
                    i,
                    Phase::Compensate,
                    &name,
                    StepState::Succeeded,
                    Some(&out),
                    None,
                    started_at,
                )
                .await?;
                let walking =
                    self.saga.state == SagaState::Compensating.as_str() && self.saga.step == i;
                if walking {
                    self.saga.step = i - 1;
                    self.compensate().await
                } else {
                    self.finish_compensation().await
                }
            }
            Outcome::Failed(error) | Outcome::NeedsReview(error) => {
                self.finish(
                    i,
                    Phase::Compensate,
                    &name,
                    StepState::NeedsReview,
                    None,
                    Some(&error),
                    started_at,
                )
                .await?;
                self.needs_review(format!("compensation of {name}: {error}"))
                    .await
            }
        }
    }
}
