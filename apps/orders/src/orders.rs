use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use oncely_core::TenantId;
use oncely_http::{IdempotentTx, NotStored, Problem, StoreFailure};
use oncely_sql::{query, Backend, Database, EffectState, StoreError, Tx};
use serde::{Deserialize, Serialize};

use crate::status::OrderStatus;

/// Body of `POST /v1/orders`. Text fields are compared byte for byte (the business key), so
/// they refuse control and invisible characters and leading or trailing whitespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewOrder {
    /// The client system the order comes from (1–64 chars). Part of the business key.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = r"^\S(.*\S)?$",
        example = "shop"
    )]
    pub source: String,
    /// The order's id in the client system (1–128 chars). Part of the business key.
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = r"^\S(.*\S)?$",
        example = "A-1001"
    )]
    pub external_ref: String,
    /// Customer reference (1–128 chars).
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = r"^\S(.*\S)?$",
        example = "cust-7"
    )]
    pub customer_id: String,
    /// 1–100 order lines.
    #[schema(min_items = 1, max_items = 100)]
    pub items: Vec<OrderItem>,
    /// Total in minor units of `currency` (cents), 1 ≤ amount ≤ 10^15.
    #[schema(minimum = 1, maximum = 1e15, example = 4200)]
    pub amount_minor: i64,
    /// ISO 4217 code, three upper-case letters.
    #[schema(pattern = "^[A-Z]{3}$", example = "EUR")]
    pub currency: String,
    /// The payment method the fulfilment saga charges (a provider's id, e.g.
    /// `pm_card_visa`; 1–255 chars). Absent: the payments provider's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_method: Option<String>,
}

/// One order line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OrderItem {
    /// Stock keeping unit (1–64 chars).
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = r"^\S(.*\S)?$",
        example = "sku-1"
    )]
    pub sku: String,
    /// 1–10 000.
    #[schema(minimum = 1, maximum = 10_000, example = 2)]
    pub quantity: i64,
}

/// An order as the service stores it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Order {
    /// The order's id (a UUIDv7), as in `Location: /v1/orders/{id}`.
    id: String,
    /// `created` when stored; `GET /v1/orders/{id}` follows the flow in both fulfilment
    /// modes: `paid`, `fulfilled` (paid and shipped), `processing` (its saga runs),
    /// `compensating`, `rejected`, `cancelled`, `needs_review`. The list shows `created`
    /// (read the order for its progress).
    #[schema(value_type = String, example = "created")]
    status: &'static str,
    #[serde(flatten)]
    details: NewOrder,
    /// When it was created, Unix ms.
    created_at: i64,
}

/// An order as `GET /v1/orders/{id}` shows it: the order's fields, and its invoice,
/// payment and shipment — each `null` until the flow got there.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct OrderView {
    #[serde(flatten)]
    order: Order,
    /// Created by the `billing` consumer.
    invoice: Option<InvoiceView>,
    /// The invoice's `payments`/`charge` effect (with payments configured).
    payment: Option<EffectView>,
    /// The order's `shipping`/`book` effect (after `invoice.paid`).
    shipment: Option<EffectView>,
    /// The order's fulfilment saga and its step log (`null` under the choreography).
    fulfilment: Option<crate::saga_view::SagaView>,
}

/// The order's invoice as `GET /v1/orders/{id}` shows it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct InvoiceView {
    /// The invoice's id.
    id: String,
    /// `order` for the order's own invoice.
    kind: String,
    /// Its total in minor units of `currency`.
    amount_minor: i64,
    /// ISO 4217 code.
    currency: String,
    /// When it was created, Unix ms.
    created_at: i64,
    /// `open` until its charge succeeded, then `paid`.
    #[schema(value_type = String, example = "open")]
    status: &'static str,
    /// When it was paid, Unix ms; `null` while open.
    paid_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct InvoiceRow {
    id: String,
    kind: String,
    amount_minor: i64,
    currency: String,
    created_at: i64,
    paid_at: Option<i64>,
}

impl From<InvoiceRow> for InvoiceView {
    fn from(r: InvoiceRow) -> Self {
        Self {
            id: r.id,
            kind: r.kind,
            amount_minor: r.amount_minor,
            currency: r.currency,
            created_at: r.created_at,
            status: if r.paid_at.is_some() { "paid" } else { "open" },
            paid_at: r.paid_at,
        }
    }
}

/// An outgoing effect as `GET /v1/orders/{id}` shows it: its id (for `oncely effects
/// show`), its state word (`pending`, `in_flight`, `succeeded`, `failed`, `unknown`,
/// `absent`, `needs_review`) and the provider's object id once known.
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub(crate) struct EffectView {
    /// The effect's id.
    #[sqlx(rename = "id")]
    effect_id: String,
    /// Its state word.
    #[schema(example = "succeeded")]
    state: String,
    /// The provider's object id, once known.
    provider_id: Option<String>,
}

#[derive(sqlx::FromRow)]
pub(crate) struct OrderRow {
    pub(crate) id: String,
    source: String,
    external_ref: String,
    customer_id: String,
    items: String,
    amount_minor: i64,
    currency: String,
    pub(crate) created_at: i64,
    payment_method: Option<String>,
}

impl OrderRow {
    pub(crate) fn into_order(self) -> Result<Order, serde_json::Error> {
        Ok(Order {
            id: self.id,
            status: "created",
            details: NewOrder {
                source: self.source,
                external_ref: self.external_ref,
                customer_id: self.customer_id,
                items: serde_json::from_str(&self.items)?,
                amount_minor: self.amount_minor,
                currency: self.currency,
                payment_method: self.payment_method,
            },
            created_at: self.created_at,
        })
    }
}

/// The order select for `backend`, without its `WHERE` clause. The business-key columns
/// have a binary collation on MySQL (exact comparison), read back as text
/// ([`Backend::text_column`]).
pub(crate) fn select_order(backend: Backend) -> String {
    format!(
        "SELECT id, {}, {}, customer_id, items, amount_minor, currency, created_at, \
         payment_method FROM orders",
        backend.text_column("source"),
        backend.text_column("external_ref")
    )
}

/// The order insert; its business key `(tenant, source, external_ref)` is UNIQUE.
const INSERT_ORDER: &str = "INSERT INTO orders (id, tenant, source, external_ref, customer_id, \
     items, amount_minor, currency, created_at, payment_method, idempotency_key) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

/// The business key, as the conflict target of [`INSERT_ORDER`].
const BUSINESS_KEY: &str = "(tenant, source, external_ref)";

/// A validation failure: 400/422 problem, marked [`NotStored`] so the key stays usable.
fn invalid(status: StatusCode, kind: &str, title: &str, detail: String) -> Response {
    let mut res = Problem::new(status, kind, title)
        .detail(detail)
        .into_response();
    res.extensions_mut().insert(NotStored);
    res
}

fn validate(o: &NewOrder) -> Result<(), String> {
    // Identifiers are compared byte for byte by the business key, so invisible differences
    // ("A-1", "A-1 ", "A-1\u{200b}") would make distinct orders: refuse them.
    let text = |name: &str, v: &str, max: usize| {
        let invisible = |c: char| {
            c.is_control()
                || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{feff}')
        };
        if v.is_empty() || v.chars().count() > max || v.chars().any(invisible) || v.trim() != v {
            Err(format!(
                "{name} must have 1 to {max} printable characters, without leading or trailing \
                 whitespace"
            ))
        } else {
            Ok(())
        }
    };
    text("source", &o.source, 64)?;
    text("external_ref", &o.external_ref, 128)?;
    text("customer_id", &o.customer_id, 128)?;
    if o.items.is_empty() || o.items.len() > 100 {
        return Err("items must have 1 to 100 lines".into());
    }
    for (i, item) in o.items.iter().enumerate() {
        text(&format!("items/{i}/sku"), &item.sku, 64)?;
        if !(1..=10_000).contains(&item.quantity) {
            return Err(format!("items/{i}/quantity must be between 1 and 10000"));
        }
    }
    if !(1..=1_000_000_000_000_000).contains(&o.amount_minor) {
        return Err("amount_minor must be between 1 and 10^15".into());
    }
    if o.currency.len() != 3 || !o.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err("currency must be an ISO 4217 code of three upper-case letters".into());
    }
    if let Some(method) = &o.payment_method {
        text("payment_method", method, 255)?;
    }
    Ok(())
}

/// `body` (an order or its view) as JSON with `Location: /v1/orders/{id}`.
fn order_response(status: StatusCode, id: &str, body: &impl Serialize) -> Response {
    let mut res = (status, Json(body)).into_response();
    if let Ok(loc) = HeaderValue::try_from(format!("/v1/orders/{id}")) {
        res.headers_mut().insert(header::LOCATION, loc);
    }
    res
}

fn internal(e: &dyn std::fmt::Display) -> Response {
    tracing::error!(error = %e, "order handler failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        crate::problem::INTERNAL,
        "The order could not be processed",
    )
    .into_response()
}

/// `POST /v1/orders`: creates the order, or answers with the existing one when the business
/// key `(tenant, source, external_ref)` is taken by an order with the same content (200),
/// or a 409 problem when the content differs. Runs in the idempotency layer's transaction.
#[utoipa::path(
    post,
    path = "/v1/orders",
    tag = "orders",
    operation_id = "create_order",
    summary = "Create an order, exactly once per Idempotency-Key",
    description = "Runs once per `Idempotency-Key` (scoped by tenant and route): a retry with \
                   the same key and the same body gets the first answer again — status, \
                   headers and body — with `Idempotent-Replayed: true`, whatever that answer \
                   was (201, 200 or the 409 order-conflict). The business key `(source, \
                   external_ref)` is a second guard that outlives the key's retention. \
                   Validation failures (400, 415, 422 invalid-order) are not stored, so the \
                   same key may be retried with a fixed body.",
    params(crate::schema::IdempotencyKey),
    request_body(content = NewOrder, content_type = "application/json"),
    responses(
        (status = 201, description = "Created", body = Order, headers(
            ("Location" = String, description = "`/v1/orders/{id}` of the order"),
            ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer of an earlier request with the same key, replayed"),
        )),
        (status = 200, description = "An order with this business key and the same content \
            exists; this is it", body = Order, headers(
            ("Location" = String, description = "`/v1/orders/{id}` of the order"),
            ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer of an earlier request with the same key, replayed"),
        )),
        (status = 400, description = "idempotency-key-missing, idempotency-key-malformed, \
            malformed-json or request-body", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 408, description = "request-timeout: the body did not arrive in time",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 409, description = "order-conflict (the business key is taken by an order \
            with other content; its `order` member points at it), request-in-flight (the \
            first request with this key is still running; `Retry-After`) or outcome-unknown",
            body = crate::schema::Problem, content_type = "application/problem+json", headers(
            ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer of an earlier request with the same key, replayed"),
            ("Retry-After" = u32, description = "Seconds to wait (request-in-flight)"),
        )),
        (status = 413, description = "request-too-large", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 415, description = "unsupported-media-type: the body is not \
            application/json", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 422, description = "invalid-order (not stored: fix the body and retry with \
            the same key) or idempotency-key-reused (the key was used with another request; \
            `differs` names `body` or `route`)", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 500, description = "store-error, internal, handler-failed, \
            response-too-large, response-body, record-corrupt or no-transaction; nothing was \
            stored", body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable, execution-outcome-unknown or \
            server-busy; retry after `Retry-After` with the same key",
            body = crate::schema::Problem, content_type = "application/problem+json", headers(
            ("Retry-After" = u32, description = "Seconds to wait before the retry"),
        )),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn create_order(
    axum::Extension(tenant): axum::Extension<TenantId>,
    axum::Extension(events): axum::Extension<crate::events::EventSettings>,
    request_headers: http::HeaderMap,
    mut tx: IdempotentTx,
    body: Bytes,
) -> Response {
    let order = match parse_order(&request_headers, &body) {
        Ok(order) => order,
        Err(refused) => return *refused,
    };
    let items = match serde_json::to_string(&order.items) {
        Ok(s) => s,
        Err(e) => return internal(&e),
    };
    let context = tx.context().cloned();
    let tx = &mut *tx;
    let created = Order {
        id: uuid::Uuid::now_v7().to_string(),
        status: "created",
        details: order,
        created_at: oncely_core::now_ms(),
    };
    let key = context
        .as_ref()
        .and_then(|c| c.key.as_ref())
        .map(oncely_core::IdempotencyKey::as_str);
    match insert_order(tx, (&tenant, key), &created, items).await {
        Ok(true) => {
            let announced = Announcement {
                events: &events,
                context: context.as_ref(),
                tenant: &tenant,
                request_headers: &request_headers,
            };
            announce_created(tx, &announced, &created).await
        }
        Ok(false) => answer_existing(tx, &tenant, &created.details).await,
        // A lost connection, a store timeout, or a lock wait on a concurrent insert of the
        // same business key that ran out ([`StoreError::is_lock_conflict`]): 503 with
        // Retry-After, and the layer rolls back, so the retry runs again. Anything else is
        // a bug: 500.
        Err(e) => StoreFailure::from(e).into_response(),
    }
}

/// The order in the body of `POST /v1/orders`, or the answer refusing it: 415 unless the
/// body is JSON, 400 when it does not parse, 422 when it does not validate.
fn parse_order(request_headers: &http::HeaderMap, body: &[u8]) -> Result<NewOrder, Box<Response>> {
    // The fingerprint canonicalises JSON only for a JSON media type, so the body is read
    // only under one: the same bytes can never be fingerprinted two ways.
    let is_json = request_headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
    if !is_json {
        return Err(Box::new(invalid(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            crate::problem::UNSUPPORTED_MEDIA_TYPE,
            "The order must be sent as application/json",
            "set Content-Type: application/json".to_owned(),
        )));
    }
    let order: NewOrder = match serde_json::from_slice(body) {
        Ok(o) => o,
        // serde's messages quote the offending input; problem details never echo values.
        Err(e) if e.is_syntax() || e.is_eof() => {
            return Err(Box::new(invalid(
                StatusCode::BAD_REQUEST,
                oncely_http::kind::MALFORMED_JSON,
                "The request body is not valid JSON",
                format!("syntax error at line {}, column {}", e.line(), e.column()),
            )));
        }
        Err(e) => {
            return Err(Box::new(invalid(
                StatusCode::UNPROCESSABLE_ENTITY,
                crate::problem::INVALID_ORDER,
                "The order is invalid",
                format!(
                    "the body does not match the order schema (a missing or unknown field, or a \
                     value of the wrong type) at line {}, column {}",
                    e.line(),
                    e.column()
                ),
            )));
        }
    };
    validate(&order).map_err(|detail| {
        Box::new(invalid(
            StatusCode::UNPROCESSABLE_ENTITY,
            crate::problem::INVALID_ORDER,
            "The order is invalid",
            detail,
        ))
    })?;
    Ok(order)
}

/// Inserts `order` in `tx` unless its business key is taken: the second guard after the
/// idempotency key, the UNIQUE constraint (never SELECT-then-INSERT). `true` when inserted.
/// `items` is the order's lines as JSON; `key` the request's `Idempotency-Key`, kept with the
/// order for its chain (the console, `orders show`).
async fn insert_order(
    tx: &mut Tx,
    (tenant, key): (&TenantId, Option<&str>),
    order: &Order,
    items: String,
) -> Result<bool, StoreError> {
    let d = &order.details;
    let insert = query(INSERT_ORDER)
        .bind(&order.id)
        .bind(tenant.as_str())
        .bind(&d.source)
        .bind(&d.external_ref)
        .bind(&d.customer_id)
        .bind(items)
        .bind(d.amount_minor)
        .bind(&d.currency)
        .bind(order.created_at)
        .bind(d.payment_method.as_deref())
        .bind(key);
    tx.insert_ignoring_duplicate(insert, BUSINESS_KEY).await
}

/// Where and how `order.created` is announced.
struct Announcement<'a> {
    events: &'a crate::events::EventSettings,
    context: Option<&'a oncely_http::IdempotencyContext>,
    tenant: &'a TenantId,
    request_headers: &'a http::HeaderMap,
}

/// Enqueues `order.created` for the order just inserted, in the same transaction (no order
/// without its event, no event without its order), and answers 201.
async fn announce_created(tx: &mut Tx, announced: &Announcement<'_>, created: &Order) -> Response {
    let payload = match serde_json::to_vec(created) {
        Ok(p) => p,
        Err(e) => return internal(&e),
    };
    let event = crate::events::order_created(
        &announced.events.topic,
        announced.context,
        announced.tenant,
        (&created.details.source, &created.details.external_ref),
        &created.id,
        payload,
        announced.request_headers,
    );
    if let Err(e) = oncely_sql::OutboxStore::enqueue(tx, &event).await {
        return StoreFailure::from(e).into_response();
    }
    metrics::counter!(crate::metrics::ORDERS_CREATED_TOTAL).increment(1);
    order_response(StatusCode::CREATED, &created.id, created)
}

/// The answer when the business key of `order` is taken: the existing order (200) when its
/// content is the same, else a 409 problem pointing at it.
async fn answer_existing(tx: &mut Tx, tenant: &TenantId, order: &NewOrder) -> Response {
    let sql = format!(
        "{} WHERE tenant = $1 AND source = $2 AND external_ref = $3",
        select_order(tx.backend())
    );
    let row: Result<OrderRow, _> = tx
        .fetch_one(
            query(sql)
                .bind(tenant.as_str())
                .bind(&order.source)
                .bind(&order.external_ref),
        )
        .await;
    let existing = match row.map(OrderRow::into_order) {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return internal(&e),
        Err(e) => return StoreFailure::from(e).into_response(),
    };
    metrics::counter!(crate::metrics::ORDERS_BUSINESS_KEY_HITS_TOTAL).increment(1);
    if existing.details == *order {
        order_response(StatusCode::OK, &existing.id, &existing)
    } else {
        Problem::new(
            StatusCode::CONFLICT,
            crate::problem::ORDER_CONFLICT,
            "An order with this source and external_ref exists with other content",
        )
        .detail("the business key (source, external_ref) is already taken by a different order")
        .with("order", format!("/v1/orders/{}", existing.id))
        .into_response()
    }
}

/// `GET /v1/orders/{id}`: the tenant's order with its invoice, payment and shipment, 404
/// for anything else (including another tenant's order). Every read names the tenant.
#[utoipa::path(
    get,
    path = "/v1/orders/{id}",
    tag = "orders",
    operation_id = "get_order",
    summary = "Read an order with its invoice, payment and shipment",
    params(("id" = String, Path, description = "The order's id, from `Location`")),
    responses(
        (status = 200, description = "The order", body = OrderView, headers(
            ("Location" = String, description = "`/v1/orders/{id}` of the order"),
        )),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "not-found: no such order in the caller's tenant",
            body = crate::schema::Problem, content_type = "application/problem+json"),
        (status = 500, description = "store-error or internal", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable or server-busy",
            body = crate::schema::Problem, content_type = "application/problem+json", headers(
            ("Retry-After" = u32, description = "Seconds to wait before the retry"),
        )),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn get_order(
    State(db): State<Database>,
    axum::Extension(tenant): axum::Extension<TenantId>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let not_found = || {
        Problem::new(
            StatusCode::NOT_FOUND,
            crate::problem::NOT_FOUND,
            "No such order",
        )
        .into_response()
    };
    // An id that is not UTF-8 (`%ff`) names no order: the same 404 problem, instead of
    // axum's plain-text 400.
    let Ok(Path(id)) = id else {
        return not_found();
    };
    // Order ids are UUIDs: anything else names no order, and is never sent to the database
    // (PostgreSQL refuses a NUL in text with an error, which would be a 500).
    if uuid::Uuid::try_parse(&id).is_err() {
        return not_found();
    }
    let sql = format!(
        "{} WHERE id = $1 AND tenant = $2",
        select_order(db.backend())
    );
    let row: Result<Option<OrderRow>, StoreError> = db
        .fetch_optional(query(sql).bind(&id).bind(tenant.as_str()))
        .await;
    let order = match row.map(|r| r.map(OrderRow::into_order)) {
        Ok(Some(Ok(o))) => o,
        Ok(Some(Err(e))) => return internal(&e),
        Ok(None) => return not_found(),
        Err(e) => return StoreFailure::from(e).into_response(),
    };
    match order_view(&db, &tenant, order).await {
        Ok(view) => order_response(StatusCode::OK, &view.order.id, &view),
        Err(e) => StoreFailure::from(e).into_response(),
    }
}

/// `order` with its invoice, the invoice's charge and the order's shipment, read in
/// `tenant`.
async fn order_view(
    db: &Database,
    tenant: &TenantId,
    order: Order,
) -> Result<OrderView, StoreError> {
    let invoice: Option<InvoiceRow> = db
        .fetch_optional(
            query(
                "SELECT id, kind, amount_minor, currency, created_at, paid_at FROM invoices \
                 WHERE order_id = $1 AND tenant = $2 AND kind = $3",
            )
            .bind(&order.id)
            .bind(tenant.as_str())
            .bind(crate::INVOICE_KIND_ORDER),
        )
        .await?;
    let payment = match &invoice {
        Some(i) => effect_view(db, tenant, (crate::PAYMENTS, crate::CHARGE), &i.id).await?,
        None => None,
    };
    let shipment = effect_view(db, tenant, (crate::SHIPPING, crate::BOOK), &order.id).await?;
    let fulfilment = crate::saga_view::view(db, tenant.as_str(), &order.id).await?;
    let mut order = order;
    order.status = match &fulfilment {
        Some(saga) => saga.order_status(),
        None => OrderStatus::of_flow(
            invoice.as_ref().is_some_and(|i| i.paid_at.is_some()),
            state_of(payment.as_ref()),
            state_of(shipment.as_ref()),
        ),
    }
    .as_str();
    Ok(OrderView {
        order,
        invoice: invoice.map(InvoiceView::from),
        payment,
        shipment,
        fulfilment,
    })
}

/// The state of an effect as the order view shows it (`None` for none, or a word no state
/// has).
fn state_of(effect: Option<&EffectView>) -> Option<EffectState> {
    effect.and_then(|e| EffectState::parse(&e.state).ok())
}

/// `tenant`'s order `id` as its `order.created` payload carries it (the fulfilment
/// saga's input), if the tenant has it.
///
/// # Errors
/// [`StoreError`] when the database fails or the row does not decode.
pub(crate) async fn order_json(
    db: &Database,
    tenant: &TenantId,
    id: &str,
) -> Result<Option<serde_json::Value>, StoreError> {
    let sql = format!(
        "{} WHERE id = $1 AND tenant = $2",
        select_order(db.backend())
    );
    let row: Option<OrderRow> = db
        .fetch_optional(query(sql).bind(id).bind(tenant.as_str()))
        .await?;
    row.map(|r| {
        r.into_order()
            .and_then(serde_json::to_value)
            .map_err(|e| StoreError::Corrupt(format!("order {id}: {e}")))
    })
    .transpose()
}

/// The tenant's effect of `(provider, operation)` for `reference`, if any.
async fn effect_view(
    db: &Database,
    tenant: &TenantId,
    (provider, operation): (&str, &str),
    reference: &str,
) -> Result<Option<EffectView>, StoreError> {
    let sql = format!(
        "SELECT id, state, {} FROM oncely_effects \
         WHERE provider = $1 AND operation = $2 AND reference = $3 AND tenant = $4",
        db.backend().text_column("provider_id")
    );
    db.fetch_optional(
        query(sql)
            .bind(provider)
            .bind(operation)
            .bind(reference)
            .bind(tenant.as_str()),
    )
    .await
}
