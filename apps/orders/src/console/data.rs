//! What the console's pages read. oncely's tables are read through their stores
//! (`IdempotencyStore`, `OutboxStore`, `QueueStore`, `EffectStore`, `DiscrepancyStore`,
//! `oncely_saga::SagaOperator`), as the `oncely` CLI reads them; the service's own tables
//! (`orders`, `invoices`) with portable SQL through [`oncely_sql::query`], text columns
//! selected through [`Backend::text_column`](oncely_sql::Backend::text_column) (MySQL's
//! binary-collated columns otherwise decode as bytes).

use oncely_broker::{DeadLetterError, DeadLetters};
use oncely_core::RecordState;
use oncely_saga::{SagaOperator, StepInReview};
use oncely_sql::{
    query, Database, Discrepancy, DiscrepancyStore, Effect, EffectState, EffectStore,
    IdempotencyStore, OutboxStore, RecordSummary, StoreError,
};

use crate::{
    BILLING_CONSUMER, BOOK, CHARGE, FULFILMENT_CONSUMER, PAYMENTS, SHIPPING, SHIPPING_CONSUMER,
};

/// The consumers whose dead letters the console lists (the service's own: the
/// choreography's and the saga's).
pub(crate) const CONSUMERS: [&str; 3] = [BILLING_CONSUMER, SHIPPING_CONSUMER, FULFILMENT_CONSUMER];
/// Effect states the console puts before a person.
pub(crate) const REVIEW_STATES: [EffectState; 3] = [
    EffectState::NeedsReview,
    EffectState::Unknown,
    EffectState::Absent,
];
/// Most rows a list shows.
const LIMIT: u32 = 200;

#[derive(sqlx::FromRow)]
struct Count {
    n: i64,
}

#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Group {
    pub(crate) label: String,
    pub(crate) n: i64,
}

/// The overview's counts.
#[derive(Debug)]
pub(crate) struct Overview {
    pub(crate) orders: i64,
    pub(crate) idempotency: Vec<Group>,
    pub(crate) processing_past_lease: i64,
    pub(crate) outbox_pending: u64,
    pub(crate) outbox_dead: u64,
    /// Per consumer group, from the broker; `Err` says why it could not be asked.
    pub(crate) dead_letters: Result<Vec<Group>, String>,
    pub(crate) effects: Vec<(String, String, i64)>,
    pub(crate) sagas: Vec<Group>,
    pub(crate) saga_steps_in_review: i64,
    pub(crate) discrepancies: Vec<Group>,
}

/// `(label, count)` pairs as the overview's groups.
fn groups(counts: Vec<(String, i64)>) -> Vec<Group> {
    counts
        .into_iter()
        .map(|(label, n)| Group { label, n })
        .collect()
}

async fn count(db: &Database, q: oncely_sql::Query) -> Result<i64, StoreError> {
    Ok(db.fetch_optional::<Count>(q).await?.map_or(0, |c| c.n))
}

/// Reads the overview's counts at `now` (Unix ms).
pub(crate) async fn overview(db: &Database, now: i64) -> Result<Overview, StoreError> {
    let records = IdempotencyStore::new(db.clone(), std::time::Duration::ZERO);
    let lease = records.lease_report(now).await?;
    let outbox = OutboxStore::new(db.clone()).stats().await?;
    let sagas = SagaOperator::new(db.clone());
    Ok(Overview {
        orders: count(db, query("SELECT COUNT(*) AS n FROM orders")).await?,
        idempotency: groups(records.state_counts().await?),
        processing_past_lease: lease.processing_past_lease,
        outbox_pending: outbox.pending,
        outbox_dead: outbox.dead,
        // Filled from the broker by the caller ([`dead_letter_counts`]).
        dead_letters: Ok(Vec::new()),
        effects: EffectStore::new(db.clone()).counts().await?,
        sagas: groups(sagas.state_counts().await?),
        saga_steps_in_review: sagas.steps_in_review_count().await?,
        discrepancies: groups(
            DiscrepancyStore::new(db.clone())
                .open_counts_by_provider()
                .await?,
        ),
    })
}

/// An effect with the order it belongs to, when one is found.
#[derive(Debug)]
pub(crate) struct EffectLine {
    pub(crate) effect: Effect,
    pub(crate) order_id: Option<String>,
}

/// The order an effect belongs to: a charge's reference is its invoice, a booking's the
/// order itself.
async fn order_of(db: &Database, effect: &Effect) -> Result<Option<String>, StoreError> {
    #[derive(sqlx::FromRow)]
    struct Id {
        order_id: String,
    }
    let sql = if effect.provider == PAYMENTS && effect.operation == CHARGE {
        format!(
            "SELECT {} FROM invoices WHERE id = $1",
            as_text(db, "order_id", "order_id")
        )
    } else if effect.provider == SHIPPING && effect.operation == BOOK {
        format!(
            "SELECT {} FROM orders WHERE id = $1",
            as_text(db, "id", "order_id")
        )
    } else {
        return Ok(None);
    };
    Ok(db
        .fetch_optional::<Id>(query(sql).bind(effect.reference.as_str()))
        .await?
        .map(|r| r.order_id))
}

/// `expr` (a column, maybe qualified) read as text, named `alias`.
pub(crate) fn as_text(db: &Database, expr: &str, alias: &str) -> String {
    let t = db.backend().text_column(expr);
    let bare = t.strip_suffix(&format!(" AS {expr}")).unwrap_or(&t);
    format!("{bare} AS {alias}")
}

/// Effects in `states`, oldest first, each with its order.
pub(crate) async fn effects_in(
    db: &Database,
    states: &[EffectState],
) -> Result<Vec<EffectLine>, StoreError> {
    let store = EffectStore::new(db.clone());
    let mut out = Vec::new();
    for state in states {
        for effect in store.list(Some(*state), LIMIT).await? {
            let order_id = order_of(db, &effect).await?;
            out.push(EffectLine { effect, order_id });
        }
    }
    Ok(out)
}

/// Idempotency records that need a person: `processing` past their lease, and `unknown`.
pub(crate) async fn stuck_records(
    db: &Database,
    now: i64,
) -> Result<Vec<RecordSummary>, StoreError> {
    let store = IdempotencyStore::new(db.clone(), std::time::Duration::ZERO);
    let mut out: Vec<RecordSummary> = store
        .list_records(Some(RecordState::Processing), LIMIT)
        .await?
        .into_iter()
        .filter(|r| r.lease_until.is_some_and(|l| l < now))
        .collect();
    out.extend(
        store
            .list_records(Some(RecordState::Unknown), LIMIT)
            .await?,
    );
    Ok(out)
}

/// A dead letter of one of the service's consumer groups, as its broker reports it.
#[derive(Debug)]
pub(crate) struct DeadLetter {
    pub(crate) consumer: &'static str,
    /// Empty for a message that had no id (it cannot be requeued by id).
    pub(crate) message_id: String,
    pub(crate) topic: String,
    pub(crate) attempts: u32,
    pub(crate) last_error: Option<String>,
    pub(crate) event_type: String,
    /// The order the payload names (`order_id`, or `id` of an `order.created`), when its
    /// preview is JSON that says.
    pub(crate) order_id: Option<String>,
}

/// The order a payload preview names, if it is a JSON object with `order_id` or `id`.
fn order_in_payload(preview: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(preview).ok()?;
    v.get("order_id")
        .or_else(|| v.get("id"))
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

/// Every dead letter of the service's consumer groups on its broker, up to [`LIMIT`] per
/// group, oldest first.
pub(crate) async fn dead_letters(dl: &dyn DeadLetters) -> Result<Vec<DeadLetter>, DeadLetterError> {
    let mut out = Vec::new();
    for consumer in CONSUMERS {
        for d in dl.list(consumer, LIMIT, None).await? {
            out.push(DeadLetter {
                consumer,
                message_id: d.message_id.map(|m| m.to_string()).unwrap_or_default(),
                order_id: order_in_payload(&d.payload_preview),
                topic: d.topic,
                attempts: d.attempts,
                last_error: d.last_error,
                event_type: d.event_type,
            });
        }
    }
    Ok(out)
}

/// How many dead letters each of the service's consumer groups has on its broker (up to
/// [`LIMIT`] counted), for the overview.
pub(crate) async fn dead_letter_counts(
    dl: &dyn DeadLetters,
) -> Result<Vec<Group>, DeadLetterError> {
    let mut out = Vec::new();
    for consumer in CONSUMERS {
        let n = dl.list(consumer, LIMIT, None).await?.len();
        out.push(Group {
            label: consumer.to_owned(),
            n: i64::try_from(n).unwrap_or(i64::MAX),
        });
    }
    Ok(out)
}

/// Saga steps in `needs_review`, oldest first.
pub(crate) async fn steps_in_review(db: &Database) -> Result<Vec<StepInReview>, StoreError> {
    SagaOperator::new(db.clone()).steps_in_review(LIMIT).await
}

/// Open discrepancies, newest first.
/// The open discrepancies, each with the order its provider records name
/// ([`Discrepancy::business_ref`]) when that order exists here (for a link to its page).
pub(crate) async fn discrepancies(
    db: &Database,
) -> Result<Vec<(Discrepancy, Option<String>)>, StoreError> {
    let open = DiscrepancyStore::new(db.clone()).open(None).await?;
    let mut out = Vec::with_capacity(open.len());
    for d in open {
        let order = match d.business_ref() {
            Some(id) if uuid::Uuid::try_parse(&id).is_ok() => {
                let exists =
                    query("SELECT COUNT(*) AS n FROM orders WHERE id = $1").bind(id.as_str());
                (count(db, exists).await? > 0).then_some(id)
            }
            _ => None,
        };
        out.push((d, order));
    }
    Ok(out)
}

/// The tenant of order `id`, if there is one (the console's links from the stuck and
/// dead-letter pages name only the order).
pub(crate) async fn tenant_of(db: &Database, id: &str) -> Result<Option<String>, StoreError> {
    #[derive(sqlx::FromRow)]
    struct Tenant {
        tenant: String,
    }
    if uuid::Uuid::try_parse(id).is_err() {
        return Ok(None);
    }
    let sql = format!(
        "SELECT {} FROM orders WHERE id = $1",
        crate::chain::text(db, &["tenant"])
    );
    Ok(db
        .fetch_optional::<Tenant>(query(sql).bind(id))
        .await?
        .map(|t| t.tenant))
}
