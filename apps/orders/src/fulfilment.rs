//! The order-fulfilment saga (docs/DESIGN.md "Sagas"), one per order, started by
//! `order.created`: reserve stock (local, compensated by releasing it) → charge
//! (`payments`/`charge`, compensated by `payments`/`refund`) → ship, the pivot
//! (`shipping`/`book`; its `shipping`/`cancel` only undoes a booking that lands after its
//! timeout) → invoice (local, retriable: the paid invoice, the reservation consumed).
//! Out of stock, a declined card or a refused shipment (422) ends the order `rejected`
//! with the earlier steps compensated; `POST /v1/orders/{id}/cancel` compensates before
//! the pivot and answers 409 after it.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures_util::future::BoxFuture;
use http::StatusCode;
use oncely_broker::{ReceivedMessage, Subscriber};
use oncely_core::{RetryPolicy, TenantId};
use oncely_effects::EffectHandler;
use oncely_http::{Path, Problem, StoreFailure};
use oncely_inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Rejected};
use oncely_saga::{
    Action, Cancelled, NewSaga, Orchestrator, OrchestratorConfig, SagaDefinition, SagaError,
    SagaState, Step, StepContext, StepError,
};
use oncely_sql::{query, Database, Tx};
use serde_json::{json, Value};

use crate::events::{decode, ORDER_CREATED};
pub use crate::flow::REFUND;
use crate::flow::{BOOK, CHARGE, PAYMENTS, SHIPPING};
use crate::saga_view::CANCELLED;
use crate::stock;

/// Name of the fulfilment consumer (its consumer group and inbox): it starts one saga per
/// `order.created`.
pub const FULFILMENT_CONSUMER: &str = "fulfilment";
/// The fulfilment saga's kind (`oncely_sagas.kind`).
pub const ORDER_SAGA: &str = "order";
/// Operation of a late shipment's compensation.
pub const CANCEL: &str = "cancel";

/// How the service fulfils an order after `order.created`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Fulfilment {
    /// Issue 16's choreography: `billing` (invoice + charge) → `invoice.paid` →
    /// `shipping` (booking), each consumer on its own; no stock, no compensation.
    #[default]
    Choreography,
    /// The orchestrated saga of this module (consumer [`FULFILMENT_CONSUMER`]).
    Saga,
}

/// Settings of the fulfilment saga.
#[derive(Debug, Clone)]
pub struct FulfilmentConfig {
    /// Which fulfilment runs. Default [`Fulfilment::Choreography`].
    pub mode: Fulfilment,
    /// The charge not settled within this starts compensation (a late charge is
    /// refunded). Default 300 s.
    pub charge_timeout: Duration,
    /// The booking not settled within this starts compensation (a late booking is
    /// cancelled). Default 300 s.
    pub ship_timeout: Duration,
}

impl Default for FulfilmentConfig {
    fn default() -> Self {
        Self {
            mode: Fulfilment::default(),
            charge_timeout: Duration::from_secs(300),
            ship_timeout: Duration::from_secs(300),
        }
    }
}

/// The saga definitions of the order service with default settings (for operator
/// commands: `oncely saga retry` runs a parked local step of these again).
pub fn saga_definitions() -> Vec<SagaDefinition> {
    vec![definition(&FulfilmentConfig::default())]
}

fn text<'v>(v: &'v Value, what: &str) -> Result<&'v str, StepError> {
    v.as_str()
        .ok_or_else(|| StepError::Refused(format!("the order has no {what}")))
}

fn reserve() -> Step {
    Step::local("reserve", |tx: &mut Tx, ctx: &StepContext| {
        Box::pin(async move {
            let lines = stock::lines(&ctx.input["items"])?;
            let order = text(&ctx.input["id"], "id")?;
            stock::reserve(tx, &ctx.tenant, order, &lines).await
        })
    })
    .compensated_by(Action::local(|tx: &mut Tx, ctx: &StepContext| {
        Box::pin(async move {
            let order = text(&ctx.input["id"], "id")?;
            Ok(stock::end_reservations(tx, &ctx.tenant, order, true).await?)
        })
    }))
}

fn charge(timeout: Duration) -> Step {
    Step::effect("charge", PAYMENTS, CHARGE, |ctx| {
        let currency = text(&ctx.input["currency"], "currency")?.to_ascii_lowercase();
        let mut params = json!({
            "amount": ctx.input["amount_minor"],
            "currency": currency,
            "metadata": {"order_id": ctx.input["id"]},
        });
        if let Some(method) = ctx.input["payment_method"].as_str() {
            params["payment_method"] = method.into();
        }
        Ok(params)
    })
    .timeout(timeout)
    .compensated_by(Action::effect(PAYMENTS, REFUND, |ctx| {
        let intent = ctx
            .output("charge")
            .and_then(|o| o["id"].as_str())
            .ok_or_else(|| StepError::Refused("no PaymentIntent to refund".into()))?;
        Ok(json!({"payment_intent": intent}))
    }))
}

fn ship(timeout: Duration) -> Step {
    Step::effect("ship", SHIPPING, BOOK, |ctx| {
        Ok(json!({"order_id": ctx.input["id"], "items": ctx.input["items"]}))
    })
    .timeout(timeout)
    // Used only when the booking commits after its timeout started compensation.
    .compensated_by(Action::effect(SHIPPING, CANCEL, |ctx| {
        let id = ctx
            .output("ship")
            .and_then(|o| o["id"].as_str())
            .ok_or_else(|| StepError::Refused("no shipment to cancel".into()))?;
        Ok(json!({"shipment_id": id}))
    }))
}

/// The paid invoice (`UNIQUE(order_id, kind)` keeps it one) and the reservations
/// consumed: stock leaves for good.
fn invoice() -> Step {
    Step::local("invoice", |tx: &mut Tx, ctx: &StepContext| {
        Box::pin(async move {
            let order = text(&ctx.input["id"], "id")?;
            let payment_id = ctx.output("charge").and_then(|o| o["id"].as_str());
            let now = oncely_core::now_ms();
            let id = uuid::Uuid::now_v7().to_string();
            tx.insert_ignoring_duplicate(
                query(
                    "INSERT INTO invoices (id, tenant, order_id, kind, amount_minor, currency, \
                     message_id, created_at, correlation_id, paid_at, payment_id) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                )
                .bind(id.as_str())
                .bind(ctx.tenant.as_str())
                .bind(order)
                .bind(crate::INVOICE_KIND_ORDER)
                .bind(ctx.input["amount_minor"].as_i64().unwrap_or(0))
                .bind(text(&ctx.input["currency"], "currency")?)
                // The invoice's origin: an id derived from the saga (a UUID, as the
                // choreography's message ids).
                .bind(
                    oncely_core::MessageId::derive_from_parts(&[ORDER_SAGA, &ctx.saga_id])
                        .to_string(),
                )
                .bind(now)
                .bind(order)
                .bind(now)
                .bind(payment_id),
                "(order_id, kind)",
            )
            .await?;
            let consumed = stock::end_reservations(tx, &ctx.tenant, order, false).await?;
            Ok(json!({"invoice_id": id, "stock": consumed}))
        })
    })
    .retry(RetryPolicy::default())
}

/// The fulfilment saga: reserve → charge → ship (pivot) → invoice (retriable).
///
/// # Panics
/// Never: the definition is checked by its own unit test.
pub fn definition(config: &FulfilmentConfig) -> SagaDefinition {
    SagaDefinition::builder(ORDER_SAGA)
        .compensable(reserve())
        .compensable(charge(config.charge_timeout))
        .pivot(ship(config.ship_timeout))
        .retriable(invoice())
        .build()
        .expect("the fulfilment saga's steps are in compensable -> pivot -> retriable order")
}

/// The orchestrator of the fulfilment saga over `db`, handing effects that are no saga's
/// (the choreography's) to `inner` (e.g. [`crate::OrderEffects`]). It is the effect
/// runner's handler; run its timeout sweep with [`Orchestrator::run`].
///
/// # Panics
/// Never: it holds one definition.
pub fn orchestrator(
    db: Database,
    config: &FulfilmentConfig,
    orchestrator: OrchestratorConfig,
    inner: Arc<dyn EffectHandler>,
) -> Orchestrator {
    Orchestrator::new(db, vec![definition(config)], orchestrator)
        .expect("one definition has no duplicate kind")
        .chain(inner)
}

/// The handler an operator's resolution (`oncely effects resolve`, the console) and a
/// reconciler complete an effect with, whichever way the service fulfils orders: an effect
/// of a fulfilment saga's step continues its saga (the steps it schedules next get the
/// default [`FulfilmentConfig`] timeouts), any other effect gets the choreography's
/// completion, [`crate::OrderEffects`] (an invoice paid and `invoice.paid` to
/// `events_topic`). Resolving a saga's charge with the choreography's handler alone would
/// leave its saga waiting on a step that is already settled.
pub fn resolution_handler(db: Database, events_topic: &str) -> Arc<dyn EffectHandler> {
    Arc::new(orchestrator(
        db,
        &FulfilmentConfig::default(),
        OrchestratorConfig::default(),
        Arc::new(crate::OrderEffects::new(events_topic)),
    ))
}

/// The `fulfilment` handler: for each `order.created`, starts the order's saga (id = the
/// order id, input = the event's payload, the order as created) in the consumer's
/// transaction; its first step, the stock reservation, commits with the inbox row. A
/// redelivered event finds the saga and records nothing. Other event types are
/// acknowledged; an `order.created` that does not decode or has no tenant is
/// [`Rejected`].
#[derive(Debug, Clone)]
pub struct FulfilmentHandler {
    orchestrator: Arc<Orchestrator>,
}

impl FulfilmentHandler {
    /// A handler starting sagas with `orchestrator` (see [`orchestrator`]).
    pub fn new(orchestrator: Arc<Orchestrator>) -> Self {
        Self { orchestrator }
    }
}

impl Handler for FulfilmentHandler {
    fn handle<'a>(
        &'a self,
        tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let Some((order, tenant)) = decode::<Value>(message, ORDER_CREATED)? else {
                return Ok(());
            };
            let id = order["id"]
                .as_str()
                .ok_or_else(|| Rejected("order.created without an id".to_owned()))?;
            let new = NewSaga {
                id,
                tenant,
                kind: ORDER_SAGA,
                input: &order,
            };
            match self.orchestrator.start(tx, &new).await {
                Ok(_) => Ok(()),
                Err(SagaError::Store(e)) => Err(e.into()),
                Err(e) => Err(Rejected(format!("order.created: {e}")).into()),
            }
        })
    }
}

/// The fulfilment consumer over `subscriber` (consumer group [`FULFILMENT_CONSUMER`] of
/// the order service's events topic). Call [`Consumer::subscribe`] before running it.
pub fn fulfilment_consumer<S: Subscriber>(
    db: Database,
    subscriber: S,
    config: ConsumerConfig,
    orchestrator: Arc<Orchestrator>,
) -> Consumer<S> {
    Consumer::new(
        db,
        subscriber,
        Arc::new(FulfilmentHandler::new(orchestrator)),
        config,
    )
}

/// What the cancel handler needs: the mode and an orchestrator (no runner: a cancel only
/// records the compensation's intents).
#[derive(Clone, Debug)]
pub(crate) struct CancelSettings {
    pub(crate) mode: Fulfilment,
    pub(crate) orchestrator: Arc<Orchestrator>,
}

fn not_cancellable(detail: String, state: Option<SagaState>) -> Response {
    let mut p = Problem::new(
        StatusCode::CONFLICT,
        crate::problem::ORDER_NOT_CANCELLABLE,
        "The order can no longer be cancelled",
    )
    .detail(detail);
    if let Some(s) = state {
        p = p.with("saga_state", s.as_str());
    }
    p.into_response()
}

/// `POST /v1/orders/{id}/cancel`: before the saga's pivot (the shipment booking) was
/// issued, compensation starts — a charge in flight is refunded if it lands, the stock is
/// released — and the order is answered as `GET` shows it (`compensating`, then
/// `cancelled`); an order whose saga has not started yet is recorded cancelled, so it
/// never starts. Repeating the request changes nothing more. After the pivot, or for an
/// order fulfilled, in review or under the choreography: 409 problem
/// (`order-not-cancellable`). Another tenant's or an unknown order (or an id that is not
/// a UUID, never sent to the database): 404.
#[utoipa::path(
    post,
    path = "/v1/orders/{id}/cancel",
    tag = "orders",
    operation_id = "cancel_order",
    summary = "Cancel an order before its shipment is booked",
    params(("id" = String, Path, description = "The order's id, from `Location`")),
    responses(
        (status = 200, description = "The order, compensating or cancelled",
            body = crate::orders::OrderView),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "not-found: no such order in the caller's tenant",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 409, description = "order-not-cancellable: past the pivot, or not a saga",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 500, description = "store-error or internal", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable or server-busy",
            body = crate::schema::Problem, content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn cancel_order(
    State(db): State<Database>,
    axum::Extension(tenant): axum::Extension<TenantId>,
    axum::Extension(settings): axum::Extension<CancelSettings>,
    Path(id): Path<String>,
) -> Response {
    let order = if uuid::Uuid::try_parse(&id).is_ok() {
        crate::orders::order_json(&db, &tenant, &id).await
    } else {
        Ok(None)
    };
    let order = match order {
        Ok(Some(o)) => o,
        Ok(None) => {
            return Problem::new(
                StatusCode::NOT_FOUND,
                crate::problem::NOT_FOUND,
                "No such order",
            )
            .into_response()
        }
        Err(e) => return StoreFailure::from(e).into_response(),
    };
    if settings.mode != Fulfilment::Saga {
        return not_cancellable(
            "orders fulfilled by the choreography cannot be cancelled".to_owned(),
            None,
        );
    }
    match cancel_in_tx(&db, &settings.orchestrator, tenant.as_str(), &id, &order).await {
        Ok(Ok(())) => {
            crate::orders::get_order(
                State(db),
                axum::Extension(tenant),
                Ok(axum::extract::Path(id)),
            )
            .await
        }
        Ok(Err(state)) => not_cancellable(
            format!("its fulfilment is {state}: past the pivot, nothing is undone"),
            Some(state),
        ),
        Err(SagaError::Store(e)) => StoreFailure::from(e).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cancel failed");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                crate::problem::INTERNAL,
                "The order could not be cancelled",
            )
            .into_response()
        }
    }
}

/// Cancels (or records cancelled) the saga of order `id` in one transaction; the saga's
/// state when it was not cancellable.
async fn cancel_in_tx(
    db: &Database,
    orchestrator: &Orchestrator,
    tenant: &str,
    id: &str,
    order: &Value,
) -> Result<Result<(), SagaState>, SagaError> {
    let mut tx = db.begin().await?;
    let outcome = match orchestrator.cancel(&mut tx, tenant, id, CANCELLED).await? {
        Some(Cancelled::Refused(state)) => return Ok(Err(state)),
        Some(_) => Ok(()),
        None => {
            let new = NewSaga {
                id,
                tenant,
                kind: ORDER_SAGA,
                input: order,
            };
            orchestrator
                .start_cancelled(&mut tx, &new, CANCELLED)
                .await?;
            Ok(())
        }
    };
    tx.commit().await?;
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fulfilment_saga_is_a_valid_definition() {
        let def = super::definition(&super::FulfilmentConfig::default());
        let names: Vec<_> = def.steps().iter().map(oncely_saga::Step::name).collect();
        assert_eq!(names, ["reserve", "charge", "ship", "invoice"]);
    }
}
