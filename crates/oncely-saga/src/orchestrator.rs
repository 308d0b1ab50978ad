use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use oncely_core::{IdempotencyKey, KeyError, TenantError, TenantId};
use oncely_effects::{EffectHandler, NoHandler, Settled};
use oncely_sql::{Database, Effect, StoreError, Tx};
use tokio_util::sync::CancellationToken;

use crate::engine::{Engine, Outcome};
use crate::metrics as metric;
use crate::store::{self, NewRow};
use crate::{Phase, Saga, SagaDefinition, SagaState, StepRecord};

/// Settings of an [`Orchestrator`].
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// Pause between timeout sweeps in [`Orchestrator::run`]. Default 100 ms.
    pub poll: Duration,
    /// Sagas expired per sweep, at most. Default 64.
    pub batch: u32,
    /// Interval of the gauges' refresh in [`Orchestrator::run`]. Default 5 s.
    pub gauges: Duration,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            poll: Duration::from_millis(100),
            batch: 64,
            gauges: Duration::from_secs(5),
        }
    }
}

/// A saga to start ([`Orchestrator::start`]).
#[derive(Debug, Clone, Copy)]
pub struct NewSaga<'a> {
    /// The saga's id, chosen by the caller and stable across redeliveries (e.g. derived
    /// from the order it serves): 1–255 visible ASCII characters, as an idempotency key,
    /// since the steps' keys derive from it.
    pub id: &'a str,
    /// The tenant it runs for (`[A-Za-z0-9._-]`, 1–128).
    pub tenant: &'a str,
    /// The kind of a definition the orchestrator holds.
    pub kind: &'a str,
    /// The saga's data, handed to every step ([`crate::StepContext::input`]).
    pub input: &'a serde_json::Value,
}

impl<'a> NewSaga<'a> {
    /// The saga's row, its input serialised as `input`, recorded at `now` (Unix ms).
    fn row(&self, input: &'a str, now: i64) -> NewRow<'a> {
        NewRow {
            id: self.id,
            tenant: self.tenant,
            kind: self.kind,
            input,
            now,
        }
    }
}

/// What [`Orchestrator::start`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Started {
    /// A new saga, in its state after its leading local steps ran (`running` while an
    /// effect step is open; `compensated` when a first local step refused).
    Created(SagaState),
    /// A saga with this id exists already (a redelivered start): nothing was recorded.
    Existing,
}

/// What [`Orchestrator::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancelled {
    /// Compensation started (the saga's state now: `compensating`, or `compensated` when
    /// only local steps had run).
    Compensating(SagaState),
    /// It was compensating or compensated already: nothing changed.
    Already(SagaState),
    /// Its pivot was issued, it completed or it waits for review: not cancelled.
    Refused(SagaState),
}

/// Why a saga could not be started or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SagaError {
    /// No definition of this kind is registered.
    #[error("no saga definition of kind {0:?}")]
    UnknownKind(String),
    /// Two definitions of one kind were given.
    #[error("two saga definitions of kind {0:?}")]
    DuplicateKind(String),
    /// The saga id is not usable as a key (1–255 visible ASCII characters).
    #[error("invalid saga id: {0}")]
    InvalidId(#[source] KeyError),
    /// The tenant is not a valid tenant id.
    #[error("invalid tenant: {0}")]
    InvalidTenant(#[source] TenantError),
    /// No saga has this id.
    #[error("no saga {0}")]
    NotFound(String),
    /// An operator's retry of a saga that is not in `needs_review`.
    #[error("saga {id} is {state}; only a saga in needs_review is retried")]
    NotInReview {
        /// The saga.
        id: String,
        /// Its state.
        state: SagaState,
    },
    /// A saga in `needs_review` without a parked step to retry (e.g. a late commit of a
    /// step that has no compensation): a person resolves its effects by hand.
    #[error("saga {0} has no parked step to retry; resolve its effects by hand")]
    NothingToRetry(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The saga orchestrator: starts sagas in the caller's transaction, continues them when
/// their steps' effects settle (it is the effect runner's [`EffectHandler`], chaining
/// effects that are no saga's to the service's own handler), expires steps past their
/// deadline, and reads sagas per tenant. Any number of orchestrators may share a store:
/// each transition is fenced by the saga's version.
pub struct Orchestrator {
    pub(crate) db: Database,
    pub(crate) definitions: HashMap<String, Arc<SagaDefinition>>,
    inner: Arc<dyn EffectHandler>,
    pub(crate) config: OrchestratorConfig,
}

impl std::fmt::Debug for Orchestrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orchestrator")
            .field("kinds", &self.definitions.keys().collect::<Vec<_>>())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> i64 {
    oncely_core::now_ms()
}

impl Orchestrator {
    /// An orchestrator over `db` (migrated with `Database::migrate`) for `definitions`.
    ///
    /// # Errors
    /// [`SagaError::DuplicateKind`] when two definitions share a kind.
    pub fn new(
        db: Database,
        definitions: Vec<SagaDefinition>,
        config: OrchestratorConfig,
    ) -> Result<Self, SagaError> {
        let mut by_kind = HashMap::new();
        for d in definitions {
            let kind = d.kind.clone();
            if by_kind.insert(kind.clone(), Arc::new(d)).is_some() {
                return Err(SagaError::DuplicateKind(kind));
            }
        }
        Ok(Self {
            db,
            definitions: by_kind,
            inner: Arc::new(NoHandler),
            config,
        })
    }

    /// Hands the settled effects that are no saga's step to `handler` (the service's own),
    /// in the same settle transaction.
    #[must_use]
    pub fn chain(mut self, handler: Arc<dyn EffectHandler>) -> Self {
        self.inner = handler;
        self
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    fn definition(&self, kind: &str) -> Result<&SagaDefinition, SagaError> {
        self.definitions
            .get(kind)
            .map(AsRef::as_ref)
            .ok_or_else(|| SagaError::UnknownKind(kind.to_owned()))
    }

    /// The definition of `new`'s kind, once its id and tenant are valid.
    fn checked(&self, new: &NewSaga<'_>) -> Result<&SagaDefinition, SagaError> {
        let def = self.definition(new.kind)?;
        IdempotencyKey::parse(new.id.as_bytes()).map_err(SagaError::InvalidId)?;
        TenantId::parse(new.tenant).map_err(SagaError::InvalidTenant)?;
        Ok(def)
    }

    /// Starts a saga in the caller's transaction `tx` (the business write that starts it
    /// — an order, an inbox row — commits with it): records the saga, runs its leading
    /// local steps in `tx` and records the first effect step's intent. A second start with
    /// the same id records nothing ([`Started::Existing`]): the primary key decides.
    ///
    /// # Errors
    /// [`SagaError::UnknownKind`], [`SagaError::InvalidId`], [`SagaError::InvalidTenant`]
    /// for bad input; [`SagaError::Store`] when the database fails (the caller rolls back).
    pub async fn start(&self, tx: &mut Tx, new: &NewSaga<'_>) -> Result<Started, SagaError> {
        let def = self.checked(new)?;
        let now = now_ms();
        let input = new.input.to_string();
        let row = new.row(&input, now);
        if !store::insert_saga(tx, &row).await? {
            return Ok(Started::Existing);
        }
        let saga = store::claim(tx, new.id)
            .await?
            .ok_or_else(|| StoreError::NotFound(new.id.to_owned()))?;
        let mut engine = Engine { tx, saga, def, now };
        engine.forward().await?;
        Ok(Started::Created(engine.saga.state()?))
    }

    /// Records saga `new` as cancelled before it started (`compensated`, nothing run,
    /// `error` = `reason`), in the caller's `tx`: a later [`Orchestrator::start`] with its
    /// id finds it and records nothing. [`Started::Existing`] when the saga exists (cancel
    /// it with [`Orchestrator::cancel`]).
    ///
    /// # Errors
    /// As [`Orchestrator::start`].
    pub async fn start_cancelled(
        &self,
        tx: &mut Tx,
        new: &NewSaga<'_>,
        reason: &str,
    ) -> Result<Started, SagaError> {
        self.checked(new)?;
        let input = new.input.to_string();
        let row = new.row(&input, now_ms());
        if store::insert_cancelled(tx, &row, reason).await? {
            Ok(Started::Created(SagaState::Compensated))
        } else {
            Ok(Started::Existing)
        }
    }

    /// Cancels saga `id` of `tenant` in the caller's `tx` (a cancel request's): before
    /// its pivot was issued, compensation starts (the step in flight turns `timed_out`
    /// with `reason` as evidence; if its effect lands later, it is compensated too). `None`
    /// when `tenant` has no such saga.
    ///
    /// # Errors
    /// [`SagaError::Store`] when the database fails or the saga's kind is not registered
    /// here (the caller rolls back).
    pub async fn cancel(
        &self,
        tx: &mut Tx,
        tenant: &str,
        id: &str,
        reason: &str,
    ) -> Result<Option<Cancelled>, SagaError> {
        let Some(saga) = store::claim(tx, id).await? else {
            return Ok(None);
        };
        if saga.tenant != tenant {
            return Ok(None);
        }
        let def = self.definition(&saga.kind)?;
        let mut engine = Engine {
            tx,
            saga,
            def,
            now: now_ms(),
        };
        Ok(Some(engine.cancel(reason).await?))
    }

    /// Continues the saga whose step's effect `effect` settled with `outcome`, in `tx`:
    /// the step's completion, the saga's transition and the next step's intent commit with
    /// the effect's settle. Returns `false` when `effect` is no saga's step.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails, or the saga's kind is not registered here
    /// ([`StoreError::Conflict`]): the settle rolls back and is tried again.
    pub async fn continue_settled(
        &self,
        tx: &mut Tx,
        effect: &Effect,
        outcome: Settled<'_>,
    ) -> Result<bool, StoreError> {
        let Some((saga_id, step, phase)) = store::step_of_effect(tx, &effect.id).await? else {
            return Ok(false);
        };
        let phase = Phase::parse(&phase)?;
        let outcome = match outcome {
            Settled::Succeeded(object) => {
                let mut raw = object.raw.clone();
                if let Some(map) = raw.as_object_mut() {
                    map.entry("id")
                        .or_insert_with(|| serde_json::Value::String(object.id.clone()));
                }
                Outcome::Succeeded(raw)
            }
            Settled::Failed { error } => Outcome::Failed(error.to_owned()),
            Settled::NeedsReview { error } => Outcome::NeedsReview(error.to_owned()),
            other => Outcome::NeedsReview(format!("unexpected settle {other:?}")),
        };
        let Some(saga) = store::claim(tx, &saga_id).await? else {
            return Ok(true);
        };
        let def = self.definitions.get(&saga.kind).ok_or_else(|| {
            StoreError::Conflict(format!("no saga definition of kind {:?}", saga.kind))
        })?;
        let mut engine = Engine {
            tx,
            saga,
            def,
            now: now_ms(),
        };
        engine.settled(step, phase, &effect.id, outcome).await?;
        Ok(true)
    }

    /// Expires the running sagas whose current step's deadline is at or before `now`
    /// (Unix ms), up to [`OrchestratorConfig::batch`], each in its own transaction: the
    /// step turns `timed_out` and compensation starts. Returns how many were expired.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (sagas expired before stay expired).
    pub async fn expire_due(&self, now: i64) -> Result<usize, StoreError> {
        let mut n = 0;
        for id in store::due(&self.db, now, self.config.batch).await? {
            let mut tx = self.db.begin().await?;
            let Some(saga) = store::claim(&mut tx, &id).await? else {
                continue;
            };
            let Some(def) = self.definitions.get(&saga.kind) else {
                continue;
            };
            let before = saga.version;
            let mut engine = Engine {
                tx: &mut tx,
                saga,
                def,
                now,
            };
            engine.expire().await?;
            let expired = engine.saga.version > before;
            tx.commit().await?;
            n += usize::from(expired);
        }
        Ok(n)
    }

    /// Saga `id` of `tenant` (another tenant's is `None`).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is corrupt.
    pub async fn get(&self, tenant: &str, id: &str) -> Result<Option<Saga>, StoreError> {
        store::get(&self.db, tenant, id)
            .await?
            .map(store::SagaRow::into_saga)
            .transpose()
    }

    /// The step log of saga `id` of `tenant`, in the order the steps started (empty for
    /// another tenant's saga).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn steps(&self, tenant: &str, id: &str) -> Result<Vec<StepRecord>, StoreError> {
        store::steps(&self.db, tenant, id)
            .await?
            .into_iter()
            .map(store::StepRow::into_record)
            .collect()
    }

    /// Up to `limit` sagas of `tenant`, in `state` when given, newest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn list(
        &self,
        tenant: &str,
        state: Option<SagaState>,
        limit: u32,
    ) -> Result<Vec<Saga>, StoreError> {
        store::list(&self.db, tenant, state, limit)
            .await?
            .into_iter()
            .map(store::SagaRow::into_saga)
            .collect()
    }

    /// Sets the gauges from the store: sagas per kind and state, and steps in
    /// `needs_review` per kind (see [`crate::metrics`]).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be read.
    pub async fn record_gauges(&self) -> Result<(), StoreError> {
        let counts = store::counts(&self.db).await?;
        let reviews = store::review_counts(&self.db).await?;
        for kind in self.definitions.keys() {
            for state in SagaState::ALL {
                let n = counts
                    .iter()
                    .find(|(k, s, _)| k == kind && s == state.as_str())
                    .map_or(0, |c| c.2);
                metrics::gauge!(metric::SAGAS, "kind" => kind.clone(), "state" => state.as_str())
                    .set(n as f64);
            }
            let n = reviews.iter().find(|(k, _)| k == kind).map_or(0, |r| r.1);
            metrics::gauge!(metric::STEPS_NEEDS_REVIEW, "kind" => kind.clone()).set(n as f64);
        }
        Ok(())
    }

    /// Runs the timeout sweep and the steps operators retried from outside the service
    /// ([`Orchestrator::rerun_due`]) every [`OrchestratorConfig::poll`] and refreshes the gauges
    /// every [`OrchestratorConfig::gauges`], until `shutdown` is cancelled. (Continuations
    /// need no loop of their own: they run in the effect runner's settle transactions.)
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut gauges_at: Option<std::time::Instant> = None;
        while !shutdown.is_cancelled() {
            if gauges_at.is_none_or(|at| at.elapsed() >= self.config.gauges) {
                gauges_at = Some(std::time::Instant::now());
                if let Err(e) = self.record_gauges().await {
                    tracing::warn!(error = %e, "saga gauges not refreshed");
                }
            }
            if let Err(e) = self.expire_due(now_ms()).await {
                tracing::warn!(error = %e, "saga timeout sweep failed; the store may be down");
            }
            if let Err(e) = self.rerun_due().await {
                tracing::warn!(error = %e, "saga retries not run; the store may be down");
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(self.config.poll) => {}
            }
        }
    }
}

impl EffectHandler for Orchestrator {
    fn settled<'a>(
        &'a self,
        tx: &'a mut Tx,
        effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            if self.continue_settled(tx, effect, outcome).await? {
                Ok(())
            } else {
                self.inner.settled(tx, effect, outcome).await
            }
        })
    }
}
