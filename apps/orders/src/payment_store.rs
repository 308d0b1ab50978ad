//! The `order_payments` and `order_payment_evidence` tables (migration 10005): one payment
//! per order, claimed by whichever path comes first (the payments endpoint or the billing
//! flow), and the evidence of every call and status check. Each write is one short
//! statement of its own, outside any request transaction: the payments endpoint runs in
//! multi-phase mode, between its record's commit and its outcome.

use oncely_sql::{query, Database, StoreError, Value};
use serde::Serialize;

/// `via` of a payment claimed by `POST /v1/orders/{id}/payments`.
pub(crate) const VIA_ENDPOINT: &str = "endpoint";
/// `via` of a payment claimed by the billing flow (the invoice's charge effect).
pub(crate) const VIA_FLOW: &str = "flow";

/// A payment row; serialized (without its idempotency key) as the operation status
/// resource shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub(crate) struct PaymentRow {
    pub(crate) order_id: String,
    /// `endpoint` (`POST /v1/orders/{id}/payments`) or `flow` (the invoice's charge effect).
    pub(crate) via: String,
    #[serde(skip)]
    pub(crate) idempotency_key: String,
    pub(crate) reference: String,
    pub(crate) provider_key: String,
    pub(crate) amount_minor: i64,
    pub(crate) currency: String,
    pub(crate) state: String,
    pub(crate) fence: i64,
    pub(crate) attempts: i64,
    pub(crate) payment_intent: Option<String>,
    pub(crate) created_at: i64,
    pub(crate) updated_at: i64,
}

/// One evidence row: a call (`kind` = `call`) or a status check (`status`); times in Unix
/// milliseconds.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub(crate) struct EvidenceRow {
    pub(crate) fence: i64,
    pub(crate) kind: String,
    pub(crate) provider_key: String,
    pub(crate) started_at: i64,
    pub(crate) finished_at: Option<i64>,
    pub(crate) outcome: String,
    pub(crate) http_status: Option<i64>,
    pub(crate) provider_id: Option<String>,
    pub(crate) detail: Option<String>,
}

/// What a new claim of an order's payment writes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewPayment<'a> {
    pub(crate) order_id: &'a str,
    pub(crate) tenant: &'a str,
    pub(crate) via: &'a str,
    pub(crate) idempotency_key: &'a str,
    pub(crate) reference: &'a str,
    pub(crate) provider_key: &'a str,
    pub(crate) amount_minor: i64,
    pub(crate) currency: &'a str,
    pub(crate) state: &'a str,
    pub(crate) fence: i64,
}

const INSERT_PAYMENT: &str = "INSERT INTO order_payments (order_id, tenant, via, \
     idempotency_key, reference, provider_key, amount_minor, currency, state, fence, attempts, \
     created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1, $11, $12)";

/// The insert of `p`, for [`oncely_sql::Tx::insert_ignoring_duplicate`] on `(order_id)`.
pub(crate) fn insert_payment(p: &NewPayment<'_>, now: i64) -> oncely_sql::Query {
    query(INSERT_PAYMENT)
        .bind(p.order_id)
        .bind(p.tenant)
        .bind(p.via)
        .bind(p.idempotency_key)
        .bind(p.reference)
        .bind(p.provider_key)
        .bind(p.amount_minor)
        .bind(p.currency)
        .bind(p.state)
        .bind(p.fence)
        .bind(now)
        .bind(now)
}

/// Claims the order's payment for `p` (`INSERT` under the primary key `order_id`): `true`
/// when this row is new.
pub(crate) async fn claim(db: &Database, p: &NewPayment<'_>, now: i64) -> Result<bool, StoreError> {
    let mut tx = db.begin().await?;
    let inserted = tx
        .insert_ignoring_duplicate(insert_payment(p, now), "(order_id)")
        .await?;
    tx.commit().await?;
    Ok(inserted)
}

fn select_payment(db: &Database) -> String {
    format!(
        "SELECT order_id, via, {}, reference, provider_key, amount_minor, currency, state, \
         fence, attempts, payment_intent, created_at, updated_at FROM order_payments",
        db.backend().text_column("idempotency_key")
    )
}

/// The payment of `order_id` in `tenant`.
pub(crate) async fn by_order(
    db: &Database,
    tenant: &str,
    order_id: &str,
) -> Result<Option<PaymentRow>, StoreError> {
    let sql = format!("{} WHERE order_id = $1 AND tenant = $2", select_payment(db));
    db.fetch_optional(query(sql).bind(order_id).bind(tenant))
        .await
}

/// The payment made under the client's `key` in `tenant`.
pub(crate) async fn by_key(
    db: &Database,
    tenant: &str,
    key: &str,
) -> Result<Option<PaymentRow>, StoreError> {
    let sql = format!(
        "{} WHERE tenant = $1 AND idempotency_key = $2",
        select_payment(db)
    );
    db.fetch_optional(query(sql).bind(tenant).bind(key)).await
}

/// Payments of the endpoint created at or after `since_ms`, oldest first.
pub(crate) async fn endpoint_since(
    db: &Database,
    since_ms: i64,
) -> Result<Vec<(PaymentRow, String)>, StoreError> {
    let sql = format!(
        "{} WHERE via = $1 AND created_at >= $2 ORDER BY created_at",
        select_payment(db).replace(
            " FROM order_payments",
            &format!(
                ", {} FROM order_payments",
                db.backend().text_column("tenant")
            )
        )
    );
    let rows: Vec<TenantPayment> = db
        .fetch_all(query(sql).bind(VIA_ENDPOINT).bind(since_ms))
        .await?;
    Ok(rows.into_iter().map(|r| (r.payment, r.tenant)).collect())
}

/// The endpoint's payment with `reference`, with its tenant.
pub(crate) async fn endpoint_by_reference(
    db: &Database,
    reference: &str,
) -> Result<Option<(PaymentRow, String)>, StoreError> {
    let sql = format!(
        "{} WHERE via = $1 AND reference = $2",
        select_payment(db).replace(
            " FROM order_payments",
            &format!(
                ", {} FROM order_payments",
                db.backend().text_column("tenant")
            )
        )
    );
    let row: Option<TenantPayment> = db
        .fetch_optional(query(sql).bind(VIA_ENDPOINT).bind(reference))
        .await?;
    Ok(row.map(|r| (r.payment, r.tenant)))
}

#[derive(sqlx::FromRow)]
struct TenantPayment {
    #[sqlx(flatten)]
    payment: PaymentRow,
    tenant: String,
}

/// The holder of `fence` under the same key takes the row to charge again: allowed when
/// its fence is newer (a take-over after a lease ran out) or nothing was charged.
pub(crate) async fn recharge(
    db: &Database,
    order_id: &str,
    key: &str,
    fence: i64,
    now: i64,
) -> Result<bool, StoreError> {
    let n = db
        .execute(
            query(
                "UPDATE order_payments SET state = 'charging', fence = $1, \
                 attempts = attempts + 1, updated_at = $2 WHERE order_id = $3 \
                 AND idempotency_key = $4 AND via = $5 \
                 AND (fence < $6 OR state IN ('not_charged', 'declined'))",
            )
            .bind(fence)
            .bind(now)
            .bind(order_id)
            .bind(key)
            .bind(VIA_ENDPOINT)
            .bind(fence),
        )
        .await?;
    Ok(n == 1)
}

/// A new key takes over a payment of the order that charged nothing (`not_charged`) or was
/// declined: the row now names the new key.
pub(crate) async fn take_over(
    db: &Database,
    old: &PaymentRow,
    p: &NewPayment<'_>,
    now: i64,
) -> Result<bool, StoreError> {
    let n = db
        .execute(
            query(
                "UPDATE order_payments SET idempotency_key = $1, provider_key = $2, \
                 state = 'charging', fence = $3, attempts = 1, updated_at = $4 \
                 WHERE order_id = $5 AND idempotency_key = $6 AND state = $7 AND via = $8",
            )
            .bind(p.idempotency_key)
            .bind(p.provider_key)
            .bind(p.fence)
            .bind(now)
            .bind(old.order_id.as_str())
            .bind(old.idempotency_key.as_str())
            .bind(old.state.as_str())
            .bind(VIA_ENDPOINT),
        )
        .await?;
    Ok(n == 1)
}

/// Sets the payment's outcome, as the holder under `key` (a later key's row is left alone).
pub(crate) async fn set_outcome(
    db: &Database,
    order_id: &str,
    key: &str,
    state: &str,
    payment_intent: Option<&str>,
    now: i64,
) -> Result<(), StoreError> {
    db.execute(
        query(
            "UPDATE order_payments SET state = $1, payment_intent = $2, updated_at = $3 \
             WHERE order_id = $4 AND idempotency_key = $5",
        )
        .bind(state)
        .bind(payment_intent)
        .bind(now)
        .bind(order_id)
        .bind(key),
    )
    .await?;
    Ok(())
}

/// A query over `values` in order: `$n` for each text or present number, `NULL` written
/// into the SQL for an absent number (PostgreSQL types a bound NULL as text, which a
/// `BIGINT` column refuses).
struct Values(Vec<Value>);

impl Values {
    fn text(&mut self, v: impl Into<Value>) -> String {
        self.0.push(v.into());
        format!("${}", self.0.len())
    }

    fn number(&mut self, v: Option<i64>) -> String {
        v.map_or_else(|| "NULL".to_owned(), |n| self.text(n))
    }

    fn query(self, sql: String) -> oncely_sql::Query {
        self.0.into_iter().fold(query(sql), oncely_sql::Query::bind)
    }
}

/// Adds an evidence row; returns its id.
pub(crate) async fn add_evidence(
    db: &Database,
    order_id: &str,
    e: &EvidenceRow,
) -> Result<String, StoreError> {
    let id = uuid::Uuid::now_v7().to_string();
    let mut v = Values(Vec::new());
    let list = [
        v.text(id.as_str()),
        v.text(order_id),
        v.text(e.fence),
        v.text(e.kind.as_str()),
        v.text(e.provider_key.as_str()),
        v.text(e.started_at),
        v.number(e.finished_at),
        v.text(e.outcome.as_str()),
        v.number(e.http_status),
        v.text(e.provider_id.as_deref()),
        v.text(e.detail.as_deref()),
    ]
    .join(", ");
    let sql = format!(
        "INSERT INTO order_payment_evidence (id, order_id, fence, kind, provider_key, \
         started_at, finished_at, outcome, http_status, provider_id, detail) VALUES ({list})"
    );
    db.execute(v.query(sql)).await?;
    Ok(id)
}

/// Completes the call evidence `id` with what the call proved.
pub(crate) async fn finish_evidence(
    db: &Database,
    id: &str,
    outcome: &str,
    http_status: Option<i64>,
    provider_id: Option<&str>,
    detail: &str,
) -> Result<(), StoreError> {
    let mut v = Values(Vec::new());
    let sql = format!(
        "UPDATE order_payment_evidence SET finished_at = {}, outcome = {}, \
         http_status = {}, provider_id = {}, detail = {} WHERE id = {}",
        v.text(oncely_core::now_ms()),
        v.text(outcome),
        v.number(http_status),
        v.text(provider_id),
        v.text(detail),
        v.text(id),
    );
    db.execute(v.query(sql)).await?;
    Ok(())
}

/// The evidence of `order_id` under `provider_key`, oldest first.
pub(crate) async fn evidence(
    db: &Database,
    order_id: &str,
    provider_key: &str,
) -> Result<Vec<EvidenceRow>, StoreError> {
    db.fetch_all(
        query(
            "SELECT fence, kind, provider_key, started_at, finished_at, outcome, http_status, \
             provider_id, detail FROM order_payment_evidence \
             WHERE order_id = $1 AND provider_key = $2 ORDER BY started_at, id",
        )
        .bind(order_id)
        .bind(provider_key),
    )
    .await
}

/// When the latest call under `provider_key` last may have reached the provider (Unix ms): its
/// end (timeout, reset, answer), or its start when it never ended; `None` when none went out.
pub(crate) async fn last_call(
    db: &Database,
    order_id: &str,
    provider_key: &str,
) -> Result<Option<i64>, StoreError> {
    let row: Option<(Option<i64>,)> = db
        .fetch_optional(
            query(
                "SELECT MAX(COALESCE(finished_at, started_at)) FROM order_payment_evidence \
                 WHERE order_id = $1 AND provider_key = $2 AND kind = 'call'",
            )
            .bind(order_id)
            .bind(provider_key),
        )
        .await?;
    Ok(row.and_then(|(t,)| t))
}
