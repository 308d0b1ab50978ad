//! The reads of an order's chain: the service's tables (`orders`, `invoices`,
//! `order_payments`) with portable SQL, text columns through
//! [`Backend::text_column`](oncely_sql::Backend::text_column); oncely's through their stores.

use oncely_core::{IdempotencyKey, MessageId, Operation, Scope, TenantId};
use oncely_saga::SagaOperator;
use oncely_sql::{query, Database, EffectState, EffectStore, IdempotencyStore, StoreError};

use super::{
    text, ChainDelivery, ChainEffect, ChainEvent, ChainInvoice, ChainOrder, ChainRecord, ChainSaga,
    ChainSagaStep, EffectPath, Evidence, OrderHit, Time,
};
use crate::status::OrderStatus;

/// The order's row.
#[derive(Debug, sqlx::FromRow)]
pub(super) struct OrderRow {
    id: String,
    tenant: String,
    source: String,
    external_ref: String,
    amount_minor: i64,
    currency: String,
    pub(super) idempotency_key: Option<String>,
    created_at: i64,
}

impl OrderRow {
    /// The order with its status, from what its flow made.
    pub(super) fn into_order(
        self,
        invoices: &[ChainInvoice],
        effects: &[ChainEffect],
        sagas: &[ChainSaga],
    ) -> ChainOrder {
        let status = status(invoices, effects, sagas);
        ChainOrder {
            id: self.id,
            tenant: self.tenant,
            source: self.source,
            external_ref: self.external_ref,
            amount_minor: self.amount_minor,
            currency: self.currency,
            idempotency_key: self.idempotency_key,
            status: status.as_str(),
            created_at: Time(self.created_at),
        }
    }
}

/// The order's status: its saga's, else the choreography's from its invoice and effects.
fn status(invoices: &[ChainInvoice], effects: &[ChainEffect], sagas: &[ChainSaga]) -> OrderStatus {
    if let Some(s) = sagas.first() {
        return OrderStatus::of_saga(
            &s.state,
            s.error.as_deref() == Some(crate::saga_view::CANCELLED),
        );
    }
    let state = |provider: &str, operation: &str| {
        effects
            .iter()
            .find(|e| {
                e.path == EffectPath::Choreography
                    && e.provider == provider
                    && e.operation == operation
            })
            .and_then(|e| EffectState::parse(&e.state).ok())
    };
    OrderStatus::of_flow(
        invoices.iter().any(|i| i.paid_at.is_some()),
        state(crate::PAYMENTS, crate::CHARGE),
        state(crate::SHIPPING, crate::BOOK),
    )
}

fn order_columns(db: &Database) -> String {
    text(
        db,
        &[
            "id",
            "tenant",
            "source",
            "external_ref",
            "currency",
            "idempotency_key",
        ],
    ) + ", amount_minor, created_at"
}

/// `tenant`'s order `id`.
pub(super) async fn order(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Option<OrderRow>, StoreError> {
    // Order ids are UUIDs: anything else names no order and is never sent to the database.
    if uuid::Uuid::try_parse(id).is_err() {
        return Ok(None);
    }
    let sql = format!(
        "SELECT {} FROM orders WHERE id = $1 AND tenant = $2",
        order_columns(db)
    );
    db.fetch_optional(query(sql).bind(id).bind(tenant)).await
}

/// `tenant`'s orders whose id, external reference or key is `text`, newest first.
pub(super) async fn search(
    db: &Database,
    tenant: &str,
    text: &str,
    limit: u32,
) -> Result<Vec<OrderHit>, StoreError> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    // The id compared only when it is one: PostgreSQL refuses a NUL in text, and an id is
    // a UUID. Each placeholder once and in order (MySQL binds by position).
    let is_id = uuid::Uuid::try_parse(text).is_ok();
    let (filter, limit_at) = if is_id {
        ("id = $2 OR external_ref = $3 OR idempotency_key = $4", 5)
    } else {
        ("external_ref = $2 OR idempotency_key = $3", 4)
    };
    let sql = format!(
        "SELECT {} FROM orders WHERE tenant = $1 AND ({filter}) \
         ORDER BY created_at DESC, id DESC LIMIT ${limit_at}",
        order_columns(db)
    );
    let text = text.replace('\0', "");
    let mut q = query(sql).bind(tenant);
    if is_id {
        q = q.bind(text.as_str());
    }
    let q = q
        .bind(text.as_str())
        .bind(text.as_str())
        .bind(i64::from(limit));
    let rows: Vec<OrderRow> = db.fetch_all(q).await?;
    Ok(rows
        .into_iter()
        .map(|r| OrderHit {
            id: r.id,
            source: r.source,
            external_ref: r.external_ref,
            idempotency_key: r.idempotency_key,
            amount_minor: r.amount_minor,
            currency: r.currency,
            created_at: Time(r.created_at),
        })
        .collect())
}

#[derive(sqlx::FromRow)]
struct InvoiceRow {
    id: String,
    kind: String,
    amount_minor: i64,
    currency: String,
    message_id: String,
    created_at: i64,
    paid_at: Option<i64>,
    payment_id: Option<String>,
}

/// The order's invoices, oldest first.
pub(super) async fn invoices(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Vec<ChainInvoice>, StoreError> {
    let sql = format!(
        "SELECT {}, amount_minor, created_at, paid_at FROM invoices \
         WHERE order_id = $1 AND tenant = $2 ORDER BY created_at, id",
        text(db, &["id", "kind", "currency", "message_id", "payment_id"])
    );
    let rows: Vec<InvoiceRow> = db.fetch_all(query(sql).bind(id).bind(tenant)).await?;
    Ok(rows
        .into_iter()
        .map(|r| ChainInvoice {
            id: r.id,
            kind: r.kind,
            amount_minor: r.amount_minor,
            currency: r.currency,
            message_id: r.message_id,
            created_at: Time(r.created_at),
            paid_at: r.paid_at.map(Time),
            payment_id: r.payment_id,
        })
        .collect())
}

/// The order's saga (its id is the order's) with its step log.
pub(super) async fn sagas(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Vec<ChainSaga>, StoreError> {
    let operator = SagaOperator::new(db.clone());
    let Some(saga) = operator.get(id).await?.filter(|s| s.tenant == tenant) else {
        return Ok(Vec::new());
    };
    let steps = operator
        .steps(id)
        .await?
        .into_iter()
        .map(|s| ChainSagaStep {
            name: s.name,
            phase: s.phase.as_str().to_owned(),
            state: s.state.as_str().to_owned(),
            attempts: s.attempts,
            effect_id: s.effect_id,
            started_at: Time(s.started_at),
            finished_at: s.finished_at.map(Time),
            evidence: s.evidence,
        })
        .collect();
    Ok(vec![ChainSaga {
        id: saga.id,
        kind: saga.kind,
        state: saga.state.as_str().to_owned(),
        error: saga.error,
        created_at: Time(saga.created_at),
        updated_at: Time(saga.updated_at),
        steps,
    }])
}

/// Every effect of the order: the choreography's charge of each invoice and its booking,
/// each saga step's effect, the payments endpoint's charge; oldest first.
pub(super) async fn effects(
    db: &Database,
    tenant: &str,
    id: &str,
    invoices: &[ChainInvoice],
    sagas: &[ChainSaga],
) -> Result<Vec<ChainEffect>, StoreError> {
    let store = EffectStore::new(db.clone());
    let mut found: Vec<(EffectPath, Option<String>, oncely_sql::Effect)> = Vec::new();
    for i in invoices {
        if let Some(e) = store.find(crate::PAYMENTS, crate::CHARGE, &i.id).await? {
            found.push((EffectPath::Choreography, None, e));
        }
    }
    if let Some(e) = store.find(crate::SHIPPING, crate::BOOK, id).await? {
        found.push((EffectPath::Choreography, None, e));
    }
    for step in sagas.iter().flat_map(|s| &s.steps) {
        let Some(effect_id) = &step.effect_id else {
            continue;
        };
        if found.iter().any(|(_, _, e)| &e.id == effect_id) {
            continue;
        }
        if let Some(e) = store.get(effect_id).await? {
            found.push((EffectPath::Saga, Some(step.name.clone()), e));
        }
    }
    let mut out = Vec::new();
    for (path, saga_step, e) in found.into_iter().filter(|(_, _, e)| e.tenant == tenant) {
        let evidence = store
            .evidence(&e.id)
            .await?
            .into_iter()
            .map(|r| Evidence {
                kind: r.kind,
                outcome: r.outcome,
                http_status: r.http_status.map(i64::from),
                provider_ids: r.provider_ids,
                key: r.key,
                detail: r.detail,
                started_at: Time(r.started_at),
                finished_at: Some(Time(r.finished_at)),
            })
            .collect();
        out.push(ChainEffect {
            path,
            saga_step,
            id: e.id,
            provider: e.provider,
            operation: e.operation,
            reference: e.reference,
            key: e.key,
            state: e.state_word,
            attempts: i64::from(e.attempts),
            provider_id: e.provider_id,
            last_error: e.last_error,
            created_at: Time(e.created_at),
            updated_at: Time(e.updated_at),
            evidence,
        });
    }
    if let Some(p) = endpoint_payment(db, tenant, id).await? {
        out.push(p);
    }
    out.sort_by_key(|e| e.created_at);
    Ok(out)
}

/// The payments endpoint's charge of the order (`order_payments`, `via = endpoint`) with
/// its evidence (`order_payment_evidence`).
async fn endpoint_payment(
    db: &Database,
    tenant: &str,
    id: &str,
) -> Result<Option<ChainEffect>, StoreError> {
    let Some(p) = crate::payment_store::by_order(db, tenant, id).await? else {
        return Ok(None);
    };
    if p.via != crate::payment_store::VIA_ENDPOINT {
        // The flow's claim: its charge is the invoice's effect, read above.
        return Ok(None);
    }
    let evidence = crate::payment_store::evidence(db, id, &p.provider_key)
        .await?
        .into_iter()
        .map(|r| Evidence {
            kind: r.kind,
            outcome: r.outcome,
            http_status: r.http_status,
            provider_ids: r.provider_id.unwrap_or_default(),
            key: r.provider_key,
            detail: r.detail.unwrap_or_default(),
            started_at: Time(r.started_at),
            finished_at: r.finished_at.map(Time),
        })
        .collect();
    Ok(Some(ChainEffect {
        path: EffectPath::Endpoint,
        saga_step: None,
        id: p.order_id,
        provider: crate::PAYMENTS.to_owned(),
        operation: crate::CHARGE.to_owned(),
        reference: p.reference,
        key: p.provider_key,
        state: p.state,
        attempts: p.attempts,
        provider_id: p.payment_intent,
        last_error: None,
        created_at: Time(p.created_at),
        updated_at: Time(p.updated_at),
        evidence,
    }))
}

/// The operation the order's creating request was recorded under.
fn create_operation() -> Operation {
    Operation::new("POST", crate::routes::ORDERS_ROUTE)
}

/// The creating request's idempotency record under `key`, while it is kept.
pub(super) async fn record(
    db: &Database,
    tenant: &TenantId,
    key: &str,
) -> Result<Option<ChainRecord>, StoreError> {
    let Ok(key) = IdempotencyKey::parse(key.as_bytes()) else {
        return Ok(None);
    };
    let operation = create_operation();
    let scope = Scope::new(tenant.clone(), operation.clone());
    let store = IdempotencyStore::new(db.clone(), std::time::Duration::ZERO);
    Ok(store.lookup(&scope, &key).await?.map(|r| ChainRecord {
        operation: operation.as_str().to_owned(),
        state: r.state.as_str(),
        response_status: r.response.as_ref().map(|s| s.status),
        created_at: Time(r.created_at),
        completed_at: r.completed_at.map(Time),
        expires_at: r.expires_at.map(Time),
    }))
}

/// The id `order.created` of `order` was written with (as `crate::events` derives it).
fn order_created_id(tenant: &TenantId, order: &OrderRow) -> MessageId {
    match order
        .idempotency_key
        .as_deref()
        .and_then(|k| IdempotencyKey::parse(k.as_bytes()).ok())
    {
        Some(key) => MessageId::derive(
            &Scope::new(tenant.clone(), create_operation()),
            &key,
            crate::ORDER_CREATED,
            0,
        ),
        None => MessageId::derive_from_parts(&[
            crate::ORDER_CREATED,
            tenant.as_str(),
            &order.source,
            &order.external_ref,
        ]),
    }
}

/// The order's events: its outbox rows while they exist, and the events it is known to
/// have had after (`order.created` always; `invoice.paid` for each invoice the
/// choreography paid) as published.
pub(super) async fn events(
    db: &Database,
    tenant: &TenantId,
    order: &OrderRow,
    invoices: &[ChainInvoice],
    choreography: bool,
) -> Result<Vec<ChainEvent>, StoreError> {
    let rows = oncely_sql::OutboxStore::new(db.clone())
        .partition(&order.id)
        .await?;
    let mut out: Vec<ChainEvent> = rows
        .into_iter()
        .map(|r| ChainEvent {
            message_id: r.event.message_id.to_string(),
            event_type: r.event.event_type.clone(),
            state: r.state.as_str().to_owned(),
            attempts: r.attempts,
            last_error: r.last_error,
            created_at: Time(r.created_at),
            published_at: r.published_at.map(Time),
            seen_in: "outbox",
        })
        .collect();
    let mut known = vec![(
        order_created_id(tenant, order),
        crate::ORDER_CREATED,
        order.created_at,
    )];
    if choreography {
        for i in invoices {
            if let Some(paid) = i.paid_at {
                known.push((
                    MessageId::derive_from_parts(&[crate::INVOICE_PAID, &i.id]),
                    crate::INVOICE_PAID,
                    paid.0,
                ));
            }
        }
    }
    for (id, event_type, at) in known {
        let id = id.to_string();
        if out.iter().any(|e| e.message_id == id) {
            continue;
        }
        out.push(ChainEvent {
            message_id: id,
            event_type: event_type.to_owned(),
            state: "published".to_owned(),
            attempts: 0,
            last_error: None,
            created_at: Time(at),
            published_at: None,
            seen_in: "derived",
        });
    }
    out.sort_by_key(|e| e.created_at);
    Ok(out)
}

#[derive(sqlx::FromRow)]
struct InboxRow {
    consumer: String,
    message_id: String,
    received_at: i64,
}

/// Who received the order's `events`: the consumers' inbox rows (kept for the inbox's
/// retention), and the SQL transport's deliveries not yet acknowledged.
pub(super) async fn deliveries(
    db: &Database,
    id: &str,
    events: &[ChainEvent],
) -> Result<Vec<ChainDelivery>, StoreError> {
    let type_of = |m: &str| {
        events
            .iter()
            .find(|e| e.message_id == m)
            .map(|e| e.event_type.clone())
    };
    let mut out = Vec::new();
    let sql = format!(
        "SELECT {}, received_at FROM oncely_inbox WHERE message_id = $1 \
         ORDER BY received_at",
        text(db, &["consumer", "message_id"])
    );
    for e in events {
        let rows: Vec<InboxRow> = db
            .fetch_all(query(sql.as_str()).bind(e.message_id.as_str()))
            .await?;
        out.extend(rows.into_iter().map(|r| ChainDelivery {
            event_type: type_of(&r.message_id),
            consumer: r.consumer,
            message_id: r.message_id,
            state: "processed".to_owned(),
            attempts: 0,
            last_error: None,
            received_at: Some(Time(r.received_at)),
        }));
    }
    let pending = oncely_sql::QueueStore::new(db.clone())
        .partition_deliveries(id)
        .await?;
    out.extend(pending.into_iter().map(|d| ChainDelivery {
        consumer: d.consumer,
        message_id: d.message_id,
        event_type: Some(d.event_type),
        state: d.state,
        attempts: d.attempts,
        last_error: d.last_error,
        received_at: None,
    }));
    Ok(out)
}
