use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use oncely_core::RetryPolicy;
use oncely_sql::{StoreError, Tx};
use serde_json::Value;

/// What a saga step sees of its saga: who it runs for, the saga's input and the outputs of
/// the forward steps that succeeded so far (an effect step's output is the provider's
/// object as it answered, e.g. a PaymentIntent with its `id`; a local step's is the value
/// it returned).
#[derive(Debug, Clone)]
pub struct StepContext {
    /// The saga's id.
    pub saga_id: String,
    /// The tenant the saga runs for.
    pub tenant: String,
    /// The saga's kind ([`SagaDefinition::kind`]).
    pub kind: String,
    /// The name of the step being run (or compensated).
    pub step: String,
    /// 1 for the first attempt of a step; a retriable step's re-issues count up.
    pub attempt: u32,
    /// The input the saga was started with.
    pub input: Value,
    /// Outputs of the succeeded forward steps, by step name.
    pub outputs: BTreeMap<String, Value>,
}

impl StepContext {
    /// The output of forward step `step`, when it succeeded.
    pub fn output(&self, step: &str) -> Option<&Value> {
        self.outputs.get(step)
    }
}

/// Why a step (or a compensation) did not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// A definitive business refusal (out of stock, invalid input): the step did not take
    /// effect, and the saga compensates what ran before it. A local step that refuses must
    /// not have written anything (check first, then write).
    #[error("refused: {0}")]
    Refused(String),
    /// The database failed: the whole transaction rolls back (nothing of the step, the
    /// transition or the next intent is kept) and the continuation is tried again later.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A local step: a write inside the saga's transaction (the transaction that also records
/// the step's completion and the saga's transition). Returns the step's output (any JSON,
/// `Value::Null` for none).
pub type LocalFn = dyn for<'a> Fn(&'a mut Tx, &'a StepContext) -> BoxFuture<'a, Result<Value, StepError>>
    + Send
    + Sync;

/// The parameters of an effect step's call, built from the saga's data.
pub type ParamsFn = dyn Fn(&StepContext) -> Result<Value, StepError> + Send + Sync;

/// An outgoing call as a step: provider, operation and the request's parameters built from
/// the saga's data. It is recorded as an effect (`oncely_sql::EffectStore::enqueue`) in the
/// saga's transaction with a key derived from the saga id and step name
/// (`oncely_effects::derive_key`, never random) and a reference `"{saga id}:{step}"` (a
/// retriable step's re-issue `n` appends `#n`; a compensation shares its step's reference,
/// as the shipping provider's cancel is looked up by the booking's `merchant_reference`).
#[derive(Clone)]
pub struct EffectStep {
    pub(crate) provider: String,
    pub(crate) operation: String,
    pub(crate) params: Arc<ParamsFn>,
}

impl EffectStep {
    /// A call of `provider`'s `operation` (e.g. `"payments"`, `"charge"`) with the
    /// parameters `params` builds.
    pub fn new(
        provider: impl Into<String>,
        operation: impl Into<String>,
        params: impl Fn(&StepContext) -> Result<Value, StepError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            provider: provider.into(),
            operation: operation.into(),
            params: Arc::new(params),
        }
    }
}

impl fmt::Debug for EffectStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EffectStep")
            .field("provider", &self.provider)
            .field("operation", &self.operation)
            .finish_non_exhaustive()
    }
}

/// What a step or a compensation does: a local write or an outgoing effect.
#[derive(Clone)]
#[non_exhaustive]
pub enum Action {
    /// A write inside the saga's transaction.
    Local(Arc<LocalFn>),
    /// A durable outgoing call, run by the effect runner.
    Effect(EffectStep),
}

impl Action {
    /// A local write: `f(tx, ctx)` runs inside the saga's transaction.
    pub fn local<F>(f: F) -> Self
    where
        F: for<'a> Fn(&'a mut Tx, &'a StepContext) -> BoxFuture<'a, Result<Value, StepError>>
            + Send
            + Sync
            + 'static,
    {
        Self::Local(Arc::new(f))
    }

    /// An effect: `provider`'s `operation` with the parameters `params` builds.
    pub fn effect(
        provider: impl Into<String>,
        operation: impl Into<String>,
        params: impl Fn(&StepContext) -> Result<Value, StepError> + Send + Sync + 'static,
    ) -> Self {
        Self::Effect(EffectStep::new(provider, operation, params))
    }
}

impl fmt::Debug for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(_) => f.write_str("Local(..)"),
            Self::Effect(e) => e.fmt(f),
        }
    }
}

/// The role of a step in the compensable → pivot → retriable order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// Undone by its compensation when a later step before the pivot fails.
    Compensable,
    /// The point of no return: once it succeeds the saga only goes forward. Its optional
    /// compensation is used only when it commits after its timeout already started the
    /// saga's compensation (a late shipment cancelled).
    Pivot,
    /// After the pivot: retried within its policy, parked `needs_review` when exhausted.
    Retriable,
}

/// One step of a saga: a name (unique in its saga), what it does, its compensation, its
/// timeout and (retriable steps) its retry policy.
#[derive(Debug, Clone)]
pub struct Step {
    pub(crate) name: String,
    pub(crate) action: Action,
    pub(crate) compensation: Option<Action>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) retry: RetryPolicy,
    pub(crate) role: Role,
}

impl Step {
    /// A step that runs `action`. Names are 1–64 characters of `[A-Za-z0-9._-]`: they are
    /// part of the effect keys and stored in the step log.
    pub fn new(name: impl Into<String>, action: Action) -> Self {
        Self {
            name: name.into(),
            action,
            compensation: None,
            timeout: None,
            retry: RetryPolicy::default(),
            role: Role::Compensable,
        }
    }

    /// A local step: `f(tx, ctx)` runs inside the saga's transaction.
    pub fn local<F>(name: impl Into<String>, f: F) -> Self
    where
        F: for<'a> Fn(&'a mut Tx, &'a StepContext) -> BoxFuture<'a, Result<Value, StepError>>
            + Send
            + Sync
            + 'static,
    {
        Self::new(name, Action::local(f))
    }

    /// An effect step: `provider`'s `operation` with the parameters `params` builds.
    pub fn effect(
        name: impl Into<String>,
        provider: impl Into<String>,
        operation: impl Into<String>,
        params: impl Fn(&StepContext) -> Result<Value, StepError> + Send + Sync + 'static,
    ) -> Self {
        Self::new(name, Action::effect(provider, operation, params))
    }

    /// Undone by `compensation` (itself a local write or an effect).
    #[must_use]
    pub fn compensated_by(mut self, compensation: Action) -> Self {
        self.compensation = Some(compensation);
        self
    }

    /// An effect step not settled `timeout` after its intent was recorded starts the
    /// saga's compensation; if it commits later, its success is compensated too. Only for
    /// effect steps before or at the pivot.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// A retriable step's policy: `max_attempts` issues of the step (each a new effect
    /// under the key of its attempt), spaced by its backoff. Default
    /// [`RetryPolicy::default`].
    #[must_use]
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// The step's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The step's role.
    pub fn role(&self) -> Role {
        self.role
    }
}

/// A definition refused by [`SagaBuilder::build`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DefinitionError {
    /// A compensable step after the pivot: after the pivot the saga only goes forward.
    #[error("step {step:?} is compensable but comes after the pivot {pivot:?}")]
    CompensableAfterPivot {
        /// The compensable step.
        step: String,
        /// The pivot.
        pivot: String,
    },
    /// A retriable step before the pivot (or in a saga without one).
    #[error("step {step:?} is retriable but comes before any pivot")]
    RetriableBeforePivot {
        /// The step.
        step: String,
    },
    /// A second pivot.
    #[error("step {step:?} is a second pivot after {pivot:?}")]
    SecondPivot {
        /// The second pivot.
        step: String,
        /// The first.
        pivot: String,
    },
    /// A compensable step without a compensation.
    #[error("step {0:?} is compensable but has no compensation")]
    MissingCompensation(String),
    /// A retriable step with a compensation or a timeout: after the pivot nothing is
    /// compensated.
    #[error("step {0:?} is retriable: it has neither a compensation nor a timeout")]
    RetriableUndoable(String),
    /// A timeout on a local step (it completes in its transaction or not at all).
    #[error("step {0:?} is local: a timeout applies to effect steps only")]
    TimeoutOnLocal(String),
    /// Two steps with one name.
    #[error("two steps are named {0:?}")]
    DuplicateStep(String),
    /// A kind or step name that is empty, longer than 64 or outside `[A-Za-z0-9._-]`.
    #[error("{0:?} is not a valid name: 1-64 characters of [A-Za-z0-9._-]")]
    InvalidName(String),
    /// A saga without steps.
    #[error("saga {0:?} has no steps")]
    Empty(String),
}

/// A saga's typed definition: its kind and its steps in the order compensable* → pivot? →
/// retriable*, checked by [`SagaBuilder::build`].
#[derive(Debug, Clone)]
pub struct SagaDefinition {
    pub(crate) kind: String,
    pub(crate) steps: Vec<Step>,
}

impl SagaDefinition {
    /// A builder for sagas of `kind` (e.g. `"order"`).
    pub fn builder(kind: impl Into<String>) -> SagaBuilder {
        SagaBuilder {
            kind: kind.into(),
            steps: Vec::new(),
        }
    }

    /// The kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
}

/// Collects a saga's steps; [`SagaBuilder::build`] checks their order.
#[derive(Debug)]
pub struct SagaBuilder {
    kind: String,
    steps: Vec<Step>,
}

impl SagaBuilder {
    /// Adds a compensable step (it needs [`Step::compensated_by`]).
    #[must_use]
    pub fn compensable(self, step: Step) -> Self {
        self.push(step, Role::Compensable)
    }

    /// Adds the pivot.
    #[must_use]
    pub fn pivot(self, step: Step) -> Self {
        self.push(step, Role::Pivot)
    }

    /// Adds a retriable step (after the pivot).
    #[must_use]
    pub fn retriable(self, step: Step) -> Self {
        self.push(step, Role::Retriable)
    }

    fn push(mut self, mut step: Step, role: Role) -> Self {
        step.role = role;
        self.steps.push(step);
        self
    }

    /// The definition.
    ///
    /// # Errors
    /// [`DefinitionError`] when the steps are not compensable* → pivot? → retriable*, a
    /// compensable step has no compensation, a retriable one has a compensation or a
    /// timeout, a local step has a timeout, names repeat or are invalid, or there are none.
    pub fn build(self) -> Result<SagaDefinition, DefinitionError> {
        valid_name(&self.kind)?;
        if self.steps.is_empty() {
            return Err(DefinitionError::Empty(self.kind));
        }
        let mut pivot: Option<&str> = None;
        for (i, step) in self.steps.iter().enumerate() {
            valid_name(&step.name)?;
            if self.steps[..i].iter().any(|s| s.name == step.name) {
                return Err(DefinitionError::DuplicateStep(step.name.clone()));
            }
            if step.timeout.is_some() && matches!(step.action, Action::Local(_)) {
                return Err(DefinitionError::TimeoutOnLocal(step.name.clone()));
            }
            check_order(step, &mut pivot)?;
        }
        Ok(SagaDefinition {
            kind: self.kind,
            steps: self.steps,
        })
    }
}

/// The order rule for one step, given the pivot seen so far (set when `step` is it).
fn check_order<'a>(step: &'a Step, pivot: &mut Option<&'a str>) -> Result<(), DefinitionError> {
    let name = step.name.clone();
    match (step.role, *pivot) {
        (Role::Compensable, Some(p)) => Err(DefinitionError::CompensableAfterPivot {
            step: name,
            pivot: p.to_owned(),
        }),
        (Role::Compensable, None) if step.compensation.is_none() => {
            Err(DefinitionError::MissingCompensation(name))
        }
        (Role::Pivot, Some(p)) => Err(DefinitionError::SecondPivot {
            step: name,
            pivot: p.to_owned(),
        }),
        (Role::Pivot, None) => {
            *pivot = Some(&step.name);
            Ok(())
        }
        (Role::Retriable, None) => Err(DefinitionError::RetriableBeforePivot { step: name }),
        (Role::Retriable, Some(_)) if step.compensation.is_some() || step.timeout.is_some() => {
            Err(DefinitionError::RetriableUndoable(name))
        }
        _ => Ok(()),
    }
}

fn valid_name(name: &str) -> Result<(), DefinitionError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(DefinitionError::InvalidName(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop() -> Action {
        Action::local(|_tx, _ctx| Box::pin(async { Ok(Value::Null) }))
    }

    fn call(name: &str) -> Step {
        Step::effect(name, "payments", "charge", |_| Ok(Value::Null))
    }

    #[test]
    fn a_compensable_step_after_the_pivot_is_refused_with_a_typed_error() {
        let err = SagaDefinition::builder("order")
            .compensable(
                Step::local("reserve", |_tx, _ctx| Box::pin(async { Ok(Value::Null) }))
                    .compensated_by(noop()),
            )
            .pivot(call("ship"))
            .compensable(call("charge").compensated_by(noop()))
            .build()
            .unwrap_err();
        assert_eq!(
            err,
            DefinitionError::CompensableAfterPivot {
                step: "charge".into(),
                pivot: "ship".into()
            }
        );
    }

    #[test]
    fn the_order_rules_each_have_their_error() {
        let built = |b: SagaBuilder| b.build().map(|_| ()).unwrap_err();
        let order = || SagaDefinition::builder("order");
        assert_eq!(
            built(order().retriable(call("mail"))),
            DefinitionError::RetriableBeforePivot {
                step: "mail".into()
            }
        );
        assert_eq!(
            built(order().compensable(call("charge"))),
            DefinitionError::MissingCompensation("charge".into())
        );
        assert!(matches!(
            built(order().pivot(call("a")).pivot(call("b"))),
            DefinitionError::SecondPivot { .. }
        ));
        assert_eq!(
            built(
                order()
                    .pivot(call("a"))
                    .retriable(call("b").timeout(Duration::from_secs(1)))
            ),
            DefinitionError::RetriableUndoable("b".into())
        );
        assert_eq!(
            built(order().pivot(call("a")).retriable(call("a"))),
            DefinitionError::DuplicateStep("a".into())
        );
        assert_eq!(
            built(order().pivot(call("a b"))),
            DefinitionError::InvalidName("a b".into())
        );
        assert_eq!(built(order()), DefinitionError::Empty("order".into()));
        assert!(order()
            .compensable(call("charge").compensated_by(noop()))
            .pivot(call("ship"))
            .retriable(call("mail"))
            .build()
            .is_ok());
    }
}
