//! Outgoing calls that leave the local transaction — a card charged, a shipment booked —
//! made so that a retry never becomes a second effect (docs/DESIGN.md "External effects",
//! "Provider contracts").
//!
//! Every provider sits behind one trait, [`Provider`]: **call** with the key derived from
//! the parent operation ([`derive_key`], never minted per attempt), ask the **status** of an
//! earlier attempt by its stable business reference, and **list** the provider's objects
//! over a window (for reconciliation). A call's answer is a [`CallOutcome`] whose
//! [`OutcomeClass`](oncely_core::OutcomeClass) says what it proves: nothing was sent, it
//! may have happened (ask the status before anything else), retry later, or final.
//!
//! # Layout
//! - `metrics` — the names of the metrics the runner records.
//! - `operator` — [`resolve_effect`]: an operator's resolution of an effect, continued by
//!   the service's handler in the same transaction or by the service's runner
//!   ([`Continue`]); [`retry_effect`] under the key's next generation.
//! - `provider` — [`Provider`], [`EffectRequest`], [`CallOutcome`], [`StatusQuery`],
//!   [`StatusOutcome`], [`RemoteObject`] with its [`ObjectState`] read through a
//!   [`StatusVocabulary`], [`not_found`] (the settle window), [`ListPage`], [`ProviderError`].
//! - `key` — [`derive_key`]: the effect's idempotency key from its parent's scope, key and
//!   step.
//! - `http` — how a `reqwest` failure or an HTTP answer maps to an outcome class.
//! - `stripe` — [`StripePayments`]: PaymentIntents and Refunds on Stripe's API v1.
//! - `stripe_webhook` — [`StripeWebhook`], [`StripeWebhookConfig`], [`StripeEvent`],
//!   [`WebhookError`]: Stripe's webhook deliveries, their `Stripe-Signature` checked
//!   ([`verify_stripe_signature`], [`sign_stripe_event`]) and a `payment_intent.*` event
//!   read as a [`PushedEvent`].
//! - `pushed` — [`apply_pushed`], [`PushedEvent`], [`Applied`]: a provider's pushed word
//!   about an object applied once (the inbox, [`PUSHED_CONSUMER`]) to the effect it names,
//!   through the status check's decision, under a lease taken in the same transaction.
//! - `runner` — [`EffectRunner`], [`RunnerConfig`], [`EffectHandler`], [`Settled`]: the
//!   library runtime that claims due effects, calls or checks each, and settles it with the
//!   business update in one transaction, and continues the outcomes decided elsewhere
//!   ([`Continue::ByRunner`]). A folder: `pipeline` (claiming, the lanes),
//!   `call` (the provider call), `check` (status checks), `decide` (the retry, give-up and
//!   park decisions both share, the evidence of an attempt), `settle` (the settle stage),
//!   `continuation` ([`Continue`], the marks in the store the runner continues).
//! - `reconcile` — [`Reconciler`], [`ReconcileConfig`], [`ReconcileReport`],
//!   [`LocalSource`] (and [`EffectsSource`]), [`resolve`] with [`ResolveAction`]: both
//!   sides compared by stable reference over a window, discrepancies stored, unknown
//!   effects completed from the provider's record. A folder: `source` (the local side),
//!   `compare` (the comparison and its findings), `resolve` (the resolution actions).
//! - `shipping` — [`ShippingClient`]: the keyless shipping contract, booked by
//!   `merchant_reference`.
//! - `model` (tests only) — the effect protocol as a `stateright` model, checked over every
//!   interleaving (docs/ARCHITECTURE.md "The effect protocol's model").

mod http;
mod key;
pub mod metrics;
mod operator;
mod provider;
mod pushed;
mod reconcile;
mod runner;
mod shipping;
mod stripe;
mod stripe_webhook;

#[cfg(test)]
mod model;

pub use key::{derive_key, next_key};
pub use operator::{resolve_effect, retry_effect};
pub use provider::{
    not_found, CallOutcome, EffectRequest, ListPage, ObjectState, Provider, ProviderError,
    RemoteObject, StatusOutcome, StatusQuery, StatusVocabulary,
};
pub use pushed::{apply_pushed, Applied, PushedEvent, PUSHED_CONSUMER};
pub use reconcile::{
    default_operation, resolve, Completion, EffectsSource, LocalIntent, LocalSource, LocalStatus,
    ReconcileConfig, ReconcileError, ReconcileReport, Reconciler, ResolveAction,
};
pub use runner::{
    Continue, EffectHandler, EffectRunner, NoHandler, RunnerConfig, Settled, SEND_BOUND,
};
pub use shipping::{ShippingClient, ShippingConfig};
pub use stripe::{StripeConfig, StripePayments};
pub use stripe_webhook::{
    sign as sign_stripe_event, verify_signature as verify_stripe_signature, StripeEvent,
    StripeWebhook, StripeWebhookConfig, WebhookError,
};
