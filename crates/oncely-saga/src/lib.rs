//! A saga orchestrator on oncely's stores (docs/DESIGN.md "Sagas"): a long process —
//! reserve stock → charge → ship — whose steps are local writes or durable outgoing
//! effects, each compensable step with its compensation, ordered compensable → pivot →
//! retriable so that after the pivot the saga only goes forward.
//!
//! - **Durable, one transaction per transition.** A saga is a row (`oncely_sagas`) and a
//!   step log (`oncely_saga_steps`), migration 0024. Each step's completion, the saga's
//!   transition and the next step's intent (an `oncely_effects` row, or the next local
//!   write itself) commit in one transaction: [`Orchestrator::start`] in the caller's, the
//!   rest in the effect runner's settle transaction, through the orchestrator's
//!   [`EffectHandler`](oncely_effects::EffectHandler) (which chains to the service's own
//!   handler for effects that are no saga's).
//! - **Versioned.** Every transition names the version it read (`UPDATE … WHERE version =
//!   read`), so two concurrent completions of one step run the continuation once.
//! - **Keys derived, never random.** A step's effect key is
//!   [`derive_key`](oncely_effects::derive_key) of the saga's tenant and kind, the saga id
//!   and the step's name (`"{step}:compensate"` for its compensation; a retriable step's
//!   attempt `n` as the key generation `n - 1`).
//! - **Compensation is never lost.** A failed compensable or pivot step compensates the
//!   completed steps in reverse order; compensations are effects (or local writes) run by
//!   the effect runner within its retry budget, and a compensation that is refused or whose
//!   outcome stays unknown parks the saga in `needs_review` with the evidence.
//! - **Timeouts.** An effect step not settled by its deadline starts compensation
//!   ([`Orchestrator::expire_due`]); when it commits after that, its success is compensated
//!   too (a late charge refunded, a late shipment cancelled) and the saga is `compensated`
//!   only once nothing of it is outstanding: nothing ends both confirmed and compensated.
//! - **Cancel and retry.** [`Orchestrator::cancel`] compensates a saga before its pivot
//!   was issued (the step in flight is treated as timed out); [`Orchestrator::retry`] puts
//!   a parked saga's step back to work, audited in `oncely_saga_audit` (migration 0028).
//!
//! # Layout
//! - `definition` — [`SagaDefinition`], [`SagaBuilder`], [`Step`], [`Action`],
//!   [`EffectStep`], [`StepContext`], [`Role`], [`StepError`], [`DefinitionError`]: the
//!   typed definition and its order rules.
//! - `orchestrator` — [`Orchestrator`], [`OrchestratorConfig`], [`NewSaga`], [`Started`],
//!   [`Cancelled`], [`SagaError`]: starting and cancelling sagas, continuing them when
//!   effects settle, the timeout sweep, reads, gauges.
//! - `operator` — [`SagaOperator`], [`SagaAudit`], [`Retried`] and
//!   [`Orchestrator::retry`]: the operators' reads across tenants and the audited retry of
//!   a parked step (`oncely saga list|show|retry`).
//! - `engine` — the state machine over one claimed saga (forward, compensate, settle,
//!   expire).
//! - `store` — the saga tables' SQL (and the operators' audit, migration 0028), portable
//!   through `oncely_sql::query`.
//! - `metrics` — the metric names.

mod definition;
mod engine;
pub mod metrics;
mod operator;
mod orchestrator;
#[cfg(test)]
mod plans;
mod store;

pub use definition::{
    Action, DefinitionError, EffectStep, LocalFn, ParamsFn, Role, SagaBuilder, SagaDefinition,
    Step, StepContext, StepError,
};
pub use operator::{Retried, SagaAudit, SagaOperator, StepInReview};
pub use orchestrator::{Cancelled, NewSaga, Orchestrator, OrchestratorConfig, SagaError, Started};

oncely_core::stored_words! {
    /// A saga's state: `running` → `completed`, or `running` → `compensating` →
    /// `compensated`; `needs_review` when a person must decide (a compensation refused or
    /// unresolved, a retriable step exhausted, a late success that cannot be undone).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum SagaState {
        /// Going forward.
        Running => "running",
        /// Undoing the completed steps, newest first.
        Compensating => "compensating",
        /// Every step succeeded.
        Completed => "completed",
        /// Every completed step was compensated and nothing is outstanding.
        Compensated => "compensated",
        /// Parked for a person, with the evidence in the step log.
        NeedsReview => "needs_review",
    }
}

oncely_core::stored_words! {
    /// A step-log row's state.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum StepState {
        /// Started; an effect step waits for its effect to settle.
        Running => "running",
        /// Done (a forward step's output recorded).
        Succeeded => "succeeded",
        /// Refused for good.
        Failed => "failed",
        /// Not settled by its deadline: compensation started; its effect may still land.
        TimedOut => "timed_out",
        /// Parked for a person.
        NeedsReview => "needs_review",
    }
}

oncely_core::stored_words! {
    /// Whether a step-log row is a step's forward run or its compensation.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum Phase {
        /// The step itself.
        Forward => "forward",
        /// Its compensation.
        Compensate => "compensate",
    }
}

/// A saga as stored ([`Orchestrator::get`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Saga {
    /// Its id (the caller's, e.g. derived from the order it serves).
    pub id: String,
    /// The tenant it runs for.
    pub tenant: String,
    /// Its definition's kind.
    pub kind: String,
    /// Its state.
    pub state: SagaState,
    /// Raised by every transition.
    pub version: i64,
    /// The current step's index: the step running (forward) or being compensated; -1 once
    /// a compensation walked past the first step.
    pub step: i64,
    /// The input it was started with.
    pub input: serde_json::Value,
    /// Why it compensates or needs review.
    pub error: Option<String>,
    /// The current step's deadline, Unix ms.
    pub deadline: Option<i64>,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms.
    pub updated_at: i64,
}

/// One row of a saga's step log ([`Orchestrator::steps`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// The saga's id.
    pub saga_id: String,
    /// The step's index in its definition.
    pub step: i64,
    /// Forward or compensation.
    pub phase: Phase,
    /// The step's name.
    pub name: String,
    /// Its state.
    pub state: StepState,
    /// Issues of the step (a retriable step's re-issues count up).
    pub attempts: i64,
    /// The effect of its latest issue (effect steps).
    pub effect_id: Option<String>,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub finished_at: Option<i64>,
    /// Its output: the provider's object, or the local step's value.
    pub output: Option<serde_json::Value>,
    /// What was seen when it did not simply succeed (the refusal, the timeout, the late
    /// commit), for the person who reviews it.
    pub evidence: Option<String>,
}
