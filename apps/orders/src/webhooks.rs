//! `POST /v1/webhooks/stripe`: Stripe's webhook deliveries, so that Stripe's own word
//! settles a charge whose outcome is unknown before the runner's next status check
//! (docs/webhooks.md).
//!
//! Not behind the API keys: Stripe authenticates by `Stripe-Signature`, checked over the
//! raw body before anything is read ([`oncely_effects::StripeWebhook::verify`]). A
//! `payment_intent.*` event is applied through [`oncely_effects::apply_pushed`]: once per
//! event id (the inbox), to the one effect its PaymentIntent's reference names (and so to
//! that effect's tenant only), through the status check's decision, continued by the
//! service's handler in the same transaction. Any other event is acknowledged and logged.
//! Mounted only with [`AppConfig::stripe_webhook`]; without it the path is the service's
//! 404 `not-found`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use oncely_effects::{apply_pushed, Applied, Continue, EffectHandler, StripeWebhook};
use oncely_http::Problem;
use oncely_sql::{Database, EffectStore};
use serde_json::json;

use crate::problem;
use crate::AppConfig;

/// The route of Stripe's webhook endpoint.
pub const STRIPE_WEBHOOK_ROUTE: &str = "/v1/webhooks/stripe";

/// Seconds a delivery that could not be applied now is asked to wait (Stripe redelivers on
/// its own schedule; another sender may honour it).
const RETRY_AFTER_SECS: u32 = 5;

/// The Stripe webhook endpoint's settings ([`AppConfig::stripe_webhook`]).
#[derive(Clone)]
pub struct StripeWebhookSettings {
    /// The signing secrets, the tolerance and the PaymentIntent reading.
    pub webhook: StripeWebhook,
    /// The service's effect handler (the one its runner settles with): an effect settled
    /// from an event gets the same business update in the same transaction.
    pub handler: Arc<dyn EffectHandler>,
    /// The lease an event's resolution takes on its effect (inside its transaction, so it
    /// never outlives a crash). Default 60 s.
    pub lease: Duration,
}

impl std::fmt::Debug for StripeWebhookSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeWebhookSettings")
            .field("webhook", &self.webhook)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
struct Endpoint {
    store: EffectStore,
    settings: Arc<StripeWebhookSettings>,
}

/// The route, when configured; else no route (the service's 404).
pub(crate) fn routes(db: &Database, config: &AppConfig) -> Router {
    let Some(settings) = &config.stripe_webhook else {
        return Router::new();
    };
    let endpoint = Endpoint {
        store: EffectStore::new(db.clone()),
        settings: Arc::new(settings.clone()),
    };
    Router::new()
        .route(STRIPE_WEBHOOK_ROUTE, post(receive))
        .with_state(endpoint)
}

async fn receive(State(endpoint): State<Endpoint>, headers: HeaderMap, body: Bytes) -> Response {
    let signature = headers
        .get("stripe-signature")
        .and_then(|v| v.to_str().ok());
    let event =
        match endpoint
            .settings
            .webhook
            .verify(signature, &body, oncely_core::now_ms() / 1000)
        {
            Ok(event) => event,
            Err(oncely_effects::WebhookError::InvalidEvent(why)) => {
                return Problem::new(
                    StatusCode::BAD_REQUEST,
                    problem::INVALID_WEBHOOK_EVENT,
                    "Not a Stripe event",
                )
                .detail(why)
                .into_response();
            }
            Err(e) => {
                tracing::warn!(error = %e, "stripe webhook refused");
                return Problem::new(
                    StatusCode::BAD_REQUEST,
                    problem::WEBHOOK_SIGNATURE_INVALID,
                    "Invalid Stripe-Signature",
                )
                .detail(e.to_string())
                .into_response();
            }
        };
    let Some(pushed) = endpoint.settings.webhook.pushed(&event) else {
        tracing::info!(event = %event.id, kind = %event.kind, "stripe webhook acknowledged, not applied (not a PaymentIntent event)");
        return received(&event.id, "ignored", None);
    };
    let how = Continue::Here(&*endpoint.settings.handler);
    match apply_pushed(&endpoint.store, how, &pushed, endpoint.settings.lease).await {
        Ok(applied) => answer(&event.id, &event.kind, &applied),
        Err(e) => {
            tracing::warn!(event = %event.id, error = %e, "stripe webhook not applied; the store failed");
            retry_later(&format!("the store failed: {e}"))
        }
    }
}

/// The answer of an applied (or deliberately not applied) event.
fn answer(id: &str, kind: &str, applied: &Applied) -> Response {
    match applied {
        Applied::Duplicate => received(id, "duplicate", None),
        Applied::NoEffect => {
            tracing::info!(event = %id, kind, "stripe webhook acknowledged: its PaymentIntent names no effect of ours");
            received(id, "no_effect", None)
        }
        Applied::Resolved {
            effect_id,
            tenant,
            state,
        } => {
            tracing::info!(event = %id, kind, effect = %effect_id, tenant = %tenant, state = %state, "stripe webhook resolved an unknown effect");
            received(id, "resolved", Some((effect_id, state)))
        }
        Applied::Noted {
            effect_id,
            tenant,
            state,
        } => {
            tracing::info!(event = %id, kind, effect = %effect_id, tenant = %tenant, state = %state, "stripe webhook noted on a settled effect");
            received(id, "noted", Some((effect_id, state)))
        }
        Applied::Busy { effect_id } => retry_later(&format!(
            "effect {effect_id} is being worked on; deliver again"
        )),
        _ => received(id, "ignored", None),
    }
}

/// 200 with what was done: `{"received": true, "event", "result", "effect"?, "state"?}`.
fn received(id: &str, result: &str, effect: Option<(&String, &String)>) -> Response {
    let mut body = json!({"received": true, "event": id, "result": result});
    if let Some((effect_id, state)) = effect {
        body["effect"] = json!(effect_id);
        body["state"] = json!(state);
    }
    (StatusCode::OK, Json(body)).into_response()
}

fn retry_later(detail: &str) -> Response {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        problem::WEBHOOK_RETRY_LATER,
        "Not applied now; deliver again",
    )
    .detail(detail.to_owned())
    .retry_after(RETRY_AFTER_SECS)
    .into_response()
}
