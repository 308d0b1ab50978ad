//! `GET /v1/orders`: the tenant's orders, newest first, one page at a time.
//!
//! Keyset pagination on `(created_at, id)` (index `orders_tenant_created`): a page is the
//! `limit` orders (1–100, default 50) after the cursor, newest first; `next_cursor` is an
//! opaque token naming the last order of the page, `null` on the last page. Orders created
//! while a client pages appear on no page it has not read yet only if they are newer than
//! its cursor — i.e. paging never repeats or skips an order that existed when it began.
//! The cursor is refused (400) unless it is exactly what this service issues — the
//! canonical encoding, re-encoded byte for byte — and names an order of the caller's
//! tenant that matches the page's filters: a hand-made cursor, another tenant's, or one
//! whose time was edited names no such order. (Orders are never deleted, so a cursor the
//! service issued stays valid.) `limit` is plain decimal digits: `+5` and `-0` are refused.
//! `source` and `external_ref` filter by exact (byte-for-byte) match. `total` is the number
//! of the tenant's orders matching the filters (so `oncely verify --count-url
//! …/v1/orders` counts the tenant's orders).

use std::fmt::Write as _;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use http::StatusCode;
use oncely_core::TenantId;
use oncely_http::{Problem, StoreFailure};
use oncely_sql::{query, Database, StoreError};
use serde::{Deserialize, Serialize};

use crate::orders::{select_order, Order, OrderRow};

/// The largest page.
pub const MAX_LIMIT: u32 = 100;
/// The page size without `limit`.
pub const DEFAULT_LIMIT: u32 = 50;

/// The query of `GET /v1/orders`; any other parameter is refused.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// Orders per page, 1–100 (default 50).
    #[param(value_type = Option<u32>, minimum = 1, maximum = 100)]
    limit: Option<String>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
    /// Only orders of this source (exact match).
    source: Option<String>,
    /// Only orders with this external_ref (exact match).
    external_ref: Option<String>,
}

/// One page.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Page {
    /// The page's orders, newest first.
    orders: Vec<Order>,
    /// The `cursor` of the next page; `null` on the last page.
    next_cursor: Option<String>,
    /// The tenant's orders matching the filters, over all pages.
    total: i64,
}

/// Where a page starts: after the order `(created_at, id)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    created_at: i64,
    id: String,
}

const CURSOR_VERSION: &str = "o1";

impl Cursor {
    fn encode(&self) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(format!("{CURSOR_VERSION}:{}:{}", self.created_at, self.id))
    }

    /// The cursor `s` names, when `s` is exactly the encoding [`Cursor::encode`] gives it
    /// (so no second spelling of one cursor, e.g. `+` before its time, passes).
    fn decode(s: &str) -> Option<Self> {
        Self::parse(s).filter(|c| c.encode() == s)
    }

    fn parse(s: &str) -> Option<Self> {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .ok()?;
        let raw = String::from_utf8(raw).ok()?;
        let mut parts = raw.splitn(3, ':');
        if parts.next()? != CURSOR_VERSION {
            return None;
        }
        let created_at = parts.next()?.parse().ok()?;
        let id = parts.next()?;
        uuid::Uuid::parse_str(id).ok()?;
        Some(Self {
            created_at,
            id: id.to_owned(),
        })
    }
}

fn bad_query(detail: &str) -> Response {
    Problem::new(
        StatusCode::BAD_REQUEST,
        crate::problem::INVALID_QUERY,
        "The list query is invalid",
    )
    .detail(detail)
    .into_response()
}

/// `GET /v1/orders?limit=&cursor=&source=&external_ref=`: a page of the tenant's orders
/// (never another tenant's), newest first. A limit outside 1–100, a cursor this service did
/// not issue, or an unknown parameter is a 400 `invalid-query` problem.
#[utoipa::path(
    get,
    path = "/v1/orders",
    tag = "orders",
    operation_id = "list_orders",
    summary = "List the caller's orders, newest first",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of orders", body = Page),
        (status = 400, description = "invalid-query: a limit outside 1–100, a cursor the \
            service did not issue or an unknown parameter", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 401, description = "unauthenticated", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 500, description = "store-error or internal", body = crate::schema::Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable or server-busy",
            body = crate::schema::Problem, content_type = "application/problem+json", headers(
            ("Retry-After" = u32, description = "Seconds to wait before the retry"),
        )),
    ),
    security(("api_key" = []))
)]
pub(crate) async fn list_orders(
    State(db): State<Database>,
    axum::Extension(tenant): axum::Extension<TenantId>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = q else {
        return bad_query("the parameters are limit, cursor, source and external_ref");
    };
    let Some(limit) = parse_limit(q.limit.as_deref()) else {
        return bad_query("limit must be an integer from 1 to 100, in decimal digits");
    };
    // No order has a control character in these (the order's validation refuses them),
    // and PostgreSQL refuses a NUL in text with an error: a 400, never a 500.
    let controls = |v: &Option<String>| {
        v.as_deref()
            .is_some_and(|v| v.chars().any(char::is_control))
    };
    if controls(&q.source) || controls(&q.external_ref) {
        return bad_query("source and external_ref cannot hold control characters");
    }
    let cursor = match q.cursor.as_deref().map(Cursor::decode) {
        None => None,
        Some(Some(c)) => Some(c),
        Some(None) => return bad_query("cursor is not a next_cursor this service issued"),
    };
    if let Some(c) = &cursor {
        match names_an_order(&db, &tenant, &q, c).await {
            Ok(true) => {}
            Ok(false) => return bad_query("cursor is not a next_cursor this service issued"),
            Err(e) => return StoreFailure::from(e).into_response(),
        }
    }
    match page(&db, &tenant, &q, cursor.as_ref(), limit).await {
        Ok(Ok(page)) => Json(page).into_response(),
        Ok(Err(e)) => {
            tracing::error!(error = %e, "an order row does not decode");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                crate::problem::INTERNAL,
                "The orders could not be listed",
            )
            .into_response()
        }
        Err(e) => StoreFailure::from(e).into_response(),
    }
}

/// `limit` (default [`DEFAULT_LIMIT`]) when it is 1 to [`MAX_LIMIT`] in plain decimal
/// digits; `u32::from_str` would also take a sign (`+5`).
fn parse_limit(limit: Option<&str>) -> Option<u32> {
    let Some(limit) = limit else {
        return Some(DEFAULT_LIMIT);
    };
    if limit.is_empty() || !limit.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    limit.parse().ok().filter(|n| (1..=MAX_LIMIT).contains(n))
}

/// Whether `cursor` names an order of `tenant` that the filters of `q` select: the page
/// that issued it ended on that order.
async fn names_an_order(
    db: &Database,
    tenant: &TenantId,
    q: &ListQuery,
    cursor: &Cursor,
) -> Result<bool, StoreError> {
    let (filter, binds) = filter(q);
    let next = binds.len() + 2;
    let sql = format!(
        "SELECT COUNT(*) AS n FROM orders WHERE {filter} AND id = ${next} AND created_at = ${}",
        next + 1
    );
    let mut select = query(sql).bind(tenant.as_str());
    for b in binds {
        select = select.bind(b);
    }
    let select = select.bind(cursor.id.clone()).bind(cursor.created_at);
    Ok(db
        .fetch_optional::<CountRow>(select)
        .await?
        .is_some_and(|r| r.n > 0))
}

/// The filter after `WHERE` and its binds, `$1` being the tenant.
fn filter(q: &ListQuery) -> (String, Vec<String>) {
    let mut sql = "tenant = $1".to_owned();
    let mut binds = Vec::new();
    for (column, value) in [("source", &q.source), ("external_ref", &q.external_ref)] {
        if let Some(v) = value {
            binds.push(v.clone());
            let _ = write!(sql, " AND {column} = ${}", binds.len() + 1);
        }
    }
    (sql, binds)
}

async fn page(
    db: &Database,
    tenant: &TenantId,
    q: &ListQuery,
    cursor: Option<&Cursor>,
    limit: u32,
) -> Result<Result<Page, serde_json::Error>, StoreError> {
    let (filter, binds) = filter(q);
    let mut count =
        query(format!("SELECT COUNT(*) AS n FROM orders WHERE {filter}")).bind(tenant.as_str());
    for b in &binds {
        count = count.bind(b.clone());
    }
    let total = db
        .fetch_optional::<CountRow>(count)
        .await?
        .map_or(0, |r| r.n);
    let mut sql = format!("{} WHERE {filter}", select_order(db.backend()));
    let next = binds.len() + 2;
    if cursor.is_some() {
        // Each placeholder once and in order: MySQL binds by position.
        let _ = write!(
            sql,
            " AND (created_at < ${next} OR (created_at = ${} AND id < ${}))",
            next + 1,
            next + 2
        );
    }
    // One more than the page: whether a next page exists.
    let _ = write!(
        sql,
        " ORDER BY created_at DESC, id DESC LIMIT {}",
        limit + 1
    );
    let mut select = query(sql).bind(tenant.as_str());
    for b in binds {
        select = select.bind(b);
    }
    if let Some(c) = cursor {
        select = select
            .bind(c.created_at)
            .bind(c.created_at)
            .bind(c.id.clone());
    }
    let mut rows: Vec<OrderRow> = db.fetch_all(select).await?;
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next_cursor = if more {
        rows.last().map(|r| {
            Cursor {
                created_at: r.created_at,
                id: r.id.clone(),
            }
            .encode()
        })
    } else {
        None
    };
    let orders = match rows.into_iter().map(OrderRow::into_order).collect() {
        Ok(o) => o,
        Err(e) => return Ok(Err(e)),
    };
    Ok(Ok(Page {
        orders,
        next_cursor,
        total,
    }))
}

#[derive(sqlx::FromRow)]
struct CountRow {
    n: i64,
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::Cursor;

    #[test]
    fn a_cursor_round_trips_and_a_forged_one_is_refused() {
        let c = Cursor {
            created_at: 1_700_000_000_000,
            id: "0192f0c4-8a4e-7cc0-9d4c-0a1b2c3d4e5f".to_owned(),
        };
        // The same cursor spelled another way: a sign before its time.
        let signed = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(format!("o1:+{}:{}", c.created_at, c.id));
        assert_eq!(Cursor::decode(&signed), None);
        assert_eq!(Cursor::decode(&c.encode()), Some(c));
        assert_eq!(Cursor::decode("not-a-cursor!"), None);
        assert_eq!(Cursor::decode("bzE6MTIzOng"), None);
    }

    #[test]
    fn a_limit_is_plain_decimal_digits_from_1_to_100() {
        assert_eq!(super::parse_limit(None), Some(super::DEFAULT_LIMIT));
        assert_eq!(super::parse_limit(Some("5")), Some(5));
        assert_eq!(super::parse_limit(Some("100")), Some(100));
        for bad in ["+5", "-0", " 5", "", "0", "101", "5.0", "ten"] {
            assert_eq!(super::parse_limit(Some(bad)), None, "{bad}");
        }
    }
}
