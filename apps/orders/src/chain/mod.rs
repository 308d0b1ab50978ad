//! The whole chain of one order, read from the durable stores on every backend: the
//! request's idempotency record, the order, its events, their deliveries, its invoices,
//! every effect of every path (the choreography's charge and booking, the saga steps'
//! effects, the payments endpoint's charge) with its evidence, and its saga — and the same
//! as a [`Step`] timeline. The console's order page and `orders show` draw it.
//!
//! Nothing is read from rows that go away on their own in normal operation: the key is the
//! order's own (`orders.idempotency_key`), an event's id is derived as its producer derives
//! it, and its publication is known from the outbox row while it exists, from its
//! consumers' inbox rows and from what its consumer made (the invoice that names it) after.
//! Every read names the tenant: another tenant's order is not found.
//!
//! - `mod.rs` — [`OrderChain`], [`order_chain`], [`search_orders`] and the parts' types;
//! - `read` — the reads of each part;
//! - `timeline` — [`Step`]s from the parts, in time order, and [`StepState`].

mod read;
mod timeline;

use oncely_core::TenantId;
use oncely_sql::{Database, StoreError};
use serde::Serialize;

/// A comma-separated select list of `columns`, each read as text (the console's readers
/// and the order chain's).
pub(crate) fn text(db: &Database, columns: &[&str]) -> String {
    columns
        .iter()
        .map(|c| db.backend().text_column(c).into_owned())
        .collect::<Vec<_>>()
        .join(", ")
}

pub use timeline::{Step, StepState};

/// A time: Unix ms stored, RFC 3339 shown (`2026-12-04T18:20:01.250Z`, UTC, RFC 3339 §5.6)
/// in JSON and text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Time(pub i64);

impl std::fmt::Display for Time {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&oncely_core::rfc3339(self.0))
    }
}

impl Serialize for Time {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The order itself, with its status ([`crate`]'s one vocabulary: `created`, `paid`,
/// `fulfilled`, …).
#[derive(Debug, Clone, Serialize)]
pub struct ChainOrder {
    /// Its id (a UUIDv7).
    pub id: String,
    /// The tenant that owns it.
    pub tenant: String,
    /// Business key: the source system…
    pub source: String,
    /// …and its reference there.
    pub external_ref: String,
    /// Total in minor units of `currency`.
    pub amount_minor: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The `Idempotency-Key` of the request that created it (`None`: sent without one, or
    /// created before the key was kept with the order).
    pub idempotency_key: Option<String>,
    /// `created`, `paid`, `fulfilled`, `processing`, `compensating`, `rejected`,
    /// `cancelled`, `needs_review` (as `GET /v1/orders/{id}` says).
    pub status: &'static str,
    /// When it was stored.
    pub created_at: Time,
}

/// The idempotency record of the request that created the order, while it is kept (until
/// its retention ends).
#[derive(Debug, Clone, Serialize)]
pub struct ChainRecord {
    /// The operation it guards (`POST /v1/orders`).
    pub operation: String,
    /// `processing`, `succeeded`, `failed`, `unknown`.
    pub state: &'static str,
    /// The stored answer's HTTP status, once final.
    pub response_status: Option<u16>,
    /// When the request reserved the key.
    pub created_at: Time,
    /// When its answer was stored.
    pub completed_at: Option<Time>,
    /// When the collector may delete it.
    pub expires_at: Option<Time>,
}

/// One event of the order (outbox message): while its outbox row exists, its state there;
/// after, `published` (the relay deletes a row once its broker took it).
#[derive(Debug, Clone, Serialize)]
pub struct ChainEvent {
    /// Its message id (derived, as its producer derives it).
    pub message_id: String,
    /// `order.created`, `invoice.paid`.
    pub event_type: String,
    /// `pending`, `published`, `dead`.
    pub state: String,
    /// Publish attempts (from the outbox row; 0 once it is gone).
    pub attempts: u32,
    /// The relay's latest error.
    pub last_error: Option<String>,
    /// When it was written (with the business change that made it).
    pub created_at: Time,
    /// When it was published, when known.
    pub published_at: Option<Time>,
    /// `outbox` (its row was read) or `derived` (its row is gone after publication).
    pub seen_in: &'static str,
}

/// One consumer's receipt of one of the order's messages.
#[derive(Debug, Clone, Serialize)]
pub struct ChainDelivery {
    /// The consumer group (`billing`, `shipping`, `fulfilment`).
    pub consumer: String,
    /// The message id.
    pub message_id: String,
    /// The event type, when known.
    pub event_type: Option<String>,
    /// `processed` (its inbox row: handled once), or the SQL transport's delivery state
    /// (`ready`, `leased`, `dead`) while not acknowledged.
    pub state: String,
    /// Delivery attempts (SQL transport, not yet acknowledged).
    pub attempts: i32,
    /// The handler's latest error.
    pub last_error: Option<String>,
    /// When the consumer recorded it (inbox rows).
    pub received_at: Option<Time>,
}

/// An invoice of the order.
#[derive(Debug, Clone, Serialize)]
pub struct ChainInvoice {
    /// Its id (the charge's reference under the choreography).
    pub id: String,
    /// `order` for the order's own invoice.
    pub kind: String,
    /// Total in minor units of `currency`.
    pub amount_minor: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The message it was made from (`order.created`, or derived from the saga).
    pub message_id: String,
    /// When it was made.
    pub created_at: Time,
    /// When it was paid.
    pub paid_at: Option<Time>,
    /// The provider's payment id.
    pub payment_id: Option<String>,
}

/// One call or status check an effect or a payment made, as recorded before and after it.
#[derive(Debug, Clone, Serialize)]
pub struct Evidence {
    /// `call` or `status`.
    pub kind: String,
    /// What was found (`succeeded`, `timeout`, `refused`, …).
    pub outcome: String,
    /// The provider's HTTP status.
    pub http_status: Option<i64>,
    /// The provider ids seen.
    pub provider_ids: String,
    /// The key sent.
    pub key: String,
    /// What else was seen.
    pub detail: String,
    /// When it started.
    pub started_at: Time,
    /// When it ended (`None`: it never did — the process died during the call).
    pub finished_at: Option<Time>,
}

/// Which path of the service made an effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectPath {
    /// The choreography's consumers (billing's charge, shipping's booking).
    Choreography,
    /// A step of the fulfilment saga (its effect, or a compensation's).
    Saga,
    /// `POST /v1/orders/{id}/payments` (multi-phase, synchronous).
    Endpoint,
}

impl EffectPath {
    /// The word shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Choreography => "choreography",
            Self::Saga => "saga",
            Self::Endpoint => "endpoint",
        }
    }
}

/// One outgoing call of the order's flow: an effect (`oncely_effects`) or the payments
/// endpoint's charge, with its evidence.
#[derive(Debug, Clone, Serialize)]
pub struct ChainEffect {
    /// Which path made it.
    pub path: EffectPath,
    /// The saga step it serves (saga path).
    pub saga_step: Option<String>,
    /// Its id (the effect's; the order id for the endpoint's payment).
    pub id: String,
    /// `payments`, `shipping`.
    pub provider: String,
    /// `charge`, `refund`, `book`, `cancel`.
    pub operation: String,
    /// Its business reference.
    pub reference: String,
    /// The idempotency key sent to the provider.
    pub key: String,
    /// The effect's state word (`pending`, `in_flight`, `succeeded`, `failed`, `unknown`,
    /// `absent`, `needs_review`), or the payment's (`charging`, `succeeded`, `declined`,
    /// `unknown`, `not_charged`).
    pub state: String,
    /// Calls that counted.
    pub attempts: i64,
    /// The provider's object id, once known.
    pub provider_id: Option<String>,
    /// What the latest attempt found, when not a success.
    pub last_error: Option<String>,
    /// When it was recorded.
    pub created_at: Time,
    /// When it last changed.
    pub updated_at: Time,
    /// Every call and status check, in order.
    pub evidence: Vec<Evidence>,
}

/// One row of a saga's step log.
#[derive(Debug, Clone, Serialize)]
pub struct ChainSagaStep {
    /// The step's name.
    pub name: String,
    /// `forward` or `compensate`.
    pub phase: String,
    /// `running`, `succeeded`, `failed`, `timed_out`, `needs_review`.
    pub state: String,
    /// Issues of the step.
    pub attempts: i64,
    /// The effect of its latest issue.
    pub effect_id: Option<String>,
    /// When it started.
    pub started_at: Time,
    /// When it ended.
    pub finished_at: Option<Time>,
    /// What was seen when it did not simply succeed.
    pub evidence: Option<String>,
}

/// The order's fulfilment saga.
#[derive(Debug, Clone, Serialize)]
pub struct ChainSaga {
    /// Its id (the order's).
    pub id: String,
    /// Its definition's kind.
    pub kind: String,
    /// `running`, `compensating`, `completed`, `compensated`, `needs_review`.
    pub state: String,
    /// Why it compensates or needs review.
    pub error: Option<String>,
    /// When it started.
    pub created_at: Time,
    /// When it last moved.
    pub updated_at: Time,
    /// Its step log.
    pub steps: Vec<ChainSagaStep>,
}

/// Everything the service holds about one order, and its [`Step`] timeline.
#[derive(Debug, Clone, Serialize)]
pub struct OrderChain {
    /// The order.
    pub order: ChainOrder,
    /// The creating request's idempotency record (`None`: no key, or collected after its
    /// retention).
    pub record: Option<ChainRecord>,
    /// Its events.
    pub events: Vec<ChainEvent>,
    /// Its events' deliveries to the service's consumers.
    pub deliveries: Vec<ChainDelivery>,
    /// Its invoices.
    pub invoices: Vec<ChainInvoice>,
    /// Every effect of every path, oldest first.
    pub effects: Vec<ChainEffect>,
    /// Its saga (saga mode).
    pub sagas: Vec<ChainSaga>,
    /// All of the above as one timeline, in time order.
    pub timeline: Vec<Step>,
}

/// The chain of `tenant`'s order `id`; `None` when the tenant has no such order (another
/// tenant's included).
///
/// # Errors
/// [`StoreError`] when the database fails or a row does not decode.
pub async fn order_chain(
    db: &Database,
    tenant: &TenantId,
    id: &str,
) -> Result<Option<OrderChain>, StoreError> {
    let Some(row) = read::order(db, tenant.as_str(), id).await? else {
        return Ok(None);
    };
    let invoices = read::invoices(db, tenant.as_str(), id).await?;
    let sagas = read::sagas(db, tenant.as_str(), id).await?;
    let effects = read::effects(db, tenant.as_str(), id, &invoices, &sagas).await?;
    let record = match &row.idempotency_key {
        Some(key) => read::record(db, tenant, key).await?,
        None => None,
    };
    let events = read::events(db, tenant, &row, &invoices, sagas.is_empty()).await?;
    let deliveries = read::deliveries(db, id, &events).await?;
    let order = row.into_order(&invoices, &effects, &sagas);
    let mut chain = OrderChain {
        order,
        record,
        events,
        deliveries,
        invoices,
        effects,
        sagas,
        timeline: Vec::new(),
    };
    chain.timeline = timeline::steps(&chain);
    Ok(Some(chain))
}

/// An order a search found.
#[derive(Debug, Clone, Serialize)]
pub struct OrderHit {
    /// Its id.
    pub id: String,
    /// Its source system.
    pub source: String,
    /// Its reference there.
    pub external_ref: String,
    /// The creating request's key.
    pub idempotency_key: Option<String>,
    /// Total in minor units of `currency`.
    pub amount_minor: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// When it was stored.
    pub created_at: Time,
}

/// Most orders a search returns.
pub const SEARCH_LIMIT: u32 = 50;

/// `tenant`'s orders whose id, external reference or idempotency key is exactly `text`,
/// newest first, at most [`SEARCH_LIMIT`]. Another tenant's orders are never found.
///
/// # Errors
/// [`StoreError`] when the database fails.
pub async fn search_orders(
    db: &Database,
    tenant: &TenantId,
    text: &str,
) -> Result<Vec<OrderHit>, StoreError> {
    read::search(db, tenant.as_str(), text.trim(), SEARCH_LIMIT).await
}
