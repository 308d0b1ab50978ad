//! An order's saga as `GET /v1/orders/{id}` shows it (`fulfilment`): a leaf the order view
//! embeds, apart from the saga's definition and the cancel handler, which show the order.

use oncely_saga::SagaOperator;
use oncely_sql::{Database, StoreError};
use serde::Serialize;

use crate::status::OrderStatus;

/// An order's saga as `GET /v1/orders/{id}` shows it (`fulfilment`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SagaView {
    saga_id: String,
    /// `running`, `compensating`, `completed`, `compensated`, `needs_review`.
    state: &'static str,
    /// Why it compensated or waits for review.
    error: Option<String>,
    steps: Vec<StepView>,
}

/// One row of the saga's step log.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct StepView {
    name: String,
    /// `forward` or `compensate`.
    phase: &'static str,
    state: &'static str,
    attempts: i64,
    effect_id: Option<String>,
    started_at: i64,
    finished_at: Option<i64>,
    evidence: Option<String>,
}

impl SagaView {
    /// The order's status the saga gives it: `processing`, `compensating`, `fulfilled`,
    /// `rejected`, `cancelled` or `needs_review`.
    pub(crate) fn order_status(&self) -> OrderStatus {
        OrderStatus::of_saga(self.state, self.error.as_deref() == Some(CANCELLED))
    }
}

/// The saga of `tenant`'s order `id`, if one was started.
///
/// # Errors
/// [`StoreError`] when the database fails.
pub(crate) async fn view(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Option<SagaView>, StoreError> {
    let sagas = SagaOperator::new(db.clone());
    let Some(saga) = sagas.get(id).await?.filter(|s| s.tenant == tenant) else {
        return Ok(None);
    };
    let steps = sagas
        .steps(id)
        .await?
        .into_iter()
        .map(|s| StepView {
            name: s.name,
            phase: s.phase.as_str(),
            state: s.state.as_str(),
            attempts: s.attempts,
            effect_id: s.effect_id,
            started_at: s.started_at,
            finished_at: s.finished_at,
            evidence: s.evidence,
        })
        .collect();
    Ok(Some(SagaView {
        saga_id: saga.id,
        state: saga.state.as_str(),
        error: saga.error,
        steps,
    }))
}

/// The reason a client's cancel records (the saga's `error`).
pub(crate) const CANCELLED: &str = "cancelled by the client";
