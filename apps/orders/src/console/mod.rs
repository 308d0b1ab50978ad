//! The operator console at `/console`: server-rendered HTML behind the admin token
//! ([`crate::AppConfig::admin_token`]; without one the routes do not exist and `/console`
//! is the service's 404).
//!
//! - Sign-in: `POST /console/login` with the admin token sets the session cookie
//!   (`session`: HMAC-signed, `HttpOnly; SameSite=Strict`). A request that carries an
//!   `Authorization` header instead gets 403 `forbidden` for a tenant API key and 401
//!   `unauthenticated` otherwise (problem+json); a page asked for without a session is sent
//!   to the sign-in form.
//! - Every action is a `POST` whose form carries the session's CSRF token; without it, or
//!   with another session's, the answer is 403 `csrf-rejected` and nothing runs. Each
//!   action writes an audit row: effects in `oncely_effect_audit`, discrepancies in
//!   `oncely_discrepancy_audit` (through the same functions as `oncely effects
//!   resolve|retry` and `oncely reconcile resolve`), dead-letter requeues in
//!   `oncely_operator_audit`.
//! - Pages: overview of counts, stuck and unknown operations, dead letters (SQL transport)
//!   with requeue, effects and saga steps in review, reconciliation discrepancies, the order
//!   search within one tenant (`/console/orders?tenant=…&q=…`: id, external ref or key) and
//!   one order's chain as a timeline (`/console/orders/{id}`, [`crate::order_chain`]).
//! - Sign-out (`POST /console/logout`) revokes the session in the store: its cookie is
//!   refused from then on, by every instance.

mod data;
mod pages;
mod session;

use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Extension, Form, Router};
use http::{header, HeaderValue, Method, StatusCode};
use maud::Markup;
use oncely_broker::{DeadLetterError, DeadLetters};
use oncely_core::{MessageId, TenantId};
use oncely_effects::{Continue, ResolveAction};
use oncely_http::{bearer, ApiKeys, Problem};
use oncely_sql::{Database, DiscrepancyStore, EffectState, EffectStore, OperatorAudit, StoreError};
use serde::Deserialize;

use session::{Keys, Session};

/// Largest console form body, in bytes.
const MAX_FORM_BYTES: usize = 16 * 1024;

#[derive(Clone)]
struct Console {
    db: Database,
    keys: Keys,
    tenants: ApiKeys,
    /// The broker's dead letters (the SQL transport's by default).
    dead_letters: Arc<dyn DeadLetters>,
    /// What a resolution completes an effect with ([`crate::resolution_handler`]): a
    /// charge resolved as succeeded writes `invoice.paid` to the service's events topic, a
    /// saga step's effect continues its saga.
    resolver: Arc<dyn oncely_effects::EffectHandler>,
}

/// The console's routes for `db`, signed in with `config`'s admin token. `tenants` are the
/// service's API keys (refused with 403); `config.dead_letters` is the broker's dead
/// letters (the SQL transport's in `db` when `None`).
pub(crate) fn router(
    db: Database,
    admin_token: &str,
    tenants: ApiKeys,
    config: &crate::AppConfig,
) -> Router {
    let letters = config.dead_letters.clone().unwrap_or_else(|| {
        Arc::new(oncely_broker::SqlDeadLetters::new(db.clone())) as Arc<dyn DeadLetters>
    });
    let state = Console {
        resolver: crate::resolution_handler(db.clone(), &config.events_topic),
        db,
        keys: Keys::new(admin_token),
        tenants,
        dead_letters: letters,
    };
    let guarded = Router::new()
        .route("/console", get(overview))
        .route("/console/stuck", get(stuck))
        .route("/console/dead-letters", get(dead_letters))
        .route("/console/dead-letters/requeue", post(requeue))
        .route("/console/review", get(review))
        .route("/console/effects/{id}/resolve", post(resolve_effect))
        .route("/console/effects/{id}/retry", post(retry_effect))
        .route("/console/reconciliation", get(reconciliation))
        .route(
            "/console/discrepancies/{id}/resolve",
            post(resolve_discrepancy),
        )
        .route("/console/orders", get(search))
        .route("/console/orders/{id}", get(order))
        .route("/console/logout", post(logout))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), guard));
    Router::new()
        .route("/console/login", get(sign_in_form).post(sign_in))
        .merge(guarded)
        .with_state(state)
}

fn html(status: StatusCode, page: Markup) -> Response {
    let mut res = (status, page.into_string()).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Never framed (clickjacking), never cached.
    res.headers_mut()
        .insert("x-frame-options", HeaderValue::from_static("DENY"));
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

fn forbidden(kind: &str, title: &str, detail: &str) -> Response {
    Problem::new(StatusCode::FORBIDDEN, kind, title)
        .detail(detail)
        .into_response()
}

/// Lets through a request with a valid session (a `POST` also with its CSRF token), and
/// refuses everything else; see the module documentation.
async fn guard(State(c): State<Console>, mut req: Request, next: Next) -> Response {
    if let Some(auth) = req.headers().get(header::AUTHORIZATION) {
        if bearer(auth).is_some_and(|t| c.tenants.tenant_of(t).is_some()) {
            return forbidden(
                crate::problem::FORBIDDEN,
                "A tenant API key cannot open the console",
                "the console takes the admin token, at /console/login",
            );
        }
        let mut res = Problem::new(
            StatusCode::UNAUTHORIZED,
            oncely_http::kind::UNAUTHENTICATED,
            "The console needs a session",
        )
        .detail("sign in with the admin token at /console/login")
        .into_response();
        res.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return res;
    }
    let now = oncely_core::now_ms();
    let session = req
        .headers()
        .get(header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|h| session::cookie(h, session::COOKIE))
        .and_then(|v| c.keys.verify(v, now));
    let session = match session {
        Some(s) => match session::is_revoked(&c.db, &s).await {
            Ok(false) => Some(s),
            Ok(true) => None,
            Err(e) => return unavailable(&e),
        },
        None => None,
    };
    let Some(session) = session else {
        if req.method() == Method::GET {
            return Redirect::to("/console/login").into_response();
        }
        return Problem::new(
            StatusCode::UNAUTHORIZED,
            oncely_http::kind::UNAUTHENTICATED,
            "The console needs a session",
        )
        .detail("sign in with the admin token at /console/login")
        .into_response();
    };
    if req.method() == Method::POST {
        req = match check_csrf(&c.keys, &session, req).await {
            Ok(req) => req,
            Err(res) => return res,
        };
    }
    req.extensions_mut().insert(session);
    next.run(req).await
}

/// Reads the form body, checks its `csrf` field against `session`, and hands the request on
/// with the body put back.
async fn check_csrf(keys: &Keys, session: &Session, req: Request) -> Result<Request, Response> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_FORM_BYTES)
        .await
        .map_err(|_| {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                crate::problem::INVALID_QUERY,
                "The form is too large",
            )
            .into_response()
        })?;
    let token = form_urlencoded::parse(&bytes)
        .find(|(k, _)| k == "csrf")
        .map(|(_, v)| v.into_owned());
    if !token.is_some_and(|t| keys.csrf_holds(session, &t)) {
        return Err(forbidden(
            crate::problem::CSRF_REJECTED,
            "The form's CSRF token is missing or not this session's",
            "reload the page and submit the form again",
        ));
    }
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

async fn sign_in_form() -> Response {
    html(StatusCode::OK, pages::sign_in(None))
}

#[derive(Deserialize)]
struct SignIn {
    token: String,
    #[serde(default)]
    name: String,
}

/// The audit name of who signs in: printable, at most 64 characters, `operator` when none
/// is given.
fn actor_name(name: &str) -> String {
    let name: String = name
        .trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(64)
        .collect();
    let name = if name.is_empty() { "operator" } else { &name };
    format!("console:{name}")
}

async fn sign_in(State(c): State<Console>, Form(f): Form<SignIn>) -> Response {
    if c.keys.is_token(&f.token) {
        let value = c.keys.issue(&actor_name(&f.name), oncely_core::now_ms());
        let mut res = Redirect::to("/console").into_response();
        if let Ok(v) = HeaderValue::from_str(&session::set_cookie(&value)) {
            res.headers_mut().insert(header::SET_COOKIE, v);
        }
        return res;
    }
    if c.tenants.tenant_of(f.token.trim()).is_some() {
        return html(
            StatusCode::FORBIDDEN,
            pages::sign_in(Some("A tenant API key cannot open the console.")),
        );
    }
    html(
        StatusCode::UNAUTHORIZED,
        pages::sign_in(Some("That is not the admin token.")),
    )
}

/// The answer when a session cannot be checked: 503 (the database), else 500.
fn unavailable(e: &StoreError) -> Response {
    let (status, kind) = if e.is_unavailable() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            oncely_http::kind::STORE_UNAVAILABLE,
        )
    } else {
        tracing::error!(error = %e, "console: the session could not be checked");
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            oncely_http::kind::STORE_ERROR,
        )
    };
    Problem::new(status, kind, "The session cannot be checked now")
        .detail("the console's database did not answer; try again")
        .into_response()
}

/// Signs out: the session is revoked in the store (every instance refuses its cookie from
/// now on) and the cookie cleared.
async fn logout(State(c): State<Console>, Extension(s): Extension<Session>) -> Response {
    if let Err(e) = session::revoke(&c.db, &s, oncely_core::now_ms()).await {
        return failed(&c, &s, &e, "/console");
    }
    let mut res = Redirect::to("/console/login").into_response();
    if let Ok(v) = HeaderValue::from_str(&session::clear_cookie()) {
        res.headers_mut().insert(header::SET_COOKIE, v);
    }
    res
}

/// A failed read or action: 404 / 409 with the store's message (it names the record and
/// why), 503 when the database cannot be reached, 500 otherwise (driver text only in the
/// log).
fn failed(c: &Console, s: &Session, e: &StoreError, back: &str) -> Response {
    let (status, text) = match e {
        StoreError::NotFound(_) => (StatusCode::NOT_FOUND, e.to_string()),
        StoreError::Conflict(m) => (StatusCode::CONFLICT, m.clone()),
        e if e.is_unavailable() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "The database cannot be reached; try again.".to_owned(),
        ),
        _ => {
            tracing::error!(error = %e, "console: a database operation failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "The operation failed; the service's log says why.".to_owned(),
            )
        }
    };
    html(
        status,
        pages::outcome("Not done", &c.keys.csrf(s), &text, false, back),
    )
}

async fn overview(State(c): State<Console>, Extension(s): Extension<Session>) -> Response {
    match data::overview(&c.db, oncely_core::now_ms()).await {
        Ok(mut o) => {
            o.dead_letters = data::dead_letter_counts(&*c.dead_letters)
                .await
                .map_err(|e| {
                    tracing::warn!(error = %e, "console: the broker's dead letters not counted");
                    format!(
                        "the broker ({}) cannot be asked now",
                        c.dead_letters.broker()
                    )
                });
            html(StatusCode::OK, pages::overview(&o, &c.keys.csrf(&s)))
        }
        Err(e) => failed(&c, &s, &e, "/console"),
    }
}

async fn stuck(State(c): State<Console>, Extension(s): Extension<Session>) -> Response {
    let read = async {
        let records = data::stuck_records(&c.db, oncely_core::now_ms()).await?;
        let effects =
            data::effects_in(&c.db, &[EffectState::Unknown, EffectState::NeedsReview]).await?;
        Ok::<_, StoreError>((records, effects))
    };
    match read.await {
        Ok((r, e)) => html(StatusCode::OK, pages::stuck(&r, &e, &c.keys.csrf(&s))),
        Err(e) => failed(&c, &s, &e, "/console"),
    }
}

/// A broker's failure to list or requeue: 503 when it cannot be reached, else as
/// [`failed`].
fn broker_failed(c: &Console, s: &Session, e: &DeadLetterError, back: &str) -> Response {
    match e {
        DeadLetterError::Store(e) => failed(c, s, e, back),
        DeadLetterError::Transient(_) => html(
            StatusCode::SERVICE_UNAVAILABLE,
            pages::outcome(
                "Not done",
                &c.keys.csrf(s),
                &format!(
                    "The broker ({}) cannot be reached; try again.",
                    c.dead_letters.broker()
                ),
                false,
                back,
            ),
        ),
        e => {
            tracing::error!(error = %e, "console: the broker refused");
            html(
                StatusCode::INTERNAL_SERVER_ERROR,
                pages::outcome(
                    "Not done",
                    &c.keys.csrf(s),
                    "The broker refused; the service's log says why.",
                    false,
                    back,
                ),
            )
        }
    }
}

async fn dead_letters(State(c): State<Console>, Extension(s): Extension<Session>) -> Response {
    let note = format!("Dead letters on {}.", c.dead_letters.broker());
    match data::dead_letters(&*c.dead_letters).await {
        Ok(d) => html(
            StatusCode::OK,
            pages::dead_letters(&d, Some(&note), &c.keys.csrf(&s), None),
        ),
        Err(e) => broker_failed(&c, &s, &e, "/console"),
    }
}

#[derive(Deserialize)]
struct Requeue {
    consumer: String,
    message_id: String,
}

/// Requeues one dead letter to its consumer group on the service's broker
/// ([`DeadLetters::requeue`]) and audits it in `oncely_operator_audit`.
async fn requeue(
    State(c): State<Console>,
    Extension(s): Extension<Session>,
    Form(f): Form<Requeue>,
) -> Response {
    let back = "/console/dead-letters";
    let csrf = c.keys.csrf(&s);
    let Some(consumer) = data::CONSUMERS.into_iter().find(|n| *n == f.consumer) else {
        let text = format!("{:?} is not a consumer of this service", f.consumer);
        return html(
            StatusCode::BAD_REQUEST,
            pages::outcome("Not done", &csrf, &text, false, back),
        );
    };
    let Ok(id) = MessageId::parse(&f.message_id) else {
        let text = format!("{:?} is not a message id", f.message_id);
        return html(
            StatusCode::BAD_REQUEST,
            pages::outcome("Not done", &csrf, &text, false, back),
        );
    };
    let n = match c
        .dead_letters
        .requeue(consumer, oncely_broker::Requeue::Message(id))
        .await
    {
        Ok(n) => n,
        Err(e) => return broker_failed(&c, &s, &e, back),
    };
    if n == 0 {
        let text = format!("No dead delivery of message {id} for {consumer} (requeued already?)");
        return html(
            StatusCode::CONFLICT,
            pages::outcome("Not done", &csrf, &text, false, back),
        );
    }
    let target = format!("inbox:{consumer}:{id}");
    let audit = OperatorAudit::new(c.db.clone());
    if let Err(e) = audit
        .record(
            oncely_core::now_ms(),
            &s.actor,
            "requeue-dead-letter",
            &target,
            &format!("requeued on {}", c.dead_letters.broker()),
        )
        .await
    {
        return failed(&c, &s, &e, back);
    }
    let text = format!("Requeued message {id} for {consumer}: it is delivered again now.");
    html(
        StatusCode::OK,
        pages::outcome("Requeued", &csrf, &text, true, back),
    )
}

async fn review(State(c): State<Console>, Extension(s): Extension<Session>) -> Response {
    let read = async {
        let effects = data::effects_in(&c.db, &data::REVIEW_STATES).await?;
        let steps = data::steps_in_review(&c.db).await?;
        Ok::<_, StoreError>((effects, steps))
    };
    match read.await {
        Ok((e, st)) => html(
            StatusCode::OK,
            pages::review(&e, &st, &c.keys.csrf(&s), None),
        ),
        Err(e) => failed(&c, &s, &e, "/console"),
    }
}

fn non_empty(s: &str) -> Option<&str> {
    Some(s.trim()).filter(|s| !s.is_empty())
}

#[derive(Deserialize)]
struct ResolveEffect {
    outcome: String,
    #[serde(default)]
    provider_id: String,
    #[serde(default)]
    reason: String,
}

/// [`oncely_effects::resolve_effect`] with the order service's handler, as `oncely effects
/// resolve` runs it.
async fn resolve_effect(
    State(c): State<Console>,
    Extension(s): Extension<Session>,
    Path(id): Path<String>,
    Form(f): Form<ResolveEffect>,
) -> Response {
    let back = "/console/review";
    let csrf = c.keys.csrf(&s);
    let to = match f.outcome.as_str() {
        "succeeded" => EffectState::Succeeded,
        "failed" => EffectState::Failed,
        _ => {
            let text = "The outcome is succeeded or failed.";
            return html(
                StatusCode::BAD_REQUEST,
                pages::outcome("Not done", &csrf, text, false, back),
            );
        }
    };
    let resolution = oncely_sql::Resolution {
        to,
        provider_id: non_empty(&f.provider_id),
        actor: &s.actor,
        reason: non_empty(&f.reason).unwrap_or("resolved in the console"),
    };
    let store = EffectStore::new(c.db.clone());
    // The service's completion (invoice paid, `invoice.paid`; a saga's next step) commits
    // with the resolution.
    let now = oncely_core::now_ms();
    match oncely_effects::resolve_effect(
        &store,
        Continue::Here(&*c.resolver),
        &id,
        &resolution,
        now,
    )
    .await
    {
        Ok(e) => {
            let text = format!("Effect {} is {} now.", e.id, e.state_word);
            html(
                StatusCode::OK,
                pages::outcome("Resolved", &csrf, &text, true, back),
            )
        }
        Err(e) => failed(&c, &s, &e, back),
    }
}

/// [`oncely_effects::retry_effect`], as `oncely effects retry` runs it.
async fn retry_effect(
    State(c): State<Console>,
    Extension(s): Extension<Session>,
    Path(id): Path<String>,
) -> Response {
    let back = "/console/review";
    let store = EffectStore::new(c.db.clone());
    match oncely_effects::retry_effect(&store, &id, &s.actor, oncely_core::now_ms()).await {
        Ok(e) => {
            let text = format!(
                "Effect {} is {} again; the runner takes it from here.",
                e.id, e.state_word
            );
            html(
                StatusCode::OK,
                pages::outcome("Retried", &c.keys.csrf(&s), &text, true, back),
            )
        }
        Err(e) => failed(&c, &s, &e, back),
    }
}

async fn reconciliation(State(c): State<Console>, Extension(s): Extension<Session>) -> Response {
    match data::discrepancies(&c.db).await {
        Ok(d) => html(
            StatusCode::OK,
            pages::reconciliation(&d, &c.keys.csrf(&s), None),
        ),
        Err(e) => failed(&c, &s, &e, "/console"),
    }
}

#[derive(Deserialize)]
struct ResolveDiscrepancy {
    action: String,
    #[serde(default)]
    provider_id: String,
    #[serde(default)]
    reason: String,
}

/// [`oncely_effects::resolve`], as `oncely reconcile resolve` runs it.
async fn resolve_discrepancy(
    State(c): State<Console>,
    Extension(s): Extension<Session>,
    Path(id): Path<String>,
    Form(f): Form<ResolveDiscrepancy>,
) -> Response {
    let back = "/console/reconciliation";
    let csrf = c.keys.csrf(&s);
    let provider_id = non_empty(&f.provider_id).map(str::to_owned);
    let action = match f.action.as_str() {
        "acknowledge" => ResolveAction::Acknowledge,
        "mark-succeeded" => ResolveAction::MarkSucceeded { provider_id },
        "refund" => ResolveAction::Refund { provider_id },
        _ => {
            let text = "The action is acknowledge, mark-succeeded or refund.";
            return html(
                StatusCode::BAD_REQUEST,
                pages::outcome("Not done", &csrf, text, false, back),
            );
        }
    };
    let store = DiscrepancyStore::new(c.db.clone());
    let reason = non_empty(&f.reason).unwrap_or("resolved in the console");
    match oncely_effects::resolve(
        &store,
        Continue::Here(&*c.resolver),
        &id,
        &action,
        &s.actor,
        reason,
    )
    .await
    {
        Ok(d) => {
            let text = format!("Discrepancy {} resolved: {}.", d.id, action.as_str());
            html(
                StatusCode::OK,
                pages::outcome("Resolved", &csrf, &text, true, back),
            )
        }
        Err(e) => failed(&c, &s, &e, back),
    }
}

#[derive(Deserialize)]
struct Search {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    q: String,
}

/// `GET /console/orders?tenant=T&q=…`: the tenant's orders whose id, external ref or
/// idempotency key is `q` (one tenant at a time: a search never crosses tenants).
async fn search(
    State(c): State<Console>,
    Extension(s): Extension<Session>,
    Query(f): Query<Search>,
) -> Response {
    let csrf = c.keys.csrf(&s);
    if f.tenant.trim().is_empty() && f.q.trim().is_empty() {
        return html(StatusCode::OK, pages::search(&f.tenant, &f.q, None, &csrf));
    }
    let Ok(tenant) = TenantId::parse(f.tenant.trim()) else {
        let text = "Name the tenant to search in.";
        return html(
            StatusCode::BAD_REQUEST,
            pages::outcome("Not searched", &csrf, text, false, "/console/orders"),
        );
    };
    match crate::search_orders(&c.db, &tenant, &f.q).await {
        Ok(hits) => html(
            StatusCode::OK,
            pages::search(tenant.as_str(), &f.q, Some(hits.as_slice()), &csrf),
        ),
        Err(e) => failed(&c, &s, &e, "/console/orders"),
    }
}

#[derive(Deserialize)]
struct OrderQuery {
    tenant: Option<String>,
}

/// One order's chain as a timeline. `?tenant=` scopes the read (the search's links name
/// it); without it, the order's own tenant (links from the stuck and dead-letter pages).
async fn order(
    State(c): State<Console>,
    Extension(s): Extension<Session>,
    Path(id): Path<String>,
    Query(q): Query<OrderQuery>,
) -> Response {
    let tenant = match q.tenant {
        Some(t) => TenantId::parse(t.trim()).ok(),
        None => match data::tenant_of(&c.db, &id).await {
            Ok(t) => t.and_then(|t| TenantId::parse(&t).ok()),
            Err(e) => return failed(&c, &s, &e, "/console"),
        },
    };
    let Some(tenant) = tenant else {
        return failed(&c, &s, &StoreError::NotFound(id), "/console/orders");
    };
    match crate::order_chain(&c.db, &tenant, &id).await {
        Ok(Some(chain)) => html(StatusCode::OK, pages::chain(&chain, &c.keys.csrf(&s))),
        Ok(None) => failed(&c, &s, &StoreError::NotFound(id), "/console/orders"),
        Err(e) => failed(&c, &s, &e, "/console"),
    }
}
